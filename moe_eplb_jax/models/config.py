"""``ModelConfig``: the shape of an MoE decoder, validated; and its presets.

One frozen dataclass describes the model (what a Hugging Face ``config.json``
of Qwen3-MoE, DeepSeek-V3 or GLM-4-MoE describes; ``models.config_from_hf``
reads one); where the experts live (``P``, the mesh) is the model
constructor's business, so one config serves every placement. Field names
follow the model code, their Hugging Face names are given beside them.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from moe_eplb_jax._checks import INT32_MAX, check_real, show
from moe_eplb_jax.models.rope import YarnScaling
from moe_eplb_jax.moe import RouterConfig

__all__ = ["ATTENTIONS", "DTYPES", "PRESETS", "ModelConfig", "preset"]

DTYPES = ("float32", "bfloat16")
ATTENTIONS = ("gqa", "mla")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The architecture of an MoE decoder-only language model.

    Attributes:
      vocab_size: tokens (``vocab_size``).
      dim: model width ``D`` (``hidden_size``).
      num_layers: decoder blocks (``num_hidden_layers``).
      num_heads: query heads (``num_attention_heads``).
      attention: ``"gqa"`` (grouped-query attention: Qwen3-MoE, GLM-4-MoE) or
        ``"mla"`` (DeepSeek-V2/V3's multi-head latent attention).
      num_kv_heads: GQA key/value heads, dividing ``num_heads`` (``num_key_value_heads``).
      head_dim: width of one GQA head (``head_dim``).
      q_lora_rank: MLA: rank of the low-rank query (``q_lora_rank``; ``None``: a full-rank ``q_proj``).
      kv_lora_rank: MLA: width of the compressed key/value latent the cache holds (``kv_lora_rank``).
      qk_nope_head_dim, qk_rope_head_dim: MLA: a query/key head is ``qk_nope_head_dim``
        dimensions from the latent and ``qk_rope_head_dim`` rotated ones, the
        rotated key shared by every head (``qk_nope_head_dim``, ``qk_rope_head_dim``).
      v_head_dim: MLA: width of one value head (``v_head_dim``).
      qkv_bias: biases on the query/key/value projections (GQA ``q/k/v_proj``; MLA
        ``q_a_proj`` and ``kv_a_proj_with_mqa``) (``attention_bias``).
      o_bias: a bias on ``o_proj`` (Qwen3-MoE's and DeepSeek-V3's ``attention_bias``; GLM-4-MoE has none).
      dense_hidden: MLP width of the dense layers (``intermediate_size``).
      first_dense_layers: the first ``k`` blocks have a dense MLP, the rest an
        MoE layer (``first_k_dense_replace``).
      dense_layers: the blocks with a dense MLP, anywhere (Qwen3-MoE's
        ``mlp_only_layers`` and ``decoder_sparse_step``); ``None``: the first
        ``first_dense_layers`` (which must then be 0 when this is given).
      num_experts: routed experts ``E`` (``n_routed_experts`` / ``num_experts``).
      top_k: experts per token (``num_experts_per_tok``).
      moe_hidden: one expert's MLP width (``moe_intermediate_size``).
      shared_hidden: width of the shared expert every token also goes through,
        0 for none (DeepSeek-V3: ``n_shared_experts * moe_intermediate_size``).
      scoring: ``"softmax"`` (Qwen3-MoE) or ``"sigmoid"`` (DeepSeek-V3, with a
        score-correction bias) (``scoring_func``). The router's fields
        (``top_k``, ``scoring``, ``renormalize``, ``routed_scaling_factor``,
        ``num_groups``, ``topk_groups``) make ``router``, the ``RouterConfig``
        every MoE layer gets.
      renormalize: renormalise the top-k weights (``norm_topk_prob``).
      routed_scaling_factor: multiplies the routed weights (``routed_scaling_factor``).
      num_groups, topk_groups: group-limited routing: experts in
        ``num_groups`` groups, a token's experts from its best ``topk_groups``
        (``n_group``, ``topk_group``; ``topk_groups=None``: plain top-k).
      qk_norm: RMSNorm of every query and key head before RoPE (Qwen3; GLM-4-MoE's ``use_qk_norm``).
      rope_theta: RoPE base (``rope_theta``).
      rope_scaling: ``YarnScaling`` or ``None`` (``rope_parameters`` / ``rope_scaling`` of ``rope_type="yarn"``).
      partial_rotary_factor: GQA: RoPE rotates the first ``int(head_dim * f)`` dimensions
        of each head (``partial_rotary_factor``; MLA rotates ``qk_rope_head_dim``).
      rope_interleave: the rotated dimensions pair as ``(2i, 2i + 1)`` instead of
        ``(i, i + R/2)`` (``rope_interleave``, DeepSeek-V3).
      rms_eps: RMSNorm epsilon (``rms_norm_eps``; MLA's ``q_a_layernorm`` and
        ``kv_a_layernorm`` use 1e-6 whatever it is, as DeepSeek's code does).
      max_seq_len: longest sequence (prompt + generated) the model serves
        (``max_position_embeddings``).
      mtp_layers: multi-token-prediction blocks a checkpoint carries after the
        decoder (``num_nextn_predict_layers``); the model does not run them:
        loading skips their tensors, export writes none.
      tie_embeddings: the output projection is the token embedding (``tie_word_embeddings``).
      dtype: weights and activations, ``"float32"`` or ``"bfloat16"``;
        norms, softmax and router run in float32 either way.
    """

    vocab_size: int = 256
    dim: int = 64
    num_layers: int = 3
    num_heads: int = 4
    attention: str = "gqa"
    num_kv_heads: int = 2
    head_dim: int = 16
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    qkv_bias: bool = False
    o_bias: bool = False
    dense_hidden: int = 128
    first_dense_layers: int = 1
    dense_layers: tuple[int, ...] | None = None
    num_experts: int = 16
    top_k: int = 2
    moe_hidden: int = 32
    shared_hidden: int = 32
    scoring: str = "softmax"
    renormalize: bool = True
    routed_scaling_factor: float = 1.0
    num_groups: int = 1
    topk_groups: int | None = None
    qk_norm: bool = True
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    partial_rotary_factor: float = 1.0
    rope_interleave: bool = False
    rms_eps: float = 1e-6
    max_seq_len: int = 512
    mtp_layers: int = 0
    tie_embeddings: bool = False
    dtype: str = "float32"

    def __post_init__(self):
        positive = (
            "vocab_size",
            "dim",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "v_head_dim",
            "dense_hidden",
            "num_experts",
            "moe_hidden",
            "max_seq_len",
        )
        for name in positive:
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("first_dense_layers", "shared_hidden", "qk_nope_head_dim", "mtp_layers"):
            _check_int(name, getattr(self, name), minimum=0)
        if self.q_lora_rank is not None:
            _check_int("q_lora_rank", self.q_lora_rank, minimum=1)
        for name in ("qk_norm", "tie_embeddings", "qkv_bias", "o_bias", "rope_interleave"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name} must be a bool, got {show(getattr(self, name))}")
        for name in ("rope_theta", "rms_eps", "partial_rotary_factor"):
            value = getattr(self, name)
            try:
                check_real(name, value, positive=True)
            except ValueError:
                raise ValueError(f"ModelConfig.{name} must be a positive finite number, got {show(value)}") from None
        try:  # the router's fields are this config's own: errors name them as written here
            self.router.check_experts(self.num_experts)
        except ValueError as e:
            raise ValueError(str(e).replace("RouterConfig.", "ModelConfig.")) from None
        if self.dtype not in DTYPES:
            raise ValueError(f"ModelConfig.dtype must be one of {DTYPES}, got {show(self.dtype)}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, YarnScaling):
            raise ValueError(f"ModelConfig.rope_scaling must be a YarnScaling or None, got {self.rope_scaling!r}")
        self._check_attention()
        self._check_layers()

    @property
    def router(self) -> RouterConfig:
        """The router of every MoE layer (``RouterConfig``)."""
        return RouterConfig(
            top_k=self.top_k,
            num_groups=self.num_groups,
            topk_groups=self.topk_groups,
            scoring=self.scoring,
            renormalize=self.renormalize,
            routed_scaling_factor=self.routed_scaling_factor,
        )

    def _check_attention(self) -> None:
        if self.attention not in ATTENTIONS:
            raise ValueError(f"ModelConfig.attention must be one of {ATTENTIONS}, got {show(self.attention)}")
        if self.attention == "mla":
            if self.qk_rope_head_dim % 2:
                raise ValueError(
                    f"ModelConfig.qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)"
                )
            if self.partial_rotary_factor != 1.0:
                raise ValueError(
                    f"ModelConfig.partial_rotary_factor={self.partial_rotary_factor}: MLA rotates its "
                    "qk_rope_head_dim dimensions whole (1.0)"
                )
            if self.qk_norm:
                raise ValueError("ModelConfig.qk_norm: MLA has no per-head query/key norm; set qk_norm=False")
            return
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}"
            )
        if self.partial_rotary_factor > 1:
            raise ValueError(f"ModelConfig.partial_rotary_factor={self.partial_rotary_factor} exceeds 1")
        rotary = self.rotary_dim
        if rotary < 2 or rotary % 2:
            raise ValueError(
                f"ModelConfig.head_dim={self.head_dim} x partial_rotary_factor={self.partial_rotary_factor} "
                f"rotates {rotary} dimensions; RoPE needs a positive even number"
            )

    def _check_layers(self) -> None:
        if self.dense_layers is not None:
            layers = self.dense_layers
            if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
                raise ValueError(f"ModelConfig.dense_layers must be a sequence of block indices, got {show(layers)}")
            layers = tuple(layers)
            for i in layers:
                if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < self.num_layers:
                    raise ValueError(
                        f"ModelConfig.dense_layers holds {show(i)}; block indices are integers in [0, {self.num_layers})"
                    )
            if len(set(layers)) != len(layers) or list(layers) != sorted(layers):
                raise ValueError(f"ModelConfig.dense_layers must be increasing without repeats, got {show(layers)}")
            if self.first_dense_layers:
                raise ValueError(
                    f"ModelConfig.first_dense_layers={self.first_dense_layers} and dense_layers={layers} both "
                    "name dense blocks; give one (dense_layers=range(k) is first_dense_layers=k)"
                )
            object.__setattr__(self, "dense_layers", tuple(int(i) for i in layers))  # hashable, JSON-able
        if self.num_moe_layers < 1:
            field = "dense_layers" if self.dense_layers is not None else "first_dense_layers"
            raise ValueError(
                f"ModelConfig.{field}={getattr(self, field)} leaves no MoE layer of num_layers={self.num_layers}"
            )

    @property
    def dense_blocks(self) -> tuple[int, ...]:
        """The blocks with a dense MLP, in order."""
        if self.dense_layers is not None:
            return self.dense_layers
        return tuple(range(min(self.first_dense_layers, self.num_layers)))

    @property
    def moe_blocks(self) -> tuple[int, ...]:
        """The blocks with an MoE layer, in order: MoE layer ``l`` of a ``Placement`` is block ``moe_blocks[l]``."""
        dense = set(self.dense_blocks)
        return tuple(i for i in range(self.num_layers) if i not in dense)

    @property
    def num_moe_layers(self) -> int:
        """``L``: the MoE layers, the ones EPLB balances."""
        return self.num_layers - len(self.dense_blocks)

    @property
    def rotary_dim(self) -> int:
        """Dimensions RoPE rotates per head: MLA's ``qk_rope_head_dim``, else ``int(head_dim * partial_rotary_factor)``."""
        if self.attention == "mla":
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    def flops_per_token(self, context: float) -> float:
        """Matmul FLOPs of one token's forward pass whose queries see ``context`` keys on average (causal
        training or prefill over ``T`` tokens: ``(T + 1) / 2``): projections, attention scores and values, dense
        MLPs, router, the ``top_k`` experts and the shared expert, the LM head. A training step is 3 times it."""
        d, h = self.dim, self.num_heads
        if self.attention == "mla":
            qk, dv, rank, rope = (
                self.qk_nope_head_dim + self.qk_rope_head_dim,
                self.v_head_dim,
                self.kv_lora_rank,
                self.qk_rope_head_dim,
            )
            query = d * h * qk if self.q_lora_rank is None else d * self.q_lora_rank + self.q_lora_rank * h * qk
            projections = query + d * (rank + rope) + rank * h * (self.qk_nope_head_dim + dv) + h * dv * d
            scores = h * (qk + dv) * context
        else:
            q, kv = h * self.head_dim, self.num_kv_heads * self.head_dim
            projections = 2 * d * q + 2 * d * kv
            scores = 2 * q * context
        dense = 3 * d * self.dense_hidden
        moe = d * self.num_experts + self.top_k * 3 * d * self.moe_hidden + 3 * d * self.shared_hidden
        per_token = (
            self.num_layers * (projections + scores)
            + len(self.dense_blocks) * dense
            + self.num_moe_layers * moe
            + d * self.vocab_size
        )
        return 2.0 * per_token

    def decode_read_bytes(self, batch: int, context: int) -> float:
        """Bytes one decode step of ``batch`` tokens must read from memory, at ``context`` cached positions: every
        non-expert weight, the experts the batch touches in expectation under uniform routing
        (``E (1 - (1 - k / E) ** batch)`` of them per MoE layer), the shared expert and the KV cache, in ``dtype``.
        Over the card's memory bandwidth it is the step's floor."""
        _check_int("decode_read_bytes batch", batch, minimum=1)
        _check_int("decode_read_bytes context", context, minimum=0)
        d, h, item = self.dim, self.num_heads, self.jnp_dtype.itemsize
        if self.attention == "mla":
            qk, rank, rope = self.qk_nope_head_dim + self.qk_rope_head_dim, self.kv_lora_rank, self.qk_rope_head_dim
            query = d * h * qk if self.q_lora_rank is None else d * self.q_lora_rank + self.q_lora_rank * h * qk
            attention = query + d * (rank + rope) + rank * h * (self.qk_nope_head_dim + self.v_head_dim)
            attention += h * self.v_head_dim * d
            cached = rank + rope
        else:
            attention = 2 * d * h * self.head_dim + 2 * d * self.num_kv_heads * self.head_dim
            cached = 2 * self.num_kv_heads * self.head_dim
        touched = self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** batch)
        moe = touched * 3 * d * self.moe_hidden + d * self.num_experts + 3 * d * self.shared_hidden
        weights = (
            self.num_layers * attention
            + len(self.dense_blocks) * 3 * d * self.dense_hidden
            + self.num_moe_layers * moe
            + d * self.vocab_size
        )
        return float(item * (weights + self.num_layers * batch * context * cached))

    @property
    def jnp_dtype(self):
        """``dtype`` as a numpy dtype (``jnp.bfloat16``'s for ``"bfloat16"``)."""
        return jnp.dtype(self.dtype)

    def replace(self, **changes) -> ModelConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


def _check_int(name: str, value, *, minimum: int) -> None:
    """Sizes index int32 arrays (token ids, positions, expert ids): past ``2**31 - 1`` they would wrap."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not minimum <= value <= INT32_MAX:
        bound = f">= {minimum}" if isinstance(value, int | np.integer) and value < minimum else "up to 2**31 - 1"
        raise ValueError(f"ModelConfig.{name} must be an integer {bound}, got {show(value)}")


PRESETS: dict[str, ModelConfig] = {
    # CPU tests and the README demo: 3 blocks (1 dense, 2 MoE), 16 experts, Qwen3-MoE routing, 0.3M parameters.
    "tiny": ModelConfig(),
    # One GPU: Qwen3-MoE-shaped, 8 blocks (1 dense, 7 MoE x 64 experts, top-8), 0.77B parameters (1.5 GB in bf16).
    "small": ModelConfig(
        vocab_size=32768,
        dim=1024,
        num_layers=8,
        num_heads=16,
        num_kv_heads=4,
        head_dim=64,
        dense_hidden=2816,
        first_dense_layers=1,
        num_experts=64,
        top_k=8,
        moe_hidden=512,
        shared_hidden=0,
        max_seq_len=4096,
        rope_theta=1_000_000.0,
        tie_embeddings=True,
        dtype="bfloat16",
    ),
    # DeepSeek-V3 as it is at CPU size: MLA (low-rank query, latent KV, interleaved decoupled RoPE with YaRN), the
    # sigmoid group-limited router, routed scaling, a shared expert, a dense first block. Tests and CPU smoke runs.
    "deepseek_v3_tiny": ModelConfig(
        attention="mla",
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        rope_interleave=True,
        rope_scaling=YarnScaling(factor=4.0, original_max_len=128, mscale=1.0, mscale_all_dim=1.0),
        scoring="sigmoid",
        num_groups=4,
        topk_groups=2,
        routed_scaling_factor=2.5,
        qk_norm=False,
    ),
    # Two GPUs: DeepSeek-V3 (MLA with q_lora_rank, kv_lora_rank 512 and 128 + 64 / 128 head dims, interleaved RoPE
    # with V3's YaRN; 256 experts, top-8 of 4 of 8 groups, sigmoid scores with a correction bias, a shared expert,
    # routed scaling 2.5, 3 of 61 blocks dense -> 1 of 12) at a smaller width; 18B parameters, 0.95B active per
    # token (36 GB in bf16; with AdamW moments and gradients training needs ~150 GB before activations: two H200s).
    "deepseek_v3_small": ModelConfig(
        vocab_size=32768,
        dim=2048,
        num_layers=12,
        num_heads=16,
        attention="mla",
        q_lora_rank=768,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_interleave=True,
        rope_scaling=YarnScaling(factor=40.0, original_max_len=4096, mscale=1.0, mscale_all_dim=1.0),
        dense_hidden=8192,
        first_dense_layers=1,
        num_experts=256,
        top_k=8,
        moe_hidden=1024,
        shared_hidden=1024,
        scoring="sigmoid",
        renormalize=True,
        routed_scaling_factor=2.5,
        num_groups=8,
        topk_groups=4,
        qk_norm=False,
        rms_eps=1e-6,
        max_seq_len=4096,
        dtype="bfloat16",
    ),
}


def preset(name: str, **changes) -> ModelConfig:
    """The preset ``name`` (``"tiny"``, ``"small"``, ``"deepseek_v3_tiny"``, ``"deepseek_v3_small"``), with ``changes``."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **changes)

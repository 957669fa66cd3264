"""``ModelConfig``: the shape of an MoE decoder, validated; and its presets.

One frozen dataclass describes the model (what a Hugging Face ``config.json``
of Qwen3-MoE or DeepSeek-V3 describes); where the experts live (``P``, the
mesh) is the model constructor's business, so one config serves every
placement. Field names follow the model code, their Hugging Face names are
given beside them.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from moe_eplb_jax.moe import RouterConfig

__all__ = ["DTYPES", "PRESETS", "ModelConfig", "preset"]

DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The architecture of an MoE decoder-only language model.

    Attributes:
      vocab_size: tokens (``vocab_size``).
      dim: model width ``D`` (``hidden_size``).
      num_layers: decoder blocks (``num_hidden_layers``).
      num_heads: query heads (``num_attention_heads``).
      num_kv_heads: key/value heads, dividing ``num_heads`` (``num_key_value_heads``).
      head_dim: width of one head, even (RoPE rotates pairs) (``head_dim``).
      dense_hidden: MLP width of the dense layers (``intermediate_size``).
      first_dense_layers: the first ``k`` blocks have a dense MLP, the rest an
        MoE layer (``first_k_dense_replace``).
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
      qk_norm: RMSNorm of every query and key head before RoPE (Qwen3).
      rope_theta: RoPE base (``rope_theta``).
      rms_eps: RMSNorm epsilon (``rms_norm_eps``).
      max_seq_len: longest sequence (prompt + generated) the model serves
        (``max_position_embeddings``).
      tie_embeddings: the output projection is the token embedding (``tie_word_embeddings``).
      dtype: weights and activations, ``"float32"`` or ``"bfloat16"``;
        norms, softmax and router run in float32 either way.
    """

    vocab_size: int = 256
    dim: int = 64
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    dense_hidden: int = 128
    first_dense_layers: int = 1
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
    rms_eps: float = 1e-6
    max_seq_len: int = 512
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
            "dense_hidden",
            "num_experts",
            "moe_hidden",
            "max_seq_len",
        )
        for name in positive:
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("first_dense_layers", self.first_dense_layers, minimum=0)
        _check_int("shared_hidden", self.shared_hidden, minimum=0)
        for name in ("qk_norm", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("rope_theta", "rms_eps"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (math.isfinite(value) and value > 0)
            ):
                raise ValueError(f"ModelConfig.{name} must be a positive finite number, got {value!r}")
        try:  # the router's fields are this config's own: errors name them as written here
            self.router.check_experts(self.num_experts)
        except ValueError as e:
            raise ValueError(str(e).replace("RouterConfig.", "ModelConfig.")) from None
        if self.dtype not in DTYPES:
            raise ValueError(f"ModelConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        if self.first_dense_layers >= self.num_layers:
            raise ValueError(
                f"ModelConfig.first_dense_layers={self.first_dense_layers} leaves no MoE layer of "
                f"num_layers={self.num_layers}"
            )

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

    @property
    def num_moe_layers(self) -> int:
        """``L``: the MoE layers, the ones EPLB balances."""
        return self.num_layers - self.first_dense_layers

    @property
    def jnp_dtype(self):
        """``dtype`` as a numpy dtype (``jnp.bfloat16``'s for ``"bfloat16"``)."""
        return jnp.dtype(self.dtype)

    def replace(self, **changes) -> ModelConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


def _check_int(name: str, value, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"ModelConfig.{name} must be an integer >= {minimum}, got {value!r}")


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
    # Two GPUs: DeepSeek-V3's MoE (256 experts, top-8 of 4 of 8 groups, sigmoid scores with a correction bias,
    # a shared expert, routed scaling 2.5, 3 of 61 blocks dense -> 1 of 12) at a smaller width, with GQA in place
    # of MLA; 18B parameters, 0.94B active per token (36 GB in bf16; with AdamW moments and gradients training
    # needs ~150 GB before activations: two H200s).
    "deepseek_v3_small": ModelConfig(
        vocab_size=32768,
        dim=2048,
        num_layers=12,
        num_heads=16,
        num_kv_heads=4,
        head_dim=128,
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
    """The preset ``name`` (``"tiny"``, ``"small"``, ``"deepseek_v3_small"``), with ``changes`` applied."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **changes)

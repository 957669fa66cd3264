"""``config_from_hf``: a ``ModelConfig`` from a Hugging Face ``config.json`` (Qwen3-MoE, DeepSeek-V3, GLM-4-MoE).

    config = config_from_hf("ckpt/")            # ckpt/config.json
    model = MoECausalLM(config, mesh=mesh, rngs=nnx.Rngs(0))
    load_checkpoint(model, "ckpt/")

Fields read as transformers' configuration classes read them: an absent
field takes the class default, ``rope_parameters`` (transformers 5) or
``rope_scaling`` + ``rope_theta`` (the released checkpoints) give the RoPE.
Every field is either mapped, checked to hold the one value the model
implements, or known to be bookkeeping that does not change the computation
(token ids, initializer range, training-only loss weights, ...). Anything
else -- a value the model cannot honour or a field it does not know -- is a
``ValueError`` naming the field, never a silent approximation.
"""

from __future__ import annotations

import os
from typing import Any

from moe_eplb_jax._files import read_json
from moe_eplb_jax.models.config import ModelConfig
from moe_eplb_jax.models.rope import YarnScaling

__all__ = ["HF_MODEL_TYPES", "config_from_hf"]

HF_MODEL_TYPES = ("qwen3_moe", "deepseek_v3", "glm4_moe")

# Fields that do not change what the model computes at inference or how it is trained here.
_BOOKKEEPING = {
    "architectures", "model_type", "transformers_version", "_name_or_path", "auto_map", "bos_token_id",
    "eos_token_id", "pad_token_id", "initializer_range", "use_cache", "output_router_logits", "router_aux_loss_coef",
    "aux_loss_alpha", "seq_aux", "ep_size", "output_attentions", "output_hidden_states", "return_dict", "torchscript",
    "id2label", "label2id", "tokenizer_class", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder",
    "tie_encoder_decoder", "use_return_dict", "_attn_implementation", "_commit_hash", "finetuning_task",
    "task_specific_params", "prefix", "sep_token_id", "decoder_start_token_id", "num_labels",
}  # fmt: skip
_YARN_KEYS = {
    "rope_type", "type", "rope_theta", "partial_rotary_factor", "factor", "original_max_position_embeddings",
    "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate",
}  # fmt: skip
_QUANT_KEYS = {"quant_method", "fmt", "weight_block_size", "activation_scheme", "modules_to_not_convert"}


class _Fields:
    """A ``config.json`` object whose fields are marked as they are read, so none goes unexamined."""

    def __init__(self, raw: dict, where: str):
        self.raw, self.where, self.seen = raw, where, set(_BOOKKEEPING)

    def get(self, key: str, default: Any = None) -> Any:
        self.seen.add(key)
        value = self.raw.get(key)
        return default if value is None else value

    def require(self, *keys: str) -> tuple[Any, ...]:
        for key in keys:
            if self.raw.get(key) is None:
                raise ValueError(f"{self.where}: field {key!r} is missing")
        return tuple(self.get(key) for key in keys)

    def only(self, key: str, allowed, default, why: str) -> None:
        """The field may only hold ``allowed`` (a value or a tuple of them), ``default`` when absent."""
        value = self.get(key, default)
        ok = value in allowed if isinstance(allowed, tuple) else value == allowed
        if not ok:
            raise ValueError(f"{self.where}: field {key!r}={value!r} cannot be honoured: {why}")

    def fail(self, key: str, why: str):
        raise ValueError(f"{self.where}: field {key!r}={self.raw.get(key)!r} cannot be honoured: {why}")

    def check_all_read(self) -> None:
        unknown = sorted(set(self.raw) - self.seen)
        if unknown:
            raise ValueError(
                f"{self.where}: field {unknown[0]!r} is not one this model reads (it may change the computation); "
                "remove it if it does not"
            )


def config_from_hf(source, *, dtype: str | None = None, max_seq_len: int | None = None) -> ModelConfig:
    """The ``ModelConfig`` a Hugging Face ``config.json`` describes.

    Args:
      source: a ``config.json`` path, a checkpoint directory holding one, or its parsed ``dict``.
      dtype: ``"float32"`` or ``"bfloat16"``; ``None``: the file's ``dtype`` / ``torch_dtype`` (float32 if absent).
      max_seq_len: the longest sequence to serve; ``None``: ``max_position_embeddings``.

    Raises ``ValueError`` naming the field the model cannot honour.
    """
    raw, where = _load(source)
    fields = _Fields(raw, where)
    kind = fields.get("model_type")
    if kind not in HF_MODEL_TYPES:
        raise ValueError(f"{where}: model_type {kind!r} is not one of {HF_MODEL_TYPES}")
    family = {"qwen3_moe": _qwen3_moe, "deepseek_v3": _deepseek_v3, "glm4_moe": _glm4_moe}[kind]
    out = _common(fields, kind) | family(fields)
    out["rope_theta"], out["rope_scaling"], partial = _rope(fields, kind, out["max_seq_len"])
    if out.get("attention") == "mla":
        if partial != 1.0:
            raise ValueError(
                f"{where}: field 'partial_rotary_factor'={partial!r} cannot be honoured: MLA rotates whole"
            )
    else:
        out["partial_rotary_factor"] = partial
    out["dtype"] = _dtype(fields, dtype)
    _quantization(fields)
    fields.check_all_read()
    if max_seq_len is not None:
        out["max_seq_len"] = max_seq_len
    try:
        return ModelConfig(**out)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _load(source) -> tuple[dict, str]:
    if isinstance(source, dict):
        return dict(source), "config"
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.lexists(path):
        raise ValueError(f"{path}: no such config file")
    try:  # a regular file only (a FIFO would block), UTF-8, no duplicate keys, not nested without end
        raw = read_json(path, what="config.json")
    except ValueError as e:
        raise ValueError(
            str(e).replace("top level must be a JSON object", "a config.json holds a JSON object")
        ) from None
    return raw, path


def _common(f: _Fields, kind: str) -> dict:
    vocab, dim, layers, heads, dense_hidden, moe_hidden, top_k = f.require(
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "moe_intermediate_size",
        "num_experts_per_tok",
    )
    f.only("hidden_act", "silu", "silu", "the MLPs are SwiGLU (silu)")
    f.only("attention_dropout", (0, 0.0), 0.0, "the model has no dropout")
    f.only("pretraining_tp", 1, 1, "no tensor-parallel emulation of the linear layers")
    defaults = {"qwen3_moe": (1e-6, 32768), "deepseek_v3": (1e-6, 4096), "glm4_moe": (1e-5, 131072)}[kind]
    return {
        "vocab_size": vocab,
        "dim": dim,
        "num_layers": layers,
        "num_heads": heads,
        "dense_hidden": dense_hidden,
        "moe_hidden": moe_hidden,
        "top_k": top_k,
        "rms_eps": f.get("rms_norm_eps", defaults[0]),
        "max_seq_len": f.get("max_position_embeddings", defaults[1]),
        "tie_embeddings": f.get("tie_word_embeddings", False),
    }


def _qwen3_moe(f: _Fields) -> dict:
    experts = f.get("num_experts", f.get("num_local_experts", 128))
    if experts < 1:
        f.fail("num_experts", "the model needs routed experts")
    heads, layers = f.raw["num_attention_heads"], f.raw["num_hidden_layers"]
    f.only("use_sliding_window", False, False, "attention is full, never sliding-window")
    f.get("sliding_window")  # read only with use_sliding_window
    f.get("max_window_layers")
    for i, kind in enumerate(f.get("layer_types", [])):
        if kind != "full_attention":
            raise ValueError(f"{f.where}: field 'layer_types'[{i}]={kind!r} cannot be honoured: full attention only")
    step = f.get("decoder_sparse_step", 1)
    only = set(f.get("mlp_only_layers", []))
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    bias = f.get("attention_bias", False)
    return {
        "num_experts": experts,
        "num_kv_heads": f.get("num_key_value_heads", heads),
        "head_dim": f.get("head_dim", f.raw["hidden_size"] // heads),
        "renormalize": f.get("norm_topk_prob", False),
        "qkv_bias": bias,
        "o_bias": bias,
        "qk_norm": True,
        "shared_hidden": 0,
        "scoring": "softmax",
        "first_dense_layers": 0,
        "dense_layers": dense or None,
    }


def _deepseek_moe(f: _Fields, defaults: dict) -> dict:
    """The DeepSeek-V3 MoE block, shared by DeepSeek-V3 and GLM-4-MoE (their class defaults differ)."""
    experts = f.get("n_routed_experts", f.get("num_local_experts", defaults["n_routed_experts"]))
    groups = f.get("n_group", defaults["n_group"])
    f.only("scoring_func", "sigmoid", "sigmoid", "the router of this family scores with a sigmoid")
    f.only("topk_method", "noaux_tc", "noaux_tc", "group-limited top-k over bias-corrected scores ('noaux_tc')")
    f.only("moe_layer_freq", 1, 1, "every block from first_k_dense_replace on is an MoE block")
    return {
        "num_experts": experts,
        "shared_hidden": f.raw["moe_intermediate_size"] * f.get("n_shared_experts", defaults["n_shared_experts"]),
        "routed_scaling_factor": float(f.get("routed_scaling_factor", defaults["routed_scaling_factor"])),
        "num_groups": groups,
        "topk_groups": f.get("topk_group", defaults["topk_group"]),
        "renormalize": f.get("norm_topk_prob", True),
        "first_dense_layers": f.get("first_k_dense_replace", defaults["first_k_dense_replace"]),
        "scoring": "sigmoid",
        "mtp_layers": f.get("num_nextn_predict_layers", f.get("num_mtp_layers", 0)),
    }


def _deepseek_v3(f: _Fields) -> dict:
    defaults = {
        "n_routed_experts": 256,
        "n_group": 8,
        "topk_group": 4,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 3,
    }
    out = _deepseek_moe(f, defaults)
    nope, rope, v = f.get("qk_nope_head_dim", 128), f.get("qk_rope_head_dim", 64), f.get("v_head_dim", 128)
    f.get("num_key_value_heads")  # MLA: every head has its own keys and values, from the shared latent
    for key, want in (("head_dim", rope), ("qk_head_dim", nope + rope)):  # derived by transformers; must agree
        f.only(key, want, want, f"DeepSeek-V3 derives it ({want}) from the MLA head dims")
    bias = f.get("attention_bias", False)
    q_lora = f.raw.get("q_lora_rank", 1536)  # an explicit null: a full-rank q_proj
    f.get("q_lora_rank")
    return out | {
        "attention": "mla",
        "q_lora_rank": q_lora,
        "kv_lora_rank": f.get("kv_lora_rank", 512),
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": v,
        "rope_interleave": f.get("rope_interleave", True),
        "qkv_bias": bias,
        "o_bias": bias,
        "qk_norm": False,
    }


def _glm4_moe(f: _Fields) -> dict:
    defaults = {
        "n_routed_experts": 128,
        "n_group": 1,
        "topk_group": 1,
        "n_shared_experts": 1,
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 1,
    }
    heads = f.raw["num_attention_heads"]
    return _deepseek_moe(f, defaults) | {
        "num_kv_heads": f.get("num_key_value_heads", 8),
        "head_dim": f.get("head_dim", f.raw["hidden_size"] // heads),
        "qkv_bias": f.get("attention_bias", False),
        "o_bias": False,  # GLM-4-MoE's o_proj has no bias whatever attention_bias says
        "qk_norm": f.get("use_qk_norm", False),
    }


def _rope(f: _Fields, kind: str, max_len: int) -> tuple[float, YarnScaling | None, float]:
    """``(rope_theta, rope_scaling, partial_rotary_factor)`` from ``rope_parameters`` or the legacy fields."""
    params = f.get("rope_parameters", {})
    legacy = f.get("rope_scaling", {})
    if not isinstance(params, dict) or not isinstance(legacy, dict):
        raise ValueError(f"{f.where}: field 'rope_parameters' / 'rope_scaling' must be an object")
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"{f.where}: field 'rope_parameters' holds per-layer-type RoPE; one RoPE for all layers only")
    p = {**legacy, **params}
    field = "rope_parameters" if params else "rope_scaling"
    unknown = sorted(set(p) - _YARN_KEYS)
    if unknown:
        raise ValueError(f"{f.where}: field {field!r} holds {unknown[0]!r}, which this model does not implement")
    theta = float(p.get("rope_theta", f.get("rope_theta", 10000.0)))
    partial = float(p.get("partial_rotary_factor", f.get("partial_rotary_factor", 0.5 if kind == "glm4_moe" else 1.0)))
    rope_type = p.get("rope_type", p.get("type", "default"))
    original = f.get("original_max_position_embeddings")
    if rope_type == "default":
        if set(p) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"}:
            raise ValueError(f"{f.where}: field {field!r} gives scaling parameters to rope_type 'default'")
        return theta, None, partial
    if rope_type != "yarn":
        raise ValueError(f"{f.where}: field {field!r} rope_type={rope_type!r} cannot be honoured: 'default' or 'yarn'")
    original = original if original is not None else p.get("original_max_position_embeddings", max_len)
    factor = p.get("factor")
    scaling = YarnScaling(
        factor=float(factor if factor is not None else max_len / original),
        original_max_len=int(original),
        beta_fast=float(p.get("beta_fast") or 32),
        beta_slow=float(p.get("beta_slow") or 1),
        mscale=p.get("mscale"),
        mscale_all_dim=p.get("mscale_all_dim"),
        attention_factor=p.get("attention_factor"),
        truncate=p.get("truncate", True),
    )
    return theta, scaling, partial


def _dtype(f: _Fields, dtype: str | None) -> str:
    stored = f.get("dtype", f.get("torch_dtype", "float32"))
    if dtype is not None:
        return dtype
    if stored not in ("float32", "bfloat16"):
        raise ValueError(f"{f.where}: field 'dtype'={stored!r}: the model runs float32 or bfloat16 (pass dtype=)")
    return stored


def _quantization(f: _Fields) -> None:
    q = f.get("quantization_config")
    if q is None:
        return
    unknown = sorted(set(q) - _QUANT_KEYS)
    if unknown:
        raise ValueError(f"{f.where}: field 'quantization_config' holds {unknown[0]!r}, which this model does not read")
    checks = (("quant_method", "fp8"), ("fmt", "e4m3"), ("weight_block_size", [128, 128]))
    for key, want in checks:
        if q.get(key, want) != want:
            raise ValueError(
                f"{f.where}: field 'quantization_config.{key}'={q.get(key)!r} cannot be honoured: DeepSeek's block "
                "FP8 (fp8, e4m3, 128 x 128 blocks) only"
            )

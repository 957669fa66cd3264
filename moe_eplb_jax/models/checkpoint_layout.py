"""The tensors of a Hugging Face-style checkpoint of a ``ModelConfig``: names, shapes, and the check of an index.

Names as Qwen3-MoE, DeepSeek-V3 and GLM-4-MoE write them; linear weights ``[out, in]`` as PyTorch stores them; a
float8_e4m3 linear weight carries float32 block scales ``{name}_scale_inv`` (one per ``128 x 128`` block).
"""

from __future__ import annotations

import re

from moe_eplb_jax.models import safetensors_io as io
from moe_eplb_jax.models.config import ModelConfig
from moe_eplb_jax.models.weights import FP8_BLOCK

__all__ = ["SCALE_SUFFIX", "check_index", "checkpoint_shapes", "dense_layout", "resolve", "router_bias_name", "skipped"]

SCALE_SUFFIX = "_scale_inv"  # "{name}.weight" + SCALE_SUFFIX: the block scales of an FP8 weight
_MTP = re.compile(r"model\.layers\.(\d+)\.")


def router_bias_name(config: ModelConfig, layer: int) -> str:
    """The router bias tensor of block ``layer``: DeepSeek-V3's ``e_score_correction_bias`` or a gate bias.

    With ``scoring="sigmoid"`` it is required; with ``"softmax"`` (Qwen3-MoE
    checkpoints have none) it is optional, read as zeros when absent and
    exported only when nonzero.
    """
    suffix = "e_score_correction_bias" if config.scoring == "sigmoid" else "bias"
    return f"model.layers.{layer}.mlp.gate.{suffix}"


# --------------------------------------------------------------------- layout
_Row = tuple[str, tuple[str, ...], tuple[int, ...], bool]


def _attention_layout(c: ModelConfig) -> list[_Row]:
    """``(checkpoint suffix, attribute path in the attention module, checkpoint shape, linear)`` of each tensor."""
    d, h = c.dim, c.num_heads
    rows: list[_Row]
    if c.attention == "gqa":
        q, kv = h * c.head_dim, c.num_kv_heads * c.head_dim
        rows = [
            ("q_proj.weight", ("q_proj",), (q, d), True),
            ("k_proj.weight", ("k_proj",), (kv, d), True),
            ("v_proj.weight", ("v_proj",), (kv, d), True),
            ("o_proj.weight", ("o_proj",), (d, q), True),
        ]
        if c.qkv_bias:
            rows += [(f"{n}_proj.bias", (f"{n}_bias",), (size,), False) for n, size in (("q", q), ("k", kv), ("v", kv))]
        if c.qk_norm:
            rows += [(f"{n}_norm.weight", (f"{n}_norm", "weight"), (c.head_dim,), False) for n in ("q", "k")]
    else:
        dn, dr, dv, r, rq = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank, c.q_lora_rank
        if rq is None:
            rows = [("q_proj.weight", ("q_proj",), (h * (dn + dr), d), True)]
        else:
            rows = [
                ("q_a_proj.weight", ("q_a_proj",), (rq, d), True),
                ("q_a_layernorm.weight", ("q_a_layernorm", "weight"), (rq,), False),
                ("q_b_proj.weight", ("q_b_proj",), (h * (dn + dr), rq), True),
            ]
            if c.qkv_bias:
                rows.append(("q_a_proj.bias", ("q_a_bias",), (rq,), False))
        rows += [
            ("kv_a_proj_with_mqa.weight", ("kv_a_proj_with_mqa",), (r + dr, d), True),
            ("kv_a_layernorm.weight", ("kv_a_layernorm", "weight"), (r,), False),
            ("kv_b_proj.weight", ("kv_b_proj",), (h * (dn + dv), r), True),
            ("o_proj.weight", ("o_proj",), (d, h * dv), True),
        ]
        if c.qkv_bias:
            rows.append(("kv_a_proj_with_mqa.bias", ("kv_a_bias",), (r + dr,), False))
    if c.o_bias:
        rows.append(("o_proj.bias", ("o_bias",), (d,), False))
    return rows


def dense_layout(c: ModelConfig):
    """``(name, owner path from the model, shape, linear)`` of every tensor but the routed and shared experts."""
    d, dense = c.dim, set(c.dense_blocks)
    rows: list[tuple[str, tuple, tuple[int, ...], bool]] = [
        ("model.embed_tokens.weight", ("embed_tokens",), (c.vocab_size, d), False)
    ]
    for i in range(c.num_layers):
        pre, block = f"model.layers.{i}.", ("layers", i)
        rows.append((pre + "input_layernorm.weight", (*block, "input_layernorm", "weight"), (d,), False))
        rows.append(
            (pre + "post_attention_layernorm.weight", (*block, "post_attention_layernorm", "weight"), (d,), False)
        )
        for suffix, path, shape, lin in _attention_layout(c):
            rows.append((pre + "self_attn." + suffix, (*block, "self_attn", *path), shape, lin))
        if i in dense:
            for name, shape in _mlp_shapes("", d, c.dense_hidden).items():
                rows.append((pre + "mlp." + name, (*block, "mlp", name.split(".")[0]), shape, True))
        else:
            rows.append((pre + "mlp.gate.weight", (*block, "mlp", "router"), (c.num_experts, d), True))
    rows.append(("model.norm.weight", ("norm", "weight"), (d,), False))
    if not c.tie_embeddings:
        rows.append(("lm_head.weight", ("lm_head",), (c.vocab_size, d), True))
    return rows


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a float checkpoint of ``config`` holds, name -> shape (the optional softmax gate bias left out)."""
    c = config
    shapes = {name: shape for name, _, shape, _ in dense_layout(c)}
    for i in c.moe_blocks:
        pre = f"model.layers.{i}.mlp."
        if c.scoring == "sigmoid":
            shapes[router_bias_name(c, i)] = (c.num_experts,)
        for j in range(c.num_experts):
            shapes.update(_mlp_shapes(f"{pre}experts.{j}.", c.dim, c.moe_hidden))
        if c.shared_hidden:
            shapes.update(_mlp_shapes(pre + "shared_experts.", c.dim, c.shared_hidden))
    return shapes


def _mlp_shapes(prefix: str, dim: int, hidden: int) -> dict[str, tuple[int, ...]]:
    return {
        prefix + "gate_proj.weight": (hidden, dim),
        prefix + "up_proj.weight": (hidden, dim),
        prefix + "down_proj.weight": (dim, hidden),
    }


def resolve(model, path):
    """``(owner module, attribute)`` at ``path`` (names and list indices) from ``model``."""
    owner = model
    for step in path[:-1]:
        owner = owner[step] if isinstance(step, int) else getattr(owner, step)
    return owner, path[-1]


def _fp8_capable(config: ModelConfig) -> set[str]:
    """The tensors an FP8 checkpoint may store as float8_e4m3 with block scales: every linear weight but
    the embedding, the output projection and the router."""
    linear = {name for name, _, _, lin in dense_layout(config) if lin}
    linear -= {"lm_head.weight"} | {n for n in linear if n.endswith(".mlp.gate.weight")}
    experts = {n for n in checkpoint_shapes(config) if ".mlp.experts." in n or ".mlp.shared_experts." in n}
    return linear | experts


def _scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    return -(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK)


def skipped(config: ModelConfig, name: str) -> bool:
    """A tensor of a multi-token-prediction block (after the decoder), which the model does not run."""
    m = _MTP.match(name)
    return m is not None and config.num_layers <= int(m.group(1)) < config.num_layers + config.mtp_layers


def check_index(index, config: ModelConfig, path, optional) -> None:
    expected = checkpoint_shapes(config)
    missing = sorted(set(expected) - set(index))
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ValueError(f"checkpoint {path}: missing tensors {', '.join(missing[:3])}{more}")
    scales = {name for name in index if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in expected}
    unexpected = sorted(set(index) - set(expected) - set(optional) - scales)
    if unexpected:
        raise ValueError(f"checkpoint {path}: unexpected tensor {unexpected[0]!r} (not part of this ModelConfig)")
    fp8_ok = _fp8_capable(config)
    for name, (file, dtype, shape) in index.items():
        if name in scales:
            weight = name[: -len(SCALE_SUFFIX)]
            want = _scale_shape(expected[weight])
            if index[weight][1] != io.FP8 or dtype != "F32" or shape != want:
                raise ValueError(
                    f"checkpoint tensor {name!r} ({file}): block scales are float32 {want} of a float8_e4m3 "
                    f"weight; got {dtype} {shape} for a {index[weight][1]} weight"
                )
            continue
        want = expected.get(name, optional.get(name))
        if shape != want:
            raise ValueError(f"checkpoint tensor {name!r} ({file}) has shape {shape}, expected {want}")
        if dtype == io.FP8:
            if name not in fp8_ok:
                raise ValueError(f"checkpoint tensor {name!r} ({file}) is {dtype}; only linear weights may be FP8")
            if name + SCALE_SUFFIX not in index:
                raise ValueError(f"checkpoint tensor {name!r} ({file}) is {dtype} without {name + SCALE_SUFFIX!r}")
        elif dtype not in io.DTYPES:
            raise ValueError(
                f"checkpoint tensor {name!r} ({file}) has dtype {dtype}; expected one of {sorted(io.DTYPES)}"
            )

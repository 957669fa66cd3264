"""Hugging Face-style safetensors checkpoints <-> the slot layout of a placement.

    load_checkpoint(model, "ckpt/", placement=placement, quantize="mxfp4")
    export_checkpoint(model, "out/model.safetensors")

A checkpoint holds one tensor per logical expert, named as Qwen3-MoE,
DeepSeek-V3 and GLM-4-MoE name them (``model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight``,
``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``,
``mlp.shared_experts.*``, ``self_attn.{q,k,v,o}_proj.{weight,bias}`` or MLA's
``self_attn.{q_a_proj,q_a_layernorm,q_b_proj,kv_a_proj_with_mqa,kv_a_layernorm,kv_b_proj,o_proj}``,
the norms, ``model.embed_tokens.weight``, ``lm_head.weight``), linear weights
stored ``[out, in]`` as PyTorch does. Loading fills the model's ``P`` slots
from them -- slot ``p`` gets expert ``phy2log[p]``, so a redundant slot is a
copy of its expert -- and hands each MoE layer the placement's tables; export
writes each logical expert once, from its first replica. Every name, shape
and dtype is checked before anything changes (``ValueError`` naming the
tensor); a failed load leaves the model as it was.

**DeepSeek's FP8 checkpoints.** A linear weight (attention, dense MLP,
experts, shared expert) may be float8_e4m3 with a float32
``{name}_scale_inv`` per ``128 x 128`` block. Such bytes are kept as read:
routed experts become the layer's ``fp8_block`` quantized experts, the other
weights ``weights.Fp8BlockWeight`` (decoded to the activation dtype at each
matmul), so export writes them back bit for bit.

**Dtypes.** Weights take the model's dtype (the routed experts float32 while
they are quantized on load); each variable remembers the dtype its tensors
had (variable metadata ``checkpoint_dtype``), and export writes every tensor
in that dtype -- a bf16 checkpoint loaded into a float32 model exports as
the same bf16 bytes. A weight the model made itself is written in the model's
dtype (``config.dtype``: a bf16 model's router as bf16, as Qwen3-MoE and
DeepSeek-V3 store it), except DeepSeek's ``e_score_correction_bias``, which
their checkpoints keep in float32.
Multi-token-prediction blocks (``config.mtp_layers``) are skipped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, cast

import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as PS

from moe_eplb_jax._files import atomic_path, check_output_path
from moe_eplb_jax.models import safetensors_io as io
from moe_eplb_jax.models.config import ModelConfig
from moe_eplb_jax.models.model import MoECausalLM
from moe_eplb_jax.models.weights import FP8_BLOCK, Fp8BlockWeight, QuantizedWeight
from moe_eplb_jax.placement import Placement
from moe_eplb_jax.transport.mesh import put_host

__all__ = ["checkpoint_shapes", "export_checkpoint", "load_checkpoint", "router_bias_name"]

_SCALE = "_scale_inv"  # "{name}.weight" + _SCALE: the block scales of an FP8 weight
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


def _dense_layout(c: ModelConfig):
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
    shapes = {name: shape for name, _, shape, _ in _dense_layout(c)}
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


def _resolve(model, path):
    """``(owner module, attribute)`` at ``path`` (names and list indices) from ``model``."""
    owner = model
    for step in path[:-1]:
        owner = owner[step] if isinstance(step, int) else getattr(owner, step)
    return owner, path[-1]


def _fp8_capable(config: ModelConfig) -> set[str]:
    """The tensors an FP8 checkpoint may store as float8_e4m3 with block scales: every linear weight but
    the embedding, the output projection and the router."""
    linear = {name for name, _, _, lin in _dense_layout(config) if lin}
    linear -= {"lm_head.weight"} | {n for n in linear if n.endswith(".mlp.gate.weight")}
    experts = {n for n in checkpoint_shapes(config) if ".mlp.experts." in n or ".mlp.shared_experts." in n}
    return linear | experts


def _scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    return -(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK)


def _skipped(config: ModelConfig, name: str) -> bool:
    """A tensor of a multi-token-prediction block (after the decoder), which the model does not run."""
    m = _MTP.match(name)
    return m is not None and config.num_layers <= int(m.group(1)) < config.num_layers + config.mtp_layers


def _check_index(index, config: ModelConfig, path, optional) -> None:
    expected = checkpoint_shapes(config)
    missing = sorted(set(expected) - set(index))
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ValueError(f"checkpoint {path}: missing tensors {', '.join(missing[:3])}{more}")
    scales = {name for name in index if name.endswith(_SCALE) and name[: -len(_SCALE)] in expected}
    unexpected = sorted(set(index) - set(expected) - set(optional) - scales)
    if unexpected:
        raise ValueError(f"checkpoint {path}: unexpected tensor {unexpected[0]!r} (not part of this ModelConfig)")
    fp8_ok = _fp8_capable(config)
    for name, (file, dtype, shape) in index.items():
        if name in scales:
            weight = name[: -len(_SCALE)]
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
            if name + _SCALE not in index:
                raise ValueError(f"checkpoint tensor {name!r} ({file}) is {dtype} without {name + _SCALE!r}")
        elif dtype not in io.DTYPES:
            raise ValueError(
                f"checkpoint tensor {name!r} ({file}) has dtype {dtype}; expected one of {sorted(io.DTYPES)}"
            )


# ---------------------------------------------------------------------- load
def load_checkpoint(
    model: MoECausalLM, path, *, placement: Placement | str | os.PathLike | None = None, quantize: str | None = None
) -> None:
    """Loads a safetensors checkpoint (a file, or a directory of shards) into ``model``, in place.

    Args:
      model: a float ``MoECausalLM`` of the checkpoint's ``ModelConfig``
        (``models.config_from_hf`` reads it from the checkpoint's ``config.json``).
      path: ``model.safetensors`` or a directory of ``*.safetensors`` shards.
      placement: the slot layout to fill (a ``Placement`` over the model's
        MoE layers, or a placement file); ``None`` keeps the model's current
        tables. Build the ``EplbController`` after loading: it reads the
        placement from the layers.
      quantize: a format of ``moe_eplb_jax.quant.FORMATS`` to quantize the
        experts to on the fly (from the checkpoint's values, not rounded to
        the model dtype first), or ``None``. Experts stored in FP8 load as
        ``fp8_block`` whatever this is (``None`` or ``"fp8_block"``).

    Raises ``ValueError`` -- a missing, unexpected, misshapen or non-float
    tensor (named), a placement for another shape, a format the expert
    shapes do not fit, NaN/Inf expert weights when quantizing -- before
    anything changes.
    """
    from moe_eplb_jax import quant

    if not isinstance(model, MoECausalLM):
        raise ValueError(f"model must be a MoECausalLM, got {type(model).__name__}")
    layers = model.moe_layers
    if any(layer.quant_format is not None for layer in layers) or _holds_fp8(model):
        raise ValueError("load_checkpoint: the model is already quantized; load into a float model (quantize=...)")
    if quantize is not None and quantize not in quant.FORMATS:
        raise ValueError(f"quantize must be None or one of {quant.FORMATS}, got {quantize!r}")
    placement = _placement_for(model, placement)
    config = model.config
    index = {n: v for n, v in io.index(io.checkpoint_files(path)).items() if not _skipped(config, n)}
    optional = (
        {}
        if config.scoring == "sigmoid"
        else {router_bias_name(config, i): (config.num_experts,) for i in config.moe_blocks}
    )
    _check_index(index, config, path, optional)
    fp8_layers = [
        i for i in config.moe_blocks if index[f"model.layers.{i}.mlp.experts.0.gate_proj.weight"][1] == io.FP8
    ]
    _check_expert_formats(index, config, fp8_layers, quantize)
    tensors = io.read(index, sorted(index))
    dtypes = {name: entry[1] for name, entry in index.items()}
    float_layers = [i for i in config.moe_blocks if i not in fp8_layers]
    if quantize is not None and float_layers:
        _check_quantizable(tensors, float_layers, quantize)
    actions = _dense_actions(model, tensors, dtypes)
    actions += _expert_actions(model, tensors, dtypes, placement, quantize, fp8_layers)
    for action in actions:
        action()
    for li, layer in enumerate(layers):
        layer.eplb_set_placement(placement.phy2log[li], placement.log2phy[li], placement.logcnt[li])
        if quantize is not None and layer.quant_format is None:
            layer.quantize(quantize)


def _holds_fp8(model) -> bool:
    return any(isinstance(v, QuantizedWeight) for _, v in nnx.iter_graph(model))


def _check_expert_formats(index, config: ModelConfig, fp8_layers, quantize) -> None:
    """Each layer's experts are all FP8 or all float; FP8 experts need whole blocks and ``quantize`` None or ``fp8_block``."""
    for i in config.moe_blocks:
        names = [n for n in index if n.startswith(f"model.layers.{i}.mlp.experts.") and not n.endswith(_SCALE)]
        kinds = {index[n][1] == io.FP8 for n in names}
        if len(kinds) > 1:
            raise ValueError(f"checkpoint: the experts of block {i} mix float8_e4m3 and float tensors")
    if not fp8_layers:
        return
    if quantize not in (None, "fp8_block"):
        raise ValueError(
            f"quantize={quantize!r}: the checkpoint's experts are block FP8, loaded as 'fp8_block' as they are "
            "(quantize=None or 'fp8_block')"
        )
    if config.moe_hidden % FP8_BLOCK or config.dim % FP8_BLOCK:
        raise ValueError(
            f"checkpoint tensor 'model.layers.{fp8_layers[0]}.mlp.experts.0.gate_proj.weight': block-FP8 experts "
            f"need whole {FP8_BLOCK}x{FP8_BLOCK} blocks (moe_hidden={config.moe_hidden}, dim={config.dim})"
        )
    for i in fp8_layers:
        name = f"model.layers.{i}.mlp.shared_experts.gate_proj.weight"
        if name in index and index[name][1] == io.FP8 and config.shared_hidden % FP8_BLOCK:
            raise ValueError(
                f"checkpoint tensor {name!r}: a block-FP8 shared expert needs whole {FP8_BLOCK}x{FP8_BLOCK} blocks "
                f"(shared_hidden={config.shared_hidden})"
            )


def _placement_for(model: MoECausalLM, placement) -> Placement:
    layers = model.moe_layers
    ranks = model.mesh.shape[model.axis]
    if placement is None:
        tables = [[np.asarray(t) for t in layer.eplb_get_placement()] for layer in layers]
        phy2log, log2phy, logcnt = (np.stack(t) for t in zip(*tables))
        return Placement.from_tables(phy2log, log2phy, logcnt, num_ranks=ranks)
    if not isinstance(placement, Placement):
        placement = Placement.load(placement)
    placement = placement.to_numpy()
    want = (len(layers), model.config.num_experts, model.num_physical)
    got = (placement.num_layers, placement.num_logical, placement.num_physical)
    if got != want:
        raise ValueError(f"placement is for (L, E, P) = {got} but the model has (L, E, P) = {want}")
    placement.validate(num_ranks=ranks)
    return placement


def _check_quantizable(tensors, blocks, fmt: str) -> None:
    """Scans the float experts of ``blocks`` for NaN/Inf, then quantizes one of them (the format's shape rules)."""
    from moe_eplb_jax import quant

    prefixes = tuple(f"model.layers.{i}.mlp.experts." for i in blocks)
    for name, value in tensors.items():
        if name.startswith(prefixes) and not np.all(np.isfinite(value.astype(np.float32))):
            raise ValueError(f"checkpoint tensor {name!r} holds NaN/Inf; it cannot be quantized to {fmt!r}")
    first = f"model.layers.{blocks[0]}.mlp.experts.0."
    gate, up, down = (tensors[first + f"{n}_proj.weight"].astype(np.float32)[None] for n in ("gate", "up", "down"))
    try:
        quant.quantize_mlp(gate, up, down, fmt)
    except ValueError as e:
        raise ValueError(f"quantize={fmt!r} does not fit the expert shapes: {e}") from None


def _set_float(model, var, value, dtype_codes, *, dtype=None):
    """An action: ``var`` takes ``value`` (in ``dtype``, default its own) and remembers its tensors' dtype."""
    codes = set(dtype_codes)
    if len(codes) != 1:
        raise ValueError(f"checkpoint tensors that form one model weight have different dtypes {sorted(codes)}")
    host = np.ascontiguousarray(value).astype(dtype or var.get_value().dtype)
    checkpoint_dtype = io.DTYPES[codes.pop()].name

    def action():
        var.set_value(put_host(host, model.mesh, var.get_value().sharding.spec))
        var.set_metadata("checkpoint_dtype", checkpoint_dtype)

    return action


def _fp8_weight(tensors, name) -> Fp8BlockWeight:
    return Fp8BlockWeight(tensors[name], tensors[name + _SCALE])


def _dense_actions(model: MoECausalLM, tensors, dtypes):
    """Actions that set every weight but the routed and shared experts from the checkpoint ``tensors``."""
    out = []
    for name, path, _, linear in _dense_layout(model.config):
        owner, attr = _resolve(model, path)
        if dtypes[name] == io.FP8:
            host = _fp8_weight(tensors, name)
            out.append(lambda owner=owner, attr=attr, host=host: setattr(owner, attr, _put_fp8(model, host)))
            continue
        value = tensors[name].T if linear else tensors[name]
        out.append(_set_float(model, getattr(owner, attr), value, [dtypes[name]]))
    for i, mlp in zip(model.config.moe_blocks, model.moe_layers):
        bias_name = router_bias_name(model.config, i)
        if bias_name in tensors:
            out.append(_set_float(model, mlp.router_bias, tensors[bias_name], [dtypes[bias_name]]))
        else:  # an optional softmax gate bias the checkpoint lacks: zeros, written back only if it changes
            out.append(lambda mlp=mlp: mlp.router_bias.set_value(mlp.router_bias.get_value() * 0))
    return out


def _put_fp8(model, host: Fp8BlockWeight) -> QuantizedWeight:
    return QuantizedWeight(
        Fp8BlockWeight(*(put_host(np.asarray(a), model.mesh, PS()) for a in (host.weight, host.scale_inv)))
    )


def _expert_actions(model: MoECausalLM, tensors, dtypes, placement: Placement, quantize, fp8_layers):
    """Actions that fill each MoE layer's slots (and its shared expert) from the checkpoint ``tensors``."""

    config, out = model.config, []
    for li, (i, mlp) in enumerate(zip(config.moe_blocks, model.moe_layers)):
        pre, phy2log = f"model.layers.{i}.mlp.", placement.phy2log[li]
        experts = [
            f"{pre}experts.{j}.{n}_proj.weight" for j in range(config.num_experts) for n in ("gate", "up", "down")
        ]
        if i in fp8_layers:
            blocks = []
            for n in ("gate", "up", "down"):
                names = [f"{pre}experts.{j}.{n}_proj.weight" for j in range(config.num_experts)]
                weight = np.stack([tensors[m] for m in names])[phy2log]
                scale = np.stack([tensors[m + _SCALE] for m in names])[phy2log]
                blocks.append(_host_fp8_experts(weight, scale))
            out.append(lambda mlp=mlp, blocks=blocks: mlp.set_quantized_experts(*blocks))
        else:
            gate = np.stack([tensors[f"{pre}experts.{j}.gate_proj.weight"] for j in range(config.num_experts)])
            up = np.stack([tensors[f"{pre}experts.{j}.up_proj.weight"] for j in range(config.num_experts)])
            down = np.stack([tensors[f"{pre}experts.{j}.down_proj.weight"] for j in range(config.num_experts)])
            w_in = np.concatenate([gate.transpose(0, 2, 1), up.transpose(0, 2, 1)], axis=2)[phy2log]  # [P, D, 2H]
            w_out = down.transpose(0, 2, 1)[phy2log]  # [P, H, D]
            # Quantized from the checkpoint's values next (float32), else in the model dtype.
            keep = np.float32 if quantize is not None else None
            codes = [dtypes[n] for n in experts]
            out.append(_set_float(model, mlp.w_in, w_in, codes, dtype=keep))
            out.append(_set_float(model, mlp.w_out, w_out, codes, dtype=keep))
        if mlp.shared_in is not None and mlp.shared_out is not None:
            out += _shared_actions(model, mlp, tensors, dtypes, pre + "shared_experts.")
    return out


def _host_fp8_experts(weight: np.ndarray, scale: np.ndarray):
    """``quant.Fp8BlockExperts`` of host arrays (placed on the mesh when installed)."""
    from moe_eplb_jax import quant

    return quant.Fp8BlockExperts(cast(Any, weight), cast(Any, scale))


def _shared_actions(model, mlp, tensors, dtypes, pre):

    names = [pre + f"{n}_proj.weight" for n in ("gate", "up", "down")]
    if dtypes[names[0]] == io.FP8:
        if {dtypes[n] for n in names} != {io.FP8}:
            raise ValueError(f"checkpoint: the shared expert {pre[:-1]!r} mixes float8_e4m3 and float tensors")
        w_in = _host_fp8_experts(
            np.stack([tensors[n] for n in names[:2]]), np.stack([tensors[n + _SCALE] for n in names[:2]])
        )
        w_out = _host_fp8_experts(tensors[names[2]][None], tensors[names[2] + _SCALE][None])

        def install(mlp=mlp, w_in=w_in, w_out=w_out):
            put = lambda q: QuantizedWeight(
                type(q)(*(put_host(np.asarray(a), model.mesh, PS()) for a in (q.weight, q.weight_scale)))
            )
            mlp.shared_in, mlp.shared_out = put(w_in), put(w_out)

        return [install]
    s_in = np.concatenate([tensors[names[0]].T, tensors[names[1]].T], axis=1)  # [D, 2Hs]
    codes = [dtypes[n] for n in names]
    return [
        _set_float(model, mlp.shared_in, s_in, codes),
        _set_float(model, mlp.shared_out, tensors[names[2]].T, codes),
    ]


# -------------------------------------------------------------------- export
def export_checkpoint(model: MoECausalLM, path) -> None:
    """Writes ``model`` as one safetensors file in the checkpoint layout, one tensor per logical expert.

    Each expert comes from its first replica (replicas hold identical bytes).
    Every tensor is written in the dtype it was loaded in (see the module
    docstring); block-FP8 weights and ``fp8_block`` experts as e4m3 with
    their ``weight_scale_inv``. The file is written beside ``path`` and
    renamed over it, so an existing checkpoint is never left half-written.
    The model must be a float or ``fp8_block`` model whose arrays this process
    can read whole (one process).
    """
    if not isinstance(model, MoECausalLM):
        raise ValueError(f"model must be a MoECausalLM, got {type(model).__name__}")
    path = check_output_path(path, what="checkpoint", suffixes=(".safetensors",))
    formats = {str(layer.quant_format) for layer in model.moe_layers} - {"None", "fp8_block"}
    if formats:
        raise ValueError(
            f"export_checkpoint: quantized experts have no float checkpoint layout ({sorted(formats)}); export a "
            "float (or fp8_block) model"
        )
    tensors = _export_tensors(model)
    with atomic_path(path, what="checkpoint") as temporary:
        io.save(tensors, temporary, metadata={"format": "pt", "moe_eplb_jax.config": _config_json(model.config)})


def _config_json(config: ModelConfig) -> str:
    return json.dumps(dataclasses.asdict(config), sort_keys=True)


def _host(var) -> np.ndarray:
    value = var.get_value()
    if not value.is_fully_addressable:
        raise ValueError("export_checkpoint: the model spans several processes; export from a single process")
    return np.asarray(value)


def _as_loaded(var, value: np.ndarray, made_as) -> np.ndarray:
    """``value`` in the dtype ``var``'s tensors had in the checkpoint it was loaded from, else ``made_as``."""
    return value.astype(var.get_metadata().get("checkpoint_dtype") or made_as)


def _fp8_tensors(name: str, weight, scale) -> dict[str, np.ndarray]:
    return {name: np.asarray(weight), name + _SCALE: np.asarray(scale)}


def _export_tensors(model: MoECausalLM) -> dict[str, np.ndarray]:
    config = model.config
    out: dict[str, np.ndarray] = {}
    for name, path, _, linear in _dense_layout(config):
        var = getattr(*_resolve(model, path))
        if isinstance(var, QuantizedWeight):
            value = var.get_value()
            out.update(_fp8_tensors(name, value.weight, value.scale_inv))
        else:
            out[name] = _as_loaded(var, _host(var).T if linear else _host(var), config.jnp_dtype)
    for i, mlp in zip(config.moe_blocks, model.moe_layers):
        pre = f"model.layers.{i}.mlp."
        bias = _host(mlp.router_bias)
        if config.scoring == "sigmoid" or np.any(bias != 0):
            # DeepSeek's checkpoints keep the score-correction bias in float32; a gate bias has the model's dtype.
            made_as = np.float32 if config.scoring == "sigmoid" else config.jnp_dtype
            out[router_bias_name(config, i)] = _as_loaded(mlp.router_bias, bias, made_as)
        out.update(_export_experts(mlp, pre, config))
        if mlp.shared_in is not None and mlp.shared_out is not None:
            out.update(_export_shared(mlp, pre + "shared_experts.", config.shared_hidden, config.jnp_dtype))
    return {name: np.ascontiguousarray(value) for name, value in out.items()}


def _export_experts(mlp, pre: str, config: ModelConfig) -> dict[str, np.ndarray]:
    out = {}
    first = np.asarray(mlp.eplb_get_placement()[1])[:, 0]  # log2phy[:, 0]: each expert's first replica
    if mlp.quant_format == "fp8_block":
        for n, var in (("gate", mlp.q_gate), ("up", mlp.q_up), ("down", mlp.q_down)):
            q = var.get_value()
            weight, scale = np.asarray(q.weight)[first], np.asarray(q.weight_scale)[first]
            for j in range(config.num_experts):
                out.update(_fp8_tensors(f"{pre}experts.{j}.{n}_proj.weight", weight[j], scale[j]))
        return out
    hidden = config.moe_hidden
    w_in = _as_loaded(mlp.w_in, _host(mlp.w_in)[first], config.jnp_dtype)
    w_out = _as_loaded(mlp.w_out, _host(mlp.w_out)[first], config.jnp_dtype)
    for j in range(config.num_experts):
        e = f"{pre}experts.{j}."
        out[e + "gate_proj.weight"] = w_in[j, :, :hidden].T
        out[e + "up_proj.weight"] = w_in[j, :, hidden:].T
        out[e + "down_proj.weight"] = w_out[j].T
    return out


def _export_shared(mlp, pre: str, hidden: int, dtype) -> dict[str, np.ndarray]:
    if isinstance(mlp.shared_in, QuantizedWeight):
        q_in, q_out = mlp.shared_in.get_value(), mlp.shared_out.get_value()
        out = _fp8_tensors(pre + "gate_proj.weight", q_in.weight[0], q_in.weight_scale[0])
        out.update(_fp8_tensors(pre + "up_proj.weight", q_in.weight[1], q_in.weight_scale[1]))
        out.update(_fp8_tensors(pre + "down_proj.weight", q_out.weight[0], q_out.weight_scale[0]))
        return out
    s_in = _as_loaded(mlp.shared_in, _host(mlp.shared_in), dtype)
    return {
        pre + "gate_proj.weight": s_in[:, :hidden].T,
        pre + "up_proj.weight": s_in[:, hidden:].T,
        pre + "down_proj.weight": _as_loaded(mlp.shared_out, _host(mlp.shared_out), dtype).T,
    }

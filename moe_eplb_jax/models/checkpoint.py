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

import os
from typing import Any, cast

import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as PS

from moe_eplb_jax import quant
from moe_eplb_jax.models import safetensors_io as io
from moe_eplb_jax.models.checkpoint_export import export_checkpoint
from moe_eplb_jax.models.checkpoint_layout import (
    SCALE_SUFFIX,
    check_index,
    checkpoint_shapes,
    dense_layout,
    resolve,
    router_bias_name,
    skipped,
)
from moe_eplb_jax.models.config import ModelConfig
from moe_eplb_jax.models.model import MoECausalLM
from moe_eplb_jax.models.weights import FP8_BLOCK, Fp8BlockWeight, QuantizedWeight
from moe_eplb_jax.placement import Placement
from moe_eplb_jax.transport.mesh import put_host

__all__ = ["checkpoint_shapes", "export_checkpoint", "load_checkpoint", "router_bias_name"]


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
    if not isinstance(model, MoECausalLM):
        raise ValueError(f"model must be a MoECausalLM, got {type(model).__name__}")
    layers = model.moe_layers
    if any(layer.quant_format is not None for layer in layers) or _holds_fp8(model):
        raise ValueError("load_checkpoint: the model is already quantized; load into a float model (quantize=...)")
    if quantize is not None and quantize not in quant.FORMATS:
        raise ValueError(f"quantize must be None or one of {quant.FORMATS}, got {quantize!r}")
    placement = _placement_for(model, placement)
    config = model.config
    index = {n: v for n, v in io.index(io.checkpoint_files(path)).items() if not skipped(config, n)}
    optional = (
        {}
        if config.scoring == "sigmoid"
        else {router_bias_name(config, i): (config.num_experts,) for i in config.moe_blocks}
    )
    check_index(index, config, path, optional)
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
        names = [n for n in index if n.startswith(f"model.layers.{i}.mlp.experts.") and not n.endswith(SCALE_SUFFIX)]
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
    return Fp8BlockWeight(tensors[name], tensors[name + SCALE_SUFFIX])


def _dense_actions(model: MoECausalLM, tensors, dtypes):
    """Actions that set every weight but the routed and shared experts from the checkpoint ``tensors``."""
    out = []
    for name, path, _, linear in dense_layout(model.config):
        owner, attr = resolve(model, path)
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
                scale = np.stack([tensors[m + SCALE_SUFFIX] for m in names])[phy2log]
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
    return quant.Fp8BlockExperts(cast(Any, weight), cast(Any, scale))


def _shared_actions(model, mlp, tensors, dtypes, pre):

    names = [pre + f"{n}_proj.weight" for n in ("gate", "up", "down")]
    if dtypes[names[0]] == io.FP8:
        if {dtypes[n] for n in names} != {io.FP8}:
            raise ValueError(f"checkpoint: the shared expert {pre[:-1]!r} mixes float8_e4m3 and float tensors")
        w_in = _host_fp8_experts(
            np.stack([tensors[n] for n in names[:2]]), np.stack([tensors[n + SCALE_SUFFIX] for n in names[:2]])
        )
        w_out = _host_fp8_experts(tensors[names[2]][None], tensors[names[2] + SCALE_SUFFIX][None])

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

"""``export_checkpoint``: a model back to one safetensors file in the checkpoint layout, each tensor in the dtype
it was loaded in (``models.checkpoint``)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from moe_eplb_jax._files import atomic_path, check_output_path
from moe_eplb_jax.models import safetensors_io as io
from moe_eplb_jax.models.checkpoint_layout import SCALE_SUFFIX, dense_layout, resolve, router_bias_name
from moe_eplb_jax.models.config import ModelConfig
from moe_eplb_jax.models.model import MoECausalLM
from moe_eplb_jax.models.weights import QuantizedWeight

__all__ = ["export_checkpoint"]


def export_checkpoint(model: MoECausalLM, path) -> None:
    """Writes ``model`` as one safetensors file in the checkpoint layout, one tensor per logical expert.

    Each expert comes from its first replica (replicas hold identical bytes).
    Every tensor is written in the dtype it was loaded in (``models.checkpoint``);
    block-FP8 weights and ``fp8_block`` experts as e4m3 with their
    ``weight_scale_inv``. The file is written beside ``path`` and renamed over
    it, so an existing checkpoint is never left half-written. The model must be
    a float or ``fp8_block`` model whose arrays this process can read whole
    (one process).
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
    return {name: np.asarray(weight), name + SCALE_SUFFIX: np.asarray(scale)}


def _export_tensors(model: MoECausalLM) -> dict[str, np.ndarray]:
    config = model.config
    out: dict[str, np.ndarray] = {}
    for name, path, _, linear in dense_layout(config):
        var = getattr(*resolve(model, path))
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

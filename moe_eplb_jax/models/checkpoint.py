"""Hugging Face-style safetensors checkpoints <-> the slot layout of a placement.

    load_checkpoint(model, "ckpt/", placement=placement, quantize="mxfp4")
    export_checkpoint(model, "out/model.safetensors")

A checkpoint holds one tensor per logical expert, named as Qwen3-MoE and
DeepSeek-V3 name them (``model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight``,
``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``,
``mlp.shared_experts.*``, ``self_attn.{q,k,v,o}_proj.weight``, the norms,
``model.embed_tokens.weight``, ``lm_head.weight``), linear weights stored
``[out, in]`` as PyTorch does. Loading fills the model's ``P`` slots from
them -- slot ``p`` gets expert ``phy2log[p]``, so a redundant slot is a copy
of its expert -- and hands each MoE layer the placement's tables; export
writes each logical expert once, from its first replica. Every name, shape
and dtype is checked before anything changes (``ValueError`` naming the
tensor); a failed load leaves the model as it was.

The reader and writer is ``safetensors``' numpy API (the optional ``hf`` extra).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

import ml_dtypes  # registers bfloat16 with numpy, which safetensors' numpy reader needs
import numpy as np

from moe_eplb_jax.models.config import ModelConfig
from moe_eplb_jax.models.layers import DenseMLP
from moe_eplb_jax.models.model import MoECausalLM
from moe_eplb_jax.placement import Placement
from moe_eplb_jax.transport.mesh import put_host

__all__ = ["checkpoint_shapes", "export_checkpoint", "load_checkpoint", "router_bias_name"]

_FLOAT_DTYPES = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F16": np.float16, "F64": np.float64}


def _safetensors():
    try:
        from safetensors import safe_open  # pyright: ignore[reportMissingImports] -- the optional "hf" extra
        from safetensors.numpy import save_file  # pyright: ignore[reportMissingImports]
    except ImportError as e:
        raise ImportError("checkpoints need safetensors: pip install 'moe_eplb_jax[hf]'") from e
    return safe_open, save_file


def router_bias_name(config: ModelConfig, layer: int) -> str:
    """The router bias tensor of block ``layer``: DeepSeek-V3's ``e_score_correction_bias`` or a gate bias.

    With ``scoring="sigmoid"`` it is required; with ``"softmax"`` (Qwen3-MoE
    checkpoints have none) it is optional, read as zeros when absent and
    exported only when nonzero.
    """
    suffix = "e_score_correction_bias" if config.scoring == "sigmoid" else "bias"
    return f"model.layers.{layer}.mlp.gate.{suffix}"


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``config`` holds, name -> shape (the optional softmax gate bias left out)."""
    c = config
    d, q, kv = c.dim, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, d)}
    for i in range(c.num_layers):
        pre = f"model.layers.{i}."
        shapes[pre + "input_layernorm.weight"] = (d,)
        shapes[pre + "post_attention_layernorm.weight"] = (d,)
        shapes[pre + "self_attn.q_proj.weight"] = (q, d)
        shapes[pre + "self_attn.k_proj.weight"] = (kv, d)
        shapes[pre + "self_attn.v_proj.weight"] = (kv, d)
        shapes[pre + "self_attn.o_proj.weight"] = (d, q)
        if c.qk_norm:
            shapes[pre + "self_attn.q_norm.weight"] = (c.head_dim,)
            shapes[pre + "self_attn.k_norm.weight"] = (c.head_dim,)
        if i < c.first_dense_layers:
            shapes.update(_mlp_shapes(pre + "mlp.", d, c.dense_hidden))
            continue
        shapes[pre + "mlp.gate.weight"] = (c.num_experts, d)
        if c.scoring == "sigmoid":
            shapes[router_bias_name(c, i)] = (c.num_experts,)
        for j in range(c.num_experts):
            shapes.update(_mlp_shapes(f"{pre}mlp.experts.{j}.", d, c.moe_hidden))
        if c.shared_hidden:
            shapes.update(_mlp_shapes(pre + "mlp.shared_experts.", d, c.shared_hidden))
    shapes["model.norm.weight"] = (d,)
    if not c.tie_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, d)
    return shapes


def _mlp_shapes(prefix: str, dim: int, hidden: int) -> dict[str, tuple[int, ...]]:
    return {
        prefix + "gate_proj.weight": (hidden, dim),
        prefix + "up_proj.weight": (hidden, dim),
        prefix + "down_proj.weight": (dim, hidden),
    }


# ---------------------------------------------------------------------- files
def _checkpoint_files(path) -> list[str]:
    path = os.fspath(path)
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise ValueError(f"{path}: directory holds no .safetensors file")
        return files
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such checkpoint file or directory")
    return [path]


def _index(files: list[str]) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """name -> (file, dtype code, shape), from the headers only."""
    safe_open, _ = _safetensors()
    found: dict[str, tuple[str, str, tuple[int, ...]]] = {}
    for file in files:
        try:
            with safe_open(file, framework="np") as f:
                for name in f.keys():  # noqa: SIM118 -- a safetensors handle, not a dict
                    if name in found:
                        raise ValueError(f"{file}: tensor {name!r} also in {found[name][0]}")
                    piece = f.get_slice(name)
                    found[name] = (file, str(piece.get_dtype()), tuple(int(n) for n in piece.get_shape()))
        except ValueError:
            raise
        except Exception as e:  # safetensors raises its own error type for a damaged header
            raise ValueError(f"{file}: not a readable safetensors file ({e})") from e
    return found


def _read(index, names) -> dict[str, np.ndarray]:
    safe_open, _ = _safetensors()
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(index[name][0], []).append(name)
    out = {}
    for file, wanted in by_file.items():
        try:
            with safe_open(file, framework="np") as f:
                for name in wanted:
                    out[name] = np.asarray(f.get_tensor(name))
        except Exception as e:
            raise ValueError(f"{file}: could not read its tensors ({e})") from e
    return out


# ---------------------------------------------------------------------- load
def load_checkpoint(
    model: MoECausalLM, path, *, placement: Placement | str | os.PathLike | None = None, quantize: str | None = None
) -> None:
    """Loads a safetensors checkpoint (a file, or a directory of shards) into ``model``, in place.

    Args:
      model: a float ``MoECausalLM`` of the checkpoint's ``ModelConfig``.
      path: ``model.safetensors`` or a directory of ``*.safetensors`` shards.
      placement: the slot layout to fill (a ``Placement`` over the model's
        MoE layers, or a placement file); ``None`` keeps the model's current
        tables. Build the ``EplbController`` after loading: it reads the
        placement from the layers.
      quantize: a format of ``moe_eplb_jax.quant.FORMATS`` to quantize the
        experts to on the fly (from the checkpoint's values, not rounded to
        the model dtype first), or ``None``.

    Raises ``ValueError`` -- a missing, unexpected, misshapen or non-float
    tensor (named), a placement for another shape, a format the expert
    shapes do not fit, NaN/Inf expert weights when quantizing -- before
    anything changes.
    """
    from moe_eplb_jax import quant

    if not isinstance(model, MoECausalLM):
        raise ValueError(f"model must be a MoECausalLM, got {type(model).__name__}")
    layers = model.moe_layers
    if any(layer.quant_format is not None for layer in layers):
        raise ValueError("load_checkpoint: the model is already quantized; load into a float model (quantize=...)")
    if quantize is not None and quantize not in quant.FORMATS:
        raise ValueError(f"quantize must be None or one of {quant.FORMATS}, got {quantize!r}")
    placement = _placement_for(model, placement)
    config = model.config
    index = _index(_checkpoint_files(path))
    expected = checkpoint_shapes(config)
    optional = (
        {}
        if config.scoring == "sigmoid"
        else {
            router_bias_name(config, config.first_dense_layers + li): (config.num_experts,) for li in range(len(layers))
        }
    )
    missing = sorted(set(expected) - set(index))
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ValueError(f"checkpoint {path}: missing tensors {', '.join(missing[:3])}{more}")
    unexpected = sorted(set(index) - set(expected) - set(optional))
    if unexpected:
        raise ValueError(f"checkpoint {path}: unexpected tensor {unexpected[0]!r} (not part of this ModelConfig)")
    for name, (file, dtype, shape) in index.items():
        want = expected.get(name, optional.get(name))
        if shape != want:
            raise ValueError(f"checkpoint tensor {name!r} ({file}) has shape {shape}, expected {want}")
        if dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"checkpoint tensor {name!r} ({file}) has dtype {dtype}; expected one of {sorted(_FLOAT_DTYPES)}"
            )
    tensors = _read(index, sorted(index))
    assignments = _assignments(model, tensors, placement, keep_expert_float32=quantize is not None)
    if quantize is not None:
        _check_quantizable(tensors, config, quantize)
    for var, value in assignments:
        spec = var.get_value().sharding.spec
        var.set_value(put_host(value, model.mesh, spec))
    for li, layer in enumerate(layers):
        layer.eplb_set_placement(placement.phy2log[li], placement.log2phy[li], placement.logcnt[li])
        if quantize is not None:
            layer.quantize(quantize)


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


def _check_quantizable(tensors, config: ModelConfig, fmt: str) -> None:
    """Scans every expert for NaN/Inf, then quantizes one expert of the shapes at hand (the format's shape rules)."""
    from moe_eplb_jax import quant

    for name, value in tensors.items():
        if ".mlp.experts." in name and not np.all(np.isfinite(value.astype(np.float32))):
            raise ValueError(f"checkpoint tensor {name!r} holds NaN/Inf; it cannot be quantized to {fmt!r}")
    first = f"model.layers.{config.first_dense_layers}.mlp.experts.0."
    gate, up, down = (tensors[first + f"{n}_proj.weight"].astype(np.float32)[None] for n in ("gate", "up", "down"))
    try:
        quant.quantize_mlp(gate, up, down, fmt)
    except ValueError as e:
        raise ValueError(f"quantize={fmt!r} does not fit the expert shapes: {e}") from None


def _assignments(model: MoECausalLM, tensors, placement: Placement, *, keep_expert_float32: bool):
    """``[(variable, host value)]`` for every weight of ``model`` from the checkpoint ``tensors``."""
    config = model.config
    out = []

    def put(var, value):
        out.append((var, np.ascontiguousarray(value).astype(var.get_value().dtype)))

    put(model.embed_tokens, tensors["model.embed_tokens.weight"])
    for i, block in enumerate(model.layers):
        pre = f"model.layers.{i}."
        put(block.input_layernorm.weight, tensors[pre + "input_layernorm.weight"])
        put(block.post_attention_layernorm.weight, tensors[pre + "post_attention_layernorm.weight"])
        attn = block.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            put(getattr(attn, name), tensors[f"{pre}self_attn.{name}.weight"].T)
        if attn.q_norm is not None and attn.k_norm is not None:
            put(attn.q_norm.weight, tensors[pre + "self_attn.q_norm.weight"])
            put(attn.k_norm.weight, tensors[pre + "self_attn.k_norm.weight"])
        mlp = block.mlp
        if isinstance(mlp, DenseMLP):
            for name in ("gate_proj", "up_proj", "down_proj"):
                put(getattr(mlp, name), tensors[f"{pre}mlp.{name}.weight"].T)
            continue
        put(mlp.router, tensors[pre + "mlp.gate.weight"].T)
        bias = tensors.get(router_bias_name(config, i))
        put(mlp.router_bias, np.zeros(config.num_experts, np.float32) if bias is None else bias)
        experts = [f"{pre}mlp.experts.{j}." for j in range(config.num_experts)]
        gate = np.stack([tensors[e + "gate_proj.weight"] for e in experts])  # [E, H, D]
        up = np.stack([tensors[e + "up_proj.weight"] for e in experts])
        down = np.stack([tensors[e + "down_proj.weight"] for e in experts])  # [E, D, H]
        w_in = np.concatenate([gate.transpose(0, 2, 1), up.transpose(0, 2, 1)], axis=2)  # [E, D, 2H]
        w_out = down.transpose(0, 2, 1)  # [E, H, D]
        phy2log = placement.phy2log[i - config.first_dense_layers]
        for var, value in ((mlp.w_in, w_in[phy2log]), (mlp.w_out, w_out[phy2log])):
            if keep_expert_float32:  # quantized from the checkpoint's values next, then dropped
                out.append((var, np.ascontiguousarray(value).astype(np.float32)))
            else:
                put(var, value)
        if mlp.shared_in is not None and mlp.shared_out is not None:
            shared = pre + "mlp.shared_experts."
            s_in = np.concatenate(
                [tensors[shared + "gate_proj.weight"].T, tensors[shared + "up_proj.weight"].T], axis=1
            )  # [D, 2Hs]
            put(mlp.shared_in, s_in)
            put(mlp.shared_out, tensors[shared + "down_proj.weight"].T)
    put(model.norm.weight, tensors["model.norm.weight"])
    if model.lm_head is not None:
        put(model.lm_head, tensors["lm_head.weight"].T)
    return out


# -------------------------------------------------------------------- export
def export_checkpoint(model: MoECausalLM, path) -> None:
    """Writes ``model`` as one safetensors file in the checkpoint layout, one tensor per logical expert.

    Each expert comes from its first replica (replicas hold identical bytes).
    Tensors keep the model's dtypes. The file is written beside ``path`` and
    renamed over it, so an existing checkpoint is never left half-written.
    The model must be a float model whose arrays this process can read whole
    (one process).
    """
    _, save_file = _safetensors()
    if not isinstance(model, MoECausalLM):
        raise ValueError(f"model must be a MoECausalLM, got {type(model).__name__}")
    path = os.fspath(path)
    if not path.endswith(".safetensors"):
        raise ValueError(f"checkpoint path must end in .safetensors, got {path!r}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{path}: directory {folder} does not exist")
    if any(layer.quant_format is not None for layer in model.moe_layers):
        raise ValueError("export_checkpoint: quantized experts have no float checkpoint layout; export a float model")
    tensors = _export_tensors(model)
    handle, temporary = tempfile.mkstemp(dir=folder, suffix=".safetensors.tmp")
    os.close(handle)
    try:
        save_file(tensors, temporary, metadata={"format": "pt", "moe_eplb_jax.config": _config_json(model.config)})
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def _config_json(config: ModelConfig) -> str:
    return json.dumps(dataclasses.asdict(config), sort_keys=True)


def _host(var) -> np.ndarray:
    value = var.get_value()
    if not value.is_fully_addressable:
        raise ValueError("export_checkpoint: the model spans several processes; export from a single process")
    return np.asarray(value)


def _export_tensors(model: MoECausalLM) -> dict[str, np.ndarray]:
    config = model.config
    out: dict[str, np.ndarray] = {"model.embed_tokens.weight": _host(model.embed_tokens)}
    for i, block in enumerate(model.layers):
        pre = f"model.layers.{i}."
        out[pre + "input_layernorm.weight"] = _host(block.input_layernorm.weight)
        out[pre + "post_attention_layernorm.weight"] = _host(block.post_attention_layernorm.weight)
        attn = block.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"{pre}self_attn.{name}.weight"] = _host(getattr(attn, name)).T
        if attn.q_norm is not None and attn.k_norm is not None:
            out[pre + "self_attn.q_norm.weight"] = _host(attn.q_norm.weight)
            out[pre + "self_attn.k_norm.weight"] = _host(attn.k_norm.weight)
        mlp = block.mlp
        if isinstance(mlp, DenseMLP):
            for name in ("gate_proj", "up_proj", "down_proj"):
                out[f"{pre}mlp.{name}.weight"] = _host(getattr(mlp, name)).T
            continue
        out[pre + "mlp.gate.weight"] = _host(mlp.router).T
        bias = _host(mlp.router_bias)
        if config.scoring == "sigmoid" or np.any(bias != 0):
            out[router_bias_name(config, i)] = bias
        hidden = config.moe_hidden
        first = np.asarray(mlp.eplb_get_placement()[1])[:, 0]  # log2phy[:, 0]: each expert's first replica
        w_in, w_out = _host(mlp.w_in)[first], _host(mlp.w_out)[first]
        for j in range(config.num_experts):
            e = f"{pre}mlp.experts.{j}."
            out[e + "gate_proj.weight"] = w_in[j, :, :hidden].T
            out[e + "up_proj.weight"] = w_in[j, :, hidden:].T
            out[e + "down_proj.weight"] = w_out[j].T
        if mlp.shared_in is not None and mlp.shared_out is not None:
            s_in, shared = _host(mlp.shared_in), pre + "mlp.shared_experts."
            out[shared + "gate_proj.weight"] = s_in[:, : config.shared_hidden].T
            out[shared + "up_proj.weight"] = s_in[:, config.shared_hidden :].T
            out[shared + "down_proj.weight"] = _host(mlp.shared_out).T
    out["model.norm.weight"] = _host(model.norm.weight)
    if model.lm_head is not None:
        out["lm_head.weight"] = _host(model.lm_head).T
    return {name: np.ascontiguousarray(value) for name, value in out.items()}

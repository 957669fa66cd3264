"""Recorded load files: per-step, per-layer expert loads.

Format ``moe_eplb_jax.load`` version 1, as ``.npz`` (preferred) or ``.json``:

* ``format``: ``"moe_eplb_jax.load"``; ``version``: ``1``;
* ``load``: non-negative numbers, shape ``[steps, L, E]`` (or ``[L, E]`` for a
  single snapshot, read as one step): tokens routed to each logical expert of
  each MoE layer in each recorded step (padding excluded);
* optional metadata: ``num_ranks`` (EP size the load was recorded at),
  ``top_k``, ``model`` (a name), ``note`` (free text), ``layer_ids`` (the
  decoder block of each MoE layer) with ``num_hidden_layers`` (the model's
  decoder blocks): where an SGLang file of every block puts each row.

Counts are kept exact: integer loads must stay below ``2**53`` (float64's exact
range) and totals must not overflow. :func:`read_load` also reads SGLang's load
JSON ``{"logical_count": ...}`` (same shapes). Writes are atomic.

Used by ``moe-eplb fit`` / ``stats`` / ``heatmap`` / ``simulate`` and by the
serving example (``EplbState.window_logical_load`` gives one step's ``[L, E]``).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from moe_eplb_jax._files import (
    array_field,
    check_document,
    check_output_path,
    int_field,
    read_fields,
    write_document,
)
from moe_eplb_jax.placement import check_layer_ids

__all__ = ["LoadTrace", "save_load", "read_load", "LOAD_FORMAT", "LOAD_VERSION"]

LOAD_FORMAT = "moe_eplb_jax.load"
LOAD_VERSION = 1
_META = ("num_ranks", "top_k", "model", "note", "layer_ids", "num_hidden_layers")
_INT_META = ("num_ranks", "top_k", "num_hidden_layers")
_TEXT_META = ("model", "note")
# float64 holds every integer count up to 2**53 exactly; a larger count would be silently rounded.
_MAX_EXACT_COUNT = 2**53


@dataclasses.dataclass(frozen=True)
class LoadTrace:
    """``load [steps, L, E]`` float64 plus the file's metadata (a dict)."""

    load: np.ndarray
    meta: dict

    @property
    def num_steps(self) -> int:
        return int(self.load.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.load.shape[1])

    @property
    def num_logical(self) -> int:
        return int(self.load.shape[2])

    def total(self) -> np.ndarray:
        """``[L, E]`` load summed over steps."""
        return self.load.sum(0)


def _check_load(load, where: str, *, field: str = "load") -> np.ndarray:
    """``load`` as float64 ``[steps, L, E]`` (a ``[L, E]`` snapshot becomes one step), checked.

    Numbers only (no bools or strings), finite, non-negative, integers exact in
    float64 (below ``2**53``), and every layer's total over the trace finite.
    """
    try:
        arr = np.asarray(load)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"{where}: field {field!r} is not a numeric table ({e})") from None
    if arr.dtype.kind not in "iuf":
        raise ValueError(f"{where}: field {field!r} must hold numbers, got dtype {arr.dtype}")
    if arr.ndim == 2:
        arr = arr[None]
    if arr.ndim != 3 or min(arr.shape) < 1:
        raise ValueError(f"{where}: field {field!r} must have shape [steps, L, E] or [L, E], got {arr.shape}")
    if arr.dtype.kind in "iu" and arr.max() >= _MAX_EXACT_COUNT:
        raise ValueError(f"{where}: field {field!r} holds a count >= 2**53, which float64 cannot hold exactly")
    if arr.dtype.kind in "iu" and arr.min() < 0:
        raise ValueError(f"{where}: field {field!r} must be finite and non-negative")
    arr = arr.astype(np.float64)
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"{where}: field {field!r} must be finite and non-negative")
    with np.errstate(over="ignore"):
        if not np.all(np.isfinite(arr.sum(axis=(0, 2)))):
            raise ValueError(f"{where}: field {field!r} is too large, a layer's total overflows float64")
    return arr


def _check_meta(meta: dict, where: str) -> dict:
    unknown = sorted(set(meta) - set(_META))
    if unknown:
        raise ValueError(f"{where}: unknown metadata field(s) {unknown}; known: {list(_META)}")
    for k in _INT_META:
        if k in meta:
            int_field(meta, k, where, minimum=1)
    for k in _TEXT_META:
        if k in meta and not isinstance(meta[k], str):
            raise ValueError(f"{where}: field {k!r} must be text, got {meta[k]!r}")
    out = {k: (int(v) if k in _INT_META else v) for k, v in meta.items()}
    if ("layer_ids" in meta) != ("num_hidden_layers" in meta):
        raise ValueError(f"{where}: fields 'layer_ids' and 'num_hidden_layers' come together or not at all")
    if "layer_ids" in meta:
        ids = array_field(meta, "layer_ids", where, kind="integer")
        try:
            out["layer_ids"] = check_layer_ids(ids, ids.size, out["num_hidden_layers"])[0].tolist()
        except ValueError as e:
            raise ValueError(f"{where}: field {e}") from None
    return out


def save_load(path, load, **meta) -> None:
    """Writes ``load`` (``[steps, L, E]`` or ``[L, E]``) and metadata (``num_ranks``, ``top_k``, ``model``, ``note``).

    The write is atomic: a unique temporary file renamed over ``path``.
    """
    path = check_output_path(path, what="load", suffixes=(".json", ".npz"))
    meta = _check_meta({k: v for k, v in meta.items() if v is not None}, path)
    _check_rows(_check_load(load, path), meta, path)
    fields = {"format": LOAD_FORMAT, "version": LOAD_VERSION, "load": np.asarray(load)}
    fields.update(meta)
    write_document(path, fields, what="load")


def read_load(path) -> LoadTrace:
    """Reads a load file; every malformed file raises ``ValueError`` naming the file and the field.

    Also reads SGLang's load JSON, ``{"logical_count": [steps, L, E] or [L, E]}``
    (what ``--init-expert-location`` fits a placement to).
    """
    path = os.fspath(path)
    doc = read_fields(path, what="load")
    if "format" not in doc and "logical_count" in doc:
        unknown = sorted(set(doc) - {"logical_count"})
        if unknown:
            raise ValueError(f"{path}: unknown field(s) {unknown} in an SGLang load file")
        field = "logical_count"
        meta = {}
    else:
        check_document(doc, path, file_format=LOAD_FORMAT, version=LOAD_VERSION, fields=("load", *_META))
        field = "load"
        meta = _check_meta({k: doc[k] for k in _META if k in doc}, path)
    load = _check_load(array_field(doc, field, path, kind="number"), path, field=field)
    _check_rows(load, meta, path)
    return LoadTrace(load=load, meta=meta)


def _check_rows(load: np.ndarray, meta: dict, where: str) -> None:
    if "layer_ids" in meta and len(meta["layer_ids"]) != load.shape[1]:
        raise ValueError(f"{where}: field 'layer_ids' names {len(meta['layer_ids'])} blocks for {load.shape[1]} layers")

"""Recorded load files: per-step, per-layer expert loads.

Format ``moe_eplb_jax.load`` version 1, as ``.npz`` (preferred) or ``.json``:

* ``format``: ``"moe_eplb_jax.load"``; ``version``: ``1``;
* ``load``: non-negative numbers, shape ``[steps, L, E]`` (or ``[L, E]`` for a
  single snapshot, read as one step): tokens routed to each logical expert of
  each MoE layer in each recorded step (padding excluded);
* optional metadata: ``num_ranks`` (EP size the load was recorded at),
  ``top_k``, ``model`` (a name), ``note`` (free text).

Used by ``moe-eplb fit`` / ``stats`` / ``heatmap`` / ``simulate`` and by the
serving example (``EplbState.window_logical_load`` gives one step's ``[L, E]``).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from moe_eplb_jax._files import read_document, write_document

__all__ = ["LoadTrace", "save_load", "read_load", "LOAD_FORMAT", "LOAD_VERSION"]

LOAD_FORMAT = "moe_eplb_jax.load"
LOAD_VERSION = 1
_META = ("num_ranks", "top_k", "model", "note")


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


def _check_load(load, where: str) -> np.ndarray:
    try:
        arr = np.asarray(load, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: field 'load' is not a numeric table ({e})") from e
    if arr.ndim == 2:
        arr = arr[None]
    if arr.ndim != 3 or min(arr.shape) < 1:
        raise ValueError(f"{where}: field 'load' must have shape [steps, L, E] or [L, E], got {arr.shape}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"{where}: field 'load' must be finite and non-negative")
    return arr


def save_load(path, load, **meta) -> None:
    """Writes ``load`` (``[steps, L, E]`` or ``[L, E]``) and metadata (``num_ranks``, ``top_k``, ``model``, ``note``)."""
    path = os.fspath(path)
    unknown = sorted(set(meta) - set(_META))
    if unknown:
        raise ValueError(f"unknown metadata field(s) {unknown}; known: {list(_META)}")
    _check_load(load, path)
    fields = {"format": LOAD_FORMAT, "version": LOAD_VERSION, "load": np.asarray(load)}
    fields.update({k: v for k, v in meta.items() if v is not None})
    write_document(path, fields, what="load")


def read_load(path) -> LoadTrace:
    """Reads a load file; every malformed file raises ``ValueError`` naming the field."""
    path = os.fspath(path)
    doc = read_document(path, what="load", file_format=LOAD_FORMAT, version=LOAD_VERSION)
    if "load" not in doc:
        raise ValueError(f"{path}: missing field 'load'")
    load = _check_load(doc["load"], path)
    meta = {k: doc[k] for k in _META if k in doc}
    for k in ("num_ranks", "top_k"):
        if k in meta and (not isinstance(meta[k], (int, np.integer)) or meta[k] < 1):
            raise ValueError(f"{path}: field {k!r} must be a positive integer, got {meta[k]!r}")
    return LoadTrace(load=load, meta=meta)

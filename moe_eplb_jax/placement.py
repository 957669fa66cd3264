"""Placement tables: which logical expert each physical slot holds.

A placement of ``L`` MoE layers with ``E`` logical experts on ``P`` physical
slots (``P >= E``; ``R = P - E`` redundant slots) is three integer tables:

* ``phy2log [L, P]`` -- the logical expert held by each slot (the ground truth);
* ``log2phy [L, E, S]`` -- the slots holding each logical expert, padded with
  ``-1``; ``S = P - E + 1`` is fixed so shapes never depend on the placement;
* ``logcnt [L, E]`` -- the number of replicas of each logical expert.

Slot ``p`` lives on EP rank ``p // (P // G)`` for ``G`` ranks.

File format (``save`` / ``load``), version 1. JSON::

    {"format": "moe_eplb_jax.placement", "version": 1,
     "num_layers": L, "num_logical": E, "num_physical": P,
     "phy2log": [[...P ints...] x L],
     "log2phy": [[[...S ints...] x E] x L],   # optional; rebuilt when absent
     "logcnt": [[...E ints...] x L]}          # optional; rebuilt when absent

``.npz`` files hold the same keys as arrays (``format`` and ``version`` as 0-d
arrays) and are the better choice for large models.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np

from moe_eplb_jax._files import read_document, write_document

FILE_FORMAT = "moe_eplb_jax.placement"
FILE_VERSION = 1

__all__ = ["Placement", "build_log2phy", "check_expert_ids", "FILE_FORMAT", "FILE_VERSION"]


def _as_int_table(name: str, value: Any, ndim: int) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not np.issubdtype(arr.dtype, np.floating) or not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr)):
            raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int32)


def build_log2phy(phy2log: np.ndarray, num_logical: int) -> tuple[np.ndarray, np.ndarray]:
    """Inverts ``phy2log [L, P]`` into ``(log2phy [L, E, P - E + 1], logcnt [L, E])``.

    Replicas of an expert are listed in ascending slot order. Ids must already be
    in ``[0, num_logical)``.
    """
    phy2log = np.asarray(phy2log, dtype=np.int64)
    num_layers, num_physical = phy2log.shape
    width = num_physical - num_logical + 1
    # Stable sort by expert id: replicas of one expert end up adjacent, in slot order.
    order = np.argsort(phy2log, axis=1, kind="stable")
    sorted_ids = np.take_along_axis(phy2log, order, axis=1)
    logcnt = np.zeros((num_layers, num_logical), dtype=np.int64)
    np.add.at(logcnt, (np.arange(num_layers)[:, None], phy2log), 1)
    first = np.cumsum(logcnt, axis=1) - logcnt  # position of each expert's first replica
    replica_rank = np.arange(num_physical)[None, :] - np.take_along_axis(first, sorted_ids, axis=1)
    log2phy = np.full((num_layers, num_logical, width), -1, dtype=np.int32)
    layer = np.broadcast_to(np.arange(num_layers)[:, None], order.shape)
    keep = replica_rank < width  # only reachable with an invalid (too many replicas) input
    log2phy[layer[keep], sorted_ids[keep], replica_rank[keep]] = order[keep]
    return log2phy, logcnt.astype(np.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Placement:
    """Placement tables of every MoE layer (see the module docstring).

    The fields are arrays (numpy on the host, or jax arrays inside a jitted
    function: ``Placement`` is a pytree), so a placement can be passed to jitted
    code; its shapes depend only on ``L, E, P``.
    """

    phy2log: Any  # [L, P] int32
    log2phy: Any  # [L, E, P - E + 1] int32, -1 padded
    logcnt: Any  # [L, E] int32

    # ------------------------------------------------------------------ sizes
    @property
    def num_layers(self) -> int:
        return int(self.phy2log.shape[0])

    @property
    def num_physical(self) -> int:
        return int(self.phy2log.shape[1])

    @property
    def num_logical(self) -> int:
        return int(self.logcnt.shape[1])

    @property
    def num_redundant(self) -> int:
        return self.num_physical - self.num_logical

    @property
    def max_replicas(self) -> int:
        """``S = P - E + 1``, the fixed width of ``log2phy``."""
        return self.num_physical - self.num_logical + 1

    # --------------------------------------------------------- constructors
    @classmethod
    def from_phy2log(cls, phy2log, num_logical: int, *, num_ranks: int | None = None) -> Placement:
        """Builds and validates a placement from ``phy2log [L, P]`` (or ``[P]`` for one layer)."""
        table = _as_int_table("phy2log", phy2log, np.ndim(phy2log))
        if table.ndim == 1:
            table = table[None]
        if table.ndim != 2:
            raise ValueError(f"phy2log must have shape [L, P] or [P], got {table.shape}")
        _check_sizes(table.shape[0], int(num_logical), table.shape[1], num_ranks)
        check_expert_ids(table, int(num_logical))
        log2phy, logcnt = build_log2phy(table, int(num_logical))
        _check_every_expert_placed(logcnt)
        return cls(phy2log=table, log2phy=log2phy, logcnt=logcnt)

    @classmethod
    def from_tables(cls, phy2log, log2phy, logcnt, *, num_ranks: int | None = None) -> Placement:
        """Wraps tables computed elsewhere (e.g. by a policy) after validating them."""
        placement = cls(
            phy2log=_as_int_table("phy2log", phy2log, 2),
            log2phy=_as_int_table("log2phy", log2phy, 3),
            logcnt=_as_int_table("logcnt", logcnt, 2),
        )
        placement.validate(num_ranks=num_ranks)
        return placement

    @classmethod
    def linear(cls, num_layers: int, num_logical: int, num_physical: int, *, num_ranks: int | None = None) -> Placement:
        """Slot ``i < E`` holds expert ``i``; redundant slot ``E + j`` holds expert ``j mod E``."""
        _check_sizes(num_layers, num_logical, num_physical, num_ranks)
        row = np.arange(num_physical) % num_logical
        return cls.from_phy2log(np.tile(row, (num_layers, 1)), num_logical, num_ranks=num_ranks)

    @classmethod
    def round_robin(cls, num_layers: int, num_logical: int, num_physical: int, num_ranks: int) -> Placement:
        """Experts dealt to ranks in turn: slot ``j`` of rank ``r`` holds ``(j * G + r) mod E``.

        Without redundancy rank ``r`` holds experts ``r, r + G, r + 2G, ...`` --
        neighbouring (often similarly hot) experts land on different ranks.
        """
        _check_sizes(num_layers, num_logical, num_physical, num_ranks)
        per_rank = num_physical // num_ranks
        slot = np.arange(num_physical)
        rank, local = slot // per_rank, slot % per_rank
        row = (local * num_ranks + rank) % num_logical
        return cls.from_phy2log(np.tile(row, (num_layers, 1)), num_logical, num_ranks=num_ranks)

    # ----------------------------------------------------------- validation
    def validate(self, *, num_ranks: int | None = None) -> Placement:
        """Checks every table and their agreement; raises ``ValueError`` naming the problem."""
        phy2log, log2phy, logcnt = (np.asarray(t) for t in (self.phy2log, self.log2phy, self.logcnt))
        if phy2log.ndim != 2:
            raise ValueError(f"phy2log must have shape [L, P], got {phy2log.shape}")
        num_layers, num_physical = phy2log.shape
        if logcnt.ndim != 2 or logcnt.shape[0] != num_layers:
            raise ValueError(f"logcnt must have shape [L={num_layers}, E], got {logcnt.shape}")
        num_logical = logcnt.shape[1]
        _check_sizes(num_layers, num_logical, num_physical, num_ranks)
        width = num_physical - num_logical + 1
        if log2phy.shape != (num_layers, num_logical, width):
            raise ValueError(
                f"log2phy must have shape [L, E, P - E + 1] = {(num_layers, num_logical, width)}, got {log2phy.shape}"
            )
        check_expert_ids(phy2log, num_logical)
        expected_log2phy, expected_cnt = build_log2phy(phy2log, num_logical)
        _check_every_expert_placed(expected_cnt)
        if not np.array_equal(logcnt, expected_cnt):
            layer, expert = np.argwhere(logcnt != expected_cnt)[0]
            raise ValueError(
                f"logcnt[{layer}, {expert}] = {logcnt[layer, expert]} but phy2log holds "
                f"{expected_cnt[layer, expert]} replicas of expert {expert} in layer {layer}"
            )
        # log2phy may list replicas in any order, but must list exactly the slots holding each expert.
        valid = np.arange(width)[None, None, :] < logcnt[..., None]
        if np.any(log2phy[~valid] != -1):
            raise ValueError("log2phy must be padded with -1 after the first logcnt entries of each expert")
        if np.any((log2phy[valid] < 0) | (log2phy[valid] >= num_physical)):
            raise ValueError(f"log2phy holds slot ids outside [0, {num_physical})")
        layer_idx = np.broadcast_to(np.arange(num_layers)[:, None, None], log2phy.shape)
        held = phy2log[layer_idx[valid], log2phy[valid]]
        expert_idx = np.broadcast_to(np.arange(num_logical)[None, :, None], log2phy.shape)[valid]
        if np.any(held != expert_idx):
            raise ValueError("log2phy lists a slot that phy2log says holds another expert")
        if not np.array_equal(np.sort(log2phy, axis=-1), np.sort(expected_log2phy, axis=-1)):
            raise ValueError("log2phy lists a slot twice for one expert")
        return self

    # ------------------------------------------------------------- queries
    def slots_per_rank(self, num_ranks: int) -> int:
        _check_sizes(self.num_layers, self.num_logical, self.num_physical, num_ranks)
        return self.num_physical // num_ranks

    def rank_of_slot(self, num_ranks: int) -> np.ndarray:
        """``[P]`` EP rank owning each physical slot."""
        return np.arange(self.num_physical) // self.slots_per_rank(num_ranks)

    def to_numpy(self) -> Placement:
        return Placement(*(np.asarray(t, dtype=np.int32) for t in (self.phy2log, self.log2phy, self.logcnt)))

    def to_jax(self) -> Placement:
        import jax.numpy as jnp

        return Placement(*(jnp.asarray(t, dtype=jnp.int32) for t in (self.phy2log, self.log2phy, self.logcnt)))

    def layer(self, index: int) -> Placement:
        """The placement of one layer, as a one-layer ``Placement``."""
        return Placement(
            self.phy2log[index : index + 1], self.log2phy[index : index + 1], self.logcnt[index : index + 1]
        )

    def __eq__(self, other: object) -> bool:  # array fields: compare by value
        if not isinstance(other, Placement):
            return NotImplemented
        return all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(self._tables(), other._tables()))

    __hash__ = None  # mutable-content arrays: not hashable

    def _tables(self):
        return (self.phy2log, self.log2phy, self.logcnt)

    # ------------------------------------------------------------------ I/O
    def save(self, path: str | os.PathLike) -> None:
        """Writes the placement as JSON (``.json``) or numpy archive (``.npz``); see the module docstring."""
        p = self.to_numpy()
        write_document(
            path,
            {
                "format": FILE_FORMAT,
                "version": FILE_VERSION,
                "num_layers": p.num_layers,
                "num_logical": p.num_logical,
                "num_physical": p.num_physical,
                "phy2log": p.phy2log,
                "log2phy": p.log2phy,
                "logcnt": p.logcnt,
            },
            what="placement",
        )

    @classmethod
    def load(cls, path: str | os.PathLike, *, num_ranks: int | None = None) -> Placement:
        """Reads a file written by :meth:`save`; every malformed file raises ``ValueError``."""
        path = os.fspath(path)
        doc = read_document(path, what="placement", file_format=FILE_FORMAT, version=FILE_VERSION)
        return cls._from_document(doc, path, num_ranks)

    @classmethod
    def _from_document(cls, doc: dict, path: str, num_ranks: int | None) -> Placement:
        def field(name):
            if name not in doc:
                raise ValueError(f"{path}: missing field {name!r}")
            return doc[name]

        sizes = {}
        for name in ("num_layers", "num_logical", "num_physical"):
            value = field(name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"{path}: field {name!r} must be a positive integer, got {value!r}")
            sizes[name] = int(value)
        shape = (sizes["num_layers"], sizes["num_physical"])
        try:
            phy2log = np.asarray(field("phy2log"))
        except ValueError as e:  # ragged nested lists
            raise ValueError(f"{path}: field 'phy2log' is not a rectangular table ({e})") from e
        if phy2log.shape != shape:
            raise ValueError(f"{path}: field 'phy2log' has shape {phy2log.shape}, header says {shape}")
        try:
            placement = cls.from_phy2log(phy2log, sizes["num_logical"], num_ranks=num_ranks)
            if "log2phy" in doc or "logcnt" in doc:
                placement = cls.from_tables(phy2log, field("log2phy"), field("logcnt"), num_ranks=num_ranks)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e
        return placement


def _check_sizes(num_layers: int, num_logical: int, num_physical: int, num_ranks: int | None) -> None:
    if num_layers < 1:
        raise ValueError(f"need at least one layer, got num_layers={num_layers}")
    if num_logical < 1:
        raise ValueError(f"need at least one logical expert, got num_logical={num_logical}")
    if num_physical < num_logical:
        raise ValueError(f"fewer physical slots ({num_physical}) than logical experts ({num_logical})")
    if num_ranks is not None:
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be positive, got {num_ranks}")
        if num_physical % num_ranks:
            raise ValueError(f"{num_physical} physical slots are not divisible by {num_ranks} ranks")


def check_expert_ids(table: np.ndarray, num_logical: int, *, name: str = "phy2log") -> None:
    """Raises ``ValueError`` naming the first entry of an ``[L, P]`` table outside ``[0, num_logical)``."""
    bad = (table < 0) | (table >= num_logical)
    if np.any(bad):
        layer, slot = np.argwhere(bad)[0]
        raise ValueError(
            f"{name}[{layer}, {slot}] = {table[layer, slot]} is outside the logical expert range [0, {num_logical})"
        )


def _check_every_expert_placed(logcnt: np.ndarray) -> None:
    if np.any(logcnt == 0):
        layer, expert = np.argwhere(logcnt == 0)[0]
        raise ValueError(f"logical expert {expert} of layer {layer} has no replica")

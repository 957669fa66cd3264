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

``log2phy`` lists each expert's replicas in ascending slot order, whatever
order the tables it was built from used (``from_tables`` checks them, then
rebuilds ``log2phy``): a placement routes the same however it was stored.

SGLang's expert-location file (``save(path, format="sglang")``; ``load`` detects
it) is the JSON object ``{"physical_to_logical_map": [[...P ints...] x N]}``
that SGLang's ``--init-expert-location`` reads. SGLang sizes it by the model's
decoder blocks (``num_hidden_layers``), dense ones included, and reads row
``layer_id`` for the MoE block ``layer_id``; it derives each expert's replica
list in ascending slot order, as ``log2phy`` here. ``save`` writes the ``L``
MoE rows at their blocks ``layer_ids`` of ``num_hidden_layers`` rows (the
others hold SGLang's trivial map, slot ``p`` -> expert ``p mod E``); ``load``
with ``layer_ids`` picks them out again. The file does not store ``E``:
``load`` takes the largest expert id + 1 unless ``num_logical`` is given.
Files are written atomically (a unique temporary file renamed over the target).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moe_eplb_jax._checks import INT32_MAX, check_fits, check_int, host_memory_bytes
from moe_eplb_jax._files import (
    array_field,
    check_document,
    check_output_path,
    int_field,
    read_fields,
    write_document,
    write_json,
)

FILE_FORMAT = "moe_eplb_jax.placement"
FILE_VERSION = 1
FILE_FORMATS = ("moe_eplb_jax", "sglang")
_FIELDS = ("num_layers", "num_logical", "num_physical", "phy2log", "log2phy", "logcnt")
_TABLES = ("phy2log", "log2phy", "logcnt")

__all__ = [
    "Placement",
    "build_log2phy",
    "check_expert_ids",
    "check_layer_ids",
    "check_placement_size",
    "FILE_FORMAT",
    "FILE_FORMATS",
    "FILE_VERSION",
]


_INT32 = np.iinfo(np.int32)


def _as_int_table(name: str, value: Any, ndim: int | None = None) -> np.ndarray:
    """``value`` as an int32 array; ``ValueError`` for non-integers and for values int32 cannot hold (no wrap)."""
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError, OverflowError) as e:  # ragged nested lists, Python ints past uint64
        raise ValueError(f"{name} must be a rectangular table of integers ({e})") from None
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {arr.shape}")
    if arr.dtype.kind not in "iuf":
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.size and arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr)):
            raise ValueError(f"{name} must hold integers, got dtype {arr.dtype} with fractional or non-finite values")
    if arr.size:
        outside = (arr < _INT32.min) | (arr > _INT32.max)
        if np.any(outside):
            index = tuple(int(i) for i in np.argwhere(outside)[0])
            raise ValueError(f"{name}{list(index)} = {arr[index]} is outside the int32 range of expert and slot ids")
    return arr.astype(np.int32)


def build_log2phy(phy2log: np.ndarray, num_logical: int) -> tuple[np.ndarray, np.ndarray]:
    """Inverts ``phy2log [L, P]`` into ``(log2phy [L, E, P - E + 1], logcnt [L, E])``.

    Replicas of an expert are listed in ascending slot order; ids outside
    ``[0, num_logical)`` raise ``ValueError``.
    """
    num_logical = check_int("num_logical", num_logical, minimum=1, maximum=INT32_MAX)
    phy2log = _as_int_table("phy2log", phy2log, 2).astype(np.int64)
    check_expert_ids(phy2log, num_logical)
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
        num_logical = check_int("num_logical", num_logical, minimum=1, maximum=INT32_MAX)
        table = _as_int_table("phy2log", phy2log)
        if table.ndim == 1:
            table = table[None]
        if table.ndim != 2:
            raise ValueError(f"phy2log must have shape [L, P] or [P], got {table.shape}")
        _check_sizes(table.shape[0], num_logical, table.shape[1], num_ranks)
        check_expert_ids(table, num_logical)
        log2phy, logcnt = build_log2phy(table, num_logical)
        _check_every_expert_placed(logcnt)
        return cls(phy2log=table, log2phy=log2phy, logcnt=logcnt)

    @classmethod
    def from_tables(cls, phy2log, log2phy, logcnt, *, num_ranks: int | None = None) -> Placement:
        """Wraps tables computed elsewhere (e.g. by a policy) after validating them.

        ``log2phy`` may list an expert's replicas in any order; the placement
        lists them in ascending slot order (the module docstring), so it routes
        as the same ``phy2log`` read from any file.
        """
        placement = cls(
            phy2log=_as_int_table("phy2log", phy2log, 2),
            log2phy=_as_int_table("log2phy", log2phy, 3),
            logcnt=_as_int_table("logcnt", logcnt, 2),
        )
        placement.validate(num_ranks=num_ranks)
        return dataclasses.replace(placement, log2phy=build_log2phy(placement.phy2log, placement.num_logical)[0])

    @classmethod
    def linear(cls, num_layers: int, num_logical: int, num_physical: int, *, num_ranks: int | None = None) -> Placement:
        """Slot ``i < E`` holds expert ``i``; redundant slot ``E + j`` holds expert ``j mod E``."""
        num_layers, num_logical, num_physical = _check_sizes(num_layers, num_logical, num_physical, num_ranks)
        row = np.arange(num_physical) % num_logical
        return cls.from_phy2log(np.tile(row, (num_layers, 1)), num_logical, num_ranks=num_ranks)

    @classmethod
    def round_robin(cls, num_layers: int, num_logical: int, num_physical: int, num_ranks: int) -> Placement:
        """Experts dealt to ranks in turn: slot ``j`` of rank ``r`` holds ``(j * G + r) mod E``.

        Without redundancy rank ``r`` holds experts ``r, r + G, r + 2G, ...`` --
        neighbouring (often similarly hot) experts land on different ranks.
        """
        num_layers, num_logical, num_physical = _check_sizes(num_layers, num_logical, num_physical, num_ranks)
        num_ranks = check_int("num_ranks", num_ranks, minimum=1)
        per_rank = num_physical // num_ranks
        slot = np.arange(num_physical)
        rank, local = slot // per_rank, slot % per_rank
        row = (local * num_ranks + rank) % num_logical
        return cls.from_phy2log(np.tile(row, (num_layers, 1)), num_logical, num_ranks=num_ranks)

    # ----------------------------------------------------------- validation
    def validate(self, *, num_ranks: int | None = None) -> Placement:
        """Checks every table and their agreement; raises ``ValueError`` naming the problem."""
        phy2log, log2phy, logcnt = (np.asarray(t) for t in (self.phy2log, self.log2phy, self.logcnt))
        for name, table in (("phy2log", phy2log), ("log2phy", log2phy), ("logcnt", logcnt)):
            if table.dtype.kind not in "iu":
                raise ValueError(f"{name} must hold integers, got dtype {table.dtype}")
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
        return self.num_physical // int(num_ranks)

    def rank_of_slot(self, num_ranks: int) -> np.ndarray:
        """``[P]`` EP rank owning each physical slot."""
        return np.arange(self.num_physical) // self.slots_per_rank(num_ranks)

    def to_numpy(self) -> Placement:
        """The tables as numpy int32 (``ValueError`` for values int32 cannot hold: nothing wraps)."""
        return Placement(*(_as_int_table(name, t) for name, t in zip(_TABLES, self._tables())))

    def to_jax(self) -> Placement:
        """The tables as jax int32 arrays (host tables checked as in :meth:`to_numpy` first)."""
        tables = (t if isinstance(t, jax.Array) else _as_int_table(n, t) for n, t in zip(_TABLES, self._tables()))
        return Placement(*(jnp.asarray(t).astype(jnp.int32) for t in tables))

    def layer(self, index: int) -> Placement:
        """The placement of one layer (``-L <= index < L``), as a one-layer ``Placement``."""
        index = check_int("index", index, minimum=-self.num_layers, maximum=self.num_layers - 1) % self.num_layers
        return Placement(
            self.phy2log[index : index + 1], self.log2phy[index : index + 1], self.logcnt[index : index + 1]
        )

    def __eq__(self, other: object) -> bool:  # array fields: compare by value
        if not isinstance(other, Placement):
            return NotImplemented
        return all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(self._tables(), other._tables()))

    def __hash__(self) -> int:  # array fields compare by value, which no hash can follow
        raise TypeError("unhashable type: 'Placement'")

    def _tables(self):
        return (self.phy2log, self.log2phy, self.logcnt)

    # ------------------------------------------------------------------ I/O
    def save(
        self,
        path: str | os.PathLike,
        *,
        format: str = "moe_eplb_jax",
        layer_ids=None,
        num_hidden_layers: int | None = None,
    ) -> None:
        """Writes the placement, validated, atomically; see the module docstring for the formats.

        ``format="moe_eplb_jax"``: JSON (``.json``) or numpy archive (``.npz``).
        ``format="sglang"``: SGLang's expert-location JSON (``.json`` only), for
        ``--init-expert-location``: ``num_hidden_layers`` rows (default ``L``),
        layer ``l``'s at row ``layer_ids[l]`` (default ``l``; the decoder
        block of MoE layer ``l``), the trivial map in the others.
        """
        if format not in FILE_FORMATS:
            raise ValueError(f"format must be one of {list(FILE_FORMATS)}, got {format!r}")
        if format != "sglang" and (layer_ids is not None or num_hidden_layers is not None):
            raise ValueError("layer_ids and num_hidden_layers place rows in an SGLang file: use format='sglang'")
        p = self.validate().to_numpy()
        if format == "sglang":
            path = check_output_path(path, what="SGLang placement", suffixes=(".json",))
            layer_ids, num_hidden_layers = check_layer_ids(layer_ids, p.num_layers, num_hidden_layers)
            rows = np.tile(np.arange(p.num_physical) % p.num_logical, (num_hidden_layers, 1))
            rows[layer_ids] = p.phy2log
            write_json(path, {"physical_to_logical_map": rows.tolist()}, what="SGLang placement")
            return
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
    def load(
        cls,
        path: str | os.PathLike,
        *,
        num_ranks: int | None = None,
        num_logical: int | None = None,
        layer_ids=None,
    ) -> Placement:
        """Reads a placement file of either format (detected from its fields); validated like any placement.

        ``num_logical`` checks ``E`` against the file; an SGLang file does not
        store ``E`` (its model config does), so without ``num_logical`` it is
        taken as the largest expert id of the MoE rows + 1. ``layer_ids``: the
        decoder blocks of the MoE layers, the rows an SGLang file of every
        block holds them in (a file of just those rows is read whole). Every
        malformed file raises ``ValueError`` naming the file and the field.
        """
        path = os.fspath(path)
        if num_logical is not None:
            num_logical = check_int("num_logical", num_logical, minimum=1)
        if num_ranks is not None:
            num_ranks = check_int("num_ranks", num_ranks, minimum=1)
        doc = read_fields(path, what="placement")
        if "format" not in doc and "physical_to_logical_map" in doc:
            return cls._from_sglang(doc, path, num_ranks, num_logical, layer_ids)
        if "format" not in doc and "logical_count" in doc:
            raise ValueError(
                f"{path}: an SGLang load file (field 'logical_count'), not a placement; "
                f"fit a placement to it with `moe-eplb fit`"
            )
        check_document(doc, path, file_format=FILE_FORMAT, version=FILE_VERSION, fields=_FIELDS)
        return cls._from_document(doc, path, num_ranks, num_logical)

    @classmethod
    def _from_sglang(cls, doc: dict, path: str, num_ranks, num_logical, layer_ids) -> Placement:
        unknown = sorted(set(doc) - {"physical_to_logical_map"})
        if unknown:  # SGLang passes the object's fields as keyword arguments: any other field breaks it
            raise ValueError(f"{path}: unknown field(s) {unknown} in an SGLang placement file")
        table = array_field(doc, "physical_to_logical_map", path, kind="integer")
        if table.ndim != 2 or 0 in table.shape:
            raise ValueError(f"{path}: field 'physical_to_logical_map' must have shape [L, P], got {table.shape}")
        try:
            if layer_ids is not None and np.size(layer_ids) != table.shape[0]:  # a row per block: the MoE blocks'
                layer_ids, _ = check_layer_ids(layer_ids, np.size(layer_ids), table.shape[0])
                table = table[layer_ids]
            table = _as_int_table("physical_to_logical_map", table)
            num_logical = int(table.max()) + 1 if num_logical is None else num_logical
            return cls.from_phy2log(table, max(num_logical, 1), num_ranks=num_ranks)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    @classmethod
    def _from_document(cls, doc: dict, path: str, num_ranks: int | None, num_logical: int | None) -> Placement:
        sizes = {name: int_field(doc, name, path, minimum=1) for name in ("num_layers", "num_logical", "num_physical")}
        if num_logical is not None and num_logical != sizes["num_logical"]:
            raise ValueError(f"{path}: field 'num_logical' is {sizes['num_logical']}, expected {num_logical}")
        shape = (sizes["num_layers"], sizes["num_physical"])
        phy2log = array_field(doc, "phy2log", path, kind="integer")
        if phy2log.shape != shape:
            raise ValueError(f"{path}: field 'phy2log' has shape {phy2log.shape}, header says {shape}")
        if ("log2phy" in doc) != ("logcnt" in doc):
            missing = "logcnt" if "log2phy" in doc else "log2phy"
            raise ValueError(f"{path}: missing field {missing!r} (log2phy and logcnt come together or not at all)")
        try:
            if "log2phy" not in doc:
                return cls.from_phy2log(phy2log, sizes["num_logical"], num_ranks=num_ranks)
            log2phy = array_field(doc, "log2phy", path, kind="integer")
            logcnt = array_field(doc, "logcnt", path, kind="integer")
            if logcnt.ndim != 2 or logcnt.shape[1] != sizes["num_logical"]:
                raise ValueError(f"field 'logcnt' has shape {logcnt.shape}, header says E = {sizes['num_logical']}")
            return cls.from_tables(phy2log, log2phy, logcnt, num_ranks=num_ranks)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def check_placement_size(num_layers, num_logical, num_physical, *, physical_name: str = "num_physical"):
    """``(L, E, P)`` as ints if a placement of that size can exist on this host, else ``ValueError``.

    Ids and counts are int32 (each size at most ``2**31 - 1``), ``P >= E``,
    and the three tables (``log2phy [L, E, P - E + 1]`` the largest) must fit
    the host's memory: a size check here, not an allocator's error later.
    """
    num_layers = check_int("num_layers", num_layers, minimum=1, maximum=INT32_MAX)
    num_logical = check_int("num_logical", num_logical, minimum=1, maximum=INT32_MAX)
    num_physical = check_int(physical_name, num_physical, minimum=1, maximum=INT32_MAX)
    if num_physical < num_logical:
        raise ValueError(f"fewer physical slots ({num_physical}) than logical experts ({num_logical})")
    entries = num_layers * (num_physical + num_logical * (num_physical - num_logical + 2))
    check_fits(
        f"a placement of L={num_layers} layers, E={num_logical} experts and P={num_physical} slots (int32 tables "
        f"phy2log [L, P], log2phy [L, E, P - E + 1], logcnt [L, E])",
        4 * entries,
        host_memory_bytes(),
        where="this host",
        hint="fewer redundant slots or experts",
    )
    return num_layers, num_logical, num_physical


def check_layer_ids(layer_ids, num_layers: int, num_hidden_layers: int | None = None) -> tuple[np.ndarray, int]:
    """``(layer_ids, num_hidden_layers)`` checked: the decoder block of each of ``num_layers`` MoE layers.

    ``layer_ids`` (default ``0 .. L - 1``) increase strictly within ``[0,
    num_hidden_layers)``; ``num_hidden_layers`` defaults to the last id + 1.
    """
    if layer_ids is None:
        layer_ids = np.arange(num_layers)
    try:
        ids = np.asarray(layer_ids)
    except (ValueError, TypeError, OverflowError) as e:
        raise ValueError(f"layer_ids must be a list of block indices ({e})") from None
    if ids.ndim != 1 or ids.dtype.kind not in "iu" or len(ids) != num_layers:
        raise ValueError(f"layer_ids must be {num_layers} block indices (one per MoE layer), got {layer_ids!r}")
    if num_hidden_layers is None:
        num_hidden_layers = int(ids.max()) + 1
    num_hidden_layers = check_int("num_hidden_layers", num_hidden_layers, minimum=1, maximum=INT32_MAX)
    if ids.min() < 0 or ids.max() >= num_hidden_layers or np.any(np.diff(ids) <= 0):
        raise ValueError(
            f"layer_ids must increase strictly within [0, num_hidden_layers={num_hidden_layers}), got {ids.tolist()}"
        )
    return ids.astype(np.int64), num_hidden_layers


def _check_sizes(num_layers, num_logical, num_physical, num_ranks) -> tuple[int, int, int]:
    num_layers, num_logical, num_physical = check_placement_size(num_layers, num_logical, num_physical)
    if num_ranks is not None:
        num_ranks = check_int("num_ranks", num_ranks, minimum=1)
        if num_physical % num_ranks:
            raise ValueError(f"{num_physical} physical slots are not divisible by {num_ranks} ranks")
    return num_layers, num_logical, num_physical


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

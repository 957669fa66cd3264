"""Relabelling a new placement so that as few experts as possible move from their old slot.

A policy decides *what* each GPU holds; which node is called node 0, which GPU
of a node is its first, and the order of slots inside a GPU do not change any
load. :func:`preserve_slots` uses that freedom, given the old ``phy2log``:

1. nodes are permuted so each new node lands where the old node that held most
   of the same experts was (greedy matching on multiset overlap);
2. within every node, GPUs are permuted the same way;
3. within every GPU, a slot whose old expert is still assigned to that GPU
   keeps it (a multiset match: the ``k``-th old copy of an expert on a GPU is
   kept when the GPU now holds at least ``k`` copies); the other experts fill
   the remaining slots in ascending slot order, in the order the policy listed
   them.

Ties prefer the identity, so an unchanged placement is returned unchanged. The
replica ranks travel with their slot, so ``log2phy`` stays consistent.
"""

from __future__ import annotations

import numpy as np

from moe_eplb_jax._checks import check_int
from moe_eplb_jax.policy._packing import gather_rows

__all__ = ["preserve_slots", "moved_slots"]


def _occurrence(ids: np.ndarray) -> np.ndarray:
    """``occ[m, b]``: how many earlier entries of row ``m`` of non-negative ``ids [M, B]`` equal ``ids[m, b]``."""
    num_rows, width = ids.shape
    # One flat sort by (row, id): equal ids of a row become one run, in slot order (stable). The keys
    # ascend with the row, and merge sort is fast on such presorted runs.
    keys = (ids + np.arange(num_rows, dtype=np.int64)[:, None] * (int(ids.max()) + 1)).ravel()
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    position = np.arange(keys.size)
    run_start = np.zeros(keys.size, dtype=np.int64)
    run_start[1:] = np.where(sorted_keys[1:] != sorted_keys[:-1], position[1:], 0)
    np.maximum.accumulate(run_start, out=run_start)
    occurrence = np.empty(keys.size, dtype=np.int64)
    occurrence[order] = position - run_start
    return occurrence.reshape(num_rows, width)


def _row_keys(ids: np.ndarray, num_logical: int, *, row_offset: bool = True) -> np.ndarray:
    """``(row, expert, occurrence)`` packed into one int64 per entry of ``ids [M, B]``.

    Keys are unique within a row; with ``row_offset`` they are unique across
    rows too and sort row-major.
    """
    num_rows, width = ids.shape
    keys = ids.astype(np.int64) * width + _occurrence(ids)
    if row_offset:
        keys += np.arange(num_rows, dtype=np.int64)[:, None] * (num_logical * width)
    return keys


def _block_overlap(new: np.ndarray, old: np.ndarray, num_logical: int) -> np.ndarray:
    """``overlap[r, i, j]``: size of the multiset intersection of new block ``i`` and old block ``j``.

    ``new`` and ``old`` are ``[R, K, B]``: ``R`` independent rows of ``K``
    blocks of ``B`` expert ids.
    """
    num_rows, num_blocks, width = new.shape
    # Key (expert, occurrence within the block), offset by row: an equal key in new block i and old
    # block j of the same row is one common copy, and counting them gives the multiset intersection.
    row_offset = (np.arange(num_rows, dtype=np.int64) * (num_logical * width))[:, None, None]
    new_keys = _row_keys(new.reshape(-1, width), num_logical, row_offset=False).reshape(new.shape)
    old_keys = _row_keys(old.reshape(-1, width), num_logical, row_offset=False).reshape(old.shape)
    new_keys = (new_keys + row_offset).ravel()
    old_keys = (old_keys + row_offset).ravel()
    # Keys ascend with the row, so the input is made of sorted-ish runs: a stable (merge) sort is
    # about ten times faster here than the default one.
    old_order = np.argsort(old_keys, kind="stable")
    old_sorted = old_keys[old_order]
    lo = np.searchsorted(old_sorted, new_keys, side="left")
    hi = np.searchsorted(old_sorted, new_keys, side="right")
    lengths = hi - lo
    # Expand every (new item, old item with the same key) pair.
    new_item = np.repeat(np.arange(new_keys.size), lengths)
    first = np.cumsum(lengths) - lengths
    old_item = old_order[lo[new_item] + np.arange(new_item.size) - first[new_item]]
    per_row = num_blocks * width
    row = new_item // per_row
    cell = (row * num_blocks + (new_item % per_row) // width) * num_blocks + (old_item % per_row) // width
    return np.bincount(cell, minlength=num_rows * num_blocks * num_blocks).reshape(num_rows, num_blocks, num_blocks)


def _match_blocks(overlap: np.ndarray) -> np.ndarray:
    """Greedy assignment ``perm [R, K]``: position ``j`` takes new block ``perm[r, j]``.

    New blocks are taken in order of their best overlap (largest first); each
    takes the free old position it overlaps most, its own index on a tie, then
    the lowest index.
    """
    num_rows, num_blocks, _ = overlap.shape
    rows = np.arange(num_rows)
    order = np.argsort(-overlap.max(axis=2), axis=1, kind="stable")
    taken = np.zeros((num_rows, num_blocks), dtype=bool)
    perm = np.empty((num_rows, num_blocks), dtype=np.int64)
    identity = np.arange(num_blocks)
    for t in range(num_blocks):
        block = order[:, t]
        score = overlap[rows, block] * 2 + (identity == block[:, None])
        score[taken] = -1
        position = score.argmax(axis=1)
        perm[rows, position] = block
        taken[rows, position] = True
    return perm


def _relabel_blocks(tables, old: np.ndarray, num_blocks: int, num_logical: int):
    """Permutes the ``num_blocks`` equal blocks of each row of every ``[M, W]`` table to match ``old``."""
    new = tables[0]
    num_rows, row_width = new.shape
    shape = (num_rows, num_blocks, row_width // num_blocks)
    perm = _match_blocks(_block_overlap(new.reshape(shape), old.reshape(shape), num_logical))
    slot = (perm[:, :, None] * shape[2] + np.arange(shape[2])).reshape(num_rows, row_width)
    return [gather_rows(t, slot) for t in tables]


def _keep_slots(new: np.ndarray, rank: np.ndarray, old: np.ndarray, num_logical: int):
    """Within each row of ``[M, B]`` tables, keeps old experts in their slot (see the module docstring)."""
    new_keys = _row_keys(new, num_logical).ravel()
    old_keys = _row_keys(old, num_logical).ravel()
    old_order = np.argsort(old_keys, kind="stable")  # row-major runs: merge sort is fastest
    old_sorted = old_keys[old_order]
    found = np.minimum(np.searchsorted(old_sorted, new_keys), old_sorted.size - 1)
    matched = old_sorted[found] == new_keys
    dest = np.empty(new_keys.size, dtype=np.int64)
    dest[matched] = old_order[found[matched]]
    kept = np.zeros(new_keys.size, dtype=bool)
    kept[dest[matched]] = True
    # Per row, unmatched new items and free slots are equally many; both lists are row-major, so
    # pairing them in order never crosses rows.
    dest[~matched] = np.flatnonzero(~kept)
    out, out_rank = np.empty_like(new).ravel(), np.empty_like(rank).ravel()
    out[dest] = new.ravel()
    out_rank[dest] = rank.ravel()
    return out.reshape(new.shape), out_rank.reshape(rank.shape)


def preserve_slots(
    phy2log: np.ndarray, phyrank: np.ndarray, old_phy2log: np.ndarray, *, num_gpus: int, num_nodes: int = 1
):
    """Relabels ``(phy2log, phyrank) [L, P]`` to keep experts of ``old_phy2log [L, P]`` in place.

    Nodes (``num_nodes`` blocks of ``P / num_nodes`` slots) and GPUs within a
    node are permuted, then slots within each GPU are reordered; the multiset
    of experts on every GPU of every node is unchanged, so are all loads.
    ``old_phy2log`` may come from any policy (ids must be in ``[0, E)``, where
    ``E`` bounds the ids of ``phy2log``, or ``-1`` for a slot that holds
    nothing: a placement carried to another EP size keeps nothing there).
    """
    num_gpus = check_int("num_gpus", num_gpus, minimum=1)
    num_nodes = check_int("num_nodes", num_nodes, minimum=1)
    phy2log, phyrank, old_phy2log = (np.asarray(t) for t in (phy2log, phyrank, old_phy2log))
    for name, table in (("phyrank", phyrank), ("old_phy2log", old_phy2log)):
        if table.shape != phy2log.shape or phy2log.ndim != 2:
            raise ValueError(f"phy2log and {name} must both have shape [L, P], got {phy2log.shape} and {table.shape}")
    for name, table in (("phy2log", phy2log), ("phyrank", phyrank), ("old_phy2log", old_phy2log)):
        lowest = -1 if name == "old_phy2log" else 0
        if table.dtype.kind not in "iu" or (table.size and table.min() < lowest):
            raise ValueError(f"{name} must hold non-negative integers" + (" (or -1: an empty slot)" if lowest else ""))
        if table.size and table.max() > np.iinfo(np.int32).max:
            raise ValueError(f"{name} holds {table.max()}, beyond the int32 range of expert ids and replica ranks")
    num_layers, num_physical = phy2log.shape
    if num_physical % num_gpus or num_gpus % num_nodes:
        raise ValueError(
            f"{num_physical} slots on num_gpus={num_gpus} GPUs in num_nodes={num_nodes} nodes: "
            "slots must divide over GPUs and GPUs over nodes"
        )
    phy2log, phyrank, old_phy2log = (t.astype(np.int64) for t in (phy2log, phyrank, old_phy2log))
    # An empty old slot (-1) becomes an id no new slot holds: it matches nothing, so its slot is free.
    empty = int(max(phy2log.max(), old_phy2log.max())) + 1
    old_phy2log = np.where(old_phy2log < 0, empty, old_phy2log)
    num_logical = empty + 1
    gpus_per_node = num_gpus // num_nodes
    slots_per_gpu = num_physical // num_gpus
    tables = [phy2log, phyrank]
    if num_nodes > 1:
        tables = _relabel_blocks(tables, old_phy2log, num_nodes, num_logical)
    if gpus_per_node > 1:
        per_node = [t.reshape(num_layers * num_nodes, -1) for t in tables]
        per_node = _relabel_blocks(
            per_node, old_phy2log.reshape(num_layers * num_nodes, -1), gpus_per_node, num_logical
        )
        tables = [t.reshape(num_layers, num_physical) for t in per_node]
    per_gpu = [t.reshape(-1, slots_per_gpu) for t in tables]
    new, rank = _keep_slots(per_gpu[0], per_gpu[1], old_phy2log.reshape(-1, slots_per_gpu), num_logical)
    return new.reshape(num_layers, num_physical), rank.reshape(num_layers, num_physical)


def moved_slots(old_phy2log, new_phy2log) -> int:
    """Number of slots whose expert changes between two ``[L, P]`` placements (the experts to copy)."""
    old, new = np.asarray(old_phy2log), np.asarray(new_phy2log)
    if old.shape != new.shape:
        raise ValueError(f"placements of different shapes: old {old.shape}, new {new.shape}")
    return int(np.count_nonzero(old != new))

"""Vectorised greedy steps of the DeepSeek algorithm, on many independent rows at once.

Each function works on ``[X, n]`` arrays whose ``X`` rows (layers, or layers x
nodes) are independent problems. The greedy steps are sequential over items,
so each keeps one Python loop over the item index, and every iteration is a
few numpy operations on all rows. Results equal the one-row loops of
:mod:`moe_eplb_jax.policy.deepseek_reference` exactly (float64, stable order,
lowest index wins a tie).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "balanced_packing",
    "balanced_packing_sorted",
    "descending_order",
    "gather_rows",
    "inverse_permutation",
    "replicate",
    "scatter_rows",
]


def inverse_permutation(perm: np.ndarray) -> np.ndarray:
    """Row-wise inverse of permutations ``perm [X, n]``: ``inv[x, perm[x, i]] = i``."""
    return scatter_rows(np.broadcast_to(np.arange(perm.shape[1], dtype=perm.dtype), perm.shape), perm)


def descending_order(weight: np.ndarray) -> np.ndarray:
    """Row-wise stable descending argsort of non-negative float64 ``weight [X, n]`` (ties: lower index first)."""
    # Non-negative float64 bit patterns order like the values (and +0.0 is the only zero after the
    # ``+ 0.0``), and a stable integer sort is about twice as fast as a stable float sort.
    bits = (weight + 0.0).view(np.int64)
    return np.argsort(-bits, axis=1, kind="stable")


def balanced_packing_sorted(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`balanced_packing` in item-sorted form: ``(order, pack, rank)``, each ``[X, n]`` int64.

    ``order[x, k]`` is the ``k``-th heaviest item of row ``x``; ``pack[x, k]``
    and ``rank[x, k]`` are where that item goes. Callers that only need to
    scatter items into packs skip the inverse permutation this way.
    """
    num_rows, num_items = weight.shape
    per_pack = num_items // num_packs
    if per_pack == 1:
        items = np.broadcast_to(np.arange(num_items, dtype=np.int64), weight.shape).copy()
        return items, items.copy(), np.zeros_like(items)
    order = descending_order(weight)
    if num_packs == 1:  # everything in the one pack, in the order it arrives
        return order, np.zeros_like(order), np.broadcast_to(np.arange(num_items, dtype=np.int64), order.shape).copy()
    # Item-major copy so each step reads one contiguous row.
    sorted_weight = gather_rows(weight, order).T.copy()
    # Flat state: pack q of row x is element x * num_packs + q. Adding +inf with a pack's last item
    # makes argmin skip full packs (adding 0.0 otherwise leaves the load bit-identical); real loads
    # stay finite because callers check that each row's total is finite.
    fill_penalty = np.zeros(per_pack)
    fill_penalty[-1] = np.inf
    load = np.zeros(num_rows * num_packs)
    count = np.zeros(num_rows * num_packs, dtype=np.int64)
    load_2d = load.reshape(num_rows, num_packs)
    row_base = np.arange(num_rows, dtype=np.int64) * num_packs
    pack_sorted = np.empty((num_items, num_rows), dtype=np.int64)
    rank_sorted = np.empty((num_items, num_rows), dtype=np.int64)
    start = 0
    if (sorted_weight[num_packs - 2] > 0).all():
        # While empty packs remain, the least-loaded one is the first empty pack, because every
        # earlier item was positive: item k < num_packs goes to pack k (no pack can be full yet).
        load_2d[:] = sorted_weight[:num_packs].T
        count[:] = 1
        pack_sorted[:num_packs] = np.arange(num_packs)[:, None]
        rank_sorted[:num_packs] = 0
        start = num_packs
    for k in range(start, num_items):
        pack = load_2d.argmin(axis=1)
        flat = row_base + pack
        filled = count[flat]
        count[flat] = filled + 1
        load[flat] = load[flat] + sorted_weight[k] + fill_penalty[filled]
        pack_sorted[k] = pack
        rank_sorted[k] = filled
    return order, pack_sorted.T, rank_sorted.T


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Packs the ``n`` items of each row into ``num_packs`` packs of ``n / num_packs`` items each.

    ``weight`` is ``[X, n]``, non-negative float64 with a finite sum per row.
    Items go heaviest first (stable), each to the least-loaded pack that still
    has room (lowest pack index on a tie). Returns ``pack [X, n]`` and
    ``rank_in_pack [X, n]`` (the order in which items entered their pack),
    both int64. With one item per pack, item ``i`` goes to pack ``i``.
    """
    order, pack_sorted, rank_sorted = balanced_packing_sorted(weight, num_packs)
    return scatter_rows(pack_sorted, order), scatter_rows(rank_sorted, order)


def scatter_rows(values: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``out[x, index[x, i]] = values[x, i]`` for a row-wise permutation ``index [X, n]``."""
    num_rows, num_items = index.shape
    out = np.empty(num_rows * num_items, dtype=values.dtype)
    out[(index + (np.arange(num_rows) * num_items)[:, None]).ravel()] = values.ravel()
    return out.reshape(num_rows, num_items)


def gather_rows(values: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``out[x, i] = values[x, index[x, i]]`` for ``values [X, n]`` and ``index [X, k]``."""
    num_rows, num_items = values.shape
    return values.ravel()[index + (np.arange(num_rows) * num_items)[:, None]]


def replicate(weight: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gives ``num_slots`` slots to the ``n`` experts of each row, greedily by load per replica.

    ``weight`` is ``[X, n]`` float64, ``num_slots >= n``. Slot ``i < n`` holds
    expert ``i``; every further slot goes to the expert with the largest
    ``weight / count`` (lowest index on a tie). Returns ``slot_expert
    [X, num_slots]``, ``slot_rank [X, num_slots]`` (0 for the first replica of
    an expert, 1 for the second, ...) and ``count [X, n]``, all int64.
    """
    num_rows, num_experts = weight.shape
    rows = np.arange(num_rows)
    slot_expert = np.empty((num_rows, num_slots), dtype=np.int64)
    slot_expert[:, :num_experts] = np.arange(num_experts)
    slot_rank = np.zeros((num_rows, num_slots), dtype=np.int64)
    count = np.ones((num_rows, num_experts), dtype=np.int64)
    per_replica = weight.copy()  # weight / count, updated one entry per row per step
    for slot in range(num_experts, num_slots):
        best = per_replica.argmax(axis=1)
        cnt = count[rows, best]
        slot_expert[:, slot] = best
        slot_rank[:, slot] = cnt
        count[rows, best] = cnt + 1
        per_replica[rows, best] = weight[rows, best] / (cnt + 1)
    return slot_expert, slot_rank, count

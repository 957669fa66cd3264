"""Vectorised greedy steps of the DeepSeek algorithm, on many independent rows at once.

Each function works on ``[X, n]`` arrays whose ``X`` rows (layers, or layers x
nodes) are independent problems. Results equal the one-row loops of
:mod:`moe_eplb_jax.policy.deepseek_reference` exactly (float64, stable order,
lowest index wins a tie).

The greedy steps are sequential over items, and the time goes to numpy call
overhead, so the packing takes shortcuts that it checks, and redoes exactly
whatever a check rejects:

* sorting: one int64 key per entry (value bits with the index in the low bits)
  and a plain sort; values that differ only in those low bits fall back to a
  stable argsort;
* packing: in DeepSeek's replica packing nearly every round of ``num_packs``
  items gives each pack one item, in ascending order of load, so a whole round
  costs one small sort (and the last round is forced by the capacity); the
  few rows where a round is not such a permutation finish in plain Python, or,
  when there are many, redo it item by item and go through a capacity check
  (see :func:`packing_slots`).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "balanced_packing",
    "descending_order",
    "gather_rows",
    "inverse_permutation",
    "packing_slots",
    "replicate",
    "scatter_rows",
    "sort_descending",
]

_INT64_MAX = np.iinfo(np.int64).max
# Rows that leave the round-by-round packing finish in plain Python when that takes at most this
# many (item, pack) visits: a few rows cost less that way than numpy steps, whose cost does not
# shrink with the number of rows (a visit costs hundreds of times less than a numpy round).
_PLAIN_PYTHON_VISITS = 2048


def inverse_permutation(perm: np.ndarray) -> np.ndarray:
    """Row-wise inverse of permutations ``perm [X, n]``: ``inv[x, perm[x, i]] = i``."""
    return scatter_rows(np.broadcast_to(np.arange(perm.shape[1], dtype=perm.dtype), perm.shape), perm)


def scatter_rows(values: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``out[x, index[x, i]] = values[x, i]`` for a row-wise permutation ``index [X, n]``."""
    num_rows, num_items = index.shape
    out = np.empty(num_rows * num_items, dtype=values.dtype)
    out[(index + (np.arange(num_rows) * num_items)[:, None]).ravel()] = values.ravel()
    return out.reshape(num_rows, num_items)


def gather_rows(values: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``out[x, i] = values[x, index[x, i]]`` for ``values [X, n]`` and ``index [X, k]``."""
    num_rows, num_items = values.shape
    return values.take(index + (np.arange(num_rows) * num_items)[:, None])


def sort_descending(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise stable descending sort of non-negative float64 ``weight [X, n]``.

    Returns ``(order, sorted_weight)``, both ``[X, n]``: ``order[x, k]`` is
    the index of the ``k``-th largest entry of row ``x`` (ties: lower index
    first) and ``sorted_weight[x, k]`` its value.
    """
    num_rows, num_items = weight.shape
    # Non-negative float64 bit patterns order like the values (and +0.0 is the only zero after the
    # ``+ 0.0``). One int64 key per entry holds the descending value's high bits and the index in
    # the low bits, so a plain (unstable, SIMD) value sort of the keys yields the stable order,
    # unless two different values share the kept high bits; the check below catches that case.
    bits = np.ascontiguousarray(weight + 0.0).view(np.int64)
    shift = max(1, (num_items - 1).bit_length())
    key = ((_INT64_MAX - bits) >> shift << shift) | np.arange(num_items, dtype=np.int64)
    key.sort(axis=1)
    order = key & ((1 << shift) - 1)
    sorted_weight = gather_rows(weight, order)
    if num_items > 1 and not (sorted_weight[:, 1:] <= sorted_weight[:, :-1]).all():
        order = np.argsort(-bits, axis=1, kind="stable")
        sorted_weight = gather_rows(weight, order)
    return order, sorted_weight


def descending_order(weight: np.ndarray) -> np.ndarray:
    """Row-wise stable descending argsort of non-negative float64 ``weight [X, n]`` (ties: lower index first)."""
    return sort_descending(weight)[0]


def _greedy_packs_by_rounds(items: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray, list]:
    """Greedy packing of ``items [X, n]`` (each row heaviest first) into packs of ``n / num_packs`` items.

    Works a round of ``num_packs`` items at a time: when every pack takes one
    item of the round, the greedy choices are the packs in ascending order of
    load (ties: lower index), which one sort finds. A row whose rounds all are
    such permutations never fills a pack before the last round, and in the
    last round the capacity forces the permutation: its packing is exact.
    Rows where a round is not a permutation (or could tie) leave the rounds:
    a few finish exactly in plain Python; otherwise they become irregular and
    redo that round, and later ones as needed, item by item, ignoring pack
    capacity. Returns ``pack [X, n]`` int64 (item ``k`` of a regular row is
    the ``k // num_packs``-th of its pack), the irregular rows (whose packing
    is capacity-blind and needs :func:`_slots_with_capacity`) and, for the
    rows finished in Python, ``(row, k, slots of items k, k + 1, ...)``.
    """
    num_rows, num_items = items.shape
    load = np.zeros((num_rows, num_packs))
    flat_load = load.reshape(-1)
    load_bits = load.view(np.int64)
    row_base = (np.arange(num_rows) * num_packs)[:, None]
    rounds = []  # pack of each item, round by round
    irregular = np.zeros(num_rows, dtype=bool)
    finished = np.zeros(num_rows, dtype=bool)
    exact = []  # (row, first item, slots of items first...) of rows finished in plain Python
    # Sort key: the load's bits (finite non-negative loads order like them) with the low bits replaced
    # by the pack index, so an unstable sort orders equal loads by index; loads that differ only in
    # the replaced bits may come out of order, which the check below catches.
    index_bits = max(1, (num_packs - 1).bit_length())
    high_bits = ~np.int64((1 << index_bits) - 1)
    pack_index = np.arange(num_packs)
    first = 0
    if (items[:, num_packs - 2] > 0).all():
        # From empty packs, the first round goes to packs 0, 1, ... when every earlier item is positive.
        load[:] = items[:, :num_packs]
        rounds.append(np.broadcast_to(pack_index, (num_rows, num_packs)))
        first = num_packs
    while first < num_items:
        size = min(num_packs, num_items - first)
        key = (load_bits & high_bits) | pack_index
        key.sort(axis=1)
        order = key & ((1 << index_bits) - 1)
        flat = order + row_base
        start_load = flat_load.take(flat)  # ascending, if the key sort was exact
        new_load = start_load[:, :size] + items[:, first : first + size]
        ascending = start_load[:, 1:] >= start_load[:, :-1]
        if first + size == num_items and size == num_packs:
            # Last round: a regular row has one free slot per pack, so the sorted order is forced;
            # irregular rows go on item by item.
            redo = irregular.copy() if irregular.any() else None
            if not ascending.all():
                redo = (~ascending.all(axis=1) | irregular) & ~finished
        else:
            # Item j of the round goes to the j-th least-loaded pack iff that pack is still strictly
            # below every pack served before it this round (strict: a tie would need the index rule).
            # Loads ascend, so it suffices that every new load tops the last pack's old load (asking
            # it of the last pack too only sends rounds with a zero item to the slow path).
            served_above = new_load > start_load[:, size - 1 : size]
            redo = None
            if not (ascending.all() and served_above.all()):
                redo = ~(ascending.all(axis=1) & served_above.all(axis=1)) & ~finished
                newly = np.flatnonzero(redo & ~irregular)
                if 0 < newly.size * (num_items - first) * num_packs <= _PLAIN_PYTHON_VISITS:
                    # A few rows: finish them exactly in plain Python, from this round's start
                    # (every pack holds first / num_packs items), and leave them out from now on.
                    for row in newly.tolist():
                        exact.append(
                            (
                                row,
                                first,
                                _finish_row_exact(
                                    items[row, first:].tolist(),
                                    load[row].tolist(),
                                    [first // num_packs] * num_packs,
                                    num_items // num_packs,
                                ),
                            )
                        )
                    finished[newly] = True
                    redo[newly] = False
                if not redo.any():
                    redo = None
        if redo is not None:
            irregular |= redo
            redo = np.flatnonzero(redo)
            redo_load = load[redo]
        flat_load[flat[:, :size]] = new_load
        order = order[:, :size]
        if redo is not None:
            order[redo] = _greedy_steps_unchecked(items[redo, first : first + size], redo_load)
            load[redo] = redo_load
        rounds.append(order)
        first += size
    return np.concatenate(rounds, axis=1), np.flatnonzero(irregular), exact


def _finish_row_exact(items: list, load: list, count: list, per_pack: int) -> list:
    """The exact greedy for one row, in plain Python (cheaper than numpy steps for a row or two).

    Places ``items`` (heaviest first) from pack ``load`` and ``count`` (lists,
    updated); returns each item's slot (``pack * per_pack`` + its rank).
    """
    slots = []
    for weight in items:
        best = -1
        for pack, filled in enumerate(count):
            if filled < per_pack and (best < 0 or load[pack] < load[best]):
                best = pack
        slots.append(best * per_pack + count[best])
        load[best] += weight
        count[best] += 1
    return slots


def _greedy_steps_unchecked(items: np.ndarray, load: np.ndarray) -> np.ndarray:
    """Capacity-blind greedy, one item at a time: packs ``[R, m]`` of ``items [R, m]``; ``load [R, packs]`` updated."""
    num_rows, num_items = items.shape
    flat_load = load.reshape(-1)
    load_bits = load.view(np.int64)
    row_base = np.arange(num_rows) * load.shape[1]
    pack = np.empty((num_items, num_rows), dtype=np.int64)
    for k in range(num_items):
        best = load_bits.argmin(axis=1)
        pack[k] = best
        best += row_base
        flat_load[best] += items[:, k]
    return pack.T


def _greedy_slots_exact(items: np.ndarray, load: np.ndarray, next_slot: np.ndarray, per_pack: int) -> np.ndarray:
    """Greedy packing with capacity, from pack ``load`` and ``next_slot`` (``[R, packs]``, updated in place).

    ``items [R, m]`` are the items still to place, each row heaviest first;
    ``next_slot[r, q]`` is the slot of row ``r`` that pack ``q`` fills next
    (``q * per_pack`` + its item count). Returns the slot of each item,
    ``[R, m]`` int64.
    """
    num_rows, num_items = items.shape
    num_packs = load.shape[1]
    items = items.T.copy()  # item-major: each step reads one contiguous row
    # Adding +inf with a pack's last item makes argmin skip full packs (adding 0.0 otherwise
    # leaves the load bit-identical); real loads stay finite because each row's total is finite.
    fill_penalty = np.zeros(num_packs * per_pack + 1)
    fill_penalty[per_pack - 1 :: per_pack] = np.inf
    load[next_slot >= (np.arange(num_packs) + 1) * per_pack] = np.inf
    flat_load, flat_next = load.reshape(-1), next_slot.reshape(-1)
    load_bits = load.view(np.int64)  # +inf orders above every finite load, also as bits
    row_base = np.arange(num_rows) * num_packs
    slot = np.empty((num_items, num_rows), dtype=np.int64)
    for k in range(num_items):
        best = load_bits.argmin(axis=1)
        best += row_base
        taken = flat_next[best]
        slot[k] = taken
        flat_next[best] = taken + 1
        flat_load[best] += items[k] + fill_penalty[taken]
    return slot.T


def _slots_with_capacity(items: np.ndarray, pack: np.ndarray, per_pack: int) -> np.ndarray:
    """Slot of each item, ``[R, n]``, given the capacity-blind packing ``pack [R, n]`` of ``items [R, n]``.

    Where no pack overflowed, the capacity-blind packing is the answer and an
    item's slot follows from its pack and arrival order. Otherwise the two
    runs agree up to the first item that went to a full pack, and the exact
    loop resumes there, from the pack loads and counts reached by then.
    """
    num_rows, num_items = pack.shape
    num_packs = num_items // per_pack
    slots = np.argsort(pack, axis=1, kind="stable")  # each pack's items in arrival order
    sorted_pack = gather_rows(pack, slots)
    # An item overflowed its pack when the item per_pack places before it (in pack order) is in the
    # same pack; the earliest such item over all rows is where the runs part.
    overflow = sorted_pack[:, per_pack:] == sorted_pack[:, :-per_pack]
    if not overflow.any():  # every pack got per_pack items: pack order is slot order
        return scatter_rows(np.broadcast_to(np.arange(num_items), pack.shape), slots)
    step = int(np.where(overflow, slots[:, per_pack:], num_items).min())
    # Before that item, each pack of a row holds the first `count` items of its run in pack order.
    key = sorted_pack + (np.arange(num_rows) * num_packs)[:, None]
    size = num_rows * num_packs
    total = np.bincount(key.ravel(), minlength=size).reshape(num_rows, num_packs)
    count = np.bincount(key[slots < step], minlength=size).reshape(num_rows, num_packs)
    run_start = np.cumsum(total, axis=1) - total
    rank = np.arange(num_items) - gather_rows(run_start, sorted_pack)
    slot = scatter_rows(sorted_pack * per_pack + rank, slots)  # right for the items before `step`
    first = run_start + (np.arange(num_rows) * num_items)[:, None]
    item_weight = gather_rows(items, slots).ravel()
    nth = np.arange(per_pack)[:, None, None]
    position = np.minimum(first + nth, item_weight.size - 1)  # [per_pack, R, packs]
    arrived = np.where(nth < count, item_weight.take(position), 0.0)
    # Item by item, as the loop added them (adding 0.0 for missing items changes no bit).
    load = np.add.accumulate(arrived, axis=0)[-1]
    next_slot = count + np.arange(num_packs) * per_pack
    slot[:, step:] = _greedy_slots_exact(items[:, step:], load, next_slot, per_pack)
    return slot


def packing_slots(weight: np.ndarray, num_packs: int) -> np.ndarray:
    """Balanced packing in slot form: ``slot_item [X, n]`` int64, the item that fills each slot.

    Pack ``q`` owns slots ``[q * n / num_packs, (q + 1) * n / num_packs)``,
    filled in the order its items arrive; items go as in
    :func:`balanced_packing`. ``weight`` is ``[X, n]``, non-negative float64
    with a finite sum per row.
    """
    num_rows, num_items = weight.shape
    per_pack = num_items // num_packs
    if per_pack == 1:  # one item per pack: keep the given order
        return np.broadcast_to(np.arange(num_items, dtype=np.int64), weight.shape).copy()
    order, items = sort_descending(weight)
    if num_packs == 1:  # everything in the one pack, in the order it arrives
        return order
    pack, irregular, exact = _greedy_packs_by_rounds(items, num_packs)
    # Where every round was a permutation of the packs, item k is the (k // num_packs)-th of its pack
    # and no pack can overflow.
    slot = pack * per_pack + np.arange(num_items) // num_packs
    if irregular.size:
        slot[irregular] = _slots_with_capacity(items[irregular], pack[irregular], per_pack)
    for row, first, row_slots in exact:
        slot[row, first:] = row_slots
    return scatter_rows(order, slot)


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Packs the ``n`` items of each row into ``num_packs`` packs of ``n / num_packs`` items each.

    ``weight`` is ``[X, n]``, non-negative float64 with a finite sum per row.
    Items go heaviest first (stable), each to the least-loaded pack that still
    has room (lowest pack index on a tie). Returns ``pack [X, n]`` and
    ``rank_in_pack [X, n]`` (the order in which items entered their pack),
    both int64. With one item per pack, item ``i`` goes to pack ``i``.
    """
    num_items = weight.shape[1]
    slot = np.broadcast_to(np.arange(num_items, dtype=np.int64), weight.shape)
    slot_of_item = scatter_rows(slot, packing_slots(weight, num_packs))
    per_pack = num_items // num_packs
    return slot_of_item // per_pack, slot_of_item % per_pack


def replicate(weight: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gives ``num_slots`` slots to the ``n`` experts of each row, greedily by load per replica.

    ``weight`` is ``[X, n]`` float64, ``num_slots >= n``. Slot ``i < n`` holds
    expert ``i``; every further slot goes to the expert with the largest
    ``weight / count`` (lowest index on a tie). Returns ``slot_expert
    [X, num_slots]``, ``slot_rank [X, num_slots]`` (0 for the first replica of
    an expert, 1 for the second, ...) and ``count [X, n]``, all int64.
    """
    num_rows, num_experts = weight.shape
    flat_weight = np.ascontiguousarray(weight).reshape(-1)
    per_replica = flat_weight.copy()  # weight / count, updated one entry per row per step
    per_replica_2d = per_replica.reshape(num_rows, num_experts)
    count = np.ones(num_rows * num_experts, dtype=np.int64)
    row_base = np.arange(num_rows) * num_experts
    slot_expert = np.empty((num_slots, num_rows), dtype=np.int64)  # slot-major: each step writes a row
    slot_expert[:num_experts] = np.arange(num_experts)[:, None]
    slot_rank = np.zeros((num_slots, num_rows), dtype=np.int64)
    for slot in range(num_experts, num_slots):
        best = per_replica_2d.argmax(axis=1)
        slot_expert[slot] = best
        best += row_base
        rank = count[best]
        slot_rank[slot] = rank
        rank += 1
        count[best] = rank
        per_replica[best] = flat_weight[best] / rank
    return slot_expert.T, slot_rank.T, count.reshape(num_rows, num_experts)

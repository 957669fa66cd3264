"""A placement for a new EP size that keeps the experts each device already holds.

When the EP group changes size (``G`` ranks to ``G'``, ``P`` slots to ``P'``)
slot ``p'`` of the new placement lives on the device of new rank ``p' //
(P' / G')``. A device that stays in the group keeps its old rank's experts for
free; everything else crosses the network. :func:`carry_phy2log` writes the
old placement in the new slot layout -- each staying device's experts in the
slots of its new rank, ``-1`` in slots that hold nothing (a new device, a
device with more slots than before, and every slot of a lost rank's experts)
-- and :func:`resize_placement` hands it to a policy as ``old_phy2log``, so
the policy's own slot-keeping (node, GPU and slot relabelling; ``balanced``'s
placement grown from the old one) keeps what it can. ``policy="fill"`` keeps
every carried slot and only fills the empty ones: the fewest bytes move.
"""

from __future__ import annotations

import numpy as np

from moe_eplb_jax._checks import check_int
from moe_eplb_jax.placement import Placement, check_expert_ids
from moe_eplb_jax.policy._registry import get
from moe_eplb_jax.policy.deepseek import check_weight

__all__ = ["FILL", "carry_phy2log", "fill_empty_slots", "rank_map", "resize_placement"]

FILL = "fill"  # the policy name that keeps every carried slot and fills only the empty ones


def rank_map(num_ranks: int, new_num_ranks: int, *, new_rank_of_old=None, lost_ranks=()) -> np.ndarray:
    """``[G]`` the new rank of each old rank's device (``-1``: it leaves the EP group), checked.

    By default the surviving old ranks become new ranks ``0, 1, ...`` in order
    (the first ``G'`` of them): with no lost rank, old rank ``r`` stays rank
    ``r`` when ``r < G'`` (``ep_mesh`` over the first devices). Lost ranks
    (``lost_ranks``: old rank ids whose device and bytes are gone) must map to
    ``-1``. ``ValueError`` for out-of-range or repeated ranks.
    """
    num_ranks = check_int("num_ranks", num_ranks, minimum=1)
    new_num_ranks = check_int("new_num_ranks", new_num_ranks, minimum=1)
    lost = _lost_set(lost_ranks, num_ranks)
    if new_rank_of_old is None:
        survivors = [r for r in range(num_ranks) if r not in lost]
        mapping = np.full(num_ranks, -1, dtype=np.int64)
        for new_rank, r in enumerate(survivors[:new_num_ranks]):
            mapping[r] = new_rank
        return mapping
    mapping = np.asarray(new_rank_of_old)
    if mapping.shape != (num_ranks,) or (mapping.size and mapping.dtype.kind not in "iu"):
        raise ValueError(f"new_rank_of_old must be {num_ranks} integers (one per old rank), got {mapping!r}")
    mapping = mapping.astype(np.int64)
    bad = (mapping < -1) | (mapping >= new_num_ranks)
    if bad.any():
        r = int(np.flatnonzero(bad)[0])
        raise ValueError(f"new_rank_of_old[{r}] = {mapping[r]} is not a new rank in [0, {new_num_ranks}) or -1")
    kept = mapping[mapping >= 0]
    if np.unique(kept).size != kept.size:
        raise ValueError(f"new_rank_of_old names a new rank twice: {mapping.tolist()}")
    for r in sorted(lost):
        if mapping[r] >= 0:
            raise ValueError(f"old rank {r} is lost but new_rank_of_old gives it new rank {mapping[r]}")
    return mapping


def _lost_set(lost_ranks, num_ranks: int) -> set[int]:
    try:
        ranks = [check_int("lost_ranks entry", r, minimum=0, maximum=num_ranks - 1) for r in lost_ranks]
    except TypeError:
        raise ValueError(f"lost_ranks must be a sequence of old rank ids, got {lost_ranks!r}") from None
    return set(ranks)


def _as_layers(name: str, table) -> np.ndarray:
    table = np.asarray(table)
    if table.ndim == 1:
        table = table[None]
    if table.ndim != 2 or table.shape[0] < 1 or table.shape[1] < 1:
        raise ValueError(f"{name} must have shape [L, P] or [P], got {np.shape(table)}")
    if table.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integer expert ids, got dtype {table.dtype}")
    return table.astype(np.int64)


def carry_phy2log(
    old_phy2log, num_ranks: int, new_num_ranks: int, new_num_physical: int, *, new_rank_of_old=None, lost_ranks=()
) -> np.ndarray:
    """The old placement ``[L, P]`` in the slot layout of ``G'`` ranks and ``P'`` slots: ``int64 [L, P']``.

    New rank ``r' = mapping[r]`` (see :func:`rank_map`) holds the experts of
    old rank ``r``, at their old position within the rank where it exists,
    ``-1`` where nothing is held. A rank with fewer slots than before keeps
    ``P' / G'`` of its experts: each distinct expert before a second copy, in
    slot order (the others are still on the device, and a placement that keeps
    them costs no transfer, but they are not carried).
    """
    old = _as_layers("old_phy2log", old_phy2log)
    num_layers, num_slots = old.shape
    num_ranks = check_int("num_ranks", num_ranks, minimum=1)
    new_num_ranks = check_int("new_num_ranks", new_num_ranks, minimum=1)
    new_num_physical = check_int("new_num_physical", new_num_physical, minimum=1)
    if num_slots % num_ranks:
        raise ValueError(f"{num_slots} old slots are not divisible by num_ranks {num_ranks}")
    if new_num_physical % new_num_ranks:
        raise ValueError(f"new_num_physical {new_num_physical} is not divisible by new_num_ranks {new_num_ranks}")
    if old.min() < 0:
        raise ValueError("old_phy2log must hold expert ids >= 0")
    mapping = rank_map(num_ranks, new_num_ranks, new_rank_of_old=new_rank_of_old, lost_ranks=lost_ranks)
    per_rank, new_per_rank = num_slots // num_ranks, new_num_physical // new_num_ranks
    carried = np.full((num_layers, new_num_physical), -1, dtype=np.int64)
    for r in np.flatnonzero(mapping >= 0).tolist():
        block = old[:, r * per_rank : (r + 1) * per_rank]
        out = carried[:, mapping[r] * new_per_rank : (mapping[r] + 1) * new_per_rank]  # a view
        if per_rank <= new_per_rank:
            out[:, :per_rank] = block
            continue
        for layer in range(num_layers):
            row = block[layer].tolist()
            first = [j for j in range(per_rank) if row[j] not in row[:j]]
            chosen = (first + [j for j in range(per_rank) if j not in first])[:new_per_rank]
            stay = [j for j in chosen if j < new_per_rank]  # these keep their position
            free = iter(j for j in range(new_per_rank) if j not in stay)
            for j in chosen:
                out[layer, j if j < new_per_rank else next(free)] = row[j]
    return carried


def fill_empty_slots(weight, carried, num_ranks: int) -> np.ndarray:
    """``carried [L, P']`` with every ``-1`` slot filled; carried slots stay as they are. ``int64 [L, P']``.

    Where the empty slots cannot hold every expert no slot holds, the extra
    replicas with the least load per replica are dropped first (their slots
    become empty). Experts no slot holds are placed first (heaviest first), then each free
    slot takes a replica of the expert with the most load per replica, as
    DeepSeek's replication does; a replica goes to the least-loaded rank with a
    free slot that does not already hold that expert (loads split evenly over
    replicas). ``weight [L, E]`` are the experts' loads.
    """
    weight = check_weight(weight)
    carried = _as_layers("carried", carried)
    num_layers, num_logical = weight.shape
    num_physical = carried.shape[1]
    if carried.shape[0] != num_layers:
        raise ValueError(f"carried has {carried.shape[0]} layers, weight has {num_layers}")
    check_expert_ids(np.where(carried == -1, 0, carried), num_logical, name="carried")
    num_ranks = check_int("num_ranks", num_ranks, minimum=1)
    if num_physical % num_ranks:
        raise ValueError(f"{num_physical} slots are not divisible by num_ranks {num_ranks}")
    if num_physical < num_logical:
        raise ValueError(f"{num_physical} slots cannot hold {num_logical} experts")
    per_rank = num_physical // num_ranks
    out = carried.copy()
    for layer in range(num_layers):
        row, w = out[layer], weight[layer]
        count = np.bincount(row[row >= 0], minlength=num_logical).astype(np.float64)
        while (row < 0).sum() < (count == 0).sum():  # room for every expert: drop the least loaded extra replica
            spare = np.where(count > 1, w / np.maximum(count, 1), np.inf)
            expert = int(np.argmin(spare))
            row[np.flatnonzero(row == expert)[-1]] = -1
            count[expert] -= 1
        missing = [int(e) for e in np.argsort(-w, kind="stable") if count[e] == 0]
        while (row < 0).any():
            held = np.zeros((num_ranks, num_logical), dtype=bool)
            ranks = np.arange(num_physical) // per_rank
            held[ranks[row >= 0], row[row >= 0]] = True
            free = np.bincount(ranks[row < 0], minlength=num_ranks) > 0
            if missing:
                expert = missing.pop(0)
            else:  # the expert with the most load per replica that some rank with a free slot lacks
                score = np.where((free[:, None] & ~held).any(axis=0), w / np.maximum(count, 1), -np.inf)
                expert = int(np.argmax(score)) if np.isfinite(score).any() else int(np.argmax(w / count))
            per_replica = np.where(row >= 0, w[np.maximum(row, 0)] / np.maximum(count[np.maximum(row, 0)], 1), 0.0)
            load = np.bincount(ranks, weights=per_replica, minlength=num_ranks)
            candidates = free & ~held[:, expert]
            candidates = candidates if candidates.any() else free
            rank = int(np.flatnonzero(candidates)[np.argmin(load[candidates])])
            slot = rank * per_rank + int(np.flatnonzero(row[rank * per_rank : (rank + 1) * per_rank] < 0)[0])
            row[slot] = expert
            count[expert] += 1
    return out


def resize_placement(
    weight,
    old_phy2log,
    *,
    num_ranks: int,
    new_num_ranks: int,
    new_num_physical: int | None = None,
    policy: str = "balanced",
    num_groups: int = 1,
    num_nodes: int = 1,
    new_rank_of_old=None,
    lost_ranks=(),
) -> Placement:
    """A placement of ``new_num_physical`` slots on ``new_num_ranks`` ranks for loads ``weight [L, E]``.

    ``old_phy2log [L, P]`` is the placement on ``num_ranks`` ranks now;
    ``new_rank_of_old`` / ``lost_ranks`` say which device becomes which new
    rank (:func:`rank_map`). ``policy`` is a registered policy's name, called
    with the old placement carried to the new size as ``old_phy2log``
    (:func:`carry_phy2log`; ``num_groups`` / ``num_nodes`` as for any policy),
    or ``"fill"``: every carried slot stays, the empty ones are filled
    (:func:`fill_empty_slots`) -- the fewest bytes move, the balance is what
    the kept slots allow. ``new_num_physical`` defaults to the smallest
    multiple of ``new_num_ranks`` that is at least ``P`` (and ``E``).
    Returns a validated :class:`~moe_eplb_jax.placement.Placement` for
    ``new_num_ranks`` ranks.
    """
    weight = check_weight(weight)
    old = _as_layers("old_phy2log", old_phy2log)
    num_layers, num_logical = weight.shape
    if old.shape[0] != num_layers:
        raise ValueError(f"old_phy2log has {old.shape[0]} layers but weight has {num_layers}")
    check_expert_ids(old, num_logical, name="old_phy2log")
    new_num_ranks = check_int("new_num_ranks", new_num_ranks, minimum=1)
    if new_num_physical is None:
        least = max(old.shape[1], num_logical)
        new_num_physical = -(-least // new_num_ranks) * new_num_ranks
    new_num_physical = check_int("new_num_physical", new_num_physical, minimum=num_logical)
    carried = carry_phy2log(
        old, num_ranks, new_num_ranks, new_num_physical, new_rank_of_old=new_rank_of_old, lost_ranks=lost_ranks
    )
    if policy == FILL:
        return Placement.from_phy2log(
            fill_empty_slots(weight, carried, new_num_ranks), num_logical, num_ranks=new_num_ranks
        )
    tables = get(policy)(weight, new_num_physical, num_groups, num_nodes, new_num_ranks, old_phy2log=carried)
    return Placement.from_tables(*tables, num_ranks=new_num_ranks)

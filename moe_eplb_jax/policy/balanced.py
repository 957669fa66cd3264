"""The ``"balanced"`` policy: DeepSeek's placement, then swaps that lower the busiest GPU.

Steps 1 and 2 (groups onto nodes, replication within nodes) and the initial
GPU packing are DeepSeek's (:mod:`moe_eplb_jax.policy.deepseek`). Greedy
packing leaves some GPU noticeably busier than the rest; a local search then
repeatedly takes the busiest GPU of each node and swaps one of its replicas
with one replica of another GPU of the same node, choosing the swap that
lowers the larger of the two GPU loads the most. Every swap lowers the sum of
squared GPU loads, so the search ends; it stops when no swap helps. Slots per
GPU stay equal, replicas never leave their node, and no GPU's load grows above
the busiest GPU's: per layer the result is never less balanced than DeepSeek's.
"""

from __future__ import annotations

import numpy as np

from moe_eplb_jax.policy import _packing
from moe_eplb_jax.policy._preserve import preserve_slots
from moe_eplb_jax.policy._sticky import old_based_layout
from moe_eplb_jax.policy.deepseek import check_inputs, hierarchical_layout, log2phy_from_ranks, topology

__all__ = ["rebalance_balanced", "refine_packing"]

# A swap must lower the pair's larger load by more than this fraction of it; guards against
# float round-off turning a zero gain into an endless sequence of swaps.
_MIN_RELATIVE_GAIN = 1e-12


def refine_packing(
    item_load: np.ndarray, *, target: np.ndarray | None = None, max_swaps: int | None = None
) -> np.ndarray:
    """Local search over swaps; returns the new item order ``[X, K * S]`` for ``item_load [X, K, S]``.

    Each of the ``X`` rows is a packing of ``K`` packs of ``S`` items (item
    ``k * S + s`` in pack ``k``). The result lists, for each new position, the
    old position of the item now there. A row stops when no swap helps, or,
    with ``target [X]``, as soon as its busiest pack is no busier than the
    target (fewest swaps). ``max_swaps`` bounds the swaps per row (default
    ``4 * K * S``).
    """
    num_rows, num_packs, per_pack = item_load.shape
    order = np.broadcast_to(np.arange(num_packs * per_pack), (num_rows, num_packs * per_pack)).copy()
    if num_packs < 2:
        return order
    load = item_load.astype(np.float64, copy=True)
    active = np.arange(num_rows)
    if target is not None:
        active = np.flatnonzero(load.sum(axis=2).max(axis=1) > target)
    for _ in range(4 * num_packs * per_pack if max_swaps is None else max_swaps):
        if active.size == 0:
            break
        rows = np.arange(active.size)
        sub = load[active]  # [A, K, S]
        pack_load = sub.sum(axis=2)
        busiest = pack_load.argmax(axis=1)
        top = pack_load[rows, busiest]
        gap = top[:, None] - pack_load  # [A, K], 0 for the busiest pack itself
        # delta[a, k, s, t]: load moved off the busiest pack by swapping its item s with item t of pack k.
        delta = sub[rows, busiest][:, None, :, None] - sub[:, :, None, :]
        # The pair's larger load becomes top - min(delta, gap - delta); only 0 < delta < gap helps.
        gain = np.minimum(delta, gap[:, :, None, None] - delta)
        gain = gain.reshape(active.size, -1)
        best = gain.argmax(axis=1)
        improves = gain[rows, best] > _MIN_RELATIVE_GAIN * top
        if not improves.any():
            break
        rows, best, busiest = rows[improves], best[improves], busiest[improves]
        other, rest = np.divmod(best, per_pack * per_pack)
        s, t = np.divmod(rest, per_pack)
        row_ids = active[rows]
        a_pos, b_pos = busiest * per_pack + s, other * per_pack + t
        flat_load = load.reshape(num_rows, -1)
        flat_load[row_ids, a_pos], flat_load[row_ids, b_pos] = flat_load[row_ids, b_pos], flat_load[row_ids, a_pos]
        order[row_ids, a_pos], order[row_ids, b_pos] = order[row_ids, b_pos], order[row_ids, a_pos]
        active = row_ids
        if target is not None:
            active = active[load[active].sum(axis=2).max(axis=1) > target[active]]
    return order


def _layer_max(weight: np.ndarray, phy2log: np.ndarray, logcnt: np.ndarray, num_gpus: int) -> np.ndarray:
    """``[L]`` busiest GPU load per layer (loads split evenly over replicas; sums in slot order)."""
    replica_load = _packing.gather_rows(weight / logcnt, phy2log)
    return replica_load.reshape(phy2log.shape[0], num_gpus, -1).sum(axis=2).max(axis=1)


def rebalance_balanced(
    weight,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    old_phy2log=None,
    *,
    prefer_fewer_moves: bool = True,
):
    """``"balanced"`` placement: DeepSeek's, with each node's GPU packing refined by swaps.

    Same arguments, validation and results as
    :func:`moe_eplb_jax.policy.rebalance_experts` (numpy int32 ``phy2log
    [L, P]``, ``log2phy [L, E, P - E + 1]``, ``logcnt [L, E]``); the same
    replicas per expert and the same node of every expert group, but a
    per-layer maximum GPU load that is never higher than DeepSeek's (and
    usually lower).

    With ``old_phy2log`` each layer takes whichever of two placements moves
    fewer slots: the one above, relabelled to keep experts in their old slots
    (as ``rebalance_experts`` does), or one grown from the old placement
    (:mod:`moe_eplb_jax.policy._sticky`: old group-to-node partition, old slots
    kept, swaps until as balanced as the one above), the latter only when its
    busiest GPU is no busier than in DeepSeek's fresh placement
    (``prefer_fewer_moves=True``, typically a tenth of the moves for a few
    tenths of a percent of balancedness) or than in the refined fresh one
    (``False``). Either way no layer is less balanced than DeepSeek's; replica
    counts may differ from DeepSeek's where the grown placement is taken.
    """
    weight, old = check_inputs(weight, num_replicas, num_groups, num_nodes, num_gpus, old_phy2log)
    num_layers, num_experts = weight.shape
    groups, nodes = topology(num_groups, num_nodes)
    phy2log, phyrank, logcnt = hierarchical_layout(weight, num_replicas, groups, nodes, num_gpus)

    gpus_per_node = num_gpus // nodes
    slots_per_gpu = num_replicas // num_gpus
    replica_load = _packing.gather_rows(weight / logcnt, phy2log)
    rows = num_layers * nodes
    order = refine_packing(replica_load.reshape(rows, gpus_per_node, slots_per_gpu))
    refined = [
        _packing.gather_rows(t.reshape(rows, -1), order).reshape(num_layers, num_replicas) for t in (phy2log, phyrank)
    ]
    # Keep the refined layout only where its busiest GPU is not busier (always, by construction;
    # checked because it is cheap and the claim is the policy's contract).
    before = _layer_max(weight, phy2log, logcnt, num_gpus)
    after = _layer_max(weight, refined[0], logcnt, num_gpus)
    better = (after <= before)[:, None]
    phy2log = np.where(better, refined[0], phy2log)
    phyrank = np.where(better, refined[1], phyrank)

    if old is not None:
        fresh_max = np.minimum(before, after)
        phy2log, phyrank = preserve_slots(phy2log, phyrank, old, num_gpus=num_gpus, num_nodes=nodes)
        grown = old_based_layout(weight, old, num_replicas, groups, nodes, num_gpus, fresh_max, refine_packing)
        grown_phy2log, grown_phyrank, grown_logcnt, usable = grown
        bar = before if prefer_fewer_moves else fresh_max
        use_grown = (
            usable
            & (_layer_max(weight, grown_phy2log, grown_logcnt, num_gpus) <= bar)
            & ((grown_phy2log != old).sum(axis=1) < (phy2log != old).sum(axis=1))
        )[:, None]
        phy2log = np.where(use_grown, grown_phy2log, phy2log)
        phyrank = np.where(use_grown, grown_phyrank, phyrank)
        logcnt = np.where(use_grown, grown_logcnt, logcnt)
    log2phy = log2phy_from_ranks(phy2log, phyrank, num_experts)
    return phy2log.astype(np.int32), log2phy, logcnt.astype(np.int32)

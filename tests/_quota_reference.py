"""Plain numpy reference of :func:`moe_eplb_jax.routing.plan_quotas` (the test oracle).

Written with explicit loops, one decision at a time, so that it reads as the
algorithm described in :mod:`moe_eplb_jax.routing.quota`. It returns the same
plan, integer for integer, as the JAX version.
"""

from __future__ import annotations

import numpy as np

from moe_eplb_jax.routing.quota import check_counts, default_max_replicas

__all__ = ["plan_quotas_reference", "simulate_quota_routing"]


def _demands(load, num_home, target):
    """Per-expert demand at ``target`` (hottest experts of an overloaded rank first)."""
    num_ranks = load.shape[0] // num_home
    demand = np.zeros_like(load)
    for rank in range(num_ranks):
        experts = list(range(rank * num_home, (rank + 1) * num_home))
        excess = max(int(load[experts].sum()) - target, 0)
        for e in sorted(experts, key=lambda e: (-load[e], e)):
            take = min(excess, int(load[e]))
            demand[e] = take
            excess -= take
    return demand


def _demand_order(load, num_home):
    """Experts in demand order: largest demand at the lowest target ``ceil(mean)`` first (ties: hot order)."""
    num_ranks = load.shape[0] // num_home
    hot = [
        (rank * num_home + j)
        for rank in range(num_ranks)
        for j in sorted(range(num_home), key=lambda j: (-load[rank * num_home + j], j))
    ]
    at_lowest = _demands(load, num_home, -(-int(load.sum()) // num_ranks))
    return sorted(hot, key=lambda e: (-at_lowest[e], hot.index(e)))


def _fill(load, num_home, num_spare, target):
    """``{(expert, rank): tokens}`` replicas at ``target`` and whether every demand found room.

    Demands (in demand order, empty ones included) and supplies (most slack
    first) lie end to end on one token axis. A rank starting at ``x`` inside
    demand ``j`` (the first demand ending after ``x``) ends at ``x + room`` or
    at the end of demand ``j + S - 1``, whichever comes first, so it never holds
    more than ``S`` experts; each overlap of its interval with a demand is one
    replica.
    """
    num_ranks = load.shape[0] // num_home
    home_load = load.reshape(num_ranks, num_home).sum(1)
    demand = _demands(load, num_home, target)
    queue = _demand_order(load, num_home)
    ends = np.cumsum([int(demand[e]) for e in queue])  # where each demand ends on the token axis
    total = int(ends[-1]) if len(queue) else 0
    pieces = {}
    x = 0
    for rank in sorted(range(num_ranks), key=lambda r: (home_load[r], r)):
        room = max(target - int(home_load[rank]), 0)
        j = int(np.sum(ends <= x))
        cap = int(ends[j + num_spare - 1]) if j + num_spare - 1 < len(queue) else total
        end = min(x + room, cap)
        for i in range(j, min(j + num_spare, len(queue))):
            start = int(ends[i]) - int(demand[queue[i]])
            amount = min(int(ends[i]), end) - max(start, x)
            if amount > 0:
                pieces[(queue[i], rank)] = amount
        x = end
    return pieces, x >= total


def _feasible(pieces, covered, num_spare, min_replica_tokens, max_replicas):
    if not covered:
        return False
    per_rank, per_expert = {}, {}
    for (e, r), amount in pieces.items():
        if amount < min_replica_tokens:
            return False
        per_rank[r] = per_rank.get(r, 0) + 1
        per_expert[e] = per_expert.get(e, 0) + 1
    return max(per_rank.values(), default=0) <= num_spare and max(per_expert.values(), default=0) <= max_replicas - 1


def plan_quotas_reference(
    counts, *, num_home, num_spare, min_replica_tokens=1, max_replicas=None, search_rounds=1, search_width=1024
):
    """Same contract as :func:`plan_quotas`; returns a dict of numpy arrays with the ``QuotaPlan`` field names."""
    counts = np.asarray(counts)
    check_counts(counts, num_home=num_home)
    counts = counts.astype(np.int64)
    num_ranks, num_experts = counts.shape
    if max_replicas is None:
        max_replicas = default_max_replicas(num_ranks, num_spare)
    slots_per_rank = num_home + num_spare
    load = counts.sum(0)
    home_load = load.reshape(num_ranks, num_home).sum(1)

    # K-ary search for the smallest feasible target (same grid as the JAX version).
    lo, hi = -(-int(load.sum()) // num_ranks), int(home_load.max())
    if num_spare > 0:
        for _ in range(search_rounds):
            span = max(hi - lo, 0)
            grid = [lo + (span * k) // (search_width - 1) for k in range(search_width)]
            first = next(
                k
                for k, t in enumerate(grid)
                if k == search_width - 1
                or _feasible(*_fill(load, num_home, num_spare, t), num_spare, min_replica_tokens, max_replicas)
            )
            new_hi = grid[first]
            new_lo = grid[first - 1] + 1 if first > 0 else new_hi
            lo, hi = min(new_lo, new_hi), new_hi
        pieces, _ = _fill(load, num_home, num_spare, hi)
    else:
        hi, pieces = int(home_load.max()), {}

    # Spare slots in expert-id order on each rank; replicas of an expert in rank (== slot) order.
    phy2log = np.full((num_ranks, slots_per_rank), -1, np.int64)
    phy2log[:, :num_home] = np.arange(num_experts).reshape(num_ranks, num_home)
    holders: dict[int, dict[int, int]] = {e: {e // num_home: -1} for e in range(num_experts)}  # expert -> {rank: slot}
    for rank in range(num_ranks):
        mine = sorted(e for (e, r) in pieces if r == rank)
        for k, e in enumerate(mine):
            phy2log[rank, num_home + k] = e
            holders[e][rank] = rank * slots_per_rank + num_home + k
    log2phy = np.full((num_experts, max_replicas), -1, np.int64)
    replica_load = np.zeros((num_experts, max_replicas), np.int64)
    quota = np.zeros((num_ranks, num_experts, max_replicas), np.int64)
    rank_load = np.zeros(num_ranks, np.int64)
    logcnt = np.zeros(num_experts, np.int64)
    for e in range(num_experts):
        home = e // num_home
        holders[e][home] = home * slots_per_rank + e % num_home
        ranks = sorted(holders[e])
        logcnt[e] = len(ranks)
        cap = [
            int(load[e]) - sum(pieces.get((e, r), 0) for r in ranks if r != home) if r == home else pieces[(e, r)]
            for r in ranks
        ]
        for s, r in enumerate(ranks):
            log2phy[e, s] = holders[e][r]
            replica_load[e, s] = cap[s]
            rank_load[r] += cap[s]
        # Locality first: each source feeds its own replica, then the rest go in source order / replica order.
        left = list(cap)
        src_left = counts[:, e].copy()
        for s, r in enumerate(ranks):
            take = min(int(src_left[r]), left[s])
            quota[r, e, s] += take
            src_left[r] -= take
            left[s] -= take
        s = 0
        for g in range(num_ranks):
            while src_left[g] > 0:
                while left[s] == 0:
                    s += 1
                take = min(int(src_left[g]), left[s])
                quota[g, e, s] += take
                src_left[g] -= take
                left[s] -= take
    return dict(
        phy2log=phy2log.reshape(-1).astype(np.int32),
        log2phy=log2phy.astype(np.int32),
        logcnt=logcnt.astype(np.int32),
        replica_load=replica_load.astype(np.int32),
        quota=quota.astype(np.int32),
        rank_load=rank_load.astype(np.int32),
        target=np.int32(hi),
    )


def simulate_quota_routing(topk_ids, log2phy, logcnt, quotas):
    """Numpy model of ``map_and_count(mode="quota")`` for one source rank.

    ``topk_ids [T, k]`` logical ids; ``log2phy [E, R]``; ``logcnt [E]``;
    ``quotas [E, R]``. Tokens of expert ``e`` in flat (token, k) order
    fill replica 0's quota, then replica 1's, ...; overflow falls back to a
    hash-free round robin over the replicas. Returns physical ids ``[T, k]``.
    """
    topk_ids = np.asarray(topk_ids)
    out = np.empty_like(topk_ids)
    used = np.zeros_like(np.asarray(quotas))
    flat_ids, flat_out = topk_ids.reshape(-1), out.reshape(-1)
    for i, e in enumerate(flat_ids):
        s = 0
        while s < logcnt[e] and used[e, s] >= quotas[e, s]:
            s += 1
        if s == logcnt[e]:  # overflow
            s = i % logcnt[e]
        used[e, s] += 1
        flat_out[i] = log2phy[e, s]
    return out

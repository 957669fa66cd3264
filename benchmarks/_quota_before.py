"""FROZEN COPY of moe_eplb_jax/routing/quota.py as of commit d7bf698 (before the one-kernel search).

Kept only so that benchmarks/online.py can time the old planner next to the new one in one run.

Per-batch quota planning (UltraEP-style online balancing), in JAX.

Each of ``G`` EP ranks holds ``H`` fixed *home* experts (expert ``e`` lives on
rank ``e // H``) and ``S`` *spare* slots, so there are ``P = G * (H + S)``
physical slots and ``E = G * H`` logical experts. Slot ``p`` lives on rank
``p // (H + S)``; the first ``H`` slots of a rank are its home experts.

For one batch, :func:`plan_quotas` takes ``counts [G, E]`` (tokens that each
source rank sends to each logical expert) and decides

* which expert fills each spare slot (``phy2log``, ``-1`` for an unused one),
* how many tokens each replica computes, and
* how many tokens each source rank sends to each replica (``quota``),

so that the largest per-rank load is as small as the greedy below can make it.

The search. For a target ``T`` (a bound on every rank's load) the *demand* of
an overloaded rank is its load above ``T``, taken from its hottest experts
first; the *supply* of a rank with slack is ``T`` minus its load. Demands
(largest first) and supplies (most slack first) are laid end to end on one
token axis and matched by overlapping intervals: every overlap of expert
``e``'s demand with rank ``r``'s supply becomes one replica of ``e`` on rank
``r``. A supply rank whose interval would hold more than ``S`` experts stops
early at a demand boundary, leaving some slack unused (a scan over the ``G``
ranks). A target is feasible when every demand found room, no expert needs more
than ``max_replicas - 1`` replicas and no replica gets fewer than
``min_replica_tokens`` tokens. ``T = max home load`` (nothing moves) is always
feasible; a ``search_width``-ary search over ``search_rounds`` rounds narrows
``[ceil(mean), max home load]`` to the smallest feasible target it finds (all
candidates of a round are evaluated at once), so the plan is a fixed chain of
array operations with static shapes: no host round trip, no data-dependent
loop. When the spare slots cannot reach the mean the plan is the best feasible
target found, and ``rank_load`` reports the imbalance left.

Quotas put locality first: a source rank's tokens for expert ``e`` go to the
replica of ``e`` on its own rank (up to that replica's capacity) before the
remaining tokens are laid against the remaining replica capacities in rank
order. Quotas of a source rank are consumed by ``map_and_count(mode=
"resolved", resolved=plan.quota[g], log2phy=plan.log2phy)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["QuotaPlan", "plan_quotas", "check_counts", "default_max_replicas"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuotaPlan:
    """One batch's spare-slot placement and per-replica token quotas.

    Shapes (``G`` ranks, ``E = G * H`` experts, ``P = G * (H + S)`` slots,
    ``R = max_replicas``):

    * ``phy2log [P]`` int32: expert held by each slot, ``-1`` for an unused spare;
    * ``log2phy [E, R]`` int32: slots of each expert's replicas in ascending slot
      order (the home slot among them), ``-1`` padded;
    * ``logcnt [E]`` int32: replicas per expert (home included);
    * ``replica_load [E, R]`` int32: tokens each replica computes;
    * ``quota [G, E, R]`` int32: tokens source rank ``g`` sends to replica ``r``
      of expert ``e`` (sums over ``R`` to ``counts``; ``None`` with ``with_quota=False``);
    * ``rank_load [G]`` int32: tokens each rank computes under the plan;
    * ``target`` int32 scalar: the load bound the search settled on.
    """

    phy2log: Any
    log2phy: Any
    logcnt: Any
    replica_load: Any
    quota: Any
    rank_load: Any
    target: Any

    @property
    def replicas_used(self):
        """Number of spare slots holding an expert."""
        return jnp.sum(self.logcnt) - self.logcnt.shape[0]

    @property
    def rank_imbalance(self):
        """``max / mean`` of ``rank_load`` (1.0 when there is no load)."""
        load = self.rank_load.astype(jnp.float32)
        mean = jnp.mean(load)
        return jnp.where(mean > 0, jnp.max(load) / jnp.where(mean > 0, mean, 1.0), 1.0)


def default_max_replicas(num_ranks: int, num_spare: int) -> int:
    """Replica-table width used when ``max_replicas`` is not given: ``min(G * S + 1, 16)``."""
    return int(min(num_ranks * num_spare + 1, 16))


def check_counts(counts, *, num_home: int) -> None:
    """Eager validation of concrete ``counts [G, E]``; raises ``ValueError`` naming the problem."""
    arr = np.asarray(counts)
    _check_static(arr.shape, arr.dtype, num_home, 0, 1, 1, 1, 2)
    if np.any(arr < 0):
        g, e = np.argwhere(arr < 0)[0]
        raise ValueError(f"counts must be non-negative; counts[{g}, {e}] = {arr[g, e]}")


def _check_static(shape, dtype, num_home, num_spare, min_replica_tokens, max_replicas, search_rounds, search_width):
    if len(shape) != 2:
        raise ValueError(f"counts must have shape [G, E], got {tuple(shape)}")
    if not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"counts must be an integer array, got dtype {dtype}")
    if num_home < 1:
        raise ValueError(f"num_home must be >= 1, got {num_home}")
    if num_spare < 0:
        raise ValueError(f"num_spare must be >= 0, got {num_spare}")
    num_ranks, num_experts = shape
    if num_ranks < 1 or num_experts != num_ranks * num_home:
        raise ValueError(f"counts [G, E] needs E = G * num_home = {num_ranks} * {num_home}, got E = {num_experts}")
    if min_replica_tokens < 1:
        raise ValueError(f"min_replica_tokens must be >= 1, got {min_replica_tokens}")
    if max_replicas < 1:
        raise ValueError(f"max_replicas must be >= 1, got {max_replicas}")
    if search_rounds < 1 or search_width < 2:
        raise ValueError(f"need search_rounds >= 1 and search_width >= 2, got {search_rounds}, {search_width}")


def plan_quotas(
    counts,
    *,
    num_home: int,
    num_spare: int,
    min_replica_tokens: int = 1,
    max_replicas: int | None = None,
    search_rounds: int = 3,
    search_width: int = 16,
    with_quota: bool = True,
) -> QuotaPlan:
    """Plans spare slots and per-replica quotas for one batch (see the module docstring).

    ``counts [G, E]`` integer: tokens each source rank sends to each logical
    expert (expert ``e``'s home is rank ``e // num_home``). Traceable: call it
    under ``jax.jit`` (with the keyword options static) inside the step. Shape
    and option errors raise ``ValueError``; concrete (non-traced) counts are also
    checked for negative values, while traced negative counts are treated as 0
    (the hot path never raises). ``with_quota=False`` skips the ``[G, E, R]``
    quota table (``quota`` is then ``None``) when only the placement and loads
    are needed, e.g. in the simulator.
    """
    if max_replicas is None:
        max_replicas = default_max_replicas(np.shape(counts)[0] if np.ndim(counts) == 2 else 1, num_spare)
    dtype = counts.dtype if hasattr(counts, "dtype") else np.asarray(counts).dtype
    _check_static(np.shape(counts), dtype, num_home, num_spare, min_replica_tokens, max_replicas,
                  search_rounds, search_width)
    if not isinstance(counts, jax.core.Tracer):
        check_counts(counts, num_home=num_home)
    counts = jnp.maximum(jnp.asarray(counts).astype(jnp.int32), 0)
    return _plan(counts, num_home, num_spare, min_replica_tokens, max_replicas, search_rounds, search_width,
                 with_quota)


# --------------------------------------------------------------------------- the search


def _prepare(counts, num_home):
    """Loads and the target-independent orders the search needs."""
    num_ranks = counts.shape[0]
    load = jnp.sum(counts, axis=0)  # [E]
    home_load = jnp.sum(load.reshape(num_ranks, num_home), axis=1)  # [G]
    # Each rank offloads its hottest experts first (ties: lower expert id first).
    hot_order = jnp.argsort(-load.reshape(num_ranks, num_home), axis=1, stable=True)  # [G, H]
    expert_of = jnp.arange(num_ranks, dtype=jnp.int32)[:, None] * num_home + hot_order.astype(jnp.int32)
    sorted_load = jnp.take_along_axis(load.reshape(num_ranks, num_home), hot_order, axis=1)
    before = jnp.cumsum(sorted_load, axis=1) - sorted_load  # load of hotter experts on the same rank
    # Supplies are laid out most-slack-first: ascending home load (ties: lower rank first).
    supply_order = jnp.argsort(home_load, stable=True).astype(jnp.int32)
    return load, home_load, expert_of.reshape(-1), sorted_load.reshape(-1), before.reshape(-1), supply_order


def _demands(target, home_load, sorted_load, before, num_home):
    """Demand of every expert at ``target`` (hot order) and the largest-first order of the demands."""
    excess = jnp.maximum(home_load - target, 0)  # [G]
    demand = jnp.clip(jnp.repeat(excess, num_home) - before, 0, sorted_load)  # [E] in hot order (rank-major)
    order = jnp.argsort(-demand, stable=True).astype(jnp.int32)
    return demand, order


def _fill(target, home_load, sorted_load, before, supply_order, num_home, num_spare):
    """Lays demands (largest first) against supplies (most slack first); returns the plan at ``target``.

    Result: ``(pieces [E, G], order [E], covered)`` where ``pieces[i, j]`` are the
    tokens the ``i``-th largest demand sends to the ``j``-th supply rank. A supply
    rank stops early, at a demand boundary, rather than take more than
    ``num_spare`` experts (the slack it leaves unused is the price of the slot
    limit); ``covered`` says whether every demand found room.
    """
    demand, order = _demands(target, home_load, sorted_load, before, num_home)
    d = demand[order]
    d_hi = jnp.cumsum(d)
    d_lo = d_hi - d
    total = d_hi[-1]
    d_pad = jnp.concatenate([d_hi, jnp.broadcast_to(total, (num_spare,))])
    supply = jnp.maximum(target - home_load, 0)[supply_order]
    last = d_pad.shape[0] - 1
    offsets = jnp.arange(num_spare, dtype=jnp.int32)

    def step(carry, s):
        x, j = carry  # position on the demand axis; index of the demand containing x
        cap = d_pad[jnp.minimum(j + num_spare - 1, last)]
        end = jnp.minimum(x + s, cap)
        passed = jnp.sum((d_pad[jnp.minimum(j + offsets, last)] <= end).astype(jnp.int32))
        return (end, j + passed), x

    j0 = jnp.sum((d_hi <= 0).astype(jnp.int32))
    (x_end, _), s_lo = jax.lax.scan(step, (jnp.zeros_like(total), j0), supply)
    s_hi = jnp.concatenate([s_lo[1:], x_end[None]])
    overlap = jnp.minimum(d_hi[:, None], s_hi[None, :]) - jnp.maximum(d_lo[:, None], s_lo[None, :])
    return jnp.maximum(overlap, 0), order, x_end >= total


def _feasible(pieces, covered, num_spare, min_replica_tokens, max_replicas):
    used = pieces > 0
    per_rank = jnp.sum(used, axis=-2)
    per_expert = jnp.sum(used, axis=-1)
    too_small = jnp.any(used & (pieces < min_replica_tokens), axis=(-2, -1))
    return (covered & jnp.all(per_rank <= num_spare, axis=-1) & jnp.all(per_expert <= max_replicas - 1, axis=-1)
            & ~too_small)


def _search(home_load, sorted_load, before, supply_order, num_home, num_spare, min_replica_tokens, max_replicas,
            search_rounds, search_width):
    total = jnp.sum(home_load)
    num_ranks = home_load.shape[0]
    lo = (total + num_ranks - 1) // num_ranks  # no plan beats the mean
    hi = jnp.max(home_load)  # nothing moves: always feasible
    steps = jnp.arange(0, search_width, dtype=jnp.int32)
    fill = jax.vmap(_fill, in_axes=(0, None, None, None, None, None, None))
    for _ in range(search_rounds):
        span = jnp.maximum(hi - lo, 0)
        # Integer grid lo + span * k / (K - 1), k = 0..K-1: both ends included; hi is known to be feasible.
        cand = lo + (span * steps) // (search_width - 1)
        pieces, _, covered = fill(cand, home_load, sorted_load, before, supply_order, num_home, num_spare)
        ok = _feasible(pieces, covered, num_spare, min_replica_tokens, max_replicas) | (steps == search_width - 1)
        first = jnp.argmax(ok)
        new_hi = cand[first]
        new_lo = jnp.where(first > 0, cand[jnp.maximum(first - 1, 0)] + 1, new_hi)
        lo, hi = jnp.minimum(new_lo, new_hi), new_hi
    return hi


def _plan(counts, num_home, num_spare, min_replica_tokens, max_replicas, search_rounds, search_width, with_quota):
    num_ranks, num_experts = counts.shape
    slots_per_rank = num_home + num_spare
    load, home_load, expert_of, sorted_load, before, supply_order = _prepare(counts, num_home)
    if num_spare == 0:
        target = jnp.max(home_load)
    else:
        target = _search(home_load, sorted_load, before, supply_order, num_home, num_spare, min_replica_tokens,
                         max_replicas, search_rounds, search_width)
    pieces_sorted, order, _ = _fill(target, home_load, sorted_load, before, supply_order, num_home,
                                    max(num_spare, 1))  # [E (largest demand first), G (supply order)]
    # Back to expert-id rows and rank-id columns.
    pieces = jnp.zeros((num_experts, num_ranks), jnp.int32)
    pieces = pieces.at[expert_of[order][:, None], supply_order[None, :]].set(pieces_sorted)
    if num_spare == 0:
        pieces = jnp.zeros_like(pieces)
    # Guards that only bind for an infeasible target (never chosen): drop what does not fit.
    used = pieces > 0
    slot_idx = jnp.cumsum(used, axis=0) - 1  # [E, G]: spare slot index on the receiving rank (expert-id order)
    rep_idx = jnp.cumsum(used, axis=1)  # provisional per-expert replica count
    keep = used & (slot_idx < num_spare) & (rep_idx <= max_replicas - 1) & (pieces >= min_replica_tokens)
    pieces = jnp.where(keep, pieces, 0)
    used = keep
    slot_idx = jnp.cumsum(used, axis=0) - 1

    # Spare slots: phy2log.
    ranks = jnp.arange(num_ranks, dtype=jnp.int32)
    experts = jnp.arange(num_experts, dtype=jnp.int32)
    spare_slot = ranks[None, :] * slots_per_rank + num_home + slot_idx  # [E, G]
    phy2log = jnp.full((num_ranks, slots_per_rank), -1, jnp.int32)
    phy2log = phy2log.at[:, :num_home].set(experts.reshape(num_ranks, num_home))
    flat = phy2log.reshape(-1)
    flat = flat.at[jnp.where(used, spare_slot, flat.shape[0])].set(
        jnp.broadcast_to(experts[:, None], used.shape), mode="drop")
    phy2log = flat

    # Replica table: every rank that holds e (home included), in rank order == ascending slot order.
    home_rank = experts // num_home
    is_home = home_rank[:, None] == ranks[None, :]  # [E, G]
    home_slot = home_rank * slots_per_rank + experts % num_home
    holds = used | is_home
    slot_of = jnp.where(is_home, home_slot[:, None], spare_slot)
    home_keep = load - jnp.sum(pieces, axis=1)
    cap_at_rank = jnp.where(is_home, home_keep[:, None], pieces)  # [E, G]
    rep_pos = jnp.cumsum(holds, axis=1) - 1
    rows = jnp.broadcast_to(experts[:, None], holds.shape)
    cols = jnp.where(holds, rep_pos, max_replicas)
    log2phy = jnp.full((num_experts, max_replicas), -1, jnp.int32).at[rows, cols].set(slot_of, mode="drop")
    replica_load = jnp.zeros((num_experts, max_replicas), jnp.int32).at[rows, cols].set(cap_at_rank, mode="drop")
    logcnt = jnp.sum(holds, axis=1).astype(jnp.int32)
    rank_load = jnp.sum(jnp.where(holds, cap_at_rank, 0), axis=0).astype(jnp.int32)
    plan = QuotaPlan(phy2log=phy2log, log2phy=log2phy, logcnt=logcnt, replica_load=replica_load, quota=None,
                     rank_load=rank_load, target=target.astype(jnp.int32))
    if not with_quota:
        return plan
    rank_of_replica = jnp.where(log2phy >= 0, log2phy // slots_per_rank, -1)  # [E, R]

    # Quotas, locality first: source g feeds its own replica of e first.
    counts_eg = counts.T  # [E, G] sources
    local_take = jnp.minimum(counts_eg, jnp.where(holds, cap_at_rank, 0))  # [E, G]
    rem_src = counts_eg - local_take
    local_by_replica = jnp.take_along_axis(local_take, jnp.maximum(rank_of_replica, 0), axis=1)
    rem_cap = replica_load - jnp.where(rank_of_replica >= 0, local_by_replica, 0)  # [E, R]
    src_hi = jnp.cumsum(rem_src, axis=1)
    src_lo = src_hi - rem_src
    cap_hi = jnp.cumsum(rem_cap, axis=1)
    cap_lo = cap_hi - rem_cap
    remote = jnp.maximum(
        jnp.minimum(src_hi[:, :, None], cap_hi[:, None, :]) - jnp.maximum(src_lo[:, :, None], cap_lo[:, None, :]), 0)
    local = jnp.where(rank_of_replica[:, None, :] == ranks[None, :, None], local_take[:, :, None], 0)
    quota = jnp.transpose(remote + local, (1, 0, 2)).astype(jnp.int32)  # [G, E, R]
    return dataclasses.replace(plan, quota=quota)

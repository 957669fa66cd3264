"""Per-batch quota planning (UltraEP-style online balancing), in JAX.

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
first; the *supply* of a rank with slack is ``T`` minus its load. Demands and
supplies are laid end to end on one token axis and matched by overlapping
intervals: every overlap of expert ``e``'s demand with rank ``r``'s supply
becomes one replica of ``e`` on rank ``r``. Supplies go most slack first;
demands go largest first *as measured at the lowest target* ``ceil(mean)``
(where every demand is largest; a demand only shrinks as ``T`` grows), so one
order, computed once, serves every candidate target and the search sorts
nothing. A supply rank whose interval would hold more than ``S`` experts stops
early at a demand boundary, leaving some slack unused: the one sequential step,
a walk over the ``G`` ranks (:mod:`._quota_search`) that also checks the pieces
it lays out. A target is feasible when every demand found room, no expert needs
more than ``max_replicas - 1`` replicas and no replica gets fewer than
``min_replica_tokens`` tokens. ``T = max home load`` (nothing moves) is always
feasible; a ``search_width``-ary search over ``search_rounds`` rounds (default
1 x 1024: one grid of 1024 targets, every candidate independent; 2 x 64 gives a
finer grid in two dependent steps) narrows ``[ceil(mean), max home load]`` to
the smallest feasible target it finds, and the last round's layout at that
target is the plan. On GPU the orders and the whole search are ONE Triton
kernel between two fused XLA stages (the loads before, the tables after: no
sort, no scatter, no loop); a one-round search runs its candidates in parallel
programs (32 each), since the walk over the ranks is a chain of dependent steps
that only fewer rounds can shorten. Elsewhere, and as the GPU fallback, the
orders are XLA ops and the walk a ``lax.scan`` per round. Either way the
plan is a fixed chain of operations with static shapes: no host round trip, no
data-dependent loop. When the spare slots cannot reach the mean the plan is the
best feasible target found, and ``rank_load`` reports the imbalance left.

Quotas put locality first: a source rank's tokens for expert ``e`` go to the
replica of ``e`` on its own rank (up to that replica's capacity) before the
remaining tokens are laid against the remaining replica capacities in rank
order. Quotas of a source rank are consumed by ``map_and_count(mode=
"quota", quotas=plan.quota[g], log2phy=plan.log2phy)``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moe_eplb_jax._checks import is_concrete
from moe_eplb_jax._kernels import pallas_default
from moe_eplb_jax.routing._quota_search import IMPLEMENTATIONS, search, search_pallas

__all__ = [
    "QuotaPlan",
    "check_counts",
    "default_implementation",
    "default_max_replicas",
    "plan_quotas",
    "search_pallas",
]


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


_INT32_MAX = int(np.iinfo(np.int32).max)


def check_counts(counts, *, num_home: int) -> None:
    """Eager validation of concrete ``counts [G, E]``; raises ``ValueError`` naming the problem.

    The planner counts in int32, so besides negative counts it refuses
    counts whose total passes ``2**31 - 1`` (every load it sums -- an
    expert's over the sources, a rank's over its experts -- is at most the
    total): cast to int32 they would wrap into other counts.
    """
    arr = np.asarray(counts)
    _check_static(arr.shape, arr.dtype, num_home, 0, 1, 1, 1, 2)
    if np.any(arr < 0):
        g, e = np.argwhere(arr < 0)[0]
        raise ValueError(f"counts must be non-negative; counts[{g}, {e}] = {arr[g, e]}")
    if np.any(arr > _INT32_MAX):
        g, e = np.argwhere(arr > _INT32_MAX)[0]
        raise ValueError(f"counts[{g}, {e}] = {arr[g, e]} does not fit the planner's int32 counts (max 2**31 - 1)")
    total = int(arr.sum(dtype=np.int64))  # every count fits int32 now: no int64 wrap
    if total > _INT32_MAX:
        raise ValueError(f"counts sum to {total} tokens, past the planner's int32 sums (max 2**31 - 1)")


def default_implementation() -> str:
    """``"pallas"`` on a GPU once a probe plan from it equals the XLA plan (once per process), else ``"xla"``."""
    return "pallas" if pallas_default("plan_quotas", _probe_pallas) else "xla"


def _probe_pallas() -> bool:
    """Whether the Pallas search, compiled ahead of time and run outside any trace, plans as the XLA search."""
    rng = np.random.default_rng(0)
    counts = (rng.pareto(1.2, size=(2, 8, 16)) * 40).astype(np.int32)
    plans = []
    for impl in IMPLEMENTATIONS:
        probe = jax.jit(jax.vmap(functools.partial(plan_quotas, num_home=2, num_spare=2, implementation=impl)))
        plans.append(probe.lower(jax.ShapeDtypeStruct(counts.shape, jnp.int32)).compile()(counts))
    return all(
        np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(*(jax.tree_util.tree_leaves(p) for p in plans))
    )


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
    search_rounds: int = 1,
    search_width: int = 1024,
    with_quota: bool = True,
    implementation: str | None = None,
) -> QuotaPlan:
    """Plans spare slots and per-replica quotas for one batch (see the module docstring).

    ``counts [G, E]`` integer: tokens each source rank sends to each logical
    expert (expert ``e``'s home is rank ``e // num_home``). Traceable: call it
    under ``jax.jit`` (with the keyword options static) inside the step. Shape
    and option errors raise ``ValueError``; concrete (non-traced) counts are also
    checked (:func:`check_counts`: non-negative, summing to at most
    ``2**31 - 1``), while traced counts are assumed to fit int32 and negative
    ones are treated as 0 (the hot path never raises). ``with_quota=False`` skips the ``[G, E, R]``
    quota table (``quota`` is then ``None``) when only the placement and loads
    are needed, e.g. in the simulator. ``implementation`` picks how the search
    runs: ``"pallas"`` (orders and every round in one Triton kernel; the GPU
    default once a probe plan from it matched the XLA plan in this process;
    interpret mode off GPU) or ``"xla"`` (a ``lax.scan`` walk per round; the
    default elsewhere).
    Both give the same plan, integer for integer.
    """
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if max_replicas is None:
        max_replicas = default_max_replicas(np.shape(counts)[0] if np.ndim(counts) == 2 else 1, num_spare)
    dtype = counts.dtype if hasattr(counts, "dtype") else np.asarray(counts).dtype
    _check_static(
        np.shape(counts), dtype, num_home, num_spare, min_replica_tokens, max_replicas, search_rounds, search_width
    )
    if is_concrete(counts):
        check_counts(counts, num_home=num_home)
    if implementation is None:
        implementation = default_implementation()  # after validation: on GPU this may run the one-time probe
    counts = jnp.maximum(jnp.asarray(counts).astype(jnp.int32), 0)
    return _plan(
        counts,
        num_home,
        num_spare,
        min_replica_tokens,
        max_replicas,
        search_rounds,
        search_width,
        with_quota,
        implementation,
    )


def _running_sum(x, axis, pairwise):
    """Inclusive prefix sum of a 2-D ``x`` along ``axis`` (at most ``G`` or ``R`` long here).

    ``pairwise``: as one masked reduction, which XLA fuses with its neighbours
    into one reduction kernel on GPU instead of a separate scan.
    """
    if not pairwise:
        return jnp.cumsum(x, axis=axis, dtype=x.dtype)
    n = x.shape[axis]
    upto = jnp.arange(n, dtype=jnp.int32)[None, :] <= jnp.arange(n, dtype=jnp.int32)[:, None]  # [i, i']: i' <= i
    if axis == 0:
        return jnp.sum(jnp.where(upto[:, :, None], x[None, :, :], 0), axis=1)
    return jnp.sum(jnp.where(upto[None, :, :], x[:, None, :], 0), axis=2)


def _plan(
    counts,
    num_home,
    num_spare,
    min_replica_tokens,
    max_replicas,
    search_rounds,
    search_width,
    with_quota,
    implementation,
):
    num_ranks, num_experts = counts.shape
    slots_per_rank = num_home + num_spare
    ranks = jnp.arange(num_ranks, dtype=jnp.int32)
    experts = jnp.arange(num_experts, dtype=jnp.int32)
    home_rank = experts // num_home
    is_home = home_rank[:, None] == ranks[None, :]  # [E, G]
    home_slot = home_rank * slots_per_rank + experts % num_home
    load = jnp.sum(counts, axis=0)  # [E]
    if num_spare == 0:
        target = jnp.max(jnp.sum(load.reshape(num_ranks, num_home), axis=1))
        pieces = jnp.zeros((num_experts, num_ranks), jnp.int32)
        spare_expert = jnp.zeros((num_ranks, 0), jnp.int32)
        spare_slot = jnp.zeros((num_experts, num_ranks), jnp.int32)
    else:
        # The orders and the whole search: one kernel ("pallas") or XLA ops and a scan per round ("xla").
        target, d_hi, s_lo, x_end, demand_expert, rank_position = search(
            load,
            implementation=implementation,
            num_home=num_home,
            num_spare=num_spare,
            min_replica_tokens=min_replica_tokens,
            max_replicas=max_replicas,
            search_rounds=search_rounds,
            search_width=search_width,
        )
        d_lo = d_hi - jnp.concatenate([d_hi[:1], jnp.diff(d_hi)])
        s_hi = jnp.concatenate([s_lo[1:], x_end[None]])
        # pieces[e, g] = overlap of expert e's demand with rank g's supply. The target is feasible, so no piece
        # breaks a limit: the search checked them. position: expert -> demand index (inverse permutation, as one
        # masked reduction rather than a scatter).
        position = jnp.sum(jnp.where(demand_expert[None, :] == experts[:, None], experts[None, :], 0), axis=1)
        d_lo_id, d_hi_id = d_lo[position], d_hi[position]
        s_lo_id, s_hi_id = s_lo[rank_position], s_hi[rank_position]
        overlap = jnp.minimum(d_hi_id[:, None], s_hi_id[None, :]) - jnp.maximum(d_lo_id[:, None], s_lo_id[None, :])
        pieces = jnp.maximum(overlap, 0).astype(jnp.int32)  # [E, G]
        # The spare experts of each rank (supply order): its interval only touches demands j .. j + S - 1, where
        # j is the demand holding its start; spare slots hold them in expert-id order.
        spare_k = jnp.arange(num_spare, dtype=jnp.int32)
        j = jnp.sum((d_hi[None, :] <= s_lo[:, None]).astype(jnp.int32), axis=1)  # [G]
        touched = j[:, None] + spare_k[None, :]  # [G, S] demand indices
        inside = touched < num_experts
        touched = jnp.minimum(touched, num_experts - 1)
        take = inside & (jnp.minimum(d_hi[touched], s_hi[:, None]) - jnp.maximum(d_lo[touched], s_lo[:, None]) > 0)
        expert_t = demand_expert[touched]  # [G, S]
        smaller = take[:, None, :] & (expert_t[:, None, :] < expert_t[:, :, None])
        k = jnp.sum(smaller.astype(jnp.int32), axis=2)  # [G, S]: spare slot of each touched expert
        at_k = take[:, :, None] & (k[:, :, None] == spare_k[None, None, :])  # [G, S (touched), S (slot)]
        spare_sorted = jnp.sum(jnp.where(at_k, expert_t[:, :, None] + 1, 0), axis=1) - 1  # [G, S], -1 when unused
        spare_expert = spare_sorted[rank_position]  # rank-id order
        # Spare slot index of expert e on rank g (meaningful where pieces[e, g] > 0).
        mine = take[rank_position][None, :, :] & (expert_t[rank_position][None, :, :] == experts[:, None, None])
        spare_slot = jnp.sum(jnp.where(mine, k[rank_position][None, :, :], 0), axis=2)  # [E, G]
    used = pieces > 0
    phy2log = jnp.concatenate([experts.reshape(num_ranks, num_home), spare_expert], axis=1).reshape(-1)

    # Replica table: every rank that holds e (home included), in rank order == ascending slot order.
    holds = used | is_home
    slot_of = jnp.where(is_home, home_slot[:, None], ranks[None, :] * slots_per_rank + num_home + spare_slot)
    home_keep = load - jnp.sum(pieces, axis=1)
    cap_at_rank = jnp.where(is_home, home_keep[:, None], pieces)  # [E, G]
    pairwise = implementation == "pallas"  # on GPU, masked sums fuse into reductions; elsewhere cumsum is cheaper
    rep_pos = _running_sum(holds.astype(jnp.int32), 1, pairwise) - 1
    at = holds[:, :, None] & (rep_pos[:, :, None] == jnp.arange(max_replicas, dtype=jnp.int32)[None, None, :])
    log2phy = jnp.sum(jnp.where(at, slot_of[:, :, None] + 1, 0), axis=1) - 1  # [E, R]
    replica_load = jnp.sum(jnp.where(at, cap_at_rank[:, :, None], 0), axis=1)  # [E, R]
    logcnt = jnp.sum(holds, axis=1).astype(jnp.int32)
    rank_load = jnp.sum(jnp.where(holds, cap_at_rank, 0), axis=0).astype(jnp.int32)
    plan = QuotaPlan(
        phy2log=phy2log,
        log2phy=log2phy,
        logcnt=logcnt,
        replica_load=replica_load,
        quota=None,
        rank_load=rank_load,
        target=target.astype(jnp.int32),
    )
    if not with_quota:
        return plan
    rank_of_replica = jnp.where(log2phy >= 0, log2phy // slots_per_rank, -1)  # [E, R]

    # Quotas, locality first: source g feeds its own replica of e first.
    counts_eg = counts.T  # [E, G] sources
    local_take = jnp.minimum(counts_eg, jnp.where(holds, cap_at_rank, 0))  # [E, G]
    rem_src = counts_eg - local_take
    local_by_replica = jnp.take_along_axis(local_take, jnp.maximum(rank_of_replica, 0), axis=1)
    rem_cap = replica_load - jnp.where(rank_of_replica >= 0, local_by_replica, 0)  # [E, R]
    src_hi = _running_sum(rem_src, 1, pairwise)
    src_lo = src_hi - rem_src
    cap_hi = _running_sum(rem_cap, 1, pairwise)
    cap_lo = cap_hi - rem_cap
    remote = jnp.maximum(
        jnp.minimum(src_hi[:, :, None], cap_hi[:, None, :]) - jnp.maximum(src_lo[:, :, None], cap_lo[:, None, :]), 0
    )
    local = jnp.where(rank_of_replica[:, None, :] == ranks[None, :, None], local_take[:, :, None], 0)
    quota = jnp.transpose(remote + local, (1, 0, 2)).astype(jnp.int32)  # [G, E, R]
    return dataclasses.replace(plan, quota=quota)

"""Per-batch token quotas over the replicas a placement already has (the MoE layer's ``routing="quota"``).

Shapes: ``G`` EP ranks, ``E`` logical experts, ``P`` physical slots (slot
``p`` on rank ``p // (P / G)``), ``S`` the width of ``log2phy [E, S]``.

UltraEP-style online balancing plans every batch from the batch's own counts,
but the weights in the slots change only when the controller moves them (the
``"online"`` policy refreshes the spare slots every ``refresh_interval``
steps). So the per-batch plan may not invent replicas: it splits each expert's
tokens over the replicas the current placement holds. For one batch,
``counts [G, E]`` (tokens each source rank routes to each expert, padding
excluded), :func:`plan_fixed_quotas`

1. solves the replica shares minimising the largest rank load -- the LP of
   :mod:`.lp` (``lp_shares``: multiplicative weights on the ranks, a fixed
   number of unrolled iterations, best iterate kept) -- on this batch's expert
   loads ``counts.sum(0)``;
2. turns them into integer replica loads by cumulative rounding: replica ``s``
   of expert ``e`` gets ``round(load[e] * c[s]) - round(load[e] * c[s - 1])``
   with ``c`` the running sum of the shares and ``c[last] = 1``: within one
   token of its share, the row summing exactly to ``load[e]``;
3. splits them per source rank, locality first: source ``g``'s tokens of ``e``
   go to ``e``'s first replica on rank ``g`` up to that replica's load; the
   rest are laid end to end against the replicas' remaining loads (sources in
   rank order against replicas in ``log2phy`` order, one interval overlap per
   pair). ``quota[g, e]`` sums to ``counts[g, e]``; ``quota[:, e, s]`` to the
   replica load.

``map_and_count(mode="quota", quotas=quota[g])`` then routes source ``g``'s
entries in token order, each replica receiving exactly its quota, so the rank
loads realised equal the plan's ``rank_load``. A second replica of an expert
on the same rank gets no tokens (the first one there serves the rank).

Why not a plan that also chooses the spare experts (``plan_quotas``): its
replicas would need the expert weights fetched into the spare slots inside the
step. Every rank of an EP group computes the plan from the same all-gathered
counts with the same program (masked sums, no float scatter), so all ranks
agree; the outputs would not depend on it anyway -- every source's quotas sum
to its own counts, so every token reaches a replica of its expert.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from moe_eplb_jax.routing.lp import lp_shares

__all__ = ["FixedQuotaPlan", "plan_fixed_quotas", "batch_quotas"]

DEFAULT_ITERS = 16
DEFAULT_STEP = 2.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FixedQuotaPlan:
    """One batch's split of each expert's tokens over its existing replicas.

    * ``quota``: ``[G, E, S]`` int32 tokens source ``g`` sends to replica ``s``
      of expert ``e`` (``[E, S]``, one source's row, when planned with ``source``);
    * ``replica_load [E, S]`` int32: tokens each replica computes;
    * ``rank_load [G]`` int32: tokens each rank computes.
    """

    quota: Any
    replica_load: Any
    rank_load: Any

    @property
    def rank_imbalance(self):
        """``max / mean`` of ``rank_load`` (1.0 when there is no load)."""
        load = self.rank_load.astype(jnp.float32)
        mean = jnp.mean(load)
        return jnp.where(mean > 0, jnp.max(load) / jnp.where(mean > 0, mean, 1.0), 1.0)


def _check(counts, log2phy, logcnt, num_physical):
    counts_shape, table_shape, cnt_shape = np.shape(counts), np.shape(log2phy), np.shape(logcnt)
    if len(counts_shape) != 2:
        raise ValueError(f"counts must have shape [G, E], got {counts_shape}")
    if len(table_shape) != 2 or counts_shape[1] != table_shape[0]:
        raise ValueError(f"log2phy must have shape [E={counts_shape[1]}, S], got {table_shape}")
    if cnt_shape != (table_shape[0],):
        raise ValueError(f"logcnt must have shape [E={table_shape[0]}], got {cnt_shape}")
    counts_dtype = counts.dtype if hasattr(counts, "dtype") else np.asarray(counts).dtype
    if not jnp.issubdtype(counts_dtype, jnp.integer):
        raise ValueError(f"counts must be integers, got dtype {counts_dtype}")
    num_ranks = counts_shape[0]
    if num_ranks < 1 or num_physical < table_shape[0] or num_physical % num_ranks:
        raise ValueError(
            f"num_physical ({num_physical}) must be >= E ({table_shape[0]}) and divisible by G ({num_ranks})"
        )
    if not isinstance(counts, Tracer) and np.any(np.asarray(counts) < 0):
        raise ValueError("counts must be non-negative")


def plan_fixed_quotas(
    counts,
    log2phy,
    logcnt,
    *,
    num_physical: int,
    source=None,
    num_iters: int = DEFAULT_ITERS,
    step_size: float = DEFAULT_STEP,
) -> FixedQuotaPlan:
    """Plans one batch's quotas over the replicas of ``log2phy`` (see the module docstring).

    Args:
      counts: ``[G, E]`` integer tokens each source rank routes to each logical expert.
      log2phy: ``[E, S]`` integer replica slots (``-1`` padded); ``logcnt [E]`` replicas per expert.
      num_physical: ``P`` (static), divisible by ``G``.
      source: ``None`` for every source's quotas ``[G, E, S]``; a (possibly
        traced) rank id for that source's row ``[E, S]`` only.
      num_iters, step_size: the LP iterations (static; see ``lp_shares``).

    Jit-able (static keyword options). Shape errors raise ``ValueError``;
    concrete counts are also checked for negative values.
    """
    _check(counts, log2phy, logcnt, num_physical)
    counts = jnp.maximum(jnp.asarray(counts).astype(jnp.int32), 0)
    log2phy, logcnt = jnp.asarray(log2phy).astype(jnp.int32), jnp.asarray(logcnt).astype(jnp.int32)
    num_ranks = counts.shape[0]
    width = log2phy.shape[1]
    live = jnp.arange(width, dtype=jnp.int32)[None, :] < logcnt[:, None]
    replica_rank = jnp.where(live & (log2phy >= 0), log2phy // (num_physical // num_ranks), -1)  # [E, S]
    ranks = jnp.arange(num_ranks, dtype=jnp.int32)
    on_rank = replica_rank[:, :, None] == ranks[None, None, :]  # [E, S, G]
    first = on_rank & (jnp.cumsum(on_rank.astype(jnp.int32), axis=1) == 1)  # the replica serving its rank
    serving = jnp.any(first, axis=2)  # [E, S]: False for a second replica on a rank

    load = jnp.sum(counts, axis=0)  # [E]
    # A second replica on a rank takes nothing: the LP sees only the serving ones.
    table = jnp.where(serving, log2phy, -1)
    order = jnp.argsort(~serving, axis=1, stable=True)  # serving replicas first, in log2phy order
    packed = jnp.take_along_axis(table, order, axis=1)
    count = jnp.sum(serving, axis=1).astype(jnp.int32)
    shares, _ = lp_shares(
        load,
        packed,
        count,
        num_physical=num_physical,
        num_ranks=num_ranks,
        num_iters=num_iters,
        step_size=step_size,
        unroll=True,
    )
    packed_load = _round_shares(load, shares, count)
    replica_load = jnp.zeros_like(packed_load).at[jnp.arange(load.shape[0])[:, None], order].set(packed_load)
    rank_load = jnp.sum(jnp.where(on_rank, replica_load[:, :, None], 0), axis=(0, 1)).astype(jnp.int32)
    quota = _source_quotas(counts, replica_load, first, source)
    return FixedQuotaPlan(quota=quota, replica_load=replica_load, rank_load=rank_load)


def _round_shares(load, shares, count):
    """``[E, S]`` int32 replica loads: ``load [E]`` split by ``shares`` (cumulative rounding, rows exact)."""
    width = shares.shape[1]
    live = jnp.arange(width, dtype=jnp.int32)[None, :] < count[:, None]
    cum = jnp.cumsum(jnp.where(live, shares, 0.0), axis=1)
    total = jnp.where(load > 0, load, 0).astype(jnp.float32)[:, None]
    edges = jnp.clip(jnp.round(total * cum), 0, total)
    edges = jnp.where(jnp.arange(width)[None, :] >= count[:, None] - 1, total, edges)  # the last live edge: all
    edges = jax.lax.cummax(edges, axis=1).astype(jnp.int32)
    return jnp.diff(edges, axis=1, prepend=jnp.zeros_like(edges[:, :1]))


def _source_quotas(counts, replica_load, first, source):
    """Per-source quotas ``[G, E, S]`` (or source ``source``'s ``[E, S]``), locality first."""
    counts_eg = counts.T  # [E, G]
    local_cap = jnp.sum(jnp.where(first, replica_load[:, :, None], 0), axis=1)  # [E, G]
    local_take = jnp.minimum(counts_eg, local_cap)
    local = jnp.where(first, local_take[:, None, :], 0)  # [E, S, G]: each replica's tokens from its own rank
    rem_src = counts_eg - local_take
    rem_cap = replica_load - jnp.sum(local, axis=2)
    src_hi = jnp.cumsum(rem_src, axis=1)
    cap_hi = jnp.cumsum(rem_cap, axis=1)
    src_lo, cap_lo = src_hi - rem_src, cap_hi - rem_cap
    if source is None:
        overlap = jnp.minimum(src_hi[:, :, None], cap_hi[:, None, :]) - jnp.maximum(
            src_lo[:, :, None], cap_lo[:, None, :]
        )  # [E, G, S]
        quota = jnp.maximum(overlap, 0) + jnp.transpose(local, (0, 2, 1))
        return jnp.transpose(quota, (1, 0, 2)).astype(jnp.int32)
    source = jnp.asarray(source, jnp.int32)
    pick = lambda a: jax.lax.dynamic_index_in_dim(a, source, axis=a.ndim - 1, keepdims=False)
    overlap = jnp.minimum(pick(src_hi)[:, None], cap_hi) - jnp.maximum(pick(src_lo)[:, None], cap_lo)
    return (jnp.maximum(overlap, 0) + pick(local)).astype(jnp.int32)


def batch_quotas(ids, log2phy, logcnt, *, axis_name, num_physical: int, num_iters: int = DEFAULT_ITERS):
    """This EP rank's quotas ``[E, S]`` for its router ids ``[T, k]``, inside ``shard_map`` over ``axis_name``.

    Counts this rank's entries per expert (ids outside ``[0, E)`` -- padding --
    are not counted), all-gathers the counts over ``axis_name`` (``G * E``
    int32), plans with :func:`plan_fixed_quotas` and returns this rank's row,
    for ``map_and_count(ids, log2phy, logcnt, mode="quota", quotas=...)``.
    """
    num_logical = log2phy.shape[0]
    flat = ids.reshape(-1)
    inside = (flat >= 0) & (flat < num_logical)
    local = jnp.zeros((num_logical,), jnp.int32).at[jnp.where(inside, flat, num_logical)].add(1, mode="drop")
    counts = jax.lax.all_gather(local, axis_name)  # [G, E]
    rank = jax.lax.axis_index(axis_name)
    return plan_fixed_quotas(counts, log2phy, logcnt, num_physical=num_physical, source=rank, num_iters=num_iters).quota

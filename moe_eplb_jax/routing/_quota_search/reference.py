"""The ``"xla"`` quota search: the orders as XLA ops and a ``lax.scan`` walk over the ranks per round.

The oracle of the kernel (:mod:`._triton`), which shares :func:`candidates` and :func:`step` with it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["candidates", "fill_layout", "prepare", "search_reference", "step"]


def candidates(lo, hi, steps, search_width):
    """``lo + floor((hi - lo) * k / (K - 1))`` for ``k`` in ``steps``, without the int32 overflow of the product."""
    span = jnp.maximum(hi - lo, 0)
    quotient, remainder = span // (search_width - 1), span % (search_width - 1)
    return lo + quotient * steps + (remainder * steps) // (search_width - 1)


def step(x, j, cnt, bad, supply, window, num_spare, min_replica_tokens, max_replicas):
    """One supply rank for every candidate; ``window [S][C]`` are ``d_pad[j + o]`` for ``o < S``.

    ``window[-1]`` is the cap. Returns the new ``(x, j, cnt, bad)``; ``cnt`` is the
    number of ranks that already took a piece of demand ``j``.
    """
    end = jnp.minimum(x + supply, window[-1])
    passed = jnp.zeros_like(j)
    cnt_next = jnp.zeros_like(cnt)
    lower = x
    for o in range(num_spare):
        piece = jnp.minimum(window[o], end) - lower
        taken = piece > 0
        held_before = cnt if o == 0 else jnp.zeros_like(cnt)
        bad = bad | (taken & ((piece < min_replica_tokens) | (held_before + 1 > max_replicas - 1)))
        # If the rank stops inside demand j + o, that demand continues with one more holder when it took a piece.
        cnt_next = jnp.where(passed == o, held_before + taken.astype(cnt.dtype), cnt_next)
        passed = passed + (window[o] <= end).astype(j.dtype)
        lower = window[o]
    cnt_next = jnp.where(passed == num_spare, 0, cnt_next)
    return end, j + passed, cnt_next, bad


def fill_layout(d_pad, supply, j0, *, num_spare: int, min_replica_tokens: int, max_replicas: int):
    """Walks the supply ranks for ``C`` candidates at once (``lax.scan``).

    ``d_pad [C, n + S]`` int32: cumulative demand boundaries in demand order
    (non-decreasing), followed by ``S = num_spare`` copies of the total;
    ``supply [C, G]`` int32 slack of each rank in supply order; ``j0 [C]`` int32
    the index of the first demand with tokens. Returns ``(s_lo [C, G], x_end [C],
    ok [C])``: where each rank's interval starts on the demand axis, where the
    last one ends, and whether every piece is at least ``min_replica_tokens`` and
    no demand is split over more than ``max_replicas - 1`` ranks (the caller
    checks that ``x_end`` reached the total).
    """
    offsets = jnp.arange(num_spare, dtype=jnp.int32)

    def body(carry, s):
        x, j, cnt, bad = carry
        index = jnp.minimum(j[:, None] + offsets[None, :], d_pad.shape[1] - 1)
        win = jnp.take_along_axis(d_pad, index, axis=1)  # [C, S]
        window = [win[:, o] for o in range(num_spare)]
        return step(x, j, cnt, bad, s, window, num_spare, min_replica_tokens, max_replicas), x

    zeros = jnp.zeros_like(j0)
    (x_end, _, _, bad), s_lo = jax.lax.scan(body, (zeros, j0, zeros, jnp.zeros(j0.shape, bool)), supply.T)
    return s_lo.T, x_end, ~bad


def prepare(load, num_home):
    """The target-independent orders the search needs (pairwise compares and one sort), from ``load [E]``.

    Returns ``home_load [G]``, ``rank_position [G]`` (each rank's
    place in the supply order: most slack, i.e. least home load, first; ties:
    lower rank first) and, in *demand order*, ``demand_rank``, ``demand_before``,
    ``demand_load`` and ``demand_expert`` (each ``[E]``): the home rank of each
    entry, the load of the hotter experts on that rank, the entry's own load and
    its expert id.
    """
    num_ranks = load.shape[0] // num_home
    ranks = jnp.arange(num_ranks, dtype=jnp.int32)
    per_rank = load.reshape(num_ranks, num_home)
    home_load = jnp.sum(per_rank, axis=1)  # [G]
    # Each rank offloads its hottest experts first (ties: lower expert id first).
    # hotter[g, i, j]: expert j of rank g goes before expert i of rank g.
    slot = jnp.arange(num_home, dtype=jnp.int32)
    mine, other = per_rank[:, :, None], per_rank[:, None, :]
    hotter = (other > mine) | ((other == mine) & (slot[None, None, :] < slot[None, :, None]))
    before = jnp.sum(jnp.where(hotter, other, 0), axis=2).reshape(-1)  # load of hotter experts on the same rank
    hot_index = (ranks[:, None] * num_home + jnp.sum(hotter.astype(jnp.int32), axis=2)).reshape(-1)
    rank_of = jnp.repeat(ranks, num_home)
    less = (home_load[None, :] < home_load[:, None]) | (
        (home_load[None, :] == home_load[:, None]) & (ranks[None, :] < ranks[:, None])
    )
    rank_position = jnp.sum(less.astype(jnp.int32), axis=1)
    # Demands are laid out largest first as measured at the lowest target, ceil(mean), where every demand is
    # at its largest (ties: hot order, rank by rank); that one order serves every target (a demand only shrinks
    # as the target grows).
    lowest = (jnp.sum(home_load) + num_ranks - 1) // num_ranks
    at_lowest = demand(lowest[None], home_load, rank_of, before, load)[0]
    experts = jnp.arange(load.shape[0], dtype=jnp.int32)
    _, _, order = jax.lax.sort((-at_lowest, hot_index, experts), num_keys=2)
    return home_load, rank_position, rank_of[order], before[order], load[order], order


def demand(targets, home_load, rank, before, load):
    """``[C, E]`` demand of every entry at each of ``targets [C]``: its rank's excess less the hotter experts' load."""
    excess = jnp.maximum(home_load[None, :] - targets[:, None], 0)  # [C, G]
    return jnp.clip(excess[:, rank] - before[None, :], 0, load[None, :])


def layouts(cand, home_load, demands, num_spare, min_replica_tokens, max_replicas):
    """Lays demands (demand order) against supplies (most slack first) for every target in ``cand [C]``.

    ``demands`` is ``(demand_rank, demand_before, demand_load)`` from
    :func:`prepare`. Returns ``(d_hi [C, E], s_lo [C, G], x_end [C], ok [C])``:
    where each demand ends and each supply rank starts on the shared token axis,
    where the last rank ends, and whether the plan at that target is feasible
    (every demand found room, pieces and replica counts within limits; see
    the package docstring).
    """
    d_hi = jnp.cumsum(demand(cand, home_load, *demands), axis=1)
    total = d_hi[:, -1:]
    d_pad = jnp.concatenate([d_hi, jnp.broadcast_to(total, (cand.shape[0], num_spare))], axis=1)
    supply = jnp.maximum(cand[:, None] - jnp.sort(home_load)[None, :], 0)  # most slack first
    j0 = jnp.sum((d_hi <= 0).astype(jnp.int32), axis=1)
    s_lo, x_end, ok = fill_layout(
        d_pad, supply, j0, num_spare=num_spare, min_replica_tokens=min_replica_tokens, max_replicas=max_replicas
    )
    return d_hi, s_lo, x_end, ok & (x_end >= total[:, 0])


def search_layout(home_load, demands, num_spare, min_replica_tokens, max_replicas, search_rounds, search_width):
    """The smallest feasible target the K-ary search finds, and its layout ``(d_hi [E], s_lo [G], x_end)``."""
    total = jnp.sum(home_load)
    num_ranks = home_load.shape[0]
    lo = (total + num_ranks - 1) // num_ranks  # no plan beats the mean
    hi = jnp.max(home_load)  # nothing moves: always feasible
    opts = dict(num_spare=num_spare, min_replica_tokens=min_replica_tokens, max_replicas=max_replicas)
    steps = jnp.arange(0, search_width, dtype=jnp.int32)
    for _ in range(search_rounds):
        # Integer grid lo + (hi - lo) * k / (K - 1), k = 0..K-1: both ends included; hi is known to be feasible.
        cand = candidates(lo, hi, steps, search_width)
        *layout, ok = layouts(cand, home_load, demands, **opts)
        first = jnp.argmax(ok | (steps == search_width - 1))
        new_hi = cand[first]
        new_lo = jnp.where(first > 0, cand[jnp.maximum(first - 1, 0)] + 1, new_hi)
        lo, hi = jnp.minimum(new_lo, new_hi), new_hi
        chosen = [a[first] for a in layout]  # the layout at hi, feasible (hi is never re-derived)
    return hi, chosen


def search_reference(
    load,
    *,
    num_home: int,
    num_spare: int,
    min_replica_tokens: int,
    max_replicas: int,
    search_rounds: int,
    search_width: int,
):
    """``(target, d_hi [E], s_lo [G], x_end, demand_expert [E], rank_position [G])`` as ``search_pallas``."""
    home_load, rank_position, *demands, demand_expert = prepare(load, num_home)
    target, (d_hi, s_lo, x_end) = search_layout(
        home_load, demands, num_spare, min_replica_tokens, max_replicas, search_rounds, search_width
    )
    return target, d_hi, s_lo, x_end, demand_expert, rank_position

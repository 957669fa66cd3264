"""The sequential part of the quota search: laying demands against supplies.

For a target ``T``, demands (in demand order) end at the cumulative boundaries
``d_hi`` on one token axis; supply ranks (most slack first) follow each other
on the same axis. A rank starting at position ``x`` inside demand ``j``
(``j = #{boundaries <= x}``) ends at ``min(x + supply, d_pad[j + S - 1])``
(``d_pad`` is ``d_hi`` followed by ``S`` copies of the total): it takes at most
``S`` experts and stops at a demand boundary rather than start another. The walk
over the ranks also checks the plan it lays out, so no ``[C, E, G]`` table is
needed: every piece (one rank's share of one demand) must hold at least
``min_replica_tokens`` tokens and no demand may be split over more than
``max_replicas - 1`` ranks (the ``S``-expert limit per rank holds by
construction).

Two implementations give the same integers:

* ``"xla"``: :func:`fill_layout`, a ``lax.scan`` over the ranks for ``C``
  candidate targets at once, called once per search round (on GPU every step
  of the scan is a few kernel launches);
* ``"pallas"``: :func:`search_pallas`, the WHOLE search (every round: candidate
  grid, demands, their cumulative sums, the walk, the pick of the smallest
  feasible candidate) in one Triton kernel with the candidates as one vector.
  Under ``vmap`` the batch becomes the kernel's grid. Off GPU it runs in Pallas
  interpret mode (slowly; for tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["fill_layout", "search_pallas", "candidates", "IMPLEMENTATIONS", "default_implementation"]

IMPLEMENTATIONS = ("xla", "pallas")


def default_implementation() -> str:
    """``"pallas"`` on GPU, ``"xla"`` elsewhere."""
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def candidates(lo, hi, steps, search_width):
    """``lo + floor((hi - lo) * k / (K - 1))`` for ``k`` in ``steps``, without the int32 overflow of the product."""
    span = jnp.maximum(hi - lo, 0)
    quotient, remainder = span // (search_width - 1), span % (search_width - 1)
    return lo + quotient * steps + (remainder * steps) // (search_width - 1)


def _step(x, j, cnt, bad, supply, window, num_spare, min_replica_tokens, max_replicas):
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
        return _step(x, j, cnt, bad, s, window, num_spare, min_replica_tokens, max_replicas), x

    zeros = jnp.zeros_like(j0)
    (x_end, _, _, bad), s_lo = jax.lax.scan(body, (zeros, j0, zeros, jnp.zeros(j0.shape, bool)), supply.T)
    return s_lo.T, x_end, ~bad


# --------------------------------------------------------------------------- the whole search in one kernel


def _search_kernel(base_ref, load_ref, home_ref, bounds_ref, target_ref, first_ref, d_ref, s_lo_ref, x_end_ref, *,
                   lanes, search_width, search_rounds, num_entries, chunk, num_ranks, num_spare, min_replica_tokens,
                   max_replicas, barrier):
    """One program per batch element; the ``lanes`` candidates of a round are one vector.

    ``d_ref`` rows (one per lane, ``num_entries + S`` wide) are written in chunks
    and then gathered by the walk: a block barrier separates the two.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    b = pl.program_id(0)
    k = jnp.arange(lanes, dtype=jnp.int32)
    steps = jnp.minimum(k, search_width - 1)  # extra lanes repeat the last candidate and are never chosen
    width = num_entries + num_spare
    row = b * (lanes * width) + k * width
    lo = bounds_ref[b * 2]
    hi = bounds_ref[b * 2 + 1]
    x = jnp.zeros((lanes,), jnp.int32)
    for round_index in range(search_rounds):
        cand = candidates(lo, hi, steps, search_width)
        # Demands at every candidate and their running sums, chunk by chunk along the demand order.
        total = jnp.zeros((lanes,), jnp.int32)
        j0 = jnp.zeros((lanes,), jnp.int32)
        for start in range(0, num_entries, chunk):
            cols = start + jnp.arange(chunk, dtype=jnp.int32)
            base = base_ref[b * num_entries + cols]
            cap = load_ref[b * num_entries + cols]
            demand = jnp.clip(base[None, :] - cand[:, None], 0, cap[None, :])
            ends = jnp.cumsum(demand, axis=1) + total[:, None]
            d_ref[row[:, None] + cols[None, :]] = ends
            j0 = j0 + jnp.sum((ends <= 0).astype(jnp.int32), axis=1)
            total = jnp.max(ends, axis=1)  # running sums never decrease
        for o in range(num_spare):
            d_ref[row + num_entries + o] = total
        if barrier:
            plgpu.debug_barrier()

        def body(r, carry):
            x, j, cnt, bad = carry
            supply = jnp.maximum(cand - home_ref[b * num_ranks + r], 0)
            window = [d_ref[row + jnp.minimum(j + o, width - 1)] for o in range(num_spare)]
            plgpu.store(s_lo_ref.at[pl.ds((b * num_ranks + r) * lanes, lanes)], x)
            return _step(x, j, cnt, bad, supply, window, num_spare, min_replica_tokens, max_replicas)

        zeros = jnp.zeros((lanes,), jnp.int32)
        x, _, _, bad = jax.lax.fori_loop(0, num_ranks, body, (zeros, j0, zeros, zeros < 0))
        ok = ~bad & (x >= total) & (k < search_width)
        first = jnp.min(jnp.where(ok | (k == search_width - 1), k, lanes))
        new_hi = jnp.sum(jnp.where(k == first, cand, 0))
        new_lo = jnp.where(first > 0, jnp.sum(jnp.where(k == first - 1, cand, 0)) + 1, new_hi)
        lo, hi = jnp.minimum(new_lo, new_hi), new_hi
        if barrier and round_index + 1 < search_rounds:
            plgpu.debug_barrier()  # every lane's gathers are done before the next round rewrites d_ref
    plgpu.store(target_ref.at[pl.ds(b * lanes, lanes)], jnp.full((lanes,), hi, jnp.int32))
    plgpu.store(first_ref.at[pl.ds(b * lanes, lanes)], jnp.full((lanes,), first, jnp.int32))
    plgpu.store(x_end_ref.at[pl.ds(b * lanes, lanes)], x)


def _search_batched(base, load, home_sorted, bounds, *, num_spare, min_replica_tokens, max_replicas, search_rounds,
                    search_width, interpret):
    """``[B, ...]`` inputs, one program each; returns ``target [B]``, ``d_hi [B, E]``, ``s_lo [B, G]``, ``x_end [B]``."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    batch, num_entries = base.shape
    num_ranks = home_sorted.shape[1]
    lanes = max(int(pl.next_power_of_2(search_width)), 16)
    chunk = min(64, max(int(pl.next_power_of_2(num_entries)), 16))
    padded = -(-num_entries // chunk) * chunk
    if padded != num_entries:  # empty demands at the end change nothing
        base = jnp.pad(base, ((0, 0), (0, padded - num_entries)))
        load = jnp.pad(load, ((0, 0), (0, padded - num_entries)))
    width = padded + num_spare
    kernel = functools.partial(
        _search_kernel, lanes=lanes, search_width=search_width, search_rounds=search_rounds, num_entries=padded,
        chunk=chunk, num_ranks=num_ranks, num_spare=num_spare, min_replica_tokens=min_replica_tokens,
        max_replicas=max_replicas, barrier=not interpret)
    whole = pl.no_block_spec
    target, first, d_pad, s_lo, x_end = pl.pallas_call(
        kernel,
        grid=(batch,),
        in_specs=[whole] * 4,
        out_specs=[whole] * 5,
        out_shape=[jax.ShapeDtypeStruct((batch * lanes,), jnp.int32),
                   jax.ShapeDtypeStruct((batch * lanes,), jnp.int32),
                   jax.ShapeDtypeStruct((batch * lanes * width,), jnp.int32),
                   jax.ShapeDtypeStruct((batch * num_ranks * lanes,), jnp.int32),
                   jax.ShapeDtypeStruct((batch * lanes,), jnp.int32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="quota_search",
    )(base.reshape(-1), load.reshape(-1), home_sorted.reshape(-1), bounds.reshape(-1))
    first = first.reshape(batch, lanes)[:, 0]
    rows = jnp.arange(batch)
    d_hi = d_pad.reshape(batch, lanes, width)[rows, first, :num_entries]
    s_lo = s_lo.reshape(batch, num_ranks, lanes)[rows, :, first]
    return target.reshape(batch, lanes)[:, 0], d_hi, s_lo, x_end.reshape(batch, lanes)[rows, first]


@functools.lru_cache(maxsize=None)
def _search_fn(num_spare, min_replica_tokens, max_replicas, search_rounds, search_width, interpret):
    batched = functools.partial(_search_batched, num_spare=num_spare, min_replica_tokens=min_replica_tokens,
                                max_replicas=max_replicas, search_rounds=search_rounds, search_width=search_width,
                                interpret=interpret)

    @jax.custom_batching.custom_vmap
    def search(base, load, home_sorted, bounds):
        target, d_hi, s_lo, x_end = batched(base[None], load[None], home_sorted[None], bounds[None])
        return target[0], d_hi[0], s_lo[0], x_end[0]

    @search.def_vmap
    def _rule(axis_size, in_batched, *args):
        args = [a if batched_arg else jnp.broadcast_to(a, (axis_size,) + a.shape)
                for a, batched_arg in zip(args, in_batched)]
        return _vmapped(*args), (True, True, True, True)

    @jax.custom_batching.custom_vmap
    def _vmapped(base, load, home_sorted, bounds):
        return batched(base, load, home_sorted, bounds)

    @_vmapped.def_vmap
    def _nested(axis_size, in_batched, *args):  # vmap of vmap: fold the outer axis into the batch
        args = [a if batched_arg else jnp.broadcast_to(a, (axis_size,) + a.shape)
                for a, batched_arg in zip(args, in_batched)]
        inner = args[0].shape[1]
        out = _vmapped(*[a.reshape((axis_size * inner,) + a.shape[2:]) for a in args])
        return tuple(o.reshape((axis_size, inner) + o.shape[1:]) for o in out), (True, True, True, True)

    return search


def search_pallas(base, load, home_sorted, lo, hi, *, num_spare: int, min_replica_tokens: int, max_replicas: int,
                  search_rounds: int, search_width: int, interpret: bool | None = None):
    """The whole K-ary search in one kernel.

    ``base [E]`` and ``load [E]`` int32, in demand order: an entry's demand at
    target ``T`` is ``clip(base - T, 0, load)`` (``base`` is its rank's home load
    less the load of hotter experts on that rank); ``home_sorted [G]`` int32 home
    loads in supply order (a rank's supply is ``max(T - home, 0)``); ``lo``/``hi``
    int32 scalars, the first round's range (``hi`` feasible). Returns
    ``(target, d_hi [E], s_lo [G], x_end)``: the smallest feasible target found
    and its layout, equal to the ``"xla"`` search integer for integer.
    """
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    bounds = jnp.stack([lo, hi]).astype(jnp.int32)
    search = _search_fn(num_spare, min_replica_tokens, max_replicas, search_rounds, search_width, bool(interpret))
    return search(base.astype(jnp.int32), load.astype(jnp.int32), home_sorted.astype(jnp.int32), bounds)

"""The Pallas (Triton) quota search: the orders and every search round in one kernel (see the package)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from moe_eplb_jax.routing._quota_search.config import Config
from moe_eplb_jax.routing._quota_search.reference import candidates, step

__all__ = ["search_pallas"]


def _chunk(rows, length):
    """Columns per step of a ``[rows, chunk]`` tile: at most 64, and about 16K elements per tile (registers)."""
    return int(min(64, length, max(16, 16384 // rows)))


def _prepare_in_kernel(
    b,
    p,
    load_ref,
    home_ref,
    key_ref,
    hot_ref,
    base_ref,
    dload_ref,
    expert_ref,
    position_ref,
    home_sorted_ref,
    *,
    entry_lanes,
    num_experts,
    rank_lanes,
    num_ranks,
    num_home,
    barrier,
):
    """The target-independent orders (as ``reference.prepare``), from ``load [E]`` in expert-id order.

    Writes the entries in demand order (``base_ref``, ``dload_ref``, ``expert_ref``),
    each rank's supply position (``position_ref``) and the home loads in supply
    order (``home_sorted_ref``). ``home_ref``, ``key_ref`` and ``hot_ref`` are
    scratch, read back by other threads after a barrier. ``b`` indexes the
    batch element's loads, ``p`` the program's own rows of every other ref. Padding entries (id >=
    E) sort last with no load; padding ranks sort last and are never walked.
    Returns the search range: ``ceil(mean)`` and the largest home load.
    """
    from jax.experimental.pallas import triton as plgpu  # here: Pallas' Triton backend may be missing

    def sync():
        if barrier:
            plgpu.debug_barrier()

    chunk = _chunk(entry_lanes, entry_lanes)
    e = jnp.arange(entry_lanes, dtype=jnp.int32)
    g = jnp.arange(rank_lanes, dtype=jnp.int32)
    real_e, real_g = e < num_experts, g < num_ranks
    load = load_ref[b * entry_lanes + e]  # zero for padding entries
    home = jnp.zeros((rank_lanes,), jnp.int32)
    for start in range(0, entry_lanes, chunk):
        cols = start + jnp.arange(chunk, dtype=jnp.int32)
        part = load_ref[b * entry_lanes + cols]
        home = home + jnp.sum(jnp.where((cols[None, :] // num_home) == g[:, None], part[None, :], 0), axis=1)
    home = jnp.where(real_g, home, np.iinfo(np.int32).max)  # padding ranks: least slack, never walked
    home_ref[p * rank_lanes + g] = home
    # Hotter experts of the same rank: higher load, or as loaded with a lower id.
    rank = jnp.minimum(e // num_home, num_ranks - 1)
    before = jnp.zeros_like(e)
    hotter = jnp.zeros_like(e)
    for t in range(num_home):
        other = load_ref[b * entry_lanes + jnp.minimum(rank * num_home + t, entry_lanes - 1)]
        hot = real_e & ((other > load) | ((other == load) & (t < e % num_home)))
        before = before + jnp.where(hot, other, 0)
        hotter = hotter + hot.astype(jnp.int32)
    hot_index = jnp.where(real_e, rank * num_home + hotter, e)
    sync()
    # Supply order: least home load first (ties: lower rank first).
    position = jnp.zeros_like(g)
    for start in range(0, rank_lanes, _chunk(rank_lanes, rank_lanes)):
        cols = start + jnp.arange(_chunk(rank_lanes, rank_lanes), dtype=jnp.int32)
        other = home_ref[p * rank_lanes + cols]
        less = (other[None, :] < home[:, None]) | ((other[None, :] == home[:, None]) & (cols[None, :] < g[:, None]))
        position = position + jnp.sum(less.astype(jnp.int32), axis=1)
    position_ref[p * rank_lanes + g] = position
    home_sorted_ref[p * rank_lanes + position] = home
    total = jnp.sum(jnp.where(real_g, home, 0))
    lowest = (total + num_ranks - 1) // num_ranks
    home_e = home_ref[p * rank_lanes + rank]
    # Demand order: largest demand at the lowest target first (ties: hot order); padding entries last.
    at_lowest = jnp.where(real_e, jnp.clip(jnp.maximum(home_e - lowest, 0) - before, 0, load), -1)
    key_ref[p * entry_lanes + e] = at_lowest
    hot_ref[p * entry_lanes + e] = hot_index
    sync()
    order = jnp.zeros_like(e)
    for start in range(0, entry_lanes, chunk):
        cols = start + jnp.arange(chunk, dtype=jnp.int32)
        key, tie = key_ref[p * entry_lanes + cols], hot_ref[p * entry_lanes + cols]
        ahead = (key[None, :] > at_lowest[:, None]) | (
            (key[None, :] == at_lowest[:, None]) & (tie[None, :] < hot_index[:, None])
        )
        order = order + jnp.sum(ahead.astype(jnp.int32), axis=1)
    base_ref[p * entry_lanes + order] = jnp.where(real_e, home_e - before, 0)
    dload_ref[p * entry_lanes + order] = load
    expert_ref[p * entry_lanes + order] = e
    sync()
    return lowest, jnp.max(jnp.where(real_g, home, 0))


def _write_demands(d_ref, base_ref, dload_ref, cand, row, program, *, num_entries, num_spare, chunk):
    """Demands at every candidate and their running sums, chunk by chunk along the demand order, into each lane's
    ``d_ref`` row (its spare columns hold the total) -> ``(j0, total)``: per lane, the entries whose running sum is
    still 0, and the total demand."""
    lanes = cand.shape[0]
    total = jnp.zeros((lanes,), jnp.int32)
    j0 = jnp.zeros((lanes,), jnp.int32)
    for start in range(0, num_entries, chunk):
        cols = start + jnp.arange(chunk, dtype=jnp.int32)
        base = base_ref[program * num_entries + cols]
        cap = dload_ref[program * num_entries + cols]
        demand = jnp.clip(base[None, :] - cand[:, None], 0, cap[None, :])
        ends = jnp.cumsum(demand, axis=1) + total[:, None]
        d_ref[row[:, None] + cols[None, :]] = ends
        j0 = j0 + jnp.sum((ends <= 0).astype(jnp.int32), axis=1)
        total = jnp.max(ends, axis=1)  # running sums never decrease
    for o in range(num_spare):
        d_ref[row + num_entries + o] = total
    return j0, total


def _search_kernel(
    load_ref,
    cand_ref,
    ok_ref,
    d_ref,
    s_lo_ref,
    x_end_ref,
    expert_ref,
    position_ref,
    home_ref,
    key_ref,
    hot_ref,
    base_ref,
    dload_ref,
    home_sorted_ref,
    *,
    lanes,
    num_chunks,
    search_width,
    search_rounds,
    num_experts,
    num_home,
    entry_lanes,
    num_ranks,
    rank_lanes,
    num_spare,
    min_replica_tokens,
    max_replicas,
    barrier,
):
    """One program per (batch element, chunk of ``lanes`` candidates): the orders, then every round.

    With one chunk, the rounds before the last pick their smallest feasible
    candidate in the kernel (all candidates are this program's lanes); with
    several chunks there is one round and each program walks its own slice of
    the candidate grid, in parallel. Either way the last round's candidates,
    their feasibility and layouts are written per lane and the caller picks.
    ``d_ref`` rows (one per candidate, ``entry_lanes + S`` wide) are written in
    chunks and then gathered by the walk: a block barrier separates the two.
    """
    from jax.experimental.pallas import triton as plgpu  # here: Pallas' Triton backend may be missing

    b, chunk_index = pl.program_id(0), pl.program_id(1)
    program = b * num_chunks + chunk_index  # this program's rows of the order refs
    lo, hi = _prepare_in_kernel(
        b,
        program,
        load_ref,
        home_ref,
        key_ref,
        hot_ref,
        base_ref,
        dload_ref,
        expert_ref,
        position_ref,
        home_sorted_ref,
        entry_lanes=entry_lanes,
        num_experts=num_experts,
        rank_lanes=rank_lanes,
        num_ranks=num_ranks,
        num_home=num_home,
        barrier=barrier,
    )
    num_entries = entry_lanes
    all_lanes = lanes * num_chunks
    chunk = _chunk(lanes, entry_lanes)
    k = chunk_index * lanes + jnp.arange(lanes, dtype=jnp.int32)  # candidate index on the grid
    steps = jnp.minimum(k, search_width - 1)  # extra lanes repeat the last candidate and are never chosen
    width = num_entries + num_spare
    row = b * (all_lanes * width) + k * width
    x = jnp.zeros((lanes,), jnp.int32)
    ok = k < 0
    cand = steps
    for round_index in range(search_rounds):
        cand = candidates(lo, hi, steps, search_width)
        j0, total = _write_demands(
            d_ref, base_ref, dload_ref, cand, row, program, num_entries=num_entries, num_spare=num_spare, chunk=chunk
        )
        if barrier:
            plgpu.debug_barrier()

        # The walk is a chain of G dependent steps, so each step's loads are issued one step early: at step r the
        # boundaries d[j_r + o], o < 2S, which hold step r + 1's window whatever the step passes (at most S
        # demands), and the next rank's home load. A step then waits on arithmetic, not on a load's latency.
        def gather(j):
            return [d_ref[row + jnp.minimum(j + o, width - 1)] for o in range(2 * num_spare)]

        def home_at(r):
            return home_sorted_ref[program * rank_lanes + jnp.minimum(r, num_ranks - 1)]

        def body(r, carry):
            x, j, cnt, bad, ahead, passed, home = carry
            loaded, home_next = gather(j), home_at(r + 1)  # in flight during this step
            window = [ahead[o] for o in range(num_spare)]
            for shift in range(1, num_spare + 1):  # d[j + o] = ahead[passed + o], passed = the last step's advance
                window = [jnp.where(passed == shift, ahead[shift + o], window[o]) for o in range(num_spare)]
            supply = jnp.maximum(cand - home, 0)  # the r-th rank in supply order
            plgpu.store(s_lo_ref.at[pl.ds((b * num_ranks + r) * all_lanes + chunk_index * lanes, lanes)], x)
            x_new, j_new, cnt, bad = step(x, j, cnt, bad, supply, window, num_spare, min_replica_tokens, max_replicas)
            return x_new, j_new, cnt, bad, loaded, j_new - j, home_next

        zeros = jnp.zeros((lanes,), jnp.int32)
        carry = (zeros, j0, zeros, zeros < 0, gather(j0), zeros, home_at(0))
        x, _, _, bad, *_ = jax.lax.fori_loop(0, num_ranks, body, carry)
        ok = ~bad & (x >= total) & (k < search_width)
        if round_index + 1 < search_rounds:  # one chunk only (checked by the caller): all candidates are here
            first = jnp.min(jnp.where(ok | (k == search_width - 1), k, lanes))
            new_hi = jnp.sum(jnp.where(k == first, cand, 0))
            new_lo = jnp.where(first > 0, jnp.sum(jnp.where(k == first - 1, cand, 0)) + 1, new_hi)
            lo, hi = jnp.minimum(new_lo, new_hi), new_hi
            if barrier:
                plgpu.debug_barrier()  # every lane's gathers are done before the next round rewrites d_ref
    lane_slice = pl.ds(b * all_lanes + chunk_index * lanes, lanes)
    plgpu.store(cand_ref.at[lane_slice], cand)
    plgpu.store(ok_ref.at[lane_slice], ok.astype(jnp.int32))
    plgpu.store(x_end_ref.at[lane_slice], x)


def _search_batched(
    load, *, num_home, num_spare, min_replica_tokens, max_replicas, search_rounds, search_width, interpret, config
):
    """``load [B, E]``; one program per batch element and chunk of candidates.

    Returns ``target [B]``, ``d_hi [B, E]``, ``s_lo [B, G]``, ``x_end [B]``,
    ``demand_expert [B, E]`` and ``rank_position [B, G]``.
    """
    from jax.experimental.pallas import triton as plgpu  # here: Pallas' Triton backend may be missing

    batch, num_experts = load.shape
    num_ranks = num_experts // num_home
    all_lanes = max(int(pl.next_power_of_2(search_width)), 16)
    lanes = all_lanes
    if search_rounds == 1:  # every candidate is independent: split the grid over programs
        lanes = min(all_lanes, config.lanes)
    num_chunks = all_lanes // lanes
    entry_lanes = max(int(pl.next_power_of_2(num_experts)), 16)
    rank_lanes = max(int(pl.next_power_of_2(num_ranks)), 16)
    load = jnp.pad(load, ((0, 0), (0, entry_lanes - num_experts)))  # padding entries carry no load
    width = entry_lanes + num_spare
    kernel = functools.partial(
        _search_kernel,
        lanes=lanes,
        num_chunks=num_chunks,
        search_width=search_width,
        search_rounds=search_rounds,
        num_experts=num_experts,
        num_home=num_home,
        entry_lanes=entry_lanes,
        num_ranks=num_ranks,
        rank_lanes=rank_lanes,
        num_spare=num_spare,
        min_replica_tokens=min_replica_tokens,
        max_replicas=max_replicas,
        barrier=not interpret,
    )
    whole = pl.no_block_spec
    int32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    programs = batch * num_chunks
    outs = [
        int32((batch * all_lanes,)),
        int32((batch * all_lanes,)),
        int32((batch * all_lanes * width,)),
        int32((batch * num_ranks * all_lanes,)),
        int32((batch * all_lanes,)),
        int32((programs * entry_lanes,)),
        int32((programs * rank_lanes,)),
    ]
    scratch = (
        [int32((programs * rank_lanes,))] + [int32((programs * entry_lanes,))] * 4 + [int32((programs * rank_lanes,))]
    )
    cand, ok, d_pad, s_lo, x_end, expert, position, *_ = pl.pallas_call(
        kernel,
        grid=(batch, num_chunks),
        in_specs=[whole],
        out_specs=[whole] * (len(outs) + len(scratch)),
        out_shape=outs + scratch,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
        interpret=interpret,
        name="quota_search",
    )(load.reshape(-1))
    # The pick: the smallest feasible candidate of the last round (the grid's last point, known feasible, if none).
    k = jnp.arange(all_lanes, dtype=jnp.int32)
    ok = (ok.reshape(batch, all_lanes) > 0) | (k == search_width - 1)[None, :]
    first = jnp.argmax(ok, axis=1).astype(jnp.int32)
    rows = jnp.arange(batch)
    target = cand.reshape(batch, all_lanes)[rows, first]
    d_hi = d_pad.reshape(batch, all_lanes, width)[rows, first, :num_experts]
    s_lo = s_lo.reshape(batch, num_ranks, all_lanes)[rows, :, first]
    expert = expert.reshape(batch, num_chunks, entry_lanes)[:, 0, :num_experts]  # every chunk computed the same
    position = position.reshape(batch, num_chunks, rank_lanes)[:, 0, :num_ranks]
    return target, d_hi, s_lo, x_end.reshape(batch, all_lanes)[rows, first], expert, position


@functools.cache
def _search_fn(num_home, num_spare, min_replica_tokens, max_replicas, search_rounds, search_width, interpret, config):
    batched = functools.partial(
        _search_batched,
        num_home=num_home,
        num_spare=num_spare,
        min_replica_tokens=min_replica_tokens,
        max_replicas=max_replicas,
        search_rounds=search_rounds,
        search_width=search_width,
        interpret=interpret,
        config=config,
    )
    num_out = 6

    @jax.custom_batching.custom_vmap
    def search(load):
        return tuple(o[0] for o in batched(load[None]))

    @search.def_vmap
    def _rule(axis_size, in_batched, *args):
        args = [
            a if batched_arg else jnp.broadcast_to(a, (axis_size,) + a.shape)
            for a, batched_arg in zip(args, in_batched)
        ]
        return _vmapped(*args), (True,) * num_out

    @jax.custom_batching.custom_vmap
    def _vmapped(load):
        return batched(load)

    @_vmapped.def_vmap
    def _nested(axis_size, in_batched, *args):  # vmap of vmap: fold the outer axis into the batch
        args = [
            a if batched_arg else jnp.broadcast_to(a, (axis_size,) + a.shape)
            for a, batched_arg in zip(args, in_batched)
        ]
        inner = args[0].shape[1]
        out = _vmapped(*[a.reshape((axis_size * inner,) + a.shape[2:]) for a in args])
        return tuple(o.reshape((axis_size, inner) + o.shape[1:]) for o in out), (True,) * num_out

    return search


def search_pallas(
    load,
    *,
    num_home: int,
    num_spare: int,
    min_replica_tokens: int,
    max_replicas: int,
    search_rounds: int,
    search_width: int,
    interpret: bool | None = None,
    config: Config | None = None,
):
    """The orders and the whole K-ary search in one kernel (``config``: its tiling, default :class:`Config`).

    ``load [E]`` int32: each expert's load (expert-id order, ``E = G *
    num_home``); the search runs over ``[ceil(mean), max home load]``. Returns
    ``(target, d_hi [E], s_lo [G], x_end, demand_expert [E], rank_position
    [G])``: the smallest feasible target found, its layout, the expert at each
    place of the demand order and each rank's place in the supply order; equal
    to ``reference.search_reference``, integer for integer.
    """
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    search = _search_fn(
        num_home,
        num_spare,
        min_replica_tokens,
        max_replicas,
        search_rounds,
        search_width,
        bool(interpret),
        Config() if config is None else config,
    )
    return search(load.astype(jnp.int32))

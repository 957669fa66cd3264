"""Per-expert ranks of ``resolved`` (the first of its kernels), for :mod:`._triton`.

The default for inputs of up to ``_triton._POSITIONS_FROM`` entries (decode
sizes); larger inputs find the quotas' boundary positions instead
(:mod:`._positions`, no per-entry rank; option ``resolved_by``).

``resolved`` needs each entry's rank among earlier entries of the same expert
(an exclusive per-expert cumsum in flat order), so it runs three kernels over
*rank tiles* of ``tile_resolved`` entries:

1. ``_rank_kernel``: each entry's rank inside its rank tile = count of ``e``
   in earlier sub-tiles (a running ``[E_pad]`` int32 histogram in registers,
   added to with ``tt.histogram`` and read with ``tt.gather``) + count of ``e``
   at earlier positions of its 32-entry sub-tile (PTX ``match.any`` +
   ``popc``, one entry per lane; ``rank_in_step="compare"`` and interpret mode:
   a ``[sub, sub]`` pairwise compare).
   Its loop reads only the ids (which Triton prefetches) and writes the ranks:
   no gather from memory on the chain from one sub-tile to the next. Its
   final running histogram is the tile's (quota-consuming entries only).
   ``rank_running="memory"`` (an option; 3% faster at one size, unsettled) keeps the running
   counts in the program's row of the histogram output instead: per step one
   gather of the 32 entries' counts, one store of the new counts, and a block
   barrier (which orders the block's global accesses) --
   a short chain instead of ``tt.histogram`` + ``tt.gather`` per step.
2. XLA: per-tile bases, an exclusive cumsum of those histograms over tiles
   (``[num_rank_tiles, E_pad]``, small).
3. ``_triton._map_kernel``: point = base[rank tile, e] + rank, then the
   threshold search of ``shares``, in the same large programs as the other
   modes.

Up to ``_triton._MAX_LOOKBACK_TILES`` rank tiles the three are one kernel
(``_triton._lookback_kernel``): each program ranks its tile with
:func:`_rank_in_chains`, gets the earlier tiles' counts from
:func:`lookback_bases` (a decoupled look-back between the programs of the
kernel) and maps its tile.

Also here: the warp primitives on PTX ``match.any`` (:func:`_warp_aggregate`
also serves the map kernel's ``count_method="atomic_warp"``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_eplb_jax.pallas._triton_ops import histogram, take

__all__ = ["lookback_bases"]

# resolved, rank kernel (H200, benchmarks/RESULTS.md): one-warp programs of 32-entry steps ([32, 32] compares);
# rank tiles of 1024 entries at 262144 x 8 (71 us in all vs 139 with 2048-entry tiles, 64-entry steps, 2 warps),
# 256 at 8192 x 8 (15.8 us vs 45 with 2048): a program's time grows with its tile, so small inputs take small tiles.
# Tenth session, same draws: 512-entry tiles at 262144 x 8 50.8 vs 51.2 us (P = 288), 58.7 vs 58.6 (P = 512) -- the
# rank kernel 20.4 vs 24.6 but XLA's cumsum over twice the tiles 6.8 vs 3.8; 128 at 4096 x 8 within 0.3 us: kept.
# Ranking only the tiles where a quota threshold falls inside a (tile, expert) pair was slower (RESULTS.md).
_SUB_RESOLVED = 32
_WARPS_RESOLVED = 1
_MIN_TILE_RESOLVED, _MAX_TILE_RESOLVED = 256, 1024


def _rank_tile(num_flat: int) -> int:
    """Entries per rank tile of ``resolved``: about 2048 tiles for large inputs, 256 to 1024 entries each."""
    return int(min(_MAX_TILE_RESOLVED, max(_MIN_TILE_RESOLVED, pl.next_power_of_2(pl.cdiv(num_flat, 2048)))))


def _warp_aggregate(values):
    """Per element: ``(rank, count)`` over the lanes of its warp holding the same value at the same position.

    ``rank`` is how many lower lanes hold the value (0: the lane leads its
    group) and ``count`` how many lanes hold it (PTX ``match.any`` + ``popc``):
    e.g. one atomic per distinct value per warp instruction instead of one per
    entry, so a hot slot does not serialise 32 atomics in L2. GPU only (inline
    PTX). One packed result (``count | rank << 16``): jax 0.11.2 lowers a
    multi-result inline asm to one value.
    """
    (packed,) = plgpu.elementwise_inline_asm(
        """{
        .reg .b32 same, below;
        match.any.sync.b32 same, $1, -1;
        mov.u32 below, %lanemask_lt;
        and.b32 below, same, below;
        popc.b32 below, below;
        popc.b32 same, same;
        shl.b32 below, below, 16;
        or.b32 $0, same, below;
        }""",
        args=[values],
        constraints="=r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(values.shape, jnp.int32)],
    )
    return packed >> 16, packed & 0xFFFF


def _rank_in_warp(values):
    """Per element of a one-warp, one-element-per-lane vector: how many lower lanes hold the same value.

    PTX ``match.any`` (the lanes holding the same value) masked by
    ``%lanemask_lt``, then ``popc``: three instructions instead of a ``[32, 32]``
    compare and row sum. GPU only (inline PTX); the caller guarantees the
    layout (32 entries, one warp).
    """
    (rank,) = plgpu.elementwise_inline_asm(
        """{
        .reg .b32 same, below;
        match.any.sync.b32 same, $1, -1;
        mov.u32 below, %lanemask_lt;
        and.b32 below, same, below;
        popc.b32 $0, below;
        }""",
        args=[values],
        constraints="=r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(values.shape, jnp.int32)],
    )
    return rank


def _rank_step_ids(ids_ref, program, index, tile, sub, num_flat, num_logical, rank_limit):
    """One rank step's ``(start, inside, rank_valid, e_bins)``: its entries' experts, -1 where they consume no quota."""
    start = pl.multiple_of(program * tile + index * sub, sub)
    flat = start + jnp.arange(sub, dtype=jnp.int32)
    inside = flat < num_flat
    ids = plgpu.load(ids_ref.at[pl.ds(start, sub)], mask=inside, other=-1)
    rank_valid = (ids >= 0) & (ids < num_logical) & (flat < rank_limit)
    return start, inside, rank_valid, jnp.where(rank_valid, ids, -1)


def _rank_kernel(
    ids_ref,
    limits_ref,
    rank_ref,
    hist_ref,
    *,
    num_flat,
    num_logical,
    tile,
    sub,
    expert_bins,
    in_step,
    running,
    barrier,
    chains=1,
    program=None,
):
    """Each entry's rank among the earlier quota-consuming entries of its expert in this program's tile,
    and the tile's histogram of those entries. (``program``: the program id, read by a caller outside a
    ``pl.when`` -- interpret mode cannot read it inside one.)"""
    program = pl.program_id(0) if program is None else program
    rank_limit = limits_ref[1]
    iota = jax.lax.broadcasted_iota
    earlier_position = iota(jnp.int32, (sub, sub), 1) < iota(jnp.int32, (sub, sub), 0)
    if chains > 1:
        _rank_in_chains(
            program,
            ids_ref,
            rank_limit,
            rank_ref,
            hist_ref,
            num_flat=num_flat,
            num_logical=num_logical,
            tile=tile,
            sub=sub,
            expert_bins=expert_bins,
            chains=chains,
            barrier=barrier,
        )
        return
    if running == "memory":
        return _rank_in_memory(
            program,
            ids_ref,
            rank_limit,
            rank_ref,
            hist_ref,
            num_flat=num_flat,
            num_logical=num_logical,
            tile=tile,
            sub=sub,
            expert_bins=expert_bins,
            in_step=in_step,
            earlier_position=earlier_position,
            barrier=barrier,
        )

    def step(index, running):
        start, inside, rank_valid, e_bins = _rank_step_ids(
            ids_ref, program, index, tile, sub, num_flat, num_logical, rank_limit
        )
        earlier = take(running, jnp.maximum(e_bins, 0))  # entries of e in earlier sub-tiles
        if in_step == "match":  # ... at earlier positions of this one (one entry per lane)
            before = _rank_in_warp(e_bins)  # lanes of -1 rank among themselves: ranks nobody reads
        else:
            same = (e_bins[:, None] == e_bins[None, :]) & earlier_position
            before = jnp.sum(same.astype(jnp.int32), axis=1)
        plgpu.store(rank_ref.at[pl.ds(start, sub)], earlier + before, mask=inside)
        return running + histogram(e_bins, expert_bins)

    hist_ref[0] = jax.lax.fori_loop(0, tile // sub, step, jnp.zeros((expert_bins,), jnp.int32))


def _rank_in_memory(
    program,
    ids_ref,
    rank_limit,
    rank_ref,
    hist_ref,
    *,
    num_flat,
    num_logical,
    tile,
    sub,
    expert_bins,
    in_step,
    earlier_position,
    barrier,
):
    """``_rank_kernel`` with the running counts in this program's row of the flat ``[tiles * 2 * E_pad]`` output.

    A row is ``2 * E_pad`` long: entry ``E_pad`` is where entries of no expert
    point (masked off: on the GPU they write nothing; interpret mode's masked
    scatter writes back the value it read, which must not land on a real bin).

    Per step: gather the counts of the step's experts, rank inside the step,
    every entry stores its expert's count plus the step's entries of that
    expert (equal values to one address), then a block barrier, which makes
    the block's global writes visible to its later reads (``barrier``; interpret
    mode runs in order and has no barrier).
    """
    row = pl.multiple_of(program * 2 * expert_bins, expert_bins)
    plgpu.store(hist_ref.at[pl.ds(row, expert_bins)], jnp.zeros((expert_bins,), jnp.int32))
    if barrier:
        plgpu.debug_barrier()

    def step(index, carry):
        start, inside, rank_valid, e_bins = _rank_step_ids(
            ids_ref, program, index, tile, sub, num_flat, num_logical, rank_limit
        )
        at = row + jnp.where(rank_valid, e_bins, expert_bins)
        earlier = plgpu.load(hist_ref.at[at], mask=rank_valid, other=0)
        if in_step == "match":  # one match.any for both
            before, same = _warp_aggregate(e_bins)
        else:
            equal = e_bins[:, None] == e_bins[None, :]
            before = jnp.sum((equal & earlier_position).astype(jnp.int32), axis=1)
            same = jnp.sum(equal.astype(jnp.int32), axis=1)
        plgpu.store(rank_ref.at[pl.ds(start, sub)], earlier + before, mask=inside)
        # Every entry of an expert stores the same new count (no masked-off lane can write back a stale one).
        plgpu.store(hist_ref.at[at], earlier + same, mask=rank_valid)
        if barrier:
            plgpu.debug_barrier()
        return carry

    jax.lax.fori_loop(0, tile // sub, step, jnp.int32(0))


def _rank_in_chains(
    program, ids_ref, rank_limit, rank_ref, hist_ref, *, num_flat, num_logical, tile, sub, expert_bins, chains, barrier
):
    """``_rank_in_memory`` with ``chains`` warps, each ranking its own ``tile / chains`` consecutive entries in a
    chain of steps that many times shorter, then one pass adding to each entry the counts of its expert in the
    earlier chains. A step is ``[chains, sub]``: one row per warp, one entry per lane for ``match.any`` (the
    compiled kernel checks it against the reference in the tests; interpret mode: a pairwise compare). Each chain
    counts in its own row of ``2 * E_pad``; the program's first row ends with the tile's histogram."""
    row_size = 2 * expert_bins
    region = program * chains * row_size
    span = tile // chains
    iota = jax.lax.broadcasted_iota
    chain = iota(jnp.int32, (chains, sub), 0)
    lane = iota(jnp.int32, (chains, sub), 1)
    row = region + chain * row_size
    rows = region + iota(jnp.int32, (chains, expert_bins), 0) * row_size + iota(jnp.int32, (chains, expert_bins), 1)
    plgpu.store(hist_ref.at[rows], jnp.zeros((chains, expert_bins), jnp.int32))
    if barrier:
        plgpu.debug_barrier()

    def flat_ids(index):
        flat = program * tile + chain * span + index * sub + lane
        inside = flat < num_flat
        ids = plgpu.load(ids_ref.at[flat], mask=inside, other=-1)
        rank_valid = (ids >= 0) & (ids < num_logical) & (flat < rank_limit)
        return flat, inside, rank_valid, jnp.where(rank_valid, ids, -1)

    def step(index, carry):
        flat, inside, rank_valid, e_bins = flat_ids(index)
        at = row + jnp.where(rank_valid, e_bins, expert_bins)
        earlier = plgpu.load(hist_ref.at[at], mask=rank_valid, other=0)
        if barrier and sub == 32:  # compiled 32-entry rows: one row per warp, one entry per lane
            before, same = _warp_aggregate(e_bins)
        else:
            equal = e_bins[:, :, None] == e_bins[:, None, :]
            earlier_lane = iota(jnp.int32, (chains, sub, sub), 2) < iota(jnp.int32, (chains, sub, sub), 1)
            before = jnp.sum((equal & earlier_lane).astype(jnp.int32), axis=2)
            same = jnp.sum(equal.astype(jnp.int32), axis=2)
        plgpu.store(rank_ref.at[flat], earlier + before, mask=inside)
        plgpu.store(hist_ref.at[at], earlier + same, mask=rank_valid)
        if barrier:
            plgpu.debug_barrier()
        return carry

    jax.lax.fori_loop(0, span // sub, step, jnp.int32(0))
    counts = plgpu.load(hist_ref.at[rows])
    prefix = jnp.cumsum(counts, axis=0) - counts
    total = jnp.sum(counts, axis=0)
    if barrier:
        plgpu.debug_barrier()
    plgpu.store(hist_ref.at[rows], prefix)
    if barrier:
        plgpu.debug_barrier()

    def add(index, carry):
        flat, inside, rank_valid, e_bins = flat_ids(index)
        later = rank_valid & (chain > 0)
        extra = plgpu.load(hist_ref.at[row + jnp.where(later, e_bins, expert_bins)], mask=later, other=0)
        rank = plgpu.load(rank_ref.at[flat], mask=later, other=0)
        plgpu.store(rank_ref.at[flat], rank + extra, mask=later)
        return carry

    jax.lax.fori_loop(0, span // sub, add, jnp.int32(0))
    if barrier:
        plgpu.debug_barrier()
    plgpu.store(hist_ref.at[pl.ds(region, expert_bins)], total)
    return total


# ------------------------------------------------------------------ look-back
_AGGREGATE, _INCLUSIVE = 1, 2  # a board word: count << 2 | status (0: not written yet)
_WINDOW = 16  # earlier programs read per look-back step


def lookback_bases(board_ref, program, total, *, expert_bins, window=_WINDOW):
    """Per expert, the quota-consuming entries of the programs before this one (``[E_pad]`` int32): a decoupled
    look-back over the board, a flat ``[programs * E_pad]`` int32 buffer that starts zeroed.

    This program first posts its own ``total [E_pad]`` (its tile's counts) as an *aggregate*; each expert's lane
    then walks back over the earlier programs' words, ``window`` programs per step, adding aggregates up to and
    including the nearest *inclusive* word (that program's counts plus all before it; the first program posts
    one at once), waiting where a word is not posted yet; then it posts its own inclusive word. Each word is one
    32-bit store of ``count << 2 | status``, so a reader sees either nothing (0) or a whole word, and every lane
    walks on its own (the words of one program need not appear together). Programs wait only for earlier ones,
    which the GPU starts first; in interpret mode those have finished. Reads are ``volatile`` (from L2, never a
    stale L1 line). (One program per step, while all programs post their aggregates at once, made the last of
    128 programs walk back over most of the others: 9.7 us for a kernel whose parts took 6.5.)
    """
    lanes = jnp.arange(expert_bins, dtype=jnp.int32)
    row = program * expert_bins + lanes
    first = program == 0
    plgpu.store(board_ref.at[row], (total << 2) | (_AGGREGATE + first.astype(jnp.int32)))  # (2: inclusive)
    back = jax.lax.broadcasted_iota(jnp.int32, (window, expert_bins), 0)  # 0: the nearest program of a window

    def walk(carry):
        top, sum_before, done = carry  # top: each lane's nearest program not yet added
        earlier = top[None, :] - back
        wanted = ~done[None, :] & (earlier >= 0)
        word = plgpu.load(
            board_ref.at[jnp.maximum(earlier, 0) * expert_bins + lanes[None, :]], mask=wanted, other=0, volatile=True
        )
        status = word & 3
        nearest_inclusive = jnp.min(jnp.where(wanted & (status == _INCLUSIVE), back, window), axis=0)
        not_posted = jnp.min(jnp.where(wanted & (status == 0), back, window), axis=0)
        # Words to add: up to the nearest inclusive one, all posted, none before the first program.
        added = jnp.minimum(jnp.minimum(nearest_inclusive + 1, not_posted), jnp.maximum(top + 1, 0))
        added = jnp.where(done, 0, added)
        sum_before = sum_before + jnp.sum(jnp.where(back < added[None, :], word >> 2, 0), axis=0)
        done = done | (nearest_inclusive < added) | (top - added < 0)
        return top - added, sum_before, done

    start = (
        jnp.full(lanes.shape, program - 1, jnp.int32),
        jnp.zeros(lanes.shape, jnp.int32),
        jnp.full(lanes.shape, first, jnp.bool_),
    )
    _, sum_before, _ = jax.lax.while_loop(lambda carry: jnp.max((~carry[2]).astype(jnp.int32)) > 0, walk, start)
    plgpu.store(board_ref.at[row], ((sum_before + total) << 2) | _INCLUSIVE, mask=jnp.broadcast_to(~first, lanes.shape))
    return sum_before

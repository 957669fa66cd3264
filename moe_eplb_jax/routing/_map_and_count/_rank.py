"""Mode ``"quota"`` by ranks (up to 65536 entries): each entry's rank among the earlier entries of its expert.

An entry's point is its rank among the earlier quota-consuming entries of its expert (flat order). Over *rank
tiles* of ``tile`` entries, each split between ``chains`` warps:

* :func:`tile_ranks` -- one kernel: programs ``[0, tiles)`` rank their tile's entries (:func:`rank_in_chains`:
  ``[ids]`` in, in-tile ranks ``[N]`` and each tile's histogram out); programs ``tiles + e`` write expert ``e``'s
  row of the thresholds from the raw quotas. XLA then sums the histograms down the tiles (one triangular
  product): ``bases [tiles, E_pad]``, and the map kernel's point is ``bases[tile, e] + in-tile rank``.
* :func:`lookback_bases` -- for the smallest inputs one kernel ranks, sums and maps: each program gets the
  earlier tiles' counts from their posted words (a decoupled look-back).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_eplb_jax.routing._map_and_count._search import clipped_quotas

__all__ = ["rank_in_chains", "tile_ranks", "lookback_bases", "MAX_TILES", "STEP"]

STEP = 32  # entries per rank step: one per lane of a warp (match.any)
MAX_TILES = 256  # rank tiles whose histograms one triangular [tiles, tiles] product sums (exact below 2**24)
_INT32_MAX = 2**31 - 1


def _warp_aggregate(values):
    """Per element: ``(rank, count)`` over the lanes of its warp holding the same value at the same position.

    ``rank`` is how many lower lanes hold the value and ``count`` how many
    lanes hold it (PTX ``match.any`` + ``popc``): three instructions instead of
    a ``[32, 32]`` compare. GPU only (inline PTX), one entry per lane of one
    warp. One packed result (``count | rank << 16``): jax 0.11.2 lowers a
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


def rank_in_chains(
    program, ids_ref, rank_limit, rank_ref, hist_ref, *, num_flat, num_logical, tile, expert_bins, chains, compiled
):
    """Ranks of the entries of rank tile ``program`` among its earlier quota-consuming entries of their expert, into
    ``rank_ref``; returns the tile's histogram ``[E_pad]`` (also stored at the program's first row of ``hist_ref``).

    Each of ``chains`` warps ranks its own ``tile / chains`` consecutive entries in ``STEP``-entry steps, keeping
    running per-expert counts in its row of ``hist_ref`` (flat ``[tiles * chains * 2 E_pad]``; a row's entry
    ``E_pad`` takes the masked-off lanes: interpret mode's masked scatter writes back what it read) -- per step a
    gather of the counts, the in-step ranks, a store of the new counts and a block barrier, which orders the
    block's global accesses. Then one pass adds to each entry the counts of its expert in the earlier chains.
    ``compiled``: ``match.any`` ranks a step (one entry per lane) and barriers order the steps; interpret mode runs
    in order and ranks by a pairwise compare.
    """
    row_size = 2 * expert_bins
    region = program * chains * row_size
    span = tile // chains
    iota = jax.lax.broadcasted_iota
    chain = iota(jnp.int32, (chains, STEP), 0)
    lane = iota(jnp.int32, (chains, STEP), 1)
    row = region + chain * row_size
    rows = region + iota(jnp.int32, (chains, expert_bins), 0) * row_size + iota(jnp.int32, (chains, expert_bins), 1)
    plgpu.store(hist_ref.at[rows], jnp.zeros((chains, expert_bins), jnp.int32))
    if compiled:
        plgpu.debug_barrier()

    def flat_ids(index):
        flat = program * tile + chain * span + index * STEP + lane
        inside = flat < num_flat
        ids = plgpu.load(ids_ref.at[flat], mask=inside, other=-1)
        rank_valid = (ids >= 0) & (ids < num_logical) & (flat < rank_limit)
        return flat, inside, rank_valid, jnp.where(rank_valid, ids, -1)

    def step(index, carry):
        flat, inside, rank_valid, e_bins = flat_ids(index)
        at = row + jnp.where(rank_valid, e_bins, expert_bins)
        earlier = plgpu.load(hist_ref.at[at], mask=rank_valid, other=0)
        if compiled:  # one row per warp, one entry per lane
            before, same = _warp_aggregate(e_bins)
        else:
            equal = e_bins[:, :, None] == e_bins[:, None, :]
            earlier_lane = iota(jnp.int32, (chains, STEP, STEP), 2) < iota(jnp.int32, (chains, STEP, STEP), 1)
            before = jnp.sum((equal & earlier_lane).astype(jnp.int32), axis=2)
            same = jnp.sum(equal.astype(jnp.int32), axis=2)
        plgpu.store(rank_ref.at[flat], earlier + before, mask=inside)
        # Every entry of an expert stores the same new count (no masked-off lane can write back a stale one).
        plgpu.store(hist_ref.at[at], earlier + same, mask=rank_valid)
        if compiled:
            plgpu.debug_barrier()
        return carry

    jax.lax.fori_loop(0, span // STEP, step, jnp.int32(0))
    counts = plgpu.load(hist_ref.at[rows])
    prefix = jnp.cumsum(counts, axis=0) - counts
    total = jnp.sum(counts, axis=0)
    if compiled:
        plgpu.debug_barrier()
    plgpu.store(hist_ref.at[rows], prefix)
    if compiled:
        plgpu.debug_barrier()

    def add(index, carry):
        flat, inside, rank_valid, e_bins = flat_ids(index)
        later = rank_valid & (chain > 0)
        extra = plgpu.load(hist_ref.at[row + jnp.where(later, e_bins, expert_bins)], mask=later, other=0)
        rank = plgpu.load(rank_ref.at[flat], mask=later, other=0)
        plgpu.store(rank_ref.at[flat], rank + extra, mask=later)
        return carry

    jax.lax.fori_loop(0, span // STEP, add, jnp.int32(0))
    if compiled:
        plgpu.debug_barrier()
    plgpu.store(hist_ref.at[pl.ds(region, expert_bins)], total)
    return total


def _ranks_and_thresholds_kernel(
    ids_ref,
    limits_ref,
    quotas_ref,
    logcnt_ref,
    rank_ref,
    hist_ref,
    thresholds_ref,
    *,
    tiles,
    width,
    cap,
    **rank_options,
):
    """Programs ``[0, tiles)``: :func:`rank_in_chains`. Program ``tiles + e``: expert ``e``'s row of the thresholds
    ``[E * S]`` from the raw quotas, as :func:`._tables.quota_thresholds` builds them."""
    program = pl.program_id(0)  # (read here: interpret mode cannot read it inside a pl.when)

    @pl.when(program < tiles)
    def _():
        rank_in_chains(program, ids_ref, limits_ref[1], rank_ref, hist_ref, **rank_options)

    @pl.when(program >= tiles)
    def _():
        expert = program - tiles
        count = jnp.minimum(logcnt_ref[expert], width)
        lanes, quotas = clipped_quotas(quotas_ref, expert, count, width=width, cap=cap)
        live = lanes < count
        sums = jnp.minimum(jnp.cumsum(quotas), cap)
        # Lanes past the row point at distinct spare entries after the E * S thresholds (interpret mode's masked
        # scatter writes back what it read, which must not land on an entry another lane writes).
        inside = lanes < width
        at = jnp.where(inside, expert * width + lanes, thresholds_ref.shape[0] - lanes.shape[0] + lanes)
        plgpu.store(thresholds_ref.at[at], jnp.where(live, sums, _INT32_MAX), mask=inside)


def tile_ranks(ids, limits, quotas, logcnt, *, num_logical, width, tile, expert_bins, cap, interpret, out_struct):
    """``(ranks [N], bases [tiles * E_pad], thresholds)``: each entry's rank inside its rank tile, the counts of each
    expert's quota-consuming entries in the earlier tiles, and the flat expert-major thresholds (``E * S`` and a
    spare tail never read) from the raw ``quotas [E * S]`` (:func:`._tables.kernel_quotas`)."""
    num_flat = ids.shape[0]
    tiles = pl.cdiv(num_flat, tile)
    if tiles > MAX_TILES or num_flat > 1 << 24:
        raise ValueError(f"quota by ranks sums at most {MAX_TILES} rank tiles of 2**24 entries; got {tiles} tiles")
    chains = min(4, tile // STEP)
    whole = pl.no_block_spec
    rank, hist, thresholds = pl.pallas_call(
        functools.partial(
            _ranks_and_thresholds_kernel,
            tiles=tiles,
            width=width,
            cap=cap,
            num_flat=num_flat,
            num_logical=num_logical,
            tile=tile,
            expert_bins=expert_bins,
            chains=chains,
            compiled=not interpret,
        ),
        grid=(tiles + num_logical,),
        in_specs=[whole] * 4,
        out_specs=[whole] * 3,
        out_shape=[
            out_struct((num_flat,), jnp.int32),
            out_struct((tiles * chains * 2 * expert_bins,), jnp.int32),
            out_struct((num_logical * width + pl.next_power_of_2(width),), jnp.int32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=chains, num_stages=3),
        interpret=interpret,
        name="expert_rank",
    )(ids, limits, quotas, logcnt)
    per_tile = hist.reshape(tiles, -1)[:, :expert_bins].astype(jnp.float32)
    # Exclusive sums down the tiles as one exact product (every sum is below 2**24): at decode sizes a small GEMM
    # beats XLA's cumsum kernels.
    earlier = (jnp.arange(tiles)[:, None] > jnp.arange(tiles)[None, :]).astype(jnp.float32)
    bases = jnp.dot(earlier, per_tile, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return rank, bases.astype(jnp.int32).reshape(-1), thresholds


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
    walks on its own. Programs wait only for earlier ones, which the GPU starts first (as CUB's scans assume); in
    interpret mode those have finished. Reads are ``volatile`` (from L2, never a stale L1 line).
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

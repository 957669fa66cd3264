"""Mode ``"quota"`` by boundary positions (above 65536 entries): where each quota runs out, instead of per-entry ranks.

An entry of expert ``e`` with rank ``r`` (its earlier quota-consuming entries of ``e``) takes replica ``#{j :
C[e, j] <= r}``, ``C`` the thresholds. Ranks rise with the flat index, so ``C[e, j] <= r`` holds exactly from
the position of ``e``'s occurrence number ``C[e, j]`` on. With those *boundary positions* ``pos [E, S]``
(``int32 max`` where ``e`` has at most ``C[e, j]`` entries) the replica is ``#{j : pos[e, j] <= i}`` for the
entry at flat index ``i``: the map kernel's search with the flat index as its point, and no rank at all. There
are at most ``sum(logcnt)`` live boundaries (``P`` for a placement), so finding them is small work:

1. ``_tile_counts_kernel``: each tile of ``tile`` entries counts its quota-consuming entries per expert
   (``tt.histogram``) into column ``t`` of ``counts [E_pad, tiles]``.
2. ``_boundary_kernel``: program ``b`` takes the ``b``-th live boundary (then ``b + programs``, ...): the running
   sum of its expert's row of counts finds the tile holding the occurrence, a scan of that tile the entry. The
   programs sum the raw quotas of their row themselves (:func:`._search.clipped_quotas`).
3. In the map kernel, :func:`start_words` / :func:`start_passed`: each loop step first finds every expert's
   boundaries before it and its next one, so only entries past their expert's next boundary search.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_eplb_jax.routing._map_and_count._search import clipped_quotas, loads, upper_bound
from moe_eplb_jax.routing._map_and_count._triton_ops import histogram, take

__all__ = ["boundary_positions", "start_passed", "start_table_fits", "start_words"]

_INT32_MAX = np.iinfo(np.int32).max


def _tile_counts_kernel(ids_ref, limits_ref, counts_ref, *, num_flat, num_logical, tile, expert_bins, num_tiles):
    """Column ``program`` of the flat ``counts [E_pad, tiles]``: the tile's quota-consuming entries per expert (an
    expert's counts side by side, as each boundary program reads them), in one step."""
    program = pl.program_id(0)
    start = pl.multiple_of(program * tile, tile)
    flat = start + jnp.arange(tile, dtype=jnp.int32)
    ids = plgpu.load(ids_ref.at[pl.ds(start, tile)], mask=flat < num_flat, other=-1)
    consuming = (ids >= 0) & (ids < num_logical) & (flat < limits_ref[1])
    hist = histogram(jnp.where(consuming, ids, -1), expert_bins)
    plgpu.store(counts_ref.at[jnp.arange(expert_bins, dtype=jnp.int32) * num_tiles + program], hist)


def _boundary_kernel(
    ids_ref,
    counts_ref,
    quotas_ref,
    logcnt_ref,
    positions_ref,
    *,
    num_flat,
    num_logical,
    width,
    tile,
    scan,
    programs,
    cap,
):
    """Program ``b`` finds the ``b``-th live boundary in expert-major order (then ``b + programs``, ... if there
    are more), and writes every ``programs``-th dead entry (``j >= logcnt[e]``) of the table as ``int32 max``."""
    program = pl.program_id(0)
    num_tiles = pl.cdiv(num_flat, tile)
    lanes = jnp.arange(max(16, pl.next_power_of_2(num_logical)), dtype=jnp.int32)
    live = jnp.where(
        lanes < num_logical, jnp.clip(plgpu.load(logcnt_ref.at[jnp.minimum(lanes, num_logical - 1)]), 0, width), 0
    )
    ends = jnp.cumsum(live)  # expert e's boundaries are the live ones numbered [ends[e] - live[e], ends[e])
    total = jnp.sum(live)
    # Dead entries, every programs-th of the table: masked-off lanes point at distinct spare entries past it
    # (interpret mode's masked scatter writes back what it read there, which must not land on an entry another
    # lane writes).
    chunk = pl.next_power_of_2(pl.cdiv(num_logical * width, programs))
    entry = program + programs * jnp.arange(chunk, dtype=jnp.int32)
    inside = entry < num_logical * width
    entry_expert = jnp.minimum(entry // width, num_logical - 1)
    dead = inside & (entry % width >= jnp.clip(plgpu.load(logcnt_ref.at[entry_expert]), 0, width))
    spare = positions_ref.shape[0] - chunk
    plgpu.store(
        positions_ref.at[jnp.where(dead, entry, spare + jnp.arange(chunk, dtype=jnp.int32))],
        jnp.full((chunk,), _INT32_MAX, jnp.int32),
        mask=dead,
    )

    def body(number):
        expert = jnp.sum((ends <= number).astype(jnp.int32))  # the expert holding live boundary `number`
        j = number - jnp.sum(jnp.where(lanes < expert, live, 0))
        find = _occurrence_finder(
            ids_ref, counts_ref, expert, num_flat=num_flat, tile=tile, scan=scan, num_tiles=num_tiles
        )
        _, quotas = clipped_quotas(quotas_ref, expert, j + 1, width=width, cap=cap)
        positions_ref[expert * width + j] = find(jnp.minimum(jnp.sum(quotas), cap))
        return number + programs

    jax.lax.while_loop(lambda number: number < total, body, program)


def _occurrence_finder(ids_ref, counts_ref, expert, *, num_flat, tile, scan, num_tiles):
    """``find(c)``: the flat index of ``expert``'s occurrence number ``c`` (0-based), ``int32 max`` where it has at
    most ``c`` quota-consuming entries. Loads the expert's row of tile counts once; each ``find`` scans one tile."""
    at = jnp.arange(pl.next_power_of_2(num_tiles), dtype=jnp.int32)
    row = plgpu.load(counts_ref.at[expert * num_tiles + jnp.minimum(at, num_tiles - 1)], mask=at < num_tiles, other=0)
    running = jnp.cumsum(row)  # occurrences of e up to and including each tile
    total = jnp.sum(row)

    def find(c):
        in_tile = jnp.sum((running <= c).astype(jnp.int32))  # the tile holding it
        wanted = c - jnp.sum(jnp.where(at < in_tile, row, 0)) + 1  # its 1-based number inside the tile

        def step(carry):
            index, seen, found = carry
            flat = in_tile * tile + index * scan + jnp.arange(scan, dtype=jnp.int32)
            ids = plgpu.load(ids_ref.at[jnp.minimum(flat, num_flat - 1)], mask=flat < num_flat, other=-1)
            # (entries past the rank limit need no mask: the wanted one, counted, comes before them all)
            match = ids == expert
            number = seen + jnp.cumsum(match.astype(jnp.int32))
            hit = jnp.min(jnp.where(match & (number == wanted), flat, _INT32_MAX))
            return index + 1, seen + jnp.sum(match.astype(jnp.int32)), jnp.minimum(found, hit)

        # Steps until found; none where c >= total (a loop, not lax.cond: Pallas Triton cannot yield a constant
        # from a branch).
        alive = c < total
        start = (jnp.int32(0), jnp.int32(0), jnp.int32(_INT32_MAX))
        return jax.lax.while_loop(
            lambda carry: alive & (carry[0] < tile // scan) & (carry[2] == _INT32_MAX), step, start
        )[2]

    return find


def boundary_positions(
    ids,
    quotas,
    limits,
    logcnt,
    *,
    num_logical,
    width,
    expert_bins,
    tile,
    scan,
    count_warps,
    num_warps,
    programs,
    cap,
    interpret,
    out_struct,
):
    """Boundary positions, expert-major, from the flat ``ids [N]`` and raw ``quotas [E * S]`` (summed as
    :func:`._tables.quota_thresholds` does, clipped to ``[0, cap]`` and capped at it; ``S * cap < 2**31 - 1``,
    :func:`._tables.kernel_quotas`): flat int32, the ``E * S`` positions then a few spare entries (the store
    target of masked-off lanes; never read: a slice would be a copy kernel).

    ``tile``: entries per tile of counts (one step); ``scan``: entries per step of a tile scan; ``programs``
    boundary programs (say ``P``, the live boundaries of a placement).
    """
    num_flat = ids.shape[0]
    scan = min(tile, scan)
    num_tiles = pl.cdiv(num_flat, tile)
    whole = pl.no_block_spec
    counts = pl.pallas_call(
        functools.partial(
            _tile_counts_kernel,
            num_flat=num_flat,
            num_logical=num_logical,
            tile=tile,
            expert_bins=expert_bins,
            num_tiles=num_tiles,
        ),
        grid=(num_tiles,),
        in_specs=[whole, whole],
        out_specs=whole,
        out_shape=out_struct((expert_bins * num_tiles,), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=count_warps, num_stages=3),
        interpret=interpret,
        name="tile_counts",
    )(ids, limits)
    programs = min(programs, num_logical * width)
    spare = pl.next_power_of_2(pl.cdiv(num_logical * width, programs))
    return pl.pallas_call(
        functools.partial(
            _boundary_kernel,
            num_flat=num_flat,
            num_logical=num_logical,
            width=width,
            tile=tile,
            scan=scan,
            programs=programs,
            cap=cap,
        ),
        grid=(programs,),
        in_specs=[whole] * 4,
        out_specs=whole,
        out_shape=out_struct((num_logical * width + spare,), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="boundary_positions",
    )(ids, counts, quotas, logcnt)


_OFFSET_SHIFT = 16  # a start word: boundaries passed before the step (low 16 bits) | next boundary's offset << 16


def start_table_fits(width: int, sub: int) -> bool:
    """Whether :func:`start_words`' words hold these shapes (the count below ``2**16``, the offset its 15 bits)."""
    return width < 1 << _OFFSET_SHIFT and sub < 1 << 15


def start_words(positions_ref, count_of, start, *, num_logical, width, sub):
    """Per expert (``[E_pad]`` lanes): its boundaries below ``start`` and the offset of its next one from
    ``start`` (clamped to ``sub``), packed ``before | offset << 16``: one bisection over every expert's row at
    once. ``count_of(experts)``: replica counts (>= 1)."""
    lanes = jnp.arange(max(16, pl.next_power_of_2(num_logical)), dtype=jnp.int32)
    lane_expert = jnp.minimum(lanes, num_logical - 1)
    lane_count = count_of(lane_expert)
    lane_live = jnp.minimum(lane_count, width)
    multi = (lanes < num_logical) & (lane_count > 1)  # one replica: no boundaries
    row = lambda j: lane_expert * width + j
    before = upper_bound(
        loads(positions_ref, row), jnp.full(lanes.shape, start - 1, jnp.int32), width, lane_live, multi, dynamic=True
    )
    following = plgpu.load(
        positions_ref.at[row(jnp.minimum(before, width - 1))], mask=multi & (before < lane_live), other=_INT32_MAX
    )
    # following >= start (every earlier boundary is counted in `before`); past the step it is clamped to `sub`.
    return before | (jnp.minimum(following - start, sub) << _OFFSET_SHIFT)


def start_passed(words, positions_ref, at, start, flat, point, expert, count, searching, *, width):
    """``#{j < count : positions[e, j] <= point}`` per entry of a map-kernel step, mostly without a search.

    Boundaries rise with the flat index, so for the step's entries from
    ``start`` each expert has ``before[e]`` boundaries below ``start`` and
    the next one at ``start + offset[e]`` (:func:`start_words`): every entry
    before its expert's next boundary has its answer, ``before[e]``; only
    entries at or after one -- at most ``P`` boundaries in the whole input --
    search on from ``before[e] + 1``. ``at(j)``: the entries' flat indices of
    their expert's position ``j``. Entries at ``point = int32 max`` (past the
    rank limit: no quota) pass all ``S`` positions of the row, the dead ones
    (``int32 max``) too, as in the reference: the caller's ``passed < count``
    then sends them to hash, or past the row where ``count > S``.
    """
    word = take(words, expert)
    before, offset = word & ((1 << _OFFSET_SHIFT) - 1), word >> _OFFSET_SHIFT
    counted = point != _INT32_MAX
    crossed = searching & counted & (flat - start >= offset)  # at or past the expert's next boundary
    passed = upper_bound(
        loads(positions_ref, at), point, width, count, crossed, dynamic=True, low=before + crossed.astype(jnp.int32)
    )
    # The constant S, not min(count, S) per entry (the same replica after the caller's test): the per-entry
    # minimum keeps more registers live across the search (78 instead of 64 per thread for sm_90), which halves
    # the resident 16-warp blocks of the map kernel.
    return jnp.where(counted, passed, width)

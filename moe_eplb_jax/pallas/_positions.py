"""Where each quota of ``resolved`` runs out: its boundary positions, for :mod:`._triton`.

``resolved`` gives an entry of expert ``e`` with rank ``r`` (its earlier
quota-consuming entries of ``e``, in flat order) the replica ``#{j : C[e, j]
<= r}``, ``C`` the quotas' running sums (the thresholds). Ranks rise with the
flat index, so ``C[e, j] <= r`` holds exactly for the entries at or after the
position of ``e``'s occurrence number ``C[e, j]`` (0-based). With those
*boundary positions* ``pos[e, j]`` (``int32 max`` where ``e`` has at most
``C[e, j]`` entries) the replica is ``#{j : pos[e, j] <= i}`` for the entry at
flat index ``i``: the map kernel's threshold search with the flat index as the
point, and no per-entry rank at all. There are at most ``sum(logcnt)`` live
boundaries (``P`` for a placement), so finding them is small work:

1. :func:`_tile_counts_kernel`: each *position tile* of ``tile`` entries counts
   its quota-consuming entries per expert (``tt.histogram``) into column
   ``t`` of ``counts [E_pad, tiles]`` (an expert's counts side by side).
2. :func:`_flat_boundary_kernel` (default): program ``b`` takes the ``b``-th
   live boundary (expert-major; the expert from the running sum of
   ``logcnt``), or :func:`_boundary_kernel`: programs ``(e, g)`` take the
   boundaries ``j = g, g + G, ...`` of expert ``e``. Either way the running sum
   of ``e``'s row of counts finds the tile holding occurrence ``C[e, j]`` and
   how many of ``e``'s entries precede that tile; a scan of that one tile (a
   ``cumsum`` of its matches, steps of ``scan`` entries until found) finds
   the entry. Entries from ``logcnt[e]`` on are ``int32 max`` (never read). Given the raw quotas
   (``quota_cap``), a program sums its row up to its threshold itself, so the wrapper's ``[E, S]`` product of
   the thresholds never runs (H200, 262144 x 8, P = 512: 33.4 vs 38.2 us per call).
3. In the map kernel, :func:`start_words` / :func:`start_passed`: each loop
   step first finds every expert's boundaries before it and its next one, so
   only entries past their expert's next boundary search.

An earlier way, ranking only where a threshold falls inside a (tile, expert)
pair (tenth session), settled those pairs in the tile's own program: every
expert's last threshold crowds into the last tile, so one program did nearly
all the work. Here each boundary is its own search, whichever tile it is in.
On an H200 (``benchmarks/RESULTS.md``, eleventh session) 262144 x 8 resolved
takes 30.7 / 38.9 us (P = 288 / 512) against 52.3 / 59.1 with ranks, the
boundary kernel 7-11 us and the counts 5 us of it; at 4096 x 8 the two
kernels' chains of dependent loads (~5 us) outlast the rank kernel (2.6 us),
so decode sizes keep the ranks (``_triton._POSITIONS_FROM``). Twelfth
session: step-start words and a program per boundary, 27.7 / 33.3 us (the
flat grid: 65536 x 8, P = 512, boundaries 4.9 vs 8.3 us). Per expert, one
program with its boundaries side by side in ``[lanes, scan]`` blocks was
1.6-3.5x slower than 8, 32 per expert 2x slower at decode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_eplb_jax.pallas._rank import _rank_step_ids
from moe_eplb_jax.pallas._search import _loads, _upper_bound
from moe_eplb_jax.pallas._triton_ops import histogram, take

__all__ = ["boundary_positions", "clipped_quotas", "position_tile", "start_passed", "start_table_fits", "start_words"]

_INT32_MAX = np.iinfo(np.int32).max
_MIN_TILE, _MAX_TILE = 256, 4096
_SCAN = 1024  # entries per step of a tile scan
_GROUPS = 8  # programs per expert (each takes every G-th boundary)
# Boundary programs: one per live boundary ("flat", P programs; H200, 65536 x 8 P = 512: 4.9 vs 8.3 us; 262144 x 8:
# 6.4 / 8.0 vs 6.9 / 8.4 at P = 288 / 512) or G per expert ("expert"; at 4096 x 8, where ranks are used, 0.2 us faster).
_GRID = "flat"


def position_tile(num_flat: int) -> int:
    """Entries per position tile: about 512 tiles for large inputs, 256 to 4096 entries each."""
    return int(min(_MAX_TILE, max(_MIN_TILE, pl.next_power_of_2(pl.cdiv(num_flat, 512)))))


def _tile_counts_kernel(ids_ref, limits_ref, counts_ref, *, num_flat, num_logical, tile, sub, expert_bins, num_tiles):
    """Column ``program`` of the flat ``counts [E_pad, tiles]``: the tile's quota-consuming entries per expert."""
    program = pl.program_id(0)
    rank_limit = limits_ref[1]

    def step(index, hist):  # the rank kernel's step of ids: experts, -1 where an entry consumes no quota
        *_, experts = _rank_step_ids(ids_ref, program, index, tile, sub, num_flat, num_logical, rank_limit)
        return hist + histogram(experts, expert_bins)

    hist = jax.lax.fori_loop(0, tile // sub, step, jnp.zeros((expert_bins,), jnp.int32))
    # Column `program` of [E_pad, tiles]: each boundary program then reads its expert's row side by side (H200,
    # 262144 x 8: boundaries 7.2 us and counts 5.3, against 9.0 and 4.2 with [tiles, E_pad] rows).
    plgpu.store(counts_ref.at[jnp.arange(expert_bins, dtype=jnp.int32) * num_tiles + program], hist)


def clipped_quotas(quotas_ref, expert, count, *, width, cap):
    """``(lanes, quotas)``, ``[2**ceil(log2 S)]`` lanes: ``expert``'s first ``count`` raw quotas (of the flat
    ``[E * S]``) clipped to ``[0, cap]`` as the wrapper clips them, 0 past them. Their running sums capped at
    ``cap`` are the wrapper's thresholds exactly (int32: callers check ``width * cap < 2**31``)."""
    lanes = jnp.arange(pl.next_power_of_2(width), dtype=jnp.int32)
    quotas = plgpu.load(quotas_ref.at[expert * width + jnp.minimum(lanes, width - 1)], mask=lanes < count, other=0)
    return lanes, jnp.clip(quotas, 0, cap)


def _threshold_reader(thresholds_ref, *, width, cap):
    """``threshold(expert, j)``: ``C[e, j]``, read from the built thresholds (``cap is None``) or summed from the
    raw quotas ``[E * S]`` (:func:`clipped_quotas`) -- so no ``[E, S]`` product runs per call."""
    if cap is None:
        return lambda expert, j: thresholds_ref[expert * width + j]

    def threshold(expert, j):
        _, quotas = clipped_quotas(thresholds_ref, expert, j + 1, width=width, cap=cap)
        return jnp.minimum(jnp.sum(quotas), cap)

    return threshold


def _boundary_kernel(
    ids_ref,
    counts_ref,
    thresholds_ref,
    logcnt_ref,
    positions_ref,
    *,
    num_flat,
    width,
    tile,
    scan,
    num_tiles,
    groups,
    cap,
):
    """Positions of expert ``e``'s boundaries ``g, g + G, ...`` below its replica count (module docstring); its
    other entries of them ``int32 max``."""
    program = pl.program_id(0)  # read here: interpret mode cannot read it inside the loop's branches
    threshold = _threshold_reader(thresholds_ref, width=width, cap=cap)
    expert, group = program // groups, program % groups
    live = jnp.minimum(logcnt_ref[expert], width)
    mine = group + groups * jnp.arange(pl.next_power_of_2(pl.cdiv(width, groups)), dtype=jnp.int32)
    dead = (mine >= live) & (mine < width)
    # Masked-off lanes point at distinct spare entries past the E * S positions (interpret mode's masked scatter
    # writes back what it read there, which must not land on an entry another lane writes).
    spare = positions_ref.shape[0] - mine.shape[0]
    plgpu.store(
        positions_ref.at[jnp.where(dead, expert * width + mine, spare + jnp.arange(mine.shape[0]))],
        jnp.full(mine.shape, _INT32_MAX),
        mask=dead,
    )

    @pl.when(group < live)  # programs without a live boundary stop here (most of them: E * G programs, P boundaries)
    def _():
        find = _occurrence_finder(
            ids_ref, counts_ref, expert, num_flat=num_flat, tile=tile, scan=scan, num_tiles=num_tiles
        )

        def body(j):
            positions_ref[expert * width + j] = find(threshold(expert, j))
            return j + groups

        jax.lax.while_loop(lambda j: j < live, body, group)


def _flat_boundary_kernel(
    ids_ref,
    counts_ref,
    thresholds_ref,
    logcnt_ref,
    positions_ref,
    *,
    num_flat,
    num_logical,
    width,
    tile,
    scan,
    num_tiles,
    programs,
    cap,
):
    """The same positions, a program per live boundary: program ``b`` finds the ``b``-th live boundary in
    expert-major order (then ``b + programs``, ... if there are more), and writes every ``programs``-th dead entry
    (``j >= logcnt[e]``) of the table as ``int32 max``."""
    program = pl.program_id(0)
    threshold = _threshold_reader(thresholds_ref, width=width, cap=cap)
    lanes = jnp.arange(max(16, pl.next_power_of_2(num_logical)), dtype=jnp.int32)
    live = jnp.where(
        lanes < num_logical, jnp.clip(plgpu.load(logcnt_ref.at[jnp.minimum(lanes, num_logical - 1)]), 0, width), 0
    )
    ends = jnp.cumsum(live)  # expert e's boundaries are the live ones numbered [ends[e] - live[e], ends[e])
    total = jnp.sum(live)
    # Dead entries, every programs-th of the table: masked-off lanes point at distinct spare entries past it (see
    # _boundary_kernel).
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
        positions_ref[expert * width + j] = find(threshold(expert, j))
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
    thresholds,
    limits,
    logcnt,
    *,
    num_logical,
    width,
    expert_bins,
    tile=None,
    sub=None,
    groups=None,
    scan=None,
    count_warps=None,
    num_warps=4,
    grid=None,
    programs=None,
    quota_cap=None,
    interpret=False,
    out_struct=jax.ShapeDtypeStruct,
):
    """Boundary positions, expert-major, from the flat ``ids [N]`` and ``thresholds [E * S]``: flat int32, the
    ``E * S`` positions then a few spare entries (the store target of masked-off lanes; returned as they are,
    since a slice would be a copy kernel, and never read).

    ``quota_cap``: ``thresholds`` are the raw quotas ``[E * S]`` (any int32) and the boundary programs sum
    them as the wrapper's thresholds are built, clipped to ``[0, quota_cap]`` and capped at it (``width *
    quota_cap`` must stay below ``2**31``); ``None``: they are the built thresholds.

    ``tile``: entries per position tile (default :func:`position_tile`); ``sub``
    the tile-count kernel's entries per step; ``scan`` entries per step of the tile
    scans. ``grid``: ``"flat"`` (``programs`` programs -- say ``P``, the live
    boundaries of a placement -- each taking one live boundary,
    :func:`_flat_boundary_kernel`) or ``"expert"`` (``groups`` programs per
    expert, :func:`_boundary_kernel`); ``None``: ``_GRID`` (flat). ``out_struct`` makes the outputs'
    ``ShapeDtypeStruct`` (inside ``shard_map``: varying over the inputs' manual axes).
    """
    num_flat = ids.shape[0]
    tile = position_tile(num_flat) if tile is None else int(tile)
    sub = min(tile, 4096) if sub is None else min(int(sub), tile)  # one step per tile
    scan = min(tile, _SCAN if scan is None else int(scan))
    groups = min(width, _GROUPS) if groups is None else int(groups)
    grid = grid or _GRID
    programs = num_logical * width if programs is None else int(programs)
    if tile & (tile - 1) or sub & (sub - 1) or sub < 16 or scan & (scan - 1) or groups < 1 or programs < 1:
        raise ValueError(
            f"position tile, step and scan must be powers of two (step >= 16), groups and programs "
            f">= 1, got tile={tile} sub={sub} scan={scan} groups={groups} programs={programs}"
        )
    if grid not in ("expert", "flat"):
        raise ValueError(f"the boundary grid must be 'expert' or 'flat', got {grid!r}")
    if quota_cap is not None and not (int(quota_cap) >= 0 and width * int(quota_cap) < 2**31 - 1):
        raise ValueError(
            f"quota_cap must be >= 0 with width * quota_cap < 2**31 - 1 (the quota sums fit int32), "
            f"got {quota_cap} for width {width}"
        )
    cap = None if quota_cap is None else int(quota_cap)
    num_tiles = pl.cdiv(num_flat, tile)
    whole = pl.no_block_spec
    counts = pl.pallas_call(
        functools.partial(
            _tile_counts_kernel,
            num_flat=num_flat,
            num_logical=num_logical,
            tile=tile,
            sub=sub,
            expert_bins=expert_bins,
            num_tiles=num_tiles,
        ),
        grid=(num_tiles,),
        in_specs=[whole, whole],
        out_specs=whole,
        out_shape=out_struct((expert_bins * num_tiles,), jnp.int32),
        # (one 4096-entry step of 8 warps: 262144 x 8 counts 5.4 vs 6.4 us in 1024-entry steps of 4, H200)
        compiler_params=plgpu.CompilerParams(num_warps=count_warps or (8 if sub >= 2048 else 4), num_stages=3),
        interpret=interpret,
        name="tile_counts",
    )(ids, limits)
    if grid == "flat":
        programs = min(programs, num_logical * width)
        kernel = functools.partial(
            _flat_boundary_kernel,
            num_flat=num_flat,
            num_logical=num_logical,
            width=width,
            tile=tile,
            scan=scan,
            num_tiles=num_tiles,
            programs=programs,
            cap=cap,
        )
        spare = pl.next_power_of_2(pl.cdiv(num_logical * width, programs))
    else:
        programs = num_logical * groups
        kernel = functools.partial(
            _boundary_kernel,
            num_flat=num_flat,
            width=width,
            tile=tile,
            scan=scan,
            num_tiles=num_tiles,
            groups=groups,
            cap=cap,
        )
        spare = pl.next_power_of_2(pl.cdiv(width, groups))
    return pl.pallas_call(
        kernel,
        grid=(programs,),
        in_specs=[whole] * 4,
        out_specs=whole,
        out_shape=out_struct((num_logical * width + spare,), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="boundary_positions",
    )(ids, counts, thresholds, logcnt)


# ------------------------------------------------------------- in the map kernel
_OFFSET_SHIFT = 16  # a start word: boundaries passed before the step (low 16 bits) | next boundary's offset << 16


def start_table_fits(width: int, sub: int) -> bool:
    """Whether :func:`start_words`' words hold these shapes (the count below ``2**16``, the offset its 15 bits)."""
    return width < 1 << _OFFSET_SHIFT and sub < 1 << 15


def start_words(positions_ref, count_of, start, *, num_logical, width, sub, dynamic=True):
    """Per expert (``[E_pad]`` lanes): its boundaries below ``start`` and the offset of its next one from
    ``start`` (clamped to ``sub``), packed ``before | offset << 16``: one bisection over every expert's row at once
    (``dynamic``: a ``while`` loop until all lanes converged). ``count_of(experts)``: replica counts (>= 1)."""
    lanes = jnp.arange(max(16, pl.next_power_of_2(num_logical)), dtype=jnp.int32)
    lane_expert = jnp.minimum(lanes, num_logical - 1)
    lane_count = count_of(lane_expert)
    lane_live = jnp.minimum(lane_count, width)
    multi = (lanes < num_logical) & (lane_count > 1)  # one replica: no boundaries
    row = lambda j: lane_expert * width + j
    before = _upper_bound(
        _loads(positions_ref, row),
        jnp.full(lanes.shape, start - 1, jnp.int32),
        width,
        lane_live,
        multi,
        dynamic=dynamic,
    )
    following = plgpu.load(
        positions_ref.at[row(jnp.minimum(before, width - 1))], mask=multi & (before < lane_live), other=_INT32_MAX
    )
    # following >= start (every earlier boundary is counted in `before`); past the step it is clamped to `sub`.
    return before | (jnp.minimum(following - start, sub) << _OFFSET_SHIFT)


def start_passed(words, positions_ref, at, start, flat, point, expert, count, searching, *, width, dynamic=True):
    """``#{j < count : positions[e, j] <= point}`` per entry of a map-kernel step, mostly without a search.

    Boundaries rise with the flat index, so for the step's entries from
    ``start`` each expert has ``before[e]`` boundaries below ``start`` and
    the next one at ``start + offset[e]`` (:func:`start_words`, once per step
    for all experts): every entry before its expert's next boundary has its
    answer, ``before[e]`` (a ``take`` from the per-expert words); only entries
    at or after one -- at most ``P`` boundaries in the whole input, so few steps
    hold any -- search on from ``before[e] + 1``. ``at(j)``: the entries' flat
    indices of their expert's position ``j``. Entries at ``point = int32 max``
    (past the rank limit: no quota) get ``count`` (every quota spent).
    """
    word = take(words, expert)
    before, offset = word & ((1 << _OFFSET_SHIFT) - 1), word >> _OFFSET_SHIFT
    counted = point != _INT32_MAX
    crossed = searching & counted & (flat - start >= offset)  # at or past the expert's next boundary
    passed = _upper_bound(
        _loads(positions_ref, at), point, width, count, crossed, dynamic=dynamic, low=before + crossed.astype(jnp.int32)
    )
    return jnp.where(counted, passed, count)

"""``resolved`` with ranks only where a threshold falls inside a tile (``resolved_ranks="straddling"``).

An entry of expert ``e`` in *rank tile* ``t`` has the point ``B[t, e] + r``:
``B[t, e]`` the entries of ``e`` in earlier tiles (an exclusive sum down the
tiles of their histograms ``h``), ``r`` its rank among the entries of ``e``
earlier in its own tile. The points of the pair ``(t, e)`` fill
``[B, B + h)`` and the replica is how many thresholds a point passed, so
wherever the next threshold after ``B`` lies above the pair's last point,
every entry of the pair takes the replica of ``B``: its own rank is never
needed. An expert of ``c`` replicas has ``c`` thresholds (the last ends its
quota: hash after it), so at most ``P`` pairs of a call *straddle* one.

The steps: :func:`tile_histograms` (one read of the ids) and the tiles' sums;
the map kernel maps every entry from its pair's first point and marks the
entries of straddling pairs (:data:`STRADDLING`, not counted) and their
tiles (a flag per tile); the rank kernel ranks only the flagged tiles; the map
kernel runs again over the flagged tiles only, with those ranks, and writes
and counts only the marked entries. (A first version settled the straddling
entries inside the map kernel, one expert at a time: every expert's last
threshold sits near its last entries, so with quotas near demand nearly all
of them fall into the last tile, and that one program's loop ran for up to
``E`` experts -- 153 vs 25 us on an H200 at P = 512.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_eplb_jax.pallas._triton_ops import histogram

__all__ = []

STRADDLING = -2  # the map kernel's mark on entries whose pair straddles a threshold (never a slot, never -1)


def _tile_histogram_kernel(ids_ref, limits_ref, hist_ref, *, num_flat, num_logical, tile, sub, expert_bins):
    """Row ``program`` of ``[tiles, E_pad]``: the quota-consuming entries of each expert in this rank tile."""
    program = pl.program_id(0)
    rank_limit = limits_ref[1]

    def step(index, hist):
        start = pl.multiple_of(program * tile + index * sub, sub)
        flat = start + jnp.arange(sub, dtype=jnp.int32)
        ids = plgpu.load(ids_ref.at[pl.ds(start, sub)], mask=flat < num_flat, other=-1)
        consuming = (ids >= 0) & (ids < num_logical) & (flat < rank_limit)
        return hist + histogram(jnp.where(consuming, ids, -1), expert_bins)

    hist_ref[0] = jax.lax.fori_loop(0, tile // sub, step, jnp.zeros((expert_bins,), jnp.int32))


def tile_histograms(ids, limits, *, num_flat, num_logical, tile, expert_bins, num_warps, num_stages, out_struct,
                    interpret):
    """``[tiles, E_pad]`` int32: per rank tile of ``tile`` entries, its quota-consuming entries per expert."""
    tiles = pl.cdiv(num_flat, tile)
    sub = min(tile, 4096)
    return pl.pallas_call(
        lambda *refs: _tile_histogram_kernel(*refs, num_flat=num_flat, num_logical=num_logical, tile=tile, sub=sub,
                                             expert_bins=expert_bins),
        grid=(tiles,),
        in_specs=[pl.no_block_spec, pl.no_block_spec],
        out_specs=pl.BlockSpec((1, expert_bins), lambda i: (i, 0)),
        out_shape=out_struct((tiles, expert_bins), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="tile_histogram",
    )(ids, limits)


def straddles(passed, *, first, pair_count, rank_valid, searching, count, thresholds_at, width):
    """Lanes whose pair has a threshold at or below its last point ``first + pair_count - 1`` beyond the
    ``passed`` ones that ``first`` passed (``thresholds_at(j, mask)`` loads each lane's threshold ``j``)."""
    live = searching & rank_valid & (passed < count)
    upcoming = thresholds_at(jnp.minimum(passed, width - 1), live)  # the first threshold `first` did not pass
    return live & (upcoming <= jnp.where(live, first + pair_count - 1, 0))


def flag_tiles(flags_ref, straddling, tile_of, num_tiles):
    """``flags_ref[t] = 1`` for the rank tiles ``tile_of`` of straddling lanes (the others point at the spare
    entry ``num_tiles``: interpret mode's masked scatter writes back what it read, which must not land on a
    flag another lane sets)."""
    at = jnp.where(straddling, tile_of, num_tiles)
    plgpu.store(flags_ref.at[at], jnp.ones(at.shape, jnp.int32), mask=straddling)

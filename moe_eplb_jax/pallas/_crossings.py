"""``resolved`` without a per-entry rank pass: ranks only where a threshold crosses a tile (``resolved_ranks="crossings"``).

An entry of expert ``e`` in *rank tile* ``t`` has the point ``B[t, e] + r``:
``B[t, e]`` the entries of ``e`` in earlier tiles (an exclusive sum down the
tiles of their histograms ``h``), ``r`` its rank among the entries of ``e``
earlier in its own tile. The points of the pair ``(t, e)`` fill
``[B, B + h)``, and the replica is how many thresholds a point passed. So
wherever no threshold lies in ``(B, B + h - 1]`` -- the next threshold after
``B`` is above the pair's last point -- every entry of the pair takes the
replica of ``B`` and its own rank is never needed. An expert of ``c``
replicas has ``c`` thresholds (the last one ends its quota: hash after it),
so at most ``P`` pairs of a call straddle one, however many tiles there are.

The map kernel therefore searches the pair's first point for every entry,
loads one more threshold to see whether the pair straddles, and only for the
lanes whose pair does (:func:`settle_straddling`), one expert at a time,
counts the earlier entries of that expert in the tile (an exclusive
``cumsum`` over the loop step, plus the tile's earlier steps) and searches
again. What replaces the rank kernel is :func:`_tile_histogram_kernel`: one
read of the ids, no per-entry output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_eplb_jax.pallas._triton_ops import histogram, take

__all__ = []

_MIN_TILE, _MAX_TILE = 256, 8192


def crossing_tile(num_flat: int) -> int:
    """Entries per rank tile: at most 256 tiles (their sums then are one small product), 256 to 8192 entries."""
    return int(min(_MAX_TILE, max(_MIN_TILE, pl.next_power_of_2(pl.cdiv(num_flat, 256)))))


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


def settle_straddling(passed, *, ids_ref, thresholds_at, search, first, pair_count, expert, rank_valid, searching,
                      count, start, sub, rank_tile, num_flat, rank_limit, width, never):
    """``passed`` (each lane's thresholds passed by its pair's first point ``first``), made exact per entry.

    ``thresholds_at(j)`` loads each lane's threshold ``j`` where a mask holds;
    ``search(point, lanes)`` counts the thresholds ``point`` passed on
    ``lanes`` (the kernel's search). A lane straddles when its expert has a
    threshold at most its pair's last point ``first + pair_count - 1`` after the
    ones ``first`` passed; one expert at a time (the largest left: a block
    reduction), those lanes get their rank in the tile and search again. The
    loop step lies inside one rank tile or holds whole ones (both powers of
    two): ranks come from an exclusive ``cumsum`` over the step, minus its value
    where each lane's tile starts, plus the tile's entries in earlier steps.
    """
    live = searching & rank_valid & (passed < count)
    upcoming = thresholds_at(jnp.minimum(passed, width - 1), live)  # the first threshold `first` did not pass
    straddling = live & (upcoming <= jnp.where(live, first + pair_count - 1, 0))
    position = jnp.arange(sub, dtype=jnp.int32)

    def earlier_in_tile(target):  # entries of `target` in this rank tile's steps before this one (rank_tile > sub)
        tile_start = (start // rank_tile) * rank_tile

        def add(index, total):
            begin = pl.multiple_of(tile_start + index * sub, sub)
            flat = begin + position
            ids = plgpu.load(ids_ref.at[pl.ds(begin, sub)], mask=flat < num_flat, other=-1)
            return total + jnp.sum(((ids == target) & (flat < rank_limit)).astype(jnp.int32))

        return jax.lax.fori_loop(0, (start - tile_start) // sub, add, jnp.int32(0))

    def settle_one_expert(carry):
        left, passed = carry
        target = jnp.max(jnp.where(left, expert, -1))
        lanes = left & (expert == target)
        mine = ((expert == target) & rank_valid).astype(jnp.int32)
        rank = jnp.cumsum(mine) - mine  # exclusive: earlier entries of `target` in this step
        if rank_tile < sub:  # ... less those before the lane's own tile
            rank = rank - take(rank, position & ~(rank_tile - 1))
        elif rank_tile > sub:  # ... plus those in the tile's earlier steps
            rank = rank + earlier_in_tile(target)
        point = jnp.where(lanes, first + rank, never)
        return left & ~lanes, jnp.where(lanes, search(point, lanes), passed)

    # (jnp.max of an int, not jnp.any: Pallas Triton has no lowering of reduce_or)
    _, passed = jax.lax.while_loop(lambda carry: jnp.max(carry[0].astype(jnp.int32)) > 0, settle_one_expert,
                                   (straddling, passed))
    return passed

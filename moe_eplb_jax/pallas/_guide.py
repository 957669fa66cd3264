"""The bucket guide of ``resolved``: most searches answered by one load, for :mod:`._triton`.

A point's replica is how many of its expert's live thresholds it passes
(:mod:`._search`). The guide cuts each multi-replica expert's point range
``[0, cap]`` into ``2**g`` buckets of ``2**shift`` points, with ``2**g >=
factor * replicas``, and stores per bucket the answer at its first point and
how many thresholds lie inside it -- usually none, so the bucket's word *is*
the answer (Chen and Asau's guide table, exact for every point). Flat int32
layout: two words per expert, ``offset | shift << 27`` and ``cap`` (the
largest point that matters: the total quota -- a point past it passes every
live threshold, as the total does), then the buckets. A bucket's word is

* ``-1``: every point of it passes all the expert's live thresholds (the
  entry falls back to hash);
* ``slot + 1`` (below ``2**16``): no threshold inside, the answer's slot;
* ``low | span << 16`` (``span > 0``): ``span`` thresholds inside; the answer
  is ``low`` plus how many of thresholds ``[low, low + span)`` the point
  passes (a short search).

Experts take buckets in order while the ``2 * factor * P`` main entries
last (enough when the replica counts sum to at most ``P``, as a placement's
do: an expert's bucket count is below ``2 * factor * count``); a later expert
gets one spare bucket spanning its whole range (still exact, it only searches
more). Quotas change per batch, so the guide is built on every call: by
:func:`guide_kernel` (one Pallas kernel: XLA's ops for the same build cost
7-11 us on an H200) or :func:`guide_table` (jnp, its reference).

An option of the map kernel (``guide=factor``), off by default: it paid while the search read a transposed copy
of the thresholds (eighth session), but once the search reads them expert-major as built, its own kernel
(2.5-4 us) costs about what it saves (H200, ``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_eplb_jax.pallas._search import _loads, _upper_bound
from moe_eplb_jax.pallas._triton_ops import take

__all__ = ["guide_table", "guide_kernel", "guide_size"]

_INT32_MAX = np.iinfo(np.int32).max
OFFSET_BITS = 27
MAX_WIDTH = 1 << 15  # low and span fit 15 bits
_CHUNK = 512  # buckets per loop step of guide_kernel


def guide_size(num_logical: int, num_physical: int, factor: int) -> int:
    """Entries of the guide array: 2 per expert, ``2 * factor * P`` main buckets, one spare bucket per expert."""
    return 2 * num_logical + 2 * factor * num_physical + num_logical


def _bit_length(x):
    return 32 - jax.lax.clz(x)


def _layout(count, cap, width, factor, main):
    """Per expert ``(offset, shift, end)`` of its buckets (``end``: past its last main bucket, else past ``main``)."""
    live = jnp.minimum(count, width)
    bits = _bit_length(jnp.maximum(factor * live, 1) - 1)  # ceil(log2(factor * live))
    shift = jnp.maximum(_bit_length(cap) - bits, 0)
    size = jnp.where(count > 1, (cap >> shift) + 1, 0)  # single-replica experts never read the guide
    end = jnp.cumsum(size, dtype=jnp.int32)
    fits = end <= main
    spare = main + jnp.arange(count.shape[0], dtype=jnp.int32)
    offset = jnp.where(fits, end - size, spare)
    shift = jnp.where(fits, shift, 31)  # one bucket: every point in [0, cap] >> 31 = 0
    return offset, shift, jnp.where(fits, end, _INT32_MAX)


def _bucket_points(entry, offset, shift, cap):
    """``(first, last)`` points of each entry's bucket (garbage for unused main entries, never read)."""
    first = (entry - offset) << shift
    points_minus_one = jnp.where(shift >= 31, _INT32_MAX, (1 << jnp.minimum(shift, 30)) - 1)
    return first, jnp.minimum(first + points_minus_one, cap)


def _word(low, span, slot, count):
    everything = low >= count  # past every live threshold: the hash fallback
    return jnp.where(span > 0, low | (span << 16), jnp.where(everything, -1, jnp.clip(slot, -1, 0xFFFE) + 1))


def guide_table(thresholds, log2phy, count, *, factor: int, num_physical: int):
    """The guide (module docstring) of ``thresholds [E, S]`` in jnp: the reference of :func:`guide_kernel`.

    ``count [E]`` is the kernel's replica count (``logcnt`` clipped to
    ``[1, 0x7FFF]``); ``log2phy [E, S]`` gives the slots of buckets with no
    threshold inside.
    """
    num_logical, width = thresholds.shape
    live = jnp.minimum(count, width)
    cap = jnp.maximum(jnp.take_along_axis(thresholds, (live - 1)[:, None], axis=1)[:, 0], 0)
    main = 2 * factor * num_physical
    offset, shift, end = _layout(count, cap, width, factor, main)
    entry = jnp.arange(main + num_logical, dtype=jnp.int32)
    owner = jnp.sum(end[None, :] <= entry[:, None], axis=1, dtype=jnp.int32)  # ends rise: the entry's expert
    owner = jnp.where(entry < main, jnp.minimum(owner, num_logical - 1), entry - main)
    first, last = _bucket_points(entry, offset[owner], shift[owner], cap[owner])
    row = thresholds[owner]  # [entries, S]
    is_live = jnp.arange(width)[None, :] < live[owner][:, None]
    low = jnp.sum(is_live & (row <= first[:, None]), axis=1, dtype=jnp.int32)
    span = jnp.sum(is_live & (row <= last[:, None]), axis=1, dtype=jnp.int32) - low
    slot = jnp.take_along_axis(log2phy[owner], jnp.minimum(low, width - 1)[:, None], axis=1)[:, 0]
    head = jnp.stack([offset | (shift << OFFSET_BITS), cap], axis=1).reshape(-1)
    return jnp.concatenate([head, _word(low, span, slot, count[owner])])


def _guide_kernel(lookup_ref, thresholds_ref, guide_ref, *, factor, num_logical, width, num_physical, chunk):
    """Program ``e`` writes expert ``e``'s buckets, ``chunk`` at a time (program 0 also every head word).

    ``lookup_ref`` is the map kernel's default lookup table (heads ``(first +
    1) | count << 16``, then ``log2phy`` replica-major), ``thresholds_ref`` the
    expert-major ``[E * S]`` thresholds. Every program derives the whole
    layout (a few ``[E]`` vectors) and holds its expert's rows, so its
    searches run in registers (``tt.gather``), not as chains of global loads.
    """
    program = pl.program_id(0)
    experts = pl.next_power_of_2(num_logical)
    expert = jnp.arange(experts, dtype=jnp.int32)
    is_expert = expert < num_logical
    head = plgpu.load(lookup_ref.at[expert], mask=is_expert, other=1 << 16)
    count = jnp.where(is_expert, head >> 16, 0)  # padding experts: no buckets
    live = jnp.minimum(count, width)
    at = expert * width + jnp.maximum(live - 1, 0)
    cap = jnp.maximum(plgpu.load(thresholds_ref.at[at], mask=is_expert, other=0), 0)
    main = 2 * factor * num_physical
    offset, shift, end = _layout(count, cap, width, factor, main)

    @pl.when(program == 0)
    def _():
        plgpu.store(guide_ref.at[2 * expert], offset | (shift << OFFSET_BITS), mask=is_expert)
        plgpu.store(guide_ref.at[2 * expert + 1], cap, mask=is_expert)

    mine = expert == program
    pick = lambda values: jnp.sum(jnp.where(mine, values, 0))
    my_count, my_offset, my_shift, my_cap = pick(count), pick(offset), pick(shift), pick(cap)
    my_live = jnp.minimum(my_count, width)
    size = jnp.where(my_count > 1, jnp.where(pick(end) == _INT32_MAX, 1, pick(end) - my_offset), 0)
    row_size = pl.next_power_of_2(width)
    j = jnp.arange(row_size, dtype=jnp.int32)
    row = plgpu.load(
        thresholds_ref.at[program * width + j], mask=(j < my_live) & (my_count > 1), other=_INT32_MAX
    )  # non-decreasing; the bisection reads only the live entries
    slots = plgpu.load(
        lookup_ref.at[num_logical + j * num_logical + program], mask=(j < width) & (my_count > 1), other=-1
    )

    def step(index, carry):
        bucket = index * chunk + jnp.arange(chunk, dtype=jnp.int32)
        used = bucket < size
        first, last = _bucket_points(bucket + my_offset, my_offset, my_shift, my_cap)
        # How many of the row's live entries each point passes: the map kernel's bisection, through tt.gather.
        passed = lambda points: _upper_bound(
            lambda j, active: take(row, j), points, width, jnp.full_like(points, my_live), used
        )
        low = passed(first)
        slot = take(slots, jnp.minimum(low, width - 1))
        word = _word(low, passed(last) - low, slot, my_count)
        plgpu.store(guide_ref.at[2 * num_logical + my_offset + bucket], word, mask=used)
        return carry

    jax.lax.fori_loop(0, pl.cdiv(size, chunk), step, jnp.int32(0))


def guide_kernel(
    lookup,
    thresholds,
    *,
    factor: int,
    num_logical: int,
    width: int,
    num_physical: int,
    out_struct=jax.ShapeDtypeStruct,
    interpret: bool = False,
):
    """The guide of expert-major thresholds ``[E * S]`` and the default ``lookup`` table, as one Pallas kernel.

    Entries no expert reads (past the last main bucket in use, spares of
    experts that fit) are left unwritten.
    """
    kernel = functools.partial(
        _guide_kernel, factor=factor, num_logical=num_logical, width=width, num_physical=num_physical, chunk=_CHUNK
    )
    return pl.pallas_call(
        kernel,
        grid=(num_logical,),
        in_specs=[pl.no_block_spec, pl.no_block_spec],
        out_specs=pl.no_block_spec,
        out_shape=out_struct((guide_size(num_logical, num_physical, factor),), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="share_guide",
    )(lookup, thresholds)


def guide_passed(guide_ref, thresholds_ref, at, expert, point, count, num_logical, width, searching, *, dynamic):
    """In the map kernel, for each entry where ``searching`` holds: ``(known, slot, passed)``.

    ``known``: the bucket holds no threshold, so ``slot`` is the answer's
    slot (``-1``: none) and no ``log2phy`` load is needed; otherwise
    ``passed`` is how many live thresholds the point passes (a short search
    inside the bucket), or ``count`` where it passes them all (resolved's
    hash fallback).
    """
    head = plgpu.load(guide_ref.at[2 * expert], mask=searching, other=0)
    offset = head & ((1 << OFFSET_BITS) - 1)
    shift = (head >> OFFSET_BITS) & 31
    cap = plgpu.load(guide_ref.at[2 * expert + 1], mask=searching, other=0)
    bucket = jnp.minimum(point, cap) >> shift
    word = plgpu.load(guide_ref.at[2 * num_logical + offset + bucket], mask=searching, other=0)
    low, span = word & 0xFFFF, (word >> 16) & 0x7FFF
    inside = searching & (word >= 0x10000)  # span > 0
    passed = _upper_bound(_loads(thresholds_ref, at), point, width, low + span, inside, dynamic=dynamic, low=low)
    known = searching & (word >= 0) & (word < 0x10000)  # slot + 1
    return known, low - 1, jnp.where(searching & (word < 0), count, passed)

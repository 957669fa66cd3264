"""Threshold search inside the map kernel (``shares`` / ``resolved``), for :mod:`._triton`.

Each entry's point is compared with its expert's non-decreasing thresholds:
the replica is how many of the first ``count`` it passes. A search per lane
(:func:`_upper_bound`: bisection, or a k-ary search with ``arity - 1``
independent probes per step; unrolled or a ``while`` loop per block),
optionally after independent loads of a row's first entries
(:func:`_count_passed`); for ``shares`` optionally a per-expert bucket table
answers most points with one load (:func:`share_buckets`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import triton as plgpu

__all__ = ["share_buckets"]

_INT32_MAX = np.iinfo(np.int32).max


def _upper_bound(thresholds_ref, at, point, width, live, searching, dynamic=False, arity=2):
    """``#{j < live : thresholds[at(j)] <= point}`` for non-decreasing rows (an ``arity``-ary search), ``live <= width``.

    ``at(j)`` is the flat index of each lane's threshold ``j`` (the table
    layout); ``live`` each lane's number of real entries (its row's later
    entries are never read). Only lanes where ``searching`` holds load
    thresholds, and only until their search has converged -- after
    ``floor(log_arity(live)) + 1`` steps, so a 4-replica expert in a 257-wide
    table loads 3 thresholds by bisection, not 9; the others return 0.
    ``dynamic``: the block stops stepping once all its lanes have converged (a
    ``while`` loop on a block reduction) instead of issuing every step the
    width needs, masked. ``arity`` > 2 probes ``arity - 1`` evenly spaced
    thresholds per step, loaded independently: fewer dependent steps (5 instead
    of 9 for 257 entries at arity 4) for more loads.
    """
    def step(bounds):  # invariant: thresholds below `low` pass, those from `high` on do not
        low, high = bounds
        active = low < high
        size = high - low
        probes = [low + size * i // arity for i in range(1, arity)]  # non-decreasing, in [low, high)
        passed = [plgpu.load(thresholds_ref.at[at(jnp.minimum(probe, width - 1))], mask=active, other=0) <= point
                  for probe in probes]
        # Rows are non-decreasing, so the passing probes are a prefix: the answer lies after the last of them
        # and at or before the first that fails.
        new_low, new_high = low, high
        for i, probe in enumerate(probes):
            new_low = jnp.where(active & passed[i], probe + 1, new_low)
        for i in reversed(range(len(probes))):
            new_high = jnp.where(active & ~passed[i], probes[i], new_high)
        return new_low, new_high

    bounds = (jnp.zeros_like(point), jnp.where(searching, jnp.minimum(live, width), 0))
    if dynamic:
        # (jnp.max of an int, not jnp.any: Pallas Triton has no lowering of reduce_or)
        bounds = jax.lax.while_loop(lambda b: jnp.max((b[0] < b[1]).astype(jnp.int32)) > 0, step, bounds)
    else:
        size = int(width)
        while size:  # the step's largest remaining interval is floor(size / arity)
            bounds = step(bounds)
            size //= arity
    return bounds[0]


_LINEAR_SEARCH = 0  # default: bisection bounded by the replica count (measured faster than independent loads)


def _count_passed(thresholds_ref, at, point, width, count, searching, linear=_LINEAR_SEARCH, dynamic=False,
                  arity=2):
    """``#{j < width : thresholds[at(j)] <= point}`` where ``searching`` holds, else 0.

    The row's first ``linear`` entries: one independent load per entry below
    ``count`` (the row's later entries are ``int32 max`` by construction, which
    is also what the masked loads read), so the loads overlap instead of a
    bisection's chain of dependent loads. Entries from ``linear`` on (rows of
    a wide table: ``Placement`` tables are ``P - E + 1`` wide whatever the
    replica counts) only for lanes that passed all of the first ``linear``
    and have more live entries -- by bisection (:func:`_upper_bound`); every
    other lane has its answer (rows are non-decreasing), so for experts of at
    most ``linear`` replicas the bisection's loads are all masked off.
    """
    linear = min(width, linear)
    passed = jnp.zeros_like(point)
    for j in range(linear):
        value = plgpu.load(thresholds_ref.at[at(j)], mask=searching & (j < count), other=_INT32_MAX)
        passed = passed + (value <= point).astype(jnp.int32)
    if width > linear:
        deeper = searching & (count > linear) & (passed == linear)
        passed = passed + _upper_bound(thresholds_ref, lambda j: at(j + linear), point, width - linear,
                                       count - linear, deeper, dynamic=dynamic, arity=arity)
    return jnp.where(searching, passed, 0)


# shares with share_buckets=b: each expert's point range [0, 2**24) in 2**b buckets. A bucket's entry is
# base | offset << 9: base = the thresholds at or below the bucket's start, offset = where in the bucket its one
# inner threshold lies (2**(24 - b): none); -1 when two or more thresholds fall inside (those entries search).
_POINT_BITS = 24
_BASE_BITS = 9  # base <= the table width: buckets need rows of at most 511 replicas


def share_buckets(thresholds, bits: int):
    """``[E * 2**bits]`` int32 bucket entries (see above) of non-decreasing ``[E, S]`` shares thresholds.

    For a point ``p`` in bucket ``k`` (``p >> (24 - bits)``) the number of
    thresholds ``<= p`` is ``base + (p - start >= offset)`` exactly, unless
    the entry is -1 -- so one load, beside the head load, replaces the search
    of almost every entry.
    """
    shift = _POINT_BITS - bits
    start = jnp.arange(1 << bits, dtype=jnp.int32) << shift  # [B]
    # Rows are sorted (entries past an expert's count are int32 max): two binary searches per bucket, unrolled
    # into one fusion, instead of comparing every bucket with every threshold ([E, B, S]).
    count_le = jax.vmap(lambda row, points: jnp.searchsorted(row, points, side="right", method="scan_unrolled"),
                        in_axes=(0, None))
    base = count_le(thresholds, start).astype(jnp.int32)  # [E, B]: thresholds <= the bucket's start
    num_inner = count_le(thresholds, start + ((1 << shift) - 1)).astype(jnp.int32) - base  # start < t < end
    first = jnp.take_along_axis(thresholds, jnp.minimum(base, thresholds.shape[1] - 1), axis=1)  # the first inner
    offset = jnp.where(num_inner == 0, 1 << shift, first - start[None, :])
    return jnp.where(num_inner >= 2, -1, base | (offset << _BASE_BITS)).reshape(-1)


def _bucket_passed(buckets_ref, expert, point, bits):
    """``(passed, crowded)``: thresholds ``<= point`` from the expert's bucket entry; crowded lanes must search."""
    shift = _POINT_BITS - bits
    entry = buckets_ref[expert * (1 << bits) + (point >> shift)]  # no dependence on the head load
    offset = (entry >> _BASE_BITS) & ((1 << (shift + 1)) - 1)
    passed = (entry & ((1 << _BASE_BITS) - 1)) + ((point & ((1 << shift) - 1)) >= offset).astype(jnp.int32)
    return passed, entry < 0

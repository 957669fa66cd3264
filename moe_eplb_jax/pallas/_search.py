"""Threshold search inside the map kernel (``resolved``), for :mod:`._triton`.

Each entry's point is compared with its expert's non-decreasing thresholds:
the replica is how many of the first ``count`` it passes. A bisection per
lane (:func:`_upper_bound`: unrolled, or a ``while`` loop per block),
optionally after independent loads of a row's first entries
(:func:`_count_passed`). With the bucket guide (:mod:`._guide`, an option,
off by default) most entries skip the search and the rest search a bucket's
few thresholds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import triton as plgpu

__all__ = []

_INT32_MAX = np.iinfo(np.int32).max


def _loads(thresholds_ref, at):
    """A reader for :func:`_upper_bound`: each lane's threshold ``j`` is a global load at flat index ``at(j)``."""
    return lambda j, active: plgpu.load(thresholds_ref.at[at(j)], mask=active, other=0)


def _upper_bound(read, point, width, live, searching, dynamic=False, low=None):
    """``#{j < live : threshold j <= point}`` for non-decreasing rows, by bisection, ``live <= width``.

    ``read(j, active)`` gives each lane's threshold ``j`` (``j < width``) where
    ``active`` holds: a global load in the table's layout (:func:`_loads`), or
    a gather from a row the program holds. ``live`` is each lane's number of
    real entries (its row's later entries are never read). Only lanes where
    ``searching`` holds read thresholds, and only until their search has converged -- after
    ``bit_length(live - low)`` steps, so a 4-replica expert in a 257-wide table
    loads 3 thresholds, not 9; the others return ``low``. ``dynamic``: the
    block stops stepping once all its lanes have converged (a ``while`` loop
    on a block reduction) instead of issuing every step the width needs,
    masked. ``low`` (default 0): each lane's first entry not yet known to
    pass (the guide's bucket start, :mod:`._guide`). (A 4- / 8-ary search,
    3 / 7 independent probes per step, was slower on an H200: resolved's map
    kernel 31.4 / 42.1 us against 24.7 / 32.1 by bisection.)
    """

    def step(bounds):  # invariant: thresholds below `low` pass, those from `high` on do not
        low, high = bounds
        active = low < high
        middle = (low + high) >> 1
        passed = read(jnp.minimum(middle, width - 1), active) <= point
        return jnp.where(active & passed, middle + 1, low), jnp.where(active & ~passed, middle, high)

    low = jnp.zeros_like(point) if low is None else low
    bounds = (low, jnp.where(searching, jnp.minimum(live, width), low))
    if dynamic:
        # (jnp.max of an int, not jnp.any: Pallas Triton has no lowering of reduce_or)
        bounds = jax.lax.while_loop(lambda b: jnp.max((b[0] < b[1]).astype(jnp.int32)) > 0, step, bounds)
    else:
        for _ in range(int(width).bit_length()):
            bounds = step(bounds)
    return bounds[0]


_LINEAR_SEARCH = 0  # default: bisection bounded by the replica count (measured faster than independent loads)


def _count_passed(thresholds_ref, at, point, width, count, searching, linear=_LINEAR_SEARCH, dynamic=False):
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
        passed = passed + _upper_bound(
            _loads(thresholds_ref, lambda j: at(j + linear)),
            point,
            width - linear,
            count - linear,
            deeper,
            dynamic=dynamic,
        )
    return jnp.where(searching, passed, 0)

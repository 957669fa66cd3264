"""Row reads shared by mode ``"quota"``'s kernels (:mod:`._triton`, :mod:`._rank`, :mod:`._positions`).

:func:`upper_bound`: how many of a non-decreasing row's first entries a point passes, by a bisection that stops
at each lane's replica count. :func:`clipped_quotas`: one expert's raw quotas as the thresholds are built from
them (:func:`._tables.quota_thresholds`), so kernels can sum them themselves.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = ["loads", "upper_bound", "clipped_quotas"]


def loads(table_ref, at):
    """A reader for :func:`upper_bound`: each lane's entry ``j`` is a global load at flat index ``at(j)``."""
    return lambda j, active: plgpu.load(table_ref.at[at(j)], mask=active, other=0)


def upper_bound(read, point, width, live, searching, *, dynamic, low=None):
    """``#{j < live : row_j <= point}`` per lane, for non-decreasing rows, ``live <= width``.

    ``read(j, active)`` gives each lane's entry ``j < width`` where ``active``
    holds (:func:`loads`). Only lanes where ``searching`` holds read, and only
    until they converge -- ``bit_length(live - low)`` steps, so a 4-replica
    expert in a 257-wide table loads 3 entries, not 9; the others return
    ``low`` (default 0: each lane's first entry not yet known to pass).
    ``dynamic``: the block stops once every lane converged (a ``while`` loop on
    a block reduction; few lanes search), else every step the width needs runs,
    masked (most lanes search).
    """

    def step(bounds):  # invariant: entries below `low` pass, those from `high` on do not
        low, high = bounds
        active = low < high
        middle = (low + high) >> 1
        passed = read(jnp.minimum(middle, width - 1), active) <= point
        return jnp.where(active & passed, middle + 1, low), jnp.where(active & ~passed, middle, high)

    low = jnp.zeros_like(point) if low is None else low
    bounds = (low, jnp.where(searching, jnp.minimum(live, width), low))
    if dynamic:  # (jnp.max of an int, not jnp.any: Pallas Triton has no lowering of reduce_or)
        bounds = jax.lax.while_loop(lambda b: jnp.max((b[0] < b[1]).astype(jnp.int32)) > 0, step, bounds)
    else:
        for _ in range(int(width).bit_length()):
            bounds = step(bounds)
    return bounds[0]


def clipped_quotas(quotas_ref, expert, count, *, width, cap):
    """``(lanes, quotas)``, ``[2**ceil(log2 S)]`` lanes: ``expert``'s first ``count`` raw quotas (of the flat
    ``[E * S]``) clipped to ``[0, cap]``, 0 past them. Their running sums capped at ``cap`` are the thresholds
    exactly (int32: :func:`._tables.kernel_quotas` makes them fit)."""
    lanes = jnp.arange(pl.next_power_of_2(width), dtype=jnp.int32)
    quotas = plgpu.load(quotas_ref.at[expert * width + jnp.minimum(lanes, width - 1)], mask=lanes < count, other=0)
    return lanes, jnp.clip(quotas, 0, cap)

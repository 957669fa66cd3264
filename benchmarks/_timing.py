"""Timing shared by the benchmark scripts: median wall time of a jitted call, device synchronised."""

from __future__ import annotations

import statistics
import time


def median_seconds(fn, *args, reps: int = 10, warmup: int = 2) -> float:
    """Median seconds of ``fn(*args)`` over ``reps`` calls, after ``warmup`` calls (compilation, caches).

    Each call is followed by ``jax.block_until_ready`` so the device work is inside the timed region.
    """
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)

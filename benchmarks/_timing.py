"""Timing shared by the benchmark scripts: median wall time of a jitted call, device synchronised."""

from __future__ import annotations

import collections
import glob
import statistics
import tempfile
import time

# The cards' HBM bandwidth (the vendors' figures): every memory floor's denominator.
HBM_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}


def hbm_bandwidth(device_kind: str) -> float | None:
    """Bytes per second of the card ``device_kind`` names (``jax.devices()[0].device_kind``); ``None`` off the table."""
    return next((value for card, value in HBM_BANDWIDTH.items() if card in device_kind), None)


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


def device_seconds(fn, *args, calls: int = 10, warmup: int = 2, trace_dir: str | None = None):
    """Device time of ``fn(*args)`` read from the profiler (CUPTI kernel records), host overheads excluded.

    Runs ``fn`` ``calls`` times under ``jax.profiler.trace`` and sums the
    durations of the kernels on the first GPU's streams. Returns ``(seconds per
    call, {kernel name: seconds per call})`` -- the names say which launches the
    time went to. Returns ``(None, {})`` where the trace has no GPU plane (CPU).
    """
    import jax
    from jax.profiler import ProfileData

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    directory = trace_dir or tempfile.mkdtemp(prefix="devtime_")
    with jax.profiler.trace(directory):
        for _ in range(calls):
            jax.block_until_ready(fn(*args))
    paths = sorted(glob.glob(f"{directory}/**/*.xplane.pb", recursive=True))
    if not paths:
        return None, {}
    per_kernel = collections.Counter()
    found = False
    for plane in ProfileData.from_file(paths[-1]).planes:
        if not plane.name.startswith("/device:GPU:0"):
            continue
        found = True
        for line in plane.lines:
            if not line.name.startswith("Stream"):  # kernel records live on the stream lines
                continue
            for event in line.events:
                per_kernel[event.name] += event.duration_ns * 1e-9 / calls
    if not found:
        return None, {}
    if not per_kernel:  # a GPU plane without kernel records on "Stream" lines: say what the lines are called
        lines = [
            line.name
            for plane in ProfileData.from_file(paths[-1]).planes
            if plane.name.startswith("/device:GPU:0")
            for line in plane.lines
        ]
        raise RuntimeError(f"no kernel records on the GPU plane's stream lines; lines: {lines}")
    return sum(per_kernel.values()), dict(per_kernel.most_common())

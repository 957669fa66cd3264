"""Diagnostic: runs ``map_and_count``'s kernels once per case, for a hardware profiler to read.

Each case is one (mode, T, P, options) of ``benchmarks/map_and_count.py``'s sweep, on the same draws (checked
against the reference first), then called ``--calls`` more times. Under Nsight Compute, on the GPU machine::

    ncu --clock-control none --target-processes all -k regex:'map_and_count|expert_rank|tile_counts|boundary' \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        python3 benchmarks/profile_kernels.py --cases "shares:262144:288;hash:262144:288"

Options of a case follow a fourth colon as JSON (``shares:262144:288:{"num_warps": 8}``). The profiler's kernel
launches come in the order of ``--cases``; ``--copy`` first runs the Pallas copy of the ids (the floor's kernel).
Under ncu's replay ``resolved``'s ``tile_counts`` kernel did not finish within a 600 s call (H200, fourteenth
session): profile ``resolved`` on its own, and give the command a timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import map_and_count as bench

from moe_eplb_jax.pallas import _reference, _triton


def case_call(mode, num_tokens, num_physical, options):
    """A jitted call of the kernels, its arguments (``bench.variant_case``'s draws) and whether it gave the
    reference's ids (and loads, unless ``options`` turn counting off)."""
    log2phy, logcnt, _, ids, thresholds, limits = bench.variant_case(mode, num_tokens, num_physical)
    fn = jax.jit(
        lambda x, log2phy, logcnt, thresholds: _triton.map_and_count_triton(
            x,
            log2phy,
            logcnt,
            thresholds,
            limits,
            num_physical=num_physical,
            mode=mode,
            interpret=jax.default_backend() != "gpu",
            **options,
        )
    )
    args = (ids[0], log2phy, logcnt, thresholds)
    got = fn(*args)
    want = _reference.map_and_count_reference(*args, limits, num_physical=num_physical, mode=mode)
    ok = np.array_equal(got[0], want[0]) and (not options.get("count", True) or np.array_equal(got[1], want[1]))
    return fn, args, ok


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True, help="semicolon-separated mode:T:P[:options JSON]")
    parser.add_argument("--calls", type=int, default=1, help="calls per case after the checked one")
    parser.add_argument("--copy", action="store_true", help="first the Pallas copy of 262144 x 8 ids")
    args = parser.parse_args()
    if args.copy:
        x = jnp.asarray(np.random.default_rng(0).integers(0, 256, (262144, 8)), jnp.int32)
        jax.block_until_ready(bench.pallas_copy(x))
    for case in args.cases.split(";"):
        mode, num_tokens, num_physical, *rest = case.split(":", 3)
        options = json.loads(rest[0]) if rest else {}
        fn, call_args, ok = case_call(mode, int(num_tokens), int(num_physical), options)
        for _ in range(args.calls):
            jax.block_until_ready(fn(*call_args))
        print(f"case {case}: {'ok' if ok else 'WRONG RESULT'}", flush=True)


if __name__ == "__main__":
    main()

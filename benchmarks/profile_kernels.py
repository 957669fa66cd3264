"""Diagnostic: runs ``map_and_count``'s kernels once per case, for a hardware profiler to read.

Each case is one (mode, T, P[, Config]) on ``benchmarks/map_and_count.py``'s draws (checked against the
reference first), then called ``--calls`` more times. Under Nsight Compute, on the GPU machine::

    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none --target-processes all \\
        -k regex:'map_and_count|expert_rank|tile_counts|boundary|alias' \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        python3 benchmarks/profile_kernels.py --cases "lp:262144:288;hash:262144:288"

A case's ``Config`` fields follow a fourth colon as JSON (``lp:262144:288:{"num_warps": 8}``; default:
``MapAndCountConfig.default`` by size). The kernels launch in the order of ``--cases``; ``--copy`` first runs a Pallas copy
of the ids (the floor's kernel). Without preallocation switched off ncu backs up the whole preallocated device
memory on every replay. Give the command a timeout: under ncu's replay ``quota``'s ``tile_counts`` kernel can
run for minutes, so profile ``quota`` on its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import map_and_count as bench

from moe_eplb_jax.routing import ROUTING_MODES, MapAndCountConfig, map_and_count, routing_mode


def pallas_copy(x, block=2048, num_warps=4):
    """The Pallas floor: a Triton kernel that reads the ids and writes ids + 1 (same bytes as the mapping)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1

    flat = x.reshape(-1)
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(flat.size, block),),
        in_specs=[pl.BlockSpec((block,), lambda i: (i,))],
        out_specs=pl.BlockSpec((block,), lambda i: (i,)),
        out_shape=jax.ShapeDtypeStruct(flat.shape, flat.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps),
        interpret=jax.default_backend() != "gpu",
    )(flat)
    return out.reshape(x.shape)


def case_call(mode, num_tokens, num_physical, fields):
    """A jitted call of the kernels, its arguments and whether it gave the reference's ids and loads."""
    rng = np.random.default_rng([num_tokens, num_physical, ROUTING_MODES.index(mode)])
    log2phy, logcnt, kw, ids = bench.make_case(rng, num_tokens, 8, num_physical, mode)
    config = dataclasses.replace(MapAndCountConfig.default(routing_mode(mode).kernel, num_tokens * 8), **fields)
    call = functools.partial(map_and_count, num_physical=num_physical, num_valid_tokens=num_tokens - 3, mode=mode)
    fn = jax.jit(lambda x, log2phy, logcnt, kw: call(x, log2phy, logcnt, implementation="pallas", config=config, **kw))
    args = (ids[0], log2phy, logcnt, kw)
    got = fn(*args)
    want = call(ids[0], log2phy, logcnt, implementation="xla", **kw)
    return fn, args, all(np.array_equal(a, b) for a, b in zip(got, want))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True, help="semicolon-separated mode:T:P[:Config fields as JSON]")
    parser.add_argument("--calls", type=int, default=1, help="calls per case after the checked one")
    parser.add_argument("--copy", action="store_true", help="first the Pallas copy of 262144 x 8 ids")
    args = parser.parse_args()
    if args.copy:
        x = jnp.asarray(np.random.default_rng(0).integers(0, 256, (262144, 8)), jnp.int32)
        jax.block_until_ready(pallas_copy(x))
    for case in args.cases.split(";"):
        mode, num_tokens, num_physical, *rest = case.split(":", 3)
        fn, call_args, ok = case_call(mode, int(num_tokens), int(num_physical), json.loads(rest[0]) if rest else {})
        for _ in range(args.calls):
            jax.block_until_ready(fn(*call_args))
        print(f"case {case}: {'ok' if ok else 'WRONG RESULT'}", flush=True)


if __name__ == "__main__":
    main()

"""The warp-specialized Mosaic grouped matmuls (``moe/_gmm/mosaic_ws.py``) against JAX's Mosaic and Triton kernels.

    PYTHONPATH=. python3 benchmarks/gmm_mosaic.py                  # one GPU: the training shape, both directions
    PYTHONPATH=. python3 benchmarks/gmm_mosaic.py --configs 128x64x64/s4/t4,128x128x64/s3/t4 --json ws.json

At ``--rows`` rows of ``--depth`` -> ``--width`` over ``--groups`` groups (multinomial sizes, ``--real`` of the rows
real, the rest padding), bf16: the forward product and the input gradient's (``transpose_rhs``), microseconds per
call from the profiler's kernel records and TFLOP/s over the real rows, for each ``--configs`` tiling
(``BLOCK_MxBLOCK_NxBLOCK_K/sSTAGES/tGRID_TILE_WIDTH``; ``BLOCK_N`` per compute warpgroup), JAX's
``ragged_dot_mgpu`` as ``moe._gmm.mosaic`` runs it, the Triton kernel, and the floor at 989 TFLOP/s; each
with its largest difference from a float32 product on the real rows. Then the weight gradient (``x_s^T dy_s``,
``mosaic_ws.transposed_grouped_matmul``) against JAX's ``transposed_ragged_dot_mgpu`` and Triton's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import device_seconds

PEAK_FLOPS = 989e12


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=65536)
    p.add_argument("--depth", type=int, default=1024)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--real", type=float, default=1.0)
    p.add_argument("--configs", default="128x64x64/s4/t4,128x128x64/s3/t4,128x64x64/s6/t8,64x128x64/s4/t4")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def parse_configs(text: str):
    """``--configs``' tilings; ``SystemExit`` naming a malformed one."""
    from moe_eplb_jax.moe._gmm.mosaic_ws import Config

    configs = []
    for item in text.split(","):
        try:
            blocks, stages, width = item.split("/")
            block_m, block_n, block_k = (int(v) for v in blocks.split("x"))
            configs.append(
                Config(
                    block_m=block_m,
                    block_n=block_n,
                    block_k=block_k,
                    max_concurrent_steps=int(stages.removeprefix("s")),
                    grid_tile_width=int(width.removeprefix("t")),
                )
            )
        except ValueError as err:
            raise SystemExit(f"--configs: {item!r} is not BLOCK_MxBLOCK_NxBLOCK_K/sSTAGES/tWIDTH ({err})") from None
    return configs


def main(argv=None):
    args = parse_args(argv)
    configs = parse_configs(args.configs)
    import jax
    import jax.numpy as jnp

    from moe_eplb_jax.moe._gmm import mosaic, mosaic_ws, triton

    if jax.default_backend() != "gpu":
        raise SystemExit("gmm_mosaic.py times Mosaic GPU kernels: no GPU here")
    rng = np.random.default_rng(0)
    live = int(args.rows * args.real)
    sizes = jnp.asarray(rng.multinomial(live, [1 / args.groups] * args.groups), jnp.int32)
    x = jnp.asarray(rng.standard_normal((args.rows, args.depth)), jnp.bfloat16)
    slot = np.repeat(np.arange(args.groups), np.asarray(sizes))
    xs = np.asarray(x, np.float32)[:live]
    flops = 2 * live * args.depth * args.width
    results = []
    for transpose in (False, True):
        shape = (args.groups, args.width, args.depth) if transpose else (args.groups, args.depth, args.width)
        w = jnp.asarray(rng.standard_normal(shape) / args.depth**0.5, jnp.bfloat16)
        dense = np.asarray(jnp.swapaxes(w, 1, 2) if transpose else w, np.float32)
        want = np.concatenate([xs[slot == s] @ dense[s] for s in range(args.groups)])
        calls = {
            label(c): jax.jit(lambda x, w, s, c=c: mosaic_ws.grouped_matmul(x, w, s, transpose_rhs=transpose, config=c))
            for c in configs
        }
        calls["ragged_dot_mgpu"] = jax.jit(
            lambda x, w, s: mosaic.grouped_matmul(x, w, s, transpose_rhs=transpose, config=mosaic.FORWARD)
        )
        calls["triton"] = jax.jit(lambda x, w, s: triton.grouped_matmul(x, w, s, transpose_rhs=transpose))
        results += timed_rows(calls, (x, w, sizes), want, flops, {"transpose_rhs": transpose}, rows=live)
    results += weight_gradient_rows(args, configs, x, sizes, rng)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def weight_gradient_rows(args, configs, x, sizes, rng):
    """The weight gradient ``x_s^T dy_s`` per group: each ``mosaic_ws`` tiling, JAX's
    ``transposed_ragged_dot_mgpu`` (``moe._gmm.mosaic``) and Triton's, against a float32 product of each group."""
    import jax
    import jax.numpy as jnp

    from moe_eplb_jax.moe._gmm import mosaic, mosaic_ws, triton

    live = int(np.asarray(sizes).sum())
    dy = jnp.asarray(rng.standard_normal((args.rows, args.width)), jnp.bfloat16)
    # Rows past the groups zeroed, as the training path hands them over (JAX's kernel masks by multiplying).
    x = x.at[live:].set(0)
    dy = dy.at[live:].set(0)
    ends = np.cumsum(np.asarray(sizes))
    xs, dys = np.asarray(x, np.float32), np.asarray(dy, np.float32)
    want = np.stack([xs[e - n : e].T @ dys[e - n : e] for n, e in zip(np.asarray(sizes), ends)])
    flops = 2 * live * args.depth * args.width
    calls = {
        label(c): jax.jit(lambda x, dy, s, c=c: mosaic_ws.transposed_grouped_matmul(x, dy, s, config=c))
        for c in configs
    }
    calls["transposed_ragged_dot_mgpu"] = jax.jit(
        lambda x, dy, s: mosaic.transposed_grouped_matmul(x, dy, s, config=mosaic.WEIGHT_GRADIENT)
    )
    calls["triton"] = jax.jit(triton.transposed_grouped_matmul)
    return timed_rows(calls, (x, dy, sizes), want, flops, {"product": "weight gradient"})


def label(config) -> str:
    """A ``mosaic_ws.Config`` as ``--configs`` writes it."""
    c = config
    return f"ws {c.block_m}x{c.block_n}x{c.block_k}/s{c.max_concurrent_steps}/t{c.grid_tile_width}"


def timed_rows(calls: dict, inputs: tuple, want, flops: int, fields: dict, *, rows: int | None = None) -> list:
    """One printed row per call: ``fields``, microseconds per call from the profiler, TFLOP/s at ``flops``, the
    floor at 989 TFLOP/s and the largest difference from ``want`` over the first ``rows`` output rows (all where
    ``None``) -- or the error of a call that cannot compile or run here."""
    out = []
    for name, call in calls.items():
        row = {**fields, "kernel": name, "floor_us": flops / PEAK_FLOPS * 1e6}
        try:
            got = np.asarray(call(*inputs), np.float32)[:rows]
            seconds, _ = device_seconds(call, *inputs, calls=10)
            row |= {"us": seconds * 1e6, "tflops": flops / seconds / 1e12, "max_diff": float(np.abs(got - want).max())}
        except Exception as err:  # a tiling past shared memory, a kernel that cannot compile here
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
        out.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return out


if __name__ == "__main__":
    main()

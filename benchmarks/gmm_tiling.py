"""The Triton grouped matmul's tilings at decode shapes: each tiling next to the default one and the weight-read floor.

    PYTHONPATH=. python3 benchmarks/gmm_tiling.py                  # one GPU, the small preset's expert shapes
    PYTHONPATH=. python3 benchmarks/gmm_tiling.py --json tiling.json

For the batch sizes of ``--batches`` (rows = batch x top-k, spread over ``--groups`` experts: at batch 1 each
row its own expert, above that multinomial), both expert products (``--dim`` -> ``2 x --hidden`` and ``--hidden``
-> ``--dim``): microseconds per call from the profiler's kernel records, the fraction of the floor (the touched
experts' weights and the rows over the card's HBM bandwidth) and the largest difference from a float32 product.
``moe._gmm.triton.default_config`` is chosen from these figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import device_seconds

HBM = {"H100": 3.35e12, "H200": 4.8e12}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,32,256")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--show", type=int, default=5, help="tilings printed per case, fastest first")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def tilings(triton, rows_per_group: float):
    block_rows = (16,) if rows_per_group <= 4 else (16, 32, 64)
    for rows, cols, depth, stages in itertools.product(block_rows, (32, 64, 128), (64, 128, 256), (2, 3, 4)):
        yield triton.Config(block_rows=rows, block_cols=cols, block_k=depth, num_warps=4, num_stages=stages)


def main(argv=None):
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp

    from moe_eplb_jax.moe._gmm import triton

    if jax.default_backend() != "gpu":
        raise SystemExit("gmm_tiling.py times Triton kernels: run it on a GPU")
    kind = jax.devices()[0].device_kind
    hbm = next((v for k, v in HBM.items() if k in kind), None)
    rng = np.random.default_rng(0)
    results = {"device": kind}
    for batch in (int(b) for b in args.batches.split(",")):
        rows, g = batch * args.top_k, args.groups
        if batch == 1:
            sizes = np.zeros(g, np.int32)
            sizes[rng.choice(g, min(rows, g), replace=False)] = 1
        else:
            sizes = rng.multinomial(rows, [1 / g] * g).astype(np.int32)
        for depth, width in ((args.dim, 2 * args.hidden), (args.hidden, args.dim)):
            x = jnp.asarray(rng.standard_normal((rows, depth)), jnp.bfloat16)
            w = jnp.asarray(rng.standard_normal((g, depth, width)) / depth**0.5, jnp.bfloat16)
            group_sizes = jnp.asarray(sizes)
            slot = np.repeat(np.arange(g), sizes)
            want = np.einsum("nk,nkm->nm", np.asarray(x, np.float32), np.asarray(w, np.float32)[slot])
            floor_bytes = int((sizes > 0).sum()) * depth * width * 2 + rows * (depth + width) * 2
            default = triton.default_config(rows, width, g)
            rows_out = []
            for config in [default, *tilings(triton, rows / g)]:
                f = jax.jit(lambda x, w, s, config=config: triton.grouped_matmul(x, w, s, config=config))
                try:
                    got = np.asarray(f(x, w, group_sizes), np.float32)
                    seconds, _ = device_seconds(f, x, w, group_sizes, calls=20, warmup=1)
                except Exception as e:  # a tiling this Triton cannot compile
                    print(f"  skipped {config}: {type(e).__name__}")
                    continue
                rows_out.append(
                    {
                        "config": f"{config.block_rows}x{config.block_cols}x{config.block_k} s{config.num_stages}",
                        "default": config == default,
                        "us": seconds * 1e6,
                        "x_floor": seconds * hbm / floor_bytes if hbm else float("nan"),
                        "max_error": float(np.max(np.abs(got - want))),
                    }
                )
            label = f"batch {batch}: {rows} rows over {g} groups, {depth} -> {width}"
            results[label] = rows_out
            floor_us = floor_bytes / hbm * 1e6 if hbm else float("nan")
            print(f"== {label}; floor {floor_us:.1f} us")
            best = sorted(rows_out, key=lambda r: r["us"])
            for row in best[: args.show] + [r for r in rows_out if r["default"]]:
                tag = " (default)" if row["default"] else ""
                print(
                    f"  {row['config']:>16}{tag:10} {row['us']:8.1f} us  {row['x_floor']:.2f}x floor  "
                    f"max error {row['max_error']:.1e}"
                )
            sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

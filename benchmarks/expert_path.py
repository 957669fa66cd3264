"""One rank's expert path without gradients: the fused expert kernel against the gather, products and SwiGLU it replaced.

    PYTHONPATH=. python3 benchmarks/expert_path.py                 # one GPU, the small preset's expert shapes
    PYTHONPATH=. python3 benchmarks/expert_path.py --tokens 32768,32 --real 0.75,1 --json expert_path.json

For ``--tokens`` tokens routed top-``--top-k`` over ``--groups`` experts (``--dim`` -> ``2 x --hidden`` ->
``--dim``, bf16), a fraction ``--real`` of the rows real and the rest padding (a prefill's prompts padded to the
longest): microseconds per call from the profiler's kernel records for

* ``fused`` -- what ``expert_mlp(row_tokens=)`` runs: ``swiglu_matmul`` (rows read from their tokens, gate and up
  products, SwiGLU) and the Triton down product;
* ``mosaic`` -- the gathered rows, Mosaic's grouped matmul, the SwiGLU in XLA, Mosaic's grouped matmul (what the
  training step's forward runs at these sizes) -- where Mosaic takes the shape;
* ``triton`` -- the same four steps on the Triton grouped matmul;

beside the floors: the real rows' FLOPs at 989 TFLOP/s and the touched experts' weights over the card's HBM
bandwidth, and each variant's largest difference from ``fused`` on the real rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import device_seconds, hbm_bandwidth

PEAK_FLOPS = 989e12


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="32768,256,32,1")
    p.add_argument("--real", default="0.75,1", help="fractions of the rows that are real (the rest padding)")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def variants(args):
    """``{name: f(x, w_in, w_out, group_sizes, row_tokens) -> [N, D]}``, jitted."""
    import jax
    import jax.numpy as jnp

    from moe_eplb_jax.moe import grouped_matmul as gmm

    hidden = args.hidden

    def fused(x, w_in, w_out, sizes, row_tokens):
        act = gmm.swiglu_matmul(x, w_in, sizes, row_tokens, backend="triton")
        return gmm.grouped_matmul(act, w_out, sizes, implementation="triton")

    def unfused(implementation):
        def run(x, w_in, w_out, sizes, row_tokens):
            live = jnp.arange(row_tokens.shape[0]) < jnp.sum(sizes)
            rows = jnp.where(live[:, None], x[row_tokens], jnp.zeros((), x.dtype))
            h = gmm.grouped_matmul(rows, w_in, sizes, implementation=implementation).astype(jnp.float32)
            act = (jax.nn.silu(h[:, :hidden]) * h[:, hidden:]).astype(x.dtype)
            return gmm.grouped_matmul(act, w_out, sizes, implementation=implementation)

        return run

    return {
        name: jax.jit(f) for name, f in (("fused", fused), ("mosaic", unfused("mosaic")), ("triton", unfused("triton")))
    }


def case(rng, args, tokens: int, real: float):
    """Inputs: tokens, weights, group sizes (multinomial over the experts) and each row's token (real rows in a
    random order, then the padding rows)."""
    import jax.numpy as jnp

    rows = tokens * args.top_k
    live = max(1, int(rows * real))
    sizes = np.bincount(rng.integers(0, args.groups, live), minlength=args.groups).astype(np.int32)
    x = jnp.asarray(rng.standard_normal((tokens, args.dim)), jnp.bfloat16)
    w_in = jnp.asarray(rng.standard_normal((args.groups, args.dim, 2 * args.hidden)) / np.sqrt(args.dim), jnp.bfloat16)
    w_out = jnp.asarray(rng.standard_normal((args.groups, args.hidden, args.dim)) / np.sqrt(args.hidden), jnp.bfloat16)
    order = np.concatenate([rng.permutation(rows)[:live], np.arange(live, rows)])
    row_tokens = jnp.asarray(order // args.top_k, jnp.int32)
    return (x, w_in, w_out, jnp.asarray(sizes), row_tokens), live, int((sizes > 0).sum())


def main(argv=None):
    args = parse_args(argv)
    import jax

    from moe_eplb_jax.moe._gmm import mosaic

    if jax.default_backend() != "gpu":
        raise SystemExit("expert_path.py times GPU kernels: no GPU here")
    bandwidth = hbm_bandwidth(jax.devices()[0].device_kind)
    rng = np.random.default_rng(0)
    runs = variants(args)
    rows_out = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for real in (float(r) for r in args.real.split(",")):
            inputs, live, touched = case(rng, args, tokens, real)
            flops = 2 * live * args.dim * 3 * args.hidden
            weight_bytes = touched * 3 * args.dim * args.hidden * 2
            row = {
                "tokens": tokens,
                "real_rows": live,
                "flop_floor_us": flops / PEAK_FLOPS * 1e6,
                "read_floor_us": weight_bytes / bandwidth * 1e6 if bandwidth else None,
            }
            reference = None
            for name, run in runs.items():
                rows_shape = (inputs[4].shape[0], args.dim)  # the gathered rows Mosaic would multiply
                if name == "mosaic" and not mosaic.supports(rows_shape, inputs[1].shape, inputs[0].dtype):
                    continue
                out = np.asarray(run(*inputs), np.float32)[:live]
                reference = out if reference is None else reference
                seconds, _ = device_seconds(run, *inputs, calls=10)
                row[f"{name}_us"] = seconds * 1e6
                row[f"{name}_max_diff"] = float(np.abs(out - reference).max())
            rows_out.append(row)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows_out, f, indent=1)


if __name__ == "__main__":
    main()

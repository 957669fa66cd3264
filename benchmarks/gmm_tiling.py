"""The Triton grouped matmuls' tilings at decode shapes: each tiling next to the default one and the weight-read floor.

    PYTHONPATH=. python3 benchmarks/gmm_tiling.py                  # one GPU, the small preset's expert shapes
    PYTHONPATH=. python3 benchmarks/gmm_tiling.py --json tiling.json
    PYTHONPATH=. python3 benchmarks/gmm_tiling.py --format fp8,mxfp4 --batches 256 --groups 32 --dim 7168 --hidden 2048
                                                                   # the quantized kernel, DeepSeek-V3's expert shape
    PYTHONPATH=. python3 benchmarks/gmm_tiling.py --format swiglu  # the fused first half (gate, up, SwiGLU)

For the batch sizes of ``--batches`` (rows = batch x top-k, spread over ``--groups`` experts: at batch 1 each
row its own expert, above that multinomial), both expert products (``--dim`` -> ``2 x --hidden`` and ``--hidden``
-> ``--dim``): microseconds per call from the profiler's kernel records, the fraction of the floor (the touched
experts' weights -- their packed bytes and scales for a quantized ``--format`` -- and the rows over the card's
HBM bandwidth) and the largest difference from a float32 product of the same (dequantized) weights.
``--format swiglu``: the first product only, as ``moe._gmm.triton_swiglu.swiglu_matmul`` runs it (rows read from
their tokens, the SwiGLU applied; ``Config.block_cols`` counts both products' columns).
``moe._gmm.triton.default_config``, ``moe._gmm.triton_swiglu.default_config`` and
``moe._qgmm.config.default_config`` are chosen from these figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import device_seconds, hbm_bandwidth


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,32,256")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--format", default="bf16", help="comma-separated: bf16, swiglu and/or moe_eplb_jax.quant formats")
    p.add_argument(
        "--configs",
        default=None,
        help="comma-separated tilings ROWSxCOLSxK/wWARPS/sSTAGES (e.g. 64x256x128/w8/s3) instead of the sweep",
    )
    p.add_argument("--show", type=int, default=5, help="tilings printed per case, fastest first")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def parse_configs(text: str, config_type) -> list:
    """``--configs``' tilings; ``SystemExit`` naming a malformed one."""
    configs = []
    for item in text.split(","):
        try:
            blocks, warps, stages = item.split("/")
            rows, cols, depth = (int(v) for v in blocks.split("x"))
            configs.append(
                config_type(
                    block_rows=rows,
                    block_cols=cols,
                    block_k=depth,
                    num_warps=int(warps.removeprefix("w")),
                    num_stages=int(stages.removeprefix("s")),
                )
            )
        except ValueError as err:
            raise SystemExit(f"--configs: {item!r} is not ROWSxCOLSxK/wWARPS/sSTAGES ({err})") from None
    return configs


def tilings(config_type, rows_per_group: float, quantized: bool):
    """The tilings swept: every bf16 one; for a quantized format fewer (each compiles longer) but wider column
    tiles (every column tile rereads its rows' activations, the bytes a packed format does not shrink), 8 warps
    tried on the largest tiles."""
    block_rows = (16,) if rows_per_group <= 4 else (16, 32, 64)
    if not quantized:
        for rows, cols, depth, stages in itertools.product(block_rows, (32, 64, 128), (64, 128, 256), (2, 3, 4)):
            yield config_type(block_rows=rows, block_cols=cols, block_k=depth, num_warps=4, num_stages=stages)
        return
    for rows, cols, depth, stages in itertools.product(block_rows[::2], (64, 128, 256), (128, 256), (3, 4)):
        for warps in (4, 8) if rows >= 64 and cols >= 128 else (4,):
            yield config_type(block_rows=rows, block_cols=cols, block_k=depth, num_warps=warps, num_stages=stages)


def swiglu_tokens(rows: int):
    """The token each row of the ``swiglu`` case reads: a fixed permutation, as a decode step's rows sorted by slot
    read tokens in no order."""
    return np.random.default_rng(1).permutation(rows)


def kernel_case(fmt: str, x, w):
    """``(call(config, x, group_sizes, operand), operand, default_config(rows, width, groups), the weights as
    float32 [g, depth, width] (dequantized) on the device, weight bytes per group, the Config type)`` for
    ``fmt``: bf16 through ``moe._gmm.triton``, a quantized format through ``moe._qgmm.triton`` on the packed
    weights (``w`` transposed: the contraction axis last). The weights are the calls' argument, not a constant
    the compiled call would carry."""
    import jax
    import jax.numpy as jnp

    from moe_eplb_jax import quant

    if fmt == "bf16":
        from moe_eplb_jax.moe._gmm import triton

        call = lambda config, x, sizes, w: triton.grouped_matmul(x, w, sizes, config=config)
        return call, w, triton.default_config, w.astype(jnp.float32), w[0].size * 2, triton.Config
    if fmt == "swiglu":
        from moe_eplb_jax.moe._gmm import triton, triton_swiglu

        tokens = jnp.asarray(swiglu_tokens(x.shape[0]), jnp.int32)  # each row read from another token
        call = lambda config, x, sizes, w: triton_swiglu.swiglu_matmul(x, w, sizes, tokens, config=config)
        default = lambda rows, width, groups: triton_swiglu.default_config(rows, width // 2, groups)
        return call, w, default, w.astype(jnp.float32), w[0].size * 2, triton.Config
    from moe_eplb_jax.moe._qgmm import config as qconfig
    from moe_eplb_jax.moe._qgmm import triton as qtriton

    q = quant.quantize_experts(jnp.swapaxes(w, 1, 2).astype(jnp.float32), fmt)
    # Weight-only formats multiply x itself; fp8 multiplies e4m3 rows (input scale 1: x is in range).
    lhs_of = (lambda x: x.astype(jnp.float8_e4m3fn)) if fmt == "fp8" else (lambda x: x)
    factor = q.global_scale if fmt == "nvfp4" else (q.alpha if fmt == "fp8" else jnp.ones((w.shape[0],)))
    call = lambda config, x, sizes, q: qtriton.grouped_matmul(lhs_of(x), q, sizes, factor, config=config)
    default = lambda rows, width, groups: qconfig.default_config(rows, groups, fmt)
    dense = jnp.swapaxes(quant.dequantize_experts(q).astype(jnp.float32), 1, 2)
    if fmt == "fp8":  # the kernel's product: e4m3 values times alpha
        dense = jnp.swapaxes(q.weight.astype(jnp.float32), 1, 2) * factor.astype(jnp.float32)[:, None, None]
    per_group = sum(leaf.size * jax.dtypes.itemsize_bits(leaf.dtype) // 8 for leaf in jax.tree.leaves(q)) // w.shape[0]
    return call, q, default, dense, per_group, qconfig.Config


def expected(fmt: str, x, dense, sizes):
    """The float32 product of each group's rows (read from their tokens for ``swiglu``, then the SwiGLU), on the
    device at full float32 precision: the rows sorted by group, ``[sum(sizes), width]`` as numpy."""
    import jax
    import jax.numpy as jnp

    lhs = (x.astype(jnp.float8_e4m3fn) if fmt == "fp8" else x).astype(jnp.float32)
    if fmt == "swiglu":
        lhs = lhs[swiglu_tokens(x.shape[0])]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    with jax.default_matmul_precision("float32"):
        want = jnp.concatenate([lhs[starts[s] : starts[s + 1]] @ dense[s] for s in range(len(sizes))])
    if fmt == "swiglu":
        gate, up = jnp.split(want, 2, axis=1)
        want = jax.nn.silu(gate) * up
    return np.asarray(want)


def main(argv=None):
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp

    if jax.default_backend() != "gpu":
        raise SystemExit("gmm_tiling.py times Triton kernels: run it on a GPU")
    kind = jax.devices()[0].device_kind
    hbm = hbm_bandwidth(kind)
    rng = np.random.default_rng(0)
    results = {"device": kind}
    for fmt, batch in itertools.product(args.format.split(","), (int(b) for b in args.batches.split(","))):
        rows, g = batch * args.top_k, args.groups
        if batch == 1:
            sizes = np.zeros(g, np.int32)
            sizes[rng.choice(g, min(rows, g), replace=False)] = 1
        else:
            sizes = rng.multinomial(rows, [1 / g] * g).astype(np.int32)
        products = (
            ((args.dim, 2 * args.hidden),)
            if fmt == "swiglu"
            else ((args.dim, 2 * args.hidden), (args.hidden, args.dim))
        )
        for index, (depth, width) in enumerate(products):
            keys = jax.random.split(jax.random.key(len(results) * 8 + index), 2)
            x = jax.random.normal(keys[0], (rows, depth), jnp.float32).astype(jnp.bfloat16)
            w = (jax.random.normal(keys[1], (g, depth, width), jnp.float32) / depth**0.5).astype(jnp.bfloat16)
            call, operand, default_of, dense, per_group, config_type = kernel_case(fmt, x, w)
            group_sizes = jnp.asarray(sizes)
            want = expected(fmt, x, dense, sizes)
            del dense
            out_width = width // 2 if fmt == "swiglu" else width
            floor_bytes = int((sizes > 0).sum()) * per_group + rows * (depth + out_width) * 2
            default = default_of(rows, width, g)
            rows_out = []
            swept = (
                parse_configs(args.configs, config_type)
                if args.configs
                else tilings(config_type, rows / g, fmt not in ("bf16", "swiglu"))
            )
            for config in [default, *swept]:
                f = jax.jit(lambda x, s, operand, config=config: call(config, x, s, operand))
                try:
                    got = np.asarray(f(x, group_sizes, operand), np.float32)
                    seconds, _ = device_seconds(f, x, group_sizes, operand, calls=20, warmup=1)
                except Exception as e:  # a tiling this Triton cannot compile
                    print(f"  skipped {config}: {type(e).__name__}")
                    continue
                rows_out.append(
                    {
                        "config": f"{config.block_rows}x{config.block_cols}x{config.block_k} "
                        f"w{config.num_warps} s{config.num_stages}",
                        "default": config == default,
                        "us": seconds * 1e6,
                        "x_floor": seconds * hbm / floor_bytes if hbm else float("nan"),
                        "max_error": float(np.max(np.abs(got[: len(want)] - want))),
                    }
                )
                print(f"  . {rows_out[-1]['config']} {rows_out[-1]['us']:.1f} us", flush=True)  # a cut run shows these
            label = f"{fmt}, batch {batch}: {rows} rows over {g} groups, {depth} -> {width}"
            results[label] = rows_out
            floor_us = floor_bytes / hbm * 1e6 if hbm else float("nan")
            print(f"== {label}; floor {floor_us:.1f} us")
            best = sorted(rows_out, key=lambda r: r["us"])
            for row in best[: args.show] + [r for r in rows_out if r["default"]]:
                tag = " (default)" if row["default"] else ""
                print(
                    f"  {row['config']:>20}{tag:10} {row['us']:8.1f} us  {row['x_floor']:.2f}x floor  "
                    f"max error {row['max_error']:.1e}"
                )
            sys.stdout.flush()
            if args.json:  # after every case: a run cut short keeps what it measured
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

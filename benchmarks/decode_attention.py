"""A decode step's attention: the Pallas kernel (``models/decode_attention.py``) next to XLA's and the cache-read floor.

    PYTHONPATH=. python3 benchmarks/decode_attention.py             # one GPU, the small preset's heads
    PYTHONPATH=. python3 benchmarks/decode_attention.py --positions 48,2048 --block-keys 32,64,128 --json da.json
    PYTHONPATH=. python3 benchmarks/decode_attention.py --batches 1,32 --positions 48 --model small

For each batch of ``--batches`` and cache length of ``--positions`` (``--heads`` query heads over ``--kv-heads``
key/value heads of ``--width``, bf16, three quarters of the positions valid): microseconds per call from the
profiler's kernel records and the kernels each call launches, for XLA's attention (``attend(implementation=
"xla")``, what a decode step runs now) and the kernel at each ``--block-keys``, beside the floor (the keys and
values read once over the card's HBM bandwidth), and the largest difference from XLA's output; with ``--model``
a preset's whole decode step with either attention. Whether the decode step's default becomes the kernel rests
on these figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import device_seconds, hbm_bandwidth


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,32,256")
    p.add_argument("--positions", default="48,2048", help="cache lengths")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--block-keys", default="64", help="comma-separated Config.block_keys to time")
    p.add_argument(
        "--model",
        default=None,
        metavar="PRESET",
        help="also decode this preset (one rank, 33 tokens, 16 passes per call) with each attention, in turns",
    )
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def model_rows(preset: str, batches, rng):
    """ms per decode step of ``preset`` with XLA's attention and with the kernel, taking turns over five rounds, and
    how many greedy tokens the two agree on (they may part at a near tie: the kernel keeps its probabilities in
    float32)."""
    import flax.nnx as nnx

    from moe_eplb_jax import models, transport
    from moe_eplb_jax.models import MoECausalLM, attention, generate

    config = models.preset(preset, dtype="bfloat16")
    # A model each (the same weights): generate compiles its steps once per model, tracing the attention in place.
    variants = {name: MoECausalLM(config, mesh=transport.ep_mesh(1), rngs=nnx.Rngs(0)) for name in ("xla", "pallas")}
    plain = attention.attend

    def kernel_attend(q, k, v, mask, *, scale, implementation=None):
        one_query = q.shape[1] == 1 and mask is not None and not isinstance(mask, attention.CausalPrefix)
        return plain(
            q,
            k,
            v,
            mask,
            scale=scale,
            implementation="pallas" if one_query and implementation is None else implementation,
        )

    rows = []
    for batch in batches:
        prompts = [list(rng.integers(0, config.vocab_size, int(rng.integers(8, 17)))) for _ in range(batch)]
        run = lambda model: generate(model, prompts, max_new_tokens=33, prompt_width=16, tokens_per_call=16)
        seconds, tokens = {"xla": [], "pallas": []}, {}
        try:
            for _ in range(6):  # the first round compiles
                for name, attend in (("xla", plain), ("pallas", kernel_attend)):
                    attention.attend = attend  # the decoder's one attention core: what the default would become
                    result = run(variants[name])
                    seconds[name].append(result.decode_seconds / 32 * 1e3)
                    tokens[name] = result.tokens
        finally:
            attention.attend = plain
        row = {"preset": preset, "batch": batch, "same_tokens": float(np.mean(tokens["xla"] == tokens["pallas"]))}
        row.update({f"{name}_ms_per_step": sorted(ms[1:])[2] for name, ms in seconds.items()})
        rows.append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return rows


def main(argv=None):
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp

    from moe_eplb_jax.models.attention import attend
    from moe_eplb_jax.models.decode_attention import Config, decode_attention

    if jax.default_backend() != "gpu":
        raise SystemExit("decode_attention.py times a GPU kernel: no GPU here")
    name = jax.devices()[0].device_kind
    hbm = hbm_bandwidth(name)
    rng = np.random.default_rng(0)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for positions in (int(s) for s in args.positions.split(",")):
            shape = (batch, args.kv_heads, positions, args.width)
            q = jnp.asarray(rng.standard_normal((batch, args.heads, args.width)), jnp.bfloat16)
            keys = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
            values = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
            valid = jnp.asarray(rng.random((batch, positions)) < 0.75)
            scale = args.width**-0.5
            swap = lambda a: jnp.swapaxes(a, 1, 2)
            xla = jax.jit(
                lambda q, k, v, m: attend(q[:, None], swap(k), swap(v), m[:, None], scale=scale, implementation="xla")
            )
            want = np.asarray(xla(q, keys, values, valid), np.float32)[:, 0]
            floor = 2 * keys.size * keys.dtype.itemsize / hbm * 1e6 if hbm else None
            seconds, kernels = device_seconds(xla, q, keys, values, valid)
            row = {
                "batch": batch,
                "positions": positions,
                "floor_us": floor,
                "xla_us": seconds * 1e6,
                "xla_kernels": len(kernels),
            }
            for block in (int(b) for b in args.block_keys.split(",")):
                kernel = jax.jit(
                    lambda q, k, v, m, c=Config(block_keys=block): decode_attention(q, k, v, m, scale=scale, config=c)
                )
                got = np.asarray(kernel(q, keys, values, valid), np.float32)
                seconds, kernels = device_seconds(kernel, q, keys, values, valid)
                row[f"pallas_{block}_us"] = seconds * 1e6
                row[f"pallas_{block}_kernels"] = len(kernels)
                row[f"pallas_{block}_max_diff"] = float(np.max(np.abs(got - want)))
            rows.append(row)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    model = model_rows(args.model, [int(b) for b in args.batches.split(",")], rng) if args.model else []
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "rows": rows, "model": model}, f, indent=1)


if __name__ == "__main__":
    main()

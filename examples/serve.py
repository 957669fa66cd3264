"""Batched generation with EPLB: balancedness before and after rebalancing, and throughput.

    python examples/serve.py                          # CPU, 8 simulated devices (the README demo)
    python examples/serve.py --devices 0 --ranks 8    # real GPUs: EP over 8 of them
    python examples/serve.py --save-placement p.json  # fit a placement from the warm-up traffic
    python examples/serve.py --init-placement p.json  # serve with a held, fitted placement

Several hosts: run one copy per host with --coordinator HOST:PORT --num-processes N --process-id I.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import time

from _runtime import Runtime, add_runtime_args


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--redundant", type=int, default=8, help="redundant slots R (P = E + R)")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="sequences per batch (divisible by the ranks)")
    p.add_argument("--prompt", type=int, default=16, help="prompt length")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens generated per batch")
    p.add_argument("--warmup-batches", type=int, default=5, help="batches served before rebalancing")
    p.add_argument("--batches", type=int, default=5, help="batches served after rebalancing")
    p.add_argument(
        "--capacity-factor",
        type=float,
        default=1.25,
        help="token exchange in rounds of this factor times the balanced share (0: one worst-case all_to_all)",
    )
    p.add_argument("--skew", type=float, default=1.5, help="Zipf skew of the routers")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--init-placement", help="serve with this placement file (no rebalancing)")
    p.add_argument("--save-placement", help="write the fitted placement here")
    p.add_argument("--seed", type=int, default=0)
    add_runtime_args(p)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    rt = Runtime(args)  # sets the device flags, then imports jax
    import jax
    import jax.numpy as jnp
    import numpy as np
    from _model import MoELM, synthetic_batch
    from flax import nnx
    from tqdm import tqdm

    from moe_eplb_jax import EplbConfig
    from moe_eplb_jax.flax import EplbController

    ranks, mesh, replicated, global_batch = rt.ranks, rt.mesh, rt.replicated, rt.global_batch
    num_physical = args.experts + args.redundant
    model = MoELM(
        vocab=256,
        dim=args.dim,
        heads=4,
        hidden=args.dim,
        num_layers=args.layers,
        num_experts=args.experts,
        top_k=args.top_k,
        num_physical=num_physical,
        mesh=mesh,
        skew=args.skew,
        capacity_factor=args.capacity_factor or None,
        dtype=jnp.bfloat16 if args.bf16 else jnp.float32,
        rngs=nnx.Rngs(args.seed),
    )
    config = EplbConfig(
        num_redundant_experts=args.redundant,
        window_size=args.warmup_batches * args.new_tokens,
        step_interval=10**9,
        num_gpus=ranks,
    )
    held = args.init_placement is not None
    controller = EplbController(model, mesh, config, placement=args.init_placement, rebalance=not held)
    main_process = jax.process_index() == 0

    @nnx.jit
    def next_token(model, tokens, position):  # greedy; the whole prefix is re-run (no KV cache: a demo)
        picked = jnp.argmax(model(tokens)[:, position - 1], axis=-1).astype(jnp.int32)
        return jax.lax.with_sharding_constraint(picked, replicated)  # readable on every process

    rng = np.random.default_rng(args.seed)
    total_len = args.prompt + args.new_tokens

    def serve(num_batches, label):
        generated, start = 0, None
        outputs = []
        for _b in tqdm(range(num_batches), desc=label, disable=not main_process):
            tokens = np.zeros((args.batch, total_len), np.int32)
            tokens[:, : args.prompt] = synthetic_batch(rng, args.batch, args.prompt, 256)
            for t in range(args.prompt, total_len):
                # Fixed shapes (full length; causal, so later positions do not matter): one compilation.
                prefix = np.where(np.arange(total_len)[None, :] < t, tokens, 0).astype(np.int32)
                tokens[:, t] = np.asarray(next_token(model, global_batch(prefix), jnp.int32(t)))
                controller.step()
                if start is not None:
                    generated += args.batch
            if start is None:
                start = time.perf_counter()  # the first batch compiles: time the others
            outputs.append(tokens)
        seconds = time.perf_counter() - start
        window = controller.window_slot_load()
        return outputs, generated / max(seconds, 1e-9), window

    _, tps_before, window = serve(
        args.warmup_batches, "serve (initial placement)" if not held else "serve (held placement)"
    )
    from moe_eplb_jax import metrics

    bal_before = float(metrics.balancedness(metrics.rank_load(window, ranks)))
    report = None
    if not held:
        report = controller.rearrange()
    if args.save_placement and main_process:
        controller.save_placement(args.save_placement)
    _, tps_after, window = serve(args.batches, "serve (EPLB placement)" if not held else "serve (held placement)")
    bal_after = float(metrics.balancedness(metrics.rank_load(window, ranks)))
    if main_process or args.num_processes > 1:  # every process prints it: their summaries must agree
        print(
            "\n=== summary ==="
            if args.num_processes == 1
            else f"\n=== summary (process {jax.process_index()} of {jax.process_count()}) ==="
        )
        print(
            f"EP ranks {ranks}, layers {args.layers}, experts {args.experts} + {args.redundant} redundant, top-{args.top_k}"
        )
        print(f"balancedness (measured) before {bal_before:.3f} -> after {bal_after:.3f}  (1.0 = perfect)")
        if report:
            print(
                f"rearrangement: {report['slots_moved']} slots moved, policy-predicted balancedness "
                f"{report['balancedness_after']:.3f}"
            )
        simulated = jax.devices()[0].platform == "cpu"
        print(
            f"throughput: {tps_before:.1f} tok/s before, {tps_after:.1f} tok/s after"
            + (" (CPU simulated devices: throughput does not show the balance)" if simulated else "")
        )
        if args.save_placement:
            print(f"placement saved to {args.save_placement}")


if __name__ == "__main__":
    main()

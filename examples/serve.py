"""Batched generation with a KV cache and EPLB: balancedness before and after rebalancing, tokens/s.

    python examples/serve.py                          # CPU, 8 simulated devices (the README demo)
    python examples/serve.py --devices 0 --ranks 8    # real GPUs: EP over 8 of them
    python examples/serve.py --save-placement p.json  # fit a placement from the warm-up traffic
    python examples/serve.py --init-placement p.json  # serve with a held, fitted placement
    python examples/serve.py --checkpoint ckpt/ --quantize mxfp4   # Hugging Face-style safetensors weights
    python examples/serve.py --devices 0 --ranks 1 --preset small --batch 32 --new-tokens 256 --compare-recompute

Each batch holds requests of different prompt lengths, left-padded to one width (padding is never routed to
an expert nor counted as load); prefill, then one jitted decode step per token with a preallocated KV cache.
Every forward pass closes a controller step (the loads are recorded); midway through the last warm-up batch
the experts are rearranged, between two decode steps, and the batches after run on the new placement.
Without --checkpoint the weights are random and the routers carry a Zipf bias (--skew) so the traffic is
skewed. --compare-recompute also times decoding without the cache (the whole sequence re-run per token).

Several hosts: run one copy per host with --coordinator HOST:PORT --num-processes N --process-id I.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import time

from _runtime import (
    HelpFormatter,
    Runtime,
    add_runtime_args,
    check_divides,
    check_runtime_args,
    nonnegative_float,
    nonnegative_int,
    positive_int,
    prepare_devices,
    unit_interval,
)


def parse_args(argv=None):
    from moe_eplb_jax.models import PRESETS
    from moe_eplb_jax.quant import FORMATS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model shape")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="override the preset's dtype")
    p.add_argument("--redundant", type=nonnegative_int, default=8, help="redundant expert slots R (P = E + R)")
    p.add_argument("--batch", type=positive_int, default=64, help="requests per batch (divisible by the ranks)")
    p.add_argument("--min-prompt", type=positive_int, default=4, help="shortest prompt")
    p.add_argument("--max-prompt", type=positive_int, default=24, help="longest prompt (the padded width)")
    p.add_argument("--new-tokens", type=positive_int, default=16, help="tokens generated per request")
    p.add_argument("--warmup-batches", type=positive_int, default=2, help="batches served before rebalancing")
    p.add_argument("--batches", type=positive_int, default=2, help="batches served after rebalancing")
    p.add_argument("--temperature", type=nonnegative_float, default=0.0, help="0: greedy decoding")
    p.add_argument("--top-k", type=nonnegative_int, default=0, help="sample from the k likeliest tokens (0: all)")
    p.add_argument("--top-p", type=unit_interval, default=1.0, help="nucleus sampling mass")
    p.add_argument(
        "--capacity-factor",
        type=nonnegative_float,
        default=1.25,
        help="token exchange in rounds of this factor times the balanced share (0: one worst-case all_to_all)",
    )
    p.add_argument("--skew", type=nonnegative_float, default=1.5, help="Zipf skew of the routers (random weights)")
    p.add_argument("--checkpoint", help="a safetensors checkpoint (file or directory) of the preset's shape")
    p.add_argument("--quantize", choices=FORMATS, default=None, help="quantize the experts on load")
    p.add_argument("--init-placement", help="serve with this placement file (no rebalancing)")
    p.add_argument("--save-placement", help="write the fitted placement here")
    p.add_argument("--compare-recompute", action="store_true", help="also time decoding without the KV cache")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="weights, prompts and sampling")
    add_runtime_args(p)
    args = p.parse_args(argv)
    config = PRESETS[args.preset]
    ranks = check_runtime_args(p, args)
    check_divides(p, ranks, _divided(args))
    if args.min_prompt > args.max_prompt:
        p.error(f"--min-prompt {args.min_prompt} exceeds --max-prompt {args.max_prompt}")
    if args.max_prompt + args.new_tokens - 1 > config.max_seq_len:
        p.error(
            f"--max-prompt {args.max_prompt} + --new-tokens {args.new_tokens} - 1 exceeds the {args.preset} "
            f"preset's max_seq_len {config.max_seq_len}"
        )
    if args.top_k > config.vocab_size:
        p.error(f"--top-k {args.top_k} exceeds the vocabulary ({config.vocab_size})")
    for flag in ("checkpoint", "init_placement"):
        path = getattr(args, flag)
        if path is not None and not os.path.exists(path):
            p.error(f"--{flag.replace('_', '-')} {path}: no such file or directory")
    if args.save_placement and not os.path.isdir(os.path.dirname(os.path.abspath(args.save_placement))):
        p.error(f"--save-placement {args.save_placement}: its directory does not exist")
    if args.quantize and not args.checkpoint:
        p.error("--quantize needs --checkpoint (it quantizes the loaded experts)")
    if args.capacity_factor == 0:
        args.capacity_factor = None
    return p, args


def _divided(args) -> dict[str, int]:
    """The sizes the EP ranks must divide."""
    from moe_eplb_jax.models import PRESETS

    return {"--batch": args.batch, "P = E + --redundant": PRESETS[args.preset].num_experts + args.redundant}


def main(argv=None):
    prepare_devices(argv)  # before anything imports jax
    parser, args = parse_args(argv)
    rt = Runtime(args, parser)  # sets the device flags, then imports jax
    check_divides(parser, rt.ranks, _divided(args))  # the EP size is known now even with --devices 0
    import jax
    import numpy as np
    from flax import nnx

    from moe_eplb_jax import EplbConfig, metrics
    from moe_eplb_jax.flax import EplbController
    from moe_eplb_jax.models import MoECausalLM, Sampling, generate, load_checkpoint, preset, skew_routers, zipf_tokens

    ranks, mesh = rt.ranks, rt.mesh
    config = preset(args.preset, **({"dtype": args.dtype} if args.dtype else {}))
    model = MoECausalLM(
        config,
        mesh=mesh,
        num_redundant_experts=args.redundant,
        capacity_factor=args.capacity_factor,
        rngs=nnx.Rngs(args.seed),
    )
    if args.checkpoint:
        try:
            load_checkpoint(model, args.checkpoint, quantize=args.quantize)
        except ValueError as e:
            parser.error(f"--checkpoint: {e}")
    else:
        skew_routers(model, args.skew)
    held = args.init_placement is not None
    eplb = EplbConfig(num_redundant_experts=args.redundant, window_size=10**6, step_interval=10**9, num_gpus=ranks)
    try:
        controller = EplbController(model, mesh, eplb, placement=args.init_placement, rebalance=not held)
    except ValueError as e:
        parser.error(f"--init-placement: {e}")
    main_process = jax.process_index() == 0
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    rng = np.random.default_rng(args.seed)
    # Midway through the last warm-up batch: the rearrangement happens between two decode steps.
    rearrange_at = (args.warmup_batches - 1) * args.new_tokens + max(1, args.new_tokens // 2)
    passes, rearranged = [0], {}

    def on_step(_):
        controller.step()
        passes[0] += 1
        if passes[0] == rearrange_at and not held:
            start = time.perf_counter()
            report = controller.rearrange()
            jax.block_until_ready(nnx.state(model))
            rearranged.update(report, seconds=time.perf_counter() - start, after_pass=passes[0])

    def batch():
        lengths = rng.integers(args.min_prompt, args.max_prompt + 1, args.batch)
        return [zipf_tokens(rng, 1, int(n), config.vocab_size, repeat=False)[0] for n in lengths]

    compiled = [False]

    def serve(num_batches, label):
        """Decode tokens/s over the batches, the compiling first one left out."""
        seconds = steps = 0.0
        for b in range(num_batches):
            moved_before = "seconds" in rearranged
            out = generate(
                model,
                batch(),
                max_new_tokens=args.new_tokens,
                sampling=sampling,
                seed=args.seed + b,
                prompt_width=args.max_prompt,
                on_step=on_step,
            )
            if main_process:
                print(f"{label}: batch {b + 1}/{num_batches} done", flush=True)
            if not compiled[0]:
                compiled[0] = True
                continue
            moved = rearranged["seconds"] if "seconds" in rearranged and not moved_before else 0.0
            seconds += out.decode_seconds - moved
            steps += args.new_tokens - 1
        return steps * args.batch / seconds if steps else float("nan")

    tps_before = serve(args.warmup_batches, "serve (initial placement)" if not held else "serve (held placement)")
    window_before = rearranged.get("balancedness_before")
    if window_before is None:
        window_before = float(metrics.balancedness(metrics.rank_load(controller.window_slot_load(), ranks)))
    tps_after = serve(args.batches, "serve (EPLB placement)" if not held else "serve (held placement)")
    bal_after = float(metrics.balancedness(metrics.rank_load(controller.window_slot_load(), ranks)))
    if args.save_placement and main_process:
        controller.save_placement(args.save_placement)
    again = None
    if rearranged:  # the first rearrangement compiled the transport; time one more, on the traffic since
        start = time.perf_counter()
        report = controller.rearrange()
        jax.block_until_ready(nnx.state(model))
        again = (time.perf_counter() - start, report["slots_moved"])
    compare = None
    if args.compare_recompute:  # same prompts, no recording: decode time per step with and without the cache
        prompts = batch()
        timed = {}
        for use_cache in (True, False):
            for _ in range(2):  # the second run is timed: the first compiles
                out = generate(
                    model,
                    prompts,
                    max_new_tokens=args.new_tokens,
                    prompt_width=args.max_prompt,
                    use_cache=use_cache,
                    record=False,
                )
            timed[use_cache] = out.decode_seconds / max(args.new_tokens - 1, 1)
        compare = (timed[True], timed[False])
    if main_process or args.num_processes > 1:  # every process prints it: their summaries must agree
        print(
            "\n=== summary ==="
            if args.num_processes == 1
            else f"\n=== summary (process {jax.process_index()} of {jax.process_count()}) ==="
        )
        print(
            f"EP ranks {ranks}, preset {args.preset}: {config.num_moe_layers} MoE layers, experts "
            f"{config.num_experts} + {args.redundant} redundant, top-{config.top_k} ({config.scoring} router)"
        )
        print(f"balancedness (measured) before {window_before:.3f} -> after {bal_after:.3f}  (1.0 = perfect)")
        if rearranged:
            print(
                f"rearrangement: {rearranged['slots_moved']} slots moved, policy-predicted balancedness "
                f"{rearranged['balancedness_after']:.3f}"
            )
            print(
                f"rearrangement took {rearranged['seconds'] * 1e3:.1f} ms between decode steps (after forward pass "
                f"{rearranged['after_pass']}; compiling the transport included)"
            )
        if again is not None:
            print(f"rearrangement took {again[0] * 1e3:.1f} ms the second time ({again[1]} slots moved)")
        simulated = jax.devices()[0].platform == "cpu" and args.devices
        print(
            f"throughput: {tps_before:.1f} tok/s before, {tps_after:.1f} tok/s after (decode, batch {args.batch})"
            + (" (CPU simulated devices: throughput does not show the balance)" if simulated else "")
        )
        if compare is not None:
            cached, recomputed = compare
            print(
                f"decode time per generated token (batch {args.batch}, {args.new_tokens} new tokens): KV cache "
                f"{cached * 1e3:.2f} ms vs full recompute {recomputed * 1e3:.2f} ms ({recomputed / cached:.1f}x)"
            )
        if args.save_placement:
            print(f"placement saved to {args.save_placement}")


if __name__ == "__main__":
    main()

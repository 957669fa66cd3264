"""Batched generation with a KV cache and EPLB: experts rearranged layer by layer between decode steps.

    python examples/serve.py                          # CPU, 8 simulated devices (the README demo)
    python examples/serve.py --devices 0 --ranks 8    # real GPUs: EP over 8 of them
    python examples/serve.py --dump-loads loads.npz   # record the expert loads ...
    moe-eplb fit loads.npz --num-ranks 8 --num-physical 24 -o p.json   # ... fit a placement to them (or
                                                      # --format sglang: SGLang's --init-expert-location file)
    python examples/serve.py --init-placement p.json  # ... and serve with it, held
    python examples/serve.py --checkpoint ckpt/ --quantize mxfp4   # Hugging Face-style safetensors weights
                                                      # (shaped by ckpt/config.json when there, else --preset)
    python examples/serve.py --quantize mxfp4         # the random weights, quantized
    python examples/serve.py --preset deepseek_v3_tiny  # DeepSeek-V3 (MLA, YaRN) at CPU size
    python examples/serve.py --devices 0 --ranks 1 --preset small --batch 32 --new-tokens 256 --compare-recompute

Each batch holds requests of different prompt lengths, left-padded to one width (padding is never routed to
an expert nor counted as load); prefill, then one jitted decode step per token with a preallocated KV cache.
A first batch compiles prefill and decode (not recorded, not timed); ``controller.warmup()`` compiles the
expert mover, so no rearrangement compiles mid-run. Every forward pass after that closes a controller step
(the loads are recorded). Midway through the last warm-up batch the controller decides a placement from the
loads so far and moves the experts one MoE layer per decode step (``overlap="layer"``, vLLM's
``use_async``); each layer switches to its new placement once its weights have arrived, and the batches
after run on the new placement. ``--eplb-config`` replaces this schedule (``step_interval``: forward passes
between rearrangements, the first after a quarter of it; ``window_size``; ``overlap``; ``policy``; ``routing``).
Without --checkpoint the weights are random and the routers carry a Zipf bias (--skew) so the traffic is
skewed. --compare-recompute also times decoding without the cache (the whole sequence re-run per token).

Several hosts: run one copy per host with --coordinator HOST:PORT --num-processes N --process-id I.
"""

from __future__ import annotations

import argparse
import os
import time

from _runtime import (
    HelpFormatter,
    Runtime,
    add_eplb_config_arg,
    add_routing_arg,
    add_runtime_args,
    build_eplb_config,
    check_divides,
    check_runtime_args,
    counting_compiles,
    eplb_fields,
    memory_bandwidth,
    nonnegative_float,
    nonnegative_int,
    output_file_problem,
    parse_eplb_fields,
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
    p.add_argument(
        "--redundant",
        type=nonnegative_int,
        default=argparse.SUPPRESS,
        help="redundant expert slots R (P = E + R) (default: 8)",
    )
    p.add_argument("--batch", type=positive_int, default=64, help="requests per batch (divisible by the ranks)")
    p.add_argument("--min-prompt", type=positive_int, default=4, help="shortest prompt")
    p.add_argument("--max-prompt", type=positive_int, default=24, help="longest prompt (the padded width)")
    p.add_argument("--new-tokens", type=positive_int, default=16, help="tokens generated per request")
    p.add_argument(
        "--tokens-per-call",
        type=positive_int,
        default=8,
        help="decode passes per host round trip (an on-device loop; every pass still a step of the EPLB window)",
    )
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
    p.add_argument(
        "--checkpoint",
        help="a safetensors checkpoint: a directory with a Hugging Face config.json (it gives the model shape), or "
        "a file or directory of the preset's shape",
    )
    p.add_argument(
        "--quantize",
        choices=FORMATS,
        default=None,
        help="quantize the experts: the checkpoint's as they load, else the model's own (random) weights",
    )
    p.add_argument(
        "--init-placement", help="serve with this placement file, held (ours or SGLang's expert-location JSON)"
    )
    p.add_argument("--save-placement", help="write the placement served with at the end here (.json / .npz)")
    p.add_argument(
        "--dump-loads", help="write the load window at the end here (.npz / .json), the file `moe-eplb fit` reads"
    )
    p.add_argument("--compare-recompute", action="store_true", help="also time decoding without the KV cache")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="weights, prompts and sampling")
    add_routing_arg(p)
    add_eplb_config_arg(p, "--redundant, --routing and --init-placement (which holds the placement)")
    add_runtime_args(p)
    args = p.parse_args(argv)
    ranks = check_runtime_args(p, args)
    if args.checkpoint is not None and not os.path.exists(args.checkpoint):
        p.error(f"--checkpoint {args.checkpoint}: no such file or directory")
    config = args.model_config = model_config(p, args)
    shape = "config.json" if _hf_config_file(args) else f"{args.preset} preset"
    if args.min_prompt > args.max_prompt:
        p.error(f"--min-prompt {args.min_prompt} exceeds --max-prompt {args.max_prompt}")
    if args.max_prompt + args.new_tokens - 1 > config.max_seq_len:
        p.error(
            f"--max-prompt {args.max_prompt} + --new-tokens {args.new_tokens} - 1 exceeds the {shape}'s "
            f"max_seq_len {config.max_seq_len}"
        )
    if args.top_k > config.vocab_size:
        p.error(f"--top-k {args.top_k} exceeds the vocabulary ({config.vocab_size})")
    for flag in ("checkpoint", "init_placement"):
        path = getattr(args, flag)
        if path is not None and not os.path.exists(path):
            p.error(f"--{flag.replace('_', '-')} {path}: no such file or directory")
    for flag in ("save_placement", "dump_loads"):  # before the run: a bad path must not waste it
        path = getattr(args, flag)
        problem = path is not None and output_file_problem(path)
        if problem:
            p.error(f"--{flag.replace('_', '-')} {path}: {problem}")
    if args.capacity_factor == 0:
        args.capacity_factor = None
    args.eplb = parse_eplb_fields(p, lambda: eplb_settings(args), ranks)
    args.redundant = args.eplb["num_redundant_experts"]
    check_divides(p, ranks, _divided(args))
    return p, args


def rearrange_at(args) -> int:
    """The forward pass after which the default schedule rearranges: midway through the last warm-up batch."""
    return (args.warmup_batches - 1) * args.new_tokens + max(1, args.new_tokens // 2)


def eplb_settings(args) -> dict:
    """The run's EplbConfig fields: the default schedule, then --eplb-config, then --redundant if given."""
    first = rearrange_at(args)
    return eplb_fields(
        args.eplb_config,
        # The first rearrangement comes after a quarter of step_interval: at pass `first`.
        defaults={"num_redundant_experts": 8, "window_size": first, "step_interval": 4 * first, "overlap": "layer"},
        flags={"num_redundant_experts": getattr(args, "redundant", None), "routing": args.routing},
    )


def _hf_config_file(args) -> str | None:
    path = args.checkpoint and os.path.join(args.checkpoint, "config.json")
    return path if path and os.path.isfile(path) else None


def model_config(parser, args):
    """The model shape: the checkpoint's config.json when it has one, else --preset; --dtype overrides."""
    from moe_eplb_jax.models import config_from_hf, preset

    dtype = {"dtype": args.dtype} if args.dtype else {}
    path = _hf_config_file(args)
    if path is None:
        return preset(args.preset, **dtype)
    try:
        return config_from_hf(path, **dtype)
    except ValueError as e:
        parser.error(f"--checkpoint: {e}")


def _window(args) -> tuple[int, int]:
    """The load window's ``(L, P)``: MoE layers and slots."""
    return args.model_config.num_moe_layers, args.model_config.num_experts + args.redundant


def _divided(args) -> dict[str, int]:
    """The sizes the EP ranks must divide."""
    return {"--batch": args.batch, "P = E + --redundant": args.model_config.num_experts + args.redundant}


def build_model(parser, args, rt):
    """``(model, controller, eplb config, held)``: the model from --checkpoint (else skewed random routers) and its
    controller; ``parser.error`` naming the flag on bad input."""
    from flax import nnx

    from moe_eplb_jax.flax import EplbController
    from moe_eplb_jax.models import MoECausalLM, load_checkpoint, skew_routers
    from moe_eplb_jax.moe import DispatchConfig

    ranks, mesh = rt.ranks, rt.mesh
    try:
        eplb = build_eplb_config(args.eplb, num_gpus=ranks, window=_window(args))
    except ValueError as e:
        parser.error(str(e))
    model = MoECausalLM(
        args.model_config,
        mesh=mesh,
        num_redundant_experts=args.redundant,
        routing=eplb.routing,
        dispatch=DispatchConfig(capacity_factor=args.capacity_factor),
        rngs=nnx.Rngs(args.seed),
    )
    if args.checkpoint:
        try:
            load_checkpoint(model, args.checkpoint, quantize=args.quantize)
        except ValueError as e:
            parser.error(f"--checkpoint: {e}")
    else:
        skew_routers(model, args.skew)
        if args.quantize:  # the model's own experts, each slot on its own (replicas stay identical)
            try:
                for layer in model.moe_layers:
                    layer.quantize(args.quantize)
            except ValueError as e:
                parser.error(f"--quantize {args.quantize}: {e}")
    # One EP rank holds every expert: no placement changes its load, so the placement is held.
    held = args.init_placement is not None or ranks == 1
    try:
        controller = EplbController(model, mesh, eplb, placement=args.init_placement, rebalance=not held)
    except ValueError as e:
        parser.error(f"--init-placement: {e}")
    return model, controller, eplb, held


class Requests:
    """Batches of requests of random prompt lengths (Zipf-distributed tokens), and generation over them."""

    def __init__(self, args, model):
        import numpy as np

        from moe_eplb_jax.models import Sampling

        self.args, self.model = args, model
        self.sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        self.rng = np.random.default_rng(args.seed)

    def batch(self):
        from moe_eplb_jax.models import zipf_tokens

        args = self.args
        lengths = self.rng.integers(args.min_prompt, args.max_prompt + 1, args.batch)
        return [zipf_tokens(self.rng, 1, int(n), args.model_config.vocab_size, repeat=False)[0] for n in lengths]

    def run(self, prompts, seed, **options):
        from moe_eplb_jax.models import generate

        return generate(
            self.model,
            prompts,
            max_new_tokens=self.args.new_tokens,
            sampling=self.sampling,
            seed=seed,
            prompt_width=self.args.max_prompt,
            tokens_per_call=self.args.tokens_per_call,
            **options,
        )


def serve_batches(args, requests: Requests, controller, say):
    """Serves the warm-up and timed batches; every forward pass is a step of the controller's window.

    Returns ``(served, reports, compiled)``: per batch (decode tokens/s, rearrangements before it, after it, moving
    after it), each rearrangement's report with the forward pass it followed, and the programs compiled meanwhile.
    """
    reports, seen = [], [controller.last_report]

    def on_step(_):  # after each call: the controller stepped through its passes (and rearranged when due)
        report = controller.last_report
        if report is not seen[0] and report and report.get("rearranged"):
            reports.append(dict(report, after_pass=controller.total_steps))
        seen[0] = report

    served = []
    with counting_compiles() as compiled_mid_run:
        for b in range(args.warmup_batches + args.batches):
            before = controller.num_rearrangements
            out = requests.run(requests.batch(), args.seed + 1 + b, controller=controller, on_step=on_step)
            tps = (args.new_tokens - 1) * args.batch / out.decode_seconds if args.new_tokens > 1 else float("nan")
            served.append((tps, before, controller.num_rearrangements, controller.rearranging))
            say(f"batch {b + 1}/{args.warmup_batches + args.batches}: {tps:.1f} decode tok/s", flush=True)
    return served, reports, compiled_mid_run[0]


def compare_recompute(args, requests: Requests):
    """Decode seconds per step with and without the KV cache on the same prompts (nothing recorded)."""
    prompts = requests.batch()
    timed = {}
    for use_cache in (True, False):
        for _ in range(2):  # the second run is timed: the first compiles
            out = requests.run(prompts, args.seed, use_cache=use_cache, record=False)
        timed[use_cache] = out.decode_seconds / max(args.new_tokens - 1, 1)
    return timed[True], timed[False]


def _decode_floor_line(args, ranks, tokens_per_second):
    """One GPU: the decode step next to its floor, the bytes it must read over the card's memory bandwidth."""
    import jax
    import numpy as np

    kind = jax.devices()[0].device_kind
    bandwidth = memory_bandwidth()
    measured = [tps for tps in tokens_per_second if np.isfinite(tps) and tps > 0]
    if ranks != 1 or bandwidth is None or not measured:
        return None
    step = args.batch / float(np.mean(measured))
    floor = args.model_config.decode_read_bytes(args.batch, args.max_prompt + args.new_tokens // 2) / bandwidth
    return (
        f"decode step {step * 1e3:.3f} ms against its floor {floor * 1e3:.3f} ms (the weights and KV cache it reads "
        f"over {kind}'s {bandwidth / 1e12:.2f} TB/s): {floor / step:.0%} of the floor's speed"
    )


def print_summary(args, ranks, eplb, held, controller, served, reports, warmup, last, compare, compiled_mid_run):
    """The run's summary: balancedness before and after, the rearrangements, throughput, what was written."""
    import jax
    import numpy as np

    from moe_eplb_jax import metrics

    config = args.model_config

    def balancedness(slot_load):
        return float(metrics.balancedness(metrics.rank_load(np.asarray(slot_load, np.float64), ranks)))

    def mean_tps(rows):
        rows = [tps for tps in rows if np.isfinite(tps)]
        return f"{np.mean(rows):.1f} tok/s" if rows else "n/a"

    print("\n=== summary ===" if args.num_processes == 1 else f"\n=== summary (process {jax.process_index()}) ===")
    print(
        f"EP ranks {ranks}, {_hf_config_file(args) or 'preset ' + args.preset} ({config.attention.upper()} "
        f"attention): {config.num_moe_layers} MoE layers, experts "
        f"{config.num_experts} + {args.redundant} redundant{f' ({args.quantize})' if args.quantize else ''}, "
        f"top-{config.top_k} ({config.scoring} router), "
        f"routing {eplb.routing!r}, policy {eplb.policy!r}, overlap {eplb.overlap!r}"
    )
    if ranks == 1:
        print("EP = 1: one rank holds every expert, so there is nothing to balance; the placement is held")
    if held:
        print(f"balancedness (measured): held placement {balancedness(last):.3f}  (1.0 = perfect)")
        print(f"throughput: {mean_tps([row[0] for row in served])} (decode, batch {args.batch})")
    else:
        # The window the first rearrangement was decided from, on the initial placement (else: all traffic so far).
        initial = reports[0]["balancedness_before"] if reports else balancedness(last)
        print(
            f"balancedness (measured): initial placement {initial:.3f} -> EPLB placement {balancedness(last):.3f}"
            "  (1.0 = perfect)"
        )
        for i, report in enumerate(reports):
            print(
                f"rearrangement {i + 1} (done after forward pass {report['after_pass']}): {report['slots_moved']} slots in "
                f"{report['layers_moved']} layers, {report['bytes_moved'] / 1e6:.2f} MB moved in "
                f"{report['move_seconds'] * 1e3:.1f} ms ({report['gb_per_s']:.3g} GB/s); policy-predicted "
                f"balancedness {report['balancedness_before']:.3f} -> {report['balancedness_after']:.3f}"
            )
        if warmup is not None:
            mid_run = f"{compiled_mid_run} programs" if compiled_mid_run else "nothing"
            print(f"controller.warmup() took {warmup['seconds']:.1f} s before serving ({mid_run} compiled mid-run)")
        print(
            f"throughput (decode, batch {args.batch}, rearrangement steps included): "
            f"{mean_tps([r[0] for r in served if r[2] == 0 and not r[3]])} on the initial placement, "
            f"{mean_tps([r[0] for r in served if r[1] >= 1])} on the EPLB placement"
        )
    floor_line = _decode_floor_line(args, ranks, [row[0] for row in served])
    if floor_line:
        print(floor_line)
    if jax.devices()[0].platform == "cpu" and args.devices:
        print("(CPU simulated devices: throughput does not show the balance)")
    if compare is not None:
        cached, recomputed = compare
        print(
            f"decode time per generated token (batch {args.batch}, {args.new_tokens} new tokens): KV cache "
            f"{cached * 1e3:.2f} ms vs full recompute {recomputed * 1e3:.2f} ms ({recomputed / cached:.1f}x)"
        )
    if args.dump_loads:
        print(f"loads of the last {int(np.asarray(controller.state.window_filled))} steps written to {args.dump_loads}")
    if args.save_placement:
        print(f"placement saved to {args.save_placement}")


def main(argv=None):
    prepare_devices(argv)  # before anything imports jax
    parser, args = parse_args(argv)
    rt = Runtime(args, parser)  # sets the device flags, then imports jax
    check_divides(parser, rt.ranks, _divided(args))  # the EP size is known now even with --devices 0
    import jax

    model, controller, eplb, held = build_model(parser, args, rt)
    main_process = jax.process_index() == 0
    say = print if main_process else lambda *a, **k: None
    requests = Requests(args, model)

    start = time.perf_counter()
    say("compiling prefill and decode (a first batch, not recorded) ...", flush=True)
    # Unrecorded with the controller: counts no load, compiles the programs the recorded batches run.
    requests.run(requests.batch(), args.seed, record=False, controller=controller)
    say(f"compiled prefill and decode in {time.perf_counter() - start:.1f} s", flush=True)
    warmup = None
    if not held:  # compiles the mover, the window update and readers, the routing tables' update
        say("controller.warmup(): compiling the expert mover and the routing tables' update ...", flush=True)
        warmup = controller.warmup()
        say(f"controller.warmup(): {warmup['moves']} moves rehearsed in {warmup['seconds']:.1f} s", flush=True)

    served, reports, compiled_mid_run = serve_batches(args, requests, controller, say)
    last = controller.window_slot_load()  # the traffic since the last rearrangement, on the placement served
    if args.dump_loads:
        controller.dump_loads(args.dump_loads)
    if args.save_placement and main_process:
        controller.save_placement(args.save_placement)
    # Same prompts, no recording: decode time per step with and without the cache.
    compare = compare_recompute(args, requests) if args.compare_recompute else None
    if not (main_process or args.num_processes > 1):
        return
    # Every process prints the summary: their figures must agree.
    print_summary(args, rt.ranks, eplb, held, controller, served, reports, warmup, last, compare, compiled_mid_run)


if __name__ == "__main__":
    main()

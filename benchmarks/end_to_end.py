"""End-to-end tokens/s of an MoE model with and without EPLB: training, decode-heavy and prefill-heavy serving.

    PYTHONPATH=. python benchmarks/end_to_end.py --ranks 2                     # 2 GPUs (4 when lent: --ranks 4)
    PYTHONPATH=. python benchmarks/end_to_end.py --ranks 2 --preset deepseek_v3_small   # DeepSeek-V3-shaped
    PYTHONPATH=. python benchmarks/end_to_end.py --ranks 1                     # one GPU: EP=1, balance moot
    PYTHONPATH=. python benchmarks/end_to_end.py --cpu-devices 8 --small       # CPU smoke run

One model (``moe_eplb_jax.models``, ``--preset``; the same weights from one seed), one token stream and one
skew, side by side in one run, four rows:

* ``no EPLB``: experts in id order (``Placement.linear``: slot ``p`` holds expert ``p mod E``), hash routing,
  nothing recorded, never rearranged;
* ``EPLB (balanced/hash)``: ``EplbController`` with the ``balanced`` policy and hash replica routing,
  rearranging every ``--interval`` steps (the first after a quarter of it) inside the timed run;
* ``online quota``: ``MoECausalLM(..., routing="quota")`` under ``EplbConfig(routing="quota",
  policy="online")``: fixed home experts, spare slots refreshed every ``--interval`` steps, per-batch quotas;
* ``uniform (ideal)``: no skew (zero router bias, uniformly drawn token ids: near-uniform routing) on a
  placement where equal expert loads give equal rank loads (``moe_step.even_placement``); the limit.

Skew (``--skew s``): every MoE layer's router bias is ``-s * log(1 + r)`` for the expert of popularity rank
``r`` over a fixed random expert order per layer -- with softmax scoring an expert is picked about
``(1 + r) ** -s`` as often as the most popular one, the Zipf popularity of ``moe_step.py``'s default -- and the
token ids follow a Zipf law (``models.zipf_tokens``). The bias is held out of the optimizer, so the skew lasts.

Three phases per row, each on a fresh model and controller that start from the linear placement, each after
one untimed compiling pass; ``controller.warmup()`` (its default rehearsal, then with the load of a held-out
batch) before it, so the mover compiles before the clock starts:

* train: AdamW steps on ``--train-batch`` sequences of ``--seq`` tokens; tokens/s = input tokens / wall time
  of the timed steps, each ``train step + controller.step()``;
* decode: ``generate`` with a KV cache, ``--decode-batch`` requests of short prompts, ``--new-tokens`` each;
  tokens/s = generated tokens / decode wall time (every pass closes a controller step);
* prefill: ``--prefill-batch`` requests of long prompts, one new token each (prefill-heavy serving); tokens/s
  = prompt tokens / wall time of the whole ``generate`` call.

Every rearrangement (decision, moves, table switch) runs inside the timed loops, so its time is amortised
over the phase; the table gives the count and the seconds the moves reported. ``bal.`` is the balancedness
measured on one held-out batch at the end of the phase (the placement the phase ended with). The MoE layers
exchange tokens in rounds of ``--capacity-factor`` times the balanced share, so a rank holding more tokens
costs more rounds for everyone; training and serving use the grouped matmul ``--matmul`` (default ``auto``: the
GPU kernels with gradients on a GPU, ``dense`` on the CPU).
With one EP rank (``--ranks 1``) balance is moot -- every expert is on the one rank -- so the EPLB rows record
loads (and the quota row routes by quotas) but hold the placement; the run says so. ``--rows`` picks rows, to
split a long run; ``--json PATH`` writes every figure.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback

import numpy as np

ROWS = ("no EPLB", "EPLB (balanced/hash)", "online quota", "uniform (ideal)")
PHASES = ("train", "decode", "prefill")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=None, help="EP ranks (default: every device)")
    p.add_argument("--cpu-devices", type=int, default=0, help="simulate this many CPU devices")
    p.add_argument("--small", action="store_true", help="the tiny preset and few steps (CPU smoke run)")
    p.add_argument("--preset", default="small", help="model shape (moe_eplb_jax.models.PRESETS)")
    p.add_argument(
        "--redundant", type=int, default=None, help="redundant slots R (default: E / 4 in multiples of the EP size)"
    )
    p.add_argument("--skew", type=float, default=1.5, help="Zipf exponent of the expert popularity")
    p.add_argument("--capacity-factor", type=float, default=1.25, help="token exchange rounds (0: one worst case)")
    p.add_argument("--matmul", default=None, help="grouped matmul (default: auto, the GPU kernels on a GPU)")
    p.add_argument("--train-batch", type=int, default=16, help="sequences per training step")
    p.add_argument("--seq", type=int, default=512, help="tokens per training sequence")
    p.add_argument("--train-steps", type=int, default=24, help="timed training steps")
    p.add_argument("--decode-batch", type=int, default=256, help="requests per decode batch")
    p.add_argument("--decode-prompt", type=int, default=64, help="longest decode prompt (the shortest: half)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per decode request")
    p.add_argument("--decode-batches", type=int, default=3, help="timed decode batches")
    p.add_argument("--tokens-per-call", type=int, default=16, help="decode passes per host round trip")
    p.add_argument("--prefill-batch", type=int, default=32, help="requests per prefill batch")
    p.add_argument("--prompt", type=int, default=1024, help="longest prefill prompt (the shortest: half)")
    p.add_argument("--prefill-batches", type=int, default=12, help="timed prefill batches")
    p.add_argument("--interval", type=int, default=None, help="steps between rearrangements (default: per phase)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated rows out of {ROWS}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write every figure here")
    args = p.parse_args(argv)
    if args.small:
        args.preset, args.train_batch, args.seq, args.train_steps = "tiny", 8, 16, 6
        args.decode_batch, args.decode_prompt, args.new_tokens, args.decode_batches = 16, 8, 6, 2
        args.prefill_batch, args.prompt, args.prefill_batches = 8, 32, 4
    rows = [r for r in args.rows.split(",") if r]
    if not rows or set(rows) - set(ROWS):
        p.error(f"--rows takes names out of {ROWS}, got {args.rows!r}")
    args.rows = rows
    return args


class Run:
    """One model, token stream and skew, and the rows' phases on it (see the module docstring)."""

    def __init__(self, args):
        import jax
        from flax import nnx

        from moe_eplb_jax.models import PRESETS, zipf_router_bias
        from moe_eplb_jax.placement import Placement

        try:  # run as a script: benchmarks/ is on sys.path
            from moe_step import even_placement
        except ImportError:
            from benchmarks.moe_step import even_placement

        self.args = args
        self.ranks = ranks = args.ranks or jax.device_count()
        self.mesh = jax.make_mesh(
            (ranks,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:ranks]
        )
        self.config = config = PRESETS[args.preset]
        E, L = config.num_experts, config.num_moe_layers
        self.E, self.L, self.V = E, L, config.vocab_size
        self.R = R = args.redundant if args.redundant is not None else max(ranks, E // 4 // ranks * ranks)
        self.P = P = E + R
        self.capacity = args.capacity_factor or None
        self.intervals = {  # steps (forward passes when serving) between rearrangements: two or three per phase
            "train": args.interval or max(4, args.train_steps * 2 // 3),
            "decode": args.interval or max(4, args.decode_batches * args.new_tokens * 2 // 3),
            "prefill": args.interval or max(4, args.prefill_batches * 2 // 3),
        }
        self.rows = list(args.rows)
        if "online quota" in self.rows and (E % ranks or R % ranks or R == 0):
            print(f"online quota skipped: E={E} and R={R} must be positive multiples of the EP size {ranks}")
            self.rows.remove("online quota")
        for name, size in (("P = E + R", P), ("--train-batch", args.train_batch)):
            if size % ranks:
                raise SystemExit(f"{name} = {size} is not divisible by the {ranks} EP ranks")
        if ranks == 1:
            print(
                "EP = 1: one rank holds every expert, so balance is moot: the EPLB rows record loads, hold the placement"
            )
        order = np.random.default_rng(args.seed + 1)
        self.biases = [zipf_router_bias(E, args.skew)[order.permutation(E)] for _ in range(L)]
        ideal = even_placement(E, P, ranks)
        self.ideal = Placement.from_phy2log(np.repeat(ideal.phy2log, L, axis=0), E, num_ranks=ranks)
        self.forward = nnx.jit(lambda model, x: model(x))
        self.trainable = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("router_bias")))  # the skew stays fixed
        self.train_step = _train_step(self.trainable)

    def build(self, row, phase):
        """(model, controller or None) of ``row`` for ``phase``: fresh weights from one seed, skew, placement."""
        from flax import nnx

        from moe_eplb_jax.config import EplbConfig
        from moe_eplb_jax.flax import EplbController
        from moe_eplb_jax.models import MoECausalLM
        from moe_eplb_jax.moe import DispatchConfig
        from moe_eplb_jax.transport import put_host

        args, mesh, ranks, R = self.args, self.mesh, self.ranks, self.R
        routing = "quota" if row == "online quota" else "hash"
        matmul = args.matmul or "auto"
        model = MoECausalLM(
            self.config,
            mesh=mesh,
            num_redundant_experts=R,
            routing=routing,
            dispatch=DispatchConfig(matmul=matmul, capacity_factor=self.capacity),
            rngs=nnx.Rngs(args.seed),
        )
        if row != "uniform (ideal)":
            for layer, bias in zip(model.moe_layers, self.biases):
                layer.router_bias.set_value(put_host(bias, mesh))
        interval = self.intervals[phase]
        if row in ("no EPLB", "uniform (ideal)"):
            if row == "uniform (ideal)":  # moves the experts to the even placement, then holds it
                EplbController(model, mesh, EplbConfig(num_redundant_experts=R, num_gpus=ranks), placement=self.ideal)
            return model, None
        eplb = EplbConfig(
            num_redundant_experts=R,
            num_gpus=ranks,
            window_size=interval,
            step_interval=interval,
            policy="online" if routing == "quota" else "balanced",
            routing=routing,
        )
        # One EP rank holds every expert: no placement changes its load, so the placement is held there.
        controller = EplbController(model, mesh, eplb, rebalance=ranks > 1)
        if ranks == 1:
            return model, controller
        # The default rehearsal, then the move to the policy's placement for a held-out batch's load (the kind of
        # move the run's first rearrangement makes): the executors those need compile here, not mid-run.
        slot = self.slot_load(model, row, np.random.default_rng(args.seed + 2))
        logical = np.zeros((self.L, self.E))
        for layer, phy2log in enumerate(controller.placement.phy2log):
            np.add.at(logical[layer], phy2log, slot[layer])
        controller.warmup()
        controller.warmup(load=logical)
        return model, controller

    def tokens(self, row, rng, batch, seq, *, repeat=True):
        from moe_eplb_jax.models import zipf_tokens

        if row == "uniform (ideal)":
            return rng.integers(0, self.V, (batch, seq)).astype(np.int32)
        return zipf_tokens(rng, batch, seq, self.V, repeat=repeat)

    def prompts(self, row, rng, batch, shortest, longest):
        lengths = rng.integers(shortest, longest + 1, batch)
        return [self.tokens(row, rng, 1, int(n), repeat=False)[0] for n in lengths]

    def slot_load(self, model, row, rng):
        """``[L, P]`` tokens per slot of one held-out batch, recorded; the layers' load variables restored after."""
        import jax

        from moe_eplb_jax.transport import put_host

        mesh, layers = self.mesh, model.moe_layers
        kept = [layer.expert_load.get_value() for layer in layers]
        for layer, value in zip(layers, kept):
            layer.expert_load.set_value(put_host(np.zeros(value.shape, np.int32), mesh, value.sharding.spec))
        x = put_host(
            self.tokens(row, rng, self.args.train_batch, self.args.seq), mesh, jax.sharding.PartitionSpec("ep")
        )
        jax.block_until_ready(self.forward(model, x))
        load = np.stack([np.asarray(layer.expert_load.get_value()).reshape(-1, self.P).sum(0) for layer in layers])
        for layer, value in zip(layers, kept):
            layer.expert_load.set_value(value)
        return load.astype(np.float64)

    def balancedness(self, model, row, rng):
        """Measured on one held-out batch, on the placement the model holds now."""
        from moe_eplb_jax import metrics

        return float(metrics.balancedness(metrics.rank_load(self.slot_load(model, row, rng), self.ranks)))

    def train(self, row):
        import jax
        import optax
        from flax import nnx

        from moe_eplb_jax.transport import put_host

        args, mesh = self.args, self.mesh
        model, controller = self.build(row, "train")
        optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=self.trainable)
        # optax makes its step counter on one device: replicated on the mesh like the rest, the step's inputs
        # keep one sharding from the first call on (no recompilation inside the timed steps).
        nnx.update(
            optimizer, jax.tree.map(lambda x: put_host(np.asarray(x), mesh) if x.ndim == 0 else x, nnx.state(optimizer))
        )
        rng = np.random.default_rng(args.seed)
        record = np.bool_(controller is not None)
        batches = [
            put_host(self.tokens(row, rng, args.train_batch, args.seq + 1), mesh, jax.sharding.PartitionSpec("ep"))
            for _ in range(args.train_steps + 1)
        ]
        first = float(self.train_step(model, optimizer, batches[0], record))  # compiles; not timed
        if controller is not None:
            controller.step()
        reports, loss = [], None
        start = time.perf_counter()
        for batch in batches[1:]:
            loss = self.train_step(model, optimizer, batch, record)
            if controller is not None:
                reports.append(controller.step())
        last = float(jax.block_until_ready(loss))
        seconds = time.perf_counter() - start
        count, move_seconds, moved_bytes = _moved(reports)
        tokens_per_s = args.train_steps * args.train_batch * args.seq / seconds
        return dict(
            tokens_per_s=tokens_per_s,
            model_tflops=3 * self.config.flops_per_token((args.seq + 1) / 2) * tokens_per_s / 1e12,
            seconds=seconds,
            loss=(first, last),
            balancedness=self.balancedness(model, row, rng),
            rearrangements=count,
            move_seconds=move_seconds,
            bytes_moved=moved_bytes,
        )

    def serve(self, row, phase):
        from moe_eplb_jax.models import generate

        args = self.args
        model, controller = self.build(row, phase)
        rng = np.random.default_rng(args.seed)
        decode = phase == "decode"
        batch = args.decode_batch if decode else args.prefill_batch
        longest = args.decode_prompt if decode else args.prompt
        shortest = max(1, longest // 2)
        new_tokens = args.new_tokens if decode else 1
        reports = []

        def on_step(_):  # after each call: the controller stepped through its passes
            reports.append(controller.last_report)
            controller.last_report = None

        def run(requests, record=True):
            stepping = record and controller is not None
            return generate(
                model,
                requests,
                max_new_tokens=new_tokens,
                prompt_width=longest,
                record=stepping,
                tokens_per_call=args.tokens_per_call,
                controller=controller,  # unrecorded: counts nothing, compiles what the recording calls run
                on_step=on_step if stepping else None,
            )

        run(self.prompts(row, rng, batch, shortest, longest), record=False)  # compiles prefill and decode; not timed
        counted, seconds = 0, 0.0
        for _ in range(args.decode_batches if decode else args.prefill_batches):
            requests = self.prompts(row, rng, batch, shortest, longest)
            start = time.perf_counter()
            out = run(requests)
            if decode:  # the decode steps (and the controller steps between them), not the prefill
                counted += (new_tokens - 1) * batch
                seconds += out.decode_seconds
            else:  # the whole call: prefill, the controller step after it, the token read back
                counted += sum(len(p) for p in requests)
                seconds += time.perf_counter() - start
        count, move_seconds, moved_bytes = _moved(reports)
        return dict(
            tokens_per_s=counted / seconds,
            seconds=seconds,
            balancedness=self.balancedness(model, row, rng),
            rearrangements=count,
            move_seconds=move_seconds,
            bytes_moved=moved_bytes,
        )


def _moved(reports):
    done = [r for r in reports if r and r.get("rearranged")]
    return len(done), sum(r["move_seconds"] for r in done), sum(r["bytes_moved"] for r in done)


def _train_step(trainable):
    """One jitted step for every row: the rows' models share a structure, so they share compilations."""
    from flax import nnx

    from moe_eplb_jax.models import cross_entropy

    @nnx.jit
    def train_step(model, optimizer, batch, record):
        def loss_fn(model):
            logits = model(batch[:, :-1], record=record)
            return cross_entropy(logits, batch[:, 1:]).mean()

        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, trainable))(model)
        optimizer.update(model, grads)
        return loss

    return train_step


def main(argv=None):
    args = parse_args(argv)
    if args.cpu_devices:
        os.environ["JAX_PLATFORMS"] = "cpu"
        # Compile-bound on CPU: LLVM's optimisation passes cost more than they save on these small programs.
        os.environ["XLA_FLAGS"] = (
            f"--xla_force_host_platform_device_count={args.cpu_devices} --xla_backend_optimization_level=0"
        )
    import jax  # after the device count is set

    run = Run(args)
    results = {}
    for row in run.rows:
        results[row] = {}
        for phase in PHASES:
            try:
                results[row][phase] = run.train(row) if phase == "train" else run.serve(row, phase)
            except Exception:  # one row failing must not hide the others' figures
                traceback.print_exc()
                results[row][phase] = None
            gc.collect()  # the phase's model and optimizer go before the next is built
            print(f"{row} / {phase}: {results[row][phase]}", flush=True)
    device = jax.devices()[0].device_kind
    return report(args, results, ranks=run.ranks, device=device, R=run.R, intervals=run.intervals)


def report(args, results, *, ranks, device, R, intervals):
    """Prints the table (and writes the JSON); 0 when every phase of every row ran."""
    from moe_eplb_jax.models import PRESETS

    config = PRESETS[args.preset]
    ideal = results.get("uniform (ideal)", {})
    print(
        f"\n=== end to end ({ranks} x {device}; preset {args.preset}: {config.num_moe_layers} MoE layers x "
        f"{config.num_experts} experts + {R} redundant, top-{config.top_k}, {config.dtype}; Zipf skew {args.skew}; "
        f"capacity factor {args.capacity_factor}) ==="
    )
    if ranks == 1:
        print("EP = 1: one rank holds every expert, so balance is moot; the EPLB rows record loads (and route by")
        print("quotas) but hold the placement: they differ from 'no EPLB' only by that bookkeeping")
    print(
        f"train {args.train_batch} x {args.seq} tokens/step, {args.train_steps} steps; decode batch "
        f"{args.decode_batch}, prompts {args.decode_prompt // 2}..{args.decode_prompt}, {args.new_tokens} new tokens, "
        f"{args.decode_batches} batches; prefill batch "
        f"{args.prefill_batch}, prompts {args.prompt // 2}..{args.prompt}, {args.prefill_batches} batches; "
        f"rearrangement interval (steps) {intervals}"
    )
    head = f"{'row':24s}" + "".join(f" {p + ' tok/s':>14s} {'/ideal':>7s} {'bal.':>6s} {'moves':>12s}" for p in PHASES)
    print(head)
    for row, phases in results.items():
        line = f"{row:24s}"
        for phase in PHASES:
            r = phases.get(phase)
            if r is None:
                line += f" {'FAILED':>14s} {'':>7s} {'':>6s} {'':>12s}"
                continue
            base = ideal.get(phase)
            vs = f"{r['tokens_per_s'] / base['tokens_per_s']:7.3f}" if base else f"{'n/a':>7s}"
            moves = f"{r['rearrangements']} / {r['move_seconds']:.2f}s" if r["rearrangements"] else "-"
            line += f" {r['tokens_per_s']:14.1f} {vs} {r['balancedness']:6.3f} {moves:>12s}"
        print(line)
    print("moves: rearrangements in the timed run / seconds their moves reported (all included in tok/s)")
    ours, base = results.get("EPLB (balanced/hash)", {}), results.get("no EPLB", {})
    quota = results.get("online quota", {})
    for name, row in (("EPLB (balanced/hash)", ours), ("online quota", quota)):
        ratios = [
            f"{phase} {row[phase]['tokens_per_s'] / base[phase]['tokens_per_s']:.3f}x"
            for phase in PHASES
            if row.get(phase) and base.get(phase)
        ]
        if ratios:
            print(f"{name} vs no EPLB: " + ", ".join(ratios))
    peak = 989e12 * ranks if ("H100" in device or "H200" in device) else None  # dense bf16, SXM
    for name, row in results.items():
        if row.get("train"):
            mfu = f", MFU {row['train']['model_tflops'] * 1e12 / peak:.1%}" if peak else ""
            print(f"{name} train: {row['train']['model_tflops']:.1f} model TFLOP/s{mfu}")
    if args.cpu_devices:
        print("(CPU simulated devices: a smoke run; the figures do not show the balance)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(ranks=ranks, device=device, args=vars(args), redundant=R, intervals=intervals, rows=results),
                f,
                indent=1,
            )
    return 0 if all(r is not None for phases in results.values() for r in phases.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

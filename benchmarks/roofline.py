"""Roofline of the model path: training and prefill MFU, decode against its weight-read floor, the grouped matmul.

    PYTHONPATH=. python benchmarks/roofline.py                        # one GPU, the small preset, every phase
    PYTHONPATH=. python benchmarks/roofline.py --preset deepseek_v3_small --phases prefill,decode
    PYTHONPATH=. python benchmarks/roofline.py --preset tiny --cpu    # CPU smoke run (figures meaningless)
    PYTHONPATH=. python benchmarks/roofline.py --phases decode --profile 25 --hlo /tmp/hlo
                                                                      # each profiled kernel's HLO instruction

One model (``moe_eplb_jax.models``, bf16, EP = 1), side by side in one run:

* train: AdamW steps on ``--train-batch`` x ``--seq`` tokens as ``examples/train.py`` runs them (``nnx.jit_partial``),
  beside ``nnx.jit`` (the graph traversed every call) and ``jax.jit`` over the split state, each timed over steps
  dispatched back to back (a loop that reads the loss only when it logs), the first also waiting for every step;
  model FLOPs = 3 x the forward's (below) per token; MFU against the card's dense bf16 peak (989 TFLOP/s on an
  H100 or H200 SXM).
* prefill: ``--prefill-batch`` prompts of ``--prompt / 2`` to ``--prompt`` tokens (left-padded), one pass with the
  KV cache; FLOPs of the real tokens only.
* decode: ms per step at each ``--decode-batches`` size (prompts up to ``--decode-prompt`` wide), next to the
  floor: the bytes of weights the step must read (every non-expert weight, the experts the batch's routing
  touched, the KV cache) over the card's HBM bandwidth (H100 3.35 TB/s, H200 4.8 TB/s); with the controller
  stepping every pass into its window (recording on, nothing due) and without, and one pass per host call; the
  three take turns over five rounds (the median of each).
* gmm: the grouped matmul alone at a training shape (forward, forward + both gradients, TFLOP/s, device time of
  the kernels) and a decode shape (GB/s against HBM), for each implementation next to XLA's ``ragged_dot``; at the decode shape also the
  quantized grouped matmul per format (``moe.quantized_matmul``, the kernel reading packed weights) against
  its weight-read floor (packed weights and scales over HBM bandwidth).

Forward FLOPs per token, from the config: every matmul of the active path -- q/k/v/o projections, attention
scores and values over the causal context, the dense MLPs, the router, the top-k experts and the shared expert,
the LM head. ``--json PATH`` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _hlo import describe, with_dump
from _timing import device_seconds, hbm_bandwidth

PEAK_BF16 = {"H100": 989e12, "H200": 989e12}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", help="model shape (moe_eplb_jax.models.PRESETS)")
    p.add_argument("--phases", default="gmm,train,prefill,decode", help="comma-separated: gmm, train, prefill, decode")
    p.add_argument("--train-batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=6, help="timed training steps")
    p.add_argument("--remat", action="store_true", help="recompute blocks in the backward pass")
    p.add_argument(
        "--bound-step-only", action="store_true", help="time only the bound training step (not nnx.jit, jax.jit)"
    )
    p.add_argument("--prefill-batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--prefill-matmuls", default="auto", help="grouped matmuls to prefill with (DispatchConfig.matmul)")
    p.add_argument("--decode-batches", default="1,32,256")
    p.add_argument("--decode-prompt", type=int, default=16, help="decode prompts' width (the context the cache holds)")
    p.add_argument("--new-tokens", type=int, default=33)
    p.add_argument("--tokens-per-call", type=int, default=16, help="decode passes per host round trip (looped rows)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU (smoke run)")
    p.add_argument("--profile", type=int, default=0, help="print the N costliest kernels of each phase (device time)")
    p.add_argument(
        "--hlo",
        default=None,
        metavar="DIR",
        help="dump XLA's optimized modules into DIR and name each profiled kernel's HLO instruction (shape, JAX op, "
        "source line)",
    )
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def forward_flops_per_token(config, context: float) -> float:
    return config.flops_per_token(context)


def card():
    import jax

    kind = jax.devices()[0].device_kind
    name = "H200" if "H200" in kind else "H100" if "H100" in kind else None
    return kind, PEAK_BF16.get(name), hbm_bandwidth(kind)


def pipelined(fn, reps: int) -> float:
    """Seconds per call of ``fn()`` (which dispatches and returns a device value) over ``reps`` calls dispatched
    back to back after one warm-up, waiting only for the last: a training loop's throughput, the host's dispatch
    hidden behind the device's work as it is where the loss is not read every step."""
    import jax

    jax.block_until_ready(fn())
    start = time.perf_counter()
    for _ in range(reps):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / reps


def kernel_seconds(fn, *args) -> tuple[float, float | None]:
    """``(all kernels, the grouped-matmul kernels alone)``: device seconds per call of ``fn(*args)`` from the
    profiler's kernel records (a product's time, not its launch's: one call of a 0.2 ms kernel is mostly host
    time); host-timed, and ``None`` for the second, where no GPU plane is recorded."""
    import jax

    seconds, per_kernel = device_seconds(fn, *args, calls=10, warmup=1)
    if seconds is None:
        return timed(lambda: jax.block_until_ready(fn(*args)), 5), None
    return seconds, sum(t for name, t in per_kernel.items() if kernel_kind(name) == "grouped matmul")


def timed(fn, reps: int) -> float:
    """Median wall seconds of ``fn()`` (which blocks) over ``reps`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


KERNEL_KINDS = (
    ("attention", ("cudnn", "flash", "fmha", "sdpa", "decode_attention")),
    ("grouped matmul", ("gmm", "grouped", "ragged", "qgmm", "swiglu_matmul", "mosaic_gpu")),
    ("routing", ("map_and_count", "expert_rank", "tile_counts", "alias", "boundary", "top_k_take", "slot_sort")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "dot")),
    ("copy", ("memcpy", "memset", "copy", "transpose")),
    ("fusion", ("fusion", "loop_", "input_", "reduce", "convert", "select", "scatter", "gather")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def profile(fn, top: int, calls: int = 3) -> dict:
    """Device time of ``fn()`` per call, by kernel kind and for the ``top`` costliest kernels."""
    return summary(*device_seconds(fn, calls=calls, warmup=1), top)


def summary(total, per_kernel: dict, top: int) -> dict:
    """``device_seconds``' figures by kernel kind and for the ``top`` costliest kernels, in ms."""
    if total is None:
        return {}
    kinds: dict[str, float] = {}
    for name, seconds in per_kernel.items():
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + seconds
    return {
        "device_ms": total * 1e3,
        "kinds_ms": {k: v * 1e3 for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "kernels_ms": {name[:90]: v * 1e3 for name, v in list(per_kernel.items())[:top]},
        "launches": len(per_kernel),
    }


def name_kernels(figures, directory: str) -> None:
    """Adds ``kernels_hlo`` beside every ``kernels_ms`` in ``figures`` (nested dicts): each kernel's HLO instruction
    from the modules dumped in ``directory``, one line per module holding it."""
    if not isinstance(figures, dict):
        return
    if isinstance(figures.get("kernels_ms"), dict):
        figures["kernels_hlo"] = {
            name: "; ".join(lines) for name, lines in describe(directory, figures["kernels_ms"]).items() if lines
        }
    for value in list(figures.values()):
        name_kernels(value, directory)


def kernel_difference(base, other, top: int) -> dict:
    """Device ms ``other`` spends beyond ``base`` (each ``device_seconds``' pair): in all and for the ``top``
    kernels whose time differs most."""
    (base_total, base_kernels), (other_total, other_kernels) = base, other
    if base_total is None or other_total is None:
        return {}
    names = set(base_kernels) | set(other_kernels)
    delta = {name: other_kernels.get(name, 0.0) - base_kernels.get(name, 0.0) for name in names}
    largest = sorted(delta.items(), key=lambda kv: -abs(kv[1]))[:top]
    return {
        "device_ms": (other_total - base_total) * 1e3,
        "launches": len(other_kernels) - len(base_kernels),
        "kernels_ms": {name[:90]: value * 1e3 for name, value in largest},
    }


def build(config, mesh, remat=False, matmul="auto"):
    from flax import nnx

    from moe_eplb_jax.models import MoECausalLM
    from moe_eplb_jax.moe import DispatchConfig

    return MoECausalLM(config, mesh=mesh, remat=remat, dispatch=DispatchConfig(matmul=matmul), rngs=nnx.Rngs(0))


def phase_train(args, config, mesh, rng, peak):
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from moe_eplb_jax.models import cross_entropy

    model = build(config, mesh, args.remat)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)

    def train_step(model, optimizer, tokens):
        loss, grads = nnx.value_and_grad(loss_fn_of(tokens, cross_entropy))(model)
        optimizer.update(model, grads)
        return loss

    # What examples/train.py runs: the model and optimizer bound once, their variables read at every call.
    step = nnx.jit_partial(train_step, model, optimizer, graph=False)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (args.train_batch, args.seq + 1)), jnp.int32)
    start = time.perf_counter()
    jax.block_until_ready(step(tokens))
    compile_s = time.perf_counter() - start
    seconds = pipelined(lambda: step(tokens), args.steps)
    blocking = timed(lambda: jax.block_until_ready(step(tokens)), args.steps)
    n = args.train_batch * args.seq
    flops = 3 * n * forward_flops_per_token(config, (args.seq + 1) / 2)
    stats = jax.devices()[0].memory_stats() or {}
    prof = profile(lambda: step(tokens), args.profile) if args.profile else {}
    nnx_jit_seconds = pure_seconds = float("nan")
    if not args.bound_step_only:
        traversing = nnx.jit(train_step, donate_argnums=(0, 1))  # the graph traversed on every call
        nnx_jit_seconds = pipelined(lambda: traversing(model, optimizer, tokens), args.steps)
        pure_seconds = _pure_step_seconds(model, optimizer, cross_entropy, tokens, args.steps)
    return {
        "profile": prof,
        "ms_per_step": seconds * 1e3,
        "ms_per_step_waiting_each": blocking * 1e3,
        "ms_per_step_nnx_jit": nnx_jit_seconds * 1e3,
        "ms_per_step_pure_jit": pure_seconds * 1e3,
        "tokens_per_s": n / seconds,
        "tflops": flops / seconds / 1e12,
        "mfu": flops / seconds / peak if peak else None,
        "first_step_s": compile_s,
        "peak_gib": stats.get("peak_bytes_in_use", 0) / 2**30,
    }


def loss_fn_of(tokens, cross_entropy):
    return lambda model: cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).mean()


def _pure_step_seconds(model, optimizer, cross_entropy, tokens, steps: int) -> float:
    """The same step as ``jax.jit`` over the split state: no per-call graph traversal on the host (what
    ``nnx.jit`` adds to every call), the state donated."""
    import functools

    import jax
    from flax import nnx

    graphdef, state = nnx.split((model, optimizer))

    @functools.partial(jax.jit, donate_argnums=0)
    def pure_step(state, tokens):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn_of(tokens, cross_entropy))(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    box = [state]

    def run():
        box[0], loss = pure_step(box[0], tokens)
        return loss

    seconds = pipelined(run, steps)
    nnx.update((model, optimizer), box[0])
    return seconds


def _prompts(rng, batch, longest, vocab):
    return [list(rng.integers(0, vocab, int(rng.integers(longest // 2, longest + 1)))) for _ in range(batch)]


def phase_prefill(args, config, mesh, rng, peak):
    """The prefill with each grouped matmul of ``--prefill-matmuls`` (the first one profiled): the padding
    positions' rows are in the buffer, which the Mosaic kernel computes and the Triton kernel skips."""
    from moe_eplb_jax.models import generate

    prompts = _prompts(rng, args.prefill_batch, args.prompt, config.vocab_size)
    real = sum(len(p) for p in prompts)
    flops = sum(len(p) * forward_flops_per_token(config, (len(p) + 1) / 2) for p in prompts)
    out = {}
    for index, matmul in enumerate(args.prefill_matmuls.split(",")):
        model = build(config, mesh, matmul=matmul)
        prefill = lambda: generate(model, prompts, max_new_tokens=1, prompt_width=args.prompt)
        prefill()  # compiles
        seconds = sorted(prefill().prefill_seconds for _ in range(5))[2]
        row = {
            "ms": seconds * 1e3,
            "tokens_per_s": real / seconds,
            "tflops": flops / seconds / 1e12,
            "mfu": flops / seconds / peak if peak else None,
        }
        if index == 0:
            row["profile"] = profile(lambda: prefill().tokens, args.profile) if args.profile else {}
            out.update(row)
        else:
            out[f"matmul_{matmul}"] = row
    return out


def phase_decode(args, config, mesh, rng, hbm):
    import functools

    from moe_eplb_jax import EplbConfig
    from moe_eplb_jax.flax import EplbController
    from moe_eplb_jax.models import generate

    model = build(config, mesh)
    controller = EplbController(model, mesh, EplbConfig(num_gpus=1))
    out = {}
    for batch in [int(b) for b in args.decode_batches.split(",")]:
        prompts = _prompts(rng, batch, args.decode_prompt, config.vocab_size)
        steps = args.new_tokens - 1
        row = {}
        # One pass per host call (the host between every two tokens), then on-device loops, bare and with the
        # controller stepping every pass's load into its window.
        variants = {
            "per_pass": {},
            "looped": {"tokens_per_call": args.tokens_per_call},
            "looped_controller": {"tokens_per_call": args.tokens_per_call, "controller": controller},
        }
        decode = functools.partial(
            generate, model, prompts, max_new_tokens=args.new_tokens, prompt_width=args.decode_prompt
        )
        for options in variants.values():
            decode(**options)  # compiles
        # The variants take turns, five rounds: a drift of the card's clocks falls on each alike, where timing one
        # variant after the other would read it as the controller's cost.
        runs = {name: [] for name in variants}
        for _ in range(5):
            for name, options in variants.items():
                runs[name].append(decode(**options).decode_seconds)
        for name, seconds in runs.items():
            row[f"ms_{name}"] = sorted(seconds)[2] / steps * 1e3
        if args.profile:
            # Both loops profiled: what the controller adds on the device is the difference, kernel by kernel.
            measured = {}
            for name in ("looped", "looped_controller"):
                run = lambda o=variants[name]: decode(**o).tokens
                measured[name] = device_seconds(run, calls=1, warmup=1)
            row["profile_per_generate"] = summary(*measured["looped"], args.profile)
            row["controller_adds_per_generate"] = kernel_difference(*measured.values(), args.profile)
        floor = config.decode_read_bytes(batch, args.decode_prompt + args.new_tokens)
        row["floor_ms"] = floor / hbm * 1e3 if hbm else None
        row["x_floor"] = row["ms_looped"] / row["floor_ms"] if hbm else None
        row["controller_overhead"] = row["ms_looped_controller"] / row["ms_looped"] - 1
        out[batch] = row
    return out


def phase_gmm(args, rng, peak, hbm):
    import jax
    import jax.numpy as jnp

    from moe_eplb_jax.moe import grouped_matmul as gmm

    out = {}
    cases = {
        "train 65536x1024->512 G64": (65536, 1024, 512, 64),
        "prefill 8192x1024->1024 G64": (8192, 1024, 1024, 64),
        "decode-256 2048x1024->1024 G64": (2048, 1024, 1024, 64),
        "decode 256x2048->1536 G128": (256, 2048, 1536, 128),
    }
    for label, (n, k, m, g) in cases.items():
        x = jnp.asarray(rng.standard_normal((n, k)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((g, k, m)) / k**0.5, jnp.bfloat16)
        sizes = jnp.asarray(rng.multinomial(n, [1 / g] * g), jnp.int32)
        cot = jnp.asarray(rng.standard_normal((n, m)), jnp.float32)
        flops, weight_bytes = 2 * n * k * m, g * k * m * 2
        for impl in ("pallas", "triton", "mosaic", "ragged_dot", "dense"):
            if impl == "dense" and n * g * m * 4 > 2**30:  # the [S, N, M] intermediate: a baseline at small sizes
                continue
            row = {}
            try:
                product = lambda x, w, impl=impl: gmm.grouped_matmul(x, w, sizes, implementation=impl)

                def both(x, w, dy, product=product):  # the forward and both gradients, no loss around them
                    y, pull = jax.vjp(product, x, w)
                    return y, *pull(dy.astype(y.dtype))

                for part, fn, inputs in (("fwd", jax.jit(product), (x, w)), ("fwd_bwd", jax.jit(both), (x, w, cot))):
                    total, products = kernel_seconds(fn, *inputs)
                    row[f"{part}_ms"] = total * 1e3
                    if products:  # the padding rows' zeroing fuses into a model's next op, not here
                        row[f"{part}_kernels_ms"] = products * 1e3
            except Exception as e:  # an implementation that cannot take the shape (memory, backend)
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            for part, passes in (("fwd", 1), ("fwd_bwd", 3)):
                for timing in ("", "_kernels"):
                    if f"{part}{timing}_ms" in row:
                        row[f"{part}{timing}_tflops"] = passes * flops / row[f"{part}{timing}_ms"] / 1e9
            if "fwd_ms" in row:
                row["fwd_gbs"] = (weight_bytes + (n * k + n * m) * 2) / row["fwd_ms"] / 1e6
            out[f"{label} {impl}"] = row
        out[f"{label} floor"] = {
            "fwd_ms": max(flops / peak, (weight_bytes + (n * k + n * m) * 2) / hbm) * 1e3 if peak and hbm else None
        }
        if label.startswith("decode "):
            out.update(_quantized_gmm_rows(label, x, w, sizes, hbm))
    return out


def _quantized_gmm_rows(label, x, w, sizes, hbm):
    """The quantized grouped matmul per format on the decode case's weights: ms and the weight-read floor."""
    import jax
    import jax.numpy as jnp

    from moe_eplb_jax import quant
    from moe_eplb_jax.moe import quantized_matmul as qmm

    rows = {}
    impl = "auto" if jax.default_backend() == "gpu" else "reference"  # the interpreter is far too slow here
    for fmt in quant.FORMATS:
        q = quant.quantize_experts(jnp.swapaxes(w, 1, 2).astype(jnp.float32), fmt)  # [G, M, K]
        packed = sum(leaf.size * jax.dtypes.itemsize_bits(leaf.dtype) // 8 for leaf in jax.tree.leaves(q))
        f = jax.jit(lambda x, q, s: qmm.quantized_grouped_matmul(x, q, s, implementation=impl))
        row = {"weight_mib": packed / 2**20}
        try:
            row["fwd_ms"] = kernel_seconds(f, x, q, sizes)[0] * 1e3
            row["kernel"] = impl == "auto" and qmm.kernel_available()  # else the dequantized reference served
            row["floor_ms"] = packed / hbm * 1e3 if hbm else None
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        rows[f"{label} quantized {fmt}"] = row
    return rows


def main(argv=None):
    args = parse_args(argv)
    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
    if args.hlo:  # read when the backend starts, below
        os.environ["XLA_FLAGS"] = with_dump(os.environ.get("XLA_FLAGS", ""), args.hlo)
    from moe_eplb_jax import models, transport

    kind, peak, hbm = card()
    config = models.preset(args.preset, dtype="bfloat16")
    mesh = transport.ep_mesh(1)
    rng = np.random.default_rng(0)
    phases = [p for p in args.phases.split(",") if p]
    results = {"device": kind, "preset": args.preset}
    print(f"{kind}, preset {args.preset}: {forward_flops_per_token(config, args.seq / 2) / 1e9:.3f} GFLOP/token fwd")
    for phase in phases:
        start = time.perf_counter()
        if phase == "train":
            results[phase] = phase_train(args, config, mesh, rng, peak)
        elif phase == "prefill":
            results[phase] = phase_prefill(args, config, mesh, rng, peak)
        elif phase == "decode":
            results[phase] = phase_decode(args, config, mesh, rng, hbm)
        elif phase == "gmm":
            results[phase] = phase_gmm(args, rng, peak, hbm)
        else:
            raise SystemExit(f"unknown phase {phase!r}")
        if args.hlo:
            name_kernels(results[phase], args.hlo)
        print(f"== {phase} ({time.perf_counter() - start:.0f} s)")
        print(json.dumps(results[phase], indent=1, default=lambda v: round(v, 4) if isinstance(v, float) else v))
        sys.stdout.flush()
        if args.json:  # after every phase: a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

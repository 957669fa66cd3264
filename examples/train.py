"""Train an MoE language model with optax and EPLB on a skew-routed token stream; checkpoint and resume.

    python examples/train.py                                    # CPU, 8 simulated devices
    python examples/train.py --devices 0 --ranks 8              # real GPUs
    python examples/train.py --checkpoint-dir ckpt --steps 40   # Orbax checkpoints every --checkpoint-every steps
    python examples/train.py --checkpoint-dir ckpt --steps 80 --resume   # continue from the latest one
    python examples/train.py --scale-to 4 --scale-at 30         # the EP group shrinks to 4 ranks at step 30

The model is ``moe_eplb_jax.models`` at a preset's shape (default ``tiny``). The routing is skewed two ways:
the tokens follow a Zipf distribution (a few ids dominate, and each row's second half repeats its first, which
the model learns: the loss falls), and every router carries a fixed Zipf bias (expert e: -skew * log(1 + e)),
held out of the optimizer like DeepSeek-V3's score-correction bias, so the skew lasts through training. The
controller rearranges every --step-interval steps (the first at a quarter of it); the optimizer state (AdamW
moments) moves with the expert weights. ``--eplb-config`` sets the rest (``{"use_async": true}``: one layer
moved per step). A checkpoint is one Orbax ``CheckpointManager`` step holding three items -- the model, the
optimizer state and the controller's state (placement, load window, counters) -- saved and restored
together; batch ``n`` is drawn from seed (--seed, n), so a resumed run repeats the steps of one that never
stopped. ``--scale-to G`` moves the run to the first ``G`` devices after step ``--scale-at`` (elastic EP:
``controller.resize``): the placement is solved for ``G`` ranks from the load window, keeping what each staying
device holds, and the experts, AdamW moments, the rest of the model, the routing tables and the window follow; the
loss of a held-out batch is printed before and after the move (the same up to XLA's rounding of the other batch
split), and training goes on on the new mesh.

Several hosts: one copy per host with --coordinator HOST:PORT --num-processes N --process-id I.
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
    dense_bf16_peak,
    eplb_fields,
    nonnegative_float,
    nonnegative_int,
    output_dir_problem,
    parse_eplb_fields,
    positive_float,
    positive_int,
    prepare_devices,
)


def parse_args(argv=None):
    from moe_eplb_jax.models import PRESETS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model shape")
    p.add_argument("--steps", type=positive_int, default=60, help="train until this step (counting resumed ones)")
    p.add_argument(
        "--redundant",
        type=nonnegative_int,
        default=argparse.SUPPRESS,
        help="redundant expert slots R (P = E + R) (default: 8)",
    )
    p.add_argument("--batch", type=positive_int, default=16, help="sequences per step (divisible by the ranks)")
    p.add_argument("--seq", type=positive_int, default=32, help="tokens per sequence")
    p.add_argument("--lr", type=positive_float, default=3e-3, help="AdamW learning rate")
    p.add_argument(
        "--step-interval",
        type=positive_int,
        default=argparse.SUPPRESS,
        help="steps between rearrangements, and the load window's length (default: 40)",
    )
    p.add_argument(
        "--capacity-factor",
        type=nonnegative_float,
        default=1.25,
        help="token exchange in rounds of this factor times the balanced share (0: one worst-case all_to_all)",
    )
    p.add_argument("--skew", type=nonnegative_float, default=1.5, help="Zipf skew of the fixed router bias")
    p.add_argument("--log-every", type=positive_int, default=10, help="steps between loss lines")
    p.add_argument("--checkpoint-dir", help="save checkpoints here (created if missing)")
    p.add_argument("--checkpoint-every", type=positive_int, default=20, help="steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="weights and data")
    p.add_argument("--scale-to", type=positive_int, help="move the run to this many EP ranks at --scale-at")
    p.add_argument("--scale-at", type=positive_int, help="the step after which --scale-to moves (default: half-way)")
    add_routing_arg(p)
    add_eplb_config_arg(p, "--redundant, --routing and --step-interval")
    add_runtime_args(p)
    args = p.parse_args(argv)
    config = PRESETS[args.preset]
    ranks = check_runtime_args(p, args)
    args.eplb = parse_eplb_fields(p, lambda: eplb_settings(args), ranks)
    args.redundant = args.eplb["num_redundant_experts"]
    check_divides(p, ranks, _divided(args))
    if args.seq + 1 > config.max_seq_len:
        p.error(f"--seq {args.seq} + 1 exceeds the {args.preset} preset's max_seq_len {config.max_seq_len}")
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")
    if args.resume and not os.path.isdir(args.checkpoint_dir):
        p.error(f"--checkpoint-dir {args.checkpoint_dir}: no such directory to resume from")
    problem = args.checkpoint_dir and output_dir_problem(args.checkpoint_dir)
    if problem:
        p.error(f"--checkpoint-dir {args.checkpoint_dir}: {problem}")
    if args.capacity_factor == 0:
        args.capacity_factor = None
    if args.scale_at is not None and args.scale_to is None:
        p.error("--scale-at needs --scale-to")
    if args.scale_to is not None:
        check_divides(p, args.scale_to, {"--batch": args.batch})
        if args.devices and args.scale_to > args.devices * args.num_processes:
            p.error(f"--scale-to {args.scale_to} exceeds the {args.devices * args.num_processes} simulated devices")
        args.scale_at = args.scale_at if args.scale_at is not None else max(1, args.steps // 2)
    return p, args


def eplb_settings(args) -> dict:
    """The run's EplbConfig fields: defaults, then --eplb-config, then --redundant / --step-interval if given."""
    interval = getattr(args, "step_interval", None)
    fields = eplb_fields(
        args.eplb_config,
        defaults={"num_redundant_experts": 8, "step_interval": 40},
        flags={
            "num_redundant_experts": getattr(args, "redundant", None),
            "routing": args.routing,
            "step_interval": interval,
            "window_size": interval,
        },
    )
    fields.setdefault("window_size", fields["step_interval"])  # a window as long as the interval unless named
    return fields


def _divided(args) -> dict[str, int]:
    """The sizes the EP ranks must divide."""
    from moe_eplb_jax.models import PRESETS

    return {"--batch": args.batch, "P = E + --redundant": PRESETS[args.preset].num_experts + args.redundant}


def on_mesh(x, mesh):
    """``x`` as is when it is already on ``mesh``, else replicated on it (from its host bytes)."""
    import numpy as np
    from jax.sharding import NamedSharding

    from moe_eplb_jax.transport import put_host

    if isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh:
        return x
    return put_host(np.asarray(x), mesh)


def restore(parser, args, manager, model, optimizer, controller) -> int:
    """Restores the latest checkpoint's model, optimizer and EPLB items in place; returns its step.

    ``parser.error`` (nothing changed) when there is none, a damaged one, or one of another model shape or EPLB
    config.
    """
    from flax import nnx

    from moe_eplb_jax.control.checkpoint import restore_step

    # The EPLB item comes back as saved and restore_item checks every field.
    try:
        start, restored = restore_step(manager, {"model": nnx.state(model), "optimizer": nnx.state(optimizer)})
        controller.restore_item(restored["eplb"])  # nothing changes unless every field passes
    except ValueError as e:
        parser.error(f"--resume: {e}")
    nnx.update(model, restored["model"])
    nnx.update(optimizer, restored["optimizer"])
    return start


def save(manager, step, model, optimizer, controller):
    """One checkpoint step holding the model, the optimizer state and the controller's state."""
    import orbax.checkpoint as ocp
    from flax import nnx

    items = ocp.args.Composite(
        model=ocp.args.StandardSave(nnx.state(model)),
        optimizer=ocp.args.StandardSave(nnx.state(optimizer)),
        eplb=ocp.args.StandardSave(controller.checkpoint_item()),
    )
    manager.save(step, args=items)  # one step directory, renamed into place when every item is written
    manager.wait_until_finished()


def make_train_step(model, optimizer, trainable, rt):
    """The jitted AdamW step ``step(tokens) -> loss`` on ``trainable`` (the router biases held out), ``model`` and
    ``optimizer`` bound: their variables are flattened once, not traversed on every call as ``nnx.jit`` does
    (host work on every step), and read afresh at each call, so a rearrangement's moved weights and
    optimizer state are what the next step sees. The loss is replicated on ``rt``'s mesh."""
    import jax
    from flax import nnx

    from moe_eplb_jax.models import cross_entropy

    def train_step(model, optimizer, tokens):
        def loss_fn(model):
            logits = model(tokens[:, :-1])
            return cross_entropy(logits, tokens[:, 1:]).mean()

        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, trainable))(model)
        optimizer.update(model, grads)
        return jax.lax.with_sharding_constraint(loss, rt.replicated)

    return nnx.jit_partial(train_step, model, optimizer, graph=False)


def print_summary(args, config, controller, start, losses, step_seconds):
    import numpy as np

    print("\n=== summary ===")
    first, last = float(losses[0][1]), float(losses[-1][1])
    print(f"steps {start + 1}..{args.steps}: loss {first:.4f} -> {last:.4f}")
    print(f"rearrangements: {controller.num_rearrangements}; final loss {last:.6f}")
    if step_seconds:  # per step between two printed losses, the first step (it compiles) left out
        seconds = float(np.median(step_seconds))
        tokens_per_s = args.batch * args.seq / seconds
        flops = 3 * config.flops_per_token((args.seq + 1) / 2) * tokens_per_s
        peak = dense_bf16_peak()
        mfu = f", MFU {flops / peak:.1%} of {peak / 1e12:.0f} TFLOP/s dense bf16" if peak else ""
        print(f"throughput: {tokens_per_s:,.0f} tokens/s, {seconds * 1e3:.1f} ms/step, {flops / 1e12:.2f} TFLOP/s{mfu}")


def scale(args, rt, model, controller, vocab_size: int, step: int) -> None:
    """Elastic EP: the run moves to the first --scale-to devices; prints the held-out loss before and after."""
    import jax
    import numpy as np
    from flax import nnx

    from moe_eplb_jax.models import cross_entropy, zipf_tokens

    @nnx.jit
    def held_out_loss(model, tokens):
        logits = model(tokens[:, :-1], record=False)
        loss = cross_entropy(logits, tokens[:, 1:]).mean()
        return jax.lax.with_sharding_constraint(loss, rt.replicated)

    held_out = zipf_tokens(np.random.default_rng([args.seed, 0]), args.batch, args.seq + 1, vocab_size)
    before = float(held_out_loss(model, rt.global_batch(held_out)))
    report = controller.resize(rt.resize(args.scale_to))
    after = float(held_out_loss(model, rt.global_batch(held_out)))
    if jax.process_index() == 0:
        print(
            f"step {step}: resized {report['num_ranks'][0]} -> {report['num_ranks'][1]} EP ranks "
            f"(P = {report['num_physical'][0]} -> {report['num_physical'][1]}): {report['slots_kept']} slots "
            f"kept, {report['rows_moved']} rows moved in {report['move_seconds']:.2f} s; held-out loss "
            f"{before:.6f} -> {after:.6f}",
            flush=True,
        )


def main(argv=None):
    prepare_devices(argv)  # before anything imports jax
    parser, args = parse_args(argv)
    rt = Runtime(args, parser)
    check_divides(parser, rt.ranks, _divided(args))  # the EP size is known now even with --devices 0
    import jax
    import numpy as np
    import optax
    import orbax.checkpoint as ocp
    from flax import nnx

    from moe_eplb_jax.flax import EplbController
    from moe_eplb_jax.models import MoECausalLM, preset, skew_routers, zipf_tokens
    from moe_eplb_jax.moe import DispatchConfig

    ranks, mesh = rt.ranks, rt.mesh
    try:
        config = preset(args.preset)
        eplb = build_eplb_config(
            args.eplb, num_gpus=ranks, window=(config.num_moe_layers, config.num_experts + args.redundant)
        )
    except ValueError as e:
        parser.error(str(e))
    say = print if jax.process_index() == 0 else lambda *a, **k: None
    say(f"building the {args.preset} model and its optimizer on {ranks} EP ranks ...", flush=True)
    model = MoECausalLM(
        config,
        mesh=mesh,
        num_redundant_experts=args.redundant,
        routing=eplb.routing,
        dispatch=DispatchConfig(capacity_factor=args.capacity_factor),
        rngs=nnx.Rngs(args.seed),
    )
    skew_routers(model, args.skew)
    trainable = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("router_bias")))  # the skew stays fixed
    optimizer = nnx.Optimizer(model, optax.adamw(args.lr), wrt=trainable)
    # optax makes its step counters on one device; put them on the mesh like everything else, so a checkpoint
    # restores them where the jitted step expects them.
    nnx.update(optimizer, jax.tree.map(lambda x: on_mesh(x, mesh), nnx.state(optimizer)))
    # One EP rank holds every expert: no placement changes its load, so the placement is held.
    controller = EplbController(model, mesh, eplb, optimizer=optimizer, rebalance=ranks > 1)
    main_process = jax.process_index() == 0

    manager = None
    start = 0
    if args.checkpoint_dir:
        folder = os.path.abspath(args.checkpoint_dir)
        manager = ocp.CheckpointManager(folder, options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
        if args.resume:
            start = restore(parser, args, manager, model, optimizer, controller)
            if main_process:
                print(f"resumed from step {start} ({controller.num_rearrangements} rearrangements so far)")
        if start >= args.steps:
            parser.error(f"--steps {args.steps}: the checkpoint is already at step {start}")
    if controller.rebalance:  # compiles the mover now: no rearrangement compiles mid-run
        say("controller.warmup(): compiling the expert mover and the routing tables' update ...", flush=True)
        warmup = controller.warmup()
        say(f"controller.warmup(): {warmup['moves']} moves rehearsed in {warmup['seconds']:.1f} s", flush=True)
    elif main_process:
        print("EP = 1: one rank holds every expert, so there is nothing to balance; the placement is held")

    train_step = make_train_step(model, optimizer, trainable, rt)

    # The host reads a loss only where it prints one: in between, it dispatches step after step while the GPU
    # runs, so its own work per step (the batch, the dispatch, controller.step()) is hidden. Throughput is
    # timed between two printed losses.
    losses, step_seconds, mark = [], [], None
    say(f"step {start + 1}: compiling the train step (the first step; the others reuse it) ...", flush=True)
    for step in range(start + 1, args.steps + 1):
        rng = np.random.default_rng([args.seed, step])  # batch n is the same whether or not the run resumed
        tokens = rt.global_batch(zipf_tokens(rng, args.batch, args.seq + 1, config.vocab_size))
        loss = train_step(tokens)
        losses.append((step, loss))
        report = controller.step()
        if main_process and report and report.get("rearranged"):
            print(
                f"step {step}: rearranged, balancedness {report['balancedness_before']:.3f} -> "
                f"{report['balancedness_after']:.3f} (predicted), {report['slots_moved']} slots moved, "
                f"{report['bytes_moved'] / 1e6:.2f} MB in {report['move_seconds'] * 1e3:.1f} ms",
                flush=True,
            )
        if step % args.log_every == 0 or step in (start + 1, args.steps):
            value = float(loss)  # waits for this step
            now = time.perf_counter()
            if mark is not None:
                step_seconds.append((now - mark[0]) / (step - mark[1]))
            mark = (now, step)
            if main_process:
                print(f"step {step}: loss {value:.4f}", flush=True)
        if args.scale_to is not None and step == args.scale_at:
            scale(args, rt, model, controller, config.vocab_size, step)
            train_step = make_train_step(model, optimizer, trainable, rt)  # bound to the resized variables
        if manager is not None and (step % args.checkpoint_every == 0 or step == args.steps):
            save(manager, step, model, optimizer, controller)
            if main_process:
                print(f"step {step}: checkpoint saved to {manager.directory}", flush=True)
    if main_process:
        print_summary(args, config, controller, start, losses, step_seconds)


if __name__ == "__main__":
    main()

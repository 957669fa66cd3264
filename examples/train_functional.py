"""Train a MoE model written without NNX (plain params pytree + optax) with EPLB's functional API.

    python examples/train_functional.py                                   # CPU, 8 simulated devices
    python examples/train_functional.py --eplb-config '{"use_async": true}'   # one layer moved per step
    python examples/train_functional.py --eplb-config eplb.json           # or the config in a file
    python examples/train_functional.py --devices 0 --ranks 8             # real GPUs

The jitted train step records each layer's load into the ``BalanceState``
(``Balancer.record_step``); outside it the loop ticks a ``Schedule`` (the
step counters on the host, so asking whether a rearrangement is due reads
no device) and rearranges -- the expert weights and their Adam moments move together,
atomically. ``--eplb-config`` takes JSON (a file or the object itself) with
vLLM's field names (``window_size``, ``step_interval``,
``num_redundant_experts``, ``log_balancedness``, ``use_async``, ``policy``)
or this library's; ``--redundant`` overrides it.
"""

from __future__ import annotations

import argparse

from _runtime import (
    HelpFormatter,
    Runtime,
    add_eplb_config_arg,
    add_runtime_args,
    build_eplb_config,
    check_divides,
    check_runtime_args,
    eplb_fields,
    nonnegative_int,
    parse_eplb_fields,
    positive_float,
    positive_int,
    prepare_devices,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--steps", type=positive_int, default=40, help="training steps")
    p.add_argument("--layers", type=positive_int, default=2, help="MoE layers")
    p.add_argument("--experts", type=positive_int, default=16, help="logical experts E")
    p.add_argument(
        "--redundant",
        type=nonnegative_int,
        default=argparse.SUPPRESS,
        help="redundant expert slots R (P = E + R) (default: 8)",
    )
    p.add_argument("--dim", type=positive_int, default=32, help="model width (and expert hidden width)")
    p.add_argument("--batch", type=positive_int, default=16, help="sequences per step (divisible by the ranks)")
    p.add_argument("--seq", type=positive_int, default=16, help="tokens per sequence")
    p.add_argument("--lr", type=positive_float, default=3e-3, help="Adam learning rate")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="weights and data")
    add_eplb_config_arg(p, "--redundant")
    add_runtime_args(p)
    args = p.parse_args(argv)
    ranks = check_runtime_args(p, args)
    fields = parse_eplb_fields(
        p, lambda: eplb_settings(args.eplb_config, redundant=getattr(args, "redundant", None)), ranks
    )
    args.redundant = fields["num_redundant_experts"]
    check_divides(p, ranks, {"--batch": args.batch, "P = E + --redundant": args.experts + args.redundant})
    return p, args


def eplb_settings(text: str | None, *, redundant: int | None) -> dict:
    """The run's EplbConfig fields: this example's defaults, then ``text`` (``--eplb-config``), then ``redundant``."""
    return eplb_fields(
        text,
        defaults={"num_redundant_experts": 8, "window_size": 16, "step_interval": 16},
        flags={"num_redundant_experts": redundant},
    )


def eplb_config(text: str | None, *, redundant: int | None, ranks: int, window: tuple[int, int] | None = None):
    """The run's ``EplbConfig`` for ``ranks`` EP ranks; ``redundant`` (``--redundant``; ``None``: not given) wins.

    ``window``: ``(L, P)``, checked to fit one device. ``ValueError`` naming the flag or field.
    """
    return build_eplb_config(eplb_settings(text, redundant=redundant), num_gpus=ranks, window=window)


def train(args, rt, *, log=print):
    """Runs the training loop; returns ``(losses, reports, balancer, params, balance)``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from _functional_lm import EXPERT_PATTERN, init_params, loss_and_loads, synthetic_batch

    from moe_eplb_jax import metrics
    from moe_eplb_jax.control import Balancer, ExpertLayout

    mesh = rt.mesh
    config = eplb_config(args.eplb_config, redundant=args.redundant, ranks=rt.ranks)
    params = init_params(
        args.seed,
        mesh=mesh,
        dim=args.dim,
        hidden=args.dim,
        num_layers=args.layers,
        num_experts=args.experts,
        num_physical=args.experts + args.redundant,
    )
    tx = optax.adam(args.lr)
    opt_state = tx.init(params)
    balancer = Balancer(config, mesh, ExpertLayout.match(params, EXPERT_PATTERN))
    balance = balancer.init(params)
    log("balancer.warmup(): compiling the expert mover and the routing tables' update ...")
    warmup = balancer.warmup(params, opt_state, balance)  # compiles the mover now: no rearrangement compiles mid-run
    log(f"balancer.warmup(): {warmup['moves']} moves rehearsed in {warmup['seconds']:.1f} s")
    schedule = balancer.schedule(balance)  # the step counters on the host: "due?" reads no device

    @jax.jit
    def train_step(params, opt_state, balance, tokens, moving):
        grad_fn = jax.value_and_grad(lambda p: loss_and_loads(p, balance.tables, tokens, mesh=mesh), has_aux=True)
        (loss, loads), grads = grad_fn(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        # Loads of steps while layers change placement are not counted (they would be charged to the wrong experts).
        balance = balancer.record_step(balance, loads, dummy=moving)
        return optax.apply_updates(params, updates), opt_state, balance, loss

    rng = np.random.default_rng(args.seed)
    losses, reports, move = [], [], None
    log("step 1: compiling the train step (the first step; the others reuse it) ...")
    for step in range(args.steps):
        tokens = rt.global_batch(synthetic_batch(rng, args.batch, args.seq + 1, 64))
        params, opt_state, balance, loss = train_step(params, opt_state, balance, tokens, jnp.bool_(move is not None))
        schedule.tick()
        losses.append(float(loss))
        if config.log_interval and (step + 1) % config.log_interval == 0:
            ranks = metrics.rank_load(balancer.window_slot_load(balance), rt.ranks)
            log(f"step {step + 1}: loss {losses[-1]:.3f}, window balancedness {metrics.balancedness(ranks):.3f}")
        report = None
        # One EP rank holds every expert: no placement changes its load, so nothing is rearranged.
        if move is None and rt.ranks > 1 and schedule.due:
            move = balancer.decide(balance)  # the window's loads -> the policy's placement (host, ~ms)
        if move is not None:  # all layers now, or one layer / byte budget per step with config.overlap
            params, opt_state, balance, move, report = balancer.advance(params, opt_state, balance, move)
            if report is not None:
                move = None
                schedule.rearranged()
                reports.append((step + 1, report))
                log(
                    f"step {step + 1}: rearranged, balancedness {report['balancedness_before']:.3f} -> "
                    f"{report['balancedness_after']:.3f} (predicted), {report['slots_moved']} slots, "
                    f"{report['bytes_moved'] / 1e6:.2f} MB in {report['move_seconds'] * 1e3:.1f} ms "
                    f"({report['gb_per_s']:.2f} GB/s)"
                )
    return losses, reports, balancer, params, balance


def main(argv=None):
    prepare_devices(argv)  # before anything imports jax
    parser, args = parse_args(argv)
    rt = Runtime(args, parser)
    import jax

    try:
        window = (args.layers, args.experts + args.redundant)
        eplb_config(args.eplb_config, redundant=args.redundant, ranks=rt.ranks, window=window)  # devices are up now
    except ValueError as e:
        parser.error(str(e))
    check_divides(parser, rt.ranks, {"--batch": args.batch, "P = E + --redundant": args.experts + args.redundant})

    main_process = jax.process_index() == 0
    losses, reports, *_ = train(args, rt, log=print if main_process else lambda *_: None)
    if main_process:
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps; {len(reports)} rearrangements")


if __name__ == "__main__":
    main()

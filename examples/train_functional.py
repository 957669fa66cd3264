"""Train a MoE model written without NNX (plain params pytree + optax) with EPLB's functional API.

    python examples/train_functional.py                                   # CPU, 8 simulated devices
    python examples/train_functional.py --eplb-config '{"use_async": true}'   # one layer moved per step
    python examples/train_functional.py --devices 0 --ranks 8             # real GPUs

The jitted train step records each layer's load into the ``BalanceState``
(``Balancer.record_step``); outside it the loop asks ``is_due`` and
rearranges -- the expert weights and their Adam moments move together,
atomically. ``--eplb-config`` takes JSON (a string or a file) with vLLM's
field names (``window_size``, ``step_interval``, ``num_redundant_experts``,
``log_balancedness``, ``use_async``, ``policy``) or this library's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _runtime import Runtime, add_runtime_args


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--redundant", type=int, default=8)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eplb-config", default=None, help="EplbConfig as JSON, or a JSON file (vLLM's names work)")
    p.add_argument("--seed", type=int, default=0)
    add_runtime_args(p)
    return p.parse_args(argv)


def eplb_config(text: str | None, *, redundant: int, ranks: int):
    """The run's ``EplbConfig``: ``--eplb-config`` (JSON text or a file) over this example's defaults."""
    from moe_eplb_jax import EplbConfig

    defaults = {"num_redundant_experts": redundant, "window_size": 16, "step_interval": 16, "num_gpus": ranks}
    if not text:
        return EplbConfig.from_dict(defaults)
    if not text.lstrip().startswith("{"):
        with open(text) as f:
            text = f.read()
    EplbConfig.from_json(text)  # checks what the user wrote: unknown or repeated keys, types, policy names
    return EplbConfig.from_dict({**defaults, **json.loads(text)})


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
    balancer.warmup(params, opt_state, balance)  # compiles the mover now: no rearrangement compiles mid-run

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
    for step in range(args.steps):
        tokens = rt.global_batch(synthetic_batch(rng, args.batch, args.seq + 1, 64))
        params, opt_state, balance, loss = train_step(params, opt_state, balance, tokens, jnp.bool_(move is not None))
        losses.append(float(loss))
        if config.log_interval and (step + 1) % config.log_interval == 0:
            ranks = metrics.rank_load(balancer.window_slot_load(balance), rt.ranks)
            log(f"step {step + 1}: loss {losses[-1]:.3f}, window balancedness {metrics.balancedness(ranks):.3f}")
        report = None
        if move is None and balancer.is_due(balance):
            move = balancer.decide(balance)  # the window's loads -> the policy's placement (host, ~ms)
        if move is not None:  # all layers now, or one layer / byte budget per step with config.overlap
            params, opt_state, balance, move, report = balancer.advance(params, opt_state, balance, move)
            if report is not None:
                move = None
                reports.append((step + 1, report))
                log(
                    f"step {step + 1}: rearranged, balancedness {report['balancedness_before']:.3f} -> "
                    f"{report['balancedness_after']:.3f} (predicted), {report['slots_moved']} slots, "
                    f"{report['bytes_moved'] / 1e6:.2f} MB in {report['move_seconds'] * 1e3:.1f} ms "
                    f"({report['gb_per_s']:.2f} GB/s)"
                )
    return losses, reports, balancer, params, balance


def main(argv=None):
    args = parse_args(argv)
    rt = Runtime(args)  # sets the device flags, then imports jax
    import jax

    main_process = jax.process_index() == 0
    losses, reports, *_ = train(args, rt, log=print if main_process else lambda *_: None)
    if main_process:
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps; {len(reports)} rearrangements")


if __name__ == "__main__":
    main()

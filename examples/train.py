"""Train a small MoE language model with optax and EPLB on synthetic, skew-routed data.

    python examples/train.py                         # CPU, 8 simulated devices
    python examples/train.py --devices 0 --ranks 8   # real GPUs

Prints loss and balancedness as it goes; the optimizer state (Adam moments)
moves with the expert weights at every rearrangement. Several hosts: one copy
per host with --coordinator HOST:PORT --num-processes N --process-id I.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _runtime import Runtime, add_runtime_args


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--redundant", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--step-interval", type=int, default=40, help="steps between rearrangements (first at 1/4)")
    p.add_argument(
        "--capacity-factor",
        type=float,
        default=1.25,
        help="token exchange in rounds of this factor times the balanced share (0: one worst-case all_to_all)",
    )
    p.add_argument("--skew", type=float, default=1.5)
    p.add_argument("--seed", type=int, default=0)
    add_runtime_args(p)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    rt = Runtime(args)  # sets the device flags, then imports jax
    import jax
    import numpy as np
    import optax
    from _model import MoELM, synthetic_batch
    from flax import nnx
    from tqdm import tqdm

    from moe_eplb_jax import EplbConfig
    from moe_eplb_jax.flax import EplbController

    ranks, mesh, replicated, global_batch = rt.ranks, rt.mesh, rt.replicated, rt.global_batch
    model = MoELM(
        vocab=256,
        dim=args.dim,
        heads=4,
        hidden=args.dim,
        num_layers=args.layers,
        num_experts=args.experts,
        top_k=args.top_k,
        num_physical=args.experts + args.redundant,
        mesh=mesh,
        skew=args.skew,
        capacity_factor=args.capacity_factor or None,
        rngs=nnx.Rngs(args.seed),
    )
    optimizer = nnx.Optimizer(model, optax.adamw(args.lr), wrt=nnx.Param)
    config = EplbConfig(
        num_redundant_experts=args.redundant,
        window_size=args.step_interval,
        step_interval=args.step_interval,
        num_gpus=ranks,
        log_interval=10,
    )
    controller = EplbController(model, mesh, config, optimizer=optimizer)

    @nnx.jit
    def train_step(model, optimizer, tokens):
        def loss_fn(model):
            logits = model(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return jax.lax.with_sharding_constraint(loss, replicated)

    rng = np.random.default_rng(args.seed)
    main_process = jax.process_index() == 0
    history = []
    bar = tqdm(range(args.steps), disable=not main_process)
    for step in bar:
        loss = train_step(model, optimizer, global_batch(synthetic_batch(rng, args.batch, args.seq + 1, 256)))
        report = controller.step()
        if report:
            history.append((step + 1, float(loss), report))
            bar.set_postfix(loss=f"{float(loss):.3f}", balancedness=f"{report.get('balancedness', 0):.3f}")
            if report.get("rearranged") and main_process:
                tqdm.write(
                    f"step {step + 1}: rearranged, balancedness {report['balancedness_before']:.3f} -> "
                    f"{report['balancedness_after']:.3f} (predicted), {report['slots_moved']} slots moved"
                )
    if main_process:
        print("\n=== summary ===")
        print("step    loss  balancedness")
        for step, loss, report in history:
            if "balancedness" in report:
                print(f"{step:4d}  {loss:6.3f}  {report['balancedness']:.3f}")
        print(f"rearrangements: {controller.num_rearrangements}; final loss {float(loss):.3f}")


if __name__ == "__main__":
    main()

"""Places a synthetic, skewed MoE model and prints how balanced it is before and after.

    python examples/placement_demo.py [--layers 58 --experts 256 --redundant 32 --gpus 32 --nodes 4 --groups 8]

Runs on the CPU in a second or two; no devices needed.
"""

import argparse
import time

import numpy as np

from moe_eplb_jax import Placement, metrics, policy


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=58)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--redundant", type=int, default=32)
    ap.add_argument("--gpus", type=int, default=32)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--sigma", type=float, default=1.0, help="log-normal skew of expert loads")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    load = rng.lognormal(0.0, args.sigma, size=(args.layers, args.experts))
    num_physical = args.experts + args.redundant
    before = Placement.linear(args.layers, args.experts, num_physical, num_ranks=args.gpus)
    rank_before = metrics.rank_load_from_logical(load, before.phy2log, args.gpus)
    print(
        f"{args.layers} layers, {args.experts} experts, {num_physical} slots on {args.gpus} GPUs "
        f"({args.nodes} nodes, {args.groups} groups), log-normal loads sigma={args.sigma}"
    )
    print(f"{'placement':<22}{'balancedness':>14}{'max rank imbalance':>20}{'time':>10}")
    print(
        f"{'linear (no EPLB)':<22}{metrics.balancedness(rank_before):>14.4f}"
        f"{metrics.rank_imbalance(rank_before).max():>20.3f}{'':>10}"
    )
    for name in policy.available():
        if name.startswith("test"):
            continue
        fn = policy.get(name)
        t0 = time.perf_counter()
        phy2log, _, _ = fn(load, num_physical, args.groups, args.nodes, args.gpus)
        ms = (time.perf_counter() - t0) * 1e3
        rank_after = metrics.rank_load_from_logical(load, phy2log, args.gpus)
        print(
            f"{name:<22}{metrics.balancedness(rank_after):>14.4f}"
            f"{metrics.rank_imbalance(rank_after).max():>20.3f}{ms:>8.1f}ms"
        )


if __name__ == "__main__":
    main()

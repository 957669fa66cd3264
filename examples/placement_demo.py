"""Places a synthetic, skewed MoE model and prints how balanced it is before and after.

    python examples/placement_demo.py [--layers 58 --experts 256 --redundant 32 --gpus 32 --nodes 4 --groups 8]

Runs on the CPU in a second or two; no devices needed.
"""

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _runtime import HelpFormatter, nonnegative_float, nonnegative_int, positive_int

from moe_eplb_jax import Placement, metrics, policy


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--layers", type=positive_int, default=58, help="MoE layers")
    ap.add_argument("--experts", type=positive_int, default=256, help="logical experts E")
    ap.add_argument("--redundant", type=nonnegative_int, default=32, help="redundant slots R")
    ap.add_argument("--gpus", type=positive_int, default=32, help="EP ranks (dividing E + R)")
    ap.add_argument("--nodes", type=positive_int, default=4, help="hosts (dividing --gpus)")
    ap.add_argument("--groups", type=positive_int, default=8, help="expert groups (dividing E)")
    ap.add_argument("--sigma", type=nonnegative_float, default=1.0, help="log-normal skew of expert loads")
    ap.add_argument("--seed", type=nonnegative_int, default=0, help="loads")
    args = ap.parse_args(argv)
    num_physical = args.experts + args.redundant
    for flag, size, divisor in (
        ("E + --redundant", num_physical, args.gpus),
        ("--gpus", args.gpus, args.nodes),
        ("--experts", args.experts, args.groups),
    ):
        if size % divisor:
            ap.error(f"{flag} = {size} is not divisible by {divisor}")

    rng = np.random.default_rng(args.seed)
    load = rng.lognormal(0.0, args.sigma, size=(args.layers, args.experts))
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

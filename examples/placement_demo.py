"""Places a synthetic, skewed MoE model and prints how balanced it is before and after.

    python examples/placement_demo.py [--layers 58 --experts 256 --redundant 32 --gpus 32 --nodes 4 --groups 8]
    python examples/placement_demo.py --eplb-config eplb.json   # topology and policy from an EplbConfig

Runs on the CPU in a second or two; no devices needed. Every registered policy is compared, or only the one
``--eplb-config`` names.
"""

import argparse
import time

import numpy as np
from _runtime import (
    HelpFormatter,
    add_eplb_config_arg,
    build_eplb_config,
    eplb_fields,
    nonnegative_float,
    nonnegative_int,
    positive_int,
)

from moe_eplb_jax import Placement, metrics, policy

# Flag -> (EplbConfig field, default): a flag given overrides --eplb-config, which overrides the default.
TOPOLOGY = {
    "redundant": ("num_redundant_experts", 32),
    "gpus": ("num_gpus", 32),
    "nodes": ("num_nodes", 4),
    "groups": ("num_groups", 8),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--layers", type=positive_int, default=58, help="MoE layers")
    ap.add_argument("--experts", type=positive_int, default=256, help="logical experts E")
    ap.add_argument(
        "--redundant", type=nonnegative_int, default=argparse.SUPPRESS, help="redundant slots R (default: 32)"
    )
    ap.add_argument(
        "--gpus", type=positive_int, default=argparse.SUPPRESS, help="EP ranks, dividing E + R (default: 32)"
    )
    ap.add_argument("--nodes", type=positive_int, default=argparse.SUPPRESS, help="hosts, dividing --gpus (default: 4)")
    ap.add_argument(
        "--groups", type=positive_int, default=argparse.SUPPRESS, help="expert groups, dividing E (default: 8)"
    )
    ap.add_argument("--sigma", type=nonnegative_float, default=1.0, help="log-normal skew of expert loads")
    ap.add_argument("--seed", type=nonnegative_int, default=0, help="loads")
    add_eplb_config_arg(ap, "--redundant, --gpus, --nodes and --groups")
    args = ap.parse_args(argv)
    try:
        fields = eplb_fields(
            args.eplb_config,
            defaults={field: default for field, default in TOPOLOGY.values()},
            flags={field: getattr(args, flag, None) for flag, (field, _) in TOPOLOGY.items()},
        )
        config = build_eplb_config(fields)
        num_physical = config.num_physical(args.experts)
    except ValueError as e:
        ap.error(str(e))
    policies = [config.policy] if "policy" in fields else [n for n in policy.available() if not n.startswith("test")]
    gpus, nodes, groups = config.num_gpus, config.num_nodes, config.num_groups

    rng = np.random.default_rng(args.seed)
    load = rng.lognormal(0.0, args.sigma, size=(args.layers, args.experts))
    before = Placement.linear(args.layers, args.experts, num_physical, num_ranks=gpus)
    rank_before = metrics.rank_load_from_logical(load, before.phy2log, gpus)
    print(
        f"{args.layers} layers, {args.experts} experts, {num_physical} slots on {gpus} GPUs "
        f"({nodes} nodes, {groups} groups), log-normal loads sigma={args.sigma}"
    )
    print(f"{'placement':<22}{'balancedness':>14}{'max rank imbalance':>20}{'time':>10}")
    print(
        f"{'linear (no EPLB)':<22}{metrics.balancedness(rank_before):>14.4f}"
        f"{metrics.rank_imbalance(rank_before).max():>20.3f}{'':>10}"
    )
    for name in policies:
        fn = policy.get(name)
        t0 = time.perf_counter()
        phy2log, _, _ = fn(load, num_physical, groups, nodes, gpus)
        ms = (time.perf_counter() - t0) * 1e3
        rank_after = metrics.rank_load_from_logical(load, phy2log, gpus)
        print(
            f"{name:<22}{metrics.balancedness(rank_after):>14.4f}"
            f"{metrics.rank_imbalance(rank_after).max():>20.3f}{ms:>8.1f}ms"
        )


if __name__ == "__main__":
    main()

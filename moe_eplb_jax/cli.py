"""The ``moe-eplb`` command-line tool.

Subcommands::

    moe-eplb generate  -o load.npz [--generator drift|zipf|lognormal] [sizes]  write a synthetic load file
    moe-eplb stats     load.npz --num-ranks G [--placement p.json]      per-layer statistics
    moe-eplb fit       load.npz --num-ranks G --num-physical P -o p.json [--policy deepseek]
    moe-eplb heatmap   load.npz --num-ranks G [--placement p.json] -o map.png   load before / after
    moe-eplb simulate  [--load load.npz | --generator ...] --num-ranks G --num-spare S [--plot sim.png]

Load files are described in :mod:`moe_eplb_jax.sim.loadfile`; placement files
in :mod:`moe_eplb_jax.placement`. "Before" is the home layout (expert ``e`` on
rank ``e // (E / G)``, no replicas); "after" is the given or fitted placement
with each expert's tokens split evenly over its replicas.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from moe_eplb_jax._files import pyplot

__all__ = ["main", "build_parser"]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-eplb", description="Expert-parallel load balancing tools.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="write a synthetic load file")
    gen.add_argument("-o", "--output", required=True, help="load file to write (.npz or .json)")
    _add_generator_args(gen)

    stats = sub.add_parser("stats", help="per-layer statistics of a load file")
    stats.add_argument("load", help="load file (.npz or .json)")
    stats.add_argument("--num-ranks", type=_positive, required=True, help="EP ranks G")
    stats.add_argument("--placement", help="placement file to evaluate (default: home layout only)")

    fit = sub.add_parser("fit", help="fit a placement to a load file")
    fit.add_argument("load", help="load file (.npz or .json)")
    fit.add_argument("--num-ranks", type=_positive, required=True, help="EP ranks G")
    fit.add_argument("--num-physical", type=_positive, required=True, help="physical slots P = E + redundant")
    fit.add_argument("--policy", default="deepseek", help="placement policy name (default: deepseek)")
    fit.add_argument("--num-groups", type=_positive, default=1)
    fit.add_argument("--num-nodes", type=_positive, default=1)
    fit.add_argument("-o", "--output", required=True, help="placement file to write (.json or .npz)")

    heat = sub.add_parser("heatmap", help="per-layer load heatmap PNG, before and after a placement")
    heat.add_argument("load", help="load file (.npz or .json)")
    heat.add_argument("--num-ranks", type=_positive, required=True, help="EP ranks G")
    heat.add_argument("--placement", help="placement for 'after' (default: fit with --policy)")
    heat.add_argument("--num-physical", type=_positive, help="slots P when fitting (default: E + G)")
    heat.add_argument("--policy", default="deepseek")
    heat.add_argument("-o", "--output", required=True, help="PNG file to write")

    sim = sub.add_parser("simulate", help="compare balancing policies on a load trace")
    sim.add_argument("--load", help="load file to replay (default: a synthetic trace)")
    _add_generator_args(sim)
    sim.add_argument("--num-spare", type=_non_negative, default=2, help="spare slots per rank S (default 2)")
    sim.add_argument(
        "--policies",
        default="none,deepseek,deepseek+lp,online",
        help="comma-separated: none, online, <policy>, <policy>+lp",
    )
    sim.add_argument("--step-interval", type=_positive, default=8, help="periodic refit interval (steps)")
    sim.add_argument("--window", type=_positive, default=8, help="periodic refit window (steps)")
    sim.add_argument("--expert-mb", type=float, default=44.0, help="bytes of one expert, in MB")
    sim.add_argument("--plot", help="PNG file for the imbalance plot")
    return parser


def _add_generator_args(p):
    p.add_argument("--generator", choices=("drift", "zipf", "lognormal"), default="drift")
    p.add_argument("--num-ranks", type=_positive, default=8, help="EP ranks G (default 8)")
    p.add_argument("--experts-per-rank", type=_positive, default=4, help="home experts per rank H (E = G * H)")
    p.add_argument("--num-layers", type=_positive, default=4)
    p.add_argument("--num-steps", type=_positive, default=32)
    p.add_argument("--tokens", type=_positive, default=8192, help="tokens per rank per step")
    p.add_argument("--top-k", type=_positive, default=8)
    p.add_argument("--imbalance", type=float, default=2.0, help="initial rank imbalance (zipf, drift)")
    p.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma")
    p.add_argument("--seed", type=int, default=0)


def _generate(args) -> np.ndarray:
    from moe_eplb_jax import sim

    num_experts = args.num_ranks * args.experts_per_rank
    tokens = args.tokens * args.num_ranks * args.top_k
    if args.generator == "drift":
        return sim.drifting_load(
            args.num_steps,
            args.num_layers,
            num_experts,
            args.num_ranks,
            imbalance=args.imbalance,
            tokens=tokens,
            seed=args.seed,
        )
    if args.generator == "zipf":
        steps = []
        for step in range(args.num_steps):
            steps.append(
                np.stack(
                    [
                        sim.zipf_counts(
                            args.num_ranks,
                            num_experts,
                            args.tokens,
                            args.top_k,
                            args.imbalance,
                            seed=args.seed + 1000 * layer + 7919 * step,
                        ).sum(0)
                        for layer in range(args.num_layers)
                    ]
                )
            )
        return np.stack(steps).astype(np.int64)
    return np.stack(
        [
            sim.lognormal_load(args.num_layers, num_experts, sigma=args.sigma, tokens=tokens, seed=args.seed + step)
            for step in range(args.num_steps)
        ]
    )


def _rank_loads(load_le: np.ndarray, phy2log: np.ndarray, num_ranks: int) -> np.ndarray:
    from moe_eplb_jax.metrics import rank_load_from_logical

    return rank_load_from_logical(load_le, phy2log, num_ranks)


def _home_phy2log(num_layers: int, num_logical: int) -> np.ndarray:
    return np.tile(np.arange(num_logical), (num_layers, 1))


def _read_placement(path, trace, num_ranks):
    from moe_eplb_jax.placement import Placement

    placement = Placement.load(path, num_ranks=num_ranks)
    if (placement.num_layers, placement.num_logical) != (trace.num_layers, trace.num_logical):
        raise ValueError(
            f"{path}: placement is for L={placement.num_layers}, E={placement.num_logical}; the load "
            f"file has L={trace.num_layers}, E={trace.num_logical}"
        )
    return placement


def _check_ranks(trace, num_ranks):
    if trace.num_logical % num_ranks:
        raise ValueError(f"E = {trace.num_logical} experts are not divisible by --num-ranks {num_ranks}")


def _stats_table(load_le, num_ranks, phy2log=None) -> str:
    from moe_eplb_jax.metrics import balancedness, rank_imbalance

    before = _rank_loads(load_le, _home_phy2log(*load_le.shape), num_ranks)
    head = f"{'layer':>5} {'tokens':>12} {'hot expert':>10} {'hot share':>9} {'imb before':>10}"
    after = None
    if phy2log is not None:
        after = _rank_loads(load_le, phy2log, num_ranks)
        head += f" {'imb after':>9}"
    rows = [head, "-" * len(head)]
    imb_b = rank_imbalance(before)
    imb_a = rank_imbalance(after) if after is not None else None
    for layer, row in enumerate(load_le):
        total = row.sum()
        line = (
            f"{layer:5d} {total:12.0f} {int(np.argmax(row)):10d} "
            f"{(row.max() / total if total else 0.0):9.4f} {imb_b[layer]:10.4f}"
        )
        if after is not None:
            line += f" {imb_a[layer]:9.4f}"
        rows.append(line)
    rows.append(
        f"balancedness before: {float(balancedness(before)):.4f}"
        + (f"   after: {float(balancedness(after)):.4f}" if after is not None else "")
    )
    return "\n".join(rows)


def _fit(trace, num_ranks, num_physical, policy, num_groups=1, num_nodes=1):
    from moe_eplb_jax.placement import Placement
    from moe_eplb_jax.sim.report import resolve_policy

    fn = resolve_policy(policy)
    weight = trace.total()
    tables = fn(weight, num_physical, num_groups, num_nodes, num_ranks)
    return Placement.from_tables(*tables, num_ranks=num_ranks)


def _heatmap(trace, before, after, path, title_after):
    plt = pyplot()

    load = trace.total()
    norm = lambda x: x / np.maximum(x.mean(1, keepdims=True), 1e-12)
    fig, axes = plt.subplots(1, 3, figsize=(15, max(3.5, 0.3 * trace.num_layers + 2.5)), layout="constrained")
    panels = [
        (norm(load), "expert load / layer mean", "logical expert"),
        (norm(before), "rank load before (home layout)", "EP rank"),
        (norm(after), f"rank load after ({title_after})", "EP rank"),
    ]
    vmax = max(p[0].max() for p in panels)
    for ax, (data, title, xlabel) in zip(axes, panels):
        im = ax.imshow(data, aspect="auto", cmap="viridis", vmin=0, vmax=vmax, interpolation="nearest")
        ax.set(title=title, xlabel=xlabel, ylabel="layer")
        ax.yaxis.get_major_locator().set_params(integer=True)
    fig.colorbar(im, ax=axes, shrink=0.8, label="load / mean")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except ValueError as e:
        print(f"moe-eplb {args.command}: error: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    from moe_eplb_jax import sim

    if args.command == "generate":
        load = _generate(args)
        sim.save_load(args.output, load, num_ranks=args.num_ranks, top_k=args.top_k, note=f"synthetic {args.generator}")
        print(f"wrote {args.output}: load [steps={load.shape[0]}, L={load.shape[1]}, E={load.shape[2]}]")
        return 0

    if args.command == "simulate":
        if args.load:
            trace = sim.read_load(args.load)
            load, num_ranks = trace.load, args.num_ranks
        else:
            load, num_ranks = _generate(args), args.num_ranks
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        if not policies:
            raise ValueError("--policies is empty")
        reports = sim.simulate(
            load,
            num_ranks=num_ranks,
            num_spare=args.num_spare,
            policies=policies,
            step_interval=args.step_interval,
            window=args.window,
            expert_bytes=args.expert_mb * 1e6,
        )
        print(
            f"EP{num_ranks}, E={load.shape[2]}, L={load.shape[1]}, steps={load.shape[0]}, "
            f"spare slots/rank={args.num_spare}"
        )
        print(sim.format_table(reports))
        if args.plot:
            sim.plot_reports(reports, args.plot)
            print(f"wrote {args.plot}")
        return 0

    trace = sim.read_load(args.load)
    _check_ranks(trace, args.num_ranks)
    if args.command == "stats":
        phy2log = _read_placement(args.placement, trace, args.num_ranks).phy2log if args.placement else None
        print(f"{args.load}: steps={trace.num_steps}, L={trace.num_layers}, E={trace.num_logical}, EP{args.num_ranks}")
        print(_stats_table(trace.total(), args.num_ranks, phy2log))
        return 0
    if args.command == "fit":
        placement = _fit(trace, args.num_ranks, args.num_physical, args.policy, args.num_groups, args.num_nodes)
        placement.save(args.output)
        print(_stats_table(trace.total(), args.num_ranks, placement.phy2log))
        print(f"wrote {args.output} ({args.policy}, P={args.num_physical}, EP{args.num_ranks})")
        return 0
    if args.command == "heatmap":
        if args.placement:
            placement, label = _read_placement(args.placement, trace, args.num_ranks), args.placement
        else:
            num_physical = args.num_physical or trace.num_logical + args.num_ranks
            placement, label = _fit(trace, args.num_ranks, num_physical, args.policy), f"{args.policy} fit"
        load = trace.total()
        before = _rank_loads(load, _home_phy2log(*load.shape), args.num_ranks)
        after = _rank_loads(load, placement.phy2log, args.num_ranks)
        _heatmap(trace, before, after, args.output, label)
        print(f"wrote {args.output}")
        return 0
    raise AssertionError(args.command)  # argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())

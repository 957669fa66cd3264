"""The ``moe-eplb`` command-line tool.

Subcommands::

    moe-eplb generate  -o load.npz [--generator drift|zipf|lognormal] [sizes]  write a synthetic load file
    moe-eplb stats     load.npz --num-ranks G [--placement p.json]      per-layer statistics
    moe-eplb fit       load.npz --num-ranks G --num-physical P -o p.json [--policy balanced] [--format sglang]
                       [--from-placement old.json --from-num-ranks G0 [--lost-ranks 3,5]]   plan a scale event
    moe-eplb heatmap   load.npz --num-ranks G [--placement p.json] -o map.png   load before / after
    moe-eplb simulate  [--load load.npz | --generator ...] --num-ranks G --num-spare S [--plot sim.png]
    moe-eplb --version

Load files are described in :mod:`moe_eplb_jax.sim.loadfile`; placement files
(ours and SGLang's expert-location JSON) in :mod:`moe_eplb_jax.placement`.
"Before" is the home layout (expert ``e`` on rank ``e // (E / G)``, no
replicas); "after" is the given or fitted placement with each expert's tokens
split evenly over its replicas. ``fit --from-placement`` plans a scale event
instead: the placement on ``--from-num-ranks`` ranks is "before", the one
fitted for ``--num-ranks`` keeps what each device holds (``--policy fill``:
every slot it can, filling only the empty ones), and the report gives the rows
moved over the network, the rows reloaded from a checkpoint (experts only
``--lost-ranks`` held) and the modelled time. Every bad input -- a flag out of range, a
damaged file, an output path that cannot be written -- prints one line on
stderr and exits with status 2, before any long work; ``simulate`` reports
its progress on stderr.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

from moe_eplb_jax import __version__, policy, sim
from moe_eplb_jax._files import FIGURE_SUFFIXES, check_output_path, pyplot, save_figure
from moe_eplb_jax.metrics import balancedness, rank_imbalance, rank_load_from_logical
from moe_eplb_jax.placement import FILE_FORMATS, Placement
from moe_eplb_jax.sim.report import policy_names, resolve_policy

__all__ = ["main", "build_parser"]

# A generated trace holds steps * L * E counts (8 bytes each) and is drawn one (step, layer) at a time;
# beyond these it would take gigabytes or hours, which is never what a synthetic trace is for.
_MAX_GENERATED_ENTRIES = 2**26
_MAX_GENERATED_ROWS = 2**18
# Counts are exact in float64 (and every generator's sums) up to 2**53 tokens per step and layer.
_MAX_TOKENS = 2**53
# More slots than this many per expert is no placement anyone serves; it only makes the policy allocate.
_MAX_SLOTS_PER_EXPERT = 64
_PROGRESS_SECONDS = 2.0


def _integer(minimum: int, maximum: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum}, got {text}")
        return value

    parse.__name__ = "integer"
    return parse


def _real(minimum: float | None = None, *, positive: bool = False):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be finite, got {text}")
        if positive and value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


_positive = _integer(1, 2**31 - 1)
_non_negative = _integer(0, 2**31 - 1)


def _rank_list(text: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    return tuple(_non_negative(p) for p in parts)


_rank_list.__name__ = "rank list"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none (required options, optional files)."""

    def _get_help_string(self, action):
        if action.default is None or action.required:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    formatter = _HelpFormatter
    parser = argparse.ArgumentParser(
        prog="moe-eplb", description="Expert-parallel load balancing tools.", formatter_class=formatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,stats,fit,heatmap,simulate}")
    policies = policy.available()

    gen = sub.add_parser("generate", help="write a synthetic load file", formatter_class=formatter)
    gen.add_argument("-o", "--output", required=True, help="load file to write (.npz or .json)")
    _add_generator_args(gen)

    stats = sub.add_parser("stats", help="per-layer statistics of a load file", formatter_class=formatter)
    stats.add_argument("load", help="load file (.npz or .json, ours or SGLang's logical_count)")
    stats.add_argument("--num-ranks", type=_positive, required=True, help="EP ranks G")
    stats.add_argument("--placement", help="placement file to evaluate (ours or SGLang's); default: home layout")

    fit = sub.add_parser("fit", help="fit a placement to a load file", formatter_class=formatter)
    fit.add_argument("load", help="load file (.npz or .json, ours or SGLang's logical_count)")
    fit.add_argument("--num-ranks", type=_positive, required=True, help="EP ranks G")
    fit.add_argument("--num-physical", type=_positive, required=True, help="physical slots P = E + redundant")
    fit.add_argument(
        "--policy",
        default=policy.DEFAULT_POLICY,
        choices=[*policies, policy.FILL],
        help=f"placement policy ({policy.FILL!r}: with --from-placement, keep every slot a device holds)",
    )
    fit.add_argument("--num-groups", type=_positive, default=1, help="expert groups (DeepSeek's hierarchical policy)")
    fit.add_argument("--num-nodes", type=_positive, default=1, help="nodes (hosts) the ranks are spread over")
    fit.add_argument("--from-placement", help="the placement now (ours or SGLang's): plan a move to --num-ranks")
    fit.add_argument("--from-num-ranks", type=_positive, help="EP ranks of --from-placement")
    fit.add_argument("--lost-ranks", type=_rank_list, default=(), help="comma-separated old ranks that are gone")
    fit.add_argument("--expert-mb", type=_real(positive=True), default=44.0, help="bytes of one expert, in MB")
    fit.add_argument("--link-gbps", type=_real(positive=True), default=400.0, help="a device's link speed, GB/s")
    fit.add_argument(
        "--format",
        default="moe_eplb_jax",
        choices=FILE_FORMATS,
        help="placement file format: ours (.json / .npz) or SGLang's expert-location JSON (--init-expert-location)",
    )
    fit.add_argument("-o", "--output", required=True, help="placement file to write (.json or .npz)")

    heat = sub.add_parser(
        "heatmap", help="per-layer load heatmap PNG, before and after a placement", formatter_class=formatter
    )
    heat.add_argument("load", help="load file (.npz or .json)")
    heat.add_argument("--num-ranks", type=_positive, required=True, help="EP ranks G")
    heat.add_argument("--placement", help="placement for 'after' (default: fit one with --policy)")
    heat.add_argument("--num-physical", type=_positive, help="slots P when fitting (default: E + G)")
    heat.add_argument("--policy", default=policy.DEFAULT_POLICY, choices=policies, help="policy when fitting")
    heat.add_argument("-o", "--output", required=True, help="image file to write (.png, .pdf or .svg)")

    sim = sub.add_parser("simulate", help="compare balancing policies on a load trace", formatter_class=formatter)
    sim.add_argument("--load", help="load file to replay (default: a synthetic trace from the flags below)")
    _add_generator_args(sim)
    sim.add_argument("--num-spare", type=_non_negative, default=2, help="spare slots per rank S")
    sim.add_argument(
        "--policies",
        default="none,deepseek,deepseek+lp,online",
        help="comma-separated policy names, from: " + ", ".join(policy_names()),
    )
    sim.add_argument("--step-interval", type=_positive, default=8, help="periodic refit interval (steps)")
    sim.add_argument("--window", type=_positive, default=8, help="periodic refit window (steps)")
    sim.add_argument("--expert-mb", type=_real(positive=True), default=44.0, help="bytes of one expert, in MB")
    sim.add_argument("--plot", help="image file for the imbalance plot (.png, .pdf or .svg)")
    return parser


def _add_generator_args(p):
    p.add_argument("--generator", choices=("drift", "zipf", "lognormal"), default="drift", help="synthetic load")
    p.add_argument("--num-ranks", type=_positive, default=8, help="EP ranks G")
    p.add_argument("--experts-per-rank", type=_positive, default=4, help="home experts per rank H (E = G * H)")
    p.add_argument("--num-layers", type=_positive, default=4, help="MoE layers L")
    p.add_argument("--num-steps", type=_positive, default=32, help="steps in the trace")
    p.add_argument("--tokens", type=_positive, default=8192, help="tokens per rank per step")
    p.add_argument("--top-k", type=_positive, default=8, help="experts per token")
    p.add_argument("--imbalance", type=_real(1.0), default=2.0, help="initial rank imbalance (zipf, drift)")
    p.add_argument("--sigma", type=_real(0.0), default=1.0, help="log-normal sigma")
    p.add_argument("--seed", type=_integer(0, 2**32 - 1), default=0, help="random seed")


def _check_generator_sizes(args) -> None:
    """``ValueError`` naming the flags when a synthetic trace would be absurdly large, before any work."""
    num_experts = args.num_ranks * args.experts_per_rank
    if args.top_k > num_experts:
        raise ValueError(
            f"--top-k {args.top_k} exceeds the {num_experts} experts (--num-ranks {args.num_ranks} x "
            f"--experts-per-rank {args.experts_per_rank}): a token picks distinct experts"
        )
    entries = args.num_steps * args.num_layers * num_experts
    if entries > _MAX_GENERATED_ENTRIES or args.num_steps * args.num_layers > _MAX_GENERATED_ROWS:
        raise ValueError(
            f"--num-steps {args.num_steps} x --num-layers {args.num_layers} x E {num_experts} is too large a trace "
            f"(at most {_MAX_GENERATED_ENTRIES} counts and {_MAX_GENERATED_ROWS} step-layer rows)"
        )
    if args.tokens * args.num_ranks * args.top_k > _MAX_TOKENS:
        raise ValueError(
            f"--tokens {args.tokens} x --num-ranks {args.num_ranks} x --top-k {args.top_k} exceeds 2**53 "
            "assignments per step (counts would lose exactness)"
        )
    if args.generator == "zipf" and args.tokens * args.top_k >= 2**31:
        raise ValueError(f"--tokens {args.tokens} x --top-k {args.top_k} must stay below 2**31 for zipf counts")
    if args.generator != "lognormal" and args.imbalance > args.num_ranks:
        raise ValueError(f"--imbalance {args.imbalance} must lie in [1, --num-ranks {args.num_ranks}]")


def _generate(args):
    _check_generator_sizes(args)
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
                        )
                        .astype(np.int64)
                        .sum(0)
                        for layer in range(args.num_layers)
                    ]
                )
            )
        return np.stack(steps)
    return np.stack(
        [
            sim.lognormal_load(args.num_layers, num_experts, sigma=args.sigma, tokens=tokens, seed=args.seed + step)
            for step in range(args.num_steps)
        ]
    )


def _progress(what: str, *, seconds: float = _PROGRESS_SECONDS, stream=None):
    """A ``progress`` wrapper for :func:`moe_eplb_jax.sim.simulate`: a line on stderr before the first step (it
    compiles the planners), at every tenth of the steps and at least every ``seconds``."""
    stream = sys.stderr if stream is None else stream

    def wrap(steps):
        steps = list(steps)
        total = len(steps)
        start = last = time.monotonic()
        after_first = None  # the first step also compiles: the rate is measured after it
        print(f"{what}: {total} steps", file=stream, flush=True)
        for done, step in enumerate(steps, start=1):
            if done == 1:
                print(f"{what}: step 1/{total} compiles the policies' planners first", file=stream, flush=True)
            yield step
            now = time.monotonic()
            after_first = now if after_first is None else after_first
            tenth = done * 10 // total > (done - 1) * 10 // total
            if (tenth or now - last >= seconds) and done < total:
                last = now
                left = f", ~{(total - done) * (now - after_first) / (done - 1):.0f} s left" if done > 1 else ""
                print(
                    f"{what}: step {done}/{total} ({100 * done / total:.0f}%), {now - start:.0f} s elapsed{left}",
                    file=stream,
                    flush=True,
                )
        print(f"{what}: done in {time.monotonic() - start:.1f} s", file=stream, flush=True)

    return wrap


def _rank_loads(load_le: np.ndarray, phy2log: np.ndarray, num_ranks: int) -> np.ndarray:
    return np.asarray(rank_load_from_logical(load_le, phy2log, num_ranks))


def _home_phy2log(num_layers: int, num_logical: int) -> np.ndarray:
    return np.tile(np.arange(num_logical), (num_layers, 1))


def _read_placement(path, trace, num_ranks):
    # An SGLang file does not store E: the load file's E is the one it must serve.
    placement = Placement.load(
        path, num_ranks=num_ranks, num_logical=trace.num_logical, layer_ids=trace.meta.get("layer_ids")
    )
    if placement.num_layers != trace.num_layers:
        raise ValueError(
            f"{path}: placement is for L={placement.num_layers} layers; the load file has L={trace.num_layers}"
        )
    return placement


def _check_ranks(trace, num_ranks):
    if trace.num_logical % num_ranks:
        raise ValueError(f"E = {trace.num_logical} experts are not divisible by --num-ranks {num_ranks}")


def _stats_table(load_le, num_ranks, phy2log=None) -> str:
    before = _rank_loads(load_le, _home_phy2log(*load_le.shape), num_ranks)
    head = f"{'layer':>5} {'tokens':>12} {'hot expert':>10} {'hot share':>9} {'imb before':>10}"
    after = None
    if phy2log is not None:
        after = _rank_loads(load_le, phy2log, num_ranks)
        head += f" {'imb after':>9}"
    rows = [head, "-" * len(head)]
    imb_b = rank_imbalance(before)
    imb_a = rank_imbalance(after) if after is not None else imb_b
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
    if num_physical > _MAX_SLOTS_PER_EXPERT * trace.num_logical:
        raise ValueError(
            f"--num-physical {num_physical} is more than {_MAX_SLOTS_PER_EXPERT} slots per expert "
            f"(E = {trace.num_logical})"
        )
    fn = resolve_policy(policy)
    weight = trace.total()
    tables = fn(weight, num_physical, num_groups, num_nodes, num_ranks)
    return Placement.from_tables(*tables, num_ranks=num_ranks)


def _fit_resize(args, trace) -> int:
    """``fit --from-placement``: a placement for ``--num-ranks`` from one on ``--from-num-ranks``, and the move."""
    from moe_eplb_jax import sim

    if args.from_num_ranks is None:
        raise ValueError("--from-placement needs --from-num-ranks (the EP ranks it was made for)")
    for rank in args.lost_ranks:
        if rank >= args.from_num_ranks:
            raise ValueError(f"--lost-ranks {rank} is not a rank of --from-num-ranks {args.from_num_ranks}")
    if args.num_physical > _MAX_SLOTS_PER_EXPERT * trace.num_logical:
        raise ValueError(
            f"--num-physical {args.num_physical} is more than {_MAX_SLOTS_PER_EXPERT} slots per expert "
            f"(E = {trace.num_logical})"
        )
    old = _read_placement(args.from_placement, trace, args.from_num_ranks)
    (report,) = sim.simulate_resize(
        trace.load,
        old.phy2log,
        num_ranks=args.from_num_ranks,
        new_num_ranks=args.num_ranks,
        new_num_physical=args.num_physical,
        policies=(args.policy,),
        num_groups=args.num_groups,
        num_nodes=args.num_nodes,
        lost_ranks=args.lost_ranks,
        expert_bytes=args.expert_mb * 1e6,
        link_gbps=args.link_gbps,
    )
    report.placement.save(args.output, format=args.format)
    head = f"{'layer':>5} {f'imb EP{args.from_num_ranks}':>10} {f'imb EP{args.num_ranks}':>10}"
    rows = [head, "-" * len(head)]
    for layer, (before, after) in enumerate(zip(report.imbalance_before, report.imbalance_after)):
        rows.append(f"{layer:5d} {before:10.4f} {after:10.4f}")
    print("\n".join(rows))
    print(sim.format_resize_table([report]))
    lost = f", ranks {list(args.lost_ranks)} lost" if args.lost_ranks else ""
    print(
        f"wrote {args.output} ({args.policy}, {args.format} format, P={args.num_physical}, "
        f"EP{args.from_num_ranks} -> EP{args.num_ranks}{lost})"
    )
    return 0


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
    try:
        save_figure(fig, path, what="heatmap")
    finally:
        plt.close(fig)


def main(argv=None) -> int:
    """Runs the command; bad input of any kind prints one line on stderr and returns 2."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse has printed its message (or --help / --version): its status is ours
        return e.code if isinstance(e.code, int) else 2
    try:
        return _run(args)
    except (ValueError, OSError) as e:
        print(f"moe-eplb {args.command}: error: {e}", file=sys.stderr)
        return 2
    except MemoryError:
        print(f"moe-eplb {args.command}: error: out of memory", file=sys.stderr)
        return 2


def _check_outputs(args) -> None:
    """Every file the command will write can be written, checked before any work."""
    if args.command == "generate":
        check_output_path(args.output, what="load", suffixes=(".json", ".npz"))
    elif args.command == "fit":
        suffixes = (".json",) if args.format == "sglang" else (".json", ".npz")
        check_output_path(args.output, what="placement", suffixes=suffixes)
    elif args.command == "heatmap":
        check_output_path(args.output, what="heatmap", suffixes=FIGURE_SUFFIXES)
        pyplot()
    elif args.command == "simulate" and args.plot:
        check_output_path(args.plot, what="plot", suffixes=FIGURE_SUFFIXES)
        pyplot()


def _run(args) -> int:
    _check_outputs(args)
    if args.command == "generate":
        load = _generate(args)
        sim.save_load(args.output, load, num_ranks=args.num_ranks, top_k=args.top_k, note=f"synthetic {args.generator}")
        print(f"wrote {args.output}: load [steps={load.shape[0]}, L={load.shape[1]}, E={load.shape[2]}]")
        return 0

    if args.command == "simulate":
        policies = sim.check_policy_names([p.strip() for p in args.policies.split(",") if p.strip()])
        if args.load:
            trace = sim.read_load(args.load)
            load, num_ranks = trace.load, args.num_ranks
        else:
            load, num_ranks = _generate(args), args.num_ranks
        reports = sim.simulate(
            load,
            num_ranks=num_ranks,
            num_spare=args.num_spare,
            policies=policies,
            step_interval=args.step_interval,
            window=args.window,
            expert_bytes=args.expert_mb * 1e6,
            progress=_progress(f"moe-eplb simulate ({', '.join(policies)})"),
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
    if not (args.command == "fit" and args.from_placement):
        _check_ranks(trace, args.num_ranks)
    if args.command == "stats":
        phy2log = _read_placement(args.placement, trace, args.num_ranks).phy2log if args.placement else None
        print(f"{args.load}: steps={trace.num_steps}, L={trace.num_layers}, E={trace.num_logical}, EP{args.num_ranks}")
        print(_stats_table(trace.total(), args.num_ranks, phy2log))
        return 0
    if args.command == "fit" and args.from_placement:
        return _fit_resize(args, trace)
    if args.command == "fit":
        if args.policy == "fill":
            raise ValueError("--policy fill keeps the slots of --from-placement: give --from-placement")
        if args.from_num_ranks or args.lost_ranks:
            raise ValueError("--from-num-ranks and --lost-ranks describe --from-placement: give it too")
        placement = _fit(trace, args.num_ranks, args.num_physical, args.policy, args.num_groups, args.num_nodes)
        rows = {k: trace.meta[k] for k in ("layer_ids", "num_hidden_layers") if k in trace.meta}
        placement.save(args.output, format=args.format, **(rows if args.format == "sglang" else {}))
        print(_stats_table(trace.total(), args.num_ranks, placement.phy2log))
        print(f"wrote {args.output} ({args.policy}, {args.format} format, P={args.num_physical}, EP{args.num_ranks})")
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

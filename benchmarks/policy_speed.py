"""Placement policy speed and quality on DeepSeek-V3-like shapes (CPU).

Times, side by side in one run:
  * ``loop``     -- :func:`moe_eplb_jax.policy.rebalance_experts_reference`, the plain-loop algorithm;
  * ``deepseek`` -- :func:`moe_eplb_jax.policy.rebalance_experts`, the vectorised version (asserted to
                    return exactly the loop's tables);
  * ``balanced`` -- :func:`moe_eplb_jax.policy.rebalance_balanced`.
and the balancedness (sum of mean / sum of max GPU load, 1.0 is perfect) of each, next to ``bound``: the
best balancedness any placement can reach with DeepSeek's node of each group and replicas per expert
(the busiest GPU of a layer carries at least its node's mean GPU load and at least the largest
replica). ``sigma`` is the log-normal spread of the synthetic per-expert loads.

Run: ``python benchmarks/policy_speed.py [--repeats N]``. Times are medians of interleaved runs, in a
process whose allocator is warm (see ``_warm_allocator``); ``(cold)`` is the speed-up measured first,
in the fresh process, where every vectorised call page-faults its temporaries; ``(best)`` is the ratio
of the fastest runs, what a quiet machine gives when other jobs share the cores (the load average is
printed before and after). Interleaving also means each vectorised call starts with caches the loop
just filled with its own data (as a call between training steps would); ``(b2b)`` is the ratio of
back-to-back runs of each implementation alone, caches warm.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np

from moe_eplb_jax import metrics
from moe_eplb_jax.policy import rebalance_balanced, rebalance_experts, rebalance_experts_reference

# (label, layers, experts, slots, groups, nodes, gpus)
CASES = [
    ("V3 288/32 hier", 58, 256, 288, 8, 4, 32),
    ("320/64 hier", 58, 256, 320, 8, 8, 64),
    ("V3 288/32 global", 58, 256, 288, 1, 1, 32),
]


def _median_ms(fn, repeats: int) -> float:
    return _interleaved_ms([fn], repeats)[0][0]


def _interleaved_ms(fns, repeats: int) -> tuple[list[float], list[float]]:
    """Median and fastest time of each function, run in turn ``repeats`` times (load changes hit all alike)."""
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, spent in zip(fns, times):
            start = time.perf_counter()
            out = fn()
            spent.append(time.perf_counter() - start)
            del out
    return [statistics.median(spent) * 1e3 for spent in times], [min(spent) * 1e3 for spent in times]


def _balancedness(weight, phy2log, num_gpus) -> float:
    return float(metrics.balancedness(metrics.rank_load_from_logical(weight, phy2log, num_gpus)))


def _bound(weight, phy2log, logcnt, num_nodes, num_gpus) -> float:
    rank_load = metrics.rank_load_from_logical(weight, phy2log, num_gpus)
    node_mean = rank_load.reshape(rank_load.shape[0], num_nodes, -1).mean(axis=2).max(axis=1)
    biggest_replica = (weight / logcnt).max(axis=1)
    return float(rank_load.mean(axis=1).sum() / np.maximum(node_mean, biggest_replica).sum())


def _warm_allocator() -> None:
    """Allocates and frees one 16 MiB buffer, as any long-running process has.

    glibc's malloc then raises its mmap and trim thresholds (they adapt to the
    largest buffer freed). Before that, a fresh process hands the temporaries of
    every call (a few 100 kB arrays) back to the OS and page-faults them in
    again on the next call -- about 1000 faults per DeepSeek-V3 call here.
    """
    buffer = np.ones(2 * 1024 * 1024)
    del buffer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21, help="timed runs of each policy per case")
    args = parser.parse_args()
    print(
        f"# {platform.processor() or platform.machine()}, numpy {np.__version__}, Python {platform.python_version()}, "
        f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"
    )
    cases = []
    for label, num_layers, num_experts, num_slots, num_groups, num_nodes, num_gpus in CASES:
        for sigma in (0.5, 1.0):
            weight = np.random.default_rng(0).lognormal(0.0, sigma, (num_layers, num_experts))
            cases.append((label, sigma, weight, (num_slots, num_groups, num_nodes, num_gpus)))

    def timings(weight, topology):
        return _interleaved_ms(
            [
                lambda: rebalance_experts_reference(weight, *topology),
                lambda: rebalance_experts(weight, *topology),
                lambda: rebalance_balanced(weight, *topology),
            ],
            args.repeats,
        )

    cold = [timings(weight, topology) for _, _, weight, topology in cases]  # fresh process first
    _warm_allocator()
    header = (
        f"{'case':<18}{'sigma':>6}{'loop ms':>9}{'deepseek ms':>12}{'speed-up':>9}{'(cold)':>8}{'(best)':>8}{'(b2b)':>8}"
        f"{'balanced ms':>12}{'bal loop':>9}{'bal deepseek':>13}{'bal balanced':>13}{'bound':>7}"
    )
    print(header)
    print("-" * len(header))
    for (label, sigma, weight, topology), ((cold_loop, cold_fast, _), _) in zip(cases, cold):
        num_slots, num_groups, num_nodes, num_gpus = topology
        loop = rebalance_experts_reference(weight, *topology)
        fast = rebalance_experts(weight, *topology)
        balanced = rebalance_balanced(weight, *topology)
        for got, want in zip(fast, loop):
            np.testing.assert_array_equal(got, want)  # same placement, bit for bit
        (t_loop, t_fast, t_bal), (best_loop, best_fast, _) = timings(weight, topology)
        b2b_loop = _median_ms(lambda: rebalance_experts_reference(weight, *topology), max(5, args.repeats // 3))
        b2b_fast = _median_ms(lambda: rebalance_experts(weight, *topology), args.repeats)
        nodes = num_nodes if num_groups % num_nodes == 0 else 1
        print(
            f"{label:<18}{sigma:>6.1f}{t_loop:>9.2f}{t_fast:>12.2f}{t_loop / t_fast:>8.1f}x"
            f"{cold_loop / cold_fast:>7.1f}x{best_loop / best_fast:>7.1f}x{b2b_loop / b2b_fast:>7.1f}x{t_bal:>12.2f}"
            f"{_balancedness(weight, loop[0], num_gpus):>9.4f}"
            f"{_balancedness(weight, fast[0], num_gpus):>13.4f}"
            f"{_balancedness(weight, balanced[0], num_gpus):>13.4f}"
            f"{_bound(weight, fast[0], fast[2], nodes, num_gpus):>7.4f}"
        )

    # Slot preservation: after a load change (loads times log-normal noise of spread "drift"), the
    # share of slots whose expert changes (each is one expert's weights to copy), with and without
    # old_phy2log, and the balancedness of both.
    print()
    header = (
        f"{'policy':<10}{'drift':>6}{'moved (fresh)':>15}{'moved (old_phy2log)':>21}{'bal fresh':>11}"
        f"{'bal old_phy2log':>17}{'ms with old':>12}"
    )
    print(header)
    print("-" * len(header))
    _, num_layers, num_experts, num_slots, num_groups, num_nodes, num_gpus = CASES[0]
    rng = np.random.default_rng(1)
    weight = rng.lognormal(0.0, 1.0, (num_layers, num_experts))
    topology = (num_slots, num_groups, num_nodes, num_gpus)
    for name, fn in (("deepseek", rebalance_experts), ("balanced", rebalance_balanced)):
        old = fn(weight, *topology)[0]
        for drift in (0.0, 0.1, 0.3):
            new_weight = weight * rng.lognormal(0.0, drift, weight.shape) if drift else weight
            fresh = fn(new_weight, *topology)[0]
            kept = fn(new_weight, *topology, old_phy2log=old)[0]
            t_old = _median_ms(lambda: fn(new_weight, *topology, old_phy2log=old), max(3, args.repeats // 3))
            print(
                f"{name:<10}{drift:>6.1f}{np.mean(fresh != old):>15.1%}{np.mean(kept != old):>21.1%}"
                f"{_balancedness(new_weight, fresh, num_gpus):>11.4f}{_balancedness(new_weight, kept, num_gpus):>17.4f}"
                f"{t_old:>12.2f}"
            )
    print(f"\n# load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()

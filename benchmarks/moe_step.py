"""MoE layer step time under Zipf-skewed routing: initial vs EPLB placement vs online quotas vs uniform routing.

    PYTHONPATH=. python3 benchmarks/moe_step.py --ranks 2                       # 2 GPUs
    PYTHONPATH=. python3 benchmarks/moe_step.py --ranks 8 --matmul pallas,dense --capacity-factor 1.25  # EP8
                                                                  # (issue 8; benchmarks/multi_gpu.py runs it)
    PYTHONPATH=. python3 benchmarks/moe_step.py --cpu-devices 8 --small --matmul dense,pallas_interpret

Prints, side by side in one run and for each grouped-matmul implementation:
the forward step time of one expert-parallel MoE layer (route + map_and_count
+ dispatch all_to_all + grouped expert MLP + combine) with the initial
placement (experts in id order, redundant slots on the coldest experts: the
hot experts share the first rank), with the EPLB placement (the ``deepseek``
policy on the measured load) and with perfectly uniform routing on an even
placement (the ideal: every expert gets ``T*k/E`` tokens); with online quota routing (``--online``; UltraEP-style,
``benchmarks/online_ep.py``: every step all_gathers the per-rank expert counts, runs ``plan_quotas`` and routes
with ``map_and_count(mode="quota")``, all inside the timed step; experts at home, ``R / G`` spare slots per
rank filled per batch, their weights taken from a resident replicated copy -- ``resident``, the fetch free -- or
from an all_gather of the home experts inside the step -- ``all_gather``, an upper bound on the fetch); the
measured balancedness of each; and whether the outputs under every placement / routing are bit-identical.

Then the EPLB bookkeeping (mapping + counting + state update) of one step, for the first matmul / exchange
listed, under the EPLB placement: (a) the EPLB step -- ``moe_apply`` with ``map_and_count`` mapping and
counting per rank (no load all-reduce: each rank keeps its own ``[G, P]`` row, summed only at rearrangement)
plus ``EplbState.record`` / ``end_step`` of the per-rank load with the state donated, as
``EplbController.step`` does -- against (b) the same step with the placement fixed and no EPLB work: the
slots come from one gather ``log2phy[ids, replica]`` (``replica`` precomputed from (a)'s routing, so both steps
exchange and multiply the same rows; checked: bit-identical outputs), no counting, no state. (a) - (b) is the
bookkeeping, printed as ms and % of (a) in device time (kernel time from the profiler's CUPTI records,
``_timing.device_seconds``; all kernels of GPU 0, and without the NCCL kernels, whose time includes waiting
for the peer -- both as % of (a)'s all-kernel time) side by side with host wall-clock time (which adds launch
and sync overheads), plus the device time of (a) by kernel name, and (a'): (a) the old way, the load
psum'd over EP every step (``load_reduce="psum"``) into a replicated window. One step per call: device time leaves the
launch gaps between calls out, and a chain of steps in one program would route different tokens than the
precomputed replicas of (b). Device columns read "n/a" on CPU.

``dense`` costs the worst case whatever the routing, so only an implementation
whose cost follows the rows a rank received (``pallas``) can show the balance
in step time.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import os
import sys
import time
import traceback


def _args():
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=None, help="EP ranks (default: every device)")
    p.add_argument("--cpu-devices", type=int, default=0, help="simulate this many CPU devices")
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--redundant", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--zipf", type=float, default=1.2, help="router bias -4*zipf*log(1+e)")
    p.add_argument("--matmul", default="dense,pallas", help="comma-separated grouped matmul implementations")
    p.add_argument("--map-impl", default=None, help="map_and_count implementation (None: its default)")
    p.add_argument(
        "--capacity-factor",
        default="none,1.25",
        help="comma-separated exchange capacity factors ('none': one worst-case all_to_all)",
    )
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--online",
        default="resident,all_gather",
        help="online quota rows: comma-separated spare-weight fetches (resident, all_gather; '' for none)",
    )
    p.add_argument("--window", type=int, default=1000, help="EplbState window (steps) in the bookkeeping step")
    p.add_argument(
        "--book-reps",
        type=int,
        default=3,
        help="bookkeeping: interleaved (a)/(b) profiler runs of --iters calls each; medians reported",
    )
    p.add_argument("--json", default=None, help="write the table rows here")
    return p.parse_args()


def main():
    args = _args()
    if args.cpu_devices:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.cpu_devices}"
    if args.small:
        args.tokens, args.dim, args.hidden, args.experts, args.redundant, args.iters = 256, 64, 32, 16, 8, 3
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as PS

    from moe_eplb_jax import metrics
    from moe_eplb_jax import state as eplb_state
    from moe_eplb_jax.flax import layer as L
    from moe_eplb_jax.pallas import map_and_count
    from moe_eplb_jax.placement import Placement
    from moe_eplb_jax.sharding import put_host
    from moe_eplb_jax.state import EplbConfig

    try:  # run as a script: benchmarks/ is on sys.path
        from _timing import device_seconds, median_seconds
        from online_ep import online_moe_apply
    except ImportError:
        from benchmarks._timing import device_seconds, median_seconds
        from benchmarks.online_ep import online_moe_apply

    ranks = args.ranks or jax.device_count()
    mesh = jax.make_mesh((ranks,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:ranks])
    E, P, D, H, K = args.experts, args.experts + args.redundant, args.dim, args.hidden, args.top_k
    T = args.tokens * ranks
    rng = np.random.default_rng(0)
    dtype = jnp.bfloat16
    w_in = rng.standard_normal((E, D, 2 * H)).astype(np.float32) * D**-0.5
    w_out = rng.standard_normal((E, H, D)).astype(np.float32) * H**-0.5
    router = put_host(rng.standard_normal((D, E)).astype(np.float32) * D**-0.5, mesh, PS())
    zipf_bias = put_host((-4.0 * args.zipf * np.log1p(np.arange(E))).astype(np.float32), mesh, PS())
    flat_bias = put_host(np.zeros(E, np.float32), mesh, PS())
    x = put_host(rng.standard_normal((T, D)).astype(np.float32).astype(dtype), mesh, PS("ep"))
    # The ideal: token t picks experts (t*k + j) mod E exactly (a one-hot router), so every expert gets
    # T*k/E tokens, under a placement that spreads E equal loads evenly (linear: replicas of 0..R-1 last).
    if D < E:
        raise ValueError(f"--dim ({D}) must be at least --experts ({E}) for the uniform routing case")
    picks = (np.arange(T)[:, None] * K + np.arange(K)[None, :]) % E
    x_uni_host = 0.01 * rng.standard_normal((T, D)).astype(np.float32)
    np.put_along_axis(x_uni_host, picks, 8.0, axis=1)
    x_uni = put_host(x_uni_host.astype(dtype), mesh, PS("ep"))
    router_uni = put_host(np.eye(D, E, dtype=np.float32), mesh, PS())

    def operands(placement, bias, tokens=x, router=router):
        phy = placement.phy2log[0]
        experts = {
            "w_in": put_host(w_in[phy].astype(dtype), mesh, PS("ep")),
            "w_out": put_host(w_out[phy].astype(dtype), mesh, PS("ep")),
        }
        return (
            tokens,
            router,
            bias,
            experts,
            put_host(placement.log2phy[0], mesh, PS()),
            put_host(placement.logcnt[0], mesh, PS()),
        )

    def bench(fn, ops):
        out = jax.block_until_ready(fn(*ops))
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*ops))
            times.append(time.perf_counter() - t0)
        return float(np.median(times)), out

    def total(load):  # moe_apply returns per-rank rows [G, P] (no psum in the step); online_moe_apply [P]
        load = np.asarray(load)
        return load.sum(0) if load.ndim == 2 else load

    def balancedness(load):
        return float(metrics.balancedness(metrics.rank_load(total(load)[None], ranks)))

    initial = np.concatenate([np.arange(E), np.arange(E - 1, E - 1 - (P - E), -1)])
    start = Placement.from_phy2log(initial[None], E, num_ranks=ranks)
    uniform = Placement.linear(1, E, P, num_ranks=ranks)
    config = EplbConfig(num_redundant_experts=P - E, num_gpus=ranks)
    fitted = None

    # The old host-timed estimate: route + map_and_count per rank + EplbState update, minus routing alone.
    def book(x, router, bias, log2phy, logcnt, state):
        def per_rank(x, router, bias, log2phy, logcnt):
            ids, _ = L.route(x, router, top_k=K, bias=bias)
            _, load = map_and_count(ids, log2phy, logcnt, num_physical=P, implementation=args.map_impl)
            return load[None]

        load = jax.shard_map(
            per_rank, mesh=mesh, in_specs=(PS("ep"),) + (PS(),) * 4, out_specs=PS("ep"), check_vma=False
        )(x, router, bias, log2phy, logcnt)
        return eplb_state.end_step(eplb_state.record(state, load[None]))

    def route_only(x, router, bias):
        return jax.shard_map(
            lambda x, r, b: L.route(x, r, top_k=K, bias=b)[0],
            mesh=mesh,
            in_specs=(PS("ep"), PS(), PS()),
            out_specs=PS("ep"),
            check_vma=False,
        )(x, router, bias)

    def bookkeeping(ops, state, state_sharding, matmul, factor):
        """(a) the EPLB step vs (b) the same step, fixed placement, no EPLB work (see the module docstring)."""
        x, router, bias, experts, log2phy, logcnt = ops

        def eplb_step(x, router, bias, experts, log2phy, logcnt, state, load_reduce="none"):  # (a)
            out, load = L.moe_apply(
                x,
                router,
                bias,
                experts,
                log2phy,
                logcnt,
                top_k=K,
                mesh=mesh,
                matmul=matmul,
                map_implementation=args.map_impl,
                capacity_factor=factor,
                load_reduce=load_reduce,
            )
            return out, eplb_state.end_step(eplb_state.record(state, load[None]))  # load: [G, P] or psum'd [P]

        def fixed_step(x, router, bias, experts, log2phy, replica):  # (b)
            def per_rank(x, router, bias, experts, log2phy, replica):
                ids, weights = L.route(x, router, top_k=K, bias=bias)
                physical = log2phy[ids, replica]  # one gather, nothing counted
                return L._routed_experts(  # moe_apply's own exchange + grouped MLP + combine
                    x,
                    physical,
                    weights,
                    experts,
                    axis="ep",
                    num_ranks=ranks,
                    slots_per_rank=P // ranks,
                    capacity=L._capacity(args.tokens * K, ranks, factor),
                    matmul=matmul,
                    quant_impl="auto",
                    activation_scaling="dynamic",
                )

            return jax.shard_map(
                per_rank,
                mesh=mesh,
                in_specs=(PS("ep"), PS(), PS(), PS("ep"), PS(), PS("ep")),
                out_specs=PS("ep"),
                check_vma=False,
            )(x, router, bias, experts, log2phy, replica)

        def replicas(x, router, bias, log2phy, logcnt):  # the replica (a)'s map_and_count picks per assignment
            def per_rank(x, router, bias, log2phy, logcnt):
                ids, _ = L.route(x, router, top_k=K, bias=bias)
                physical, _ = map_and_count(
                    ids,
                    log2phy,
                    logcnt,
                    num_physical=P,
                    mode="hash",
                    num_valid_tokens=jnp.int32(x.shape[0]),
                    implementation=args.map_impl,
                )
                return jnp.argmax(log2phy[ids] == physical[..., None], axis=-1).astype(jnp.int32)

            return jax.shard_map(
                per_rank, mesh=mesh, in_specs=(PS("ep"),) + (PS(),) * 4, out_specs=PS("ep"), check_vma=False
            )(x, router, bias, log2phy, logcnt)

        def runner(state, sharding, load_reduce):
            # The state is donated, as EplbController.step does: the window row is written in place.
            step = jax.jit(
                functools.partial(eplb_step, load_reduce=load_reduce),
                donate_argnums=6,
                out_shardings=(NamedSharding(mesh, PS("ep")), sharding),
            )
            held = [state]

            def run(*a):
                out, held[0] = step(*a, held[0])
                return out

            return run

        run_a = runner(state, state_sharding, "none")
        # (a'): the old path -- the load psum'd every step, recorded into a replicated [W, 1, P] window.
        replicated = NamedSharding(mesh, PS())
        summed_state = jax.jit(lambda: eplb_state.init_state(book_config, 1, P), out_shardings=replicated)()
        run_psum = runner(summed_state, replicated, "psum")

        run_b = jax.jit(fixed_step)
        ops_b = (x, router, bias, experts, log2phy, jax.jit(replicas)(x, router, bias, log2phy, logcnt))
        same = bool(np.array_equal(np.asarray(run_a(*ops)).view(np.uint16), np.asarray(run_b(*ops_b)).view(np.uint16)))
        device = {"a": [], "b": [], "psum": []}
        compute = {"a": [], "b": [], "psum": []}  # without NCCL kernels (their time includes waiting for the peer)
        kernels = {"a": collections.Counter(), "b": collections.Counter(), "psum": collections.Counter()}
        for _ in range(args.book_reps):  # interleaved, so drift hits all alike
            for name, fn, fn_ops in (("a", run_a, ops), ("b", run_b, ops_b), ("psum", run_psum, ops)):
                seconds, per_kernel = device_seconds(fn, *fn_ops, calls=args.iters)
                device[name].append(seconds)
                compute[name].append(
                    None if seconds is None else sum(t for k, t in per_kernel.items() if "nccl" not in k.lower())
                )
                kernels[name].update({k: t / args.book_reps for k, t in per_kernel.items()})
        host = {
            "a": [median_seconds(run_a, *ops, reps=args.iters)],
            "b": [median_seconds(run_b, *ops_b, reps=args.iters)],
            "psum": [median_seconds(run_psum, *ops, reps=args.iters)],
        }

        def column(times, step=None):  # medians -> ms of (a), (b), (a) - (b), % of the step; the same for (a')
            if any(t is None for t in times["a"] + times["b"] + times["psum"]):
                return None
            a, b, p = (float(np.median(times[k])) for k in ("a", "b", "psum"))
            step = a if step is None else step  # the (a) step time the percentages are of
            return dict(
                a_ms=a * 1e3,
                b_ms=b * 1e3,
                book_ms=(a - b) * 1e3,
                pct=100 * (a - b) / step,
                psum_ms=p * 1e3,
                psum_book_ms=(p - b) * 1e3,
                psum_pct=100 * (p - b) / step,
            )

        names = set(kernels["a"]) | set(kernels["b"])
        table = [(k, kernels["a"][k] * 1e6, kernels["b"][k] * 1e6) for k in names]
        return dict(
            case=f"{matmul}/{'worst' if factor is None else f'cf{factor:g}'}",
            window=args.window,
            same=same,
            device=column(device),
            compute=column(compute, None if device["a"][0] is None else float(np.median(device["a"]))),
            host=column(host),
            kernels_a=sorted(table, key=lambda r: -r[1])[:10],
            kernels_diff=sorted(table, key=lambda r: r[2] - r[1])[:10],
        )

    def print_bookkeeping(row, t_book, t_book_route, t_route):
        print("\nEPLB bookkeeping per step (mapping + counting + state update)", end="")
        if row is None:
            print(": FAILED (traceback above)")
        else:
            print(f", {row['case']}, EPLB placement, window {row['window']} steps:")
            print(f"{'':44s} {'device ms':>10s} {'w/o NCCL':>10s} {'host ms':>10s}")
            cols = (row["device"], row["compute"], row["host"])
            for name, key, fmt in (
                ("(a) EPLB step: map+count+state", "a_ms", "{:10.3f}"),
                ("(b) fixed placement, no EPLB work", "b_ms", "{:10.3f}"),
                ("bookkeeping (a) - (b)", "book_ms", "{:10.3f}"),
                ("bookkeeping, % of (a) (device: all kernels)", "pct", "{:9.2f}%"),
                ("(a') old path: + load psum every step", "psum_ms", "{:10.3f}"),
                ("(a') bookkeeping (a') - (b)", "psum_book_ms", "{:10.3f}"),
                ("(a') bookkeeping, % of (a)", "psum_pct", "{:9.2f}%"),
            ):
                print(f"{name:44s} " + " ".join("       n/a" if c is None else fmt.format(c[key]) for c in cols))
            print(f"(a) and (b) route the same rows (bit-identical outputs): {row['same']}")
            if row["kernels_a"]:
                print(
                    "device time by kernel, us per step: (a), (b) for the same name, (a) - (b); XLA may number "
                    "fusions differently in (b)"
                )
                for title, key in (("top 10 of (a)", "kernels_a"), ("top 10 of (a) - (b)", "kernels_diff")):
                    print(f"  {title}:")
                    for k, a, b in row[key]:
                        print(f"  {a:10.1f} {b:10.1f} {a - b:10.1f}  {k[:90]}")
        print(
            f"old host estimate (route+map+count+state minus route, separate programs): {t_book * 1e3:.3f} ms "
            f"({t_book_route * 1e3:.3f} - {t_route * 1e3:.3f} ms)"
        )

    # Online quota routing needs the home layout: E/G experts per rank, (P-E)/G spare slots per rank.
    fetches = [f for f in args.online.split(",") if f]
    if set(fetches) - {"resident", "all_gather"}:
        raise ValueError(f"--online takes 'resident' and/or 'all_gather', got {args.online!r}")
    if fetches and (E % ranks or (P - E) % ranks or P == E):
        print(f"online rows skipped: E={E} and R={P - E} must be positive multiples of the EP size {ranks}")
        fetches = []
    if fetches:
        home = {name: put_host(w.astype(dtype), mesh, PS("ep")) for name, w in (("w_in", w_in), ("w_out", w_out))}
        resident = {name: put_host(w.astype(dtype), mesh, PS()) for name, w in (("w_in", w_in), ("w_out", w_out))}

    rows = []
    factors = [None if f == "none" else float(f) for f in args.capacity_factor.split(",")]
    for matmul, factor in [(m, f) for m in args.matmul.split(",") for f in factors]:
        label = f"{matmul}/{'worst' if factor is None else f'cf{factor:g}'}"
        apply = jax.jit(
            lambda *a, matmul=matmul, factor=factor: L.moe_apply(
                *a, top_k=K, mesh=mesh, matmul=matmul, map_implementation=args.map_impl, capacity_factor=factor
            )
        )
        try:
            t_init, (y_init, load_init) = bench(apply, operands(start, zipf_bias))
            if fitted is None:
                logical = np.bincount(start.phy2log[0], weights=total(load_init), minlength=E)[None]
                fitted = eplb_state.compute_placement(logical, config)
            ops_fit = operands(fitted, zipf_bias)
            t_fit, (y_fit, load_fit) = bench(apply, ops_fit)
            t_uni, (_, load_uni) = bench(apply, operands(uniform, flat_bias, x_uni, router_uni))
        except Exception:  # one implementation failing must not hide the others' figures
            traceback.print_exc()
            rows.append((label, None))
            continue
        same = bool(np.array_equal(np.asarray(y_init).view(np.uint16), np.asarray(y_fit).view(np.uint16)))
        loads_ok = int(total(load_init).sum()) == T * K == int(total(load_fit).sum())
        online = {}
        for fetch in fetches:
            run_online = jax.jit(
                lambda *a, matmul=matmul, factor=factor: online_moe_apply(
                    *a,
                    top_k=K,
                    mesh=mesh,
                    num_spare=(P - E) // ranks,
                    matmul=matmul,
                    map_implementation=args.map_impl,
                    capacity_factor=factor,
                )
            )
            try:
                t_onl, (y_onl, load_onl) = bench(
                    run_online, (x, router, zipf_bias, home, resident if fetch == "resident" else None)
                )
            except Exception:  # the online rows must not hide the others
                traceback.print_exc()
                online[fetch] = None
                continue
            same = same and bool(np.array_equal(np.asarray(y_init).view(np.uint16), np.asarray(y_onl).view(np.uint16)))
            loads_ok = loads_ok and int(total(load_onl).sum()) == T * K
            online[fetch] = (t_onl, balancedness(load_onl))
        rows.append(
            (
                label,
                dict(
                    t_init=t_init,
                    t_fit=t_fit,
                    t_uni=t_uni,
                    b_init=balancedness(load_init),
                    b_fit=balancedness(load_fit),
                    b_uni=balancedness(load_uni),
                    same=same,
                    loads_ok=loads_ok,
                    online=online,
                ),
            )
        )
        print(f"{label}: {rows[-1][1]}", flush=True)  # a run cut short still shows what it measured

    # The per-rank state layout the controller keeps: rank rows on their EP rank, counters replicated.
    book_config = EplbConfig(num_gpus=ranks, num_redundant_experts=P - E, window_size=args.window)
    make_state = lambda: eplb_state.init_state(book_config, 1, P, per_rank=True)
    state_sharding = jax.tree.map(lambda _: NamedSharding(mesh, PS()), jax.eval_shape(make_state))
    state_sharding = dataclasses.replace(
        state_sharding,
        pass_load=NamedSharding(mesh, PS(None, "ep", None)),
        window=NamedSharding(mesh, PS(None, None, "ep", None)),
    )
    state = jax.jit(make_state, out_shardings=state_sharding)()
    ops_fit = operands(fitted or start, zipf_bias)
    t_book_route = median_seconds(jax.jit(book), *ops_fit[:3], *ops_fit[4:], state, reps=args.iters)
    t_route = median_seconds(jax.jit(route_only), *ops_fit[:3], reps=args.iters)
    t_book = max(t_book_route - t_route, 0.0)
    try:
        book_row = bookkeeping(ops_fit, state, state_sharding, args.matmul.split(",")[0], factors[0])
    except Exception:  # must not hide the step-time rows
        traceback.print_exc()
        book_row = None

    print(
        f"\n=== MoE step ({ranks} x {jax.devices()[0].device_kind}; T={args.tokens}/rank, D={D}, H={H}, E={E}, "
        f"P={P}, top-{K}, bf16, map_and_count={args.map_impl or 'default'}) ==="
    )
    print("matmul/exchange: 'worst' = one worst-case all_to_all; 'cfX' = rounds of X times the balanced share")
    print(f"{'matmul/exchange':24s} {'routing / placement':26s} {'step ms':>9s} {'vs ideal':>9s} {'balancedness':>13s}")
    for label, r in rows:
        if r is None:
            print(f"{label:24s} FAILED (traceback above)")
            continue
        cases = [("zipf / initial", r["t_init"], r["b_init"]), ("zipf / EPLB", r["t_fit"], r["b_fit"])]
        cases += [(f"zipf / online {fetch}",) + (tb if tb else (None, None)) for fetch, tb in r["online"].items()]
        for name, t, b in cases + [("uniform (ideal)", r["t_uni"], r["b_uni"])]:
            if t is None:
                print(f"{label:24s} {name:26s} FAILED (traceback above)")
                continue
            print(f"{label:24s} {name:26s} {t * 1e3:9.3f} {t / r['t_uni']:9.3f} {b:13.3f}")
        print(f"{label:24s} outputs bit-identical across placements: {r['same']}; load sums exact: {r['loads_ok']}")
    print_bookkeeping(book_row, t_book, t_book_route, t_route)
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(
                dict(
                    ranks=ranks,
                    device=jax.devices()[0].device_kind,
                    bookkeeping_ms=t_book * 1e3,
                    bookkeeping=book_row,
                    rows={label: r for label, r in rows},
                ),
                f,
                indent=1,
            )


if __name__ == "__main__":
    sys.exit(main())

"""The EPLB bookkeeping of one MoE step, for ``benchmarks/moe_step.py``: (a) the EPLB step against (b) the same step
with the placement fixed and no EPLB work, in device and host time (that script's docstring says what each runs).

``b`` is ``moe_step.Bench``: the mesh, the shapes, the router and the per-case operands.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import numpy as np


def _book_runners(b, routing, ops, matmul, factor):
    """``(run_a, run_psum, run_b, ops_b)``: (a) the EPLB step, (a') with the load psum'd, (b) the fixed step and
    its operands (see ``moe_step.py``'s docstring)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as PS

    from moe_eplb_jax import moe
    from moe_eplb_jax import state as eplb_state
    from moe_eplb_jax.config import EplbConfig

    mesh, ranks, P = b.mesh, b.ranks, b.P
    x, router, bias, experts, log2phy, logcnt, lookup, shares = ops
    book_config = EplbConfig(num_gpus=ranks, num_redundant_experts=P - b.E, window_size=b.args.window)
    make_state = lambda: eplb_state.init_state(book_config, 1, P, per_rank=True)
    state_sharding = jax.tree.map(lambda _: NamedSharding(mesh, PS()), jax.eval_shape(make_state))
    state_sharding = dataclasses.replace(
        state_sharding,
        pass_load=NamedSharding(mesh, PS(None, "ep", None)),
        window=NamedSharding(mesh, PS(None, None, "ep", None)),
    )

    def eplb_step(*ops_and_state, load_reduce="none"):  # (a)
        *step_ops, state = ops_and_state
        out, load = b.stepper(routing, matmul, factor, load_reduce)(*step_ops)
        return out, eplb_state.end_step(eplb_state.record(state, load[None]))  # load: [G, P] or psum'd [P]

    def fixed_step(x, router, bias, experts, log2phy, replica):  # (b)
        def per_rank(x, router, bias, experts, log2phy, replica):
            ids, weights = moe.route(x, router, b.top_k, bias=bias)
            physical = log2phy[ids, replica]  # one gather, nothing counted
            return moe.routed_experts(  # moe_apply's own exchange + grouped MLP + combine
                x, physical, weights, experts, axis="ep", num_ranks=ranks, dispatch=b.dispatch_config(matmul, factor)
            )

        return jax.shard_map(
            per_rank,
            mesh=mesh,
            in_specs=(PS("ep"), PS(), PS(), PS("ep"), PS(), PS("ep")),
            out_specs=PS("ep"),
            check_vma=False,
        )(x, router, bias, experts, log2phy, replica)

    def replicas(x, router, bias, log2phy, logcnt, lookup, shares):  # the replica (a) picks per assignment
        def per_rank(x, router, bias, log2phy, logcnt, lookup, shares):
            ids, _ = moe.route(x, router, b.top_k, bias=bias)
            physical, _ = moe.map_replicas(  # exactly the layer's routing, plan included
                ids,
                log2phy,
                logcnt,
                routing=routing,
                num_physical=P,
                axis="ep",
                lookup=lookup,
                replica_shares=shares,
                implementation=b.args.map_impl,
            )
            return jnp.argmax(log2phy[ids] == physical[..., None], axis=-1).astype(jnp.int32)

        return jax.shard_map(
            per_rank, mesh=mesh, in_specs=(PS("ep"),) + (PS(),) * 6, out_specs=PS("ep"), check_vma=False
        )(x, router, bias, log2phy, logcnt, lookup, shares)

    def runner(state, sharding, load_reduce):
        # The state is donated, as EplbController.step does: the window row is written in place.
        step = jax.jit(
            functools.partial(eplb_step, load_reduce=load_reduce),
            donate_argnums=len(ops),
            out_shardings=(NamedSharding(mesh, PS("ep")), sharding),
        )
        held = [state]

        def run(*a):
            out, held[0] = step(*a, held[0])
            return out

        return run

    run_a = runner(jax.jit(make_state, out_shardings=state_sharding)(), state_sharding, "none")
    # (a'): the load psum'd every step, recorded into a replicated [W, 1, P] window.
    replicated = NamedSharding(mesh, PS())
    summed_state = jax.jit(lambda: eplb_state.init_state(book_config, 1, P), out_shardings=replicated)()
    run_psum = runner(summed_state, replicated, "psum")
    ops_b = (x, router, bias, experts, log2phy, jax.jit(replicas)(x, router, bias, log2phy, logcnt, lookup, shares))
    return run_a, run_psum, jax.jit(fixed_step), ops_b


def _book_column(times, step=None):
    """Medians -> ms of (a), (b), (a) - (b), % of the step; the same for (a')."""
    if any(t is None for t in times["a"] + times["b"] + times["psum"]):
        return None
    a, bb, p = (float(np.median(times[k])) for k in ("a", "b", "psum"))
    step = a if step is None else step  # the (a) step time the percentages are of
    return dict(
        a_ms=a * 1e3,
        b_ms=bb * 1e3,
        book_ms=(a - bb) * 1e3,
        pct=100 * (a - bb) / step,
        psum_ms=p * 1e3,
        psum_book_ms=(p - bb) * 1e3,
        psum_pct=100 * (p - bb) / step,
    )


def bookkeeping(b, routing, ops, matmul, factor, label):
    """(a) the EPLB step vs (b) the same step, fixed placement, no EPLB work (see ``moe_step.py``'s docstring);
    ``label`` names the matmul / exchange in the row."""
    try:  # run as a script: benchmarks/ is on sys.path
        from _timing import device_seconds, median_seconds
    except ImportError:
        from benchmarks._timing import device_seconds, median_seconds

    args = b.args
    run_a, run_psum, run_b, ops_b = _book_runners(b, routing, ops, matmul, factor)
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
    names = set(kernels["a"]) | set(kernels["b"])
    table = [(k, kernels["a"][k] * 1e6, kernels["b"][k] * 1e6) for k in names]
    return dict(
        case=label,
        window=args.window,
        same=same,
        device=_book_column(device),
        compute=_book_column(compute, None if device["a"][0] is None else float(np.median(device["a"]))),
        host=_book_column(host),
        kernels_a=sorted(table, key=lambda r: -r[1])[:10],
        kernels_diff=sorted(table, key=lambda r: r[2] - r[1])[:10],
    )


def print_bookkeeping(routing, where, row):
    print(f"\nEPLB bookkeeping per step, routing {routing!r} on the {where} placement", end="")
    if row is None:
        print(": FAILED (traceback above)")
        return
    extra = " (+ all_gather + plan + reroute)" if routing == "quota" else ""
    print(f", {row['case']}, window {row['window']} steps: mapping + counting{extra} + state update")
    print(f"{'':44s} {'device ms':>10s} {'w/o NCCL':>10s} {'host ms':>10s}")
    cols = (row["device"], row["compute"], row["host"])
    for name, key, fmt in (
        ("(a) EPLB step", "a_ms", "{:10.3f}"),
        ("(b) fixed placement, no EPLB work", "b_ms", "{:10.3f}"),
        ("bookkeeping (a) - (b)", "book_ms", "{:10.3f}"),
        ("bookkeeping, % of (a) (device: all kernels)", "pct", "{:9.2f}%"),
        ("(a') + load psum every step", "psum_ms", "{:10.3f}"),
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
            for k, a, bb in row[key]:
                print(f"  {a:10.1f} {bb:10.1f} {a - bb:10.1f}  {k[:90]}")

"""MoE layer step time under Zipf-skewed routing: initial placement vs EPLB placement vs uniform routing.

    PYTHONPATH=. python3 benchmarks/moe_step.py --ranks 2            # 2 GPUs
    PYTHONPATH=. python3 benchmarks/moe_step.py --cpu-devices 8 --small   # smoke run on CPU

Prints, side by side in one run: the forward step time of one expert-parallel
MoE layer (dispatch all_to_all + grouped expert matmul + combine) with the
initial (linear) placement, with the EPLB placement fitted to the measured
load, and with uniform routing (the ideal); the balancedness of each; and the
EPLB bookkeeping (map_and_count + load psum + EplbState record/end_step) as a
fraction of the layer step. Also checks that the outputs under the two
placements are bit-identical (placement invariance on this backend).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _args():
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=None)
    p.add_argument("--cpu-devices", type=int, default=0)
    p.add_argument("--small", action="store_true")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--redundant", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--zipf", type=float, default=1.2)
    p.add_argument("--matmul", default="dense")
    p.add_argument("--map-impl", default=None, help="map_and_count implementation (None: its default)")
    p.add_argument("--iters", type=int, default=20)
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

    from moe_eplb_jax import metrics, state as eplb_state
    from moe_eplb_jax.flax import layer as L
    from moe_eplb_jax.pallas import map_and_count
    from moe_eplb_jax.placement import Placement
    from moe_eplb_jax.state import EplbConfig

    ranks = args.ranks or jax.device_count()
    mesh = jax.make_mesh((ranks,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:ranks])
    E, P, D, H, K = args.experts, args.experts + args.redundant, args.dim, args.hidden, args.top_k
    T = args.tokens * ranks
    rng = np.random.default_rng(0)
    dtype = jnp.bfloat16
    w_in = rng.standard_normal((E, D, 2 * H)).astype(np.float32) * D**-0.5
    w_out = rng.standard_normal((E, H, D)).astype(np.float32) * H**-0.5
    router = rng.standard_normal((D, E)).astype(np.float32) * D**-0.5
    zipf_bias = (-args.zipf * np.log1p(np.arange(E))).astype(np.float32) * 4.0
    flat_bias = np.zeros(E, np.float32)
    x = L._put(rng.standard_normal((T, D)).astype(np.float32).astype(dtype), mesh, jax.sharding.PartitionSpec("ep"))

    apply = jax.jit(lambda *a: L.moe_apply(*a, top_k=K, mesh=mesh, matmul=args.matmul,
                                                 map_implementation=args.map_impl))

    def operands(placement, bias):
        phy = placement.phy2log[0]
        slots = jax.sharding.PartitionSpec("ep")
        return (x, L._put(router, mesh, jax.sharding.PartitionSpec()), L._put(bias, mesh, jax.sharding.PartitionSpec()),
                L._put(w_in[phy].astype(dtype), mesh, slots), L._put(w_out[phy].astype(dtype), mesh, slots),
                L._put(placement.log2phy[0], mesh, jax.sharding.PartitionSpec()),
                L._put(placement.logcnt[0], mesh, jax.sharding.PartitionSpec()))

    def bench(fn, ops):
        out = fn(*ops)
        jax.block_until_ready(out)
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*ops))
            times.append(time.perf_counter() - t0)
        return float(np.median(times)), out

    # Initial placement: experts in id order, redundant slots on the coldest experts (hot ones share rank 0).
    initial = np.concatenate([np.arange(E), np.arange(E - 1, E - 1 - (P - E), -1)])
    linear = Placement.from_phy2log(initial[None], E, num_ranks=ranks)
    ops_lin = operands(linear, zipf_bias)
    t_lin, (y_lin, load_lin) = bench(apply, ops_lin)
    load_lin = np.asarray(load_lin)[None]
    logical = np.bincount(linear.phy2log[0], weights=load_lin[0], minlength=E)[None]
    config = EplbConfig(num_redundant_experts=P - E, num_gpus=ranks)
    fitted = eplb_state.compute_placement(logical, config)
    ops_fit = operands(fitted, zipf_bias)
    t_fit, (y_fit, load_fit) = bench(apply, ops_fit)
    ops_uni = operands(linear, flat_bias)
    t_uni, (_, load_uni) = bench(apply, ops_uni)
    same = bool(np.array_equal(np.asarray(y_lin).view(np.uint16), np.asarray(y_fit).view(np.uint16)))
    bal = {name: float(metrics.balancedness(metrics.rank_load(np.asarray(l)[None], ranks)))
           for name, l in (("initial", load_lin), ("eplb", load_fit), ("uniform", load_uni))}

    # Bookkeeping: routing map + count per rank, load psum, EplbState update (one layer).
    def book(x, router, bias, log2phy, logcnt, state):
        def per_rank(x, router, bias, log2phy, logcnt):
            ids, _ = L.route(x, router, top_k=K, bias=bias)
            _, load = map_and_count(ids, log2phy, logcnt, num_physical=P, implementation=args.map_impl)
            return jax.lax.psum(load, "ep")
        sm = jax.shard_map(per_rank, mesh=mesh, in_specs=(jax.sharding.PartitionSpec("ep"),) + (jax.sharding.PartitionSpec(),) * 4,
                           out_specs=jax.sharding.PartitionSpec(), check_vma=False)
        load = sm(x, router, bias, log2phy, logcnt)
        return eplb_state.end_step(eplb_state.record(state, load[None]))

    def route_only(x, router, bias):
        def per_rank(x, router, bias):
            return L.route(x, router, top_k=K, bias=bias)[0]
        return jax.shard_map(per_rank, mesh=mesh, in_specs=(jax.sharding.PartitionSpec("ep"),) + (jax.sharding.PartitionSpec(),) * 2,
                             out_specs=jax.sharding.PartitionSpec("ep"), check_vma=False)(x, router, bias)

    st = eplb_state.init_state(EplbConfig(num_gpus=ranks, num_redundant_experts=P - E, window_size=64), 1, P)
    st = jax.tree.map(lambda a: L._put(np.asarray(a), mesh, jax.sharding.PartitionSpec()), st)
    t_book_route, _ = bench(jax.jit(book), (ops_fit[0], ops_fit[1], ops_fit[2], ops_fit[5], ops_fit[6], st))
    t_route, _ = bench(jax.jit(route_only), ops_fit[:3])
    t_book = max(t_book_route - t_route, 0.0)

    dev = jax.devices()[0].device_kind
    print(f"\n=== MoE step ({ranks} x {dev}; T={args.tokens}/rank, D={D}, H={H}, E={E}, P={P}, top-{K}, bf16, "
          f"matmul={args.matmul}, map_and_count={args.map_impl or 'default'}) ===")
    print(f"{'routing / placement':28s} {'step ms':>9s} {'vs ideal':>9s} {'balancedness':>13s}")
    for name, t, b in (("zipf / initial", t_lin, bal["initial"]), ("zipf / EPLB", t_fit, bal["eplb"]),
                       ("uniform / initial (ideal)", t_uni, bal["uniform"])):
        print(f"{name:28s} {t * 1e3:9.3f} {t / t_uni:9.3f} {b:13.3f}")
    print(f"EPLB bookkeeping (map+count+psum+state): {t_book * 1e3:.3f} ms = {100 * t_book / t_fit:.2f}% of the EPLB step "
          f"(route+bookkeeping {t_book_route * 1e3:.3f} ms, route alone {t_route * 1e3:.3f} ms)")
    print(f"outputs bit-identical under initial and EPLB placement: {same}")
    print(f"load sums: {int(np.asarray(load_lin).sum())} {int(np.asarray(load_fit).sum())} (expect {T * K})")


if __name__ == "__main__":
    sys.exit(main())

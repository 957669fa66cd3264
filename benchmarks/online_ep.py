"""Online (quota) balancing inside the step on an EP mesh: all_gather of counts + plan_quotas + quota reroute.

    PYTHONPATH=. python3 benchmarks/online_ep.py --ranks 8                  # EP8 (issue 8), real GPUs
    PYTHONPATH=. python3 benchmarks/online_ep.py --cpu-devices 8 --small    # CPU smoke run

Setting (default): G ranks, E = 256 experts (E / G home experts per rank),
4 spare slots per rank (P = 288 at EP8: DeepSeek-V3's slot count), top-8,
8,192 tokens per rank, Zipf-skewed token-level routing (``sim.zipf_topk``) at
initial rank imbalance ``--imbalance``. Per layer, every rank

1. counts its own tokens per logical expert (``[E]``),
2. all_gathers the counts over the EP axis (``[G, E]``, ``G * E * 4`` bytes),
3. runs ``plan_quotas`` on them (every rank computes the same plan),
4. reroutes its own tokens with ``map_and_count(mode="quota")`` and its quota row.

Timed per layer as ``--layers`` dependent layers in one jit divided by the
layer count (host dispatch amortised, as inside a model step): the whole chain,
and each stage alone. Printed next to the chain: the all_gather alone (the
collective's floor, pure latency at 8 KiB) and UltraEP's reported figure
(~0.07 ms planner + ~0.04 ms reroute); the target is <= 0.1 ms per layer.
Correctness: each rank's routed slot loads, summed over ranks, give per-rank
loads equal to the plan's ``rank_load`` (so every rank computed the same plan),
and the load sums are exact.

Beside it, the MoE layer's own ``routing="quota"`` (its replicas fixed between
the controller's refreshes): the same all_gather, then ``plan_fixed_quotas``
(per-batch LP shares over the replicas of a placement the ``online`` policy
fitted to the expected loads, rounded to per-source quotas) and the
``map_and_count(mode="quota")`` reroute -- ``routing.batch_quotas`` + the map,
exactly as ``moe_apply`` runs them -- timed the same way; its routed loads must
equal its plan's, and its final imbalance is printed beside the free-spare
plan's. ``benchmarks/moe_step.py`` times the layer's whole step per mode.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import median_seconds


# ------------------------------------------------------------- planner timing
def _args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=None, help="EP ranks (default: every device)")
    p.add_argument("--cpu-devices", type=int, default=0, help="simulate this many CPU devices")
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--spare", type=int, default=4, help="spare slots per rank")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--imbalance", type=float, default=2.0, help="initial rank imbalance of the Zipf loads")
    p.add_argument("--layers", type=int, default=8, help="dependent layers per timed call")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument(
        "--planners",
        default=None,
        help="comma-separated plan_quotas implementations (default: pallas,xla on GPU, xla elsewhere)",
    )
    p.add_argument("--json", default=None, help="write the figures here")
    return p.parse_args()


class Stages:
    """The per-layer stages on the EP mesh, each over ``NL`` dependent layers (see the module docstring).

    Every stage threads a zero carry (min(x, 0) of its output, unknown to the compiler) into the next layer's
    input, so layers run one after another as inside a model.
    """

    def __init__(self, args, mesh, G: int):
        self.mesh, self.G = mesh, G
        self.E, self.S, self.T, self.K, self.NL = args.experts, args.spare, args.tokens, args.top_k, args.layers
        self.H = self.E // G
        self.P = G * (self.H + self.S)

    def count(self, ids_l):
        import jax.numpy as jnp

        return jnp.zeros((self.E,), jnp.int32).at[ids_l.reshape(-1)].add(jnp.int32(1))

    def plan(self, counts, implementation):
        from moe_eplb_jax.routing import plan_quotas

        return plan_quotas(counts, num_home=self.H, num_spare=self.S, implementation=implementation)

    def reroute(self, ids_l, quota, log2phy, logcnt):  # quota [G, E, R]: this rank takes its row
        import jax
        import jax.numpy as jnp

        from moe_eplb_jax.routing import map_and_count

        rank = jax.lax.axis_index("ep").astype(jnp.int32)
        mine = jax.lax.dynamic_index_in_dim(quota, rank, 0, keepdims=False)
        return map_and_count(ids_l, log2phy, logcnt, num_physical=self.P, mode="quota", quotas=mine)

    def smap(self, fn, in_specs):
        import jax
        from jax.sharding import PartitionSpec as PS

        return jax.jit(jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=PS("ep"), check_vma=False))

    def chain(self, ids, implementation):  # the whole per-layer path; returns this rank's routed loads [1, NL, P]
        import jax
        import jax.numpy as jnp

        carry, loads = jnp.zeros((), jnp.int32), []
        for layer in range(self.NL):
            counts = jax.lax.all_gather(self.count(ids[layer]) + carry, "ep")
            p = self.plan(counts, implementation)
            _, load = self.reroute(ids[layer], p.quota, p.log2phy, p.logcnt)
            carry = jnp.minimum(load[0], 0)
            loads.append(load)
        return jnp.stack(loads)[None]

    def count_gather(self, ids):
        import jax
        import jax.numpy as jnp

        carry = jnp.zeros((), jnp.int32)
        for layer in range(self.NL):
            carry = jnp.minimum(jax.lax.all_gather(self.count(ids[layer]) + carry, "ep")[0, 0], 0)
        return carry[None]

    def gather_alone(self, counts):  # the raw collective: all_gather of an [E] int32 row
        import jax
        import jax.numpy as jnp

        carry = jnp.zeros((), jnp.int32)
        rank = jax.lax.axis_index("ep")
        for layer in range(self.NL):
            carry = jnp.minimum(jax.lax.all_gather(counts[layer, rank] + carry, "ep")[0, 0], 0)
        return carry[None]

    def plan_alone(self, counts, implementation):
        import jax.numpy as jnp

        carry = jnp.zeros((), jnp.int32)
        for layer in range(self.NL):
            carry = jnp.minimum(self.plan(counts[layer] + carry, implementation).target, 0)
        return carry[None]

    def reroute_alone(self, ids, quota, log2phy, logcnt):
        import jax.numpy as jnp

        carry = jnp.zeros((), jnp.int32)
        for layer in range(self.NL):
            _, load = self.reroute(ids[layer] + carry, quota[layer], log2phy[layer], logcnt[layer])
            carry = jnp.minimum(load[0], 0)
        return carry[None]

    def chain_fixed(self, ids, log2phy, logcnt):  # count + all_gather + plan + reroute, as moe_apply runs them
        import jax.numpy as jnp

        from moe_eplb_jax.routing import batch_quotas, map_and_count

        P, carry, loads = self.P, jnp.zeros((), jnp.int32), []
        for layer in range(self.NL):
            mine = batch_quotas(ids[layer] + carry, log2phy[layer], logcnt[layer], axis_name="ep", num_physical=P)
            _, load = map_and_count(
                ids[layer], log2phy[layer], logcnt[layer], num_physical=P, mode="quota", quotas=mine
            )
            carry = jnp.minimum(load[0], 0)
            loads.append(load)
        return jnp.stack(loads)[None]

    def plan_fixed_alone(self, counts, log2phy, logcnt):
        import jax.numpy as jnp

        from moe_eplb_jax.routing import plan_fixed_quotas

        carry = jnp.zeros((), jnp.int32)
        for layer in range(self.NL):
            plan = plan_fixed_quotas(counts[layer] + carry, log2phy[layer], logcnt[layer], num_physical=self.P)
            carry = jnp.minimum(plan.rank_load[0], 0)
        return carry[None]


def _time_planners(st: Stages, planners, ids, counts_host, counts_rep, reps):
    """The free-spare planner per implementation: ``(per_layer seconds, finals, correct)``."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as PS

    G, NL, P, H, S = st.G, st.NL, st.P, st.H, st.S
    ids_spec, rep = PS(None, "ep"), NamedSharding(st.mesh, PS())
    per_layer, finals, correct, reference = {}, {}, {}, None
    for impl in planners:
        # One failing planner implementation (e.g. its kernel inside shard_map) must not hide the other's figures.
        try:
            plans = jax.jit(jax.vmap(functools.partial(st.plan, implementation=impl)))(jnp.asarray(counts_host))
            chain_fn = st.smap(functools.partial(st.chain, implementation=impl), (ids_spec,))
            loads = np.asarray(chain_fn(ids)).reshape(G, NL, P)  # per rank
            slot_load = loads.sum(0)  # [NL, P]
            rank_load = slot_load.reshape(NL, G, H + S).sum(2)
            # The routed loads equal the plan's only if every rank computed the plan of the all_gathered counts.
            correct[impl] = bool(np.array_equal(rank_load, np.asarray(plans.rank_load))) and bool(
                np.all(slot_load.sum(1) == G * st.T * st.K)
            )
            finals[impl] = float(np.mean(rank_load.max(1) / rank_load.mean(1)))
            per_layer[f"all_gather + plan + reroute, planner {impl}"] = median_seconds(chain_fn, ids, reps=reps)
            per_layer[f"  plan_quotas alone, {impl}"] = median_seconds(
                st.smap(functools.partial(st.plan_alone, implementation=impl), (PS(),)), counts_rep, reps=reps
            )
            reference = reference or plans
        except Exception:
            traceback.print_exc()
            correct[impl] = False
    per_layer["  count + all_gather"] = median_seconds(st.smap(st.count_gather, (ids_spec,)), ids, reps=reps)
    per_layer["  all_gather alone (floor of the collective)"] = median_seconds(
        st.smap(st.gather_alone, (PS(),)), counts_rep, reps=reps
    )
    if reference is not None:
        tables = [jax.device_put(np.asarray(a), rep) for a in (reference.quota, reference.log2phy, reference.logcnt)]
        per_layer["  reroute alone (quota map_and_count)"] = median_seconds(
            st.smap(st.reroute_alone, (ids_spec, PS(), PS(), PS())), ids, *tables, reps=reps
        )
    return per_layer, finals, correct


def _time_fixed(st: Stages, imbalance, ids, counts_host, counts_rep, reps):
    """The MoE layer's routing="quota": replicas of a placement the online policy fitted to the expected loads.

    Returns ``(per_layer seconds, final imbalance, correct)``; ``None`` figures where it failed.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as PS

    from moe_eplb_jax.policy.online import online_policy
    from moe_eplb_jax.routing import plan_fixed_quotas
    from moe_eplb_jax.sim import zipf_popularity

    G, NL, P, H, S = st.G, st.NL, st.P, st.H, st.S
    rep = NamedSharding(st.mesh, PS())
    expected = np.stack([zipf_popularity(st.E, G, imbalance, seed=100 + i) for i in range(NL)]) * (G * st.T * st.K)
    _, fixed_log2phy, fixed_logcnt = online_policy(expected, P, 1, 1, G)
    fixed_tables = [jax.device_put(a, rep) for a in (fixed_log2phy, fixed_logcnt)]
    per_layer, final = {}, None
    try:
        chain_fn = st.smap(st.chain_fixed, (PS(None, "ep"), PS(), PS()))
        slot_load = np.asarray(chain_fn(ids, *fixed_tables)).reshape(G, NL, P).sum(0)
        rank_load = slot_load.reshape(NL, G, H + S).sum(2)
        planned = jax.jit(jax.vmap(functools.partial(plan_fixed_quotas, num_physical=P)))(
            jnp.asarray(counts_host), *fixed_tables
        )
        correct = bool(np.array_equal(rank_load, np.asarray(planned.rank_load))) and bool(
            np.all(slot_load.sum(1) == G * st.T * st.K)
        )
        final = float(np.mean(rank_load.max(1) / rank_load.mean(1)))
        per_layer["layer quota: all_gather + fixed plan + reroute"] = median_seconds(
            chain_fn, ids, *fixed_tables, reps=reps
        )
        per_layer["  plan_fixed_quotas alone"] = median_seconds(
            st.smap(st.plan_fixed_alone, (PS(), PS(), PS())), counts_rep, *fixed_tables, reps=reps
        )
    except Exception:
        traceback.print_exc()
        return per_layer, final, False
    return per_layer, final, correct


def _print_result(st: Stages, device_kind, initial, finals, correct, per_layer, best, reps):
    G, NL = st.G, st.NL
    print(
        f"\n=== online planner at EP{G} ({device_kind}): E={st.E}, {st.H} home + {st.S} spare/rank "
        f"(P={st.P}), top-{st.K}, {st.T} tokens/rank; per layer = {NL} dependent layers in one jit / {NL}, "
        f"median of {reps} ==="
    )
    print(
        f"rank imbalance: initial {initial:.4f} -> final "
        + ", ".join(f"{v:.4f} ({k})" for k, v in finals.items())
        + f" (mean over {NL} layers; target <= 1.01)"
    )
    print("routed loads == plan on every rank, load sums exact: " + ", ".join(f"{k} {v}" for k, v in correct.items()))
    print(f"{'stage':<52} {'ms/layer':>9}")
    for name, ms in per_layer.items():
        print(f"{name:<52} {ms:9.4f}")
    print(f"{'UltraEP (reported): planner ~0.07 + reroute ~0.04':<52} {0.11:9.4f}")
    floor = per_layer["  all_gather alone (floor of the collective)"]
    print(
        f"best chain {best:.4f} ms: {best / 0.1:.2f}x the 0.1 ms target, {best / 0.11:.2f}x UltraEP, "
        f"{best / floor:.1f}x the all_gather floor"
    )


def main():
    args = _args()
    if args.cpu_devices:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.cpu_devices}"
    if args.small:
        args.experts, args.spare, args.tokens, args.top_k, args.layers, args.reps = 32, 2, 256, 4, 2, 3
    import jax  # after the device count is set
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as PS

    from moe_eplb_jax.sim import zipf_topk

    G = args.ranks or jax.device_count()
    if args.planners is None:
        args.planners = "pallas,xla" if jax.default_backend() == "gpu" else "xla"
    if args.experts % G:
        raise SystemExit(f"--experts {args.experts} must be divisible by the EP size {G}")
    mesh = jax.make_mesh((G,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:G])
    st = Stages(args, mesh, G)
    E, T, K, NL, H = st.E, st.T, st.K, st.NL, st.H
    print(
        f"devices: {G} x {jax.devices()[0].device_kind}; jax {jax.__version__}; E={E} ({H} home + {st.S} spare per "
        f"rank, P={st.P}), top-{K}, {T} tokens/rank, {NL} layers per call",
        flush=True,
    )

    # ids [NL, G*T, K]: layer l, rank g's tokens at rows g*T..(g+1)*T.
    ids_host = np.stack([zipf_topk(G, E, T, K, args.imbalance, seed=100 + i).reshape(G * T, K) for i in range(NL)])
    ids = jax.device_put(ids_host, NamedSharding(mesh, PS(None, "ep")))
    counts_host = np.stack(
        [
            np.stack([np.bincount(ids_host[i, g * T : (g + 1) * T].ravel(), minlength=E) for g in range(G)])
            for i in range(NL)
        ]
    ).astype(np.int32)  # [NL, G, E]
    counts_rep = jax.device_put(counts_host, NamedSharding(mesh, PS()))
    home = counts_host.sum(1).reshape(NL, G, H).sum(2)
    initial = float(np.mean(home.max(1) / home.mean(1)))

    reps, planners = args.reps, args.planners.split(",")
    per_layer, finals, correct = _time_planners(st, planners, ids, counts_host, counts_rep, reps)
    fixed = "fixed replicas (layer quota)"
    fixed_layer, fixed_final, correct[fixed] = _time_fixed(st, args.imbalance, ids, counts_host, counts_rep, reps)
    per_layer.update(fixed_layer)
    if fixed_final is not None:
        finals[fixed] = fixed_final
    per_layer = {k: v * 1e3 / NL for k, v in per_layer.items()}
    chains = {k: v for k, v in per_layer.items() if k.startswith("all_gather + plan")}
    best = min(chains.values()) if chains else float("nan")
    ok = bool(correct) and all(correct.values())
    result = dict(
        ranks=G,
        experts=E,
        home=H,
        spare=st.S,
        slots=st.P,
        tokens=T,
        top_k=K,
        layers=NL,
        initial_imbalance=initial,
        final_imbalance=finals,
        correct=correct,
        best_chain_ms=best,
        per_layer_ms=per_layer,
        device=jax.devices()[0].device_kind,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    _print_result(st, jax.devices()[0].device_kind, initial, finals, correct, per_layer, best, reps)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

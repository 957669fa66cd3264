"""Every replica-routing mode through the MoE layer, and the tables behind them.

Placement invariance after a rearrangement (bit for bit), recorded loads equal
to the rows each slot computed, padding never counted, the per-batch quota
planner (invariants, quality against HiGHS, Zipf balance on 8 devices),
``routing_tables``, mode switching, and the online policy's refresh.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import ep_mesh, identity_router, one_hot_tokens, random_placement
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as PS

from moe_eplb_jax.flax import MoELayer
from moe_eplb_jax.moe import DispatchConfig, RouterConfig, moe_apply, route, shared_mlp, waterfill_shared_mlp
from moe_eplb_jax.moe import apply as apply_module
from moe_eplb_jax.placement import Placement, build_log2phy
from moe_eplb_jax.policy.online import keep_spare_slots, online_policy
from moe_eplb_jax.routing import (
    ROUTING_MODES,
    equal_shares,
    lp_shares,
    lp_shares_reference,
    plan_fixed_quotas,
    routing_tables,
    waterfill_shares,
)
from moe_eplb_jax.sim import zipf_popularity, zipf_topk
from moe_eplb_jax.transport import put_host, rearrange_experts

G, E, P, D, H, K = 4, 8, 12, 16, 8, 2
S = P - E + 1
pytestmark = pytest.mark.devices(G)  # skipped on fewer devices, where MESH is None
MESH = ep_mesh(G)


def _random_placement(rng, num_logical=E, num_physical=P):
    return random_placement(rng, num_logical, num_physical)


# ------------------------------------------------------------- the planner
@functools.cache
def _planner(num_physical, source=False):
    plan = functools.partial(plan_fixed_quotas, num_physical=num_physical)
    if source:
        return jax.jit(lambda c, t, n, g: plan(c, t, n, source=g).quota)
    return jax.jit(plan)


@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([0, 1, 7, 300]))
def test_fixed_quotas_route_every_token_to_a_replica(seed, scale):
    """Quotas sum to each source's counts, replica loads to the quotas, nothing to a missing or duplicate replica."""
    rng = np.random.default_rng(seed)
    placement = _random_placement(rng)
    log2phy, logcnt = placement.log2phy[0], placement.logcnt[0]
    counts = (rng.pareto(1.2, (G, E)) * scale).astype(np.int32)
    plan = _planner(P)(counts, log2phy, logcnt)
    quota, replica_load, rank_load = (np.asarray(a) for a in (plan.quota, plan.replica_load, plan.rank_load))
    assert quota.shape == (G, E, S) and quota.dtype == np.int32
    assert np.all(quota >= 0)
    np.testing.assert_array_equal(quota.sum(2), counts)
    np.testing.assert_array_equal(quota.sum(0), replica_load)
    rank = np.where(log2phy >= 0, log2phy // (P // G), -1)
    live = np.arange(S)[None, :] < logcnt[:, None]
    second = np.zeros_like(live)  # a second replica of an expert on one rank serves nothing
    for e in range(E):
        for s in range(1, logcnt[e]):
            second[e, s] = rank[e, s] in rank[e, :s]
    assert not replica_load[~live | second].any()
    np.testing.assert_array_equal(rank_load, [replica_load[(rank == g) & live].sum() for g in range(G)])
    for g in (0, G - 1):  # one source's row, as each rank computes it inside the layer
        row = _planner(P, source=True)(counts, log2phy, logcnt, jnp.int32(g))
        np.testing.assert_array_equal(np.asarray(row), quota[g])


def test_fixed_quotas_near_the_lp_optimum(rng):
    """The per-batch plan's largest rank load against HiGHS' optimum on the same replicas."""
    ratios = []
    for _ in range(6):
        placement = _random_placement(rng, 16, 24)
        log2phy, logcnt = placement.log2phy[0], placement.logcnt[0]
        counts = (rng.lognormal(0.0, 1.2, (G, 16)) * 200).astype(np.int32)
        plan = _planner(24)(counts, log2phy, logcnt)
        _, optimum = lp_shares_reference(counts.sum(0), log2phy, logcnt, num_physical=24, num_ranks=G)
        worst = int(np.max(np.asarray(plan.rank_load)))
        assert worst >= optimum - 1e-6 * optimum  # no integer split beats the LP
        ratios.append(worst / optimum)
    assert max(ratios) <= 1.05, ratios


def test_fixed_quotas_reject_bad_input():
    placement = Placement.linear(1, E, P)
    tables = (placement.log2phy[0], placement.logcnt[0])
    with pytest.raises(ValueError, match="counts must have shape"):
        plan_fixed_quotas(np.zeros(E, np.int32), *tables, num_physical=P)
    with pytest.raises(ValueError, match="integers"):
        plan_fixed_quotas(np.zeros((G, E), np.float32), *tables, num_physical=P)
    with pytest.raises(ValueError, match="non-negative"):
        plan_fixed_quotas(-np.ones((G, E), np.int32), *tables, num_physical=P)
    with pytest.raises(ValueError, match="divisible"):
        plan_fixed_quotas(np.zeros((5, E), np.int32), *tables, num_physical=P)
    with pytest.raises(ValueError, match="log2phy must have shape"):
        plan_fixed_quotas(np.zeros((G, E + 1), np.int32), *tables, num_physical=P)


# ----------------------------------------------------------- routing tables
def test_routing_tables_solve_lp_shares_per_layer(rng):
    placements = [_random_placement(rng) for _ in range(3)]
    placement = Placement.from_phy2log(np.concatenate([p.phy2log for p in placements]), E)
    load = rng.lognormal(0.0, 1.0, (3, E)).astype(np.float32) * 100
    tables = routing_tables("lp", load, placement, num_ranks=G)
    assert len(tables) == 3
    for layer, table in enumerate(tables):
        shares = table["replica_shares"]
        assert set(table) == {"replica_shares"} and shares.shape == (E, S) and shares.dtype == np.float32
        want, _ = lp_shares(load[layer], placement.log2phy[layer], placement.logcnt[layer], num_physical=P, num_ranks=G)
        np.testing.assert_allclose(shares, np.asarray(want), rtol=1e-6, atol=1e-7)
        live = np.arange(S)[None, :] < placement.logcnt[layer][:, None]
        np.testing.assert_allclose(shares.sum(1), 1.0, rtol=1e-5)
        assert not shares[~live].any()
    for mode in ("hash", "round_robin", "quota"):
        assert routing_tables(mode, load, placement, num_ranks=G) == [{}, {}, {}]
    with pytest.raises(ValueError, match="routing must be one of"):
        routing_tables("shares", load, placement, num_ranks=G)
    with pytest.raises(ValueError, match="logical_load must have shape"):
        routing_tables("lp", load[:2], placement, num_ranks=G)
    with pytest.raises(ValueError, match="non-negative"):
        routing_tables("lp", -load, placement, num_ranks=G)
    with pytest.raises(ValueError, match="num_ranks"):
        routing_tables("lp", load, placement, num_ranks=5)
    np.testing.assert_allclose(equal_shares(np.array([1, 3]), 3), [[1, 0, 0], [1 / 3, 1 / 3, 1 / 3]], rtol=1e-7)


# ------------------------------------------------------------------ layer
def _layer(routing, shared_expert="local", seed=3, mesh=MESH, batch_axes=None):
    return MoELayer(
        D,
        H,
        E,
        K,
        mesh=mesh,
        num_physical=P,
        shared_hidden=4,
        routing=routing,
        dispatch=DispatchConfig(shared_expert=shared_expert, batch_axes=batch_axes),
        rngs=nnx.Rngs(seed),
    )


def _move(layer, new, **tables):
    """Rearranges ``layer``'s experts in place to ``new`` (the transport), then installs its tables."""
    old = np.asarray(layer.phy2log.get_value())
    variables = layer.eplb_expert_variables()
    moved = rearrange_experts(
        {k: v.get_value() for k, v in variables.items()}, old, new.phy2log[0], mesh=layer.mesh, num_logical=E
    )
    for k, v in variables.items():
        v.set_value(moved[k])
    layer.eplb_set_placement(new.phy2log[0], new.log2phy[0], new.logcnt[0], **tables)


def _from_checkpoint(layer, new, **tables):
    """``layer`` (on the linear start, slot ``e < E`` holding expert ``e``) loaded from a permuted checkpoint."""
    for var in layer.eplb_expert_variables().values():
        logical = np.asarray(var.get_value())[:E]
        var.set_value(put_host(logical[new.phy2log[0]], layer.mesh, PS("ep")))
    layer.eplb_set_placement(new.phy2log[0], new.log2phy[0], new.logcnt[0], **tables)


_SERVED: dict[int, np.ndarray] = {}  # one dict: a compiled forward keeps the callback of its first trace


def _record_served(rank, group_sizes):
    _SERVED[int(rank)] = np.asarray(group_sizes)


@pytest.fixture
def served(monkeypatch):
    """Records, per EP rank, the rows each local slot computed in the layer's grouped expert MLP."""
    original = apply_module.expert_mlp

    def expert_mlp(x, experts, group_sizes, **kw):
        jax.debug.callback(_record_served, jax.lax.axis_index("ep"), group_sizes)
        return original(x, experts, group_sizes, **kw)

    monkeypatch.setattr(apply_module, "expert_mlp", expert_mlp)
    _SERVED.clear()
    return _SERVED


FORWARD = nnx.jit(lambda module, x, valid: module(x, valid=valid))


# Every mode, each shared-expert placement twice.
CASES = [("hash", "local"), ("round_robin", "waterfill"), ("lp", "local"), ("quota", "waterfill")]
assert {mode for mode, _ in CASES} == set(ROUTING_MODES)


@pytest.mark.parametrize("routing, shared_expert", CASES)
def test_every_mode_after_rearrangement_equals_the_permuted_checkpoint(rng, served, routing, shared_expert):
    new = _random_placement(rng)
    load = rng.lognormal(0.0, 1.0, (1, E)) * 100
    tables = routing_tables(routing, load, new, num_ranks=G)[0]
    moved = _layer(routing, shared_expert)
    _move(moved, new, **tables)
    loaded = _layer(routing, shared_expert)
    _from_checkpoint(loaded, new, **tables)
    x = jnp.asarray(rng.standard_normal((G * 6, D)).astype(np.float32))
    valid = rng.random(G * 6) < 0.7
    valid[6:12] = False  # one rank with no real token

    out = np.asarray(FORWARD(moved, x, jnp.asarray(valid)))
    jax.effects_barrier()
    rows = np.concatenate([served[r] for r in range(G)])  # [P]: rows each slot computed
    out_loaded = np.asarray(FORWARD(loaded, x, jnp.asarray(valid)))
    np.testing.assert_array_equal(out.view(np.uint32), out_loaded.view(np.uint32))
    load_moved = np.asarray(moved.expert_load.get_value())
    np.testing.assert_array_equal(load_moved, np.asarray(loaded.expert_load.get_value()))
    # The recorded load is what each slot computed: padding neither computed nor counted.
    np.testing.assert_array_equal(load_moved.sum(0), rows)
    ids, _ = route(x, moved.router.get_value(), moved.router_config, bias=moved.router_bias.get_value())
    real = np.asarray(ids)[valid]
    np.testing.assert_array_equal(
        np.bincount(new.phy2log[0], weights=load_moved.sum(0), minlength=E), np.bincount(real.ravel(), minlength=E)
    )
    # Whatever the mode and the shared expert's placement: the plain layer's outputs, bit for bit.
    plain = _layer("hash")
    _from_checkpoint(plain, new)
    want = np.asarray(FORWARD(plain, x, jnp.asarray(valid)))
    np.testing.assert_array_equal(out[valid].view(np.uint32), want[valid].view(np.uint32))
    if shared_expert == "waterfill":  # padding goes to no expert at all
        assert not out[~valid].any()


@pytest.mark.slow
def test_quota_mode_balances_a_zipf_batch_better_than_hash_and_lp():
    """Scaled-down UltraEP on 8 ranks: 8 home experts + 2 spares per rank (spares from the online policy on the
    expected loads), top-4, 128 tokens per rank; the batch's rank imbalance per mode."""
    num_ranks, num_home, num_spare, tokens, top_k = 8, 8, 2, 128, 4
    num_logical = num_ranks * num_home
    num_physical = num_ranks * (num_home + num_spare)
    mesh = ep_mesh(num_ranks)
    ids = zipf_topk(num_ranks, num_logical, tokens, top_k, 2.0, seed=5).reshape(-1, top_k)
    expected = zipf_popularity(num_logical, num_ranks, 2.0, seed=5)[None] * ids.size  # similar loads, not the batch
    new = Placement.from_phy2log(online_policy(expected, num_physical, 1, 1, num_ranks)[0], num_logical)
    # A one-hot router: token t's top-k are exactly ids[t].
    x = one_hot_tokens(ids, num_logical)
    layer = MoELayer(num_logical, 4, num_logical, top_k, mesh=mesh, num_physical=num_physical, rngs=nnx.Rngs(0))
    identity_router(layer)
    old = np.asarray(layer.phy2log.get_value())
    variables = layer.eplb_expert_variables()
    moved = rearrange_experts(
        {k: v.get_value() for k, v in variables.items()}, old, new.phy2log[0], mesh=mesh, num_logical=num_logical
    )
    for k, v in variables.items():
        v.set_value(moved[k])
    tables = routing_tables("lp", expected, new, num_ranks=num_ranks)[0]
    layer.eplb_set_placement(new.phy2log[0], new.log2phy[0], new.logcnt[0], **tables)
    forward = nnx.jit(lambda module, x: module(x))
    imbalance, outs = {}, {}
    for mode in ("hash", "lp", "quota"):
        layer.eplb_set_routing(mode)
        layer.expert_load.set_value(jnp.zeros_like(layer.expert_load.get_value()))
        outs[mode] = np.asarray(forward(layer, jnp.asarray(x)))
        slot_load = np.asarray(layer.expert_load.get_value()).sum(0)
        assert slot_load.sum() == ids.size
        rank_load = slot_load.reshape(num_ranks, -1).sum(1)
        imbalance[mode] = rank_load.max() / rank_load.mean()
    home = np.bincount(ids.ravel(), minlength=num_logical).reshape(num_ranks, -1).sum(1)
    assert home.max() / home.mean() > 1.5  # the batch is skewed
    assert imbalance["quota"] <= 1.05, imbalance
    assert imbalance["quota"] < imbalance["hash"] and imbalance["quota"] < imbalance["lp"], imbalance
    for mode in ("lp", "quota"):
        np.testing.assert_array_equal(outs[mode].view(np.uint32), outs["hash"].view(np.uint32))


def test_switching_mode_and_bad_tables_leave_the_layer_unchanged(rng):
    layer = _layer("hash", seed=5)
    tables = [np.asarray(t.get_value()) for t in (layer.phy2log, layer.log2phy, layer.logcnt, layer.replica_shares)]
    new = _random_placement(rng)
    for bad, match in [
        (np.ones((E, S + 1), np.float32), "replica_shares must be floats of shape"),
        (np.ones((E, S), np.int32), "replica_shares must be floats of shape"),
        (-np.ones((E, S), np.float32), "finite and non-negative"),
        (np.full((E, S), np.nan, np.float32), "finite and non-negative"),
    ]:
        with pytest.raises(ValueError, match=match):
            layer.eplb_set_placement(new.phy2log[0], new.log2phy[0], new.logcnt[0], replica_shares=bad)
    with pytest.raises(ValueError, match="routing must be one of"):
        layer.eplb_set_routing("resolved")
    after = [np.asarray(t.get_value()) for t in (layer.phy2log, layer.log2phy, layer.logcnt, layer.replica_shares)]
    for a, b in zip(tables, after):
        np.testing.assert_array_equal(a, b)
    assert layer.routing == "hash"
    np.testing.assert_array_equal(tables[3], equal_shares(tables[2], S))
    # The lookup carries the shares' alias table in "lp" only.
    size = np.asarray(layer.route_lookup.get_value()).size
    layer.eplb_set_routing("lp")
    assert layer.routing == "lp" and np.asarray(layer.route_lookup.get_value()).size > size
    layer.eplb_set_routing("quota")
    assert np.asarray(layer.route_lookup.get_value()).size == size
    for kwargs, match in [
        ({"routing": "shares"}, "routing must be one of"),
        ({"shared_expert": "remote"}, "DispatchConfig.shared_expert must be one of"),
        ({"batch_axes": ("ep",)}, "batch_axes must name"),
        ({"batch_axes": ("data",)}, "batch_axes must name"),
        ({"batch_axes": ("data", "data")}, "batch_axes must name distinct"),
    ]:
        with pytest.raises(ValueError, match=match):
            _layer(**({"routing": "hash"} | kwargs))
    with pytest.raises(ValueError, match="routing must be one of"):
        moe_apply(
            jnp.zeros((G, D)),
            jnp.zeros((D, E)),
            jnp.zeros(E),
            {"w_in": jnp.zeros((P, D, 2 * H)), "w_out": jnp.zeros((P, H, D))},
            jnp.asarray(new.log2phy[0]),
            jnp.asarray(new.logcnt[0]),
            router=RouterConfig(top_k=K),
            mesh=MESH,
            routing="resolved",
        )


@pytest.mark.slow
def test_data_and_ep_mesh_computes_each_token_once(rng):
    """(data=2, ep=4): tokens over both axes, experts over ep. Each data replica computes exactly what a 1-D EP
    group computes for its own half of the tokens (bit for bit, loads summed over the replicas); half the FLOPs of
    the 1-D mesh on all the tokens, whose outputs equal up to the rounding of a matmul of another row count."""
    mesh = ep_mesh(G, batch=("data", 2))
    new = _random_placement(rng)
    x = jnp.asarray(rng.standard_normal((2 * G * 4, D)).astype(np.float32))
    valid = jnp.asarray(rng.random(2 * G * 4) < 0.8)
    forward = nnx.jit(lambda module, x, valid: module(x, valid=valid))
    layer = _layer("quota", "waterfill", mesh=mesh)
    _from_checkpoint(layer, new)
    out = np.asarray(forward(layer, x, valid))
    load = layer.expert_load.get_value()
    assert load.shape == (G, P) and load.sharding.spec == PS("ep")
    flat = _layer("quota", "waterfill", mesh=MESH)
    _from_checkpoint(flat, new)
    half = x.shape[0] // 2
    halves = [np.asarray(forward(flat, x[i * half : (i + 1) * half], valid[i * half : (i + 1) * half])) for i in (0, 1)]
    np.testing.assert_array_equal(out.view(np.uint32), np.concatenate(halves).view(np.uint32))
    np.testing.assert_array_equal(np.asarray(load), np.asarray(flat.expert_load.get_value()))
    np.testing.assert_allclose(out, np.asarray(forward(flat, x, valid)), rtol=1e-5, atol=1e-5)
    assert np.asarray(load).sum() == int(valid.sum()) * K

    # Per-device FLOPs of the compiled step: each data replica computes only its own tokens.
    placement = Placement.linear(1, E, P)
    experts = {
        "w_in": rng.standard_normal((P, D, 2 * H)).astype(np.float32),
        "w_out": rng.standard_normal((P, H, D)).astype(np.float32),
    }
    # Enough tokens that every rank's buffers are whole 64-row tiles of the dense matmul on both meshes.
    many = rng.standard_normal((2 * G * 64, D)).astype(np.float32)
    args = (many, np.zeros((D, E), np.float32), np.zeros(E, np.float32), experts, placement.log2phy[0])
    flops = {}
    for name, on in (("ep", MESH), ("data_ep", mesh)):
        step = jax.jit(functools.partial(moe_apply, router=RouterConfig(top_k=K), mesh=on))
        cost = step.lower(*args, placement.logcnt[0]).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # a list of one per device in older jax
        assert cost is not None
        flops[name] = cost["flops"]
    assert 0.45 <= flops["data_ep"] / flops["ep"] <= 0.55, flops
    with pytest.raises(ValueError, match="batch axes' size 2"):
        _layer("hash", mesh=mesh)(jnp.zeros((G * 3, D)))


# ---------------------------------------------------------- online refresh
def test_online_refresh_keeps_spares_a_rank_already_holds(rng):
    num_ranks, num_home, num_spare = 4, 3, 2
    num_logical, num_physical = num_ranks * num_home, num_ranks * (num_home + num_spare)
    before = rng.lognormal(0.0, 1.5, (2, num_logical))
    after = before * rng.lognormal(0.0, 0.3, before.shape)
    old, _, _ = online_policy(before, num_physical, 1, 1, num_ranks)
    fresh, _, _ = online_policy(after, num_physical, 1, 1, num_ranks)
    sticky, log2phy, logcnt = online_policy(after, num_physical, 1, 1, num_ranks, old_phy2log=old)
    spr = num_home + num_spare
    for layer in range(2):
        for rank in range(num_ranks):
            lo = rank * spr
            np.testing.assert_array_equal(sticky[layer, lo : lo + num_home], fresh[layer, lo : lo + num_home])
            spares = slice(lo + num_home, lo + spr)
            assert sorted(sticky[layer, spares]) == sorted(fresh[layer, spares])  # the same experts per rank
            for slot in range(spares.start, spares.stop):  # an expert the rank kept stays in its slot
                if old[layer, slot] in fresh[layer, spares]:
                    assert sticky[layer, slot] == old[layer, slot]
        assert np.sum(sticky[layer] != old[layer]) <= np.sum(fresh[layer] != old[layer])
    want_log2phy, want_logcnt = build_log2phy(sticky, num_logical)
    np.testing.assert_array_equal(log2phy, want_log2phy)
    np.testing.assert_array_equal(logcnt, want_logcnt)
    kept = keep_spare_slots(np.array([0, 5, 6, 1, 7, 8]), np.array([0, 6, 9, 1, 8, 7]), 1, 2)
    np.testing.assert_array_equal(kept, [0, 6, 5, 1, 8, 7])


# ------------------------------------------------------------- waterfill
@pytest.mark.parametrize("capacity", [None, 32, 5])  # one worst-case round; rounds of 32 / 5 rows per rank pair
def test_waterfill_moves_shared_work_to_the_ranks_with_slack(rng, capacity):
    tokens = 32
    shared = {
        "w_in": jnp.asarray(rng.standard_normal((D, 8)).astype(np.float32)),
        "w_out": jnp.asarray(rng.standard_normal((4, D)).astype(np.float32)),
    }
    x = rng.standard_normal((G * tokens, D)).astype(np.float32)
    valid = rng.random(G * tokens) < 0.9
    routed = np.array([90, 20, 0, 50], np.int32)  # routed rows per rank: rank 2 has the most slack

    def per_rank(x, valid, shared):
        out, work = waterfill_shared_mlp(
            x, valid, jnp.asarray(routed), shared, axis_name="ep", num_ranks=G, capacity=capacity
        )
        return out, work[None]

    f = jax.jit(
        jax.shard_map(
            per_rank, mesh=MESH, in_specs=(PS("ep"), PS("ep"), PS()), out_specs=(PS("ep"), PS("ep")), check_vma=False
        )
    )
    out, work = (np.asarray(a) for a in f(x, valid, shared))
    assert np.all(work == work[0])  # every rank computed the same assignment totals
    work = work[0]
    want = np.asarray(shared_mlp(jnp.asarray(x), shared))
    np.testing.assert_array_equal(out[valid].view(np.uint32), want[valid].view(np.uint32))
    assert not out[~valid].any()  # padding: computed nowhere
    total = int(valid.sum())
    assert work.sum() == total
    # The water level over the routed floor: rank 0 (above it) gets nothing, the others fill to about the level.
    expected = np.asarray(waterfill_shares(jnp.asarray(routed), total)) * total
    assert work[0] == 0
    np.testing.assert_allclose(work, expected, atol=3 * np.sqrt(expected.max()) + 1)
    own = valid.reshape(G, tokens).sum(1)  # the local shared expert's rows per rank
    assert (routed + work).max() < (routed + own).max()


def test_waterfill_gradients_do_not_depend_on_the_capacity(rng):
    """Training through Waterfill: the shared weights' gradients in rounds of 5 rows equal one worst-case round's
    (float32 sums over rounds: to rounding)."""
    tokens = 32
    shared = {
        "w_in": jnp.asarray(rng.standard_normal((D, 8)).astype(np.float32)),
        "w_out": jnp.asarray(rng.standard_normal((4, D)).astype(np.float32)),
    }
    x = rng.standard_normal((G * tokens, D)).astype(np.float32)
    cot = rng.standard_normal((G * tokens, D)).astype(np.float32)
    valid = rng.random(G * tokens) < 0.9
    routed = jnp.asarray([90, 20, 0, 50], jnp.int32)

    def grads(capacity):
        def per_rank(x, valid, cot, shared):
            def loss(shared, x):
                out, _ = waterfill_shared_mlp(x, valid, routed, shared, axis_name="ep", num_ranks=G, capacity=capacity)
                return jnp.sum(out * cot)

            d_shared, d_x = jax.grad(loss, argnums=(0, 1))(shared, x)
            return jax.tree.map(lambda g: jax.lax.psum(g, "ep"), d_shared), d_x  # the replicated weights' sum

        f = jax.shard_map(
            per_rank,
            mesh=MESH,
            in_specs=(PS("ep"), PS("ep"), PS("ep"), PS()),
            out_specs=(PS(), PS("ep")),
            check_vma=False,
        )
        return jax.jit(f)(x, valid, cot, shared)

    (w_once, x_once), (w_rounds, x_rounds) = grads(None), grads(5)
    for name in ("w_in", "w_out"):
        np.testing.assert_allclose(w_rounds[name], w_once[name], rtol=1e-5, atol=1e-5)
        assert np.abs(np.asarray(w_once[name])).max() > 0
    np.testing.assert_allclose(x_rounds, x_once, rtol=1e-5, atol=1e-5)
    assert not np.asarray(x_once)[~valid].any()  # padding gets no gradient


# -------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.devices(1)  # every GPU of the host, however many
@pytest.mark.parametrize("routing", ROUTING_MODES)
def test_pallas_map_routes_every_mode_like_the_reference_on_gpu(rng, routing):
    """On a GPU the layer maps with the Pallas kernel (its prepared lookup: with the alias table for "lp"):
    the same slots counted and the same outputs as the jnp reference, every mode, on every GPU of the host."""
    devices = jax.devices()
    mesh = ep_mesh(len(devices))
    num_physical = E + 8 * len(devices)
    phy2log = np.concatenate([np.arange(E), rng.integers(0, E, num_physical - E)])
    new = Placement.from_phy2log(rng.permutation(phy2log)[None], E)
    load = rng.lognormal(0.0, 1.0, (1, E)) * 100
    tables = routing_tables(routing, load, new, num_ranks=len(devices))[0]
    x = jnp.asarray(rng.standard_normal((len(devices) * 64, D)).astype(np.float32))
    valid = jnp.asarray(rng.random(x.shape[0]) < 0.9)
    results = {}
    for implementation in ("pallas", "xla"):
        layer = MoELayer(
            D,
            H,
            E,
            K,
            mesh=mesh,
            num_physical=num_physical,
            routing=routing,
            dispatch=DispatchConfig(map_implementation=implementation),
            rngs=nnx.Rngs(1),
        )
        for var in layer.eplb_expert_variables().values():
            var.set_value(put_host(np.asarray(var.get_value())[:E][new.phy2log[0]], mesh, PS("ep")))
        layer.eplb_set_placement(new.phy2log[0], new.log2phy[0], new.logcnt[0], **tables)
        out = np.asarray(nnx.jit(lambda module, x, valid: module(x, valid=valid))(layer, x, valid))
        results[implementation] = (out, np.asarray(layer.expert_load.get_value()))
    np.testing.assert_array_equal(results["pallas"][1], results["xla"][1])
    np.testing.assert_array_equal(results["pallas"][0].view(np.uint32), results["xla"][0].view(np.uint32))


def _bounds(weight, phy2log, num_ranks):
    """Each layer's routing bound (HiGHS): the least largest rank load any split over its replicas reaches."""
    num_physical = phy2log.shape[1]
    log2phy, logcnt = build_log2phy(phy2log, weight.shape[1])
    return np.array(
        [
            lp_shares_reference(w, t, c, num_physical=num_physical, num_ranks=num_ranks)[1]
            for w, t, c in zip(weight, log2phy, logcnt)
        ]
    )


@pytest.mark.parametrize("imbalance", [1.5, 2.0, 3.0])
@pytest.mark.parametrize("num_physical", [72, 80])
def test_online_refresh_never_routes_worse_than_the_balanced_placement(imbalance, num_physical):
    """E = 64 on 8 ranks with one or two spares each: the planner's spares (fixed homes) could leave a layer's routing
    bound above what the balanced placement of the same slots allows (quota then served worse than lp); a layer
    takes the balanced placement where it routes better, and keeps its homes (only spares move) otherwise."""
    from moe_eplb_jax.policy import rebalance_balanced

    num_ranks, num_logical = 8, 64
    weight = np.stack([zipf_popularity(num_logical, num_ranks, imbalance, seed=s) * 1e5 for s in range(3)])
    phy2log, _, _ = online_policy(weight, num_physical, 1, 1, num_ranks)
    balanced, _, _ = rebalance_balanced(weight, num_physical, 1, 1, num_ranks)
    ours, theirs = _bounds(weight, phy2log, num_ranks), _bounds(weight, balanced, num_ranks)
    assert np.all(ours <= theirs * (1 + 1e-6)), (ours, theirs)
    per_rank = num_physical // num_ranks
    homes = phy2log.reshape(3, num_ranks, per_rank)[:, :, : num_logical // num_ranks].reshape(3, -1)
    kept = np.all(homes == np.arange(num_logical), axis=1)
    assert np.all(kept | np.isclose(ours, theirs, rtol=1e-6))  # a layer left its homes only to take `balanced`

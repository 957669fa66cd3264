"""Every routing mode through the controller: ``EplbConfig.routing`` reaches every layer, LP shares follow the
window, quota refreshes the spare slots, rollbacks and checkpoints keep the shares.

The model: two MoE layers reading the same tokens (their outputs summed), so each layer's router sees the batch
as built -- one-hot tokens with an identity router make a layer route exactly the ids a test draws.
"""

import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import ep_mesh, identity_router
from flax import nnx
from jax.sharding import PartitionSpec as PS

from moe_eplb_jax.config import EplbConfig
from moe_eplb_jax.control import Balancer, ExpertLayout, RearrangementError, moves
from moe_eplb_jax.control import loop as loop_module
from moe_eplb_jax.flax import EplbController, MoELayer
from moe_eplb_jax.moe import RouterConfig, moe_apply
from moe_eplb_jax.moe import apply as apply_mod
from moe_eplb_jax.placement import Placement
from moe_eplb_jax.policy.online import home_layout
from moe_eplb_jax.routing import ROUTING_MODES, equal_shares, routing_tables
from moe_eplb_jax.sim import zipf_popularity
from moe_eplb_jax.transport import put_host

G, E, P, L, K = 4, 8, 16, 2, 2  # 2 home experts and 2 spare slots per rank
S = P - E + 1
D = E  # one-hot tokens: an identity router picks exactly the ids a token names
pytestmark = pytest.mark.devices(G)  # skipped on fewer devices, where MESH is None
MESH = ep_mesh(G)


class TwoLayers(nnx.Module):
    """Two MoE layers on the same tokens, outputs summed (placement- and mode-invariant, bit for bit)."""

    def __init__(self, seed=0, routing="hash", layer_type=MoELayer):
        rngs = nnx.Rngs(seed)
        self.layers = nnx.List(
            [layer_type(D, 4, E, K, mesh=MESH, num_physical=P, routing=routing, rngs=rngs) for _ in range(L)]
        )
        for layer in self.layers:  # identity router: token t's top-k are the coordinates where it is largest
            identity_router(layer)

    def __call__(self, x):
        out = x
        for layer in self.layers:
            out = out + layer(x)
        return out


def config(routing, **kw):
    policy = {"policy": "online"} if routing == "quota" else {}
    return EplbConfig(
        num_redundant_experts=P - E, window_size=4, step_interval=8, num_gpus=G, routing=routing, **policy, **kw
    )


def tokens(ids):
    """One-hot-ish tokens ``[T, D]`` whose top-k router ids are ``ids [T, k]``."""
    x = np.full((ids.shape[0], D), -4.0, np.float32)
    np.put_along_axis(x, ids, 4.0, axis=1)
    return jnp.asarray(x)


def zipf_batch(seed, *, imbalance=2.0, order=0, per_rank=64):
    """Tokens of ``G * per_rank`` whose top-k ids are drawn (Gumbel top-k) from one Zipf popularity: the same
    for every ``seed`` of one ``order`` (its home rank imbalance ``imbalance``)."""
    logp = np.log(zipf_popularity(E, G, imbalance, seed=order))
    keys = logp + np.random.default_rng(seed).gumbel(size=(G * per_rank, E))
    return tokens(np.argpartition(-keys, K - 1, axis=1)[:, :K])


forward = nnx.jit(lambda model, x: model(x))


def layer_loads(model):
    """``[L, P]`` the tokens each slot served since the loads were last reset, summed over the ranks."""
    return np.stack([np.asarray(layer.expert_load.get_value()).sum(0) for layer in model.layers])


def run_until_rearranged(model, ctl, seed=0, max_steps=12):
    """Serves Zipf batches and steps until a rearrangement completes; returns the logical load of every step
    served (what the decision saw, when it moved every layer at one step)."""
    logical = np.zeros((L, E))
    for step in range(max_steps):
        forward(model, zipf_batch(seed + step))
        for i, layer in enumerate(model.layers):  # what the window holds: each slot's load, to its expert
            np.add.at(logical[i], ctl.placement.phy2log[i], np.asarray(layer.expert_load.get_value()).sum(0))
        report = ctl.step()
        if report and report.get("rearranged"):
            return logical
    raise AssertionError("no rearrangement happened")


def permuted_checkpoint(placement, routing, tables, seed=0):
    """A model built from the start checkpoint permuted to ``placement`` (the linear start: slot ``e`` < E holds e)."""
    model = TwoLayers(seed, routing=routing)
    for i, layer in enumerate(model.layers):
        for var in layer.eplb_expert_variables().values():
            logical = np.asarray(var.get_value())[:E]
            var.set_value(put_host(logical[placement.phy2log[i]], MESH, PS("ep")))
        rows = {name: table[i] for name, table in tables.items()}
        layer.eplb_set_placement(placement.phy2log[i], placement.log2phy[i], placement.logcnt[i], **rows)
    return model


def shares_of(model):
    return np.stack([np.asarray(layer.replica_shares.get_value()) for layer in model.layers])


# ------------------------------------------------------------ config -> layer
@pytest.mark.parametrize("routing", ROUTING_MODES)
def test_config_routing_changes_what_every_layer_does(monkeypatch, routing):
    """A model built with hash layers follows ``EplbConfig(routing=m)``: every layer maps with mode ``m`` and
    serves the loads a model built with ``MoELayer(routing=m)`` serves."""
    model = TwoLayers(routing="hash")
    ctl = EplbController(model, MESH, config(routing))
    assert [layer.routing for layer in model.layers] == [routing] * L
    modes = []  # the mode each layer's map_and_count is traced with
    real = apply_mod.map_and_count
    monkeypatch.setattr(apply_mod, "map_and_count", lambda *a, **k: modes.append(k["mode"]) or real(*a, **k))
    x = zipf_batch(seed=1)
    nnx.eval_shape(lambda model, x: model(x), model, x)  # traced now, whatever a compiled forward cached
    assert modes == [routing] * L
    out = np.asarray(forward(model, x))
    built = TwoLayers(routing=routing)
    want = np.asarray(forward(built, x))
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(layer_loads(model), layer_loads(built))
    assert np.all(layer_loads(model).sum(1) == x.shape[0] * K)
    if routing in ("lp", "quota"):  # the mode matters: under round robin the same batch loads replicas otherwise
        # (not so hash here: a fresh controller's lp shares are equal, and equal shares pick as the hash does)
        other = TwoLayers(routing="round_robin")
        forward(other, x)
        assert not np.array_equal(layer_loads(other), layer_loads(model))
    ctl.step()  # the controller records what the layers served
    np.testing.assert_array_equal(ctl.window_slot_load(), layer_loads(built))


class FixedRouting(MoELayer):
    eplb_set_routing = None  # a layer that cannot switch modes


class NoShares(MoELayer):
    def eplb_set_placement(self, phy2log, log2phy, logcnt):  # takes no replica shares
        super().eplb_set_placement(phy2log, log2phy, logcnt)


def test_layers_that_cannot_follow_the_config_are_refused_before_anything_changes():
    model = TwoLayers(layer_type=FixedRouting)
    EplbController(model, MESH, config("hash"))  # the same mode: nothing to switch
    with pytest.raises(ValueError, match="has no eplb_set_routing"):
        EplbController(model, MESH, config("round_robin"))
    assert [layer.routing for layer in model.layers] == ["hash"] * L
    model = TwoLayers(layer_type=NoShares)
    with pytest.raises(ValueError, match="takes no replica_shares"):
        EplbController(model, MESH, config("lp"))
    assert [layer.routing for layer in model.layers] == ["hash"] * L
    EplbController(model, MESH, config("quota"))
    assert [layer.routing for layer in model.layers] == ["quota"] * L


def test_a_construction_that_fails_late_hands_the_layers_back_their_mode(monkeypatch):
    """The layers switched mode, then the start placement's move failed (a layer refused its tables once):
    rolled back, and every layer routes by its old mode again."""
    model = TwoLayers()
    other = Placement.from_phy2log(np.stack([np.roll(np.arange(P) % E, 1)] * L), E, num_ranks=G)
    real, armed = MoELayer.eplb_set_placement, [True]

    def refuse_once(layer, *args, **kwargs):
        if armed[0]:
            armed[0] = False
            raise RuntimeError("refused")
        return real(layer, *args, **kwargs)

    monkeypatch.setattr(MoELayer, "eplb_set_placement", refuse_once)
    with pytest.raises(RearrangementError, match="rolled back"):
        EplbController(model, MESH, config("round_robin"), placement=other)
    assert [layer.routing for layer in model.layers] == ["hash"] * L
    assert all(np.array_equal(np.asarray(layer.phy2log.get_value()), np.arange(P) % E) for layer in model.layers)


# ------------------------------------------------- rearrangement = permuted checkpoint
@pytest.mark.parametrize(
    "routing", [pytest.param(m, marks=pytest.mark.slow) if m == "lp" else m for m in ROUTING_MODES]
)
def test_after_a_rearrangement_every_mode_equals_the_permuted_checkpoint(routing):
    model = TwoLayers()
    ctl = EplbController(model, MESH, config(routing))
    logical = run_until_rearranged(model, ctl)
    new = ctl.placement
    assert new != Placement.linear(L, E, P)
    tables = ctl.routing_tables
    if routing == "lp":  # the shares solved from the window's loads on the new placement
        want = np.stack([t["replica_shares"] for t in routing_tables("lp", logical, new, num_ranks=G)])
        np.testing.assert_array_equal(tables["replica_shares"], want)
        np.testing.assert_array_equal(shares_of(model), want)
        assert not np.array_equal(want, equal_shares(new.logcnt, S))
    else:
        assert tables == {}
    loaded = permuted_checkpoint(new, routing, tables)
    for layer in model.layers:
        layer.expert_load.set_value(jnp.zeros_like(layer.expert_load.get_value()))
    x = zipf_batch(seed=50)
    out, want = np.asarray(forward(model, x)), np.asarray(forward(loaded, x))
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(layer_loads(model), layer_loads(loaded))


# --------------------------------------------------------------------- lp
@pytest.mark.slow
def test_lp_starts_equal_and_apply_placement_solves_from_the_window():
    model = TwoLayers()
    start = Placement.from_phy2log(np.stack([np.arange(P) % E, (np.arange(P) * 3) % E]), E, num_ranks=G)
    ctl = EplbController(model, MESH, config("lp"), placement=start)
    equal = equal_shares(start.logcnt, S)
    np.testing.assert_array_equal(shares_of(model), equal)  # no load yet: equal shares
    np.testing.assert_array_equal(ctl.routing_tables["replica_shares"], equal)
    run_until_rearranged(model, ctl)
    forward(model, zipf_batch(seed=9))  # one step in the window, under the placement of that rearrangement
    current = ctl.placement
    logical = np.stack([np.bincount(current.phy2log[i], layer_loads(model)[i], minlength=E) for i in range(L)])
    assert ctl.step() is None
    new = Placement.from_phy2log(np.stack([np.roll(row, P // G) for row in current.phy2log]), E, num_ranks=G)
    ctl.apply_placement(new)
    want = np.stack([t["replica_shares"] for t in routing_tables("lp", logical, new, num_ranks=G)])
    np.testing.assert_array_equal(shares_of(model), want)
    np.testing.assert_array_equal(ctl.routing_tables["replica_shares"], want)
    assert not np.array_equal(want, equal_shares(new.logcnt, S))


@pytest.mark.parametrize("overlap", [None, pytest.param("layer", marks=pytest.mark.slow)])
def test_lp_rollback_restores_the_old_shares(monkeypatch, overlap):
    """A failure at layer 1's switch after layer 0 took its new shares: every layer routes by its old shares."""
    model = TwoLayers()
    ctl = EplbController(model, MESH, config("lp"), overlap=overlap)
    run_until_rearranged(model, ctl)
    old_placement, old_shares = ctl.placement, shares_of(model)
    old_lookups = [np.asarray(layer.route_lookup.get_value()) for layer in model.layers]
    assert not np.array_equal(old_shares, equal_shares(old_placement.logcnt, S))
    rng = np.random.default_rng(4)
    target = Placement.from_phy2log(np.stack([rng.permutation(r) for r in old_placement.phy2log]), E, num_ranks=G)
    monkeypatch.setattr(loop_module, "compute_placement", lambda *a, **k: target)
    real, armed = MoELayer.eplb_set_placement, [True]

    def switch(layer, *args, **kwargs):
        if layer is model.layers[1] and armed[0]:
            armed[0] = False
            raise RuntimeError("injected switch failure")
        return real(layer, *args, **kwargs)

    monkeypatch.setattr(MoELayer, "eplb_set_placement", switch)
    x = zipf_batch(seed=70)
    before = np.asarray(forward(model, x))
    with pytest.raises(RearrangementError, match="rolled back"):
        for _ in range(3 * 8):
            forward(model, x)
            ctl.step()
    assert not armed[0] and not ctl.rearranging
    assert ctl.placement == old_placement
    np.testing.assert_array_equal(shares_of(model), old_shares)
    np.testing.assert_array_equal(ctl.routing_tables["replica_shares"], old_shares)
    for layer, lookup in zip(model.layers, old_lookups):
        np.testing.assert_array_equal(np.asarray(layer.route_lookup.get_value()), lookup)
    np.testing.assert_array_equal(np.asarray(forward(model, x)), before)
    for _ in range(3):  # the retry installs the target and its shares
        if ctl.step():
            break
    assert ctl.placement == target
    np.testing.assert_array_equal(shares_of(model), ctl.routing_tables["replica_shares"])
    assert not np.array_equal(shares_of(model), old_shares)


@pytest.mark.slow
def test_lp_shares_travel_in_the_checkpoint_item():
    """Restored into a fresh model and controller, the layers route by the saved shares, and the resumed run
    rearranges exactly as the uninterrupted one."""
    model = TwoLayers()
    ctl = EplbController(model, MESH, config("lp"))
    run_until_rearranged(model, ctl)
    forward(model, zipf_batch(seed=30))
    ctl.step()
    item = ctl.checkpoint_item()
    np.testing.assert_array_equal(item["replica_shares"], shares_of(model))

    fresh = TwoLayers(seed=0)  # the weights a model checkpoint restores (the same seed), on the linear start
    twin = EplbController(fresh, MESH, config("lp"))
    for layer, saved in zip(fresh.layers, model.layers):
        for name, var in layer.eplb_expert_variables().items():
            var.set_value(saved.eplb_expert_variables()[name].get_value())
    twin.restore_item(item)
    assert twin.placement == ctl.placement
    np.testing.assert_array_equal(shares_of(fresh), shares_of(model))
    for a, b in zip(fresh.layers, model.layers):
        np.testing.assert_array_equal(np.asarray(a.route_lookup.get_value()), np.asarray(b.route_lookup.get_value()))
    for step in range(8):
        x = zipf_batch(seed=40 + step)
        out, want = np.asarray(forward(fresh, x)), np.asarray(forward(model, x))
        np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
        np.testing.assert_array_equal(layer_loads(fresh), layer_loads(model))
        assert (twin.step() or {}).get("rearranged") == (ctl.step() or {}).get("rearranged")
    assert twin.num_rearrangements == ctl.num_rearrangements == 2
    np.testing.assert_array_equal(shares_of(fresh), shares_of(model))

    # Shares a restore must refuse, leaving the controller and the layers as they were.
    before = shares_of(fresh)
    for bad, match in [
        (np.full_like(item["replica_shares"], np.nan), "finite"),
        (-item["replica_shares"], "non-negative"),
        (np.ones_like(item["replica_shares"]), "replicas the placement does not have"),
        (item["replica_shares"].astype(np.int32), "floats"),
        (item["replica_shares"][:, :, :-1], "'replica_shares' has shape"),
    ]:
        with pytest.raises(ValueError, match=match):
            twin.restore_item({**item, "replica_shares": bad})
        np.testing.assert_array_equal(shares_of(fresh), before)
    # An item of version 1 (written before the shares were stored) restores with equal shares.
    old = {k: v for k, v in item.items() if k != "replica_shares"} | {"version": np.int32(1)}
    twin.restore_item(old)
    np.testing.assert_array_equal(shares_of(fresh), equal_shares(ctl.placement.logcnt, S))


# ------------------------------------------------------------------ quota
def test_quota_refresh_balances_zipf_batches_and_moves_only_spare_slots():
    num_home, num_spare = home_layout(E, P, G)
    home = (np.arange(P) % (num_home + num_spare)) < num_home
    model = TwoLayers()
    ctl = EplbController(model, MESH, config("quota"))
    run_until_rearranged(model, ctl)  # the first refresh puts the home experts in place
    first = ctl.placement
    np.testing.assert_array_equal(first.phy2log[:, home], np.broadcast_to(np.arange(E), (L, E)))

    imbalance = {"quota": [], "hash": []}
    hashed = permuted_checkpoint(first, "hash", {})
    for seed in range(100, 104):  # fresh Zipf batches, the same distribution as the window's
        x = zipf_batch(seed)
        for name, m in (("quota", model), ("hash", hashed)):
            for layer in m.layers:
                layer.expert_load.set_value(jnp.zeros_like(layer.expert_load.get_value()))
            forward(m, x)
            rank_load = layer_loads(m).reshape(L, G, -1).sum(2)
            imbalance[name].append(rank_load.max(1) / rank_load.mean(1))
    quota, hashed_imbalance = np.array(imbalance["quota"]), np.array(imbalance["hash"])
    assert quota.max() <= 1.05, quota
    assert np.all(quota < hashed_imbalance), (quota, hashed_imbalance)
    for layer in model.layers:
        layer.expert_load.set_value(jnp.zeros_like(layer.expert_load.get_value()))

    # The next refresh, on another distribution: home slots keep their experts, only changed spares move.
    for step in range(8):
        forward(model, zipf_batch(seed=200 + step, imbalance=3.0, order=1))
        report = ctl.step()
    assert report and report["rearranged"] and ctl.num_rearrangements == 2
    second = ctl.placement
    np.testing.assert_array_equal(second.phy2log[:, home], first.phy2log[:, home])
    assert report["slots_moved"] == int(np.sum(second.phy2log != first.phy2log)) > 0


# ------------------------------------------------------------ functional API
def functional_step(routing):
    """A jitted serving step over plain pytrees: ``TwoLayers``' math through ``moe_apply`` and the balancer's
    tables (``routing`` and, for ``"lp"``, the replica shares as the train step passes them)."""

    @jax.jit
    def step(params, balance, x):
        t, out, loads = balance.tables, x, []
        for i, p in enumerate(params["layers"]):
            y, load = moe_apply(
                x,
                p["router"],
                p["router_bias"],
                p["experts"],
                t.log2phy[i],
                t.logcnt[i],
                router=RouterConfig(top_k=K),
                mesh=MESH,
                routing=routing,
                lookup=t.lookup[i],
                replica_shares=t.replica_shares[i],
            )
            out, loads = out + y, [*loads, load]
        return out, Balancer.record_step(balance, loads)

    return step


@pytest.mark.slow
@pytest.mark.parametrize("routing", ["lp", "quota"])
def test_functional_balancer_routes_and_rearranges_like_the_controller(monkeypatch, routing):
    model = TwoLayers()
    params = {
        "layers": [
            {
                "router": layer.router.get_value(),
                "router_bias": layer.router_bias.get_value(),
                "experts": {"w_in": layer.w_in.get_value(), "w_out": layer.w_out.get_value()},
            }
            for layer in model.layers
        ]
    }
    ctl = EplbController(model, MESH, config(routing))
    balancer = Balancer(config(routing), MESH, ExpertLayout.match(params, r"layers/(\d+)/experts/"))
    balance = balancer.init(params)
    step = functional_step(routing)
    for i in range(3):
        x = zipf_batch(seed=i)
        out, balance = step(params, balance, x)
        want = np.asarray(forward(model, x))
        np.testing.assert_array_equal(np.asarray(out).view(np.uint32), want.view(np.uint32))
        ctl.step()
        if balancer.is_due(balance):
            params, _, balance, report = balancer.rearrange(params, (), balance)
            assert report["rearranged"]
    assert ctl.num_rearrangements == 1 and balance.tables.placement() == ctl.placement != Placement.linear(L, E, P)
    shares = np.asarray(balance.tables.replica_shares)
    if routing == "lp":
        np.testing.assert_array_equal(shares, ctl.routing_tables["replica_shares"])
        assert not np.array_equal(shares, equal_shares(ctl.placement.logcnt, S))
    else:
        np.testing.assert_array_equal(shares, equal_shares(ctl.placement.logcnt, S))
    for i, layer in enumerate(model.layers):
        np.testing.assert_array_equal(np.asarray(balance.tables.lookup[i]), np.asarray(layer.route_lookup.get_value()))
    x = zipf_batch(seed=60)
    out, balance = step(params, balance, x)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint32), np.asarray(forward(model, x)).view(np.uint32))

    # The shares travel in the checkpoint item, and a failed move hands back the tables it started from.
    restored = balancer.restore_item(balancer.checkpoint_item(balance))
    for a, b in zip(jax.tree.leaves(restored.tables), jax.tree.leaves(balance.tables)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    rng = np.random.default_rng(5)
    current = balance.tables.placement()
    target = Placement.from_phy2log(np.stack([rng.permutation(r) for r in current.phy2log]), E, num_ranks=G)
    monkeypatch.setattr(moves, "execute_plan", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected")))
    with pytest.raises(RearrangementError) as failure:
        balancer.rearrange(params, (), balance, placement=target)
    _, _, back = failure.value.restored
    for a, b in zip(jax.tree.leaves(back.tables), jax.tree.leaves(balance.tables)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("overlap", [None, pytest.param("layer", marks=pytest.mark.slow)])
@pytest.mark.parametrize("routing", ROUTING_MODES)
def test_after_warmup_nothing_compiles_while_serving_and_rearranging(routing, overlap):
    """``warmup()`` covers every mode's table update and the step's window update: steps and a rearrangement (at once
    or a layer per step) compile no program of theirs. ``lp`` built its layers' alias lookup tables op by op at each
    move, compiling them anew every time (seconds per move on a GPU). (The mover's executor is rehearsed on
    synthetic loads: a move that needs more send capacity than those compiles once, as ``warmup`` says.)"""
    model = TwoLayers(routing=routing)
    ctl = EplbController(model, MESH, config(routing, overlap=overlap))
    forward(model, zipf_batch(0))  # the model's own program compiles here
    ctl.warmup()
    compiled = []

    def listener(event, duration, **kwargs):
        stack = "".join(traceback.format_stack())
        if event == "/jax/core/compile/backend_compile_duration" and "moe_eplb_jax/transport/" not in stack:
            compiled.append(stack)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        run_until_rearranged(model, ctl, seed=1)
        run_until_rearranged(model, ctl, seed=20)  # a second move: nothing new either
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert not compiled, f"{len(compiled)} programs compiled after warmup ({routing}, {overlap}):\n{compiled[0]}"

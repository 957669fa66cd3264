"""The functional API: a model written without NNX trains, rearranges with its Adam state, matches the NNX controller."""

import argparse

import jax
import numpy as np
import optax
import pytest
import train_functional
from _functional_lm import EXPERT_PATTERN, init_params, loss_and_loads, rms_norm, synthetic_batch
from _runtime import Runtime
from flax import nnx

from moe_eplb_jax.config import EplbConfig
from moe_eplb_jax.control import Balancer, ExpertLayout, PytreeStore, RearrangementError, moves
from moe_eplb_jax.flax import EplbController, MoELayer
from moe_eplb_jax.placement import Placement
from moe_eplb_jax.sim.loadfile import read_load

DIM, EXPERTS, REDUNDANT, LAYERS = 16, 8, 8, 2


def example_args(eplb_config, steps=12):
    return argparse.Namespace(
        steps=steps,
        layers=LAYERS,
        experts=EXPERTS,
        redundant=REDUNDANT,
        dim=DIM,
        batch=8,
        seq=8,
        lr=1e-2,
        eplb_config=eplb_config,
        seed=0,
        devices=8,
        ranks=None,
        coordinator=None,
        num_processes=1,
        process_id=0,
    )


class Twin(nnx.Module):
    """The functional example's model as an NNX module: the same parameters and the same math."""

    def __init__(self, params, mesh):
        self.embed = nnx.Param(params["embed"])
        self.layers = nnx.List()
        for p in params["layers"]:
            layer = MoELayer(DIM, DIM, EXPERTS, 2, mesh=mesh, num_physical=EXPERTS + REDUNDANT, rngs=nnx.Rngs(0))
            for var, value in (
                (layer.router, p["router"]),
                (layer.router_bias, p["router_bias"]),
                (layer.w_in, p["experts"]["w_in"]),
                (layer.w_out, p["experts"]["w_out"]),
            ):
                var.set_value(value)
            self.layers.append(layer)

    def __call__(self, tokens):
        x = self.embed.get_value()[tokens]
        for layer in self.layers:
            x = x + layer(rms_norm(x))
        return rms_norm(x) @ self.embed.get_value().T


@pytest.mark.slow  # a training run per config
@pytest.mark.parametrize(
    "eplb_config",
    [
        '{"window_size": 4, "step_interval": 8}',
        '{"step_interval": 8, "use_async": true}',  # one layer per step
    ],
)
def test_functional_example_matches_the_nnx_controller(eplb_config):
    args = example_args(eplb_config)
    rt = Runtime(args)
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam mixes int and float scalars
        losses, reports, balancer, params, balance = train_functional.train(args, rt, log=lambda *_: None)
    assert [step for step, _ in reports] == ([2, 10] if "use_async" not in eplb_config else [3, 12])
    assert all(r["bytes_moved"] > 0 and r["layers_moved"] == LAYERS for _, r in reports)
    assert losses[-1] < losses[0]

    # The same model, data and optimizer through NNX and EplbController.
    mesh = rt.mesh
    config = train_functional.eplb_config(eplb_config, redundant=REDUNDANT, ranks=rt.ranks)
    twin = Twin(
        init_params(
            0, mesh=mesh, dim=DIM, hidden=DIM, num_layers=LAYERS, num_experts=EXPERTS, num_physical=EXPERTS + REDUNDANT
        ),
        mesh,
    )
    optimizer = nnx.Optimizer(twin, optax.adam(args.lr), wrt=nnx.Param)
    ctl = EplbController(twin, mesh, config, optimizer=optimizer)

    @nnx.jit
    def step(model, optimizer, tokens):
        def loss_fn(model):
            logits = model(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    rng, twin_losses, twin_reports = np.random.default_rng(args.seed), [], []
    for i in range(args.steps):
        tokens = rt.global_batch(synthetic_batch(rng, args.batch, args.seq + 1, 64))
        with jax.numpy_dtype_promotion("standard"):
            twin_losses.append(float(step(twin, optimizer, tokens)))
        report = ctl.step()
        if report and report.get("rearranged"):
            twin_reports.append((i + 1, report))
    np.testing.assert_allclose(twin_losses, losses, rtol=1e-5)
    assert [s for s, _ in twin_reports] == [s for s, _ in reports]
    for (_, a), (_, b) in zip(twin_reports, reports):
        assert a["slots_moved"] == b["slots_moved"] and a["bytes_moved"] == b["bytes_moved"]
    assert ctl.placement == balance.tables.placement()
    for layer, p in zip(twin.layers, params["layers"]):
        for name in ("w_in", "w_out"):
            np.testing.assert_allclose(
                np.asarray(getattr(layer, name).get_value()), np.asarray(p["experts"][name]), rtol=1e-5, atol=1e-6
            )


def small(mesh):
    params = init_params(
        1, mesh=mesh, dim=DIM, hidden=DIM, num_layers=LAYERS, num_experts=EXPERTS, num_physical=EXPERTS + REDUNDANT
    )
    config = EplbConfig(num_redundant_experts=REDUNDANT, window_size=4, step_interval=8, num_gpus=8)
    tx = optax.adam(1e-2)
    return params, tx.init(params), Balancer(config, mesh, ExpertLayout.match(params, EXPERT_PATTERN))


pytestmark = pytest.mark.devices(8)  # skipped on fewer devices, where MESH is None
MESH = jax.make_mesh((8,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,)) if jax.device_count() >= 8 else None


@jax.jit
def loss_and_record(params, balance, tokens):
    loss, loads = loss_and_loads(params, balance.tables, tokens, mesh=MESH)
    return loss, Balancer.record_step(balance, loads)


def tokens(seed):
    sharding = jax.NamedSharding(MESH, jax.sharding.PartitionSpec("ep"))
    return jax.device_put(synthetic_batch(np.random.default_rng(seed), 8, 9, 64), sharding)


def record(balancer, params, balance, steps=3):
    for step in range(steps):
        balance = loss_and_record(params, balance, tokens(step))[1]
    return balance


def test_failed_functional_move_leaves_inputs_and_returns_them_restored(monkeypatch):
    params, opt_state, balancer = small(MESH)
    balance = record(balancer, params, balancer.init(params))
    host = lambda tree: [np.asarray(x) for x in jax.tree.leaves(tree)]
    before = host((params, opt_state, balance))
    real, calls = moves.execute_plan, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the second layer's move
            raise RuntimeError("injected transfer failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(moves, "execute_plan", failing)
    target = Placement.from_phy2log(
        np.stack([np.random.default_rng(i).permutation(r) for i, r in enumerate(balance.tables.placement().phy2log)]),
        EXPERTS,
    )
    with pytest.raises(RearrangementError) as failure:
        balancer.rearrange(params, opt_state, balance, placement=target)
    assert "injected" in str(failure.value.__cause__)
    assert all(np.array_equal(a, b) for a, b in zip(host((params, opt_state, balance)), before))  # inputs intact
    restored = failure.value.restored
    assert all(np.array_equal(a, b) for a, b in zip(host(restored), before))
    # A retry moves everything, and the optimizer moments with the weights.
    monkeypatch.setattr(moves, "execute_plan", real)
    new_params, new_opt, new_balance, report = balancer.rearrange(*restored, placement=target)
    assert new_balance.tables.placement() == target and report["layers_moved"] == LAYERS
    assert (
        int(np.asarray(new_balance.loads.window_filled)) == 0
        and int(np.asarray(new_balance.loads.num_rearrangements)) == 1
    )
    old = balance.tables.placement().phy2log
    for layer in range(LAYERS):
        source = np.array([np.flatnonzero(old[layer] == e)[0] for e in target.phy2log[layer]])
        w = np.asarray(params["layers"][layer]["experts"]["w_in"])
        assert np.array_equal(np.asarray(new_params["layers"][layer]["experts"]["w_in"]), w[source])
        mu = np.asarray(opt_state[0].mu["layers"][layer]["experts"]["w_in"])
        assert np.array_equal(np.asarray(new_opt[0].mu["layers"][layer]["experts"]["w_in"]), mu[source])


def test_functional_checkpoint_item_dump_and_bad_input(tmp_path):
    params, opt_state, balancer = small(MESH)
    balance = record(balancer, params, balancer.init(params))
    item = balancer.checkpoint_item(balance)
    again = balancer.restore_item(item)
    assert int(np.asarray(item["window_filled"])) == 3 and item["window"].sum() > 0
    assert all(np.array_equal(a, b) for a, b in zip(item.values(), balancer.checkpoint_item(again).values()))
    assert again.tables.placement() == balance.tables.placement()
    balancer.dump_loads(balance, tmp_path / "loads.json")
    assert read_load(tmp_path / "loads.json").load.shape == (3, LAYERS, EXPERTS)
    with pytest.raises(ValueError, match="window_filled"):
        balancer.restore_item({**item, "window_filled": np.int32(-3)})
    with pytest.raises(ValueError, match="no leaf"):
        Balancer(balancer.config, MESH, ExpertLayout((("layers/0/experts/nope",),))).init(params)
    with pytest.raises(ValueError, match="matches"):
        ExpertLayout.match(params, r"blocks/(\d+)/")
    with pytest.raises(ValueError, match="group"):
        ExpertLayout.match(params, r"layers/0/experts")
    replicated = jax.tree.map(
        lambda x: jax.device_put(np.asarray(x), jax.NamedSharding(MESH, jax.sharding.PartitionSpec())), params
    )
    with pytest.raises(ValueError, match="no slot axis"):
        balancer.init(replicated)
    with pytest.raises(ValueError, match="num_gpus"):
        Balancer(EplbConfig(num_redundant_experts=REDUNDANT, num_gpus=4), MESH, balancer.layout)
    with pytest.raises(ValueError, match="init"):
        Balancer(balancer.config, MESH, balancer.layout).decide(balance)


def test_functional_overlap_moves_a_layer_per_call_and_stays_consistent():
    params, opt_state, balancer = small(MESH)
    balancer = Balancer(EplbConfig(**{**balancer.config.to_dict(), "overlap": "layer"}), MESH, balancer.layout)
    balance = record(balancer, params, balancer.init(params))
    batch = tokens(9)
    loss0, _ = loss_and_record(params, balance, batch)
    move = balancer.decide(balance)
    assert len(move.pending) == LAYERS
    calls = 0
    while True:
        params, opt_state, balance, move, report = balancer.advance(params, opt_state, balance, move)
        calls += 1
        loss, _ = loss_and_record(params, balance, batch)
        assert float(loss) == float(loss0)  # consistent after every call: outputs placement-invariant
        if report is not None:
            break
    assert calls == LAYERS and balance.tables.placement() == move.new and report["rearranged"]


@pytest.mark.parametrize("kind", [RuntimeError, KeyboardInterrupt])
def test_a_functional_write_that_stops_partway_returns_the_old_pytrees(monkeypatch, kind):
    """The second layer's write stops after its first leaf: the restored pytrees are the old ones, every leaf."""
    params, opt_state, balancer = small(MESH)
    balance = record(balancer, params, balancer.init(params))
    host = lambda tree: [np.asarray(x) for x in jax.tree.leaves(tree)]
    before = host((params, opt_state, balance))
    real, calls = PytreeStore.write, []

    def half_write(store, layer, tree):
        calls.append(layer)
        if len(calls) == 2:
            store.params[store.positions[layer][0][0]] = tree["experts"][0]
            raise kind("injected: the write stopped after one leaf")
        return real(store, layer, tree)

    monkeypatch.setattr(PytreeStore, "write", half_write)
    current = balance.tables.placement()
    target = Placement.from_phy2log(np.stack([np.roll(r, 3) for r in current.phy2log]), EXPERTS)
    with pytest.raises(RearrangementError) as failure:
        balancer.rearrange(params, opt_state, balance, placement=target)
    assert isinstance(failure.value.__cause__, kind)
    assert all(np.array_equal(a, b) for a, b in zip(host(failure.value.restored), before))

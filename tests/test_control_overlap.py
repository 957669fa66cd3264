"""Moves overlapped with steps, warmup, reports, and the record -> dump -> fit -> serve loop."""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_eplb_jax import cli
from moe_eplb_jax.config import EplbConfig
from moe_eplb_jax.flax import EplbController, MoELayer
from moe_eplb_jax.placement import Placement
from moe_eplb_jax.sim.loadfile import read_load
from moe_eplb_jax.transport import executor_trace_count

G, E, P, L, D = 4, 8, 12, 3, 16
pytestmark = pytest.mark.devices(G)  # skipped on fewer devices, where MESH is None
MESH = jax.make_mesh((G,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,)) if jax.device_count() >= G else None
CONFIG = EplbConfig(num_redundant_experts=P - E, window_size=4, step_interval=8, num_gpus=G)


class Stack(nnx.Module):
    def __init__(self, seed):
        rngs = nnx.Rngs(seed)
        self.layers = nnx.List([MoELayer(D, 16, E, 2, mesh=MESH, num_physical=P, rngs=rngs) for _ in range(L)])
        for i, layer in enumerate(self.layers):  # each layer favours other experts: every layer moves
            skew = -1.5 * np.log1p(np.roll(np.arange(E, dtype=np.float32), 3 * i))
            layer.router_bias.set_value(jax.device_put(skew, layer.router_bias.get_value().sharding))

    def __call__(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


@nnx.jit
def forward(model, x):
    return model(x)


def batch(step):
    return jnp.asarray(np.random.default_rng(step).standard_normal((G * 8, D)).astype(np.float32))


def experts(model):
    return [np.asarray(leaf) for layer in model.layers for leaf in jax.tree.leaves(layer.eplb_expert_variables())]


def test_overlapped_outputs_equal_the_all_at_once_run_at_every_step():
    runs = {mode: Stack(seed=4) for mode in (None, "layer")}
    ctls = {mode: EplbController(model, MESH, CONFIG, overlap=mode) for mode, model in runs.items()}
    moving_steps, reports = 0, {}
    for step in range(8):
        x = batch(step)
        outs = {mode: np.asarray(forward(model, x)) for mode, model in runs.items()}
        assert np.array_equal(outs[None], outs["layer"]), step  # placement-invariant at every step
        for mode, ctl in ctls.items():
            report = ctl.step()
            if report and report.get("rearranged"):
                reports[mode] = (step, report)
        moving_steps += ctls["layer"].rearranging
        if ctls["layer"].rearranging:  # layers switch one at a time: some still route with the old tables
            assert ctls["layer"].placement != ctls[None].placement
    assert moving_steps == L - 1  # decided at step 1 (the first step due), a layer per step
    (step_all, all_at_once), (step_over, over) = reports[None], reports["layer"]
    assert step_all == 1 and step_over == step_all + L - 1
    assert ctls[None].placement == ctls["layer"].placement != Placement.linear(L, E, P)
    assert all(np.array_equal(a, b) for a, b in zip(experts(runs[None]), experts(runs["layer"])))
    for key in ("slots_moved", "bytes_moved", "layers_moved", "balancedness_before", "balancedness_after"):
        assert all_at_once[key] == over[key], key


@pytest.mark.parametrize("budget, moving_steps", [(1, L - 1), (10**12, 0)])
def test_byte_budget_moves_as_many_layers_as_fit(budget, moving_steps):
    """A byte budget per step: one layer when none fits (at least one moves), every layer when all fit."""
    model = Stack(seed=5)
    ctl = EplbController(model, MESH, CONFIG, overlap=budget)
    steps, report = 0, None
    for step in range(10):
        forward(model, batch(step))
        report = ctl.step()
        steps += ctl.rearranging
        if report and report.get("rearranged"):
            break
    assert report is not None and report["layers_moved"] == L and steps == moving_steps
    with pytest.raises(ValueError, match="overlap"):
        EplbController(model, MESH, CONFIG, overlap=0)
    with pytest.raises(ValueError, match="overlap"):
        EplbController(model, MESH, CONFIG, overlap="layers")


def test_warmup_leaves_nothing_to_compile_in_the_first_rearrangement(caplog):
    model = Stack(seed=6)
    ctl = EplbController(model, MESH, CONFIG)
    before = experts(model), ctl.placement
    info = ctl.warmup()
    assert info["send_capacity"] > 0 and info["moves"] >= L
    assert ctl.placement == before[1] and all(np.array_equal(a, b) for a, b in zip(experts(model), before[0]))
    traces = executor_trace_count()
    with caplog.at_level(logging.INFO, logger="moe_eplb_jax"):
        report = None
        for step in range(2):
            forward(model, batch(step))
            report = ctl.step()
    assert report is not None and report["rearranged"] and report["bytes_moved"] > 0
    assert executor_trace_count() == traces  # the mover compiled in warmup serves the real move
    assert report["move_seconds"] > 0 and report["gb_per_s"] == pytest.approx(
        report["bytes_moved"] / report["move_seconds"] / 1e9
    )
    assert any("MB in" in r.getMessage() and "GB/s" in r.getMessage() for r in caplog.records)


def test_record_dump_fit_serve_round_trip(tmp_path):
    model = Stack(seed=7)
    ctl = EplbController(model, MESH, dataclasses.replace(CONFIG, step_interval=100), rebalance=False)
    x = batch(0)
    for _ in range(3):
        forward(model, x)
        ctl.step()
    path = tmp_path / "loads.npz"
    ctl.dump_loads(path)
    trace = read_load(path)
    assert trace.load.shape == (3, L, E) and trace.meta["num_ranks"] == G
    # Every step's logical loads: tokens * top_k per layer, the slot loads mapped through the placement.
    assert np.all(trace.load.sum(2) == x.shape[0] * 2)
    slot = ctl.window_slot_load()
    for layer in range(L):
        expected = np.bincount(ctl.placement.phy2log[layer], weights=slot[layer], minlength=E)
        assert np.allclose(trace.total()[layer], expected)
    fitted = tmp_path / "placement.json"
    code = cli.main(["fit", str(path), "--num-ranks", str(G), "--num-physical", str(P), "-o", str(fitted)])
    assert code in (0, None)
    served = Stack(seed=7)
    held = EplbController(served, MESH, CONFIG, placement=str(fitted), rebalance=False)
    assert held.placement == Placement.load(fitted) != Placement.linear(L, E, P)
    assert np.array_equal(np.asarray(forward(served, x)), np.asarray(forward(model, x)))
    before = ctl.window_slot_load()
    fresh = EplbController(Stack(seed=7), MESH, CONFIG)
    with pytest.raises(ValueError, match="window is empty"):
        fresh.dump_loads(tmp_path / "empty.npz")
    assert np.array_equal(ctl.window_slot_load(), before)


def test_rearrange_finishes_an_overlapped_move_and_checkpoints_mid_move_stay_consistent():
    model = Stack(seed=8)
    ctl = EplbController(model, MESH, CONFIG, overlap="layer")
    for step in range(2):
        forward(model, batch(step))
        ctl.step()
    assert ctl.rearranging and len(ctl._run.moving.moved) == 1
    item = ctl.checkpoint_item()  # mid-move: the tables layers route with now, moved layers' window rows dropped
    assert np.array_equal(item["phy2log"], ctl.placement.phy2log)
    assert item["window"][:, 0].sum() == 0 and item["window"][:, 1:].sum() > 0
    with pytest.raises(ValueError, match="in progress"):
        ctl.apply_placement(Placement.linear(L, E, P))
    out = np.asarray(forward(model, batch(9)))
    report = ctl.rearrange()  # finishes the layers left, now
    assert report["rearranged"] and report["layers_moved"] == L and not ctl.rearranging
    assert ctl.num_rearrangements == 1 and int(np.asarray(ctl.state.window_filled)) == 0
    assert np.array_equal(np.asarray(forward(model, batch(9))), out)
    twin = EplbController(Stack(seed=8), MESH, CONFIG)
    twin.restore_item(item)  # the mid-move item is a consistent state of its own
    assert twin.placement == Placement.from_tables(item["phy2log"], item["log2phy"], item["logcnt"])

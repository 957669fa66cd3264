"""The one control loop: its two adapters run the same scenario alike, and a step with nothing due stays on the device.

``EplbController`` (NNX variables) and ``Balancer`` (plain pytrees) are fed the same per-step loads under the same
config; at every step they hold the same placement, routing tables, load window, counters and expert bytes, and
report the same rearrangements.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as PS

from moe_eplb_jax.config import EplbConfig
from moe_eplb_jax.control import Balancer, ExpertLayout, Schedule
from moe_eplb_jax.flax import EplbController, MoELayer
from moe_eplb_jax.transport import put_host

G, E, P, L, D = 4, 8, 12, 3, 16
pytestmark = pytest.mark.devices(G)  # skipped on fewer devices, where MESH is None
MESH = jax.make_mesh((G,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,)) if jax.device_count() >= G else None
TIMING = ("move_seconds", "gb_per_s")


class Stack(nnx.Module):
    """``L`` MoE layers whose loads the test writes itself (no forward pass: the loads are the scenario)."""

    def __init__(self, routing="hash"):
        rngs = nnx.Rngs(0)
        self.layers = nnx.List(
            [MoELayer(D, 16, E, 2, mesh=MESH, num_physical=P, routing=routing, rngs=rngs) for _ in range(L)]
        )


def scenario_loads(step: int) -> np.ndarray:
    """``[L, G, P]`` int32 tokens per slot counted on each rank: skewed, another hot expert per layer."""
    rng = np.random.default_rng(step)
    weight = np.stack([np.roll(1.0 / np.arange(1, P + 1) ** 1.5, 4 * layer) for layer in range(L)])
    return rng.poisson(200 * weight[:, None, :], size=(L, G, P)).astype(np.int32)


record = jax.jit(Balancer.record_step)


def assert_same(ctl, balancer, balance, params, routing):
    assert ctl.placement == balance.tables.placement()
    ours, theirs = ctl.routing_tables, balance.tables.host_tables(routing)
    assert ours.keys() == theirs.keys() and all(np.array_equal(ours[k], theirs[k]) for k in ours)
    for name in ("window", "pass_load", "window_pos", "window_filled", "step", "total_steps", "num_rearrangements"):
        assert np.array_equal(np.asarray(getattr(ctl.state, name)), np.asarray(getattr(balance.loads, name))), name
    assert np.array_equal(ctl.window_slot_load(), balancer.window_slot_load(balance))
    for layer, p in zip(ctl._store.layers, params["layers"]):
        for name, var in layer.module.eplb_expert_variables().items():
            assert np.array_equal(np.asarray(var.get_value()), np.asarray(p["experts"][name])), name


@pytest.mark.parametrize(
    "fields",
    [
        {},
        pytest.param({"routing": "lp", "overlap": "layer"}, marks=pytest.mark.slow),
        {"routing": "quota", "policy": "online", "overlap": 1},  # a byte budget: one layer per step
    ],
)
def test_both_adapters_run_the_same_loop(fields):
    config = EplbConfig(num_redundant_experts=P - E, window_size=3, step_interval=8, num_gpus=G, **fields)
    model = Stack(config.routing)
    params = {
        "layers": [
            {"experts": {"w_in": layer.w_in.get_value(), "w_out": layer.w_out.get_value()}} for layer in model.layers
        ]
    }
    ctl = EplbController(model, MESH, config)
    balancer = Balancer(config, MESH, ExpertLayout.match(params, r"layers/(\d+)/experts/"))
    balance = balancer.init(params)
    schedule, opt_state, move = balancer.schedule(balance), (), None
    reports = {"nnx": [], "functional": []}
    for step in range(14):  # rearrangements decided at steps 2 and 10 (a quarter of the interval, then 8 more)
        loads = scenario_loads(step)
        for layer, load in zip(model.layers, loads):
            layer.expert_load.set_value(put_host(load, MESH, PS("ep")))
        report = ctl.step()
        if report and report.get("rearranged"):
            reports["nnx"].append((step, {k: v for k, v in report.items() if k not in TIMING}))

        rows = [put_host(load, MESH, PS("ep")) for load in loads]
        balance = record(balance, rows, dummy=jnp.bool_(move is not None))
        schedule.tick()
        assert schedule.due == balancer.is_due(balance)
        if move is None and schedule.due:
            move = balancer.decide(balance)
        if move is not None:
            params, opt_state, balance, move, report = balancer.advance(params, opt_state, balance, move)
            if report is not None:
                move = None
                schedule.rearranged()
                report = {k: v for k, v in report.items() if k not in TIMING}
                reports["functional"].append((step, {**report, "num_rearrangements": schedule.num_rearrangements}))
        assert ctl.rearranging == (move is not None), step
        assert_same(ctl, balancer, balance, params, config.routing)
    assert len(reports["nnx"]) == 2 and reports["nnx"] == reports["functional"]
    assert all(r["bytes_moved"] > 0 for _, r in reports["nnx"])


def count_host_reads(monkeypatch) -> list:
    """Records every read of an array's value on the host: ``int()``, ``float()``, ``jax.device_get`` and
    ``np.asarray`` of an array over several devices all go through its ``_value``. (The transfer guard refuses
    uploads and copies between devices, but lets a CPU array's reads through: they are zero-copy there.)"""
    reads, array_type = [], type(jnp.zeros(()))
    real = array_type._value
    monkeypatch.setattr(array_type, "_value", property(lambda array: reads.append(array.shape) or real.fget(array)))
    return reads


def test_a_step_with_nothing_due_reads_and_uploads_nothing(monkeypatch):
    """``step()`` with nothing due reads no device value and runs under a transfer guard that refuses every
    upload, and still records every step's loads; a step that logs reads the device, and the count sees it."""
    config = EplbConfig(num_redundant_experts=P - E, window_size=4, step_interval=100, num_gpus=G)
    model = Stack()
    ctl = EplbController(model, MESH, config)
    ctl.step()  # compiles the window update
    placed = [[put_host(load, MESH, PS("ep")) for load in scenario_loads(step)] for step in range(3)]
    schedule = Schedule(config)
    reads = count_host_reads(monkeypatch)
    with jax.transfer_guard("disallow"):
        for loads in placed:
            for layer, load in zip(model.layers, loads):
                layer.expert_load.set_value(load)
            assert ctl.step() is None
            schedule.tick()
            assert not schedule.due
    assert reads == []
    want = sum(scenario_loads(step).sum(1) for step in range(3))
    np.testing.assert_array_equal(ctl.window_slot_load(), want)  # recorded on the device, read when asked
    assert reads and ctl.total_steps == 4 and int(np.asarray(ctl.state.total_steps)) == 4

    logging = EplbController(Stack(), MESH, EplbConfig(**{**config.to_dict(), "log_interval": 1}))
    logging.step()
    reads.clear()
    assert logging.step() is not None and reads

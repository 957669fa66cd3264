"""The EPLB state as an Orbax item: round trip beside model and optimizer, damaged items, crashes, two processes."""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from _processes import free_port, run_workers
from flax import nnx

from moe_eplb_jax.config import EplbConfig
from moe_eplb_jax.control import checkpoint
from moe_eplb_jax.flax import EplbController, MoELayer
from moe_eplb_jax.placement import Placement

G, E, P, L, D = 4, 8, 12, 2, 16
W = 4
pytestmark = pytest.mark.devices(G)  # skipped on fewer devices, where MESH is None
MESH = jax.make_mesh((G,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,)) if jax.device_count() >= G else None
CONFIG = EplbConfig(num_redundant_experts=P - E, window_size=W, step_interval=8, num_gpus=G)
HERE = os.path.dirname(os.path.abspath(__file__))


class Stack(nnx.Module):
    def __init__(self, seed, num_layers=L):
        rngs = nnx.Rngs(seed)
        self.layers = nnx.List([MoELayer(D, 16, E, 2, mesh=MESH, num_physical=P, rngs=rngs) for _ in range(num_layers)])
        skew = -1.5 * np.log1p(np.arange(E, dtype=np.float32))
        for layer in self.layers:
            layer.router_bias.set_value(jax.device_put(skew, layer.router_bias.get_value().sharding))

    def __call__(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


@nnx.jit
def forward(model, x):
    return model(x)


def run(steps, seed=0):
    """A controller after ``steps`` steps of serving: one rearrangement (at step 2), window rows after it."""
    model = Stack(seed)
    ctl = EplbController(model, MESH, CONFIG)
    x = jnp.asarray(np.random.default_rng(seed).standard_normal((G * 8, D)).astype(np.float32))
    for _ in range(steps):
        forward(model, x)
        ctl.step()
    return model, ctl, x


def test_orbax_round_trip_beside_model_and_optimizer(tmp_path):
    model, ctl, x = run(steps=5)
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    assert ctl.num_rearrangements == 1 and int(np.asarray(ctl.state.window_filled)) == 3
    manager = ocp.CheckpointManager(tmp_path / "ckpt", options=ocp.CheckpointManagerOptions(max_to_keep=2))
    manager.save(
        5,
        args=ocp.args.Composite(
            model=ocp.args.StandardSave(nnx.state(model)),
            optimizer=ocp.args.StandardSave(nnx.state(optimizer)),
            eplb=ocp.args.StandardSave(ctl.checkpoint_item()),
        ),
    )
    manager.wait_until_finished()

    fresh = Stack(seed=1)  # other weights, linear placement
    fresh_opt = nnx.Optimizer(fresh, optax.adam(1e-3), wrt=nnx.Param)
    twin = EplbController(fresh, MESH, CONFIG, optimizer=fresh_opt)
    restored = ocp.CheckpointManager(tmp_path / "ckpt").restore(
        5,
        args=ocp.args.Composite(
            model=ocp.args.StandardRestore(nnx.state(fresh)),
            optimizer=ocp.args.StandardRestore(nnx.state(fresh_opt)),
            eplb=ocp.args.StandardRestore(),
        ),
    )
    twin.restore_item(restored["eplb"])
    nnx.update(fresh, restored["model"])
    nnx.update(fresh_opt, restored["optimizer"])
    assert twin.placement == ctl.placement != Placement.linear(L, E, P)
    assert (twin.total_steps, twin.num_rearrangements) == (ctl.total_steps, ctl.num_rearrangements)
    for name in ("window_pos", "window_filled", "step", "total_steps", "num_rearrangements"):
        assert int(np.asarray(getattr(twin.state, name))) == int(np.asarray(getattr(ctl.state, name))), name
    assert np.array_equal(twin.window_slot_load(), ctl.window_slot_load())
    assert np.array_equal(np.asarray(forward(fresh, x)), np.asarray(forward(model, x)))
    # Both continue in lock-step: the next rearrangement comes at the same step with the same placement.
    for _ in range(CONFIG.step_interval):
        forward(model, x), forward(fresh, x)
        assert (ctl.step() or {}).get("rearranged") == (twin.step() or {}).get("rearranged")
    assert ctl.num_rearrangements == twin.num_rearrangements == 2 and twin.placement == ctl.placement


def _damage(item, field, value):
    return {**item, field: value}


def _bad_placement(item):
    phy2log = item["phy2log"].copy()
    phy2log[1, 3] = E  # an expert id outside [0, E)
    return _damage(item, "phy2log", phy2log)


def _unplaced_expert(item):
    phy2log = item["phy2log"].copy()
    phy2log[0] = 0  # every slot holds expert 0: the others have no replica
    return _damage(item, "phy2log", phy2log)


def _config_bytes(text):
    return np.frombuffer(text.encode(), np.uint8).copy()


DAMAGE = {
    "negative step": (lambda it: _damage(it, "step", np.int32(-1)), "'step'"),
    "negative rearrangements": (lambda it: _damage(it, "num_rearrangements", np.int32(-2)), "num_rearrangements"),
    "step past total": (lambda it: _damage(it, "step", np.int32(int(it["total_steps"]) + 1)), "total_steps"),
    "filled -3": (lambda it: _damage(it, "window_filled", np.int32(-3)), "window_filled"),
    "filled past W": (lambda it: _damage(it, "window_filled", np.int32(W + 1)), "window_filled"),
    "pos out of range": (lambda it: _damage(it, "window_pos", np.int32(W)), "window_pos"),
    "pos and filled disagree": (lambda it: _damage(it, "window_pos", np.int32(0)), "disagree"),
    "NaN window": (lambda it: _damage(it, "window", np.full(it["window"].shape, np.nan, np.float32)), "integers"),
    "negative window": (lambda it: _damage(it, "window", it["window"] - 1000), "negative"),
    "negative pass load": (lambda it: _damage(it, "pass_load", it["pass_load"] - 1), "negative"),
    "window of another shape": (lambda it: _damage(it, "window", it["window"][:, :1]), "'window' has shape"),
    "other L": (lambda it: _damage(it, "phy2log", np.concatenate([it["phy2log"]] * 2)), "'phy2log' has shape"),
    "expert out of range": (_bad_placement, "outside the logical expert range"),
    "unplaced expert": (_unplaced_expert, "placement"),
    "logcnt disagrees": (lambda it: _damage(it, "logcnt", it["logcnt"][:, ::-1].copy()), "logcnt"),
    "config garbage": (lambda it: _damage(it, "config", _config_bytes("{not json")), "'config'"),
    "config other W": (
        lambda it: _damage(it, "config", _config_bytes(json.dumps({**CONFIG.to_dict(), "window_size": 9}))),
        "window_size",
    ),
    "missing field": (lambda it: {k: v for k, v in it.items() if k != "window"}, "missing field"),
    "unknown field": (lambda it: _damage(it, "extra", np.int32(1)), "unknown field"),
    "version": (lambda it: _damage(it, "version", np.int32(3)), "version"),
    "version 1 with shares": (
        lambda it: _damage(it, "version", np.int32(1)),
        r"unknown field\(s\) \['replica_shares'\]",
    ),
    "missing version": (lambda it: {k: v for k, v in it.items() if k != "version"}, "'version'"),
}


@pytest.fixture(scope="module")
def restore_target():
    """A good item and one controller every damaged case restores into: each case also checks that the earlier
    cases' failed restores left it as it was."""
    _, ctl, _ = run(steps=5)
    item = ctl.checkpoint_item()
    assert item["logcnt"][:, ::-1].tolist() != item["logcnt"].tolist()
    _, twin, _ = run(steps=1, seed=2)
    return item, twin, (twin.placement, twin.window_slot_load(), twin.total_steps)


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_item_raises_at_restore_and_changes_nothing(case, restore_target):
    item, twin, before = restore_target
    damage, match = DAMAGE[case]
    with pytest.raises(ValueError, match=match):
        twin.restore_item(damage(item))
    assert twin.placement == before[0] and np.array_equal(twin.window_slot_load(), before[1])
    assert twin.total_steps == before[2]


def test_damaged_item_through_orbax_raises_at_restore(tmp_path):
    _, ctl, _ = run(steps=5)
    item = ctl.checkpoint_item()
    item["window"] = item["window"].astype(np.float32)
    item["window"][0, 0, 0] = np.nan
    item["window_filled"] = np.int32(-3)
    manager = ocp.CheckpointManager(tmp_path / "ckpt")
    manager.save(1, args=ocp.args.Composite(eplb=ocp.args.StandardSave(item)))
    manager.wait_until_finished()
    restored = manager.restore(1, args=ocp.args.Composite(eplb=ocp.args.StandardRestore()))
    with pytest.raises(ValueError, match="'window' must hold integers"):
        ctl.restore_item(restored["eplb"])


def _damage_files(folder, name):
    for root, _, files in os.walk(folder):
        for file in files:
            if file == name or name == "*":
                with open(os.path.join(root, file), "wb") as f:
                    f.write(b"garbage")


def test_restore_step_gives_value_errors_for_missing_and_damaged_checkpoints(tmp_path):
    """Orbax raises its own FileNotFoundError / JSON / TensorStore errors; restore_step one ValueError each."""
    model, ctl, _ = run(steps=3)
    manager = ocp.CheckpointManager(tmp_path / "ckpt")
    for step in (1, 2):
        manager.save(
            step,
            args=ocp.args.Composite(
                model=ocp.args.StandardSave(nnx.state(model)), eplb=ocp.args.StandardSave(ctl.checkpoint_item())
            ),
        )
    manager.wait_until_finished()
    step, restored = checkpoint.restore_step(tmp_path / "ckpt", {"model": nnx.state(model)})
    assert step == 2 and set(restored) == {"model", "eplb"}
    assert all(np.array_equal(restored["eplb"][k], v) for k, v in ctl.checkpoint_item().items())
    assert checkpoint.restore_step(manager, {"model": nnx.state(model)}, step=1)[0] == 1
    (tmp_path / "empty").mkdir()
    _damage_files(tmp_path / "ckpt" / "2" / "eplb", "_METADATA")
    _damage_files(tmp_path / "ckpt" / "1" / "model", "*")
    for directory, step, match in (
        (tmp_path / "none", None, "no such checkpoint directory"),
        (tmp_path / "empty", None, "holds no checkpoint"),
        (tmp_path / "ckpt", 7, r"holds no checkpoint of step 7 \(steps: \[1, 2\]\)"),
        (tmp_path / "ckpt", True, "step must be an integer"),
        (tmp_path / "ckpt", None, "step 2 cannot be restored"),
        (tmp_path / "ckpt", 1, "step 1 cannot be restored"),
    ):
        with pytest.raises(ValueError, match=match) as error:
            checkpoint.restore_step(directory, {"model": nnx.state(model)}, step=step)
        assert "\n" not in str(error.value) and str(directory) in str(error.value)


def test_snapshot_item_round_trip_and_model_shape():
    _, ctl, _ = run(steps=3)
    item = ctl.checkpoint_item()
    snap = checkpoint.from_item(item, config=CONFIG, num_layers=L, num_logical=E, num_physical=P)
    again = checkpoint.to_item(snap)
    assert item.keys() == again.keys() and all(np.array_equal(item[k], again[k]) for k in item)
    with pytest.raises(ValueError, match="'phy2log' has shape"):
        checkpoint.from_item(item, config=CONFIG, num_layers=L + 1, num_logical=E, num_physical=P)
    with pytest.raises(ValueError, match="mapping"):
        checkpoint.from_item([1, 2], config=CONFIG, num_layers=L, num_logical=E, num_physical=P)


@pytest.mark.slow
def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path):
    """A process killed while committing step 2 leaves step 1 restorable, byte for byte."""
    worker = os.path.join(HERE, "_checkpoint_worker.py")
    ((code, out),) = run_workers([(worker, "crash", tmp_path)], timeout=600)
    assert code != 0 and "saved 1" in out and "committing 2" in out, out
    manager = ocp.CheckpointManager(tmp_path / "ckpt")
    assert manager.all_steps() == [1]
    restored = manager.restore(1, args=ocp.args.Composite(eplb=ocp.args.StandardRestore()))
    expected = np.load(tmp_path / "saved_1.npz")
    assert sorted(restored["eplb"]) == sorted(expected.files)
    for key in expected.files:
        assert np.array_equal(np.asarray(restored["eplb"][key]), expected[key]), key


@pytest.mark.slow
def test_two_processes_save_and_restore_one_checkpoint(tmp_path):
    """Both processes of a jax.distributed run save into one CheckpointManager and restore the same state."""
    worker = os.path.join(HERE, "_checkpoint_worker.py")
    port = free_port()
    results = run_workers([(worker, "two", tmp_path, port, i) for i in range(2)], timeout=900)
    for code, out in results:
        assert code == 0, out
    docs = [json.loads((tmp_path / f"result_{i}.json").read_text()) for i in range(2)]
    assert docs[0] == docs[1] and docs[0]["restored_equal"] and docs[0]["steps"] == [3]
    assert docs[0]["placement_moved"]  # the checkpoint holds a rearranged placement


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))

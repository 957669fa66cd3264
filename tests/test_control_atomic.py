"""Atomic rearrangement: a failure in any phase at any layer leaves model, optimizer, tables and EPLB state as before.

Failures are injected in each phase of a layer's move -- plan (host planning), pack, transfer and unpack (inside
the transport's executor, at trace time) and the table switch (the layer's ``eplb_set_placement``) -- at each
layer, with every layer moved at one step boundary and with ``overlap="layer"`` (one layer per step). Afterwards
outputs, expert weights, Adam moments, every layer's tables and the controller's placement and window equal the
state before; a retry then equals a model built from the permuted checkpoint.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from moe_eplb_jax.config import EplbConfig
from moe_eplb_jax.control import RearrangementError, moves
from moe_eplb_jax.control import loop as loop_module
from moe_eplb_jax.flax import EplbController, MoELayer
from moe_eplb_jax.placement import Placement
from moe_eplb_jax.transport import _executor as executor

G, E, P, L, D = 4, 8, 12, 3, 16
pytestmark = pytest.mark.devices(G)  # skipped on fewer devices, where MESH is None
MESH = jax.make_mesh((G,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,)) if jax.device_count() >= G else None
CONFIG = EplbConfig(num_redundant_experts=P - E, window_size=4, step_interval=8, num_gpus=G)
PHASES = ("plan", "pack", "transfer", "unpack", "switch")


class Stack(nnx.Module):
    """``L`` residual MoE layers with skewed routers (no attention: cheap to compile)."""

    def __init__(self, seed):
        rngs = nnx.Rngs(seed)
        self.layers = nnx.List([MoELayer(D, 16, E, 2, mesh=MESH, num_physical=P, rngs=rngs) for _ in range(L)])
        skew = -1.5 * np.log1p(np.arange(E, dtype=np.float32))
        for layer in self.layers:
            layer.router_bias.set_value(jax.device_put(skew, layer.router_bias.get_value().sharding))

    def __call__(self, x, record=True):
        for layer in self.layers:
            x = x + layer(x, record=record)
        return x


@nnx.jit
def forward(model, x, record):
    return model(x, record)


@nnx.jit
def train_step(model, optimizer, x):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - x) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def trained(seed):
    """A model and Adam state after two steps: non-zero moments, replicas still identical (tied gradients)."""
    model = Stack(seed)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    x = inputs()
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam mixes int and float scalars
        for _ in range(2):
            train_step(model, optimizer, x)
    return model, optimizer


def inputs():
    return jnp.asarray(np.random.default_rng(3).standard_normal((G * 8, D)).astype(np.float32))


def scrambled(placement: Placement, seed: int) -> Placement:
    """Every layer's slots shuffled: experts change ranks (transfers) in every layer."""
    rng = np.random.default_rng(seed)
    rows = np.stack([rng.permutation(row) for row in placement.phy2log])
    return Placement.from_phy2log(rows, placement.num_logical, num_ranks=G)


def snapshot(model, optimizer, ctl, x):
    """Everything a failed rearrangement must leave as it was, as host arrays."""
    host = lambda tree: [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]
    state = {
        "out": np.asarray(forward(model, x, jnp.bool_(False))),  # not counted: the window stays as it is
        "params": host(nnx.state(model, nnx.Param)),
        "opt": host(nnx.state(optimizer)),
        "layers": [host(ctl._store.read(layer)) for layer in range(L)],  # experts + their moments
        "tables": [np.asarray(t) for layer in model.layers for t in (*layer.eplb_get_placement(), layer.route_lookup)],
        "placement": [np.asarray(t) for t in (ctl.placement.phy2log, ctl.placement.log2phy, ctl.placement.logcnt)],
        "window": ctl.window_slot_load(),
    }
    for name in ("window_filled", "window_pos", "num_rearrangements"):
        state[name] = int(np.asarray(getattr(ctl.state, name)))
    return state


def assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if key == "layers":
            assert all(np.array_equal(x, y) for la, lb in zip(a[key], b[key]) for x, y in zip(la, lb)), key
        elif isinstance(a[key], list):
            assert len(a[key]) == len(b[key]) and all(np.array_equal(x, y) for x, y in zip(a[key], b[key])), key
        else:
            assert np.array_equal(a[key], b[key]), key


def permuted(values: np.ndarray, old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """``values`` (per slot, placement ``old``) as a checkpoint permuted to ``new`` would hold them."""
    first = {int(e): int(np.flatnonzero(old == e)[0]) for e in np.unique(old)}
    return values[[first[int(e)] for e in new]]


class Inject:
    """Makes phase ``phase`` fail once: at the ``layer``-th forward move, or at layer ``layer``'s first switch."""

    def __init__(self, monkeypatch, phase: str, layer: int, module):
        self.phase, self.layer, self.calls, self.fired = phase, layer, 0, False
        if phase == "plan":
            real = moves.plan_rearrangement
            monkeypatch.setattr(moves, "plan_rearrangement", lambda *a, **k: self._maybe_fail() or real(*a, **k))
        elif phase == "switch":
            real_switch = MoELayer.eplb_set_placement

            def switch(target, *args, **kwargs):
                if target is module and not self.fired:
                    self.calls = self.layer  # the first switch of that layer fails
                    self._maybe_fail()
                return real_switch(target, *args, **kwargs)

            monkeypatch.setattr(MoELayer, "eplb_set_placement", switch)
        else:
            real_execute = moves.execute_plan
            monkeypatch.setattr(moves, "execute_plan", lambda *a, **k: self._traced_failure(real_execute, *a, **k))

    def _maybe_fail(self):
        """Counts the calls of the phase; raises at the chosen one."""
        call, self.calls = self.calls, self.calls + 1
        if call == self.layer and not self.fired:
            self.fired = True
            raise RuntimeError(f"injected {self.phase} failure")
        return None

    def _traced_failure(self, real_execute, *args, **kwargs):
        """Runs the real move; at the chosen call with a fresh executor whose trace fails in the phase."""
        call, self.calls = self.calls, self.calls + 1
        if call != self.layer or self.fired:
            return real_execute(*args, **kwargs)
        self.fired = True

        def boom(*a, **k):
            raise RuntimeError(f"injected {self.phase} failure")

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(executor, "_EXECUTORS", {})  # trace anew, so the failure happens inside the executor
            if self.phase == "pack":
                mp.setattr(executor, "pack_rows", boom)
            elif self.phase == "unpack":
                mp.setattr(executor, "unpack_leaf", boom)
            else:
                mp.setattr(jax.lax, "ppermute", boom)
            return real_execute(*args, **kwargs)


# One case runs in the fast lane (the last layer, overlapped); the whole matrix is slow.
FAST = {("switch", 2, "layer")}
CASES = [
    pytest.param(phase, layer, overlap, marks=() if (phase, layer, overlap) in FAST else pytest.mark.slow)
    for phase in PHASES
    for layer in range(L)
    for overlap in (None, "layer")
]


@pytest.mark.parametrize("phase, layer, overlap", CASES)
def test_failure_in_any_phase_at_any_layer_rolls_back(monkeypatch, phase, layer, overlap):
    model, optimizer = trained(seed=0)
    ctl = EplbController(model, MESH, CONFIG, optimizer=optimizer, overlap=overlap)
    ctl.step()  # records the training steps' loads; the first rearrangement is due at the next step
    linear = ctl.placement
    target = scrambled(linear, seed=10)
    assert all(not np.array_equal(a, b) for a, b in zip(linear.phy2log, target.phy2log))
    monkeypatch.setattr(loop_module, "compute_placement", lambda *a, **k: target)
    x = inputs()
    before = snapshot(model, optimizer, ctl, x)
    assert before["window"].sum() > 0 and before["num_rearrangements"] == 0
    Inject(monkeypatch, phase, layer, model.layers[layer])
    with pytest.raises(RearrangementError, match="rolled back") as failure:
        for _ in range(L):  # no forward pass: the steps record zero loads
            ctl.step()
    assert "injected" in str(failure.value.__cause__) and not ctl.rearranging
    after = snapshot(model, optimizer, ctl, x)
    # The step that decided recorded one (zero) row; steps during an overlapped move record none.
    before["window_filled"] += 1
    before["window_pos"] += 1
    assert_same(before, after)

    report = None  # a retry completes and equals the checkpoint permuted to the target placement
    for _ in range(L):
        report = ctl.step()
        if report is not None:
            break
    assert report is not None and report["rearranged"] and ctl.placement == target
    assert report["bytes_moved"] > 0 and report["layers_moved"] == L and report["move_seconds"] > 0
    done = snapshot(model, optimizer, ctl, x)
    assert np.array_equal(done["out"], before["out"])  # placement-invariant outputs
    for i, module in enumerate(model.layers):
        old, new = linear.phy2log[i], target.phy2log[i]
        assert len(done["layers"][i]) == 6  # w_in, w_out and their mu, nu
        for moved, was in zip(done["layers"][i], before["layers"][i]):
            assert np.array_equal(moved, permuted(was, old, new))
        assert np.array_equal(np.asarray(module.phy2log.get_value()), new)


def test_one_layer_move_rolls_back(monkeypatch):
    """apply_placement of a placement that changes one layer: a failed transfer leaves everything as it was."""
    model, optimizer = trained(seed=0)
    ctl = EplbController(model, MESH, CONFIG, optimizer=optimizer)
    x = inputs()
    before = snapshot(model, optimizer, ctl, x)
    linear = ctl.placement
    phy2log = linear.phy2log.copy()
    phy2log[1] = scrambled(linear, seed=3).phy2log[1]
    target = Placement.from_phy2log(phy2log, E, num_ranks=G)
    Inject(monkeypatch, "transfer", 0, None)
    with pytest.raises(RearrangementError, match="layer 1"):
        ctl.apply_placement(target)
    assert_same(before, snapshot(model, optimizer, ctl, x))
    summary = ctl.apply_placement(target)
    assert summary["layers_moved"] == 1 and ctl.placement == target
    assert np.array_equal(np.asarray(forward(model, x, jnp.bool_(False))), before["out"])


class FailingWrites:
    """Counts ``nnx.Variable.set_value`` calls; the ``fail_at``-th raises ``kind`` instead of writing."""

    def __init__(self, monkeypatch):
        self.calls, self.fail_at, self.kind = 0, None, RuntimeError
        real = nnx.Variable.set_value

        def set_value(var, *args, **kwargs):
            self.calls += 1
            if self.calls == self.fail_at:
                raise self.kind(f"injected failure of write {self.calls}")
            return real(var, *args, **kwargs)

        monkeypatch.setattr(nnx.Variable, "set_value", set_value)

    def arm(self, index: int, kind) -> None:
        self.calls, self.fail_at, self.kind = 0, index, kind


@pytest.mark.parametrize("sweep", [pytest.param(False), pytest.param(True, marks=pytest.mark.slow)])
def test_a_write_that_stops_partway_is_rolled_back(monkeypatch, sweep):
    """Every variable write of a rearrangement fails in turn -- an error or Ctrl-C, in the middle of a layer's
    experts, moments or tables: every layer's bytes and tables are the old ones, as the error says."""
    target = scrambled(Placement.linear(L, E, P), seed=12)
    monkeypatch.setattr(loop_module, "compute_placement", lambda *a, **k: target)
    writes = FailingWrites(monkeypatch)
    twin, twin_optimizer = trained(seed=0)  # counts the writes of the move that goes through
    twin_ctl = EplbController(twin, MESH, CONFIG, optimizer=twin_optimizer)
    writes.arm(0, RuntimeError)
    twin_ctl.rearrange()
    count, per_layer = writes.calls, writes.calls // L
    assert twin_ctl.placement == target and count == L * per_layer == L * (6 + 5)  # w_in, w_out, 4 moments; 5 tables

    model, optimizer = trained(seed=0)
    ctl = EplbController(model, MESH, CONFIG, optimizer=optimizer)
    x = inputs()
    before = snapshot(model, optimizer, ctl, x)
    # Fast lane: Ctrl-C once the second layer's w_in is written (its w_out and moments still old: the six writes
    # of each layer's pytree come first, then the tables), and an error in the last layer's tables.
    cases = [(i, kind) for i in range(1, count + 1) for kind in (RuntimeError, KeyboardInterrupt)]
    cases = cases if sweep else [(6 + 2, KeyboardInterrupt), (count - 2, RuntimeError)]
    for index, kind in cases:
        writes.arm(index, kind)
        with pytest.raises(RearrangementError, match="rolled back; every layer is on its old placement") as failure:
            ctl.rearrange()
        assert isinstance(failure.value.__cause__, kind), (index, kind)
        writes.arm(0, RuntimeError)
        assert_same(before, snapshot(model, optimizer, ctl, x))
    report = ctl.rearrange()  # and then the move goes through
    assert report["layers_moved"] == L and ctl.placement == target

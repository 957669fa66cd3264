"""An atomic resize: a failure in any phase (at any layer) leaves the model, its optimizer, the layers' meshes and
tables and the controller's placement, config and window exactly as they were on the old mesh; a retry then
completes and equals the checkpoint permuted to the new placement, with the same outputs."""

import jax
import numpy as np
import pytest
from _elastic import (
    L,
    MixedLayer,
    assert_model_holds,
    assert_same,
    build,
    checkpoint,
    everything,
    forward,
    functional_twin,
    tokens,
)

from moe_eplb_jax import EplbConfig
from moe_eplb_jax.control import Balancer, ExpertLayout, PytreeStore, RearrangementError, elastic
from moe_eplb_jax.control import loop as loop_module
from moe_eplb_jax.control.window import LoadWindow
from moe_eplb_jax.flax import EplbController, graph_state
from moe_eplb_jax.flax.store import ModuleStore
from moe_eplb_jax.placement import Placement
from moe_eplb_jax.transport import _resize_executor, ep_mesh

pytestmark = pytest.mark.devices(8)
E, P = 8, 16
CONFIG = EplbConfig(num_redundant_experts=P - E, window_size=4, step_interval=1000, num_gpus=8)
# (phase, call): the call-th call of the phase fails (per layer where the phase runs per layer)
PHASES = [
    ("decide", 0),
    ("plan", 0),
    ("plan", L - 1),
    ("move", 0),
    ("move", L - 1),
    ("pack", 0),
    ("replicate", 0),
    ("window", 0),
    ("write", 0),
    ("write", L - 1),
    ("switch", 0),
    ("switch", L - 1),
    ("repoint", 0),
]
FAST = {("switch", L - 1)}


class Inject:
    """Makes the ``call``-th call of ``phase`` raise once."""

    def __init__(self, monkeypatch, phase: str, call: int):
        self.calls, self.call, self.fired = 0, call, False
        targets = {
            "decide": (elastic, "resize_placement"),
            "plan": (elastic, "plan_for_meshes"),
            "move": (elastic, "execute_resize"),
            "replicate": (loop_module, "replicate_to"),
            "window": (LoadWindow, "put"),
            "write": (ModuleStore, "write"),
            "switch": (MixedLayer, "eplb_resize"),
            "repoint": (graph_state, "repoint_meshes"),
        }
        if phase == "pack":  # inside the executor, at trace time
            monkeypatch.setattr(_resize_executor, "_EXECUTORS", {})
            monkeypatch.setattr(_resize_executor, "pack_rows", self.wrap(_resize_executor.pack_rows))
            return
        owner, name = targets[phase]
        monkeypatch.setattr(owner, name, self.wrap(getattr(owner, name)))

    def wrap(self, real):
        def call(*args, **kwargs):
            index, self.calls = self.calls, self.calls + 1
            if index == self.call and not self.fired:
                self.fired = True
                raise RuntimeError("injected failure")
            return real(*args, **kwargs)

        return call


def setup():
    ckpt = checkpoint()
    mesh = ep_mesh(8)
    model, optimizer = build(mesh, P, ckpt, Placement.linear(L, E, P).phy2log)
    ctl = EplbController(model, mesh, CONFIG, optimizer=optimizer)
    ctl.step()
    return ckpt, model, optimizer, ctl


@pytest.mark.parametrize("phase, call", [pytest.param(*c, marks=() if c in FAST else pytest.mark.slow) for c in PHASES])
def test_a_failure_in_any_phase_leaves_the_model_on_its_old_mesh(monkeypatch, phase, call):
    ckpt, model, optimizer, ctl = setup()
    x = tokens()
    before = everything(model, optimizer, ctl, x)
    new_mesh = ep_mesh(6)
    with monkeypatch.context() as patch:
        inject = Inject(patch, phase, call)
        with pytest.raises((RuntimeError, RearrangementError)) as failure:
            ctl.resize(new_mesh, num_physical=18)
        assert inject.fired
    chain = f"{failure.value} {failure.value.__cause__}"
    assert "injected" in chain
    assert_same(before, everything(model, optimizer, ctl, x))
    ctl.resize(new_mesh, num_physical=18)  # a retry completes
    assert_model_holds(model, optimizer, ckpt, ctl.placement.phy2log, new_mesh)
    np.testing.assert_array_equal(np.asarray(forward(model, x)), before["forward"])


def test_a_failed_balancer_resize_leaves_its_inputs_as_they_were(monkeypatch):
    ckpt, model, optimizer, ctl = setup()
    params, opt_state = functional_twin(model, optimizer)
    balancer = Balancer(CONFIG, ctl.mesh, ExpertLayout.match(params, r"layers/(\d+)/experts/"))
    balance = balancer.init(params)
    host = lambda tree: [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(tree)]
    before = host((params, opt_state, balance))
    with monkeypatch.context() as patch:
        real = PytreeStore.install

        def install(store, *args, **kwargs):
            real(store, *args, **kwargs)
            raise RuntimeError("injected failure after every write")

        patch.setattr(PytreeStore, "install", install)
        with pytest.raises(RearrangementError, match="rolled back") as failure:
            balancer.resize(params, opt_state, balance, ep_mesh(4))
    assert failure.value.restored[0] is params and host(failure.value.restored) == before
    assert host((params, opt_state, balance)) == before
    balancer4, params, opt_state, balance, _ = balancer.resize(params, opt_state, balance, ep_mesh(4))
    assert balancer4.mesh == ep_mesh(4) and balance.tables.placement().num_physical == 16

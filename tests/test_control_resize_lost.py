"""Elastic EP with lost ranks: experts come from surviving replicas, else a clear error names them (nothing changes)
until a checkpoint is offered through ``expert_source``."""

import jax
import numpy as np
import pytest
from _elastic import (
    L,
    assert_bytes,
    assert_model_holds,
    assert_same,
    build,
    checkpoint,
    everything,
    expected_layer,
    forward,
    functional_twin,
    tokens,
)

from moe_eplb_jax import EplbConfig
from moe_eplb_jax.control import Balancer, ExpertLayout
from moe_eplb_jax.flax import EplbController
from moe_eplb_jax.placement import Placement
from moe_eplb_jax.transport import ep_mesh

pytestmark = pytest.mark.devices(8)
E, P = 8, 16
CONFIG = EplbConfig(num_redundant_experts=P - E, window_size=4, step_interval=1000, num_gpus=8)


def test_a_lost_rank_recovers_from_surviving_replicas_then_a_second_needs_the_checkpoint():
    ckpt = checkpoint()
    mesh = ep_mesh(8)
    linear = Placement.linear(L, E, P)  # rank r holds what rank r + 4 holds
    model, optimizer = build(mesh, P, ckpt, linear.phy2log)
    ctl = EplbController(model, mesh, CONFIG, optimizer=optimizer)
    x = tokens()
    reference = np.asarray(forward(model, x))
    ctl.step()
    devices = list(mesh.devices.flat)
    survivors = ep_mesh(4, devices=[devices[i] for i in (0, 1, 3, 4)])  # rank 2 is lost; 5, 6, 7 leave
    report = ctl.resize(survivors, num_physical=8, lost_ranks=[2])
    assert report["rows_reloaded"] == 0 and report["lost_ranks"] == (2,)
    assert_model_holds(model, optimizer, ckpt, ctl.placement.phy2log, survivors)
    np.testing.assert_array_equal(np.asarray(forward(model, x)), reference)

    # P' = E: one replica each, so losing rank 1 of these four loses experts with no replica anywhere.
    before = everything(model, optimizer, ctl, x)
    smaller = ep_mesh(2, devices=[devices[0], devices[3]])
    lost = set(ctl.placement.phy2log[:, 2:4].ravel().tolist())
    with pytest.raises(ValueError, match="no replica outside the lost ranks") as error:
        ctl.resize(smaller, num_physical=8, lost_ranks=[1])
    message = str(error.value)
    assert "expert_source" in message and "Nothing was changed" in message
    assert all(f"expert {e})" in message for e in lost)
    assert_same(before, everything(model, optimizer, ctl, x))

    # The way out: the experts from a checkpoint (a model saved on the linear placement, with its optimizer).
    saved_model, saved_optimizer = build(mesh, P, ckpt, linear.phy2log)
    source = EplbController.expert_source(saved_model, linear, optimizer=saved_optimizer)
    report = ctl.resize(smaller, num_physical=8, lost_ranks=[1], reload=source)
    assert report["rows_reloaded"] == 2 * L
    assert_model_holds(model, optimizer, ckpt, ctl.placement.phy2log, smaller)
    np.testing.assert_array_equal(np.asarray(forward(model, x)), reference)


def test_bad_resize_arguments_change_nothing():
    ckpt = checkpoint()
    mesh = ep_mesh(8)
    model, optimizer = build(mesh, P, ckpt, Placement.linear(L, E, P).phy2log)
    ctl = EplbController(model, mesh, CONFIG, optimizer=optimizer)
    x = tokens()
    before = everything(model, optimizer, ctl, x)
    four = ep_mesh(4)
    for kwargs, match in (
        (dict(num_physical=10), "divisible"),
        (dict(num_physical=6), "new_num_physical must be >= 8"),
        (dict(lost_ranks=[9]), "lost_ranks"),
        (dict(lost_ranks=[1]), "is lost but"),  # rank 1's device is in the new mesh
        (dict(placement=Placement.linear(L, E, 10)), "divisible"),
        (dict(reload="ckpt"), "ExpertSource"),
    ):
        with pytest.raises(ValueError, match=match):
            ctl.resize(four, **kwargs)
    with pytest.raises(ValueError, match="EP axis"):
        ctl.resize(ep_mesh(4, axis="x"))
    assert_same(before, everything(model, optimizer, ctl, x))


def test_the_balancer_reloads_from_a_host_checkpoint():
    """The functional twin: 8 -> 4 ranks with P' = E (one replica each), then rank 1 of 4 lost: a ValueError names
    its experts (the inputs untouched), and host arrays of a checkpoint bring them back."""
    ckpt = checkpoint()
    mesh = ep_mesh(8)
    linear = Placement.linear(L, E, P)
    model, optimizer = build(mesh, P, ckpt, linear.phy2log)
    params, opt_state = functional_twin(model, optimizer)
    balancer = Balancer(CONFIG, mesh, ExpertLayout.match(params, r"layers/(\d+)/experts/"))
    balance = balancer.init(params)
    balancer, params, opt_state, balance, _ = balancer.resize(params, opt_state, balance, ep_mesh(4), num_physical=8)
    devices = list(mesh.devices.flat)
    smaller = ep_mesh(2, devices=[devices[0], devices[2]])
    with pytest.raises(ValueError, match="no replica outside the lost ranks"):
        balancer.resize(params, opt_state, balance, smaller, num_physical=8, lost_ranks=[1])
    host = jax.tree.map(np.asarray, functional_twin(*build(mesh, P, ckpt, linear.phy2log)))
    source = balancer.expert_source(*host, linear)
    balancer, params, opt_state, balance, report = balancer.resize(
        params, opt_state, balance, smaller, num_physical=8, lost_ranks=[1], reload=source
    )
    assert report["rows_reloaded"] == 2 * L
    phy2log = balance.tables.placement().phy2log
    for layer in range(L):
        want = expected_layer(ckpt, phy2log, layer)
        assert_bytes(params["layers"][layer]["experts"], want["experts"], smaller, "params")
        assert_bytes(opt_state["mu"]["layers"][layer]["experts"], want["mu"], smaller, "mu")

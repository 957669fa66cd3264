"""Elastic EP through the control loop: ``EplbController.resize`` and ``Balancer.resize`` on 8 simulated devices.

A model whose expert state holds every dtype (fp4, e8m0, fp8, bf16, f32, int8) and Adam moments moves 8 -> 4 ->
6 -> 8 ranks through both adapters: they decide the same placements and report the same moves, every per-expert
leaf equals the checkpoint permuted to the new placement on the new mesh, the replicated rest of the model follows,
the window keeps its logical loads, and the model's outputs are bit-identical before and after every move. A lost
rank recovers from surviving replicas, or is a clear error (the model untouched) until a checkpoint is offered.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _elastic import (
    L,
    assert_bytes,
    assert_model_holds,
    build,
    checkpoint,
    expected_layer,
    forward,
    functional_twin,
    scenario_loads,
    tokens,
)
from _models import tiny_model
from flax import nnx
from jax.sharding import PartitionSpec as PS

from moe_eplb_jax import EplbConfig, transport
from moe_eplb_jax.control import Balancer, ExpertLayout
from moe_eplb_jax.flax import EplbController
from moe_eplb_jax.models import generate, preset
from moe_eplb_jax.placement import Placement
from moe_eplb_jax.transport import ep_mesh, put_host

pytestmark = pytest.mark.devices(8)
E, P = 8, 16
CONFIG = EplbConfig(num_redundant_experts=P - E, window_size=4, step_interval=1000, num_gpus=8)
TIMING = ("move_seconds",)
record = jax.jit(Balancer.record_step)


def controller(ckpt, mesh=None, num_physical=P, config=CONFIG):
    mesh = mesh if mesh is not None else ep_mesh(8)
    linear = Placement.linear(L, E, num_physical)
    model, optimizer = build(mesh, num_physical, ckpt, linear.phy2log)
    return model, optimizer, EplbController(model, mesh, config, optimizer=optimizer)


def feed(ctl, model, step):
    """One step of skewed loads recorded by the controller; returns the loads for the functional twin."""
    loads = scenario_loads(step, ctl.num_ranks, ctl.num_physical)
    for layer, load in zip(model.layers, loads):
        layer.expert_load.set_value(put_host(load, ctl.mesh, PS("ep")))
    ctl.step()
    return [put_host(load, ctl.mesh, PS("ep")) for load in loads]


def without_timing(report):
    return {k: v for k, v in report.items() if k not in TIMING}


@pytest.mark.slow
def test_8_to_4_to_6_to_8_through_the_controller_and_the_balancer():
    ckpt = checkpoint()
    model, optimizer, ctl = controller(ckpt)
    params, opt_state = functional_twin(model, optimizer)
    balancer = Balancer(CONFIG, ctl.mesh, ExpertLayout.match(params, r"layers/(\d+)/experts/"))
    balance = balancer.init(params)
    x = tokens()
    reference = np.asarray(forward(model, x))
    step = 0
    for num_ranks, num_physical in ((4, 16), (6, 18), (8, 16)):
        for _ in range(2):  # loads under the current placement, recorded alike by both adapters
            balance = record(balance, feed(ctl, model, step))
            step += 1
        new_mesh = ep_mesh(num_ranks)
        report = ctl.resize(new_mesh, num_physical=num_physical)
        balancer, params, opt_state, balance, theirs = balancer.resize(
            params, opt_state, balance, new_mesh, num_physical=num_physical
        )
        assert without_timing(report) == without_timing(theirs)
        assert report["num_ranks"][1] == num_ranks and report["num_physical"][1] == num_physical
        placement = ctl.placement
        assert placement == balance.tables.placement() and placement.num_physical == num_physical
        assert ctl.config.num_gpus == num_ranks == balancer.config.num_gpus
        assert ctl.config.num_redundant_experts == num_physical - E
        for name in ("window", "pass_load", "window_pos", "window_filled", "step", "total_steps"):
            assert np.array_equal(np.asarray(getattr(ctl.state, name)), np.asarray(getattr(balance.loads, name)))
        assert ctl.state.window.shape[2:] == (num_ranks, num_physical)
        assert_model_holds(model, optimizer, ckpt, placement.phy2log, new_mesh)
        for layer in range(L):
            want = expected_layer(ckpt, placement.phy2log, layer)
            assert_bytes(params["layers"][layer]["experts"], want["experts"], new_mesh, "params")
            assert_bytes(opt_state["mu"]["layers"][layer]["experts"], want["mu"], new_mesh, "mu")
            module = model.layers[layer]
            assert module.mesh == new_mesh and module.num_physical == num_physical
            assert module.expert_load.get_value().shape == (num_ranks, num_physical)
            router = params["layers"][layer]["router"]
            assert router.sharding.mesh == new_mesh and np.array_equal(router, module.router.get_value())
        assert opt_state["count"].sharding.mesh == new_mesh
        np.testing.assert_array_equal(np.asarray(forward(model, x)), reference)
    # The loop goes on on the new mesh: both adapters rearrange alike.
    balance = record(balance, feed(ctl, model, step))
    ctl.rearrange()
    params, opt_state, balance, _ = balancer.rearrange(params, opt_state, balance)
    assert ctl.placement == balance.tables.placement()
    assert_model_holds(model, optimizer, ckpt, ctl.placement.phy2log, ctl.mesh)
    np.testing.assert_array_equal(np.asarray(forward(model, x)), reference)


def test_8_to_4_keeps_outputs_the_window_and_every_byte():
    ckpt = checkpoint()
    model, optimizer, ctl = controller(ckpt)
    x = tokens()
    reference = np.asarray(forward(model, x))
    feed(ctl, model, 0)
    logical = ctl._loop.window.logical_load(ctl.state, ctl.placement.phy2log, E)
    report = ctl.resize(ep_mesh(4))
    assert report["slots_kept"] > 0 and report["rows_reloaded"] == 0
    np.testing.assert_array_equal(np.asarray(forward(model, x)), reference)
    assert_model_holds(model, optimizer, ckpt, ctl.placement.phy2log, ctl.mesh)
    # each step's logical load survives the move (split over the new replicas)
    np.testing.assert_array_equal(ctl._loop.window.logical_load(ctl.state, ctl.placement.phy2log, E), logical)
    assert ctl.total_steps == 1 and int(np.asarray(ctl.state.window_filled)) == 1


def test_8_to_7_moves_no_more_than_the_slots_that_must_change():
    """Rank 7 leaves, holding the only replicas of experts 6 and 7; "fill" keeps every slot a staying device holds:
    only those experts move, one row each per layer, and the bytes are no more than those rows."""
    ckpt = checkpoint()
    model, optimizer, ctl = controller(ckpt)
    row = [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1, 6, 7]
    ctl.apply_placement(Placement.from_phy2log(np.array([row] * L), E, num_ranks=8))
    old = ctl.placement.phy2log
    feed(ctl, model, 0)
    report = ctl.resize(ep_mesh(7), num_physical=14, policy="fill")
    new = ctl.placement.phy2log
    must = 0  # new slots whose device did not hold that expert before
    for layer in range(L):
        for rank in range(7):
            before = set(old[layer, rank * 2 : rank * 2 + 2].tolist())
            must += len(set(new[layer, rank * 2 : rank * 2 + 2].tolist()) - before)
    changed = int((new != old[:, :14]).sum())
    assert report["rows_moved"] == must == 2 * L <= changed
    assert report["slots_kept"] == 14 * L - must
    row_bytes = transport.row_bytes(ctl._store.read(0))
    assert 0 < report["bytes_moved"] <= must * row_bytes
    assert_model_holds(model, optimizer, ckpt, new, ctl.mesh)


@pytest.mark.parametrize("routing", ["lp", pytest.param("quota", marks=pytest.mark.slow)])
def test_routing_state_follows(routing):
    """``lp`` shares are solved for the new placement from the carried window; ``quota`` keeps its home experts
    per rank (E divides into G'); every layer routes by the new tables, with the same outputs."""
    fields = {"routing": routing, "policy": "online"} if routing == "quota" else {"routing": routing}
    config = EplbConfig(**{**CONFIG.to_dict(), **fields})
    ckpt = checkpoint()
    model, optimizer, ctl = controller(ckpt, config=config)
    x = tokens()
    feed(ctl, model, 0)
    reference = np.asarray(forward(model, x))
    ctl.resize(ep_mesh(4), num_physical=12)
    tables = ctl.routing_tables
    if routing == "lp":
        shares = tables["replica_shares"]
        assert shares.shape == (L, E, 12 - E + 1)
        assert not np.array_equal(
            shares, np.where(ctl.placement.log2phy >= 0, 1.0 / ctl.placement.logcnt[..., None], 0)
        )
        for layer, module in enumerate(model.layers):
            np.testing.assert_array_equal(np.asarray(module.replica_shares.get_value()), shares[layer])
    else:
        assert tables == {}
    for layer, module in enumerate(model.layers):
        assert module.routing == routing
        np.testing.assert_array_equal(np.asarray(module.log2phy.get_value()), ctl.placement.log2phy[layer])
    np.testing.assert_array_equal(np.asarray(forward(model, x)), reference)


def random_events(rng, count):
    """``count`` scale events from 8 ranks: (devices of the new group, P', lost ranks of the current group)."""
    current, events = list(range(8)), []
    for _ in range(count):
        lost = [int(rng.integers(len(current)))] if len(current) > 1 and rng.random() < 0.4 else []
        pool = [d for i, d in enumerate(current) if i not in lost] + [d for d in range(8) if d not in current]
        size = int(rng.choice([g for g in (1, 2, 3, 4, 6, 8) if g <= len(pool)]))
        devices = [int(d) for d in rng.permutation(pool)[:size]]
        num_physical = size * int(rng.integers(-(-E // size), -(-24 // size) + 1))
        events.append((devices, num_physical, lost))
        current = devices
    return events


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_random_sequences_of_scale_events_through_both_adapters(seed):
    """Random groups (any devices, any order), sizes and lost ranks; experts no survivor holds come from a
    checkpoint through expert_source. Both adapters agree; every byte and every output is as before."""
    ckpt = checkpoint()
    model, optimizer, ctl = controller(ckpt)
    params, opt_state = functional_twin(model, optimizer)
    balancer = Balancer(CONFIG, ctl.mesh, ExpertLayout.match(params, r"layers/(\d+)/experts/"))
    balance = balancer.init(params)
    linear = Placement.linear(L, E, P)
    saved_model, saved_optimizer = build(ep_mesh(8), P, ckpt, linear.phy2log)
    saved_params, saved_opt = functional_twin(saved_model, saved_optimizer)
    x = tokens()
    reference = np.asarray(forward(model, x))
    devices = jax.devices()
    for step, (group, num_physical, lost) in enumerate(random_events(np.random.default_rng(seed), 4)):
        balance = record(balance, feed(ctl, model, step))
        new_mesh = ep_mesh(len(group), devices=[devices[d] for d in group])
        options = dict(num_physical=num_physical, lost_ranks=lost)
        missing = transport.missing_experts(ctl.placement.phy2log, ctl.num_ranks, lost_ranks=lost).size
        source = EplbController.expert_source(saved_model, linear, optimizer=saved_optimizer) if missing else None
        report = ctl.resize(new_mesh, reload=source, **options)
        source = balancer.expert_source(saved_params, saved_opt, linear) if missing else None
        balancer, params, opt_state, balance, theirs = balancer.resize(
            params, opt_state, balance, new_mesh, reload=source, **options
        )
        assert without_timing(report) == without_timing(theirs), (group, num_physical, lost)
        assert ctl.placement == balance.tables.placement()
        assert_model_holds(model, optimizer, ckpt, ctl.placement.phy2log, new_mesh)
        for layer in range(L):
            want = expected_layer(ckpt, ctl.placement.phy2log, layer)
            assert_bytes(params["layers"][layer]["experts"], want["experts"], new_mesh, "params")
            assert_bytes(opt_state["nu"]["layers"][layer]["experts"], want["nu"], new_mesh, "nu")
        np.testing.assert_array_equal(np.asarray(forward(model, x)), reference)


@pytest.mark.slow
def test_a_served_model_generates_the_same_tokens_after_scaling_in_and_out():
    """MoECausalLM (attention, dense and MoE blocks, a shared expert) served with a KV cache: greedy tokens are
    the same on 8, 4 and again 8 ranks, and the logits agree to float32 rounding (attention and dense matmuls run
    on other per-rank batch sizes)."""
    mesh = ep_mesh(8)
    model = tiny_model(preset("tiny"), mesh, redundant=8, routing="lp")
    ctl = EplbController(model, mesh, EplbConfig(num_redundant_experts=8, num_gpus=8, routing="lp"))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.config.vocab_size, n) for n in (5, 11, 1, 8, 3, 7, 2, 9)]
    tokens = lambda: generate(model, prompts, max_new_tokens=6, prompt_width=12, on_step=lambda n: ctl.step()).tokens
    logits = lambda: np.asarray(nnx.jit(lambda m, t: m(t, record=False))(model, jnp.asarray(np.stack(
        [np.resize(p, 12) for p in prompts]).astype(np.int32))))  # fmt: skip
    first, first_logits = tokens(), logits()
    report = ctl.resize(ep_mesh(4))
    assert report["num_ranks"] == (8, 4) and model.mesh == ep_mesh(4)
    np.testing.assert_array_equal(tokens(), first)
    np.testing.assert_allclose(logits(), first_logits, rtol=1e-5, atol=1e-5)
    ctl.resize(ep_mesh(8), num_physical=24)
    np.testing.assert_array_equal(tokens(), first)
    np.testing.assert_allclose(logits(), first_logits, rtol=1e-5, atol=1e-5)

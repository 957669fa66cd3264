"""Discovery and the controller: loads, rearrangement with optimizer state, files, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from moe_eplb_jax.config import EplbConfig
from moe_eplb_jax.flax import EplbController, MoELayer, find_moe_layers
from moe_eplb_jax.models import MoECausalLM, generate, preset, skew_routers, zipf_tokens
from moe_eplb_jax.moe import DispatchConfig
from moe_eplb_jax.placement import Placement

G, E, P, L = 4, 8, 12, 2
pytestmark = pytest.mark.devices(G)  # skipped on fewer devices, where MESH is None
MESH = jax.make_mesh((G,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,)) if jax.device_count() >= G else None
CONFIG = EplbConfig(num_redundant_experts=P - E, window_size=8, step_interval=8, num_gpus=G)
# The tiny preset, smaller still: two blocks, both MoE (no dense first block), 8 experts.
MODEL = preset(
    "tiny",
    vocab_size=64,
    dim=16,
    num_layers=L,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    first_dense_layers=0,
    num_experts=E,
    moe_hidden=16,
    shared_hidden=16,
)


class VisionLanguageModel(nnx.Module):
    """A wrapper implementing nothing: its language model holds the MoE layers (discovery must find them)."""

    def __init__(self, lm: MoECausalLM, *, rngs):
        self.vision_proj = nnx.Linear(8, 8, rngs=rngs)
        self.language_model = lm

    def __call__(self, tokens):
        return self.language_model(tokens)


def _model(seed=0):
    lm = MoECausalLM(MODEL, mesh=MESH, num_redundant_experts=P - E, rngs=nnx.Rngs(seed))
    skew_routers(lm, 1.5)
    return VisionLanguageModel(lm, rngs=nnx.Rngs(seed + 1))


_TIMING = ("move_seconds", "gb_per_s")  # report entries that measure time


def _tokens(rng):
    return jnp.asarray(zipf_tokens(rng, G, 8, 64))


@nnx.jit
def _forward(model, tokens):
    return model(tokens)


@nnx.jit
def _train_step(model, optimizer, tokens):
    def loss_fn(model):
        logits = model(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def _train(model, optimizer, tokens):
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam mixes int and float scalars
        return _train_step(model, optimizer, tokens)


def test_discovery_finds_nested_layers_in_order():
    layers = find_moe_layers(_model())
    assert [ref.name for ref in layers] == ["language_model/layers/0/mlp", "language_model/layers/1/mlp"]
    with pytest.raises(ValueError, match="holds no MoE layer"):
        find_moe_layers(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="nnx.Module"):
        find_moe_layers({"not": "a module"})


@pytest.mark.slow
def test_training_rearranges_moves_optimizer_state_and_keeps_outputs(rng):
    model = _model(int(rng.integers(100)))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    ctl = EplbController(model, MESH, CONFIG, optimizer=optimizer)
    assert [len(v) for v in ctl._store.opt_vars] == [4, 4]  # mu and nu of w_in and w_out per layer
    tokens = _tokens(rng)
    report = None
    for _ in range(CONFIG.first_rearrangement_step):
        _train(model, optimizer, tokens)
        report = ctl.step()
    assert report is not None and report["rearranged"] and ctl.num_rearrangements == 1
    assert report["balancedness_after"] >= report["balancedness_before"]
    assert not np.array_equal(ctl.placement.phy2log, Placement.linear(L, E, P).phy2log)
    # Replicas stayed identical through training (tied gradients), so moved slots equal any old replica.
    layer = ctl.layers[0].module
    old_phy = ctl.placement.phy2log[0].copy()
    w_before = np.asarray(layer.w_in.get_value())
    mu_before = np.asarray(ctl._store.opt_vars[0][0].get_value())
    logits_before = np.asarray(_forward(model, tokens))
    ctl.step()
    new = ctl.rearrange()["num_rearrangements"]
    assert new == 2
    new_phy = ctl.placement.phy2log[0]
    w_after = np.asarray(layer.w_in.get_value())
    mu_after = np.asarray(ctl._store.opt_vars[0][0].get_value())
    for p in range(P):
        q = np.nonzero(old_phy == new_phy[p])[0]
        assert any(np.array_equal(w_after[p], w_before[s]) for s in q)
        assert any(np.array_equal(mu_after[p], mu_before[s]) for s in q)
        assert all(np.array_equal(w_before[q[0]], w_before[s]) for s in q)
    assert np.array_equal(np.asarray(_forward(model, tokens)), logits_before)
    loss = _train(model, optimizer, tokens)  # training continues on the moved state
    assert np.isfinite(float(loss))


def test_controller_records_load_and_logs(rng):
    model = _model(3)
    config = EplbConfig(num_redundant_experts=P - E, window_size=4, step_interval=100, num_gpus=G, log_interval=1)
    ctl = EplbController(model, MESH, config)
    tokens = _tokens(rng)
    _forward(model, tokens)
    report = ctl.step()
    assert 0 < report["balancedness"] <= 1 and len(report["rank_imbalance"]) == L
    assert int(np.asarray(ctl.state.window_filled)) == 1 and ctl.total_steps == 1
    window = ctl.window_slot_load()
    assert window.shape == (L, P) and np.all(window.sum(1) == tokens.size * 2)
    assert int(ctl.layers[0].module.expert_load.get_value().sum()) == 0  # reset after reading


def test_fitted_placement_file_round_trip(rng, tmp_path):
    model = _model(5)
    ctl = EplbController(model, MESH, CONFIG)
    tokens = _tokens(rng)
    for _ in range(CONFIG.first_rearrangement_step):
        _forward(model, tokens)
        ctl.step()
    path = tmp_path / "placement.json"
    ctl.save_placement(path)
    served = _model(5)  # same weights, fresh linear placement
    held = EplbController(served, MESH, CONFIG, placement=str(path), rebalance=False)
    assert held.placement == ctl.placement
    assert np.array_equal(np.asarray(_forward(served, tokens)), np.asarray(_forward(model, tokens)))
    for _ in range(CONFIG.step_interval + 1):
        held.step()
    assert held.num_rearrangements == 0
    twin = EplbController(_model(5), MESH, CONFIG)
    twin.restore_item(ctl.checkpoint_item())
    assert twin.placement == ctl.placement and twin.total_steps == ctl.total_steps
    # The checkpoint holds the window summed over the EP ranks: every row's totals come back.
    assert np.array_equal(np.asarray(twin.state.window).sum(2), np.asarray(ctl.state.window).sum(2))
    assert np.asarray(ctl.state.window).sum() > 0
    for name in ("window_pos", "window_filled", "step", "total_steps", "num_rearrangements"):
        assert int(getattr(twin.state, name)) == int(getattr(ctl.state, name)), name
    assert np.array_equal(twin.window_slot_load(), ctl.window_slot_load())


def test_bad_input_raises_before_anything_changes(tmp_path):
    model = _model(7)
    w_before = np.asarray(model.language_model.layers[0].mlp.w_in.get_value())
    with pytest.raises(ValueError, match="num_gpus"):
        EplbController(model, MESH, EplbConfig(num_redundant_experts=P - E, num_gpus=2))
    with pytest.raises(ValueError, match="num_redundant_experts"):
        EplbController(model, MESH, EplbConfig(num_redundant_experts=0, num_gpus=G))
    with pytest.raises(ValueError, match="no axis"):
        EplbController(model, MESH, CONFIG, axis="tp")
    with pytest.raises(ValueError, match="nnx.Optimizer"):
        EplbController(model, MESH, CONFIG, optimizer=optax.adam(1e-3))
    other = tmp_path / "other.json"
    Placement.linear(L + 1, E, P).save(other)
    with pytest.raises(ValueError, match="model has"):
        EplbController(model, MESH, CONFIG, placement=str(other))
    assert np.array_equal(np.asarray(model.language_model.layers[0].mlp.w_in.get_value()), w_before)
    # Expert weights without a slot axis sharded over EP.
    layer = model.language_model.layers[1].mlp
    layer.w_out.set_value(jax.device_put(np.asarray(layer.w_out.get_value()), NamedSharding(MESH, PS())))
    with pytest.raises(ValueError, match="no slot axis"):
        EplbController(model, MESH, CONFIG)
    with pytest.raises(ValueError, match="holds no MoE layer"):
        EplbController(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), MESH, CONFIG)
    # An EP size that does not divide P.
    mesh8 = jax.make_mesh((8,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    with pytest.raises(ValueError, match="not divisible by EP size"):
        EplbController(_model(8), mesh8, EplbConfig(num_redundant_experts=P - E, num_gpus=8))


class _OneLayer(nnx.Module):
    def __init__(self, dim, seed):
        self.moe = MoELayer(dim, 32, E, 2, mesh=MESH, num_physical=P, rngs=nnx.Rngs(seed))
        skew = -1.5 * np.log1p(np.arange(E, dtype=np.float32))
        self.moe.router_bias.set_value(jax.device_put(skew, self.moe.router_bias.get_value().sharding))

    def __call__(self, x):
        return self.moe(x)


@pytest.mark.parametrize("fmt", [pytest.param("fp8", marks=pytest.mark.slow), "mxfp4"])
def test_quantized_experts_move_with_their_scales(rng, fmt):
    dim = 32  # MX formats need contraction sizes that are multiples of 32
    model = _OneLayer(dim, int(rng.integers(100)))
    x = jnp.asarray(rng.standard_normal((G * 4, dim)).astype(np.float32))
    y_float = np.asarray(_forward(model, x))
    model.moe.quantize(fmt)
    assert model.moe.w_in is None and set(model.moe.eplb_expert_variables()) == {"gate", "up", "down"}
    y0 = np.asarray(_forward(model, x))
    rel = np.linalg.norm(y0 - y_float) / np.linalg.norm(y_float)
    assert rel < (0.1 if fmt == "fp8" else 0.35), rel
    ctl = EplbController(model, MESH, CONFIG)
    before = [
        np.asarray(leaf)
        for leaf in jax.tree.leaves({k: v.get_value() for k, v in model.moe.eplb_expert_variables().items()})
    ]
    old = ctl.placement.phy2log[0].copy()
    for _ in range(CONFIG.first_rearrangement_step):
        _forward(model, x)
        ctl.step()
    assert ctl.num_rearrangements == 1
    new = ctl.placement.phy2log[0]
    after = [
        np.asarray(leaf)
        for leaf in jax.tree.leaves({k: v.get_value() for k, v in model.moe.eplb_expert_variables().items()})
    ]
    source = np.array([np.nonzero(old == e)[0][0] for e in new])  # linear start: one old slot per expert
    for b, a in zip(before, after):  # every leaf (fp8/fp4 codes and their scales) moved byte for byte
        assert np.array_equal(a.view(np.uint8), b[source].view(np.uint8))
    assert np.array_equal(np.asarray(_forward(model, x)), y0)
    with pytest.raises(ValueError, match="already quantized"):
        model.moe.quantize(fmt)


class _PaddedLayer(nnx.Module):
    """One MoE layer on 8 ranks whose forward pass takes a count of valid (non-padding) tokens, a prefix."""

    def __init__(self, mesh, load_reduce):
        reduce = DispatchConfig(load_reduce=load_reduce)
        self.moe = MoELayer(16, 16, E, 2, mesh=mesh, num_physical=16, dispatch=reduce, rngs=nnx.Rngs(11))
        skew = -1.5 * np.log1p(np.arange(E, dtype=np.float32))
        self.moe.router_bias.set_value(jax.device_put(skew, self.moe.router_bias.get_value().sharding))

    def __call__(self, x, num_valid):
        return self.moe(x, valid=jnp.arange(x.shape[0]) < num_valid)


def test_deferred_load_sum_equals_per_step_psum(rng):
    """Per-rank loads summed at read time give the loads, reports and placements of the per-step psum."""
    mesh8 = jax.make_mesh((8,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    config = EplbConfig(num_redundant_experts=16 - E, window_size=3, step_interval=12, num_gpus=8, log_interval=1)
    models = {mode: _PaddedLayer(mesh8, mode) for mode in ("psum", "none")}
    ctls = {mode: EplbController(model, mesh8, config) for mode, model in models.items()}
    forward = nnx.jit(lambda m, x, n: m(x, n))
    rearranged, history = 0, []  # history: per-step totals since the last rearrangement (the oracle)
    for step in range(7):  # crosses the first rearrangement (step 3) and wraps the 3-row window
        reports = {}
        for _passes in range(2):  # two forward passes per step, each with its own padding tail
            x = jnp.asarray(rng.standard_normal((8 * 6, 16)).astype(np.float32))
            num_valid = jnp.int32(int(rng.integers(1, 8 * 6)))
            outs = {mode: np.asarray(forward(model, x, num_valid)) for mode, model in models.items()}
            assert np.array_equal(outs["psum"], outs["none"])
        total = np.asarray(models["psum"].moe.expert_load.get_value())
        rows = np.asarray(models["none"].moe.expert_load.get_value())
        assert total.shape == (16,) and rows.shape == (8, 16)
        assert np.array_equal(rows.sum(0), total)
        history.append(total)
        for mode, ctl in ctls.items():
            reports[mode] = ctl.step()
        timeless = {mode: {k: v for k, v in (r or {}).items() if k not in _TIMING} for mode, r in reports.items()}
        assert timeless["psum"] == timeless["none"], step
        assert np.array_equal(ctls["psum"].window_slot_load(), ctls["none"].window_slot_load())
        assert ctls["psum"].placement == ctls["none"].placement
        if reports["none"].get("rearranged"):
            rearranged, history = rearranged + 1, []
        else:
            assert np.array_equal(ctls["none"].window_slot_load()[0], np.sum(history[-3:], axis=0))
    assert rearranged == 1 and ctls["none"].num_rearrangements == 1
    assert ctls["none"].placement != Placement.linear(1, E, 16)
    # The per-step bookkeeping is local to each rank: no all-reduce in the controller's compiled step update.
    ctl = ctls["none"]
    loads = [models["none"].moe.expert_load.get_value()]
    assert (
        "all-reduce"
        not in ctl._loop.window.close.lower(ctl.state, loads, ctl._loop.window.dummy(False)).compile().as_text()
    )


@pytest.mark.parametrize("ranks", [1, G])
def test_generate_hands_the_window_back_without_a_copy(ranks, rng):
    """``generate``'s on-device loop returns the window in the controller's own shardings (the form a jitted
    program writes them in), so ``steps_closed`` keeps the very arrays it is handed: no ``device_put`` per call."""
    mesh = jax.make_mesh((ranks,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    lm = MoECausalLM(MODEL, mesh=mesh, num_redundant_experts=P - E, rngs=nnx.Rngs(0))
    ctl = EplbController(lm, mesh, EplbConfig(num_redundant_experts=P - E, window_size=4, num_gpus=ranks))
    handed, taken = [], []
    steps_closed = ctl.steps_closed

    def spy(state, num_steps):
        handed.append(state)
        report = steps_closed(state, num_steps)
        taken.append(ctl.state)
        return report

    ctl.steps_closed = spy
    generate(lm, [rng.integers(0, 64, 5) for _ in range(4)], max_new_tokens=4, tokens_per_call=2, controller=ctl)
    assert len(handed) == 3 and ctl.total_steps == 4  # the prefill and two calls of two passes
    for state, kept in zip(handed, taken):
        assert all(a is b for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(kept)))

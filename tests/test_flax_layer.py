"""The reference MoE layer: dispatch, numerics against a per-token oracle, placement invariance."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import ep_mesh, random_placement
from flax import nnx
from jax.sharding import PartitionSpec as PS

from moe_eplb_jax.flax import MoELayer
from moe_eplb_jax.moe import DispatchConfig, RouterConfig, moe_apply, route, tie_replicas
from moe_eplb_jax.moe import dispatch as disp
from moe_eplb_jax.placement import Placement
from moe_eplb_jax.routing import lookup_table
from moe_eplb_jax.transport import put_host

G, E, P, D, H, K = 4, 8, 12, 16, 8, 2
pytestmark = pytest.mark.devices(G)  # skipped on fewer devices, where MESH is None
MESH = ep_mesh(G)
ROUTER = RouterConfig(top_k=K)


def _apply_fn(router=ROUTER, **dispatch):
    return jax.jit(functools.partial(moe_apply, router=router, mesh=MESH, dispatch=DispatchConfig(**dispatch)))


APPLY = _apply_fn()
BIAS = np.linspace(-1, 1, E).astype(np.float32)


def _weights(rng, dtype=np.float32):
    w_in = rng.standard_normal((E, D, 2 * H)).astype(dtype)
    w_out = rng.standard_normal((E, H, D)).astype(dtype)
    router = rng.standard_normal((D, E)).astype(np.float32)
    return w_in, w_out, router


def _random_placement(rng):
    return random_placement(rng, E, P)


def _oracle(x, router, w_in, w_out, *, top_k=K, **route_kw):
    config = RouterConfig(top_k=top_k, **route_kw)
    ids, weights = route(jnp.asarray(x), jnp.asarray(router), config, bias=jnp.asarray(BIAS))
    ids, weights = np.asarray(ids), np.asarray(weights, np.float64)
    out = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for j in range(top_k):
            h = x[t].astype(np.float64) @ w_in[ids[t, j]].astype(np.float64)
            act = h[:H] / (1 + np.exp(-h[:H])) * h[H:]
            out[t] += weights[t, j] * (act @ w_out[ids[t, j]].astype(np.float64))
    return out, ids


@pytest.mark.parametrize("capacity", [None, 5])
def test_dispatch_is_dropless_under_total_skew(rng, capacity):
    """Every assignment to one rank (worst case): nothing is dropped, each row comes back to its token."""
    tokens = 6

    def per_rank(x, ids, w):
        rows, slot, plan = disp.dispatch(x, ids, slots_per_rank=P // G, axis_name="ep", num_ranks=G, capacity=capacity)
        valid = (slot >= 0).sum()
        return disp.combine(rows, plan, w, axis_name="ep", capacity=capacity), valid[None], slot

    f = jax.jit(jax.shard_map(per_rank, mesh=MESH, in_specs=(PS("ep"),) * 3, out_specs=(PS("ep"),) * 3))
    x = rng.standard_normal((G * tokens, D)).astype(np.float32)
    ids = rng.integers(0, P // G, (G * tokens, K)).astype(np.int32)  # all slots of rank 0
    w = rng.random((G * tokens, K)).astype(np.float32)
    out, valid, slot = f(x, ids, w)
    np.testing.assert_allclose(np.asarray(out), x * w.sum(1, keepdims=True), rtol=1e-6)
    assert np.asarray(valid).tolist() == [G * tokens * K, 0, 0, 0]
    # Rank 0 received every assignment with the right local slot.
    slots0 = np.asarray(slot).reshape(G, -1)[0]
    assert np.array_equal(np.sort(slots0[slots0 >= 0]), np.sort(ids.reshape(-1)))


@pytest.mark.parametrize("groups", [None, (4, 2)])
def test_layer_matches_per_token_oracle(rng, groups):
    w_in, w_out, router = _weights(rng)
    placement = _random_placement(rng)
    phy = placement.phy2log[0]
    x = rng.standard_normal((G * 5, D)).astype(np.float32)
    route_kw = {} if groups is None else {"num_groups": groups[0], "topk_groups": groups[1]}
    fn = APPLY if groups is None else _apply_fn(RouterConfig(top_k=K, **route_kw))
    out, load = fn(x, router, BIAS, {"w_in": w_in[phy], "w_out": w_out[phy]}, placement.log2phy[0], placement.logcnt[0])
    ref, ids = _oracle(x, router, w_in, w_out, **route_kw)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=2e-4, atol=2e-4)
    assert load.shape == (G, P)  # per-rank rows (load_reduce="none", the default)
    load = np.asarray(load).sum(0)
    assert load.sum() == x.shape[0] * K
    # Each expert's load is split over its replicas only.
    per_expert = np.bincount(phy, weights=load, minlength=E)
    assert np.array_equal(per_expert, np.bincount(ids.reshape(-1), minlength=E))
    if groups is not None:  # group-limited: every token's experts lie in at most 2 of the 4 groups
        assert all(len(set(row // (E // 4))) <= 2 for row in ids)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_outputs_do_not_depend_on_placement(rng, dtype):
    """Bit-identical outputs for the same logical weights under any placement (invariant 8)."""
    w_in, w_out, router = _weights(rng, dtype)
    x = rng.standard_normal((G * 6, D)).astype(dtype)
    outs = []
    for placement in [Placement.linear(1, E, P), _random_placement(rng), _random_placement(rng)]:
        phy = placement.phy2log[0]
        experts = {"w_in": w_in[phy], "w_out": w_out[phy]}
        out, _ = APPLY(x, router, BIAS, experts, placement.log2phy[0], placement.logcnt[0])
        outs.append(np.asarray(out))
    assert outs[0].dtype == np.dtype(dtype)
    for other in outs[1:]:
        assert np.array_equal(outs[0].view(np.uint8), other.view(np.uint8))


def test_module_forward_records_load_and_never_recompiles(rng):
    model = MoELayer(D, H, E, K, mesh=MESH, num_physical=P, shared_hidden=4, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    fwd = nnx.jit(lambda m, x: m(x))
    x = jnp.asarray(rng.standard_normal((2, G * 3, D)).astype(np.float32))
    y0 = fwd(model, x)
    assert y0.shape == x.shape
    assert int(model.expert_load.get_value().sum()) == 2 * G * 3 * K
    assert model.expert_load.get_value().shape == (G, P)
    before = fwd._cache_size() if hasattr(fwd, "_cache_size") else None
    # Permute the slots by hand: weights follow the tables.
    new = _random_placement(rng)
    logical_in = np.asarray(model.w_in.get_value())[:E]  # linear start: slot e holds expert e
    logical_out = np.asarray(model.w_out.get_value())[:E]
    model.w_in.set_value(put_host(logical_in[new.phy2log[0]], MESH, PS("ep")))
    model.w_out.set_value(put_host(logical_out[new.phy2log[0]], MESH, PS("ep")))
    model.eplb_set_placement(new.phy2log[0], new.log2phy[0], new.logcnt[0])
    y1 = fwd(model, x)
    assert np.array_equal(np.asarray(y0), np.asarray(y1))
    assert int(model.expert_load.get_value().sum()) == 2 * 2 * G * 3 * K
    if before is not None:
        assert fwd._cache_size() == before


def test_tie_replicas_sums_gradients_over_replicas(rng):
    phy2log = jnp.asarray([0, 1, 2, 0, 0, 1], jnp.int32)
    w = jnp.asarray(rng.standard_normal((6, 3)).astype(np.float32))
    coef = jnp.asarray(rng.standard_normal((6, 3)).astype(np.float32))
    grad = jax.grad(lambda w: jnp.sum(tie_replicas(w, phy2log) * coef))(w)
    expected = np.asarray(coef)[[0, 1, 2, 0, 0, 1]]
    totals = {e: np.asarray(coef)[np.asarray(phy2log) == e].sum(0) for e in range(3)}
    expected = np.stack([totals[int(e)] for e in np.asarray(phy2log)])
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-6)
    assert np.array_equal(np.asarray(grad)[0], np.asarray(grad)[3])


def test_tie_replicas_one_replica_each_passes_gradient_through(rng):
    phy2log = jnp.asarray([2, 0, 1], jnp.int32)
    w = jnp.asarray(rng.standard_normal((3, 4)).astype(np.float32))
    coef = jnp.asarray(rng.standard_normal((3, 4)).astype(np.float32))
    grad = jax.grad(lambda w: jnp.sum(tie_replicas(w, phy2log, num_logical=3) * coef))(w)
    assert np.array_equal(np.asarray(grad), np.asarray(coef))
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda w: jnp.sum(tie_replicas(w, phy2log, num_logical=3))))(w))
    assert "scatter" not in jaxpr
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="num_logical must be a positive int"):
            tie_replicas(w, phy2log, num_logical=bad)


def test_tie_replicas_sums_bfloat16_gradients_in_float32():
    phy2log = jnp.asarray([0, 0, 0, 1], jnp.int32)
    coef = jnp.asarray([[1.0], [2.0**-8], [2.0**-8], [3.0]], jnp.bfloat16)  # bf16 sums would round each 2**-8 away
    w = jnp.zeros((4, 1), jnp.bfloat16)
    grad = jax.grad(lambda w: jnp.sum((tie_replicas(w, phy2log, num_logical=2) * coef).astype(jnp.float32)))(w)
    assert grad.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(grad, np.float32)[:, 0], [1.0 + 2.0**-7] * 3 + [3.0])


@pytest.mark.parametrize(
    "router, layer, dispatch, match",
    [
        ({"top_k": E + 1}, {}, {}, "RouterConfig.top_k=9 is larger than num_experts=8"),
        ({}, {"num_physical": 10}, {}, "divisible by the EP size"),
        ({}, {"num_physical": E - 1}, {}, "num_physical"),
        ({}, {"axis": "tp"}, {}, "no axis"),
        ({"num_groups": 3}, {}, {}, "not divisible by RouterConfig.num_groups=3"),
        ({"num_groups": 4, "topk_groups": 5}, {}, {}, "RouterConfig.topk_groups"),
        ({}, {}, {"matmul": "magic"}, "DispatchConfig.matmul: unknown grouped matmul"),
        ({}, {}, {"capacity_factor": 0.0}, "DispatchConfig.capacity_factor"),
        ({}, {}, {"load_reduce": "sum"}, "DispatchConfig.load_reduce"),
        ({}, {"router": 0}, {}, "RouterConfig.top_k must be an integer >= 1"),
        ({}, {"router": True}, {}, "router must be a RouterConfig or a top_k"),
    ],
)
def test_layer_rejects_bad_configuration(router, layer, dispatch, match):
    """Every field is checked where its config object is built (or, against the mesh and ``E``, where the layer is),
    before any weight is made."""
    with pytest.raises(ValueError, match=match):
        args = {"router": RouterConfig(**{"top_k": K} | router), "num_physical": P} | layer
        MoELayer(D, H, E, mesh=MESH, dispatch=DispatchConfig(**dispatch), rngs=nnx.Rngs(0), **args)


def test_layer_rejects_tokens_not_divisible_by_ep(rng):
    model = MoELayer(D, H, E, K, mesh=MESH, num_physical=P, rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match="not divisible by the EP size"):
        model(jnp.asarray(rng.standard_normal((G + 1, D)).astype(np.float32)))
    with pytest.raises(ValueError, match="placement table must have shape"):
        model.eplb_set_placement(np.arange(P + 1), np.zeros((E, P - E + 1)), np.ones(E))


def test_pallas_path_is_placement_invariant(rng):
    dim, hidden = 32, 16  # Triton blocks need powers of two >= 16
    w_in = rng.standard_normal((E, dim, 2 * hidden)).astype(np.float32)
    w_out = rng.standard_normal((E, hidden, dim)).astype(np.float32)
    router = rng.standard_normal((dim, E)).astype(np.float32)
    x = rng.standard_normal((G * 4, dim)).astype(np.float32)
    outs = []
    for matmul, placement in [
        ("pallas_interpret", Placement.linear(1, E, P)),
        ("pallas_interpret", _random_placement(rng)),
        ("dense", Placement.linear(1, E, P)),
    ]:
        phy = placement.phy2log[0]
        out, _ = _apply_fn(matmul=matmul)(
            x, router, BIAS, {"w_in": w_in[phy], "w_out": w_out[phy]}, placement.log2phy[0], placement.logcnt[0]
        )
        outs.append(np.asarray(out))
    assert np.array_equal(outs[0], outs[1])
    # Another kernel, another summation order: float32 rounding on the outputs' scale (tens).
    np.testing.assert_allclose(outs[0], outs[2], rtol=1e-5, atol=1e-6 * np.abs(outs[2]).max())


def test_module_keeps_the_kernel_lookup_with_its_placement(rng):
    """The layer rebuilds ``route_lookup`` with every placement and its Pallas map_and_count reads it: the slots
    counted follow the lookup table, equal the XLA path's with the right one, and differ with a wrong one."""
    pallas = DispatchConfig(map_implementation="pallas")
    layer = MoELayer(D, H, E, K, mesh=MESH, num_physical=P, dispatch=pallas, rngs=nnx.Rngs(0))
    placement = _random_placement(rng)
    layer.eplb_set_placement(placement.phy2log[0], placement.log2phy[0], placement.logcnt[0])
    want = np.asarray(lookup_table(placement.log2phy[0], placement.logcnt[0]))
    np.testing.assert_array_equal(np.asarray(layer.route_lookup.get_value()), want)
    x = jnp.asarray(rng.standard_normal((G * 6, D)).astype(np.float32))

    forward = nnx.jit(lambda module, x: module(x))  # (eager, the interpret-mode kernel took ~50 s of CPU)

    def load_after_pass(module):
        module.expert_load.set_value(jnp.zeros_like(module.expert_load.get_value()))
        forward(module, x)
        return np.asarray(module.expert_load.get_value()).sum(0)

    pallas_load = load_after_pass(layer)
    layer.dispatch = dataclasses.replace(pallas, map_implementation="xla")
    np.testing.assert_array_equal(load_after_pass(layer), pallas_load)
    other = Placement.linear(1, E, P)  # a lookup of another placement: the kernel follows it
    layer.route_lookup.set_value(put_host(np.asarray(lookup_table(other.log2phy[0], other.logcnt[0])), MESH, PS()))
    layer.dispatch = pallas
    assert not np.array_equal(load_after_pass(layer), pallas_load)
    with pytest.raises(ValueError, match="placement table must have shape"):
        layer.eplb_set_placement(placement.phy2log[0], placement.log2phy[0][:, :1], placement.logcnt[0])


def test_padding_tokens_are_neither_computed_nor_counted(rng):
    w_in, w_out, router = _weights(rng)
    placement = _random_placement(rng)
    phy = placement.phy2log[0]
    x = rng.standard_normal((G * 5, D)).astype(np.float32)
    args = (x, router, BIAS, {"w_in": w_in[phy], "w_out": w_out[phy]}, placement.log2phy[0], placement.logcnt[0])
    out_all, _ = APPLY(*args)
    valid = rng.random(G * 5) < 0.5  # scattered padding, as a batch of requests of different lengths has
    valid[5:10] = False  # and one rank with none real
    out, load = APPLY(*args, jnp.asarray(valid))
    out = np.asarray(out)
    assert np.array_equal(out[valid], np.asarray(out_all)[valid])  # real tokens: the same bits
    assert not out[~valid].any()  # padding goes to no expert
    _, ids = _oracle(x, router, w_in, w_out)
    # Per-rank rows: row r counts only rank r's own real tokens.
    rows = np.asarray(load)
    for rank in range(G):
        lo, hi = rank * 5, (rank + 1) * 5
        real = ids[lo:hi][valid[lo:hi]]
        assert np.array_equal(
            np.bincount(phy, weights=rows[rank], minlength=E), np.bincount(real.reshape(-1), minlength=E)
        )
    # load_reduce="psum": the replicated per-step total, equal to the sum of the rows.
    out_psum, load_psum = _apply_fn(load_reduce="psum")(*args, jnp.asarray(valid))
    assert load_psum.shape == (P,) and np.array_equal(np.asarray(load_psum), rows.sum(0))
    assert np.array_equal(np.asarray(out_psum), out)
    # record=False (traced): the same outputs, nothing counted, no recompilation.
    out_quiet, load_quiet = APPLY(*args, jnp.asarray(valid), jnp.bool_(False))
    assert np.array_equal(np.asarray(out_quiet), out) and not np.asarray(load_quiet).any()
    with pytest.raises(ValueError, match="valid must be"):
        APPLY(*args, jnp.asarray(valid[:-1]))
    with pytest.raises(ValueError, match="DispatchConfig.load_reduce must be one of"):
        DispatchConfig(load_reduce="mean")


def test_per_rank_load_has_no_collective_in_the_step(rng):
    """load_reduce="none" leaves no all-reduce in the compiled forward pass; "psum" has exactly the load's one."""
    w_in, w_out, router = _weights(rng)
    placement = Placement.linear(1, E, P)
    args = (
        rng.standard_normal((G * 4, D)).astype(np.float32),
        router,
        BIAS,
        {"w_in": w_in[placement.phy2log[0]], "w_out": w_out[placement.phy2log[0]]},
        placement.log2phy[0],
        placement.logcnt[0],
    )
    hlo = {mode: _apply_fn(load_reduce=mode).lower(*args).compile().as_text() for mode in ("none", "psum")}
    assert hlo["none"].count("all-reduce") == 0
    assert hlo["psum"].count("all-reduce") >= 1


def test_moe_apply_rejects_bad_shapes(rng):
    w_in, w_out, router = _weights(rng)
    placement = Placement.linear(1, E, P)
    experts = {"w_in": w_in[placement.phy2log[0]], "w_out": w_out[placement.phy2log[0]]}
    good = (
        rng.standard_normal((G * 2, D)).astype(np.float32),
        router,
        BIAS,
        experts,
        placement.log2phy[0],
        placement.logcnt[0],
    )
    bad = [
        (0, good[0][: G * 2 - 1], "divisible by the EP size"),
        (1, router[:, : E - 1], "router_bias"),
        (3, {"w_in": experts["w_in"][:10], "w_out": experts["w_out"][:10]}, "divisible by the EP size"),
        (4, placement.log2phy[0][:, :2], "log2phy"),
    ]
    for index, value, match in bad:
        args = list(good)
        args[index] = value
        with pytest.raises(ValueError, match=match):
            moe_apply(*args, router=ROUTER, mesh=MESH)
    with pytest.raises(ValueError, match="RouterConfig.top_k=9 is larger than num_experts=8"):
        moe_apply(*good, router=RouterConfig(top_k=E + 1), mesh=MESH)
    with pytest.raises(ValueError, match="dispatch must be a DispatchConfig"):
        moe_apply(*good, router=ROUTER, mesh=MESH, dispatch={"matmul": "dense"})


@pytest.mark.slow
def test_capacity_rounds_give_identical_outputs_and_gradients(rng):
    """Bounded exchange rounds (dropless under total skew) equal the single worst-case exchange, bit for bit."""
    w_in, w_out, router = _weights(rng)
    placement = _random_placement(rng)
    phy = placement.phy2log[0]
    x = rng.standard_normal((G * 6, D)).astype(np.float32)
    skewed = np.where(np.arange(E) < 2, 6.0, 0.0).astype(np.float32)  # nearly all tokens to experts 0 and 1
    experts = {"w_in": jnp.asarray(w_in[phy]), "w_out": jnp.asarray(w_out[phy])}

    def loss(experts, x, factor):
        out, load = moe_apply(
            x,
            router,
            skewed,
            experts,
            placement.log2phy[0],
            placement.logcnt[0],
            router=ROUTER,
            mesh=MESH,
            dispatch=DispatchConfig(capacity_factor=factor, one_round_rows=0),
        )
        return jnp.sum(out * out), (out, load)

    grads = {}
    for factor in (None, 1.0, 0.25):
        (_, (out, load)), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)(
            experts, jnp.asarray(x), factor
        )
        grads[factor] = (np.asarray(out), np.asarray(load), jax.tree.map(np.asarray, g))
    for factor in (1.0, 0.25):
        assert np.array_equal(grads[factor][0], grads[None][0])
        assert np.array_equal(grads[factor][1], grads[None][1])
        for a, b in zip(jax.tree.leaves(grads[factor][2]), jax.tree.leaves(grads[None][2])):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="capacity_factor"):
        DispatchConfig(capacity_factor=float("inf"))

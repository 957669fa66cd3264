"""The token exchange of ``moe_eplb_jax.moe.dispatch``: the one-rank path (no plan, no exchange) against the exchange."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as PS

from moe_eplb_jax.moe import DispatchConfig, dispatch, expert_mlp, local, routed_experts


def _exchanged(x, physical, weights, experts):
    """The general path (plan, all_to_all over one rank, sort, combine), as ``G > 1`` runs it."""
    slots = experts["w_in"].shape[0]
    rows, row_slot, plan = dispatch.dispatch(x, physical, slots_per_rank=slots, axis_name="ep", num_ranks=1)
    order, sizes = dispatch.sort_by_slot(row_slot, slots)
    y = dispatch.unsort(expert_mlp(rows[order], experts, sizes, implementation="dense"), order)
    return dispatch.combine(y, plan, weights, axis_name="ep", out_dtype=x.dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_one_rank_path_equals_the_exchange(dtype, rng):
    """Same outputs and gradients (to rounding: XLA may fuse the weighted sum differently), with unsent assignments
    (id -1) and empty slots."""
    tokens, top_k, dim, hidden, slots = 24, 3, 16, 8, 6
    x = jnp.asarray(rng.standard_normal((tokens, dim)), dtype)
    physical = rng.integers(0, slots - 1, (tokens, top_k)).astype(np.int32)  # the last slot gets nothing
    physical[rng.random((tokens, top_k)) < 0.2] = -1
    weights = jnp.asarray(rng.random((tokens, top_k)), jnp.float32)
    experts = {
        "w_in": jnp.asarray(rng.standard_normal((slots, dim, 2 * hidden)) / 4, dtype),
        "w_out": jnp.asarray(rng.standard_normal((slots, hidden, dim)) / 4, dtype),
    }
    mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    config = DispatchConfig(matmul="dense")

    def run(path):
        def f(x, experts):
            body = lambda x, experts: path(x, physical, weights, experts)
            specs = (PS("ep"), PS("ep"))
            return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=PS("ep"), check_vma=False)(x, experts)

        out = jax.jit(f)(x, experts)
        grads = jax.jit(jax.grad(lambda x, e: jnp.sum(f(x, e).astype(jnp.float32) ** 2), argnums=(0, 1)))(x, experts)
        return out, grads

    one_rank = run(lambda x, p, w, e: routed_experts(x, p, w, e, axis="ep", num_ranks=1, dispatch=config))
    exchanged = run(_exchanged)
    for a, b in zip(jax.tree.leaves(one_rank), jax.tree.leaves(exchanged)):
        tolerance = 1e-6 if dtype == jnp.float32 else 1e-2
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tolerance, atol=tolerance)
    unsent = (physical < 0).all(axis=1)
    if unsent.any():
        np.testing.assert_array_equal(np.asarray(one_rank[0], np.float32)[unsent], 0.0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_permutations_are_gathers_both_ways(dtype, rng):
    """``permute_rows`` / ``unsort``: autodiff's values and gradients bit for bit, and no scatter-add of rows in the
    gradient (a permutation's transpose is its inverse gather; only the int inverse is scattered)."""
    n, dim = 37, 5
    x = jnp.asarray(rng.standard_normal((n, dim)), dtype)
    cot = jnp.asarray(rng.standard_normal((n, dim)), dtype)
    order = jnp.asarray(rng.permutation(n), jnp.int32)
    inverse = np.asarray(dispatch.inverse_permutation(order))
    np.testing.assert_array_equal(inverse[np.asarray(order)], np.arange(n))
    for ours, autodiff in (
        (lambda x: dispatch.permute_rows(x, order), lambda x: x[order]),
        (lambda x: dispatch.unsort(x, order), lambda x: jnp.zeros_like(x).at[order].set(x)),
    ):
        np.testing.assert_array_equal(np.asarray(ours(x), np.float32), np.asarray(autodiff(x), np.float32))
        grad = lambda f: jax.grad(lambda x: jnp.sum((f(x) * cot).astype(jnp.float32)))
        np.testing.assert_array_equal(np.asarray(grad(ours)(x), np.float32), np.asarray(grad(autodiff)(x), np.float32))
        jaxpr = str(jax.make_jaxpr(grad(ours))(x))
        assert "scatter-add" not in jaxpr and "scatter_add" not in jaxpr
    with pytest.raises(ValueError, match="permutation of x's"):
        dispatch.permute_rows(x, order[:-1])
    with pytest.raises(ValueError, match="1-D integer permutation"):
        dispatch.inverse_permutation(order.astype(jnp.float32))


def test_one_rank_gather_sums_each_tokens_gradient_over_its_assignments(rng):
    """``gather_local``'s input gradient: each token's ``k`` row gradients summed (sent rows only), with no
    scatter-add of rows."""
    tokens, top_k, dim, slots = 19, 3, 4, 5
    x = jnp.asarray(rng.standard_normal((tokens, dim)), jnp.float32)
    physical = rng.integers(0, slots, (tokens, top_k)).astype(np.int32)
    physical[rng.random((tokens, top_k)) < 0.25] = -1
    cot = jnp.asarray(rng.standard_normal((tokens * top_k, dim)), jnp.float32)
    rows_of = lambda x: local.gather_local(x, jnp.asarray(physical), slots)[0]
    _, order, inverse, sizes = local.gather_local(x, jnp.asarray(physical), slots)
    flat = np.where(physical < 0, slots, physical).reshape(-1)
    np.testing.assert_array_equal(np.asarray(order), np.argsort(flat, kind="stable"))
    np.testing.assert_array_equal(np.asarray(inverse)[np.asarray(order)], np.arange(tokens * top_k))
    assert int(sizes.sum()) == int((physical >= 0).sum())
    got = np.asarray(jax.grad(lambda x: jnp.sum(rows_of(x) * cot))(x))
    sent = np.asarray(order) < tokens * top_k  # every row of the permutation
    want = np.zeros((tokens, dim), np.float32)
    flat = physical.reshape(-1)
    for position, assignment in enumerate(np.asarray(order)):
        if sent[position] and flat[assignment] >= 0:
            want[assignment // top_k] += np.asarray(cot)[position]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert "scatter-add" not in str(jax.make_jaxpr(jax.grad(lambda x: jnp.sum(rows_of(x) * cot)))(x))


def test_one_rank_combine_gradients_are_gathers_and_ignore_the_padding_rows(rng):
    """``combine_local``: each token's weighted sum in router order, and the gradients of the grouped results and of
    the router weights, against loops over the assignments -- with NaN in the padding rows (an expert MLP leaves
    them unspecified), which reach neither the output nor a gradient."""
    tokens, top_k, dim, slots = 17, 4, 5, 3
    physical = rng.integers(0, slots, (tokens, top_k)).astype(np.int32)
    physical[rng.random((tokens, top_k)) < 0.3] = -1
    x = jnp.asarray(rng.standard_normal((tokens, dim)), jnp.float32)
    _, order, inverse, sizes = local.gather_local(x, jnp.asarray(physical), slots)
    sent = int(sizes.sum())
    y = rng.standard_normal((tokens * top_k, dim)).astype(np.float32)
    y[sent:] = np.nan
    weights = rng.random((tokens, top_k)).astype(np.float32)
    cot = rng.standard_normal((tokens, dim)).astype(np.float32)

    def loss(y, w):
        return jnp.sum(local.combine_local(y, order, inverse, jnp.asarray(physical), w) * cot)

    out = np.asarray(local.combine_local(jnp.asarray(y), order, inverse, jnp.asarray(physical), jnp.asarray(weights)))
    dy, dw = jax.grad(loss, argnums=(0, 1))(jnp.asarray(y), jnp.asarray(weights))
    row_of = np.empty(tokens * top_k, np.int64)
    row_of[np.asarray(order)] = np.arange(tokens * top_k)  # assignment -> its sorted row
    want_out = np.zeros((tokens, dim), np.float32)
    want_dy = np.zeros_like(y)
    want_dw = np.zeros_like(weights)
    for t in range(tokens):
        for j in range(top_k):
            if physical[t, j] < 0:
                continue
            row = row_of[t * top_k + j]
            want_out[t] += weights[t, j] * y[row]
            want_dy[row] = weights[t, j] * cot[t]
            want_dw[t, j] = np.dot(cot[t], y[row])
    np.testing.assert_allclose(out, want_out, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dy), want_dy, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dw), want_dw, rtol=1e-5, atol=1e-5)
    jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(y), jnp.asarray(weights)))
    assert "scatter-add" not in jaxpr


def test_one_rank_gather_checks_its_shapes():
    with pytest.raises(ValueError, match="x must have shape"):
        local.gather_local(jnp.zeros((4, 3)), jnp.zeros((5, 2), jnp.int32), 2)
    with pytest.raises(ValueError, match="group_sizes must have shape"):
        local.sort_local(jnp.zeros((4, 2), jnp.int32), 2, group_sizes=jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match="physical_ids must have shape"):
        local.sort_local(jnp.zeros(8, jnp.int32), 2)
    with pytest.raises(ValueError, match="order, inverse"):
        local.gather_rows(jnp.zeros((4, 3)), jnp.arange(8), jnp.arange(7), jnp.zeros(2, jnp.int32), 2)
    with pytest.raises(ValueError, match="rows and weights"):
        local.combine_local(
            jnp.zeros((8, 3)), jnp.arange(8), jnp.arange(8), jnp.zeros((4, 2), jnp.int32), jnp.zeros((4, 3))
        )
    with pytest.raises(ValueError, match="order and inverse"):
        local.combine_local(
            jnp.zeros((8, 3)), jnp.arange(8), jnp.arange(7), jnp.zeros((4, 2), jnp.int32), jnp.zeros((4, 2))
        )


def test_one_rank_path_reads_token_rows_inside_the_kernel(rng):
    """On a Triton backend the one-rank MLP reads each row from its token inside one kernel (gate, up, SwiGLU)
    when nothing differentiates it: the outputs equal the gathered path's to float32 rounding, and gradients
    take the gathered path (its VJPs; equal to float32 rounding, as XLA fuses them in or out of ``shard_map``)."""
    tokens, top_k, dim, hidden, slots = 20, 3, 32, 16, 5
    x = jnp.asarray(rng.standard_normal((tokens, dim)), jnp.float32)
    physical = rng.integers(0, slots - 1, (tokens, top_k)).astype(np.int32)  # the last slot gets nothing
    physical[rng.random((tokens, top_k)) < 0.2] = -1
    weights = jnp.asarray(rng.random((tokens, top_k)), jnp.float32)
    experts = {
        "w_in": jnp.asarray(rng.standard_normal((slots, dim, 2 * hidden)) / 6, jnp.float32),
        "w_out": jnp.asarray(rng.standard_normal((slots, hidden, dim)) / 4, jnp.float32),
    }
    mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])

    def layer(matmul):
        config = DispatchConfig(matmul=matmul)

        def f(x, experts):
            body = lambda x, e: routed_experts(x, physical, weights, e, axis="ep", num_ranks=1, dispatch=config)
            specs = (PS("ep"), PS("ep"))
            return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=PS("ep"), check_vma=False)(x, experts)

        return f

    loss = lambda f: jax.grad(lambda x, e: jnp.sum(f(x, e) ** 2), argnums=(0, 1))
    fused, dense = layer("pallas_interpret"), layer("dense")
    assert "swiglu_matmul" in str(jax.make_jaxpr(fused)(x, experts))
    assert "swiglu_matmul" not in str(jax.make_jaxpr(loss(fused))(x, experts))
    want = np.asarray(jax.jit(dense)(x, experts))
    np.testing.assert_allclose(np.asarray(jax.jit(fused)(x, experts)), want, rtol=1e-5, atol=1e-5)
    unsent = (physical < 0).all(axis=1)
    np.testing.assert_array_equal(np.asarray(jax.jit(fused)(x, experts))[unsent], 0.0)

    def gathered(x, experts):  # the same layer with the rows gathered first (no fused kernel anywhere)
        order, inverse, sizes, _ = local.sort_local(jnp.asarray(physical), slots)
        rows = local.gather_rows(x, order, inverse, sizes, top_k)
        y = expert_mlp(rows, experts, sizes, implementation="pallas_interpret")
        return local.combine_local(y, order, inverse, jnp.asarray(physical), weights)

    grads = jax.jit(loss(fused))(x, experts), jax.jit(loss(gathered))(x, experts)
    for got, expect in zip(*map(jax.tree.leaves, grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expect), rtol=1e-5, atol=1e-6)

"""The token exchange of ``moe_eplb_jax.moe.dispatch``: the one-rank path (no plan, no exchange) against the exchange."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as PS

from moe_eplb_jax.moe import DispatchConfig, dispatch, expert_mlp, routed_experts


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

    local = run(lambda x, p, w, e: routed_experts(x, p, w, e, axis="ep", num_ranks=1, dispatch=config))
    exchanged = run(_exchanged)
    for a, b in zip(jax.tree.leaves(local), jax.tree.leaves(exchanged)):
        tolerance = 1e-6 if dtype == jnp.float32 else 1e-2
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tolerance, atol=tolerance)
    unsent = (physical < 0).all(axis=1)
    if unsent.any():
        np.testing.assert_array_equal(np.asarray(local[0], np.float32)[unsent], 0.0)

"""``dispatch.exchange_apply``: rounds of ``capacity`` rows per rank pair against the single worst-case exchange
(outputs, gradients, dropless under skew), and buffers sized by the capacity (from the compiled program)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as PS

from moe_eplb_jax.moe import DispatchConfig, dispatch, expert_mlp, routed_experts

pytestmark = pytest.mark.devices(8)

TOKENS, TOP_K, DIM, HIDDEN, SLOTS_PER_RANK = 8, 2, 8, 4, 2


def _mesh(num_ranks):
    return jax.make_mesh(
        (num_ranks,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:num_ranks]
    )


def _worst_case(x, physical, weights, experts):
    """Today's one-shot path: ``[G, A, D]`` buffers, one all_to_all each way, the MLP on all ``G * A`` rows."""
    slots = experts["w_in"].shape[0]
    num_ranks = jax.lax.axis_size("ep")
    rows, row_slot, plan = dispatch.dispatch(x, physical, slots_per_rank=slots, axis_name="ep", num_ranks=num_ranks)
    order, sizes = dispatch.sort_by_slot(row_slot, slots)
    y = dispatch.unsort(expert_mlp(rows[order], experts, sizes, implementation="dense"), order)
    return dispatch.combine(y, plan, weights, axis_name="ep", out_dtype=x.dtype)


def _rounds(factor):
    def path(x, physical, weights, experts):
        num_ranks = jax.lax.axis_size("ep")
        config = DispatchConfig(matmul="dense", capacity_factor=factor)
        return routed_experts(x, physical, weights, experts, axis="ep", num_ranks=num_ranks, dispatch=config)

    return path


def _skewed_ids(rng, num_ranks, hot_ranks):
    """``[G * T, k]`` slots, every assignment on the first ``hot_ranks`` ranks (distinct slots per token), some
    unsent (``-1``)."""
    per_token = np.stack([rng.permutation(hot_ranks * SLOTS_PER_RANK)[:TOP_K] for _ in range(num_ranks * TOKENS)])
    per_token[rng.random(per_token.shape) < 0.1] = -1
    return per_token.astype(np.int32)


def _operands(rng, num_ranks, hot_ranks):
    slots = num_ranks * SLOTS_PER_RANK
    x = jnp.asarray(rng.standard_normal((num_ranks * TOKENS, DIM)), jnp.float32)
    physical = jnp.asarray(_skewed_ids(rng, num_ranks, hot_ranks))
    weights = jnp.asarray(rng.random((num_ranks * TOKENS, TOP_K)), jnp.float32)
    experts = {
        "w_in": jnp.asarray(rng.standard_normal((slots, DIM, 2 * HIDDEN)) / 2, jnp.float32),
        "w_out": jnp.asarray(rng.standard_normal((slots, HIDDEN, DIM)) / 2, jnp.float32),
    }
    return x, physical, weights, experts


def _run(path, mesh, operands):
    x, physical, weights, experts = operands

    def f(x, weights, experts):
        specs = (PS("ep"), PS("ep"), PS("ep"), PS("ep"))
        return jax.shard_map(path, mesh=mesh, in_specs=specs, out_specs=PS("ep"), check_vma=False)(
            x, physical, weights, experts
        )

    def loss(x, weights, experts):
        return jnp.sum(jnp.sin(f(x, weights, experts)))

    out = jax.jit(f)(x, weights, experts)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, weights, experts)
    return out, grads


def _rounds_needed(physical, num_ranks, capacity):
    dest = np.where(physical >= 0, physical // SLOTS_PER_RANK, num_ranks).reshape(num_ranks, -1)
    fullest = max(int((dest[src] == g).sum()) for src in range(num_ranks) for g in range(num_ranks))
    return max(1, -(-fullest // capacity))


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25, 4.0])
def test_rounds_equal_the_worst_case_exchange(num_ranks, factor, rng):
    """Every skew from balanced to all on one rank (1 .. G and more rounds): the same outputs, bit for bit, and
    the same gradients (to float32 rounding: the rounds' gradients are summed in another order)."""
    mesh = _mesh(num_ranks)
    capacity = DispatchConfig(capacity_factor=factor).capacity(TOKENS * TOP_K, num_ranks)
    seen = set()
    for hot_ranks in sorted({num_ranks, max(1, num_ranks // 2), 1}):
        operands = _operands(rng, num_ranks, hot_ranks)
        seen.add(_rounds_needed(np.asarray(operands[1]), num_ranks, capacity))
        out, grads = _run(_rounds(factor), mesh, operands)
        ref_out, ref_grads = _run(_worst_case, mesh, operands)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(ref_out))
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=2e-6)
    if factor <= 1.0:
        assert max(seen) > 1, seen  # the skews reach the overflow rounds

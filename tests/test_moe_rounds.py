"""``dispatch.exchange_apply``: rounds of ``capacity`` rows per rank pair against the single worst-case exchange
(outputs, gradients, dropless under skew), and buffers sized by the capacity (from the compiled program)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as PS

from moe_eplb_jax import quant
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
        config = DispatchConfig(matmul="dense", capacity_factor=factor, one_round_rows=0)
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


def _compiled(path, mesh):
    """``operands -> (outputs, gradients wrt x, weights, experts)`` of ``path``, jitted once (the slots are an
    input, so every skew shares the compile)."""

    def f(x, physical, weights, experts):
        specs = (PS("ep"), PS("ep"), PS("ep"), PS("ep"))
        return jax.shard_map(path, mesh=mesh, in_specs=specs, out_specs=PS("ep"), check_vma=False)(
            x, physical, weights, experts
        )

    def loss(x, physical, weights, experts):
        return jnp.sum(jnp.sin(f(x, physical, weights, experts)))

    forward, backward = jax.jit(f), jax.jit(jax.grad(loss, argnums=(0, 2, 3)))
    return lambda operands: (forward(*operands), backward(*operands))


def _rounds_needed(physical, num_ranks, capacity):
    dest = np.where(physical >= 0, physical // SLOTS_PER_RANK, num_ranks).reshape(num_ranks, -1)
    fullest = max(int((dest[src] == g).sum()) for src in range(num_ranks) for g in range(num_ranks))
    return max(1, -(-fullest // capacity))


@pytest.mark.parametrize(
    ("num_ranks", "factors"),
    [
        (4, (0.5,)),
        pytest.param(2, (0.5, 1.0, 1.25, 4.0), marks=pytest.mark.slow),
        pytest.param(4, (1.0, 1.25, 4.0), marks=pytest.mark.slow),
        pytest.param(8, (0.5, 1.0, 1.25, 4.0), marks=pytest.mark.slow),
    ],
)
def test_rounds_equal_the_worst_case_exchange(num_ranks, factors, rng):
    """Capacity factors 0.5 / 1 / 1.25 / 4 and skews from balanced to all on one rank (1 .. 2G rounds): the same
    outputs, bit for bit, and the same gradients (to float32 rounding: the rounds' gradients add in another
    order)."""
    mesh = _mesh(num_ranks)
    skews = [_operands(rng, num_ranks, hot) for hot in sorted({num_ranks, max(1, num_ranks // 2), 1})]
    worst_case = _compiled(_worst_case, mesh)
    reference = [worst_case(operands) for operands in skews]
    rounds = set()
    for factor in factors:
        capacity = DispatchConfig(capacity_factor=factor, one_round_rows=0).capacity(TOKENS * TOP_K, num_ranks)
        run = _compiled(_rounds(factor), mesh)
        for operands, (ref_out, ref_grads) in zip(skews, reference):
            rounds.add(_rounds_needed(np.asarray(operands[1]), num_ranks, capacity))
            out, grads = run(operands)
            np.testing.assert_array_equal(np.asarray(out), np.asarray(ref_out))
            for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=2e-6)
    assert max(rounds) >= num_ranks, rounds  # total skew: the overflow rounds run
    assert min(rounds) == 1 or min(factors) < 1, rounds


def _compiled_buffers(path, mesh, tokens, dim):
    """The compiled forward and backward programs of ``path`` (one slot per rank, hidden width 1, so the ``dense``
    matmul's slot-times-rows product stays small): elements of their largest array and of their largest
    ``all-to-all``, and the forward's temporary bytes."""
    num_ranks = mesh.shape["ep"]
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((num_ranks * tokens, dim)), jnp.float32)
    physical = jnp.asarray(rng.integers(0, num_ranks, (num_ranks * tokens, TOP_K)), jnp.int32)
    weights = jnp.ones((num_ranks * tokens, TOP_K), jnp.float32)
    experts = {
        "w_in": jnp.zeros((num_ranks, dim, 2), jnp.float32),
        "w_out": jnp.zeros((num_ranks, 1, dim), jnp.float32),
    }

    def f(x, experts):
        specs = (PS("ep"), PS("ep"), PS("ep"), PS("ep"))
        return jax.shard_map(path, mesh=mesh, in_specs=specs, out_specs=PS("ep"), check_vma=False)(
            x, physical, weights, experts
        )

    def elements(shape):
        return int(np.prod([int(n) for n in shape.split(",")]))

    largest, exchanged, temp = 0, 0, None
    for fn in (f, jax.grad(lambda x, e: jnp.sum(f(x, e)), argnums=(0, 1))):
        compiled = jax.jit(fn).lower(x, experts).compile()
        text, memory = compiled.as_text(), compiled.memory_analysis()
        assert text is not None and memory is not None
        largest = max([largest] + [elements(s) for s in re.findall(r"\bf32\[([\d,]+)\]", text)])
        for line in text.splitlines():  # an all-to-all's result: one array, or (on CPU) a tuple of G parts
            if " all-to-all(" in line:
                result = line.split(" all-to-all(")[0]
                exchanged = max(exchanged, sum(elements(s) for s in re.findall(r"\bf32\[([\d,]+)\]", result)))
        temp = memory.temp_size_in_bytes if temp is None else temp
    return largest, exchanged, temp


def test_rounds_buffers_are_sized_by_the_capacity():
    """At EP 8 with a capacity factor, no float array of the compiled step (forward or backward) holds ``G * A *
    D`` elements, nor half that (the worst-case exchange does): the buffers are ``[A, D]`` and ``[G, C, D]``, the
    all-to-alls ``[G, C, D]``."""
    mesh, tokens, dim = _mesh(8), 32, 64
    worst = 8 * tokens * TOP_K * dim  # G * A * D
    capacity = DispatchConfig(capacity_factor=1.0, one_round_rows=0).capacity(tokens * TOP_K, 8)
    assert capacity is not None
    largest, exchanged, temp = _compiled_buffers(_rounds(1.0), mesh, tokens, dim)
    ref_largest, ref_exchanged, ref_temp = _compiled_buffers(_worst_case, mesh, tokens, dim)
    assert ref_largest >= worst and ref_exchanged == worst  # the check sees worst-case buffers where they exist
    assert largest < worst // 2, (largest, worst)
    assert exchanged == 8 * capacity * dim, (exchanged, capacity)
    assert temp < ref_temp / 2, (temp, ref_temp)


@pytest.mark.slow
@pytest.mark.parametrize("scaling", ["static", "dynamic"])
def test_quantized_experts_in_rounds_equal_the_worst_case(scaling, rng):
    """fp8 experts through the rounds at EP 4 under total skew: outputs equal the single worst-case exchange's
    (dynamic scales: one worst-case round, so the EP-wide scale covers every row) and so do the input gradients
    through the integer-leaved pytree."""
    num_ranks, dim, hidden = 4, 32, 32
    mesh, slots = _mesh(num_ranks), num_ranks * SLOTS_PER_RANK
    weights_f32 = [rng.standard_normal(s).astype(np.float32) * 0.1 for s in [(slots, hidden, dim)] * 2]
    gate, up, down = quant.quantize_mlp(
        *weights_f32, rng.standard_normal((slots, dim, hidden)).astype(np.float32) * 0.1, "fp8", input_scale=0.02
    )
    experts = {"gate": gate, "up": up, "down": down}
    x = jnp.asarray(rng.standard_normal((num_ranks * TOKENS, dim)), jnp.float32)
    physical = jnp.asarray(_skewed_ids(rng, num_ranks, 1))
    weights = jnp.asarray(rng.random((num_ranks * TOKENS, TOP_K)), jnp.float32)

    def run(factor):
        config = DispatchConfig(capacity_factor=factor, activation_scaling=scaling, one_round_rows=0)

        def f(x):
            body = functools.partial(routed_experts, axis="ep", num_ranks=num_ranks, dispatch=config)
            specs = (PS("ep"), PS("ep"), PS("ep"), PS("ep"))
            return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=PS("ep"), check_vma=False)(
                x, physical, weights, experts
            )

        return jax.jit(f)(x), jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(f(x)))))(x)

    (out, grad), (ref_out, ref_grad) = run(0.5), run(None)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref_out))
    np.testing.assert_allclose(np.asarray(grad), np.asarray(ref_grad), rtol=2e-6, atol=2e-6)

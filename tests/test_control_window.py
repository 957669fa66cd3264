"""``control.close_steps``: several steps closed at once equal as many ``close_step`` calls, dummy steps included."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from moe_eplb_jax import EplbConfig
from moe_eplb_jax import state as eplb_state
from moe_eplb_jax.control import close_step, close_steps, step_loads


def _state(rng, window_size, num_layers, num_ranks, num_physical, steps_before):
    """A per-rank state after ``steps_before`` closed steps and a partly recorded open one."""
    config = EplbConfig(window_size=window_size, num_gpus=num_ranks)
    state = eplb_state.init_state(config, num_layers, num_physical, per_rank=True)
    for _ in range(steps_before):
        state = close_step(state, rng.integers(0, 50, (num_layers, num_ranks, num_physical)).astype(np.int32))
    return eplb_state.record(state, rng.integers(0, 9, (num_layers, num_ranks, num_physical)).astype(np.int32))


@given(
    window_size=st.integers(1, 5),
    steps=st.integers(1, 9),
    steps_before=st.integers(0, 7),
    dummy=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_closing_steps_at_once_equals_closing_them_one_by_one(window_size, steps, steps_before, dummy, seed):
    rng = np.random.default_rng(seed)
    state = _state(rng, window_size, 2, 2, 4, steps_before)
    loads = rng.integers(0, 1000, (steps, 2, 2, 4)).astype(np.int32)
    want = state
    for row in loads:
        want = close_step(want, list(row), dummy=dummy)
    rows = jnp.stack([step_loads(state, list(row)) for row in loads])
    got = jax.jit(close_steps, static_argnames=())(state, rows, dummy=jnp.asarray(dummy))
    for field in dataclasses.fields(want):
        np.testing.assert_array_equal(getattr(got, field.name), getattr(want, field.name), err_msg=field.name)


def test_step_loads_takes_what_close_step_takes(rng):
    state = _state(rng, 3, 2, 2, 4, 0)
    summed = rng.integers(0, 9, 4).astype(np.int32)  # a layer's load already summed over the ranks: rank 0's row
    per_rank = rng.integers(0, 9, (2, 4)).astype(np.int32)
    row = np.asarray(step_loads(state, [per_rank, summed]))
    np.testing.assert_array_equal(row[0], per_rank)
    np.testing.assert_array_equal(row[1], np.stack([summed, np.zeros(4, np.int32)]))
    with pytest.raises(ValueError, match=r"loads must be one array per MoE layer \(2\)"):
        step_loads(state, [per_rank])
    with pytest.raises(ValueError, match=r"steps must have shape \[n >= 1, L, G, P\] = \[n, 2, 2, 4\], got \(2, 4\)"):
        close_steps(state, per_rank)
    with pytest.raises(ValueError, match="steps must have shape"):
        close_steps(state, np.zeros((0, 2, 2, 4), np.int32))
    with pytest.raises(ValueError, match="steps must hold integer token counts"):
        close_steps(state, np.zeros((1, 2, 2, 4), np.float32))
    summed = eplb_state.init_state(EplbConfig(window_size=3, num_gpus=2), 2, 4)
    for bad, got in ((summed, "the summed layout"), ({"pass_load": per_rank}, "dict")):
        with pytest.raises(ValueError, match=f"state must be an EplbState in the per-rank layout .*, got {got}"):
            close_steps(bad, np.zeros((1, 2, 2, 4), np.int32))
        with pytest.raises(ValueError, match="state must be an EplbState in the per-rank layout"):
            step_loads(bad, [per_rank, per_rank])
    with pytest.raises(ValueError, match="dummy must be"):
        close_steps(state, np.zeros((2, 2, 2, 4), np.int32), dummy="no")

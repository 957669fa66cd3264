"""The counted sort and top-k (``moe/_ranks.py``) against ``jnp.argsort(stable=True)`` and ``jax.lax.top_k``, bit
for bit, on values with every edge: signed zeros, subnormals, infinities, NaNs with payloads and signs, ties, ids at
the int32 limits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_eplb_jax.moe import _ranks

EDGES = np.array(
    [0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, 1e-45, -1e-45, 1e-40, 3.0, 3.0]
    + [np.uint32(bits).view(np.float32) for bits in (0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFBFFFFF, 0x7FC0BEEF)],
    np.float32,
)


def _floats(rng, shape):
    picked = rng.choice(EDGES, size=shape)
    return np.where(rng.random(shape) < 0.5, rng.standard_normal(shape).astype(np.float32), picked)


@pytest.mark.parametrize("counted", [True, None])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32, jnp.int8, jnp.uint16])
def test_top_k_indices_equal_lax_top_k(rng, counted, dtype):
    for _ in range(6):
        width = int(rng.integers(1, 70))
        shape = tuple(int(s) for s in rng.integers(1, 5, int(rng.integers(1, 3)))) + (width,)
        k = int(rng.integers(1, width + 1))
        if jnp.issubdtype(dtype, jnp.floating):
            values = jnp.asarray(_floats(rng, shape), dtype)
        else:
            info = jnp.iinfo(dtype)
            values = jnp.asarray(rng.integers(int(info.min), int(info.max), shape, endpoint=True), dtype)
            values = jnp.where(jnp.asarray(rng.random(shape) < 0.3), jnp.asarray(info.max, dtype), values)
        got = _ranks.top_k_indices(values, k, counted=counted)
        assert got.dtype == jnp.int32 and got.shape == shape[:-1] + (k,)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.lax.top_k(values, k)[1]))


@pytest.mark.parametrize("counted", [True, None])
def test_stable_argsort_equals_argsort_and_its_inverse(rng, counted):
    limits = np.array([np.iinfo(np.int32).min, np.iinfo(np.int32).max, -1, 0, 1], np.int32)
    for _ in range(12):
        size = int(rng.integers(1, 300))
        keys = np.where(rng.random(size) < 0.3, rng.choice(limits, size), rng.integers(-4, 5, size)).astype(np.int32)
        order, inverse = _ranks.stable_argsort(jnp.asarray(keys), counted=counted)
        want = np.argsort(keys, kind="stable")
        np.testing.assert_array_equal(np.asarray(order), want)
        np.testing.assert_array_equal(np.asarray(inverse)[want], np.arange(size))
        assert order.dtype == inverse.dtype == jnp.int32
    floats = jnp.asarray(_floats(rng, (257,)))  # argsort's NaNs all go last: float keys take the sort
    order, _ = _ranks.stable_argsort(floats, counted=True)
    np.testing.assert_array_equal(np.asarray(order), np.asarray(jnp.argsort(floats, stable=True)))


def test_counting_is_the_default_only_on_a_gpu_within_the_pair_limit():
    values = jnp.zeros((4, 64), jnp.float32)
    on_gpu = jax.default_backend() == "gpu"
    assert _ranks._counts(values, 4 * 64 * 64, None) == on_gpu
    assert not _ranks._counts(values, _ranks.MAX_PAIRS + 1, None)
    assert _ranks._counts(values, 10**12, True)
    assert not _ranks._counts(jnp.zeros((4,), jnp.uint32), 16, True)  # int32 keys would wrap its order
    assert not _ranks._counts(jnp.zeros((4,), jnp.float64), 16, True) or not jax.config.jax_enable_x64


def test_counted_paths_lower_to_no_sort_and_no_scatter():
    keys = jnp.arange(256, dtype=jnp.int32)[::-1]
    text = jax.jit(lambda k: _ranks.stable_argsort(k, counted=True)).lower(keys).as_text()
    assert "sort" not in text and "scatter" not in text
    text = jax.jit(lambda v: _ranks.top_k_indices(v, 8, counted=True)).lower(jnp.zeros((32, 64))).as_text()
    assert "sort" not in text and "top_k" not in text and "topk" not in text.lower()

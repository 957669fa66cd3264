"""The counted sort and top-k (``moe/_ranks.py``) against ``jnp.argsort(stable=True)`` and ``jax.lax.top_k``, bit
for bit, on values with every edge: signed zeros, subnormals, infinities, NaNs with payloads and signs, ties, ids at
the int32 limits."""

import functools

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


@pytest.mark.parametrize("implementation", ["interpret", pytest.param("triton", marks=pytest.mark.gpu)])
def test_top_k_take_kernel_equals_lax_top_k_and_the_gather(implementation, rng):
    """``moe._top_k``: the ids of ``lax.top_k`` and the taken values' bits, on every edge value (signed zeros, NaN
    payloads, infinities, ties), rows and widths off a power of two, k = 1 and k = E."""
    from moe_eplb_jax.moe._top_k import triton as fused

    for rows, width, k in ((32, 64, 8), (5, 24, 6), (70, 256, 8), (1, 3, 3), (33, 7, 1), (3, 1000, 9)):
        choice = _floats(rng, (rows, width))
        choice[0] = choice[0, 0]  # a row of one value: the lowest indices win
        taken = _floats(rng, (rows, width))
        ids, values = fused.top_k_take(
            jnp.asarray(choice), jnp.asarray(taken), k, interpret=implementation == "interpret"
        )
        want = np.asarray(jax.lax.top_k(jnp.asarray(choice), k)[1])
        assert ids.dtype == jnp.int32 and ids.shape == (rows, k) and values.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(ids), want, err_msg=f"{rows} x {width}, k={k}")
        picked = np.take_along_axis(taken, want, axis=1)
        np.testing.assert_array_equal(np.asarray(values).view(np.uint32), picked.view(np.uint32))


def test_top_k_take_refuses_what_it_does_not_take():
    from moe_eplb_jax.moe._top_k import triton as fused

    assert fused.applies((32, 64), 8, jnp.float32, jnp.float32) and fused.applies((1, 1024), 1, jnp.float32, jnp.int32)
    assert not fused.applies((32, 64), 8, jnp.bfloat16, jnp.float32)
    assert not fused.applies((32, 64), 8, jnp.float32, jnp.bfloat16)
    assert not fused.applies((32, 64), 65, jnp.float32, jnp.float32)
    assert not fused.applies((32, 2048), 8, jnp.float32, jnp.float32)
    assert not fused.applies((2, 32, 64), 8, jnp.float32, jnp.float32)
    with pytest.raises(ValueError, match="top_k_take"):
        fused.top_k_take(jnp.zeros((4, 8)), jnp.zeros((4, 9)), 2, interpret=True)
    for bad in ({"block_rows": 3}, {"num_warps": 0}):
        with pytest.raises(ValueError, match="power of two"):
            fused.Config(**bad)


@pytest.mark.parametrize("counted", [True, False, None])
def test_top_k_take_equals_top_k_and_the_gather(rng, counted):
    choice, taken = _floats(rng, (16, 40)), _floats(rng, (16, 40))
    ids, values = _ranks.top_k_take(jnp.asarray(choice), jnp.asarray(taken), 5, counted=counted)
    want = np.asarray(jax.lax.top_k(jnp.asarray(choice), 5)[1])
    np.testing.assert_array_equal(np.asarray(ids), want)
    np.testing.assert_array_equal(
        np.asarray(values).view(np.uint32), np.take_along_axis(taken, want, 1).view(np.uint32)
    )


@pytest.mark.parametrize("implementation", ["interpret", pytest.param("triton", marks=pytest.mark.gpu)])
def test_top_k_take_kernel_renormalizes_scales_and_masks_as_the_router(implementation, rng):
    """With the router's options: each row's picked scores over their sum (plus 1e-20) times the scale, in float32;
    the rows ``valid`` marks false get ids -1 (their weights as computed)."""
    from moe_eplb_jax.moe._top_k import triton as fused

    rows, width, k = 37, 64, 8
    scores = rng.random((rows, width), dtype=np.float32)
    scores[1] = 0.0  # a row summing to zero: the 1e-20 keeps it finite
    valid = rng.random(rows) < 0.7
    ids, weights = fused.top_k_take(
        jnp.asarray(scores),
        jnp.asarray(scores),
        k,
        valid=jnp.asarray(valid),
        renormalize=True,
        scale=2.5,
        interpret=implementation == "interpret",
    )
    want_ids = np.asarray(jax.lax.top_k(jnp.asarray(scores), k)[1])
    picked = np.take_along_axis(scores, want_ids, axis=1)
    total = np.zeros(rows, np.float32)
    for place in range(k):
        total = (total + picked[:, place]).astype(np.float32)
    want = (picked / (total + np.float32(1e-20))[:, None]).astype(np.float32) * np.float32(2.5)
    np.testing.assert_array_equal(np.asarray(ids), np.where(valid[:, None], want_ids, -1))
    # XLA may fold the division and the scaling into one another (and the card's division may round otherwise):
    # two units in the last place, as between this and the XLA router
    np.testing.assert_array_max_ulp(np.asarray(weights), want, maxulp=2)
    assert np.isfinite(np.asarray(weights)).all()


def test_top_k_take_probe_agrees_in_the_interpreter(monkeypatch):
    from moe_eplb_jax.moe._top_k import triton as fused

    monkeypatch.setattr(fused, "top_k_take", functools.partial(fused.top_k_take, interpret=True))
    assert fused.probe()

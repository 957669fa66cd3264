"""Metrics on hand-computed examples, numpy and jax alike."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_eplb_jax import metrics


def test_rank_load_sums_contiguous_slots():
    slot_load = np.array([[1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 2, 2]])
    np.testing.assert_array_equal(metrics.rank_load(slot_load, 3), [[3, 7, 11], [0, 2, 4]])
    np.testing.assert_array_equal(metrics.rank_load(slot_load, 2), [[6, 15], [1, 5]])
    with pytest.raises(ValueError, match="not divisible by 4 ranks"):
        metrics.rank_load(slot_load, 4)


def test_balancedness_and_rank_imbalance_hand_computed():
    loads = np.array([[10.0, 30.0], [20.0, 20.0]])
    # layer 0: mean 20, max 30; layer 1: mean 20, max 20 -> (20 + 20) / (30 + 20)
    assert metrics.balancedness(loads) == pytest.approx(0.8)
    np.testing.assert_allclose(metrics.rank_imbalance(loads), [1.5, 1.0])
    assert metrics.balancedness(np.zeros((2, 4))) == 1.0
    np.testing.assert_allclose(metrics.rank_imbalance(np.array([[0.0, 0.0], [1.0, 3.0]])), [1.0, 1.5])


def test_load_from_logical_splits_over_replicas():
    # 3 experts on 4 slots (expert 0 twice), 2 ranks
    phy2log = np.array([[0, 1, 0, 2]])
    logical = np.array([[8.0, 2.0, 6.0]])
    np.testing.assert_allclose(metrics.slot_load_from_logical(logical, phy2log), [[4.0, 2.0, 4.0, 6.0]])
    np.testing.assert_allclose(metrics.rank_load_from_logical(logical, phy2log, 2), [[6.0, 10.0]])
    # a [P] placement is shared by all layers
    np.testing.assert_allclose(
        metrics.rank_load_from_logical(np.tile(logical, (3, 1)), phy2log[0], 2), np.tile([[6.0, 10.0]], (3, 1))
    )


def test_jax_inputs_give_jax_outputs_under_jit(rng):
    logical = rng.gamma(2.0, 10.0, size=(3, 8)).astype(np.float32)
    phy2log = np.stack([rng.permutation(np.r_[np.arange(8), rng.integers(0, 8, 4)]) for _ in range(3)])

    @jax.jit
    def f(load, table):
        rl = metrics.rank_load_from_logical(load, table, 4)
        return metrics.balancedness(rl), metrics.rank_imbalance(rl)

    b, imb = f(jnp.asarray(logical), jnp.asarray(phy2log))
    rl = metrics.rank_load_from_logical(logical.astype(np.float64), phy2log, 4)
    assert isinstance(b, jax.Array)
    np.testing.assert_allclose(float(b), rl.mean(1).sum() / rl.max(1).sum(), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(imb), rl.max(1) / rl.mean(1), rtol=1e-5)
    assert 0 < float(b) <= 1

"""LP replica routing: on-device multiplicative weights vs the HiGHS optimum; waterfill for a shared expert."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_eplb_jax.placement import build_log2phy
from moe_eplb_jax.routing import (
    lp_shares,
    lp_shares_reference,
    shares_rank_load,
    waterfill_assign,
    waterfill_reference_level,
    waterfill_shares,
)

E, G, SPR = 16, 4, 6  # 16 experts, 4 ranks, 24 slots
P = G * SPR


@functools.cache
def _lp():
    return jax.jit(functools.partial(lp_shares, num_physical=P, num_ranks=G))


def _placement(rng):
    phy2log = np.concatenate([np.arange(E), rng.integers(0, E, P - E)])[rng.permutation(P)]
    log2phy, logcnt = build_log2phy(phy2log[None], E)
    return log2phy[0], logcnt[0]


def test_lp_within_half_percent_of_highs(rng):
    for _ in range(6):
        log2phy, logcnt = _placement(rng)
        load = (rng.lognormal(0.0, 1.5, E) * 1000).astype(np.float32)
        shares, rank_load = _lp()(jnp.asarray(load), jnp.asarray(log2phy), jnp.asarray(logcnt))
        ref_shares, optimum = lp_shares_reference(load, log2phy, logcnt, num_physical=P, num_ranks=G)
        shares = np.asarray(shares)
        valid = np.arange(log2phy.shape[1])[None, :] < logcnt[:, None]
        np.testing.assert_allclose(shares.sum(1), 1.0, rtol=1e-5)
        assert np.all(shares[~valid] == 0) and np.all(shares >= 0)
        np.testing.assert_allclose(
            np.asarray(rank_load),
            shares_rank_load(load, log2phy, logcnt, shares, num_physical=P, num_ranks=G),
            rtol=1e-4,
        )
        # The reference is optimal: never worse than our result nor than an even split.
        ref_load = shares_rank_load(load.astype(np.float64), log2phy, logcnt, ref_shares, num_physical=P, num_ranks=G)
        np.testing.assert_allclose(ref_load.max(), optimum, rtol=1e-6)
        even = valid / logcnt[:, None]
        assert optimum <= shares_rank_load(load, log2phy, logcnt, even, num_physical=P, num_ranks=G).max() + 1e-3
        assert optimum <= float(np.max(rank_load)) * (1 + 1e-6)
        assert float(np.max(rank_load)) <= optimum * 1.005


def test_lp_bad_input(rng):
    log2phy, logcnt = _placement(rng)
    load = np.ones(E, np.float32)
    with pytest.raises(ValueError, match="load must have shape"):
        lp_shares(load[:-1], log2phy, logcnt, num_physical=P, num_ranks=G)
    with pytest.raises(ValueError, match="non-negative"):
        lp_shares(-load, log2phy, logcnt, num_physical=P, num_ranks=G)
    with pytest.raises(ValueError, match="divisible"):
        lp_shares(load, log2phy, logcnt, num_physical=P, num_ranks=5)
    bad = log2phy.copy()
    bad[0, 0] = P + 3
    with pytest.raises(ValueError, match="outside"):
        lp_shares_reference(load, bad, logcnt, num_physical=P, num_ranks=G)


def test_waterfill_level_matches_bisection(rng):
    for _ in range(5):
        floor = rng.integers(0, 1000, 12).astype(np.float32)
        total = float(rng.integers(1, 5000))
        share = np.asarray(waterfill_shares(jnp.asarray(floor), total))
        level = waterfill_reference_level(floor, total)
        np.testing.assert_allclose(share * total, np.maximum(level - floor, 0), atol=1e-2 * total / 12 + 1e-3)
        np.testing.assert_allclose(share.sum(), 1.0, rtol=1e-5)


def test_waterfill_assign_balances_and_is_deterministic(rng):
    num_ranks, tokens = 8, 4096
    routed = rng.integers(0, 2000, num_ranks).astype(np.float32)
    candidates = np.stack(
        [
            np.repeat(np.arange(num_ranks), tokens // num_ranks),
            rng.integers(0, num_ranks, tokens),
            rng.integers(0, num_ranks, tokens),
        ],
        1,
    ).astype(np.int32)
    fn = jax.jit(waterfill_assign)
    dest, load = fn(jnp.asarray(candidates), jnp.asarray(routed))
    dest2, _ = fn(jnp.asarray(candidates), jnp.asarray(routed))
    dest, load = np.asarray(dest), np.asarray(load)
    np.testing.assert_array_equal(dest, np.asarray(dest2))
    assert np.all((dest[:, None] == candidates).any(1))  # always one of the token's candidates
    np.testing.assert_array_equal(np.bincount(dest, minlength=num_ranks), load)
    local = routed + np.bincount(candidates[:, 0], minlength=num_ranks)
    balanced = routed + load
    assert balanced.max() < local.max()
    # Small batches skip balancing: the first candidate.
    few, _ = waterfill_assign(candidates[:16], jnp.asarray(routed), min_tokens=64)
    np.testing.assert_array_equal(np.asarray(few), candidates[:16, 0])
    with pytest.raises(ValueError, match="rank ids"):
        waterfill_assign(candidates + num_ranks, jnp.asarray(routed))
    with pytest.raises(ValueError, match="shape"):
        waterfill_shares(jnp.zeros((2, 2), jnp.float32), 1.0)

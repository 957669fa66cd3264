"""Shared data and the numpy oracle of the ``map_and_count`` tests (``test_map_and_count*.py``).

The oracle is written entry by entry from the documented semantics, independent of both implementations.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from moe_eplb_jax.pallas import map_and_count
from moe_eplb_jax.placement import Placement

GOLDEN = 2654435769


def random_placement(rng, num_logical, num_physical):
    """A random valid one-layer placement (every expert placed, extra slots to random experts)."""
    phy2log = np.concatenate([np.arange(num_logical), rng.integers(0, num_logical, num_physical - num_logical)])
    rng.shuffle(phy2log)
    return Placement.from_phy2log(phy2log, num_logical)


def random_mode_inputs(rng, mode, placement, num_flat):
    num_logical, width = placement.log2phy.shape[1:]
    if mode == "shares":
        # Dyadic weights (multiples of 1/4) so float32 sums are exact in every summation order.
        shares = rng.integers(0, 5, (num_logical, width)).astype(np.float32) / 4
        shares[rng.random(num_logical) < 0.1] = 0.0  # some all-zero rows: equal shares
        return {"replica_shares": shares}
    if mode == "resolved":
        per_expert = max(1, 2 * num_flat // num_logical)
        return {"resolved": rng.integers(0, per_expert, (num_logical, width)).astype(np.int32)}
    return {}


def random_ids(rng, num_tokens, top_k, num_logical, invalid_fraction=0.05):
    ids = rng.integers(0, num_logical, (num_tokens, top_k))
    bad = rng.random((num_tokens, top_k)) < invalid_fraction
    ids[bad] = rng.choice([-1, -7, num_logical, num_logical + 3], size=int(bad.sum()))
    return ids.astype(np.int32)


def layered_inputs(rng, num_layers, num_tokens, top_k, num_logical, num_physical):
    """Per layer a random placement and ids: ``(placements, log2phy [L, E, S], logcnt [L, E], ids [L, T, k])``."""
    placements = [random_placement(rng, num_logical, num_physical) for _ in range(num_layers)]
    log2phy = np.stack([p.log2phy[0] for p in placements])
    logcnt = np.stack([p.logcnt[0] for p in placements])
    ids = np.stack([random_ids(rng, num_tokens, top_k, num_logical) for _ in range(num_layers)])
    return placements, log2phy, logcnt, ids


def oracle(ids, log2phy, logcnt, num_physical, num_valid, mode, replica_shares=None, resolved=None, record=True):
    """Entry-by-entry numpy model of the documented semantics."""
    num_tokens, top_k = ids.shape
    num_logical, width = log2phy.shape
    phys = np.full(ids.size, -1, np.int64)
    load = np.zeros(num_physical, np.int64)
    consumed = np.zeros(num_logical, np.int64)
    for i, expert in enumerate(ids.reshape(-1)):
        token = i // top_k
        if not 0 <= expert < num_logical:
            continue
        count = max(int(logcnt[expert]), 1)
        hashed = (token * GOLDEN) % 2**32
        replica = hashed % count
        if mode == "round_robin":
            replica = token % count
        elif mode == "shares":
            weights = np.asarray(replica_shares[expert, :count], np.float32)
            weights = np.where(np.isfinite(weights) & (weights > 0), weights, np.float32(0))
            weights = np.minimum(weights, np.float32(2.0**100))  # larger weights count as 2**100
            if not np.any(weights > 0):  # no positive weight: equal shares
                weights = np.ones(count, np.float32)
            cumulative = np.cumsum(weights, dtype=np.float32)
            thresholds = np.floor(cumulative / cumulative[-1] * np.float32(2**24))
            replica = int(np.sum(thresholds <= (hashed >> 8)))
        elif mode == "resolved" and token < num_valid:
            quotas = np.maximum(resolved[expert, :count], 0)
            passed = int(np.sum(np.cumsum(quotas) <= consumed[expert]))
            consumed[expert] += 1
            if passed < count:
                replica = passed
        slot = log2phy[expert, min(replica, width - 1)]
        if 0 <= slot < num_physical:
            phys[i] = slot
            if record and token < num_valid:
                load[slot] += 1
    return phys.reshape(num_tokens, top_k), load


@functools.lru_cache(maxsize=None)
def jitted(implementation, mode, num_physical):
    """One jitted function per (implementation, mode, P): shared by every test and example."""

    def run(ids, log2phy, logcnt, num_valid, record, extra):
        return map_and_count(ids, log2phy, logcnt, num_physical=num_physical, num_valid_tokens=num_valid,
                             mode=mode, record=record, implementation=implementation, **extra)

    return jax.jit(run)


def check_against_oracle(implementation, rng, mode, num_tokens, top_k, num_logical, num_physical, record=True):
    placement = random_placement(rng, num_logical, num_physical)
    log2phy, logcnt = placement.log2phy[0], placement.logcnt[0]
    ids = random_ids(rng, num_tokens, top_k, num_logical)
    extra = random_mode_inputs(rng, mode, placement, ids.size)
    num_valid = int(rng.integers(0, num_tokens + 1))
    phys, load = jitted(implementation, mode, num_physical)(ids, log2phy, logcnt, np.int32(num_valid), record, extra)
    assert phys.shape == (num_tokens, top_k) and phys.dtype == jnp.int32
    assert load.shape == (num_physical,) and load.dtype == jnp.int32
    want_phys, want_load = oracle(ids, log2phy, logcnt, num_physical, num_valid, mode, record=record, **extra)
    np.testing.assert_array_equal(np.asarray(phys), want_phys)
    np.testing.assert_array_equal(np.asarray(load), want_load)
    return placement, ids, np.asarray(phys), np.asarray(load), num_valid

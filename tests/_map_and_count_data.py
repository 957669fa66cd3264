"""Shared data and the numpy oracle of the ``map_and_count`` tests (``test_map_and_count*.py``).

The oracle is written entry by entry from the documented semantics, independent of both implementations.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np

from moe_eplb_jax.placement import Placement
from moe_eplb_jax.routing import map_and_count

GOLDEN = 2654435769


def random_placement(rng, num_logical, num_physical):
    """A random valid one-layer placement (every expert placed, extra slots to random experts)."""
    phy2log = np.concatenate([np.arange(num_logical), rng.integers(0, num_logical, num_physical - num_logical)])
    rng.shuffle(phy2log)
    return Placement.from_phy2log(phy2log, num_logical)


def random_mode_inputs(rng, mode, placement, num_flat):
    num_logical, width = placement.log2phy.shape[1:]
    if mode == "lp":
        # Dyadic weights (multiples of 1/4) so float32 sums are exact in every summation order.
        shares = rng.integers(0, 5, (num_logical, width)).astype(np.float32) / 4
        shares[rng.random(num_logical) < 0.1] = 0.0  # some all-zero rows: equal shares
        return {"replica_shares": shares}
    if mode == "quota":
        per_expert = max(1, 2 * num_flat // num_logical)
        return {"quotas": rng.integers(0, per_expert, (num_logical, width)).astype(np.int32)}
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


def share_masses(weights, width):
    """Integer masses of one expert's live weights, summing to ``len(weights) * 2**10``: the documented rule in
    exact rational arithmetic (an independent model of ``_alias.integer_masses``). Each weight times the power of
    two that puts the largest in ``[2**(B-1), 2**B)``, floored; every replica but the last with a positive
    integer weight gets ``floor(c * U * q / Q)``, that one the rest; equal masses for ``Q = 0``."""
    count, unit = len(weights), 1 << 10
    weights = [float(w) if (w > 0 and w < np.inf) else 0.0 for w in np.asarray(weights, np.float32)]
    if max(weights) == 0:
        return [unit] * count
    bits = min(24, 30 - (width - 1).bit_length())
    exponent = math.frexp(max(weights))[1] - 1  # floor(log2(largest))
    quanta = [math.floor(Fraction(w) * Fraction(2) ** (bits - 1 - exponent)) for w in weights]
    assert 2 ** (bits - 1) <= max(quanta) < 2**bits
    total = sum(quanta)
    last = max(j for j in range(count) if quanta[j] > 0)
    masses = [count * unit * q // total if j != last else 0 for j, q in enumerate(quanta)]
    masses[last] = count * unit - sum(masses)
    return masses


def sweep_alias_table(masses, unit):
    """Vose's alias construction run as a sequential sweep (an independent model of ``_alias.alias_words``): light
    replicas in index order, each filled by the current heavy one; a heavy one whose excess runs out closes (keeps
    all of its bucket when exactly none is left, else becomes light and the next heavy one fills it first)."""
    count = len(masses)
    prob, alias = [unit] * count, list(range(count))
    heavy = [j for j in range(count) if masses[j] > unit]
    current, left = 0, (masses[heavy[0]] if heavy else 0)

    def close():
        nonlocal current, left
        while current < len(heavy) and left <= unit:
            closing = heavy[current]
            current += 1
            if left == unit:  # its excess given away exactly: the next light starts with the next heavy
                left = masses[heavy[current]] if current < len(heavy) else 0
                continue
            prob[closing], alias[closing] = left, heavy[current]
            left = masses[heavy[current]] - (unit - left)

    for light in (j for j in range(count) if masses[j] < unit):
        prob[light], alias[light] = masses[light], heavy[current]
        left -= unit - masses[light]
        close()
    return prob, alias


def oracle(ids, log2phy, logcnt, num_physical, num_valid, mode, replica_shares=None, quotas=None, record=True):
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
        elif mode == "lp":
            live = min(count, width)
            masses = share_masses(replica_shares[expert, :live], width)
            prob, alias = sweep_alias_table(masses, 1 << 10)
            scaled = hashed * live // 2**16  # exact in Python ints
            bucket, fraction = scaled >> 16, (scaled & 0xFFFF) >> 6  # 10 bits: U = 2**10 units per bucket
            replica = bucket if fraction < prob[bucket] else alias[bucket]
        elif mode == "quota" and token < num_valid:
            passed = int(np.sum(np.cumsum(np.maximum(quotas[expert, :count], 0)) <= consumed[expert]))
            consumed[expert] += 1
            if passed < count:
                replica = passed
        slot = log2phy[expert, min(replica, width - 1)]
        if 0 <= slot < num_physical:
            phys[i] = slot
            if record and token < num_valid:
                load[slot] += 1
    return phys.reshape(num_tokens, top_k), load


@functools.cache
def jitted(implementation, mode, num_physical):
    """One jitted function per (implementation, mode, P): shared by every test and example."""

    def run(ids, log2phy, logcnt, num_valid, record, extra):
        return map_and_count(
            ids,
            log2phy,
            logcnt,
            num_physical=num_physical,
            num_valid_tokens=num_valid,
            mode=mode,
            record=record,
            implementation=implementation,
            **extra,
        )

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


# ------------------------------------------------------------ the private implementations, on the same inputs
def reference_call(ids, log2phy, logcnt, limits, num_physical, mode, values=None):
    """The XLA implementation (the reference) on prepared inputs: ``limits [2]``, ``values`` the shares / quotas."""
    from moe_eplb_jax.routing._map_and_count import _alias, _tables
    from moe_eplb_jax.routing._map_and_count import reference as _reference

    log2phy, logcnt = jnp.asarray(log2phy, jnp.int32), jnp.asarray(logcnt, jnp.int32)
    if mode == "lp":
        table = _alias.alias_words(jnp.asarray(values, jnp.float32), log2phy, logcnt)
    elif mode == "quota":
        table = _tables.quota_thresholds(jnp.asarray(values, jnp.int32), logcnt, cap=int(np.size(ids)))
    else:
        table = jnp.zeros(log2phy.shape, jnp.int32)
    limits = jnp.asarray(limits, jnp.int32)
    return _reference.map_and_count_reference(
        jnp.asarray(ids, jnp.int32), log2phy, logcnt, table, limits, num_physical=num_physical, mode=mode
    )


def kernel_call(ids, log2phy, logcnt, limits, num_physical, mode, values=None, *, config=None, lookup=None):
    """The Pallas implementation (interpret mode off GPU) on the inputs of :func:`reference_call`."""
    from moe_eplb_jax.routing._map_and_count import _triton

    return _triton.map_and_count_triton(
        jnp.asarray(ids, jnp.int32),
        jnp.asarray(log2phy, jnp.int32),
        jnp.asarray(logcnt, jnp.int32),
        jnp.asarray(limits, jnp.int32),
        num_physical=num_physical,
        mode=mode,
        quotas=values if mode == "quota" else None,
        shares=values if mode == "lp" else None,
        lookup=lookup,
        interpret=jax.default_backend() != "gpu",
        config=config,
    )


def assert_same(got, want, message=""):
    """Physical ids and loads equal, element for element."""
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]), err_msg=message)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]), err_msg=message)

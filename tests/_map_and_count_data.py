"""Shared data, the numpy oracle and the ONE parity body of the ``map_and_count`` tests (``test_map_and_count*.py``).

The oracle is written entry by entry from the documented semantics, independent of every implementation.
:func:`check_parity` runs an implementation (with a Pallas tiling, a prepared lookup) on a :class:`Case` and
compares it with the oracle (small cases) or the reference, after the properties every result has.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from fractions import Fraction

import jax
import numpy as np
from _models import random_placement

from moe_eplb_jax.routing import map_and_count

GOLDEN = 2654435769
ORACLE_ENTRIES = 4096  # the entry-by-entry oracle up to this many entries; the reference above


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


def oracle(
    ids, log2phy, logcnt, num_physical, num_valid, mode, replica_shares=None, quotas=None, record=True, token_offset=0
):
    """Entry-by-entry numpy model of the documented semantics."""
    num_tokens, top_k = ids.shape
    num_logical, width = log2phy.shape
    phys = np.full(ids.size, -1, np.int64)
    load = np.zeros(num_physical, np.int64)
    consumed = np.zeros(num_logical, np.int64)
    alias_tables = {}  # lp: each expert's (prob, alias), built on first use
    for i, expert in enumerate(ids.reshape(-1)):
        token = i // top_k
        if not 0 <= expert < num_logical:
            continue
        count = max(int(logcnt[expert]), 1)
        position = (token_offset + token) % 2**32  # the global position
        hashed = (position * GOLDEN) % 2**32
        replica = hashed * min(count, 2**16 - 1) // 2**32  # the high bits (exact in Python ints)
        if mode == "round_robin":
            replica = position % count
        elif mode == "lp":
            live = min(count, width)
            if expert not in alias_tables:
                alias_tables[expert] = sweep_alias_table(share_masses(replica_shares[expert, :live], width), 1 << 10)
            prob, alias = alias_tables[expert]
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
def jitted(implementation, mode, num_physical, config=None):
    """One jitted function per (implementation, mode, P, tiling): shared by every test and example."""

    def run(ids, log2phy, logcnt, num_valid, record, extra, lookup=None, token_offset=0):
        return map_and_count(
            ids,
            log2phy,
            logcnt,
            num_physical=num_physical,
            num_valid_tokens=num_valid,
            token_offset=token_offset,
            mode=mode,
            record=record,
            implementation=implementation,
            lookup=lookup,
            config=config,
            **extra,
        )

    return jax.jit(run)


@dataclasses.dataclass
class Case:
    """One ``map_and_count`` call's inputs: ids ``[T, k]``, one layer's tables, the mode's table, the flags."""

    ids: np.ndarray
    log2phy: np.ndarray
    logcnt: np.ndarray
    num_physical: int
    mode: str
    extra: dict  # {"replica_shares": ...} / {"quotas": ...} / {}
    num_valid: int
    record: bool = True
    token_offset: int = 0

    @classmethod
    def draw(cls, rng, mode, num_tokens, top_k, num_logical, num_physical, *, num_valid=None, record=True):
        """Fresh random ids (a few invalid), placement, mode table and token offset (near 2**31 at times: the
        positions wrap mod 2**32 past it); ``num_valid`` random where not given."""
        placement = random_placement(rng, num_logical, num_physical)
        ids = random_ids(rng, num_tokens, top_k, num_logical)
        extra = random_mode_inputs(rng, mode, placement, ids.size)
        if num_valid is None:
            num_valid = int(rng.integers(0, num_tokens + 1))
        offset = int(rng.choice([0, rng.integers(0, 2**20), 2**31 - 1 - rng.integers(0, num_tokens + 1)]))
        return cls(ids, placement.log2phy[0], placement.logcnt[0], num_physical, mode, extra, num_valid, record, offset)

    def oracle(self):
        return oracle(
            self.ids,
            self.log2phy,
            self.logcnt,
            self.num_physical,
            self.num_valid,
            self.mode,
            record=self.record,
            token_offset=self.token_offset,
            **self.extra,
        )

    def expected(self):
        """The oracle's ``(phys, load)``; the reference's above ``ORACLE_ENTRIES`` (the oracle is slow)."""
        return self.oracle() if self.ids.size <= ORACLE_ENTRIES else self.run("xla")

    def run(self, implementation, *, config=None, lookup=None):
        """``map_and_count`` of this case, jitted (so tables that only concrete checks refuse still run)."""
        fn = jitted(implementation, self.mode, self.num_physical, config)
        args = (self.ids, self.log2phy, self.logcnt, np.int32(self.num_valid), self.record, self.extra)
        return tuple(np.asarray(a) for a in fn(*args, lookup, np.int32(self.token_offset)))


def check_parity(implementation, case: Case, *, config=None, lookup=None, message=""):
    """THE shared body: ``implementation`` (tiled by ``config``, reading a prepared ``lookup``) on ``case`` gives
    int32 ids and loads of the right shapes, every mapped entry on a slot its expert's row lists (invalid ids on
    ``-1``) and the loads the counted entries' bincount -- and, bit for bit, the oracle's results where the tables
    agree (every valid id then mapped; the reference's above ``ORACLE_ENTRIES``, where the entry-by-entry oracle
    would be slow), the reference's where they do not (the semantics promise no more for such tables).

    Returns ``(phys [T, k], load [P])``.
    """
    phys, load = case.run(implementation, config=config, lookup=lookup)
    num_tokens, top_k = case.ids.shape
    assert phys.shape == (num_tokens, top_k) and phys.dtype == np.int32, message
    assert load.shape == (case.num_physical,) and load.dtype == np.int32, message
    num_logical, width = case.log2phy.shape
    valid = (case.ids >= 0) & (case.ids < num_logical)
    mapped = phys >= 0
    assert not mapped[~valid].any(), message
    slots = [set(row.tolist()) for row in case.log2phy]
    assert all(int(p) in slots[e] for p, e in zip(phys[mapped], case.ids[mapped])), message
    counted = phys[: case.num_valid][mapped[: case.num_valid]] if case.record else np.zeros(0, np.int32)
    np.testing.assert_array_equal(load, np.bincount(counted, minlength=case.num_physical), err_msg=message)
    live = np.arange(width)[None, :] < case.logcnt[:, None]
    agree = np.all((case.logcnt >= 1) & (case.logcnt <= width)) and np.all(
        (case.log2phy[live] >= 0) & (case.log2phy[live] < case.num_physical)
    )
    if agree:
        assert mapped[valid].all(), message
    if implementation == "xla" and (not agree or case.ids.size > ORACLE_ENTRIES):  # the reference itself
        return phys, load
    want = case.expected() if agree else case.run("xla")
    np.testing.assert_array_equal(phys, want[0], err_msg=message)
    np.testing.assert_array_equal(load, want[1], err_msg=message)
    return phys, load

"""Tests of ``moe_eplb_jax.routing.map_and_count`` (``routing._map_and_count.api``).

One shared parity body (``check_parity``, ``_map_and_count_data.py``) checks every implementation of
``IMPLEMENTATIONS`` ("xla"; "pallas" in interpret mode on CPU, compiled on GPU) against an independent numpy
oracle written entry by entry from the documented semantics (the reference above 4096 entries), after the
properties every result has. Large inputs run on the xla path only on CPU (interpret mode is slow), on both on a
GPU. The kernels' own tilings and parts: ``test_map_and_count_kernel.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _map_and_count_data import (
    GOLDEN,
    Case,
    check_parity,
    jitted,
    layered_inputs,
    oracle,
    random_ids,
    random_mode_inputs,
    share_masses,
    sweep_alias_table,
)
from _models import random_placement
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_eplb_jax.placement import Placement
from moe_eplb_jax.routing import ROUTING_MODES, routing_mode
from moe_eplb_jax.routing._map_and_count import IMPLEMENTATIONS, Config, _alias, _tables, lookup_table, map_and_count

MODES = ROUTING_MODES


@pytest.fixture(params=IMPLEMENTATIONS)
def implementation(request):
    """Every implementation of ``map_and_count``, each through the same test body."""
    return request.param


def _gpu(value):
    return pytest.param(value, marks=pytest.mark.gpu)


# ------------------------------------------------ every implementation, vs the oracle
SHAPES = [  # (T, k, E, P): tiny, odd sizes, S = 8 with E = 512, a multi-tile case; on a GPU the sizes of use
    (1, 1, 4, 4),
    (37, 2, 16, 23),
    (129, 6, 512, 519),
    (700, 8, 64, 72),
    _gpu((4096, 8, 256, 288)),
    _gpu((65536, 8, 256, 512)),
    _gpu((262144, 8, 256, 288)),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}k{}E{}P{}".format(*s))
def test_matches_oracle(implementation, mode, shape, rng):
    check_parity(implementation, Case.draw(rng, mode, *shape))


def test_record_false_counts_nothing(implementation, rng):
    phys, load = check_parity(implementation, Case.draw(rng, "hash", 37, 2, 16, 23, record=False))
    assert not load.any() and (phys >= 0).any()


def test_modes_are_the_registry(rng):
    """``map_and_count`` takes every registered routing mode by name or as its ``RoutingMode`` (the same call), and
    only the table its kernel rule reads."""
    case = Case.draw(rng, "round_robin", 37, 2, 16, 23)
    call = functools.partial(map_and_count, case.ids, case.log2phy, case.logcnt, num_physical=23, implementation="xla")
    for a, b in zip(call(mode="round_robin"), call(mode=routing_mode("round_robin"))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert [routing_mode(mode).table for mode in MODES] == [None, None, "replica_shares", "quotas"]


@pytest.mark.slow  # hypothesis examples, each compiles anew
@settings(max_examples=12)
@given(
    num_tokens=st.integers(1, 3000),
    top_k=st.sampled_from([1, 2, 6, 8]),
    num_logical=st.sampled_from([1, 8, 60, 512]),
    extra_slots=st.integers(0, 7),
    mode=st.sampled_from(MODES),
    seed=st.integers(0, 2**31),
)
def test_xla_matches_oracle_property(num_tokens, top_k, num_logical, extra_slots, mode, seed):
    rng = np.random.default_rng(seed)
    check_parity("xla", Case.draw(rng, mode, num_tokens, top_k, num_logical, num_logical + extra_slots))


# --------------------------------------------------- large-T properties (the reference)
@pytest.mark.parametrize("mode", MODES)
def test_large_t_properties(mode, rng):
    """65536 x 8 entries through the reference: the properties every result has (no oracle at this size)."""
    case = Case.draw(rng, mode, 65536, 8, 256, 288, num_valid=65536 - 1000)
    phys, _ = check_parity("xla", case)
    owner = np.full(case.num_physical, -1)  # the expert each slot holds
    live = np.arange(case.log2phy.shape[1])[None, :] < case.logcnt[:, None]
    owner[case.log2phy[live]] = np.nonzero(live)[0]
    mapped = phys >= 0
    np.testing.assert_array_equal(owner[phys[mapped]], case.ids[mapped])  # a replica of its own expert


def test_hash_is_uniform_over_replicas(rng):
    num_tokens, num_logical, num_physical = 65536, 8, 8 + 21
    placement = Placement.from_phy2log(
        np.concatenate([np.arange(num_logical), np.repeat(np.arange(1, 7), np.arange(1, 7))]), num_logical
    )
    assert placement.num_physical == num_physical
    for expert in range(1, 7):  # 2..7 replicas
        ids = np.full((num_tokens, 1), expert, np.int32)
        _, load = jitted("xla", "hash", num_physical)(
            ids, placement.log2phy[0], placement.logcnt[0], np.int32(num_tokens), True, {}
        )
        replicas = placement.log2phy[0, expert, : placement.logcnt[0, expert]]
        per_replica = np.asarray(load)[replicas]
        assert per_replica.sum() == num_tokens
        np.testing.assert_allclose(per_replica, num_tokens / len(replicas), rtol=0.02)


def test_lp_follows_shares_within_two_percent(rng):
    num_tokens, num_logical = 65536, 4
    placement = Placement.from_phy2log(np.array([0, 1, 2, 3, 0, 0, 0, 1, 1]), num_logical)
    width = placement.max_replicas
    shares = rng.uniform(0.1, 1.0, (num_logical, width)).astype(np.float32)
    shares[1, 1] = 0.0  # a zero-share replica is never chosen
    ids = rng.integers(0, 2, (num_tokens, 1)).astype(np.int32)
    _, load = jitted("xla", "lp", 9)(
        ids, placement.log2phy[0], placement.logcnt[0], np.int32(num_tokens), True, {"replica_shares": shares}
    )
    load = np.asarray(load)
    for expert in (0, 1):
        count = placement.logcnt[0, expert]
        replicas = placement.log2phy[0, expert, :count]
        want = shares[expert, :count] / shares[expert, :count].sum() * np.sum(ids == expert)
        np.testing.assert_allclose(load[replicas], want, rtol=0.02, atol=0.5)
    assert load[placement.log2phy[0, 1, 1]] == 0


@pytest.mark.slow
def test_lp_zero_and_huge_rows(implementation, rng):
    """A row without a positive weight is split equally; weights near float32 max do not overflow the sums."""
    num_tokens = 65536
    placement = Placement.from_phy2log(np.array([0, 1, 0, 0, 1, 1]), 2)
    shares = np.zeros((2, placement.max_replicas), np.float32)
    shares[0, :3] = [np.nan, -1.0, 0.0]  # nothing positive: equal shares
    shares[1, :3] = [3e38, 1.5e38, np.inf]  # counts as [3e38, 1.5e38, 0]: no overflow
    ids = rng.integers(0, 2, (num_tokens, 1)).astype(np.int32)
    case = Case(ids, placement.log2phy[0], placement.logcnt[0], 6, "lp", {"replica_shares": shares}, num_tokens)
    phys, load = check_parity(implementation, case)
    for expert, fractions in ((0, [1 / 3, 1 / 3, 1 / 3]), (1, [2 / 3, 1 / 3, 0])):
        replicas = placement.log2phy[0, expert, :3]
        np.testing.assert_allclose(load[replicas], np.multiply(fractions, np.sum(ids == expert)), rtol=0.03, atol=0)
    np.testing.assert_array_equal(phys, case.oracle()[0])  # (past the oracle's size in check_parity)


def test_quota_matches_quotas_exactly(implementation, rng):
    num_logical, num_physical, top_k = 16, 28, 2
    placement = random_placement(rng, num_logical, num_physical)
    logcnt = placement.logcnt[0]
    width = placement.max_replicas
    quotas = rng.integers(0, 40, (num_logical, width)) * (np.arange(width)[None, :] < logcnt[:, None])
    quotas[:, 0] += 1  # demand >= 1 per expert
    ids = np.repeat(np.arange(num_logical), quotas.sum(1))
    rng.shuffle(ids)
    num_tokens = ids.size // top_k
    ids = ids[: num_tokens * top_k]  # an odd total drops one entry: demand may fall one short of supply
    demand = np.bincount(ids, minlength=num_logical)
    ids = ids.reshape(num_tokens, top_k).astype(np.int32)
    case = Case(
        ids, placement.log2phy[0], logcnt, num_physical, "quota", {"quotas": quotas.astype(np.int32)}, num_tokens
    )
    _, load = check_parity(implementation, case)
    for expert in range(num_logical):
        replicas = placement.log2phy[0, expert, : logcnt[expert]]
        got = load[replicas]
        # Quotas are consumed in order, so every replica but the expert's last non-empty one is exactly full.
        cumulative = np.minimum(np.cumsum(quotas[expert, : logcnt[expert]]), demand[expert])
        np.testing.assert_array_equal(got, np.diff(np.concatenate([[0], cumulative])))


def test_quota_overflow_falls_back_to_hash(rng):
    placement = Placement.from_phy2log(np.array([0, 1, 0, 0]), 2)
    quotas = np.array([[3, 0, 2], [0, 0, 0]], np.int32)  # replica 1 of expert 0 has quota 0
    ids = np.zeros((20, 1), np.int32)
    phys, load = jitted("xla", "quota", 4)(
        ids, placement.log2phy[0], placement.logcnt[0], np.int32(20), True, {"quotas": quotas}
    )
    phys = np.asarray(phys)[:, 0]
    replicas = placement.log2phy[0, 0]
    np.testing.assert_array_equal(phys[:5], replicas[[0, 0, 0, 2, 2]])
    hashed = (np.arange(5, 20) * GOLDEN % 2**32) * 3 // 2**32  # the hash's high bits
    np.testing.assert_array_equal(phys[5:], replicas[hashed])


# ------------------------------------------- tracing, vmap, shard_map, EplbState
def test_traced_flags_do_not_recompile(rng):
    placement = random_placement(rng, 8, 12)
    traces = []

    @jax.jit
    def run(ids, num_valid, record):
        traces.append(1)
        return map_and_count(
            ids,
            placement.log2phy[0],
            placement.logcnt[0],
            num_physical=12,
            num_valid_tokens=num_valid,
            record=record,
            implementation="xla",
        )

    ids = random_ids(rng, 50, 2, 8, invalid_fraction=0.0)
    totals = [
        int(run(ids, jnp.int32(nv), jnp.bool_(rec))[1].sum()) for nv, rec in [(50, True), (10, True), (10, False)]
    ]
    assert totals == [100, 20, 0] and len(traces) == 1


@pytest.mark.parametrize("shape", [(40, 2, 8, 12), _gpu((4096, 8, 256, 288))], ids=lambda s: "T{}k{}E{}P{}".format(*s))
def test_vmap_over_layers_with_a_traced_record_flag(implementation, shape, rng):
    """vmapped over three layers, ``record`` traced: every layer's ids and loads are the oracle's, recorded or not."""
    num_layers, (num_tokens, _, _, num_physical) = 3, shape
    _, log2phy, logcnt, ids = layered_inputs(rng, num_layers, *shape)
    num_valid = num_tokens * 3 // 4
    call = functools.partial(
        map_and_count, num_physical=num_physical, num_valid_tokens=num_valid, implementation=implementation
    )
    fn = jax.jit(
        jax.vmap(lambda ids, log2phy, logcnt, record: call(ids, log2phy, logcnt, record=record), (0, 0, 0, None))
    )
    for record in (True, False):
        phys, load = fn(ids, log2phy, logcnt, jnp.bool_(record))
        for layer in range(num_layers):
            case = Case(ids[layer], log2phy[layer], logcnt[layer], num_physical, "hash", {}, num_valid, record)
            want_phys, want_load = case.expected()
            np.testing.assert_array_equal(np.asarray(phys[layer]), want_phys)
            np.testing.assert_array_equal(np.asarray(load[layer]), want_load)
        assert np.asarray(load).any() == record


@pytest.mark.parametrize("shape", [(24, 2, 16, 24), _gpu((4096, 8, 256, 288))], ids=lambda s: "T{}k{}E{}P{}".format(*s))
def test_shard_map_psum_equals_global(implementation, shape, rng, mesh):
    """Inside ``shard_map`` over every device (``shape``: per rank), each rank's tokens at their global positions
    (``token_offset``): each shard maps as its own call with that offset, and the psum'd load is their sum."""
    num_local, top_k, num_logical, num_physical = shape
    num_ranks = mesh.shape["ep"]
    placement = random_placement(rng, num_logical, num_physical)
    ids = random_ids(rng, num_local * num_ranks, top_k, num_logical)
    num_valid = num_local * 5 // 6
    P = jax.sharding.PartitionSpec

    def local(ids_shard, log2phy, logcnt):
        phys, load = map_and_count(
            ids_shard,
            log2phy,
            logcnt,
            num_physical=num_physical,
            num_valid_tokens=num_valid,
            token_offset=jax.lax.axis_index("ep") * num_local,
            implementation=implementation,
        )
        return phys, jax.lax.psum(load, "ep")

    # Pallas interpret mode trips jax's own varying-axes check inside shard_map (its interpreter
    # slices a varying operand with an invariant index), so interpret runs with check_vma=False;
    # the compiled kernel runs with check_vma=True.
    check_vma = implementation == "xla" or jax.default_backend() == "gpu"
    fn = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P("ep"), P(), P()), out_specs=(P("ep"), P()), check_vma=check_vma)
    )
    phys, load = fn(ids, placement.log2phy[0], placement.logcnt[0])
    want_load = np.zeros(num_physical, np.int64)
    for rank in range(num_ranks):
        shard = ids[rank * num_local : (rank + 1) * num_local]
        case = Case(
            shard,
            placement.log2phy[0],
            placement.logcnt[0],
            num_physical,
            "hash",
            {},
            num_valid,
            True,
            rank * num_local,
        )
        want_phys, shard_load = case.expected()
        np.testing.assert_array_equal(np.asarray(phys[rank * num_local : (rank + 1) * num_local]), want_phys)
        want_load += shard_load
    np.testing.assert_array_equal(np.asarray(load), want_load)


def test_feeds_eplb_state_record(rng):
    state_mod = pytest.importorskip("moe_eplb_jax.state")
    num_layers, num_logical, num_physical = 2, 8, 12
    config = state_mod.EplbConfig()
    state = state_mod.init_state(config, num_layers, num_physical)
    placements = [random_placement(rng, num_logical, num_physical) for _ in range(num_layers)]
    log2phy = np.stack([p.log2phy[0] for p in placements])
    logcnt = np.stack([p.logcnt[0] for p in placements])
    ids = np.stack([random_ids(rng, 30, 2, num_logical) for _ in range(num_layers)])
    _, load = jax.vmap(functools.partial(map_and_count, num_physical=num_physical))(ids, log2phy, logcnt)
    state = state_mod.record(state_mod.record(state, load), load)
    np.testing.assert_array_equal(np.asarray(state.pass_load), 2 * np.asarray(load))


# ---------------------------------------------------------------- validation
def _small_tables(rng):
    placement = random_placement(rng, 8, 12)
    return random_ids(rng, 10, 2, 8), placement.log2phy[0], placement.logcnt[0]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(topk_ids=a["topk_ids"][:, 0]), "topk_ids must have 2 dimensions"),
        (lambda a: a.update(topk_ids=a["topk_ids"].astype(np.float32)), "topk_ids must have an integer dtype"),
        (lambda a: a.update(logcnt=a["logcnt"][:-1]), "logcnt must have shape"),
        (lambda a: a.update(log2phy=a["log2phy"][None]), "log2phy must have 2 dimensions"),
        (lambda a: a.update(num_physical=7), "num_physical"),
        (lambda a: a.update(num_physical=12.0), "num_physical must be a Python int"),
        (lambda a: a.update(mode="random"), "mode must be one of"),
        (lambda a: a.update(mode="shares"), "mode must be one of"),
        (lambda a: a.update(mode="resolved"), "mode must be one of"),
        (lambda a: a.update(mode="lp"), "needs replica_shares"),
        (lambda a: a.update(mode="quota"), "needs quotas"),
        (lambda a: a.update(replica_shares=np.ones((8, 5), np.float32)), "only used with mode='lp'"),
        (lambda a: a.update(quotas=np.ones((8, 5), np.int32)), "only used with mode='quota'"),
        (lambda a: a.update(mode="lp", replica_shares=np.ones((8, 4), np.float32)), "replica_shares must have shape"),
        (lambda a: a.update(mode="lp", replica_shares=np.ones((8, 5), np.int32)), "floating dtype"),
        (lambda a: a.update(mode="quota", quotas=np.ones((8, 5), np.float32)), "quotas must have an integer"),
        (lambda a: a.update(num_physical=True), "num_physical must be a Python int"),
        (lambda a: a.update(num_valid_tokens=11), "num_valid_tokens must be in"),
        (lambda a: a.update(num_valid_tokens=np.ones(2, np.int32)), "num_valid_tokens must be an integer scalar"),
        (lambda a: a.update(record=1), "record must be a boolean"),
        (lambda a: a.update(implementation="cuda"), "implementation must be one of"),
        (lambda a: a.update(lookup=np.zeros(47, np.int32)), "lookup must be lookup_table"),
        (lambda a: a.update(lookup=np.zeros(48, np.int64)), "lookup must be lookup_table"),
        (lambda a: a.update(config={"tile": 64}), "config must be a map_and_count Config"),
    ],
)
def test_validation_errors(change, message, rng):
    ids, log2phy, logcnt = _small_tables(rng)
    kwargs = dict(topk_ids=ids, log2phy=log2phy, logcnt=logcnt, num_physical=12)
    change(kwargs)
    with pytest.raises(ValueError, match=message):
        map_and_count(**kwargs)


# ------------------------------------------- values: integers past int32, tables that disagree
@pytest.mark.parametrize("dtype", [np.int64, np.uint64, np.uint32])
def test_ids_past_int32_are_refused_not_wrapped(dtype, rng):
    """Concrete 64-bit (or unsigned 32-bit) ids that int32 cannot hold raise instead of wrapping onto another
    expert (``2**32 + 3`` would be expert 3); ids that fit, in any integer dtype, route as int32 ones."""
    ids, log2phy, logcnt = _small_tables(rng)
    ids = np.where(ids < 0, 9, ids)  # invalid ids that unsigned dtypes hold too
    want = map_and_count(ids, log2phy, logcnt, num_physical=12)
    got = map_and_count(ids.astype(dtype), log2phy.astype(np.int64), logcnt.astype(dtype), num_physical=12)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    wrapped = ids.astype(dtype)
    wrapped[0, 0] = dtype(2**32 + 3) if np.dtype(dtype).itemsize == 8 else dtype(2**31)
    for implementation in ("xla", "pallas"):
        with pytest.raises(ValueError, match="outside int32"):
            map_and_count(wrapped, log2phy, logcnt, num_physical=12, implementation=implementation)


def test_wide_integers_under_jit_saturate(rng):
    """Under jit (64-bit ints enabled) values cannot be checked: an id or slot past int32 saturates, so it stays out
    of range and maps to -1 -- never onto the expert or slot its low 32 bits name -- and a huge quota is spent like
    any quota past the entry count."""
    ids, log2phy, logcnt = _small_tables(rng)
    quotas = np.zeros((8, log2phy.shape[1]), np.int64)
    quotas[:, 0] = 2**40  # every entry to replica 0
    with jax.enable_x64(True):
        wide = ids.astype(np.int64)
        wide[0, 0], wide[1, 0] = 2**32 + 3, -(2**32) + 3  # low 32 bits: expert 3
        table = log2phy.astype(np.int64)
        table[3, 0] = 2**32 + int(log2phy[4, 0])  # expert 3's first replica: low 32 bits name expert 4's slot
        for mode, extra in (("hash", {}), ("quota", {"quotas": quotas})):
            fn = jax.jit(functools.partial(map_and_count, num_physical=12, mode=mode, implementation="xla", **extra))
            phys = np.asarray(fn(wide, table, logcnt.astype(np.int64))[0])
            assert phys[0, 0] == phys[1, 0] == -1
            assert set(phys[wide == 3].tolist()) <= {-1, *log2phy[3, 1 : logcnt[3]].tolist()}
            if mode == "quota":
                np.testing.assert_array_equal(phys[wide == 3], -1)
                np.testing.assert_array_equal(phys[wide == 4], log2phy[4, 0])


CONTRADICTIONS = [  # (edit of log2phy [8, 5] / logcnt [8] of a 12-slot placement, message)
    (lambda t, c: c.__setitem__(0, 6), "logcnt\\[0\\] = 6 is outside \\[0, S = 5\\]"),
    (lambda t, c: c.__setitem__(1, -1), "logcnt\\[1\\] = -1 is outside"),
    (lambda t, c: t.__setitem__((2, 0), 12), "log2phy\\[2, 0\\] = 12 is not a slot in \\[0, 12\\)"),
    (lambda t, c: t.__setitem__((2, 0), -1), "log2phy\\[2, 0\\] = -1 is not a slot"),
    (lambda t, c: (c.__setitem__(4, 0),), "log2phy\\[4, 0\\] = .* past logcnt\\[4\\] = 0 must be -1"),
    (lambda t, c: t.__setitem__((5, 4), 3), "log2phy\\[5, 4\\] = 3 past logcnt\\[5\\] = .* must be -1"),
    (lambda t, c: t.__setitem__((6, 0), t[7, 0]), "is listed more than once in log2phy \\(experts \\[6, 7\\]\\)"),
]


def _placement_with_spare(rng):
    """An 8-expert, 12-slot placement whose expert 5 has fewer than S = 5 replicas (its last column is padding)."""
    placement = Placement.from_phy2log(np.array([0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 1, 2]), 8)
    return random_ids(rng, 10, 2, 8), placement.log2phy[0].copy(), placement.logcnt[0].copy()


@pytest.mark.parametrize("edit, message", CONTRADICTIONS)
def test_tables_that_disagree_are_refused(edit, message, rng):
    """Concrete ``logcnt`` / ``log2phy`` that contradict each other -- a count past the listed slots or negative, a
    live replica outside ``[0, P)``, a listed slot past the count, a slot held twice -- raise ``ValueError`` in both
    implementations and in ``lookup_table``, before anything runs; under jit the same tables are assumed right
    (no error, the documented behaviour)."""
    ids, log2phy, logcnt = _placement_with_spare(rng)
    edit(log2phy, logcnt)
    for implementation in ("xla", "pallas"):
        with pytest.raises(ValueError, match=message):
            map_and_count(ids, log2phy, logcnt, num_physical=12, implementation=implementation)
    if "not a slot in" not in message:  # (lookup_table knows P only with shares)
        with pytest.raises(ValueError, match=message):
            lookup_table(log2phy, logcnt)
    with pytest.raises(ValueError, match=message):
        lookup_table(log2phy, logcnt, replica_shares=np.ones(log2phy.shape, np.float32), num_physical=12)
    traced = jax.jit(functools.partial(map_and_count, num_physical=12, implementation="xla"))(ids, log2phy, logcnt)
    assert traced[1].shape == (12,)


# ------------------------------------------- prepared lookups; vmap and shard_map of every kernel
@pytest.mark.slow  # the Pallas kernel in interpret mode
@pytest.mark.parametrize("mode", MODES)
def test_prepared_lookup_gives_the_same_results(mode, rng):
    """A lookup table built once per placement (vmapped over layers, as a model keeps it) changes nothing, with
    or without the alias words in it (which every mode accepts; lp then reads them)."""
    num_layers, num_tokens, top_k, num_logical, num_physical = 2, 48, 4, 16, 30
    placements, log2phy, logcnt, ids = layered_inputs(rng, num_layers, num_tokens, top_k, num_logical, num_physical)
    extra = [random_mode_inputs(rng, mode, p, num_tokens * top_k) for p in placements]
    extra = {k: np.stack([e[k] for e in extra]) for k in extra[0]}
    width = log2phy.shape[2]
    weights = extra["replica_shares"] if mode == "lp" else rng.random(log2phy.shape).astype(np.float32)
    lookups = [jax.vmap(lookup_table)(log2phy, logcnt), jax.vmap(lookup_table)(log2phy, logcnt, replica_shares=weights)]
    assert lookups[0].shape == (num_layers, num_logical * (1 + width)) and lookups[0].dtype == jnp.int32
    assert lookups[1].shape == (num_layers, 3 * num_logical * (1 + width)) and lookups[1].dtype == jnp.int32
    np.testing.assert_array_equal(lookups[1][:, : num_logical * (1 + width)], lookups[0])

    def run(ids, log2phy, logcnt, extra, lookup=None):
        return map_and_count(
            ids,
            log2phy,
            logcnt,
            num_physical=num_physical,
            num_valid_tokens=40,
            mode=mode,
            implementation="pallas",
            lookup=lookup,
            **extra,
        )

    for lookup in lookups:
        got = jax.jit(jax.vmap(run))(ids, log2phy, logcnt, extra, lookup)
        for layer in range(num_layers):
            want = oracle(
                ids[layer],
                log2phy[layer],
                logcnt[layer],
                num_physical,
                40,
                mode,
                **{k: v[layer] for k, v in extra.items()},
            )
            for g, w in zip(got, want):
                np.testing.assert_array_equal(np.asarray(g[layer]), w)


@pytest.mark.slow  # every kernel path in interpret mode
@pytest.mark.parametrize(
    "mode, path", [("lp", "ranks"), ("quota", "lookback"), ("quota", "ranks"), ("quota", "positions")]
)
def test_every_kernel_under_vmap_and_shard_map(mode, path, rng, mesh):
    """The alias-table kernel and each quota path (forced by a Config for these small inputs), under vmap over layers
    with prepared lookups, and inside shard_map with per-rank quotas or shares, equal the oracle: their extra
    kernels batch and shard like the map kernel."""
    config = Config(quota_path=path, rank_tile=64, tile=64, sub=32, position_tile=32)
    num_layers, num_tokens, top_k, num_logical, num_physical = 2, 48, 4, 16, 30
    placements, log2phy, logcnt, ids = layered_inputs(rng, num_layers, num_tokens, top_k, num_logical, num_physical)
    extra = [random_mode_inputs(rng, mode, p, num_tokens * top_k) for p in placements]
    values = np.stack([next(iter(e.values())) for e in extra])
    name = routing_mode(mode).table
    call = functools.partial(
        map_and_count, num_physical=num_physical, mode=mode, implementation="pallas", config=config
    )

    def run(ids, log2phy, logcnt, values, lookup):
        return call(ids, log2phy, logcnt, num_valid_tokens=40, lookup=lookup, **{name: values})

    got = jax.jit(jax.vmap(run))(ids, log2phy, logcnt, values, jax.vmap(lookup_table)(log2phy, logcnt))
    for layer in range(num_layers):
        want = oracle(ids[layer], log2phy[layer], logcnt[layer], num_physical, 40, mode, **{name: values[layer]})
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g[layer]), w)

    num_ranks = mesh.shape["ep"]
    P = jax.sharding.PartitionSpec
    num_local = 12
    ids = random_ids(rng, num_local * num_ranks, top_k, num_logical)
    per_rank = np.stack(
        [next(iter(random_mode_inputs(rng, mode, placements[0], num_local * top_k).values())) for _ in range(num_ranks)]
    )

    def local(ids_shard, values, log2phy, logcnt):
        phys, load = call(ids_shard, log2phy, logcnt, **{name: values[0]})
        return phys, jax.lax.psum(load, "ep")

    # Pallas interpret mode trips jax's own varying-axes check inside shard_map (its interpreter slices a varying
    # operand with an invariant index), so interpret runs with check_vma=False; compiled kernels with True.
    check_vma = jax.default_backend() == "gpu"
    specs = dict(in_specs=(P("ep"), P("ep"), P(), P()), out_specs=(P("ep"), P()), check_vma=check_vma)
    phys, load = jax.jit(jax.shard_map(local, mesh=mesh, **specs))(ids, per_rank, log2phy[0], logcnt[0])
    want_load = np.zeros(num_physical, np.int64)
    for rank in range(num_ranks):
        shard = ids[rank * num_local : (rank + 1) * num_local]
        want_phys, shard_load = oracle(
            shard, log2phy[0], logcnt[0], num_physical, num_local, mode, **{name: per_rank[rank]}
        )
        np.testing.assert_array_equal(np.asarray(phys[rank * num_local : (rank + 1) * num_local]), want_phys)
        want_load += shard_load
    np.testing.assert_array_equal(np.asarray(load), want_load)


def test_lookup_table_rejects_bad_tables(rng):
    _, log2phy, logcnt = _small_tables(rng)
    with pytest.raises(ValueError, match="logcnt must have shape"):
        lookup_table(log2phy, logcnt[:-1])
    with pytest.raises(ValueError, match="log2phy must have an integer dtype"):
        lookup_table(log2phy.astype(np.float32), logcnt)
    with pytest.raises(ValueError, match="replica_shares must have shape"):
        lookup_table(log2phy, logcnt, replica_shares=np.ones((log2phy.shape[0], 2), np.float32))
    with pytest.raises(ValueError, match="replica_shares must have a floating dtype"):
        lookup_table(log2phy, logcnt, replica_shares=np.ones(log2phy.shape, np.int32))
    with pytest.raises(ValueError, match="num_physical is only used with replica_shares"):
        lookup_table(log2phy, logcnt, num_physical=2000)
    with pytest.raises(ValueError, match="num_physical .* must be at least the number of logical experts"):
        lookup_table(log2phy, logcnt, replica_shares=np.ones(log2phy.shape, np.float32), num_physical=1)


def test_empty_input(rng):
    _, log2phy, logcnt = _small_tables(rng)
    phys, load = map_and_count(np.zeros((0, 4), np.int32), log2phy, logcnt, num_physical=12, implementation="pallas")
    assert phys.shape == (0, 4) and load.shape == (12,) and not np.asarray(load).any()


# ------------------------------------------- the default: Pallas on a GPU, XLA where its kernels cannot run
@pytest.fixture
def probes(monkeypatch):
    """A fresh record of probes and warnings, and ``map_and_count`` deciding as on a GPU."""
    from moe_eplb_jax import _kernels

    monkeypatch.setattr(_kernels, "_PROBED", {})
    monkeypatch.setattr(_kernels, "_WARNED", set())
    monkeypatch.setattr(_kernels, "on_gpu", lambda: True)
    return _kernels


def _default_calls(rng):
    """The default implementation in every mode inside jit (and eager for hash): each result against the oracle."""
    placement = random_placement(rng, 16, 23)
    log2phy, logcnt = placement.log2phy[0], placement.logcnt[0]
    ids = random_ids(rng, 37, 2, 16)
    for mode in MODES:
        extra = random_mode_inputs(rng, mode, placement, ids.size)
        want = oracle(ids, log2phy, logcnt, 23, 30, mode, **extra)
        fn = functools.partial(map_and_count, num_physical=23, num_valid_tokens=30, mode=mode, **extra)
        calls = [jax.jit(fn)] + ([fn] if mode == "hash" else [])
        for got in (call(ids, log2phy, logcnt) for call in calls):
            for g, w in zip(got, want):
                np.testing.assert_array_equal(np.asarray(g), w)


@pytest.mark.slow
def test_default_is_pallas_where_its_probe_agrees(probes, rng, recwarn):
    """As on a GPU: each mode's kernels are probed once (here in interpret mode, where they run and agree), then
    serve as the default -- no warning."""
    _default_calls(rng)
    assert {("map_and_count", mode): True for mode in MODES} == probes._PROBED
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


@pytest.mark.slow  # probes every kernel
def test_default_falls_back_to_xla_without_the_triton_backend(probes, monkeypatch, rng):
    """Pallas' Triton backend missing (its import fails): every mode falls back to the XLA implementation -- the
    oracle's results, eager and inside jit -- with exactly one warning in the process."""
    import sys

    from jax.experimental import pallas

    import moe_eplb_jax.routing._map_and_count as package

    monkeypatch.setitem(sys.modules, "jax.experimental.pallas.triton", None)  # `import` raises ImportError
    monkeypatch.delattr(pallas, "triton", raising=False)
    for name in ("_triton", "_alias_kernel", "_rank", "_positions", "_search", "_triton_ops"):  # re-imported on use
        monkeypatch.delitem(sys.modules, f"moe_eplb_jax.routing._map_and_count.{name}", raising=False)
        monkeypatch.delattr(package, name, raising=False)
    with pytest.warns(RuntimeWarning, match="map_and_count: the Pallas kernel failed .*ModuleNotFoundError") as caught:
        _default_calls(rng)
        _default_calls(rng)
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    assert {("map_and_count", mode): False for mode in MODES} == probes._PROBED


@pytest.mark.slow  # probes every kernel
def test_default_falls_back_to_xla_when_a_kernel_fails_to_lower(probes, monkeypatch, rng):
    """A kernel that fails to lower (here: the map kernel's wrapper raises as a broken lowering rule would) or that
    disagrees with the reference: the XLA implementation serves, with one warning."""
    from moe_eplb_jax.routing._map_and_count import _triton

    def broken(*args, **kwargs):
        raise AttributeError("'tuple' object has no attribute 'type'")

    monkeypatch.setattr(_triton, "map_and_count_triton", broken)
    with pytest.warns(RuntimeWarning, match="failed on this device \\(AttributeError") as caught:
        _default_calls(rng)
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    probes._PROBED.clear()
    probes._WARNED.clear()
    monkeypatch.setattr(_triton, "map_and_count_triton", lambda *a, **k: (np.zeros((64, 4), np.int32), np.zeros(24)))
    with pytest.warns(RuntimeWarning, match="disagrees with its XLA implementation"):
        _default_calls(rng)


# ------------------------------------------------------------------ GPU only
@pytest.mark.gpu
def test_gpu_default_is_pallas():
    """On a GPU each mode's first-use probe passes: the default is the Pallas implementation, without a warning."""
    from moe_eplb_jax import _kernels
    from moe_eplb_jax.routing._map_and_count.api import _probe_pallas

    for mode in MODES:
        assert _probe_pallas(mode)
        assert _kernels.pallas_default("map_and_count", functools.partial(_probe_pallas, mode), case=mode)


# ------------------------------------------------------------ mode tables
@pytest.mark.parametrize("width", [1, 5, 33, 257, pytest.param(4100, marks=pytest.mark.slow)])
@pytest.mark.parametrize("limit", [2**31 - 1, 2**21, 2**26, 100, 2**24 - 1, 3 * 2**23])
def test_quota_thresholds_are_exact(width, limit, rng):
    """Quota thresholds are the capped int64 prefix sums exactly, whichever way the shape makes them run (the
    triangular product on the quotas themselves below a cap of 2**24, else on two or three limbs; the saturating
    scan past 4096 replicas or where limbs' sums could pass int32)."""
    num_logical = 40 if width < 4096 else 3
    logcnt = rng.integers(0, width + 1, num_logical)
    live = np.arange(width)[None, :] < logcnt[:, None]
    # All three 11-bit limbs; below a cap, mostly unclipped (odd sums near 2**24 would round in float32).
    high = min(30_000_000, limit + limit // 4)
    quotas = rng.integers(-5, high, (num_logical, width)).astype(np.int32)
    sums = np.cumsum(np.clip(np.where(live, quotas, 0), 0, limit).astype(np.int64), axis=1)
    want = np.where(live, np.minimum(sums, limit), np.iinfo(np.int32).max)
    got = _tables.quota_thresholds(jnp.asarray(quotas), jnp.asarray(logcnt), cap=limit)
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("draw", ["spread", "ties", "tiny"])
@pytest.mark.parametrize("width", [1, 5, *(pytest.param(w, marks=pytest.mark.slow) for w in (33, 257, 300))])
def test_alias_table_is_the_sequential_sweep(width, draw, rng):
    """lp's alias table -- jnp, and the Pallas kernel in interpret mode -- is Vose's sequential sweep over the
    documented masses (modelled in exact rational arithmetic), each replica's parts add up to its mass (none for a
    zero weight) and the words name the alias's slot: weights spanning 60 orders of magnitude, a few small
    integers (masses that tie running sums exactly) or subnormal ones, zeros, NaN, infinities and negatives, rows
    without a positive weight, counts past the table's width."""
    from moe_eplb_jax.routing._map_and_count._alias_kernel import alias_kernel

    num_logical = 24
    logcnt = rng.integers(0, width + 3, num_logical)
    if draw == "spread":
        shares = (10.0 ** rng.uniform(-30, 30, (num_logical, width))).astype(np.float32)
    elif draw == "ties":
        shares = rng.choice(np.asarray([1.0, 2.0, 3.0, 4.0, 6.0], np.float32), (num_logical, width))
    else:  # subnormal and the smallest normal weights: the largest weight scaled up, not down
        shares = (rng.integers(1, 1 << 12, (num_logical, width)) * 2.0**-149).astype(np.float32)
        shares[::3] *= np.float32(2.0**20)
    shares[rng.random((num_logical, width)) < 0.2] = 0.0
    shares[rng.random((num_logical, width)) < 0.05] = rng.choice([np.nan, np.inf, -1.0])
    shares[:2] = 0.0
    log2phy = rng.permutation(num_logical * width + 7)[: num_logical * width].reshape(num_logical, width)
    words = np.asarray(_alias.alias_words(jnp.asarray(shares), jnp.asarray(log2phy), jnp.asarray(logcnt)))
    # The map kernel's packed layout: per expert (count << 17 | first slot + 1 or offset, offset), then (word,
    # own slot) per live bucket in order.
    packed = np.asarray(_alias.pack_words(jnp.asarray(words), jnp.asarray(log2phy), jnp.asarray(logcnt)))
    counts = np.clip(logcnt, 1, width)
    used = 2 * (num_logical + counts.sum())
    assert packed.shape == (_alias.packed_size(num_logical, width),) and not packed[used:].any()
    np.testing.assert_array_equal(
        packed[: 2 * num_logical].reshape(-1, 2),
        np.stack(
            [
                np.where(counts == 1, log2phy[:, 0] + 1, np.cumsum(counts) - counts) | (counts << 17),
                np.cumsum(counts) - counts,
            ],
            1,
        ),
    )
    pairs = packed[2 * num_logical : used].reshape(-1, 2)
    np.testing.assert_array_equal(pairs[:, 0], np.concatenate([words[e, :c] for e, c in enumerate(counts)]))
    np.testing.assert_array_equal(pairs[:, 1], np.concatenate([log2phy[e, :c] for e, c in enumerate(counts)]))
    built = alias_kernel(jnp.asarray(shares), jnp.asarray(log2phy), jnp.asarray(logcnt, jnp.int32), interpret=True)
    np.testing.assert_array_equal(np.asarray(built)[:used], packed[:used])
    unit = 1 << _alias.UNIT_BITS
    for expert in range(num_logical):
        count = int(counts[expert])
        masses = share_masses(shares[expert, :count], width)
        prob, alias = sweep_alias_table(masses, unit)
        slots = log2phy[expert]
        want = [(p << 16 | slots[a]) if p < unit else slots[j] for j, (p, a) in enumerate(zip(prob, alias))]
        got = words[expert, :count].astype(np.int64) & 0xFFFFFFFF
        np.testing.assert_array_equal(got, want)
        assert not words[expert, count:].any()
        parts = dict.fromkeys(slots[:count], 0)
        for bucket, word in enumerate(got):
            keep = word >> 16
            parts[slots[bucket]] += keep
            parts[word & 0xFFFF] += unit - keep
        np.testing.assert_array_equal([parts[slot] for slot in slots[:count]], masses)
        weights = shares[expert, :count]
        if np.any((weights > 0) & (weights < np.inf)):
            assert not np.asarray(masses)[~((weights > 0) & (weights < np.inf))].any()


def test_bucket_and_fraction_split_the_hash_exactly(rng):
    """The bucket is floor(h * c / 2**32) and the fraction the next 10 bits of h * c (U = 2**10 units per
    bucket), computed in 32 bits (h split in 16-bit halves) exactly as in 64."""
    hashes = np.concatenate(
        [rng.integers(0, 2**32, 4000, dtype=np.uint64), np.array([0, 2**32 - 1, 2**31, 65535, 65536], np.uint64)]
    )
    for count in (1, 2, 3, 257, 300, _alias.MAX_WIDTH):
        scaled = (hashes * np.uint64(count)) >> np.uint64(16)
        bucket, fraction = _alias.bucket_and_fraction(
            jnp.asarray(hashes.astype(np.uint32)), jnp.full(hashes.shape, count, jnp.int32)
        )
        np.testing.assert_array_equal(np.asarray(bucket), (scaled >> np.uint64(16)).astype(np.int64))
        np.testing.assert_array_equal(np.asarray(fraction), (scaled & np.uint64(0xFFFF)) >> np.uint64(6))
        assert np.asarray(bucket).max() < count


@pytest.mark.parametrize("prepared", [False, True])
def test_lp_never_wraps_an_invalid_slot_onto_a_valid_one(prepared, rng):
    """A live replica whose slot is past 16 bits (tables that disagree with ``P``: refused where concrete, so traced
    here) maps to -1 like the reference's, as an alias, as a bucket's own replica and as a single-replica expert's
    first slot -- not to its low 16 bits or a clipped 65534, both valid slots with ``num_physical = 65535``
    (counted by per-entry atomics: too many bins for a histogram in shared memory)."""
    log2phy = np.asarray([[3, 70000], [65536, 65534], [70001, -1], [65533, -1]], np.int32)
    logcnt = np.asarray([2, 2, 1, 1], np.int32)
    shares = np.asarray([[1.0, 3.0], [2.0, 1.0], [1.0, 0.0], [1.0, 0.0]], np.float32)
    ids = rng.integers(0, 4, (256, 2)).astype(np.int32)
    kw = dict(num_physical=65535, mode="lp")
    with pytest.raises(ValueError, match="log2phy\\[0, 1\\] = 70000 is not a slot in \\[0, 65535\\)"):
        map_and_count(ids, log2phy, logcnt, replica_shares=shares, **kw)

    def run(ids, log2phy, logcnt, shares, implementation):
        lookup = lookup_table(log2phy, logcnt, replica_shares=shares) if prepared else None
        return map_and_count(
            ids, log2phy, logcnt, replica_shares=shares, implementation=implementation, lookup=lookup, **kw
        )

    want = jax.jit(functools.partial(run, implementation="xla"))(ids, log2phy, logcnt, shares)
    got = jax.jit(functools.partial(run, implementation="pallas"))(ids, log2phy, logcnt, shares)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    phys = np.asarray(want[0])
    assert (phys[ids == 2] == -1).all() and (phys[ids == 3] == 65533).all()
    assert {int(p) for p in phys[ids == 0]} == {3, -1} and {int(p) for p in phys[ids == 1]} == {65534, -1}


@pytest.mark.parametrize("mode", MODES)
def test_many_slots_count_by_entry_atomics(mode, rng):
    """Past 32768 slots the kernel counts each entry with an atomic into the loads (a histogram's bins would not
    fit a block's shared memory on the GPU): the reference's ids and loads, with padding and a hot slot."""
    num_physical = 40000
    placement = random_placement(rng, 64, num_physical)
    logcnt = placement.logcnt[0]
    log2phy = placement.log2phy[0][:, : logcnt.max()]  # (Placement pads to P - E + 1 columns: past lp's limit)
    ids = random_ids(rng, 300, 4, 64)
    ids[::3, 0] = 5  # one expert hot: many atomics on its slots
    extra = {k: v[:, : log2phy.shape[1]] for k, v in random_mode_inputs(rng, mode, placement, ids.size).items()}
    _, load = check_parity("pallas", Case(ids, log2phy, logcnt, num_physical, mode, extra, num_valid=290))
    assert load.sum() > 0


def test_lp_rejects_tables_its_words_cannot_hold(rng):
    width = _alias.MAX_WIDTH + 1
    with pytest.raises(ValueError, match="at most 32767 replicas per expert"):
        map_and_count(
            np.zeros((2, 1), np.int32),
            np.zeros((1, width), np.int32),
            np.ones(1, np.int32),
            num_physical=2,
            mode="lp",
            replica_shares=np.ones((1, width), np.float32),
        )
    with pytest.raises(ValueError, match="at most 32767 replicas per expert"):
        lookup_table(
            np.zeros((1, width), np.int32), np.ones(1, np.int32), replica_shares=np.ones((1, width), np.float32)
        )
    with pytest.raises(ValueError, match="num_physical up to 65535"):
        map_and_count(
            np.zeros((2, 1), np.int32),
            np.zeros((1, 2), np.int32),
            np.ones(1, np.int32),
            num_physical=65536,
            mode="lp",
            replica_shares=np.ones((1, 2), np.float32),
        )


# ------------------------------------------------------- replica spread at any batch size
@pytest.mark.parametrize("count", [2, 3, 4, 8])
def test_hash_is_not_round_robin_for_any_replica_count(count):
    """``h mod c`` with an odd multiplier repeats the position's low bits: for c = 2, 4, 8 every token took the
    replica round robin gives it. The high bits differ from round robin and spread every window evenly."""
    placement = Placement.from_phy2log(np.r_[np.zeros(count, np.int64), np.arange(1, 4)], 4)
    ids = np.zeros((64, 1), np.int32)
    replica_of = {int(s): j for j, s in enumerate(placement.log2phy[0, 0, :count])}
    picked = {}
    for mode in ("hash", "round_robin"):
        phys, _ = map_and_count(ids, placement.log2phy[0], placement.logcnt[0], num_physical=count + 3, mode=mode)
        picked[mode] = np.array([replica_of[int(s)] for s in np.asarray(phys)[:, 0]])
    assert picked["round_robin"].tolist() == [t % count for t in range(64)]
    assert not np.array_equal(picked["hash"], picked["round_robin"])
    for start in range(0, 56, 7):  # any window of consecutive positions: near-uniform
        counts = np.bincount(picked["hash"][start : start + 9], minlength=count)
        assert counts.max() - counts.min() <= 3, (start, counts)


@pytest.mark.devices(8)
@pytest.mark.parametrize("tokens_per_rank", [1, 2, 4])
@pytest.mark.parametrize("count", [2, 4, 8])
def test_decode_spreads_replicas_over_every_ranks_tokens(tokens_per_rank, count):
    """In decode each rank holds a token or two: hashing the rank-local index sent every rank's token 0 to the same
    replica. ``moe_apply`` hashes global positions, so the ranks' tokens spread over the replicas."""
    from moe_eplb_jax.moe import map_replicas
    from moe_eplb_jax.transport import ep_mesh

    mesh = ep_mesh(8)
    placement = Placement.from_phy2log(np.r_[np.zeros(count, np.int64), np.arange(1, 17 - count)], 16 - count + 1)
    ids = np.zeros((8 * tokens_per_rank, 1), np.int32)  # every token routed to expert 0, which has `count` replicas
    P = jax.sharding.PartitionSpec

    def local(ids, log2phy, logcnt):
        phys, _ = map_replicas(ids, log2phy, logcnt, routing="hash", num_physical=16, axis="ep")
        return phys

    run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("ep"), P(), P()), out_specs=P("ep")))
    phys = np.asarray(run(ids, placement.log2phy[0], placement.logcnt[0]))[:, 0]
    counts = np.bincount(phys, minlength=16)[placement.log2phy[0, 0, :count]]
    assert counts.sum() == ids.size and counts.max() - counts.min() <= 3, counts
    assert counts.max() <= max(2, 2 * ids.size // count), counts

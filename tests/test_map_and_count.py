"""Tests of ``moe_eplb_jax.pallas.map_and_count``.

One shared body checks each implementation ("xla", and "pallas" in interpret
mode on CPU / compiled on GPU) against an independent numpy oracle written
entry by entry from the documented semantics (``_map_and_count_data.py``).
Large-T properties run on the xla path only (interpret mode is slow). The
kernels' own options and parts: ``test_map_and_count_kernel.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _map_and_count_data import (
    GOLDEN,
    check_against_oracle,
    jitted,
    layered_inputs,
    oracle,
    random_ids,
    random_mode_inputs,
    random_placement,
    share_masses,
    sweep_alias_table,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_eplb_jax.pallas import MODES, map_and_count
from moe_eplb_jax.placement import Placement

# ------------------------------------------------ both implementations, vs oracle
SHAPES = [  # (T, k, E, P): tiny, odd sizes, S = 8 with E = 512, a multi-tile case
    (1, 1, 4, 4),
    (37, 2, 16, 23),
    (129, 6, 512, 519),
    (700, 8, 64, 72),
]


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}k{}E{}P{}".format(*s))
def test_matches_oracle(implementation, mode, shape, rng):
    check_against_oracle(implementation, rng, mode, *shape)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_record_false_counts_nothing(implementation, rng):
    _, _, phys, load, _ = check_against_oracle(implementation, rng, "hash", 37, 2, 16, 23, record=False)
    assert not load.any() and (phys >= 0).any()


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
    check_against_oracle("xla", rng, mode, num_tokens, top_k, num_logical, num_logical + extra_slots)


# --------------------------------------------------- large-T properties (xla path)
@pytest.mark.parametrize("mode", MODES)
def test_large_t_properties(mode, rng):
    num_tokens, top_k, num_logical, num_physical = 65536, 8, 256, 288
    placement = random_placement(rng, num_logical, num_physical)
    log2phy, logcnt = placement.log2phy[0], placement.logcnt[0]
    ids = random_ids(rng, num_tokens, top_k, num_logical)
    extra = random_mode_inputs(rng, mode, placement, ids.size)
    num_valid = num_tokens - 1000
    phys, load = map(
        np.asarray, jitted("xla", mode, num_physical)(ids, log2phy, logcnt, np.int32(num_valid), True, extra)
    )
    valid = (ids >= 0) & (ids < num_logical)
    np.testing.assert_array_equal(phys < 0, ~valid)  # invalid ids, and only they, map to -1
    np.testing.assert_array_equal(placement.phy2log[0][phys[valid]], ids[valid])  # a replica of its expert
    counted = phys[:num_valid][valid[:num_valid]]
    np.testing.assert_array_equal(load, np.bincount(counted, minlength=num_physical))


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


def test_shares_followed_within_two_percent(rng):
    num_tokens, num_logical = 65536, 4
    placement = Placement.from_phy2log(np.array([0, 1, 2, 3, 0, 0, 0, 1, 1]), num_logical)
    width = placement.max_replicas
    shares = rng.uniform(0.1, 1.0, (num_logical, width)).astype(np.float32)
    shares[1, 1] = 0.0  # a zero-share replica is never chosen
    ids = rng.integers(0, 2, (num_tokens, 1)).astype(np.int32)
    _, load = jitted("xla", "shares", 9)(
        ids, placement.log2phy[0], placement.logcnt[0], np.int32(num_tokens), True, {"replica_shares": shares}
    )
    load = np.asarray(load)
    for expert in (0, 1):
        count = placement.logcnt[0, expert]
        replicas = placement.log2phy[0, expert, :count]
        want = shares[expert, :count] / shares[expert, :count].sum() * np.sum(ids == expert)
        np.testing.assert_allclose(load[replicas], want, rtol=0.02, atol=0.5)
    assert load[placement.log2phy[0, 1, 1]] == 0


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_shares_zero_and_huge_rows(implementation, rng):
    """A row without a positive weight is split equally; weights near float32 max do not overflow the sums."""
    num_tokens = 65536
    placement = Placement.from_phy2log(np.array([0, 1, 0, 0, 1, 1]), 2)
    shares = np.zeros((2, placement.max_replicas), np.float32)
    shares[0, :3] = [np.nan, -1.0, 0.0]  # nothing positive: equal shares
    shares[1, :3] = [3e38, 1.5e38, np.inf]  # counts as [3e38, 1.5e38, 0]: no overflow
    ids = rng.integers(0, 2, (num_tokens, 1)).astype(np.int32)
    phys, load = jitted(implementation, "shares", 6)(
        ids, placement.log2phy[0], placement.logcnt[0], np.int32(num_tokens), True, {"replica_shares": shares}
    )
    load = np.asarray(load)
    for expert, fractions in ((0, [1 / 3, 1 / 3, 1 / 3]), (1, [2 / 3, 1 / 3, 0])):
        replicas = placement.log2phy[0, expert, :3]
        np.testing.assert_allclose(load[replicas], np.multiply(fractions, np.sum(ids == expert)), rtol=0.03, atol=0)
    want, _ = oracle(ids, placement.log2phy[0], placement.logcnt[0], 6, num_tokens, "shares", replica_shares=shares)
    np.testing.assert_array_equal(np.asarray(phys), want)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_resolved_matches_quotas_exactly(implementation, rng):
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
    phys, load = jitted(implementation, "resolved", num_physical)(
        ids.reshape(num_tokens, top_k).astype(np.int32),
        placement.log2phy[0],
        logcnt,
        np.int32(num_tokens),
        True,
        {"resolved": quotas.astype(np.int32)},
    )
    load = np.asarray(load)
    for expert in range(num_logical):
        replicas = placement.log2phy[0, expert, : logcnt[expert]]
        got = load[replicas]
        # Quotas are consumed in order, so every replica but the expert's last non-empty one is exactly full.
        cumulative = np.minimum(np.cumsum(quotas[expert, : logcnt[expert]]), demand[expert])
        np.testing.assert_array_equal(got, np.diff(np.concatenate([[0], cumulative])))


def test_resolved_overflow_falls_back_to_hash(rng):
    placement = Placement.from_phy2log(np.array([0, 1, 0, 0]), 2)
    quotas = np.array([[3, 0, 2], [0, 0, 0]], np.int32)  # replica 1 of expert 0 has quota 0
    ids = np.zeros((20, 1), np.int32)
    phys, load = jitted("xla", "resolved", 4)(
        ids, placement.log2phy[0], placement.logcnt[0], np.int32(20), True, {"resolved": quotas}
    )
    phys = np.asarray(phys)[:, 0]
    replicas = placement.log2phy[0, 0]
    np.testing.assert_array_equal(phys[:5], replicas[[0, 0, 0, 2, 2]])
    hashed = (np.arange(5, 20) * GOLDEN % 2**32) % 3
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


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_vmap_over_layers(implementation, rng):
    num_layers, num_tokens, top_k, num_logical, num_physical = 3, 40, 2, 8, 12
    placements, log2phy, logcnt, ids = layered_inputs(rng, num_layers, num_tokens, top_k, num_logical, num_physical)
    fn = functools.partial(map_and_count, num_physical=num_physical, num_valid_tokens=30, implementation=implementation)
    phys, load = jax.jit(jax.vmap(fn))(ids, log2phy, logcnt)
    for layer in range(num_layers):
        want_phys, want_load = oracle(ids[layer], log2phy[layer], logcnt[layer], num_physical, 30, "hash")
        np.testing.assert_array_equal(np.asarray(phys[layer]), want_phys)
        np.testing.assert_array_equal(np.asarray(load[layer]), want_load)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_shard_map_psum_equals_global(implementation, rng):
    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    num_local, top_k, num_logical, num_physical = 24, 2, 16, 24
    placement = random_placement(rng, num_logical, num_physical)
    ids = random_ids(rng, num_local * len(devices), top_k, num_logical)
    P = jax.sharding.PartitionSpec

    def local(ids_shard, log2phy, logcnt):
        phys, load = map_and_count(
            ids_shard, log2phy, logcnt, num_physical=num_physical, num_valid_tokens=20, implementation=implementation
        )
        return phys, jax.lax.psum(load, "ep")

    # Pallas interpret mode trips jax's own varying-axes check inside shard_map (its interpreter
    # slices a varying operand with an invariant index), so interpret runs with check_vma=False;
    # the compiled kernel runs with check_vma=True (test_gpu_shard_map).
    check_vma = implementation == "xla" or jax.default_backend() == "gpu"
    fn = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P("ep"), P(), P()), out_specs=(P("ep"), P()), check_vma=check_vma)
    )
    phys, load = fn(ids, placement.log2phy[0], placement.logcnt[0])
    want_load = np.zeros(num_physical, np.int64)
    for rank in range(len(devices)):  # token indices are local to each rank
        shard = ids[rank * num_local : (rank + 1) * num_local]
        want_phys, shard_load = oracle(shard, placement.log2phy[0], placement.logcnt[0], num_physical, 20, "hash")
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
def _tables(rng):
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
        (lambda a: a.update(mode="shares"), "needs replica_shares"),
        (lambda a: a.update(mode="resolved"), "needs resolved"),
        (lambda a: a.update(replica_shares=np.ones((8, 5), np.float32)), "only used with mode='shares'"),
        (
            lambda a: a.update(mode="shares", replica_shares=np.ones((8, 4), np.float32)),
            "replica_shares must have shape",
        ),
        (lambda a: a.update(mode="shares", replica_shares=np.ones((8, 5), np.int32)), "floating dtype"),
        (lambda a: a.update(mode="resolved", resolved=np.ones((8, 5), np.float32)), "resolved must have an integer"),
        (lambda a: a.update(num_valid_tokens=11), "num_valid_tokens must be in"),
        (lambda a: a.update(num_valid_tokens=np.ones(2, np.int32)), "num_valid_tokens must be an integer scalar"),
        (lambda a: a.update(record=1), "record must be a boolean"),
        (lambda a: a.update(implementation="cuda"), "implementation must be one of"),
        (lambda a: a.update(lookup=np.zeros(47, np.int32)), "lookup must be lookup_table"),
        (lambda a: a.update(lookup=np.zeros(48, np.int64)), "lookup must be lookup_table"),
    ],
)
def test_validation_errors(change, message, rng):
    ids, log2phy, logcnt = _tables(rng)
    kwargs = dict(topk_ids=ids, log2phy=log2phy, logcnt=logcnt, num_physical=12)
    change(kwargs)
    with pytest.raises(ValueError, match=message):
        map_and_count(**kwargs)


@pytest.mark.parametrize("mode", MODES)
def test_prepared_lookup_gives_the_same_results(mode, rng):
    """A lookup table built once per placement (vmapped over layers, as a model keeps it) changes nothing, with
    or without shares' alias words in it (which every mode accepts; shares then reads them)."""
    from moe_eplb_jax.pallas import lookup_table

    num_layers, num_tokens, top_k, num_logical, num_physical = 2, 48, 4, 16, 30
    placements, log2phy, logcnt, ids = layered_inputs(rng, num_layers, num_tokens, top_k, num_logical, num_physical)
    extra = [random_mode_inputs(rng, mode, p, num_tokens * top_k) for p in placements]
    extra = {k: np.stack([e[k] for e in extra]) for k in extra[0]}
    width = log2phy.shape[2]
    weights = extra["replica_shares"] if mode == "shares" else rng.random(log2phy.shape).astype(np.float32)
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


@pytest.mark.parametrize("mode, path", [("shares", "alias"), ("resolved", "guide"), ("resolved", "positions")])
def test_extra_kernels_under_vmap_and_shard_map(mode, path, monkeypatch, rng):
    """Shares' alias-table kernel, resolved's guided path and resolved by boundary positions (both forced on for
    small inputs here), under vmap over layers with prepared lookups, and inside shard_map with per-rank quotas or
    shares, equal the oracle: their extra kernels batch and shard like the map kernel."""
    from moe_eplb_jax.pallas import _triton, lookup_table

    if path == "guide":
        monkeypatch.setitem(_triton.DEFAULTS, "guide", 4)
    elif path == "positions":
        monkeypatch.setattr(_triton, "_POSITIONS_FROM", 0)
    num_layers, num_tokens, top_k, num_logical, num_physical = 2, 48, 4, 16, 30
    placements, log2phy, logcnt, ids = layered_inputs(rng, num_layers, num_tokens, top_k, num_logical, num_physical)
    extra = [random_mode_inputs(rng, mode, p, num_tokens * top_k) for p in placements]
    extra = {k: np.stack([e[k] for e in extra]) for k in extra[0]}

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

    got = jax.jit(jax.vmap(run))(ids, log2phy, logcnt, extra, jax.vmap(lookup_table)(log2phy, logcnt))
    for layer in range(num_layers):
        want = oracle(
            ids[layer], log2phy[layer], logcnt[layer], num_physical, 40, mode, **{k: v[layer] for k, v in extra.items()}
        )
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g[layer]), w)

    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    P = jax.sharding.PartitionSpec
    num_local = 12
    ids = random_ids(rng, num_local * len(devices), top_k, num_logical)
    per_rank = [random_mode_inputs(rng, mode, placements[0], num_local * top_k) for _ in devices]
    values = np.stack([r[next(iter(r))] for r in per_rank])  # [G, E, S]: each rank its own row
    name = next(iter(per_rank[0]))

    def local(ids_shard, values, log2phy, logcnt):
        phys, load = map_and_count(
            ids_shard,
            log2phy,
            logcnt,
            num_physical=num_physical,
            mode=mode,
            implementation="pallas",
            **{name: values[0]},
        )
        return phys, jax.lax.psum(load, "ep")

    fn = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P("ep"), P("ep"), P(), P()),
            out_specs=(P("ep"), P()),
            check_vma=jax.default_backend() == "gpu",
        )
    )  # interpret mode: see above
    phys, load = fn(ids, values, log2phy[0], logcnt[0])
    want_load = np.zeros(num_physical, np.int64)
    for rank in range(len(devices)):
        shard = ids[rank * num_local : (rank + 1) * num_local]
        want_phys, shard_load = oracle(
            shard, log2phy[0], logcnt[0], num_physical, num_local, mode, **{name: values[rank]}
        )
        np.testing.assert_array_equal(np.asarray(phys[rank * num_local : (rank + 1) * num_local]), want_phys)
        want_load += shard_load
    np.testing.assert_array_equal(np.asarray(load), want_load)


def test_lookup_table_rejects_bad_tables(rng):
    from moe_eplb_jax.pallas import lookup_table

    _, log2phy, logcnt = _tables(rng)
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
    _, log2phy, logcnt = _tables(rng)
    phys, load = map_and_count(np.zeros((0, 4), np.int32), log2phy, logcnt, num_physical=12, implementation="pallas")
    assert phys.shape == (0, 4) and load.shape == (12,) and not np.asarray(load).any()


# ------------------------------------------------------------------ GPU only
@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "shape",
    [(1, 1, 8, 8), (333, 6, 512, 519), (4096, 8, 256, 288), (65536, 8, 256, 512), (262144, 8, 256, 288)],
    ids=lambda s: "T{}k{}E{}P{}".format(*s),
)
def test_gpu_kernel_matches_reference(mode, shape, rng):
    num_tokens, top_k, num_logical, num_physical = shape
    placement = random_placement(rng, num_logical, num_physical)
    log2phy, logcnt = placement.log2phy[0], placement.logcnt[0]
    for _ in range(2):  # fresh inputs each time
        ids = random_ids(rng, num_tokens, top_k, num_logical)
        extra = random_mode_inputs(rng, mode, placement, ids.size)
        num_valid = np.int32(rng.integers(0, num_tokens + 1))
        got = jitted("pallas", mode, num_physical)(ids, log2phy, logcnt, num_valid, True, extra)
        want = jitted("xla", mode, num_physical)(ids, log2phy, logcnt, num_valid, True, extra)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
        if ids.size <= 4096:
            want_phys, want_load = oracle(ids, log2phy, logcnt, num_physical, int(num_valid), mode, **extra)
            np.testing.assert_array_equal(np.asarray(got[0]), want_phys)
            np.testing.assert_array_equal(np.asarray(got[1]), want_load)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "options",
    [
        {"count_method": "onehot", "tables": "global"},
        {"count_method": "atomic", "tables": "global"},
        {"count_method": "atomic_warp", "tables": "global"},
        {"count_method": "histogram", "tables": "global"},
        {"count_method": "histogram", "tables": "shared"},
        {"count_method": "histogram", "tables": "head"},
        {"count_method": "onehot", "tables": "head"},
        {"tables": "head", "layout": "replica_major"},
        {"tables": "global", "layout": "replica_major"},
        {"tables": "shared", "layout": "replica_major"},
        {"reduce": "atomic"},
        {"reduce": "atomic", "layout": "replica_major"},
        {"reduce": "atomic", "layout": "expert_major", "tables": "global"},
        {"rank_in_step": "match"},
        {"rank_in_step": "match", "reduce": "atomic", "layout": "replica_major"},
        {"linear_search": 16},
        {"linear_search": 4},
        {"guide": 0},
        {"guide": 1},
        {"guide": 16, "search": "unrolled"},
        {"rank_running": "registers", "rank_chains": 1},
        {"rank_running": "memory", "rank_in_step": "compare"},
        {"rank_chains": 1},
        {"rank_chains": 2},
        {"rank_chains": 4},
        {"resolved_by": "positions"},
        {"resolved_by": "ranks"},
        {"resolved_by": "positions", "position_tile": 256, "position_groups": 1},
        {"resolved_by": "positions", "position_tile": 4096, "position_groups": 3, "position_scan": 512},
    ],
    ids=lambda o: "-".join(map(str, o.values())),
)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "shape", [(1, 1, 8, 8), (333, 6, 512, 519), (65536, 8, 256, 288)], ids=lambda s: "T{}k{}E{}P{}".format(*s)
)
def test_gpu_count_methods_match_reference(options, mode, shape, rng):
    """Every counting method and table layout of the compiled kernel gives the reference's ids and loads on fresh
    inputs."""
    from moe_eplb_jax.pallas import _reference, _triton
    from moe_eplb_jax.pallas.map_and_count import _build_mode_table

    num_tokens, top_k, num_logical, num_physical = shape
    placement = random_placement(rng, num_logical, num_physical)
    log2phy, logcnt = jnp.asarray(placement.log2phy[0]), jnp.asarray(placement.logcnt[0])
    log2phy.shape[1]
    for _ in range(2):
        ids = jnp.asarray(random_ids(rng, num_tokens, top_k, num_logical))
        extra = random_mode_inputs(rng, mode, placement, ids.size)
        values = extra.get("replica_shares", extra.get("resolved"))
        thresholds = (
            jnp.zeros_like(log2phy) if values is None else _build_mode_table(mode, jnp.asarray(values), log2phy, logcnt)
        )
        valid = int(rng.integers(0, num_tokens + 1)) * top_k
        limits = jnp.asarray([valid, valid], jnp.int32)
        want = _reference.map_and_count_reference(
            ids, log2phy, logcnt, thresholds, limits, num_physical=num_physical, mode=mode
        )
        got = jax.jit(
            lambda x: _triton.map_and_count_triton(
                x, log2phy, logcnt, thresholds, limits, num_physical=num_physical, mode=mode, **options
            )
        )(ids)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


@pytest.mark.gpu
def test_gpu_vmap_and_record_flag(rng):
    placements = [random_placement(rng, 256, 288) for _ in range(3)]
    log2phy = np.stack([p.log2phy[0] for p in placements])
    logcnt = np.stack([p.logcnt[0] for p in placements])
    ids = np.stack([random_ids(rng, 4096, 8, 256) for _ in range(3)])
    for record in (True, False):
        fn = functools.partial(map_and_count, num_physical=288, num_valid_tokens=4000, record=jnp.bool_(record))
        got = jax.jit(jax.vmap(functools.partial(fn, implementation="pallas")))(ids, log2phy, logcnt)
        want = jax.jit(jax.vmap(functools.partial(fn, implementation="xla")))(ids, log2phy, logcnt)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
        assert np.asarray(got[1]).any() == record


@pytest.mark.gpu
def test_gpu_shard_map(rng):
    mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    placement = random_placement(rng, 256, 288)
    ids = random_ids(rng, 4096, 8, 256)
    P = jax.sharding.PartitionSpec

    def local(ids_shard, log2phy, logcnt):
        phys, load = map_and_count(ids_shard, log2phy, logcnt, num_physical=288, implementation="pallas")
        return phys, jax.lax.psum(load, "ep")

    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("ep"), P(), P()), out_specs=(P("ep"), P())))
    phys, load = fn(ids, placement.log2phy[0], placement.logcnt[0])
    want_phys, want_load = oracle(ids, placement.log2phy[0], placement.logcnt[0], 288, 4096, "hash")
    np.testing.assert_array_equal(np.asarray(phys), want_phys)
    np.testing.assert_array_equal(np.asarray(load), want_load)


# ------------------------------------------------------------ mode tables
@pytest.mark.parametrize("width", [1, 5, 33, 257])
@pytest.mark.parametrize("limit", [None, 2**21, 2**26, 100, 2**24 - 1, 3 * 2**23])
def test_thresholds_exact_by_every_summation(width, limit, rng):
    """Quota thresholds are the capped int64 prefix sums exactly, whichever way the sums run (the triangular
    product on the quotas themselves below a cap of 2**24, else on two or three limbs; or the saturating scan)."""
    from moe_eplb_jax.pallas.map_and_count import _build_thresholds

    num_logical = 40
    logcnt = rng.integers(0, width + 1, num_logical)
    live = np.arange(width)[None, :] < logcnt[:, None]
    # All three 11-bit limbs; below a cap, mostly unclipped (odd sums near 2**24 would round in float32).
    high = 30_000_000 if limit is None else min(30_000_000, limit + limit // 4)
    quotas = rng.integers(-5, high, (num_logical, width)).astype(np.int32)
    cap = np.iinfo(np.int32).max if limit is None else limit
    sums = np.cumsum(np.clip(np.where(live, quotas, 0), 0, cap).astype(np.int64), axis=1)
    want = np.where(live, np.minimum(sums, cap), np.iinfo(np.int32).max)
    for method in ("matmul", "cumsum"):
        got = _build_thresholds("resolved", jnp.asarray(quotas), jnp.asarray(logcnt), width, limit=limit, sums=method)
        np.testing.assert_array_equal(np.asarray(got), want)
    with pytest.raises(ValueError, match="thresholds are resolved's"):
        _build_thresholds("shares", jnp.asarray(quotas, jnp.float32), jnp.asarray(logcnt), width)


@pytest.mark.parametrize("draw", ["spread", "ties", "tiny"])
@pytest.mark.parametrize("width", [1, 5, 33, 257, 300])
def test_alias_table_is_the_sequential_sweep(width, draw, rng):
    """shares' alias table -- jnp, and the Pallas kernel in interpret mode -- is Vose's sequential sweep over the
    documented masses (modelled in exact rational arithmetic), each replica's parts add up to its mass (none for a
    zero weight) and the words name the alias's slot: weights spanning 60 orders of magnitude, a few small
    integers (masses that tie running sums exactly) or subnormal ones, zeros, NaN, infinities and negatives, rows
    without a positive weight, counts past the table's width."""
    from moe_eplb_jax.pallas import _alias

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
    built = _alias.alias_kernel(
        jnp.asarray(shares), jnp.asarray(log2phy), jnp.asarray(logcnt, jnp.int32), interpret=True
    )
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
    from moe_eplb_jax.pallas import _alias

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
def test_shares_never_wraps_an_invalid_slot_onto_a_valid_one(prepared, rng):
    """A live replica whose slot is past 16 bits (an invalid placement) maps to -1 like the reference's, as an
    alias, as a bucket's own replica and as a single-replica expert's first slot -- not to its low 16 bits or a
    clipped 65534, both valid slots with ``num_physical = 65535`` (counted by per-entry atomics: too many bins
    for a histogram in shared memory)."""
    from moe_eplb_jax.pallas import lookup_table

    log2phy = np.asarray([[3, 70000], [65536, 65534], [70001, -1], [65534, -1]], np.int32)
    logcnt = np.asarray([2, 2, 1, 1], np.int32)
    shares = np.asarray([[1.0, 3.0], [2.0, 1.0], [1.0, 0.0], [1.0, 0.0]], np.float32)
    ids = rng.integers(0, 4, (256, 2)).astype(np.int32)
    kw = dict(num_physical=65535, mode="shares", replica_shares=shares)
    want = map_and_count(ids, log2phy, logcnt, implementation="xla", **kw)
    lookup = lookup_table(log2phy, logcnt, replica_shares=shares) if prepared else None
    got = map_and_count(ids, log2phy, logcnt, implementation="pallas", lookup=lookup, **kw)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    phys = np.asarray(want[0])
    assert (phys[ids == 2] == -1).all() and (phys[ids == 3] == 65534).all()
    assert {int(p) for p in phys[ids == 0]} == {3, -1} and {int(p) for p in phys[ids == 1]} == {65534, -1}


@pytest.mark.parametrize("mode", MODES)
def test_many_slots_count_by_entry_atomics(mode, rng):
    """Past 32768 slots the kernel counts each entry with an atomic into the loads (a histogram's bins would not
    fit a block's shared memory on the GPU): the reference's ids and loads, with padding and a hot slot."""
    num_physical = 40000
    placement = random_placement(rng, 64, num_physical)
    logcnt = placement.logcnt[0]
    log2phy = placement.log2phy[0][:, : logcnt.max()]  # (Placement pads to P - E + 1 columns: past shares' limit)
    ids = random_ids(rng, 300, 4, 64)
    ids[::3, 0] = 5  # one expert hot: many atomics on its slots
    extra = {k: v[:, : log2phy.shape[1]] for k, v in random_mode_inputs(rng, mode, placement, ids.size).items()}
    got = jitted("pallas", mode, num_physical)(ids, log2phy, logcnt, np.int32(290), True, extra)
    want = jitted("xla", mode, num_physical)(ids, log2phy, logcnt, np.int32(290), True, extra)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    assert np.asarray(got[1]).sum() > 0


@pytest.mark.parametrize("shape", [(15, 4), (2200, 64)])
def test_shares_table_forms_and_loads(shape, rng):
    """However the alias table lies and the map kernel reads it -- one word per bucket (up to 2047 slots) or a
    (word, slot) pair, the expert's head word alone (where every offset fits its 17 bits) or the head pair -- it
    gives the reference's ids and loads: built per call, packed from given words, or prepared; and with more
    buckets than a head word can address (2200 x 64, offsets past 2**17: the head pair) and more slots than 11
    bits hold (4000: two words per bucket)."""
    from moe_eplb_jax.pallas import _alias, _reference, _triton, lookup_table

    num_logical, width = shape
    num_physical = min(num_logical * width, 4000)
    logcnt = np.full(num_logical, width, np.int32)
    logcnt[1::10] = rng.integers(1, width + 1, logcnt[1::10].size)
    log2phy = rng.integers(0, num_physical, (num_logical, width)).astype(np.int32)
    shares = rng.uniform(0.0, 1.0, (num_logical, width)).astype(np.float32)
    ids = rng.integers(-1, num_logical + 1, (500, 4)).astype(np.int32)
    ids[::2, 1] = 0  # the widest expert: buckets up to its last
    ids[1::2, 2] = num_logical - 1 - ids[1::2, 2] % 40  # the last experts: offsets past 2**17 (the large shape)
    limits = jnp.asarray([480 * 4, 490 * 4], jnp.int32)
    words = _alias.alias_words(jnp.asarray(shares), jnp.asarray(log2phy), jnp.asarray(logcnt))
    want = _reference.map_and_count_reference(
        ids, log2phy, logcnt, words, limits, num_physical=num_physical, mode="shares"
    )
    small = shape == (15, 4)
    assert _alias.word_heads_fit(num_logical, width) == small == _alias.compact_fits(num_physical)
    assert small or np.clip(logcnt, 1, width)[:-1].sum() >= 1 << _alias.HEAD_SHIFT
    one_word = dict(lookup=lookup_table(log2phy, logcnt, replica_shares=shares, num_physical=num_physical))
    two_words = dict(lookup=lookup_table(log2phy, logcnt, replica_shares=shares))
    per_call, given = dict(shares=shares), dict(thresholds=words)
    sizes = one_word["lookup"].size, two_words["lookup"].size
    assert sizes[0] < sizes[1] if small else sizes[0] == sizes[1]
    cases = (
        [
            ({}, one_word),
            ({}, two_words),
            ({}, per_call),
            ({"compact": False}, per_call),
            ({"word_heads": False, "compact": False}, given),
            ({"word_heads": False}, one_word),
        ]
        if small
        else [({}, given), ({}, one_word)]
    )
    for options, tables in cases:
        got = _triton.map_and_count_triton(
            ids,
            log2phy,
            logcnt,
            tables.get("thresholds"),
            limits,
            num_physical=num_physical,
            mode="shares",
            interpret=jax.default_backend() != "gpu",
            lookup=tables.get("lookup"),
            shares=tables.get("shares"),
            **options,
        )
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]), err_msg=str(options))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]), err_msg=str(options))
    if small:  # a one-word table cannot name slots past 2047
        with pytest.raises(ValueError, match="cannot serve num_physical = 3000"):
            map_and_count(
                ids,
                log2phy,
                logcnt,
                num_physical=3000,
                mode="shares",
                replica_shares=shares,
                implementation="pallas",
                **one_word,
            )


def test_shares_rejects_tables_its_words_cannot_hold(rng):
    from moe_eplb_jax.pallas import _alias, lookup_table

    width = _alias.MAX_WIDTH + 1
    with pytest.raises(ValueError, match="at most 32767 replicas per expert"):
        map_and_count(
            np.zeros((2, 1), np.int32),
            np.zeros((1, width), np.int32),
            np.ones(1, np.int32),
            num_physical=2,
            mode="shares",
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
            mode="shares",
            replica_shares=np.ones((1, 2), np.float32),
        )

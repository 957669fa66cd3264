"""plan_quotas: JAX == numpy reference, feasibility, quality, bad input, determinism, end-to-end routing."""

import functools
import hashlib
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _quota_reference import plan_quotas_reference, simulate_quota_routing
from hypothesis import given
from hypothesis import strategies as st

from moe_eplb_jax.routing import check_counts, plan_quotas
from moe_eplb_jax.routing._quota_search import IMPLEMENTATIONS as SEARCH_IMPLEMENTATIONS
from moe_eplb_jax.sim import zipf_counts, zipf_topk

FIELDS = ("phy2log", "log2phy", "logcnt", "replica_load", "quota", "rank_load", "target")
# A few fixed shapes so hypothesis examples share compiled functions: (G, H, S).
SHAPES = [(2, 1, 1), (4, 2, 2), (6, 3, 1)]


@functools.cache
def _jitted(num_home, num_spare, min_replica_tokens=1):
    return jax.jit(
        functools.partial(plan_quotas, num_home=num_home, num_spare=num_spare, min_replica_tokens=min_replica_tokens)
    )


def _skewed_counts(rng, num_ranks, num_home):
    scale = rng.integers(1, 50)
    return (rng.pareto(1.2, size=(num_ranks, num_ranks * num_home)) * scale).astype(np.int32)


def check_plan(plan, counts, num_home, num_spare):
    """Every invariant a plan must satisfy, whatever its quality."""
    counts = np.asarray(counts)
    num_ranks, num_experts = counts.shape
    spr = num_home + num_spare
    phy2log = np.asarray(plan.phy2log).reshape(num_ranks, spr)
    log2phy, logcnt = np.asarray(plan.log2phy), np.asarray(plan.logcnt)
    quota, replica_load = np.asarray(plan.quota), np.asarray(plan.replica_load)
    # Home experts never move.
    np.testing.assert_array_equal(phy2log[:, :num_home], np.arange(num_experts).reshape(num_ranks, num_home))
    # At most the spare slots used; no duplicate expert on a rank.
    for rank in range(num_ranks):
        held = phy2log[rank][phy2log[rank] >= 0]
        assert len(set(held.tolist())) == held.size, f"rank {rank} holds an expert twice: {held}"
    # Replica table agrees with phy2log, ascending slots, home among them.
    width = log2phy.shape[1]
    valid = np.arange(width)[None, :] < logcnt[:, None]
    assert np.all(log2phy[~valid] == -1) and np.all(replica_load[~valid] == 0)
    flat = np.asarray(plan.phy2log)
    for e in range(num_experts):
        slots = log2phy[e, : logcnt[e]]
        np.testing.assert_array_equal(slots, np.sort(np.flatnonzero(flat == e)))
        assert (e // num_home) * spr + e % num_home in slots
    # Every token routed exactly once: quotas sum to the counts; replica loads to the expert loads.
    np.testing.assert_array_equal(quota.sum(2), counts)
    np.testing.assert_array_equal(quota.sum(0), replica_load)
    assert np.all(quota >= 0) and np.all(replica_load >= 0)
    # Rank loads are what the replicas on each rank compute.
    rank = np.where(valid, log2phy // spr, 0)
    np.testing.assert_array_equal(
        np.bincount(rank[valid], replica_load[valid], minlength=num_ranks), np.asarray(plan.rank_load)
    )
    assert int(plan.target) == int(np.asarray(plan.rank_load).max())


@pytest.mark.slow  # hypothesis examples against the reference planner
@given(st.integers(0, 2**32 - 1), st.sampled_from(SHAPES), st.sampled_from([1, 40]))
def test_matches_reference(seed, shape, min_tokens):
    rng = np.random.default_rng(seed)
    num_ranks, num_home, num_spare = shape
    counts = _skewed_counts(rng, num_ranks, num_home)
    plan = _jitted(num_home, num_spare, min_tokens)(jnp.asarray(counts))
    ref = plan_quotas_reference(counts, num_home=num_home, num_spare=num_spare, min_replica_tokens=min_tokens)
    for field in FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(plan, field)), ref[field], err_msg=field)
    check_plan(plan, counts, num_home, num_spare)
    home_max = counts.sum(0).reshape(num_ranks, num_home).sum(1).max()
    assert int(plan.target) <= home_max  # never worse than not balancing


def test_routing_follows_quotas_exactly(rng):
    """Token-level: quota routing with each source's quota row sends each replica exactly its tokens."""
    num_ranks, num_home, num_spare, top_k = 8, 2, 2, 4
    ids = zipf_topk(num_ranks, num_ranks * num_home, 64, top_k, 2.5, seed=int(rng.integers(1000)))
    counts = np.stack([np.bincount(ids[g].ravel(), minlength=num_ranks * num_home) for g in range(num_ranks)])
    plan = _jitted(num_home, num_spare)(jnp.asarray(counts, jnp.int32))
    check_plan(plan, counts, num_home, num_spare)
    slot_load = np.zeros(num_ranks * (num_home + num_spare), np.int64)
    for g in range(num_ranks):
        phys = simulate_quota_routing(
            ids[g], np.asarray(plan.log2phy), np.asarray(plan.logcnt), np.asarray(plan.quota[g])
        )
        assert np.all(np.asarray(plan.phy2log)[phys] == ids[g])  # each entry went to a replica of its expert
        slot_load += np.bincount(phys.ravel(), minlength=slot_load.size)
    np.testing.assert_array_equal(slot_load.reshape(num_ranks, -1).sum(1), np.asarray(plan.rank_load))


def test_map_and_count_quota_end_to_end(rng):
    pallas = pytest.importorskip("moe_eplb_jax.routing._map_and_count")
    num_ranks, num_home, num_spare, top_k = 8, 2, 2, 4
    ids = zipf_topk(num_ranks, num_ranks * num_home, 64, top_k, 3.0, seed=int(rng.integers(1000)))
    counts = np.stack([np.bincount(ids[g].ravel(), minlength=num_ranks * num_home) for g in range(num_ranks)])
    plan = _jitted(num_home, num_spare)(jnp.asarray(counts, jnp.int32))
    num_physical = num_ranks * (num_home + num_spare)
    total = np.zeros(num_physical, np.int64)
    for g in range(num_ranks):
        phys, load = pallas.map_and_count(
            jnp.asarray(ids[g]),
            plan.log2phy,
            plan.logcnt,
            num_physical=num_physical,
            mode="quota",
            quotas=plan.quota[g],
            implementation="xla",
        )
        assert np.all(np.asarray(plan.phy2log)[np.asarray(phys)] == ids[g])
        total += np.asarray(load)
    used = np.asarray(plan.phy2log) >= 0
    expected = np.zeros(num_physical, np.int64)
    log2phy, replica_load = np.asarray(plan.log2phy), np.asarray(plan.replica_load)
    valid = log2phy >= 0
    expected[log2phy[valid]] = replica_load[valid]
    np.testing.assert_array_equal(total, expected)
    assert np.all(total[~used] == 0)


@pytest.mark.parametrize("imbalance", [1.5, 2.0, 3.0])
def test_ultraep_setting_reaches_target(imbalance):
    """EP64, 256 experts, 4 home + 2 spare, top-8, 8192 tokens/rank: rank imbalance <= 1.01."""
    counts = zipf_counts(64, 256, 8192, 8, imbalance, seed=3)
    plan = _jitted(4, 2)(jnp.asarray(counts))
    rank_load = np.asarray(plan.rank_load)
    home = counts.sum(0).reshape(64, 4).sum(1)
    assert home.max() / home.mean() > imbalance - 0.1
    assert rank_load.max() / rank_load.mean() <= 1.01
    assert 0 < int(plan.replicas_used) <= 128
    np.testing.assert_array_equal(np.asarray(plan.quota).sum(2), counts)


def test_ample_spares_reach_the_mean(rng):
    """With enough spare slots the plan is optimal: max rank load == ceil(mean) (the LP bound)."""
    for _ in range(5):
        counts = _skewed_counts(rng, 4, 2)
        plan = _jitted(2, 4)(jnp.asarray(counts))
        assert int(plan.target) == -(-int(counts.sum()) // 4)


def test_too_few_spares_is_best_effort(rng):
    """One spare slot and a single very hot expert: no exception, the imbalance left is reported."""
    counts = rng.integers(1, 10, size=(4, 8)).astype(np.int32)
    counts[:, [0, 2, 4]] += 1000  # three hot ranks, one cold rank with a single spare slot
    plan = _jitted(2, 1)(jnp.asarray(counts))
    check_plan(plan, counts, 2, 1)
    assert float(plan.rank_imbalance) > 1.2
    no_spare = _jitted(2, 0)(jnp.asarray(counts))
    np.testing.assert_array_equal(np.asarray(no_spare.rank_load), counts.sum(0).reshape(4, 2).sum(1))
    assert int(no_spare.replicas_used) == 0


def test_bad_input():
    good = np.ones((4, 8), np.int32)
    with pytest.raises(ValueError, match="non-negative"):
        plan_quotas(np.where(np.arange(8) == 3, -1, good).astype(np.int32), num_home=2, num_spare=1)
    with pytest.raises(ValueError, match="E = G \\* num_home"):
        plan_quotas(good, num_home=3, num_spare=1)
    with pytest.raises(ValueError, match="integer"):
        plan_quotas(good.astype(np.float32), num_home=2, num_spare=1)
    with pytest.raises(ValueError, match="shape"):
        plan_quotas(good.reshape(-1), num_home=2, num_spare=1)
    with pytest.raises(ValueError, match="num_spare"):
        plan_quotas(good, num_home=2, num_spare=-1)
    with pytest.raises(ValueError, match="min_replica_tokens"):
        plan_quotas(good, num_home=2, num_spare=1, min_replica_tokens=0)
    # Counts int32 cannot hold, or whose sums it cannot hold, are refused, not wrapped into other counts.
    for dtype in (np.int64, np.uint32, np.uint64):
        with pytest.raises(ValueError, match=r"counts\[1, 5\] = 2147483648 does not fit"):
            plan_quotas(
                np.where((np.arange(4) == 1)[:, None] & (np.arange(8) == 5), 2**31, good.astype(np.int64)).astype(
                    dtype
                ),
                num_home=2,
                num_spare=1,
            )
        with pytest.raises(ValueError, match="sum to 2147483648 tokens"):  # each count fits, their total does not
            check_counts(np.full((4, 8), 2**26, dtype), num_home=2)
    assert check_counts(np.full((4, 8), (2**31 - 1) // 32, np.int64), num_home=2) is None  # a total just below 2**31
    # Traced negative counts never raise: they count as zero.
    negative = np.where(np.arange(8) == 3, -5, good).astype(np.int32)
    plan = _jitted(2, 1)(jnp.asarray(negative))
    np.testing.assert_array_equal(np.asarray(plan.quota).sum(2), np.maximum(negative, 0))


_CHILD = """
import hashlib, numpy as np, jax, jax.numpy as jnp
from moe_eplb_jax.routing import plan_quotas
from moe_eplb_jax.sim import zipf_counts
p = jax.jit(lambda c: plan_quotas(c, num_home=2, num_spare=2))(jnp.asarray(zipf_counts(8, 16, 512, 4, 2.0, seed=5)))
print(hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(p))).hexdigest())
"""


def test_deterministic_across_processes():
    plan = _jitted(2, 2)(jnp.asarray(zipf_counts(8, 16, 512, 4, 2.0, seed=5)))
    digest = hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(plan))).hexdigest()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip().splitlines()[-1] == digest


# --------------------------------------------------------------------------- every search == the reference


@functools.cache
def _planner(implementation, num_home, num_spare, min_replica_tokens, search_rounds, search_width, nested=False):
    fn = functools.partial(
        plan_quotas,
        num_home=num_home,
        num_spare=num_spare,
        implementation=implementation,
        min_replica_tokens=min_replica_tokens,
        search_rounds=search_rounds,
        search_width=search_width,
    )
    return jax.jit(jax.vmap(jax.vmap(fn)) if nested else fn)


def _both(num_home, num_spare, min_replica_tokens, search_rounds, search_width, nested=False):
    return tuple(
        _planner(impl, num_home, num_spare, min_replica_tokens, search_rounds, search_width, nested)
        for impl in ("xla", "pallas")
    )


# (4, 2, 2) x 1 round x 100: a grid split over 4 programs of 32 candidates (the one-round default's layout).
@pytest.mark.slow  # the search kernel in interpret mode
@pytest.mark.parametrize("implementation", SEARCH_IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "shape,min_tokens,rounds,width",
    [((4, 2, 2), 1, 2, 64), ((6, 3, 1), 40, 3, 16), ((5, 4, 3), 5, 1, 7), ((4, 2, 2), 1, 1, 100)],
)
def test_search_matches_reference(rng, implementation, shape, min_tokens, rounds, width):
    """One body for every search implementation (the Triton kernel in interpret mode on CPU): the numpy
    reference's plan for the same search grid, also under (nested) vmap."""
    num_ranks, num_home, num_spare = shape
    options = dict(num_home=num_home, num_spare=num_spare, min_replica_tokens=min_tokens)
    options.update(search_rounds=rounds, search_width=width)
    flat = _planner(implementation, num_home, num_spare, min_tokens, rounds, width)
    for _ in range(2):
        counts = _skewed_counts(rng, num_ranks, num_home)
        plan, want = flat(jnp.asarray(counts)), plan_quotas_reference(counts, **options)
        for field in FIELDS:
            np.testing.assert_array_equal(np.asarray(getattr(plan, field)), want[field], err_msg=field)
    nested = _planner(implementation, num_home, num_spare, min_tokens, rounds, width, nested=True)
    counts = np.stack([np.stack([_skewed_counts(rng, num_ranks, num_home) for _ in range(3)]) for _ in range(2)])
    plans = nested(jnp.asarray(counts))
    assert plans.rank_load.shape == (2, 3, num_ranks)
    for i, j in np.ndindex(2, 3):
        want = plan_quotas_reference(counts[i, j], **options)
        for field in FIELDS:
            np.testing.assert_array_equal(np.asarray(getattr(plans, field))[i, j], want[field], err_msg=field)


def test_bad_implementation():
    with pytest.raises(ValueError, match="implementation"):
        plan_quotas(np.ones((4, 8), np.int32), num_home=2, num_spare=1, implementation="cuda")


@pytest.mark.gpu
def test_pallas_plan_equals_xla_plan_on_gpu(rng):
    """On the GPU: the compiled Triton search equals the XLA search (UltraEP shape, other shapes, under vmap)."""
    from moe_eplb_jax.routing import quota

    counts = jnp.asarray(zipf_counts(64, 256, 8192, 8, 2.0, seed=7))
    plans = [
        jax.jit(functools.partial(plan_quotas, num_home=4, num_spare=2, implementation=impl))(counts)
        for impl in ("pallas", "xla")
    ]
    for field in FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(plans[0], field)), np.asarray(getattr(plans[1], field)))
    for shape, min_tokens, rounds, width in [
        ((4, 2, 2), 1, 2, 64),
        ((6, 3, 1), 40, 3, 16),
        ((5, 4, 3), 5, 1, 7),
        ((4, 2, 2), 1, 1, 100),
        ((8, 4, 2), 1, 1, 1024),
    ]:
        xla, pallas = _both(shape[1], shape[2], min_tokens, rounds, width, nested=True)
        batch = jnp.asarray(
            np.stack([np.stack([_skewed_counts(rng, shape[0], shape[1]) for _ in range(3)]) for _ in range(2)])
        )
        for a, b in zip(*(jax.tree_util.tree_leaves(p) for p in (xla(batch), pallas(batch)))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert quota._probe_pallas()


@pytest.fixture
def probes(monkeypatch):
    """A fresh record of probes and warnings, and defaults decided as on a GPU."""
    from moe_eplb_jax import _kernels

    monkeypatch.setattr(_kernels, "_PROBED", {})
    monkeypatch.setattr(_kernels, "_WARNED", set())
    monkeypatch.setattr(_kernels, "on_gpu", lambda: True)
    return _kernels


@pytest.mark.slow  # probes the kernel in interpret mode
def test_gpu_default_falls_back_to_xla_when_the_kernel_fails(probes, monkeypatch):
    """The GPU default is the Pallas search only if a probe plan from it equals the XLA plan; else the XLA search
    plans (the reference's plan), with exactly one warning per process."""
    from moe_eplb_jax.routing import _quota_search as quota_search
    from moe_eplb_jax.routing import quota

    assert quota.default_implementation() == "pallas"  # interpret mode here: compiles and agrees
    probes._PROBED.clear()

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(quota_search.api, "search_pallas", broken)
    counts = zipf_counts(4, 8, 256, 4, 2.0, seed=3)
    with pytest.warns(RuntimeWarning, match="plan_quotas: the Pallas kernel failed .*no kernel today") as caught:
        for _ in range(2):
            plan = plan_quotas(counts, num_home=2, num_spare=2)
            want = plan_quotas_reference(counts, num_home=2, num_spare=2)
            for field in FIELDS:
                np.testing.assert_array_equal(np.asarray(getattr(plan, field)), np.asarray(want[field]))
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1


@pytest.mark.slow  # plans once per config with the kernel in interpret mode
def test_search_config_is_checked_and_keeps_the_plan(rng):
    """The search kernel's lanes per program change nothing but how programs share the grid."""
    from moe_eplb_jax.routing import _quota_search

    with pytest.raises(ValueError, match="Config.lanes must be a power of two >= 16"):
        _quota_search.Config(lanes=24)
    load = jnp.asarray(_skewed_counts(rng, 4, 2).sum(0))
    kw = dict(num_home=2, num_spare=2, min_replica_tokens=1, max_replicas=8, search_rounds=1, search_width=100)
    plans = [_quota_search.search_pallas(load, config=_quota_search.Config(lanes=lanes), **kw) for lanes in (16, 128)]
    for a, b in zip(*plans):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

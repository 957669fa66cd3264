"""Placement policies: DeepSeek's algorithm (vectorised vs loop oracle), "balanced", slot preservation."""

import json
import pathlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from moe_eplb_jax import metrics, policy
from moe_eplb_jax.placement import Placement
from moe_eplb_jax.policy import _packing
from moe_eplb_jax.policy.balanced import refine_packing

GOLDEN = json.loads((pathlib.Path(__file__).parent / "data" / "deepseek_eplb_readme_case.json").read_text())
POLICIES = ["deepseek", "balanced"]

# (layers, experts, slots, groups, nodes, gpus): hierarchical, global (groups % nodes), one slot per GPU,
# one GPU per node, one node, no redundancy.
SHAPES = [
    (3, 12, 16, 4, 2, 8),
    (4, 16, 24, 4, 2, 4),
    (3, 16, 24, 4, 3, 6),
    (2, 8, 16, 2, 2, 16),
    (3, 16, 20, 4, 4, 4),
    (3, 16, 32, 1, 1, 8),
    (2, 12, 12, 3, 1, 4),
    (5, 32, 48, 8, 4, 16),
]


def _loads(rng, num_layers, num_experts, kind):
    if kind == "lognormal":
        return rng.lognormal(0.0, 1.0, (num_layers, num_experts))
    if kind == "integer":  # many exact ties, in loads and in loads per replica
        return rng.integers(1, 6, (num_layers, num_experts)).astype(np.float64)
    weight = rng.lognormal(0.0, 1.0, (num_layers, num_experts))  # some idle experts
    weight[rng.random(weight.shape) < 0.3] = 0.0
    return weight


def _rank_load(weight, phy2log, num_gpus):
    return metrics.rank_load_from_logical(weight, phy2log, num_gpus)


def _check_valid(tables, weight, num_replicas, num_groups, num_nodes, num_gpus):
    phy2log, log2phy, logcnt = tables
    num_layers, num_experts = weight.shape
    assert phy2log.shape == (num_layers, num_replicas) and phy2log.dtype == np.int32
    assert log2phy.shape == (num_layers, num_experts, num_replicas - num_experts + 1) and log2phy.dtype == np.int32
    assert logcnt.shape == (num_layers, num_experts) and logcnt.dtype == np.int32
    Placement.from_tables(phy2log, log2phy, logcnt, num_ranks=num_gpus)  # consistency of the three tables
    assert (logcnt >= 1).all() and (logcnt.sum(axis=1) == num_replicas).all()
    if num_groups % num_nodes == 0 and num_nodes > 1:  # hierarchical: each group's replicas on one node
        group_size = num_experts // num_groups
        node_of_slot = np.arange(num_replicas) // (num_replicas // num_nodes)
        for layer in range(num_layers):
            group_nodes = {}
            for slot, expert in enumerate(phy2log[layer]):
                group_nodes.setdefault(expert // group_size, set()).add(node_of_slot[slot])
            assert all(len(nodes) == 1 for nodes in group_nodes.values())
            node_groups = np.bincount([next(iter(n)) for n in group_nodes.values()], minlength=num_nodes)
            assert (node_groups == num_groups // num_nodes).all()


# ----------------------------------------------------------------------------- the DeepSeek algorithm
@pytest.mark.parametrize("fn", [policy.rebalance_experts, policy.rebalance_experts_reference])
def test_golden_readme_case(fn):
    phy2log, log2phy, logcnt = fn(
        np.array(GOLDEN["weight"]),
        GOLDEN["num_replicas"],
        GOLDEN["num_groups"],
        GOLDEN["num_nodes"],
        GOLDEN["num_gpus"],
    )
    np.testing.assert_array_equal(phy2log, GOLDEN["expected_phy2log"])
    np.testing.assert_array_equal(logcnt, GOLDEN["expected_logcnt"])
    Placement.from_tables(phy2log, log2phy, logcnt, num_ranks=GOLDEN["num_gpus"])
    # Replicas are listed in creation order: expert 1 of layer 0 got its second replica later (slot 13).
    np.testing.assert_array_equal(log2phy[0, 1, :2], [15, 13])


@pytest.mark.parametrize("kind", ["lognormal", "integer", "with_zeros"])
@pytest.mark.parametrize("shape", SHAPES)
def test_vectorised_equals_loop_reference(rng, shape, kind):
    num_layers, num_experts, num_replicas, num_groups, num_nodes, num_gpus = shape
    weight = _loads(rng, num_layers, num_experts, kind)
    args = (weight, num_replicas, num_groups, num_nodes, num_gpus)
    for got, want in zip(policy.rebalance_experts(*args), policy.rebalance_experts_reference(*args)):
        np.testing.assert_array_equal(got, want)


def test_vectorised_equals_loop_reference_deepseek_v3_shape(rng):
    weight = rng.lognormal(0.0, 1.0, (4, 256))
    for topology in [(8, 4, 32), (8, 3, 24)]:  # hierarchical, and global (8 groups on 3 nodes)
        args = (weight, 288, *topology)
        for got, want in zip(policy.rebalance_experts(*args), policy.rebalance_experts_reference(*args)):
            np.testing.assert_array_equal(got, want)


def test_balanced_packing_matches_definition(rng):
    weight = rng.integers(0, 5, (6, 12)).astype(np.float64)
    pack, rank = _packing.balanced_packing(weight, 3)
    for row in range(6):  # greedy by hand: heaviest first (stable), least-loaded pack with room
        load, count = [0.0] * 3, [0] * 3
        for item in sorted(range(12), key=lambda i: -weight[row, i]):
            best = min((p for p in range(3) if count[p] < 4), key=lambda p: load[p])
            assert (pack[row, item], rank[row, item]) == (best, count[best])
            load[best] += weight[row, item]
            count[best] += 1


@st.composite
def _problems(draw):
    num_nodes = draw(st.integers(1, 3))
    gpus_per_node = draw(st.integers(1, 3))
    num_groups = num_nodes * draw(st.integers(1, 3)) + draw(st.sampled_from([0, 0, 1]))  # sometimes global
    group_size = draw(st.integers(1, 4))
    num_experts = num_groups * group_size
    num_gpus = num_nodes * gpus_per_node
    slots_per_gpu = -(-num_experts // num_gpus) + draw(st.integers(0, 2))
    num_layers = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**32 - 1))
    kind = draw(st.sampled_from(["lognormal", "integer", "with_zeros"]))
    weight = _loads(np.random.default_rng(seed), num_layers, num_experts, kind)
    return weight, slots_per_gpu * num_gpus, num_groups, num_nodes, num_gpus


@given(_problems())
def test_properties_of_every_policy(problem):
    weight, num_replicas, num_groups, num_nodes, num_gpus = problem
    deepseek = policy.rebalance_experts(*problem)
    for got, want in zip(deepseek, policy.rebalance_experts_reference(*problem)):
        np.testing.assert_array_equal(got, want)
    balanced = policy.rebalance_balanced(*problem)
    for tables in (deepseek, balanced):
        _check_valid(tables, *problem)
    for name, tables in zip(POLICIES, (deepseek, balanced)):  # deterministic
        for got, want in zip(policy.get(name)(weight.copy(), num_replicas, num_groups, num_nodes, num_gpus), tables):
            np.testing.assert_array_equal(got, want)
    # "balanced": same replication, never a busier busiest GPU in any layer.
    np.testing.assert_array_equal(balanced[2], deepseek[2])
    ds_max = _rank_load(weight, deepseek[0], num_gpus).max(axis=1)
    bal_max = _rank_load(weight, balanced[0], num_gpus).max(axis=1)
    assert (bal_max <= ds_max * (1 + 1e-12)).all()
    # Any old placement of the same shape (here a random one): valid, and the same GPU loads.
    seed = int(weight.size * 7919 + num_replicas)
    old = np.random.default_rng(seed).integers(0, weight.shape[1], (weight.shape[0], num_replicas))
    for name, fresh in zip(POLICIES, (deepseek, balanced)):
        kept = policy.get(name)(*problem, old_phy2log=old)
        _check_kept(name, kept, fresh, old, *problem)


def _check_kept(name, kept, fresh, old, weight, num_replicas, num_groups, num_nodes, num_gpus):
    """What old_phy2log may change: valid, never less balanced per layer, never more slots moved."""
    _check_valid(kept, weight, num_replicas, num_groups, num_nodes, num_gpus)
    kept_load, fresh_load = _rank_load(weight, kept[0], num_gpus), _rank_load(weight, fresh[0], num_gpus)
    if name == "deepseek":  # the same GPU contents, relabelled
        np.testing.assert_array_equal(kept[2], fresh[2])
        np.testing.assert_allclose(np.sort(kept_load, axis=1), np.sort(fresh_load, axis=1))
    else:  # never less balanced than DeepSeek's fresh placement, in any layer
        deepseek = policy.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
        deepseek_max = _rank_load(weight, deepseek[0], num_gpus).max(axis=1)
        assert (kept_load.max(axis=1) <= deepseek_max * (1 + 1e-12)).all()
    assert policy.moved_slots(old, kept[0]) <= policy.moved_slots(old, fresh[0])


# ------------------------------------------------------------------------------------ "balanced"
@pytest.mark.parametrize("topology", [(8, 4, 32), (8, 3, 24), (1, 1, 16)])
def test_balanced_is_more_balanced_than_deepseek(rng, topology):
    weight = rng.lognormal(0.0, 1.0, (6, 64))
    deepseek = policy.rebalance_experts(weight, 96, *topology)
    balanced = policy.rebalance_balanced(weight, 96, *topology)
    _check_valid(balanced, weight, 96, *topology)
    ds = float(metrics.balancedness(_rank_load(weight, deepseek[0], topology[2])))
    bal = float(metrics.balancedness(_rank_load(weight, balanced[0], topology[2])))
    assert bal > ds


def test_refine_packing_lowers_the_busiest_pack(rng):
    item_load = rng.lognormal(0.0, 1.0, (20, 4, 5))
    order = refine_packing(item_load)
    assert (np.sort(order, axis=1) == np.arange(20)).all()  # a permutation of each row
    refined = _packing.gather_rows(item_load.reshape(20, -1), order).reshape(item_load.shape)
    assert (refined.sum(2).max(1) <= item_load.sum(2).max(1)).all()
    assert (refined.sum(2).max(1) < item_load.sum(2).max(1)).sum() >= 15
    # At the end no single swap with the busiest pack lowers the pair's larger load.
    for row in refined:
        loads = row.sum(1)
        top = loads.argmax()
        for other in range(4):
            gap = loads[top] - loads[other]
            delta = row[top][:, None] - row[other][None, :]
            assert not ((delta > 1e-9 * loads[top]) & (delta < gap - 1e-9 * loads[top])).any()


# -------------------------------------------------------------------------------- slot preservation
@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("topology", [(8, 4, 32), (8, 3, 24), (4, 2, 4)])
def test_unchanged_load_moves_nothing(rng, name, topology):
    weight = rng.lognormal(0.0, 1.0, (4, 64))
    fn = policy.get(name)
    first = fn(weight, 96, *topology)
    again = fn(weight, 96, *topology, old_phy2log=first[0])
    for got, want in zip(again, first):
        np.testing.assert_array_equal(got, want)
    assert policy.moved_slots(first[0], again[0]) == 0


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("topology", [(8, 4, 32), (8, 3, 24), (4, 2, 4)])
def test_perturbed_load_moves_fewer_slots(rng, name, topology):
    weight = rng.lognormal(0.0, 1.0, (8, 64))
    fn = policy.get(name)
    old = fn(weight, 96, *topology)[0]
    new_weight = weight * rng.lognormal(0.0, 0.3, weight.shape)
    fresh = fn(new_weight, 96, *topology)
    kept = fn(new_weight, 96, *topology, old_phy2log=old)
    _check_kept(name, kept, fresh, old, new_weight, 96, *topology)
    assert policy.moved_slots(old, kept[0]) < policy.moved_slots(old, fresh[0])


def test_balanced_grows_from_the_old_placement_under_small_drift(rng):
    weight = rng.lognormal(0.0, 1.0, (8, 64))
    old = policy.rebalance_balanced(weight, 96, 8, 4, 32)[0]
    new_weight = weight * rng.lognormal(0.0, 0.05, weight.shape)
    kept = policy.rebalance_balanced(new_weight, 96, 8, 4, 32, old_phy2log=old)
    relabelled = policy.rebalance_experts(new_weight, 96, 8, 4, 32, old_phy2log=old)
    # Far fewer moves than relabelling DeepSeek's fresh placement, and at least as balanced.
    assert policy.moved_slots(old, kept[0]) < policy.moved_slots(old, relabelled[0]) / 2
    assert float(metrics.balancedness(_rank_load(new_weight, kept[0], 32))) >= float(
        metrics.balancedness(_rank_load(new_weight, relabelled[0], 32))
    )


def test_slot_kept_when_its_expert_stays_on_the_gpu(rng):
    weight = rng.lognormal(0.0, 1.0, (6, 32))
    old = Placement.round_robin(6, 32, 48, 8).phy2log  # from another policy
    phy2log, _, _ = policy.rebalance_experts(weight, 48, 4, 2, 8, old_phy2log=old)
    for layer in range(6):
        for gpu in range(8):
            new_slots, old_slots = phy2log[layer, gpu * 6 : (gpu + 1) * 6], old[layer, gpu * 6 : (gpu + 1) * 6]
            remaining = list(new_slots)
            for slot, expert in enumerate(old_slots):  # multiset match: a kept expert keeps its slot
                if expert in remaining:
                    remaining.remove(expert)
                    assert new_slots[slot] == expert


def test_preserve_slots_only_reorders_within_gpus_and_relabels(rng):
    phy2log = np.stack([rng.permutation(np.arange(24) % 16) for _ in range(3)])
    phyrank = rng.integers(0, 3, phy2log.shape)
    old = np.stack([rng.permutation(np.arange(24) % 16) for _ in range(3)])
    new, rank = policy.preserve_slots(phy2log, phyrank, old, num_gpus=6, num_nodes=2)
    for layer in range(3):
        before = {
            tuple(sorted(zip(phy2log[layer, g * 4 : (g + 1) * 4], phyrank[layer, g * 4 : (g + 1) * 4])))
            for g in range(6)
        }
        after = {
            tuple(sorted(zip(new[layer, g * 4 : (g + 1) * 4], rank[layer, g * 4 : (g + 1) * 4]))) for g in range(6)
        }
        assert before == after  # every GPU's (expert, replica rank) contents survive, only relabelled


def test_preserve_slots_and_moved_slots_reject_bad_input():
    table = np.zeros((2, 8), dtype=np.int64)
    with pytest.raises(ValueError, match="old_phy2log must both have shape"):
        policy.preserve_slots(table, table, np.zeros((2, 9), np.int64), num_gpus=4)
    with pytest.raises(ValueError, match="non-negative integers"):
        policy.preserve_slots(table, table, table - 2, num_gpus=4)  # -1 is an empty slot
    with pytest.raises(ValueError, match="slots must divide"):
        policy.preserve_slots(table, table, table, num_gpus=3)
    with pytest.raises(ValueError, match="different shapes"):
        policy.moved_slots(table, table[:1])


# ---------------------------------------------------------------------------------------- registry
def test_registry_names():
    assert policy.get("deepseek") is policy.rebalance_experts
    assert policy.get("balanced") is policy.rebalance_balanced
    assert {"deepseek", "balanced"} <= set(policy.available())


# --------------------------------------------------------------------------------------- bad input
_GOOD = dict(num_replicas=16, num_groups=4, num_nodes=2, num_gpus=8)


def _bad_weight(value, where=(0, 3)):
    weight = np.random.default_rng(0).lognormal(0.0, 1.0, (2, 12))
    weight[where] = value
    return weight


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize(
    "weight, overrides, match",
    [
        (_bad_weight(np.nan), {}, "NaN"),
        (_bad_weight(-1.0), {}, "negative"),
        (_bad_weight(np.inf), {}, "infinite"),
        (_bad_weight(1e308, (0, slice(0, 3))), {}, "overflows"),
        (np.ones(12), {}, "2-D"),
        (np.ones((2, 3, 4)), {}, "2-D"),
        (np.ones((0, 12)), {}, "at least one"),
        (np.array([["a"] * 12] * 2), {}, "real numbers"),
        (np.ones((2, 12)), {"num_replicas": 8, "num_gpus": 4}, "smaller than the number of experts"),
        (np.ones((2, 12)), {"num_replicas": 18}, "not divisible by num_gpus"),
        (np.ones((2, 12)), {"num_groups": 8}, "not divisible by num_groups"),  # hierarchical: 8 groups, 2 nodes
        (np.ones((2, 12)), {"num_nodes": 4, "num_gpus": 2}, "not divisible by num_nodes"),
        (np.ones((2, 12)), {"num_replicas": 16.7}, "num_replicas must be an integer"),
        (np.ones((2, 12)), {"num_replicas": 16.0}, "num_replicas must be an integer"),
        (np.ones((2, 12)), {"num_gpus": True}, "num_gpus must be an integer"),
        (np.ones((2, 12), dtype=bool), {}, "real numbers"),
        (np.ones((2, 12)).astype(object), {}, "real numbers"),
        ([[1.0] * 12, [1.0] * 11], {}, "rectangular"),
        (np.ones((2, 12)), {"num_gpus": 0}, "num_gpus must be >= 1"),
        (np.ones((2, 12)), {"num_groups": 2.0}, "num_groups must be an integer"),
        (np.ones((2, 12)), {"old_phy2log": np.zeros((2, 15), np.int32)}, "old_phy2log must have shape"),
        (np.ones((2, 12)), {"old_phy2log": np.full((2, 16), 12)}, "outside the logical expert range"),
        (np.ones((2, 12)), {"old_phy2log": np.full((2, 16), -2)}, "outside the logical expert range"),
        (np.ones((2, 12)), {"old_phy2log": np.zeros((2, 16))}, "integer expert ids"),
    ],
)
def test_bad_input_raises(name, weight, overrides, match):
    with pytest.raises(ValueError, match=match):
        policy.get(name)(weight, **dict(_GOOD, **overrides))


# ----------------------------------------------------------- reference compatibility (DeepSeek, vLLM)
def _reference_accepts(num_experts, num_replicas, num_groups, num_nodes, num_gpus) -> bool:
    """The asserts DeepSeek's eplb.py (and vLLM's copy) make, after its switch to the global variant."""
    if num_groups % num_nodes:  # global: rebalance_experts_hierarchical(weight, P, 1, 1, G)
        num_groups = num_nodes = 1
    return (
        num_replicas >= num_experts
        and num_experts % num_groups == 0
        and num_groups % num_nodes == 0
        and num_gpus % num_nodes == 0
        and num_replicas % num_gpus == 0
    )


@given(
    num_layers=st.integers(1, 3),
    num_experts=st.integers(1, 12),
    num_groups=st.integers(1, 6),
    num_nodes=st.integers(1, 4),
    num_gpus=st.integers(1, 8),
    slots_per_gpu=st.integers(1, 6),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_input_the_reference_accepts_gives_the_reference_placement(
    num_layers, num_experts, num_groups, num_nodes, num_gpus, slots_per_gpu, seed
):
    weight = _loads(np.random.default_rng(seed), num_layers, num_experts, "with_zeros")
    args = (weight, num_gpus * slots_per_gpu, num_groups, num_nodes, num_gpus)
    if not _reference_accepts(num_experts, *args[1:]):
        for fn in (policy.rebalance_experts, policy.rebalance_balanced, policy.rebalance_experts_reference):
            with pytest.raises(ValueError):
                fn(*args)
        return
    want = policy.rebalance_experts_reference(*args)
    for got, expected in zip(policy.rebalance_experts(*args), want):
        np.testing.assert_array_equal(got, expected)
    if num_groups % num_nodes:  # the global variant, whatever the groups and nodes
        for got, expected in zip(want, policy.rebalance_experts_reference(weight, args[1], 1, 1, num_gpus)):
            np.testing.assert_array_equal(got, expected)
    balanced = policy.rebalance_balanced(*args)
    _check_valid(balanced, weight, args[1], num_groups, num_nodes, num_gpus)
    np.testing.assert_array_equal(balanced[2], want[2])  # same replication as DeepSeek's


def test_global_fallback_example_from_the_issue():
    # 4 experts in 3 groups on 2 nodes: 3 % 2 != 0, so DeepSeek and vLLM run the global policy and
    # never ask 4 experts to divide into 3 groups (nor 3 GPUs over 2 nodes).
    weight = np.array([[10.0, 1.0, 5.0, 2.0], [0.0, 3.0, 3.0, 9.0]])
    for num_gpus in (4, 3):
        for name in ("deepseek", "balanced"):
            tables = policy.get(name)(weight, 6 if num_gpus == 3 else 4, 3, 2, num_gpus)
            Placement.from_tables(*tables, num_ranks=num_gpus)
        got = policy.rebalance_experts(weight, 4, 3, 2, 4)
        for a, b in zip(got, policy.rebalance_experts_reference(weight, 4, 1, 1, 4)):
            np.testing.assert_array_equal(a, b)
    old = policy.rebalance_experts(weight, 8, 1, 1, 4)[0]
    tables = policy.rebalance_balanced(weight[::-1].copy(), 8, 3, 2, 4, old_phy2log=old)
    Placement.from_tables(*tables, num_ranks=4)


@pytest.mark.parametrize(
    "weight, args, match",
    [
        ([["a", "b", "c", "d"]], (8, 1, 1, 4), "real numbers"),
        (np.ones((2, 4)).astype(str), (8, 1, 1, 4), "real numbers"),
        (np.ones((0, 4)), (8, 1, 1, 4), "at least one"),
        (np.ones((2, 0)), (8, 1, 1, 4), "at least one"),
        ([], (8, 1, 1, 4), "2-D"),
        (np.ones((2, 4)), (8.5, 1, 1, 4), "num_replicas must be an integer"),
        (np.ones((2, 4)), (8, 1, 1, True), "num_gpus must be an integer"),
        (np.ones((2, 4)), (8, 1, 1, 3), "divisible"),
        (np.full((2, 4), np.nan), (8, 1, 1, 4), "NaN"),
    ],
)
def test_online_policy_rejects_bad_input_with_value_error(weight, args, match):
    with pytest.raises(ValueError, match=match):
        policy.get("online")(weight, *args)


def test_registry_rejects_non_string_names():
    with pytest.raises(ValueError, match="policy name must be a string"):
        policy.get(["deepseek"])
    with pytest.raises(ValueError, match="unknown placement policy"):
        policy.get("nope")
    assert policy.DEFAULT_POLICY in policy.available()


def test_preserve_slots_rejects_non_integer_topology():
    table = np.zeros((1, 4), np.int64)
    with pytest.raises(ValueError, match="num_gpus must be an integer"):
        policy.preserve_slots(table, table, table, num_gpus=2.0)
    with pytest.raises(ValueError, match="int32 range"):
        policy.preserve_slots(table + 2**40, table, table, num_gpus=2)


# ------------------------------------------------------------- fast paths of the vectorised packing
def _packing_by_definition(weight, num_packs):
    """One row at a time, as the loop reference packs: heaviest first (stable), least-loaded pack with room."""
    pack = np.empty(weight.shape, dtype=np.int64)
    rank = np.empty(weight.shape, dtype=np.int64)
    per_pack = weight.shape[1] // num_packs
    for row in range(weight.shape[0]):
        load, count = [0.0] * num_packs, [0] * num_packs
        for item in sorted(range(weight.shape[1]), key=lambda i: -weight[row, i]):
            best = min((p for p in range(num_packs) if count[p] < per_pack), key=lambda p: load[p])
            pack[row, item], rank[row, item] = best, count[best]
            load[best] += weight[row, item]
            count[best] += 1
    return pack, rank


@pytest.mark.parametrize("plain_python", [True, False])
@pytest.mark.parametrize("kind", ["lognormal", "one_heavy", "integer", "with_zeros", "near_ties"])
def test_balanced_packing_long_rows_match_definition(rng, monkeypatch, kind, plain_python):
    # 40 items on 4 packs, by rounds; rows whose rounds are not permutations finish in plain Python,
    # or (with no budget for that) item by item in numpy, then through the capacity check.
    if not plain_python:
        monkeypatch.setattr(_packing, "_PLAIN_PYTHON_VISITS", 0)
    weight = rng.lognormal(0.0, 1.0, (12, 40))
    if kind == "one_heavy":  # capacity binds: the capacity-blind run would overfill the light packs
        weight[:, 0] *= 1000.0
    elif kind == "integer":  # ties between loads, and rounds that are not permutations
        weight = rng.integers(1, 4, (12, 40)).astype(np.float64)
    elif kind == "with_zeros":
        weight[rng.random(weight.shape) < 0.4] = 0.0
    elif kind == "near_ties":  # loads that differ only in the last bits of the mantissa
        weight = 1.0 + rng.integers(0, 4, (12, 40)) * np.finfo(np.float64).eps
    pack, rank = _packing.balanced_packing(weight, 4)
    want_pack, want_rank = _packing_by_definition(weight, 4)
    np.testing.assert_array_equal(pack, want_pack)
    np.testing.assert_array_equal(rank, want_rank)


def test_sort_descending_is_stable_on_near_ties(rng):
    # Values that share all but their lowest mantissa bits, and exact ties.
    weight = 1.0 + rng.integers(0, 8, (5, 300)) * np.finfo(np.float64).eps
    weight[:, ::7] = 0.0
    order, sorted_weight = _packing.sort_descending(weight)
    np.testing.assert_array_equal(order, np.argsort(-weight, axis=1, kind="stable"))
    np.testing.assert_array_equal(sorted_weight, np.take_along_axis(weight, order, axis=1))


@pytest.mark.parametrize("kind", ["lognormal", "ratio_ties", "with_zeros"])
def test_replicate_matches_definition(rng, kind):
    weight = rng.lognormal(0.0, 1.0, (6, 10))
    if kind == "ratio_ties":  # weight / 2 of one expert equals another's weight: ties go to the lower index
        weight = rng.choice([1.0, 2.0, 3.0, 4.0, 6.0], (6, 10))
    elif kind == "with_zeros":
        weight[rng.random(weight.shape) < 0.5] = 0.0
    slot_expert, slot_rank, count = _packing.replicate(weight, 25)
    for row in range(6):
        cnt = [1] * 10
        for slot in range(10, 25):
            best = max(range(10), key=lambda e: (weight[row, e] / cnt[e], -e))
            assert (slot_expert[row, slot], slot_rank[row, slot]) == (best, cnt[best])
            cnt[best] += 1
        np.testing.assert_array_equal(count[row], cnt)
    np.testing.assert_array_equal(slot_expert[:, :10], np.broadcast_to(np.arange(10), (6, 10)))


@pytest.mark.parametrize("plain_python", [True, False])
def test_balanced_packing_random_shapes_match_definition(rng, monkeypatch, plain_python):
    if not plain_python:
        monkeypatch.setattr(_packing, "_PLAIN_PYTHON_VISITS", 0)
    for case in range(150):
        num_packs, per_pack = (int(v) for v in rng.integers(2, 7, 2))
        weight = rng.lognormal(0.0, float(rng.uniform(0.2, 2.0)), (40, num_packs * per_pack))
        if case % 3 == 1:  # ties everywhere; rows that leave the rounds early, with packs filling unevenly
            weight = rng.integers(0, 4, (40, num_packs * 3)).astype(np.float64)
        elif case % 3 == 2:
            weight[rng.random(weight.shape) < 0.4] = 0.0
        pack, rank = _packing.balanced_packing(weight, num_packs)
        want_pack, want_rank = _packing_by_definition(weight, num_packs)
        np.testing.assert_array_equal(pack, want_pack)
        np.testing.assert_array_equal(rank, want_rank)

"""Placements for a new EP size: valid for G' ranks, keeping what each device holds (host numpy only)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_eplb_jax import Placement, policy
from moe_eplb_jax import transport as eps
from moe_eplb_jax.metrics import balancedness, rank_load_from_logical


def network_rows(old, new, num_ranks, new_num_ranks, mapping, lost=()):
    """Rows the move must receive: per (new rank, layer), the experts its device did not hold."""
    per, new_per = old.shape[1] // num_ranks, new.shape[1] // new_num_ranks
    rows = 0
    for layer in range(old.shape[0]):
        for r_new in range(new_num_ranks):
            held = set()
            for r in np.flatnonzero(mapping == r_new):
                if r not in lost:
                    held |= set(old[layer, r * per : (r + 1) * per].tolist())
            rows += len(set(new[layer, r_new * new_per : (r_new + 1) * new_per].tolist()) - held)
    return rows


@st.composite
def problems(draw):
    num_ranks, new_num_ranks = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    experts = num_ranks * draw(st.integers(1, 4))
    slots = experts + num_ranks * draw(st.integers(0, 2))
    least = max(experts, 1)
    new_slots = new_num_ranks * draw(st.integers(-(-least // new_num_ranks), -(-least // new_num_ranks) + 2))
    lost = draw(st.sets(st.integers(0, num_ranks - 1), max_size=num_ranks - 1))
    seed = draw(st.integers(0, 2**31 - 1))
    name = draw(st.sampled_from(["fill", "balanced", "deepseek", "online"]))
    return num_ranks, new_num_ranks, experts, slots, new_slots, sorted(lost), seed, name


@settings(max_examples=40)
@given(problems())
def test_resized_placement_is_valid_and_fill_keeps_every_carried_slot(problem):
    num_ranks, new_num_ranks, experts, slots, new_slots, lost, seed, name = problem
    rng = np.random.default_rng(seed)
    layers = 2
    weight = rng.lognormal(0, 1, (layers, experts))
    old = policy.get("balanced")(weight, slots, 1, 1, num_ranks)[0]
    if name == "online" and experts % new_num_ranks:
        with pytest.raises(ValueError, match="divisible"):
            policy.resize_placement(weight, old, num_ranks=num_ranks, new_num_ranks=new_num_ranks, policy=name)
        return
    placement = policy.resize_placement(
        weight,
        old,
        num_ranks=num_ranks,
        new_num_ranks=new_num_ranks,
        new_num_physical=new_slots,
        policy=name,
        lost_ranks=lost,
    )
    placement.validate(num_ranks=new_num_ranks)
    assert placement.phy2log.shape == (layers, new_slots) and (placement.logcnt >= 1).all()
    carried = policy.carry_phy2log(old, num_ranks, new_num_ranks, new_slots, lost_ranks=lost)
    mapping = policy.rank_map(num_ranks, new_num_ranks, lost_ranks=lost)
    moved = network_rows(old, placement.phy2log, num_ranks, new_num_ranks, mapping, lost)
    holes = int((carried < 0).sum())
    if name == "fill":  # carried slots stay (but those that must make room for an expert no slot holds)
        kept = carried >= 0
        absent = [experts - np.unique(row[row >= 0]).size for row in carried]
        room = sum(max(0, a - int((row < 0).sum())) for a, row in zip(absent, carried))
        assert int((placement.phy2log != carried)[kept].sum()) == room
        assert moved <= holes + room
    # the plan moves exactly these rows (or names the experts only lost ranks held)
    missing = eps.missing_experts(old, num_ranks, placement.phy2log, lost_ranks=lost)
    plan = eps.plan_resize(
        old, placement.phy2log, num_ranks, new_num_ranks, new_rank_of_old=mapping, lost_ranks=lost, reload=True
    )
    assert plan.rows_moved + int(plan.reload_count.sum()) == moved
    assert int(plan.reload_count.sum()) >= len(missing)


def test_carry_keeps_each_device_s_experts_in_its_new_rank():
    old = np.array([[0, 1, 2, 3, 4, 5, 0, 1]])  # 4 ranks of 2 slots
    np.testing.assert_array_equal(
        policy.carry_phy2log(old, 4, 2, 6), [[0, 1, -1, 2, 3, -1]]
    )  # ranks 0, 1 stay (3 slots each now); 2, 3 leave
    np.testing.assert_array_equal(
        policy.carry_phy2log(old, 4, 3, 6, lost_ranks=[1]), [[0, 1, 4, 5, 0, 1]]
    )  # survivors 0, 2, 3 become ranks 0, 1, 2
    np.testing.assert_array_equal(
        policy.carry_phy2log(old, 4, 3, 9, new_rank_of_old=[-1, 2, 0, -1]), [[4, 5, -1, -1, -1, -1, 2, 3, -1]]
    )
    # fewer slots per rank: distinct experts first, positions kept where they fit
    np.testing.assert_array_equal(policy.carry_phy2log(np.array([[7, 7, 8, 9]]), 1, 2, 4), [[7, 8, -1, -1]])
    np.testing.assert_array_equal(policy.carry_phy2log(np.array([[3, 3, 3, 4]]), 1, 2, 4), [[3, 4, -1, -1]])


def test_same_size_resize_is_the_policy_with_the_old_placement(rng):
    weight = rng.lognormal(0, 1, (3, 16))
    old = policy.get("balanced")(weight, 24, 1, 1, 4)[0]
    drifted = weight * rng.uniform(0.8, 1.2, weight.shape)
    for name in ("balanced", "deepseek"):
        got = policy.resize_placement(drifted, old, num_ranks=4, new_num_ranks=4, policy=name)
        want = policy.get(name)(drifted, 24, 1, 1, 4, old_phy2log=old)
        np.testing.assert_array_equal(got.phy2log, want[0])
    assert (
        policy.resize_placement(weight, old, num_ranks=4, new_num_ranks=4, policy="fill").phy2log.tolist()
        == old.tolist()
    )


def test_8_to_7_fill_moves_only_the_leaving_rank_and_policies_stay_balanced(rng):
    layers, experts, slots = 4, 48, 56
    weight = rng.lognormal(0, 1, (layers, experts))
    old = policy.get("balanced")(weight, slots, 1, 1, 8)[0]
    mapping = policy.rank_map(8, 7)
    results = {}
    for name in ("fill", "balanced", "deepseek"):
        new = policy.resize_placement(weight, old, num_ranks=8, new_num_ranks=7, policy=name).phy2log
        loads = rank_load_from_logical(weight, new, 7)
        results[name] = (network_rows(old, new, 8, 7, mapping), float(balancedness(loads)))
    fresh = policy.get("balanced")(weight, slots, 1, 1, 7)[0]
    assert results["fill"][0] <= layers * 7  # the leaving rank's slots
    assert results["balanced"][0] < network_rows(old, fresh, 8, 7, mapping)  # carrying beats a fresh solve
    assert results["balanced"][1] >= float(balancedness(rank_load_from_logical(weight, fresh, 7))) - 0.01
    assert results["balanced"][1] > 0.97


def test_every_expert_on_a_lost_rank_with_no_replica_is_placed_again(rng):
    weight = rng.lognormal(0, 1, (2, 8))
    old = np.array([np.arange(8), np.arange(8)[::-1]])  # no replicas: rank 1's experts exist nowhere else
    for name in ("fill", "balanced"):
        placement = policy.resize_placement(weight, old, num_ranks=2, new_num_ranks=1, policy=name, lost_ranks=[1])
        assert (placement.logcnt == 1).all()
        np.testing.assert_array_equal(
            eps.missing_experts(old, 2, placement.phy2log, lost_ranks=[1]),
            [[0, 4], [0, 5], [0, 6], [0, 7], [1, 0], [1, 1], [1, 2], [1, 3]],
        )


def test_empty_slots_in_old_phy2log_are_free_for_every_policy(rng):
    weight = rng.lognormal(0, 1, (2, 8))
    old = policy.get("balanced")(weight, 12, 1, 1, 4)[0]
    holes = old.copy()
    holes[:, 3:6] = -1  # rank 1 is new
    for name in ("balanced", "deepseek", "online"):
        tables = policy.get(name)(weight, 12, 1, 1, 4, old_phy2log=holes)
        Placement.from_tables(*tables, num_ranks=4)
    with pytest.raises(ValueError, match="outside the logical expert range"):
        policy.get("balanced")(weight, 12, 1, 1, 4, old_phy2log=np.full((2, 12), -2))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(new_num_ranks=0), "new_num_ranks must be >= 1"),
        (dict(new_num_physical=13), "not divisible by new_num_ranks"),
        (dict(new_num_physical=4), "new_num_physical must be >= 8"),
        (dict(lost_ranks=[4]), "lost_ranks entry must be <= 3"),
        (dict(lost_ranks=[0], new_rank_of_old=[0, 1, -1, -1]), "old rank 0 is lost"),
        (dict(new_rank_of_old=[0, 0, -1, -1]), "names a new rank twice"),
        (dict(new_rank_of_old=[0, 5, -1, -1]), r"new_rank_of_old\[1\] = 5"),
        (dict(new_rank_of_old=[0, 1]), "4 integers"),
        (dict(policy="nope"), "unknown placement policy"),
        (dict(num_ranks=5), "not divisible by num_ranks 5"),
        (dict(old_phy2log=np.zeros((3, 12), np.int64)), "3 layers but weight has 2"),
        (dict(old_phy2log=np.full((2, 12), 9)), "outside the logical expert range"),
    ],
)
def test_bad_input_raises(kwargs, match, rng):
    weight = rng.lognormal(0, 1, (2, 8))
    old = policy.get("balanced")(weight, 12, 1, 1, 4)[0]
    args = dict(weight=weight, old_phy2log=old, num_ranks=4, new_num_ranks=2) | kwargs
    with pytest.raises(ValueError, match=match):
        policy.resize_placement(**args)

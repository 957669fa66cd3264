"""Bad input to the public functions of placements, metrics, routing, quantization and load recording.

The classes of issue 31 each have a test here: integers that would wrap in an
int32 cast, types that pass as others (a bool as an int, 16.7 as 16, "no" as
true), tables that disagree with their sizes. Each must raise ``ValueError``
naming the argument; where a function also runs under ``jit``, the concrete
check is made outside it.
"""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

from moe_eplb_jax import EplbConfig, Placement, metrics, policy, quant
from moe_eplb_jax import state as eplb_state
from moe_eplb_jax.placement import build_log2phy
from moe_eplb_jax.policy.online import fill_unused_spares
from moe_eplb_jax.routing.lp import lp_shares, lp_shares_reference, shares_rank_load
from moe_eplb_jax.routing.waterfill import waterfill_assign, waterfill_shares


def _wrapping_to(valid: int):
    """int64 values an int32 cast turns into ``valid``: ``valid + k * 2**32``, ``k != 0``."""
    return st.integers(-(2**30) + 1, 2**30).filter(bool).map(lambda k: valid + k * 2**32)


# --------------------------------------------------------------------------------- integers that wrap
@given(data=st.data(), layer=st.integers(0, 1), slot=st.integers(0, 5))
def test_placement_tables_never_wrap_wide_integers(data, layer, slot):
    good = Placement.linear(2, 4, 6)
    phy2log = good.phy2log.astype(np.int64)
    phy2log[layer, slot] = data.draw(_wrapping_to(int(good.phy2log[layer, slot])))
    with pytest.raises(ValueError, match="phy2log"):
        Placement.from_phy2log(phy2log, 4)
    with pytest.raises(ValueError, match="phy2log"):
        Placement.from_tables(phy2log, good.log2phy, good.logcnt)
    logcnt = good.logcnt.astype(np.int64)
    logcnt[layer, slot % 4] = data.draw(_wrapping_to(int(good.logcnt[layer, slot % 4])))
    with pytest.raises(ValueError, match="logcnt"):
        Placement.from_tables(good.phy2log, good.log2phy, logcnt)


@given(value=st.one_of(st.integers(2**31, 2**63 - 1), _wrapping_to(5).filter(lambda v: v > 0)), index=st.integers(0, 7))
def test_record_never_wraps_wide_counts(value, index):
    state = eplb_state.init_state(EplbConfig(window_size=2), num_layers=2, num_physical=4)
    load = np.zeros((2, 4), np.int64)
    load.reshape(-1)[index] = value
    with pytest.raises(ValueError, match=r"load\[.*\] = .* token count"):
        eplb_state.record(state, load)
    load.reshape(-1)[index] = -1
    with pytest.raises(ValueError, match="token count"):
        eplb_state.record(state, load)


def test_record_accepts_what_fits_and_refuses_other_types():
    state = eplb_state.init_state(EplbConfig(window_size=2), num_layers=1, num_physical=2)
    state = eplb_state.record(state, np.array([[2**31 - 1, 0]], np.int64))
    assert int(state.pass_load[0, 0]) == 2**31 - 1
    for bad, match in (
        (np.array([[1.0, 2.0]]), "integer token counts"),
        (np.array([[True, False]]), "integer token counts"),
        ([["1", "2"]], "integer token counts"),
        (np.zeros((2, 2), np.int32), "shape"),
    ):
        with pytest.raises(ValueError, match=match):
            eplb_state.record(state, bad)
    with pytest.raises(ValueError, match="EplbState"):
        eplb_state.record({"pass_load": 0}, np.zeros((1, 2), np.int32))


def test_window_logical_load_sums_past_int32():
    cfg = EplbConfig(window_size=4)
    state = eplb_state.init_state(cfg, num_layers=1, num_physical=2)
    for _ in range(4):  # 4 * 2**30 tokens on slot 0: an int32 sum wraps to 0
        state = eplb_state.end_step(eplb_state.record(state, np.array([[2**30, 1]], np.int32)))
    logical = np.asarray(eplb_state.window_logical_load(state, np.array([[0, 1]]), 2))
    np.testing.assert_allclose(logical, [[4.0 * 2**30, 4.0]], rtol=1e-7)


@pytest.mark.parametrize(
    "phy2log, num_logical, match",
    [
        (np.array([[0, 3]]), 3, r"phy2log\[0, 1\] = 3 is outside"),
        (np.array([[0, -1]]), 3, "outside"),
        (np.array([[0, 2**32 + 1]], np.int64), 3, "outside"),  # would wrap to expert 1
        (jnp.array([[0, 5]]), 3, "outside"),
        (np.array([[0.0, 1.0]]), 3, "integer expert ids"),
        (np.array([[0, 1]]), True, "num_logical must be an integer"),
        (np.array([[0, 1]]), 2.5, "num_logical must be an integer"),
        (np.array([[0, 1, 1]]), 2, "shape"),
    ],
)
def test_window_logical_load_checks_concrete_ids(phy2log, num_logical, match):
    state = eplb_state.init_state(EplbConfig(window_size=2), num_layers=1, num_physical=2)
    state = eplb_state.end_step(eplb_state.record(state, np.array([[3, 4]], np.int32)))
    with pytest.raises(ValueError, match=match):
        eplb_state.window_logical_load(state, phy2log, num_logical)
    # Under jit the ids are assumed valid (documented); the jitted call still traces.
    if match == "outside" and phy2log.dtype != np.int64:
        jax.jit(eplb_state.window_logical_load, static_argnums=2)(state, jnp.asarray(phy2log), num_logical)


@given(data=st.data(), rank=st.integers(0, 1))
def test_waterfill_candidates_never_wrap(data, rank):
    candidates = np.zeros((3, 2), np.int64)
    candidates[1, 1] = data.draw(_wrapping_to(rank))  # an int32 cast makes it a valid rank id
    with pytest.raises(ValueError, match="candidates must be rank ids"):
        waterfill_assign(candidates, np.array([1.0, 2.0]))


def test_placement_conversions_never_wrap():
    good = Placement.linear(1, 2, 3)
    wide = Placement(good.phy2log.astype(np.int64) + np.array([[0, 0, 2**32]]), good.log2phy, good.logcnt)
    for convert in (wide.to_numpy, wide.to_jax):
        with pytest.raises(ValueError, match="int32"):
            convert()
    with pytest.raises(ValueError, match="outside the logical expert range"):
        wide.save("p.json")  # validated before any conversion: the file never holds the wrapped id


# ------------------------------------------------------------------------------ types passing as others
@pytest.mark.parametrize("dummy", ["no", "", 0, 1, None, np.array([True, False])])
def test_end_step_dummy_must_be_a_bool(dummy):
    state = eplb_state.init_state(EplbConfig(window_size=2), num_layers=1, num_physical=2)
    with pytest.raises(ValueError, match="dummy must be True, False"):
        eplb_state.end_step(state, dummy=dummy)


def test_end_step_accepts_bools_and_traced_flags():
    state = eplb_state.init_state(EplbConfig(window_size=2), num_layers=1, num_physical=2)
    state = eplb_state.end_step(state, dummy=np.bool_(True))
    state = jax.jit(eplb_state.end_step)(state, dummy=jnp.asarray(False))
    assert int(state.step) == 2 and int(state.window_filled) == 1


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: Placement.linear(True, 4, 6), "num_layers must be an integer"),
        (lambda: Placement.linear(2, 4, 6.0), "num_physical must be an integer"),
        (lambda: Placement.linear(2, 4, 6, num_ranks=True), "num_ranks must be an integer"),
        (lambda: Placement.round_robin(1, 8, 8, 4.0), "num_ranks must be an integer"),
        (lambda: Placement.from_phy2log([[0, 1]], 16.7), "num_logical must be an integer"),
        (lambda: Placement.from_phy2log([[0, 1]], True), "num_logical must be an integer"),
        (lambda: Placement.from_phy2log([[0, "1"]], 2), "must hold integers"),
        (lambda: Placement.from_phy2log([[0, 1], [0]], 2), "rectangular"),
        (lambda: Placement.from_phy2log([[0.5, 1]], 2), "must hold integers"),
        (lambda: Placement.from_phy2log([[True, False]], 2), "must hold integers"),
        (lambda: Placement(np.zeros((1, 2)), np.zeros((1, 2, 1)), np.ones((1, 2))).validate(), "must hold integers"),
        (lambda: Placement.linear(2, 4, 6).slots_per_rank(True), "num_ranks must be an integer"),
        (lambda: Placement.linear(2, 4, 6).layer(2), "index must be <= 1"),
        (lambda: Placement.linear(2, 4, 6).layer(True), "index must be an integer"),
        (lambda: Placement.load("p.json", num_ranks=True), "num_ranks must be an integer"),
        (lambda: metrics.rank_load(np.ones(4), True), "num_ranks must be an integer"),
        (lambda: metrics.rank_load(np.ones(4), 2.0), "num_ranks must be an integer"),
        (lambda: metrics.rank_load(np.array(["1", "2"]), 2), "must hold numbers"),
        (lambda: metrics.rank_load(np.ones(4, bool), 2), "must hold numbers"),
        (lambda: metrics.balancedness(np.array([[1.0, np.nan]])), "finite and non-negative"),
        (lambda: metrics.balancedness(np.array([[1.0, -2.0]])), "finite and non-negative"),
        (lambda: metrics.rank_imbalance(np.zeros((2, 0))), "non-empty"),
        (lambda: metrics.slot_load_from_logical(np.ones((1, 3)), np.array([[0, 1, 3]])), r"phy2log\[0, 2\] = 3"),
        (lambda: metrics.slot_load_from_logical(jnp.ones((1, 3)), jnp.array([[0, 1, -1]])), "outside"),
        (lambda: metrics.slot_load_from_logical(np.ones((1, 3)), np.array([[0.0, 1.0]])), "integer expert ids"),
        (lambda: metrics.slot_load_from_logical(np.ones((2, 3)), np.zeros((3, 4), int)), "shape"),
        (lambda: waterfill_assign(np.zeros((2, 1), int), np.ones(2), min_tokens=True), "min_tokens must be"),
        (lambda: waterfill_assign(np.zeros((2, 1)), np.ones(2)), "must be integers"),
        (lambda: waterfill_assign(np.zeros((2, 1), int), np.ones(2), token_offset=-1), "token_offset"),
        (lambda: waterfill_shares(np.array([1.0, np.nan]), 4.0), "finite"),
        (lambda: waterfill_shares(np.ones(2), -4.0), "non-negative"),
        (lambda: waterfill_shares(np.array(["a", "b"]), 4.0), "must hold numbers"),
        (lambda: waterfill_shares(np.ones(0), 4.0), "G >= 1"),
        (lambda: quant.quantize_experts(jnp.ones((1, 16, 16)), "fp8_block", block_size=(8.5, 8)), "block_size"),
        (lambda: quant.quantize_experts(jnp.ones((1, 16, 16)), "fp8_block", block_size=(True, 8)), "block_size"),
        (lambda: quant.quantize_experts(jnp.ones((1, 16, 16)), "fp8_block", block_size=8), "block_size"),
        (lambda: quant.quantize_experts(jnp.ones((1, 16, 16)), "fp8", input_scale=True), "input_scale"),
        (lambda: quant.quantize_experts(jnp.ones((1, 16, 16)), "fp8", weight_scale="1"), "weight_scale"),
        (lambda: fill_unused_spares(np.array([0, -1, 1, -1]), np.ones(3), 1, 1), "weight must be numbers"),
        (lambda: fill_unused_spares(np.array([0, -1, 5, -1]), np.ones(2), 1, 1), "outside"),
        (lambda: fill_unused_spares(np.array([0.0, -1.0]), np.ones(1), 1, 1), "integer ids"),
        (lambda: fill_unused_spares(np.array([0, -1]), np.ones(1), 1, 1.0), "num_spare must be an integer"),
        (lambda: build_log2phy(np.array([[0, 2]]), 2), "outside"),
        (lambda: build_log2phy(np.array([[0, 1]]), 2.0), "num_logical must be an integer"),
    ],
)
def test_types_that_pass_as_others_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _lp_inputs():
    log2phy = np.array([[0, 2], [1, -1]])
    logcnt = np.array([2, 1])
    return np.array([4.0, 2.0]), log2phy, logcnt


@pytest.mark.parametrize(
    "change, match",
    [
        ({"num_ranks": True}, "num_ranks must be an integer"),
        ({"num_physical": 4.0}, "num_physical must be an integer"),
        ({"num_iters": 2.5}, "num_iters must be an integer"),
        ({"step_size": float("nan")}, "step_size must be finite"),
        ({"step_size": -1.0}, "step_size must be positive"),
        ({"load": np.array([np.nan, 1.0])}, "finite and non-negative"),
        ({"load": np.array([np.inf, 1.0])}, "finite and non-negative"),
        ({"load": np.array(["4", "2"])}, "load must hold numbers"),
        ({"logcnt": np.array([1.5, 1.0])}, "logcnt must hold integers"),
        ({"log2phy": np.array([[0.0, 2.0], [1.0, -1.0]])}, "log2phy must hold integers"),
        ({"log2phy": np.array([[0, 2**32 + 2], [1, -1]], np.int64)}, "outside"),
        ({"log2phy": np.zeros((0, 2), int), "load": np.zeros(0), "logcnt": np.zeros(0, int)}, r"\[E, S\]"),
    ],
)
def test_lp_routing_checks_every_argument(change, match):
    load, log2phy, logcnt = _lp_inputs()
    args = dict(load=load, log2phy=log2phy, logcnt=logcnt, num_physical=4, num_ranks=2)
    args.update(change)
    options = {k: args.pop(k) for k in ("num_iters", "step_size") if k in args}
    with pytest.raises(ValueError, match=match):
        lp_shares(args.pop("load"), args.pop("log2phy"), args.pop("logcnt"), **args, **options)
    if not options:
        args = dict(load=load, log2phy=log2phy, logcnt=logcnt, num_physical=4, num_ranks=2)
        args.update(change)
        with pytest.raises(ValueError, match=match):
            lp_shares_reference(args.pop("load"), args.pop("log2phy"), args.pop("logcnt"), **args)


def test_shares_rank_load_checks_its_tables():
    load, log2phy, logcnt = _lp_inputs()
    shares = np.array([[0.5, 0.5], [1.0, 0.0]])
    np.testing.assert_allclose(shares_rank_load(load, log2phy, logcnt, shares, num_physical=4, num_ranks=2), [4, 2])
    with pytest.raises(ValueError, match="shares must have the shape"):
        shares_rank_load(load, log2phy, logcnt, shares[:, :1], num_physical=4, num_ranks=2)
    with pytest.raises(ValueError, match="num_ranks must be an integer"):
        shares_rank_load(load, log2phy, logcnt, shares, num_physical=4, num_ranks=2.0)


def test_expert_mlp_flags_are_typed():
    x = jnp.ones((2, 3, 32), jnp.float32)
    gate = up = jnp.ones((2, 32, 32), jnp.float32)
    with pytest.raises(ValueError, match="fast_accumulation must be True or False"):
        quant.expert_mlp(x, gate, up, gate, fast_accumulation="no")
    with pytest.raises(ValueError, match="compute_dtype must be a float dtype"):
        quant.expert_mlp(x, gate, up, gate, compute_dtype=jnp.int8)
    with pytest.raises(ValueError, match="compute_dtype must be a float dtype"):
        quant.expert_mlp(x, gate, up, gate, compute_dtype="not a dtype")
    with pytest.raises(ValueError, match="w_down"):
        quant.quantize_mlp(gate, up, jnp.ones((2, 32, 16), jnp.float32), "mxfp8")


# ------------------------------------------------------------------------------------------ overflow
def test_metrics_ratios_do_not_overflow():
    loads = np.array([[1e308, 1e308, 5e307, 1e308], [1e308, 1e308, 1e308, 1e308]])
    expected = (loads / 1e308).mean(1).sum() / (loads / 1e308).max(1).sum()
    assert float(metrics.balancedness(loads)) == pytest.approx(expected)
    np.testing.assert_allclose(metrics.rank_imbalance(loads), [1.0 / 0.875, 1.0])
    near_max = jnp.asarray(loads / 1e308 * 3e38, jnp.float32)  # float32 sums of these overflow
    assert float(metrics.balancedness(near_max)) == pytest.approx(expected, rel=1e-6)
    np.testing.assert_allclose(np.asarray(metrics.rank_imbalance(near_max)), [1.0 / 0.875, 1.0], rtol=1e-6)


# ------------------------------------------------------------------------ the edges of the runtime
HUGE = 10**5000 - 1  # Python refuses to print it: an error message must still name the field


def _policy_call(name, weight, num_replicas):
    return lambda: policy.get(name)(weight, num_replicas, 1, 1, 1)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: eplb_state.init_state(EplbConfig(), 2.0, 8), "num_layers must be an integer"),
        (lambda: eplb_state.init_state(EplbConfig(), "2", 8), "num_layers must be an integer"),
        (lambda: eplb_state.init_state(EplbConfig(), 2, 8.0), "num_physical must be an integer"),
        (lambda: eplb_state.init_state(EplbConfig(), 2, 10**12), "num_physical must be <= 2147483647"),
        (lambda: eplb_state.init_state(EplbConfig(), HUGE, 8), "num_layers must be <= .*5000 digits"),
        (lambda: eplb_state.init_state(EplbConfig(), 2, 8, per_rank="yes"), "per_rank must be True or False"),
        (lambda: eplb_state.init_state("config", 2, 8), "config must be an EplbConfig"),
        # a window of petabytes: a size check naming the field, not RESOURCE_EXHAUSTED from the allocator
        (lambda: eplb_state.init_state(EplbConfig(window_size=2**31 - 1), 2**20, 2**20), "EplbConfig.window_size"),
        (lambda: policy.compute_placement(np.ones((2, 4)), "balanced"), "config must be an EplbConfig"),
        (lambda: policy.compute_placement([["a", "b"]], EplbConfig()), "logical_load"),
        (lambda: EplbConfig().num_physical(10**12), "num_logical must be <= 2147483647"),
        (lambda: EplbConfig(num_redundant_experts=2**31 - 1).num_physical(8), "num_redundant_experts"),
        (lambda: Placement.linear(2, 4, 10**12), "num_physical must be <= 2147483647"),
        (lambda: Placement.round_robin(2, 4, 10**12, 2), "num_physical must be <= 2147483647"),
        (lambda: Placement.linear(1, 2**20, 2**31 - 1), "a placement of L=1 layers, E=1048576 experts"),
        (lambda: Placement.from_phy2log([[0, 1]], 10**12), "num_logical must be <= 2147483647"),
        (
            lambda: lp_shares(
                np.ones(4), np.arange(4)[:, None], np.ones(4, np.int32), num_physical=10**12, num_ranks=1
            ),
            "num_physical must be <= 2147483647",
        ),
        (_policy_call("deepseek", np.ones((1, 4)), 10**12), "num_replicas must be <= 2147483647"),
        (_policy_call("balanced", np.ones((1, 4)), 10**12), "num_replicas must be <= 2147483647"),
        (_policy_call("online", np.ones((1, 4)), 10**12), "num_replicas must be <= 2147483647"),
        (_policy_call("deepseek", np.ones((1, 2**16)), 2**31 - 1), "a placement of L=1 layers"),
        (_policy_call("balanced", np.ones((1, 2**16)), 2**31 - 1), "a placement of L=1 layers"),
        (_policy_call("online", np.ones((1, 2**16)), 2**31 - 2**15), "a placement of L=1 layers"),
    ],
)
def test_sizes_past_int32_or_memory_are_value_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_map_and_count_refuses_slot_counts_past_int32():
    from moe_eplb_jax.routing import map_and_count

    p = Placement.linear(1, 4, 4)
    with pytest.raises(ValueError, match=r"num_physical \(1000000000000\) must be <= 2\*\*31 - 1"):
        map_and_count(jnp.zeros((4, 2), jnp.int32), p.log2phy[0], p.logcnt[0], num_physical=10**12)


def test_validate_placements_memory_follows_the_slots_not_the_largest_id():
    """An id of 10**12 is refused by its range; a valid pair of placements still checks membership per layer."""
    from moe_eplb_jax.transport import validate_placements

    with pytest.raises(ValueError, match=r"old_phy2log\[0, 1\] = 1000000000000 is outside the expert id range"):
        validate_placements(np.array([[0, 10**12]]), np.array([[0, 1]]), 2)
    big = 2**31 - 1  # the largest int32 id: [L, id + 1] would be 2 GiB of bools
    old, new = np.array([[big, 5, 7, 5]]), np.array([[5, big, 5, 7]])
    assert validate_placements(old, new, 2)[0].tolist() == old.tolist()
    with pytest.raises(ValueError, match=r"new_phy2log\[0, 3\] = 6 names an expert that no slot"):
        validate_placements(old, np.array([[5, big, 5, 6]]), 2)
    with pytest.raises(ValueError, match=r"new_phy2log\[1\] = 2147483646"):
        validate_placements(np.array([big, 0]), np.array([0, big - 1]), 1)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"window_size": 10**30}, "EplbConfig.window_size must be a positive integer up to 2\\*\\*31 - 1"),
        ({"step_interval": 2**40}, "EplbConfig.step_interval"),
        ({"step_interval": 2**31}, "EplbConfig.step_interval"),
        ({"routing": "quota", "policy": "online", "refresh_interval": 2**31}, "EplbConfig.refresh_interval"),
        ({"log_interval": 2**31}, "EplbConfig.log_interval"),
        ({"num_gpus": 2**31}, "EplbConfig.num_gpus"),
        ({"num_redundant_experts": 2**31}, "EplbConfig.num_redundant_experts"),
        ({"window_size": HUGE}, "EplbConfig.window_size .* got an integer of 5000 digits"),
        ({"overlap": HUGE}, "EplbConfig.overlap .* got an integer of 5000 digits"),
    ],
)
def test_config_fields_past_their_counters_are_refused_when_built(fields, match):
    with pytest.raises(ValueError, match=match):
        EplbConfig(**fields)
    with pytest.raises(ValueError, match=match):
        EplbConfig.from_dict(fields)


def test_config_json_at_the_edges():
    with pytest.raises(ValueError, match="EplbConfig.window_size .* an integer of 5000 digits"):
        EplbConfig.from_json('{"window_size": ' + "9" * 5000 + "}")
    with pytest.raises(ValueError, match="EplbConfig.log_balancedness_interval"):
        EplbConfig.from_json('{"log_balancedness": true, "log_balancedness_interval": -' + "9" * 5000 + "}")
    for deep in ("[" * 100_000 + "]" * 100_000, '{"a":' * 100_000 + "1" + "}" * 100_000):
        with pytest.raises(ValueError, match="nested too deeply"):
            EplbConfig.from_json(deep)
    assert EplbConfig.from_json('{"window_size": 2147483647}').window_size == 2**31 - 1


def _balance(num_layers):
    """A functional balance state of ``num_layers`` layers of 4 slots on 2 ranks (record_step reads its loads)."""
    from moe_eplb_jax.control import BalanceState
    from moe_eplb_jax.control.window import LoadWindow
    from moe_eplb_jax.transport import ep_mesh

    window = LoadWindow(EplbConfig(window_size=2, num_gpus=2), ep_mesh(2), num_layers, 4, "ep")
    return BalanceState(window.fresh(), None)


@pytest.mark.parametrize(
    "loads, match",
    [
        ([np.ones((2, 4), np.float32)], r"loads\[0\] must hold integer token counts, got dtype float32"),
        ([np.zeros((2, 4), np.int32), -np.ones((2, 4), np.int64)], r"loads\[1\]\[0, 0\] = -1 is not a token count"),
        ([np.full((4,), 2**33)], r"loads\[0\]\[0\] = 8589934592 is not a token count"),
        ([jnp.ones((2, 4), jnp.float32)], "must hold integer token counts"),
        ([[[1.5, 2, 0, 0], [3, 4, 0, 0]]], "must hold integer token counts"),
    ],
)
def test_balancer_record_step_checks_loads_before_the_int32_cast(loads, match):
    """Outside jit a float, negative or past-int32 load used to be cast to int32 first and recorded wrapped."""
    from moe_eplb_jax.control import Balancer

    balance = _balance(len(loads))
    with pytest.raises(ValueError, match=match):
        Balancer.record_step(balance, loads)
    good = Balancer.record_step(balance, [np.full((2, 4), 3, np.int64)] * len(loads))
    assert int(np.asarray(good.loads.window).sum()) == 3 * 8 * len(loads)
    with pytest.raises(ValueError, match="integer token counts"):  # under jit the dtype is checked too
        jax.jit(Balancer.record_step)(balance, [jnp.ones((2, 4), jnp.float32)] * len(loads))
    with pytest.raises(ValueError, match="one array per MoE layer"):
        Balancer.record_step(balance, 3)


def test_load_window_sizes_are_integers():
    from moe_eplb_jax.control.window import LoadWindow
    from moe_eplb_jax.transport import ep_mesh

    for bad, match in ((2.5, "num_layers must be an integer"), ("2", "num_layers must be an integer")):
        with pytest.raises(ValueError, match=match):
            LoadWindow(EplbConfig(num_gpus=2), ep_mesh(2), bad, 4, "ep")


def test_control_loop_sizes_are_checked_before_anything_is_built():
    from moe_eplb_jax.control import ControlLoop
    from moe_eplb_jax.control.moves import Mover
    from moe_eplb_jax.transport import ep_mesh

    mesh = ep_mesh(2)
    for sizes, match in (
        ({"num_layers": 2.0, "num_logical": 4, "num_physical": 4}, "num_layers must be an integer"),
        ({"num_layers": 2, "num_logical": "4", "num_physical": 4}, "num_logical must be an integer"),
        ({"num_layers": 2, "num_logical": 4, "num_physical": 10**12}, "num_physical must be <= 2147483647"),
    ):
        with pytest.raises(ValueError, match=match):
            ControlLoop(EplbConfig(num_gpus=2), mesh, "ep", **sizes)
    with pytest.raises(ValueError, match="num_physical must be an integer"):
        Mover(mesh, "ep", 4, 4.5)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: EplbConfig(routing=HUGE), "EplbConfig.routing must be one of .* an integer of 5000 digits"),
        (lambda: EplbConfig(policy=HUGE), "EplbConfig.policy .* an integer of 5000 digits"),
        (lambda: EplbConfig.from_dict({"use_async": HUGE}), "'use_async' must be true or false, got an integer"),
        (lambda: quant_check_real(), "scale must be finite, got an integer of 5000 digits"),
    ],
)
def test_huge_integers_are_named_not_printed(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def quant_check_real():
    from moe_eplb_jax._checks import check_real

    return check_real("scale", HUGE)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"num_experts": 2**40}, r"ModelConfig.num_experts must be an integer up to 2\*\*31 - 1"),
        ({"vocab_size": HUGE}, "ModelConfig.vocab_size .* an integer of 5000 digits"),
        ({"rope_theta": 10**400}, "ModelConfig.rope_theta must be a positive finite number"),
        ({"rms_eps": HUGE}, "ModelConfig.rms_eps .* an integer of 5000 digits"),
        ({"top_k": 2**31}, "ModelConfig.top_k"),
        ({"dtype": HUGE}, "ModelConfig.dtype must be one of"),
    ],
)
def test_model_config_numbers_at_the_edges(fields, match):
    from moe_eplb_jax.models import ModelConfig, YarnScaling

    with pytest.raises(ValueError, match=match):
        ModelConfig(**fields)
    with pytest.raises(ValueError, match="YarnScaling.factor must be a finite number"):
        YarnScaling(factor=10**400, original_max_len=4096)

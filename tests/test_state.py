"""EplbState: recording, the window ring buffer, the trigger, logical loads."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from moe_eplb_jax import EplbConfig, Placement, metrics, policy
from moe_eplb_jax import state as st


def test_config_validation():
    with pytest.raises(ValueError, match="window_size"):
        EplbConfig(window_size=0)
    with pytest.raises(ValueError, match="num_redundant_experts"):
        EplbConfig(num_redundant_experts=-1)
    with pytest.raises(ValueError, match="num_gpus .* num_nodes"):
        EplbConfig(num_groups=4, num_gpus=6, num_nodes=4)  # hierarchical (4 groups on 4 nodes)
    with pytest.raises(ValueError, match="not divisible by num_gpus=8"):
        EplbConfig(num_redundant_experts=3, num_gpus=8).num_physical(16)
    with pytest.raises(ValueError, match="num_groups=3"):
        EplbConfig(num_groups=3).num_physical(16)
    with pytest.raises(ValueError, match="EplbConfig.routing must be one of"):
        EplbConfig(routing="nope")
    assert EplbConfig(num_redundant_experts=8, num_gpus=8).num_physical(16) == 24


def test_record_and_window_ring_buffer(rng):
    cfg = EplbConfig(window_size=3, step_interval=8)
    s = st.init_state(cfg, num_layers=2, num_physical=4)
    loads = [rng.integers(1, 100, size=(2, 4)).astype(np.int32) for _ in range(5)]
    record, end_step = jax.jit(st.record), jax.jit(st.end_step)
    for load in loads:
        half = load // 2
        s = end_step(record(record(s, half), load - half))  # two passes make one step
    assert int(s.window_filled) == 3 and int(s.step) == 5 and int(s.total_steps) == 5
    # the window holds the last three steps
    np.testing.assert_array_equal(
        np.sort(np.asarray(s.window).reshape(3, -1), 0), np.sort(np.stack(loads[-3:]).reshape(3, -1), 0)
    )
    np.testing.assert_array_equal(np.asarray(s.pass_load), 0)
    phy2log = np.array([[0, 1, 2, 0], [2, 2, 1, 0]])
    logical = np.asarray(st.window_logical_load(s, phy2log, 3))
    total = np.sum(loads[-3:], axis=0)
    expected = np.zeros((2, 3))
    for layer in range(2):
        np.add.at(expected[layer], phy2log[layer], total[layer])
    np.testing.assert_allclose(logical, expected)


def test_dummy_steps_advance_without_recording(rng):
    cfg = EplbConfig(window_size=4, step_interval=8)
    s = st.init_state(cfg, 1, 2)
    s = st.end_step(st.record(s, jnp.asarray([[5, 7]], jnp.int32)))
    s = st.end_step(st.record(s, jnp.asarray([[100, 100]], jnp.int32)), dummy=True)
    s = st.end_step(s, dummy=jnp.asarray(True))
    assert int(s.step) == 3 and int(s.window_filled) == 1
    np.testing.assert_allclose(np.asarray(st.window_logical_load(s, np.array([[0, 1]]), 2)), [[5, 7]])


def test_trigger_first_after_quarter_then_every_interval():
    cfg = EplbConfig(window_size=2, step_interval=8)
    s = st.init_state(cfg, 1, 2)
    fired = []
    for step in range(1, 21):
        s = st.end_step(s)
        if bool(st.should_rearrange(s, cfg)):
            fired.append(step)
            s = st.mark_rearranged(s)
    assert fired == [2, 10, 18]
    # the window restarts at each rearrangement: steps 19 and 20 only
    assert int(s.num_rearrangements) == 3 and int(s.window_filled) == 2 and int(s.step) == 2


def test_record_rejects_bad_loads():
    s = st.init_state(EplbConfig(window_size=2), 2, 4)
    with pytest.raises(ValueError, match="shape"):
        st.record(s, jnp.zeros((2, 5), jnp.int32))
    with pytest.raises(ValueError, match="integer"):
        st.record(s, jnp.ones((2, 4), jnp.float32))
    with pytest.raises(ValueError, match="not divisible by num_gpus"):
        st.init_state(EplbConfig(num_gpus=3), 2, 4)


def test_window_logical_load_psums_over_the_ep_axis(rng):
    mesh = jax.make_mesh((8,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
    cfg = EplbConfig(window_size=2)
    local = rng.integers(1, 50, size=(8, 3, 16)).astype(np.int32)  # each rank's own counts [L, P]
    phy2log = np.stack([rng.permutation(np.r_[np.arange(12), np.arange(4)]) for _ in range(3)]).astype(np.int32)

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("ep"), P()), out_specs=P("ep"))
    def per_rank(load, table):
        s = st.end_step(st.record(st.init_state(cfg, 3, 16), load[0]))
        return st.window_logical_load(s, table, 12, axis_name="ep")[None]

    out = jax.jit(per_rank)(jax.device_put(local, jax.NamedSharding(mesh, P("ep"))), phy2log)
    expected = np.zeros((3, 12))
    for layer in range(3):
        np.add.at(expected[layer], phy2log[layer], local.sum(0)[layer])
    for rank in range(8):  # every rank sees the same global load
        np.testing.assert_allclose(np.asarray(out)[rank], expected)


def test_per_rank_layout_sums_rows_only_when_read(rng):
    """Per-rank rows [L, G, P] sharded over EP: recording is local, the readers equal the summed layout."""
    mesh = jax.make_mesh((8,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    cfg = EplbConfig(window_size=3, num_gpus=8)
    rows = jax.NamedSharding(mesh, P(None, "ep", None))
    shardings = jax.tree.map(lambda _: jax.NamedSharding(mesh, P()), jax.eval_shape(lambda: st.init_state(cfg, 2, 16)))
    shardings = st.EplbState(
        **{**vars(shardings), "pass_load": rows, "window": jax.NamedSharding(mesh, P(None, None, "ep", None))}
    )
    ranked = jax.jit(lambda: st.init_state(cfg, 2, 16, per_rank=True), out_shardings=shardings)()
    summed = st.init_state(cfg, 2, 16)
    assert ranked.per_rank and not summed.per_rank and ranked.num_physical == summed.num_physical == 16
    step = jax.jit(lambda s, a, b: st.end_step(st.record(st.record(s, a), b)), out_shardings=shardings)
    for _ in range(5):  # two passes per step; the 3-row window wraps
        a, b = (rng.integers(0, 30, size=(2, 8, 16)).astype(np.int32) for _ in range(2))
        ranked = step(ranked, jax.device_put(a, rows), jax.device_put(b, rows))
        summed = st.end_step(st.record(st.record(summed, a.sum(1)), b.sum(1)))
    np.testing.assert_array_equal(np.asarray(st.window_slot_load(ranked)), np.asarray(st.window_slot_load(summed)))
    phy2log = np.stack([rng.permutation(np.r_[np.arange(12), np.arange(4)]) for _ in range(2)]).astype(np.int32)
    np.testing.assert_array_equal(
        np.asarray(st.window_logical_load(ranked, phy2log, 12)), np.asarray(st.window_logical_load(summed, phy2log, 12))
    )
    # Recording is elementwise on each rank's rows; the sum over ranks is the readers' one all-reduce.
    a = jax.device_put(np.zeros((2, 8, 16), np.int32), rows)
    assert "all-reduce" not in step.lower(ranked, a, a).compile().as_text()
    read = jax.jit(st.window_slot_load, out_shardings=jax.NamedSharding(mesh, P()))
    assert "all-reduce" in read.lower(ranked).compile().as_text()
    with pytest.raises(ValueError, match=r"\[L, G, P\]"):
        st.record(ranked, jnp.zeros((2, 16), jnp.int32))
    with pytest.raises(ValueError, match="phy2log must have shape"):
        st.window_logical_load(ranked, np.zeros((2, 8), np.int32), 12)


def test_compute_placement_uses_the_registered_policy(rng):
    calls = []

    def sort_policy(weight, num_replicas, num_groups, num_nodes, num_gpus, old_phy2log=None):
        calls.append((weight.shape, num_replicas, num_gpus, old_phy2log is not None))
        order = np.argsort(-weight, axis=1, kind="stable")
        extra = order[:, : num_replicas - weight.shape[1]]  # hottest experts get the spare slots
        return Placement.from_phy2log(np.concatenate([order, extra], axis=1), weight.shape[1])._tables()

    policy.register("test_sort", sort_policy, overwrite=True)
    cfg = EplbConfig(num_redundant_experts=2, num_gpus=2, policy="test_sort")
    load = rng.gamma(1.0, 10.0, size=(2, 6))
    p = policy.compute_placement(load, cfg, old_phy2log=np.zeros((2, 8), np.int32))
    assert calls == [((2, 6), 8, 2, True)]
    assert p.num_physical == 8 and np.all(p.logcnt[np.arange(2), np.argmax(load, 1)] == 2)
    with pytest.raises(ValueError, match="logical_load holds a negative load"):
        policy.compute_placement(-load, cfg)
    with pytest.raises(ValueError, match="old_phy2log must have shape"):
        policy.compute_placement(load, cfg, old_phy2log=np.zeros((2, 7), np.int32))
    with pytest.raises(ValueError, match="unknown placement policy 'nope'"):
        policy.compute_placement(load, EplbConfig(policy="nope"))


def test_config_from_vllm_json_and_back():
    vllm = '{"window_size": 1000, "step_interval": 3000, "num_redundant_experts": 8, "log_balancedness": true,'
    vllm += ' "log_balancedness_interval": 5, "use_async": true, "policy": "default"}'
    cfg = EplbConfig.from_json(vllm)
    assert (cfg.window_size, cfg.step_interval, cfg.num_redundant_experts) == (1000, 3000, 8)
    assert cfg.log_interval == 5 and cfg.overlap == "layer" and cfg.policy == "balanced"
    assert EplbConfig.from_json('{"log_balancedness": false, "log_balancedness_interval": 5}').log_interval is None
    assert EplbConfig.from_json(cfg.to_json()) == cfg and EplbConfig.from_dict(cfg.to_dict()) == cfg
    quota = EplbConfig(routing="quota", policy="online", refresh_interval=40, step_interval=400)
    assert quota.rearrange_interval == 40 and quota.first_rearrangement_step == 10
    assert EplbConfig.from_json(quota.to_json()) == quota
    assert EplbConfig(overlap=1 << 20).overlap == 1 << 20


def test_config_reads_every_field_of_vllms_eplb_config_with_its_defaults():
    """vLLM's communicator was refused as unknown; a vLLM config without use_async is async in vLLM (its default)."""
    from moe_eplb_jax.config import EPLB_COMMUNICATORS

    assert EPLB_COMMUNICATORS == ("torch_nccl", "torch_gloo", "nixl", "pynccl")
    for name in (*EPLB_COMMUNICATORS, None):
        assert EplbConfig.from_dict({"communicator": name, "use_async": False}) == EplbConfig()
    with pytest.raises(ValueError, match="field 'communicator' must be null or one of vLLM's"):
        EplbConfig.from_json('{"communicator": "mpi"}')
    with pytest.raises(ValueError, match="field 'communicator' must be null"):
        EplbConfig.from_json('{"communicator": 3}')
    assert EplbConfig.from_json('{"window_size": 100}').overlap == "layer"  # vLLM's use_async defaults to true
    assert EplbConfig.from_json('{"use_async": false}').overlap is None
    assert EplbConfig.from_json('{"overlap": null}').overlap is None and EplbConfig().overlap is None
    vllm_defaults = EplbConfig.from_json("{}")
    assert (vllm_defaults.window_size, vllm_defaults.step_interval, vllm_defaults.num_redundant_experts) == (
        1000,
        3000,
        0,
    )
    assert vllm_defaults.log_interval is None and vllm_defaults.overlap == "layer"


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"window_size": true}', "window_size must be a positive integer"),
        ('{"window_size": 16.7}', "window_size must be a positive integer"),
        ('{"window_size": 16.0}', "window_size must be a positive integer"),
        ('{"step_interval": "3000"}', "step_interval must be a positive integer"),
        ('{"num_redundant_experts": -1}', "num_redundant_experts"),
        ('{"log_balancedness": "no"}', "'log_balancedness' must be true or false"),
        ('{"use_async": 1}', "'use_async' must be true or false"),
        ('{"log_balancedness": true, "log_balancedness_interval": 0}', "log_balancedness_interval"),
        ('{"log_interval": 3, "log_balancedness": true}', "not both"),
        ('{"overlap": "layer", "use_async": false}', "not both"),
        ('{"window_size": 8, "window_size": 9}', "repeats key"),
        ('{"windowsize": 8}', r"unknown field\(s\) \['windowsize'\]"),
        ('{"policy": "nope"}', "EplbConfig.policy: unknown placement policy 'nope'"),
        ('{"policy": 3}', "policy must be a policy name"),
        ('{"routing": "shares"}', "routing must be one of"),
        ('{"routing": "quota"}', "needs policy='online'"),
        ('{"refresh_interval": 10}', "refresh_interval is the spare-slot refresh period"),
        ('{"overlap": "layers"}', "overlap must be None, 'layer' or a positive integer"),
        ('{"overlap": true}', "overlap must be"),
        ('{"log_interval": true}', "log_interval must be None or a positive integer"),
        ('{"log_interval": 0}', "log_interval must be None or a positive integer"),
        ('{"log_balancedness": true, "log_balancedness_interval": true}', "log_balancedness_interval"),
        ('{"num_groups": 4, "num_nodes": 2, "num_gpus": 3}', "num_gpus .3. is not divisible by num_nodes .2."),
        ("[1, 2]", "must be an object"),
        ("{not json", "not valid JSON"),
    ],
)
def test_config_rejects_what_users_get_wrong(text, match):
    with pytest.raises(ValueError, match=match):
        EplbConfig.from_json(text)


def test_quota_routing_refreshes_every_refresh_interval():
    cfg = EplbConfig(routing="quota", policy="quota", window_size=2, step_interval=100, refresh_interval=8)
    s = st.init_state(cfg, 1, 2)
    fired = []
    for step in range(1, 21):
        s = st.end_step(s)
        if bool(st.should_rearrange(s, cfg)):
            fired.append(step)
            s = st.mark_rearranged(s)
    assert fired == [2, 10, 18]


@pytest.mark.parametrize("name", ["deepseek", "balanced"])
def test_config_accepts_what_deepseek_and_vllm_accept(name):
    """When num_groups % num_nodes != 0 the reference balances globally, and requires neither E % num_groups nor
    num_gpus % num_nodes: the config accepts the same and the policies return the reference's placement."""
    from moe_eplb_jax.policy import rebalance_experts_reference

    for groups, nodes, gpus, experts, redundant in [(3, 2, 4, 4, 4), (3, 2, 3, 4, 2), (4, 3, 3, 6, 0), (1, 4, 6, 6, 0)]:
        cfg = EplbConfig(
            num_groups=groups, num_nodes=nodes, num_gpus=gpus, num_redundant_experts=redundant, policy=name
        )
        assert not cfg.hierarchical
        assert cfg.num_physical(experts) == experts + redundant
        load = np.arange(1, experts + 1, dtype=np.float64)[None] ** 2
        got = policy.compute_placement(load, cfg)
        want = rebalance_experts_reference(load, experts + redundant, groups, nodes, gpus)
        if name == "deepseek":  # the same tables
            np.testing.assert_array_equal(got.phy2log, want[0])
        rank = lambda p: metrics.rank_load_from_logical(load, p, gpus)
        assert np.max(rank(got.phy2log)) <= np.max(rank(np.asarray(want[0]))) + 1e-9
    # Hierarchical (groups a multiple of nodes): both divisions are still required.
    with pytest.raises(ValueError, match="not divisible by num_groups=2"):
        EplbConfig(num_groups=2, num_nodes=2, num_gpus=4, num_redundant_experts=1).num_physical(7)
    with pytest.raises(ValueError, match="num_gpus .6. is not divisible by num_nodes .4."):
        EplbConfig(num_groups=8, num_nodes=4, num_gpus=6)


def test_config_defaults_to_the_library_policy():
    assert EplbConfig().policy == policy.DEFAULT_POLICY
    assert EplbConfig.from_json('{"policy": "default"}').policy == policy.DEFAULT_POLICY
    with pytest.raises(
        ValueError, match=r"log_interval must be None or a positive integer up to 2\*\*31 - 1, got True"
    ):
        EplbConfig(log_interval=True)


def test_window_readers_do_not_wrap_past_int32():
    """Four steps of 2**30 tokens in one slot: 2**32 over the window, in both layouts (int32 sums would wrap to 0)."""
    from moe_eplb_jax.control import LoadWindow

    cfg = EplbConfig(window_size=4, num_gpus=2)
    big = np.array([[2**30, 0, 0, 6]], np.int32)
    summed = st.init_state(cfg, 1, 4)
    ranked = st.init_state(cfg, 1, 4, per_rank=True)
    for _ in range(4):
        summed = st.end_step(st.record(summed, big))
        ranked = st.end_step(st.record(ranked, np.stack([big, big // 2], axis=1)))
    want = np.array([[2.0**32, 0, 0, 24]])
    np.testing.assert_array_equal(np.asarray(st.window_slot_load(summed)), want)
    np.testing.assert_array_equal(np.asarray(st.window_slot_load(ranked)), want * 1.5)
    phy2log = np.array([[0, 1, 1, 0]], np.int32)
    np.testing.assert_allclose(np.asarray(st.window_logical_load(summed, phy2log, 2)), [[2.0**32 + 24, 0]], rtol=1e-7)
    # The controller's reader, on the mesh.
    mesh = jax.make_mesh((2,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    window = LoadWindow(cfg, mesh, 1, 4, "ep")
    state = window.fresh()
    for _ in range(4):
        state = window.close(state, [jnp.asarray(np.concatenate([big, big]))], np.bool_(False))
    np.testing.assert_array_equal(np.asarray(window.slot_load(state)), want * 2)
    np.testing.assert_allclose(window.logical_load(state, phy2log, 2), [[2.0**33 + 48, 0]], rtol=1e-7)

"""Simulator: generators, load files, per-policy reports, the online L1 policy."""

import importlib.util
import json

import numpy as np
import pytest

from moe_eplb_jax import policy
from moe_eplb_jax.placement import Placement
from moe_eplb_jax.policy.online import refresh_phy2log
from moe_eplb_jax.sim import (
    drifting_load,
    format_table,
    home_rank_imbalance,
    lognormal_load,
    plot_reports,
    read_load,
    save_load,
    simulate,
    zipf_counts,
    zipf_popularity,
    zipf_topk,
)

needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="plots need matplotlib (pip install -e '.[test]')"
)


@pytest.mark.parametrize("imbalance", [1.5, 3.0])
def test_zipf_hits_target_imbalance(imbalance):
    p = zipf_popularity(128, 32, imbalance, seed=4)
    assert abs(home_rank_imbalance(p, 32) - imbalance) < 1e-6 and abs(p.sum() - 1) < 1e-12
    counts = zipf_counts(32, 128, 2048, 8, imbalance, seed=4)
    assert counts.shape == (32, 128) and np.all(counts.sum(1) == 2048 * 8)
    ids = zipf_topk(4, 16, 64, 4, imbalance, seed=4)
    assert ids.shape == (4, 64, 4) and all(len(set(row)) == 4 for row in ids.reshape(-1, 4).tolist())


def test_generators_shapes_and_bad_input():
    assert lognormal_load(3, 16, tokens=1000).sum(1).tolist() == [1000] * 3
    trace = drifting_load(6, 2, 16, 4, imbalance=2.0, tokens=4096, seed=1)
    assert trace.shape == (6, 2, 16) and np.all(trace.sum(-1) == 4096)
    assert not np.array_equal(trace[0].argmax(-1), trace[-1].argmax(-1))  # the hot experts moved
    with pytest.raises(ValueError, match="imbalance"):
        zipf_popularity(16, 4, 5.0)
    with pytest.raises(ValueError, match="multiple"):
        zipf_popularity(15, 4, 2.0)


@pytest.mark.parametrize("suffix", [".npz", ".json"])
def test_load_file_round_trip(tmp_path, rng, suffix):
    load = rng.integers(0, 100, size=(3, 2, 8))
    path = tmp_path / f"load{suffix}"
    save_load(path, load, num_ranks=4, top_k=2, note="x")
    trace = read_load(path)
    np.testing.assert_array_equal(trace.load, load)
    assert trace.meta["num_ranks"] == 4 and trace.meta["top_k"] == 2
    single = tmp_path / f"single{suffix}"
    save_load(single, load[0])
    assert read_load(single).load.shape == (1, 2, 8)


def test_load_file_errors(tmp_path, rng):
    with pytest.raises(ValueError, match="non-negative"):
        save_load(tmp_path / "a.npz", -np.ones((2, 4)))
    with pytest.raises(ValueError, match="unknown metadata"):
        save_load(tmp_path / "a.npz", np.ones((2, 4)), colour="red")
    (tmp_path / "b.json").write_text(json.dumps({"format": "other", "version": 1, "load": [[1]]}))
    with pytest.raises(ValueError, match="'format'"):
        read_load(tmp_path / "b.json")
    (tmp_path / "c.json").write_text(json.dumps({"format": "moe_eplb_jax.load", "version": 1}))
    with pytest.raises(ValueError, match="missing field 'load'"):
        read_load(tmp_path / "c.json")
    (tmp_path / "d.json").write_text("{not json")
    with pytest.raises(ValueError, match="JSON"):
        read_load(tmp_path / "d.json")
    with pytest.raises(ValueError, match=r"load file must end in \.json or \.npz"):
        read_load(tmp_path / "e.txt")


@needs_matplotlib
def test_simulate_reports(tmp_path):
    trace = drifting_load(8, 2, 32, 8, imbalance=2.0, tokens=65536, seed=2)
    reports = simulate(
        trace,
        num_ranks=8,
        num_spare=2,
        policies=("none", "deepseek", "deepseek+lp", "online"),
        step_interval=4,
        window=4,
    )
    by = {r.name: r for r in reports}
    assert set(by) == {"none", "deepseek", "deepseek+lp", "online"}
    for r in reports:
        assert r.rank_load.shape == (8, 2, 8)
        np.testing.assert_allclose(r.rank_load.sum(-1), trace.sum(-1), rtol=1e-4)  # no token lost
    assert by["none"].replicas_used == 0 and by["deepseek"].replicas_used == 16
    assert by["deepseek"].num_rebalances == 1 and by["deepseek"].bytes_moved > 0
    assert by["online"].balancedness > by["deepseek+lp"].balancedness >= by["deepseek"].balancedness - 1e-9
    assert by["deepseek"].balancedness > by["none"].balancedness
    assert by["online"].layer_imbalance.max() < 1.02
    table = format_table(reports)
    assert all(name in table for name in by)
    plot_reports(reports, tmp_path / "sim.png")
    assert (tmp_path / "sim.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="unknown policy"):
        simulate(trace, num_ranks=8, num_spare=2, policies=("nope",))
    with pytest.raises(ValueError, match="divisible"):
        simulate(trace, num_ranks=5, num_spare=2)


def test_online_policy_registered(rng):
    # registered by importing moe_eplb_jax.policy alone
    weight = rng.lognormal(0.0, 1.0, size=(3, 32))
    tables = policy.get("online")(weight, 48, 1, 1, 8)
    placement = Placement.from_tables(*tables, num_ranks=8)
    phy2log = placement.phy2log.reshape(3, 8, 6)
    np.testing.assert_array_equal(phy2log[:, :, :4], np.broadcast_to(np.arange(32).reshape(8, 4), (3, 8, 4)))
    for layer in range(3):
        for rank in range(8):
            assert len(set(phy2log[layer, rank].tolist())) == 6  # no expert twice on a rank
    assert policy.get("quota") is policy.get("online")
    with pytest.raises(ValueError, match="divisible"):
        policy.get("online")(weight, 50, 1, 1, 8)
    old = np.arange(12) % 5
    new = np.where(np.arange(12) % 3 == 2, -1, np.arange(12) % 4)
    np.testing.assert_array_equal(refresh_phy2log(old, new), np.where(new >= 0, new, old))


# ------------------------------------------------------------------- big numbers and bad input
def test_simulator_never_wraps_large_loads():
    trace = drifting_load(4, 2, 32, 8, imbalance=2.0, tokens=65536, seed=2).astype(np.float64)
    small = {r.name: r for r in simulate(trace, num_ranks=8, num_spare=2, policies=("none", "online"))}
    scale = 3e9 * 32 / 65536  # ~3e9 tokens per expert: int32 counts would wrap
    large = {r.name: r for r in simulate(trace * scale, num_ranks=8, num_spare=2, policies=("none", "online"))}
    for name in ("none", "online"):
        assert large[name].balancedness == pytest.approx(small[name].balancedness, abs=2e-3)
        np.testing.assert_allclose(large[name].rank_load.sum(-1), trace.sum(-1) * scale, rtol=1e-6)
    assert large["online"].balancedness > 0.99
    fractional = {r.name: r for r in simulate(trace / 1e6, num_ranks=8, num_spare=2, policies=("online",))}
    assert fractional["online"].balancedness == pytest.approx(small["online"].balancedness, abs=2e-3)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"num_ranks": True}, "num_ranks must be an integer"),
        ({"num_ranks": 8.0}, "num_ranks must be an integer"),
        ({"num_spare": 16.7}, "num_spare must be an integer"),
        ({"num_spare": 10**9}, "num_spare must be <="),
        ({"step_interval": 0}, "step_interval must be >= 1"),
        ({"window": "4"}, "window must be an integer"),
        ({"expert_bytes": -5e6}, "expert_bytes must be >= 0"),
        ({"expert_bytes": float("nan")}, "expert_bytes must be finite"),
        ({"link_gbps": 0.0}, "link_gbps must be positive"),
        ({"token_time_us": float("inf")}, "token_time_us must be finite"),
        ({"policies": ()}, "policies is empty"),
        ({"policies": ("none", "none")}, "twice"),
        ({"policies": (3,)}, "must be strings"),
        ({"policies": ("deepseek+lp+lp",)}, "unknown policy"),
        ({"progress": "yes"}, "progress must be callable"),
        ({"load": np.ones((2, 2, 16), dtype=bool)}, "must hold numbers"),
        ({"load": np.array([[["1"] * 16] * 2])}, "must hold numbers"),
        ({"load": np.full((2, 2, 16), 1e307)}, "overflows"),
        ({"load": np.ones((0, 2, 16))}, "shape"),
    ],
)
def test_simulate_rejects_bad_arguments_before_any_work(overrides, match):
    args = dict(load=np.ones((2, 2, 16)), num_ranks=4, num_spare=1, policies=("none",))
    args.update(overrides)
    with pytest.raises(ValueError, match=match):
        simulate(args.pop("load"), **args)


def test_generators_reject_bools_floats_and_counts_that_would_wrap():
    with pytest.raises(ValueError, match="num_layers must be an integer"):
        lognormal_load(True, 8)
    with pytest.raises(ValueError, match="tokens must be an integer"):
        lognormal_load(2, 8, tokens=1000.5)
    with pytest.raises(ValueError, match="sigma must be finite"):
        lognormal_load(2, 8, sigma=float("inf"))
    with pytest.raises(ValueError, match="int32"):
        zipf_counts(2, 8, 2**28, 8, 1.5)
    with pytest.raises(ValueError, match="imbalance must be finite|imbalance must lie"):
        zipf_popularity(8, 2, float("nan"))
    with pytest.raises(ValueError, match="popularity must be"):
        home_rank_imbalance(np.ones(7), 2)
    with pytest.raises(ValueError, match="num_ranks must be an integer"):
        home_rank_imbalance(np.ones(8), 2.0)


def test_simulate_resize_reports_balance_bytes_and_time():
    """8 -> 7 ranks on a log-normal window: "fill" moves at most the leaving rank's experts, "balanced" balances
    better and moves more; the bytes are the plan's rows; with rank 3 lost its unreplicated experts are reloaded."""
    from moe_eplb_jax import sim

    load = np.stack([sim.lognormal_load(3, 48, sigma=1.0, tokens=10_000, seed=s) for s in range(4)])
    old = policy.get("balanced")(load.mean(0), 56, 1, 1, 8)[0]
    fill, balanced = sim.simulate_resize(
        load, old, num_ranks=8, new_num_ranks=7, policies=("fill", "balanced"), expert_bytes=1e6, link_gbps=100.0
    )
    assert fill.placement.phy2log.shape == balanced.placement.phy2log.shape == (3, 56)
    assert 0 < fill.rows_moved <= 3 * 7 and fill.rows_moved < balanced.rows_moved
    assert balanced.balancedness_after > fill.balancedness_after and balanced.balancedness_after > 0.98
    assert fill.balancedness_before == balanced.balancedness_before > 0.98
    for r in (fill, balanced):
        assert r.bytes_moved == r.rows_moved * 1e6 and r.rows_reloaded == 0
        assert r.time_ms == pytest.approx(r.busiest_rows * 1e6 / 100e9 * 1e3)
        assert r.imbalance_before.shape == r.imbalance_after.shape == (3,)
    (lost,) = sim.simulate_resize(load, old, num_ranks=8, new_num_ranks=7, policies="fill", lost_ranks=[3])
    held_elsewhere = {(lyr, e) for lyr in range(3) for e in np.delete(old[lyr], np.s_[21:28]).tolist()}
    only_on_3 = {(lyr, e) for lyr in range(3) for e in old[lyr, 21:28].tolist()} - held_elsewhere
    assert lost.rows_reloaded == len(only_on_3) > 0
    assert "fill" in sim.format_resize_table([fill, balanced, lost]) and "8->7" in sim.format_resize_table([fill])
    with pytest.raises(ValueError, match="old_phy2log must be expert ids"):
        sim.simulate_resize(load, old[:2], num_ranks=8, new_num_ranks=7)

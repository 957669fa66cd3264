"""Placement tables: construction, validation, initial layouts, files."""

import json

import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from hypothesis import given

from moe_eplb_jax import Placement
from moe_eplb_jax.placement import FILE_FORMAT, build_log2phy


def random_phy2log(rng, num_layers, num_logical, num_physical):
    """Every expert at least once, the redundant slots random, shuffled per layer."""
    rows = []
    for _ in range(num_layers):
        row = np.concatenate([np.arange(num_logical), rng.integers(0, num_logical, num_physical - num_logical)])
        rows.append(rng.permutation(row))
    return np.stack(rows).astype(np.int32)


@given(
    num_layers=st.integers(1, 4),
    num_logical=st.integers(1, 20),
    num_redundant=st.integers(0, 12),
    seed=st.integers(0, 2**31),
)
def test_from_phy2log_inverts(num_layers, num_logical, num_redundant, seed):
    rng = np.random.default_rng(seed)
    num_physical = num_logical + num_redundant
    phy2log = random_phy2log(rng, num_layers, num_logical, num_physical)
    p = Placement.from_phy2log(phy2log, num_logical)
    assert p.log2phy.shape == (num_layers, num_logical, num_redundant + 1)
    assert p.logcnt.dtype == np.int32 and p.log2phy.dtype == np.int32
    for layer in range(num_layers):
        for e in range(num_logical):
            slots = np.flatnonzero(phy2log[layer] == e)
            assert p.logcnt[layer, e] == len(slots)
            np.testing.assert_array_equal(p.log2phy[layer, e, : len(slots)], slots)  # ascending slot order
            assert np.all(p.log2phy[layer, e, len(slots) :] == -1)
    p.validate()


def test_linear_and_round_robin_layouts():
    lin = Placement.linear(2, 6, 8, num_ranks=4)
    np.testing.assert_array_equal(lin.phy2log[0], [0, 1, 2, 3, 4, 5, 0, 1])
    np.testing.assert_array_equal(lin.logcnt[1], [2, 2, 1, 1, 1, 1])
    rr = Placement.round_robin(1, 8, 8, 4)
    # rank r holds r and r + 4
    np.testing.assert_array_equal(rr.phy2log[0], [0, 4, 1, 5, 2, 6, 3, 7])
    rr = Placement.round_robin(3, 12, 16, 8)
    assert np.all(rr.logcnt >= 1) and rr.logcnt.sum() == 3 * 16
    np.testing.assert_array_equal(rr.rank_of_slot(8), np.repeat(np.arange(8), 2))


def test_placement_is_a_pytree_usable_under_jit():
    p = Placement.round_robin(2, 8, 12, 4)
    leaves = jax.tree_util.tree_leaves(p)
    assert len(leaves) == 3
    doubled = jax.jit(lambda q: q.logcnt * 2)(p.to_jax())
    np.testing.assert_array_equal(np.asarray(doubled), p.logcnt * 2)
    assert p.layer(1) == Placement(p.phy2log[1:2], p.log2phy[1:2], p.logcnt[1:2])


@pytest.mark.parametrize(
    "phy2log, num_logical, num_ranks, match",
    [
        ([[0, 1, 2, 5]], 4, None, r"phy2log\[0, 3\] = 5 is outside"),
        ([[0, 1, -1, 2]], 4, None, r"phy2log\[0, 2\] = -1 is outside"),
        ([[0, 1, 1, 2]], 4, None, "expert 3 of layer 0 has no replica"),
        ([[0, 1, 2]], 4, None, "fewer physical slots"),
        ([[0, 1, 2, 3, 0, 1]], 4, 4, "6 physical slots are not divisible by 4 ranks"),
        ([[[0, 1]]], 2, None, "shape"),
        ([[0.5, 1.0]], 2, None, "integers"),
    ],
)
def test_from_phy2log_rejects_bad_tables(phy2log, num_logical, num_ranks, match):
    with pytest.raises(ValueError, match=match):
        Placement.from_phy2log(np.asarray(phy2log), num_logical, num_ranks=num_ranks)


def test_from_tables_rejects_inconsistent_tables(rng):
    p = Placement.from_phy2log(random_phy2log(rng, 2, 6, 9), 6)
    bad_cnt = p.logcnt.copy()
    bad_cnt[1, 2] += 1
    with pytest.raises(ValueError, match=r"logcnt\[1, 2\]"):
        Placement.from_tables(p.phy2log, p.log2phy, bad_cnt)
    bad = p.log2phy.copy()
    e = int(np.argmax(p.logcnt[0]))
    bad[0, e, 0] = int(np.flatnonzero(p.phy2log[0] != e)[0])  # a slot of another expert
    with pytest.raises(ValueError, match="holds another expert"):
        Placement.from_tables(p.phy2log, bad, p.logcnt)
    bad = p.log2phy.copy()
    bad[0, e, 1] = bad[0, e, 0]  # listed twice
    with pytest.raises(ValueError, match="twice"):
        Placement.from_tables(p.phy2log, bad, p.logcnt)
    bad = p.log2phy.copy()
    e1 = int(np.argmin(p.logcnt[0]))
    bad[0, e1, -1] = 0  # padding overwritten
    with pytest.raises(ValueError, match="padded with -1"):
        Placement.from_tables(p.phy2log, bad, p.logcnt)
    with pytest.raises(ValueError, match="log2phy must have shape"):
        Placement.from_tables(p.phy2log, p.log2phy[:, :, :-1], p.logcnt)
    # A replica order other than ascending slots is valid; the placement lists them in slot order.
    swapped = p.log2phy.copy()
    e = int(np.argmax(p.logcnt[1]))
    swapped[1, e, [0, 1]] = swapped[1, e, [1, 0]]
    assert np.array_equal(Placement.from_tables(p.phy2log, swapped, p.logcnt).log2phy, p.log2phy)


@pytest.mark.parametrize("suffix", [".json", ".npz"])
def test_save_load_round_trip(tmp_path, rng, suffix):
    p = Placement.from_phy2log(random_phy2log(rng, 3, 10, 16), 10)
    # a non-ascending replica order must survive the round trip
    log2phy = p.log2phy.copy()
    e = int(np.argmax(p.logcnt[2]))
    log2phy[2, e, [0, 1]] = log2phy[2, e, [1, 0]]
    p = Placement.from_tables(p.phy2log, log2phy, p.logcnt)
    path = tmp_path / f"placement{suffix}"
    p.save(path)
    q = Placement.load(path, num_ranks=4)
    assert q == p
    assert q.phy2log.dtype == np.int32


def _write_json(path, doc):
    path.write_text(json.dumps(doc))
    return path


def _valid_doc():
    p = Placement.linear(2, 4, 6)
    return {
        "format": FILE_FORMAT,
        "version": 1,
        "num_layers": 2,
        "num_logical": 4,
        "num_physical": 6,
        "phy2log": p.phy2log.tolist(),
        "log2phy": p.log2phy.tolist(),
        "logcnt": p.logcnt.tolist(),
    }


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d.pop("format"), "missing field 'format'"),
        (lambda d: d.update(format="something"), "field 'format'"),
        (lambda d: d.update(version=99), "unsupported field 'version'"),
        (lambda d: d.pop("phy2log"), "missing field 'phy2log'"),
        (lambda d: d.update(num_layers=3), "field 'phy2log' has shape"),
        (lambda d: d.update(num_logical=-1), "field 'num_logical' must be a positive integer"),
        (lambda d: d.update(num_logical="4"), "field 'num_logical' must be a positive integer"),
        (lambda d: d["phy2log"][0].__setitem__(0, 9), "outside the logical expert range"),
        (lambda d: d["phy2log"].__setitem__(1, [0, 1]), "phy2log"),
        (lambda d: d["logcnt"][0].__setitem__(0, 5), "logcnt"),
        (lambda d: d.pop("logcnt"), "missing field 'logcnt'"),
    ],
)
def test_load_rejects_malformed_json(tmp_path, mutate, match):
    doc = _valid_doc()
    mutate(doc)
    path = _write_json(tmp_path / "p.json", doc)
    with pytest.raises(ValueError, match=match):
        Placement.load(path)


def test_load_rejects_corrupt_files(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Placement.load(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        Placement.load(bad)
    npz = tmp_path / "p.npz"
    npz.write_bytes(b"garbage bytes")
    with pytest.raises(ValueError, match="npz"):
        Placement.load(npz)
    with pytest.raises(ValueError, match=r"\.json or \.npz"):
        Placement.load(tmp_path / "p.txt")
    with pytest.raises(ValueError, match=r"\.json or \.npz"):
        Placement.linear(1, 2, 2).save(tmp_path / "p.yaml")
    # valid file, wrong rank count for this mesh
    good = tmp_path / "good.json"
    Placement.linear(1, 4, 6).save(good)
    with pytest.raises(ValueError, match="not divisible by 4 ranks"):
        Placement.load(good, num_ranks=4)


def test_build_log2phy_matches_loops(rng):
    phy2log = random_phy2log(rng, 5, 7, 13)
    log2phy, logcnt = build_log2phy(phy2log, 7)
    for layer in range(5):
        np.testing.assert_array_equal(logcnt[layer], np.bincount(phy2log[layer], minlength=7))

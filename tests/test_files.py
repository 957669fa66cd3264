"""Files the package reads and writes: atomic writes, hostile inputs, exact numbers, SGLang's formats.

Every malformed file must raise ``ValueError`` naming the file and the field,
before any large allocation; every write must leave either the old file or the
new one, whole.
"""

import io
import json
import os
import subprocess
import sys
import zipfile

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

from moe_eplb_jax import Placement
from moe_eplb_jax import _files as files
from moe_eplb_jax.placement import FILE_FORMAT
from moe_eplb_jax.sim import read_load, save_load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _placement(seed=0, num_layers=3, num_logical=8, num_physical=12):
    rng = np.random.default_rng(seed)
    rows = [
        rng.permutation(np.r_[np.arange(num_logical), rng.integers(0, num_logical, num_physical - num_logical)])
        for _ in range(num_layers)
    ]
    return Placement.from_phy2log(np.stack(rows), num_logical)


def _doc(p: Placement) -> dict:
    return {
        "format": FILE_FORMAT,
        "version": 1,
        "num_layers": p.num_layers,
        "num_logical": p.num_logical,
        "num_physical": p.num_physical,
        "phy2log": p.phy2log.tolist(),
    }


def _leftovers(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(".tmp") or ".tmp." in name)


# ------------------------------------------------------------ atomic writes
@pytest.mark.parametrize("suffix", [".json", ".npz"])
def test_crash_mid_write_keeps_the_previous_file(tmp_path, monkeypatch, suffix):
    path = tmp_path / f"p{suffix}"
    old, new = _placement(0), _placement(1)
    old.save(path)
    before = path.read_bytes()

    def crash(fd):  # the data is written, the rename has not happened: a crash here must lose nothing
        raise OSError(5, "injected crash")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(ValueError, match=r"p\.(json|npz): cannot write the placement file \(injected crash\)"):
        new.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before and Placement.load(path) == old
    assert _leftovers(tmp_path) == []
    new.save(path)
    assert Placement.load(path) == new


def test_crash_while_serialising_keeps_the_previous_load_file(tmp_path, monkeypatch):
    path = tmp_path / "load.npz"
    save_load(path, np.ones((2, 3, 4)))
    before = path.read_bytes()

    def half_written(member, array, **kwargs):
        member.write(b"\x93NUMPY half an array")
        raise KeyboardInterrupt

    monkeypatch.setattr(np.lib.format, "write_array", half_written)
    with pytest.raises(KeyboardInterrupt):
        save_load(path, np.zeros((2, 3, 4)))
    assert path.read_bytes() == before and _leftovers(tmp_path) == []


_WRITER = """
import sys
import numpy as np
from moe_eplb_jax import Placement
seed, path = int(sys.argv[1]), sys.argv[2]
rng = np.random.default_rng(seed)
rows = [rng.permutation(np.r_[np.arange(64), rng.integers(0, 64, 64)]) for _ in range(64)]
p = Placement.from_phy2log(np.stack(rows), 64)
for _ in range(15):
    p.save(path)
print(int(p.phy2log.sum()))
"""


@pytest.mark.slow  # two fresh interpreters importing jax
def test_two_processes_writing_one_path_leave_one_complete_file(tmp_path):
    path = str(tmp_path / "shared.npz")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(seed), path],
            cwd=ROOT,
            env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2)
    ]
    sums = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        sums.append(int(out.split()[-1]))
    loaded = Placement.load(path)
    assert int(loaded.phy2log.sum()) in sums and loaded.phy2log.shape == (64, 128)
    assert _leftovers(tmp_path) == []


def test_new_files_get_ordinary_permissions(tmp_path):
    path = tmp_path / "p.json"
    _placement().save(path)
    umask = os.umask(0)
    os.umask(umask)
    assert (path.stat().st_mode & 0o777) == (0o666 & ~umask)
    path.chmod(0o600)
    _placement(1).save(path)  # replacing keeps the file's permissions
    assert (path.stat().st_mode & 0o777) == 0o600


def test_unwritable_output_paths_raise_value_error(tmp_path):
    (tmp_path / "dir.json").mkdir()
    (tmp_path / "dir.npz").mkdir()
    writers = (lambda path: _placement().save(path), lambda path: save_load(path, np.ones((2, 4))))
    for write in writers:
        for target, match in (
            ("missing_dir/p.json", "directory 'missing_dir' does not exist|missing_dir.*does not exist"),
            ("dir.json", "names a directory"),
            ("dir.npz", "names a directory"),
        ):
            with pytest.raises(ValueError, match=match):
                write(tmp_path / target)
    assert sorted(os.listdir(tmp_path)) == ["dir.json", "dir.npz"]


@pytest.mark.parametrize("kind", ["placement", "sglang", "load"])
def test_special_and_missing_output_paths_raise_value_errors_naming_them(kind):
    """/proc and /sys take no new file even for root (raw OSError before); None raised TypeError."""
    write = {
        "placement": lambda path: _placement().save(path),
        "sglang": lambda path: _placement().save(path, format="sglang"),
        "load": lambda path: save_load(path, np.ones((2, 4))),
    }[kind]
    what = {"placement": "placement", "sglang": "SGLang placement", "load": "load"}[kind]
    for path, match in (
        ("/proc/p.json", f"/proc/p.json: cannot write the {what} file in '/proc'"),
        ("/sys/p.json", f"/sys/p.json: cannot write the {what} file in '/sys'"),
        (None, f"{what} file: need a path, got None"),
        (3, f"{what} file: need a path, got 3"),
        ("", f"{what} file: need a non-empty path"),
    ):
        with pytest.raises(ValueError, match=match):
            write(path)
    with pytest.raises(ValueError, match="cannot write the plot file in '/proc'"):
        files.check_output_path("/proc/plot.png", what="plot")


def test_output_path_naming_a_device_is_refused(tmp_path):
    link = tmp_path / "null.json"
    link.symlink_to("/dev/null")
    with pytest.raises(ValueError, match="device, FIFO or socket"):
        _placement().save(link)
    assert os.path.exists("/dev/null") and link.is_symlink()


# ------------------------------------------------------------ hostile reads
def test_devices_fifos_and_links_to_them_are_refused_before_reading(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # reading would wait for a writer forever
    zero = tmp_path / "zero.npz"
    zero.symlink_to("/dev/zero")  # reading would never end
    urandom = tmp_path / "random.json"
    urandom.symlink_to("/dev/urandom")
    for path in (fifo, zero, urandom):
        for read in (Placement.load, read_load):
            with pytest.raises(ValueError, match="not a regular file") as info:
                read(path)
            assert str(path) in str(info.value)
    (tmp_path / "dir.npz").mkdir()
    with pytest.raises(ValueError, match="directory"):
        Placement.load(tmp_path / "dir.npz")


def _npy_bytes(shape, dtype="<f8", payload=b"", version=(1, 0)):
    header = {"descr": dtype, "fortran_order": False, "shape": shape}
    buf = io.BytesIO()
    write = np.lib.format.write_array_header_1_0 if version == (1, 0) else np.lib.format.write_array_header_2_0
    write(buf, header)
    return buf.getvalue() + payload


def _npz_with(members: dict, compression=zipfile.ZIP_DEFLATED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=compression) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


def _load_members(extra: dict | None = None) -> dict:
    members = {
        "format.npy": _npy_bytes((), "<U17", "moe_eplb_jax.load".encode("utf-32-le")),
        "version.npy": _npy_bytes((), "<i8", np.int64(1).tobytes()),
    }
    members.update(extra or {})
    return members


@pytest.mark.parametrize("compression", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_npz_header_declaring_a_huge_array_is_refused_before_allocation(tmp_path, compression):
    path = tmp_path / "huge.npz"
    path.write_bytes(_npz_with(_load_members({"load.npy": _npy_bytes((10**13,), payload=b"\0" * 64)}), compression))
    with pytest.raises(ValueError, match=r"field 'load'.*declares shape"):
        read_load(path)


def test_npz_with_pickled_objects_or_foreign_members_is_refused(tmp_path):
    path = tmp_path / "objects.npz"
    with open(path, "wb") as f:
        np.savez(f, load=np.array([[1, 2]], dtype=object), format="moe_eplb_jax.load", version=1)
    with pytest.raises(ValueError, match="field 'load'.*dtype object"):
        read_load(path)
    path.write_bytes(_npz_with(_load_members({"evil.sh": b"rm -rf /"})))
    with pytest.raises(ValueError, match="evil.sh"):
        read_load(path)
    path.write_bytes(_npz_with(_load_members({"load.npy": _npy_bytes((1, 2), payload=b"\0" * 16)})))
    assert read_load(path).load.shape == (1, 1, 2)  # the hand-built archive is valid as such


@given(data=st.data())
def test_damaged_npz_raises_value_error_or_reads_the_original(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("npz") / "p.npz"
    original = _placement(3)
    original.save(path)
    raw = bytearray(path.read_bytes())
    damage = data.draw(st.sampled_from(["truncate", "flip", "zero_run"]))
    if damage == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif damage == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(0, len(raw) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    else:
        start = data.draw(st.integers(0, len(raw) - 1))
        raw[start : start + data.draw(st.integers(1, 64))] = b"\0" * len(raw[start : start + 64])
    path.write_bytes(bytes(raw))
    try:
        loaded = Placement.load(path)
    except ValueError as e:
        assert str(path) in str(e)
    else:
        assert loaded == original


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"format": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply|not valid JSON"),
        ('{"format": "moe_eplb_jax.load", "version": 1, "version": 1, "load": [[1]]}', "duplicate key 'version'"),
        ('{"format": "moe_eplb_jax.load", "version": 1, "load": [[NaN, 1]]}', "NaN is not a JSON number"),
        ('{"format": "moe_eplb_jax.load", "version": 1, "load": [[Infinity]]}', "Infinity"),
        ('{"format": "moe_eplb_jax.load", "version": true, "load": [[1]]}', "'version'"),
        ('{"format": "moe_eplb_jax.load", "version": 1.0, "load": [[1]]}', "'version'"),
        ('{"format": "moe_eplb_jax.load", "version": 1, "load": [[1, true]]}', "field 'load' holds true/false"),
        ('{"format": "moe_eplb_jax.load", "version": 1, "load": [["1", "2"]]}', "field 'load' must hold numbers"),
        ('{"format": "moe_eplb_jax.load", "version": 1, "load": [[1, null]]}', "field 'load'"),
        ('{"format": "moe_eplb_jax.load", "version": 1, "load": [[1e999]]}', "finite"),
        ('{"format": "moe_eplb_jax.load", "version": 1, "load": [[1]], "num_ranks": true}', "'num_ranks'"),
        ('{"format": "moe_eplb_jax.load", "version": 1, "load": [[1]], "num_ranks": 2.0}', "'num_ranks'"),
        ('{"format": "moe_eplb_jax.load", "version": 1, "load": [[1]], "model": 7}', "'model'"),
        ('{"format": "moe_eplb_jax.load", "version": 1, "load": [[1]], "colour": "red"}', "'colour'"),
        ('{"format": "moe_eplb_jax.load", "version": 1, "load": [[1e308, 1e308]]}', "overflows"),
        ('{"format": "moe_eplb_jax.load", "version": 1, "load": [[9007199254740993]]}', "2\\*\\*53"),
    ],
)
def test_malformed_load_json_raises_value_error_naming_the_file(tmp_path, text, match):
    path = tmp_path / "load.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        read_load(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d.update(version=True), "'version'"),
        (lambda d: d.update(num_logical=True), "'num_logical'"),
        (lambda d: d.update(num_layers=3.0), "'num_layers'"),
        (lambda d: d["phy2log"][0].__setitem__(0, 2**32), r"outside|int32"),
        (lambda d: d["phy2log"][0].__setitem__(0, 2**32 + 1), r"outside|int32"),
        (lambda d: d["phy2log"][0].__setitem__(0, 2**64 + 1), "phy2log"),
        (lambda d: d["phy2log"][0].__setitem__(0, -(2**63) - 5), "phy2log"),
        (lambda d: d["phy2log"][0].__setitem__(0, 1.0), "must hold integers"),
        (lambda d: d["phy2log"][0].__setitem__(0, True), "true/false"),
        (lambda d: d.update(extra=1), "unknown field"),
    ],
)
def test_placement_json_values_are_exact_or_refused(tmp_path, mutate, match):
    p = Placement.linear(2, 4, 6)
    doc = _doc(p)
    mutate(doc)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=match):
        Placement.load(path)


@pytest.mark.parametrize("dtype", [np.int64, np.uint64, np.uint32])
def test_wide_integer_npz_ids_never_wrap(tmp_path, dtype):
    p = Placement.linear(2, 4, 6)
    phy2log = p.phy2log.astype(dtype)
    phy2log[1, 5] = 2**32 + 1 if np.iinfo(dtype).max > 2**32 else 2**31 + 1  # wraps to expert 1 in int32
    path = tmp_path / "p.npz"
    with open(path, "wb") as f:
        np.savez(f, format=FILE_FORMAT, version=1, num_layers=2, num_logical=4, num_physical=6, phy2log=phy2log)
    with pytest.raises(ValueError, match=r"phy2log.*(outside|int32)"):
        Placement.load(path)
    with pytest.raises(ValueError, match=r"phy2log.*(outside|int32)"):
        Placement.from_phy2log(phy2log, 4)


def test_wide_integer_load_counts_stay_exact(tmp_path):
    load = np.full((2, 3, 4), 3 * 2**31 + 7, dtype=np.int64)  # int32 would wrap these
    path = tmp_path / "load.npz"
    save_load(path, load)
    np.testing.assert_array_equal(read_load(path).load, load.astype(np.float64))
    assert read_load(path).load[0, 0, 0] == 3 * 2**31 + 7
    json_path = tmp_path / "load.json"
    save_load(json_path, load)
    assert read_load(json_path).load[1, 2, 3] == 3 * 2**31 + 7
    with pytest.raises(ValueError, match=r"2\*\*53"):
        save_load(path, np.full((1, 2), 2**60, dtype=np.uint64))


def test_save_load_metadata_is_typed():
    with pytest.raises(ValueError, match="'num_ranks'"):
        save_load("x.npz", np.ones((2, 4)), num_ranks=True)
    with pytest.raises(ValueError, match="'top_k'"):
        save_load("x.npz", np.ones((2, 4)), top_k=2.5)
    with pytest.raises(ValueError, match="'note'"):
        save_load("x.npz", np.ones((2, 4)), note=3)
    with pytest.raises(ValueError, match="must hold numbers"):
        save_load("x.npz", np.array([[True, False]]))


# ---------------------------------------------------------------- SGLang
def test_sglang_placement_round_trip(tmp_path):
    p = _placement(5, num_layers=4, num_logical=16, num_physical=24)
    path = tmp_path / "expert_location.json"
    p.save(path, format="sglang")
    doc = json.loads(path.read_text())
    # SGLang calls init_by_mapping(**doc): the object must hold that one field and nothing else.
    assert list(doc) == ["physical_to_logical_map"]
    assert doc["physical_to_logical_map"] == p.phy2log.tolist()
    q = Placement.load(path, num_ranks=4)
    assert q == p  # SGLang's logical_to_all_physical_map lists replicas in ascending slot order, as ours
    assert Placement.load(path, num_logical=16) == p
    with pytest.raises(ValueError, match="expert 16 of layer 0 has no replica"):
        Placement.load(path, num_logical=17)
    with pytest.raises(ValueError, match=r"\.json"):
        p.save(tmp_path / "x.npz", format="sglang")
    with pytest.raises(ValueError, match="format must be one of"):
        p.save(tmp_path / "x.json", format="vllm")


def test_sglang_files_hold_a_row_per_decoder_block(tmp_path):
    """SGLang sizes its map by num_hidden_layers and reads row layer_id for MoE block layer_id; a model with dense
    blocks got one row per MoE layer, so SGLang read the wrong rows (and too few)."""
    p = _placement(2, num_layers=3, num_logical=8, num_physical=12)
    path = tmp_path / "loc.json"
    p.save(path, format="sglang", layer_ids=[1, 3, 4], num_hidden_layers=6)
    rows = json.loads(path.read_text())["physical_to_logical_map"]
    assert len(rows) == 6  # SGLang's ModelConfigForExpertLocation.num_layers: the model's num_hidden_layers
    trivial = (np.arange(12) % 8).tolist()  # SGLang's own map for a block (init_trivial)
    assert [rows[i] for i in (0, 2, 5)] == [trivial] * 3 and [rows[i] for i in (1, 3, 4)] == p.phy2log.tolist()
    assert Placement.load(path, layer_ids=[1, 3, 4]) == p
    assert Placement.load(path, layer_ids=[1, 3, 4], num_logical=8, num_ranks=4) == p
    p.save(tmp_path / "moe_rows.json", format="sglang")  # a file of the MoE rows only is read whole
    assert Placement.load(tmp_path / "moe_rows.json", layer_ids=[1, 3, 4]) == p
    for ids, blocks, match in (
        ([1, 3], 6, "layer_ids must be 3 block indices"),
        ([1, 1, 4], 6, "layer_ids must increase strictly"),
        ([1, 3, 6], 6, r"within \[0, num_hidden_layers=6\)"),
        ([1, 3, 4], 0, "num_hidden_layers must be >= 1"),
    ):
        with pytest.raises(ValueError, match=match):
            p.save(path, format="sglang", layer_ids=ids, num_hidden_layers=blocks)
    with pytest.raises(ValueError, match="use format='sglang'"):
        p.save(tmp_path / "p.json", layer_ids=[1, 3, 4])
    with pytest.raises(ValueError, match="loc.json: layer_ids must increase strictly"):
        Placement.load(path, layer_ids=[4, 3, 1, 0])


def test_one_placement_routes_the_same_from_our_file_and_sglangs(tmp_path):
    """Our files kept the policy's replica order, SGLang's loader (and ours of its files) lists them by slot: one
    phy2log routed differently (hash picks replica j of log2phy)."""
    from moe_eplb_jax.policy import rebalance_experts
    from moe_eplb_jax.routing import map_and_count

    weight = np.random.default_rng(3).gamma(0.5, 10.0, size=(2, 16))
    tables = rebalance_experts(weight, 24, 1, 1, 4)
    ascending = np.sort(np.where(tables[1] < 0, 99, tables[1]), axis=-1)
    assert not np.array_equal(np.where(ascending == 99, -1, ascending), tables[1])  # the policy's order differs
    placement = Placement.from_tables(*tables, num_ranks=4)
    loaded = []
    for name, fmt in (("p.json", "moe_eplb_jax"), ("p.npz", "moe_eplb_jax"), ("s.json", "sglang")):
        placement.save(tmp_path / name, format=fmt)
        loaded.append(Placement.load(tmp_path / name, num_logical=16))
    for q in loaded:
        assert np.array_equal(q.log2phy, loaded[-1].log2phy) and np.array_equal(q.log2phy, placement.log2phy)
    ids = np.random.default_rng(4).integers(0, 16, size=(64, 4)).astype(np.int32)
    routed = [
        np.asarray(map_and_count(ids, q.log2phy[0], q.logcnt[0], num_physical=24, mode="hash")[0]) for q in loaded
    ]
    assert all(np.array_equal(r, routed[0]) for r in routed)


@pytest.mark.parametrize(
    "doc, match",
    [
        ({"physical_to_logical_map": [[0, 1, 2, 4, 4]]}, "expert 3 of layer 0 has no replica"),
        ({"physical_to_logical_map": [[0, 1], [0]]}, "rectangular"),
        ({"physical_to_logical_map": [0, 1]}, r"shape \[L, P\]"),
        ({"physical_to_logical_map": [[0, 1, -1]]}, "outside the logical expert range"),
        ({"physical_to_logical_map": [[0, 1, 2**33]]}, "int32"),
        ({"physical_to_logical_map": [[0, 1]], "num_gpus": 2}, "unknown field"),
        ({"logical_count": [[1, 2]]}, "SGLang load file"),
    ],
)
def test_sglang_placement_files_are_validated(tmp_path, doc, match):
    path = tmp_path / "loc.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=match):
        Placement.load(path)


def test_sglang_logical_count_reads_as_a_load_file(tmp_path):
    path = tmp_path / "count.json"
    path.write_text(json.dumps({"logical_count": [[[1, 2, 3, 4]], [[5, 6, 7, 8]]]}))
    trace = read_load(path)
    assert trace.load.shape == (2, 1, 4) and trace.total().tolist() == [[6.0, 8.0, 10.0, 12.0]]
    path.write_text(json.dumps({"logical_count": [[1, 2]], "extra": 1}))
    with pytest.raises(ValueError, match="unknown field"):
        read_load(path)


def test_non_utf8_json_is_refused(tmp_path):
    path = tmp_path / "load.json"
    path.write_bytes(b'{"format": "moe_eplb_jax.load", "version": 1, "load": [[1]], "note": "\xff"}')
    with pytest.raises(ValueError, match="not valid JSON"):
        read_load(path)


def test_read_helpers_name_file_and_field(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('{"a": [[1, 2], [3]], "b": "x", "c": true}')
    doc = files.read_json(path, what="test")
    with pytest.raises(ValueError, match=f"{path}: field 'a' is not a rectangular"):
        files.array_field(doc, "a", str(path), kind="number")
    with pytest.raises(ValueError, match="field 'b' must hold numbers"):
        files.array_field(doc, "b", str(path), kind="number")
    with pytest.raises(ValueError, match="field 'c' must be a positive integer"):
        files.int_field(doc, "c", str(path), minimum=1)
    with pytest.raises(ValueError, match="missing field 'd'"):
        files.int_field(doc, "d", str(path))

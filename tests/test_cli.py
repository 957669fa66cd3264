"""The moe-eplb command-line tool, run in-process."""

import importlib.util
import json
import os

import numpy as np
import pytest

from moe_eplb_jax.cli import main
from moe_eplb_jax.placement import Placement
from moe_eplb_jax.sim import read_load

needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="plots need matplotlib (pip install -e '.[test]')"
)


@needs_matplotlib
def test_cli_end_to_end(tmp_path, capsys):
    load = tmp_path / "load.npz"
    assert (
        main(
            [
                "generate",
                "-o",
                str(load),
                "--num-ranks",
                "4",
                "--experts-per-rank",
                "4",
                "--num-layers",
                "2",
                "--num-steps",
                "3",
                "--tokens",
                "256",
                "--seed",
                "3",
            ]
        )
        == 0
    )
    assert read_load(load).load.shape == (3, 2, 16)
    assert main(["stats", str(load), "--num-ranks", "4"]) == 0
    out = capsys.readouterr().out
    assert "imb before" in out and "balancedness before" in out
    placement = tmp_path / "p.json"
    assert main(["fit", str(load), "--num-ranks", "4", "--num-physical", "24", "-o", str(placement)]) == 0
    fitted = Placement.load(placement, num_ranks=4)
    assert fitted.phy2log.shape == (2, 24)
    assert main(["stats", str(load), "--num-ranks", "4", "--placement", str(placement)]) == 0
    out = capsys.readouterr().out
    before, after = (float(x) for x in out.strip().splitlines()[-1].replace("balancedness before:", "").split("after:"))
    assert after > before
    png = tmp_path / "map.png"
    assert main(["heatmap", str(load), "--num-ranks", "4", "--placement", str(placement), "-o", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    sim_png = tmp_path / "sim.png"
    assert (
        main(
            [
                "simulate",
                "--load",
                str(load),
                "--num-ranks",
                "4",
                "--num-spare",
                "2",
                "--policies",
                "none,online",
                "--plot",
                str(sim_png),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "online" in out and sim_png.exists()


def test_cli_errors(tmp_path, capsys):
    load = tmp_path / "load.json"
    main(
        [
            "generate",
            "-o",
            str(load),
            "--generator",
            "lognormal",
            "--num-ranks",
            "2",
            "--num-steps",
            "1",
            "--num-layers",
            "1",
        ]
    )
    capsys.readouterr()
    assert main(["fit", str(load), "--num-ranks", "3", "--num-physical", "12", "-o", str(tmp_path / "x.json")]) == 2
    assert "not divisible" in capsys.readouterr().err
    assert main(["stats", str(tmp_path / "missing.npz"), "--num-ranks", "2"]) == 2
    assert (
        main(
            [
                "fit",
                str(load),
                "--num-ranks",
                "2",
                "--num-physical",
                "10",
                "--policy",
                "nope",
                "-o",
                str(tmp_path / "y.json"),
            ]
        )
        == 2
    )
    assert "invalid choice: 'nope'" in capsys.readouterr().err
    assert not (tmp_path / "y.json").exists()
    np.testing.assert_equal(read_load(load).load.shape, (1, 1, 8))


# --------------------------------------------------------------------------- bad input: one line, exit 2
def _small_load(tmp_path, name="load.npz", load=None):
    from moe_eplb_jax.sim import save_load

    path = tmp_path / name
    save_load(path, np.arange(2 * 16, dtype=np.int64).reshape(2, 16) + 1 if load is None else load)
    return str(path)


def _fails_cleanly(capsys, argv, match=None):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("moe-eplb") and "error" in last
    if match is not None:
        assert match in last, last
    return last


def test_bad_output_paths_fail_before_any_work(tmp_path, capsys):
    load = _small_load(tmp_path)
    (tmp_path / "dir.json").mkdir()
    (tmp_path / "dir.png").mkdir()
    missing = str(tmp_path / "missing" / "out.json")
    _fails_cleanly(capsys, ["generate", "-o", missing], "does not exist")
    _fails_cleanly(capsys, ["fit", load, "--num-ranks", "4", "--num-physical", "20", "-o", missing], "does not exist")
    _fails_cleanly(
        capsys, ["fit", load, "--num-ranks", "4", "--num-physical", "20", "-o", str(tmp_path / "dir.json")], "directory"
    )
    _fails_cleanly(capsys, ["heatmap", load, "--num-ranks", "4", "-o", str(tmp_path / "dir.png")], "directory")
    missing_png = str(tmp_path / "missing" / "out.png")
    _fails_cleanly(capsys, ["simulate", "--load", load, "--num-ranks", "4", "--plot", missing_png], "does not exist")
    _fails_cleanly(
        capsys,
        ["fit", load, "--num-ranks", "4", "--num-physical", "20", "--format", "sglang", "-o", str(tmp_path / "p.npz")],
        ".json",
    )


def test_damaged_input_files_fail_cleanly(tmp_path, capsys):
    good = _small_load(tmp_path)
    raw = (tmp_path / "load.npz").read_bytes()
    for name, data in (("truncated.npz", raw[: len(raw) // 2]), ("garbage.npz", b"PK\x03\x04" + b"\x00" * 50)):
        (tmp_path / name).write_bytes(data)
        _fails_cleanly(capsys, ["stats", str(tmp_path / name), "--num-ranks", "4"], name)
    (tmp_path / "deep.json").write_text('{"format": ' + "[" * 50_000 + "]" * 50_000 + "}")
    _fails_cleanly(capsys, ["stats", str(tmp_path / "deep.json"), "--num-ranks", "4"], "deep.json")
    os.mkfifo(tmp_path / "fifo.json")
    _fails_cleanly(capsys, ["stats", str(tmp_path / "fifo.json"), "--num-ranks", "4"], "not a regular file")
    _fails_cleanly(capsys, ["stats", good, "--num-ranks", "4", "--placement", str(tmp_path / "fifo.json")])
    huge = tmp_path / "huge.json"  # every value finite, the totals not: save_load refuses to write it
    huge.write_text(json.dumps({"format": "moe_eplb_jax.load", "version": 1, "load": [[1e308] * 16] * 2}))
    _fails_cleanly(capsys, ["stats", str(huge), "--num-ranks", "4"], "overflows")


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "--expert-mb", "-5"],
        ["simulate", "--expert-mb", "nan"],
        ["simulate", "--expert-mb", "inf"],
        ["generate", "-o", "x.npz", "--imbalance", "nan"],
        ["generate", "-o", "x.npz", "--sigma", "-1"],
        ["generate", "-o", "x.npz", "--num-layers", "1e9"],
        ["generate", "-o", "x.npz", "--seed", "-3"],
        ["generate", "-o", "x.npz", "--num-ranks", "0"],
        ["generate", "-o", "x.npz", "--tokens", str(2**40)],
        ["fit", "x.npz", "--num-ranks", "2", "--num-physical", "8", "--policy", "nope", "-o", "y.json"],
        ["fit", "x.npz", "--num-ranks", "2", "--num-physical", "8", "--format", "yaml", "-o", "y.json"],
    ],
)
def test_absurd_flags_are_refused_by_the_parser(argv, capsys):
    _fails_cleanly(capsys, argv)


def test_huge_sizes_are_refused_before_allocating(tmp_path, capsys):
    out = str(tmp_path / "x.npz")
    _fails_cleanly(capsys, ["generate", "-o", out, "--num-layers", "1000000000"], "too large")
    _fails_cleanly(capsys, ["generate", "-o", out, "--num-steps", "100000", "--experts-per-rank", "1000"], "too large")
    big_k = ["--top-k", "600000", "--experts-per-rank", "80000", "--num-steps", "1", "--num-layers", "1"]
    _fails_cleanly(capsys, ["generate", "-o", out, "--tokens", "2000000000", *big_k], "2**53")
    _fails_cleanly(capsys, ["simulate", "--num-spare", "1000000000"], "num_spare")
    load = _small_load(tmp_path)
    _fails_cleanly(capsys, ["fit", load, "--num-ranks", "4", "--num-physical", "1000000000", "-o", out], "slots")
    assert not os.path.exists(out)


def test_version_help_defaults_and_choices(capsys):
    from moe_eplb_jax import __version__, policy

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"moe-eplb {__version__}"
    assert main(["fit", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"(default: {policy.DEFAULT_POLICY})" in text
    assert "{" + ",".join([*policy.available(), policy.FILL]) + "}" in text
    assert "{moe_eplb_jax,sglang}" in text and "(default: moe_eplb_jax)" in text
    assert main(["simulate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "deepseek+lp" in text and "(default: 44.0)" in text and "(default: 2)" in text


def test_fit_defaults_to_the_library_policy_and_writes_sglang_files(tmp_path, capsys):
    from moe_eplb_jax import policy
    from moe_eplb_jax.sim import read_load

    load = _small_load(tmp_path)
    out = tmp_path / "p.json"
    assert main(["fit", load, "--num-ranks", "4", "--num-physical", "20", "-o", str(out)]) == 0
    assert f"({policy.DEFAULT_POLICY}," in capsys.readouterr().out
    expected = Placement.from_tables(*policy.get(policy.DEFAULT_POLICY)(read_load(load).total(), 20, 1, 1, 4))
    assert Placement.load(out) == expected
    sglang = tmp_path / "sglang.json"
    argv = ["fit", load, "--num-ranks", "4", "--num-physical", "20", "--format", "sglang", "-o", str(sglang)]
    assert main(argv) == 0
    assert json.loads(sglang.read_text()) == {"physical_to_logical_map": expected.phy2log.tolist()}
    capsys.readouterr()
    assert main(["stats", load, "--num-ranks", "4", "--placement", str(sglang)]) == 0
    assert "after:" in capsys.readouterr().out


def test_simulate_reports_progress_on_stderr(tmp_path, capsys):
    load = _small_load(tmp_path, load=np.arange(3 * 2 * 16).reshape(3, 2, 16) + 1)
    assert main(["simulate", "--load", load, "--num-ranks", "4", "--num-spare", "1", "--policies", "none"]) == 0
    captured = capsys.readouterr()
    assert "3 steps" in captured.err and "done in" in captured.err
    assert "none" in captured.out and "3 steps" not in captured.out


def test_cli_help_and_errors_say_the_same_things(tmp_path, capsys):
    """heatmap -o x.jpg wrote a format its help does not list; generate --top-k above E was accepted; simulate's
    help and its error listed different policy names."""
    from moe_eplb_jax.sim.report import policy_names

    load = _small_load(tmp_path)
    for suffix in (".jpg", ".tiff", ".eps"):
        out = tmp_path / f"map{suffix}"
        _fails_cleanly(capsys, ["heatmap", load, "--num-ranks", "4", "-o", str(out)], ".png or .pdf or .svg")
        assert not out.exists()
        _fails_cleanly(capsys, ["simulate", "--policies", "none", "--plot", str(out)], ".png or .pdf or .svg")
    _fails_cleanly(capsys, ["generate", "-o", str(tmp_path / "g.npz"), "--top-k", "33"], "--top-k 33 exceeds the 32")
    _fails_cleanly(capsys, ["simulate", "--top-k", "40"], "--top-k 40 exceeds the 32 experts")
    assert main(["simulate", "--help"]) == 0
    helped = " ".join(capsys.readouterr().out.split())
    listed = ", ".join(policy_names())
    assert listed in helped
    _fails_cleanly(capsys, ["simulate", "--policies", "none,quota+lp"], f"choose from {listed}")


def test_fit_plans_a_scale_event_from_a_placement_on_other_ranks(tmp_path, capsys):
    """8 ranks -> 7 (and with rank 3 lost): the placement for 7 ranks is written, the move reported; bad flags
    fail with one line."""
    load = str(tmp_path / "load.npz")
    assert main(["generate", "-o", load, "--num-ranks", "8", "--experts-per-rank", "6", "--num-steps", "2"]) == 0
    old = str(tmp_path / "p8.json")
    assert main(["fit", load, "--num-ranks", "8", "--num-physical", "56", "-o", old]) == 0
    capsys.readouterr()
    new = tmp_path / "p7.json"
    argv = ["fit", load, "--num-ranks", "7", "--num-physical", "56", "--from-placement", old, "--from-num-ranks", "8"]
    assert main([*argv, "--policy", "fill", "-o", str(new)]) == 0
    out = capsys.readouterr().out
    assert "imb EP8" in out and "imb EP7" in out and "fill" in out and "8->7" in out
    fitted, before = Placement.load(new, num_ranks=7), Placement.load(old, num_ranks=8)
    row = next(line for line in out.splitlines() if line.startswith("fill"))
    rows_moved, reloaded = int(row.split()[4]), int(row.split()[5])
    assert reloaded == 0 and 0 < rows_moved <= 4 * 7  # the leaving rank's slots
    kept = fitted.phy2log.reshape(4, 7, 8)[..., :7]  # ranks 0-6 keep their 7 old slots, rank 7 leaves
    np.testing.assert_array_equal(kept, before.phy2log.reshape(4, 8, 7)[:, :7])
    assert main([*argv, "--lost-ranks", "3", "-o", str(new)]) == 0
    assert "ranks [3] lost" in capsys.readouterr().out
    out7 = str(tmp_path / "x.json")
    _fails_cleanly(capsys, [*argv[:-2], "-o", out7], "--from-num-ranks")
    _fails_cleanly(capsys, [*argv, "--lost-ranks", "9", "-o", out7], "--lost-ranks 9")
    _fails_cleanly(capsys, ["fit", load, "--num-ranks", "8", "--num-physical", "56", "--policy", "fill", "-o", out7])
    _fails_cleanly(capsys, ["fit", load, "--num-ranks", "8", "--num-physical", "56", "--lost-ranks", "1", "-o", out7])
    _fails_cleanly(capsys, [*argv[:-1], "3", "-o", out7], "not divisible by 3 ranks")

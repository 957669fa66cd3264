"""The moe-eplb command-line tool, run in-process."""

import numpy as np

from moe_eplb_jax.cli import main
from moe_eplb_jax.placement import Placement
from moe_eplb_jax.sim import read_load


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

"""The example scripts: flags checked up front (one argparse line, exit 2), help with defaults, full runs."""

import os
import re
import shutil
import sys

import jax
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import serve
import train


@pytest.mark.parametrize(
    ("script", "argv", "message"),
    [
        (serve, ["--ranks", "3"], "--batch = 64 is not divisible by the 3 EP ranks"),
        (train, ["--ranks", "3"], "--batch = 16 is not divisible by the 3 EP ranks"),
        (serve, ["--batch", "12"], "--batch = 12 is not divisible by the 8 EP ranks"),
        (serve, ["--redundant", "3"], r"P = E \+ --redundant = 19 is not divisible by the 8 EP ranks"),
        (serve, ["--ranks", "16"], "--ranks 16 exceeds the 8 simulated devices"),
        (train, ["--steps", "-5"], "argument --steps: '-5' must be a positive integer"),
        (train, ["--steps", "1e9"], "argument --steps: '1e9' is not an integer"),
        (train, ["--lr", "nan"], "argument --lr: 'nan' is not a finite number"),
        (serve, ["--top-p", "0"], r"argument --top-p: '0' must be in \(0, 1\]"),
        (serve, ["--temperature", "-1"], "argument --temperature: '-1' must be a number >= 0"),
        (serve, ["--max-prompt", "600"], "exceeds the tiny preset's max_seq_len 512"),
        (serve, ["--min-prompt", "9", "--max-prompt", "8"], "--min-prompt 9 exceeds --max-prompt 8"),
        (serve, ["--init-placement", "/nonexistent/p.json"], "no such file or directory"),
        (serve, ["--save-placement", "/nonexistent/dir/p.json"], "its directory does not exist"),
        (serve, ["--quantize", "mxfp4"], "--quantize needs --checkpoint"),
        (serve, ["--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
        (serve, ["--process-id", "1"], "--process-id 1 must be below --num-processes 1"),
        (train, ["--resume"], "--resume needs --checkpoint-dir"),
        (train, ["--seq", "600"], "--seq 600 \\+ 1 exceeds"),
    ],
)
def test_bad_flags_exit_2_with_one_line(capsys, script, argv, message):
    with pytest.raises(SystemExit) as e:
        script.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert ": error: " in err[-1] and re.search(message, err[-1]), err
    assert not any("Traceback" in line for line in err)


@pytest.mark.parametrize("script", [serve, train])
def test_help_shows_defaults(capsys, script):
    with pytest.raises(SystemExit) as e:
        script.parse_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "(default: tiny)" in out and "(default: 8)" in out and "{deepseek_v3_small,small,tiny}" in out


@pytest.fixture
def keep_environment(monkeypatch):
    """The scripts set JAX's device flags in os.environ (no effect once JAX runs): undo that afterwards."""
    for name in ("XLA_FLAGS", "JAX_PLATFORMS"):
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])
        else:
            monkeypatch.delenv(name, raising=False)


@pytest.mark.slow
@pytest.mark.usefixtures("keep_environment")
def test_serve_runs_and_rebalances(capsys):
    serve.main(["--batch", "8", "--new-tokens", "3", "--max-prompt", "8", "--warmup-batches", "2", "--batches", "1"])
    out = capsys.readouterr().out
    assert "=== summary ===" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("balancedness (measured) before"))
    before, after = (float(x) for x in line.split("before ")[1].split("  ")[0].split(" -> after "))
    assert 0 < before <= 1 and 0 < after <= 1
    assert "rearrangement: " in out and "between decode steps" in out


@pytest.mark.slow
@pytest.mark.usefixtures("keep_environment")
def test_train_checkpoints_and_resumes_exactly(capsys, tmp_path):
    """Six steps with checkpoints at 3 and 6; the one at 6 removed, --resume from 3 repeats steps 4-6 exactly."""
    ckpt = tmp_path / "ckpt"
    common = ["--batch", "8", "--seq", "8", "--step-interval", "4", "--log-every", "1", "--checkpoint-dir", str(ckpt)]
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):  # optax's Adam mixes dtypes
        train.main([*common, "--steps", "6", "--checkpoint-every", "3"])
        straight = capsys.readouterr().out
        assert sorted(os.listdir(ckpt)) == ["3", "6", "eplb-3.npz", "eplb-6.npz"]
        shutil.rmtree(ckpt / "6")
        os.remove(ckpt / "eplb-6.npz")
        train.main([*common, "--steps", "6", "--resume"])
        resumed = capsys.readouterr().out
    assert "step 3: checkpoint saved" in straight and "resumed from step 3 (1 rearrangements so far)" in resumed
    assert "step 5: rearranged" in straight and "step 5: rearranged" in resumed  # the window and counters came back

    def losses(text, first):
        return [ln for ln in text.splitlines() if ln.startswith("step ") and ": loss " in ln][first:]

    assert losses(straight, 3) == losses(resumed, 0) and len(losses(resumed, 0)) == 3
    final = [ln for ln in straight.splitlines() if ln.startswith("rearrangements:")]
    assert final and final == [ln for ln in resumed.splitlines() if ln.startswith("rearrangements:")]
    loss = [float(ln.split("loss ")[1]) for ln in losses(straight, 0)]
    assert loss[-1] < loss[0]

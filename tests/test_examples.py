"""The example scripts: flags checked up front (one argparse line, exit 2), help with defaults, full runs."""

import json
import os
import re
import shutil

import jax
import numpy as np
import placement_demo
import pytest
import serve
import train
import train_functional

from moe_eplb_jax import cli
from moe_eplb_jax.placement import Placement


def _parse(script, argv):
    """``parse_args`` of any example (placement_demo parses inside ``main``)."""
    return script.main(argv) if script is placement_demo else script.parse_args(argv)


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
        (serve, ["--dump-loads", "/nonexistent/dir/loads.npz"], "--dump-loads .*: its directory does not exist"),
        (serve, ["--dump-loads", "loads.txt"], "must end in .json or .npz"),
        (serve, ["--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
        (serve, ["--process-id", "1"], "--process-id 1 must be below --num-processes 1"),
        (train, ["--resume"], "--resume needs --checkpoint-dir"),
        (train, ["--seq", "600"], "--seq 600 \\+ 1 exceeds"),
        (train, ["--scale-to", "3"], "--batch = 16 is not divisible by the 3 EP ranks"),
        (train, ["--scale-to", "16"], "--scale-to 16 exceeds the 8 simulated devices"),
        (train, ["--scale-at", "4"], "--scale-at needs --scale-to"),
        (serve, ["--eplb-config", "/nonexistent/eplb.json"], "--eplb-config /nonexistent/eplb.json: no such file"),
        (serve, ["--eplb-config", "{"], "--eplb-config: EplbConfig: not valid JSON"),
        (train, ["--eplb-config", '{"window": 4}'], r"--eplb-config: EplbConfig: unknown field\(s\) \['window'\]"),
        (train, ["--eplb-config", '{"policy": "nope"}'], "--eplb-config: EplbConfig.policy: "),
        (serve, ["--eplb-config", '{"step_interval": 0}'], "EplbConfig.step_interval must be a positive integer"),
        (serve, ["--eplb-config", '{"num_gpus": 4}'], "num_gpus=4 but the run has 8 EP ranks"),
        (
            train,
            ["--eplb-config", '{"routing": "quota", "policy": "balanced"}'],
            "routing 'quota' needs policy 'online' .* write \"policy\": \"online\" in --eplb-config",
        ),
        (serve, ["--routing", "quota", "--eplb-config", '{"policy": "deepseek"}'], "routing 'quota' needs policy"),
        (serve, ["--routing", "fast"], "argument --routing: invalid choice: 'fast'"),
        # A file's R that the EP size does not divide is caught as the flag's would be.
        (train, ["--eplb-config", '{"num_redundant_experts": 3}'], r"P = E \+ --redundant = 19 is not divisible"),
        (train_functional, ["--batch", "12"], "--batch = 12 is not divisible by the 8 EP ranks"),
        (train_functional, ["--steps", "0"], "argument --steps: '0' must be a positive integer"),
        (train_functional, ["--eplb-config", '{"use_async": 1}'], "field 'use_async' must be true or false"),
        (placement_demo, ["--experts", "60"], "60 experts \\+ 32 redundant = 92 slots, not divisible by num_gpus=32"),
        (placement_demo, ["--gpus", "6", "--redundant", "0", "--experts", "24"], "num_gpus .6. is not divisible by"),
        (placement_demo, ["--eplb-config", '{"log_balancedness": "yes"}'], "must be true or false"),
    ],
)
def test_bad_flags_exit_2_with_one_line(capsys, script, argv, message):
    with pytest.raises(SystemExit) as e:
        _parse(script, argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert ": error: " in err[-1] and re.search(message, err[-1]), err
    assert not any("Traceback" in line for line in err)


@pytest.mark.parametrize("script", [serve, train, train_functional, placement_demo])
def test_help_shows_defaults(capsys, script):
    with pytest.raises(SystemExit) as e:
        _parse(script, ["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--eplb-config FILE" in out and "vLLM's field names" in out
    if script is not placement_demo:
        assert "(default: 8)" in out
    if script in (serve, train):
        assert "(default: tiny)" in out and "{deepseek_v3_small,deepseek_v3_tiny,small,tiny}" in out
        assert "--routing {hash,round_robin,lp,quota}" in out and "quota uses policy online" in out
    flat = " ".join(out.split())
    assert "(default: None)" not in flat and not re.search(r"\(default: [^)]*\) \(default:", flat)  # said once


def test_eplb_config_layers_defaults_file_and_flags(tmp_path):
    """The example's defaults, then the fields the file names (vLLM's names too), then the flags given."""
    path = tmp_path / "eplb.json"
    path.write_text(json.dumps({"use_async": False, "window_size": 5, "num_redundant_experts": 16}))
    _, args = serve.parse_args(["--eplb-config", str(path)])
    assert args.redundant == 16 and args.eplb["num_redundant_experts"] == 16
    assert args.eplb["window_size"] == 5 and args.eplb["overlap"] is None  # the file's use_async: false
    assert args.eplb["step_interval"] == 4 * serve.rearrange_at(args)  # not in the file: the example's
    _, args = serve.parse_args(["--eplb-config", str(path), "--redundant", "8"])
    assert args.redundant == 8 and args.eplb["num_redundant_experts"] == 8  # the flag wins
    _, args = serve.parse_args([])
    assert args.eplb["overlap"] == "layer" and args.redundant == 8
    _, args = train.parse_args(["--eplb-config", '{"step_interval": 12, "log_balancedness": true}'])
    assert args.eplb == {"num_redundant_experts": 8, "step_interval": 12, "window_size": 12, "log_interval": 1}
    _, args = train.parse_args(["--eplb-config", '{"step_interval": 12, "window_size": 3}', "--step-interval", "6"])
    assert (args.eplb["step_interval"], args.eplb["window_size"]) == (6, 6)


def test_placement_demo_runs_with_a_config_file(capsys, tmp_path):
    """The file's topology and policy (only that policy is listed); a flag given overrides the file."""
    path = tmp_path / "eplb.json"
    path.write_text('{"num_redundant_experts": 8, "num_groups": 4, "policy": "deepseek"}')
    common = ["--layers", "3", "--experts", "16", "--gpus", "8", "--eplb-config", str(path)]
    placement_demo.main(common)
    from_file = capsys.readouterr().out
    placement_demo.main([*common, "--redundant", "16", "--nodes", "2"])
    with_flags = capsys.readouterr().out
    assert from_file.startswith("3 layers, 16 experts, 24 slots on 8 GPUs (4 nodes, 4 groups)")
    assert with_flags.startswith("3 layers, 16 experts, 32 slots on 8 GPUs (2 nodes, 4 groups)")
    for out in (from_file, with_flags):
        rows = out.splitlines()[2:]
        assert [row.split()[0] for row in rows] == ["linear", "deepseek"]
        before, after = (float(row.split()[-3 if row.startswith("deepseek") else -2]) for row in rows)
        assert 0 < before < after <= 1


def _one_line_exit_2(capsys, call, message):
    with pytest.raises(SystemExit) as e:
        call()
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert ": error: " in err[-1] and re.search(message, err[-1]), err
    assert not any("Traceback" in line for line in err)


def test_output_paths_and_config_files_are_checked_before_the_run(capsys, tmp_path):
    """Output paths a run could not write failed with a traceback after the run; a config file that is not UTF-8
    text did not name the flag, a FIFO blocked."""
    (tmp_path / "loads.npz").mkdir()
    latin = tmp_path / "eplb.json"
    latin.write_bytes('{"policy": "défaut"}'.encode("latin-1"))
    os.mkfifo(tmp_path / "fifo.json")
    for script, argv, message in (
        (serve, ["--dump-loads", str(tmp_path / "loads.npz")], r"--dump-loads .*loads\.npz: it is a directory"),
        (serve, ["--save-placement", "/proc/p.json"], r"--save-placement /proc/p\.json: cannot write in /proc"),
        (serve, ["--dump-loads", "/sys/loads.npz"], r"--dump-loads /sys/loads\.npz: cannot write in /sys"),
        (serve, ["--eplb-config", str(latin)], r"--eplb-config .*eplb\.json: not UTF-8 text"),
        (train, ["--eplb-config", str(tmp_path / "fifo.json")], "--eplb-config .*fifo.json: not a regular file"),
        (serve, ["--eplb-config", '{"window_size": 1e30}'], "EplbConfig.window_size must be a positive integer"),
        (serve, ["--eplb-config", '{"window_size": ' + "9" * 30 + "}"], "window_size must be a positive integer up to"),
        (train, ["--checkpoint-dir", "/proc/ckpt"], "--checkpoint-dir /proc/ckpt: cannot write in /proc"),
        (train, ["--checkpoint-dir", str(latin)], "--checkpoint-dir .*: it is not a directory"),
    ):
        _one_line_exit_2(capsys, lambda: _parse(script, argv), message)


@pytest.mark.usefixtures("keep_environment")
def test_a_window_one_device_cannot_hold_exits_2_before_the_model_is_built(capsys):
    big = '{"window_size": 2147483647}'
    for script in (serve, train, train_functional):
        _one_line_exit_2(capsys, lambda: script.main(["--eplb-config", big]), "EplbConfig.window_size")


@pytest.mark.usefixtures("keep_environment")
def test_train_resume_from_a_damaged_checkpoint_exits_2_with_one_line(capsys, tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / "3").mkdir(parents=True)
    (ckpt / "3" / "_CHECKPOINT_METADATA").write_text("garbage")
    argv = ["--batch", "8", "--seq", "8", "--checkpoint-dir", str(ckpt), "--resume"]
    _one_line_exit_2(capsys, lambda: train.main(argv), r"--resume: .*ckpt: step 3 cannot be restored \(KeyError")
    _one_line_exit_2(capsys, lambda: train.main([*argv[:-2], str(tmp_path), "--resume"]), "holds no checkpoint")


def test_routing_and_quantize_flags(capsys):
    """serve had no --routing (quota also needs the online policy: the flag brings it); --quantize needed a
    checkpoint that nothing wrote (now the model's own experts are quantized)."""
    _, args = serve.parse_args(["--routing", "quota"])
    assert (args.eplb["routing"], args.eplb["policy"]) == ("quota", "online")
    _, args = serve.parse_args(["--eplb-config", '{"routing": "quota"}'])
    assert (args.eplb["routing"], args.eplb["policy"]) == ("quota", "online")
    _, args = train.parse_args(["--routing", "lp", "--eplb-config", '{"routing": "hash", "policy": "deepseek"}'])
    assert (args.eplb["routing"], args.eplb["policy"]) == ("lp", "deepseek")  # the flag wins over the file
    _, args = serve.parse_args(["--quantize", "mxfp4"])
    assert args.quantize == "mxfp4" and args.checkpoint is None


def test_counting_compiles_counts_programs_compiled_in_its_block():
    from _runtime import counting_compiles

    def fresh(x):
        return x * 3 + 1

    jitted = jax.jit(fresh)
    with counting_compiles() as compiled:
        jitted(np.float32(2))
        jitted(np.float32(5))  # the same program: compiled once
    assert compiled[0] == 1
    with counting_compiles() as compiled:
        jitted(np.float32(7))
    assert compiled[0] == 0


@pytest.fixture
def keep_environment(monkeypatch):
    """The scripts set JAX's device flags in os.environ (no effect once JAX runs): undo that afterwards."""
    for name in ("XLA_FLAGS", "JAX_PLATFORMS"):
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])
        else:
            monkeypatch.delenv(name, raising=False)


SERVE_SMALL = ["--batch", "16", "--new-tokens", "4", "--max-prompt", "12", "--warmup-batches", "2", "--batches", "1"]


def _summary_value(out: str, prefix: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(prefix))[len(prefix) :]


@pytest.mark.slow
@pytest.mark.usefixtures("keep_environment")
def test_serve_record_fit_serve_round_trip(capsys, tmp_path):
    """serve --dump-loads -> moe-eplb fit (ours and SGLang's format) -> serve --init-placement: balanced traffic."""
    loads = tmp_path / "loads.npz"
    serve.main([*SERVE_SMALL, "--dump-loads", str(loads), "--save-placement", str(tmp_path / "served.json")])
    out = capsys.readouterr().out
    assert "=== summary ===" in out and "controller.warmup() took" in out and "overlap 'layer'" in out
    found = re.search(r"^balancedness \(measured\): initial placement ([\d.]+) -> EPLB placement ([\d.]+) ", out, re.M)
    assert found, out
    initial, after = float(found[1]), float(found[2])
    assert 0 < initial < after <= 1
    moved = _summary_value(out, "rearrangement 1 (done after forward pass ")
    # Due after pass 6, inside batch 2's decode call (passes 6-8, one call): decided at its end with the first
    # layer moved, the second layer after the next call (batch 3's prefill, pass 9).
    assert serve.rearrange_at(serve.parse_args(SERVE_SMALL)[1]) == 6
    assert int(moved.split(")")[0]) == 9
    assert " slots in 2 layers, " in moved and " MB moved in " in moved and "GB/s" in moved
    assert "on the initial placement" in out and "on the EPLB placement" in out
    assert Placement.load(tmp_path / "served.json") != Placement.linear(2, 16, 24)
    for fmt in ("moe_eplb_jax", "sglang"):
        fitted = tmp_path / f"{fmt}.json"
        fit = ["fit", str(loads), "--num-ranks", "8", "--num-physical", "24", "--format", fmt, "-o", str(fitted)]
        assert cli.main(fit) == 0
        capsys.readouterr()
        doc = json.loads(fitted.read_text())
        assert ("physical_to_logical_map" in doc) == (fmt == "sglang")
        serve.main([*SERVE_SMALL, "--init-placement", str(fitted)])
        held = capsys.readouterr().out
        # A few steps of traffic to fit from and to measure with: well above the linear placement, not at 1.
        assert float(_summary_value(held, "balancedness (measured): held placement ").split()[0]) > initial + 0.15
        assert "rearrangement 1" not in held


@pytest.mark.slow
@pytest.mark.usefixtures("keep_environment")
def test_train_checkpoints_and_resumes_exactly(capsys, tmp_path):
    """Six steps with checkpoints at 3 and 6; the one at 6 removed, --resume from 3 repeats steps 4-6 exactly."""
    ckpt = tmp_path / "ckpt"
    common = ["--batch", "8", "--seq", "8", "--step-interval", "4", "--log-every", "1", "--checkpoint-dir", str(ckpt)]
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):  # optax's Adam mixes dtypes
        train.main([*common, "--steps", "6", "--checkpoint-every", "3"])
        straight = capsys.readouterr().out
        assert sorted(os.listdir(ckpt)) == ["3", "6"]  # one Orbax step each: model, optimizer and EPLB items
        assert {"eplb", "model", "optimizer"} <= set(os.listdir(ckpt / "3"))
        shutil.rmtree(ckpt / "6")
        train.main([*common, "--steps", "6", "--resume"])
        resumed = capsys.readouterr().out
    assert "step 3: checkpoint saved" in straight and "resumed from step 3 (1 rearrangements so far)" in resumed
    assert straight.index("controller.warmup(): compiling") < straight.index("step 1: compiling the train step")
    assert "step 4: compiling the train step" in resumed
    assert "step 5: rearranged" in straight and "step 5: rearranged" in resumed  # the window and counters came back

    def losses(text, first):
        return [ln for ln in text.splitlines() if ln.startswith("step ") and ": loss " in ln][first:]

    def rearranged(text):  # the report without its timing
        return [ln.split(" slots moved")[0] for ln in text.splitlines() if ": rearranged" in ln]

    assert losses(straight, 3) == losses(resumed, 0) and len(losses(resumed, 0)) == 3
    assert rearranged(straight)[1:] == rearranged(resumed)
    final = [ln for ln in straight.splitlines() if ln.startswith("rearrangements:")]
    assert final and final == [ln for ln in resumed.splitlines() if ln.startswith("rearrangements:")]
    loss = [float(ln.split("loss ")[1]) for ln in losses(straight, 0)]
    assert loss[-1] < loss[0]
    assert "tokens/s" in straight and "TFLOP/s" in straight  # the throughput line (MFU where the peak is known)


@pytest.mark.slow
@pytest.mark.usefixtures("keep_environment")
def test_train_scales_in_and_goes_on(capsys):
    """--scale-to 4: after step 3 the run moves from 8 EP ranks to 4, the held-out loss barely moves (another batch
    split rounds differently), training goes on and the loss keeps falling."""
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):  # optax's Adam mixes dtypes
        train.main(
            ["--batch", "8", "--seq", "8", "--steps", "5", "--log-every", "1", "--scale-to", "4", "--scale-at", "3"]
        )
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "resized" in ln)
    assert line.startswith("step 3: resized 8 -> 4 EP ranks (P = 24 -> 24)")
    before, after = (float(v) for v in line.split("held-out loss ")[1].split(" -> "))
    assert abs(before - after) <= 1e-5 * before
    loss = [float(ln.split("loss ")[1]) for ln in out.splitlines() if ln.startswith("step ") and ": loss " in ln]
    assert len(loss) == 5 and loss[-1] < loss[0]


@pytest.mark.slow
@pytest.mark.usefixtures("keep_environment")
def test_train_resume_refuses_a_checkpoint_of_another_config(capsys, tmp_path):
    """A checkpoint saved with another EPLB window: one error line at restore, exit 2."""
    ckpt = tmp_path / "ckpt"
    common = ["--batch", "8", "--seq", "8", "--checkpoint-dir", str(ckpt)]
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        train.main([*common, "--steps", "1", "--step-interval", "4"])
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            train.main([*common, "--steps", "2", "--step-interval", "5", "--resume"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert re.search("--resume: EPLB checkpoint field 'config': saved with window_size=4", err[-1]), err
    assert np.array_equal(sorted(os.listdir(ckpt)), ["1"])


@pytest.mark.slow
@pytest.mark.usefixtures("keep_environment")
def test_serve_and_train_run_deepseek_v3(capsys, tmp_path):
    """serve from a Hugging Face-style DeepSeek-V3 directory (config.json + safetensors), train the preset."""
    import _models_reference as reference
    from safetensors.numpy import save_file

    from moe_eplb_jax.models import config_from_hf

    hf = {
        "model_type": "deepseek_v3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "n_routed_experts": 16,
        "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1, "q_lora_rank": 32,
        "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "max_position_embeddings": 256, "dtype": "float32",
        "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 64, "mscale": 1.0,
                         "mscale_all_dim": 1.0},
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(hf))
    tensors = reference.random_tensors(config_from_hf(hf), np.random.default_rng(0))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    serve.main([*SERVE_SMALL, "--checkpoint", str(tmp_path)])
    out = capsys.readouterr().out
    assert "config.json (MLA attention): 2 MoE layers" in out and "rearrangement 1 (done after" in out
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):  # optax's Adam mixes dtypes
        train.main(["--preset", "deepseek_v3_tiny", "--steps", "3"])
    out = capsys.readouterr().out
    first, last = re.search(r"steps 1\.\.3: loss ([\d.]+) -> ([\d.]+)", out).groups()
    assert float(last) < float(first)


@pytest.mark.slow
@pytest.mark.usefixtures("keep_environment")
def test_serve_with_routing_flag_and_quantized_random_experts(capsys):
    """--routing lp and --quantize fp8 without a checkpoint: a move under lp took seconds (its lookup tables compiled
    at the move) while the summary said nothing compiled mid-run; now warmup compiles them and the summary counts."""
    serve.main([*SERVE_SMALL, "--routing", "lp", "--quantize", "fp8"])
    out = capsys.readouterr().out
    assert (
        out.index("compiling prefill and decode") < out.index("controller.warmup(): compiling") < out.index("batch 1/")
    )
    assert "routing 'lp'" in out and "redundant (fp8)" in out and "rearrangement 1" in out
    assert "(nothing compiled mid-run)" in out

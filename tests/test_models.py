"""The MoE decoder: config checks, the two router styles, the forward pass against a numpy oracle, checkpoints."""

import contextlib
import dataclasses
import json
import os
import stat
import subprocess
import sys

import _models_reference as reference
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import ep_mesh, tiny_model
from flax import nnx

from moe_eplb_jax import transport
from moe_eplb_jax.models import (
    PRESETS,
    ModelConfig,
    MoECausalLM,
    checkpoint_shapes,
    config_from_hf,
    export_checkpoint,
    load_checkpoint,
    preset,
)
from moe_eplb_jax.models.checkpoint import router_bias_name
from moe_eplb_jax.moe import RouterConfig, route
from moe_eplb_jax.placement import Placement

try:
    from safetensors import numpy as safetensors_numpy
    from safetensors import safe_open
except ImportError:  # the optional "hf" extra; the GPU machines lack it
    safetensors_numpy = safe_open = None
needs_safetensors = pytest.mark.skipif(safetensors_numpy is None, reason="needs safetensors (pip install .[hf])")

G, R = 4, 4
pytestmark = pytest.mark.devices(G)  # skipped on fewer devices, where MESH is None
MESH = ep_mesh(G)
SOFTMAX = preset("tiny")
SIGMOID = preset(
    "tiny", scoring="sigmoid", num_groups=4, topk_groups=2, routed_scaling_factor=2.5, qk_norm=False, shared_hidden=16
)


@nnx.jit
def _forward(model, tokens, valid):
    return model(tokens, valid=valid)


def _model(config, seed=0):
    return tiny_model(config, MESH, redundant=R, seed=seed)


def _write(tmp_path, tensors, name="model.safetensors"):
    path = tmp_path / name
    safetensors_numpy.save_file(tensors, str(path))
    return path


def _left_padded(rng, config, lengths, width):
    tokens = rng.integers(0, config.vocab_size, (len(lengths), width)).astype(np.int32)
    valid = np.arange(width)[None, :] >= (width - np.asarray(lengths))[:, None]
    return tokens, valid


# ------------------------------------------------------------------- config
def test_presets_are_valid_and_shaped_as_described():
    assert set(PRESETS) == {"tiny", "small", "deepseek_v3_tiny", "deepseek_v3_small"}
    for v3 in (PRESETS["deepseek_v3_small"], PRESETS["deepseek_v3_tiny"]):
        assert v3.scoring == "sigmoid" and v3.top_k <= v3.num_experts and v3.topk_groups < v3.num_groups
        assert v3.routed_scaling_factor == 2.5 and v3.shared_hidden > 0 and v3.num_moe_layers == v3.num_layers - 1
        assert v3.attention == "mla" and v3.rope_interleave and v3.rope_scaling is not None
        assert v3.rope_scaling.mscale == v3.rope_scaling.mscale_all_dim == 1.0
    v3 = PRESETS["deepseek_v3_small"]
    assert (v3.num_experts, v3.top_k, v3.num_groups, v3.topk_groups) == (256, 8, 8, 4)
    # DeepSeek-V3's head shape and cache width: 128 + 64 query/key, 128 value, a 512-wide latent.
    assert (v3.qk_nope_head_dim, v3.qk_rope_head_dim, v3.v_head_dim, v3.kv_lora_rank) == (128, 64, 128, 512)
    assert v3.q_lora_rank is not None and v3.rope_scaling.factor == 40
    assert PRESETS["tiny"].scoring == "softmax" and PRESETS["tiny"].num_moe_layers == 2
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        preset("huge")


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"dim": 0}, "dim"),
        ({"num_layers": True}, "num_layers"),
        ({"num_heads": 6, "num_kv_heads": 4}, "num_heads"),
        ({"head_dim": 15}, "head_dim"),
        ({"first_dense_layers": 3}, "first_dense_layers"),
        ({"top_k": 17}, "top_k"),
        ({"num_groups": 3}, "num_groups"),
        ({"num_groups": 4, "topk_groups": 5}, "topk_groups"),
        ({"num_groups": 8, "topk_groups": 1, "top_k": 3}, "topk_groups"),
        ({"scoring": "relu"}, "scoring"),
        ({"dtype": "float16"}, "dtype"),
        ({"routed_scaling_factor": float("nan")}, "routed_scaling_factor"),
        ({"rms_eps": -1.0}, "rms_eps"),
        ({"renormalize": 1}, "renormalize"),
    ],
)
def test_config_rejects_bad_fields_by_name(changes, field):
    with pytest.raises(ValueError, match=f"ModelConfig.{field}"):
        ModelConfig(**changes)


def test_model_rejects_bad_construction():
    with pytest.raises(ValueError, match="not divisible by the EP size 4"):
        MoECausalLM(SOFTMAX, mesh=MESH, num_redundant_experts=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="mesh has no axis 'tp'"):
        MoECausalLM(SOFTMAX, mesh=MESH, axis="tp", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="config must be a ModelConfig"):
        MoECausalLM({"dim": 64}, mesh=MESH, rngs=nnx.Rngs(0))  # type: ignore[arg-type]


# ------------------------------------------------------------------- router
@pytest.mark.parametrize(
    "config",
    [
        SOFTMAX,
        SOFTMAX.replace(renormalize=False),
        SOFTMAX.replace(num_groups=4, topk_groups=2),
        SIGMOID,
        SIGMOID.replace(renormalize=False, routed_scaling_factor=1.0, topk_groups=None),
    ],
    ids=["qwen3", "qwen3-raw", "softmax-groups", "deepseek-v3", "sigmoid-plain"],
)
def test_route_matches_reference(rng, config):
    tokens, dim, e = 64, 8, config.num_experts
    x = rng.standard_normal((tokens, dim)).astype(np.float32)
    w = rng.standard_normal((dim, e)).astype(np.float32)
    bias = (rng.standard_normal(e) * 0.3).astype(np.float32)
    ids, weights = route(jnp.asarray(x), jnp.asarray(w), config.router, bias=jnp.asarray(bias))
    ids, weights = np.asarray(ids), np.asarray(weights)
    for t in range(tokens):
        want_ids, want_w = reference.route(x[t].astype(np.float64) @ w.astype(np.float64), bias, config)
        order = np.argsort(want_ids)
        got = np.argsort(ids[t])
        assert np.array_equal(ids[t][got], want_ids[order]), t
        np.testing.assert_allclose(weights[t][got], want_w[order], rtol=1e-5, atol=1e-6)
    if config.scoring == "sigmoid" and config.topk_groups is not None:
        per_group = e // config.num_groups
        assert all(len(set(row // per_group)) <= config.topk_groups for row in ids)


def test_sigmoid_bias_chooses_but_does_not_weigh(rng):
    """DeepSeek-V3: a large bias on expert 3 makes every token pick it, with its unbiased sigmoid weight."""
    x = rng.standard_normal((16, 8)).astype(np.float32)
    w = rng.standard_normal((8, 16)).astype(np.float32)
    bias = np.zeros(16, np.float32)
    bias[3] = 10.0
    sigmoid = RouterConfig(top_k=2, scoring="sigmoid", renormalize=False)
    ids, weights = route(jnp.asarray(x), jnp.asarray(w), sigmoid, bias=jnp.asarray(bias))
    ids, weights = np.asarray(ids), np.asarray(weights)
    assert np.all(ids[:, 0] == 3)
    np.testing.assert_allclose(weights[:, 0], 1 / (1 + np.exp(-(x @ w)[:, 3])), rtol=1e-5)


# ------------------------------------------------------------- forward pass
@pytest.mark.slow
@needs_safetensors
@pytest.mark.parametrize("config", [SOFTMAX, SIGMOID], ids=["qwen3", "deepseek-v3"])
def test_loaded_model_matches_numpy_oracle(tmp_path, rng, config):
    """Checkpoint -> model (redundant slots, a random placement) == the float64 oracle on the checkpoint tensors."""
    tensors = reference.random_tensors(config, rng)
    path = _write(tmp_path, tensors)
    model = _model(config)
    phy2log = np.stack([rng.permutation(np.r_[np.arange(16), rng.integers(0, 16, R)]) for _ in range(2)])
    load_checkpoint(model, path, placement=Placement.from_phy2log(phy2log, 16))
    tokens, valid = _left_padded(rng, config, [9, 4, 1, 7], 9)
    got = np.asarray(_forward(model, jnp.asarray(tokens), jnp.asarray(valid)))
    want = reference.logits(tensors, config, tokens, valid)
    np.testing.assert_allclose(got[valid], want[valid], rtol=2e-4, atol=2e-4)
    # Padding is routed nowhere: every layer counted exactly the valid tokens' k assignments.
    for layer in model.moe_layers:
        assert int(np.asarray(layer.expert_load.get_value()).sum()) == valid.sum() * config.top_k


# -------------------------------------------------------------- checkpoints
@needs_safetensors
def test_export_round_trips_every_tensor_byte_for_byte(tmp_path, rng):
    tensors = reference.random_tensors(SIGMOID, rng, dtype=jnp.bfloat16)
    path = _write(tmp_path, tensors)
    model = _model(SIGMOID.replace(dtype="bfloat16"))
    phy2log = np.stack([rng.permutation(np.r_[np.arange(16), rng.integers(0, 16, R)]) for _ in range(2)])
    placement = Placement.from_phy2log(phy2log, 16)
    load_checkpoint(model, path, placement=placement)
    # Slot p holds expert phy2log[p]: redundant slots are copies of their expert.
    layer = model.moe_layers[1]
    w_in = np.asarray(layer.w_in.get_value())
    for p, e in enumerate(phy2log[1]):
        gate = tensors[f"model.layers.2.mlp.experts.{e}.gate_proj.weight"]
        assert np.array_equal(w_in[p, :, :32].view(np.uint16), gate.T.view(np.uint16))
    # Routers stay float32 in the model, and remember the dtype they came in.
    assert all(layer.router.get_value().dtype == np.float32 for layer in model.moe_layers)
    out = tmp_path / "export.safetensors"
    export_checkpoint(model, out)
    back = safetensors_numpy.load_file(str(out))
    assert set(back) == set(tensors)
    for name, value in tensors.items():
        assert back[name].dtype == value.dtype and back[name].shape == value.shape, name
        assert np.array_equal(back[name].view(np.uint8), value.view(np.uint8)), name


@needs_safetensors
def test_softmax_gate_bias_is_optional_and_exported_only_when_set(tmp_path, rng):
    tensors = reference.random_tensors(SOFTMAX, rng)
    path = _write(tmp_path, tensors)
    model = _model(SOFTMAX)
    load_checkpoint(model, path)
    assert all(not np.asarray(layer.router_bias.get_value()).any() for layer in model.moe_layers)
    export_checkpoint(model, tmp_path / "plain.safetensors")
    assert set(safetensors_numpy.load_file(str(tmp_path / "plain.safetensors"))) == set(tensors)
    tensors["model.layers.1.mlp.gate.bias"] = np.linspace(-1, 0, 16).astype(np.float32)
    load_checkpoint(model, _write(tmp_path, tensors, "biased.safetensors"))
    export_checkpoint(model, tmp_path / "biased_out.safetensors")
    back = safetensors_numpy.load_file(str(tmp_path / "biased_out.safetensors"))
    assert np.array_equal(back["model.layers.1.mlp.gate.bias"], tensors["model.layers.1.mlp.gate.bias"])
    assert "model.layers.2.mlp.gate.bias" not in back


@needs_safetensors
def test_sharded_directory_loads_like_one_file(tmp_path, rng):
    tensors = reference.random_tensors(SOFTMAX, rng)
    names = sorted(tensors)
    (tmp_path / "shards").mkdir()
    _write(tmp_path / "shards", {n: tensors[n] for n in names[::2]}, "model-00001-of-00002.safetensors")
    _write(tmp_path / "shards", {n: tensors[n] for n in names[1::2]}, "model-00002-of-00002.safetensors")
    one, two = _model(SOFTMAX, seed=1), _model(SOFTMAX, seed=2)
    load_checkpoint(one, tmp_path / "shards")
    load_checkpoint(two, _write(tmp_path, tensors))
    for a, b in zip(jax.tree.leaves(nnx.state(one, nnx.Param)), jax.tree.leaves(nnx.state(two, nnx.Param))):
        assert np.array_equal(np.asarray(a), np.asarray(b))


@needs_safetensors
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_quantize_on_load_equals_quantizing_the_loaded_model(tmp_path, rng, fmt):
    tensors = reference.random_tensors(SOFTMAX, rng)
    path = _write(tmp_path, tensors)
    direct, later = _model(SOFTMAX), _model(SOFTMAX)
    load_checkpoint(direct, path, quantize=fmt)
    load_checkpoint(later, path)
    for layer in later.moe_layers:
        layer.quantize(fmt)
    for a, b in zip(direct.moe_layers, later.moe_layers):
        assert a.quant_format == fmt and a.w_in is None
        for name in ("gate", "up", "down"):
            leaves_a = jax.tree.leaves(a.eplb_expert_variables()[name].get_value())
            leaves_b = jax.tree.leaves(b.eplb_expert_variables()[name].get_value())
            for x, y in zip(leaves_a, leaves_b):
                assert np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
    with pytest.raises(ValueError, match="already quantized"):
        load_checkpoint(direct, path)
    with pytest.raises(ValueError, match="quantized experts have no float checkpoint layout"):
        export_checkpoint(direct, tmp_path / "q.safetensors")


def _params(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]


@needs_safetensors
def test_bad_checkpoints_raise_naming_the_tensor_and_change_nothing(tmp_path, rng):
    config = SIGMOID
    tensors = reference.random_tensors(config, rng)
    model = _model(config)
    before = _params(model)
    gate0 = "model.layers.1.mlp.experts.0.gate_proj.weight"

    def bad(name, tensors, match, **kw):
        with pytest.raises(ValueError, match=match):
            load_checkpoint(model, _write(tmp_path, tensors, name), **kw)

    bad("missing.safetensors", {k: v for k, v in tensors.items() if k != gate0}, "missing tensors " + gate0)
    bad("extra.safetensors", {**tensors, "model.layers.9.mlp.gate.weight": tensors["model.norm.weight"]}, "unexpected")
    bad("shape.safetensors", {**tensors, gate0: tensors[gate0][:-1]}, f"{gate0}.*shape")
    bad("dtype.safetensors", {**tensors, gate0: tensors[gate0].astype(np.int32)}, f"{gate0}.*dtype I32")
    nan = tensors[gate0].copy()
    nan[0, 0] = np.nan
    bad("nan.safetensors", {**tensors, gate0: nan}, f"{gate0}.*NaN", quantize="fp8")
    bad("ok.safetensors", tensors, "does not fit the expert shapes", quantize="fp8_block")
    bad("ok.safetensors", tensors, "quantize must be", quantize="int3")
    bad(
        "ok.safetensors",
        tensors,
        r"placement is for \(L, E, P\) = \(3, 16, 20\)",
        placement=Placement.linear(3, 16, 20),
    )
    (tmp_path / "damaged.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match="damaged.safetensors: not a readable safetensors file"):
        load_checkpoint(model, tmp_path / "damaged.safetensors")
    with pytest.raises(ValueError, match="no such checkpoint"):
        load_checkpoint(model, tmp_path / "absent.safetensors")
    assert all(np.array_equal(a, b) for a, b in zip(before, _params(model)))
    with pytest.raises(ValueError, match="must end in .safetensors"):
        export_checkpoint(model, tmp_path / "model.bin")
    with pytest.raises(ValueError, match="does not exist"):
        export_checkpoint(model, tmp_path / "nowhere" / "model.safetensors")


_RELEASE = """
import os, sys, time
time.sleep(float(sys.argv[1]))
for fifo in sys.argv[2:]:
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # ENXIO: nobody is reading it
        pass
"""


@contextlib.contextmanager
def _unblocked_after(seconds, fifos):
    """A reader blocked on one of ``fifos`` gets an empty file after ``seconds`` (from another process: a reader
    blocked in native code holds the GIL), so the test fails on the message instead of hanging the suite."""
    watchdog = subprocess.Popen([sys.executable, "-c", _RELEASE, str(seconds), *map(str, fifos)])
    try:
        yield
    finally:
        watchdog.kill()
        watchdog.wait()


@needs_safetensors
def test_checkpoint_files_and_paths_are_value_errors_that_never_hang(tmp_path, rng):
    """A FIFO among the shards or as config.json used to block forever; an existing directory as the export path
    raised IsADirectoryError; /proc and /sys raised raw OS errors; export wrote mode 0600."""
    config = SOFTMAX
    model = _model(config)
    tensors = reference.random_tensors(config, rng)
    shards = tmp_path / "shards"
    shards.mkdir()
    safetensors_numpy.save_file(tensors, str(shards / "a.safetensors"))
    os.mkfifo(shards / "b.safetensors")
    os.mkfifo(tmp_path / "fifo.safetensors")
    hf = tmp_path / "hf"
    hf.mkdir()
    os.mkfifo(hf / "config.json")
    with _unblocked_after(10, [shards / "b.safetensors", tmp_path / "fifo.safetensors", hf / "config.json"]):
        with pytest.raises(ValueError, match=r"b\.safetensors: cannot read the checkpoint file, it is not a regular"):
            load_checkpoint(model, shards)
        with pytest.raises(ValueError, match=r"fifo\.safetensors: cannot read the checkpoint file, it is not a"):
            load_checkpoint(model, tmp_path / "fifo.safetensors")
        with pytest.raises(ValueError, match=r"config\.json: cannot read the config\.json file, it is not a regular"):
            config_from_hf(hf)
    (tmp_path / "dir.safetensors").mkdir()
    for path, match in (
        (tmp_path / "dir.safetensors", "dir.safetensors: cannot write the checkpoint file, the path names a directory"),
        ("/proc/model.safetensors", "/proc/model.safetensors: cannot write the checkpoint file in '/proc'"),
        ("/sys/model.safetensors", "/sys/model.safetensors: cannot write the checkpoint file in '/sys'"),
        (None, "checkpoint file: need a path, got None"),
    ):
        with pytest.raises(ValueError, match=match):
            export_checkpoint(model, path)
    umask = os.umask(0o022)
    try:
        export_checkpoint(model, tmp_path / "out.safetensors")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(os.stat(tmp_path / "out.safetensors").st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left


@needs_safetensors
def test_a_bf16_model_exports_a_bf16_checkpoint(tmp_path):
    """The router (kept float32 inside the model) was written as float32 into an otherwise bf16 checkpoint."""
    for config in (preset("tiny", dtype="bfloat16"), preset("deepseek_v3_tiny", dtype="bfloat16")):
        model = _model(config)
        export_checkpoint(model, tmp_path / "bf16.safetensors")
        dtypes = {}
        with safe_open(str(tmp_path / "bf16.safetensors"), "np") as f:
            for name in f.keys():  # noqa: SIM118 -- a safetensors handle
                dtypes[name] = str(f.get_slice(name).get_dtype())
        # DeepSeek-V3's checkpoints keep only the score-correction bias in float32.
        f32 = sorted(n for n, d in dtypes.items() if d != "BF16")
        assert f32 == [router_bias_name(config, i) for i in config.moe_blocks if config.scoring == "sigmoid"], f32
        assert {dtypes[f"model.layers.{i}.mlp.gate.weight"] for i in config.moe_blocks} == {"BF16"}


def test_sglang_files_and_load_files_of_a_model_with_dense_blocks(tmp_path):
    """The tiny preset has a dense block 0: SGLang reads a row per block, so the controller's files say which."""
    from moe_eplb_jax import EplbConfig, cli
    from moe_eplb_jax.flax import EplbController
    from moe_eplb_jax.sim import read_load

    config = SOFTMAX
    assert config.dense_blocks == (0,) and config.moe_blocks == (1, 2)
    model = _model(config)
    assert model.eplb_layer_ids == ((1, 2), 3)
    eplb = EplbConfig(num_redundant_experts=R, num_gpus=G, window_size=4)
    ctl = EplbController(model, MESH, eplb, rebalance=False)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (G * 2, 8)), jnp.int32)
    for _ in range(2):
        _forward(model, tokens, jnp.ones(tokens.shape, bool))
        ctl.step()
    ctl.dump_loads(tmp_path / "loads.npz")
    trace = read_load(tmp_path / "loads.npz")
    assert trace.meta["layer_ids"] == [1, 2] and trace.meta["num_hidden_layers"] == 3 and trace.num_layers == 2
    fitted = tmp_path / "fitted.json"
    argv = ["fit", str(tmp_path / "loads.npz"), "--num-ranks", str(G), "--num-physical", "20", "--format", "sglang"]
    assert cli.main([*argv, "-o", str(fitted)]) == 0
    rows = json.loads(fitted.read_text())["physical_to_logical_map"]
    assert len(rows) == 3 and rows[0] == (np.arange(20) % 16).tolist()
    ctl.save_placement(tmp_path / "served.json", format="sglang")
    served = json.loads((tmp_path / "served.json").read_text())["physical_to_logical_map"]
    assert len(served) == 3 and served[1:] == ctl.placement.phy2log.tolist()
    again = EplbController(model, MESH, eplb, placement=fitted, rebalance=False)  # read back by its blocks
    assert again.placement.phy2log.tolist() == rows[1:]


def test_checkpoint_shapes_cover_the_model(rng):
    """Every parameter of the model is named by the checkpoint layout (nothing silently left at its init)."""
    for config in (SOFTMAX, SIGMOID, SOFTMAX.replace(tie_embeddings=True, shared_hidden=0)):
        model = _model(config)
        names = checkpoint_shapes(config)
        experts = sum(1 for n in names if ".mlp.experts." in n)
        assert experts == config.num_moe_layers * config.num_experts * 3
        params = nnx.state(model, nnx.Param)
        per_expert_params = 2 * config.num_moe_layers  # w_in, w_out per MoE layer hold the experts
        shared = 3 * config.num_moe_layers if config.shared_hidden else 0  # gate, up, down -> shared_in/out
        bias = config.num_moe_layers if config.scoring == "softmax" else 0  # the optional softmax gate bias
        plain = len(names) - experts - shared
        have = len(jax.tree.leaves(params))
        assert have == plain + per_expert_params + (2 * config.num_moe_layers if config.shared_hidden else 0) + bias
        assert dataclasses.asdict(config) == dataclasses.asdict(model.config)


def test_remat_gives_the_same_loss_gradients_and_loads():
    """``remat=True`` recomputes the blocks in the backward pass: same loss, gradients and recorded loads."""
    import optax

    config = preset("tiny")
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, config.vocab_size, (8, 12)), jnp.int32)
    out = []
    for remat in (False, True):
        model = MoECausalLM(config, mesh=transport.ep_mesh(1), remat=remat, rngs=nnx.Rngs(0))

        def loss_fn(model):
            logits = model(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(model)
        loads = [np.asarray(layer.expert_load.get_value()) for layer in model.moe_layers]
        out.append((float(loss), jax.tree.leaves(nnx.to_pure_dict(grads)), loads))
    assert out[0][0] == out[1][0]
    for a, b in zip(out[0][1], out[1][1]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    for a, b in zip(out[0][2], out[1][2]):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="remat"):
        MoECausalLM(config, mesh=transport.ep_mesh(1), remat="yes", rngs=nnx.Rngs(0))


def test_decode_read_bytes_counts_weights_experts_touched_and_cache():
    """A decode step's floor: one token touches top_k experts per MoE layer, a large batch all of them; the KV
    cache grows with batch x context; MLA caches its latent."""
    from moe_eplb_jax.models import preset

    c = preset("small", dtype="bfloat16")
    expert = 3 * c.dim * c.moe_hidden * 2
    one, many = c.decode_read_bytes(1, 0), c.decode_read_bytes(10_000, 0)
    assert many - one == pytest.approx(c.num_moe_layers * (c.num_experts - c.top_k) * expert, rel=1e-9)
    cache = c.decode_read_bytes(32, 100) - c.decode_read_bytes(32, 0)
    assert cache == pytest.approx(c.num_layers * 32 * 100 * 2 * c.num_kv_heads * c.head_dim * 2)
    mla = preset("deepseek_v3_tiny")
    latent = mla.decode_read_bytes(4, 10) - mla.decode_read_bytes(4, 0)
    assert latent == pytest.approx(mla.num_layers * 40 * (mla.kv_lora_rank + mla.qk_rope_head_dim) * 4)
    with pytest.raises(ValueError, match="decode_read_bytes batch must be an integer >= 1"):
        c.decode_read_bytes(0, 10)
    with pytest.raises(ValueError, match="decode_read_bytes context"):
        c.decode_read_bytes(4, -1)

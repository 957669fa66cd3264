"""DeepSeek-V3 as it is: MLA, YaRN / partial / interleaved RoPE and attention biases against a float64 oracle,
the latent KV cache against recompute, block-FP8 checkpoints loaded as they are and exported bit for bit."""

import _models_reference as reference
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from moe_eplb_jax.models import (
    ModelConfig,
    MoECausalLM,
    YarnScaling,
    checkpoint_shapes,
    export_checkpoint,
    generate,
    load_checkpoint,
    preset,
)
from moe_eplb_jax.models.attention import MultiLatentAttention
from moe_eplb_jax.models.rope import apply_rope, rope_frequencies, softmax_mscale
from moe_eplb_jax.models.weights import QuantizedWeight
from moe_eplb_jax.placement import Placement

safetensors_numpy = pytest.importorskip("safetensors.numpy")

G, R = 4, 4
pytestmark = pytest.mark.devices(G)  # skipped on fewer devices, where MESH is None
MESH = (
    jax.make_mesh((G,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:G])
    if jax.device_count() >= G
    else None
)
V3 = preset("deepseek_v3_tiny")
MLA_PLAIN = V3.replace(q_lora_rank=None, rope_interleave=False, qkv_bias=True, o_bias=True, rope_scaling=None)
GLM = preset(
    "tiny",
    qkv_bias=True,
    partial_rotary_factor=0.5,
    scoring="sigmoid",
    num_groups=4,
    topk_groups=2,
    shared_hidden=16,
    rope_scaling=YarnScaling(factor=4.0, original_max_len=64),
)
QWEN_PATTERN = preset("tiny", num_layers=4, first_dense_layers=0, dense_layers=(0, 2), qkv_bias=True, o_bias=True)
# Block-FP8 needs whole 128 x 128 expert blocks: a 128-wide DeepSeek-V3.
V3_FP8 = V3.replace(dim=128, moe_hidden=128, shared_hidden=128, dense_hidden=256, num_experts=8, vocab_size=64)


def _model(config, seed=0, **kw):
    return MoECausalLM(config, mesh=MESH, num_redundant_experts=R, rngs=nnx.Rngs(seed), **kw)


def _write(tmp_path, tensors, name="model.safetensors"):
    path = tmp_path / name
    safetensors_numpy.save_file(tensors, str(path))
    return path


def _placement(rng, config):
    e = config.num_experts
    phy2log = np.stack([rng.permutation(np.r_[np.arange(e), rng.integers(0, e, R)]) for _ in config.moe_blocks])
    return Placement.from_phy2log(phy2log, e)


def _left_padded(rng, config, lengths, width):
    tokens = rng.integers(0, config.vocab_size, (len(lengths), width)).astype(np.int32)
    valid = np.arange(width)[None, :] >= (width - np.asarray(lengths))[:, None]
    return tokens, valid


@nnx.jit
def _forward(model, tokens, valid):
    return model(tokens, valid=valid)


# --------------------------------------------------------------------- RoPE
@pytest.mark.parametrize(
    "scaling",
    [
        None,
        YarnScaling(factor=40.0, original_max_len=4096, mscale=1.0, mscale_all_dim=1.0),  # DeepSeek-V3's
        YarnScaling(factor=4.0, original_max_len=32768),  # Qwen3's long-context recipe
        YarnScaling(factor=8.0, original_max_len=64, beta_fast=16, beta_slow=2, mscale=0.707, mscale_all_dim=1.0),
        YarnScaling(factor=2.0, original_max_len=100, truncate=False, attention_factor=1.3),
        YarnScaling(
            factor=3.0, original_max_len=50, mscale=0.0, mscale_all_dim=1.0
        ),  # a zero mscale: plain temperature
    ],
)
@pytest.mark.parametrize("rotary_dim", [8, 64])
def test_rope_frequencies_match_the_yarn_equations(scaling, rotary_dim):
    got, factor = rope_frequencies(rotary_dim, 10000.0, scaling)
    want, want_factor = reference.rope_frequencies(rotary_dim, 10000.0, scaling)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert factor == pytest.approx(want_factor, rel=1e-12)
    if scaling is not None:  # the highest frequency is kept, the lowest interpolated by `factor` when in the ramp
        assert got[0] == want[0] == 1.0
        assert np.all(got <= reference.rope_frequencies(rotary_dim, 10000.0, None)[0] + 1e-15)


def test_deepseek_v3_temperature():
    v3 = YarnScaling(factor=40.0, original_max_len=4096, mscale=1.0, mscale_all_dim=1.0)
    assert rope_frequencies(64, 10000.0, v3)[1] == 1.0  # mscale / mscale_all_dim cancel on cos/sin ...
    assert softmax_mscale(v3) == pytest.approx((0.1 * np.log(40.0) + 1) ** 2)  # ... and square into the softmax
    assert softmax_mscale(None) == 1.0 and softmax_mscale(YarnScaling(factor=4.0, original_max_len=8)) == 1.0


@pytest.mark.parametrize(("interleaved", "rotary"), [(False, 16), (True, 16), (False, 8), (True, 6)])
def test_apply_rope_rotates_pairs_and_keeps_dot_products(rng, interleaved, rotary):
    x = rng.standard_normal((2, 5, 3, 16)).astype(np.float32)
    positions = rng.integers(0, 300, (2, 5)).astype(np.int32)
    freq, factor = rope_frequencies(rotary, 500.0, YarnScaling(factor=4.0, original_max_len=64))
    got = np.asarray(
        apply_rope(jnp.asarray(x), jnp.asarray(positions), freq, attention_factor=factor, interleaved=interleaved)
    )
    for b in range(2):
        want = reference._rope(x[b].astype(np.float64), positions[b].astype(np.float64), freq, factor, interleaved)
        np.testing.assert_allclose(got[b, :, :, rotary:], want[:, :, rotary:])  # the rest passes through
        # The layout of the rotated part may differ; every query-key dot product may not.
        np.testing.assert_allclose(
            np.einsum("thd,shd->tsh", got[b], got[b]), np.einsum("thd,shd->tsh", want, want), rtol=2e-5, atol=2e-5
        )
        # A relative rotation: the product depends on the position difference only.
    shifted = np.asarray(
        apply_rope(jnp.asarray(x), jnp.asarray(positions + 17), freq, attention_factor=factor, interleaved=interleaved)
    )
    np.testing.assert_allclose(
        np.einsum("bthd,bshd->btsh", shifted, shifted), np.einsum("bthd,bshd->btsh", got, got), rtol=1e-4, atol=1e-4
    )


# ------------------------------------------------------------- forward pass
@pytest.mark.parametrize(
    "config",
    [
        V3,
        pytest.param(MLA_PLAIN, marks=pytest.mark.slow),
        pytest.param(GLM, marks=pytest.mark.slow),
        pytest.param(QWEN_PATTERN, marks=pytest.mark.slow),
    ],
    ids=["deepseek-v3", "mla-fullrank-bias", "glm-partial-yarn-bias", "qwen3-dense-pattern"],
)
def test_loaded_model_matches_numpy_oracle(tmp_path, rng, config):
    """Checkpoint -> model (redundant slots, a random placement) == the float64 oracle on the checkpoint tensors."""
    tensors = reference.random_tensors(config, rng)
    model = _model(config)
    load_checkpoint(model, _write(tmp_path, tensors), placement=_placement(rng, config))
    tokens, valid = _left_padded(rng, config, [9, 4, 1, 7], 9)
    got = np.asarray(_forward(model, jnp.asarray(tokens), jnp.asarray(valid)))
    want = reference.logits(tensors, config, tokens, valid)
    np.testing.assert_allclose(got[valid], want[valid], rtol=2e-4, atol=2e-4)
    assert [block.mlp.__class__.__name__ for block in model.layers] == [
        "DenseMLP" if i in config.dense_blocks else "MoELayer" for i in range(config.num_layers)
    ]


def test_absorbed_decode_equals_expanded_attention(rng):
    """MLA's weight-absorbed form (a shared latent key/value head) == keys and values expanded per head."""
    model = _model(V3)
    attn = model.layers[1].self_attn
    assert isinstance(attn, MultiLatentAttention)
    b, s = 4, 10
    cache = (jnp.asarray(rng.standard_normal((b, s, V3.kv_lora_rank + V3.qk_rope_head_dim)), jnp.float32),)
    x = jnp.asarray(rng.standard_normal((b, 1, V3.dim)), jnp.float32)
    positions = jnp.asarray(rng.integers(0, 50, (b, 1)), jnp.int32)
    mask = jnp.asarray(rng.random((b, 1, s)) < 0.7).at[:, :, 6].set(True)
    absorbed, state_a = attn(x, positions, mask, cache, 6, absorb=True)
    expanded, state_e = attn(x, positions, mask, cache, 6, absorb=False)
    np.testing.assert_allclose(np.asarray(absorbed), np.asarray(expanded), rtol=1e-5, atol=1e-5)
    assert np.array_equal(np.asarray(state_a[0]), np.asarray(state_e[0]))
    assert np.array_equal(np.asarray(state_a[0])[:, :6], np.asarray(cache[0])[:, :6])  # only position 6 is written


def test_latent_cache_holds_kv_lora_rank_plus_rope_dims_per_token():
    mla, gqa = _model(V3).init_cache(4, 16), _model(preset("tiny")).init_cache(4, 16)
    assert [tuple(a.shape for a in layer) for layer in mla.layers] == [((4, 16, 32 + 8),)] * V3.num_layers
    assert [tuple(a.shape for a in layer) for layer in gqa.layers] == [((4, 2, 16, 16),) * 2] * 3  # [B, K, S, Dh]


def test_a_decode_step_reads_the_kv_cache_where_it_lies():
    """The cache is head-major, the layout of the attention's product over (batch, head): a decode step writes
    one position and copies no cache-sized array (position-major, XLA transposed the whole cache in every layer
    of every step). The cache is donated, as `generate` donates it."""
    import re

    one_rank = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    model = MoECausalLM(preset("tiny"), mesh=one_rank, rngs=nnx.Rngs(0))  # the compiled shapes are the global ones
    cache = model.init_cache(4, 64)
    graphdef, variables = nnx.split(model)

    def decode(variables, token, cache):
        return nnx.merge(graphdef, variables).call_cached(token, cache)

    text = jax.jit(decode, donate_argnums=2).lower(variables, jnp.zeros((4, 1), jnp.int32), cache).compile().as_text()
    sides = sorted(cache.layers[0][0].shape)  # the cache's array in any order of its sides
    moved = [
        line.strip()[:120]
        for line in text.splitlines()
        for shape in re.findall(r"= \w+\[([\d,]+)\]\S* (?:copy|transpose)\(", line)
        if sorted(int(n) for n in shape.split(",")) == sides
    ]
    assert not moved, moved


@pytest.mark.slow
@pytest.mark.parametrize("config", [V3, MLA_PLAIN, GLM], ids=["deepseek-v3", "mla-fullrank-bias", "glm"])
def test_cache_equals_recompute_token_for_token(tmp_path, rng, config):
    model = _model(config)
    load_checkpoint(model, _write(tmp_path, reference.random_tensors(config, rng)))
    prompts = [rng.integers(0, config.vocab_size, n) for n in (5, 11, 1, 8)]
    cached = generate(model, prompts, max_new_tokens=6, prompt_width=12)
    again = generate(model, prompts, max_new_tokens=6, prompt_width=12, use_cache=False)
    assert np.array_equal(cached.tokens, again.tokens)
    # And the logits: the decode step (MLA: absorbed) against the whole sequence run again.
    tokens, valid = _left_padded(rng, config, [5, 9, 2, 7], 9)
    full = np.asarray(_forward(model, jnp.asarray(tokens), jnp.asarray(valid)))
    cache = model.init_cache(4, 9)
    step = nnx.jit(lambda m, t, c, v: m.call_cached(t, c, valid=v))
    _, cache = step(model, jnp.asarray(tokens[:, :6]), cache, jnp.asarray(valid[:, :6]))
    for i in range(6, 9):
        logits, cache = step(model, jnp.asarray(tokens[:, i : i + 1]), cache, jnp.asarray(valid[:, i : i + 1]))
        real = valid[:, i]  # a padding query's output is never used
        np.testing.assert_allclose(np.asarray(logits)[real], full[real, i], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("config", [V3, GLM], ids=["deepseek-v3", "glm"])
def test_prefill_equals_the_cached_call_on_left_padded_prompts(tmp_path, rng, config):
    """``prefill`` (right-padded, causal over each prompt) gives the logits and, for the decode steps after it, the
    same cache contents as ``call_cached`` over the left-padded prompts; a row of length 0 stays finite."""
    model = _model(config)
    load_checkpoint(model, _write(tmp_path, reference.random_tensors(config, rng)))
    lengths, width, max_len = np.array([5, 9, 0, 7]), 9, 12
    left, valid = _left_padded(rng, config, lengths, width)
    right = np.take_along_axis(left, (np.arange(width)[None, :] - lengths[:, None]) % width, axis=1)
    step = nnx.jit(lambda m, t, c, v: m.call_cached(t, c, valid=v))
    prefill = nnx.jit(lambda m, t, n: m.prefill(t, n, max_len=max_len))
    want, want_cache = step(model, jnp.asarray(left), model.init_cache(4, max_len), jnp.asarray(valid))
    got, cache = prefill(model, jnp.asarray(right), jnp.asarray(lengths, jnp.int32))
    real = lengths > 0
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], rtol=1e-5, atol=1e-5)
    assert int(cache.index) == width == int(want_cache.index)
    assert np.array_equal(np.asarray(cache.valid[:, :width]), np.arange(width)[None, :] < lengths[:, None])
    assert not np.asarray(cache.valid[:, width:]).any()
    for _ in range(3):  # the same decode steps from either cache
        token = jnp.asarray(rng.integers(0, config.vocab_size, (4, 1)), jnp.int32)
        on = jnp.ones((4, 1), bool)
        want, want_cache = step(model, token, want_cache, on)
        got, cache = step(model, token, cache, on)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_prefill_rejects_bad_lengths():
    model = _model(GLM)
    tokens = jnp.zeros((4, 6), jnp.int32)
    with pytest.raises(ValueError, match=r"lengths must be an integer \[4\] array"):
        model.prefill(tokens, jnp.zeros((4, 1), jnp.int32), max_len=8)
    with pytest.raises(ValueError, match="lengths must be an integer"):
        model.prefill(tokens, jnp.zeros(4, jnp.float32), max_len=8)
    with pytest.raises(ValueError, match="6 tokens do not fit a cache of 5 positions"):
        model.prefill(tokens, jnp.zeros(4, jnp.int32), max_len=5)


# -------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("config", [V3, GLM, QWEN_PATTERN], ids=["deepseek-v3", "glm", "qwen3-pattern"])
def test_bf16_checkpoint_into_float32_model_exports_the_same_bytes(tmp_path, rng, config):
    tensors = reference.random_tensors(config, rng, dtype=ml_dtypes.bfloat16)
    tensors = {n: v.astype(np.float32) if n.endswith("mlp.gate.weight") else v for n, v in tensors.items()}  # as HF
    model = _model(config)
    load_checkpoint(model, _write(tmp_path, tensors), placement=_placement(rng, config))
    assert model.embed_tokens.get_value().dtype == np.float32
    export_checkpoint(model, tmp_path / "out.safetensors")
    back = safetensors_numpy.load_file(str(tmp_path / "out.safetensors"))
    assert set(back) == set(tensors)
    for name, value in tensors.items():
        assert back[name].dtype == value.dtype and back[name].shape == value.shape, name
        assert back[name].tobytes() == value.tobytes(), name


def test_multi_token_prediction_blocks_are_skipped(tmp_path, rng):
    config = V3.replace(mtp_layers=1)
    tensors = reference.random_tensors(config, rng)
    extra = {"model.layers.3.eh_proj.weight": np.ones((4, 4), np.float32), "model.layers.3.enorm.weight": np.ones(4)}
    model = _model(config)
    load_checkpoint(model, _write(tmp_path, {**tensors, **extra}))
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.3.eh_proj.weight'"):
        load_checkpoint(_model(V3), _write(tmp_path, {**tensors, **extra}, "b.safetensors"))


def _fp8(w):
    """DeepSeek's block FP8 of ``w [out, in]``: e4m3 values and float32 scale_inv per 128 x 128 block."""
    rows, cols = -(-w.shape[0] // 128), -(-w.shape[1] // 128)
    scale = np.empty((rows, cols), np.float32)
    q = np.empty(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            block = (slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1)))
            amax = np.abs(w[block]).max()
            scale[i, j] = amax / 448 if amax else 1.0
            q[block] = (w[block] / scale[i, j]).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def _fp8_checkpoint(config, rng):
    """A DeepSeek-V3-style FP8 checkpoint: linear weights in block FP8, the rest bf16, the router bias float32.

    Returns ``(file tensors, what they mean in float32)``."""
    tensors = reference.random_tensors(config, rng)
    linear = [n for n, v in tensors.items() if v.ndim == 2 and n.endswith(("_proj.weight", "_mqa.weight"))]
    out, meaning = {}, {}
    for name, value in tensors.items():
        if name in linear:
            q, s = _fp8(value)
            out[name], out[name + "_scale_inv"] = q, s
            blocks = np.repeat(np.repeat(s, 128, 0), 128, 1)[: value.shape[0], : value.shape[1]]
            meaning[name] = q.astype(np.float32) * blocks
        else:
            out[name] = value if name.endswith("bias") else value.astype(ml_dtypes.bfloat16)
            meaning[name] = out[name].astype(np.float32)
    return out, meaning


def test_fp8_checkpoint_loads_as_it_is_and_exports_bit_for_bit(tmp_path, rng):
    tensors, meaning = _fp8_checkpoint(V3_FP8, rng)
    path = _write(tmp_path, tensors)
    placement = _placement(rng, V3_FP8)
    model = _model(V3_FP8)
    load_checkpoint(model, path, placement=placement)
    # Routed experts are the layer's fp8_block experts, slot p holding expert phy2log[p]'s very bytes.
    for li, (i, layer) in enumerate(zip(V3_FP8.moe_blocks, model.moe_layers)):
        assert layer.quant_format == "fp8_block" and layer.w_in is None
        q = layer.q_down.get_value()
        # Read whole to the host: a device-side index of a sharded e4m3 array may turn -0 into +0.
        weight, scale = np.asarray(q.weight), np.asarray(q.weight_scale)
        for p, e in enumerate(placement.phy2log[li]):
            name = f"model.layers.{i}.mlp.experts.{e}.down_proj.weight"
            assert weight[p].tobytes() == tensors[name].tobytes()
            assert scale[p].tobytes() == tensors[name + "_scale_inv"].tobytes()
    attn = model.layers[0].self_attn
    assert isinstance(attn.kv_a_proj_with_mqa, QuantizedWeight)  # 40 rows: a partial 128-row block
    assert np.asarray(attn.kv_a_proj_with_mqa.get_value().weight).tobytes() == (
        tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].tobytes()
    )
    tokens, valid = _left_padded(rng, V3_FP8, [7, 3, 1, 7], 7)
    got = np.asarray(_forward(model, jnp.asarray(tokens), jnp.asarray(valid)))
    want = reference.logits(meaning, V3_FP8, tokens, valid)
    np.testing.assert_allclose(got[valid], want[valid], rtol=2e-4, atol=2e-4)
    export_checkpoint(model, tmp_path / "out.safetensors")
    from moe_eplb_jax.models import safetensors_io as io

    files = [io.index([str(path)]), io.index([str(tmp_path / "out.safetensors")])]
    assert set(files[0]) == set(files[1])
    read = [io.read(f, sorted(f)) for f in files]
    for name in files[0]:
        assert files[0][name][1:] == files[1][name][1:], name
        assert read[0][name].tobytes() == read[1][name].tobytes(), name
    with pytest.raises(ValueError, match="already quantized"):
        load_checkpoint(model, path)


def test_bad_fp8_checkpoints_raise_naming_the_tensor(tmp_path, rng):
    tensors, _ = _fp8_checkpoint(V3_FP8, rng)
    model = _model(V3_FP8)
    gate = "model.layers.1.mlp.experts.0.gate_proj.weight"

    def bad(name, changed, match, **kw):
        with pytest.raises(ValueError, match=match):
            load_checkpoint(model, _write(tmp_path, changed, name), **kw)

    bad("noscale.safetensors", {k: v for k, v in tensors.items() if k != gate + "_scale_inv"}, f"{gate}.*without")
    bad("scale.safetensors", {**tensors, gate + "_scale_inv": np.ones((2, 1), np.float32)}, "block scales")
    embed = "model.embed_tokens.weight"
    bad("embed.safetensors", {**tensors, embed: tensors[embed].astype(ml_dtypes.float8_e4m3fn)}, f"{embed}.*linear")
    mixed = {**tensors, gate: tensors[gate].astype(np.float32)}
    del mixed[gate + "_scale_inv"]
    bad("mixed.safetensors", mixed, "experts of block 1 mix")
    bad("ok.safetensors", tensors, "loaded as 'fp8_block'", quantize="mxfp4")
    narrow = V3.replace(vocab_size=64)  # 64-wide experts: no whole 128 x 128 blocks
    t, _ = _fp8_checkpoint(narrow, rng)
    with pytest.raises(ValueError, match="whole 128x128 blocks"):
        load_checkpoint(_model(narrow), _write(tmp_path, t, "narrow.safetensors"))
    assert all(layer.quant_format is None for layer in model.moe_layers)


# ------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"attention": "mqa"}, "attention"),
        ({"attention": "mla", "qk_norm": True}, "qk_norm"),
        ({"attention": "mla", "qk_norm": False, "qk_rope_head_dim": 7}, "qk_rope_head_dim"),
        ({"attention": "mla", "qk_norm": False, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"attention": "mla", "qk_norm": False, "q_lora_rank": 0}, "q_lora_rank"),
        ({"partial_rotary_factor": 0.1}, "head_dim"),
        ({"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
        ({"qkv_bias": 1}, "qkv_bias"),
        ({"rope_scaling": {"factor": 4}}, "rope_scaling"),
        ({"first_dense_layers": 0, "dense_layers": (0, 0)}, "dense_layers"),
        ({"first_dense_layers": 0, "dense_layers": (3,)}, "dense_layers"),
        ({"first_dense_layers": 0, "dense_layers": (0, 1, 2)}, "dense_layers"),
        ({"dense_layers": (1,)}, "first_dense_layers"),
        ({"mtp_layers": -1}, "mtp_layers"),
    ],
)
def test_config_rejects_bad_attention_fields_by_name(changes, field):
    with pytest.raises(ValueError, match=f"ModelConfig.{field}"):
        ModelConfig(**changes)


def test_config_layer_patterns():
    config = ModelConfig(num_layers=6, first_dense_layers=0, dense_layers=[1, 4])
    assert config.dense_layers == (1, 4) and config.moe_blocks == (0, 2, 3, 5) and config.num_moe_layers == 4
    assert preset("tiny").moe_blocks == (1, 2) and hash(config)
    names = checkpoint_shapes(config)
    assert "model.layers.4.mlp.gate_proj.weight" in names and "model.layers.4.mlp.gate.weight" not in names


def test_dot_f32_differentiates_16_bit_inputs_with_16_bit_products(rng):
    """The LM head's and dense MLP's product: float32 out, bit for bit ``jnp.dot``'s; its gradients multiply in
    bf16 (no float32 GEMM in the backward pass) and agree with float64 to bf16 rounding. Float32 is autodiff."""
    from moe_eplb_jax.models.layers import dot_f32

    x = jnp.asarray(rng.standard_normal((2, 6, 32)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((32, 48)) / 6, jnp.bfloat16)
    cot = rng.standard_normal((2, 6, 48)).astype(np.float32)
    np.testing.assert_array_equal(
        np.asarray(dot_f32(x, w)), np.asarray(jnp.dot(x, w, preferred_element_type=jnp.float32))
    )
    loss = lambda x, w: jnp.sum(dot_f32(x, w) * cot)
    dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    want_dx, want_dw = cot @ w64.T, np.einsum("btk,btn->kn", x64, cot)
    np.testing.assert_allclose(np.asarray(dx, np.float64), want_dx, rtol=3e-2, atol=3e-2 * np.abs(want_dx).max())
    np.testing.assert_allclose(np.asarray(dw, np.float64), want_dw, rtol=3e-2, atol=3e-2 * np.abs(want_dw).max())
    dots = [
        e for e in jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w).jaxpr.eqns if e.primitive.name == "dot_general"
    ]
    assert len(dots) == 2 and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)  # dx, dw
    x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
    auto = jax.grad(lambda x, w: jnp.sum(jnp.dot(x, w) * cot), argnums=(0, 1))(x32, w32)
    ours = jax.grad(lambda x, w: jnp.sum(dot_f32(x, w) * cot), argnums=(0, 1))(x32, w32)
    for a, b in zip(ours, auto):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_embedding_gradient_adds_repeated_tokens_in_float32(rng):
    """``embed``: the gather's values; its bf16 table gradient is the float32 sum of each token's rows, rounded
    once (a repeated token's rows are not summed in bf16), and rows never looked up get zero."""
    from moe_eplb_jax.models.layers import embed

    table = jnp.asarray(rng.standard_normal((11, 8)), jnp.bfloat16)
    tokens = jnp.asarray([[3, 3, 3, 0], [7, 3, 0, 10]], jnp.int32)
    cot = rng.standard_normal((2, 4, 8)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(embed(table, tokens)), np.asarray(table)[np.asarray(tokens)])
    got = jax.grad(lambda t: jnp.sum(embed(t, tokens).astype(jnp.float32) * cot))(table)
    want = np.zeros((11, 8), np.float32)
    for position, token in enumerate(np.asarray(tokens).ravel()):
        want[token] += np.asarray(cot.reshape(-1, 8)[position].astype(ml_dtypes.bfloat16), np.float32)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got), want.astype(ml_dtypes.bfloat16))


def test_cross_entropy_matches_optax_and_its_gradient_scatters_nothing(rng):
    from moe_eplb_jax.models import cross_entropy

    optax = pytest.importorskip("optax")
    logits = jnp.asarray(rng.standard_normal((3, 5, 40)) * 4, jnp.bfloat16)
    labels = jnp.asarray(rng.integers(0, 40, (3, 5)), jnp.int32)
    want = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    np.testing.assert_allclose(np.asarray(cross_entropy(logits, labels)), np.asarray(want), rtol=1e-6, atol=1e-6)
    ours = jax.grad(lambda z: jnp.mean(cross_entropy(z, labels)))(logits.astype(jnp.float32))
    theirs = jax.grad(lambda z: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(z, labels)))(
        logits.astype(jnp.float32)
    )
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-6, atol=1e-7)
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda z: jnp.mean(cross_entropy(z, labels))))(logits.astype(jnp.float32)))
    assert "scatter" not in jaxpr
    with pytest.raises(ValueError, match="labels must have shape"):
        cross_entropy(logits, labels[:, :2])

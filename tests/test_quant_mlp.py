"""The quantized expert MLP: fast paths against the dequantize-then-matmul reference."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from moe_eplb_jax import quant
from moe_eplb_jax.quant.mlp import _project

E, T, H, I = 4, 16, 128, 256


def _layer(rng):
    x = rng.standard_normal((E, T, H)).astype(np.float32)
    weights = [(rng.standard_normal(s) * 0.05).astype(np.float32) for s in ((E, I, H), (E, I, H), (E, H, I))]
    return x, weights


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)) and np.all(np.isfinite(b))
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_fast_paths_match_reference(fmt, rng):
    x, (wg, wu, wd) = _layer(rng)
    gate, up, down = quant.quantize_mlp(
        wg, wu, wd, fmt, input_scale=float(np.abs(x).max() / 448), down_input_scale=0.005
    )
    ref = quant.expert_mlp_reference(x, gate, up, down)
    f32 = quant.expert_mlp_reference(x, wg, wu, wd)
    assert 1e-4 < _rel(ref, f32) < {"mxfp4": 0.3, "nvfp4": 0.3}.get(fmt, 0.1)  # quantization is visible, bounded
    for impl in ("auto", "dequant"):
        out = quant.expert_mlp(x, gate, up, down, impl=impl)
        assert out.shape == (E, T, H) and out.dtype == jnp.float32
        # fp8 W8A8: the same e4m3 products, only the f32 summation order differs; others: bf16 activations.
        assert _rel(out, ref) < (1e-5 if fmt == "fp8" else 1.5e-2), impl


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
def test_scaled_matmul_matches_fake_quant_oracle(fmt, rng):
    x, weights = _layer(rng)
    gate, up, down = quant.quantize_mlp(*weights, fmt)

    def project(a, q):  # activations MXFP8-quantized per token, blocks of 32, then an f32 matmul
        a_q = quant.dequantize_experts(quant.quantize_experts(a, "mxfp8"))
        return jnp.einsum("etk,enk->etn", a_q, quant.dequantize_experts(q), precision="highest")

    hidden = jnp.asarray(project(x, gate))
    hidden = hidden * jnp.reciprocal(1 + jnp.exp(-hidden)) * project(x, up)
    oracle = project(hidden, down)
    assert _rel(quant.expert_mlp(x, gate, up, down, impl="scaled_matmul"), oracle) < 1e-5


def test_bf16_baseline_arrays(rng):
    x, (wg, wu, wd) = _layer(rng)
    ref = quant.expert_mlp_reference(x, wg, wu, wd)
    bf16 = [jnp.asarray(w, jnp.bfloat16) for w in (wg, wu, wd)]
    assert _rel(quant.expert_mlp(x, *bf16), ref) < 1.5e-2


def test_quantize_mlp_fp8_shares_gate_up_scale(rng):
    _, (wg, wu, wd) = _layer(rng)
    wu[1] *= 3.0  # expert 1's up projection dominates, gate's elsewhere
    gate, up, down = quant.quantize_mlp(wg, wu, wd, "fp8", input_scale=0.5, down_input_scale=0.25)
    want = np.maximum(np.abs(wg).max(axis=(1, 2)), np.abs(wu).max(axis=(1, 2))) * np.float32(1 / 448)
    np.testing.assert_array_equal(np.asarray(gate.weight_scale), want)
    np.testing.assert_array_equal(np.asarray(up.weight_scale), want)
    np.testing.assert_array_equal(np.asarray(gate.alpha), want * np.float32(0.5))
    np.testing.assert_array_equal(np.asarray(down.input_scale), np.full(E, 0.25, np.float32))


def test_share_weight_scale_requantizes_to_the_max(rng):
    _, (wg, wu, _) = _layer(rng)
    wu[0] *= 4.0
    gate, up = quant.quantize_experts(wg, "fp8"), quant.quantize_experts(wu, "fp8")
    gate2, up2 = quant.share_weight_scale(gate, up)
    np.testing.assert_array_equal(np.asarray(gate2.weight_scale), np.asarray(up2.weight_scale))
    np.testing.assert_array_equal(np.asarray(gate2.alpha), np.asarray(gate2.weight_scale * gate2.input_scale))
    np.testing.assert_array_equal(np.asarray(up2.weight[0]).view(np.uint8), np.asarray(up.weight[0]).view(np.uint8))
    assert _rel(gate2.dequantize(), wg) < 0.05 and _rel(up2.dequantize(), wu) < 0.05


def test_dynamic_scaling_equals_static_with_the_same_scales(rng):
    x, weights = _layer(rng)
    gate, up, down = quant.quantize_mlp(*weights, "fp8")
    dynamic = quant.expert_mlp(x, gate, up, down, activation_scaling="dynamic", impl="reference")
    s_x = quant.activation_scale(x)
    gate, up = quant.with_input_scale(gate, s_x), quant.with_input_scale(up, s_x)
    kw = dict(impl="reference", activation_scaling="static", axis_name=None, compute_dtype=jnp.float32)
    hidden = np.asarray(_project(x, gate, **kw))
    hidden = hidden / (1 + np.exp(-hidden)) * np.asarray(_project(x, up, **kw))
    down = quant.with_input_scale(down, quant.activation_scale(jnp.asarray(hidden, jnp.float32)))
    static = quant.expert_mlp(x, gate, up, down, impl="reference")
    assert _rel(dynamic, static) < 1e-5
    assert (
        _rel(quant.expert_mlp(x, gate, up, dataclasses.replace(down, alpha=down.alpha * 2), impl="reference"), static)
        > 0.5
    )  # the stored alpha is what the compute path uses: no hidden copy elsewhere


def test_bad_mlp_inputs_raise(rng):
    x, weights = _layer(rng)
    gate, up, down = quant.quantize_mlp(*weights, "fp8")
    with pytest.raises(ValueError, match="unknown impl"):
        quant.expert_mlp(x, gate, up, down, impl="cudnn")
    with pytest.raises(ValueError, match="expected gate/up"):
        quant.expert_mlp(x, gate, up, gate)
    with pytest.raises(ValueError, match="scaled_matmul"):
        quant.expert_mlp(x, gate, up, down, impl="scaled_matmul")
    with pytest.raises(ValueError, match="x must be"):
        quant.expert_mlp(x.astype(np.int32), gate, up, down)
    with pytest.raises(ValueError, match="activation_scaling"):
        quant.expert_mlp(x, gate, up, down, activation_scaling="per_token")
    with pytest.raises(ValueError, match="input_scale must be positive"):
        quant.with_input_scale(gate, 0.0)

"""Exact encodings of the quantized expert formats, checked against gfloat, ml_dtypes and numpy oracles."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from moe_eplb_jax import quant
from moe_eplb_jax.quant import _elements as el

try:
    import gfloat
    from gfloat.formats import format_info_mxfp4_e2m1, format_info_mxfp8_e4m3
except ImportError:  # a test-only package: the tests against it skip, the others run
    gfloat = None
needs_gfloat = pytest.mark.skipif(gfloat is None, reason="needs gfloat (pip install -e '.[test]')")

_ldexp = jax.jit(el.ldexp_exact)
_enc_e4m3 = jax.jit(lambda v: jax.lax.bitcast_convert_type(el.encode_e4m3(v), jnp.uint8))
_enc_e2m1 = jax.jit(el.encode_e2m1)


def _u8(x) -> np.ndarray:
    """Bytes of any array (uint8 view; fp8/e8m0 keep their shape)."""
    x = np.asarray(x)
    return x.view(np.uint8) if x.dtype.itemsize == 1 else x.view(np.uint8).reshape(*x.shape, -1)


def _random_weights(rng, shape, spread=4.0):
    """Normal values times per-row log-uniform magnitudes, so blocks span many exponents."""
    mags = np.exp2(rng.uniform(-spread, spread, size=shape[:-1] + (1,)))
    return (rng.standard_normal(shape) * mags).astype(np.float32)


# ---------------------------------------------------------------- element types vs ml_dtypes


def test_e4m3_encoding_matches_ml_dtypes_saturating(rng):
    table = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = table[np.isfinite(table)]
    mids = (np.sort(np.unique(finite))[1:] + np.sort(np.unique(finite))[:-1]) / 2  # ties: RNE decides
    v = np.concatenate(
        [
            finite,
            mids,
            rng.standard_normal(4000).astype(np.float32) * 100,
            np.array([500.0, -1e30, 464.0, -465.0, 1e-12, -1e-12, -0.0], np.float32),
        ]
    )
    ours = np.asarray(_enc_e4m3(v))
    want = np.clip(v, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(ours, want)
    assert ours[-1] == 0x80 and ours[-2] == 0x80  # negative values that round to zero keep the sign


def test_e2m1_encoding_and_table_match_ml_dtypes(rng):
    table = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(table, el.E2M1_VALUES)
    grid = np.unique(np.abs(table))
    mids = (grid[1:] + grid[:-1]) / 2
    v = np.concatenate(
        [
            table,
            mids,
            -mids,
            rng.standard_normal(4000).astype(np.float32) * 3,
            np.array([7.0, -100.0, 5.0, 5.0001, -0.2], np.float32),
        ]
    )
    ours = np.asarray(_enc_e2m1(v))
    want = np.clip(v, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    np.testing.assert_array_equal(ours, want)


def test_arithmetic_decoders_match_tables():
    codes = jnp.arange(16, dtype=jnp.uint8)
    np.testing.assert_array_equal(np.asarray(el.decode_e2m1(codes)).view(np.uint32), el.E2M1_VALUES.view(np.uint32))
    e8m0 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)
    ours = np.asarray(el.e8m0_to_float32(jnp.asarray(e8m0)))
    np.testing.assert_array_equal(ours[1:], e8m0[1:].astype(np.float32))  # code 0 (2**-127) flushes to 0
    assert ours[0] == 0


def test_ldexp_exact_handles_subnormals(rng):
    x = np.concatenate(
        [
            rng.standard_normal(500).astype(np.float32),
            (rng.integers(1, 2**23, 500) * np.float64(2.0**-149) * rng.choice([-1, 1], 500)).astype(np.float32),
        ]
    )
    k = rng.integers(-40, 40, x.shape).astype(np.int32)
    want = np.ldexp(x.astype(np.float64), k)
    ours = np.asarray(_ldexp(x, k)).astype(np.float64)
    # Exact wherever the result is a float32 value; otherwise (deep subnormal) truncated by < 1 ulp.
    exact = want.astype(np.float32).astype(np.float64) == want
    assert exact.sum() > 600
    np.testing.assert_array_equal(ours[exact], want[exact])
    assert np.all(np.abs(ours - want)[~exact] < 2.0**-149) and np.all(np.abs(ours[~exact]) <= np.abs(want[~exact]))
    special = np.asarray(
        _ldexp(np.array([np.inf, -np.inf, np.nan, 3e38], np.float32), np.array([1, -3, 2, 5], np.int32))
    )
    assert special[0] == np.inf and special[1] == -np.inf and np.isnan(special[2]) and special[3] == np.inf


def test_fp4_packing_matches_jax_float4_bitcast(rng):
    codes = rng.integers(0, 16, (3, 8)).astype(np.uint8)
    packed = np.asarray(el.pack_fp4(jnp.asarray(codes)))
    assert np.array_equal(packed & 0xF, codes[:, 0::2]) and np.array_equal(packed >> 4, codes[:, 1::2])
    as_f4 = jax.lax.bitcast_convert_type(jnp.asarray(packed), jnp.float4_e2m1fn).reshape(3, 8)
    np.testing.assert_array_equal(np.asarray(as_f4.astype(jnp.float32)), el.E2M1_VALUES[codes])
    np.testing.assert_array_equal(np.asarray(el.unpack_fp4(jnp.asarray(packed))), codes)


# ---------------------------------------------------------------- MX vs gfloat


def _edge_blocks(rng):
    """Rows of 32: all-zero, NaN, Inf, subnormal, power-of-two amax, saturating, and mixed exponents."""
    rows = [
        np.zeros(32),
        rng.standard_normal(32),
        rng.standard_normal(32),
        rng.standard_normal(32),
        (rng.integers(-(2**23), 2**23, 32) * 2.0**-149),
        rng.standard_normal(32),
        rng.standard_normal(32) * 2.0**-120,
        rng.standard_normal(32) * 1e30,
        rng.standard_normal(32),
    ]
    rows[1][5] = np.nan
    rows[2][3], rows[2][7] = np.inf, -np.inf
    rows[3][0] = -np.inf
    rows[5] = np.clip(rows[5], -0.99, 0.99)
    rows[5][9] = -4.0  # amax exactly a power of two
    rows[8] = np.where(np.abs(rows[8]) > 0.9, 1.9375, rows[8])  # just under the next power: saturates elements
    rows[8][0] = -0.0
    return np.stack(rows).astype(np.float32)


@needs_gfloat
@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
def test_mx_encoding_equals_gfloat(fmt, rng):
    info = format_info_mxfp8_e4m3 if fmt == "mxfp8" else format_info_mxfp4_e2m1
    blocks = np.concatenate([_edge_blocks(rng), _random_weights(rng, (23, 32), spread=30.0)])
    q = quant.quantize_experts(blocks.reshape(2, 16, 32), fmt, nonfinite="propagate")
    scale_codes = _u8(q.scales).reshape(-1)
    elements = _u8(q.elements).reshape(32, -1)
    if fmt == "mxfp4":
        elements = np.asarray(quant.unpack_fp4(jnp.asarray(elements)))
    decoded = np.asarray(quant.dequantize_experts(q)).reshape(32, 32)
    for i, block in enumerate(blocks.astype(np.float64)):
        scale = gfloat.compute_scale_amax(info.etype.emax, block)
        if np.isnan(scale):  # NaN block: NaN scale, the whole block decodes to NaN
            assert scale_codes[i] == 0xFF and np.all(np.isnan(decoded[i]))
            if fmt == "mxfp8":
                assert np.all(elements[i] == 0xFF)
            continue
        want = list(gfloat.encode_block(info, scale, block / scale))
        assert scale_codes[i] == want[0], (i, scale_codes[i], want[0])
        np.testing.assert_array_equal(elements[i], want[1:], err_msg=f"block {i}")
        with np.errstate(over="ignore"):  # Inf blocks decode to 448 * 2**127, Inf in float32
            want_values = np.fromiter(gfloat.decode_block(info, want), float).astype(np.float32)
        np.testing.assert_array_equal(decoded[i], want_values, err_msg=f"block {i}")


def test_mx_scale_is_floor_not_nearest(rng):
    # amax 1.9 * 2**k: floor rule gives 2**(k - emax); astype(e8m0) would round up to 2**(k + 1 - emax).
    w = np.full((1, 1, 32), 0.1, np.float32)
    w[0, 0, 0] = 1.9 * 2.0**5
    q = quant.quantize_experts(w, "mxfp8")
    assert _u8(q.scales)[0, 0, 0] == 127 + 5 - 8


# ---------------------------------------------------------------- fp8, fp8_block, nvfp4 oracles


def _numpy_nvfp4(w):
    """Numpy float32 oracle of the NVFP4 rule (module docstring of quant.nvfp4)."""
    e, n, k = w.shape
    amax = np.abs(w).max(axis=(1, 2))
    g = np.where(amax == 0, np.float32(1), amax * np.float32(1 / 2688)).astype(np.float32)
    blocks = w.reshape(e, n, k // 16, 16)
    sb = (np.abs(blocks).max(-1) / (g[:, None, None] * np.float32(6))).astype(np.float32)
    sb8 = np.clip(sb, 0, 448).astype(ml_dtypes.float8_e4m3fn)
    denom = (sb8.astype(np.float32) * g[:, None, None])[..., None]
    with np.errstate(invalid="ignore", divide="ignore"):
        scaled = np.where(denom > 0, blocks / np.where(denom > 0, denom, 1), 0).astype(np.float32)
    codes = np.clip(scaled, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8).reshape(e, n, k)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), sb8, g


def test_nvfp4_equals_numpy_oracle_and_error_bound(rng):
    w = _random_weights(rng, (3, 8, 64))
    w[1, 2, :16] = 0.0  # an all-zero block
    q = quant.quantize_experts(w, "nvfp4")
    elements, block_scales, global_scale = _numpy_nvfp4(w)
    np.testing.assert_array_equal(_u8(q.elements), elements)
    np.testing.assert_array_equal(_u8(q.block_scales), block_scales.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(q.global_scale), global_scale)
    step = (block_scales.astype(np.float32) * global_scale[:, None, None])[..., None]
    err = np.abs(np.asarray(quant.dequantize_experts(q)) - w).reshape(3, 8, 4, 16)
    saturation = np.maximum(np.abs(w).reshape(3, 8, 4, 16) - 6 * step, 0)
    assert np.all(err <= step * 1.0 + saturation + 1e-30)  # half the widest e2m1 gap (4 -> 6) is 1 step


@pytest.mark.parametrize("fmt", ["fp8", "fp8_block"])
def test_fp8_formats_equal_numpy_oracle(fmt, rng):
    w = _random_weights(rng, (2, 256, 256)).astype(np.float32)
    q = quant.quantize_experts(w, fmt)
    if fmt == "fp8":
        scale = np.abs(w).max(axis=(1, 2)) * np.float32(1 / 448)
        np.testing.assert_array_equal(np.asarray(q.weight_scale), scale)
        want = np.clip(w / scale[:, None, None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
        np.testing.assert_array_equal(np.asarray(q.alpha), scale * np.float32(1.0))
    else:
        tiles = w.reshape(2, 2, 128, 2, 128)
        scale = np.abs(tiles).max(axis=(2, 4)) * np.float32(1 / 448)
        np.testing.assert_array_equal(np.asarray(q.weight_scale), scale)
        want = np.clip(tiles / scale[:, :, None, :, None], -448, 448).astype(ml_dtypes.float8_e4m3fn).reshape(w.shape)
    np.testing.assert_array_equal(_u8(q.weight), want.view(np.uint8))
    d = np.asarray(quant.dequantize_experts(q))
    np.testing.assert_array_equal(
        d,
        want.astype(np.float32).reshape(d.shape)
        * (scale[:, None, None] if fmt == "fp8" else np.repeat(np.repeat(scale, 128, 1), 128, 2)),
    )
    assert np.all(np.abs(d - w) <= np.abs(w) * 2.0**-4 + 2.0**-10 * np.max(np.abs(w)))


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_round_trip_error_is_format_sized(fmt, rng):
    w = rng.standard_normal((4, 128, 128)).astype(np.float32)
    d = np.asarray(quant.dequantize_experts(quant.quantize_experts(jnp.asarray(w, jnp.bfloat16), fmt)))
    ref = np.asarray(jnp.asarray(w, jnp.bfloat16).astype(jnp.float32))
    rel = np.linalg.norm(d - ref) / np.linalg.norm(ref)
    bound = {"fp8": 0.04, "fp8_block": 0.04, "mxfp8": 0.04, "mxfp4": 0.16, "nvfp4": 0.12}[fmt]
    assert 0 < rel < bound, rel


# ---------------------------------------------------------------- structure, permutation, bad input


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_every_leaf_is_expert_major(fmt, rng):
    q = quant.quantize_experts(_random_weights(rng, (5, 128, 128)), fmt)
    leaves = jax.tree.leaves(q)
    assert len(leaves) >= 2 and all(leaf.shape[0] == 5 for leaf in leaves)
    assert type(jax.tree.unflatten(jax.tree.structure(q), leaves)) is type(q)


def test_quantize_under_jit_and_vmap_equals_eager(rng):
    """Traced weights (jit; vmap over a layer axis for [L, E, N, K] stacks) give the same bytes."""
    w = _random_weights(rng, (2, 2, 128, 128))
    for fmt in quant.FORMATS:
        eager = [quant.quantize_experts(w[layer], fmt) for layer in range(2)]
        layered = jax.jit(jax.vmap(lambda v, f=fmt: quant.quantize_experts(v, f)))(w)
        for layer in range(2):
            for a, b in zip(jax.tree.leaves(eager[layer]), jax.tree.leaves(layered), strict=True):
                np.testing.assert_array_equal(_u8(a), _u8(b[layer]))


@given(seed=st.integers(0, 2**31 - 1))
def test_quantizing_permuted_experts_permutes_every_leaf(seed):
    """The algebra behind the rearrangement contract: quantize(w[phy2log]) == quantize(w)[phy2log]."""
    rng = np.random.default_rng(seed)
    w = _random_weights(rng, (4, 128, 128))
    phy2log = rng.integers(0, 4, 6)
    for fmt in quant.FORMATS:
        whole = quant.quantize_experts(w, fmt)
        permuted = quant.quantize_experts(w[phy2log], fmt)
        for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(permuted), strict=True):
            np.testing.assert_array_equal(_u8(a)[phy2log], _u8(b))


@pytest.mark.parametrize(
    "fmt,shape,match",
    [
        ("mxfp8", (2, 4, 48), "multiple of 32"),
        ("mxfp4", (2, 4, 33), "multiple of 32"),
        ("nvfp4", (2, 4, 24), "multiple of 16"),
        ("fp8_block", (2, 100, 128), "multiples of the block size"),
        ("fp8", (4, 128), "3 dims"),
        ("fp8", (0, 4, 4), "non-empty"),
        ("fp9", (2, 4, 32), "unknown format"),
    ],
)
def test_bad_shapes_and_names_raise(fmt, shape, match, rng):
    with pytest.raises(ValueError, match=match):
        quant.quantize_experts(rng.standard_normal(shape).astype(np.float32), fmt)


def test_bad_options_and_dtypes_raise(rng):
    w = rng.standard_normal((2, 128, 128)).astype(np.float32)
    with pytest.raises(ValueError, match="unknown options"):
        quant.quantize_experts(w, "mxfp8", block_size=(32,))
    with pytest.raises(ValueError, match="dtype"):
        quant.quantize_experts(w.astype(np.int32), "fp8")
    with pytest.raises(ValueError, match="input_scale must be positive"):
        quant.quantize_experts(w, "fp8", input_scale=-1.0)
    with pytest.raises(ValueError, match="weight_scale must be a scalar or shape"):
        quant.quantize_experts(w, "fp8", weight_scale=np.ones(3, np.float32))
    with pytest.raises(ValueError, match="nonfinite"):
        quant.quantize_experts(w, "fp8", nonfinite="ignore")
    with pytest.raises(ValueError, match="dequantize_experts"):
        quant.dequantize_experts(w)


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_nonfinite_weights_raise_or_follow_documented_rule(fmt, rng):
    w = _random_weights(rng, (3, 128, 128))
    w[1, 5, 7] = np.nan
    w[2, 130 % 128, 3] = np.inf
    with pytest.raises(ValueError, match=r"NaN/Inf values in experts \[1, 2\]"):
        quant.quantize_experts(w, fmt)
    q = quant.quantize_experts(w, fmt, nonfinite="propagate")
    for leaf in jax.tree.leaves(q):  # NaNs in float32 scale leaves have one bit pattern on every backend
        if leaf.dtype == jnp.float32 and np.isnan(np.asarray(leaf)).any():
            assert set(np.asarray(leaf)[np.isnan(np.asarray(leaf))].view(np.uint32).tolist()) == {0x7FC00000}
    d = np.asarray(quant.dequantize_experts(q))
    assert np.all(np.isfinite(d[0]))  # a clean expert is untouched
    if fmt in ("fp8", "nvfp4") or fmt == "fp8_block":  # the expert's scale is non-finite: the whole expert is NaN
        assert np.all(np.isnan(d[1])) and np.all(np.isnan(d[2]))
    else:  # MX: the NaN block is NaN, the Inf decodes to Inf, the rest of its block flushes to ~0
        assert np.all(np.isnan(d[1, 5, 0:32])) and np.isfinite(d[1]).sum() == 128 * 128 - 32
        assert d[2, 2, 3] == np.inf and np.all(np.abs(np.delete(d[2, 2, 0:32], 3)) < 1e-30)

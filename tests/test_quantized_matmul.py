"""One test body for every quantized grouped matmul (``moe_eplb_jax.moe.quantized_matmul``) and the ragged MLP.

Each implementation is checked against independent oracles on fresh random
inputs: a float64 numpy product of ``quant.dequantize_experts`` weights (with
fp8's activations quantized by ``quant.quantize_activation_fp8``), and the
whole expert MLP against ``quant.expert_mlp_reference`` run per slot. Edges:
empty groups, all rows in one group, no rows at all, groups at the row tile's
boundaries, padding rows holding NaN, tiny-scale blocks, signed zeros, NaN/Inf
activations. On CPU: ``reference`` and the Triton kernel in Pallas' interpreter
(small shapes: the interpreter is slow); on a GPU also the compiled kernel.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import ep_mesh
from jax.sharding import PartitionSpec

from moe_eplb_jax import quant
from moe_eplb_jax.moe import expert_mlp
from moe_eplb_jax.moe import quantized_matmul as qmm
from moe_eplb_jax.moe._qgmm import triton as qtriton

gpu = pytest.mark.gpu
slow = pytest.mark.slow
IMPLEMENTATIONS = ["reference", "pallas_interpret"] + [pytest.param(i, marks=gpu) for i in ("triton", "auto")]
FORMATS = list(quant.FORMATS)
# Small tiles so the interpreter's shapes still loop over K, split M and straddle row tiles.
CONFIG = qmm.Config(block_rows=16, block_k=32, block_cols=16)
NUM_ROWS, DEPTH, WIDTH = 48, 64, 32
SLOW_F32 = ("fp8_block", "mxfp8", "nvfp4")


def _quantize(w, fmt):
    opts = {"block_size": (16, 32)} if fmt == "fp8_block" else {}
    if fmt == "fp8":
        opts["input_scale"] = float(np.abs(w).max()) / 448 * 8  # any positive scale; rows saturate where large
    return quant.quantize_experts(jnp.asarray(w), fmt, nonfinite="propagate", **opts)


def _matmul(implementation, x, q, sizes, **kw):
    return np.asarray(
        qmm.quantized_grouped_matmul(
            jnp.asarray(x), q, jnp.asarray(sizes, jnp.int32), implementation=implementation, config=CONFIG, **kw
        )
    )


def _oracle(x, q, sizes, *, activation_scaling="static"):
    """float64 rows times their slot's dequantized weights (fp8: quantized activations, then times alpha)."""
    sizes = np.asarray(sizes)
    live = int(sizes.sum())
    slot = np.repeat(np.arange(len(sizes)), sizes)
    lhs = jnp.asarray(x[:live], jnp.float32)
    if isinstance(q, quant.Fp8Experts):
        if activation_scaling == "static":
            scale, alpha = np.asarray(q.input_scale)[slot], np.asarray(q.alpha)[slot]
        else:
            s = quant.activation_scale(lhs)
            scale = np.full(live, np.float32(s))
            alpha = (np.asarray(q.weight_scale) * np.float32(s))[slot]
        lhs = quant.quantize_activation_fp8(lhs[:, None, :], jnp.asarray(scale, jnp.float32))[:, 0, :]
        w = np.asarray(q.weight.astype(jnp.float32), np.float64)
    else:
        alpha = np.ones(live)
        w = np.asarray(quant.dequantize_experts(q), np.float64)
    y = np.zeros((x.shape[0], q.shape[1]))
    with np.errstate(invalid="ignore", over="ignore"):
        y[:live] = np.einsum("nk,nmk->nm", np.asarray(lhs, np.float64), w[slot]) * alpha[:, None]
    return y


def _case(rng, fmt, dtype, sizes):
    x = rng.standard_normal((NUM_ROWS, DEPTH)).astype(np.float32)
    x = np.array(jnp.asarray(x, dtype))  # the values the matmul sees (a writable copy)
    w = (rng.standard_normal((len(sizes), WIDTH, DEPTH)) * np.exp2(rng.integers(-4, 4, (len(sizes), WIDTH, 1)))) * 0.1
    return x, _quantize(w.astype(np.float32), fmt)


def _assert_close(got, want, live, tol=2e-5):
    assert got.shape == want.shape and got.dtype == np.float32
    err = np.linalg.norm(got[:live] - want[:live]) / max(np.linalg.norm(want[:live]), 1e-30)
    assert err < tol, err
    np.testing.assert_array_equal(got[live:], 0.0)  # padding rows come out zero


# The interpreter's float32 runs of the formats fp8 and mxfp4 do not cover are the slow lane's.
ORACLE_CASES = [
    pytest.param(i, f, d, marks=slow if i == "pallas_interpret" and d == jnp.float32 and f in SLOW_F32 else ())
    for i in ("reference", "pallas_interpret")
    for f in FORMATS
    for d in (jnp.float32, jnp.bfloat16)
] + [pytest.param(i, f, d, marks=gpu) for i in ("triton", "auto") for f in FORMATS for d in (jnp.float32, jnp.bfloat16)]


@pytest.mark.parametrize("implementation,fmt,dtype", ORACLE_CASES)
def test_matches_float64_oracle(implementation, fmt, dtype, rng):
    sizes = np.array([13, 0, 20, 3], np.int32)  # an empty group, tiles shared by groups, 12 padding rows
    x, q = _case(rng, fmt, dtype, sizes)
    x[36:] = np.nan  # padding rows reach nothing
    for scaling in ("static", "dynamic") if fmt == "fp8" else ("static",):
        got = _matmul(implementation, x, q, sizes, activation_scaling=scaling)
        _assert_close(got, _oracle(x, q, sizes, activation_scaling=scaling), 36)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_16_bit_result_is_the_float32_one_rounded_once(implementation, rng):
    """``out_dtype``: the float32 result rounded to bfloat16 or float16 as the kernel stores it, bit for bit;
    padding rows zero; any other dtype refused by name."""
    sizes = np.array([13, 0, 20, 3], np.int32)
    for fmt in ("fp8", "mxfp4", "nvfp4"):
        x, q = _case(rng, fmt, jnp.bfloat16, sizes)
        x[36:] = np.nan
        full = _matmul(implementation, x, q, sizes)
        for dtype in (jnp.bfloat16, jnp.float16):
            got = _matmul(implementation, x, q, sizes, out_dtype=dtype)
            assert got.dtype == dtype
            np.testing.assert_array_equal(got, np.asarray(jnp.asarray(full, dtype)))
    with pytest.raises(ValueError, match="out_dtype"):
        _matmul(implementation, x, q, sizes, out_dtype=jnp.int32)


@pytest.mark.parametrize(
    "sizes",
    [[48, 0, 0], [0, 0, 48], [0, 0, 0], [16, 1, 15], [17, 15, 16], [32, 0, 1]],
    ids=["first-takes-all", "last-takes-all", "no-rows", "tile-edges", "straddle", "tail"],
)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_group_sizes_at_the_edges(implementation, sizes, rng):
    for fmt in ("mxfp4", "fp8"):
        x, q = _case(rng, fmt, jnp.bfloat16, sizes)
        live = int(np.sum(sizes))
        _assert_close(_matmul(implementation, x, q, sizes), _oracle(x, q, sizes), live)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_edge_values(implementation, fmt, rng):
    """Tiny-scale blocks decode exactly (MX scale code 0 to zero); -0.0 rows give zeros; NaN/Inf rows as the oracle."""
    sizes = np.array([20, 28], np.int32)
    x, _ = _case(rng, fmt, jnp.float32, sizes)
    w = rng.standard_normal((2, WIDTH, DEPTH)).astype(np.float32)
    w[0] *= np.float32(1e-33)  # slot 0: tiny blocks (MX scale codes near the bottom, NVFP4 tiny global scale)
    w[1, :4, :32] = np.float32(1e-39)  # float32 subnormal weights: scale code 0 in MX
    w[1, 4:8] = 0.0
    w[1, 8:10] = -0.0
    q = _quantize(w, fmt)
    x[0] = -0.0
    x[1, 5] = np.inf
    x[2, 7] = -np.inf
    x[3, 9] = np.nan
    got = _matmul(implementation, x, q, sizes)
    want = _oracle(x, q, sizes)
    np.testing.assert_array_equal(got[0], 0.0)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    for rows in (slice(0, 20), slice(20, 48)):  # each slot on its own scale
        g, o = got[rows][finite[rows]], want[rows][finite[rows]]
        assert np.linalg.norm(g - o) <= 2e-5 * np.linalg.norm(o) + 1e-36 * o.size, (fmt, rows)


def test_decoders_match_the_formats_tables():
    codes = jnp.arange(256, dtype=jnp.int32)
    e4m3 = np.asarray(jax.lax.bitcast_convert_type(codes.astype(jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float32))
    got = np.asarray(qtriton._e4m3(codes.astype(jnp.uint8)))
    np.testing.assert_array_equal(got.view(np.uint32)[~np.isnan(e4m3)], e4m3.view(np.uint32)[~np.isnan(e4m3)])
    np.testing.assert_array_equal(np.isnan(got), np.isnan(e4m3))  # 0x7F and 0xFF
    even, odd = (np.asarray(v) for v in qtriton._e2m1_pair(codes.astype(jnp.uint8)))
    table = quant.E2M1_VALUES.view(np.uint32)  # -0.0 included
    np.testing.assert_array_equal(even.view(np.uint32), table[np.arange(256) & 15])
    np.testing.assert_array_equal(odd.view(np.uint32), table[np.arange(256) >> 4])
    e8m0 = np.asarray(qtriton._e8m0(codes))
    assert e8m0[0] == 0 and np.isnan(e8m0[255])
    np.testing.assert_array_equal(e8m0[1:255], np.exp2(np.arange(1, 255) - 127.0).astype(np.float32))


@pytest.mark.parametrize("implementation", ["reference", "pallas_interpret"])
def test_rows_compute_alike_wherever_they_sit(implementation, rng):
    """A row's result does not depend on its slot's index, its neighbours or the padding (bit for bit)."""
    sizes = np.array([5, 11, 16], np.int32)
    x, q = _case(rng, "fp8", jnp.bfloat16, sizes)
    got = _matmul(implementation, x, q, sizes, activation_scaling="dynamic")
    order = [2, 0, 1]  # the same experts in other slots, their rows elsewhere in the buffer
    moved_q = jax.tree.map(lambda leaf: leaf[np.asarray(order)], q)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    moved_x = np.concatenate([x[starts[s] : starts[s + 1]] for s in order] + [np.full((20, DEPTH), 1e4, np.float32)])
    moved = _matmul(implementation, moved_x.astype(x.dtype), moved_q, sizes[order], activation_scaling="dynamic")
    place = {s: np.concatenate([[0], np.cumsum(sizes[order])])[i] for i, s in enumerate(order)}
    for s in range(3):
        np.testing.assert_array_equal(
            moved[place[s] : place[s] + sizes[s]], got[starts[s] : starts[s + 1]], err_msg=f"slot {s}"
        )


def _mlp_case(rng, fmt, sizes, dim=64, hidden=32):
    e = len(sizes)
    w = [(rng.standard_normal(s) / np.sqrt(s[2])).astype(np.float32) for s in ((e, hidden, dim),) * 2]
    w.append((rng.standard_normal((e, dim, hidden)) / np.sqrt(hidden)).astype(np.float32))
    if fmt == "fp8_block":  # small tiles: quantize_mlp takes the default 128 x 128
        layer = [quant.quantize_experts(jnp.asarray(v), fmt, block_size=(16, 32)) for v in w]
    else:
        layer = quant.quantize_mlp(*map(jnp.asarray, w), fmt, input_scale=0.01, down_input_scale=0.004)
    x = rng.standard_normal((NUM_ROWS, dim)).astype(np.float32)
    return x, dict(zip(("gate", "up", "down"), layer))


def _mlp_oracle(x, experts, sizes, scaling):
    """``quant.expert_mlp_reference`` on each slot's rows (zero-padded per slot), put back in buffer order."""
    starts = np.concatenate([[0], np.cumsum(sizes)])
    per_slot = np.zeros((len(sizes), max(int(np.max(sizes)), 1), x.shape[1]), np.float32)
    for s in range(len(sizes)):
        per_slot[s, : sizes[s]] = x[starts[s] : starts[s + 1]]
    y = np.asarray(
        quant.expert_mlp_reference(
            jnp.asarray(per_slot), experts["gate"], experts["up"], experts["down"], activation_scaling=scaling
        )
    )
    out = np.zeros_like(x)
    for s in range(len(sizes)):
        out[starts[s] : starts[s + 1]] = y[s, : sizes[s]]
    return out


MLP_CASES = [
    pytest.param(f, i, marks=() if f in ("fp8", "mxfp4") else slow)
    for f in FORMATS
    for i in ("dense", "pallas_interpret")
] + [pytest.param(f, "auto", marks=gpu) for f in FORMATS]


@pytest.mark.parametrize("fmt,implementation", MLP_CASES)
def test_ragged_mlp_matches_quant_reference(fmt, implementation, rng):
    """``moe.expert_mlp`` on quantized experts (ragged) equals ``quant.expert_mlp_reference`` run per slot."""
    sizes = np.array([9, 0, 30], np.int32)
    x, experts = _mlp_case(rng, fmt, sizes)
    x[39:] = np.nan  # padding rows: nothing reaches the real rows or the dynamic scales
    for scaling in ("static", "dynamic") if fmt == "fp8" else ("dynamic",):
        for dtype, tol in ((jnp.float32, 1e-4), (jnp.bfloat16, 1e-2)):
            xd = jnp.asarray(x, dtype)
            got = expert_mlp(xd, experts, jnp.asarray(sizes), implementation=implementation, activation_scaling=scaling)
            assert got.dtype == dtype and got.shape == x.shape
            want = _mlp_oracle(np.asarray(xd.astype(jnp.float32)), experts, sizes, scaling)
            got = np.asarray(got.astype(jnp.float32))
            err = np.linalg.norm(got[:39] - want[:39]) / np.linalg.norm(want[:39])
            assert err < tol, (scaling, dtype, err)


def test_ragged_mlp_equals_dense_mlp_within_rounding(rng):
    """The ragged path and the dense ``quant.expert_mlp`` path (``quant_impl="dequant"``) agree for every format."""
    sizes = np.array([7, 25, 0, 10], np.int32)
    for fmt in FORMATS:
        x, experts = _mlp_case(rng, fmt, sizes)
        run = functools.partial(expert_mlp, jnp.asarray(x), experts, jnp.asarray(sizes))
        ragged = np.asarray(run())[:42]
        dense = np.asarray(run(quant_impl="dequant"))[:42]
        err = np.linalg.norm(ragged - dense) / np.linalg.norm(dense)
        assert err < 1e-4, (fmt, err)


def test_bad_inputs_raise_naming_the_argument():
    q = _quantize(np.ones((2, 32, 64), np.float32), "mxfp4")
    x, sizes = jnp.ones((8, 64), jnp.float32), jnp.array([4, 4], jnp.int32)
    cases = [
        (dict(x=jnp.ones((8, 32))), "differ in K"),
        (dict(x=jnp.ones((8, 64), jnp.int32)), "x must be a float"),
        (dict(q=jnp.ones((2, 32, 64))), "q must be a moe_eplb_jax.quant pytree"),
        (dict(group_sizes=jnp.array([8], jnp.int32)), "group_sizes must have shape"),
        (dict(group_sizes=jnp.array([4.0, 4.0])), "group_sizes must be integers"),
        (dict(implementation="fast"), "unknown implementation"),
        (dict(activation_scaling="max"), "activation_scaling"),
        (dict(compute_dtype=jnp.int8), "compute_dtype"),
    ]
    for change, match in cases:
        args = dict(x=x, q=q, group_sizes=sizes) | change
        with pytest.raises(ValueError, match=match):
            qmm.quantized_grouped_matmul(**args)
    with pytest.raises(ValueError, match="Config.block_k must be a power of two"):
        qmm.Config(block_k=48)
    with pytest.raises(ValueError, match="K=64 needs a power-of-two block >= 32"):
        qmm.quantized_grouped_matmul(x, q, sizes, implementation="pallas_interpret", config=qmm.Config(block_k=16))


@slow
def test_probe_agrees_in_the_interpreter():
    """The first-use probes (their shapes, tolerance and every format; fp8 with e4m3 rows too) pass where the
    kernel is right."""
    assert qmm._probe(interpret=True)
    assert qmm._probe(interpret=True, formats=("fp8",), e4m3_rows=True)


def _spec_experts(fmt, slots, width, depth):
    """A ``quant`` pytree of ``ShapeDtypeStruct`` leaves (lowering needs shapes only)."""
    spec = jax.ShapeDtypeStruct
    f8, u8, f32 = jnp.float8_e4m3fn, jnp.uint8, jnp.float32
    if fmt == "fp8":
        return quant.Fp8Experts(spec((slots, width, depth), f8), *(spec((slots,), f32),) * 3)
    if fmt == "fp8_block":
        return quant.Fp8BlockExperts(spec((slots, width, depth), f8), spec((slots, width // 128, depth // 128), f32))
    if fmt == "mxfp8":
        return quant.Mxfp8Experts(
            spec((slots, width, depth), f8), spec((slots, width, depth // 32), jnp.float8_e8m0fnu)
        )
    if fmt == "mxfp4":
        return quant.Mxfp4Experts(
            spec((slots, width, depth // 2), u8), spec((slots, width, depth // 32), jnp.float8_e8m0fnu)
        )
    return quant.Nvfp4Experts(
        spec((slots, width, depth // 2), u8), spec((slots, width, depth // 16), f8), spec((slots,), f32)
    )


def test_default_tiling_follows_the_rows_per_slot_and_the_format():
    """Decode (up to 16 rows a slot) takes 16-row tiles, prefill (4096 rows and more) 128-row tiles on 8 warps, 256
    columns wide for e2m1; in between fp8 and e2m1 take 128-column tiles (measured:
    ``moe._qgmm.config.default_config``)."""
    from moe_eplb_jax.moe._qgmm.config import default_config

    assert default_config(512, 32, "fp8") == default_config(512, 32, "mxfp4") == qmm.Config(block_rows=16)
    for fmt in FORMATS:
        wide = fmt in ("fp8", "mxfp4", "nvfp4")
        assert default_config(2048, 32, fmt) == (qmm.Config(block_cols=128) if wide else qmm.Config())
        columns = 256 if fmt in ("mxfp4", "nvfp4") else 128
        assert default_config(16384, 8, fmt) == qmm.Config(block_rows=128, block_cols=columns, num_warps=8)


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_lowers_to_triton_ir(fmt, h100_lowering):
    """The kernel lowers to (verified) Triton IR for an H100/H200 without a GPU, at DeepSeek-V3's expert shapes
    with the decode and prefill tilings, bfloat16 and float32 activations: catches a construct only the
    interpreter takes."""
    spec = jax.ShapeDtypeStruct
    for rows, dtype in ((512, jnp.bfloat16), (16384, jnp.bfloat16), (64, jnp.float32)):
        for width, depth in ((2048, 7168), (7168, 2048)):
            q = _spec_experts(fmt, 8, width, depth)
            fn = jax.jit(lambda x, q, s, f: qtriton.grouped_matmul(x, q, s, f))
            args = (spec((rows, depth), dtype), q, spec((8,), jnp.int32), spec((8,), jnp.float32))
            exported = jax.export.export(fn, platforms=["cuda"], disabled_checks=h100_lowering)(*args)
            assert exported.mlir_module().count("xla.gpu.triton") == 1, (rows, dtype, width)


MOSAIC_LOWERING = [jax.export.DisabledSafetyCheck.custom_call(n) for n in ("mosaic_gpu", "mosaic_gpu_v2")]


def test_fp8_mosaic_path_lowers_for_hopper_and_refuses_what_it_cannot_take():
    """No GPU needed: fp8's Mosaic path builds its module at a decode and a prefill shape (both tilings, rows off
    the tile), and refuses other formats and sides off its blocks by name before any work."""
    spec = jax.ShapeDtypeStruct
    for (rows, slots), out_dtype in itertools.product(((2048, 32), (16400, 8)), (jnp.float32, jnp.bfloat16)):
        q = _spec_experts("fp8", slots, 512, 1024)
        fn = jax.jit(
            lambda x, q, s: qmm.quantized_grouped_matmul(x, q, s, implementation="mosaic", out_dtype=out_dtype)
        )
        args = (spec((rows, 1024), jnp.bfloat16), q, spec((slots,), jnp.int32))
        module = jax.export.export(fn, platforms=["cuda"], disabled_checks=MOSAIC_LOWERING)(*args).mlir_module()
        assert "mosaic_gpu" in module and "xla.gpu.triton" not in module
    x, sizes = jnp.ones((8, 64), jnp.bfloat16), jnp.array([4, 4], jnp.int32)
    for q in (_quantize(np.ones((2, 32, 64), np.float32), "mxfp4"), _quantize(np.ones((2, 32, 64), np.float32), "fp8")):
        with pytest.raises(ValueError, match="implementation 'mosaic' multiplies fp8 experts"):
            qmm.quantized_grouped_matmul(x, q, sizes, implementation="mosaic")


def test_fp8_mosaic_tiling_follows_the_rows_per_slot():
    """Under 128 rows a slot (decode) 64-row tiles, else 128; e4m3's 128-byte contraction chunks either way."""
    from moe_eplb_jax.moe._qgmm.config import mosaic_config

    assert mosaic_config(2048, 32).block_m == 64 and mosaic_config(16384, 8).block_m == 128
    assert {mosaic_config(n, 8).block_k for n in (64, 1 << 16)} == {128}


@gpu
@pytest.mark.parametrize("rows_per_slot", [3, 64, 300], ids=["decode", "mid", "prefill"])
def test_fp8_mosaic_path_matches_float64_oracle(rows_per_slot, rng):
    """On a card: e4m3 rows times e4m3 weights on the Mosaic kernel against float64, static and dynamic scales,
    with an empty slot, slots straddling tiles and NaN padding rows that reach nothing."""
    sizes = np.array([rows_per_slot, 0, rows_per_slot + 5, 1, rows_per_slot], np.int32)
    live = int(sizes.sum())
    x = np.array(jnp.asarray(rng.standard_normal((live + 20, 1024)), jnp.bfloat16))
    x[live:] = np.nan
    w = rng.standard_normal((5, 512, 1024)) * np.exp2(rng.integers(-4, 4, (5, 512, 1)))
    q = _quantize(w.astype(np.float32), "fp8")
    for scaling in ("static", "dynamic"):
        got = np.asarray(
            qmm.quantized_grouped_matmul(
                jnp.asarray(x), q, jnp.asarray(sizes), implementation="mosaic", activation_scaling=scaling
            )
        )
        # fp8 wgmma's own accumulation inside each 128-element chunk: ~1e-4 of the exact product of the e4m3
        # values (whose own rounding, 2**-4 per element, is far larger).
        _assert_close(got, _oracle(x, q, sizes, activation_scaling=scaling), live, tol=qmm.MOSAIC_TOLERANCE)
        rounded = qmm.quantized_grouped_matmul(
            jnp.asarray(x), q, jnp.asarray(sizes), implementation="mosaic", activation_scaling=scaling,
            out_dtype=jnp.bfloat16,
        )  # fmt: skip
        np.testing.assert_array_equal(np.asarray(rounded), np.asarray(jnp.asarray(got, jnp.bfloat16)))
    assert qmm.mosaic_available()


@pytest.mark.parametrize("implementation", ["dense", pytest.param("pallas_interpret", marks=slow)])
def test_dynamic_scales_inside_shard_map_follow_the_rows_not_the_placement(implementation, rng):
    """Per rank inside ``shard_map``, with padding rows: the dynamic fp8 scales cover the EP group's real rows, so
    each row's output equals that of one rank holding every slot (and differs without the EP max)."""
    ranks, slots_per_rank, rows_per_rank = 4, 2, 16
    mesh = ep_mesh(ranks)
    sizes = rng.integers(0, 7, (ranks, slots_per_rank)).astype(np.int32)  # at most 12 real rows, then padding
    _, experts = _mlp_case(rng, "fp8", np.zeros(ranks * slots_per_rank, np.int32))
    x = rng.standard_normal((ranks * rows_per_rank, 64)) * np.repeat(np.exp2(np.arange(ranks)), rows_per_rank)[:, None]
    x = x.astype(np.float32)
    spec = PartitionSpec("ep")

    def run(axis):
        fn = jax.shard_map(
            lambda v, s, e: expert_mlp(
                v, e, s, implementation=implementation, activation_scaling="dynamic", axis_name=axis
            ),
            mesh=mesh,
            in_specs=spec,
            out_specs=spec,
            check_vma=False,
        )
        return np.asarray(jax.jit(fn)(jnp.asarray(x), jnp.asarray(sizes.reshape(-1)), experts))

    per_rank = run("ep")
    real = np.concatenate([np.arange(r * rows_per_rank, r * rows_per_rank + sizes[r].sum()) for r in range(ranks)])
    whole = np.asarray(
        expert_mlp(
            jnp.asarray(x[real]),
            experts,
            jnp.asarray(sizes.reshape(-1)),
            implementation=implementation,
            activation_scaling="dynamic",
        )
    )
    np.testing.assert_allclose(per_rank[real], whole, rtol=1e-6, atol=1e-6 * np.abs(whole).max())
    assert not np.allclose(run(None)[real], whole, rtol=1e-3)


def _run_ptx(text: str, registers: dict) -> dict:
    """A reference interpreter of the handful of PTX instructions the e2m1 decoder uses, on uint32 registers."""
    import ml_dtypes

    def bf16_pair(word):
        halves = np.array([word & 0xFFFF, word >> 16], np.uint16).view(ml_dtypes.bfloat16)
        return halves.astype(np.float32)

    value = lambda op: registers[op] if op in registers else int(op, 0)
    for statement in text.replace("\n", " ").strip("{} ").split(";"):
        if not statement.strip() or statement.strip().startswith(".reg"):
            continue
        opcode, operands = statement.split(None, 1)
        dest, *srcs = [o.strip() for o in operands.split(",")]
        args = [value(o) for o in srcs]
        if opcode == "mov.b32":
            out = args[0]
        elif opcode == "prmt.b32":
            pool = (args[0] | args[1] << 32).to_bytes(8, "little")
            out = int.from_bytes(bytes(pool[(args[2] >> (4 * i)) & 7] for i in range(4)), "little")
        elif opcode == "shl.b32":
            out = (args[0] << args[1]) & 0xFFFFFFFF
        elif opcode == "and.b32":
            out = args[0] & args[1]
        elif opcode == "or.b32":
            out = args[0] | args[1]
        elif opcode == "mul.rn.bf16x2":
            with np.errstate(over="ignore"):
                product = (bf16_pair(args[0]) * bf16_pair(args[1])).astype(ml_dtypes.bfloat16).view(np.uint16)
            out = int(product[0]) | int(product[1]) << 16
        else:
            raise AssertionError(f"unexpected PTX {opcode}")
        registers[dest] = out
    return registers


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_e2m1_ptx_decodes_every_byte_times_its_scale_exactly(fmt):
    """The inline PTX's decode, run by a reference interpreter on every byte and edge scales (MX codes 0, 1, 127,
    254, 255; NVFP4 subnormal, largest and NaN e4m3), equals the e2m1 table times the scale ``_scale_bfloat16``
    gives, which equals the float32 decode's scale; signed zeros and NaN kept."""
    import ml_dtypes

    codes = np.array([0, 1, 127, 130, 254, 255] if fmt == "mxfp4" else [0, 1, 0x38, 0x7E, 0xFE, 0x7F], np.uint8)
    scales = np.asarray(qtriton._scale_bfloat16(jnp.asarray(codes), fmt)).astype(np.float32)
    reference_scales = np.asarray(
        qtriton._e8m0(jnp.asarray(codes, jnp.int32)) if fmt == "mxfp4" else qtriton._e4m3(jnp.asarray(codes))
    )
    np.testing.assert_array_equal(scales.view(np.uint32), reference_scales.view(np.uint32))
    table = quant.E2M1_VALUES
    for nibble in ("low", "high"):
        text = qtriton._e2m1_to_bfloat16(nibble)
        for scale in scales:
            scale_bits = int(np.array([scale], ml_dtypes.bfloat16).view(np.uint16)[0])
            for first in range(0, 256, 4):
                word = int.from_bytes(bytes(range(first, first + 4)), "little")
                out = _run_ptx(text, {"$2": word, "$3": scale_bits * 0x10001, "$4": scale_bits * 0x10001})
                got = np.array([out["$0"], out["$1"]], np.uint32).view(np.uint16).view(ml_dtypes.bfloat16)
                got = got.astype(np.float32)
                element = np.arange(first, first + 4) & 15 if nibble == "low" else np.arange(first, first + 4) >> 4
                with np.errstate(over="ignore"):  # MX code 254 times 6 overflows to inf, in bfloat16 as in float32
                    want = (table[element].astype(np.float32) * scale).astype(ml_dtypes.bfloat16).astype(np.float32)
                np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
                ok = ~np.isnan(want)
                np.testing.assert_array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32))

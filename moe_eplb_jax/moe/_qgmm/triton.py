"""A grouped matmul in Pallas (Triton backend) that decodes quantized expert weights from their packed bytes.

``grouped_matmul(lhs [N, K], q [S, M, K], group_sizes [S], factor [S]) -> [N, M]`` (float32 or ``out_dtype``): rows
``[start_s, end_s)`` times slot ``s``'s weights, times ``factor[s]``. ``fp8`` with e4m3 rows (W8A8) multiplies
the weights' bytes as they are on the tensor cores (e4m3 x e4m3, float32 accumulation). Otherwise weight-only:
each program loads a ``[block_cols, block_k]`` tile of the packed weights (e4m3 bytes, or e2m1 pairs: even
element in the low nibble) and its scales, decodes them in registers (e4m3 by Triton's conversion, e2m1 through
it too, e8m0 as an exponent; in float32) to ``lhs.dtype`` and runs a 16-bit (or float32) MMA with float32
accumulation. On a GPU, e2m1 bytes with bfloat16 rows decode to bfloat16 in a few integer and packed-bfloat16
instructions of inline PTX per pair (``_e2m1_to_bfloat16``), where the float32 route costs several conversions
per element. The weights are read once per work item, in their packed size, never written back dequantized.

What a tile decodes to, exactly (``lhs`` bfloat16 or float32):

* ``fp8``: the e4m3 values; the slot's ``alpha`` multiplies the float32 result (``factor``).
* ``fp8_block``: the e4m3 values; the tile's float32 scale multiplies each step's partial product (the
  tiling is clipped so a step lies in one scale tile).
* ``mxfp8`` / ``mxfp4``: element times ``2**(code - 127)`` of its 32-element block (code 0 decodes to 0,
  255 to NaN), exact in bfloat16 but for float32-subnormal products.
* ``nvfp4``: e2m1 times the block's e4m3 scale (exact in bfloat16); the global scale is ``factor``.

Work items follow ``sum(group_sizes)`` as in ``moe._gmm.triton`` (``work_item``): a rank that received
few rows does little work, and each row runs the same instruction sequence wherever it sits. Rows outside
every group are never written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_eplb_jax import quant
from moe_eplb_jax.moe._gmm.triton import max_items, padded_sizes, work_item
from moe_eplb_jax.moe._qgmm.config import Config, default_config

__all__ = ["grouped_matmul", "operands"]

_SCALE_BLOCK = {"mxfp8": 32, "mxfp4": 32, "nvfp4": 16}


def _e4m3(code):
    """uint8 e4m3fn codes -> float32 (NaN for 0x7F / 0xFF): Triton's ``fp_to_fp``, the hardware conversion on
    Hopper (subnormals exact, no flush; every e4m3 value is exact in bfloat16 too)."""
    return jax.lax.bitcast_convert_type(code, jnp.float8_e4m3fn).astype(jnp.float32)


def _e2m1_pair(packed):
    """uint8 bytes of two e2m1 codes -> float32 ``(even, odd)`` elements (the even one in the low nibble).

    Each code's fields moved into an e4m3 byte (sign to bit 7, exponent and mantissa two bits up) make an
    e4m3 value of exactly ``e2m1 * 2**-6`` -- the subnormal codes too, as both formats' subnormals line up --
    so Triton's conversion does the decode and one exact multiply by 64 undoes the shift.
    """
    low = ((packed & 0x08) << 4) | ((packed & 0x07) << 2)
    high = (packed & 0x80) | ((packed & 0x70) >> 2)
    return _e4m3(low) * jnp.float32(64), _e4m3(high) * jnp.float32(64)


def _e8m0(code):
    """int32 e8m0 codes -> float32 ``2**(code - 127)``; code 0 gives 0 (float32 subnormal), 255 NaN."""
    value = jax.lax.bitcast_convert_type(code << 23, jnp.float32)
    return jnp.where(code == 255, jnp.float32(jnp.nan), value)


def _e2m1_to_bfloat16(nibble: str) -> str:
    """PTX decoding the ``nibble`` (``"low"``: even elements, ``"high"``: odd) of 4 packed bytes ($2) to bfloat16
    pairs ($0: bytes 0-1, $1: bytes 2-3) times their block scales ($3, $4, bfloat16 pairs alike).

    The magnitude bits land at the bottom of bfloat16's exponent -- the value e2m1 * 2**-126, the subnormal codes
    too -- and the sign at bit 15; then times 2**126 and times the scale, both exact in bfloat16.
    """
    magnitude, sign = (6, 12) if nibble == "low" else (2, 8)
    pair = """shl.b32 m, {0}, {2}; and.b32 m, m, 0x01C001C0; shl.b32 s, {0}, {3}; and.b32 s, s, 0x80008000;
or.b32 m, m, s; mul.rn.bf16x2 m, m, bias; mul.rn.bf16x2 {1}, m, {4};"""
    return "\n".join(
        [
            "{",
            ".reg .b32 lo, hi, m, s, bias, zero;",
            "mov.b32 bias, 0x7E807E80;",  # 2**126 in both halves
            "mov.b32 zero, 0;",
            "prmt.b32 lo, $2, zero, 0x4140;",  # bytes 0 and 1 to the low byte of each half
            "prmt.b32 hi, $2, zero, 0x4342;",  # bytes 2 and 3
            pair.format("lo", "$0", magnitude, sign, "$3"),
            pair.format("hi", "$1", magnitude, sign, "$4"),
            "}",
        ]
    )


def _e2m1_bfloat16(packed, scale):
    """``(even, odd)`` bfloat16 elements of ``packed`` bytes times ``scale`` (bfloat16, one per byte), by PTX."""
    like = [jax.ShapeDtypeStruct(packed.shape, jnp.bfloat16)]
    return tuple(
        plgpu.elementwise_inline_asm(
            _e2m1_to_bfloat16(nibble), args=[packed, scale], constraints="=r,=r,r,r,r", pack=4, result_shape_dtypes=like
        )[0]
        for nibble in ("low", "high")
    )


def _block_scale(codes, fmt: str):
    """Block scale codes -> float32: NVFP4's e4m3 values, MX's e8m0 powers of two."""
    return _e4m3(codes) if fmt == "nvfp4" else _e8m0(codes.astype(jnp.int32))


def _scale_bfloat16(codes, fmt: str):
    """Block scale codes -> bfloat16 (exact): NVFP4's e4m3 values, or MX's ``2**(code - 127)`` as its exponent bits
    (code 0 to 0 as ``_e8m0`` decodes it, 255 to NaN)."""
    if fmt == "nvfp4":
        return _block_scale(codes, fmt).astype(jnp.bfloat16)
    code = codes.astype(jnp.int32)
    bits = jnp.where(code == 255, 0x7FC0, code << 7).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


def _spread(scale, block: int):
    """``[C, nb]`` block scales -> ``[C, nb * block]``, each repeated over its block's elements."""
    cols, blocks = scale.shape
    return jnp.broadcast_to(scale[:, :, None], (cols, blocks, block)).reshape(cols, blocks * block)


def _decode_pairs(w_ref, s_ref, first, k, *, fmt, block_k, block_cols, ptx):
    """The e2m1 weight tile's ``(even, odd)`` elements, each ``[block_cols, block_k // 2]`` bfloat16 times its
    block scale: by inline PTX (``ptx``) or through float32."""
    block = _SCALE_BLOCK[fmt]
    packed = w_ref[pl.ds(first, block_cols), pl.ds(k * (block_k // 2), block_k // 2)]
    codes = s_ref[pl.ds(first, block_cols), pl.ds(k * (block_k // block), block_k // block)]
    if ptx:
        return _e2m1_bfloat16(packed, _spread(_scale_bfloat16(codes, fmt), block // 2))
    scale = _spread(_block_scale(codes, fmt), block // 2)
    return tuple((v * scale).astype(jnp.bfloat16) for v in _e2m1_pair(packed))


def _pairs_apart(lhs, block_k: int):
    """``lhs [N, K]`` with each ``block_k`` chunk's even columns first, then its odd ones: the order the kernel's
    two half-depth products take the decoded ``(even, odd)`` weights in (no interleave of registers)."""
    n, depth = lhs.shape
    return lhs.reshape(n, depth // block_k, block_k // 2, 2).swapaxes(2, 3).reshape(n, depth)


def _decode_tile(w_ref, s_ref, first, k, *, fmt, block_k, block_cols):
    """The weight tile ``[block_cols, block_k]`` (weight rows from ``first``, contraction step ``k``) as float32."""
    if fmt in ("mxfp4", "nvfp4"):
        packed = w_ref[pl.ds(first, block_cols), pl.ds(k * (block_k // 2), block_k // 2)]
        values = jax.lax.stack(_e2m1_pair(packed), axis=2).reshape(block_cols, block_k)
    else:
        values = _e4m3(w_ref[pl.ds(first, block_cols), pl.ds(k * block_k, block_k)])
    if fmt not in _SCALE_BLOCK:
        return values
    block = _SCALE_BLOCK[fmt]
    codes = s_ref[pl.ds(first, block_cols), pl.ds(k * (block_k // block), block_k // block)]
    return values * _spread(_block_scale(codes, fmt), block)


def _kernel(lhs_ref, w_ref, s_ref, factor_ref, sizes_ref, out_ref, **st):
    block_rows, block_k, block_cols = st["block_rows"], st["block_k"], st["block_cols"]
    fmt, width, depth = st["fmt"], st["width"], st["depth"]
    live, group, first_row, start, end = work_item(sizes_ref, pl.program_id(0), block_rows)
    col = pl.program_id(1)

    @pl.when(live)
    def _():
        rows = first_row + jnp.arange(block_rows, dtype=jnp.int32)
        mine = (rows >= start) & (rows < end)
        first = group * width + col * block_cols  # the tile's first weight row in w [S * M, ...]

        def rows_of(start, depth):
            return plgpu.load(
                lhs_ref.at[pl.ds(first_row, block_rows), pl.ds(start, depth)],
                mask=jnp.broadcast_to(mine[:, None], (block_rows, depth)),
                other=0,
            )

        def step(k, acc):
            if st["pairs_apart"]:  # bfloat16 rows, e2m1 weights: even and odd elements as two half-depth products
                half = block_k // 2
                even, odd = _decode_pairs(
                    w_ref, s_ref, first, k, fmt=fmt, block_k=block_k, block_cols=block_cols, ptx=st["ptx"]
                )
                acc = acc + jnp.dot(rows_of(k * block_k, half), even.T, preferred_element_type=jnp.float32)
                return acc + jnp.dot(rows_of(k * block_k + half, half), odd.T, preferred_element_type=jnp.float32)
            a = rows_of(k * block_k, block_k)
            if st["e4m3_rows"]:  # W8A8: e4m3 times e4m3 on the tensor cores, nothing decoded
                a = jax.lax.bitcast_convert_type(a, jnp.float8_e4m3fn)  # loaded as codes: a masked load fills 0
                codes = w_ref[pl.ds(first, block_cols), pl.ds(k * block_k, block_k)]
                b = jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)
            else:
                b = _decode_tile(w_ref, s_ref, first, k, fmt=fmt, block_k=block_k, block_cols=block_cols)
            part = jnp.dot(a, b.astype(a.dtype).T, preferred_element_type=jnp.float32, precision=st["precision"])
            if fmt == "fp8_block":  # one float32 scale per (tile row block, contraction block)
                bn, bk = st["tile"]
                part = part * s_ref[(group * width + col * block_cols) // bn, (k * block_k) // bk]
            return acc + part

        acc = jax.lax.fori_loop(0, depth // block_k, step, jnp.zeros((block_rows, block_cols), jnp.float32))
        plgpu.store(
            out_ref.at[pl.ds(first_row, block_rows), pl.ds(col * block_cols, block_cols)],
            (acc * factor_ref[group]).astype(out_ref.dtype),
            mask=jnp.broadcast_to(mine[:, None], (block_rows, block_cols)),
        )


def operands(q):
    """``(fmt, weight bytes [S * M, K or K // 2], scales [S * M', K'], fp8_block tile or None)`` of ``q``."""
    s, m, k = q.shape
    as_bytes = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint8)
    if isinstance(q, quant.Fp8Experts):
        return "fp8", as_bytes(q.weight).reshape(s * m, k), jnp.zeros((1, 1), jnp.uint8), None
    if isinstance(q, quant.Fp8BlockExperts):
        scales = q.weight_scale.reshape(-1, q.weight_scale.shape[2])
        return "fp8_block", as_bytes(q.weight).reshape(s * m, k), scales, q.block_size
    if isinstance(q, quant.Mxfp8Experts):
        return "mxfp8", as_bytes(q.elements).reshape(s * m, k), as_bytes(q.scales).reshape(s * m, -1), None
    if isinstance(q, quant.Mxfp4Experts):
        return "mxfp4", q.elements.reshape(s * m, k // 2), as_bytes(q.scales).reshape(s * m, -1), None
    if isinstance(q, quant.Nvfp4Experts):
        return "nvfp4", q.elements.reshape(s * m, k // 2), as_bytes(q.block_scales).reshape(s * m, -1), None
    raise ValueError(f"q must be a moe_eplb_jax.quant pytree, got {type(q).__name__}")


def _blocks(config: Config, fmt: str, width: int, depth: int, tile) -> tuple[int, int]:
    """``(block_k, block_cols)`` clipped to the matrix (and to one scale tile for fp8_block), checked."""
    block_k, block_cols = min(config.block_k, depth), min(config.block_cols, width)
    if tile is not None:
        block_k, block_cols = min(block_k, tile[1]), min(block_cols, tile[0])
    least_k = max(16, _SCALE_BLOCK.get(fmt, 16))
    for name, block, size, least in (("K", block_k, depth, least_k), ("M", block_cols, width, 16)):
        if block < least or block & (block - 1) or size % block:
            raise ValueError(
                f"quantized_grouped_matmul: {name}={size} needs a power-of-two block >= {least} dividing it "
                f"(got {block}; fmt {fmt!r})"
            )
    if tile is not None and (tile[0] % block_cols or tile[1] % block_k):
        raise ValueError(f"quantized_grouped_matmul: fp8_block tile {tile} is not a multiple of the blocks")
    return block_k, block_cols


@functools.partial(jax.jit, static_argnames=("config", "out_dtype", "interpret"))
def grouped_matmul(
    lhs, q, group_sizes, factor, *, config: Config | None = None, out_dtype=jnp.float32, interpret: bool = False
):
    """See the module docstring. ``lhs`` bfloat16 or float32 (float8_e4m3fn for ``fp8``: the e4m3 product on the
    tensor cores, half the activation bytes); ``K`` and ``M`` multiples of the clipped blocks; ``factor [S]``
    multiplies each slot's float32 result, rounded once to ``out_dtype`` as it is stored."""
    num_rows, depth = lhs.shape
    num_slots, width, _ = q.shape
    fmt, w, scales, tile = operands(q)
    if lhs.dtype == jnp.float8_e4m3fn and fmt != "fp8":
        raise ValueError(f"quantized_grouped_matmul: float8_e4m3fn rows multiply fp8 weights only, not {fmt!r}")
    e4m3_rows = lhs.dtype == jnp.float8_e4m3fn
    if e4m3_rows:
        lhs = jax.lax.bitcast_convert_type(lhs, jnp.uint8)
    config = config or default_config(num_rows, num_slots, fmt)
    block_k, block_cols = _blocks(config, fmt, width, depth, tile)
    pairs_apart = fmt in ("mxfp4", "nvfp4") and lhs.dtype == jnp.bfloat16
    if pairs_apart:
        lhs = _pairs_apart(lhs, block_k)
    kernel = functools.partial(
        _kernel,
        block_rows=config.block_rows,
        block_k=block_k,
        block_cols=block_cols,
        fmt=fmt,
        width=width,
        depth=depth,
        tile=tile,
        e4m3_rows=e4m3_rows,
        pairs_apart=pairs_apart,
        ptx=pairs_apart and not interpret,
        precision=jax.lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else None,
    )
    whole = pl.no_block_spec
    return pl.pallas_call(
        kernel,
        grid=(max_items(num_rows, num_slots, config.block_rows), width // block_cols),
        in_specs=[whole] * 5,
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((num_rows, width), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name=f"quantized_grouped_matmul_{fmt}",
    )(lhs, w, scales, factor.astype(jnp.float32), padded_sizes(group_sizes))

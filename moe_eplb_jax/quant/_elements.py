"""Exact element and scale encodings shared by the quantized formats.

Everything here works on float32 bit patterns with integer arithmetic where
exactness matters, so the results are the same on every backend whatever its
denormal handling: XLA:CPU and XLA:GPU flush float32 subnormals to zero in
arithmetic, which would otherwise change MX encodings of tiny blocks.

* ``ldexp_exact(x, k)`` -- ``x * 2**k`` on bit patterns (subnormal inputs and
  outputs included; bits shifted below the float32 subnormal range are dropped,
  which only happens for values far under any element format's resolution).
* ``mx_scale_exponent`` -- the OCP MX shared-scale rule
  ``clip(floor(log2(amax)) - emax_elem, -127, 127)`` read from exponent bits.
* ``encode_e4m3`` -- saturating round-to-nearest-even float32 -> e4m3 codes.
* ``encode_e2m1`` / ``E2M1_VALUES`` -- saturating round-to-nearest-even
  float32 -> 4-bit e2m1 codes (sign in bit 3) and the decode table.
* ``pack_fp4`` / ``unpack_fp4`` -- two codes per byte, even element in the low
  nibble (the layout ``bitcast_convert_type`` gives ``float4_e2m1fn`` pairs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "abs_bits",
    "abs_max",
    "canonical_nan",
    "decode_e2m1",
    "e8m0_to_float32",
    "encode_e2m1",
    "encode_e4m3",
    "ldexp_exact",
    "mx_scale_exponent",
    "pack_fp4",
    "unpack_fp4",
]

E4M3_MAX = 448.0
E2M1_MAX = 6.0
# Scales multiply by these float32 reciprocals (XLA rewrites division by a constant into this anyway,
# so stating it makes the rule the same on every backend and in numpy oracles).
INV_E4M3_MAX = np.float32(1.0 / 448.0)
INV_NVFP4_RANGE = np.float32(1.0 / (448.0 * 6.0))
E4M3_EMAX = 8  # largest unbiased exponent of a finite e4m3 value (448 = 1.75 * 2**8)
E2M1_EMAX = 2  # 6 = 1.5 * 2**2

_SIGN = np.uint32(0x80000000)
_ABS = np.uint32(0x7FFFFFFF)
_INF_BITS = 0x7F800000

# e2m1 magnitudes by code 0..7; codes 8..15 are their negatives (8 is -0).
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32
)


def _bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def abs_bits(x: jax.Array) -> jax.Array:
    """Bit pattern of ``|x|`` as int32. Integer order equals float order, NaN sorts above Inf."""
    return (_bits(x) & _ABS).astype(jnp.int32)


def abs_max(x: jax.Array, axis) -> jax.Array:
    """``max |x|`` over ``axis`` as float32, NaN if any element is NaN.

    Reduces the integer bit patterns: a float max reduction on XLA:CPU drops NaN
    in vectorised loops, which would make non-finite handling backend-dependent.
    """
    return jax.lax.bitcast_convert_type(jnp.max(abs_bits(x), axis=axis), jnp.float32)


def canonical_nan(x: jax.Array) -> jax.Array:
    """float32 ``x`` with every NaN replaced by the one pattern 0x7FC00000.

    Backends generate NaNs with different sign and payload bits (XLA:GPU
    0xFFFFFFFF, XLA:CPU 0xFFC00000), so scale leaves holding a NaN would
    otherwise differ byte for byte between a GPU and a CPU quantization.
    """
    nan = jax.lax.bitcast_convert_type(jnp.uint32(0x7FC00000), jnp.float32)
    return jnp.where(jnp.isnan(x), nan, x)


def ldexp_exact(x: jax.Array, k: jax.Array) -> jax.Array:
    """``x * 2**k`` for float32 ``x`` and int32 ``k`` (broadcast), exact for normal and subnormal results.

    NaN and Inf pass through unchanged; overflow gives a signed Inf; results under
    the float32 subnormal range are truncated toward zero (sign kept).
    """
    bits = _bits(x)
    sign = bits & _SIGN
    mag = (bits & _ABS).astype(jnp.int32)
    biased = mag >> 23
    frac = mag & 0x7FFFFF
    # A subnormal input is frac * 2**-149; converting frac to float32 (exact, frac < 2**23)
    # gives a normal number whose exponent field says where its leading bit is.
    frac_bits = jax.lax.bitcast_convert_type(frac.astype(jnp.float32), jnp.int32)
    exponent = jnp.where(biased > 0, biased, (frac_bits >> 23) - 149)
    significand = jnp.where(biased > 0, frac, frac_bits & 0x7FFFFF) | 0x800000
    new_exponent = exponent + k.astype(jnp.int32)
    normal = (jnp.clip(new_exponent, 1, 254) << 23) | (significand & 0x7FFFFF)
    shift = jnp.clip(1 - new_exponent, 0, 31)
    subnormal = jnp.where(1 - new_exponent > 24, 0, significand >> shift)
    out = jnp.where(new_exponent >= 1, normal, subnormal)
    out = jnp.where(new_exponent >= 255, _INF_BITS, out)
    out = jnp.where(mag == 0, 0, out)
    out = jnp.where(biased == 255, mag, out)
    return jax.lax.bitcast_convert_type(out.astype(jnp.uint32) | sign, jnp.float32)


def mx_scale_exponent(amax_bits: jax.Array, emax_elem: int) -> tuple[jax.Array, jax.Array]:
    """OCP MX shared scale of blocks whose ``|x|`` maximum has bit pattern ``amax_bits`` (int32).

    Returns ``(exponent, code)``: the int32 scale exponent
    ``clip(floor(log2(amax)) - emax_elem, -127, 127)`` (an all-zero or subnormal
    block gets -127, an Inf block 127) and its uint8 E8M0 code, 0xFF (NaN) for a
    block holding a NaN. The exponent is read from the bits, never rounded.
    """
    unbiased = (amax_bits >> 23) - 127  # -127 for zero/subnormal amax
    exponent = jnp.clip(unbiased - emax_elem, -127, 127)
    exponent = jnp.where(amax_bits == _INF_BITS, 127, exponent)
    code = jnp.where(amax_bits > _INF_BITS, 255, exponent + 127).astype(jnp.uint8)
    return exponent, code


def _with_sign_of(codes_u8: jax.Array, magnitude_mask: int, sign_bit: int, x: jax.Array) -> jax.Array:
    """Sets the sign of zero codes from ``x`` (a value that rounds to zero keeps its sign)."""
    negative = (_bits(x) & _SIGN) != 0
    zero = (codes_u8 & magnitude_mask) == 0
    return jnp.where(zero & negative, jnp.uint8(sign_bit), codes_u8)


def encode_e4m3(v: jax.Array) -> jax.Array:
    """Saturating round-to-nearest-even float32 -> ``float8_e4m3fn``; NaN becomes the code 0x7F.

    ``astype`` alone turns values past 464 into NaN, hence the clip first.
    """
    q = jnp.clip(v.astype(jnp.float32), -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    codes = jax.lax.bitcast_convert_type(q, jnp.uint8)
    codes = _with_sign_of(codes, 0x7F, 0x80, v)
    # One NaN code (0x7F) whatever the NaN's sign bit: backends differ in the sign of generated NaNs.
    codes = jnp.where(jnp.isnan(v), jnp.uint8(0x7F), codes)
    return jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)


def encode_e2m1(v: jax.Array) -> jax.Array:
    """Saturating round-to-nearest-even float32 -> e2m1 codes (uint8 in [0, 16), sign in bit 3).

    The magnitude code counts the rounding thresholds ``|v|`` passes; at a tie
    (0.25, 0.75, ..., 5) it goes to the even code. NaN encodes as 0 (e2m1 has no
    NaN; formats mark NaN through their scales).
    """
    a = jnp.abs(v.astype(jnp.float32))
    code = (
        (a > 0.25).astype(jnp.uint8)
        + (a >= 0.75).astype(jnp.uint8)
        + (a > 1.25).astype(jnp.uint8)
        + (a >= 1.75).astype(jnp.uint8)
        + (a > 2.5).astype(jnp.uint8)
        + (a >= 3.5).astype(jnp.uint8)
        + (a > 5.0).astype(jnp.uint8)
    )
    negative = (_bits(v) & _SIGN) != 0
    code = jnp.where(negative, code | jnp.uint8(8), code)
    return jnp.where(jnp.isnan(v), jnp.uint8(0), code)


def decode_e2m1(codes: jax.Array) -> jax.Array:
    """e2m1 codes (uint8 in [0, 16)) -> float32 values (``E2M1_VALUES[codes]``, elementwise arithmetic).

    Exponent field ``e = (c >> 1) & 3``, mantissa bit ``m = c & 1``: ``0.5 * m`` when
    ``e == 0``, else ``2**(e - 1) * (1 + 0.5 * m)``; bit 3 is the sign. Arithmetic
    rather than a table gather, so XLA fuses it into a consumer (a GEMM operand).
    """
    c = codes.astype(jnp.int32)
    e = (c >> 1) & 3
    half_m = (c & 1).astype(jnp.float32) * jnp.float32(0.5)
    power = jax.lax.bitcast_convert_type((e + 126) << 23, jnp.float32)  # 2**(e - 1), e >= 1
    magnitude = jnp.where(e == 0, half_m, power * (1 + half_m))
    return jnp.where((c & 8) != 0, -magnitude, magnitude)


def e8m0_to_float32(scales: jax.Array) -> jax.Array:
    """float8_e8m0fnu -> float32 ``2**(code - 127)`` by placing the code in the exponent field.

    Code 0 (2**-127, a float32 subnormal) becomes 0 and code 255 (NaN) becomes NaN;
    meant for compute paths, where the GPU flushes subnormals anyway.
    """
    code = jax.lax.bitcast_convert_type(scales, jnp.uint8).astype(jnp.uint32)
    value = jax.lax.bitcast_convert_type(code << 23, jnp.float32)
    return jnp.where(code == 255, jnp.float32(jnp.nan), value)


def pack_fp4(codes: jax.Array) -> jax.Array:
    """4-bit codes ``[..., K]`` (K even) -> bytes ``[..., K // 2]``, even element in the low nibble."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(packed: jax.Array) -> jax.Array:
    """Bytes ``[..., K // 2]`` -> 4-bit codes ``[..., K]`` (inverse of ``pack_fp4``)."""
    pairs = jnp.stack([packed & jnp.uint8(0xF), packed >> 4], axis=-1)
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)

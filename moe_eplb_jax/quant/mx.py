"""OCP Microscaling experts: ``mxfp8`` (e4m3 elements) and ``mxfp4`` (e2m1 elements).

Blocks of 32 consecutive elements along the contraction axis K share one E8M0
scale ``2**s`` with the OCP MX v1.0 rule ``s = floor(log2(amax)) - emax_elem``
(emax_elem = 8 for e4m3, 2 for e2m1), clipped to [-127, 127] and read from the
float32 exponent bits (``astype(float8_e8m0fnu)`` would round to nearest).
Elements are ``x / 2**s`` converted with round-to-nearest-even and saturation
(+-448, +-6), computed exactly on bit patterns. Encodings equal Graphcore's
``gfloat.encode_block`` with ``compute_scale_amax``.

Layout: ``elements`` ``[E, N, K]`` float8_e4m3fn (mxfp8) or ``[E, N, K // 2]``
uint8 with two e2m1 codes per byte, even element in the low nibble (mxfp4);
``scales`` ``[E, N, K // 32]`` float8_e8m0fnu.

Special blocks, as gfloat and the OCP spec define them: an all-zero (or
all-subnormal-tiny) block gets scale code 0 (2**-127); a block with a NaN gets
the NaN scale code 0xFF and decodes to NaN (its mxfp8 elements are 0xFF, its
mxfp4 elements 0); a block with an Inf gets scale 2**127, its Infs saturate to
the largest element (decoding back to Inf in float32) and its finite values
flush toward zero.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from moe_eplb_jax.quant._elements import (
    E2M1_EMAX,
    E4M3_EMAX,
    abs_bits,
    decode_e2m1,
    encode_e2m1,
    encode_e4m3,
    ldexp_exact,
    mx_scale_exponent,
    pack_fp4,
    unpack_fp4,
)

__all__ = ["MX_BLOCK", "Mxfp4Experts", "Mxfp8Experts", "quantize_mxfp4", "quantize_mxfp8"]

MX_BLOCK = 32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mxfp8Experts:
    """MXFP8 experts: ``elements`` float8_e4m3fn ``[E, N, K]``, ``scales`` float8_e8m0fnu ``[E, N, K // 32]``."""

    elements: jax.Array
    scales: jax.Array
    fmt: ClassVar[str] = "mxfp8"

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, k = self.elements.shape
        return e, n, k

    def dequantize(self) -> jax.Array:
        return _dequantize_mx(self.elements.astype(jnp.float32), self.scales)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mxfp4Experts:
    """MXFP4 experts: ``elements`` uint8 ``[E, N, K // 2]`` (two e2m1 codes per byte, even
    element low), ``scales`` float8_e8m0fnu ``[E, N, K // 32]``."""

    elements: jax.Array
    scales: jax.Array
    fmt: ClassVar[str] = "mxfp4"

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, half = self.elements.shape
        return e, n, 2 * half

    def dequantize(self) -> jax.Array:
        return _dequantize_mx(decode_e2m1(unpack_fp4(self.elements)), self.scales)


def _scale_blocks(w: jax.Array, emax_elem: int):
    """Blocks ``[E, N, K // 32, 32]`` scaled by their shared scale, plus the E8M0 codes and NaN mask."""
    e, n, k = w.shape
    blocks = w.astype(jnp.float32).reshape(e, n, k // MX_BLOCK, MX_BLOCK)
    exponent, code = mx_scale_exponent(jnp.max(abs_bits(blocks), axis=-1), emax_elem)
    scaled = ldexp_exact(blocks, -exponent[..., None])
    scales = jax.lax.bitcast_convert_type(code, jnp.float8_e8m0fnu)
    return scaled, scales, (code == 255)[..., None]


@jax.jit
def quantize_mxfp8(w: jax.Array) -> Mxfp8Experts:
    """Core of ``quantize_experts(w, "mxfp8")``; shapes already validated."""
    scaled, scales, nan_block = _scale_blocks(w, E4M3_EMAX)
    codes = jax.lax.bitcast_convert_type(encode_e4m3(scaled), jnp.uint8)
    codes = jnp.where(nan_block, jnp.uint8(0xFF), codes).reshape(w.shape)
    return Mxfp8Experts(jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn), scales)


@jax.jit
def quantize_mxfp4(w: jax.Array) -> Mxfp4Experts:
    """Core of ``quantize_experts(w, "mxfp4")``; shapes already validated."""
    scaled, scales, nan_block = _scale_blocks(w, E2M1_EMAX)
    codes = jnp.where(nan_block, jnp.uint8(0), encode_e2m1(scaled)).reshape(w.shape)
    return Mxfp4Experts(pack_fp4(codes), scales)


@jax.jit
def _dequantize_mx(values: jax.Array, scales: jax.Array) -> jax.Array:
    e, n, k = values.shape
    codes = jax.lax.bitcast_convert_type(scales, jnp.uint8)
    blocks = values.reshape(e, n, k // MX_BLOCK, MX_BLOCK)
    out = ldexp_exact(blocks, (codes.astype(jnp.int32) - 127)[..., None])
    out = jnp.where((codes == 255)[..., None], jnp.float32(jnp.nan), out)
    return out.reshape(e, n, k)

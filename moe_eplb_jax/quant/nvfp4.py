"""NVFP4 experts: e2m1 elements in blocks of 16, e4m3 block scales, a float32 global scale.

Two-level scaling (NVIDIA's NVFP4): per expert ``global_scale = amax * fl32(1 / (448 * 6))``
(1 for an all-zero expert), so the block scales use the whole e4m3 range; per
16-element block along K, ``block_scale = e4m3(block_amax / (6 * global_scale))``
(round to nearest even, at most 448); elements are
``e2m1(x / (block_scale * global_scale))`` with round-to-nearest-even and
saturation at +-6 (0 where the block scale underflows to 0). Decoding is
``e2m1 * block_scale * global_scale``.

Layout: ``elements`` uint8 ``[E, N, K // 2]`` (two e2m1 codes per byte, even
element in the low nibble), ``block_scales`` float8_e4m3fn ``[E, N, K // 16]``,
``global_scale`` float32 ``[E]``.

Non-finite weights (``nonfinite="propagate"`` or under tracing): a NaN or Inf
makes its expert's global scale non-finite and the whole expert decodes to NaN.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from moe_eplb_jax.quant._elements import (
    E2M1_MAX,
    INV_NVFP4_RANGE,
    abs_max,
    canonical_nan,
    decode_e2m1,
    encode_e2m1,
    encode_e4m3,
    pack_fp4,
    unpack_fp4,
)

__all__ = ["NVFP4_BLOCK", "Nvfp4Experts", "quantize_nvfp4"]

NVFP4_BLOCK = 16


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Nvfp4Experts:
    """NVFP4 experts: ``elements`` uint8 ``[E, N, K // 2]``, ``block_scales`` float8_e4m3fn
    ``[E, N, K // 16]``, ``global_scale`` float32 ``[E]``."""

    elements: jax.Array
    block_scales: jax.Array
    global_scale: jax.Array
    fmt: ClassVar[str] = "nvfp4"

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, half = self.elements.shape
        return e, n, 2 * half

    def dequantize(self) -> jax.Array:
        return _dequantize_nvfp4(self.elements, self.block_scales, self.global_scale)


@jax.jit
def quantize_nvfp4(w: jax.Array) -> Nvfp4Experts:
    """Core of ``quantize_experts(w, "nvfp4")``; shapes already validated."""
    e, n, k = w.shape
    x = w.astype(jnp.float32)
    amax = abs_max(x, axis=(1, 2))
    # amax == 0 (not <= 0) so a NaN/Inf amax stays non-finite and poisons the expert.
    global_scale = canonical_nan(jnp.where(amax == 0, jnp.float32(1.0), amax * INV_NVFP4_RANGE))
    blocks = x.reshape(e, n, k // NVFP4_BLOCK, NVFP4_BLOCK)
    block_amax = abs_max(blocks, axis=-1)
    block_scales = encode_e4m3(block_amax / (global_scale[:, None, None] * jnp.float32(E2M1_MAX)))
    denominator = (block_scales.astype(jnp.float32) * global_scale[:, None, None])[..., None]
    safe = jnp.where(denominator > 0, denominator, jnp.float32(1.0))
    scaled = jnp.where(denominator > 0, blocks / safe, jnp.float32(0.0))
    codes = encode_e2m1(scaled).reshape(e, n, k)
    return Nvfp4Experts(pack_fp4(codes), block_scales, global_scale)


@jax.jit
def _dequantize_nvfp4(elements, block_scales, global_scale):
    values = decode_e2m1(unpack_fp4(elements))
    e, n, k = values.shape
    blocks = values.reshape(e, n, k // NVFP4_BLOCK, NVFP4_BLOCK)
    scale = block_scales.astype(jnp.float32) * global_scale[:, None, None]
    return (blocks * scale[..., None]).reshape(e, n, k)

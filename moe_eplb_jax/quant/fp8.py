"""FP8 expert weights: per-expert scaling (``fp8``) and 128x128 block scaling (``fp8_block``).

``fp8`` (the common serving layout): e4m3 weights ``[E, N, K]``, one float32
weight scale per expert, ``weight_scale = amax * fl32(1/448)`` over that expert's whole
matrix (1 for an all-zero expert), and the layer's activation (input) scale
stored once per expert together with the derived dequant factor
``alpha = weight_scale * input_scale``. A token ``x`` is quantized as
``e4m3(clip(x / input_scale))`` and ``y = (x_q @ w_q^T) * alpha``. The gate and up
projections of a SiLU-gated MLP should share one weight scale per expert:
``quant.quantize_mlp`` does it, or pass ``weight_scale=`` explicitly.

``fp8_block`` (DeepSeek-V3 style): e4m3 weights ``[E, N, K]`` and one float32
scale per 128x128 tile, ``[E, N // 128, K // 128]``, ``scale = amax * fl32(1/448)`` of
the tile (1 for an all-zero tile).

Element conversion saturates at +-448 and rounds to nearest even. Non-finite
weights (when ``nonfinite="propagate"`` or under tracing): a NaN or Inf makes the
scale of its expert (``fp8``) or tile (``fp8_block``) non-finite, and that whole
expert or tile dequantizes to NaN. NaN is written as one pattern on every
backend: e4m3 code 0x7F, float32 0x7FC00000.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from moe_eplb_jax.quant._elements import INV_E4M3_MAX, abs_max, canonical_nan, encode_e4m3

__all__ = ["Fp8BlockExperts", "Fp8Experts", "quantize_fp8", "quantize_fp8_block", "expert_amax"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Experts:
    """Per-expert-scaled FP8 experts; every leaf has the leading expert (slot) axis.

    Fields: ``weight`` float8_e4m3fn ``[E, N, K]``; ``weight_scale`` float32 ``[E]``;
    ``input_scale`` float32 ``[E]`` (the layer's activation scale, identical across
    experts); ``alpha`` float32 ``[E]`` = ``weight_scale * input_scale``.
    """

    weight: jax.Array
    weight_scale: jax.Array
    input_scale: jax.Array
    alpha: jax.Array
    fmt: ClassVar[str] = "fp8"

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, k = self.weight.shape
        return e, n, k

    def dequantize(self) -> jax.Array:
        """Float32 ``[E, N, K]`` weights ``weight * weight_scale``."""
        return _dequantize_fp8(self.weight, self.weight_scale)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8BlockExperts:
    """Tile-scaled FP8 experts: ``weight`` float8_e4m3fn ``[E, N, K]``, ``weight_scale``
    float32 ``[E, N // bn, K // bk]`` (``bn x bk`` tiles, 128x128 by default)."""

    weight: jax.Array
    weight_scale: jax.Array
    fmt: ClassVar[str] = "fp8_block"

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, k = self.weight.shape
        return e, n, k

    @property
    def block_size(self) -> tuple[int, int]:
        e, n, k = self.weight.shape
        return n // self.weight_scale.shape[1], k // self.weight_scale.shape[2]

    def dequantize(self) -> jax.Array:
        """Float32 ``[E, N, K]`` weights, each tile times its scale."""
        return _dequantize_fp8_block(self.weight, self.weight_scale)


def _scale_from_amax(amax: jax.Array) -> jax.Array:
    # An all-zero expert/tile gets scale 1 so decoding never divides by zero; a NaN/Inf
    # amax keeps a non-finite scale so the bad expert/tile decodes to NaN, not to garbage.
    return canonical_nan(jnp.where(amax == 0, jnp.float32(1.0), amax * INV_E4M3_MAX))


@jax.jit
def expert_amax(w: jax.Array) -> jax.Array:
    """``max |w|`` per expert of ``w [E, N, K]`` as float32 ``[E]`` (NaN propagates)."""
    return abs_max(w, axis=(1, 2))


@jax.jit
def _quantize_fp8(w, weight_scale, input_scale):
    x = w.astype(jnp.float32)
    if weight_scale is None:
        weight_scale = _scale_from_amax(abs_max(x, axis=(1, 2)))
    weight = encode_e4m3(x / weight_scale[:, None, None])
    input_scale = jnp.broadcast_to(input_scale, weight_scale.shape)
    return Fp8Experts(weight, weight_scale, input_scale, canonical_nan(weight_scale * input_scale))


def quantize_fp8(w: jax.Array, weight_scale: ArrayLike | None, input_scale: ArrayLike) -> Fp8Experts:
    """Core of ``quantize_experts(w, "fp8")``; inputs already validated (float32 ``[E]`` scales).

    ``weight_scale=None`` derives ``amax * fl32(1/448)`` per expert (one jitted pass).
    """
    return _quantize_fp8(w, weight_scale, input_scale)


@jax.jit
def _dequantize_fp8(weight, weight_scale):
    return weight.astype(jnp.float32) * weight_scale[:, None, None]


@functools.partial(jax.jit, static_argnames=("block_size",))
def quantize_fp8_block(w: jax.Array, block_size: tuple[int, int] = (128, 128)) -> Fp8BlockExperts:
    """Core of ``quantize_experts(w, "fp8_block")``; shapes already validated."""
    e, n, k = w.shape
    bn, bk = block_size
    tiles = w.astype(jnp.float32).reshape(e, n // bn, bn, k // bk, bk)
    scale = _scale_from_amax(abs_max(tiles, axis=(2, 4)))
    weight = encode_e4m3(tiles / scale[:, :, None, :, None]).reshape(e, n, k)
    return Fp8BlockExperts(weight, scale)


@jax.jit
def _dequantize_fp8_block(weight, weight_scale):
    e, n, k = weight.shape
    nb, kb = weight_scale.shape[1:]
    tiles = weight.astype(jnp.float32).reshape(e, nb, n // nb, kb, k // kb)
    return (tiles * weight_scale[:, :, None, :, None]).reshape(e, n, k)

"""EP-consistent activation scales.

An activation scale folded into a dequant factor (``alpha = weight_scale *
input_scale``) must be the same on every EP rank: after a rearrangement an
expert computes on another rank, and a rank-local scale would change what its
tokens quantize to. ``ep_amax`` max-reduces the statistic over the EP mesh axis
in float32; every calibration or dynamic scale goes through it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_eplb_jax._checks import is_concrete
from moe_eplb_jax.quant._elements import INV_E4M3_MAX, abs_max, encode_e4m3
from moe_eplb_jax.quant.fp8 import Fp8Experts

__all__ = ["activation_scale", "ep_amax", "quantize_activation_fp8", "with_input_scale"]


def ep_amax(amax: jax.Array, axis_name: str | tuple[str, ...] | None) -> jax.Array:
    """Max of ``amax`` (any shape, float) over the EP mesh axis ``axis_name``, as float32.

    Call inside ``jax.shard_map`` (or any context binding ``axis_name``). With
    ``axis_name=None`` it only casts (single-rank use).
    """
    amax = jnp.asarray(amax)
    if not jnp.issubdtype(amax.dtype, jnp.floating):
        raise ValueError(f"ep_amax: amax must be a float array, got dtype {amax.dtype}")
    amax = amax.astype(jnp.float32)
    if axis_name is None:
        return amax
    return jax.lax.pmax(amax, axis_name)


def activation_scale(x: jax.Array, axis_name: str | tuple[str, ...] | None = None) -> jax.Array:
    """Per-tensor e4m3 activation scale ``ep_amax(max|x|) * fl32(1/448)`` (float32 scalar; 1 for all-zero ``x``).

    ``x`` is any float array of the rank's activations (padding rows should be
    zero). Inside ``shard_map`` pass the EP ``axis_name`` so all ranks agree.
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"activation_scale: x must be a float array, got dtype {x.dtype}")
    amax = ep_amax(abs_max(x, axis=None), axis_name)
    return jnp.where(amax == 0, jnp.float32(1.0), amax * INV_E4M3_MAX)


def with_input_scale(q: Fp8Experts, input_scale) -> Fp8Experts:
    """``q`` with a new layer activation scale (float scalar, positive) and the matching ``alpha``.

    The scale is stored once per expert (identical), so it moves with the experts.
    """
    if not isinstance(q, Fp8Experts):
        raise ValueError(f"with_input_scale: expects Fp8Experts, got {type(q).__name__}")
    scale = jnp.asarray(input_scale)
    if scale.ndim != 0 or not jnp.issubdtype(scale.dtype, jnp.floating):
        raise ValueError(
            f"with_input_scale: input_scale must be a float scalar, got shape {scale.shape} dtype {scale.dtype}"
        )
    if is_concrete(scale) and not (0.0 < float(scale) < float("inf")):
        raise ValueError(f"with_input_scale: input_scale must be positive and finite, got {float(scale)}")
    per_expert = jnp.broadcast_to(scale.astype(jnp.float32), q.weight_scale.shape)
    return dataclasses.replace(q, input_scale=per_expert, alpha=q.weight_scale * per_expert)


def quantize_activation_fp8(x: jax.Array, input_scale: jax.Array) -> jax.Array:
    """``x [E, T, K]`` -> float8_e4m3fn ``e4m3(clip(x / input_scale[e]))`` with ``input_scale [E]``."""
    return encode_e4m3(x.astype(jnp.float32) / input_scale.astype(jnp.float32)[:, None, None])

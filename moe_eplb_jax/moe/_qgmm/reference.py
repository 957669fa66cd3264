"""The jnp quantized grouped matmul: the S slots' weights dequantized once, then the float ``dense`` grouped matmul.

The oracle of the Triton kernel and the CPU path: exact float32 weights, a
float32 product (each row rounded alike wherever it sits, see
``moe._gmm.reference.dense``), the per-slot factor on the float32 result.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_eplb_jax import quant
from moe_eplb_jax.moe._gmm.reference import dense, slot_of_row

__all__ = ["grouped_matmul", "unit_weights"]


def unit_weights(q) -> jax.Array:
    """Float32 ``[S, M, K]`` weights of ``q`` without its per-slot factor (fp8: the e4m3 values; NVFP4: without the
    global scale), exactly as the kernel decodes them; the factor multiplies the product instead."""
    if isinstance(q, quant.Fp8Experts):
        return q.weight.astype(jnp.float32)
    if isinstance(q, quant.Nvfp4Experts):
        return dataclasses.replace(q, global_scale=jnp.ones_like(q.global_scale)).dequantize()
    return q.dequantize()


def grouped_matmul(lhs, q, group_sizes, factor) -> jax.Array:
    """Rows ``[start_s, end_s)`` of ``lhs [N, K]`` times slot ``s``'s weights of ``q [S, M, K]``, times ``factor[s]``.

    Args:
      lhs: ``[N, K]`` prepared activations (any float dtype; computed in float32).
      q: a quantized pytree of ``moe_eplb_jax.quant`` with the slot axis first.
      group_sizes: ``[S]`` int rows per slot.
      factor: ``[S]`` float32 per-slot factor (fp8 ``alpha``, NVFP4 global scale, else ones).

    Returns:
      ``[N, M]`` float32; rows past ``sum(group_sizes)`` are zero.
    """
    w = jnp.swapaxes(unit_weights(q), 1, 2)
    with jax.default_matmul_precision("float32"):  # full float32 on a GPU too (not TF32)
        y = dense(lhs.astype(jnp.float32), w, group_sizes)
    slot = jnp.minimum(slot_of_row(group_sizes, lhs.shape[0]), group_sizes.shape[0] - 1)
    return y * factor.astype(jnp.float32)[slot][:, None]

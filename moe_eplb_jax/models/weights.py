"""Linear weights of the dense parts: a float ``[in, out]`` array, or DeepSeek's block-FP8 layout as read.

DeepSeek-V3's FP8 checkpoints store each linear weight as e4m3 ``[out, in]``
(PyTorch's layout) with a float32 ``weight_scale_inv`` per ``128 x 128``
block, ``[ceil(out / 128), ceil(in / 128)]`` (the last block of an axis may
be partial: ``kv_a_proj_with_mqa`` has 576 rows). ``Fp8BlockWeight`` keeps
those bytes as they are, so export writes them back bit for bit; a matmul
dequantizes it to the activation dtype first (weight-only, as Hopper has no
block-scaled FP8 instructions).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["FP8_BLOCK", "Fp8BlockWeight", "QuantizedWeight", "dense_weight", "linear"]

FP8_BLOCK = 128


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8BlockWeight:
    """``weight`` float8_e4m3fn ``[out, in]``; ``scale_inv`` float32 ``[ceil(out/128), ceil(in/128)]``.

    Block ``(i, j)`` decodes as ``weight[128 i : 128 (i+1), 128 j : 128 (j+1)] * scale_inv[i, j]``.
    """

    weight: jax.Array
    scale_inv: jax.Array

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The ``[out, in]`` weights in ``dtype`` (decoded in float32, then rounded once)."""
        out, inp = self.weight.shape
        scale = jnp.repeat(jnp.repeat(self.scale_inv, FP8_BLOCK, axis=0), FP8_BLOCK, axis=1)[:out, :inp]
        return (self.weight.astype(jnp.float32) * scale).astype(dtype)


class QuantizedWeight(nnx.Variable):
    """A dense-part weight held as ``Fp8BlockWeight`` (read from an FP8 checkpoint). Frozen: not a ``Param``."""


def dense_weight(value, dtype) -> jax.Array:
    """A weight as a float ``[in, out]`` array in ``dtype``: as stored, or an ``Fp8BlockWeight`` decoded."""
    if isinstance(value, Fp8BlockWeight):
        return value.dequantize(dtype).T
    return value.astype(dtype)


def linear(x, value, bias=None):
    """``x @ w (+ bias)`` for ``w`` a float ``[in, out]`` array or an ``Fp8BlockWeight``, in ``x.dtype``."""
    y = jnp.dot(x, dense_weight(value, x.dtype))
    if bias is not None:
        y = y + bias.astype(y.dtype).reshape((1,) * (y.ndim - 1) + bias.shape)
    return y

"""The dense parts of the decoder around attention: RMSNorm, the causal mask, the SwiGLU MLP.

Weights are stored ``[in, out]`` (``x @ w``), replicated on the mesh, or as
``Fp8BlockWeight`` after an FP8 checkpoint; activations are sharded by the
caller (batch over the EP axis). Attention is in ``attention``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moe_eplb_jax.models.weights import dense_weight
from moe_eplb_jax.transport.mesh import put_host

__all__ = ["DenseMLP", "RMSNorm", "attention_mask", "dot_f32", "embed", "replicated_param"]


def replicated_param(rngs: nnx.Rngs, shape, *, fan_in: int, dtype, mesh) -> nnx.Param:
    """A parameter drawn from ``N(0, 1/fan_in)``, replicated on ``mesh`` (same on every process).

    Drawn on the host from a seed taken from ``rngs``: no device program per
    weight shape to compile.
    """
    seed = np.asarray(jax.random.key_data(rngs.params())).ravel()
    value = np.random.default_rng(seed).standard_normal(shape, np.float32) * np.float32(fan_in**-0.5)
    return nnx.Param(put_host(value.astype(dtype), mesh))


class RMSNorm(nnx.Module):
    """``x / rms(x) * weight`` over the last axis, computed in float32 (``weight [N]``, Hugging Face's name)."""

    def __init__(self, size: int, *, eps: float, dtype, mesh):
        self.eps = eps
        self.weight = nnx.Param(put_host(np.ones(size, dtype), mesh))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + jnp.float32(self.eps))
        weight = self.weight.get_value().astype(jnp.float32)
        return (y * weight.reshape((1,) * (x.ndim - 1) + weight.shape)).astype(x.dtype)


def attention_mask(key_valid, query_offset, num_queries: int):
    """``[B, T, S]`` bool: query ``i`` (at position ``query_offset + i``) sees key ``j`` iff valid and ``j <= i``.

    ``key_valid [B, S]`` marks the keys that hold real tokens (padding and
    unwritten cache positions are ``False``).
    """
    keys = jnp.arange(key_valid.shape[1])[None, None, :]
    queries = query_offset + jnp.arange(num_queries)[None, :, None]
    return key_valid[:, None, :] & (keys <= queries)


def dot_f32(x, w):
    """``x [..., K] @ w [K, N]`` accumulated and returned in float32, differentiated in the inputs' dtype.

    Autodiff would multiply the float32 cotangent by the 16-bit operands promoted to float32 (TF32 GEMMs at a
    fraction of the bf16 rate); here the cotangent is rounded to the inputs' dtype first, the mixed-precision rule
    every 16-bit trainer follows, and both gradient products accumulate in float32. Float32 inputs take autodiff.
    """
    if x.dtype == jnp.float32 and w.dtype == jnp.float32:
        return jnp.dot(x, w, preferred_element_type=jnp.float32)
    return _dot_f32(x, w)


@jax.custom_vjp
def _dot_f32(x, w):
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


def _dot_f32_fwd(x, w):
    return _dot_f32(x, w), (x, w)


def _dot_f32_bwd(residuals, grad):
    x, w = residuals
    dx = jnp.dot(grad.astype(x.dtype), w.T.astype(x.dtype), preferred_element_type=jnp.float32)
    dw = jnp.einsum("...k,...n->kn", x, grad.astype(x.dtype), preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_dot_f32.defvjp(_dot_f32_fwd, _dot_f32_bwd)


def embed(table, tokens):
    """``table[tokens]`` (``table [vocab, D]``), its gradient added up in float32.

    Autodiff's gradient of a 16-bit gather is a 16-bit scatter-add: on a GPU a compare-and-swap loop per element
    (no native bfloat16 atomic add), and repeated tokens summed in 16 bits. Float32 tables take autodiff.
    """
    if table.dtype == jnp.float32:
        return jnp.take(table, tokens, axis=0)
    return _embed(table, tokens)


@jax.custom_vjp
def _embed(table, tokens):
    return jnp.take(table, tokens, axis=0)


def _embed_fwd(table, tokens):
    return _embed(table, tokens), (table, tokens)


def _embed_bwd(residuals, grad):
    table, tokens = residuals
    rows = grad.reshape(-1, table.shape[-1]).astype(jnp.float32)
    summed = jnp.zeros(table.shape, jnp.float32).at[tokens.reshape(-1)].add(rows, mode="drop")
    return summed.astype(table.dtype), None


_embed.defvjp(_embed_fwd, _embed_bwd)


class DenseMLP(nnx.Module):
    """SwiGLU MLP ``down(silu(x @ gate) * (x @ up))``: ``gate_proj``/``up_proj [D, F]``, ``down_proj [F, D]``."""

    def __init__(self, dim: int, hidden: int, *, dtype, mesh, rngs: nnx.Rngs):
        self.gate_proj = replicated_param(rngs, (dim, hidden), fan_in=dim, dtype=dtype, mesh=mesh)
        self.up_proj = replicated_param(rngs, (dim, hidden), fan_in=dim, dtype=dtype, mesh=mesh)
        self.down_proj = replicated_param(rngs, (hidden, dim), fan_in=hidden, dtype=dtype, mesh=mesh)

    def __call__(self, x, *, valid=None, record=True):
        """``valid`` / ``record`` are accepted so every block calls its MLP alike; a dense MLP counts nothing."""
        del valid, record
        gate = dot_f32(x, dense_weight(self.gate_proj.get_value(), x.dtype))
        up = dot_f32(x, dense_weight(self.up_proj.get_value(), x.dtype))
        act = (jax.nn.silu(gate) * up).astype(x.dtype)
        return dot_f32(act, dense_weight(self.down_proj.get_value(), x.dtype)).astype(x.dtype)

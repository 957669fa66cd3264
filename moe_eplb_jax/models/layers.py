"""The dense parts of the decoder: RMSNorm, RoPE, grouped-query attention, the SwiGLU MLP.

Shapes: ``B`` sequences of ``T`` new tokens, ``D`` model width, ``H`` query
heads and ``K`` key/value heads of width ``Dh``, ``S`` positions of the KV
cache. Weights are stored ``[in, out]`` (``x @ w``), replicated on the mesh;
activations are sharded by the caller (batch over the EP axis). Attention
reads and writes one layer's slice of a preallocated cache, so decoding a
token costs one position, not the whole sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moe_eplb_jax.transport.mesh import put_host

__all__ = ["Attention", "DenseMLP", "RMSNorm", "apply_rope", "attend", "attention_mask", "replicated_param"]


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


def apply_rope(x, positions, *, theta: float):
    """Rotary position embedding of ``x [B, T, heads, Dh]`` at ``positions [B, T]``.

    The rotate-half layout of Llama / Qwen / DeepSeek checkpoints: dimension
    ``i`` pairs with ``i + Dh/2`` at frequency ``theta ** (-2i / Dh)``.
    """
    half = x.shape[-1] // 2
    inv_freq = jnp.asarray(theta ** (-np.arange(half, dtype=np.float64) * 2.0 / x.shape[-1]), jnp.float32)
    angle = positions.astype(jnp.float32)[:, :, None, None] * inv_freq[None, None, None, :]  # [B, T, 1, half]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attention_mask(key_valid, query_offset, num_queries: int):
    """``[B, T, S]`` bool: query ``i`` (at position ``query_offset + i``) sees key ``j`` iff valid and ``j <= i``.

    ``key_valid [B, S]`` marks the keys that hold real tokens (padding and
    unwritten cache positions are ``False``).
    """
    keys = jnp.arange(key_valid.shape[1])[None, None, :]
    queries = query_offset + jnp.arange(num_queries)[None, :, None]
    return key_valid[:, None, :] & (keys <= queries)


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE (and Qwen3's per-head q/k RMSNorm when ``qk_norm``).

    Weights ``q_proj [D, H*Dh]``, ``k_proj``/``v_proj [D, K*Dh]``,
    ``o_proj [H*Dh, D]``; ``q_norm``/``k_norm`` over ``Dh``.
    """

    def __init__(self, config, *, mesh, rngs: nnx.Rngs):
        d, h, k, dh = config.dim, config.num_heads, config.num_kv_heads, config.head_dim
        dtype = config.jnp_dtype
        self.num_heads, self.num_kv_heads, self.head_dim, self.rope_theta = h, k, dh, config.rope_theta
        self.q_proj = replicated_param(rngs, (d, h * dh), fan_in=d, dtype=dtype, mesh=mesh)
        self.k_proj = replicated_param(rngs, (d, k * dh), fan_in=d, dtype=dtype, mesh=mesh)
        self.v_proj = replicated_param(rngs, (d, k * dh), fan_in=d, dtype=dtype, mesh=mesh)
        self.o_proj = replicated_param(rngs, (h * dh, d), fan_in=h * dh, dtype=dtype, mesh=mesh)
        if config.qk_norm:
            self.q_norm = RMSNorm(dh, eps=config.rms_eps, dtype=dtype, mesh=mesh)
            self.k_norm = RMSNorm(dh, eps=config.rms_eps, dtype=dtype, mesh=mesh)
        else:
            self.q_norm = self.k_norm = None

    def __call__(self, x, positions, mask, cache=None, cache_index: jax.Array | int = 0):
        """``x [B, T, D]`` at ``positions [B, T]`` -> ``(out [B, T, D], keys, values)``.

        Without a cache the keys are this call's tokens (returned as
        ``[B, T, K, Dh]``) and ``mask`` is ``[B, T, T]`` (``None``: causal, no padding). With ``cache = (k, v)``
        (each ``[B, S, K, Dh]``) the new keys and values are written at
        ``cache_index``, the queries attend to all ``S`` positions through
        ``mask [B, T, S]``, and the updated cache arrays are returned.
        """
        b, t, _ = x.shape
        q = jnp.dot(x, self.q_proj.get_value()).reshape(b, t, self.num_heads, self.head_dim)
        k = jnp.dot(x, self.k_proj.get_value()).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = jnp.dot(x, self.v_proj.get_value()).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, positions, theta=self.rope_theta)
        k = apply_rope(k, positions, theta=self.rope_theta)
        if cache is not None:
            start = (0, cache_index, 0, 0)
            k = jax.lax.dynamic_update_slice(cache[0], k.astype(cache[0].dtype), start)
            v = jax.lax.dynamic_update_slice(cache[1], v.astype(cache[1].dtype), start)
        out = attend(q, k, v, mask)
        return jnp.dot(out.reshape(b, t, -1), self.o_proj.get_value()), k, v


def attend(q, k, v, mask, *, implementation: str | None = None):
    """Softmax attention of ``q [B, T, H, Dh]`` over ``k``/``v [B, S, K, Dh]`` (``H/K`` queries per key head).

    ``mask [B, T, S]`` bool, or ``None``: causal over ``S = T`` keys, no padding.
    ``implementation``: ``"xla"`` (the reference; every backend), ``"cudnn"``
    (cuDNN's fused flash attention through ``jax.nn.dot_product_attention``:
    16-bit floats on a GPU) or ``None``: cuDNN where it applies, else XLA.
    """
    if implementation is None:
        fused = jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16) and q.shape[1] > 1
        implementation = "cudnn" if fused and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256 else "xla"
    if implementation == "cudnn":
        return _attend_cudnn(q, k, v, mask)
    if implementation != "xla":
        raise ValueError(f"implementation must be 'xla', 'cudnn' or None, got {implementation!r}")
    if mask is None:
        mask = jnp.broadcast_to(
            jnp.tril(jnp.ones((q.shape[1], k.shape[1]), jnp.bool_)), (q.shape[0], q.shape[1], k.shape[1])
        )
    return _attend_xla(q, k, v, mask)


def _attend_cudnn(q, k, v, mask):
    if mask is None:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    # A query that sees no key (padding) sees key 0 instead: it averages one finite row rather than giving a NaN
    # that a zero probability could carry into real rows. Real queries are unchanged.
    blind = ~jnp.any(mask, axis=-1, keepdims=True)
    mask = mask | (blind & (jnp.arange(mask.shape[-1]) == 0)[None, None, :])
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation="cudnn")


def _attend_xla(q, k, v, mask):
    b, t, h, dh = q.shape
    groups = h // k.shape[2]
    q = q.reshape(b, t, k.shape[2], groups, dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * jnp.float32(dh**-0.5)
    # A finite floor, not -inf: a padding query that sees no key gets a harmless uniform average, not NaN.
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, dh).astype(q.dtype)


class DenseMLP(nnx.Module):
    """SwiGLU MLP ``down(silu(x @ gate) * (x @ up))``: ``gate_proj``/``up_proj [D, F]``, ``down_proj [F, D]``."""

    def __init__(self, dim: int, hidden: int, *, dtype, mesh, rngs: nnx.Rngs):
        self.gate_proj = replicated_param(rngs, (dim, hidden), fan_in=dim, dtype=dtype, mesh=mesh)
        self.up_proj = replicated_param(rngs, (dim, hidden), fan_in=dim, dtype=dtype, mesh=mesh)
        self.down_proj = replicated_param(rngs, (hidden, dim), fan_in=hidden, dtype=dtype, mesh=mesh)

    def __call__(self, x, *, valid=None, record=True):
        """``valid`` / ``record`` are accepted so every block calls its MLP alike; a dense MLP counts nothing."""
        del valid, record
        gate = jnp.dot(x, self.gate_proj.get_value(), preferred_element_type=jnp.float32)
        up = jnp.dot(x, self.up_proj.get_value(), preferred_element_type=jnp.float32)
        act = (jax.nn.silu(gate) * up).astype(x.dtype)
        return jnp.dot(act, self.down_proj.get_value(), preferred_element_type=jnp.float32).astype(x.dtype)

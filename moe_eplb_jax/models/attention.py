"""Self-attention of the decoder: grouped-query attention and DeepSeek's multi-head latent attention (MLA).

Shapes: ``B`` sequences of ``T`` new tokens, ``D`` model width, ``H`` query
heads, ``S`` positions of the KV cache. Weights are stored ``[in, out]``
(``x @ w``), replicated on the mesh, or as ``Fp8BlockWeight`` after an FP8
checkpoint (see ``weights``). Each module reads and writes its slice of a
preallocated cache (a tuple of arrays, batch first), so decoding a token
costs one position, not the whole sequence. Every variant ends in
``attend(q, k, v, mask, scale=)``, the one softmax-attention core.

Cache bytes per token and layer (``b`` bytes per element):

* GQA: ``2 * K * Dh * b`` (keys and values of the ``K`` key/value heads).
* MLA: ``(kv_lora_rank + qk_rope_head_dim) * b``: the normalized latent
  ``c_kv`` and the rotated key shared by all heads; keys and values of every
  head are recomputed from it (DeepSeek-V2, Sec. 2.1). DeepSeek-V3:
  ``(512 + 64) * 2 = 1152`` bytes in bf16, where its 128 full heads would
  take ``2 * 128 * 128 * 2 = 65536`` (57x).

MLA decodes with the up-projection absorbed: ``q_nope`` is mapped into the
latent space by ``W_uk`` and the attention output back out by ``W_uv``, so a
step reads the cached latent as one shared key/value head (multi-query
attention over ``kv_lora_rank + qk_rope_head_dim`` dimensions) instead of
expanding every cached position to ``H`` heads. The same scores, summed in
another order.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moe_eplb_jax._kernels import pallas_default
from moe_eplb_jax.models.layers import RMSNorm, replicated_param
from moe_eplb_jax.models.rope import apply_rope, rope_frequencies, rotation, softmax_mscale
from moe_eplb_jax.models.weights import Fp8BlockWeight, dense_weight, linear
from moe_eplb_jax.transport.mesh import put_host

__all__ = ["Attention", "CausalPrefix", "MLA_NORM_EPS", "MultiLatentAttention", "attend", "attention_module"]

MLA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: DeepSeek's code builds them with the default epsilon


class CausalPrefix(NamedTuple):
    """The mask of a prefill into an empty cache, right-padded: query ``i`` sees key ``j`` iff ``j <= i`` and
    ``j < max(lengths, 1)``, so a padding query (or a row of length 0) averages finite keys rather than none.

    Held as the lengths, not as a ``[B, T, S]`` array: cuDNN's fused kernel then skips the blocks the mask hides.
    """

    lengths: jax.Array  # [B] int32: each row's real tokens, at its first positions

    def dense(self, num_queries: int, num_keys: int):
        """The same mask as a ``[B, T, S]`` bool array."""
        keys = jnp.arange(num_keys)[None, None, :]
        seen = jnp.maximum(self.lengths, 1)[:, None, None]
        return (keys <= jnp.arange(num_queries)[None, :, None]) & (keys < seen)


def attend(q, k, v, mask, *, scale: float, implementation: str | None = None):
    """Softmax attention: ``q [B, T, H, Dk]`` over ``k [B, S, K, Dk]`` / ``v [B, S, K, Dv]`` -> ``[B, T, H, Dv]``.

    ``H / K`` query heads share each key/value head; ``mask [B, T, S]`` bool
    marks the keys each query sees (``None``: causal over ``S = T`` keys, no
    padding; a ``CausalPrefix``: causal over each row's first keys).
    ``implementation``: ``"xla"`` (the reference, every backend; scores and softmax in float32), ``"cudnn"`` (cuDNN's fused flash attention
    through ``jax.nn.dot_product_attention``: 16-bit floats on a GPU) or ``None``: cuDNN where it applies (a GPU, 16-bit, more than one query, head
    widths up to 256), else XLA.
    """
    if implementation is None:
        fused = jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16) and q.shape[1] > 1
        widths = max(q.shape[-1], v.shape[-1])
        implementation = "cudnn" if fused and q.shape[-1] % 8 == 0 and v.shape[-1] % 8 == 0 and widths <= 256 else "xla"
    if implementation == "cudnn":
        return _attend_cudnn(q, k, v, mask, scale)
    if implementation != "xla":
        raise ValueError(f"implementation must be 'xla', 'cudnn' or None, got {implementation!r}")
    if mask is None:
        causal = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), jnp.bool_))
        mask = jnp.broadcast_to(causal, (q.shape[0], q.shape[1], k.shape[1]))
    elif isinstance(mask, CausalPrefix):
        mask = mask.dense(q.shape[1], k.shape[1])
    return _attend_xla(q, k, v, mask, scale)


def _attend_cudnn(q, k, v, mask, scale):
    width = v.shape[-1]
    if width != k.shape[-1]:  # the fused kernel takes one head width: zero columns give zero outputs
        v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, k.shape[-1] - width))) if width < k.shape[-1] else v
        if width > k.shape[-1]:
            pad = ((0, 0), (0, 0), (0, 0), (0, width - k.shape[-1]))
            q, k = jnp.pad(q, pad), jnp.pad(k, pad)
    if mask is None:
        out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation="cudnn")
    elif isinstance(mask, CausalPrefix):
        seen = jnp.maximum(mask.lengths, 1).astype(jnp.int32)
        out = jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=True, key_value_seq_lengths=seen, implementation="cudnn"
        )
    else:
        # A query that sees no key (padding) sees key 0 instead: it averages one finite row rather than giving a
        # NaN that a zero probability could carry into real rows. Real queries are unchanged.
        blind = ~jnp.any(mask, axis=-1, keepdims=True)
        mask = mask | (blind & (jnp.arange(mask.shape[-1]) == 0)[None, None, :])
        out = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale, implementation="cudnn")
    return out[..., :width]


def _attend_xla(q, k, v, mask, scale):
    b, t, h, dk = q.shape
    dtype, groups = q.dtype, h // k.shape[2]
    if jax.default_backend() == "cpu":
        # XLA's CPU runtime fails on some 16-bit products with a float32 result ("Unsupported element type for
        # DotThunk"); the values are the same in float32 (a product of two 16-bit floats is exact in it).
        q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
    q = q.reshape(b, t, k.shape[2], groups, dk)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * jnp.float32(scale)
    # A finite floor, not -inf: a padding query that sees no key gets a harmless uniform average, not NaN.
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, v.shape[-1]).astype(dtype)


def _bias(size: int, enabled: bool, *, dtype, mesh):
    return nnx.Param(put_host(jnp.zeros(size, dtype), mesh)) if enabled else None


def _value(var):
    return None if var is None else var.get_value()


def _linears(x, weights, biases, *, joined: bool):
    """``linear(x, w, bias)`` for each weight; ``joined``: one product of the weights side by side, split after --
    a decode step's small projections are each a launch longer than its read, and XLA hoists the join of weights
    the decode loop does not change out of the loop. Block-FP8 weights, or biases on some products only, stay
    apart."""
    present = [bias is not None for bias in biases]
    if not joined or any(isinstance(w, Fp8BlockWeight) for w in weights) or any(present) != all(present):
        return tuple(linear(x, w, bias) for w, bias in zip(weights, biases, strict=True))
    bias = jnp.concatenate([b for b in biases if b is not None]) if all(present) else None
    out = linear(x, jnp.concatenate(weights, axis=1), bias)
    ends = list(itertools.accumulate(w.shape[1] for w in weights))
    return tuple(out[..., end - w.shape[1] : end] for w, end in zip(weights, ends, strict=True))


def _write(cache, new, index, *, axis: int = 1):
    """``new`` written into ``cache`` at position ``index`` of the positions ``axis`` (their other sides equal)."""
    start = tuple(index if a == axis else 0 for a in range(cache.ndim))
    return jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype), start)


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE (Qwen3-MoE, GLM-4-MoE).

    Weights ``q_proj [D, H*Dh]``, ``k_proj``/``v_proj [D, K*Dh]``,
    ``o_proj [H*Dh, D]``; ``q_bias``/``k_bias``/``v_bias`` (``qkv_bias``) and
    ``o_bias`` (``o_bias``); ``q_norm``/``k_norm`` over ``Dh`` (``qk_norm``,
    before RoPE). RoPE rotates the first ``config.rotary_dim`` dimensions of
    each head. Cache: ``(keys, values)``, each ``[B, K, S, Dh]``: head-major, the layout the decode step's
    product over (batch, head) reads in place; position-major, XLA would copy the whole cache into it in every
    layer of every step.
    """

    def __init__(self, config, *, mesh, rngs: nnx.Rngs):
        d, h, k, dh = config.dim, config.num_heads, config.num_kv_heads, config.head_dim
        dtype = config.jnp_dtype
        self.num_heads, self.num_kv_heads, self.head_dim = h, k, dh
        # The fused decode kernel runs unpartitioned: on a one-device mesh only (a sharded batch keeps XLA's).
        self.one_device = mesh.size == 1
        self.rope = (config.rotary_dim, config.rope_theta, config.rope_scaling, config.rope_interleave)
        self.q_proj = replicated_param(rngs, (d, h * dh), fan_in=d, dtype=dtype, mesh=mesh)
        self.k_proj = replicated_param(rngs, (d, k * dh), fan_in=d, dtype=dtype, mesh=mesh)
        self.v_proj = replicated_param(rngs, (d, k * dh), fan_in=d, dtype=dtype, mesh=mesh)
        self.o_proj = replicated_param(rngs, (h * dh, d), fan_in=h * dh, dtype=dtype, mesh=mesh)
        self.q_bias = _bias(h * dh, config.qkv_bias, dtype=dtype, mesh=mesh)
        self.k_bias = _bias(k * dh, config.qkv_bias, dtype=dtype, mesh=mesh)
        self.v_bias = _bias(k * dh, config.qkv_bias, dtype=dtype, mesh=mesh)
        self.o_bias = _bias(d, config.o_bias, dtype=dtype, mesh=mesh)
        if config.qk_norm:
            self.q_norm = RMSNorm(dh, eps=config.rms_eps, dtype=dtype, mesh=mesh)
            self.k_norm = RMSNorm(dh, eps=config.rms_eps, dtype=dtype, mesh=mesh)
        else:
            self.q_norm = self.k_norm = None

    def cache_shapes(self, batch: int, max_len: int) -> tuple[tuple[int, ...], ...]:
        """Shapes of this layer's cache arrays."""
        shape = (batch, self.num_kv_heads, max_len, self.head_dim)
        return shape, shape

    def __call__(self, x, positions, mask, cache=None, cache_index: jax.Array | int = 0):
        """``x [B, T, D]`` at ``positions [B, T]`` -> ``(out [B, T, D], cache)``.

        Without a cache the returned cache is this call's keys and values
        (``[B, K, T, Dh]``) and ``mask`` is ``[B, T, T]``. With ``cache`` the new
        keys and values are written at ``cache_index``, the queries attend to all
        ``S`` positions through ``mask [B, T, S]``, and the updated arrays are
        returned; with a ``CausalPrefix`` (a prefill: the cache was empty) they
        attend to the new keys only.
        """
        b, t, _ = x.shape
        q, k, v = self._project(x, joined=cache is not None and t == 1)
        q = q.reshape(b, t, self.num_heads, self.head_dim)
        k, v = (a.reshape(b, t, self.num_kv_heads, self.head_dim) for a in (k, v))
        rotary_dim, theta, scaling, interleaved = self.rope
        inv_freq, factor = rope_frequencies(rotary_dim, theta, scaling)
        if cache is not None and t == 1 and not isinstance(mask, CausalPrefix) and self._fused_decode(q, cache[0]):
            out, keys, values = self._decode(q, k, v, positions, inv_freq, factor, cache, cache_index, mask)
            return linear(out.reshape(b, t, -1), self.o_proj.get_value(), _value(self.o_bias)), (keys, values)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, positions, inv_freq, attention_factor=factor, interleaved=interleaved)
        k = apply_rope(k, positions, inv_freq, attention_factor=factor, interleaved=interleaved)
        keys, values = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
        if cache is not None:
            keys, values = _write(cache[0], keys, cache_index, axis=2), _write(cache[1], values, cache_index, axis=2)
            if not isinstance(mask, CausalPrefix):
                k, v = jnp.swapaxes(keys, 1, 2), jnp.swapaxes(values, 1, 2)  # a view: XLA reads the stored layout
        out = attend(q, k, v, mask, scale=self.head_dim**-0.5)
        return linear(out.reshape(b, t, -1), self.o_proj.get_value(), _value(self.o_bias)), (keys, values)

    def _project(self, x, *, joined: bool):
        """``(q, k, v)`` of ``x``; ``joined``: one product (``_linears``)."""
        weights = [p.get_value() for p in (self.q_proj, self.k_proj, self.v_proj)]
        return _linears(x, weights, [_value(b) for b in (self.q_bias, self.k_bias, self.v_bias)], joined=joined)

    def _decode(self, q, k, v, positions, inv_freq, factor, cache, cache_index, mask):
        """One decode step in one kernel (``_decode_attention``): the norms and a whole-head rotate-half RoPE inside
        it, any other RoPE applied here first. ``q``, ``k``, ``v`` as projected, ``[B, 1, heads, D]``."""
        from moe_eplb_jax.models._decode_attention import triton as decode

        rotary_dim, _, _, interleaved = self.rope
        whole_rope = rotary_dim == self.head_dim and not interleaved
        norms, q_norm, k_norm = {}, self.q_norm, self.k_norm
        if q_norm is not None and k_norm is not None:
            if whole_rope and q_norm.eps == k_norm.eps:  # one epsilon in the kernel, before its RoPE
                norms = dict(q_norm=q_norm.weight.get_value(), k_norm=k_norm.weight.get_value(), eps=q_norm.eps)
            else:
                q, k = q_norm(q), k_norm(k)
        rope = None
        if whole_rope:
            rope = jnp.stack(rotation(positions[:, 0], inv_freq, factor), axis=1)
        else:
            q = apply_rope(q, positions, inv_freq, attention_factor=factor, interleaved=interleaved)
            k = apply_rope(k, positions, inv_freq, attention_factor=factor, interleaved=interleaved)
        return decode.decode_attention(
            q[:, 0], k[:, 0], v[:, 0], cache[0], cache[1], cache_index, mask[:, 0], scale=self.head_dim**-0.5,
            rope=rope, **norms,
        )  # fmt: skip

    def _fused_decode(self, q, keys) -> bool:
        """Whether a decode step's attention and cache write run as one kernel (``_decode_attention``): on a GPU
        where its probe passed, a one-device mesh, a cache it takes (short: ``MAX_KEYS`` positions)."""
        from moe_eplb_jax.models._decode_attention import triton as decode

        shapes = decode.applies((q.shape[0], q.shape[2], q.shape[3]), keys.shape, keys.dtype) and q.dtype == keys.dtype
        return self.one_device and shapes and pallas_default("decode_attention", decode.probe)


class MultiLatentAttention(nnx.Module):
    """DeepSeek-V2/V3 multi-head latent attention (MLA), named as their checkpoints name it.

    Query: ``q_proj [D, H*(dn+dr)]``, or low-rank ``q_a_proj [D, Rq]`` ->
    ``q_a_layernorm`` -> ``q_b_proj [Rq, H*(dn+dr)]``. Key/value:
    ``kv_a_proj_with_mqa [D, Rkv+dr]`` gives the latent (normalized by
    ``kv_a_layernorm``) and one rotated key ``k_rope`` shared by every head;
    ``kv_b_proj [Rkv, H*(dn+dv)]`` expands the latent to each head's ``k_nope``
    and value; ``o_proj [H*dv, D]``. Biases ``q_a_bias``/``kv_a_bias``
    (``qkv_bias``) and ``o_bias``. Softmax scale ``(dn+dr)**-0.5`` times YaRN's
    ``softmax_mscale``. Cache: ``(latent,)`` with ``latent [B, S, Rkv+dr]``,
    ``c_kv`` then ``k_rope``.
    """

    def __init__(self, config, *, mesh, rngs: nnx.Rngs):
        d, h = config.dim, config.num_heads
        dn, dr, dv, r = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim, config.kv_lora_rank
        dtype = config.jnp_dtype
        self.num_heads, self.nope_dim, self.rope_dim, self.v_dim, self.kv_rank = h, dn, dr, dv, r
        self.rope = (dr, config.rope_theta, config.rope_scaling, config.rope_interleave)
        self.scale = (dn + dr) ** -0.5 * softmax_mscale(config.rope_scaling)
        rq = config.q_lora_rank
        if rq is None:
            self.q_proj = replicated_param(rngs, (d, h * (dn + dr)), fan_in=d, dtype=dtype, mesh=mesh)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = self.q_a_bias = None
        else:
            self.q_proj = None
            self.q_a_proj = replicated_param(rngs, (d, rq), fan_in=d, dtype=dtype, mesh=mesh)
            self.q_a_bias = _bias(rq, config.qkv_bias, dtype=dtype, mesh=mesh)
            self.q_a_layernorm = RMSNorm(rq, eps=MLA_NORM_EPS, dtype=dtype, mesh=mesh)
            self.q_b_proj = replicated_param(rngs, (rq, h * (dn + dr)), fan_in=rq, dtype=dtype, mesh=mesh)
        self.kv_a_proj_with_mqa = replicated_param(rngs, (d, r + dr), fan_in=d, dtype=dtype, mesh=mesh)
        self.kv_a_bias = _bias(r + dr, config.qkv_bias, dtype=dtype, mesh=mesh)
        self.kv_a_layernorm = RMSNorm(r, eps=MLA_NORM_EPS, dtype=dtype, mesh=mesh)
        self.kv_b_proj = replicated_param(rngs, (r, h * (dn + dv)), fan_in=r, dtype=dtype, mesh=mesh)
        self.o_proj = replicated_param(rngs, (h * dv, d), fan_in=h * dv, dtype=dtype, mesh=mesh)
        self.o_bias = _bias(d, config.o_bias, dtype=dtype, mesh=mesh)

    def cache_shapes(self, batch: int, max_len: int) -> tuple[tuple[int, ...], ...]:
        """Shapes of this layer's cache arrays: the latent and the rotated key, side by side."""
        return ((batch, max_len, self.kv_rank + self.rope_dim),)

    def __call__(self, x, positions, mask, cache=None, cache_index: jax.Array | int = 0, *, absorb=None):
        """``x [B, T, D]`` at ``positions [B, T]`` -> ``(out [B, T, D], (latent,))``; see ``Attention``.

        ``absorb``: attend in the latent space (``None``: when decoding, i.e.
        with a cache and one new token per row); else every position's keys
        and values are expanded to all heads first.
        """
        b, t, _ = x.shape
        h, dn, r = self.num_heads, self.nope_dim, self.kv_rank
        q, kv = self._project(x, joined=cache is not None and t == 1)  # kv: [B, T, r + dr]
        if self.q_proj is None:
            assert self.q_a_layernorm is not None and self.q_b_proj is not None
            q = linear(self.q_a_layernorm(q), self.q_b_proj.get_value())
        q = q.reshape(b, t, h, dn + self.rope_dim)
        rotary_dim, theta, scaling, interleaved = self.rope
        inv_freq, factor = rope_frequencies(rotary_dim, theta, scaling)
        q_rope = apply_rope(q[..., dn:], positions, inv_freq, attention_factor=factor, interleaved=interleaved)
        k_rope = apply_rope(kv[:, :, None, r:], positions, inv_freq, attention_factor=factor, interleaved=interleaved)
        latent = jnp.concatenate([self.kv_a_layernorm(kv[..., :r]), k_rope[:, :, 0]], axis=-1)
        seen = latent
        if cache is not None:
            latent = _write(cache[0], latent, cache_index)
            seen = seen if isinstance(mask, CausalPrefix) else latent
        if absorb is None:
            absorb = cache is not None and t == 1
        attended = self._absorbed if absorb else self._expanded
        out = attended(q[..., :dn], q_rope, seen.astype(x.dtype), mask)
        return linear(out.reshape(b, t, -1), self.o_proj.get_value(), _value(self.o_bias)), (latent,)

    def _project(self, x, *, joined: bool):
        """``(query or its low-rank projection, the latent and rotated key)`` of ``x``; ``joined``: one product
        (``_linears``)."""
        query = self.q_proj if self.q_proj is not None else self.q_a_proj
        assert query is not None
        weights = [query.get_value(), self.kv_a_proj_with_mqa.get_value()]
        biases = [None if self.q_proj is not None else _value(self.q_a_bias), _value(self.kv_a_bias)]
        return _linears(x, weights, biases, joined=joined)

    def _expanded(self, q_nope, q_rope, latent, mask):
        """Keys and values of every position and head from the latent, then attention of ``H`` heads."""
        b, s, _ = latent.shape
        h, dn, r = self.num_heads, self.nope_dim, self.kv_rank
        kv = linear(latent[..., :r], self.kv_b_proj.get_value()).reshape(b, s, h, dn + self.v_dim)
        k_rope = jnp.broadcast_to(latent[:, :, None, r:], (b, s, h, self.rope_dim))
        k = jnp.concatenate([kv[..., :dn], k_rope], axis=-1)
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        return attend(q, k, kv[..., dn:], mask, scale=self.scale)

    def _absorbed(self, q_nope, q_rope, latent, mask):
        """``W_uk`` folded into the query, ``W_uv`` applied after: one shared latent key/value head."""
        dtype = q_nope.dtype
        h, dn, r = self.num_heads, self.nope_dim, self.kv_rank
        w = dense_weight(self.kv_b_proj.get_value(), dtype).reshape(r, h, dn + self.v_dim)
        q_latent = jnp.einsum("bthn,rhn->bthr", q_nope, w[..., :dn], preferred_element_type=jnp.float32)
        q = jnp.concatenate([q_latent.astype(dtype), q_rope], axis=-1)  # [B, T, H, r + dr]
        out = attend(q, latent[:, :, None, :], latent[:, :, None, :r], mask, scale=self.scale)  # [B, T, H, r]
        return jnp.einsum("bthr,rhv->bthv", out, w[..., dn:], preferred_element_type=jnp.float32).astype(dtype)


def attention_module(config, *, mesh, rngs: nnx.Rngs):
    """The attention of ``config.attention``: ``Attention`` (``"gqa"``) or ``MultiLatentAttention`` (``"mla"``)."""
    if config.attention == "mla":
        return MultiLatentAttention(config, mesh=mesh, rngs=rngs)
    return Attention(config, mesh=mesh, rngs=rngs)

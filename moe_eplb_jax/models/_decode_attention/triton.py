"""One decode step's grouped-query attention over a short cache, its cache write included, in one Pallas kernel.

``decode_attention(q [B, H, D], k [B, K, D], v [B, K, D], keys [B, K, S, D], values [B, K, S, D], index, mask
[B, S], scale=) -> (out [B, H, D], keys, values)``: the new key and value written at cache position ``index``
of every row (the caches updated in place), then each query head attending over its key/value head's ``S``
positions where ``mask`` is true -- scores in float32, masked to ``finfo(float32).min`` (a row with no key left
averages them all, as the XLA form does), softmax in float32, probabilities rounded to the cache's dtype, values
summed in float32. Optionally the queries and the new key arrive as projected, and the kernel first applies what
the attention module would: ``q_norm`` / ``k_norm`` (RMSNorm weights ``[D]``, in float32, rounded back to the
dtype) and the rotate-half RoPE of the whole head from ``rope [B, 2, D / 2]`` (each row's cos and sin, times the
attention factor; in float32, rounded back). The XLA form is about ten kernels of a layer: the norms and RoPE,
the two cache writes, the scores, the mask, the exponent, the cast, the values. A program per (sequence,
key/value head) holds the head's whole cache in one tile (as two halves of the head, the halves RoPE pairs), so
the kernel serves caches of up to ``MAX_KEYS`` positions; longer ones keep XLA's (one program per head would idle
the card over a long cache: ``docs/kernels.md``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_eplb_jax._kernels import traced_zero

__all__ = ["MAX_KEYS", "applies", "decode_attention", "probe"]

MAX_KEYS = 512


def applies(q_shape, keys_shape, dtype) -> bool:
    """Whether the kernel takes queries ``[B, H, D]`` over caches ``[B, K, S, D]`` of ``dtype``: 16-bit, ``D`` a
    power of two in [32, 256], ``K`` dividing ``H`` in groups of at most 16, ``S <= MAX_KEYS``."""
    if (
        len(q_shape) != 3
        or len(keys_shape) != 4
        or jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    ):
        return False
    (batch, heads, width), (cache_batch, kv_heads, positions, cache_width) = q_shape, keys_shape
    return (
        batch == cache_batch
        and width == cache_width
        and 32 <= width <= 256
        and not width & (width - 1)
        and heads % kv_heads == 0
        and heads // kv_heads <= 16
        and 1 <= positions <= MAX_KEYS
    )


def _rms(halves, weight_ref, eps: float, width: int):
    """RMSNorm over a head split in two halves (float32, rounded back to the halves' dtype)."""
    wide = [h.astype(jnp.float32) for h in halves]
    rms = jax.lax.rsqrt((jnp.sum(wide[0] * wide[0], axis=1) + jnp.sum(wide[1] * wide[1], axis=1)) / width + eps)
    half = width // 2
    weights = [weight_ref[pl.ds(start, half)].astype(jnp.float32) for start in (0, half)]
    return [(h * rms[:, None] * w[None, :]).astype(halves[0].dtype) for h, w in zip(wide, weights)]


def _rope(halves, cos, sin):
    """Rotate-half RoPE of a head split in its two halves (float32, rounded back)."""
    low, high = (h.astype(jnp.float32) for h in halves)
    dtype = halves[0].dtype
    return [(low * cos + (-high) * sin).astype(dtype), (high * cos + low * sin).astype(dtype)]


def _kernel(
    index_ref, rope_ref, q_ref, k_ref, v_ref, q_norm_ref, k_norm_ref, keys_in, values_in, mask_ref, *outs, **static
):
    del keys_in, values_in  # the same buffers as keys_ref / values_ref (aliased)
    out_ref, keys_ref, values_ref = outs
    positions, padded, group, width = (static[n] for n in ("positions", "padded", "group", "width"))
    half = width // 2
    row, head = pl.program_id(0), pl.program_id(1)
    zero = traced_zero()  # the masked window past the positions lies outside the arrays
    index = index_ref[0]
    sides = (pl.ds(0, half), pl.ds(half, half))
    heads = jnp.arange(16, dtype=jnp.int32) < group
    q = [plgpu.load(q_ref.at[row, pl.ds(head * group, 16), side], mask=heads[:, None], other=0) for side in sides]
    k = [k_ref[row, pl.ds(head, 1), side] for side in sides]  # [1, half] each
    if static["eps"] is not None:
        q, k = _rms(q, q_norm_ref, static["eps"], width), _rms(k, k_norm_ref, static["eps"], width)
    if static["rope"]:
        cos, sin = (rope_ref[row, pl.ds(part, 1), :] for part in (0, 1))  # [1, half] each
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)

    slots = jnp.arange(padded, dtype=jnp.int32)
    inside = slots < positions
    current = (slots == index)[:, None]
    keys = []
    for side, new in zip(sides, k):
        stored = plgpu.load(keys_ref.at[row, head, pl.ds(zero, padded), side], mask=inside[:, None], other=0)
        keys.append(jnp.where(current, new, stored))
        keys_ref[row, head, pl.ds(index, 1), side] = new
    new_v = v_ref[row, pl.ds(head, 1), :]
    window = (row, head, pl.ds(zero, padded), pl.ds(0, width))
    values = jnp.where(current, new_v, plgpu.load(values_ref.at[window], mask=inside[:, None], other=0))
    values_ref[row, head, pl.ds(index, 1), :] = new_v

    scores = sum(jnp.dot(part, stored.T, preferred_element_type=jnp.float32) for part, stored in zip(q, keys))
    scores = scores * jnp.float32(static["scale"])
    seen = plgpu.load(mask_ref.at[row, pl.ds(zero, padded)], mask=inside, other=0) != 0
    scores = jnp.where(seen[None, :], scores, jnp.finfo(jnp.float32).min)
    scores = jnp.where(inside[None, :], scores, -jnp.inf)  # padding slots weigh nothing, even in a blind row
    exp = jnp.exp(scores - jnp.max(scores, axis=1, keepdims=True))
    probs = (exp / jnp.sum(exp, axis=1, keepdims=True)).astype(values.dtype)
    out = jnp.dot(probs, values, preferred_element_type=jnp.float32)
    plgpu.store(out_ref.at[row, pl.ds(head * group, 16), :], out.astype(out_ref.dtype), mask=heads[:, None])


@functools.partial(jax.jit, static_argnames=("scale", "eps", "interpret"))
def decode_attention(
    q, k, v, keys, values, index, mask, *, scale: float, q_norm=None, k_norm=None, eps=None, rope=None, interpret=False
):
    """See the module docstring; ``applies(q.shape, keys.shape, keys.dtype)`` must hold, ``k`` / ``v`` ``[B, K, D]``
    and ``q`` in the caches' dtype, ``index`` an int32 scalar in ``[0, S)``, ``mask [B, S]`` bool; ``q_norm`` and
    ``k_norm`` ``[D]`` with ``eps`` (both or neither), ``rope [B, 2, D / 2]`` float32 or ``None``."""
    if not applies(q.shape, keys.shape, keys.dtype) or values.shape != keys.shape or q.dtype != keys.dtype:
        raise ValueError(
            f"decode_attention takes 16-bit q [B, H, D] over caches [B, K, S <= {MAX_KEYS}, D] of its dtype, "
            f"got q {q.dtype} {q.shape}, caches {keys.dtype} {keys.shape} / {values.shape}"
        )
    batch, heads, width = q.shape
    _, kv_heads, positions, _ = keys.shape
    if k.shape != (batch, kv_heads, width) or v.shape != k.shape or mask.shape != (batch, positions):
        raise ValueError(f"need k, v [{batch}, {kv_heads}, {width}] and mask [{batch}, {positions}]")
    if (q_norm is None) != (eps is None) or (k_norm is None) != (eps is None):
        raise ValueError("q_norm, k_norm and eps come together")
    if rope is not None and rope.shape != (batch, 2, width // 2):
        raise ValueError(f"rope must have shape [{batch}, 2, {width // 2}], got {rope.shape}")
    kernel = functools.partial(
        _kernel,
        positions=positions,
        padded=max(16, pl.next_power_of_2(positions)),
        group=heads // kv_heads,
        width=width,
        scale=float(scale),
        eps=None if eps is None else float(eps),
        rope=rope is not None,
    )
    unused = jnp.zeros((1,), jnp.float32)
    operands = (
        jnp.asarray(index, jnp.int32).reshape(1),
        unused if rope is None else rope.astype(jnp.float32),
        q,
        k.astype(keys.dtype),
        v.astype(values.dtype),
        unused if q_norm is None else q_norm,
        unused if k_norm is None else k_norm,
        keys,
        values,
        mask.astype(jnp.int32),
    )
    return pl.pallas_call(
        kernel,
        grid=(batch, kv_heads),
        in_specs=[pl.no_block_spec] * len(operands),
        out_specs=[pl.no_block_spec] * 3,
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct(keys.shape, keys.dtype),
            jax.ShapeDtypeStruct(values.shape, values.dtype),
        ],
        input_output_aliases={7: 1, 8: 2},
        compiler_params=plgpu.CompilerParams(num_warps=4),
        interpret=interpret,
        name="decode_attention",
    )(*operands)


def probe() -> bool:
    """Whether the kernel compiles here and agrees with XLA's attention on a small case, with the queries and key
    ready and with the norms and RoPE inside it (outside any trace)."""
    from moe_eplb_jax.models.attention import attend
    from moe_eplb_jax.models.rope import apply_rope, rotation

    rng = np.random.default_rng(0)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    q, k, v, keys, values = draw(2, 8, 64), draw(2, 2, 64), draw(2, 2, 64), draw(2, 2, 40, 64), draw(2, 2, 40, 64)
    weight, positions, index = draw(64), jnp.asarray([[6], [2]], jnp.int32), 6
    mask = jnp.asarray(np.arange(40)[None, :] < np.array([[30], [7]]))
    inv_freq = 10000.0 ** (-np.arange(32) / 32.0)
    rope = jnp.stack(rotation(positions[:, 0], inv_freq), axis=1)

    def ready(x):  # what the attention module does before the XLA attention
        x32 = x.astype(jnp.float32)
        scale = weight.astype(jnp.float32).reshape(1, 1, -1)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6) * scale
        return apply_rope(normed.astype(x.dtype)[:, None], positions, inv_freq)[:, 0]

    call = jax.jit(functools.partial(decode_attention, scale=0.125, eps=1e-6))
    out, new_keys, _ = call(q, k, v, keys, values, index, mask, q_norm=weight, k_norm=weight, rope=rope)
    q, k = ready(q), ready(k)
    plain, plain_keys, _ = jax.jit(functools.partial(decode_attention, scale=0.125))(q, k, v, keys, values, index, mask)
    keys, values = keys.at[:, :, index].set(k), values.at[:, :, index].set(v)
    want = attend(q[:, None], jnp.swapaxes(keys, 1, 2), jnp.swapaxes(values, 1, 2), mask[:, None], scale=0.125)
    close = lambda a, b: bool(np.allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=3e-2, rtol=3e-2))
    return close(plain, want[:, 0]) and close(out, want[:, 0]) and close(new_keys, keys) and close(plain_keys, keys)

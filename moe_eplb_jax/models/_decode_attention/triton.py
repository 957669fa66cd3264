"""One decode step's grouped-query attention over a short cache, its cache write included, in one Pallas kernel.

``decode_attention(q [B, H, D], k [B, K, D], v [B, K, D], keys [B, K, S, D], values [B, K, S, D], index, mask
[B, S], scale=) -> (out [B, H, D], keys, values)``: the new key and value written at cache position ``index``
of every row (the caches updated in place), then each query head attending over its key/value head's ``S``
positions where ``mask`` is true -- scores in float32, masked to ``finfo(float32).min`` (a row with no key left
averages them all, as the XLA form does), softmax in float32, probabilities rounded to the cache's dtype, values
summed in float32. The XLA form (``attention.attend``) is seven kernels of a layer: the two cache writes, the
scores, the mask, the exponent, the cast, the values. A program per (sequence, key/value head) holds the head's
whole cache in one tile, so the kernel serves caches of up to ``MAX_KEYS`` positions; longer ones keep XLA's
(one program per head would idle the card over a long cache: ``docs/kernels.md``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = ["MAX_KEYS", "applies", "decode_attention", "probe"]

MAX_KEYS = 512


def applies(q_shape, keys_shape, dtype) -> bool:
    """Whether the kernel takes queries ``[B, H, D]`` over caches ``[B, K, S, D]`` of ``dtype``: 16-bit, ``D`` a
    power of two in [16, 256], ``K`` dividing ``H`` in groups of at most 16, ``S <= MAX_KEYS``."""
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
        and 16 <= width <= 256
        and not width & (width - 1)
        and heads % kv_heads == 0
        and heads // kv_heads <= 16
        and 1 <= positions <= MAX_KEYS
    )


def _kernel(index_ref, q_ref, k_ref, v_ref, keys_in, values_in, mask_ref, out_ref, keys_ref, values_ref, **static):
    del keys_in, values_in  # the same buffers as keys_ref / values_ref (aliased)
    positions, padded, group, width, scale = (static[n] for n in ("positions", "padded", "group", "width", "scale"))
    row, head = pl.program_id(0), pl.program_id(1)
    zero = pl.program_id(0) * 0  # a traced start: the masked window past the positions lies outside the arrays
    index = index_ref[0]
    slots = jnp.arange(padded, dtype=jnp.int32)
    inside = slots < positions
    window = (row, head, pl.ds(zero, padded), pl.ds(0, width))
    new_k = k_ref[row, head, :]
    new_v = v_ref[row, head, :]
    current = (slots == index)[:, None]
    keys = jnp.where(current, new_k[None, :], plgpu.load(keys_ref.at[window], mask=inside[:, None], other=0))
    values = jnp.where(current, new_v[None, :], plgpu.load(values_ref.at[window], mask=inside[:, None], other=0))
    keys_ref[row, head, pl.ds(index, 1), :] = new_k[None, :]
    values_ref[row, head, pl.ds(index, 1), :] = new_v[None, :]

    heads = jnp.arange(16, dtype=jnp.int32) < group
    queries = (row, pl.ds(head * group, 16), pl.ds(0, width))
    q = plgpu.load(q_ref.at[queries], mask=heads[:, None], other=0)
    scores = jnp.dot(q, keys.T, preferred_element_type=jnp.float32) * jnp.float32(scale)
    seen = plgpu.load(mask_ref.at[row, pl.ds(zero, padded)], mask=inside, other=0) != 0
    scores = jnp.where(seen[None, :], scores, jnp.finfo(jnp.float32).min)
    scores = jnp.where(inside[None, :], scores, -jnp.inf)  # padding slots weigh nothing, even in a blind row
    exp = jnp.exp(scores - jnp.max(scores, axis=1, keepdims=True))
    probs = (exp / jnp.sum(exp, axis=1, keepdims=True)).astype(values.dtype)
    out = jnp.dot(probs, values, preferred_element_type=jnp.float32)
    plgpu.store(out_ref.at[queries], out.astype(out_ref.dtype), mask=heads[:, None])


@functools.partial(jax.jit, static_argnames=("scale", "interpret"), donate_argnames=())
def decode_attention(q, k, v, keys, values, index, mask, *, scale: float, interpret: bool = False):
    """See the module docstring; ``applies(q.shape, keys.shape, keys.dtype)`` must hold, ``k`` / ``v`` ``[B, K, D]``
    and ``q`` in the caches' dtype, ``index`` an int32 scalar in ``[0, S)``, ``mask [B, S]`` bool."""
    if not applies(q.shape, keys.shape, keys.dtype) or values.shape != keys.shape or q.dtype != keys.dtype:
        raise ValueError(
            f"decode_attention takes 16-bit q [B, H, D] over caches [B, K, S <= {MAX_KEYS}, D] of its dtype, "
            f"got q {q.dtype} {q.shape}, caches {keys.dtype} {keys.shape} / {values.shape}"
        )
    batch, heads, width = q.shape
    _, kv_heads, positions, _ = keys.shape
    if k.shape != (batch, kv_heads, width) or v.shape != k.shape or mask.shape != (batch, positions):
        raise ValueError(f"need k, v [{batch}, {kv_heads}, {width}] and mask [{batch}, {positions}]")
    kernel = functools.partial(
        _kernel,
        positions=positions,
        padded=max(16, pl.next_power_of_2(positions)),
        group=heads // kv_heads,
        width=width,
        scale=float(scale),
    )
    index = jnp.asarray(index, jnp.int32).reshape(1)
    return pl.pallas_call(
        kernel,
        grid=(batch, kv_heads),
        in_specs=[pl.no_block_spec] * 7,
        out_specs=[pl.no_block_spec] * 3,
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct(keys.shape, keys.dtype),
            jax.ShapeDtypeStruct(values.shape, values.dtype),
        ],
        input_output_aliases={4: 1, 5: 2},
        compiler_params=plgpu.CompilerParams(num_warps=4),
        interpret=interpret,
        name="decode_attention",
    )(index, q, k.astype(keys.dtype), v.astype(values.dtype), keys, values, mask.astype(jnp.int32))


def probe() -> bool:
    """Whether the kernel compiles here and agrees with XLA's attention on a small case (outside any trace)."""
    from moe_eplb_jax.models.attention import attend

    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 8, 64)).astype(jnp.bfloat16)
    k, v = (rng.standard_normal((2, 2, 64)).astype(jnp.bfloat16) for _ in range(2))
    keys, values = (rng.standard_normal((2, 2, 40, 64)).astype(jnp.bfloat16) for _ in range(2))
    mask = np.arange(40)[None, :] < np.array([[30], [7]])
    args = (q, k, v, keys, values, np.int32(6), mask)
    out, new_keys, _ = jax.jit(functools.partial(decode_attention, scale=0.125)).lower(*args).compile()(*args)
    keys[:, :, 6], values[:, :, 6] = k, v
    want = attend(
        q[:, None], np.swapaxes(keys, 1, 2), np.swapaxes(values, 1, 2), mask[:, None], scale=0.125, implementation="xla"
    )
    close = np.allclose(np.asarray(out, np.float32), np.asarray(want[:, 0], np.float32), atol=2e-2, rtol=2e-2)
    return bool(close and (np.asarray(new_keys) == keys).all())

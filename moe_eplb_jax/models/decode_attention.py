"""One decode step's grouped-query attention over the head-major KV cache in one Pallas (Triton) kernel.

XLA runs a decode step's attention as five kernels per layer (scores, mask, exponent, cast, values), each a
launch of 1-2 us over a few kilobytes; this kernel reads each key/value head's cache once and keeps the softmax
online (flash decoding, one program per sequence and key/value head). ``attend(implementation="xla")`` is its
reference: the same masked softmax, with the probabilities rounded to the inputs' dtype before the values'
product where this kernel keeps them in float32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = ["Config", "decode_attention", "supports"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """``block_keys`` cache positions per step of a program's loop (a power of two >= 16), Triton's warps and
    stages."""

    block_keys: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_keys", "num_warps", "num_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Config.{name} must be a positive int, got {value!r}")
        if self.block_keys < 16 or self.block_keys & (self.block_keys - 1):
            raise ValueError(f"Config.block_keys must be a power of two >= 16, got {self.block_keys}")


def _power_of_two(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


def supports(num_heads: int, num_kv_heads: int, key_width: int, value_width: int) -> bool:
    """Whether the kernel takes these heads: query heads a multiple of the key/value heads, each group and head
    width a power of two (Triton's blocks), widths of at least 16."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        return False
    widths = (key_width, value_width)
    return _power_of_two(num_heads // num_kv_heads) and all(_power_of_two(w) and w >= 16 for w in widths)


def _products(a, b, group: int):
    """``a [G, n] x b [n, m]`` in float32: a matrix product from 16 rows (Triton's smallest), else broadcast and
    summed (a handful of query heads per key/value head)."""
    if group >= 16:
        return jnp.dot(a, b, preferred_element_type=jnp.float32)
    return jnp.sum(a[:, :, None] * b[None, :, :], axis=1)


def _kernel(q_ref, k_ref, v_ref, valid_ref, o_ref, *, num_keys, num_kv_heads, group, block_keys, scale):
    row, head = pl.program_id(0), pl.program_id(1)
    first_query = (row * num_kv_heads + head) * group
    first_key = (row * num_kv_heads + head) * num_keys
    q = q_ref[pl.ds(first_query, group), :].astype(jnp.float32) * jnp.float32(scale)
    floor = jnp.finfo(jnp.float32).min

    def step(chunk, carry):
        top, total, acc = carry
        positions = chunk * block_keys + jnp.arange(block_keys, dtype=jnp.int32)
        inside = positions < num_keys
        keys = plgpu.load(
            k_ref.at[pl.ds(first_key + chunk * block_keys, block_keys), :], mask=inside[:, None], other=0
        ).astype(jnp.float32)
        values = plgpu.load(
            v_ref.at[pl.ds(first_key + chunk * block_keys, block_keys), :], mask=inside[:, None], other=0
        ).astype(jnp.float32)
        seen = plgpu.load(valid_ref.at[pl.ds(row * num_keys + chunk * block_keys, block_keys)], mask=inside, other=0)
        scores = _products(q, keys.T, group)  # [G, block_keys]
        # A masked key scores the float32 floor (as the reference: a query that sees none averages them all);
        # positions past the cache take no part.
        scores = jnp.where((seen > 0)[None, :], scores, floor)
        scores = jnp.where(inside[None, :], scores, -jnp.inf)
        new_top = jnp.maximum(top, jnp.max(scores, axis=1))
        rescale = jnp.exp(top - new_top)
        probs = jnp.exp(scores - new_top[:, None])
        return (
            new_top,
            total * rescale + jnp.sum(probs, axis=1),
            acc * rescale[:, None] + _products(probs, values, group),
        )

    width = o_ref.shape[1]
    start = (
        jnp.full((group,), -jnp.inf, jnp.float32),
        jnp.zeros((group,), jnp.float32),
        jnp.zeros((group, width), jnp.float32),
    )
    _, total, acc = jax.lax.fori_loop(0, pl.cdiv(num_keys, block_keys), step, start)
    o_ref[pl.ds(first_query, group), :] = (acc / total[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret"))
def decode_attention(q, keys, values, valid, *, scale: float, config: Config = Config(), interpret: bool = False):
    """One query per sequence over the cache.

    Args:
      q: ``[B, H, Dk]`` the step's queries.
      keys: ``[B, K, S, Dk]``, values ``[B, K, S, Dv]``: the head-major cache (``Attention``'s layout); query head
        ``h`` reads key/value head ``h // (H / K)``.
      valid: ``[B, S]`` bool, the positions each sequence sees.
      scale: the scores' scale.
      config: the tiling (``Config``).
      interpret: run in Pallas' interpreter (CPU tests).

    Returns:
      ``[B, H, Dv]`` in ``q.dtype``.
    """
    batch, num_heads, key_width = q.shape
    _, num_kv_heads, num_keys, _ = keys.shape
    value_width = values.shape[-1]
    if keys.shape != (batch, num_kv_heads, num_keys, key_width) or values.shape[:3] != keys.shape[:3]:
        raise ValueError(f"keys / values must be [B, K, S, D] for q {q.shape}, got {keys.shape} / {values.shape}")
    if valid.shape != (batch, num_keys):
        raise ValueError(f"valid must have shape [B, S] = {(batch, num_keys)}, got {valid.shape}")
    if not supports(num_heads, num_kv_heads, key_width, value_width):
        raise ValueError(
            f"decode_attention needs query heads a power-of-two multiple of the key/value heads and power-of-two "
            f"widths >= 16; got H={num_heads}, K={num_kv_heads}, Dk={key_width}, Dv={value_width}"
        )
    group = num_heads // num_kv_heads
    kernel = functools.partial(
        _kernel,
        num_keys=num_keys,
        num_kv_heads=num_kv_heads,
        group=group,
        block_keys=config.block_keys,
        scale=scale,
    )
    whole = pl.no_block_spec
    out = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads),
        in_specs=[whole] * 4,
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((batch * num_heads, value_width), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="decode_attention",
    )(
        q.reshape(batch * num_heads, key_width),
        keys.reshape(-1, key_width),
        values.reshape(-1, value_width),
        valid.astype(jnp.int32).reshape(-1),
    )
    return out.reshape(batch, num_heads, value_width)

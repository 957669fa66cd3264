"""A stable argsort and a top-k by counting, for the small arrays of a decode step on a GPU.

XLA's GPU sort is a kernel plus a copy of every operand, several launches for a few hundred entries; an entry's
rank counted over all pairs is one fused reduction. The pairs grow as the square of the size, so past
``MAX_PAIRS`` comparisons (and on a CPU, which launches nothing) the sort serves. Both ways give exactly what
``jnp.argsort(stable=True)`` and ``jax.lax.top_k`` give.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_eplb_jax._kernels import on_gpu, pallas_default

__all__ = ["MAX_PAIRS", "inverse_permutation", "ordered_keys", "stable_argsort", "top_k_indices", "top_k_take"]

MAX_PAIRS = 1 << 22


def ordered_keys(values):
    """int32 keys in the order ``jax.lax.top_k`` and ``jnp.argsort`` compare: IEEE total order for floats (-NaN <
    -inf < -0 < +0 < inf < NaN)."""
    if jnp.issubdtype(values.dtype, jnp.floating):
        bits = jax.lax.bitcast_convert_type(values.astype(jnp.float32), jnp.int32)
        return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)
    return values.astype(jnp.int32)


def _counts(values, pairs: int, counted: bool | None) -> bool:
    """Whether to count: asked for, or by default on a GPU within ``MAX_PAIRS``; only for dtypes ``ordered_keys``
    keeps in order (floats and signed integers of up to 32 bits, narrower unsigned ones)."""
    dtype = jnp.dtype(values.dtype)
    if jnp.issubdtype(dtype, jnp.unsignedinteger):
        orderable = dtype.itemsize < 4
    else:
        orderable = dtype.itemsize <= 4 and (
            jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.signedinteger)
        )
    wanted = (on_gpu() and pairs <= MAX_PAIRS) if counted is None else counted
    return orderable and wanted


def _ranks(keys, *, descending: bool):
    """``[..., n]`` int32: each entry's place in the stable order of the last axis (ties: lower index first)."""
    index = jnp.arange(keys.shape[-1], dtype=jnp.int32)
    other, this = keys[..., None, :], keys[..., :, None]
    ahead = (other > this) if descending else (other < this)
    earlier_tie = (other == this) & jnp.broadcast_to(index[None, :] < index[:, None], ahead.shape)
    return jnp.sum(ahead | earlier_tie, axis=-1, dtype=jnp.int32)


def inverse_permutation(order):
    """``inverse`` with ``inverse[order[i]] = i`` for ``order`` a permutation ``[N]`` (a scatter of ``N`` ints)."""
    if order.ndim != 1 or not jnp.issubdtype(order.dtype, jnp.integer):
        raise ValueError(f"order must be a 1-D integer permutation, got {order.dtype} {order.shape}")
    positions = jnp.arange(order.shape[0], dtype=order.dtype)
    return jnp.zeros_like(order).at[order].set(positions, unique_indices=True)


def stable_argsort(keys, *, counted: bool | None = None):
    """``(order, inverse)`` of a 1-D array: ``order = jnp.argsort(keys, stable=True)`` and ``inverse[order[i]] = i``,
    both int32. ``counted``: force (``True``) or forbid (``False``) counting; ``None`` decides by the size. Float
    keys always sort (``argsort`` puts every NaN last, not in total order)."""
    size = keys.shape[0]
    if jnp.issubdtype(keys.dtype, jnp.floating) or not _counts(keys, size * size, counted):
        order = jnp.argsort(keys, stable=True).astype(jnp.int32)
        return order, inverse_permutation(order)
    inverse = _ranks(ordered_keys(keys), descending=False)
    index = jnp.arange(size, dtype=jnp.int32)
    order = jnp.sum(jnp.where(inverse[None, :] == index[:, None], index[None, :], 0), axis=1, dtype=jnp.int32)
    return order, inverse


def top_k_indices(values, k: int, *, counted: bool | None = None):
    """``jax.lax.top_k(values, k)[1]`` (int32 ``[..., k]``: the largest first, ties by lower index). ``counted`` as
    in :func:`stable_argsort`."""
    width = values.shape[-1]
    if not _counts(values, values.size * width, counted):
        return jax.lax.top_k(values, k)[1].astype(jnp.int32)
    rank = _ranks(ordered_keys(values), descending=True)
    places = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32)[:, None], (*rank.shape[:-1], k, 1))
    hit = rank[..., None, :] == places  # [..., k, n]: one entry per place
    index = jnp.arange(width, dtype=jnp.int32)
    return jnp.sum(jnp.where(hit, jnp.broadcast_to(index, hit.shape), 0), axis=-1, dtype=jnp.int32)


def top_k_take(values, taken, k: int, *, valid=None, renormalize: bool = False, scale: float = 1.0, counted=None):
    """``(ids, taken_at)`` for ``[T, E]`` arrays: ``ids = top_k_indices(values, k)`` (``-1`` in the rows ``valid
    [T]`` marks false) and ``taken_at = take_along_axis(taken, ids)``, divided by its row's sum plus ``1e-20`` with
    ``renormalize`` and times ``scale``. Where the top-k would be counted on a GPU (``counted`` as in
    :func:`stable_argsort`), one kernel (``moe._top_k``) does all of it, where the counted form is four or five
    (the sum's order may differ there in the last bit)."""
    from moe_eplb_jax.moe._top_k import triton as fused

    serves = counted is None and _counts(values, values.size * values.shape[-1], None)
    if serves and fused.applies(values.shape, k, values.dtype, taken.dtype) and taken.dtype == jnp.float32:
        if pallas_default("top_k_take", fused.probe):
            return fused.top_k_take(values, taken, k, valid=valid, renormalize=renormalize, scale=scale)
    ids = top_k_indices(values, k, counted=counted)
    taken_at = jnp.take_along_axis(taken, ids, axis=-1)
    if renormalize:
        taken_at = taken_at / (taken_at.sum(-1, keepdims=True) + jnp.float32(1e-20))
    if scale != 1.0:
        taken_at = taken_at * jnp.float32(scale)
    if valid is not None:
        ids = jnp.where(valid[..., None], ids, jnp.int32(-1))
    return ids, taken_at

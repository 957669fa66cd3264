"""Waterfill for a shared expert: send shared-expert work where the routed load left slack.

Every rank holds one copy of the shared expert (one extra slot per rank), so a
token's shared-expert work may run on any rank. The routed experts already
load the ranks unevenly (``routed_load [G]``); Waterfill pours the batch's
shared-expert work (``total`` token units) into the ranks like water into a
vessel with an uneven floor: the level ``λ`` solves
``sum_r max(λ - routed_load[r], 0) = total`` and rank ``r`` gets the share
``max(λ - routed_load[r], 0) / total`` of the work.

Each token then picks one of its candidate ranks (``candidates [T, C]``: e.g.
its own rank and the ranks its top-k experts went to, so no extra transfer is
needed) by a deterministic hash of its index, weighted by those ranks' shares.
A token whose candidates all have zero share keeps its first candidate.
Batches with fewer than ``min_tokens`` tokens skip balancing (first candidate).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from moe_eplb_jax._checks import check_int, is_concrete

__all__ = ["waterfill_shares", "waterfill_assign", "waterfill_reference_level"]


def _dtype(value):
    return np.dtype(value.dtype) if hasattr(value, "dtype") else np.asarray(value).dtype


def _is_number(dtype) -> bool:
    return dtype.kind in "iuf" or bool(jnp.issubdtype(dtype, jnp.floating))


def _check_loads(routed_load, total) -> None:
    """Shapes and dtypes always; finite, non-negative values where the inputs are concrete."""
    if np.ndim(routed_load) != 1 or np.shape(routed_load)[0] < 1:
        raise ValueError(f"routed_load must have shape [G] with G >= 1, got {np.shape(routed_load)}")
    if np.ndim(total) != 0:
        raise ValueError(f"total must be a scalar, got shape {np.shape(total)}")
    for name, value in (("routed_load", routed_load), ("total", total)):
        if not _is_number(_dtype(value)):
            raise ValueError(f"{name} must hold numbers, got dtype {_dtype(value)}")
        if is_concrete(value):
            host = np.asarray(value)
            if not np.all(np.isfinite(host)) or np.any(host < 0):
                raise ValueError(f"{name} must be finite and non-negative")


def waterfill_shares(routed_load, total):
    """Share ``[G]`` float32 of the shared-expert work each rank should take (sums to 1 when ``total > 0``).

    ``routed_load [G]`` is each rank's routed-expert load; ``total`` the shared
    work (a scalar). Exact: sorts the floor and finds the level in closed form.
    """
    _check_loads(routed_load, total)
    floor = jnp.asarray(routed_load).astype(jnp.float32)
    total = jnp.asarray(total).astype(jnp.float32)
    num_ranks = floor.shape[0]
    ordered = jnp.sort(floor)
    k = jnp.arange(1, num_ranks + 1, dtype=jnp.float32)
    # With the k lowest ranks under water the level is (total + sum of their floors) / k. Every k whose level
    # covers the k-th floor gives a level at or above the true one (a floor under water only lowers it), and
    # the true k attains it: the level is the smallest such candidate.
    level_k = (total + jnp.cumsum(ordered)) / k
    fits = level_k >= ordered
    level = jnp.min(jnp.where(fits, level_k, jnp.inf))
    fill = jnp.maximum(level - floor, 0.0)
    return jnp.where(total > 0, fill / jnp.where(total > 0, total, 1.0), 1.0 / num_ranks)


def _hash_unit(index):
    """A deterministic per-token uniform in [0, 1) (multiplicative hash, 24 high bits)."""
    h = index.astype(jnp.uint32) * jnp.uint32(0x9E3779B1)
    h = h ^ (h >> jnp.uint32(15))
    h = h * jnp.uint32(0x85EBCA77)
    h = h ^ (h >> jnp.uint32(13))
    return (h >> jnp.uint32(8)).astype(jnp.float32) / jnp.float32(1 << 24)


def waterfill_assign(candidates, routed_load, *, min_tokens: int = 0, token_offset=0, total=None, valid=None):
    """Rank ``[T]`` int32 that computes each token's shared expert, and the shared load ``[G]`` int32.

    ``candidates [T, C]`` int32 rank ids (the first is the fallback, usually the
    token's own rank); ``routed_load [G]`` the routed load of the batch.
    ``token_offset`` shifts the hash index (use the global token index so that
    ranks agree). ``total``: the shared work poured into the ranks (default
    ``T``, this call's tokens; pass the whole batch's when each rank assigns
    only its own tokens, so every rank pours the same water). ``valid``:
    optional ``[T]`` bool; a ``False`` token (padding) goes nowhere (rank
    ``-1``) and is not counted. Jit-able with ``min_tokens`` static. Candidate
    ids outside ``[0, G)`` raise ``ValueError`` where concrete (checked before
    the int32 cast); under ``jit`` they are assumed in range.
    """
    if np.ndim(candidates) != 2 or np.shape(candidates)[1] < 1:
        raise ValueError(f"candidates must have shape [T, C] with C >= 1, got {np.shape(candidates)}")
    min_tokens = check_int("min_tokens", min_tokens, minimum=0)
    _check_loads(routed_load, 0)
    if _dtype(candidates).kind not in "iu" or _dtype(token_offset).kind not in "iu" or np.ndim(token_offset):
        raise ValueError(
            f"candidates and token_offset must be integers, got dtypes {_dtype(candidates)}, {_dtype(token_offset)}"
        )
    num_ranks = np.shape(routed_load)[0]
    if is_concrete(candidates):  # checked before the int32 cast, so no id wraps into range
        host = np.asarray(candidates)
        if np.any((host < 0) | (host >= num_ranks)):
            raise ValueError(f"candidates must be rank ids in [0, {num_ranks})")
    if is_concrete(token_offset) and not 0 <= int(token_offset) < 2**31:
        raise ValueError(f"token_offset must lie in [0, 2**31), got {int(token_offset)}")
    candidates = jnp.asarray(candidates).astype(jnp.int32)
    num_tokens = candidates.shape[0]
    if valid is not None and np.shape(valid) != (num_tokens,):
        raise ValueError(f"valid must have shape [T] = ({num_tokens},), got {np.shape(valid)}")
    if total is not None and np.ndim(total) != 0:
        raise ValueError(f"total must be a scalar, got shape {np.shape(total)}")
    total = jnp.float32(num_tokens) if total is None else jnp.asarray(total).astype(jnp.float32)
    share = waterfill_shares(routed_load, total)
    if num_tokens < min_tokens or num_tokens == 0:
        dest = candidates[:, 0]
    else:
        weight = share[candidates]  # [T, C]
        cum = jnp.cumsum(weight, axis=1)
        weight_sum = cum[:, -1:]
        u = _hash_unit(jnp.arange(num_tokens, dtype=jnp.int32) + jnp.asarray(token_offset, jnp.int32))
        pick = jnp.sum((cum <= u[:, None] * weight_sum).astype(jnp.int32), axis=1)
        pick = jnp.minimum(pick, candidates.shape[1] - 1)
        chosen = jnp.take_along_axis(candidates, pick[:, None], axis=1)[:, 0]
        dest = jnp.where(weight_sum[:, 0] > 0, chosen, candidates[:, 0])
    if valid is not None:
        dest = jnp.where(jnp.asarray(valid), dest, -1)
    load = jnp.zeros((num_ranks,), jnp.int32).at[jnp.where(dest >= 0, dest, num_ranks)].add(1, mode="drop")
    return dest, load


def waterfill_reference_level(routed_load, total) -> float:
    """Numpy bisection for the water level (test oracle for :func:`waterfill_shares`)."""
    _check_loads(routed_load, total)
    floor = np.asarray(routed_load, dtype=np.float64)
    lo, hi = floor.min(), floor.max() + float(total)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if np.maximum(mid - floor, 0).sum() < total:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)

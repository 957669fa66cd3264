"""The tables ``map_and_count``'s implementations read, built in jnp (so every implementation reads the same).

* :func:`placement_lookup` ``(log2phy [E, S], logcnt [E])`` -> flat int32 ``[E + E S]``, the Pallas map
  kernel's view of a placement layer: per expert a head word ``(first slot + 1) | count << 16`` (one load
  answers an entry of a single-replica expert), then ``log2phy`` replica-major (``[S, E]`` flat: a warp's
  gathers of replica ``j`` fall in one row). :func:`wide_lookup`: plain counts instead of heads, where slots
  do not fit 16 bits.
* :func:`quota_thresholds` ``(quotas [E, S], logcnt [E])`` -> ``[E, S]``: mode ``"quota"``'s running sums of
  the live quotas, capped; :func:`kernel_quotas`: quotas whose running sums the kernels may take in int32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moe_eplb_jax.routing._map_and_count import _alias

__all__ = ["placement_lookup", "wide_lookup", "lookup_size", "quota_thresholds", "kernel_quotas", "NEVER", "WIDE"]

NEVER = int(np.iinfo(np.int32).max)  # a threshold no point passes
WIDE = 0xFFFF  # from this many physical slots a head word cannot hold a slot (16 bits): wide_lookup
_MAX_MATMUL_WIDTH = 4096  # the triangular [S, S] matrix of the sums grows as S**2
_LIMB_BITS = 11  # quotas split in 11-bit limbs: sums of up to 8192 limbs stay below 2**24 (exact in float32)


def lookup_size(num_logical: int, width: int) -> int:
    """Entries of :func:`placement_lookup`'s array for ``log2phy [num_logical, width]``."""
    return num_logical + num_logical * width


def placement_lookup(log2phy, logcnt):
    """The Pallas map kernel's lookup table of one placement layer (module docstring), flat int32 ``[E + E S]``."""
    by_replica = jnp.asarray(log2phy, jnp.int32).T  # [S, E]
    counts = jnp.clip(jnp.asarray(logcnt, jnp.int32), 1, 0xFFFF)
    return jnp.concatenate([_alias.head_word(by_replica[0], counts), by_replica.reshape(-1)])


def wide_lookup(log2phy, logcnt):
    """:func:`placement_lookup` with ``logcnt`` itself for the heads (slots past 16 bits), flat int32 ``[E + E S]``."""
    return jnp.concatenate([jnp.asarray(logcnt, jnp.int32), jnp.asarray(log2phy, jnp.int32).T.reshape(-1)])


def quota_thresholds(quotas, logcnt, *, cap: int):
    """``[E, S]`` int32 non-decreasing thresholds of mode ``"quota"``: the running sums of the live quotas.

    Quotas ``j < logcnt[e]`` count, clipped to ``[0, cap]``, and the sums are
    capped at ``cap`` (the number of entries: no rank reaches it, so the cap
    changes no result); entries from ``logcnt[e]`` on are ``int32 max``, which
    no point passes. Exact integers however the sums run: one float32 product
    with a triangular ``[S, S]`` matrix (of the quotas while ``cap < 2**24``,
    else of their 11-bit limbs), or a saturating scan for very wide rows.
    """
    width = quotas.shape[1]
    cap = int(min(cap, NEVER))
    live = jnp.arange(width, dtype=jnp.int32)[None, :] < logcnt[:, None]
    quotas = jnp.where(live, jnp.clip(quotas.astype(jnp.int32), 0, cap), 0)
    return jnp.where(live, _capped_sums(quotas, cap), jnp.int32(NEVER))


def kernel_quotas(quotas, logcnt, *, cap: int):
    """Quotas for the kernels that sum their own rows in int32 (:func:`._search.clipped_quotas`): ``quotas`` as
    they are where ``S * cap < 2**31 - 1``, else the steps of :func:`quota_thresholds` (whose running sums stay
    below ``cap``) -- either way their clipped, capped running sums are the thresholds."""
    width = quotas.shape[1]
    if width * cap < 2**31 - 1:
        return quotas
    sums = quota_thresholds(quotas, logcnt, cap=cap)
    live = jnp.arange(width, dtype=jnp.int32)[None, :] < logcnt[:, None]
    before = jnp.concatenate([jnp.zeros_like(sums[:, :1]), sums[:, :-1]], axis=1)
    return jnp.where(live, sums - before, 0)


def _triangular_sums(values):
    """Inclusive prefix sums of ``values [R, S]`` along ``S`` as one float32 product (exact below ``2**24``)."""
    width = values.shape[1]
    upper = (jnp.arange(width)[:, None] <= jnp.arange(width)[None, :]).astype(jnp.float32)
    return jnp.dot(
        values.astype(jnp.float32), upper, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )


def _capped_sums(quotas, cap):
    """``min(prefix sums of quotas [E, S] along S, cap)``, exact, for quotas in ``[0, cap]``."""
    num_logical, width = quotas.shape
    if width <= _MAX_MATMUL_WIDTH and cap < 2**24:
        # A float32 sum of non-negative integers is exact while the true sum is below 2**24, and a larger one
        # rounds to >= 2**24 > cap: capped in float32 first, the result is exact (and fits int32).
        return jnp.minimum(_triangular_sums(quotas), jnp.float32(cap)).astype(jnp.int32)
    if width <= _MAX_MATMUL_WIDTH and width * cap < 2**31:  # exact limbs, an int32 total
        num_limbs = -(-cap.bit_length() // _LIMB_BITS)
        mask = (1 << _LIMB_BITS) - 1
        limbs = jnp.concatenate([(quotas >> (_LIMB_BITS * i)) & mask for i in range(num_limbs)], axis=0)
        limb_sums = _triangular_sums(limbs).astype(jnp.int32)  # [num_limbs * E, S]: integers < 2**24
        total = sum(limb_sums[i * num_logical : (i + 1) * num_logical] << (_LIMB_BITS * i) for i in range(num_limbs))
        return jnp.minimum(total, cap)
    # Saturating sums, associative for values in [0, cap]: min(a + b, cap) without overflowing int32.
    return jax.lax.associative_scan(lambda a, b: jnp.minimum(a, cap - b) + b, quotas, axis=1)

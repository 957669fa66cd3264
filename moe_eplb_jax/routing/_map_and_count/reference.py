"""Pure-jnp reference of ``map_and_count``: the XLA implementation and the test oracle.

Written for clarity, not speed: every step of the semantics documented in
:mod:`moe_eplb_jax.routing._map_and_count.api` is one array expression here. The
inputs are validated and prepared by the public function: ``mode`` is the kernel
rule, ``limits`` the ``[3]`` int32 ``(count_limit, rank_limit, token_offset)``:
the first two in flat (token, k) positions, the third the global position of
token 0; the mode's raw table (``shares`` / ``quotas``) is turned into the
``[E, S]`` int32 table the rule reads here.
"""

from __future__ import annotations

import jax.numpy as jnp

from moe_eplb_jax.routing._map_and_count import _alias, _tables

__all__ = ["map_and_count_reference", "hash_replica", "hash_token", "replica_rank", "GOLDEN", "MAX_HASH_COUNT"]

GOLDEN = 2654435769  # 2**32 / golden ratio: Knuth's multiplicative hash constant
MAX_HASH_COUNT = 2**16 - 1  # hash_replica's product stays in uint32


def hash_token(position):
    """``(position * 2654435769) mod 2**32`` as uint32, for global token positions ``[...]`` (uint32 or int32)."""
    return position.astype(jnp.uint32) * jnp.uint32(GOLDEN)


def hash_replica(hashed, count):
    """``floor(h * min(c, 2**16 - 1) / 2**32)``: the replica of hash ``h`` among ``c``, from its high bits.

    A multiplicative hash spreads its high bits; its low bits repeat the
    position's (``h mod 2**j == t mod 2**j`` for an odd constant), so ``h mod
    c`` would be round robin wherever ``c`` is a power of two. Exact in uint32:
    ``h = a 2**16 + b`` gives ``floor((a c + floor(b c / 2**16)) / 2**16)``.
    """
    count = jnp.minimum(count, MAX_HASH_COUNT).astype(jnp.uint32)
    high = (hashed >> 16) * count + (((hashed & jnp.uint32(0xFFFF)) * count) >> 16)
    return (high >> 16).astype(jnp.int32)


def replica_rank(expert, rank_valid, num_logical: int):
    """For each flat position, how many earlier positions hold the same expert and are ``rank_valid``.

    ``expert [N]`` int32 in ``[0, E)`` wherever ``rank_valid [N]`` is true. The
    result ``[N]`` int32 is the exclusive per-expert running count in flat order
    (the order of a stable sort by expert id); it is 0 at positions that are
    not ``rank_valid`` (those never consume quota).
    """
    num_flat = expert.shape[0]
    key = jnp.where(rank_valid, expert, num_logical)
    order = jnp.argsort(key, stable=True)
    counts = jnp.bincount(key, length=num_logical + 1)
    first = jnp.cumsum(counts) - counts  # first sorted position of each expert
    sorted_key = key[order]
    rank_sorted = jnp.arange(num_flat, dtype=jnp.int32) - first[sorted_key].astype(jnp.int32)
    rank = jnp.zeros((num_flat,), jnp.int32).at[order].set(rank_sorted)
    return jnp.where(rank_valid, rank, 0)


def map_and_count_reference(
    topk_ids, log2phy, logcnt, limits, *, num_physical: int, mode: str, shares=None, quotas=None
):
    """Maps ``topk_ids [T, k]`` to ``(physical_ids [T, k] int32, load [num_physical] int32)``.

    ``log2phy [E, S]``, ``logcnt [E]`` and ``limits [3]`` are int32; ``shares``
    (``"lp"``) ``[E, S]`` float32 weights, ``quotas`` (``"quota"``) ``[E, S]``
    int32 quotas.
    """
    if mode == "lp":
        table = _alias.alias_words(jnp.asarray(shares, jnp.float32), log2phy, logcnt)
    elif mode == "quota":
        table = _tables.quota_thresholds(jnp.asarray(quotas, jnp.int32), logcnt, cap=topk_ids.size)
    else:
        table = jnp.zeros(log2phy.shape, jnp.int32)  # hash / round_robin read no table
    return _map_with_table(topk_ids, log2phy, logcnt, table, limits, num_physical=num_physical, mode=mode)


def _map_with_table(topk_ids, log2phy, logcnt, table, limits, *, num_physical: int, mode: str):
    """The rule ``mode`` over its ``[E, S]`` int32 ``table`` (the alias words of ``"lp"``,
    :func:`._alias.alias_words`; the thresholds of ``"quota"``, :func:`._tables.quota_thresholds`)."""
    num_tokens, top_k = topk_ids.shape
    num_logical, width = log2phy.shape
    ids = topk_ids.reshape(-1)
    flat = jnp.arange(ids.shape[0], dtype=jnp.int32)
    position = (flat // top_k).astype(jnp.uint32) + limits[2].astype(jnp.uint32)  # global: wraps mod 2**32
    valid_id = (ids >= 0) & (ids < num_logical)
    expert = jnp.where(valid_id, ids, 0)
    count = jnp.maximum(logcnt[expert], 1)
    hashed = hash_token(position)
    by_hash = hash_replica(hashed, count)

    if mode == "hash":
        replica = by_hash
    elif mode == "round_robin":
        replica = (position % count.astype(jnp.uint32)).astype(jnp.int32)
    elif mode == "lp":  # the alias words: the hash picks a bucket and a point inside it
        bucket, fraction = _alias.bucket_and_fraction(hashed, _alias.live_counts(logcnt[expert], width))
        replica = bucket  # (the word names the slot itself where the point falls to the alias)
    elif mode == "quota":
        point = replica_rank(expert, valid_id & (flat < limits[1]), num_logical)
        point = jnp.where(flat < limits[1], point, jnp.iinfo(jnp.int32).max)  # padding: no quota
        # Thresholds rise along each row; the replica is how many of them the point has passed.
        passed = jnp.sum(table[expert] <= point[:, None], axis=1, dtype=jnp.int32)
        replica = jnp.where(passed < count, passed, by_hash)
    else:
        raise ValueError(f"unknown mode {mode!r}")

    replica = jnp.clip(replica, 0, width - 1)
    slot = log2phy[expert, replica]
    if mode == "lp":
        slot = _alias.alias_slot(table[expert, replica], slot, fraction)
    mapped = valid_id & (slot >= 0) & (slot < num_physical)
    physical_ids = jnp.where(mapped, slot, -1)
    counted = mapped & (flat < limits[0])
    load = jnp.bincount(jnp.where(counted, physical_ids, num_physical), length=num_physical + 1)
    return physical_ids.reshape(num_tokens, top_k), load[:num_physical].astype(jnp.int32)

"""Pure-jnp reference of ``map_and_count``: the XLA implementation and the test oracle.

Written for clarity, not speed: every step of the semantics documented in
:mod:`moe_eplb_jax.routing._map_and_count.api` is one array expression here. The
inputs are validated and prepared by the public function: ``mode`` is the kernel
rule, ``limits`` the ``[2]`` int32 pair ``(count_limit, rank_limit)`` in flat
(token, k) positions, and the mode's raw table (``shares`` / ``quotas``) is
turned into the ``[E, S]`` int32 table the rule reads here.
"""

from __future__ import annotations

import jax.numpy as jnp

from moe_eplb_jax.routing._map_and_count import _alias, _tables

__all__ = ["map_and_count_reference", "hash_token", "replica_rank", "GOLDEN"]

GOLDEN = 2654435769  # 2**32 / golden ratio: Knuth's multiplicative hash constant


def hash_token(token_idx):
    """``(token_idx * 2654435769) mod 2**32`` as uint32, for int32 token indices ``[...]``."""
    return token_idx.astype(jnp.uint32) * jnp.uint32(GOLDEN)


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

    ``log2phy [E, S]``, ``logcnt [E]`` and ``limits [2]`` are int32; ``shares``
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
    token = flat // top_k
    valid_id = (ids >= 0) & (ids < num_logical)
    expert = jnp.where(valid_id, ids, 0)
    count = jnp.maximum(logcnt[expert], 1)
    hashed = hash_token(token)
    by_hash = (hashed % count.astype(jnp.uint32)).astype(jnp.int32)

    if mode == "hash":
        replica = by_hash
    elif mode == "round_robin":
        replica = token % count
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

"""Load metrics: rank loads, balancedness and rank imbalance.

Every function takes numpy or jax arrays and returns the same kind (jax
inputs make them usable under ``jit``).

* rank load ``[L, G]``: tokens computed by each of ``G`` EP ranks, per layer;
* ``balancedness = sum_l mean_g(load[l]) / sum_l max_g(load[l])`` (1.0 is perfect);
* ``rank_imbalance[l] = max_g(load[l]) / mean_g(load[l])`` (1.0 is perfect).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "rank_load",
    "slot_load_from_logical",
    "rank_load_from_logical",
    "balancedness",
    "rank_imbalance",
]


def _xp(*arrays):
    return jnp if any(isinstance(a, jax.Array) for a in arrays) else np


def rank_load(slot_load, num_ranks: int):
    """Sums per-slot loads ``[..., P]`` into per-rank loads ``[..., G]`` (slot p on rank p // (P/G))."""
    xp = _xp(slot_load)
    slot_load = xp.asarray(slot_load)
    num_physical = slot_load.shape[-1]
    if num_ranks < 1 or num_physical % num_ranks:
        raise ValueError(f"{num_physical} slots are not divisible by {num_ranks} ranks")
    return slot_load.reshape(*slot_load.shape[:-1], num_ranks, num_physical // num_ranks).sum(-1)


def slot_load_from_logical(logical_load, phy2log):
    """Per-slot loads ``[L, P]`` when each expert's load ``[L, E]`` splits evenly over its replicas.

    ``phy2log`` is ``[L, P]`` (or ``[P]``, shared by all layers).
    """
    xp = _xp(logical_load, phy2log)
    logical_load = xp.asarray(logical_load)
    phy2log = xp.asarray(phy2log)
    if logical_load.ndim != 2:
        raise ValueError(f"logical_load must have shape [L, E], got {logical_load.shape}")
    num_layers, num_logical = logical_load.shape
    phy2log = xp.broadcast_to(phy2log, (num_layers, phy2log.shape[-1]))
    # Replica counts: one-hot sum (works identically for numpy and jax, and under jit).
    onehot = phy2log[..., None] == xp.arange(num_logical)[None, None, :]
    logcnt = onehot.sum(1)
    loads = logical_load.astype(jnp.float32 if xp is jnp else np.float64)
    per_replica = loads / xp.maximum(logcnt, 1).astype(loads.dtype)
    return xp.take_along_axis(per_replica, phy2log, axis=1)


def rank_load_from_logical(logical_load, phy2log, num_ranks: int):
    """Per-rank loads ``[L, G]`` from logical loads ``[L, E]`` and a placement ``phy2log [L, P]``."""
    return rank_load(slot_load_from_logical(logical_load, phy2log), num_ranks)


def balancedness(rank_loads):
    """``sum_l mean_g / sum_l max_g`` of per-rank loads ``[L, G]`` (or ``[G]``); 1.0 when there is no load."""
    xp = _xp(rank_loads)
    loads = xp.asarray(rank_loads)
    loads = loads.reshape(-1, loads.shape[-1])
    total_max = loads.max(-1).sum()
    return xp.where(total_max > 0, loads.mean(-1).sum() / xp.where(total_max > 0, total_max, 1), 1.0)


def rank_imbalance(rank_loads):
    """Per-layer ``max_g / mean_g`` of per-rank loads ``[L, G]`` -> ``[L]`` (1.0 for a layer with no load)."""
    xp = _xp(rank_loads)
    loads = xp.asarray(rank_loads)
    mean = loads.mean(-1)
    return xp.where(mean > 0, loads.max(-1) / xp.where(mean > 0, mean, 1), 1.0)

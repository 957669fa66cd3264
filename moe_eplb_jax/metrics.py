"""Load metrics: rank loads, balancedness and rank imbalance.

Every function takes numpy or jax arrays and returns the same kind (jax
inputs make them usable under ``jit``). Loads must be numbers, finite and
non-negative, and placement ids in range: checked where the inputs are concrete
(``ValueError``), assumed under ``jit``. The ratios divide each load by the
number of ranks and layers before summing, so no sum overflows.

* rank load ``[L, G]``: tokens computed by each of ``G`` EP ranks, per layer;
* ``balancedness = sum_l mean_g(load[l]) / sum_l max_g(load[l])`` (1.0 is perfect);
* ``rank_imbalance[l] = max_g(load[l]) / mean_g(load[l])`` (1.0 is perfect).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moe_eplb_jax._checks import check_int, is_concrete

__all__ = [
    "rank_load",
    "slot_load_from_logical",
    "rank_load_from_logical",
    "balancedness",
    "rank_imbalance",
]


def _xp(*arrays):
    return jnp if any(isinstance(a, jax.Array) for a in arrays) else np


def _loads(name: str, value, xp, *, min_ndim: int = 1):
    """``value`` as an array of numbers (no bools or strings); finite and non-negative where concrete."""
    try:
        arr = xp.asarray(value)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"{name} must be an array of numbers ({e})") from None
    if arr.ndim < min_ndim or arr.shape[-1] == 0:
        raise ValueError(f"{name} must have at least {min_ndim} non-empty dimension(s), got shape {arr.shape}")
    if arr.dtype.kind not in "iuf" and not jnp.issubdtype(arr.dtype, jnp.floating):
        raise ValueError(f"{name} must hold numbers, got dtype {arr.dtype}")
    if is_concrete(arr) and arr.size:
        host = np.asarray(arr)
        if not np.all(np.isfinite(host)) or np.any(host < 0):
            raise ValueError(f"{name} must be finite and non-negative")
    return arr


def rank_load(slot_load, num_ranks: int):
    """Sums per-slot loads ``[..., P]`` into per-rank loads ``[..., G]`` (slot p on rank p // (P/G))."""
    xp = _xp(slot_load)
    num_ranks = check_int("num_ranks", num_ranks, minimum=1)
    slot_load = _loads("slot_load", slot_load, xp)
    num_physical = slot_load.shape[-1]
    if num_physical % num_ranks:
        raise ValueError(f"{num_physical} slots are not divisible by {num_ranks} ranks")
    return slot_load.reshape(*slot_load.shape[:-1], num_ranks, num_physical // num_ranks).sum(-1)


def slot_load_from_logical(logical_load, phy2log):
    """Per-slot loads ``[L, P]`` when each expert's load ``[L, E]`` splits evenly over its replicas.

    ``phy2log`` is ``[L, P]`` (or ``[P]``, shared by all layers) with ids in
    ``[0, E)``, checked where concrete; under ``jit`` an id outside that range
    reads a clamped expert.
    """
    xp = _xp(logical_load, phy2log)
    logical_load = _loads("logical_load", logical_load, xp)
    if logical_load.ndim != 2:
        raise ValueError(f"logical_load must have shape [L, E], got {logical_load.shape}")
    num_layers, num_logical = logical_load.shape
    phy2log = xp.asarray(phy2log)
    if phy2log.dtype.kind not in "iu":
        raise ValueError(f"phy2log must hold integer expert ids, got dtype {phy2log.dtype}")
    if phy2log.ndim not in (1, 2) or (phy2log.ndim == 2 and phy2log.shape[0] != num_layers):
        raise ValueError(f"phy2log must have shape [L={num_layers}, P] or [P], got {phy2log.shape}")
    if is_concrete(phy2log) and phy2log.size:
        host = np.asarray(phy2log)
        bad = (host < 0) | (host >= num_logical)
        if np.any(bad):
            index = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"phy2log{list(index)} = {host[index]} is outside the expert range [0, {num_logical})")
    phy2log = xp.broadcast_to(phy2log, (num_layers, phy2log.shape[-1]))
    # Replica counts: one-hot sum (works identically for numpy and jax, and under jit).
    onehot = phy2log[..., None] == xp.arange(num_logical)[None, None, :]
    logcnt = onehot.sum(1)
    loads = logical_load.astype(jnp.float32 if xp is jnp else np.float64)
    per_replica = loads / xp.maximum(logcnt, 1).astype(loads.dtype)
    if xp is jnp:
        return jnp.take_along_axis(per_replica, phy2log, axis=1)
    return np.take_along_axis(np.asarray(per_replica), np.asarray(phy2log), axis=1)


def rank_load_from_logical(logical_load, phy2log, num_ranks: int):
    """Per-rank loads ``[L, G]`` from logical loads ``[L, E]`` and a placement ``phy2log [L, P]``."""
    return rank_load(slot_load_from_logical(logical_load, phy2log), num_ranks)


def _float(loads, xp):
    return loads.astype(jnp.float32 if xp is jnp else np.float64)


def balancedness(rank_loads):
    """``sum_l mean_g / sum_l max_g`` of per-rank loads ``[L, G]`` (or ``[G]``); 1.0 when there is no load."""
    xp = _xp(rank_loads)
    loads = _float(_loads("rank_loads", rank_loads, xp), xp)
    loads = loads.reshape(-1, loads.shape[-1])
    num_layers, num_ranks = loads.shape
    # Each term is divided by L (and G) before it is summed, so no sum exceeds the largest load.
    total_mean = ((loads / num_ranks).sum(-1) / num_layers).sum()
    total_max = (loads.max(-1) / num_layers).sum()
    return xp.where(total_max > 0, total_mean / xp.where(total_max > 0, total_max, 1), 1.0)


def rank_imbalance(rank_loads):
    """Per-layer ``max_g / mean_g`` of per-rank loads ``[L, G]`` -> ``[L]`` (1.0 for a layer with no load)."""
    xp = _xp(rank_loads)
    loads = _float(_loads("rank_loads", rank_loads, xp), xp)
    mean = (loads / loads.shape[-1]).sum(-1)  # divided before the sum: it cannot overflow
    return xp.where(mean > 0, loads.max(-1) / xp.where(mean > 0, mean, 1), 1.0)

"""Online (quota) placement policy, registered as ``"online"`` (alias ``"quota"``).

The L1 side of per-batch balancing. Every rank keeps ``H = E / G`` fixed home
experts (expert ``e`` on rank ``e // H``, in slot ``e % H`` of the rank) and
``S = P / G - H`` spare slots that :func:`moe_eplb_jax.routing.plan_quotas`
fills with replicas of the hottest experts. Home slots never move, so an
online refresh only ever rewrites spare slots (see :func:`refresh_phy2log`).

Through the registry interface (``weight [L, E]`` -> tables) the policy plans
on the given loads and fills spare slots the planner left unused with further
replicas (largest load per replica first, never a second copy on one rank),
so the result is a complete :class:`~moe_eplb_jax.placement.Placement`.
Inside a step, call ``plan_quotas`` directly on the batch's counts and route
with ``map_and_count(mode="quota")``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from moe_eplb_jax.placement import build_log2phy
from moe_eplb_jax.policy._registry import register
from moe_eplb_jax.routing.quota import plan_quotas

__all__ = ["online_policy", "home_layout", "fill_unused_spares", "refresh_phy2log"]

_TOKEN_SCALE = 1 << 20  # float loads are scaled to integers summing to about this per layer


def home_layout(num_logical: int, num_physical: int, num_gpus: int) -> tuple[int, int]:
    """``(H, S)``: home experts and spare slots per rank; ``ValueError`` when the sizes do not fit."""
    if num_gpus < 1 or num_physical % num_gpus:
        raise ValueError(f"num_replicas ({num_physical}) must be divisible by num_gpus ({num_gpus})")
    if num_logical % num_gpus:
        raise ValueError(f"the online policy needs E ({num_logical}) divisible by num_gpus ({num_gpus})")
    num_home = num_logical // num_gpus
    num_spare = num_physical // num_gpus - num_home
    if num_spare < 0:
        raise ValueError(f"fewer slots ({num_physical}) than experts ({num_logical})")
    return num_home, num_spare


@functools.lru_cache(maxsize=32)
def _planner(num_home: int, num_spare: int):
    plan = functools.partial(plan_quotas, num_home=num_home, num_spare=num_spare, with_quota=False)
    return jax.jit(jax.vmap(lambda c: plan(c).phy2log))


def fill_unused_spares(phy2log: np.ndarray, weight: np.ndarray, num_home: int, num_spare: int) -> np.ndarray:
    """Fills ``-1`` spare slots of ``phy2log [P]`` with replicas: largest load per replica first.

    A rank never gets a second copy of an expert it already holds (unless it
    holds every expert). Returns a new ``[P]`` array.
    """
    phy2log = np.array(phy2log, dtype=np.int64)
    slots_per_rank = num_home + num_spare
    num_ranks = phy2log.size // slots_per_rank
    num_logical = weight.size
    count = np.bincount(phy2log[phy2log >= 0], minlength=num_logical).astype(np.float64)
    for slot in np.flatnonzero(phy2log < 0):
        rank = slot // slots_per_rank
        held = phy2log[rank * slots_per_rank : (rank + 1) * slots_per_rank]
        score = weight / count
        score[held[held >= 0]] = -np.inf
        if np.all(np.isinf(score)):
            score = weight / count
        e = int(np.argmax(score))
        phy2log[slot] = e
        count[e] += 1
    del num_ranks
    return phy2log


def _integer_counts(weight: np.ndarray, num_home: int) -> np.ndarray:
    """``[L, G, E]`` counts with each expert's (integer-scaled) load sent from its home rank."""
    num_layers, num_logical = weight.shape
    if np.issubdtype(weight.dtype, np.integer) and weight.max(initial=0) < 2**30 // max(num_logical, 1):
        tokens = weight.astype(np.int64)
    else:
        totals = np.maximum(weight.sum(1, keepdims=True), 1e-300)
        tokens = np.round(weight / totals * _TOKEN_SCALE).astype(np.int64)
    num_ranks = num_logical // num_home
    counts = np.zeros((num_layers, num_ranks, num_logical), np.int32)
    home = np.arange(num_logical) // num_home
    counts[:, home, np.arange(num_logical)] = tokens
    return counts


def online_policy(weight, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int, old_phy2log=None):
    """Registry entry: home experts fixed, spare slots planned by ``plan_quotas`` on ``weight [L, E]``.

    ``num_groups`` / ``num_nodes`` are ignored; ``old_phy2log`` is ignored too
    (home slots never move, so nothing is gained by relabelling).
    """
    weight = np.asarray(weight)
    if weight.ndim != 2:
        raise ValueError(f"weight must have shape [L, E], got {weight.shape}")
    if not np.all(np.isfinite(weight)) or np.any(weight < 0):
        raise ValueError("weight must be finite and non-negative")
    num_layers, num_logical = weight.shape
    num_home, num_spare = home_layout(num_logical, int(num_replicas), int(num_gpus))
    counts = _integer_counts(weight, num_home)
    planned = np.asarray(_planner(num_home, num_spare)(jnp.asarray(counts)))
    phy2log = np.stack(
        [
            fill_unused_spares(planned[layer], weight[layer].astype(np.float64), num_home, num_spare)
            for layer in range(num_layers)
        ]
    ).astype(np.int32)
    log2phy, logcnt = build_log2phy(phy2log, num_logical)
    return phy2log, log2phy, logcnt


def refresh_phy2log(old_phy2log, planned_phy2log):
    """The ``phy2log`` to hand the transport for an online refresh: unused (``-1``) spares keep their old expert.

    Home slots are equal in both by construction, so only spare slots whose
    expert changed move bytes. Works for numpy and jax arrays of any shape.
    """
    xp = jnp if isinstance(planned_phy2log, jax.Array) else np
    if np.shape(old_phy2log) != np.shape(planned_phy2log):
        raise ValueError(f"phy2log shapes differ: {np.shape(old_phy2log)} vs {np.shape(planned_phy2log)}")
    return xp.where(planned_phy2log >= 0, planned_phy2log, old_phy2log)


register("online", online_policy, overwrite=True)
register("quota", online_policy, overwrite=True)

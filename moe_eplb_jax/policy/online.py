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
Given ``old_phy2log`` (a refresh: the controller calls the policy every
``refresh_interval`` steps on the window's loads), a rank's spare experts that
it already held keep their slots, so only the spare slots whose expert
changes move bytes (:func:`keep_spare_slots`); home slots never move.
The per-batch side is the MoE layer's ``routing="quota"``: quotas over the
replicas this placement holds (``moe_eplb_jax.routing.plan_fixed_quotas``).

Never worse than ``lp``: the planner fills spares for the spare-slot model
(any expert, per batch), not for quotas over fixed replicas, and fixed homes
can hold a layer's hot experts together. So each layer's result is checked
against its routing bound -- the least largest rank load any split of the
loads over its replicas reaches (the LP ``lp`` and the per-batch quotas solve,
:func:`moe_eplb_jax.routing.lp_shares_reference`) -- and a layer whose
``"balanced"`` placement (what ``lp`` routes over, on the same slots) has a
lower bound takes that placement instead: its home slots move then.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from moe_eplb_jax._checks import INT32_MAX, check_int
from moe_eplb_jax.placement import build_log2phy, check_placement_size
from moe_eplb_jax.policy._registry import register
from moe_eplb_jax.policy.balanced import rebalance_balanced
from moe_eplb_jax.policy.deepseek import check_old_phy2log, check_weight
from moe_eplb_jax.routing.lp import lp_shares_reference
from moe_eplb_jax.routing.quota import plan_quotas

__all__ = [
    "fill_unused_spares",
    "home_layout",
    "keep_spare_slots",
    "online_policy",
    "refresh_phy2log",
    "routing_bound",
]

_TOKEN_SCALE = 1 << 20  # float loads are scaled to integers summing to about this per layer


def home_layout(num_logical: int, num_physical: int, num_gpus: int) -> tuple[int, int]:
    """``(H, S)``: home experts and spare slots per rank; ``ValueError`` when the sizes do not fit."""
    num_logical = check_int("num_logical", num_logical, minimum=1)
    num_physical = check_int("num_replicas", num_physical, minimum=1)
    num_gpus = check_int("num_gpus", num_gpus, minimum=1)
    if num_physical % num_gpus:
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
    num_home = check_int("num_home", num_home, minimum=1)
    num_spare = check_int("num_spare", num_spare, minimum=0)
    weight = np.asarray(weight)
    phy2log = np.asarray(phy2log)
    slots_per_rank = num_home + num_spare
    if phy2log.ndim != 1 or phy2log.dtype.kind not in "iu" or phy2log.size % slots_per_rank:
        raise ValueError(f"phy2log must be integer ids of shape [G * (H + S)], got {phy2log.dtype} {phy2log.shape}")
    num_ranks = phy2log.size // slots_per_rank
    if weight.shape != (num_ranks * num_home,) or weight.dtype.kind not in "iuf":
        raise ValueError(f"weight must be numbers of shape [E = {num_ranks * num_home}], got {weight.shape}")
    if not np.all(np.isfinite(weight)) or np.any(weight < 0):
        raise ValueError("weight must be finite and non-negative")
    num_logical = weight.size
    if np.any((phy2log < -1) | (phy2log >= num_logical)):
        raise ValueError(f"phy2log holds ids outside [-1, {num_logical})")
    phy2log = phy2log.astype(np.int64)
    weight = weight.astype(np.float64)
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
    return phy2log


def _integer_counts(weight: np.ndarray, num_home: int, *, whole_tokens: bool) -> np.ndarray:
    """``[L, G, E]`` counts with each expert's (integer-scaled) load sent from its home rank.

    Whole-token loads small enough for the planner's int32 sums are used as
    they are; any other load is scaled to about ``_TOKEN_SCALE`` per layer.
    """
    num_layers, num_logical = weight.shape
    if whole_tokens and weight.max(initial=0) < 2**30 // max(num_logical, 1):
        tokens = weight.astype(np.int64)
    else:
        totals = np.maximum(weight.sum(1, keepdims=True), 1e-300)
        tokens = np.round(weight / totals * _TOKEN_SCALE).astype(np.int64)
    num_ranks = num_logical // num_home
    counts = np.zeros((num_layers, num_ranks, num_logical), np.int32)
    home = np.arange(num_logical) // num_home
    counts[:, home, np.arange(num_logical)] = tokens
    return counts


def keep_spare_slots(phy2log: np.ndarray, old_phy2log: np.ndarray, num_home: int, num_spare: int) -> np.ndarray:
    """``phy2log [P]`` with each rank's spare experts reordered so those ``old_phy2log [P]`` already held there
    keep their slot (the same experts per rank: the same placement, fewer slots to move). Returns a new array."""
    phy2log = np.array(phy2log, dtype=np.int64)
    old = np.asarray(old_phy2log)
    slots_per_rank = num_home + num_spare
    for start in range(num_home, phy2log.size, slots_per_rank):
        new_spares, old_spares = list(phy2log[start : start + num_spare]), old[start : start + num_spare]
        kept = [-1] * num_spare
        for k, expert in enumerate(old_spares):
            if expert in new_spares:
                kept[k] = int(expert)
                new_spares.remove(expert)
        rest = iter(new_spares)
        phy2log[start : start + num_spare] = [expert if expert >= 0 else next(rest) for expert in kept]
    return phy2log


def online_policy(weight, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int, old_phy2log=None):
    """Registry entry: home experts fixed, spare slots planned by ``plan_quotas`` on ``weight [L, E]``.

    ``num_groups`` / ``num_nodes`` are ignored. With ``old_phy2log [L, P]``
    each rank's spare experts that it already held stay in their slots
    (:func:`keep_spare_slots`). ``weight`` is checked like every policy's
    (numbers, finite, non-negative, at least one layer and one expert).
    """
    num_replicas = check_int("num_replicas", num_replicas, minimum=1, maximum=INT32_MAX)
    check_int("num_groups", num_groups, minimum=1)
    check_int("num_nodes", num_nodes, minimum=1)
    num_gpus = check_int("num_gpus", num_gpus, minimum=1)
    whole_tokens = np.asarray(weight).dtype.kind in "iu"
    weight = check_weight(weight)
    num_layers, num_logical = weight.shape
    num_home, num_spare = home_layout(num_logical, num_replicas, num_gpus)
    check_placement_size(num_layers, num_logical, num_replicas, physical_name="num_replicas")
    check_old_phy2log(old_phy2log, num_layers, num_replicas, num_logical)
    counts = _integer_counts(weight, num_home, whole_tokens=whole_tokens)
    planned = np.asarray(_planner(num_home, num_spare)(jnp.asarray(counts)))
    phy2log = np.stack(
        [
            fill_unused_spares(planned[layer], weight[layer].astype(np.float64), num_home, num_spare)
            for layer in range(num_layers)
        ]
    )
    if old_phy2log is not None:
        old = np.asarray(old_phy2log)
        if old.shape != phy2log.shape:
            raise ValueError(f"old_phy2log must have shape [L, P] = {phy2log.shape}, got {old.shape}")
        phy2log = np.stack([keep_spare_slots(phy2log[i], old[i], num_home, num_spare) for i in range(num_layers)])
    phy2log = _no_worse_than_balanced(weight, phy2log.astype(np.int32), num_gpus, old_phy2log)
    log2phy, logcnt = build_log2phy(phy2log, num_logical)
    return phy2log, log2phy, logcnt


def routing_bound(weight, phy2log, num_gpus: int) -> np.ndarray:
    """``[L]`` the least largest rank load each layer's replicas allow for ``weight [L, E]`` (the routing LP)."""
    weight, phy2log = np.asarray(weight, np.float64), np.asarray(phy2log)
    num_physical = phy2log.shape[1]
    log2phy, logcnt = build_log2phy(phy2log, weight.shape[1])
    return np.array(
        [
            lp_shares_reference(w, table, count, num_physical=num_physical, num_ranks=num_gpus)[1]
            for w, table, count in zip(weight, log2phy, logcnt)
        ]
    )


def _no_worse_than_balanced(weight, phy2log, num_gpus, old_phy2log):
    """``phy2log``, each layer whose routing bound the ``"balanced"`` placement beats taking that one instead."""
    num_physical = phy2log.shape[1]
    balanced, _, _ = rebalance_balanced(weight, num_physical, 1, 1, num_gpus, old_phy2log=old_phy2log)
    ours, theirs = routing_bound(weight, phy2log, num_gpus), routing_bound(weight, balanced, num_gpus)
    worse = theirs < ours * (1 - _BOUND_TOLERANCE)  # ties keep the home layout: only its spares move
    return np.where(worse[:, None], balanced, phy2log).astype(np.int32)


# A fallback must lower the bound by more than this fraction: an LP solver's round-off never swaps layouts.
_BOUND_TOLERANCE = 1e-6


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

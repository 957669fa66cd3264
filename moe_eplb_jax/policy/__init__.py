"""Placement (L1) policies behind one interface and a name registry.

* ``get("deepseek")`` -- DeepSeek's hierarchical / global EPLB algorithm
  (:func:`rebalance_experts`), vectorised over layers and nodes;
* ``get("online")`` (alias ``"quota"``) -- fixed home experts plus spare slots
  planned by :func:`moe_eplb_jax.routing.plan_quotas` (UltraEP-style);
* ``get("balanced")`` -- the same replication, with each node's GPU packing
  refined by swaps (:func:`rebalance_balanced`); never less balanced, the
  recommended default.

Every policy takes ``old_phy2log`` to keep experts in their old slots (``-1``
there: a slot that holds nothing). :func:`resize_placement` solves a placement
for another EP size with any of them, keeping what each device already holds.
``DEFAULT_POLICY`` names the library's default (``"balanced"``);
:func:`compute_placement` runs the policy an ``EplbConfig`` names and returns
a validated ``Placement``.
"""

from moe_eplb_jax.policy._preserve import moved_slots, preserve_slots
from moe_eplb_jax.policy._registry import PlacementPolicy, available, get, register
from moe_eplb_jax.policy.balanced import rebalance_balanced
from moe_eplb_jax.policy.compute import compute_placement
from moe_eplb_jax.policy.deepseek import rebalance_experts
from moe_eplb_jax.policy.deepseek_reference import rebalance_experts_reference
from moe_eplb_jax.policy.resize import FILL, carry_phy2log, fill_empty_slots, rank_map, resize_placement

DEFAULT_POLICY = "balanced"

register("deepseek", rebalance_experts)
register("balanced", rebalance_balanced)

# Registers "online" / "quota" (the L1 side of per-batch quota balancing).
from moe_eplb_jax.policy import online  # noqa: E402,F401

__all__ = [
    "DEFAULT_POLICY",
    "FILL",
    "PlacementPolicy",
    "available",
    "carry_phy2log",
    "compute_placement",
    "fill_empty_slots",
    "get",
    "moved_slots",
    "preserve_slots",
    "rank_map",
    "rebalance_balanced",
    "rebalance_experts",
    "rebalance_experts_reference",
    "register",
    "resize_placement",
]

"""Replica (L2) routing rules and their tables.

* :func:`plan_quotas` -- per-batch spare-slot placement and per-replica token
  quotas (UltraEP-style), consumed by ``map_and_count(mode="quota")``;
* :func:`lp_shares` / :func:`lp_shares_reference` -- replica shares minimising the
  max rank load (LPLB-style; on device / exact HiGHS), for ``mode="lp"``;
* :func:`waterfill_assign` / :func:`waterfill_shares` -- where a shared expert's
  work runs, by the slack the routed load leaves;
* :data:`ROUTING_MODES` -- the L2 names ``EplbConfig.routing``, ``MoELayer`` and
  ``map_and_count(mode=...)`` accept; :func:`check_routing` checks one.
"""

from moe_eplb_jax.routing.lp import lp_shares, lp_shares_reference, shares_rank_load
from moe_eplb_jax.routing.quota import QuotaPlan, check_counts, default_max_replicas, plan_quotas
from moe_eplb_jax.routing.waterfill import waterfill_assign, waterfill_reference_level, waterfill_shares

# "hash" (stateless token hash), "round_robin", "lp" (LP replica shares), "quota" (per-batch quotas).
ROUTING_MODES = ("hash", "round_robin", "lp", "quota")


def check_routing(routing: str) -> str:
    """``routing`` itself once it is one of :data:`ROUTING_MODES`; ``ValueError`` naming the known ones otherwise."""
    if routing not in ROUTING_MODES:
        raise ValueError(f"unknown routing {routing!r}; known: {list(ROUTING_MODES)}")
    return routing


map_and_count_mode = check_routing  # the name EplbConfig imports: routing names are map_and_count's modes

__all__ = [
    "QuotaPlan",
    "ROUTING_MODES",
    "check_counts",
    "check_routing",
    "default_max_replicas",
    "lp_shares",
    "lp_shares_reference",
    "plan_quotas",
    "shares_rank_load",
    "waterfill_assign",
    "waterfill_reference_level",
    "waterfill_shares",
]

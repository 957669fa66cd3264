"""Replica (L2) routing rules and their tables.

* :func:`plan_quotas` -- per-batch spare-slot placement and per-replica token
  quotas (UltraEP-style), consumed by ``map_and_count(mode="resolved")``;
* :func:`lp_shares` / :func:`lp_shares_reference` -- replica shares minimising the
  max rank load (LPLB-style; on device / exact HiGHS), for ``mode="shares"``;
* :func:`waterfill_assign` / :func:`waterfill_shares` -- where a shared expert's
  work runs, by the slack the routed load leaves;
* :data:`ROUTING_MODES` -- the L2 names ``EplbConfig.routing`` accepts.
"""

from moe_eplb_jax.routing.lp import lp_shares, lp_shares_reference, shares_rank_load
from moe_eplb_jax.routing.quota import QuotaPlan, check_counts, default_max_replicas, plan_quotas
from moe_eplb_jax.routing.waterfill import waterfill_assign, waterfill_reference_level, waterfill_shares

# L2 modes: "hash" (stateless token hash), "round_robin", "lp" (LP replica shares), "quota" (per-batch quotas).
ROUTING_MODES = ("hash", "round_robin", "lp", "quota")


def map_and_count_mode(routing: str) -> str:
    """The ``map_and_count`` mode behind an L2 routing name; ``ValueError`` for an unknown name."""
    modes = {
        "hash": "hash",
        "round_robin": "round_robin",
        "lp": "shares",
        "shares": "shares",
        "quota": "resolved",
        "resolved": "resolved",
    }
    if routing not in modes:
        raise ValueError(f"unknown routing {routing!r}; known: {sorted(modes)}")
    return modes[routing]


__all__ = [
    "QuotaPlan",
    "ROUTING_MODES",
    "check_counts",
    "default_max_replicas",
    "lp_shares",
    "lp_shares_reference",
    "map_and_count_mode",
    "plan_quotas",
    "shares_rank_load",
    "waterfill_assign",
    "waterfill_reference_level",
    "waterfill_shares",
]

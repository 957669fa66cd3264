"""Replica (L2) routing rules and their tables.

* :func:`plan_fixed_quotas` / :func:`batch_quotas` -- per-batch token quotas
  over the replicas the placement already has: the MoE layer's
  ``routing="quota"``, consumed by ``map_and_count(mode="quota")``;
* :func:`routing_tables` / :func:`stacked_routing_tables` -- per layer, the
  tables a mode reads, solved at each rearrangement (``"lp"``: replica
  shares), for ``eplb_set_placement``;
* :func:`plan_quotas` -- per-batch spare-slot placement and per-replica token
  quotas (UltraEP-style, spares chosen per batch), consumed by
  ``map_and_count(mode="quota")``;
* :func:`lp_shares` / :func:`lp_shares_reference` -- replica shares minimising the
  max rank load (LPLB-style; on device / exact HiGHS), for ``mode="lp"``;
* :func:`waterfill_assign` / :func:`waterfill_shares` -- where a shared expert's
  work runs, by the slack the routed load leaves;
* :func:`map_and_count` / :func:`lookup_table` -- the fused replica mapping and load
  counting (Pallas GPU kernels tiled by a :class:`MapAndCountConfig`, a pure-jnp reference) and its
  per-placement lookup table;
* :data:`MODES` / :func:`routing_mode` -- the registry of routing modes (:class:`RoutingMode`: what each reads,
  its ``map_and_count`` rule, the policy it needs) that ``EplbConfig.routing``, ``MoELayer``, ``moe_apply`` and
  ``map_and_count(mode=...)`` consult; :data:`ROUTING_MODES` their names; :func:`mode_lookup` a layer's lookup
  table for its mode.
"""

from moe_eplb_jax.routing._map_and_count import IMPLEMENTATIONS as MAP_AND_COUNT_IMPLEMENTATIONS
from moe_eplb_jax.routing._map_and_count import Config as MapAndCountConfig
from moe_eplb_jax.routing._map_and_count import lookup_table, map_and_count
from moe_eplb_jax.routing.fixed_quota import FixedQuotaPlan, batch_quotas, plan_fixed_quotas
from moe_eplb_jax.routing.lp import lp_shares, lp_shares_reference, shares_rank_load
from moe_eplb_jax.routing.modes import MODES, ROUTING_MODES, RoutingMode, check_routing, routing_mode
from moe_eplb_jax.routing.quota import QuotaPlan, check_counts, default_max_replicas, plan_quotas
from moe_eplb_jax.routing.tables import equal_shares, mode_lookup, routing_tables, stacked_routing_tables
from moe_eplb_jax.routing.waterfill import waterfill_assign, waterfill_reference_level, waterfill_shares

__all__ = [
    "MAP_AND_COUNT_IMPLEMENTATIONS",
    "MODES",
    "FixedQuotaPlan",
    "MapAndCountConfig",
    "QuotaPlan",
    "ROUTING_MODES",
    "RoutingMode",
    "batch_quotas",
    "check_counts",
    "check_routing",
    "default_max_replicas",
    "equal_shares",
    "lookup_table",
    "lp_shares",
    "lp_shares_reference",
    "map_and_count",
    "mode_lookup",
    "plan_fixed_quotas",
    "plan_quotas",
    "routing_mode",
    "routing_tables",
    "shares_rank_load",
    "stacked_routing_tables",
    "waterfill_assign",
    "waterfill_reference_level",
    "waterfill_shares",
]

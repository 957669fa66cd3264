"""``search``: the quota planner's target search, by the implementation asked for."""

from __future__ import annotations

from moe_eplb_jax.routing._quota_search._triton import search_pallas
from moe_eplb_jax.routing._quota_search.config import IMPLEMENTATIONS
from moe_eplb_jax.routing._quota_search.reference import search_reference

__all__ = ["search"]


def search(
    load,
    *,
    implementation: str,
    num_home: int,
    num_spare: int,
    min_replica_tokens: int,
    max_replicas: int,
    search_rounds: int,
    search_width: int,
):
    """The smallest feasible target the K-ary search finds over ``[ceil(mean), max home load]``, and its layout.

    ``load [E]`` int32: each expert's load (expert-id order, ``E = G * num_home``). Returns ``(target,
    d_hi [E], s_lo [G], x_end, demand_expert [E], rank_position [G])``: the target, where each demand ends
    and each supply rank starts on the shared token axis, where the last rank ends, the expert at each place
    of the demand order and each rank's place in the supply order. ``implementation``: one of
    :data:`IMPLEMENTATIONS`, the same integers either way.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    run = search_pallas if implementation == "pallas" else search_reference
    return run(
        load,
        num_home=num_home,
        num_spare=num_spare,
        min_replica_tokens=min_replica_tokens,
        max_replicas=max_replicas,
        search_rounds=search_rounds,
        search_width=search_width,
    )

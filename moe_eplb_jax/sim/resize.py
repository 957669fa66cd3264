"""A scale event in the simulator: balancedness, bytes moved and time of a move between EP sizes.

:func:`simulate_resize` solves the placement for ``G'`` ranks from a load
window (:func:`moe_eplb_jax.policy.resize_placement`, one report per policy),
plans the move (:func:`moe_eplb_jax.transport.plan_resize`: local copies free,
each missing (device, layer, expert) received once, experts only lost ranks
held reloaded from the host) and models its time as the busiest device's
transfer -- ``max(rows sent, rows received)`` expert rows over ``link_gbps`` --
plus its reloaded rows over ``reload_gbps``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moe_eplb_jax._checks import check_real
from moe_eplb_jax.metrics import balancedness, rank_imbalance, rank_load_from_logical
from moe_eplb_jax.placement import Placement
from moe_eplb_jax.policy import rank_map, resize_placement
from moe_eplb_jax.sim.loadfile import _check_load
from moe_eplb_jax.transport.resize_plan import plan_resize

__all__ = ["ResizeReport", "simulate_resize", "format_resize_table"]


@dataclasses.dataclass
class ResizeReport:
    """One policy's scale event: the new placement, its balance and the move's cost (numbers are host floats)."""

    policy: str
    placement: Placement
    num_ranks: int
    new_num_ranks: int
    balancedness_before: float  # the old placement on the old ranks
    balancedness_after: float
    imbalance_before: np.ndarray  # [L] max / mean rank load
    imbalance_after: np.ndarray
    rows_moved: int  # expert rows over the network, in total
    rows_reloaded: int  # expert rows read from the checkpoint (experts only lost ranks held)
    busiest_rows: int  # the most rows one device sends or receives
    bytes_moved: float
    bytes_reloaded: float
    time_ms: float


def simulate_resize(
    load,
    old_phy2log,
    *,
    num_ranks: int,
    new_num_ranks: int,
    new_num_physical: int | None = None,
    policies=("fill", "balanced"),
    num_groups: int = 1,
    num_nodes: int = 1,
    new_rank_of_old=None,
    lost_ranks=(),
    expert_bytes: float = 44e6,
    link_gbps: float = 400.0,
    reload_gbps: float = 10.0,
) -> list[ResizeReport]:
    """A scale event from ``old_phy2log [L, P]`` on ``num_ranks`` ranks to ``new_num_ranks``, one report per policy.

    ``load`` is the window the new placement is solved on, ``[steps, L, E]``
    (averaged) or ``[L, E]``; ``policies`` are registered policy names or
    ``"fill"`` (keep every carried slot); the rest as
    :func:`moe_eplb_jax.policy.resize_placement`. ``expert_bytes`` is one
    expert's bytes (a row of every per-expert leaf), ``link_gbps`` a device's
    link speed, ``reload_gbps`` a device's checkpoint read speed.
    """
    load = np.asarray(load)
    weight = _check_load(load[None] if load.ndim == 2 else load, "simulate_resize").mean(axis=0)
    expert_bytes = check_real("expert_bytes", expert_bytes, minimum=0.0)
    link_gbps = check_real("link_gbps", link_gbps, positive=True)
    reload_gbps = check_real("reload_gbps", reload_gbps, positive=True)
    if isinstance(policies, str):
        policies = (policies,)
    old = np.atleast_2d(np.asarray(getattr(old_phy2log, "phy2log", old_phy2log)))
    if old.shape[0] != weight.shape[0] or old.dtype.kind not in "iu":
        raise ValueError(f"old_phy2log must be expert ids [L = {weight.shape[0]}, P], got {old.dtype} {old.shape}")
    before = np.asarray(rank_load_from_logical(weight, old, num_ranks))
    reports = []
    for name in policies:
        placement = resize_placement(
            weight,
            old,
            num_ranks=num_ranks,
            new_num_ranks=new_num_ranks,
            new_num_physical=new_num_physical,
            policy=name,
            num_groups=num_groups,
            num_nodes=num_nodes,
            new_rank_of_old=new_rank_of_old,
            lost_ranks=lost_ranks,
        )
        mapping = rank_map(num_ranks, new_num_ranks, new_rank_of_old=new_rank_of_old, lost_ranks=lost_ranks)
        plan = plan_resize(
            old,
            placement.phy2log,
            num_ranks,
            new_num_ranks,
            new_rank_of_old=mapping,
            lost_ranks=lost_ranks,
            reload=True,
        )
        after = np.asarray(rank_load_from_logical(weight, placement.phy2log, new_num_ranks))
        busiest = int(max(plan.rows_sent.max(), plan.rows_received.max())) if plan.num_members > 1 else 0
        reloaded = int(plan.reload_count.sum())
        time_s = busiest * expert_bytes / (link_gbps * 1e9) + plan.reload_count.max() * expert_bytes / (
            reload_gbps * 1e9
        )
        reports.append(
            ResizeReport(
                policy=name,
                placement=placement,
                num_ranks=int(num_ranks),
                new_num_ranks=int(new_num_ranks),
                balancedness_before=float(balancedness(before)),
                balancedness_after=float(balancedness(after)),
                imbalance_before=np.asarray(rank_imbalance(before)),
                imbalance_after=np.asarray(rank_imbalance(after)),
                rows_moved=plan.rows_moved,
                rows_reloaded=reloaded,
                busiest_rows=busiest,
                bytes_moved=float(plan.rows_moved * expert_bytes),
                bytes_reloaded=float(reloaded * expert_bytes),
                time_ms=float(time_s * 1e3),
            )
        )
    return reports


def format_resize_table(reports: list[ResizeReport]) -> str:
    """A fixed-width text table, one row per policy."""
    head = (
        f"{'policy':<10} {'EP':>7} {'balanced before':>15} {'after':>7} {'rows moved':>10} {'reloaded':>8} "
        f"{'busiest':>7} {'GB moved':>9} {'time ms':>9}"
    )
    rows = [head, "-" * len(head)]
    for r in reports:
        rows.append(
            f"{r.policy:<10} {f'{r.num_ranks}->{r.new_num_ranks}':>7} {r.balancedness_before:15.4f} "
            f"{r.balancedness_after:7.4f} {r.rows_moved:10d} {r.rows_reloaded:8d} {r.busiest_rows:7d} "
            f"{r.bytes_moved / 1e9:9.2f} {r.time_ms:9.2f}"
        )
    return "\n".join(rows)

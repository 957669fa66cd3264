"""``compute_placement``: the configured policy run on a window's logical loads, its tables validated."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from moe_eplb_jax.placement import Placement
from moe_eplb_jax.policy._registry import get

if TYPE_CHECKING:  # the config validates policy names against this package: imported for the annotation only
    from moe_eplb_jax.config import EplbConfig

__all__ = ["compute_placement"]


def compute_placement(logical_load, config: EplbConfig, *, old_phy2log=None) -> Placement:
    """Runs the configured policy on host loads ``[L, E]`` and returns a validated ``Placement``.

    With ``old_phy2log`` the policy keeps experts that stay on a rank in their
    old slot, so the rearrangement moves as few bytes as possible.
    """
    load = np.asarray(logical_load, dtype=np.float64)
    if load.ndim != 2:
        raise ValueError(f"logical_load must have shape [L, E], got {load.shape}")
    if not np.all(np.isfinite(load)) or np.any(load < 0):
        raise ValueError("logical_load must be finite and non-negative")
    num_logical = load.shape[1]
    num_physical = config.num_physical(num_logical)
    if old_phy2log is not None:
        old_phy2log = np.asarray(old_phy2log)
        if old_phy2log.shape != (load.shape[0], num_physical):
            raise ValueError(f"old_phy2log must have shape {(load.shape[0], num_physical)}, got {old_phy2log.shape}")
    fn = get(config.policy)
    phy2log, log2phy, logcnt = fn(
        load, num_physical, config.num_groups, config.num_nodes, config.num_gpus, old_phy2log=old_phy2log
    )
    return Placement.from_tables(phy2log, log2phy, logcnt, num_ranks=config.num_gpus)

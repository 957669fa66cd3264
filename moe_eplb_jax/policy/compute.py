"""``compute_placement``: the configured policy run on a window's logical loads, its tables validated."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from moe_eplb_jax.placement import Placement
from moe_eplb_jax.policy._registry import get
from moe_eplb_jax.policy.deepseek import check_weight

if TYPE_CHECKING:
    from moe_eplb_jax.config import EplbConfig

__all__ = ["compute_placement"]


def compute_placement(logical_load, config: EplbConfig, *, old_phy2log=None) -> Placement:
    """Runs the configured policy on host loads ``[L, E]`` and returns a validated ``Placement``.

    With ``old_phy2log`` the policy keeps experts that stay on a rank in their
    old slot, so the rearrangement moves as few bytes as possible.
    """
    from moe_eplb_jax.config import EplbConfig  # config.py checks policy names against this package: a cycle

    if not isinstance(config, EplbConfig):
        raise ValueError(f"config must be an EplbConfig, got {type(config).__name__}")
    load = check_weight(logical_load, name="logical_load")
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

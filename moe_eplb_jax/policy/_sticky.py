"""A placement grown from the old one: the candidate that lets ``"balanced"`` move few experts.

DeepSeek's greedy packing is chaotic: a 10% change of loads reshuffles most
GPUs, so even with the best relabelling most slots change expert. When the old
placement keeps every expert group on one node (or the policy runs globally),
:func:`old_based_layout` instead

1. keeps the old node of every group, and replicates within each node as
   DeepSeek does (greedy by load per replica);
2. keeps every old slot whose expert still has a replica to place on that node
   (the first ``count`` of its old copies, in slot order), and gives the freed
   slots to the experts that gained replicas;
3. swaps replicas between GPUs of a node, busiest GPU first (as
   :func:`moe_eplb_jax.policy.balanced.refine_packing`), but only until the
   node's busiest GPU is no busier than ``target`` -- each swap moves two slots.

The caller compares it with the fresh placement, layer by layer.
"""

from __future__ import annotations

import numpy as np

from moe_eplb_jax.policy import _packing
from moe_eplb_jax.policy._preserve import _occurrence
from moe_eplb_jax.policy.deepseek import node_major_order

__all__ = ["old_based_layout"]


def _old_group_nodes(old: np.ndarray, num_experts: int, num_groups: int, num_nodes: int):
    """``(group_node [L, groups], usable [L])``: each group's node in ``old``, and whether that is a partition.

    Empty slots (``-1``) belong to no group.
    """
    num_layers, num_physical = old.shape
    group_size = num_experts // num_groups
    node_of_slot = np.broadcast_to(np.arange(num_physical) // (num_physical // num_nodes), old.shape)
    group_of_slot = np.where(old >= 0, old // group_size, num_groups)  # empty slots: a column dropped below
    rows = np.arange(num_layers)[:, None]
    group_node = np.full((num_layers, num_groups + 1), -1, dtype=np.int64)
    group_node[rows, group_of_slot] = node_of_slot  # any slot of the group; consistency checked next
    consistent = ((group_node[rows, group_of_slot] == node_of_slot) | (old < 0)).all(axis=1)
    group_node = group_node[:, :num_groups]
    present = (group_node >= 0).all(axis=1)
    cell = rows * num_nodes + np.maximum(group_node, 0)
    groups_on_node = np.bincount(cell.ravel(), minlength=num_layers * num_nodes).reshape(num_layers, num_nodes)
    usable = consistent & present & (groups_on_node == num_groups // num_nodes).all(axis=1)
    # Unusable layers get any valid partition so the arrays stay well formed; callers discard them.
    fallback = np.arange(num_groups) // (num_groups // num_nodes)
    return np.where(usable[:, None], group_node, fallback), usable


def old_based_layout(
    weight: np.ndarray,
    old: np.ndarray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    target: np.ndarray,
    refine,
):
    """The old-placement-based candidate (see the module docstring).

    ``weight [L, E]`` float64 and ``old [L, P]`` int64 are validated
    (``-1`` in ``old``: an empty slot, always given to a newcomer);
    ``target [L]`` is the busiest-GPU load to reach per layer; ``refine`` is
    the swap search (``refine_packing``). Returns ``(phy2log, phyrank, logcnt,
    usable [L])``; layers where ``usable`` is False must not be used.
    """
    num_layers, num_experts = weight.shape
    group_size = num_experts // num_groups
    slots_per_node = num_replicas // num_nodes
    gpus_per_node = num_gpus // num_nodes
    slots_per_gpu = num_replicas // num_gpus

    # 1. Old partition of groups onto nodes (groups of a node in ascending id), replication within nodes.
    group_node, usable = _old_group_nodes(old, num_experts, num_groups, num_nodes)
    group_at = np.argsort(group_node * num_groups + np.arange(num_groups), axis=1)
    expert_to_local, local_to_expert = node_major_order(_packing.inverse_permutation(group_at), group_size)
    local_weight = _packing.gather_rows(weight, local_to_expert).reshape(-1, num_experts // num_nodes)
    _, _, count = _packing.replicate(local_weight, slots_per_node)
    logcnt = _packing.gather_rows(count.reshape(num_layers, num_experts), expert_to_local)

    # 2. Keep old slots while their expert has replicas left; freed (and empty) slots go to experts that gained.
    held = old >= 0
    known = np.where(held, old, num_experts)  # empty slots as an id past every expert: counted apart
    keep = held & (_occurrence(known) < _packing.gather_rows(np.pad(logcnt, ((0, 0), (0, 1))), known))
    old_count = np.bincount(
        (known + np.arange(num_layers)[:, None] * (num_experts + 1)).ravel(), minlength=num_layers * (num_experts + 1)
    ).reshape(num_layers, num_experts + 1)[:, :num_experts]
    gained = np.maximum(logcnt - old_count, 0)
    # Both lists run layer by layer and node by node (local order is node-major), so each freed slot
    # is paired with an expert of its own node (per node the two counts agree when usable).
    newcomers = np.repeat(local_to_expert.ravel(), _packing.gather_rows(gained, local_to_expert).ravel())
    phy2log = old.copy()
    phy2log.ravel()[np.flatnonzero(~keep)] = newcomers
    phyrank = _occurrence(phy2log)

    # 3. Swaps within each node until its busiest GPU reaches the target.
    replica_load = _packing.gather_rows(weight / logcnt, phy2log)
    rows = num_layers * num_nodes
    order = refine(replica_load.reshape(rows, gpus_per_node, slots_per_gpu), target=np.repeat(target, num_nodes))
    phy2log, phyrank = (
        _packing.gather_rows(t.reshape(rows, -1), order).reshape(num_layers, num_replicas) for t in (phy2log, phyrank)
    )
    return phy2log, phyrank, logcnt, usable

"""DeepSeek's EPLB algorithm written as plain loops: the test oracle and the benchmark baseline.

One layer at a time, one item at a time, in ordinary Python. It is meant to be
read next to the algorithm's description, not to be fast; the vectorised
:func:`moe_eplb_jax.policy.rebalance_experts` must return exactly what this
returns. Arithmetic is float64 and every sort is stable (ties keep the lower
index first), so the result is deterministic.

The algorithm, for ``E`` logical experts in ``num_groups`` groups, ``N`` nodes
and ``G`` GPUs holding ``P`` physical slots:

1. Pack the expert groups onto the nodes: groups by total load, heaviest first,
   each to the least-loaded node that still has room for one (``num_groups / N``
   groups per node).
2. Within each node, give its ``P / N`` slots to its ``E / N`` experts: every
   expert gets one, and each further slot goes to the expert whose load per
   replica (``load / replicas``) is the highest.
3. Within each node, pack its replicas onto its ``G / N`` GPUs, by load per
   replica, heaviest first, each to the least-loaded GPU with a free slot.

When ``num_groups`` is not divisible by ``N`` the global variant runs the same
steps with one group and one node (no node constraint).
"""

from __future__ import annotations

import numpy as np

from moe_eplb_jax.policy.deepseek import check_inputs

__all__ = ["rebalance_experts_reference"]


def _balanced_packing(weights: list[float], num_packs: int) -> tuple[list[int], list[int]]:
    """Packs items into ``num_packs`` packs of equal item count; returns (pack, position in pack) per item."""
    num_items = len(weights)
    per_pack = num_items // num_packs
    if per_pack == 1:  # one item per pack: keep the given order
        return list(range(num_items)), [0] * num_items
    pack_of = [-1] * num_items
    rank_of = [-1] * num_items
    pack_load = [0.0] * num_packs
    pack_count = [0] * num_packs
    for item in sorted(range(num_items), key=lambda i: -weights[i]):  # stable: ties keep index order
        best = -1
        for pack in range(num_packs):
            if pack_count[pack] < per_pack and (best < 0 or pack_load[pack] < pack_load[best]):
                best = pack
        pack_of[item] = best
        rank_of[item] = pack_count[best]
        pack_load[best] += weights[item]
        pack_count[best] += 1
    return pack_of, rank_of


def _replicate(weights: list[float], num_slots: int) -> tuple[list[int], list[int], list[int]]:
    """Gives ``num_slots`` slots to ``len(weights)`` experts; returns (expert per slot, replica rank, count)."""
    num_experts = len(weights)
    slot_expert = list(range(num_experts))
    slot_rank = [0] * num_experts
    count = [1] * num_experts
    for _ in range(num_experts, num_slots):
        best = 0
        for e in range(1, num_experts):
            if weights[e] / count[e] > weights[best] / count[best]:
                best = e
        slot_expert.append(best)
        slot_rank.append(count[best])
        count[best] += 1
    return slot_expert, slot_rank, count


def _rebalance_layer(weights: list[float], num_slots: int, num_groups: int, num_nodes: int, num_gpus: int):
    num_experts = len(weights)
    group_size = num_experts // num_groups
    groups_per_node = num_groups // num_nodes
    experts_per_node = num_experts // num_nodes
    slots_per_node = num_slots // num_nodes
    gpus_per_node = num_gpus // num_nodes
    slots_per_gpu = num_slots // num_gpus

    # Step 1: groups onto nodes. Expert j of the group at position r of node n gets the node-local
    # index r * group_size + j, so node n holds local experts [n * E/N, (n + 1) * E/N).
    group_load = [sum(weights[g * group_size : (g + 1) * group_size]) for g in range(num_groups)]
    node_of_group, rank_in_node = _balanced_packing(group_load, num_nodes)
    local_to_expert = [0] * num_experts
    for group in range(num_groups):
        first = (node_of_group[group] * groups_per_node + rank_in_node[group]) * group_size
        for j in range(group_size):
            local_to_expert[first + j] = group * group_size + j

    phy2log = [0] * num_slots
    phyrank = [0] * num_slots
    logcnt = [0] * num_experts
    for node in range(num_nodes):
        experts = local_to_expert[node * experts_per_node : (node + 1) * experts_per_node]
        # Step 2: replicate within the node.
        node_weights = [weights[e] for e in experts]
        slot_expert, slot_rank, count = _replicate(node_weights, slots_per_node)
        for local, expert in enumerate(experts):
            logcnt[expert] = count[local]
        # Step 3: replicas onto the node's GPUs.
        replica_load = [node_weights[e] / count[e] for e in slot_expert]
        gpu_of, rank_in_gpu = _balanced_packing(replica_load, gpus_per_node)
        for replica in range(slots_per_node):
            slot = node * slots_per_node + gpu_of[replica] * slots_per_gpu + rank_in_gpu[replica]
            phy2log[slot] = experts[slot_expert[replica]]
            phyrank[slot] = slot_rank[replica]
    return phy2log, phyrank, logcnt


def rebalance_experts_reference(weight, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int):
    """DeepSeek EPLB, one layer and one item at a time (see the module docstring).

    ``weight`` is ``[L, E]``; returns numpy int32 ``phy2log [L, P]``,
    ``log2phy [L, E, P - E + 1]`` (replicas in replica-rank order, ``-1``
    padded) and ``logcnt [L, E]``. Inputs are checked as the vectorised
    policy checks them (:func:`moe_eplb_jax.policy.deepseek.check_inputs`).
    """
    weight, _ = check_inputs(weight, num_replicas, num_groups, num_nodes, num_gpus)
    num_replicas, num_groups, num_nodes, num_gpus = (int(n) for n in (num_replicas, num_groups, num_nodes, num_gpus))
    num_layers, num_experts = weight.shape
    if num_groups % num_nodes:  # global variant: no node constraint
        num_groups, num_nodes = 1, 1
    width = num_replicas - num_experts + 1
    phy2log = np.zeros((num_layers, num_replicas), dtype=np.int32)
    log2phy = np.full((num_layers, num_experts, width), -1, dtype=np.int32)
    logcnt = np.zeros((num_layers, num_experts), dtype=np.int32)
    for layer in range(num_layers):
        p2l, rank, cnt = _rebalance_layer(weight[layer].tolist(), num_replicas, num_groups, num_nodes, num_gpus)
        phy2log[layer] = p2l
        logcnt[layer] = cnt
        for slot in range(num_replicas):
            log2phy[layer, p2l[slot], rank[slot]] = slot
    return phy2log, log2phy, logcnt

"""DeepSeek's EPLB placement policy, vectorised over layers and nodes.

The algorithm (see :mod:`moe_eplb_jax.policy.deepseek_reference` for the
plain-loop version it must equal):

1. pack expert groups onto nodes (heaviest group first, to the least-loaded
   node with room);
2. within each node, replicate experts greedily: each redundant slot goes to
   the expert with the highest load per replica;
3. within each node, pack the replicas onto the node's GPUs (heaviest replica
   first, to the least-loaded GPU with a free slot).

When ``num_groups % num_nodes != 0`` the global variant runs with one group and
one node, and, as in DeepSeek's and vLLM's code, neither ``E % num_groups`` nor
``num_gpus % num_nodes`` is required then. Every greedy step loops over items only; each iteration works on all
layers and nodes at once.

With ``old_phy2log`` the result is relabelled to move as few experts as
possible (see :mod:`moe_eplb_jax.policy._preserve`); loads per GPU, and so
balancedness, are unchanged.
"""

from __future__ import annotations

import numpy as np

from moe_eplb_jax._checks import INT32_MAX, check_int
from moe_eplb_jax.placement import check_expert_ids, check_placement_size
from moe_eplb_jax.policy import _packing
from moe_eplb_jax.policy._preserve import preserve_slots

__all__ = [
    "rebalance_experts",
    "check_inputs",
    "check_old_phy2log",
    "check_weight",
    "hierarchical_layout",
    "log2phy_from_ranks",
    "node_major_order",
    "topology",
]


def check_weight(weight, *, name: str = "weight") -> np.ndarray:
    """``weight`` as float64 ``[L, E]``: real numbers (no bools or strings), finite, non-negative, non-empty.

    Errors call it ``name``.
    """
    try:
        weight = np.asarray(weight)
    except (ValueError, TypeError, OverflowError) as e:  # ragged nested lists
        raise ValueError(f"{name} must be a rectangular [L, E] array ({e})") from None
    if weight.ndim != 2:
        raise ValueError(f"{name} must have shape [L, E] (2-D), got shape {weight.shape}")
    if weight.shape[0] < 1 or weight.shape[1] < 1:
        raise ValueError(f"{name} must have at least one layer and one expert, got shape {weight.shape}")
    if weight.dtype.kind not in "iuf":
        raise ValueError(f"{name} must hold real numbers, got dtype {weight.dtype}")
    weight = weight.astype(np.float64) + 0.0  # + 0.0 turns -0.0 into 0.0 (sorts use the bit patterns)
    with np.errstate(over="ignore", invalid="ignore"):
        row_total = weight.sum(axis=1)  # NaN or inf anywhere makes a total non-finite: one cheap check
    if not np.isfinite(row_total).all() or weight.min() < 0:
        for problem, bad in (
            ("NaN", np.isnan(weight)),
            ("an infinite value", np.isinf(weight)),
            ("a negative load", weight < 0),
        ):
            if bad.any():
                layer, expert = (int(i) for i in np.argwhere(bad)[0])
                raise ValueError(f"{name} holds {problem} at [layer {layer}, expert {expert}]")
        raise ValueError(f"{name} is too large: a layer's total load overflows float64")
    return weight


def check_old_phy2log(old_phy2log, num_layers: int, num_replicas: int, num_experts: int) -> np.ndarray | None:
    """``old_phy2log`` as int64 ``[L, P]`` with ids in ``[0, E)`` or ``-1`` (``None`` passes through).

    ``-1`` marks a slot that holds no expert: the old placement carried to
    another EP size (:func:`moe_eplb_jax.policy.carry_phy2log`), where a
    device is new or has more slots than before.
    """
    if old_phy2log is None:
        return None
    old = np.asarray(old_phy2log)
    if old.shape != (num_layers, num_replicas):
        raise ValueError(f"old_phy2log must have shape [L, P] = {(num_layers, num_replicas)}, got {old.shape}")
    if old.dtype.kind not in "iu":
        raise ValueError(f"old_phy2log must hold integer expert ids, got dtype {old.dtype}")
    check_expert_ids(np.where(old == -1, 0, old), num_experts, name="old_phy2log")
    return old.astype(np.int64)


def check_inputs(weight, num_replicas, num_groups, num_nodes, num_gpus, old_phy2log=None):
    """Validates a policy call; returns ``(weight float64 [L, E], old_phy2log int64 [L, P] or None)``.

    Accepts exactly what DeepSeek's EPLB (and vLLM's copy of it) accepts.
    Raises ``ValueError`` naming the problem: weight not a finite, non-negative
    2-D array of numbers; a count that is not a positive integer (a bool or
    16.7 is not); ``num_replicas < E``; ``num_replicas % num_gpus``; and only
    for the hierarchical variant (``num_groups % num_nodes == 0``; the global
    one ignores groups and nodes) ``E % num_groups`` or ``num_gpus %
    num_nodes``; ``old_phy2log`` of the wrong shape or holding ids outside
    ``[0, E)``.
    """
    num_replicas = check_int("num_replicas", num_replicas, minimum=1, maximum=INT32_MAX)
    num_groups = check_int("num_groups", num_groups, minimum=1)
    num_nodes = check_int("num_nodes", num_nodes, minimum=1)
    num_gpus = check_int("num_gpus", num_gpus, minimum=1)
    weight = check_weight(weight)
    num_layers, num_experts = weight.shape
    if num_replicas < num_experts:
        raise ValueError(f"num_replicas ({num_replicas}) is smaller than the number of experts ({num_experts})")
    check_placement_size(num_layers, num_experts, num_replicas, physical_name="num_replicas")
    if num_replicas % num_gpus:
        raise ValueError(f"num_replicas ({num_replicas}) is not divisible by num_gpus ({num_gpus})")
    if num_groups % num_nodes == 0:  # hierarchical: groups stay on one node
        if num_experts % num_groups:
            raise ValueError(f"the number of experts ({num_experts}) is not divisible by num_groups ({num_groups})")
        if num_gpus % num_nodes:
            raise ValueError(f"num_gpus ({num_gpus}) is not divisible by num_nodes ({num_nodes})")
    return weight, check_old_phy2log(old_phy2log, num_layers, num_replicas, num_experts)


def log2phy_from_ranks(phy2log: np.ndarray, phyrank: np.ndarray, num_logical: int) -> np.ndarray:
    """``log2phy [L, E, P - E + 1]``: ``log2phy[l, phy2log[l, p], phyrank[l, p]] = p``, ``-1`` elsewhere."""
    num_layers, num_physical = phy2log.shape
    width = num_physical - num_logical + 1
    log2phy = np.empty(num_layers * num_logical * width, dtype=np.int32)
    log2phy.view(np.uint8).fill(0xFF)  # -1 in every int32; a byte fill is a memset
    cell = phy2log * width + phyrank + (np.arange(num_layers) * (num_logical * width))[:, None]
    log2phy[cell] = np.arange(num_physical, dtype=np.int32)
    return log2phy.reshape(num_layers, num_logical, width)


def node_major_order(group_slot: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Expert order that lists each node's experts together.

    ``group_slot [L, groups]`` is a permutation per layer: group ``g`` takes
    position ``group_slot[l, g]`` (node ``n`` owns positions ``[n * groups /
    N, (n + 1) * groups / N)``). Returns ``(expert_to_local, local_to_expert)``,
    ``[L, E]`` inverse permutations: expert ``j`` of group ``g`` is local
    expert ``group_slot[l, g] * group_size + j``.
    """
    num_layers, num_groups = group_slot.shape
    group_at = _packing.inverse_permutation(group_slot)
    within = np.arange(group_size)
    expert_to_local = (group_slot[:, :, None] * group_size + within).reshape(num_layers, -1)
    local_to_expert = (group_at[:, :, None] * group_size + within).reshape(num_layers, -1)
    return expert_to_local, local_to_expert


def hierarchical_layout(weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int):
    """Steps 1-3 on all layers at once; the building block of every policy here.

    Returns ``(phy2log [L, P], phyrank [L, P], logcnt [L, E])`` int64, where
    ``phyrank`` is each slot's replica rank (0 for an expert's first replica).
    Assumes validated inputs; callers pick the global variant by passing one
    group and one node.
    """
    num_layers, num_experts = weight.shape
    group_size = num_experts // num_groups
    experts_per_node = num_experts // num_nodes
    slots_per_node = num_replicas // num_nodes
    gpus_per_node = num_gpus // num_nodes

    # Step 1: groups onto nodes. Expert j of the group at position r of node n gets the node-major
    # index (n * groups_per_node + r) * group_size + j. With one group per node, group g lands on
    # node g, and the node-major order is the identity.
    node_major = num_groups != num_nodes
    if node_major:
        group_load = weight.reshape(num_layers, num_groups, group_size).sum(axis=2)
        group_at = _packing.packing_slots(group_load, num_nodes)  # the group at each node-major position
        local_to_expert = (group_at[:, :, None] * group_size + np.arange(group_size)).reshape(num_layers, -1)
        local_weight = _packing.gather_rows(weight, local_to_expert)
    else:
        local_weight = weight

    # Step 2: replicate within each node; rows are (layer, node) pairs.
    local_weight = local_weight.reshape(-1, experts_per_node)
    slot_expert, slot_rank, count = _packing.replicate(local_weight, slots_per_node)

    # Step 3: replicas onto the node's GPUs, by load per replica.
    replica_load = _packing.gather_rows(local_weight / count, slot_expert)
    slot_replica = _packing.packing_slots(replica_load, gpus_per_node)
    node_expert = _packing.gather_rows(slot_expert, slot_replica)
    phyrank = _packing.gather_rows(slot_rank, slot_replica).reshape(num_layers, num_replicas)

    count = count.reshape(num_layers, num_experts)
    local_ids = node_expert.reshape(num_layers, num_nodes, slots_per_node)
    if num_nodes > 1:
        local_ids = local_ids + (np.arange(num_nodes) * experts_per_node)[:, None]
    local_ids = local_ids.reshape(num_layers, num_replicas)
    if not node_major:
        return local_ids, phyrank, count
    return (_packing.gather_rows(local_to_expert, local_ids), phyrank, _packing.scatter_rows(count, local_to_expert))


def topology(num_groups: int, num_nodes: int) -> tuple[int, int]:
    """``(groups, nodes)`` the algorithm runs with: the global variant when groups do not split over nodes."""
    return (num_groups, num_nodes) if num_groups % num_nodes == 0 else (1, 1)


def rebalance_experts(weight, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int, old_phy2log=None):
    """DeepSeek EPLB placement of ``num_replicas`` slots for per-expert loads ``weight [L, E]``.

    ``num_groups`` expert groups (contiguous blocks of ``E / num_groups``
    experts) are kept on one of ``num_nodes`` nodes when ``num_groups %
    num_nodes == 0`` (hierarchical); otherwise the global variant ignores
    groups and nodes (and needs neither to divide anything). ``num_gpus`` GPUs hold ``num_replicas / num_gpus`` slots
    each (slot ``p`` is on GPU ``p // (P / G)``).

    Returns numpy int32 ``phy2log [L, P]``, ``log2phy [L, E, P - E + 1]``
    (replicas in the order the algorithm created them, ``-1`` padded) and
    ``logcnt [L, E]``. Without ``old_phy2log`` this is exactly DeepSeek's
    placement (ties broken by lowest index). With ``old_phy2log [L, P]`` the
    same per-GPU contents are relabelled (nodes and GPUs permuted, slots within
    a GPU reordered) to keep as many experts as possible in their old slot.
    """
    weight, old = check_inputs(weight, num_replicas, num_groups, num_nodes, num_gpus, old_phy2log)
    groups, nodes = topology(num_groups, num_nodes)
    phy2log, phyrank, logcnt = hierarchical_layout(weight, num_replicas, groups, nodes, num_gpus)
    if old is not None:
        phy2log, phyrank = preserve_slots(phy2log, phyrank, old, num_gpus=num_gpus, num_nodes=nodes)
    log2phy = log2phy_from_ranks(phy2log, phyrank, weight.shape[1])
    return phy2log.astype(np.int32), log2phy, logcnt.astype(np.int32)

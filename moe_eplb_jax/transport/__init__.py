"""Expert transport on a Mesh: move planning, packing of slot rows and the collective executor.

``rearrange_experts(experts, old_phy2log, new_phy2log, mesh=mesh)`` moves every
leaf of an expert pytree (weights, quantisation scales, optimizer state) to a
new placement, bit-exactly, sending only the slots whose expert changes, as one
packed row of unsigned integers per slot. The lower-level pieces:

* ``plan_rearrangement`` -> ``TransportPlan`` (host numpy index tables, the
  same on every process) and ``execute_plan`` (the jitted ``shard_map``), or
  ``prepare_move`` (validation, ordering, table upload ahead of time) ->
  ``PreparedMove``, called when the move is due;
  ``plan_layer_by_layer`` -> one same-shaped plan per changed layer, to
  interleave the move with forward steps;
* ``packing`` -- unsigned-integer views of any dtype (fp4 in pairs) and row packing;
* ``mesh`` -- an EP mesh, the slot sharding, placing host arrays on it;
* ``resize_experts`` -- the same contract from a mesh of ``G`` devices to one
  of ``G'`` (``plan_resize`` -> ``ResizePlan``, ``execute_resize``; lost ranks'
  experts from surviving replicas, or from the host through ``reload_from``);
  ``replicate_to`` places the replicated rest of a model on the new mesh.
"""

from moe_eplb_jax.transport.mesh import axis_size, ep_mesh, put_host, shard_slots, slot_sharding
from moe_eplb_jax.transport.packing import (
    LeafLayout,
    from_byte_rows,
    leaf_layout,
    pack_rows,
    pack_rows_numpy,
    to_byte_rows,
    unpack_rows,
)
from moe_eplb_jax.transport.plan import (
    TransportPlan,
    bucket_capacity,
    plan_layer_by_layer,
    plan_rearrangement,
    validate_placements,
)
from moe_eplb_jax.transport.replicate import replicate_to
from moe_eplb_jax.transport.resize import (
    execute_resize,
    new_rank_of_old,
    plan_for_meshes,
    reload_from,
    resize_experts,
    union_mesh,
)
from moe_eplb_jax.transport.resize_plan import ResizePlan, missing_experts, plan_resize
from moe_eplb_jax.transport.transport import (
    PreparedMove,
    execute_plan,
    executor_trace_count,
    prepare_move,
    rearrange_experts,
    row_bytes,
)

__all__ = [
    "LeafLayout",
    "PreparedMove",
    "ResizePlan",
    "TransportPlan",
    "axis_size",
    "bucket_capacity",
    "ep_mesh",
    "execute_plan",
    "execute_resize",
    "executor_trace_count",
    "from_byte_rows",
    "leaf_layout",
    "missing_experts",
    "new_rank_of_old",
    "pack_rows",
    "pack_rows_numpy",
    "plan_layer_by_layer",
    "plan_for_meshes",
    "plan_rearrangement",
    "plan_resize",
    "prepare_move",
    "put_host",
    "rearrange_experts",
    "reload_from",
    "replicate_to",
    "resize_experts",
    "row_bytes",
    "shard_slots",
    "slot_sharding",
    "to_byte_rows",
    "union_mesh",
    "unpack_rows",
    "validate_placements",
]

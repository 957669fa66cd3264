"""Move expert slots from a mesh of ``G`` devices to a mesh of ``G'`` devices, bit for bit.

``resize_experts(experts, old_phy2log, new_phy2log, mesh=old, new_mesh=new)``
returns the pytree laid out for the new placement on the new mesh: every leaf
``[P, ...]`` / ``[L, P, ...]`` becomes ``[P', ...]`` / ``[L, P', ...]`` with
its slot axis over the new mesh's EP axis. Slot ``p'`` holds the bytes of a
slot that held its expert: from the same device where it was there before,
else over the network from a surviving device (:mod:`resize_plan`), else --
for an expert only lost ranks held -- from the host through ``reload``. The
device sets may overlap or not; the work runs on their union (``jax.distributed``
processes included), as one jitted ``shard_map`` (``_resize_executor``).

Everything is checked before any device work: placements, leaves, the
experts no survivor holds (``ValueError`` naming them unless ``reload`` is
given), the reloaded rows (and, with several processes, that every process
found its part possible). The input is never donated: the old arrays stay
valid until the caller drops them.

Extra memory during the move: the new shards beside the old ones; a device
that joins holds a zero old shard, one that leaves an unused new shard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from moe_eplb_jax.transport import _resize_executor
from moe_eplb_jax.transport.mesh import axis_size
from moe_eplb_jax.transport.packing import leaf_layout
from moe_eplb_jax.transport.resize_plan import ResizePlan, plan_resize

__all__ = ["new_rank_of_old", "plan_for_meshes", "reload_from", "resize_experts", "execute_resize", "union_mesh"]

Reload = Callable[[np.ndarray], Any]


def _ep_devices(mesh: Mesh, axis: str, name: str) -> list:
    """The devices of ``mesh`` along ``axis``; ``ValueError`` unless every other axis has size 1."""
    axis_size(mesh, axis)
    others = {a: int(s) for a, s in mesh.shape.items() if a != axis and s != 1}
    if others:
        raise ValueError(f"{name} must have the EP axis {axis!r} as its only axis of size > 1, has {others}")
    return list(mesh.devices.flat)


def new_rank_of_old(mesh: Mesh, new_mesh: Mesh, *, axis: str = "ep") -> np.ndarray:
    """``[G]`` the rank of each old rank's device in ``new_mesh`` (``-1``: not in it)."""
    index = {d: i for i, d in enumerate(_ep_devices(new_mesh, axis, "new_mesh"))}
    return np.array([index.get(d, -1) for d in _ep_devices(mesh, axis, "mesh")], dtype=np.int64)


def union_mesh(plan: ResizePlan, mesh: Mesh, new_mesh: Mesh, *, axis: str = "ep") -> Mesh:
    """The one-axis mesh over the plan's members: surviving old devices, then devices new to the group."""
    old, new = _ep_devices(mesh, axis, "mesh"), _ep_devices(new_mesh, axis, "new_mesh")
    if (len(old), len(new)) != (plan.num_ranks, plan.new_num_ranks):
        raise ValueError(
            f"the plan is for {plan.num_ranks} -> {plan.new_num_ranks} ranks, the meshes have {len(old)} -> {len(new)}"
        )
    devices = []
    for old_rank, new_rank in plan.members.tolist():
        device = old[old_rank] if old_rank >= 0 else new[new_rank]
        if new_rank >= 0 and new[new_rank] != device or old_rank < 0 and device in old:
            raise ValueError("the plan's ranks do not match the meshes' devices (plan it with new_rank_of_old)")
        devices.append(device)
    return Mesh(np.array(devices), (axis,), axis_types=(jax.sharding.AxisType.Auto,))


def plan_for_meshes(
    old_phy2log, new_phy2log, *, mesh: Mesh, new_mesh: Mesh, axis: str = "ep", lost_ranks=(), reload=False, **kwargs
) -> ResizePlan:
    """:func:`plan_resize` with the ranks and the device map read from the two meshes."""
    return plan_resize(
        old_phy2log,
        new_phy2log,
        len(_ep_devices(mesh, axis, "mesh")),
        len(_ep_devices(new_mesh, axis, "new_mesh")),
        new_rank_of_old=new_rank_of_old(mesh, new_mesh, axis=axis),
        lost_ranks=lost_ranks,
        reload=bool(reload),
        **kwargs,
    )


def reload_from(checkpoint: Any, *, layered: bool = True) -> Reload:
    """A ``reload`` for :func:`resize_experts` that reads rows of a host checkpoint in logical layout.

    ``checkpoint`` has the structure of the experts, each leaf ``[L, E, ...]``
    (``layered``) or ``[E, ...]`` (one layer, tables ``[P]``), indexable with
    numpy integer arrays (numpy arrays, memory maps). The callable returns, for
    requests ``[K, 2]`` of ``(layer, expert)``, each leaf's ``[K, ...]`` rows
    (0-d leaves as they are).
    """

    def read(requests: np.ndarray):
        layers, experts = requests[:, 0], requests[:, 1]

        def rows(leaf):
            if np.ndim(leaf) == 0:
                return leaf
            return np.asarray(leaf[layers, experts] if layered else leaf[experts])

        return jax.tree_util.tree_map(rows, checkpoint)

    return read


def resize_experts(
    experts: Any,
    old_phy2log,
    new_phy2log,
    *,
    mesh: Mesh,
    new_mesh: Mesh,
    axis: str = "ep",
    lost_ranks=(),
    reload: Reload | None = None,
    num_logical: int | None = None,
) -> Any:
    """Moves ``experts`` from ``old_phy2log`` on ``mesh`` to ``new_phy2log`` on ``new_mesh``, bit for bit.

    ``experts`` is a pytree of ``jax.Array`` leaves ``[P, ...]`` (tables
    ``[P]`` and ``[P']``) or ``[L, P, ...]`` (tables ``[L, P]`` and ``[L,
    P']``), the slot axis sharded over ``axis`` of ``mesh`` (the only axis of
    size > 1 of either mesh); parameters, quantization scales and optimizer
    moments of every dtype go in one pytree; 0-d leaves are copied to the new
    mesh (replicated). ``lost_ranks`` are old ranks whose devices are gone:
    nothing is read from them, and they may not be in ``new_mesh``. An expert
    of the new placement that only lost ranks held comes from ``reload``
    (``reload(requests [K, 2] of (layer, expert))`` -> a pytree like
    ``experts`` of host rows ``[K, ...]``; see :func:`reload_from`); without
    it, ``ValueError`` names those experts. Returns a pytree of the same
    structure on ``new_mesh``; the input stays valid and unchanged.
    """
    plan = plan_for_meshes(
        old_phy2log,
        new_phy2log,
        mesh=mesh,
        new_mesh=new_mesh,
        axis=axis,
        lost_ranks=lost_ranks,
        reload=reload is not None,
        num_logical=num_logical,
    )
    return execute_resize(experts, plan, mesh=mesh, new_mesh=new_mesh, axis=axis, reload=reload)


def execute_resize(
    experts: Any, plan: ResizePlan, *, mesh: Mesh, new_mesh: Mesh, axis: str = "ep", reload: Reload | None = None
) -> Any:
    """Runs a :class:`ResizePlan` (see :func:`resize_experts`); ``ValueError`` before any device work."""
    if not isinstance(plan, ResizePlan):
        raise ValueError(f"plan must be a ResizePlan, got {type(plan).__name__}")
    if reload is not None and not callable(reload):
        raise ValueError(f"reload must be callable (requests [K, 2] -> rows), got {type(reload).__name__}")
    union = union_mesh(plan, mesh, new_mesh, axis=axis)
    flat, treedef = jax.tree_util.tree_flatten(experts)
    moving, scalars, layouts = _check_leaves(experts, plan, mesh, axis)
    if scalars and not (plan.members[:, 0] >= 0).any():
        raise ValueError("every old rank is lost: the 0-d leaves of experts cannot be read")
    reloading = bool(plan.reload_count.any())
    if reloading and reload is None:
        raise ValueError(f"the plan reloads {int(plan.reload_count.sum())} expert rows but no reload was given")
    # Host reads that may fail, before any device work; with several processes all agree first.
    problem, rows, values = None, {}, []
    try:
        rows = _reload_rows(reload, plan, union, flat, moving, layouts, treedef) if reloading else {}
        if union.devices.flat[0].process_index == jax.process_index():
            values = [_scalar_value(flat[i], plan, mesh) for i in scalars]
    except ValueError as err:
        problem = err
    _agree(problem)

    local = [(u, d) for u, d in enumerate(union.devices.flat) if d.process_index == jax.process_index()]
    reloaded = (
        [_rows_on_union(rows, k, layout, plan, union, axis) for k, layout in enumerate(layouts)] if reloading else []
    )
    old_arrays = [_on_union(flat[i], plan, union, axis, local) for i in moving]
    scalar_arrays = [
        _scalar_on_union(flat[i], values[k] if values else None, union, local) for k, i in enumerate(scalars)
    ]
    specs = [_slot_spec(plan.layered, axis)] * len(moving)
    run, tables = _resize_executor.build(plan, layouts, specs, [flat[i].dtype for i in scalars], union, axis, reloading)
    new_leaves, new_scalars = run(tables, old_arrays, reloaded, scalar_arrays)
    out = list(flat)
    for i, leaf in zip(moving, new_leaves):
        out[i] = _on_new_mesh(leaf, new_mesh, plan, axis)
    for i, leaf in zip(scalars, new_scalars):
        out[i] = _on_new_mesh(leaf, new_mesh, None, axis)
    return jax.tree_util.tree_unflatten(treedef, out)


# ----------------------------------------------------------------- placing
def _slot_spec(layered: bool, axis: str) -> PartitionSpec:
    return PartitionSpec(None, axis) if layered else PartitionSpec(axis)


def _on_union(leaf: jax.Array, plan: ResizePlan, union: Mesh, axis: str, local) -> jax.Array:
    """``leaf``'s old shards as one array on the union mesh (zero shards on devices new to the group); no copy."""
    shards = {shard.device: shard.data for shard in leaf.addressable_shards}
    shard_shape = leaf.sharding.shard_shape(leaf.shape)
    slot_dim = 1 if plan.layered else 0
    shape = list(leaf.shape)
    shape[slot_dim] = shard_shape[slot_dim] * plan.num_members
    sharding = NamedSharding(union, _slot_spec(plan.layered, axis))
    arrays = [shards[d] if plan.members[u, 0] >= 0 else jnp.zeros(shard_shape, leaf.dtype, device=d) for u, d in local]
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays, dtype=leaf.dtype)


def _on_new_mesh(leaf: jax.Array, new_mesh: Mesh, plan: ResizePlan | None, axis: str) -> jax.Array:
    """The shards on ``new_mesh``'s devices of a union-mesh result as an array there (a 0-d one: ``plan`` None)."""
    shape, spec = (), PartitionSpec()
    if plan is not None:
        shape, spec = list(leaf.shape), _slot_spec(plan.layered, axis)
        shape[1 if plan.layered else 0] = plan.new_num_slots
    shards = {shard.device: shard.data for shard in leaf.addressable_shards}
    sharding = NamedSharding(new_mesh, spec)
    arrays = [shards[d] for d in sharding.addressable_devices_indices_map(tuple(shape))]
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays, dtype=leaf.dtype)


def _scalar_on_union(leaf, value, union: Mesh, local) -> jax.Array:
    """A 0-d leaf on every union device: ``value`` on member 0 (the executor broadcasts it), zeros elsewhere."""
    dtype = leaf.dtype if isinstance(leaf, jax.Array) else np.asarray(leaf).dtype
    arrays = [jax.device_put(value, d) if u == 0 else jnp.zeros((), dtype, device=d) for u, d in local]
    return jax.make_array_from_single_device_arrays((), NamedSharding(union, PartitionSpec()), arrays, dtype=dtype)


def _scalar_value(leaf, plan: ResizePlan, mesh: Mesh) -> np.ndarray:
    """The host bytes of a 0-d leaf, from a shard on a surviving device first (``ValueError`` if none is here)."""
    if not isinstance(leaf, jax.Array):
        return np.asarray(leaf)
    old_devices = list(mesh.devices.flat)
    surviving = {old_devices[r] for r in plan.members[:, 0].tolist() if r >= 0}
    shards = sorted(leaf.addressable_shards, key=lambda shard: shard.device not in surviving)
    if not shards:
        raise ValueError("a 0-d leaf of experts has no copy on the process of the first surviving old device")
    return np.asarray(shards[0].data)


def _reload_rows(reload, plan, union, flat, moving, layouts, treedef) -> dict:
    """``{device: [rows [Q, ...] per moving leaf]}`` for this process's union devices, read and checked."""
    capacity = plan.capacities[2]
    out = {}
    for u, d in enumerate(union.devices.flat):
        if d.process_index != jax.process_index():
            continue
        count = int(plan.reload_count[u])
        if count:
            out[d] = _read_reload(reload, plan.reload_experts[u, :count], treedef, flat, moving, layouts, capacity)
        else:
            out[d] = [np.zeros((capacity,) + layout.row_shape, flat[i].dtype) for i, layout in zip(moving, layouts)]
    return out


def _rows_on_union(rows: dict, k: int, layout, plan: ResizePlan, union: Mesh, axis: str) -> jax.Array:
    """Leaf ``k``'s reloaded rows as ``[U * Q, ...]`` on the union mesh, placed from their host bytes."""
    shape = (plan.capacities[2] * plan.num_members,) + layout.row_shape
    arrays = [jax.device_put(per_leaf[k], d) for d, per_leaf in rows.items()]
    return jax.make_array_from_single_device_arrays(
        shape, NamedSharding(union, PartitionSpec(axis)), arrays, dtype=layout.dtype
    )


def _read_reload(reload, requests, treedef, flat, moving, layouts, capacity) -> list[np.ndarray]:
    """``reload(requests)`` checked against the experts; each moving leaf's rows padded to ``capacity``."""
    try:
        got = reload(np.array(requests, dtype=np.int64))
        got_flat, got_def = jax.tree_util.tree_flatten(got)
    except (IndexError, KeyError, TypeError) as err:
        raise ValueError(f"reload failed for {len(requests)} (layer, expert) rows: {err!r}") from err
    if got_def != treedef:
        raise ValueError(f"reload returned the structure {got_def}, the experts have {treedef}")
    out = []
    for i, layout in zip(moving, layouts):
        rows = np.asarray(got_flat[i])
        want = (len(requests),) + layout.row_shape
        if rows.shape != want or rows.dtype != flat[i].dtype:
            raise ValueError(
                f"reload gave leaf {i} as {rows.dtype}{list(rows.shape)}, the move needs {flat[i].dtype}{list(want)}"
            )
        padded = np.zeros((capacity,) + layout.row_shape, rows.dtype)
        padded[: len(requests)] = rows
        out.append(padded)
    return out


def _agree(problem: ValueError | None) -> None:
    """Raises ``problem`` -- on every process when any process found one (so none waits in the move)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        failed = multihost_utils.process_allgather(np.array(problem is not None))
        if np.any(failed) and problem is None:
            raise ValueError("another process could not read the rows it must reload; nothing was moved")
    if problem is not None:
        raise problem


# ----------------------------------------------------------------- validation
def _devices(mesh) -> list:
    """The devices of a mesh in order (none for an abstract mesh)."""
    return list(np.asarray(getattr(mesh, "devices", [])).flat)


def _check_leaves(experts: Any, plan: ResizePlan, mesh: Mesh, axis: str):
    """``(positions of moving leaves, positions of 0-d leaves, layouts)``; ``ValueError`` for a bad leaf."""
    with_path, _ = jax.tree_util.tree_flatten_with_path(experts)
    lead = (plan.num_layers, plan.num_slots) if plan.layered else (plan.num_slots,)
    expected = _slot_spec(plan.layered, axis)
    moving, scalars, layouts = [], [], []
    for position, (path, leaf) in enumerate(with_path):
        name = "experts" + jax.tree_util.keystr(path)
        if isinstance(leaf, Tracer):
            raise ValueError(f"{name} must be a concrete array, got a tracer")
        if np.ndim(leaf) == 0:
            _resize_executor.scalar_bits(np.asarray(leaf).dtype if not isinstance(leaf, jax.Array) else leaf.dtype)
            scalars.append(position)
            continue
        if not isinstance(leaf, jax.Array):
            raise ValueError(f"{name} must be a jax.Array, got {type(leaf).__name__}")
        if leaf.is_deleted():
            raise ValueError(f"{name} was deleted (donated to an earlier call?)")
        if leaf.shape[: len(lead)] != lead:
            raise ValueError(f"{name} has shape {leaf.shape}; its leading axes must be the slot axes {lead}")
        sharding = leaf.sharding
        if not isinstance(sharding, NamedSharding) or _devices(sharding.mesh) != list(mesh.devices.flat):
            raise ValueError(f"{name} must be sharded with a NamedSharding on the old mesh, got {sharding}")
        if not sharding.is_equivalent_to(NamedSharding(mesh, expected), leaf.ndim):
            raise ValueError(f"{name}: only the slot axis may be sharded, over {axis!r}; spec is {sharding.spec}")
        layouts.append(leaf_layout(leaf.dtype, leaf.shape[len(lead) :], name=name))
        moving.append(position)
    return moving, scalars, layouts

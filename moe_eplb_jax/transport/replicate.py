"""Replicated arrays of one mesh placed on another, bit for bit: the rest of a model when its EP group resizes.

``replicate_to(tree, mesh, new_mesh)`` returns every leaf -- a ``jax.Array``
replicated over ``mesh`` (a model's dense weights, router, norms, their
optimizer moments and step counts) -- as the same bytes replicated over
``new_mesh``. Each device of the new mesh copies the leaf from a surviving old
device of its own process (itself where it was in the old group: no copy);
where a process of the new mesh has no surviving old device (it joins the
group), every leaf is broadcast over the union of the surviving old and the
new devices instead, as unsigned integers (``psum`` of the value on the first
survivor and zeros elsewhere), so no float op meets the bytes. Every process
decides the same way from the two meshes alone. The input stays valid.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from moe_eplb_jax.transport.mesh import axis_size
from moe_eplb_jax.transport.packing import from_row_view, leaf_layout, row_view

__all__ = ["replicate_to"]

_BROADCASTS: dict = {}


def replicate_to(tree: Any, mesh: Mesh, new_mesh: Mesh, *, axis: str = "ep", lost_ranks=()) -> Any:
    """Every leaf of ``tree`` (replicated over ``mesh``) replicated over ``new_mesh``, byte for byte.

    ``lost_ranks``: ranks of ``mesh`` (along ``axis``) whose devices are gone;
    nothing is read from them. ``ValueError`` before any device work for a
    leaf that is not a ``jax.Array`` replicated over ``mesh``, or when every
    rank is lost. Returns a pytree of the same structure.
    """
    axis_size(mesh, axis)
    axis_size(new_mesh, axis)
    old_devices = list(mesh.devices.flat)
    lost = {int(r) for r in lost_ranks}
    if any(r < 0 or r >= len(old_devices) for r in lost):
        raise ValueError(f"lost_ranks {sorted(lost)} are not ranks of the old mesh (0..{len(old_devices) - 1})")
    survivors = [d for r, d in enumerate(old_devices) if r not in lost]
    if not survivors:
        raise ValueError("every rank of the old mesh is lost: replicated arrays have no copy left to read")
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    for path, leaf in flat:
        _check(f"tree{jax.tree_util.keystr(path)}", leaf, mesh)
    leaves = [leaf for _, leaf in flat]
    processes = {d.process_index for d in survivors}
    if all(d.process_index in processes for d in new_mesh.devices.flat):
        out = [_local_copy(leaf, survivors, new_mesh) for leaf in leaves]
    else:
        out = _broadcast(leaves, survivors, new_mesh, axis)
    return jax.tree_util.tree_unflatten(treedef, out)


def _check(name: str, leaf, mesh: Mesh) -> None:
    if not isinstance(leaf, jax.Array):
        raise ValueError(f"{name} must be a jax.Array, got {type(leaf).__name__}")
    sharding = leaf.sharding
    if not isinstance(sharding, NamedSharding) or sharding.mesh != mesh:
        raise ValueError(f"{name} must be placed on the old mesh with a NamedSharding, got {sharding}")
    if not sharding.is_fully_replicated:
        raise ValueError(f"{name} is sharded ({sharding.spec}); only replicated arrays follow a resize this way")
    if leaf.is_deleted():
        raise ValueError(f"{name} was deleted (donated to an earlier call?)")


def _local_copy(leaf: jax.Array, survivors: list, new_mesh: Mesh) -> jax.Array:
    """``leaf`` on ``new_mesh``: each local new device takes its own shard, else a surviving local one's."""
    shards = {shard.device: shard.data for shard in leaf.addressable_shards if shard.device in survivors}
    sharding = NamedSharding(new_mesh, PartitionSpec())
    arrays = []
    for device in sharding.addressable_devices_indices_map(leaf.shape):
        source = shards.get(device)
        arrays.append(source if source is not None else jax.device_put(next(iter(shards.values())), device))
    return jax.make_array_from_single_device_arrays(leaf.shape, sharding, arrays, dtype=leaf.dtype)


def _broadcast(leaves: list[jax.Array], survivors: list, new_mesh: Mesh, axis: str) -> list[jax.Array]:
    """The leaves from the first survivor to every new device over the union mesh, as unsigned integers."""
    members = survivors + [d for d in new_mesh.devices.flat if d not in survivors]
    union = Mesh(np.array(members), (axis,), axis_types=(jax.sharding.AxisType.Auto,))
    replicated = NamedSharding(union, PartitionSpec())
    placed = []
    for leaf in leaves:
        shards = {shard.device: shard.data for shard in leaf.addressable_shards}
        arrays = [
            shards[d] if d in shards and d in survivors else jnp.zeros(leaf.shape, leaf.dtype, device=d)
            for d in replicated.addressable_devices_indices_map(leaf.shape)
        ]
        placed.append(jax.make_array_from_single_device_arrays(leaf.shape, replicated, arrays, dtype=leaf.dtype))
    key = (union, axis, tuple((leaf.shape, np.dtype(leaf.dtype)) for leaf in leaves))
    if key not in _BROADCASTS:
        _BROADCASTS[key] = _jitted(*key)
    moved = _BROADCASTS[key](placed)
    out = []
    for leaf in moved:
        sharding = NamedSharding(new_mesh, PartitionSpec())
        shards = {shard.device: shard.data for shard in leaf.addressable_shards}
        arrays = [shards[d] for d in sharding.addressable_devices_indices_map(leaf.shape)]
        out.append(jax.make_array_from_single_device_arrays(leaf.shape, sharding, arrays, dtype=leaf.dtype))
    return out


def _jitted(union: Mesh, axis: str, shapes):
    layouts = [
        leaf_layout(dtype, (int(np.prod(shape, dtype=np.int64)),), name="replicated leaf") for shape, dtype in shapes
    ]

    def body(leaves):
        first = jax.lax.axis_index(axis) == 0
        out = []
        for leaf, layout, (shape, _) in zip(leaves, layouts, shapes):
            view = row_view(leaf.reshape(1, -1), layout, 1)
            view = jax.lax.psum(jnp.where(first, view, jnp.zeros_like(view)), axis)
            out.append(from_row_view(view, layout, shape))
        return out

    specs = [PartitionSpec()] * len(shapes)
    mapped = jax.shard_map(body, mesh=union, in_specs=(specs,), out_specs=specs)
    sharding = [NamedSharding(union, PartitionSpec())] * len(shapes)
    return jax.jit(mapped, in_shardings=(sharding,), out_shardings=sharding)

"""The jitted executor of a move between EP sizes, on the union of the old and the new devices.

Per union member it takes the old shard of every moving leaf (a zero shard on
a device new to the group), the rows reloaded from the host for it, and the
plan's tables as one int32 row; it returns the member's new shard (unused on a
device that leaves). The old shards are views as unsigned integers
(``packing``); the new shard starts as zeros, takes its local copies and
reloaded rows, then in each of the ``U - 1`` rounds one ``ppermute`` of packed
rows, then the duplicates. Every op between the entry and exit bitcasts is an
integer op. Old and new shards are separate buffers, so no transfer waits for
a write. 0-d leaves (an optimizer's step count) are broadcast from member 0 as
unsigned integers (``psum`` of the value and zeros).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from moe_eplb_jax.transport.mesh import put_host
from moe_eplb_jax.transport.packing import from_row_view, pack_rows, row_view, unpack_leaf
from moe_eplb_jax.transport.resize_plan import ResizePlan

__all__ = ["build", "scalar_bits"]

_EXECUTORS: dict = {}


def scalar_bits(dtype) -> np.dtype:
    """The unsigned integer a 0-d leaf of ``dtype`` travels as (``ValueError`` for 4-bit scalars)."""
    bits = jax.dtypes.itemsize_bits(np.dtype(dtype))
    if np.dtype(dtype) == np.bool_:
        return np.dtype(np.uint8)
    if bits not in (8, 16, 32, 64):
        raise ValueError(f"a 0-d leaf of dtype {np.dtype(dtype)} ({bits} bits) cannot be moved")
    return np.dtype(f"uint{bits}")


def device_tables(plan: ResizePlan, mesh: Mesh, axis: str) -> tuple[jax.Array, tuple]:
    """The plan's tables as one int32 array ``[U, T]`` on the union mesh, and their static layout."""
    layout, parts, start = [], [], 0
    for name, table in plan.device_tables().items():
        size = int(np.prod(table.shape[1:]))
        layout.append((name, start, tuple(int(d) for d in table.shape[1:])))
        parts.append(np.asarray(table, dtype=np.int32).reshape(table.shape[0], size))
        start += size
    return put_host(np.concatenate(parts, axis=1), mesh, PartitionSpec(axis)), tuple(layout)


def build(plan: ResizePlan, layouts, specs, scalar_dtypes, mesh: Mesh, axis: str, reloading: bool):
    """``(run, tables)``: the jitted executor for this plan's shapes (cached) and the plan's tables on ``mesh``.

    ``run(tables, old_leaves, reload_leaves, scalars)`` takes union-mesh
    arrays and returns ``(new_leaves, scalars)`` on the union mesh.
    """
    tables, table_layout = device_tables(plan, mesh, axis)
    new_lead = (plan.num_layers, plan.new_num_slots // plan.new_num_ranks) if plan.layered else (plan.new_local_rows,)
    key = (mesh, axis, tuple(layouts), tuple(specs), tuple(scalar_dtypes), plan.layered, new_lead)
    key += (plan.old_local_rows, table_layout, bool(reloading))
    if key not in _EXECUTORS:
        _EXECUTORS[key] = _jitted(*key)
    return _EXECUTORS[key], tables


def _jitted(mesh, axis, layouts, specs, scalar_dtypes, layered, new_lead, old_rows, table_layout, reloading):
    num_members = int(mesh.shape[axis])
    new_rows = int(np.prod(new_lead))

    def body(table, old_leaves, reload_leaves, scalars):
        t = {name: table[0, start : start + int(np.prod(shape))].reshape(shape) for name, start, shape in table_layout}
        old = [row_view(leaf, layout, old_rows) for leaf, layout in zip(old_leaves, layouts)]
        new = [jnp.zeros((new_rows, layout.view_width), layout.view_dtype) for layout in layouts]

        def write(rows, dst, values):  # padding rows are distinct and out of range: dropped
            return rows.at[dst].set(values, mode="drop", unique_indices=True)

        if t["copy_dst"].shape[0]:
            new = [write(n, t["copy_dst"], o[t["copy_src"]]) for n, o in zip(new, old)]
        if reloading:
            count = t["reload_dst"].shape[0]
            loaded = [row_view(r, layout, count) for r, layout in zip(reload_leaves, layouts)]
            new = [write(n, t["reload_dst"], r) for n, r in zip(new, loaded)]
        if t["send_rows"].shape[-1]:
            for d in range(1, num_members):
                packed = pack_rows(old, layouts, t["send_rows"][d - 1])
                perm = [(u, (u + d) % num_members) for u in range(num_members)]
                received = jax.lax.ppermute(packed, axis, perm)
                new = [write(n, t["recv_dst"][d - 1], unpack_leaf(received, layouts, i)) for i, n in enumerate(new)]
        if t["dup_dst"].shape[0]:
            new = [write(n, t["dup_dst"], n[t["dup_src"]]) for n in new]
        shapes = [new_lead + layout.row_shape for layout in layouts]
        moved = [from_row_view(n, layout, shape) for n, layout, shape in zip(new, layouts, shapes)]
        first = jax.lax.axis_index(axis) == 0
        out_scalars = []
        for value, dtype in zip(scalars, scalar_dtypes):
            bits = scalar_bits(dtype)
            raw = value.astype(bits) if np.dtype(dtype) == np.bool_ else jax.lax.bitcast_convert_type(value, bits)
            raw = jax.lax.psum(jnp.where(first, raw, jnp.zeros_like(raw)), axis)
            out_scalars.append(raw != 0 if np.dtype(dtype) == np.bool_ else jax.lax.bitcast_convert_type(raw, dtype))
        return moved, out_scalars

    table_spec, scalar_spec = PartitionSpec(axis), PartitionSpec()
    reload_specs = [PartitionSpec(axis)] * len(layouts) if reloading else []
    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(table_spec, list(specs), reload_specs, [scalar_spec] * len(scalar_dtypes)),
        out_specs=(list(specs), [scalar_spec] * len(scalar_dtypes)),
    )
    sharding = lambda spec: NamedSharding(mesh, spec)
    return jax.jit(
        mapped,
        in_shardings=(
            sharding(table_spec),
            [sharding(s) for s in specs],
            [sharding(s) for s in reload_specs],
            [sharding(scalar_spec)] * len(scalar_dtypes),
        ),
        out_shardings=([sharding(s) for s in specs], [sharding(scalar_spec)] * len(scalar_dtypes)),
    )

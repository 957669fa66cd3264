"""Mesh helpers: an EP mesh, the slot sharding, and putting host arrays on it.

Expert leaves are expert-major: a leading physical-slot axis ``[P, ...]`` (one
layer) or ``[L, P, ...]`` (all layers), the slot axis sharded over the EP mesh
axis so rank ``r`` holds slots ``r * P / G ... (r + 1) * P / G - 1``.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = ["ep_mesh", "axis_size", "slot_sharding", "put_host", "shard_slots"]


def ep_mesh(num_ranks: int | None = None, *, axis: str = "ep", devices=None) -> Mesh:
    """A one-axis mesh named ``axis`` over ``num_ranks`` devices (default: all of ``jax.devices()``).

    The axis type is ``Auto``, so jitted code may take arrays sharded over it
    without explicit-sharding annotations.
    """
    devices = list(jax.devices() if devices is None else devices)
    if num_ranks is None:
        num_ranks = len(devices)
    if not isinstance(num_ranks, (int, np.integer)) or not 1 <= num_ranks <= len(devices):
        raise ValueError(f"num_ranks must be an integer in [1, {len(devices)}], got {num_ranks!r}")
    return Mesh(np.array(devices[:num_ranks]), (axis,), axis_types=(jax.sharding.AxisType.Auto,))


def axis_size(mesh: Mesh, axis: str) -> int:
    """The number of devices along ``axis`` of ``mesh``; ``ValueError`` if the mesh has no such axis."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis not in mesh.axis_names:
        raise ValueError(f"mesh has no axis {axis!r}; its axes are {mesh.axis_names}")
    return int(mesh.shape[axis])


def slot_sharding(mesh: Mesh, ndim: int, *, axis: str = "ep", layered: bool = False) -> NamedSharding:
    """The sharding of an ``ndim``-dimensional leaf whose slot axis (0, or 1 when ``layered``) is over ``axis``."""
    axis_size(mesh, axis)
    lead = 2 if layered else 1
    if ndim < lead:
        raise ValueError(
            f"a {'[L, P, ...]' if layered else '[P, ...]'} leaf needs at least {lead} dimensions, got {ndim}"
        )
    spec: list[str | None] = [None] * ndim
    spec[lead - 1] = axis
    return NamedSharding(mesh, PartitionSpec(*spec))


def put_host(value, mesh: Mesh, spec: PartitionSpec = PartitionSpec()) -> jax.Array:
    """Places one host array on ``mesh`` with ``spec`` (default: replicated), from its host bytes.

    Every process passes the same full array; each device receives its block
    as raw bytes (no device-side op runs, so narrow-float bytes such as
    float8_e5m2 NaN payloads arrive unchanged). Works with several processes.
    """
    value = np.asarray(value)
    sharding = NamedSharding(mesh, spec)  # dtype given: a process with no device in ``mesh`` makes no shard
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index], dtype=value.dtype)


def shard_slots(tree, mesh: Mesh, *, axis: str = "ep", layered: bool = False):
    """Places a pytree of host (numpy) arrays on ``mesh`` with the slot axis sharded over ``axis``.

    Each leaf goes through :func:`put_host`, so it arrives byte for byte and
    works with several processes.
    """

    def put(x):
        x = np.asarray(x)
        return put_host(x, mesh, slot_sharding(mesh, x.ndim, axis=axis, layered=layered).spec)

    return jax.tree_util.tree_map(put, tree)

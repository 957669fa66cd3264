"""Helpers shared by the package's Pallas kernels (``pallas/``, ``routing/``, ``sharding/``)."""

from __future__ import annotations

import functools

import jax

__all__ = ["join_varying"]


def join_varying(*arrays):
    """Inside ``shard_map``: makes every input vary over the union of the inputs' manual axes.

    Returns the cast arrays and a ``ShapeDtypeStruct`` factory whose outputs
    vary over that union (``pallas_call`` needs it under ``check_vma=True``).
    """
    mats = [getattr(jax.typeof(a), "mat", None) for a in arrays]
    if any(m is None for m in mats):  # a jax without manual axis types
        return arrays, jax.ShapeDtypeStruct
    axes = frozenset().union(*(m.varying for m in mats))
    cast = []
    for array, mat in zip(arrays, mats):
        missing = tuple(sorted(axes - mat.varying, key=str))
        cast.append(jax.lax.pcast(array, missing, to="varying") if missing else array)
    mat = jax.sharding.ManualAxisType(varying=axes)
    return cast, functools.partial(jax.ShapeDtypeStruct, manual_axis_type=mat)

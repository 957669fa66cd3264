"""Three Triton operations that Pallas Triton does not expose (or lowers wrongly), as JAX primitives.

Pallas lowers a kernel body primitive by primitive to Triton IR; these
primitives lower to Triton ops that have no ``jax.lax`` counterpart:

* :func:`histogram` -> ``tt.histogram``: counts of a 1-D int32 tensor in
  ``num_bins`` bins. Triton builds it per warp from one ballot per bit of the
  bin index and ``popc`` over the bins each lane owns, then adds the warps'
  histograms with shared-memory atomics: no global atomics and no one-hot
  matrices, which is why ``map_and_count`` counts with it.
* :func:`take` -> ``tt.gather``: ``table[index]`` for a 1-D table held by the
  program (registers), lowered through shared memory (or warp shuffles)
  instead of one global-memory load per index.
* :func:`atomic_add_int` -> ``tt.atomic_rmw add`` (relaxed): ``ref[index] +=
  values`` where ``mask`` holds, as integer atomics (``plgpu.atomic_add``
  lowers an int32 *vector* add as a float add in jax 0.11.2, and is always
  ``acq_rel``).

Outside a Triton kernel (Pallas interpret mode, or plain ``jit``) they run as
ordinary jnp code with the same results, so the interpret-mode tests check
the kernels that use them. They lean on jax's private Pallas Triton lowering
registry (written for jax 0.11.2 and 0.12): importing this module fails where
those internals are gone, and the kernels' callers then fall back to XLA
(:func:`moe_eplb_jax._kernels.pallas_default`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax._src import core as jax_core
from jax._src.interpreters import mlir
from jax._src.lib.mlir.dialects import arith as arith_dialect
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas import primitives as pallas_primitives
from jax._src.pallas.triton import lowering as triton_lowering
from jax._src.state import discharge as state_discharge
from jax._src.state import primitives as state_primitives

__all__ = ["histogram", "take", "atomic_add_int"]


# ------------------------------------------------------------------ histogram
def histogram(values: jax.Array, num_bins: int, mask: jax.Array | None = None) -> jax.Array:
    """``[num_bins]`` int32 counts of the int32 ``values [n]`` where ``mask [n]`` holds.

    Values outside ``[0, num_bins)`` are not counted (also on the GPU, where
    ``tt.histogram`` alone would wrap them: they are masked here).
    ``num_bins`` must be a power of two, at least 32 (one bin per warp lane).
    """
    if num_bins < 32 or num_bins & (num_bins - 1):
        raise ValueError(f"num_bins must be a power of two >= 32, got {num_bins}")
    if values.ndim != 1 or values.dtype != jnp.int32:
        raise ValueError(f"values must be a 1-D int32 array, got {values.dtype} {values.shape}")
    inside = (values >= 0) & (values < num_bins)
    mask = inside if mask is None else mask & inside
    return _histogram_p.bind(values, mask, num_bins=int(num_bins))


_histogram_p = jax_core.Primitive("eplb_histogram")


def _histogram_jnp(values, mask, *, num_bins):
    bins = jnp.where(mask, values, num_bins)  # masked entries land out of range and are dropped
    return jnp.zeros((num_bins,), jnp.int32).at[bins].add(1, mode="drop")


@_histogram_p.def_abstract_eval
def _histogram_abstract(values, mask, *, num_bins):
    del values, mask
    return jax_core.ShapedArray((num_bins,), jnp.int32)


_histogram_p.def_impl(lambda values, mask, *, num_bins: _histogram_jnp(values, mask, num_bins=num_bins))
mlir.register_lowering(_histogram_p, mlir.lower_fun(_histogram_jnp, multiple_results=False))


@triton_lowering.register_lowering(_histogram_p)
def _histogram_triton(ctx, values, mask, *, num_bins):
    del num_bins
    result = mlir.aval_to_ir_type(ctx.context.mlir_ctx, ctx.avals_out[0])
    return tt_dialect.histogram(result, values, mask=mask)


# ----------------------------------------------------------------------- take
def take(table: jax.Array, index: jax.Array) -> jax.Array:
    """``table[index]`` for a 1-D ``table [m]`` (``m`` a power of two) and 1-D int32 ``index [n]`` in ``[0, m)``.

    Out-of-range indices are a caller error (clamped off the GPU, undefined in
    the kernel): callers clamp.
    """
    if table.ndim != 1 or index.ndim != 1 or index.dtype != jnp.int32:
        raise ValueError(
            f"take needs a 1-D table and 1-D int32 indices, got {table.shape} and {index.dtype} {index.shape}"
        )
    size = table.shape[0]
    if size & (size - 1):
        raise ValueError(f"the table size must be a power of two (a Triton tensor), got {size}")
    return _take_p.bind(table, index)


_take_p = jax_core.Primitive("eplb_take")


def _take_jnp(table, index):
    return table[jnp.clip(index, 0, table.shape[0] - 1)]


@_take_p.def_abstract_eval
def _take_abstract(table, index):
    return jax_core.ShapedArray(index.shape, table.dtype)


_take_p.def_impl(_take_jnp)
mlir.register_lowering(_take_p, mlir.lower_fun(_take_jnp, multiple_results=False))


@triton_lowering.register_lowering(_take_p)
def _take_triton(ctx, table, index):
    result = mlir.aval_to_ir_type(ctx.context.mlir_ctx, ctx.avals_out[0])
    return tt_dialect.gather(table, index, 0, results=[result])


# ------------------------------------------------------------- atomic_add_int
def atomic_add_int(ref, index: jax.Array, values: jax.Array, mask: jax.Array) -> None:
    """``ref[index[i]] += values[i]`` for every ``i`` where ``mask[i]``, as relaxed integer atomics.

    ``ref`` is a 1-D int32 ref of the kernel, ``index``, ``values`` and ``mask``
    1-D of one length; masked-off lanes may hold any index. Lanes adding to
    one address in one call are all applied (atomics on the GPU, a scatter-add
    in interpret mode). Relaxed: nothing is ordered around it, so it only
    suits counters read after the kernel.
    """
    if values.dtype != jnp.int32 or index.dtype != jnp.int32 or index.shape != values.shape:
        raise ValueError(
            f"atomic_add_int needs int32 index and values of one shape, got {index.dtype} "
            f"{index.shape} and {values.dtype} {values.shape}"
        )
    index = jnp.where(mask, index, 0)  # in range wherever the mask is off (the discharge rule indexes them)
    ref, transforms = state_primitives.get_ref_and_transforms(ref, (index,), "atomic_add_int")
    flat, tree = jax.tree_util.tree_flatten((ref, transforms, values, mask))
    _atomic_add_p.bind(*flat, args_tree=tree)


_atomic_add_p = jax_core.Primitive("eplb_atomic_add_int")


@_atomic_add_p.def_effectful_abstract_eval
def _atomic_add_abstract(*avals_flat, args_tree):
    return pallas_primitives._swap_abstract_eval(*avals_flat, args_tree=args_tree)


def _atomic_add_discharge(ctx, *args_flat, args_tree):
    del ctx
    ref, transforms, values, mask = args_tree.unflatten(args_flat)
    (indexer,) = transforms
    (index,) = indexer.indices
    old = ref[index]
    new = ref.at[index].add(jnp.where(mask, values, 0))
    return (new,) + (None,) * (len(args_flat) - 1), old


state_discharge.register_discharge_rule(_atomic_add_p)(_atomic_add_discharge)


@triton_lowering.register_lowering(_atomic_add_p)
def _atomic_add_triton(ctx, *args_flat, args_tree):
    block_info, *_ = ctx.block_infos
    ptr, transforms, values, mask = args_tree.unflatten(args_flat)
    *_, values_aval, mask_aval = args_tree.unflatten(ctx.avals_in)
    (indexer,) = transforms
    values = triton_lowering._ensure_ir_value(values, values_aval)
    mask = triton_lowering._ensure_ir_value(mask, mask_aval)
    ptr = triton_lowering._compute_pointers_from_indices(ptr, block_info, indexer)
    if isinstance(ptr, tuple):  # jax >= 0.12: (pointers, the lanes inside the block or None)
        ptr, inside = ptr
        if inside is not None:
            mask = arith_dialect.andi(mask, inside)
    return triton_lowering._atomic_rmw(
        tt_dialect.RMWOp.ADD, ptr, values, mask=mask, semantic=tt_dialect.MemSemantic.RELAXED
    )

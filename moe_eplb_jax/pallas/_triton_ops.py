"""Two Triton operations that Pallas Triton does not expose, as JAX primitives.

Pallas lowers a kernel body primitive by primitive to Triton IR; these two
primitives lower to Triton ops that have no ``jax.lax`` counterpart:

* :func:`histogram` -> ``tt.histogram``: counts of a 1-D int32 tensor in
  ``num_bins`` bins. Triton builds it per warp from one ballot per bit of the
  bin index and ``popc`` over the bins each lane owns, then adds the warps'
  histograms with shared-memory atomics: no global atomics and no one-hot
  matrices, which is why ``map_and_count`` counts with it.
* :func:`take` -> ``tt.gather``: ``table[index]`` for a 1-D table held by the
  program (registers), lowered through shared memory (or warp shuffles)
  instead of one global-memory load per index.

Outside a Triton kernel (Pallas interpret mode, or plain ``jit``) both run as
ordinary jnp code with the same results, so the interpret-mode tests check
the kernels that use them. They are internal to :mod:`moe_eplb_jax.pallas`:
they lean on jax's private Pallas Triton lowering registry (jax 0.11).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax._src import core as jax_core
from jax._src.interpreters import mlir
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering as triton_lowering

__all__ = ["histogram", "take"]


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
        raise ValueError(f"take needs a 1-D table and 1-D int32 indices, got {table.shape} and "
                         f"{index.dtype} {index.shape}")
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

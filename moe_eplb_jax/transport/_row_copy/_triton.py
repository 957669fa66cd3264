"""The Pallas (Triton) row-copy kernels: ``config.num_programs`` programs loop over the work items.

A work item is one ``[R, W]`` tile of one leaf (``R * W == Config.block``):
wide leaves take ``R = 1`` (one contiguous run of a row), narrow ones
(quantisation scales of a few words) several rows per item. Program ``p``
takes items ``p, p + num_programs, ...`` of the items of all leaves. Offsets
are int32 (``api.offsets_fit``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from moe_eplb_jax._kernels import join_varying
from moe_eplb_jax.transport._row_copy.config import Config

__all__ = ["gather_rows_triton", "scatter_rows_triton", "triton_backend"]


@functools.cache
def triton_backend():
    """Pallas' Triton backend; ``ValueError`` in a jax without it (the transport then copies rows with XLA)."""
    try:
        from jax.experimental.pallas import triton
    except ImportError as err:
        raise ValueError(f"Pallas' Triton backend is not available in this jax ({err}): use XLA's copies") from err
    return triton


def _tile(width: int, block: int) -> tuple[int, int]:
    """``(R, W)``: rows and columns of one work item of a leaf of ``width`` columns (``R * W == block``)."""
    cols = min(block, pl.next_power_of_2(width))
    return block // cols, cols


def _schedule(widths, num_selected, block, num_programs):
    """Per leaf ``(R, W, column blocks, items, first global item)``; items are numbered over all leaves."""
    plans, base = [], 0
    for width in widths:
        rows, cols = _tile(width, block)
        col_blocks = pl.cdiv(width, cols)
        items = pl.cdiv(num_selected, rows) * col_blocks
        plans.append((rows, cols, col_blocks, items, base % num_programs))
        base += items
    return plans


def _pow2_factor(value: int, cap: int = 16) -> int:
    """Largest power of two (at most ``cap``) dividing ``value`` (``cap`` for 0)."""
    return cap if value == 0 else min(cap, value & -value)


def _hint(offset, *terms):
    """``pl.multiple_of`` for an offset that is a sum of multiples of the static ``terms`` (16 at most)."""
    multiple = min(_pow2_factor(term) for term in terms)
    return pl.multiple_of(offset, (multiple,) * max(1, offset.ndim)) if multiple > 1 else offset


def _for_items(program, num_programs, items, first_global, body):
    """Runs ``body(item)`` for this program's items of one leaf: ``item = start + k * num_programs``."""
    # Leaf items are global items base .. base + items - 1; program p owns the global items == p (mod P).
    # Non-negative operands: truncating lax.div / lax.rem (no floor-division fix-ups in the kernel).
    start = jax.lax.rem(program + (num_programs - first_global), num_programs)
    trips = jax.lax.div(items - start + (num_programs - 1), num_programs)

    def step(k, carry):
        body(start + k * num_programs)
        return carry

    jax.lax.fori_loop(0, trips, step, 0)


def _item_coords(item, rows, cols, col_blocks, num_selected):
    """Selected-row indices ``[R, 1]`` (and which are < C), columns ``[1, W]`` of one work item."""
    group = jax.lax.div(item, col_blocks)
    col_block = jax.lax.rem(item, col_blocks)
    selected = group * rows + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    columns = col_block * cols + jax.lax.broadcasted_iota(jnp.int32, (1, cols), 1)
    return selected, selected < num_selected, columns


def _safe(offsets, mask, size, interpret):
    """Interpret mode: masked lanes point past the end (its scatter drops them; no duplicate index races)."""
    return jnp.where(mask, offsets, size) if interpret else offsets


def _item_rows(index_ref, item, rows, cols, col_blocks, num_selected, index_start, interpret, other):
    """:func:`_item_coords` and the item's entries of the index (``other`` where masked), from ``index_start``."""
    selected, row_ok, columns = _item_coords(item, rows, cols, col_blocks, num_selected)
    at = index_start + _safe(selected, row_ok, num_selected, interpret)
    return selected, row_ok, columns, triton_backend().load(index_ref.at[at], mask=row_ok, other=other)


def _gather_kernel(rows_ref, *refs, num_rows, num_selected, widths, total, plans, num_programs, interpret, index_start):
    *view_refs, out_ref = refs
    program = pl.program_id(0)
    offset = 0
    for view_ref, width, (rows, cols, col_blocks, items, first) in zip(view_refs, widths, plans):

        def copy(item, view_ref=view_ref, width=width, offset=offset, rows=rows, cols=cols, col_blocks=col_blocks):
            selected, row_ok, columns, index = _item_rows(
                rows_ref, item, rows, cols, col_blocks, num_selected, index_start, interpret, other=0
            )
            index = jnp.clip(index, 0, num_rows - 1)  # out-of-range rows are clamped: never an out-of-bounds read
            mask = row_ok & (columns < width)
            src = _hint(index * width, width) + columns
            words = triton_backend().load(view_ref.at[src], mask=mask, other=jnp.uint32(0))
            dst = _hint(selected * total + offset, total, offset) + columns
            triton_backend().store(out_ref.at[_safe(dst, mask, num_selected * total, interpret)], words, mask=mask)

        _for_items(program, num_programs, items, first, copy)
        offset += width


def _scatter_kernel(
    dst_ref, packed_ref, *refs, num_rows, num_selected, widths, total, plans, num_programs, interpret, index_start
):
    out_refs = refs[len(widths) :]  # the aliased views; the inputs refs[:len(widths)] are the same buffers
    program = pl.program_id(0)
    offset = 0
    for out_ref, width, (rows, cols, col_blocks, items, first) in zip(out_refs, widths, plans):

        def copy(item, out_ref=out_ref, width=width, offset=offset, rows=rows, cols=cols, col_blocks=col_blocks):
            selected, row_ok, columns, index = _item_rows(
                dst_ref, item, rows, cols, col_blocks, num_selected, index_start, interpret, other=-1
            )
            row_ok = row_ok & (index >= 0) & (index < num_rows)  # out-of-range destinations are skipped
            mask = row_ok & (columns < width)
            src = _hint(selected * total + offset, total, offset) + columns
            words = triton_backend().load(
                packed_ref.at[_safe(src, mask, num_selected * total, interpret)], mask=mask, other=jnp.uint32(0)
            )
            dst = _hint(jnp.where(row_ok, index, 0) * width, width) + columns
            triton_backend().store(out_ref.at[_safe(dst, mask, num_rows * width, interpret)], words, mask=mask)

        _for_items(program, num_programs, items, first, copy)
        offset += width


def gather_rows_triton(row_views, rows, *, num_rows, widths, num_selected, config: Config, interpret, index_start):
    """The gather kernel on checked inputs (``num_selected > 0``, ``num_rows > 0``)."""
    total = sum(widths)
    num_programs, block = int(config.num_programs), int(config.block)
    plans = _schedule(widths, num_selected, block, num_programs)
    (rows, *flat), out_struct = join_varying(jnp.asarray(rows), *(jnp.asarray(v).reshape(-1) for v in row_views))
    kernel = functools.partial(
        _gather_kernel,
        num_rows=num_rows,
        num_selected=num_selected,
        widths=widths,
        total=total,
        plans=plans,
        num_programs=num_programs,
        interpret=interpret,
        index_start=int(index_start),
    )
    packed = pl.pallas_call(
        kernel,
        grid=(num_programs,),
        in_specs=[pl.no_block_spec] * (1 + len(flat)),
        out_specs=pl.no_block_spec,
        out_shape=out_struct((num_selected * total,), jnp.uint32),
        compiler_params=triton_backend().CompilerParams(
            num_warps=int(config.num_warps), num_stages=int(config.num_stages)
        ),
        interpret=interpret,
        name="gather_rows",
    )(rows, *flat)
    return packed.reshape(num_selected, total)


def scatter_rows_triton(
    row_views, packed, dst, *, num_rows, widths, num_selected, config: Config, interpret, index_start
):
    """The scatter kernel on checked inputs (``num_selected > 0``, ``num_rows > 0``)."""
    total = sum(widths)
    num_programs, block = int(config.num_programs), int(config.block)
    plans = _schedule(widths, num_selected, block, num_programs)
    (dst, packed, *flat), out_struct = join_varying(
        jnp.asarray(dst), jnp.asarray(packed).reshape(-1), *(jnp.asarray(v).reshape(-1) for v in row_views)
    )
    kernel = functools.partial(
        _scatter_kernel,
        num_rows=num_rows,
        num_selected=num_selected,
        widths=widths,
        total=total,
        plans=plans,
        num_programs=num_programs,
        interpret=interpret,
        index_start=int(index_start),
    )
    outs = pl.pallas_call(
        kernel,
        grid=(num_programs,),
        in_specs=[pl.no_block_spec] * (2 + len(flat)),
        out_specs=[pl.no_block_spec] * len(flat),
        out_shape=[out_struct((num_rows * width,), jnp.uint32) for width in widths],
        input_output_aliases={2 + i: i for i in range(len(flat))},
        compiler_params=triton_backend().CompilerParams(
            num_warps=int(config.num_warps), num_stages=int(config.num_stages)
        ),
        interpret=interpret,
        name="scatter_rows",
    )(dst, packed, *flat)
    return [out.reshape(num_rows, width) for out, width in zip(outs, widths)]

"""Row gather / scatter kernels with a bounded grid (Pallas, Triton backend).

``gather_rows(row_views, rows)`` packs rows ``[C]`` of uint32 row views
``[N, m_i]`` into one ``[C, sum(m_i)]`` buffer; ``scatter_rows(row_views,
packed, dst)`` writes packed rows back into the views in place. The
transport's stream schedule runs them beside an NCCL transfer: XLA's gather
and scatter fusions fill every SM at full HBM speed and slow the transfer
they overlap, while these kernels launch ``Config.num_programs`` programs that
loop over their work items, taking a bounded share of the GPU.

A work item is one ``[R, W]`` tile of one leaf (``R * W == Config.block``):
wide leaves take ``R = 1`` (one contiguous run of a row), narrow ones
(quantisation scales of a few words) several rows per item. Program ``p``
takes items ``p, p + num_programs, ...`` of the items of all leaves.

Offsets are int32: every view needs ``N * m < 2**31`` words and the packed
buffer ``C * sum(m) < 2**31`` (:func:`offsets_fit`). Off the GPU the kernels
run in Pallas interpret mode.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from moe_eplb_jax._kernels import join_varying

__all__ = ["Config", "gather_rows", "scatter_rows", "offsets_fit"]

_MAX_OFFSET = 2**31  # int32 flat offsets


@dataclasses.dataclass(frozen=True)
class Config:
    """Tiling of the row-copy kernels.

    ``num_programs`` CUDA blocks share the work: few enough to leave a
    concurrent transfer its bandwidth, enough that the copies keep up with it
    (the default suits an H200 moving rows of about half a megabyte). ``block`` words are copied per loop
    step (a power of two >= 128; a multiple of ``4 * 32 * num_warps`` gives
    16-byte accesses); ``num_warps`` and ``num_stages`` go to Triton.
    """

    num_programs: int = 48
    block: int = 4096
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("num_programs", "num_warps", "num_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        block = self.block
        if isinstance(block, bool) or not isinstance(block, int | np.integer) or block < 128 or block & (block - 1):
            raise ValueError(f"block must be a power of two >= 128, got {block!r}")


@functools.cache
def _triton():
    """Pallas' Triton backend; ``ValueError`` in a jax without it (the transport then copies rows with XLA)."""
    try:
        from jax.experimental.pallas import triton
    except ImportError as err:
        raise ValueError(f"Pallas' Triton backend is not available in this jax ({err}): use XLA's copies") from err
    return triton


def offsets_fit(num_rows: int, widths, num_selected: int) -> bool:
    """Whether views ``[num_rows, m]`` of these widths and ``num_selected`` packed rows fit int32 offsets."""
    return max(num_rows * w for w in widths) < _MAX_OFFSET and num_selected * sum(widths) < _MAX_OFFSET


# ----------------------------------------------------------------- validation
def _dtype_shape(x):
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        x = np.asarray(x)
        dtype = x.dtype
    return jnp.dtype(dtype), tuple(np.shape(x))


def _check_views(row_views) -> tuple[int, tuple[int, ...]]:
    """``(N, widths)`` of the row views, or a ``ValueError``."""
    if isinstance(row_views, jax.Array | np.ndarray) or not isinstance(row_views, Sequence):
        raise ValueError(f"row_views must be a sequence of 2-D uint32 arrays, got {type(row_views).__name__}")
    if not row_views:
        raise ValueError("row_views must hold at least one array")
    num_rows, widths = None, []
    for i, view in enumerate(row_views):
        dtype, shape = _dtype_shape(view)
        if dtype != jnp.uint32:
            raise ValueError(f"row_views[{i}] must have dtype uint32, got {dtype}")
        if len(shape) != 2:
            raise ValueError(f"row_views[{i}] must have 2 dimensions [N, m], got shape {shape}")
        if shape[1] < 1:
            raise ValueError(f"row_views[{i}] must have at least one column, got shape {shape}")
        if num_rows is None:
            num_rows = shape[0]
        elif shape[0] != num_rows:
            raise ValueError(
                f"row_views must all have the same number of rows N: row_views[0] has {num_rows}, "
                f"row_views[{i}] has {shape[0]}"
            )
        if shape[0] * shape[1] >= _MAX_OFFSET:
            raise ValueError(
                f"row_views[{i}] has {shape[0]} x {shape[1]} words, too many for int32 offsets "
                f"(N * m must be < 2**31): use the XLA path"
            )
        widths.append(int(shape[1]))
    assert num_rows is not None
    return int(num_rows), tuple(widths)


def _check_index(name, index, start: int = 0, count: int | None = None) -> int:
    """``C``: the number of entries used, ``index[start : start + C]`` (all from ``start`` when ``count`` is None)."""
    dtype, shape = _dtype_shape(index)
    if dtype != jnp.int32:
        raise ValueError(f"{name} must have dtype int32, got {dtype}")
    if len(shape) != 1:
        raise ValueError(f"{name} must have 1 dimension [C], got shape {shape}")
    for what, value in (("index_start", start), ("index_count", count)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0):
            raise ValueError(f"{what} must be an int >= 0, got {value!r}")
    used = shape[0] - start if count is None else count
    if start + used > shape[0] or used < 0:
        raise ValueError(f"{name} has {shape[0]} entries: too few for index_start={start}, index_count={used}")
    return int(used)


def _check_config(config, interpret) -> bool:
    """Interpret mode (off the GPU unless ``interpret`` says), or a ``ValueError``."""
    if not isinstance(config, Config):
        raise ValueError(f"config must be a _row_copy.Config, got {type(config).__name__}")
    if interpret is not None and not isinstance(interpret, bool):
        raise ValueError(f"interpret must be None or a bool, got {interpret!r}")
    _triton()
    return jax.default_backend() != "gpu" if interpret is None else interpret


def _check_packed_size(num_selected, total):
    if num_selected * total >= _MAX_OFFSET:
        raise ValueError(
            f"the packed buffer has {num_selected} x {total} words, too many for int32 offsets "
            f"(C * sum(m) must be < 2**31): use the XLA path"
        )


# --------------------------------------------------------------------- kernels
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
    return selected, row_ok, columns, _triton().load(index_ref.at[at], mask=row_ok, other=other)


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
            words = _triton().load(view_ref.at[src], mask=mask, other=jnp.uint32(0))
            dst = _hint(selected * total + offset, total, offset) + columns
            _triton().store(out_ref.at[_safe(dst, mask, num_selected * total, interpret)], words, mask=mask)

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
            words = _triton().load(
                packed_ref.at[_safe(src, mask, num_selected * total, interpret)], mask=mask, other=jnp.uint32(0)
            )
            dst = _hint(jnp.where(row_ok, index, 0) * width, width) + columns
            _triton().store(out_ref.at[_safe(dst, mask, num_rows * width, interpret)], words, mask=mask)

        _for_items(program, num_programs, items, first, copy)
        offset += width


# --------------------------------------------------------------------- wrappers
def gather_rows(
    row_views: Sequence[jax.Array],
    rows: jax.Array,
    *,
    config: Config = Config(),
    interpret: bool | None = None,
    index_start: int = 0,
    index_count: int | None = None,
) -> jax.Array:
    """Gathers rows of several row views into one packed buffer, on ``config.num_programs`` programs.

    **Arguments:**

    - `row_views`: a sequence of uint32 arrays of shape ``[N, m_i]``, all with
      the same number of rows ``N`` and any widths ``m_i >= 1``, with
      ``N * m_i < 2**31``.
    - `rows`: an int32 array of shape ``[C]``, the rows to gather, each in
      ``[0, N)`` (callers pad with row 0; rows outside are clamped into range).
      With `index_start` / `index_count` it may be a longer table of which
      ``rows[index_start : index_start + index_count]`` are used (default: all
      from `index_start`) -- read in place, where a sliced operand would cost
      the executor a copy (and a launch) per call.
    - `config`: the kernel's tiling (:class:`Config`).
    - `interpret`: Pallas interpret mode; ``None`` picks it when
      ``jax.default_backend() != "gpu"``.

    **Returns:**

    A uint32 array of shape ``[C, sum(m_i)]``: row ``c`` holds row ``rows[c]``
    of every view, leaf after leaf, i.e.
    ``jnp.concatenate([v[rows] for v in row_views], axis=1)``.

    **Raises:**

    ``ValueError`` (before any device work) on a wrong dtype or rank, views
    with different ``N``, a bad ``config``, sizes too large for int32 offsets,
    or a jax without Pallas' Triton backend.
    """
    num_rows, widths = _check_views(row_views)
    num_selected = _check_index("rows", rows, index_start, index_count)
    interpret = _check_config(config, interpret)
    total = sum(widths)
    _check_packed_size(num_selected, total)
    if num_selected == 0:
        return jnp.zeros((0, total), jnp.uint32)
    if num_rows == 0:
        raise ValueError(f"rows has {num_selected} entries but the row views have no rows (N = 0)")
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
        compiler_params=_triton().CompilerParams(num_warps=int(config.num_warps), num_stages=int(config.num_stages)),
        interpret=interpret,
        name="gather_rows",
    )(rows, *flat)
    return packed.reshape(num_selected, total)


def scatter_rows(
    row_views: Sequence[jax.Array],
    packed: jax.Array,
    dst: jax.Array,
    *,
    config: Config = Config(),
    interpret: bool | None = None,
    index_start: int = 0,
    index_count: int | None = None,
) -> list[jax.Array]:
    """Scatters the rows of a packed buffer into several row views, in place, on ``config.num_programs`` programs.

    **Arguments:**

    - `row_views`: a sequence of uint32 arrays of shape ``[N, m_i]``, all with
      the same ``N`` and any widths ``m_i >= 1``, with ``N * m_i < 2**31``.
      Donate them (``jax.jit(..., donate_argnums=...)``) to update them
      without copying: only the written rows are touched.
    - `packed`: a uint32 array of shape ``[C, sum(m_i)]``; leaf ``i``'s
      columns start at ``sum(m_0 .. m_{i-1})`` (the layout of
      :func:`gather_rows`).
    - `dst`: an int32 array of shape ``[C]``: packed row ``c`` goes to row
      ``dst[c]`` of every view. Entries outside ``[0, N)``, negative ones
      included, are skipped (callers pad with distinct out-of-range rows);
      in-range entries must be distinct.
    - `config`, `interpret`, `index_start`, `index_count`: as in
      :func:`gather_rows` (``C`` is then the number of entries used).

    **Returns:**

    A list of the updated views (same shapes), equal to
    ``[v.at[dst].set(packed[:, off_i:off_i + m_i], mode="drop", unique_indices=True) for each i]``;
    rows not named in ``dst`` keep their bytes. (Unlike ``.at[]``, which
    wraps a negative index around, a negative ``dst[c]`` is skipped.)

    **Raises:**

    ``ValueError`` (before any device work) on a wrong dtype or rank, views
    with different ``N``, ``packed`` not ``[len(dst), sum(m_i)]``, a bad
    ``config``, sizes too large for int32 offsets, or a jax without Pallas'
    Triton backend.
    """
    num_rows, widths = _check_views(row_views)
    num_selected = _check_index("dst", dst, index_start, index_count)
    dtype, shape = _dtype_shape(packed)
    if dtype != jnp.uint32:
        raise ValueError(f"packed must have dtype uint32, got {dtype}")
    if len(shape) != 2:
        raise ValueError(f"packed must have 2 dimensions [C, sum(m)], got shape {shape}")
    total = sum(widths)
    if shape[0] != num_selected:
        raise ValueError(f"packed has {shape[0]} rows but dst has {num_selected} entries (both must be C)")
    if shape[1] != total:
        raise ValueError(f"packed has {shape[1]} columns but the row views' widths {widths} sum to {total}")
    interpret = _check_config(config, interpret)
    _check_packed_size(num_selected, total)
    if num_selected == 0 or num_rows == 0:
        return [jnp.asarray(v) for v in row_views]
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
        compiler_params=_triton().CompilerParams(num_warps=int(config.num_warps), num_stages=int(config.num_stages)),
        interpret=interpret,
        name="scatter_rows",
    )(dst, packed, *flat)
    return [out.reshape(num_rows, width) for out, width in zip(outs, widths)]

"""``gather_rows`` / ``scatter_rows``: the semantics, the checks and the implementation choice.

Offsets are int32: every view needs ``N * m < 2**31`` words and the packed
buffer ``C * sum(m) < 2**31`` (:func:`offsets_fit`). Off the GPU the kernels
run in Pallas interpret mode.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from moe_eplb_jax.transport._row_copy import _triton
from moe_eplb_jax.transport._row_copy.config import Config
from moe_eplb_jax.transport._row_copy.reference import gather_rows_reference, scatter_rows_reference

__all__ = ["IMPLEMENTATIONS", "gather_rows", "offsets_fit", "scatter_rows"]

IMPLEMENTATIONS = ("pallas", "xla")  # the bounded-grid kernels; the jnp reference
_MAX_OFFSET = 2**31  # int32 flat offsets


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


def _check_config(config, interpret, implementation) -> bool:
    """Interpret mode (off the GPU unless ``interpret`` says), or a ``ValueError``."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if not isinstance(config, Config):
        raise ValueError(f"config must be a _row_copy.Config, got {type(config).__name__}")
    if interpret is not None and not isinstance(interpret, bool):
        raise ValueError(f"interpret must be None or a bool, got {interpret!r}")
    if implementation == "pallas":
        _triton.triton_backend()
    return jax.default_backend() != "gpu" if interpret is None else interpret


def _check_packed_size(num_selected, total):
    if num_selected * total >= _MAX_OFFSET:
        raise ValueError(
            f"the packed buffer has {num_selected} x {total} words, too many for int32 offsets "
            f"(C * sum(m) must be < 2**31): use the XLA path"
        )


def gather_rows(
    row_views: Sequence[jax.Array],
    rows: jax.Array,
    *,
    config: Config = Config(),
    interpret: bool | None = None,
    implementation: str = "pallas",
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
    - `implementation`: one of :data:`IMPLEMENTATIONS` (``"xla"``: the
      reference, after the same checks).

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
    interpret = _check_config(config, interpret, implementation)
    total = sum(widths)
    _check_packed_size(num_selected, total)
    if num_selected == 0:
        return jnp.zeros((0, total), jnp.uint32)
    if num_rows == 0:
        raise ValueError(f"rows has {num_selected} entries but the row views have no rows (N = 0)")
    if implementation == "xla":
        rows = jnp.asarray(rows)[index_start : index_start + num_selected]
        return gather_rows_reference(row_views, rows)
    return _triton.gather_rows_triton(
        row_views,
        rows,
        num_rows=num_rows,
        widths=widths,
        num_selected=num_selected,
        config=config,
        interpret=interpret,
        index_start=index_start,
    )


def scatter_rows(
    row_views: Sequence[jax.Array],
    packed: jax.Array,
    dst: jax.Array,
    *,
    config: Config = Config(),
    interpret: bool | None = None,
    implementation: str = "pallas",
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
    - `config`, `interpret`, `implementation`, `index_start`, `index_count`: as in
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
    interpret = _check_config(config, interpret, implementation)
    _check_packed_size(num_selected, total)
    if num_selected == 0 or num_rows == 0:
        return [jnp.asarray(v) for v in row_views]
    if implementation == "xla":
        return scatter_rows_reference(row_views, packed, jnp.asarray(dst)[index_start : index_start + num_selected])
    return _triton.scatter_rows_triton(
        row_views,
        packed,
        dst,
        num_rows=num_rows,
        widths=widths,
        num_selected=num_selected,
        config=config,
        interpret=interpret,
        index_start=index_start,
    )

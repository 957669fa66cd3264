"""Slot rows as bytes: the leaves of every moving slot become one packed row.

A leaf with leading slot axes ``[N, *row_shape]`` is handled as a *row view*
``[N, m]`` (``m`` elements per row), in one of two forms:

* ``word_view``: rows whose size is a multiple of 4 bytes as ``uint32`` words.
  Gathers and scatters then move 4 bytes per element -- about twice as fast
  as 1-byte dtypes on H200 -- and XLA:GPU makes the whole-leaf bitcast free
  (no extra memory measured). The GPU default.
* the leaf's own dtype (a reshape only), except float8_e5m2, whose NaN
  payloads XLA:CPU rewrites in gathers and scatters: e5m2 leaves are viewed as
  ``uint8``. The CPU default, because XLA:CPU materialises a whole-leaf
  ``bitcast_convert_type`` as a copy.

Both forms are byte-exact for every dtype (tested with random bytes, NaN
payloads included, on CPU and on 2xH200).

Only rows that move are packed: :func:`pack_rows` gathers the requested rows
of several leaves into one ``[C, B]`` buffer -- ``uint32`` words when every
leaf is viewed as words, else ``uint8`` bytes (:func:`to_byte_rows`: bitcast;
4-bit dtypes in pairs, element ``2i`` in the low nibble of byte ``i``, so a
row needs an even element count). Either way the buffer holds each row's
bytes in order, leaf after leaf. ``pack_rows_numpy`` is the host reference.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "BYTE_VIEW_DTYPES",
    "LeafLayout",
    "leaf_layout",
    "row_view",
    "from_row_view",
    "to_byte_rows",
    "from_byte_rows",
    "pack_rows",
    "unpack_leaf",
    "unpack_rows",
    "wire_dtype",
    "wire_offsets",
    "pack_rows_numpy",
    "byte_rows_numpy",
]


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """How one leaf's slot row maps to bytes.

    ``dtype`` is the leaf's dtype, ``row_shape`` the shape of one slot's row,
    ``row_bytes`` its size in bytes and ``view_dtype`` the dtype of the row
    view (``uint8`` for dtypes in ``BYTE_VIEW_DTYPES``, else ``dtype``).
    """

    dtype: np.dtype
    row_shape: tuple[int, ...]
    row_bytes: int
    view_dtype: np.dtype

    @property
    def row_elements(self) -> int:
        return math.prod(self.row_shape)


# Dtypes whose gathers / scatters are not byte-exact on some backend: moved through uint8 views.
BYTE_VIEW_DTYPES = frozenset({np.dtype(jnp.float8_e5m2)})


# ml_dtypes floats report numpy kind 'V'.
_ML_DTYPE_KINDS = frozenset(
    np.dtype(d)
    for d in (
        jnp.bfloat16,
        jnp.float8_e4m3fn,
        jnp.float8_e5m2,
        jnp.float8_e8m0fnu,
        jnp.float4_e2m1fn,
        jnp.float8_e4m3fnuz,
        jnp.float8_e5m2fnuz,
        jnp.float8_e4m3b11fnuz,
        jnp.int4,
        jnp.uint4,
    )
    + tuple(getattr(jnp, n) for n in ("float8_e3m4", "float8_e4m3") if hasattr(jnp, n))
)


def _bits(dtype) -> int:
    return int(jax.dtypes.itemsize_bits(np.dtype(dtype)))


def leaf_layout(dtype, row_shape: Sequence[int], *, name: str = "leaf", word_view: bool = False) -> LeafLayout:
    """The byte layout of one row of ``row_shape`` elements of ``dtype``.

    With ``word_view`` a row whose size is a multiple of 4 bytes is handled as
    ``uint32`` words (gathers and scatters then move 4 bytes per element).
    Raises ``ValueError`` for dtypes that cannot be viewed as bytes and for
    4-bit rows with an odd element count.
    """
    dtype = np.dtype(dtype)
    row_shape = tuple(int(d) for d in row_shape)
    count = math.prod(row_shape)
    if dtype.kind not in "biuf" and dtype not in _ML_DTYPE_KINDS:
        raise ValueError(f"{name}: dtype {dtype} cannot be moved as bytes (need bool, integer or float)")
    bits = _bits(dtype)
    if bits == 4:
        if count % 2:
            raise ValueError(
                f"{name}: a {dtype} row of shape {row_shape} has {count} elements; 4-bit rows are moved as "
                "byte pairs and need an even element count per slot"
            )
        row_bytes = count // 2
    elif bits in (8, 16, 32, 64):
        row_bytes = count * bits // 8
    else:
        raise ValueError(f"{name}: dtype {dtype} ({bits} bits) cannot be moved as bytes")
    if word_view and row_bytes % 4 == 0 and bits <= 32 and dtype != np.bool_:
        view = np.dtype(np.uint32)
    elif dtype in BYTE_VIEW_DTYPES:
        view = np.dtype(np.uint8)
    else:
        view = dtype
    return LeafLayout(dtype, row_shape, row_bytes, view)


def row_view(x: jax.Array, layout: LeafLayout, num_rows: int) -> jax.Array:
    """``x [.., *row_shape]`` with ``num_rows`` rows as the row view ``[num_rows, m]`` of ``layout.view_dtype``."""
    flat = x.reshape(num_rows, layout.row_elements)
    if layout.view_dtype == layout.dtype:
        return flat
    ratio = _bits(layout.view_dtype) // _bits(layout.dtype)
    if ratio > 1:  # several elements per view element: group them on a trailing axis
        flat = flat.reshape(num_rows, layout.row_elements // ratio, ratio)
    return jax.lax.bitcast_convert_type(flat, layout.view_dtype)


def from_row_view(rows: jax.Array, layout: LeafLayout, shape: Sequence[int]) -> jax.Array:
    """Inverse of :func:`row_view`: back to ``layout.dtype`` and ``shape``."""
    if layout.view_dtype != layout.dtype:
        rows = jax.lax.bitcast_convert_type(rows, layout.dtype)  # [N, w] or [N, w, ratio]
    return rows.reshape(tuple(shape))


def to_byte_rows(rows: jax.Array, layout: LeafLayout) -> jax.Array:
    """Row view ``[C, m]`` to ``uint8 [C, row_bytes]`` (bitcast; 4-bit dtypes in pairs)."""
    num_rows = rows.shape[0]
    if rows.dtype == jnp.uint8:
        return rows
    if rows.dtype == jnp.bool_:
        return rows.astype(jnp.uint8)  # bool is one 0/1 byte: exact
    if _bits(rows.dtype) == 4:
        rows = rows.reshape(num_rows, layout.row_bytes, 2)
    return jax.lax.bitcast_convert_type(rows, jnp.uint8).reshape(num_rows, layout.row_bytes)


def from_byte_rows(rows: jax.Array, layout: LeafLayout) -> jax.Array:
    """Inverse of :func:`to_byte_rows`: ``uint8 [C, row_bytes]`` to the row view ``[C, m]``."""
    num_rows = rows.shape[0]
    view = layout.view_dtype
    if view == np.uint8:
        return rows
    if view == np.bool_:
        return rows != jnp.uint8(0)
    bits = _bits(view)
    if bits == 4:
        return jax.lax.bitcast_convert_type(rows, view).reshape(num_rows, layout.row_elements)
    if bits == 8:
        return jax.lax.bitcast_convert_type(rows, view)
    return jax.lax.bitcast_convert_type(rows.reshape(num_rows, -1, bits // 8), view)


def wire_dtype(layouts: Sequence[LeafLayout]) -> np.dtype:
    """The element type of packed rows: ``uint32`` words when every leaf is viewed as words, else ``uint8``."""
    if layouts and all(lay.view_dtype == np.uint32 for lay in layouts):
        return np.dtype(np.uint32)
    return np.dtype(np.uint8)


def wire_offsets(layouts: Sequence[LeafLayout]) -> list[int]:
    """Column offsets of each leaf in a packed row (in ``wire_dtype`` elements), plus the total."""
    unit = np.dtype(wire_dtype(layouts)).itemsize
    return [int(o) // unit for o in np.cumsum([0] + [lay.row_bytes for lay in layouts])]


def pack_rows(row_views: Sequence[jax.Array], layouts: Sequence[LeafLayout], rows: jax.Array) -> jax.Array:
    """Gathers ``rows [C]`` of every row view into one packed ``[C, B]`` buffer of ``wire_dtype`` bytes/words.

    Row indices must be in ``[0, N)``; only the ``C`` requested rows are read.
    """
    if wire_dtype(layouts) == np.uint32:
        return jnp.concatenate([v[rows] for v in row_views], axis=1)
    return jnp.concatenate([to_byte_rows(v[rows], lay) for v, lay in zip(row_views, layouts)], axis=1)


def unpack_leaf(packed: jax.Array, layouts: Sequence[LeafLayout], index: int) -> jax.Array:
    """Leaf ``index``'s row view ``[C, m]`` from packed rows made by :func:`pack_rows`."""
    offsets = wire_offsets(layouts)
    part = packed[:, offsets[index] : offsets[index + 1]]
    return part if packed.dtype == jnp.uint32 else from_byte_rows(part, layouts[index])


def unpack_rows(packed: jax.Array, layouts: Sequence[LeafLayout]) -> list[jax.Array]:
    """Splits packed ``[C, B]`` rows from :func:`pack_rows` into the leaves' row views ``[C, m_i]``."""
    width = wire_offsets(layouts)[-1]
    if packed.shape[1] != width or packed.dtype != wire_dtype(layouts):
        raise ValueError(
            f"packed rows are {packed.dtype} [*, {packed.shape[1]}], the leaves need {wire_dtype(layouts)} [*, {width}]"
        )
    return [unpack_leaf(packed, layouts, i) for i in range(len(layouts))]


# ------------------------------------------------------------- host reference
def byte_rows_numpy(x: np.ndarray, num_lead: int = 1) -> np.ndarray:
    """Host reference of :func:`to_byte_rows` for numpy (ml_dtypes) arrays with ``num_lead`` row axes.

    ml_dtypes stores one 4-bit element per byte (low nibble); pairs are packed
    here exactly as on device.
    """
    x = np.asarray(x)
    lead = x.shape[:num_lead]
    num_rows = math.prod(lead)
    layout = leaf_layout(x.dtype, x.shape[num_lead:])
    flat = np.ascontiguousarray(x).reshape(num_rows, -1)
    if _bits(x.dtype) == 4:
        nibbles = flat.view(np.uint8) & np.uint8(0x0F)
        packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << np.uint8(4))
        return packed.reshape(lead + (layout.row_bytes,))
    return flat.view(np.uint8).reshape(lead + (layout.row_bytes,))


def pack_rows_numpy(leaves: Sequence[np.ndarray], rows: np.ndarray) -> np.ndarray:
    """Host reference of :func:`pack_rows` starting from typed ``[N, *row_shape]`` leaves."""
    rows = np.asarray(rows)
    return np.concatenate([byte_rows_numpy(leaf, 1)[rows] for leaf in leaves], axis=1)

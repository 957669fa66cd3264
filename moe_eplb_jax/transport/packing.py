"""Slot rows as unsigned integers: the leaves of every moving slot become one packed row.

A leaf with leading slot axes ``[N, *row_shape]`` is handled as a *row view*
``[N, m]`` of unsigned integers: ``uint32`` words where a row is a multiple of
4 bytes, else the unsigned type of the element's width (``uint8`` for 8-, 4-
and 2-bit dtypes, sub-byte elements packed into whole bytes, and bools;
``uint16`` for 16-bit). :func:`pack_rows` gathers the rows that move of
several leaves into one ``[C, B]`` buffer: ``uint32`` words when every leaf is
viewed as words, else ``uint8`` bytes (:func:`to_byte_rows`; sub-byte element
``j`` of byte ``i`` is element ``i * 8 / bits + j``, lowest bits first, so a
sub-byte row needs a whole number of bytes). Either way the buffer holds each
row's bytes in order, leaf after leaf; :func:`pack_rows_numpy` is the host
reference.

Why unsigned integers: the only op that sees a leaf's own dtype is the
bitcast into (and out of) its view, so no gather, scatter, select or
concatenate ever handles a float. Float ops are not byte-exact on every
backend (XLA:CPU rewrites float8_e5m2 NaN payloads and may flush bfloat16
subnormals); integer ops are.

Two bitcasts that change the element width never meet: XLA's simplifier folds
a widening bitcast followed by a narrowing one into a single bitcast of the
wrong shape (an HLO verifier error), which happens wherever the gather or
scatter between them vanishes, e.g. a rank holding one slot.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
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
    ``row_bytes`` its size in bytes and ``view_dtype`` the unsigned integer
    dtype of the row view (see the module docstring).
    """

    dtype: np.dtype
    row_shape: tuple[int, ...]
    row_bytes: int
    view_dtype: np.dtype

    @property
    def row_elements(self) -> int:
        return math.prod(self.row_shape)

    @property
    def view_width(self) -> int:
        """Elements of ``view_dtype`` per row."""
        return self.row_bytes * 8 // _bits(self.view_dtype)


# ml_dtypes floats and narrow ints report numpy kind 'V'.
_ML_DTYPES = frozenset(
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
        jnp.int2,
        jnp.uint2,
    )
    + tuple(getattr(jnp, n) for n in ("float8_e3m4", "float8_e4m3") if hasattr(jnp, n))
)
_UNSIGNED = {
    2: np.dtype(jnp.uint2),
    4: np.dtype(jnp.uint4),
    8: np.dtype(np.uint8),
    16: np.dtype(np.uint16),
    32: np.dtype(np.uint32),
}
_UNSIGNED[64] = np.dtype(np.uint64)


def _bits(dtype) -> int:
    return int(jax.dtypes.itemsize_bits(np.dtype(dtype)))


def leaf_layout(dtype, row_shape: Sequence[int], *, name: str = "leaf") -> LeafLayout:
    """The byte layout of one row of ``row_shape`` elements of ``dtype``.

    Raises ``ValueError`` for dtypes that cannot be viewed as bytes and for
    sub-byte rows that do not fill whole bytes.
    """
    dtype = np.dtype(dtype)
    row_shape = tuple(int(d) for d in row_shape)
    count = math.prod(row_shape)
    if dtype.kind not in "biuf" and dtype not in _ML_DTYPES:
        raise ValueError(f"{name}: dtype {dtype} cannot be moved as bytes (need bool, integer or float)")
    bits = _bits(dtype)
    if bits not in _UNSIGNED:
        raise ValueError(f"{name}: dtype {dtype} ({bits} bits) cannot be moved as bytes")
    if bits < 8 and count % (8 // bits):
        raise ValueError(
            f"{name}: a {dtype} row of shape {row_shape} has {count} elements; {bits}-bit rows are moved as "
            f"whole bytes and need an element count per slot that is a multiple of {8 // bits}"
        )
    row_bytes = count * bits // 8
    view = _UNSIGNED[32] if row_bytes % 4 == 0 else _UNSIGNED[max(8, bits)]
    return LeafLayout(dtype, row_shape, row_bytes, view)


def _regroup(x: jax.Array, dtype) -> jax.Array:
    """Unsigned ``x [N, k]`` as ``dtype [N, k']`` over the same bytes (a bitcast; integers only).

    A narrowing bitcast takes its input through an optimisation barrier, so it
    never meets a widening one (module docstring).
    """
    src, dst = _bits(x.dtype), _bits(dtype)
    if src == dst:
        return x
    num_rows = x.shape[0]
    if src < dst:  # several elements per new element: group them on a trailing axis
        return jax.lax.bitcast_convert_type(x.reshape(num_rows, -1, dst // src), dtype)
    return jax.lax.bitcast_convert_type(jax.lax.optimization_barrier(x), dtype).reshape(num_rows, -1)


def row_view(x: jax.Array, layout: LeafLayout, num_rows: int) -> jax.Array:
    """``x [.., *row_shape]`` with ``num_rows`` rows as the row view ``[num_rows, view_width]``.

    The leaf's own dtype meets one op only: the bitcast to the unsigned
    integer of its width (bools: a conversion to ``uint8``). Where the view
    then regroups elements into words, an optimisation barrier keeps XLA from
    moving that bitcast past the regrouping (XLA:CPU would slice the float
    leaf to assemble its words).
    """
    if layout.dtype == np.bool_:
        unsigned = x.astype(jnp.uint8)
    else:
        unsigned = _fenced(jax.lax.bitcast_convert_type(x, _UNSIGNED[_bits(layout.dtype)]), layout)
    return _regroup(unsigned.reshape(num_rows, layout.row_elements), layout.view_dtype)


def from_row_view(rows: jax.Array, layout: LeafLayout, shape: Sequence[int]) -> jax.Array:
    """Inverse of :func:`row_view`: back to ``layout.dtype`` and ``shape`` (the bitcast to it last)."""
    if layout.dtype == np.bool_:
        return _regroup(rows, np.uint8).reshape(tuple(shape)) != jnp.uint8(0)
    unsigned = _fenced(_regroup(rows, _UNSIGNED[_bits(layout.dtype)]).reshape(tuple(shape)), layout)
    return jax.lax.bitcast_convert_type(unsigned, layout.dtype)


def _fenced(unsigned: jax.Array, layout: LeafLayout) -> jax.Array:
    """``unsigned`` behind an optimisation barrier where the row view regroups its elements."""
    return jax.lax.optimization_barrier(unsigned) if _bits(layout.dtype) != _bits(layout.view_dtype) else unsigned


def to_byte_rows(rows: jax.Array, layout: LeafLayout) -> jax.Array:
    """Row view ``[C, view_width]`` to ``uint8 [C, row_bytes]`` (a bitcast; sub-byte dtypes packed in bytes)."""
    del layout  # the view's own dtype says how many bytes an element holds
    return _regroup(rows, np.uint8)


def from_byte_rows(rows: jax.Array, layout: LeafLayout) -> jax.Array:
    """Inverse of :func:`to_byte_rows`: ``uint8 [C, row_bytes]`` to the row view ``[C, view_width]``."""
    return _regroup(rows, layout.view_dtype)


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
    """Gathers ``rows [C]`` of every row view into one packed ``[C, B]`` buffer of ``wire_dtype``.

    Row indices must be in ``[0, N)``; only the ``C`` requested rows are read.
    """
    wire = wire_dtype(layouts)
    return jnp.concatenate([_regroup(v[rows], wire) for v in row_views], axis=1)


def unpack_leaf(packed: jax.Array, layouts: Sequence[LeafLayout], index: int) -> jax.Array:
    """Leaf ``index``'s row view ``[C, view_width]`` from packed rows made by :func:`pack_rows`."""
    offsets = wire_offsets(layouts)
    return _regroup(packed[:, offsets[index] : offsets[index + 1]], layouts[index].view_dtype)


def unpack_rows(packed: jax.Array, layouts: Sequence[LeafLayout]) -> list[jax.Array]:
    """Splits packed ``[C, B]`` rows from :func:`pack_rows` into the leaves' row views."""
    width = wire_offsets(layouts)[-1]
    if packed.shape[1] != width or packed.dtype != wire_dtype(layouts):
        raise ValueError(
            f"packed rows are {packed.dtype} [*, {packed.shape[1]}], the leaves need {wire_dtype(layouts)} [*, {width}]"
        )
    return [unpack_leaf(packed, layouts, i) for i in range(len(layouts))]


# ------------------------------------------------------------- host reference
def byte_rows_numpy(x: np.ndarray, num_lead: int = 1) -> np.ndarray:
    """Host reference of :func:`to_byte_rows` for numpy (ml_dtypes) arrays with ``num_lead`` row axes.

    ml_dtypes stores one sub-byte element per byte (lowest bits); they are
    packed here exactly as on device.
    """
    x = np.asarray(x)
    lead = x.shape[:num_lead]
    num_rows = math.prod(lead)
    layout = leaf_layout(x.dtype, x.shape[num_lead:])
    flat = np.ascontiguousarray(x).reshape(num_rows, -1)
    bits = _bits(x.dtype)
    if bits < 8:
        per_byte = 8 // bits
        codes = flat.view(np.uint8) & np.uint8((1 << bits) - 1)
        packed = np.zeros((num_rows, layout.row_bytes), np.uint8)
        for j in range(per_byte):
            packed |= codes[:, j::per_byte] << np.uint8(bits * j)
        return packed.reshape(lead + (layout.row_bytes,))
    return flat.view(np.uint8).reshape(lead + (layout.row_bytes,))


def pack_rows_numpy(leaves: Sequence[np.ndarray], rows: np.ndarray) -> np.ndarray:
    """Host reference of :func:`pack_rows` starting from typed ``[N, *row_shape]`` leaves."""
    rows = np.asarray(rows)
    return np.concatenate([byte_rows_numpy(leaf, 1)[rows] for leaf in leaves], axis=1)

"""Unsigned-integer row views and row packing: exact for every dtype, special float values included."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _bytes import random_bytes

from moe_eplb_jax.transport import packing

SUB_BYTE = [ml_dtypes.float4_e2m1fn, ml_dtypes.int4, ml_dtypes.uint4, ml_dtypes.int2, ml_dtypes.uint2]
ONE_BYTE = [
    np.uint8,
    np.int8,
    np.bool_,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e8m0fnu,
    ml_dtypes.float8_e4m3fnuz,
    ml_dtypes.float8_e5m2fnuz,
    ml_dtypes.float8_e4m3b11fnuz,
    ml_dtypes.float8_e3m4,
    ml_dtypes.float8_e4m3,
]
DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16, np.int32, *ONE_BYTE, *SUB_BYTE]


def bits(dtype) -> int:
    return jax.dtypes.itemsize_bits(np.dtype(dtype))


def random_rows(rng, dtype, num_rows, row_shape):
    return random_bytes(rng, dtype, (num_rows,) + tuple(row_shape))


@pytest.fixture(scope="module")
def roundtrip():
    """(pack of gathered rows, unpack back to the row view) jitted once per layout."""

    def run(x, layout, rows):
        view = packing.row_view(x, layout, x.shape[0])
        packed = packing.pack_rows([view], [layout], rows)
        (back,) = packing.unpack_rows(packed, [layout])
        return packed, packing.from_row_view(back, layout, (rows.shape[0],) + layout.row_shape)

    return jax.jit(run, static_argnums=1)


@pytest.mark.parametrize("row_shape", [(4, 4), (12,)], ids=["words", "odd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_pack_unpack_bytes_exact(dtype, row_shape, rng, roundtrip):
    if row_shape == (12,) and bits(dtype) in (8, 32):
        row_shape = (3,) if bits(dtype) == 8 else (1,)  # odd bytes (8-bit), one word (32-bit)
    x = random_rows(rng, dtype, 12, row_shape)
    layout = packing.leaf_layout(x.dtype, x.shape[1:])
    assert layout.row_bytes == x[0].size * bits(dtype) // 8
    want = np.uint32 if layout.row_bytes % 4 == 0 else np.uint16 if bits(dtype) == 16 else np.uint8
    assert layout.view_dtype == want
    rows = rng.permutation(12)[:7].astype(np.int32)
    packed, back = roundtrip(jax.device_put(x), layout, jnp.asarray(rows))
    expected = packing.pack_rows_numpy([x], rows)
    assert packed.shape[0] == 7 and packed.nbytes == 7 * layout.row_bytes
    np.testing.assert_array_equal(np.asarray(packed).view(np.uint8).reshape(7, -1), expected)
    np.testing.assert_array_equal(packing.byte_rows_numpy(np.asarray(back)), packing.byte_rows_numpy(x[rows]))


def test_fp4_pairs_low_nibble_first(roundtrip):
    values = np.array([[0.5, -6.0, 1.0, 3.0]], dtype=ml_dtypes.float4_e2m1fn)
    codes = values.view(np.uint8)  # one code per byte on the host
    layout = packing.leaf_layout(values.dtype, values.shape[1:])
    packed, _ = roundtrip(jax.device_put(values), layout, jnp.asarray([0], dtype=jnp.int32))
    expected = [codes[0, 0] | (codes[0, 1] << 4), codes[0, 2] | (codes[0, 3] << 4)]
    np.testing.assert_array_equal(np.asarray(packed)[0], np.array(expected, dtype=np.uint8))


def test_words_only_when_every_leaf_is_words(rng):
    four = packing.leaf_layout(np.float32, (3,))
    odd = packing.leaf_layout(ml_dtypes.float8_e5m2, (3,))
    assert four.view_dtype == np.uint32 and odd.view_dtype == np.uint8
    assert packing.wire_dtype([four, four]) == np.uint32 and packing.wire_dtype([four, odd]) == np.uint8
    assert packing.wire_offsets([four, four]) == [0, 3, 6] and packing.wire_offsets([four, odd]) == [0, 12, 15]


def test_several_leaves_concatenate_in_order(rng):
    leaves = [
        random_rows(rng, np.float32, 6, (2,)),
        random_rows(rng, ml_dtypes.float8_e5m2, 6, (3,)),
        random_rows(rng, ml_dtypes.float4_e2m1fn, 6, (4,)),
    ]
    layouts = [packing.leaf_layout(x.dtype, x.shape[1:]) for x in leaves]
    rows = np.array([5, 0, 3], dtype=np.int32)

    @jax.jit
    def pack(a, b, c):
        views = [packing.row_view(x, lay, 6) for x, lay in zip((a, b, c), layouts)]
        return packing.pack_rows(views, layouts, jnp.asarray(rows))

    packed = np.asarray(pack(*[jax.device_put(x) for x in leaves]))
    assert packed.shape == (3, 8 + 3 + 2)
    np.testing.assert_array_equal(packed, packing.pack_rows_numpy(leaves, rows))
    np.testing.assert_array_equal(packed[:, 8:11], leaves[1][rows].view(np.uint8))


def test_two_bit_elements_fill_bytes_lowest_bits_first(roundtrip):
    values = np.array([[1, -2, 0, -1, 1, 1, 0, 0]], dtype=ml_dtypes.int2)
    codes = values.view(np.uint8) & 3  # one code per byte on the host
    layout = packing.leaf_layout(values.dtype, values.shape[1:])
    packed, back = roundtrip(jax.device_put(values), layout, jnp.asarray([0], dtype=jnp.int32))
    expected = [sum(int(codes[0, 4 * i + j]) << (2 * j) for j in range(4)) for i in range(2)]
    np.testing.assert_array_equal(np.asarray(packed)[0], np.array(expected, dtype=np.uint8))
    np.testing.assert_array_equal(np.asarray(back).view(np.uint8) & 3, codes)


@pytest.mark.parametrize("num_rows", [1, 2, 5])
def test_every_dtype_in_one_pack_even_one_row(num_rows, rng):
    """Sub-byte, byte, 16-bit and word leaves packed together: with one row (a rank holding one slot) the gather
    between the row view's widening bitcast and the packing's narrowing one vanishes; the bytes still match."""
    shapes = {4: (2, 4), 2: (12,), 8: (3,), 16: (3,), 32: (1,)}
    leaves = [random_rows(rng, d, num_rows, shapes.get(bits(d), (2, 2))) for d in DTYPES]
    leaves.append(random_rows(rng, ml_dtypes.bfloat16, num_rows, (4,)))  # a 16-bit leaf viewed as words
    layouts = [packing.leaf_layout(x.dtype, x.shape[1:]) for x in leaves]
    assert {lay.view_dtype for lay in layouts} == {np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32)}
    rows = rng.permutation(num_rows).astype(np.int32)

    @jax.jit
    def pack_and_back(xs, rows):
        views = [packing.row_view(x, lay, num_rows) for x, lay in zip(xs, layouts)]
        packed = packing.pack_rows(views, layouts, rows)
        backs = packing.unpack_rows(packed, layouts)
        return packed, [packing.from_row_view(b, lay, x.shape) for b, lay, x in zip(backs, layouts, xs)]

    packed, backs = pack_and_back([jax.device_put(x) for x in leaves], jnp.asarray(rows))
    np.testing.assert_array_equal(np.asarray(packed), packing.pack_rows_numpy(leaves, rows))
    for back, x in zip(backs, leaves):
        assert back.dtype == x.dtype
        np.testing.assert_array_equal(packing.byte_rows_numpy(np.asarray(back)), packing.byte_rows_numpy(x[rows]))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_views_are_unsigned_integers(dtype):
    """No row view is a float: gathers, scatters and concatenations see integers only."""
    for row_shape in [(4,), (6,), (2, 4), (1,), (8,)]:
        if bits(dtype) < 8 and np.prod(row_shape) % (8 // bits(dtype)):
            continue  # sub-byte rows fill whole bytes
        layout = packing.leaf_layout(dtype, row_shape)
        assert np.dtype(layout.view_dtype).kind == "u"
        assert layout.view_width * np.dtype(layout.view_dtype).itemsize == layout.row_bytes


def test_sub_byte_rows_that_do_not_fill_bytes_are_errors():
    with pytest.raises(ValueError, match=r"experts\['w'\].*multiple of 2"):
        packing.leaf_layout(ml_dtypes.float4_e2m1fn, (3, 1), name="experts['w']")
    with pytest.raises(ValueError, match="multiple of 4"):
        packing.leaf_layout(ml_dtypes.uint2, (6,))


@pytest.mark.parametrize("dtype", [np.complex64, ml_dtypes.float6_e2m3fn], ids=lambda d: np.dtype(d).name)
def test_unsupported_dtypes_are_errors(dtype):
    with pytest.raises(ValueError, match="cannot be moved as bytes"):
        packing.leaf_layout(dtype, (4,))


def test_unpack_checks_width(rng):
    layout = packing.leaf_layout(np.float32, (2,))
    with pytest.raises(ValueError, match=r"uint8 \[\*, 5\], the leaves need uint32 \[\*, 2\]"):
        packing.unpack_rows(jnp.zeros((3, 5), jnp.uint8), [layout])

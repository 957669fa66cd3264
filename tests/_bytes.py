"""Random test data made of raw bytes, so every bit pattern of a dtype can occur, special values above all."""

import jax
import ml_dtypes
import numpy as np

E5M2_NANS = np.array([0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF], dtype=np.uint8)  # rewritten by XLA:CPU float ops
SUB_BYTE_INTS = tuple(np.dtype(d) for d in (ml_dtypes.int4, ml_dtypes.uint4, ml_dtypes.int2, ml_dtypes.uint2))
_UNSIGNED = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}


def _float_fields(dtype):
    """``(exponent bits, mantissa bits, has sign)`` of a float dtype, or None for integers and bools."""
    if dtype == np.bool_ or np.issubdtype(dtype, np.integer) or dtype in SUB_BYTE_INTS:
        return None
    info = ml_dtypes.finfo(dtype)
    bits = jax.dtypes.itemsize_bits(dtype)
    return info.nexp, info.nmant, info.nexp + info.nmant < bits


def random_bytes(rng, dtype, shape):
    """Random bytes viewed as ``dtype`` of ``shape``, float special values drawn often.

    For a float dtype half of the elements are special: an all-zero exponent
    (subnormals), an all-ones exponent (NaNs with their payloads, infinities,
    the largest finite values of the ``fn`` types), signed zeros and all-ones
    exponents with a zero mantissa, each with a random sign; float8_e5m2 arrays always hold the
    NaN codes XLA:CPU would rewrite; sub-byte values sit in the lowest bits of
    a byte (as ml_dtypes stores them); bools are 0 or 1.
    """
    dtype = np.dtype(dtype)
    bits = jax.dtypes.itemsize_bits(dtype)
    shape = tuple(shape)
    unsigned = _UNSIGNED[max(8, bits)]
    raw = rng.integers(0, 256, shape + (np.dtype(unsigned).itemsize,), dtype=np.uint8).view(unsigned)[..., 0]
    if bits < 8:
        raw &= np.uint8((1 << bits) - 1)
    fields = _float_fields(dtype)
    if fields is not None:
        nexp, nmant, signed = fields
        mantissa = raw & unsigned((1 << nmant) - 1)
        sign = raw & unsigned(1 << (nexp + nmant)) if signed else unsigned(0)
        top = unsigned(((1 << nexp) - 1) << nmant)
        special = [sign | mantissa, sign | top | mantissa, sign, sign | top]  # subnormal, NaN / inf, zero, inf
        kind = rng.integers(0, 2 * len(special), shape)  # half of the elements special
        for k, value in enumerate(special):
            raw = np.where(kind == k, value, raw).astype(unsigned)
    if dtype == np.bool_:
        raw &= unsigned(1)
    if dtype == np.dtype(ml_dtypes.float8_e5m2):
        n = min(E5M2_NANS.size, raw.size)
        raw.reshape(-1)[:n] = E5M2_NANS[:n]
    return raw.view(dtype).reshape(shape)

"""Random test data made of raw bytes, so every bit pattern of a dtype can occur."""

import jax
import ml_dtypes
import numpy as np

E5M2_NANS = np.array([0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF], dtype=np.uint8)  # rewritten by XLA:CPU float ops


def random_bytes(rng, dtype, shape):
    """Random bytes viewed as ``dtype`` of ``shape``: NaNs with payloads, infinities, denormals all likely.

    float8_e5m2 arrays always hold the NaN codes XLA:CPU would rewrite; 4-bit values sit in the low nibble of
    a byte (as ml_dtypes stores them); bools are 0 or 1.
    """
    dtype = np.dtype(dtype)
    bits = jax.dtypes.itemsize_bits(dtype)
    raw = rng.integers(0, 256, tuple(shape) + (max(1, bits // 8),), dtype=np.uint8)
    if bits == 4:
        raw &= np.uint8(0x0F)
    if dtype == np.bool_:
        raw &= np.uint8(1)
    if dtype == np.dtype(ml_dtypes.float8_e5m2):
        n = min(E5M2_NANS.size, raw.size)
        raw.reshape(-1)[:n] = E5M2_NANS[:n]
    return raw.view(dtype).reshape(shape)

"""The tiling ``Config`` of the row-copy kernels (no Pallas needed)."""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["Config"]


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

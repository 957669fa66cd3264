"""The tiling ``Config`` of the quantized grouped matmul's Triton kernel and the default one by size.

Kept apart from the kernel so callers can name a tiling without importing Pallas' Triton backend.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Config", "default_config"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Tiling of one ``quantized_grouped_matmul`` call (block sizes are powers of two, clipped to the matrix).

    Attributes:
      block_rows: rows per output tile (a tile straddling two groups is one work item of each).
      block_k: contraction elements decoded per loop step (at least one scale block: 32 for MX, 16 for NVFP4).
      block_cols: output columns per tile (weight rows decoded per step).
      num_warps, num_stages: Triton's warps and software-pipelining stages.
      decode_bfloat16: with bfloat16 rows, decode the weights and apply their block scales in bfloat16 rather
        than float32 (the same bits: every decoded value and power-of-two or e4m3 scale product is exact in
        bfloat16, or rounds once either way) -- fewer conversions per element where decoding bounds the kernel.
      split_pairs: for the e2m1 formats (mxfp4, nvfp4), multiply each packed byte's even and odd elements as two
        products over the contraction's even and odd halves (the rows loaded at stride 2), rather than
        interleaving the two nibbles' values into one tile first; the same products summed in another order.
    """

    block_rows: int = 64
    block_k: int = 128
    block_cols: int = 64
    num_warps: int = 4
    num_stages: int = 3
    decode_bfloat16: bool = False
    split_pairs: bool = False

    def __post_init__(self):
        for name in ("decode_bfloat16", "split_pairs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Config.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("block_rows", "block_k", "block_cols", "num_warps", "num_stages"):
            value = getattr(self, name)
            least = 16 if name.startswith("block") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"Config.{name} must be an int >= {least}, got {value!r}")
            if name.startswith("block") and value & (value - 1):
                raise ValueError(f"Config.{name} must be a power of two, got {value}")


def default_config(num_rows: int, num_slots: int) -> Config:
    """A tiling for ``num_rows`` buffer rows over ``num_slots`` groups (not measured yet: a starting point).

    Few rows per slot (decode) make reading the weights the cost: 16-row tiles waste the least MMA work on
    a short group; many rows (prefill) take larger tiles for reuse of each decoded weight tile.
    """
    if num_rows <= 16 * num_slots:
        return Config(block_rows=16)
    if num_rows >= 4096:
        return Config(block_rows=128, block_cols=128, num_warps=8)
    return Config()

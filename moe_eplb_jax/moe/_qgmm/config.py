"""The tiling ``Config`` of the quantized grouped matmul's Triton kernel and the default one by size.

Kept apart from the kernel so callers can name a tiling without importing Pallas' Triton backend.
"""

from __future__ import annotations

import dataclasses

from moe_eplb_jax.moe._gmm import mosaic_ws

__all__ = ["Config", "default_config", "mosaic_config"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Tiling of one ``quantized_grouped_matmul`` call (block sizes are powers of two, clipped to the matrix).

    Attributes:
      block_rows: rows per output tile (a tile straddling two groups is one work item of each).
      block_k: contraction elements decoded per loop step (at least one scale block: 32 for MX, 16 for NVFP4).
      block_cols: output columns per tile (weight rows decoded per step).
      num_warps, num_stages: Triton's warps and software-pipelining stages.
    """

    block_rows: int = 64
    block_k: int = 128
    block_cols: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_rows", "block_k", "block_cols", "num_warps", "num_stages"):
            value = getattr(self, name)
            least = 16 if name.startswith("block") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"Config.{name} must be an int >= {least}, got {value!r}")
            if name.startswith("block") and value & (value - 1):
                raise ValueError(f"Config.{name} must be a power of two, got {value}")


def default_config(num_rows: int, num_slots: int, fmt: str | None = None) -> Config:
    """A tiling for ``num_rows`` buffer rows over ``num_slots`` groups of format ``fmt``.

    Few rows per slot (decode) make reading the weights the cost: 16-row tiles waste the least MMA work on
    a short group; many rows (prefill) take larger tiles for reuse of each decoded weight tile, e2m1's 256 columns
    wide. Between the two, fp8 and the e2m1 formats take 128-column tiles, each re-reading its rows half as often
    (the measurements: ``docs/kernels.md``, ``benchmarks/RESULTS.md``).
    """
    wide = fmt in ("fp8", "mxfp4", "nvfp4")
    if num_rows <= 16 * num_slots:
        return Config(block_rows=16)
    if num_rows >= 4096:
        columns = 256 if fmt in ("mxfp4", "nvfp4") else 128
        return Config(block_rows=128, block_cols=columns, num_warps=8)
    return Config(block_cols=128) if wide else Config()


def mosaic_config(num_rows: int, num_slots: int) -> mosaic_ws.Config:
    """fp8's Mosaic tiling for ``num_rows`` buffer rows over ``num_slots`` slots: 64-row tiles where a slot holds
    under 128 rows (decode: a 128-row tile would load the next slot's rows for nothing), 128 rows otherwise; 128-byte
    contraction chunks (one swizzle row of e4m3), the float32 epilogue's buffer inside shared memory."""
    if num_rows < 128 * num_slots:
        return mosaic_ws.Config(block_m=64, block_n=128, block_k=128, max_concurrent_steps=3)
    return mosaic_ws.Config(block_m=128, block_n=64, block_k=128, max_concurrent_steps=4)

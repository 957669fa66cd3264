"""The tiling ``Config`` of ``map_and_count``'s Pallas kernels and the default one by size (no Pallas needed)."""

from __future__ import annotations

import dataclasses

__all__ = ["QUOTA_PATHS", "Config"]

# How mode "quota" finds each entry's point: ranks, bases and mapping in one kernel (a look-back between its
# programs), ranks then the map kernel, or boundary positions then the map kernel.
QUOTA_PATHS = ("lookback", "ranks", "positions")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Tiling of one ``map_and_count`` call's Pallas kernels (sizes are powers of two).

    Attributes:
      tile: entries per map program.
      sub: entries per loop step of a map program (``<= tile``, ``>= 16``).
      num_warps, num_stages: the map kernel's Triton parameters.
      quota_path: how mode ``"quota"`` finds each entry's point, one of :data:`QUOTA_PATHS`.
      rank_tile: ``"lookback"`` / ``"ranks"``: entries per rank program (up to four warps of 32-entry steps;
        ``"lookback"`` maps them in the same program).
      position_tile: ``"positions"``: entries per tile of expert counts (one step).
      position_scan: ``"positions"``: entries per step of a boundary's tile scan.
      count_warps, boundary_warps: ``"positions"``: warps of the tile-count and boundary kernels.
      alias_warps: mode ``"lp"``: warps of the kernel that builds the alias table per call.
    """

    tile: int = 256
    sub: int = 256
    num_warps: int = 4
    num_stages: int = 3
    quota_path: str = "ranks"
    rank_tile: int = 256
    position_tile: int = 256
    position_scan: int = 1024
    count_warps: int = 4
    boundary_warps: int = 4
    alias_warps: int = 4

    def __post_init__(self):
        for name, least in (("tile", 16), ("sub", 16), ("rank_tile", 32), ("position_tile", 16), ("position_scan", 16)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least or value & (value - 1):
                raise ValueError(f"Config.{name} must be a power of two >= {least}, got {value!r}")
        if self.sub > self.tile:
            raise ValueError(f"Config.sub ({self.sub}) must not exceed Config.tile ({self.tile})")
        for name in ("num_warps", "count_warps", "boundary_warps", "alias_warps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
                raise ValueError(f"Config.{name} must be a power of two >= 1, got {value!r}")
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"Config.num_stages must be a positive int, got {self.num_stages!r}")
        if self.quota_path not in QUOTA_PATHS:
            raise ValueError(f"Config.quota_path must be one of {QUOTA_PATHS}, got {self.quota_path!r}")

    @classmethod
    def default(cls, mode: str, num_entries: int) -> Config:
        """The tiling measured fastest on an H200 for ``num_entries`` flat entries of the kernel rule ``mode``
        (docs/kernels.md).

        About 512 map programs of 256 to 8192 entries in 256-entry steps; from ``2**19`` entries one 4096-entry
        step of 16 warps per program (8192-entry programs from ``2**21``, except for ``"quota"``, which does more
        per entry). ``"quota"`` by ranks up to 65536 entries, all in one kernel up to 32 rank tiles of 256
        entries, by boundary positions above (tiles of 256 to 4096 entries, about 512 of them).
        """
        tile, sub, num_warps = min(max(_next_power_of_2(max(1, _cdiv(num_entries, 512))), 256), 8192), 256, 4
        if num_entries >= 1 << 21 and mode != "quota":
            tile, sub, num_warps = 8192, 4096, 16
        elif num_entries >= 1 << 19:
            tile, sub, num_warps = 4096, 4096, 16
        if mode != "quota":
            return cls(tile=tile, sub=sub, num_warps=num_warps)
        position_tile = min(4096, max(256, _next_power_of_2(_cdiv(num_entries, 512))))
        return cls(
            tile=tile,
            sub=sub,
            num_warps=num_warps,
            quota_path="lookback" if num_entries <= 32 * 256 else "ranks" if num_entries <= 1 << 16 else "positions",
            position_tile=position_tile,
            count_warps=8 if position_tile >= 2048 else 4,
        )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for 0), as ``pallas.next_power_of_2``."""
    return 1 if n <= 0 else 1 << (n - 1).bit_length()

"""The tiling ``Config`` of the quota search kernel and the implementations' names (no Pallas needed)."""

from __future__ import annotations

import dataclasses

__all__ = ["IMPLEMENTATIONS", "Config"]

IMPLEMENTATIONS = ("xla", "pallas")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """The search kernel's tiling.

    Attributes:
      lanes: candidates per program of a one-round search (a power of two >= 16; each program's walk over the
        ranks is the same chain of dependent steps whatever its lane count, so the lanes only set how many
        programs share the grid). A search of several rounds runs in one program of all its candidates.
      num_warps: warps per program.
    """

    lanes: int = 32
    num_warps: int = 4

    def __post_init__(self):
        for name, least in (("lanes", 16), ("num_warps", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least or value & (value - 1):
                raise ValueError(f"Config.{name} must be a power of two >= {least}, got {value!r}")

"""The tiling ``Config`` of the put kernel, its default per device, and the words per TMA copy (no Pallas)."""

from __future__ import annotations

import dataclasses

__all__ = ["Config", "WORD_MULTIPLE", "config_for", "copy_words"]

_SMEM_BYTES = 227 * 1024  # shared memory per block on H100 / H200 available to a kernel
WORD_MULTIPLE = 32  # Lane semantics: each of the warpgroup's 128 threads arrives on a TMA barrier with bytes / 128


@dataclasses.dataclass(frozen=True)
class Config:
    """Tiling of the put kernel.

    ``num_programs`` CUDA blocks (:func:`config_for`: one per SM), of which
    ``pack_programs`` pack the next chunk while the others write this one;
    each program cycles ``stages`` shared-memory buffers of one TMA copy of at
    most ``max_copy_bytes`` (the largest multiple of 128 bytes dividing a
    leaf's row, up to this: :func:`copy_words`).
    """

    num_programs: int = 132
    pack_programs: int = 16
    stages: int = 4
    max_copy_bytes: int = 40 * 1024

    def __post_init__(self):
        for name in ("num_programs", "pack_programs", "stages", "max_copy_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.stages < 2:
            raise ValueError(f"stages must be at least 2 (one buffer loading while one is stored), got {self.stages}")
        if self.stages * self.max_copy_bytes > _SMEM_BYTES:
            raise ValueError(
                f"stages * max_copy_bytes = {self.stages * self.max_copy_bytes} exceeds {_SMEM_BYTES} bytes of "
                "shared memory"
            )
        if self.pack_programs >= self.num_programs:
            raise ValueError(
                f"pack_programs ({self.pack_programs}) must leave writing programs of num_programs "
                f"({self.num_programs})"
            )


def config_for(device) -> Config:
    """The default :class:`Config` for ``device``: one program per streaming multiprocessor."""
    return Config(num_programs=int(getattr(device, "core_count", 0) or Config.num_programs))


def copy_words(width: int, max_copy_bytes: int = Config.max_copy_bytes) -> int:
    """Words per TMA copy for rows of ``width`` uint32 words, or 0 when no multiple of 32 words divides them."""
    best = 0
    for chunk in range(WORD_MULTIPLE, min(width, max_copy_bytes // 4) + 1, WORD_MULTIPLE):
        if width % chunk == 0:
            best = chunk
    return best

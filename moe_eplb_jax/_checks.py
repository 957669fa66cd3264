"""Strict scalar checks shared by every public entry point: a bool is not an int, 16.7 is not 16, NaN is no size.

Each returns the value as a plain Python ``int`` / ``float`` or raises
``ValueError`` naming the argument. :func:`show` prints a value for such a
message even where Python refuses to (an integer of thousands of digits);
:func:`check_fits` refuses a size before an allocation would fail.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os

import jax
import numpy as np
from jax.core import Tracer

__all__ = [
    "INT32_MAX",
    "check_fits",
    "check_int",
    "check_powers_of_two",
    "check_real",
    "device_memory_bytes",
    "host_memory_bytes",
    "is_concrete",
    "show",
]

INT32_MAX = 2**31 - 1


def show(value) -> str:
    """``repr(value)`` for an error message; an integer Python will not print is shown by its digit count."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)):
        magnitude = abs(int(value))
        if magnitude.bit_length() > 4000:  # past about 1,200 digits: print the count, not the number
            return f"an integer of {_digits(magnitude)} digits"
    try:
        return repr(value)
    except ValueError:  # a container of such integers
        return f"a {type(value).__name__} that cannot be printed"


def _digits(magnitude: int) -> int:
    digits = int(math.log10(magnitude)) + 1  # a float log: off by one at powers of ten, corrected exactly below
    if 10 ** (digits - 1) > magnitude:
        digits -= 1
    elif 10**digits <= magnitude:
        digits += 1
    return digits


def check_int(name: str, value, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an ``int``: any integer type but ``bool``; ``minimum`` / ``maximum`` inclusive."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {show(value)} ({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {show(value)}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {show(value)}")
    return value


def check_powers_of_two(config) -> None:
    """Every field of the dataclass ``config`` a positive power-of-two ``int`` (a kernel tiling), or a
    ``ValueError`` naming the first that is not."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
            raise ValueError(f"{type(config).__name__}.{field.name} must be a positive power of two, got {value!r}")


def host_memory_bytes() -> int:
    """This host's physical memory in bytes (unbounded where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2**63 - 1


def device_memory_bytes(device=None) -> int:
    """The memory one device can hold in bytes: its allocator's limit, else (CPU) the host's memory."""
    device = device if device is not None else jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:
        stats = None
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else host_memory_bytes()


def check_fits(what: str, num_bytes: int, available: int, *, where: str, hint: str) -> None:
    """``ValueError`` when ``what`` (``num_bytes``) cannot fit ``available`` bytes of ``where``'s memory."""
    if num_bytes > available:
        raise ValueError(f"{what} needs {_size(num_bytes)}, more than {where} holds ({_size(available)}); {hint}")


def _size(num_bytes: int) -> str:
    for unit, scale in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.3g} {unit}"
    return f"{num_bytes} bytes"


def check_real(name: str, value, *, minimum: float | None = None, positive: bool = False) -> float:
    """``value`` as a finite ``float``: any real number type but ``bool``; ``positive`` excludes 0."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {show(value)} ({type(value).__name__})")
    try:
        value = float(value)
    except OverflowError:  # an integer past float's range
        raise ValueError(f"{name} must be finite, got {show(value)}") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def is_concrete(*values) -> bool:
    """True when no value is a JAX tracer, so its contents can be checked on the host."""
    return not any(isinstance(v, Tracer) for v in values)

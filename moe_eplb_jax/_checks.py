"""Strict scalar checks shared by every public entry point: a bool is not an int, 16.7 is not 16, NaN is no size.

Each returns the value as a plain Python ``int`` / ``float`` or raises
``ValueError`` naming the argument.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
from jax.core import Tracer

__all__ = ["check_int", "check_real", "is_concrete"]


def check_int(name: str, value, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an ``int``: any integer type but ``bool``; ``minimum`` / ``maximum`` inclusive."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_real(name: str, value, *, minimum: float | None = None, positive: bool = False) -> float:
    """``value`` as a finite ``float``: any real number type but ``bool``; ``positive`` excludes 0."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    value = float(value)
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

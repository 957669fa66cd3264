"""A registry of placement (L1) policies, looked up by name.

A placement policy is a pure function of per-expert loads (and optionally the
old placement)::

    policy(weight, num_replicas, num_groups, num_nodes, num_gpus, old_phy2log=None)
        -> (phy2log [L, P], log2phy [L, E, P - E + 1], logcnt [L, E])

``weight [L, E]`` is a numpy array of non-negative loads, ``num_replicas`` is
``P``; the result is numpy ``int32`` tables (``log2phy`` padded with ``-1``).
``num_groups`` / ``num_nodes`` / ``num_gpus`` describe the topology (expert
groups, hosts, EP ranks); a policy may ignore what it does not use.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

__all__ = ["PlacementPolicy", "register", "get", "available"]


class PlacementPolicy(Protocol):
    def __call__(
        self,
        weight: np.ndarray,
        num_replicas: int,
        num_groups: int,
        num_nodes: int,
        num_gpus: int,
        old_phy2log: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...


_POLICIES: dict[str, PlacementPolicy] = {}


def register(name: str, fn: PlacementPolicy | None = None, *, overwrite: bool = False):
    """Registers ``fn`` under ``name``; usable as ``register(name, fn)`` or as a decorator ``@register(name)``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"policy name must be a non-empty string, got {name!r}")

    def _add(f: PlacementPolicy) -> PlacementPolicy:
        if not callable(f):
            raise ValueError(f"policy {name!r} must be callable, got {type(f).__name__}")
        if name in _POLICIES and not overwrite and _POLICIES[name] is not f:
            raise ValueError(f"a policy named {name!r} is already registered (pass overwrite=True to replace it)")
        _POLICIES[name] = f
        return f

    return _add if fn is None else _add(fn)


def get(name: str) -> PlacementPolicy:
    """The policy registered under ``name``; ``ValueError`` listing the known names otherwise."""
    if not isinstance(name, str):
        raise ValueError(f"policy name must be a string, got {name!r}; registered: {sorted(_POLICIES)}")
    try:
        return _POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown placement policy {name!r}; registered: {sorted(_POLICIES)}") from None


def available() -> list[str]:
    return sorted(_POLICIES)

"""Placement (L1) policies behind one interface and a name registry.

``get("deepseek")`` is DeepSeek's hierarchical / global EPLB algorithm.
"""

from moe_eplb_jax.policy._registry import PlacementPolicy, available, get, register

__all__ = ["PlacementPolicy", "available", "get", "register"]

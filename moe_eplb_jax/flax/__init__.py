"""The Flax NNX side of moe_eplb_jax.

* ``MoELayer`` -- a reference expert-parallel MoE layer with physical slots; its forward pass is
  ``moe_eplb_jax.moe.moe_apply``.
* ``EplbMoE`` -- the protocol any Flax NNX MoE module implements to be balanced.
* ``find_moe_layers`` -- discovery of every MoE layer, however nested.
* ``EplbController`` -- wraps a model + mesh + ``EplbConfig``: records loads,
  rebalances, moves parameters and optimizer state atomically (all at once or
  a layer per step), checkpoints its state as an Orbax item, dumps loads and
  saves placements; a thin layer over ``moe_eplb_jax.control``.
"""

from moe_eplb_jax.flax.controller import EplbController
from moe_eplb_jax.flax.discovery import MoELayerRef, find_moe_layers
from moe_eplb_jax.flax.layer import EplbTable, ExpertLoad, MoELayer, QuantizedExperts
from moe_eplb_jax.flax.protocol import EplbMoE

__all__ = [
    "EplbController",
    "EplbMoE",
    "EplbTable",
    "ExpertLoad",
    "MoELayer",
    "MoELayerRef",
    "QuantizedExperts",
    "find_moe_layers",
]

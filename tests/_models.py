"""Meshes, placements and small MoE models shared by the token-path, layer and model tests.

A module that needs ``n`` devices marks itself ``pytest.mark.devices(n)`` and builds its mesh with
:func:`ep_mesh` at import: ``None`` on a machine with fewer devices, where the marker skips its tests.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as PS

from moe_eplb_jax.flax import MoELayer
from moe_eplb_jax.models import MoECausalLM
from moe_eplb_jax.placement import Placement
from moe_eplb_jax.transport import put_host


def ep_mesh(num_ranks: int, *, batch: tuple[str, int] | None = None) -> jax.sharding.Mesh | None:
    """A mesh over the first devices: ``("ep",)`` of ``num_ranks``, or ``(batch name, ep)`` with ``batch = (name,
    size)``; ``None`` where this machine has fewer devices."""
    names, sizes = ("ep",), (num_ranks,)
    if batch is not None:
        names, sizes = (batch[0], "ep"), (batch[1], num_ranks)
    count = math.prod(sizes)
    if jax.device_count() < count:
        return None
    auto = (jax.sharding.AxisType.Auto,) * len(sizes)
    return jax.make_mesh(sizes, names, axis_types=auto, devices=jax.devices()[:count])


def random_placement(rng, num_logical: int, num_physical: int) -> Placement:
    """A random valid one-layer placement: every expert placed, the extra slots to random experts, shuffled."""
    phy2log = np.concatenate([np.arange(num_logical), rng.integers(0, num_logical, num_physical - num_logical)])
    return Placement.from_phy2log(rng.permutation(phy2log)[None], num_logical)


def identity_router(layer: MoELayer) -> MoELayer:
    """Sets ``layer``'s router to the identity (``D = E``): a one-hot token picks exactly the experts it names."""
    num_experts = layer.num_experts
    layer.router.set_value(put_host(np.eye(num_experts, dtype=np.float32), layer.mesh, PS()))
    return layer


def one_hot_tokens(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """``[T, E]`` float32 tokens whose identity-routed top-k are the ``ids [T, k]`` (4 where named, -4 elsewhere)."""
    x = np.full((ids.shape[0], num_experts), -4.0, np.float32)
    np.put_along_axis(x, ids, 4.0, axis=1)
    return x


def tiny_model(config, mesh, *, redundant: int = 4, seed: int = 0, **options) -> MoECausalLM:
    """``MoECausalLM(config)`` on ``mesh`` with ``redundant`` spare slots per MoE layer (``options``: ``routing``,
    ``dispatch``)."""
    return MoECausalLM(config, mesh=mesh, num_redundant_experts=redundant, rngs=nnx.Rngs(seed), **options)

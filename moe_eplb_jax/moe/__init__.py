"""The token path of an expert-parallel MoE layer, framework-free (jax and numpy only).

* ``moe_apply`` -- the forward pass: route, map to replicas, dispatch, experts, combine; per rank inside
  ``shard_map``, its two halves ``map_replicas`` (routing mode -> physical slots and load) and ``routed_experts``
  (exchange, grouped MLP, combine).
* ``RouterConfig`` / ``DispatchConfig`` -- the frozen configuration: the router's style, and how a layer runs
  (kernels, exchange, load layout, shared-expert placement, batch axes).
* ``route`` -- the router: top-k logical experts and their weights (Qwen3 softmax or DeepSeek-V3 sigmoid).
* ``dispatch`` -- the token exchange over the EP axis and its combine; ``local`` -- the same on one EP rank.
* ``expert_mlp`` / ``shared_mlp`` / ``waterfill_shared_mlp`` -- the expert MLPs; ``tie_replicas`` ties the
  gradients of an expert's replicas.
* ``grouped_matmul`` / ``quantized_matmul`` -- the grouped matmuls the expert MLP runs on (float / quantized
  experts).
"""

from moe_eplb_jax.moe import dispatch, grouped_matmul, local, quantized_matmul
from moe_eplb_jax.moe.apply import map_replicas, moe_apply, routed_experts
from moe_eplb_jax.moe.config import (
    LOAD_REDUCTIONS,
    ROUTER_SCORINGS,
    SHARED_EXPERTS,
    DispatchConfig,
    RouterConfig,
    axes_size,
)
from moe_eplb_jax.moe.experts import expert_mlp, shared_mlp, tie_replicas, waterfill_shared_mlp
from moe_eplb_jax.moe.router import route

__all__ = [
    "LOAD_REDUCTIONS",
    "ROUTER_SCORINGS",
    "SHARED_EXPERTS",
    "DispatchConfig",
    "RouterConfig",
    "axes_size",
    "dispatch",
    "expert_mlp",
    "grouped_matmul",
    "local",
    "map_replicas",
    "moe_apply",
    "quantized_matmul",
    "route",
    "routed_experts",
    "shared_mlp",
    "tie_replicas",
    "waterfill_shared_mlp",
]

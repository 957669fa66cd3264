"""moe_eplb_jax: an expert-parallel load balancer for Mixture-of-Experts models in JAX.

Subpackages (one concern each):
  placement  -- Placement tables (phy2log / log2phy / logcnt), validation, files
  policy     -- placement (L1) policies and their registry ("deepseek", ...)
  routing    -- replica (L2) routing: modes, tables, quota planning, the fused map_and_count kernels
  metrics    -- rank loads, balancedness, rank imbalance
  config     -- EplbConfig: the static EPLB configuration (vLLM's JSON names too)
  state      -- EplbState: the load window, its pure updates, the trigger
  control    -- the control loop: atomic moves, the functional API, Orbax checkpoint items
  moe        -- the token path: its config objects, router, dispatch/combine, grouped matmuls, expert MLP, moe_apply
  transport  -- expert-weight moves: mesh helpers, move planning, uint8 packing, the executors
  quant      -- quantized expert formats and EP-consistent scales
  flax       -- Flax NNX MoE layer, protocol, discovery and controller adapter
"""

from moe_eplb_jax import metrics
from moe_eplb_jax.config import EplbConfig
from moe_eplb_jax.metrics import balancedness, rank_imbalance, rank_load, rank_load_from_logical
from moe_eplb_jax.placement import Placement
from moe_eplb_jax.state import EplbState

__version__ = "0.1.0"

__all__ = [
    "EplbConfig",
    "EplbState",
    "Placement",
    "balancedness",
    "metrics",
    "rank_imbalance",
    "rank_load",
    "rank_load_from_logical",
]

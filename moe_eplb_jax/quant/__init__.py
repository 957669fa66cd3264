"""Quantized expert formats (FP8, block FP8, MXFP8, MXFP4, NVFP4) and EP-consistent scales.

``quantize_experts(w, fmt)`` turns float expert weights ``[E, N, K]`` into an
expert-major pytree (every leaf leads with the expert/slot axis, so it moves
whole with ``transport.rearrange_experts``); ``dequantize_experts`` decodes it to
float32. ``ep_amax`` max-reduces activation statistics over the EP axis so every
rank uses the same activation scale. ``expert_mlp`` runs a SiLU-gated expert MLP
on quantized (or plain) weights; ``expert_mlp_reference`` is its oracle.
"""

from moe_eplb_jax.quant._api import FORMATS, QuantizedExperts, dequantize_experts, quantize_experts
from moe_eplb_jax.quant._elements import E2M1_VALUES, pack_fp4, unpack_fp4
from moe_eplb_jax.quant.fp8 import Fp8BlockExperts, Fp8Experts
from moe_eplb_jax.quant.mlp import (
    ACTIVATION_SCALINGS,
    IMPLS,
    expert_mlp,
    expert_mlp_reference,
    quantize_mlp,
    share_weight_scale,
)
from moe_eplb_jax.quant.mx import Mxfp4Experts, Mxfp8Experts
from moe_eplb_jax.quant.nvfp4 import Nvfp4Experts
from moe_eplb_jax.quant.scales import activation_scale, ep_amax, quantize_activation_fp8, with_input_scale

__all__ = [
    "ACTIVATION_SCALINGS",
    "E2M1_VALUES",
    "FORMATS",
    "IMPLS",
    "Fp8BlockExperts",
    "Fp8Experts",
    "Mxfp4Experts",
    "Mxfp8Experts",
    "Nvfp4Experts",
    "QuantizedExperts",
    "activation_scale",
    "dequantize_experts",
    "ep_amax",
    "expert_mlp",
    "expert_mlp_reference",
    "pack_fp4",
    "quantize_activation_fp8",
    "quantize_experts",
    "quantize_mlp",
    "share_weight_scale",
    "unpack_fp4",
    "with_input_scale",
]

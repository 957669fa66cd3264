"""MoE language models that EPLB balances as they are: config, model, checkpoints, generation.

* ``ModelConfig`` / ``preset(name)`` -- the architecture (``"tiny"``, ``"small"``, ``"deepseek_v3_tiny"``,
  ``"deepseek_v3_small"``); ``config_from_hf`` reads one from a checkpoint's ``config.json``.
* ``MoECausalLM`` -- the Flax NNX decoder; its MoE layers are ``moe_eplb_jax.flax.MoELayer``s.
* ``cross_entropy`` -- the next-token loss, its gradient elementwise (no scatter into the logits' gradient).
* ``generate`` / ``Sampling`` -- batched prefill + decode with a KV cache, greedy or sampled.
* ``load_checkpoint`` / ``export_checkpoint`` -- Hugging Face-style safetensors <-> the slot layout of a placement.
* ``skew_routers`` / ``zipf_tokens`` -- skewed synthetic traffic for examples and benchmarks.
"""

from moe_eplb_jax.models.checkpoint import checkpoint_shapes, export_checkpoint, load_checkpoint, router_bias_name
from moe_eplb_jax.models.config import ATTENTIONS, DTYPES, PRESETS, ModelConfig, preset
from moe_eplb_jax.models.data import skew_routers, zipf_router_bias, zipf_tokens
from moe_eplb_jax.models.generation import Generation, Sampling, generate, left_pad, sample
from moe_eplb_jax.models.hf_config import HF_MODEL_TYPES, config_from_hf
from moe_eplb_jax.models.loss import cross_entropy
from moe_eplb_jax.models.model import DecoderBlock, KVCache, MoECausalLM
from moe_eplb_jax.models.rope import YarnScaling

__all__ = [
    "ATTENTIONS",
    "DTYPES",
    "PRESETS",
    "DecoderBlock",
    "Generation",
    "HF_MODEL_TYPES",
    "KVCache",
    "ModelConfig",
    "MoECausalLM",
    "Sampling",
    "YarnScaling",
    "checkpoint_shapes",
    "config_from_hf",
    "cross_entropy",
    "export_checkpoint",
    "generate",
    "left_pad",
    "load_checkpoint",
    "preset",
    "router_bias_name",
    "sample",
    "skew_routers",
    "zipf_router_bias",
    "zipf_tokens",
]

"""Skewed synthetic traffic for the examples and benchmarks: Zipf tokens, Zipf router biases.

Real routers favour a few experts; these make that reproducible. The skew
comes from two places, which can be used alone or together:

* ``skew_routers(model, s)`` sets every MoE layer's router bias to
  ``-s * log(1 + e)`` for expert ``e`` (hold it out of the optimizer to keep
  the skew through training, as DeepSeek-V3 holds its score-correction bias).
  With softmax scoring expert ``e`` is then picked about ``(1 + e) ** -s`` as
  often as expert 0; with sigmoid scoring the bias shifts scores in ``(0, 1)``
  and the same ``s`` skews far more.
* ``zipf_tokens`` draws tokens from a Zipf unigram distribution, so a few
  token ids (and whatever experts the router sends them to) dominate.
"""

from __future__ import annotations

import numpy as np

from moe_eplb_jax.models.model import MoECausalLM
from moe_eplb_jax.transport.mesh import put_host

__all__ = ["skew_routers", "zipf_router_bias", "zipf_tokens"]


def zipf_router_bias(num_experts: int, skew: float) -> np.ndarray:
    """``[E]`` float32 ``-skew * log(1 + e)``: expert 0 favoured most, expert ``E - 1`` least."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive integer, got {num_experts!r}")
    if not np.isfinite(skew) or skew < 0:
        raise ValueError(f"skew must be a finite number >= 0, got {skew!r}")
    return (-float(skew) * np.log1p(np.arange(num_experts, dtype=np.float64))).astype(np.float32)


def skew_routers(model: MoECausalLM, skew: float) -> None:
    """Sets the router bias of every MoE layer of ``model`` to ``zipf_router_bias(E, skew)``."""
    bias = zipf_router_bias(model.config.num_experts, skew)
    for layer in model.moe_layers:
        layer.router_bias.set_value(put_host(bias, model.mesh))


def zipf_tokens(
    rng: np.random.Generator, batch: int, seq: int, vocab: int, *, exponent: float = 1.1, repeat: bool = True
) -> np.ndarray:
    """``[batch, seq]`` int32 tokens with ``P(id) ~ (id + 1) ** -exponent``.

    ``repeat``: the second half of each row repeats its first half, a
    structure a model learns quickly (the loss visibly falls).
    """
    for name, value in (("batch", batch), ("seq", seq), ("vocab", vocab)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not np.isfinite(exponent) or exponent < 0:
        raise ValueError(f"exponent must be a finite number >= 0, got {exponent!r}")
    probs = 1.0 / np.arange(1, vocab + 1, dtype=np.float64) ** exponent
    tokens = rng.choice(vocab, size=(batch, seq), p=probs / probs.sum())
    if repeat:
        tokens[:, seq // 2 :] = tokens[:, : seq - seq // 2]
    return tokens.astype(np.int32)

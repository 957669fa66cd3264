"""A small MoE language model shared by the examples (and the controller tests).

Token embedding -> ``num_layers`` blocks of (RMS norm, causal self-attention,
RMS norm, expert-parallel ``MoELayer``) -> tied output projection
(``attention=False`` drops the attention: a cheaper model for tests). Routing is
skewed on purpose: each router starts with a Zipf-like bias (expert ``e`` gets
``-skew * log(e + 1)``), the way real routers favour a few experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moe_eplb_jax.flax import MoELayer


class Block(nnx.Module):
    def __init__(
        self,
        dim,
        heads,
        hidden,
        num_experts,
        top_k,
        *,
        mesh,
        num_physical,
        skew,
        dtype,
        attention,
        capacity_factor,
        rngs,
    ):
        self.norm1 = nnx.RMSNorm(dim, rngs=rngs)
        self.attn = (
            nnx.MultiHeadAttention(heads, dim, qkv_features=dim, decode=False, dtype=dtype, rngs=rngs)
            if attention
            else None
        )
        self.norm2 = nnx.RMSNorm(dim, rngs=rngs)
        self.moe = MoELayer(
            dim,
            hidden,
            num_experts,
            top_k,
            mesh=mesh,
            num_physical=num_physical,
            shared_hidden=hidden,
            dtype=dtype,
            capacity_factor=capacity_factor,
            rngs=rngs,
        )
        bias = -skew * np.log1p(np.arange(num_experts, dtype=np.float32))
        self.moe.router_bias.set_value(jax.device_put(bias, self.moe.router_bias.get_value().sharding))

    def __call__(self, x, mask):
        if self.attn is not None:
            x = x + self.attn(self.norm1(x), mask=mask)
        return x + self.moe(self.norm2(x))


class MoELM(nnx.Module):
    """``tokens [B, T] int32 -> logits [B, T, vocab] float32``."""

    def __init__(
        self,
        *,
        vocab=256,
        dim=64,
        heads=4,
        hidden=64,
        num_layers=2,
        num_experts=16,
        top_k=2,
        num_physical=None,
        mesh,
        skew=1.0,
        dtype=jnp.float32,
        attention=True,
        capacity_factor=None,
        rngs,
    ):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.blocks = nnx.List(
            [
                Block(
                    dim,
                    heads,
                    hidden,
                    num_experts,
                    top_k,
                    mesh=mesh,
                    num_physical=num_physical,
                    skew=skew,
                    dtype=dtype,
                    attention=attention,
                    capacity_factor=capacity_factor,
                    rngs=rngs,
                )
                for _ in range(num_layers)
            ]
        )
        self.norm = nnx.RMSNorm(dim, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.embed.attend(self.norm(x)).astype(jnp.float32)


class VisionLanguageModel(nnx.Module):
    """A wrapper implementing nothing: its language model holds the MoE layers (discovery must find them)."""

    def __init__(self, lm: MoELM, *, rngs):
        self.vision_proj = nnx.Linear(8, 8, rngs=rngs)
        self.language_model = lm

    def __call__(self, tokens):
        return self.language_model(tokens)


def synthetic_batch(rng: np.random.Generator, batch: int, seq: int, vocab: int) -> np.ndarray:
    """Token sequences from a skewed (Zipf) unigram distribution with copy structure to learn."""
    probs = 1.0 / np.arange(1, vocab + 1) ** 1.1
    probs /= probs.sum()
    tokens = rng.choice(vocab, size=(batch, seq), p=probs)
    tokens[:, seq // 2 :] = tokens[:, : seq - seq // 2]  # second half repeats the first
    return tokens.astype(np.int32)

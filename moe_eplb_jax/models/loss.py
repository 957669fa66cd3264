"""The next-token loss, written so its gradient is elementwise: no scatter into the ``[B, T, vocab]`` gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["cross_entropy"]


def cross_entropy(logits, labels):
    """Per-position softmax cross entropy ``logsumexp(logits) - logits[label]`` in float32.

    Args:
      logits: ``[..., vocab]`` (any float dtype; computed in float32).
      labels: ``[...]`` int token ids in ``[0, vocab)``.

    The label's logit is picked by a one-hot product rather than a gather: a gather's gradient is a scatter-add
    into a zero ``[..., vocab]`` float32 buffer (a whole extra pass over the largest array of a training step, and
    atomic on a GPU), where the one-hot's is the elementwise ``softmax - one_hot`` that fuses with the rest.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"labels must have shape {logits.shape[:-1]} (logits without vocab), got {labels.shape}")
    logits = logits.astype(jnp.float32)
    picked = jnp.sum(jnp.where(jax.nn.one_hot(labels, logits.shape[-1], dtype=jnp.bool_), logits, 0.0), axis=-1)
    return jax.nn.logsumexp(logits, axis=-1) - picked

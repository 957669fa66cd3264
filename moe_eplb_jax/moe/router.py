"""Top-k expert routing in the styles of released MoE models (Qwen3-MoE softmax, DeepSeek-V3 sigmoid)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_eplb_jax.moe._gmm.reference import row_invariant_dot
from moe_eplb_jax.moe._ranks import top_k_indices, top_k_take
from moe_eplb_jax.moe.config import RouterConfig

__all__ = ["route"]


def route(x, router_w, config: RouterConfig, *, bias=None, valid=None):
    """Top-k routing in the two styles of released MoE models, as ``config`` says.

    ``scoring="softmax"`` (Qwen3-MoE; group-limited as DeepSeek-V2): scores
    are ``softmax(logits + bias)``; a group's score is its best expert's.
    ``scoring="sigmoid"`` (DeepSeek-V3): scores are ``sigmoid(logits)``;
    ``bias`` (the checkpoint's ``e_score_correction_bias``) is added for the
    choice of experts only, a group's score is the sum of its two best biased
    scores, and the weights come from the unbiased scores.

    Args:
      x: ``[T, D]`` tokens.
      router_w: ``[D, E]`` router weights.
      config: ``top_k``, the groups, the scoring and the weights' scaling
        (``RouterConfig``; ``E`` divisible by ``num_groups``: ``config.check_experts(E)``).
      bias: optional ``[E]`` router bias (see ``scoring``).
      valid: optional ``[T]`` bool: the rows it marks false get ids ``-1`` (padding, routed nowhere).

    Returns:
      ``(ids [T, k] int32, weights [T, k] float32)``.
    """
    if valid is not None and jnp.shape(valid) != (x.shape[0],):
        raise ValueError(f"valid must have shape [T={x.shape[0]}], got {jnp.shape(valid)}")
    top_k, num_groups, topk_groups, scoring = config.top_k, config.num_groups, config.topk_groups, config.scoring
    num_experts = router_w.shape[1]
    # Row-invariant: a token's logits do not depend on how many tokens its rank holds (the EP size).
    logits = row_invariant_dot(x.astype(jnp.float32), router_w.astype(jnp.float32))
    bias = None if bias is None else bias.astype(jnp.float32)[None, :]
    if scoring == "softmax":
        scores = jax.nn.softmax(logits if bias is None else logits + bias, axis=-1)
        choice = scores
    else:
        scores = jax.nn.sigmoid(logits)
        choice = scores if bias is None else scores + bias
    if topk_groups is not None and topk_groups < num_groups:
        per_group = choice.reshape(choice.shape[0], num_groups, num_experts // num_groups)
        if scoring == "softmax":
            group_score = per_group.max(-1)
        else:
            best = top_k_indices(per_group, min(2, per_group.shape[-1]))
            group_score = jnp.take_along_axis(per_group, best, axis=-1).sum(-1)
        keep = top_k_indices(group_score, topk_groups)  # [T, topk_groups]
        group_mask = (keep[:, :, None] == jnp.arange(num_groups)[None, None, :]).any(1)  # [T, groups]
        mask = jnp.repeat(group_mask, num_experts // num_groups, axis=1)
        choice = jnp.where(mask, choice, -jnp.inf)  # never picked
    return top_k_take(
        choice,
        scores,
        top_k,
        valid=valid,
        renormalize=config.renormalize,
        scale=config.routed_scaling_factor,
    )

"""A float64 numpy oracle of ``moe_eplb_jax.models``: the decoder computed from checkpoint tensors, token by token.

Written from the model descriptions (Qwen3-MoE, DeepSeek-V3), not from the
package: it reads the Hugging Face-named tensors directly, so it checks the
checkpoint mapping (transposes, gate/up order, expert slots) as well as the
math. Also writes random checkpoints for the tests.
"""

from __future__ import annotations

import numpy as np

from moe_eplb_jax.models import ModelConfig, checkpoint_shapes


def random_tensors(config: ModelConfig, rng: np.random.Generator, dtype=np.float32) -> dict[str, np.ndarray]:
    """A random checkpoint of ``config``: weights ~ N(0, 1/fan_in), norms near 1, a Zipf-like router bias."""
    out = {}
    for name, shape in checkpoint_shapes(config).items():
        if len(shape) == 1 and name.endswith("e_score_correction_bias"):
            value = -0.3 * np.log1p(np.arange(shape[0])) + 0.01 * rng.standard_normal(shape)
        elif len(shape) == 1:
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) * shape[-1] ** -0.5
        out[name] = value.astype(np.float32 if name.endswith("bias") else dtype)
    return out


def _rms(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w.astype(np.float64)


def _rope(x, pos, theta):  # x [T, heads, Dh], pos [T]
    half = x.shape[-1] // 2
    freq = theta ** (-np.arange(half) * 2.0 / x.shape[-1])
    ang = pos[:, None, None] * freq[None, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], axis=-1)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _mlp(x, gate, up, down):  # HF layout: gate/up [H, D], down [D, H]
    return (_silu(x @ gate.T.astype(np.float64)) * (x @ up.T.astype(np.float64))) @ down.T.astype(np.float64)


def route(logits, bias, config: ModelConfig):
    """One token: ``(ids [k], weights [k])`` from router ``logits [E]``."""
    e = logits.shape[0]
    if config.scoring == "softmax":
        z = logits + bias
        scores = np.exp(z - z.max())
        scores /= scores.sum()
        choice = scores.copy()
    else:
        scores = 1.0 / (1.0 + np.exp(-logits))
        choice = scores + bias
    if config.topk_groups is not None and config.topk_groups < config.num_groups:
        groups = choice.reshape(config.num_groups, e // config.num_groups)
        if config.scoring == "softmax":
            group_score = groups.max(1)
        else:
            group_score = np.sort(groups, axis=1)[:, ::-1][:, :2].sum(1)
        keep = np.argsort(-group_score, kind="stable")[: config.topk_groups]
        allowed = np.zeros(e, bool)
        for g in keep:
            allowed[g * (e // config.num_groups) : (g + 1) * (e // config.num_groups)] = True
        choice = np.where(allowed, choice, -np.inf)
    ids = np.argsort(-choice, kind="stable")[: config.top_k]
    weights = scores[ids]
    if config.renormalize:
        weights = weights / weights.sum()
    return ids, weights * config.routed_scaling_factor


def logits(tensors: dict[str, np.ndarray], config: ModelConfig, tokens: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """``[B, T, vocab]`` float64 logits of ``tokens [B, T]``; ``valid`` marks real tokens (padding is not attended)."""
    c, t = config, {k: np.asarray(v, np.float64) for k, v in tensors.items()}
    out = np.zeros((*tokens.shape, c.vocab_size))
    for b in range(tokens.shape[0]):
        x = t["model.embed_tokens.weight"][tokens[b]]  # [T, D]
        pos = np.maximum(np.cumsum(valid[b]) - 1, 0).astype(np.float64)
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            h = _rms(x, t[p + "input_layernorm.weight"], c.rms_eps)
            q = (h @ t[p + "self_attn.q_proj.weight"].T).reshape(-1, c.num_heads, c.head_dim)
            k = (h @ t[p + "self_attn.k_proj.weight"].T).reshape(-1, c.num_kv_heads, c.head_dim)
            v = (h @ t[p + "self_attn.v_proj.weight"].T).reshape(-1, c.num_kv_heads, c.head_dim)
            if c.qk_norm:
                q = _rms(q, t[p + "self_attn.q_norm.weight"], c.rms_eps)
                k = _rms(k, t[p + "self_attn.k_norm.weight"], c.rms_eps)
            q, k = _rope(q, pos, c.rope_theta), _rope(k, pos, c.rope_theta)
            attn = np.zeros_like(q)
            for head in range(c.num_heads):
                kv = head // (c.num_heads // c.num_kv_heads)
                for i_q in range(q.shape[0]):
                    seen = valid[b, : i_q + 1].copy()
                    if not seen.any():
                        continue  # a padding query that sees nothing: its output is never used
                    s = k[: i_q + 1, kv] @ q[i_q, head] / np.sqrt(c.head_dim)
                    s = np.where(seen, s, -np.inf)
                    w = np.exp(s - s.max())
                    attn[i_q, head] = (w / w.sum()) @ v[: i_q + 1, kv]
            x = x + attn.reshape(x.shape[0], -1) @ t[p + "self_attn.o_proj.weight"].T
            h = _rms(x, t[p + "post_attention_layernorm.weight"], c.rms_eps)
            if i < c.first_dense_layers:
                x = x + _mlp(
                    h, t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"], t[p + "mlp.down_proj.weight"]
                )
                continue
            bias_name = p + ("mlp.gate.e_score_correction_bias" if c.scoring == "sigmoid" else "mlp.gate.bias")
            bias = t.get(bias_name, np.zeros(c.num_experts))
            moe = np.zeros_like(x)
            for j in range(x.shape[0]):
                if c.shared_hidden:
                    s = p + "mlp.shared_experts."
                    moe[j] += _mlp(h[j], t[s + "gate_proj.weight"], t[s + "up_proj.weight"], t[s + "down_proj.weight"])
                if not valid[b, j]:
                    continue
                ids, weights = route(h[j] @ t[p + "mlp.gate.weight"].T, bias, c)
                for e, w in zip(ids, weights):
                    ex = f"{p}mlp.experts.{e}."
                    moe[j] += w * _mlp(
                        h[j], t[ex + "gate_proj.weight"], t[ex + "up_proj.weight"], t[ex + "down_proj.weight"]
                    )
            x = x + moe
        head = t["model.embed_tokens.weight"] if c.tie_embeddings else t["lm_head.weight"]
        out[b] = _rms(x, t["model.norm.weight"], c.rms_eps) @ head.T
    return out

"""A float64 numpy oracle of ``moe_eplb_jax.models``: the decoder computed from checkpoint tensors, token by token.

Written from the model descriptions (Qwen3-MoE, DeepSeek-V3, GLM-4-MoE; MLA
from the DeepSeek-V2 paper, Sec. 2.1; YaRN from its paper and the Hugging Face
config semantics), not from the package: it reads the Hugging Face-named
tensors directly, so it checks the checkpoint mapping (transposes, gate/up
order, expert slots) as well as the math. Rotary pairs are rotated as complex
numbers in the layout the checkpoint gives (interleaved or rotate-half); the
package may lay them out differently, which no dot product can see. Also
writes random checkpoints for the tests.
"""

from __future__ import annotations

import math

import numpy as np

from moe_eplb_jax.models import ModelConfig, checkpoint_shapes


def random_tensors(config: ModelConfig, rng: np.random.Generator, dtype=np.float32) -> dict[str, np.ndarray]:
    """A random checkpoint of ``config``: weights ~ N(0, 1/fan_in), norms near 1, a Zipf-like router bias."""
    out = {}
    for name, shape in checkpoint_shapes(config).items():
        router_bias = name.endswith(("e_score_correction_bias", "mlp.gate.bias"))
        if name.endswith("e_score_correction_bias"):
            value = -0.3 * np.log1p(np.arange(shape[0])) + 0.01 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            value = 0.1 * rng.standard_normal(shape)
        elif len(shape) == 1:
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) * shape[-1] ** -0.5
        out[name] = value.astype(np.float32 if router_bias else dtype)  # routers keep float32 biases
    return out


def _rms(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w.astype(np.float64)


def yarn_mscale(scale, m=1.0):
    """YaRN's temperature, ``0.1 m ln(s) + 1`` for ``s > 1`` (paper, Eq. 21 as DeepSeek generalises it)."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def rope_frequencies(rotary_dim, theta, scaling):
    """``(frequencies [R/2], cos/sin factor)``: ``theta^(-2i/R)``, YaRN-blended when ``scaling`` is set.

    YaRN: pair ``i`` turns ``L / wavelength_i`` times over the original
    context ``L``; pairs turning more than ``beta_fast`` times keep their
    frequency, fewer than ``beta_slow`` are divided by ``factor``, with a
    linear blend in the pair index between the two (the index bounds rounded
    outward when ``truncate``).
    """
    i = np.arange(rotary_dim // 2, dtype=np.float64)
    freq = theta ** (-2.0 * i / rotary_dim)
    if scaling is None:
        return freq, 1.0
    s = scaling

    def index_turning(n):  # solve L * freq_i / (2 pi) = n for i
        return math.log(s.original_max_len / (2 * math.pi * n)) / math.log(theta) * rotary_dim / 2

    lo, hi = index_turning(s.beta_fast), index_turning(s.beta_slow)
    if s.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, rotary_dim - 1)
    hi = hi + 0.001 if hi == lo else hi
    blend = np.minimum(np.maximum((i - lo) / (hi - lo), 0.0), 1.0)  # 0: keep, 1: interpolate
    freq = freq * (1 - blend) + freq / s.factor * blend
    if s.attention_factor is not None:
        return freq, s.attention_factor
    if s.mscale and s.mscale_all_dim:
        return freq, yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    return freq, yarn_mscale(s.factor)


def _rope(x, pos, freq, factor=1.0, interleaved=False):  # x [T, heads, Dh], pos [T]: rotates the first 2*len(freq)
    r = 2 * freq.shape[0]
    rot = x[..., :r]
    pairs = (rot[..., 0::2] + 1j * rot[..., 1::2]) if interleaved else (rot[..., : r // 2] + 1j * rot[..., r // 2 :])
    turned = pairs * np.exp(1j * pos[:, None, None] * freq[None, None, :]) * factor
    out = np.empty_like(rot)
    if interleaved:
        out[..., 0::2], out[..., 1::2] = turned.real, turned.imag
    else:
        out[..., : r // 2], out[..., r // 2 :] = turned.real, turned.imag
    return np.concatenate([out, x[..., r:]], axis=-1)


def _softmax_attention(q, k, v, valid_row, scale):
    """q [T, H, Dk], k [T, H, Dk], v [T, H, Dv]: causal attention over the valid keys -> [T, H, Dv]."""
    out = np.zeros((*q.shape[:2], v.shape[-1]))
    for i_q in range(q.shape[0]):
        seen = valid_row[: i_q + 1]
        if not seen.any():
            continue  # a padding query that sees nothing: its output is never used
        for head in range(q.shape[1]):
            s = k[: i_q + 1, head] @ q[i_q, head] * scale
            s = np.where(seen, s, -np.inf)
            w = np.exp(s - s.max())
            out[i_q, head] = (w / w.sum()) @ v[: i_q + 1, head]
    return out


def _linear(t, name, x):
    y = x @ t[name + ".weight"].T
    return y + t[name + ".bias"] if name + ".bias" in t else y


def _gqa(t, p, c: ModelConfig, h, pos, valid_row):
    q = _linear(t, p + "q_proj", h).reshape(-1, c.num_heads, c.head_dim)
    k = _linear(t, p + "k_proj", h).reshape(-1, c.num_kv_heads, c.head_dim)
    v = _linear(t, p + "v_proj", h).reshape(-1, c.num_kv_heads, c.head_dim)
    if c.qk_norm:
        q, k = _rms(q, t[p + "q_norm.weight"], c.rms_eps), _rms(k, t[p + "k_norm.weight"], c.rms_eps)
    freq, factor = rope_frequencies(int(c.head_dim * c.partial_rotary_factor), c.rope_theta, c.rope_scaling)
    q = _rope(q, pos, freq, factor, c.rope_interleave)
    k = _rope(k, pos, freq, factor, c.rope_interleave)
    group = c.num_heads // c.num_kv_heads
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    out = _softmax_attention(q, k, v, valid_row, c.head_dim**-0.5)
    return _linear(t, p + "o_proj", out.reshape(h.shape[0], -1))


def _mla(t, p, c: ModelConfig, h, pos, valid_row):
    """DeepSeek-V2 Sec. 2.1: c_Q = norm(W_DQ h), [q_C; q_R] = W_UQ c_Q; c_KV = norm(W_DKV h), k_R = W_KR h;
    [k_C; v_C] = W_UKV c_KV per head; score = (q_C.k_C + RoPE(q_R).RoPE(k_R)) / sqrt(dn + dr)."""
    n, heads = h.shape[0], c.num_heads
    dn, dr, dv, r = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    if c.q_lora_rank is None:
        q = _linear(t, p + "q_proj", h)
    else:
        c_q = _rms(_linear(t, p + "q_a_proj", h), t[p + "q_a_layernorm.weight"], 1e-6)
        q = _linear(t, p + "q_b_proj", c_q)
    q = q.reshape(n, heads, dn + dr)
    compressed = _linear(t, p + "kv_a_proj_with_mqa", h)
    c_kv = _rms(compressed[:, :r], t[p + "kv_a_layernorm.weight"], 1e-6)
    kv = (c_kv @ t[p + "kv_b_proj.weight"].T).reshape(n, heads, dn + dv)
    freq, factor = rope_frequencies(dr, c.rope_theta, c.rope_scaling)
    q_r = _rope(q[..., dn:], pos, freq, factor, c.rope_interleave)
    k_r = _rope(compressed[:, None, r:], pos, freq, factor, c.rope_interleave)  # one key shared by every head
    q_full = np.concatenate([q[..., :dn], q_r], axis=-1)
    k_full = np.concatenate([kv[..., :dn], np.repeat(k_r, heads, axis=1)], axis=-1)
    scale = (dn + dr) ** -0.5
    s = c.rope_scaling
    if s is not None and s.mscale_all_dim:
        scale *= yarn_mscale(s.factor, s.mscale_all_dim) ** 2
    out = _softmax_attention(q_full, k_full, kv[..., dn:], valid_row, scale)
    return _linear(t, p + "o_proj", out.reshape(n, -1))


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
            attention = _mla if c.attention == "mla" else _gqa
            x = x + attention(t, p + "self_attn.", c, h, pos, valid[b])
            h = _rms(x, t[p + "post_attention_layernorm.weight"], c.rms_eps)
            if i in c.dense_blocks:
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

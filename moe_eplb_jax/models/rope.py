"""Rotary position embeddings as Hugging Face configs describe them: plain or YaRN-scaled, full or partial.

The frequencies of the ``R`` rotated dimensions (``R = 2 * len(inv_freq)``,
the whole head or its first ``partial_rotary_factor`` part) are
``theta ** (-2i / R)``; YaRN (Peng et al. 2023, "YaRN: Efficient Context
Window Extension of Large Language Models") interpolates the low frequencies
by ``factor`` and keeps the high ones, with a linear ramp in the dimension
index between the two correction dimensions (``beta_fast`` / ``beta_slow``
rotations over the original context), and scales cos/sin by an attention
temperature. Two pair layouts: rotate-half (dimension ``i`` pairs with
``i + R/2``: Llama, Qwen, GLM) and interleaved (``2i`` pairs with ``2i + 1``:
DeepSeek's MLA weights, ``rope_interleave``); an interleaved input comes out
in the rotate-half layout, so queries and keys must both go through here.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from moe_eplb_jax._checks import check_real, show

__all__ = ["YarnScaling", "apply_rope", "rope_frequencies", "rotation", "softmax_mscale", "yarn_mscale"]


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN context extension (Hugging Face ``rope_parameters`` with ``rope_type="yarn"``).

    Attributes:
      factor: context extension factor ``s`` (``factor``).
      original_max_len: the context the model was pretrained on (``original_max_position_embeddings``).
      beta_fast, beta_slow: rotations over ``original_max_len`` that bound the ramp (``beta_fast``, ``beta_slow``).
      mscale, mscale_all_dim: DeepSeek's temperature terms (``mscale``, ``mscale_all_dim``; ``None``: absent).
      attention_factor: cos/sin scale; ``None``: from ``mscale`` / ``mscale_all_dim`` or
        ``0.1 ln(factor) + 1`` (``attention_factor``).
      truncate: round the correction dimensions outward to integers (``truncate``).
    """

    factor: float
    original_max_len: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        for name in ("factor", "beta_fast", "beta_slow"):
            _check_positive(name, getattr(self, name))
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            value = getattr(self, name)
            if value is not None:
                _check_positive(name, value, allow_zero=name != "attention_factor")
        n = self.original_max_len
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"YarnScaling.original_max_len must be a positive integer, got {n!r}")
        if not isinstance(self.truncate, bool):
            raise ValueError(f"YarnScaling.truncate must be a bool, got {self.truncate!r}")


def _check_positive(name: str, value, *, allow_zero: bool = False) -> None:
    try:
        ok = check_real(name, value) >= 0 and (value != 0 or allow_zero)
    except ValueError:
        ok = False
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"YarnScaling.{name} must be a finite number {bound}, got {show(value)}")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """The YaRN temperature ``0.1 * mscale * ln(scale) + 1`` (1 when ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(rotary_dim: int, theta: float, scaling: YarnScaling | None = None) -> tuple[np.ndarray, float]:
    """``(inv_freq [rotary_dim // 2] float64, attention_factor)`` of ``rotary_dim`` rotated dimensions."""
    half = rotary_dim // 2
    inv_freq = theta ** (-np.arange(half, dtype=np.float64) * 2.0 / rotary_dim)
    if scaling is None:
        return inv_freq, 1.0
    s = scaling

    def correction_dim(rotations: float) -> float:  # the dimension whose wavelength fits `rotations` times
        return rotary_dim * math.log(s.original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a one-point ramp would divide by zero
    interpolated = np.clip((np.arange(half, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    inv_freq = inv_freq / s.factor * interpolated + inv_freq * (1.0 - interpolated)
    if s.attention_factor is not None:
        factor = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        factor = yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        factor = yarn_mscale(s.factor)
    return inv_freq, float(factor)


def softmax_mscale(scaling: YarnScaling | None) -> float:
    """What DeepSeek's MLA multiplies its softmax scale by: ``yarn_mscale(factor, mscale_all_dim) ** 2`` (else 1)."""
    if scaling is None or not scaling.mscale_all_dim:
        return 1.0
    return yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def rotation(positions, inv_freq, attention_factor: float = 1.0):
    """``(cos, sin)``, each ``positions.shape + [len(inv_freq)]`` float32: the angles ``position * inv_freq``'s
    cosine and sine times ``attention_factor`` -- what :func:`apply_rope` rotates by."""
    freq = jnp.asarray(np.asarray(inv_freq, np.float32))
    angle = positions.astype(jnp.float32)[..., None] * freq.reshape((1,) * positions.ndim + freq.shape)
    return jnp.cos(angle) * jnp.float32(attention_factor), jnp.sin(angle) * jnp.float32(attention_factor)


def apply_rope(x, positions, inv_freq, *, attention_factor: float = 1.0, interleaved: bool = False):
    """Rotates the first ``2 * len(inv_freq)`` dimensions of ``x [B, T, heads, Dh]`` at ``positions [B, T]``.

    The rest of each head passes through. Computed in float32, returned in ``x.dtype``.
    """
    half = inv_freq.shape[0]
    cos, sin = (c[:, :, None, :] for c in rotation(positions, inv_freq, attention_factor))  # [B, T, 1, half]
    rot = x[..., : 2 * half].astype(jnp.float32)
    lead = rot.shape[:-1]
    # Each rotated pair (x1, x2) as one [2, half] block, out = pairs * cos + (-x2, x1) * sin: no slices joined by
    # a concatenate, which XLA's GPU fusion would split into a kernel per half and one to join them.
    if interleaved:  # pairs (x[2i], x[2i + 1]), written back half-split as DeepSeek's code does
        pairs = jnp.swapaxes(rot.reshape(*lead, half, 2), -1, -2)
    else:
        pairs = rot.reshape(*lead, 2, half)
    sign = jnp.asarray([-1.0, 1.0], jnp.float32).reshape((1,) * len(lead) + (2, 1))
    partner = jnp.flip(pairs, axis=-2) * sign
    out = (pairs * cos[..., None, :] + partner * sin[..., None, :]).reshape(*lead, 2 * half).astype(x.dtype)
    if 2 * half == x.shape[-1]:
        return out
    return jnp.concatenate([out, x[..., 2 * half :]], axis=-1)

"""``quantize_experts`` / ``dequantize_experts``: one entry point for every format.

Every returned pytree is expert-major: each leaf's leading axis is the expert
(slot) axis, values global to a layer (an activation scale) are stored once per
expert, identical. So a rearrangement that permutes or replicates slots along
that axis moves the whole quantized state, derived factors included, and
quantizing ``w[phy2log]`` gives exactly the rearranged bytes (each expert is
quantized independently of the others).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moe_eplb_jax._checks import is_concrete
from moe_eplb_jax.quant.fp8 import Fp8BlockExperts, Fp8Experts, quantize_fp8, quantize_fp8_block
from moe_eplb_jax.quant.mx import MX_BLOCK, Mxfp4Experts, Mxfp8Experts, quantize_mxfp4, quantize_mxfp8
from moe_eplb_jax.quant.nvfp4 import NVFP4_BLOCK, Nvfp4Experts, quantize_nvfp4

__all__ = ["FORMATS", "QuantizedExperts", "dequantize_experts", "quantize_experts"]

FORMATS = ("fp8", "fp8_block", "mxfp8", "mxfp4", "nvfp4")
QuantizedExperts = Fp8Experts | Fp8BlockExperts | Mxfp8Experts | Mxfp4Experts | Nvfp4Experts
_TYPES = (Fp8Experts, Fp8BlockExperts, Mxfp8Experts, Mxfp4Experts, Nvfp4Experts)
_OPTIONS = {
    "fp8": {"weight_scale", "input_scale"},
    "fp8_block": {"block_size"},
    "mxfp8": set(),
    "mxfp4": set(),
    "nvfp4": set(),
}
_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _check_weights(w, fmt: str, nonfinite: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"quantize_experts: unknown format {fmt!r}; choose one of {list(FORMATS)}")
    if nonfinite not in ("raise", "propagate"):
        raise ValueError(f"quantize_experts: nonfinite must be 'raise' or 'propagate', got {nonfinite!r}")
    if not hasattr(w, "shape") or not hasattr(w, "dtype"):
        raise ValueError(f"quantize_experts: w must be an array, got {type(w).__name__}")
    if len(w.shape) != 3:
        raise ValueError(f"quantize_experts: w must be [E, N, K] (3 dims), got shape {tuple(w.shape)}")
    if any(d == 0 for d in w.shape):
        raise ValueError(f"quantize_experts: w must be non-empty, got shape {tuple(w.shape)}")
    if not any(w.dtype == d for d in _FLOAT_DTYPES):
        raise ValueError(f"quantize_experts: w must be float32, bfloat16 or float16, got dtype {w.dtype}")


def _check_finite(w, fmt: str) -> None:
    """Raises on NaN/Inf in a concrete ``w``; traced values cannot be inspected and follow the format's rule."""
    if not is_concrete(w):
        return
    bad = ~jnp.isfinite(jnp.asarray(w))
    if bool(jnp.any(bad)):
        experts = np.unique(np.nonzero(np.asarray(bad))[0])
        raise ValueError(
            f"quantize_experts({fmt!r}): w holds {int(jnp.sum(bad))} NaN/Inf values in experts "
            f"{experts[:8].tolist()}{'...' if experts.size > 8 else ''}; pass nonfinite='propagate' for "
            f"the format's documented behaviour"
        )


def _block_size(block) -> tuple[int, int]:
    """``(bn, bk)`` from a pair of positive integers (a bool or 16.7 is not one)."""
    try:
        pair = tuple(block)
    except TypeError:
        pair = ()
    if len(pair) != 2 or any(
        isinstance(b, (bool, np.bool_)) or not isinstance(b, (int, np.integer)) or b <= 0 for b in pair
    ):
        raise ValueError(f"quantize_experts('fp8_block'): block_size must be two positive ints, got {block!r}")
    return int(pair[0]), int(pair[1])


def _per_expert_scale(name: str, value, num_experts: int):
    """A float32 ``[E]`` scale from a scalar or ``[E]`` value, checked on the host (no device work)."""
    if not is_concrete(value):
        if not jnp.issubdtype(value.dtype, jnp.floating) or value.shape not in ((), (num_experts,)):
            raise ValueError(
                f"quantize_experts('fp8'): {name} must be a float scalar or shape ({num_experts},), "
                f"got {value.dtype} {value.shape}"
            )
        return jnp.broadcast_to(value.astype(jnp.float32), (num_experts,))
    arr = np.asarray(value)
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"quantize_experts('fp8'): {name} must be float, got dtype {arr.dtype}")
    if arr.ndim == 0:
        arr = np.broadcast_to(arr, (num_experts,))
    if arr.shape != (num_experts,):
        raise ValueError(f"quantize_experts('fp8'): {name} must be a scalar or shape ({num_experts},), got {arr.shape}")
    if not np.all((arr > 0) & np.isfinite(arr)):
        raise ValueError(f"quantize_experts('fp8'): {name} must be positive and finite")
    return arr.astype(np.float32)


def quantize_experts(w, fmt: str, *, nonfinite: str = "raise", **opts) -> QuantizedExperts:
    """Quantizes expert weights ``w`` (float ``[E, N, K]``, K the contraction axis) to format ``fmt``.

    Formats (``FORMATS``) and options:

    * ``"fp8"`` -> ``Fp8Experts``; ``weight_scale`` (float32 ``[E]`` or scalar;
      default ``max|w_e| * fl32(1/448)`` per expert; share it between gate and up),
      ``input_scale`` (the layer's activation scale, default 1.0; see
      ``activation_scale`` and ``with_input_scale``).
    * ``"fp8_block"`` -> ``Fp8BlockExperts``; ``block_size=(128, 128)`` (N and K
      must be multiples).
    * ``"mxfp8"``, ``"mxfp4"`` -> ``Mxfp8Experts``, ``Mxfp4Experts`` (K a multiple of 32).
    * ``"nvfp4"`` -> ``Nvfp4Experts`` (K a multiple of 16).

    ``nonfinite="raise"`` (default) rejects NaN/Inf weights when ``w`` is a concrete
    array; ``"propagate"`` (and any traced call) applies the format's documented
    rule instead (see each format module). Raises ``ValueError`` before any work
    on a bad shape, dtype, option or format name.
    """
    _check_weights(w, fmt, nonfinite)
    unknown = set(opts) - _OPTIONS[fmt]
    if unknown:
        raise ValueError(
            f"quantize_experts({fmt!r}): unknown options {sorted(unknown)}; accepted: {sorted(_OPTIONS[fmt])}"
        )
    e, n, k = w.shape
    block = _block_size(opts.get("block_size", (128, 128)))
    if fmt == "fp8_block":
        if n % block[0] or k % block[1]:
            raise ValueError(
                f"quantize_experts('fp8_block'): N={n} and K={k} must be multiples of the block size {block}"
            )
    elif fmt in ("mxfp8", "mxfp4") and k % MX_BLOCK:
        raise ValueError(f"quantize_experts({fmt!r}): contraction axis K={k} must be a multiple of {MX_BLOCK}")
    elif fmt == "nvfp4" and k % NVFP4_BLOCK:
        raise ValueError(f"quantize_experts('nvfp4'): contraction axis K={k} must be a multiple of {NVFP4_BLOCK}")
    weight_scale = opts.get("weight_scale")
    if weight_scale is not None:
        weight_scale = _per_expert_scale("weight_scale", weight_scale, e)
    input_scale = _per_expert_scale("input_scale", opts.get("input_scale", 1.0), e)
    if nonfinite == "raise":
        _check_finite(w, fmt)

    if fmt == "fp8":
        return quantize_fp8(w, weight_scale, input_scale)
    if fmt == "fp8_block":
        return quantize_fp8_block(w, block_size=block)
    if fmt == "mxfp8":
        return quantize_mxfp8(w)
    if fmt == "mxfp4":
        return quantize_mxfp4(w)
    return quantize_nvfp4(w)


def dequantize_experts(q: QuantizedExperts) -> jax.Array:
    """Float32 ``[E, N, K]`` weights that ``q`` encodes (NaN where the format marks NaN)."""
    if not isinstance(q, _TYPES):
        raise ValueError(f"dequantize_experts: expects one of {[t.__name__ for t in _TYPES]}, got {type(q).__name__}")
    return q.dequantize()

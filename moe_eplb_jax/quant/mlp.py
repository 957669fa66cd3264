"""SiLU-gated expert MLP on quantized expert weights.

``y = down(silu(gate(x)) * up(x))`` per expert, with ``x [E, T, H]`` (the tokens
of each local expert slot), gate/up weights ``[E, I, H]`` and down weights
``[E, H, I]`` (contraction axis last, as ``quantize_experts`` expects). Each
projection is a quantized pytree of any format, or a plain float array (the
unquantized baseline).

What each ``impl`` computes, and where it runs (figures in benchmarks/RESULTS.md):

* ``"reference"`` -- the oracle, any backend: weights dequantized to float32 and
  a float32 (HIGHEST precision) einsum. For ``fp8`` the activations are first
  quantized with the stored (or dynamic) activation scale, exactly as the fast
  path does, and the result is ``(x_q @ w_q^T) * alpha``.
* ``"auto"`` -- the fast path. ``fp8``: an e4m3 x e4m3 ``dot_general`` times the
  stored ``alpha`` (W8A8). On Hopper XLA runs it as cuBLASLt's FP8 GEMM
  (``__cublas$lt$matmul$f8``); with ``fast_accumulation=False`` (default) the
  GEMM keeps float32 accumulation (HIGHEST precision), equal to the reference to
  rounding; ``True`` allows cuBLASLt's reduced-precision accumulation (7e-3
  relative error on the 7168-deep MLP, no faster at decode sizes). Every other
  format is weight-only: weights dequantized to ``compute_dtype`` (bfloat16)
  inside the jitted step, then a bf16 GEMM with float32 accumulation. Hopper
  has no block-scaled FP8/FP4 matrix instructions, and XLA does not fuse the
  dequantization into the GEMM, so these move more bytes than bf16 weights.
* ``"dequant"`` -- ``fp8`` written as a bf16 GEMM of e4m3 values (exact in bf16);
  XLA recognises the converts and still emits the FP8 GEMM on Hopper. The rest
  as ``"auto"``.
* ``"scaled_matmul"`` -- ``mxfp8``/``mxfp4`` weights through
  ``jax.nn.scaled_matmul`` with activations quantized on the fly to MXFP8
  (blocks of 32 along H, the OCP floor rule). cuDNN fuses this on Blackwell
  only; on Hopper and CPU XLA expands it to a float32 dequantize + dot (slower
  than ``"auto"`` there).

Activation scales of ``fp8`` are ``"static"`` (the calibrated ``input_scale``
leaves, already EP-consistent if calibrated with ``ep_amax``) or ``"dynamic"``
(``max|x|`` of the rank's tokens, max-reduced over ``axis_name`` so every rank
agrees); padding tokens should be zero.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from moe_eplb_jax.quant._api import _TYPES, _check_finite, _check_weights, _per_expert_scale, quantize_experts
from moe_eplb_jax.quant._elements import e8m0_to_float32
from moe_eplb_jax.quant.fp8 import Fp8Experts, _scale_from_amax, expert_amax, quantize_fp8
from moe_eplb_jax.quant.mx import MX_BLOCK, Mxfp4Experts, Mxfp8Experts, quantize_mxfp8
from moe_eplb_jax.quant.nvfp4 import NVFP4_BLOCK, Nvfp4Experts
from moe_eplb_jax.quant.scales import activation_scale, quantize_activation_fp8

__all__ = ["ACTIVATION_SCALINGS", "IMPLS", "expert_mlp", "expert_mlp_reference", "quantize_mlp", "share_weight_scale"]

IMPLS = ("reference", "auto", "dequant", "scaled_matmul")
ACTIVATION_SCALINGS = ("static", "dynamic")
_BATCHED = (((2,), (2,)), ((0,), (0,)))  # [E, T, K] x [E, N, K] -> [E, T, N]


def quantize_mlp(w_gate, w_up, w_down, fmt: str, *, input_scale=1.0, down_input_scale=1.0, nonfinite: str = "raise"):
    """Quantizes one MoE layer's expert MLP; returns ``(gate, up, down)`` pytrees.

    ``w_gate``/``w_up`` are ``[E, I, H]``, ``w_down`` ``[E, H, I]``. For ``fp8`` the
    gate and up projections share one weight scale per expert (``max`` of both
    amaxes / 448, so one fused gate-up GEMM could use one alpha), ``input_scale``
    is the scale of ``x`` and ``down_input_scale`` that of ``silu(gate) * up`` (both
    fp8 only; the other formats keep activations in bf16).
    """
    for w in (w_gate, w_up, w_down):
        _check_weights(w, fmt, nonfinite)
    e, i, h = w_gate.shape
    if tuple(w_up.shape) != (e, i, h) or tuple(w_down.shape) != (e, h, i):
        raise ValueError(
            f"quantize_mlp: expected w_gate / w_up [E, I, H] and w_down [E, H, I], got "
            f"{tuple(w_gate.shape)}, {tuple(w_up.shape)}, {tuple(w_down.shape)}"
        )
    if fmt != "fp8":
        return tuple(quantize_experts(w, fmt, nonfinite=nonfinite) for w in (w_gate, w_up, w_down))
    num_experts = w_gate.shape[0]
    scales = [
        _per_expert_scale(name, value, num_experts)
        for name, value in (("input_scale", input_scale), ("down_input_scale", down_input_scale))
    ]
    if nonfinite == "raise":
        for w in (w_gate, w_up, w_down):
            _check_finite(w, fmt)
    shared = _scale_from_amax(jnp.maximum(expert_amax(jnp.asarray(w_gate)), expert_amax(jnp.asarray(w_up))))
    gate = quantize_fp8(w_gate, shared, scales[0])
    up = quantize_fp8(w_up, shared, scales[0])
    down = quantize_experts(w_down, "fp8", nonfinite="propagate", input_scale=scales[1])
    return gate, up, down


def share_weight_scale(gate: Fp8Experts, up: Fp8Experts) -> tuple[Fp8Experts, Fp8Experts]:
    """Requantizes an already-quantized fp8 gate/up pair onto one weight scale per expert (the max).

    For checkpoints that ship separate w1/w3 scales. Values of the projection
    whose scale grows are re-rounded (the usual max-scale requantization).
    """
    if not (isinstance(gate, Fp8Experts) and isinstance(up, Fp8Experts)):
        raise ValueError(f"share_weight_scale: expects two Fp8Experts, got {type(gate).__name__}, {type(up).__name__}")
    if gate.shape != up.shape:
        raise ValueError(f"share_weight_scale: gate {gate.shape} and up {up.shape} differ")
    shared = jnp.maximum(gate.weight_scale, up.weight_scale)

    def requantize(q: Fp8Experts) -> Fp8Experts:
        same = bool(jnp.all(q.weight_scale == shared))
        if same:
            return q
        new = quantize_experts(q.dequantize(), "fp8", weight_scale=shared, input_scale=q.input_scale[0])
        assert isinstance(new, Fp8Experts)  # what "fp8" returns; narrows the union for the replace below
        return dataclasses.replace(new, input_scale=q.input_scale, alpha=shared * q.input_scale)

    return requantize(gate), requantize(up)


def _check_mlp(x, gate, up, down, impl, activation_scaling, compute_dtype, fast_accumulation):
    if not isinstance(fast_accumulation, (bool, np.bool_)):
        raise ValueError(f"expert_mlp: fast_accumulation must be True or False, got {fast_accumulation!r}")
    try:
        floating = jnp.issubdtype(jnp.dtype(compute_dtype), jnp.floating)
    except TypeError:
        floating = False
    if not floating:
        raise ValueError(f"expert_mlp: compute_dtype must be a float dtype (e.g. bfloat16), got {compute_dtype!r}")
    if impl not in IMPLS:
        raise ValueError(f"expert_mlp: unknown impl {impl!r}; choose one of {list(IMPLS)}")
    if activation_scaling not in ACTIVATION_SCALINGS:
        raise ValueError(f"expert_mlp: activation_scaling must be 'static' or 'dynamic', got {activation_scaling!r}")
    if not hasattr(x, "shape") or len(x.shape) != 3 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"expert_mlp: x must be a float [E, T, H] array, got {getattr(x, 'shape', type(x))}")
    shapes = {}
    for name, w in (("gate", gate), ("up", up), ("down", down)):
        if isinstance(w, _TYPES) or hasattr(w, "shape") and len(w.shape) == 3 and jnp.issubdtype(w.dtype, jnp.floating):
            shapes[name] = tuple(w.shape)
        else:
            raise ValueError(
                f"expert_mlp: {name} must be a quantized pytree or a float [E, N, K] array, got {type(w).__name__}"
            )
        if impl == "scaled_matmul" and not isinstance(w, (Mxfp8Experts, Mxfp4Experts)):
            raise ValueError(
                f"expert_mlp: impl='scaled_matmul' needs mxfp8/mxfp4 weights, {name} is {type(w).__name__}"
            )
    e, t, h = x.shape
    i = shapes["gate"][1]
    if shapes["gate"] != (e, i, h) or shapes["up"] != (e, i, h) or shapes["down"] != (e, h, i):
        raise ValueError(
            f"expert_mlp: with x [E, T, H] = {tuple(x.shape)} expected gate/up [E, I, H] and down [E, H, I], "
            f"got gate {shapes['gate']}, up {shapes['up']}, down {shapes['down']}"
        )
    if impl == "scaled_matmul" and (h % MX_BLOCK or i % MX_BLOCK):
        raise ValueError(f"expert_mlp: impl='scaled_matmul' needs H={h} and I={i} multiples of {MX_BLOCK}")


def _fp8_scales(x, q: Fp8Experts, activation_scaling, axis_name):
    """(input_scale [E], alpha [E]): the stored leaves, or a dynamic EP-wide scale and its alpha."""
    if activation_scaling == "static":
        return q.input_scale, q.alpha
    input_scale = jnp.broadcast_to(activation_scale(x, axis_name), q.weight_scale.shape)
    return input_scale, q.weight_scale * input_scale


def _unpack_fp4_to_float4(packed):
    pairs = jax.lax.bitcast_convert_type(packed, jnp.float4_e2m1fn)  # [..., K // 2, 2], even element first
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _project(x, q, *, impl, activation_scaling, axis_name, compute_dtype, fast_accumulation=False):
    """``x [E, T, K]`` times the weights ``[E, N, K]`` of ``q`` -> float32 ``[E, T, N]``."""
    if isinstance(q, Fp8Experts):
        input_scale, alpha = _fp8_scales(x, q, activation_scaling, axis_name)
        x_q = quantize_activation_fp8(x, input_scale)
        alpha = alpha[:, None, None]
        if impl == "reference":
            acc = jnp.einsum(
                "etk,enk->etn",
                x_q.astype(jnp.float32),
                q.weight.astype(jnp.float32),
                precision=jax.lax.Precision.HIGHEST,
            )
        else:
            # DEFAULT precision lets XLA pick cuBLASLt's FP8 fast accumulation (lower-precision partial
            # sums on Hopper); HIGHEST keeps float32 accumulation of the exact e4m3 products.
            precision = jax.lax.Precision.DEFAULT if fast_accumulation else jax.lax.Precision.HIGHEST
            lhs, rhs = x_q, q.weight
            if impl != "auto":
                lhs, rhs = lhs.astype(compute_dtype), rhs.astype(compute_dtype)
            acc = jax.lax.dot_general(lhs, rhs, _BATCHED, precision=precision, preferred_element_type=jnp.float32)
        return acc * alpha
    if impl == "reference":
        w = q.dequantize() if isinstance(q, _TYPES) else q.astype(jnp.float32)
        return jnp.einsum("etk,enk->etn", x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    if impl == "scaled_matmul":
        x_q = quantize_mxfp8(x)
        rhs = q.elements if isinstance(q, Mxfp8Experts) else _unpack_fp4_to_float4(q.elements)
        return jax.nn.scaled_matmul(x_q.elements, rhs, x_q.scales, q.scales, preferred_element_type=jnp.float32)
    w = _dequantize_fast(q, compute_dtype) if isinstance(q, _TYPES) else q.astype(compute_dtype)
    return jax.lax.dot_general(x.astype(compute_dtype), w, _BATCHED, preferred_element_type=jnp.float32)


def _dequantize_fast(q, dtype):
    """Dequantization for the compute path: plain float multiplies XLA can fuse into the GEMM's operand.

    Differs from ``dequantize_experts`` only for blocks whose values are float32
    subnormal (where the GPU flushes to zero); exact otherwise for fp8/mx.
    """
    if isinstance(q, (Mxfp8Experts, Mxfp4Experts)):
        e, n, k = q.shape
        values = q.elements.astype(jnp.float32) if isinstance(q, Mxfp8Experts) else _fp4_values(q.elements)
        scale = e8m0_to_float32(q.scales)[..., None]
        return (values.reshape(e, n, k // MX_BLOCK, MX_BLOCK) * scale).reshape(e, n, k).astype(dtype)
    if isinstance(q, Nvfp4Experts):
        e, n, k = q.shape
        values = _fp4_values(q.elements).reshape(e, n, k // NVFP4_BLOCK, NVFP4_BLOCK)
        scale = q.block_scales.astype(jnp.float32) * q.global_scale[:, None, None]
        return (values * scale[..., None]).reshape(e, n, k).astype(dtype)
    return q.dequantize().astype(dtype)


def _fp4_values(packed):
    """Packed e2m1 pairs ``[..., K // 2]`` -> float32 ``[..., K]`` for the compute path.

    XLA's own float4 conversion, which decodes faster on GPU than ``decode_e2m1``'s arithmetic.
    """
    return _unpack_fp4_to_float4(packed).astype(jnp.float32)


@functools.partial(
    jax.jit, static_argnames=("impl", "activation_scaling", "axis_name", "compute_dtype", "fast_accumulation")
)
def _mlp(x, gate, up, down, *, impl, activation_scaling, axis_name, compute_dtype, fast_accumulation):
    project = functools.partial(
        _project,
        impl=impl,
        activation_scaling=activation_scaling,
        axis_name=axis_name,
        compute_dtype=compute_dtype,
        fast_accumulation=fast_accumulation,
    )
    hidden = jax.nn.silu(project(x, gate)) * project(x, up)
    return project(hidden, down)


def expert_mlp(
    x,
    gate,
    up,
    down,
    *,
    impl: str = "auto",
    activation_scaling: str = "static",
    axis_name: str | None = None,
    compute_dtype=jnp.bfloat16,
    fast_accumulation: bool = False,
) -> jax.Array:
    """Expert MLP ``down(silu(gate(x)) * up(x))`` per expert slot -> float32 ``[E, T, H]``.

    ``x`` is float ``[E, T, H]``; ``gate``/``up`` are ``[E, I, H]`` and ``down``
    ``[E, H, I]`` weights, each a quantized pytree or a float array. ``impl`` is
    one of ``IMPLS`` (see the module docstring for what runs where);
    ``activation_scaling`` applies to ``fp8`` projections; ``axis_name`` is the
    EP mesh axis for dynamic scales inside ``shard_map``. ``fast_accumulation``
    lets ``fp8`` GEMMs use the GPU's reduced-precision FP8 accumulation (faster,
    less accurate at large K); off by default.
    """
    _check_mlp(x, gate, up, down, impl, activation_scaling, compute_dtype, fast_accumulation)
    return _mlp(
        x,
        gate,
        up,
        down,
        impl=impl,
        activation_scaling=activation_scaling,
        axis_name=axis_name,
        compute_dtype=jnp.dtype(compute_dtype),
        fast_accumulation=bool(fast_accumulation),
    )


def expert_mlp_reference(x, gate, up, down, *, activation_scaling: str = "static", axis_name: str | None = None):
    """The float32 oracle of ``expert_mlp`` (``impl="reference"``)."""
    return expert_mlp(x, gate, up, down, impl="reference", activation_scaling=activation_scaling, axis_name=axis_name)

"""The quantized grouped matmul: rows sorted by slot times per-slot quantized weights, read in their packed bytes.

``quantized_grouped_matmul(x [N, K], q [S, M, K], group_sizes [S]) -> [N, M]`` (float32, or ``out_dtype``):
rows ``[start_s, start_s + group_sizes[s])`` times slot ``s``'s weights of ``q``
(a ``moe_eplb_jax.quant`` pytree, contraction axis last); rows past
``sum(group_sizes)`` are padding and come out zero. It computes what
``quant.expert_mlp_reference`` computes for each row with its own slot's
weights, up to float32 summation order, with the activations in
``compute_dtype``:

* ``fp8`` (W8A8): the rows are quantized to e4m3 with the activation scale --
  the stored ``input_scale`` (``"static"``) or ``max|x|`` over the real rows,
  max-reduced over ``axis_name`` (``"dynamic"``: padding rows excluded, so the
  scale does not depend on the placement) -- then e4m3 x e4m3 products (exact in
  bfloat16) accumulate in float32 and ``alpha`` multiplies the result.
* every other format is weight-only: ``x`` in ``compute_dtype`` (default
  ``x.dtype``), the weights decoded exactly (MX scale code 0 aside, which
  decodes to 0) with their block scales, float32 accumulation.

Implementations (``implementation=``): ``"auto"`` -- on a GPU, ``"mosaic"`` for
fp8 where its tiles fit and ``"triton"`` otherwise, each where a first-use probe
compiles and agrees with the reference; else ``"reference"``; ``"reference"`` --
the slots' weights dequantized once to float32 and the float ``dense`` grouped matmul (exact; the CPU path and the
oracle); ``"triton"`` -- the Pallas Triton kernel (``moe._qgmm.triton``) that
decodes the packed bytes in registers, its work following the real row count;
``"mosaic"`` -- fp8 only: the e4m3 rows times the e4m3 weights on the project's
warp-specialized Mosaic GPU kernel (``moe._gmm.mosaic_ws``: TMA loads overlapping
wgmma, faster than Triton's at every size measured, ``docs/kernels.md``). Hopper's fp8 wgmma sums each
128-element chunk with about 14 mantissa bits before the float32 sum, so its
result is within ``MOSAIC_TOLERANCE`` (relative) of the exact product of the
e4m3 values, where Triton's is float32-exact;
``"pallas_interpret"`` -- that kernel in Pallas' interpreter (CPU tests).
Not differentiable (serving).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from moe_eplb_jax import quant
from moe_eplb_jax._kernels import on_gpu, probed
from moe_eplb_jax.moe._gmm import mosaic_ws
from moe_eplb_jax.moe._gmm.reference import slot_of_row
from moe_eplb_jax.moe._qgmm import reference
from moe_eplb_jax.moe._qgmm.config import Config, mosaic_config

__all__ = [
    "IMPLEMENTATIONS",
    "MOSAIC_TOLERANCE",
    "Config",
    "kernel_available",
    "mosaic_available",
    "quantized_grouped_matmul",
]

IMPLEMENTATIONS = ("auto", "reference", "triton", "mosaic", "pallas_interpret")
# fp8 wgmma accumulates each 128-element chunk with about 14 bits before the float32 sum: the relative error to
# the exact product of the e4m3 values that "auto" accepts from the Mosaic path.
MOSAIC_TOLERANCE = 2e-4
_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)


def _check(x, q, group_sizes, implementation, activation_scaling, compute_dtype, config, out_dtype) -> None:
    name = "quantized_grouped_matmul"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{name}: unknown implementation {implementation!r}; known: {list(IMPLEMENTATIONS)}")
    if activation_scaling not in quant.ACTIVATION_SCALINGS:
        raise ValueError(f"{name}: activation_scaling must be 'static' or 'dynamic', got {activation_scaling!r}")
    if not isinstance(q, quant.QuantizedExperts):
        raise ValueError(f"{name}: q must be a moe_eplb_jax.quant pytree, got {type(q).__name__}")
    if not hasattr(x, "shape") or x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name}: x must be a float [N, K] array, got {getattr(x, 'shape', type(x))}")
    if x.shape[1] != q.shape[2]:
        raise ValueError(f"{name}: x [N, K] = {tuple(x.shape)} and q [S, M, K] = {q.shape} differ in K")
    if not hasattr(group_sizes, "shape") or group_sizes.shape != (q.shape[0],):
        raise ValueError(f"{name}: group_sizes must have shape [S]=({q.shape[0]},), got {group_sizes}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"{name}: group_sizes must be integers, got dtype {group_sizes.dtype}")
    if compute_dtype is not None and not any(jnp.dtype(compute_dtype) == d for d in _FLOATS):
        raise ValueError(f"{name}: compute_dtype must be bfloat16, float16 or float32, got {compute_dtype!r}")
    if not any(jnp.dtype(out_dtype) == d for d in _FLOATS):
        raise ValueError(f"{name}: out_dtype must be float32, bfloat16 or float16, got {out_dtype!r}")
    if implementation == "mosaic" and not _mosaic_fits(x.shape[0], q, config):
        raise ValueError(
            f"{name}: implementation 'mosaic' multiplies fp8 experts whose K and M tile its blocks; got "
            f"{type(q).__name__} {q.shape}"
        )


def prepare(x, q, group_sizes, live, *, compute_dtype, activation_scaling: str, axis_name, e4m3_rows: bool = True):
    """``(lhs [N, K], factor [S] float32)``: the activations the matmul multiplies and the per-slot factor.

    ``fp8``: ``x`` quantized to e4m3 with each row's slot's activation scale (padding rows zero), as
    float8_e4m3fn -- or, without ``e4m3_rows``, the same values in bfloat16, exactly; ``factor`` is ``alpha``
    (dynamic: ``weight_scale`` times the EP-wide scale of the real rows). Other formats: ``x`` in
    ``compute_dtype``, ``factor`` the NVFP4 global scale or ones.
    """
    x = jnp.where(live[:, None], x, jnp.zeros((), x.dtype))
    if isinstance(q, quant.Fp8Experts):
        if activation_scaling == "static":
            input_scale, alpha = q.input_scale, q.alpha
        else:
            input_scale = jnp.broadcast_to(quant.activation_scale(x, axis_name), q.weight_scale.shape)
            alpha = q.weight_scale * input_scale
        row_scale = input_scale[jnp.minimum(slot_of_row(group_sizes, x.shape[0]), q.shape[0] - 1)]
        x_q = quant.quantize_activation_fp8(x[:, None, :], row_scale)[:, 0, :]
        return (x_q if e4m3_rows else x_q.astype(jnp.bfloat16)), alpha.astype(jnp.float32)
    lhs = x.astype(compute_dtype or x.dtype)
    if isinstance(q, quant.Nvfp4Experts):
        return lhs, q.global_scale.astype(jnp.float32)
    return lhs, jnp.ones((q.shape[0],), jnp.float32)


def quantized_grouped_matmul(
    x,
    q,
    group_sizes,
    *,
    implementation: str = "auto",
    compute_dtype=None,
    activation_scaling: str = "static",
    axis_name=None,
    config: Config | mosaic_ws.Config | None = None,
    out_dtype=jnp.float32,
) -> jax.Array:
    """See the module docstring.

    Args:
      x: ``[N, K]`` float rows sorted by slot; rows past ``sum(group_sizes)`` are padding (any value).
      q: a ``moe_eplb_jax.quant`` pytree ``[S, M, K]`` (the ``S`` local slots).
      group_sizes: ``[S]`` int rows per slot.
      implementation: one of ``IMPLEMENTATIONS``.
      compute_dtype: the activations' dtype in the MMA, bfloat16, float16 or float32 (``None``: ``x.dtype``; fp8 always
        multiplies e4m3 values, exact in bfloat16).
      activation_scaling, axis_name: fp8's activation scale (``quant.expert_mlp``'s meaning).
      config: the kernel's tiling: a ``Config`` for the Triton kernel, a ``mosaic_ws.Config`` for fp8's Mosaic one
        (``None``: ``moe._qgmm.config.default_config`` or ``mosaic_config``).
      out_dtype: the result's dtype, float32, bfloat16 or float16: the float32 sums rounded once, as the kernel
        stores them (a 16-bit result writes half the bytes, with no conversion pass after).

    Returns:
      ``[N, M]`` in ``out_dtype``, padding rows zero.
    """
    _check(x, q, group_sizes, implementation, activation_scaling, compute_dtype, config, out_dtype)
    if compute_dtype is None and not any(x.dtype == d for d in _FLOATS):
        compute_dtype = jnp.float32
    backend = _backend(implementation, x.shape[0], q, config)
    return _matmul(
        x,
        q,
        group_sizes,
        backend=backend,
        e4m3_rows=backend != "triton" or e4m3_rows_available(),
        compute_dtype=None if compute_dtype is None else jnp.dtype(compute_dtype),
        activation_scaling=activation_scaling,
        axis_name=axis_name,
        config=config,
        out_dtype=jnp.dtype(out_dtype),
    )


def _backend(implementation: str, num_rows: int, q, config) -> str:
    if implementation != "auto":
        return implementation
    if not on_gpu():
        return "reference"
    if not isinstance(config, Config) and _mosaic_fits(num_rows, q, config) and mosaic_available():
        return "mosaic"
    return "triton" if kernel_available() else "reference"


def _mosaic_tiling(num_rows: int, num_slots: int, config) -> mosaic_ws.Config:
    """``config`` where it is a Mosaic tiling, else the default one for the rows per slot."""
    return config if isinstance(config, mosaic_ws.Config) else mosaic_config(num_rows, num_slots)


def _mosaic_fits(num_rows: int, q, config) -> bool:
    """Whether ``q`` is fp8 whose sides tile the Mosaic kernel's blocks."""
    if not isinstance(q, quant.Fp8Experts):
        return False
    tiling = _mosaic_tiling(num_rows, q.shape[0], config)
    return mosaic_ws.supports((num_rows, q.shape[2]), q.shape, jnp.float8_e4m3fn, transpose_rhs=True, config=tiling)


@functools.partial(
    jax.jit,
    static_argnames=("backend", "e4m3_rows", "compute_dtype", "activation_scaling", "axis_name", "config", "out_dtype"),
)
def _matmul(x, q, group_sizes, *, backend, e4m3_rows, compute_dtype, activation_scaling, axis_name, config, out_dtype):
    live = jnp.arange(x.shape[0], dtype=jnp.int32) < jnp.sum(group_sizes.astype(jnp.int32))
    lhs, factor = prepare(
        x,
        q,
        group_sizes,
        live,
        compute_dtype=compute_dtype,
        activation_scaling=activation_scaling,
        axis_name=axis_name,
        e4m3_rows=e4m3_rows,
    )
    if backend == "reference":
        y = reference.grouped_matmul(lhs, q, group_sizes, factor).astype(out_dtype)
    elif backend == "mosaic":
        tiling = _mosaic_tiling(x.shape[0], q.shape[0], config)
        y = mosaic_ws.grouped_matmul(
            lhs, q.weight, group_sizes, transpose_rhs=True, factor=factor, out_dtype=out_dtype, config=tiling
        )
    else:
        interpret = backend != "triton"
        y = _triton().grouped_matmul(
            lhs, q, group_sizes, factor, config=config, out_dtype=out_dtype, interpret=interpret
        )
    return jnp.where(live[:, None], y, jnp.zeros((), out_dtype))


def _triton():
    """The Triton kernel, imported on first use: Pallas' Triton backend is deprecated and may be missing."""
    from moe_eplb_jax.moe._qgmm import triton

    return triton


def kernel_available() -> bool:
    """Whether the Triton kernel compiles here and agrees with the reference for every format (probed once)."""
    return probed("quantized_grouped_matmul", _probe)


def mosaic_available() -> bool:
    """Whether fp8's Mosaic GPU kernel compiles here and agrees with the reference (probed once)."""
    return probed("quantized_grouped_matmul", _mosaic_probe, case="mosaic fp8")


def _mosaic_probe() -> bool:
    """fp8's Mosaic kernel, compiled ahead of time outside any trace, against the reference on a small case."""
    rng = np.random.default_rng(0)
    sizes = jnp.asarray([100, 0, 120, 36], jnp.int32)  # then 32 padding rows
    x = jnp.asarray(rng.standard_normal((288, 256)), jnp.bfloat16)
    q = quant.quantize_experts(jnp.asarray(rng.standard_normal((4, 256, 256)) * 0.1, jnp.float32), "fp8")
    assert isinstance(q, quant.Fp8Experts)
    live = jnp.arange(288) < 256
    lhs, factor = prepare(x, q, sizes, live, compute_dtype=None, activation_scaling="static", axis_name=None)
    call = functools.partial(
        mosaic_ws.grouped_matmul, transpose_rhs=True, out_dtype=jnp.float32, config=mosaic_config(288, 4)
    )
    args = (lhs, q.weight, sizes)
    got = np.asarray(jax.jit(call).lower(*args, factor=factor).compile()(*args, factor=factor))[:256]
    want = np.asarray(reference.grouped_matmul(lhs, q, sizes, factor))[:256]
    return bool(np.linalg.norm(got - want) <= MOSAIC_TOLERANCE * np.linalg.norm(want))


def e4m3_rows_available() -> bool:
    """Whether the kernel's fp8 path multiplying e4m3 rows on the tensor cores compiles here and agrees with the
    reference (probed once); where not, fp8 rows go to the kernel in bfloat16 and its weights are decoded."""
    return kernel_available() and probed(
        "quantized_grouped_matmul", functools.partial(_probe, formats=("fp8",), e4m3_rows=True), case="e4m3 rows"
    )


def _probe(*, interpret: bool = False, formats=quant.FORMATS, e4m3_rows: bool = False) -> bool:
    """Each format's kernel, compiled ahead of time outside any trace, against the reference on a small case
    (``interpret``: in Pallas' interpreter, to test the probe itself on a CPU; fp8's rows in bfloat16 unless
    ``e4m3_rows``)."""
    rng = np.random.default_rng(0)
    sizes = jnp.asarray([20, 0, 28], jnp.int32)  # then 16 padding rows
    x = jnp.asarray(rng.standard_normal((64, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((3, 64, 128)) * 0.1, jnp.float32)
    for fmt in formats:
        q = (
            quant.quantize_experts(w, fmt, block_size=(32, 64))
            if fmt == "fp8_block"
            else quant.quantize_experts(w, fmt)
        )
        lhs, factor = prepare(
            x,
            q,
            sizes,
            jnp.arange(64) < 48,
            compute_dtype=None,
            activation_scaling="static",
            axis_name=None,
            e4m3_rows=e4m3_rows,
        )
        config = Config(block_rows=16, block_k=64)
        kernel = jax.jit(functools.partial(_triton().grouped_matmul, config=config, interpret=interpret))
        got = np.asarray(kernel.lower(lhs, q, sizes, factor).compile()(lhs, q, sizes, factor))[:48]
        want = np.asarray(reference.grouped_matmul(lhs, q, sizes, factor))[:48]
        if not np.allclose(got, want, rtol=2e-3, atol=2e-3 * float(np.abs(want).max())):
            return False
    return True

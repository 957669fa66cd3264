"""Grouped matmuls for the MoE layer: rows sorted by slot times per-slot weights, with gradients.

``grouped_matmul(x [N, K], w [S, K, M], group_sizes [S]) -> [N, M]``:
rows ``[start_s, start_s + group_sizes[s])`` are multiplied by ``w[s]``; rows
past ``sum(group_sizes)`` are padding and come out zero (their inputs reach
nothing in the kernel paths; ``dense`` needs them finite). Differentiable in
``x`` and ``w`` on every implementation.

Implementations (``implementation=``):

* ``"auto"`` (default) -- ``"pallas"`` on a GPU, ``"dense"`` elsewhere.
* ``"dense"`` -- every row times every slot's weights, each row keeping its
  own slot's result: exact and placement-invariant bit for bit, ``S`` times
  the work. The CPU path and the oracle.
* ``"ragged_dot"`` -- ``jax.lax.ragged_dot`` (not placement-invariant; dense
  on GPU).
* ``"pallas"`` -- the GPU kernels, the gradient by a custom VJP (the input
  gradient is the same product with ``w`` transposed, the weight gradient a
  per-group ``x^T dy``): Mosaic GPU kernels (wgmma; ``_gmm/mosaic.py``) for
  16-bit training-size buffers under differentiation, the Triton kernels -- whose cost
  follows the rows a rank received -- for inference, fewer rows, float32 (full
  precision) and other shapes;
  ``"dense"`` for widths neither tiles (below 16, off their power-of-two blocks).
  Where no kernel compiles (no GPU, Pallas' Triton backend missing: a
  first-use probe) ``"dense"`` serves, with one warning.
* ``"triton"`` / ``"mosaic"`` -- one of those kernel families, forced.
* ``"pallas_interpret"`` -- the Triton kernels in Pallas' interpreter (CPU tests).

``swiglu_matmul`` is the expert MLP's first half (gate and up products, SwiGLU,
rows optionally read from their tokens) in one Triton kernel, no gradient:
``moe.expert_mlp`` runs it where ``swiglu_backend`` names a backend.

The result is float32 from ``dense`` and ``ragged_dot`` and in the inputs'
dtype from the kernels (float32 accumulation): a bf16 product writes and its
gradient reads half the bytes. The kernels' cotangent is cast to the inputs'
dtype (bf16 in, bf16 gradients).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from moe_eplb_jax._kernels import fused_unless_differentiated, on_gpu, probed
from moe_eplb_jax.moe._gmm import mosaic
from moe_eplb_jax.moe._gmm.reference import dense, ragged_dot, select_own_slot, slot_of_row, transposed_dense

__all__ = [
    "IMPLEMENTATIONS",
    "available",
    "dense",
    "get",
    "grouped_matmul",
    "ragged_dot",
    "select_own_slot",
    "slot_of_row",
    "swiglu_backend",
    "swiglu_matmul",
    "transposed_dense",
]

IMPLEMENTATIONS = ("auto", "dense", "ragged_dot", "pallas", "triton", "mosaic", "pallas_interpret")
_KERNELS = ("triton", "mosaic", "interpret")


def grouped_matmul(x, w, group_sizes, *, implementation: str = "auto") -> jax.Array:
    """See the module docstring."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown grouped matmul {implementation!r}; known: {available()}")
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"need x [N, K] and w [S, K, M] with the same K, got {x.shape} and {w.shape}")
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(f"group_sizes must have shape [S]=({w.shape[0]},), got {group_sizes.shape}")
    backend = _backend(implementation, x.shape, w.shape, x.dtype)
    if backend == "dense":
        return dense(x, w, group_sizes)
    if backend == "ragged_dot":
        return ragged_dot(x, w, group_sizes)
    inference = _inference_backend(implementation, backend)
    if inference != backend and _triton().supports(x.shape[1], w.shape[2]):
        forward = lambda x, w, group_sizes: _product(x, w, group_sizes, inference)
        training = lambda x, w, group_sizes: _kernel_matmul(x, w, group_sizes, backend)
        return fused_unless_differentiated(forward, training)(x, w, group_sizes)
    return _kernel_matmul(x, w, group_sizes, backend)


def _inference_backend(implementation: str, backend: str) -> str:
    """The backend of a product nothing differentiates: ``"pallas"`` (or ``"auto"``) takes Triton where it gives a
    differentiated one Mosaic -- the Triton kernels skip the padding rows' tiles and write the same 16-bit rows,
    while Mosaic's weight gradient keeps the training step (``docs/kernels.md``)."""
    return "triton" if backend == "mosaic" and implementation in ("auto", "pallas") else backend


def _backend(
    implementation: str, x_shape, w_shape, dtype, *, min_mosaic_rows: int = 1024, min_mosaic_group_rows: int = 128
) -> str:
    """The backend for this product: a ``_KERNELS`` name, ``"dense"`` or ``"ragged_dot"``. Mosaic from
    ``min_mosaic_rows`` rows and ``min_mosaic_group_rows`` rows per group on average, where its large tiles fill;
    with fewer rows per group (decode) Triton's small tiles read the weights faster (``docs/kernels.md``)."""
    if implementation == "auto":
        implementation = "pallas" if on_gpu() else "dense"
    if implementation == "pallas_interpret":
        return "interpret"
    if implementation in ("dense", "ragged_dot"):
        return implementation
    if not probed("grouped_matmul", _probe_triton):
        return "dense"
    wants_mosaic = implementation == "mosaic" or (
        implementation == "pallas"
        and x_shape[0] >= max(min_mosaic_rows, min_mosaic_group_rows * w_shape[0])
        and mosaic.supports(x_shape, w_shape, dtype)
    )
    if wants_mosaic and probed("grouped_matmul", mosaic.probe, case="mosaic"):
        return "mosaic"
    if implementation == "pallas" and not _triton().supports(x_shape[1], w_shape[2]):
        return "dense"  # widths the kernels cannot tile (below 16, off their power-of-two blocks)
    return "triton"


def swiglu_backend(implementation: str, num_rows: int, w_in_shape, dtype, *, tokens: int | None = None) -> str | None:
    """The kernel backend (``"triton"``, ``"interpret"``) on which :func:`swiglu_matmul` is one kernel for
    ``num_rows`` rows through ``w_in [S, D, 2H]`` -- read from ``tokens`` rows of ``x`` where given -- or ``None``
    where it is not: another backend for these rows (dense, a forced Mosaic), widths the kernel cannot tile, or
    an ``x`` too large to index in int32. The kernel runs where nothing differentiates it: the inference backend."""
    num_groups, depth, width = w_in_shape
    backend = _inference_backend(implementation, _backend(implementation, (num_rows, depth), w_in_shape, dtype))
    if backend not in ("triton", "interpret") or width % 2:
        return None
    if tokens is not None and tokens * depth >= 2**31:
        return None
    from moe_eplb_jax.moe._gmm import triton_swiglu

    return backend if triton_swiglu.supports(num_rows, depth, width // 2, num_groups) else None


def swiglu_matmul(x, w_in, group_sizes, row_tokens=None, *, backend: str):
    """``silu(rows @ gate_s) * (rows @ up_s)`` per slot ``s`` (``w_in [S, D, 2H]``: gate columns, then up) in one
    kernel on ``backend`` (:func:`swiglu_backend`'s), rows ``x[row_tokens]`` (``None``: ``x``) -> ``[N, H]`` in
    ``x.dtype``, padding rows unspecified. No gradient: ``moe.expert_mlp`` runs it where nothing differentiates."""
    if backend not in ("triton", "interpret"):
        raise ValueError(f"backend must be 'triton' or 'interpret' (swiglu_backend's), got {backend!r}")
    from moe_eplb_jax.moe._gmm import triton_swiglu

    return triton_swiglu.swiglu_matmul(x, w_in, group_sizes, row_tokens, interpret=backend == "interpret")


def _product(x, w, group_sizes, backend: str, *, transpose_rhs: bool = False):
    """One grouped product on a kernel backend, in ``x.dtype`` (float32 accumulation), padding rows zero.

    The zeroing is a select the consumer's fusion absorbs: no pass of its own.
    """
    if backend == "mosaic":
        y = mosaic.grouped_matmul(x, w, group_sizes, transpose_rhs=transpose_rhs)
    else:
        y = _triton().grouped_matmul(x, w, group_sizes, transpose_rhs=transpose_rhs, interpret=backend == "interpret")
    return _zero_padding(y.astype(x.dtype), group_sizes)


def _zero_padding(rows, group_sizes):
    """``rows`` with every row past the groups zeroed (a Mosaic weight-gradient tile reads rows past its group and
    masks by multiplying, which would pass a NaN). A select over the whole buffer fuses into the rows' producer
    (the SwiGLU's backward, the permutation's gather); zeroing a window in place would make XLA write both the
    zeroed and the plain buffer."""
    live = jnp.arange(rows.shape[0], dtype=jnp.int32) < jnp.sum(group_sizes.astype(jnp.int32))
    return jnp.where(live[:, None], rows, jnp.zeros((), rows.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _kernel_matmul(x, w, group_sizes, backend):
    return _product(x, w, group_sizes, backend)


def _kernel_matmul_fwd(x, w, group_sizes, backend):
    if backend == "mosaic":
        # The weight gradient's tiles read past their group: its rows must be zero there. Zeroed here, the select
        # fuses into the rows' producer (the dispatch's gather, the SwiGLU); in the backward it would be a pass of
        # its own over the saved rows.
        x = _zero_padding(x, group_sizes)
    return _product(x, w, group_sizes, backend), (x, w, group_sizes)


def _kernel_matmul_bwd(backend, residuals, dy):
    x, w, group_sizes = residuals
    dy = dy.astype(x.dtype)
    if backend == "mosaic":  # one zeroed cotangent for both products: padding rows of dx come out zero anyway
        dy = _zero_padding(dy, group_sizes)
    dx = _product(dy, w, group_sizes, backend, transpose_rhs=True)
    if backend == "mosaic":
        dw = mosaic.transposed_grouped_matmul(x, dy, group_sizes)  # x zeroed past the groups in the forward
    else:  # masked loads: rows past a group are never read
        dw = _triton().transposed_grouped_matmul(x, dy, group_sizes, interpret=backend == "interpret")
    return dx, dw.astype(w.dtype), None


_kernel_matmul.defvjp(_kernel_matmul_fwd, _kernel_matmul_bwd)


def _triton():
    """The Triton kernels, imported on first use: Pallas' Triton backend is deprecated and may be missing."""
    from moe_eplb_jax.moe._gmm import triton

    return triton


def _probe_triton() -> bool:
    """Whether the Triton kernel, compiled ahead of time and run outside any trace, matches a float64 product.

    The reference is numpy's: XLA's own float32 matmul runs at TF32 on recent
    GPUs, further from the truth than the kernel's full-precision one.
    """
    rng = np.random.default_rng(0)
    sizes = np.asarray([10, 0, 30], np.int32)  # then 8 padding rows, never compared
    x = rng.standard_normal((48, 32)).astype(np.float32)
    w = rng.standard_normal((3, 32, 32)).astype(np.float32)
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, w, sizes)]
    got = np.asarray(jax.jit(_triton().grouped_matmul).lower(*specs).compile()(x, w, sizes))
    slot = np.repeat(np.arange(3), sizes)
    want = np.einsum("nk,nkm->nm", x[:40].astype(np.float64), w[slot].astype(np.float64))
    return np.allclose(got[:40], want, rtol=1e-4, atol=1e-4)


def available() -> list[str]:
    return sorted(IMPLEMENTATIONS)


def get(name: str) -> Callable[..., jax.Array]:
    """The grouped matmul called ``name`` as ``f(x, w, group_sizes)``; ``ValueError`` listing the known names."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown grouped matmul {name!r}; known: {available()}")
    return functools.partial(grouped_matmul, implementation=name)

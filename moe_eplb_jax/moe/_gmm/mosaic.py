"""Grouped matmuls on Hopper in Pallas Mosaic GPU (wgmma, TMA, a persistent grid), with their gradients' products.

The forward and input-gradient products run the project's warp-specialized kernel (``mosaic_ws``: one warpgroup
loads while two multiply, items past the real rows skipped) where the output width tiles its 256-column bands, and
JAX's ``ragged_dot_mgpu`` (one warpgroup alternating loads and products, every row tile computed) elsewhere; the
weight gradient likewise runs ``mosaic_ws.transposed_grouped_matmul`` where its tiles fit and JAX's
``transposed_ragged_dot_mgpu`` elsewhere. This module fixes their tilings per product and says which shapes they
take. Outputs are in the inputs' dtype, accumulated in float32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from moe_eplb_jax.moe._gmm import mosaic_ws

__all__ = ["Config", "grouped_matmul", "supports", "transposed_grouped_matmul"]

DTYPES = (jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Tiling of one product: ``[block_m, block_n]`` output tiles, the contraction in ``block_k`` chunks,
    ``max_concurrent_steps`` pipeline stages, ``grid_block_n`` column tiles per row band of the snake order.
    The defaults won on an H100 at 65,536 rows of 512-1024 columns."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 4

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Config.{field.name} must be a positive int, got {value!r}")


FORWARD = Config()
WEIGHT_GRADIENT = Config(grid_block_n=1)
WARP_SPECIALIZED = mosaic_ws.Config(block_n=128, max_concurrent_steps=3, grid_tile_width=4)


def _ops():
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

    return ragged_dot_mgpu, transposed_ragged_dot_mgpu


def supports(x_shape, w_shape, dtype, *, transpose_rhs: bool = False, config: Config = FORWARD) -> bool:
    """Whether the kernels take this product (and its two gradient products): 16-bit floats, every matrix side a
    multiple of its tiles."""
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES] or len(x_shape) != 2 or len(w_shape) != 3:
        return False
    depth, width = (w_shape[2], w_shape[1]) if transpose_rhs else (w_shape[1], w_shape[2])
    tiles = (config.block_k, config.block_n, WEIGHT_GRADIENT.block_m, WEIGHT_GRADIENT.block_n)
    return all(side % tile == 0 for side in (depth, width) for tile in tiles) and x_shape[1] == depth


def grouped_matmul(x, w, group_sizes, *, transpose_rhs: bool = False, config: Config | mosaic_ws.Config | None = None):
    """``x [N, K] @ w[s]`` per group run (``transpose_rhs``: ``w [S, M, K]`` read transposed) -> ``[N, M]`` in
    ``x.dtype``; rows past the groups are not written. ``config``: a ``mosaic_ws.Config`` runs the warp-specialized
    kernel, a :class:`Config` JAX's; ``None`` the warp-specialized one where its bands tile the width (it measured
    faster, ``docs/kernels.md``), else JAX's."""
    if config is None:
        fits = mosaic_ws.supports(x.shape, w.shape, x.dtype, transpose_rhs=transpose_rhs, config=WARP_SPECIALIZED)
        config = WARP_SPECIALIZED if fits and x.dtype == w.dtype else FORWARD
    if isinstance(config, mosaic_ws.Config):
        return mosaic_ws.grouped_matmul(x, w, group_sizes, transpose_rhs=transpose_rhs, config=config)
    ragged_dot, _ = _ops()
    width = w.shape[1] if transpose_rhs else w.shape[2]
    if (width // config.block_n) % config.grid_block_n:
        config = dataclasses.replace(config, grid_block_n=1)
    call = functools.partial(ragged_dot.ragged_dot, transpose_rhs=transpose_rhs, **dataclasses.asdict(config))
    return call(x, w, group_sizes=group_sizes.astype(jnp.int32))


def transposed_grouped_matmul(x, dy, group_sizes, *, config: Config | mosaic_ws.Config | None = None):
    """Per group ``x_s^T @ dy_s`` -> ``[S, K, M]`` in ``x.dtype`` (zero for an empty group). Rows outside the
    groups must hold finite values (both kernels let them into the product, masked to zero). ``config`` as in
    :func:`grouped_matmul`: ``None`` the warp-specialized kernel where its tiles fit, else JAX's."""
    if config is None:
        fits = mosaic_ws.supports_transposed(x.shape, dy.shape, x.dtype, config=WARP_SPECIALIZED)
        config = WARP_SPECIALIZED if fits and x.dtype == dy.dtype else WEIGHT_GRADIENT
    if isinstance(config, mosaic_ws.Config):
        return mosaic_ws.transposed_grouped_matmul(x, dy, group_sizes, config=config)
    _, transposed = _ops()
    return transposed.transposed_ragged_dot(
        x, dy, group_sizes=group_sizes.astype(jnp.int32), **dataclasses.asdict(config)
    )


def probe() -> bool:
    """Whether the kernels compile here and match a float64 product (a small case, outside any trace)."""
    rng = np.random.default_rng(0)
    sizes = np.asarray([100, 0, 180, 200], np.int32)  # then 32 rows of padding
    x = rng.standard_normal((512, 128)).astype(jnp.bfloat16)
    w = (rng.standard_normal((4, 128, 256)) / 16).astype(jnp.bfloat16)
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, w, sizes)]
    live = int(sizes.sum())
    # The padding rows are left unwritten: only the live ones are read (garbage may not even cast).
    got = np.asarray(jax.jit(grouped_matmul).lower(*specs).compile()(x, w, sizes))[:live].astype(np.float64)
    slot = np.repeat(np.arange(4), sizes)
    want = np.einsum("nk,nkm->nm", x[:live].astype(np.float64), w[slot].astype(np.float64))
    return bool(np.allclose(got, want, rtol=2e-2, atol=2e-2))

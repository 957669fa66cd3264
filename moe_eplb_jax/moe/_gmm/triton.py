"""Grouped matmuls in Pallas (Triton backend) whose cost follows the real row count.

``grouped_matmul(x [N, K], w [S, K, M], group_sizes [S]) -> [N, M]`` in ``x.dtype`` (float32 accumulation):
rows ``[start_s, end_s)`` (the runs of ``group_sizes``) times ``w[s]``
(``transpose_rhs=True``: ``w [S, M, K]`` read transposed, the input gradient's
product). ``transposed_grouped_matmul(x [N, K], dy [N, M], group_sizes) ->
[S, K, M] float32``: per group ``x_s^T dy_s`` (the weight gradient).

Work items. Each group's rows are cut into tiles of ``Config.block_rows`` from
the group's first row, the last one partial; a tile reaching into the next
group writes only its own group's rows (disjoint masked stores, no race).
There are at most ``cdiv(N, block_rows) + S`` items; the grid has that many rows of programs and
those past the real item count return at once. So the work done follows
``sum(group_sizes)``, not ``N`` -- on a rank that received few rows the
kernel is cheap, which is what makes per-rank load visible in step time. The
weight-gradient kernel loops over its group's rows only, for the same reason.

Each program computes one output tile with a loop over the contraction in
chunks of ``block_k``: the same instruction sequence for every row, so a row's
result does not depend on its position or its group's index
(placement-invariant). Rows outside every group (padding) are never written:
their content is unspecified.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = [
    "Config",
    "check_blocks",
    "default_config",
    "grouped_matmul",
    "max_items",
    "padded_sizes",
    "precision",
    "supports",
    "tiles",
    "transposed_grouped_matmul",
    "work_item",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """The kernel's tiling: ``[block_rows, block_cols]`` output tiles (the weight gradient: ``[block_k, block_cols]``
    tiles over ``block_rows``-row chunks), the contraction in chunks of ``block_k`` (powers of two >= 16, clipped to
    the matrix), and Triton's warps and stages."""

    block_rows: int = 64
    block_k: int = 64
    block_cols: int = 128
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_rows", "block_k", "block_cols", "num_warps", "num_stages"):
            value, least = getattr(self, name), 16 if name.startswith("block") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"Config.{name} must be an int >= {least}, got {value!r}")


def default_config(num_rows: int, width: int, num_groups: int) -> Config:
    """The measured tiling for ``num_rows`` rows over ``num_groups`` groups and ``width`` output columns
    (``docs/kernels.md``): 128 x 256 tiles at training sizes (1.3-1.4x the small tiles on an H100); with fewer
    rows than groups (small-batch decode: one work item per touched group) 16-row tiles with 256-deep loads,
    more bytes in flight per program; small tiles between, three stages deep from 16 rows per group."""
    if num_rows >= 4096 and width % 256 == 0:
        return Config(block_rows=128, block_k=64, block_cols=256, num_warps=8, num_stages=3)
    if num_rows <= num_groups:
        return Config(block_rows=16, block_k=256, block_cols=64, num_warps=4, num_stages=3)
    if num_rows >= 16 * num_groups:
        return Config(num_stages=3)
    return Config()


def padded_sizes(group_sizes):
    """``group_sizes`` as int32 padded with empty groups to a power of two >= 16: a Triton block, read whole."""
    sizes = group_sizes.astype(jnp.int32)
    return jnp.pad(sizes, (0, (1 << max(4, (sizes.shape[0] - 1).bit_length())) - sizes.shape[0]))


def max_items(num_rows: int, num_groups: int, block_rows: int) -> int:
    """The grid's rows: at most ``cdiv(N, bm) + S`` work items (each group adds at most one partial tile)."""
    return pl.cdiv(num_rows, block_rows) + num_groups


def work_item(sizes_ref, item, block_rows: int):
    """Inside a kernel: ``(live, group, first_row, start, end)`` of work item ``item`` -- whether it exists, its
    group, the first row of its tile and its group's rows ``[start, end)`` -- from ``padded_sizes``' ref.

    Tiles start at their group's first row, so a group of ``n`` rows is ``cdiv(n, block_rows)`` items and its
    weights are read that many times: a decode step's few rows per group read each weight once (tiles cut at
    multiples of ``block_rows`` would read a straddling group's twice). Computed by every program from the group
    sizes (a scan over at most a few hundred groups), so no kernel before this one has to build an item table.
    """
    sizes = sizes_ref[...]
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    tiles = (sizes + block_rows - 1) // block_rows
    item_end = jnp.cumsum(tiles)
    group = jnp.sum((item >= item_end).astype(jnp.int32))
    at_group = jnp.arange(sizes.shape[0], dtype=jnp.int32) == group
    pick = lambda v: jnp.sum(jnp.where(at_group, v, 0))
    start = pick(starts)
    first_row = start + (item - (pick(item_end) - pick(tiles))) * block_rows
    return item < jnp.sum(tiles), group, first_row, start, pick(ends)


def precision(dtype):
    """The dot's precision: full float32 for float32 operands (Triton would take TF32)."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def tiles(block: int, size: int) -> bool:
    """Whether ``size`` splits into Triton blocks of ``block``: a power of two >= 16 that divides it."""
    return block >= 16 and not block & (block - 1) and size % block == 0


def supports(depth: int, width: int, config: Config = Config()) -> bool:
    """Whether the product ``[N, depth] x [depth, width]``, its input gradient and its weight gradient tile with
    ``config``'s blocks (clipped to the matrix): sizes below 16 or off the power-of-two blocks do not."""
    return all(
        tiles(min(config.block_k, k), k) and tiles(min(config.block_cols, m), m)
        for k, m in ((depth, width), (width, depth))
    )


def check_blocks(**blocks_and_sizes) -> None:
    """``ValueError`` unless each ``name=(block, size)`` pair tiles (:func:`tiles`)."""
    for name, (block, size) in blocks_and_sizes.items():
        if not tiles(block, size):
            raise ValueError(
                f"matrix sizes must be multiples of power-of-two blocks >= 16 (Triton); got {name}={block} for {size}"
            )


def _gmm_kernel(x_ref, w_ref, sizes_ref, out_ref, **static):
    block_rows, block_k, block_cols = static["block_rows"], static["block_k"], static["block_cols"]
    depth, width, transpose = static["depth"], static["width"], static["transpose"]
    live, group, first_row, start, end = work_item(sizes_ref, pl.program_id(0), block_rows)
    col = pl.program_id(1)

    @pl.when(live)
    def _():
        rows = first_row + jnp.arange(block_rows, dtype=jnp.int32)
        mine = (rows >= start) & (rows < end)

        def step(k, acc):
            a = plgpu.load(
                x_ref.at[pl.ds(first_row, block_rows), pl.ds(k * block_k, block_k)],
                mask=jnp.broadcast_to(mine[:, None], (block_rows, block_k)),
                other=0,
            )
            if transpose:  # w [S, M, K] flattened to [S * M, K]: the tile [block_cols, block_k], used transposed
                b = w_ref[pl.ds(group * width + col * block_cols, block_cols), pl.ds(k * block_k, block_k)].T
            else:  # w [S, K, M] flattened to [S * K, M]
                b = w_ref[pl.ds(group * depth + k * block_k, block_k), pl.ds(col * block_cols, block_cols)]
            return acc + jnp.dot(a, b, preferred_element_type=jnp.float32, precision=static["precision"])

        acc = jax.lax.fori_loop(0, depth // block_k, step, jnp.zeros((block_rows, block_cols), jnp.float32))
        plgpu.store(
            out_ref.at[pl.ds(first_row, block_rows), pl.ds(col * block_cols, block_cols)],
            acc.astype(out_ref.dtype),
            mask=jnp.broadcast_to(mine[:, None], (block_rows, block_cols)),
        )


@functools.partial(jax.jit, static_argnames=("transpose_rhs", "config", "interpret"))
def grouped_matmul(x, w, group_sizes, *, transpose_rhs: bool = False, config: Config | None = None, interpret=False):
    """See the module docstring. ``K`` and ``M`` must be multiples of the (clipped, power-of-two) blocks."""
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[2 if transpose_rhs else 1]:
        raise ValueError(f"need x [N, K] and w [S, K, M] (transposed: [S, M, K]), got {x.shape} and {w.shape}")
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(f"group_sizes must have shape [S]=({w.shape[0]},), got {group_sizes.shape}")
    if x.dtype != w.dtype:
        raise ValueError(f"x and w must share a dtype, got {x.dtype} and {w.dtype}")
    num_rows, depth = x.shape
    width = w.shape[1] if transpose_rhs else w.shape[2]
    config = config or default_config(num_rows, width, w.shape[0])
    block_rows, block_k, block_cols = config.block_rows, min(config.block_k, depth), min(config.block_cols, width)
    check_blocks(block_k=(block_k, depth), block_cols=(block_cols, width), block_rows=(block_rows, block_rows))
    kernel = functools.partial(
        _gmm_kernel,
        block_rows=block_rows,
        block_k=block_k,
        block_cols=block_cols,
        depth=depth,
        width=width,
        transpose=transpose_rhs,
        precision=precision(x.dtype),
    )
    whole = pl.no_block_spec
    return pl.pallas_call(
        kernel,
        grid=(max_items(num_rows, w.shape[0], block_rows), width // block_cols),
        in_specs=[whole] * 3,
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((num_rows, width), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="grouped_matmul",
    )(x, w.reshape(-1, w.shape[2]), padded_sizes(group_sizes))


def _tgmm_kernel(x_ref, dy_ref, starts_ref, ends_ref, out_ref, *, block_rows, block_k, block_cols, depth, precision):
    group = pl.program_id(0)
    k_tile = pl.program_id(1)
    col = pl.program_id(2)
    start, end = starts_ref[group], ends_ref[group]

    def step(chunk, acc):
        first_row = start + chunk * block_rows
        rows = first_row + jnp.arange(block_rows, dtype=jnp.int32)
        mine = rows < end
        a = plgpu.load(
            x_ref.at[pl.ds(first_row, block_rows), pl.ds(k_tile * block_k, block_k)],
            mask=jnp.broadcast_to(mine[:, None], (block_rows, block_k)),
            other=0,
        )
        b = plgpu.load(
            dy_ref.at[pl.ds(first_row, block_rows), pl.ds(col * block_cols, block_cols)],
            mask=jnp.broadcast_to(mine[:, None], (block_rows, block_cols)),
            other=0,
        )
        return acc + jnp.dot(a.T, b, preferred_element_type=jnp.float32, precision=precision)

    chunks = (end - start + block_rows - 1) // block_rows
    acc = jax.lax.fori_loop(0, chunks, step, jnp.zeros((block_k, block_cols), jnp.float32))
    out_ref[pl.ds(group * depth + k_tile * block_k, block_k), pl.ds(col * block_cols, block_cols)] = acc


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def transposed_grouped_matmul(x, dy, group_sizes, *, config: Config = Config(), interpret: bool = False):
    """Per group ``x_s^T @ dy_s`` -> ``[S, K, M]`` float32 (zero for an empty group). Rows past the groups are read
    by no program."""
    if x.ndim != 2 or dy.ndim != 2 or x.shape[0] != dy.shape[0]:
        raise ValueError(f"need x [N, K] and dy [N, M] with the same N, got {x.shape} and {dy.shape}")
    if x.dtype != dy.dtype:
        raise ValueError(f"x and dy must share a dtype, got {x.dtype} and {dy.dtype}")
    if group_sizes.ndim != 1:
        raise ValueError(f"group_sizes must have shape [S], got {group_sizes.shape}")
    depth, width = x.shape[1], dy.shape[1]
    num_groups = group_sizes.shape[0]
    block_k, block_cols = min(config.block_k, depth), min(config.block_cols, width)
    check_blocks(block_k=(block_k, depth), block_cols=(block_cols, width))
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    starts = ends - group_sizes.astype(jnp.int32)
    kernel = functools.partial(
        _tgmm_kernel,
        block_rows=config.block_rows,
        block_k=block_k,
        block_cols=block_cols,
        depth=depth,
        precision=precision(x.dtype),
    )
    whole = pl.no_block_spec
    out = pl.pallas_call(
        kernel,
        grid=(num_groups, depth // block_k, width // block_cols),
        in_specs=[whole] * 4,
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((num_groups * depth, width), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="transposed_grouped_matmul",
    )(x, dy, starts, ends)
    return out.reshape(num_groups, depth, width)

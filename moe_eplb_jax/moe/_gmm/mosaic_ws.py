"""A warp-specialized grouped matmul for Hopper in Pallas Mosaic GPU: one warpgroup loads, two multiply.

``grouped_matmul(x [N, K], w [S, K, M], group_sizes [S]) -> [N, M]`` in ``x.dtype`` (float32 accumulation;
``transpose_rhs``: ``w [S, M, K]`` read transposed; float8_e4m3fn operands, both K-major as fp8 wgmma needs them,
with ``transpose_rhs`` only, into ``out_dtype`` times a per-group ``factor``). A persistent grid walks work items
-- a row tile of ``Config.block_m`` rows inside one group (a tile straddling two groups is an item of each) times a column band of
``2 * Config.block_n`` columns; a memory warpgroup streams the row tile and the group's weight band through
``max_concurrent_steps`` shared-memory stages while two compute warpgroups each multiply one half of the band
(wgmma), so loads and products overlap where JAX's ``ragged_dot_mgpu`` (one warpgroup) alternates them. Items
past the real rows -- a prefill's padding, the tiles an empty group would add -- do no work, and each item writes
only its own group's rows (TMA stores of power-of-two row counts), so padding rows are never written.

``transposed_grouped_matmul(x [N, K], dy [N, M], group_sizes [S]) -> [S, K, M]``, the weight gradient ``x_s^T dy_s``
per group: a work item is one group's ``block_m`` x ``2 * block_n`` output tile, the contraction its group's rows
in ``block_k``-row chunks (as many as the group spans); the chunks at the group's ends are shared with the next
groups, and each compute warpgroup zeroes the other groups' rows of its half of the ``dy`` chunk before it
multiplies (a select, not a product: no NaN passes). Rows past the groups must be finite (``x`` enters the
product unmasked); an empty group's tile is written as zeros.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

__all__ = ["Config", "grouped_matmul", "supports", "supports_transposed", "transposed_grouped_matmul"]

DTYPES = (jnp.bfloat16, jnp.float16)
FP8 = jnp.float8_e4m3fn
H100_SMS = 132


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Tiling: ``block_m`` rows by ``2 * block_n`` columns per work item (``block_n`` per compute warpgroup), the
    contraction in ``block_k`` chunks through ``max_concurrent_steps`` stages, ``grid_tile_width`` column bands per
    row stripe of the snake order."""

    block_m: int = 128
    block_n: int = 64
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_tile_width: int = 4

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Config.{field.name} must be a positive int, got {value!r}")


def supports(x_shape, w_shape, dtype, *, transpose_rhs: bool = False, config: Config = Config()) -> bool:
    """Whether the kernel takes this product: 16-bit floats (or e4m3 with ``transpose_rhs``), the contraction a
    multiple of ``block_k`` and the output width of ``2 * block_n``."""
    fp8 = jnp.dtype(dtype) == jnp.dtype(FP8) and transpose_rhs
    if not (fp8 or jnp.dtype(dtype) in [jnp.dtype(d) for d in DTYPES]) or len(x_shape) != 2 or len(w_shape) != 3:
        return False
    depth, width = (w_shape[2], w_shape[1]) if transpose_rhs else (w_shape[1], w_shape[2])
    return x_shape[1] == depth and depth % config.block_k == 0 and width % (2 * config.block_n) == 0


def _num_sms() -> int:
    """The persistent grid's size: the card's SM count (an H100's where no GPU is attached, for lowering on a CPU)."""
    device = jax.devices()[0]
    return device.core_count if device.platform == "gpu" else H100_SMS


def _item_rows(sizes_ref, num_groups: int, row_tile, block_m: int):
    """``(group, first_row, start, size)`` of the work item in row-tile slot ``row_tile``: its group, the first row of
    its tile and the rows of the group inside the tile (``size`` 0: no such item). Items are numbered group by
    group, each group taking the tiles its rows touch."""

    def visit(group, carry):
        end_before, items_before, found = carry
        size = sizes_ref[group]
        start, end = end_before, end_before + size
        first_tile = lax.div(start, jnp.int32(block_m))
        tiles = jnp.where(size > 0, lax.div(end - 1, jnp.int32(block_m)) - first_tile + 1, 0)
        mine = (row_tile >= items_before) & (row_tile < items_before + tiles)
        tile = first_tile + row_tile - items_before
        lo = jnp.maximum(start, tile * block_m)
        hi = jnp.minimum(end, (tile + 1) * block_m)
        picked = (group, tile * block_m, lo, hi - lo)
        found = tuple(jnp.where(mine, new, old) for new, old in zip(picked, found))
        return end, items_before + tiles, found

    zero = jnp.int32(0)
    _, _, found = lax.fori_loop(0, num_groups, visit, (zero, zero, (zero, zero, zero, zero)))
    return found


def _swizzled(minor: int, dtype):
    """The shared-memory transforms of a block whose rows hold ``minor`` elements of ``dtype``: 8-row tiles, the
    widest swizzle those rows allow (what TMA and wgmma read without bank conflicts)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor * itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))  # pyright: ignore[reportAbstractUsage]


def _kernel(sizes_ref, factor_ref, x_ref, w_ref, out_ref, *, config, transpose_rhs, num_row_tiles, scaled):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    num_rows, depth = x_ref.shape
    num_groups = w_ref.shape[0]
    # Hopper's fp8 wgmma accumulates with about 14 bits of mantissa: each block_k chunk's product goes to a fresh
    # accumulator and is added in float32, as DeepSeek-V3 promotes its FP8 GEMMs.
    promote = x_ref.dtype == FP8
    width = w_ref.shape[1] if transpose_rhs else w_ref.shape[2]
    block_m, block_n, block_k = config.block_m, config.block_n, config.block_k
    band = 2 * block_n
    num_bands = width // band
    tiled = _swizzled(block_k, x_ref.dtype)
    w_block, w_index = ((band, block_k), lambda k: (0, k)) if transpose_rhs else ((block_k, band), lambda k: (k, 0))

    def pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(depth // block_k,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((block_m, block_k), lambda k: (0, k), transforms=tiled, memory_space=plgpu.SMEM),
                plgpu.BlockSpec(w_block, w_index, transforms=tiled, memory_space=plgpu.SMEM),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=config.max_concurrent_steps,
            compute_context=compute_context,
        )

    nothing = lambda *_, **__: None
    row_view = x_ref.at[pl.ds(0, block_m), :]
    w_view = w_ref.at[0, :, pl.ds(0, band)] if not transpose_rhs else w_ref.at[0, pl.ds(0, band), :]

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(nothing, nothing).get_allocations(row_view, w_view),
        out_smem=plgpu.SMEM((2, block_m, block_n), out_ref.dtype),
        collective_axes="wg",
    )
    def _scope(allocations, out_smem):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((num_row_tiles * num_bands,), collective_axes="sm")
        def _items(loop):
            row_tile, band_index = plgpu.planar_snake(
                loop.index[0], (num_row_tiles, num_bands), 1, config.grid_tile_width
            )
            group, first_row, start, size = _item_rows(sizes_ref, num_groups, row_tile, block_m)
            first_row = pl.multiple_of(first_row, block_m)
            columns = pl.ds(band_index * band, band)
            own_columns = pl.ds(band_index * band + wg * block_n, block_n)

            def epilogue(values):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # this buffer's previous stores have read it
                out_smem[wg] = (values * factor_ref[group] if scaled else values).astype(out_ref.dtype)
                plgpu.commit_smem()
                offset = start - first_row
                rows = min(block_m, num_rows)
                while rows:  # the item's rows as TMA stores of power-of-two row counts, largest first

                    @pl.when(size & rows != 0)
                    def _store(rows=rows, offset=offset):
                        plgpu.copy_smem_to_gmem(
                            out_smem.at[wg, pl.ds(offset, rows)],
                            out_ref.at[pl.ds(first_row + offset, rows), own_columns],
                        )

                    offset = offset + (size & rows)
                    rows //= 2

            def compute_context(run_pipeline):
                if promote:  # the float32 sum lives in registers; each chunk's product in an accumulator of its own
                    zeros = jnp.zeros((block_m, block_n), jnp.float32)
                    epilogue(run_pipeline(plgpu.layout_cast(zeros, plgpu.Layout.WGMMA)))
                    return
                accumulator = plgpu.ACC((block_m, block_n), jnp.float32)  # pyright: ignore[reportPrivateImportUsage]

                @functools.partial(pl.run_scoped, acc=accumulator)
                def _acc(acc):
                    run_pipeline(acc)
                    epilogue(acc[...])

            def multiply(_, x_smem, w_smem, acc):
                half = pl.ds(wg * block_n, block_n)
                rhs = w_smem.at[half, :].transpose((1, 0)) if transpose_rhs else w_smem.at[:, half]
                if promote:

                    def product(part):
                        plgpu.wgmma(part, x_smem, rhs)
                        plgpu.wgmma_wait(0)
                        return part[...]

                    fresh = plgpu.ACC((block_m, block_n), jnp.float32)  # pyright: ignore[reportPrivateImportUsage]
                    return acc + pl.run_scoped(product, fresh)
                plgpu.wgmma(acc, x_smem, rhs)
                plgpu.wgmma_wait(0)
                return acc

            @pl.when(size > 0)
            def _run():
                weights = w_ref.at[group, columns, :] if transpose_rhs else w_ref.at[group, :, columns]
                pipeline(multiply, compute_context)(
                    x_ref.at[pl.ds(first_row, block_m), :], weights, allocations=allocations
                )

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def grouped_matmul(
    x, w, group_sizes, *, transpose_rhs: bool = False, factor=None, out_dtype=None, config: Config = Config()
):
    """See the module docstring. ``K`` and ``M`` must tile (:func:`supports`); ``N`` off a multiple of ``block_m``
    costs a padded copy of ``x``. ``factor [S]`` (float32) multiplies each group's float32 result before it is
    cast to ``out_dtype`` (default ``x.dtype``; e4m3 operands need one: float32, bfloat16 or float16)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if not supports(x.shape, w.shape, x.dtype, transpose_rhs=transpose_rhs, config=config) or x.dtype != w.dtype:
        raise ValueError(
            f"mosaic_ws takes 16-bit (or, transposed, e4m3) x [N, K] and w [S, K, M] that tile {config}; "
            f"got {x.dtype}{x.shape}, {w.dtype}{w.shape}"
        )
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(f"group_sizes must have shape [S]=({w.shape[0]},), got {group_sizes.shape}")
    if factor is not None and factor.shape != (w.shape[0],):
        raise ValueError(f"factor must have shape [S]=({w.shape[0]},), got {factor.shape}")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if out_dtype not in [jnp.dtype(d) for d in (jnp.float32, *DTYPES)]:
        raise ValueError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    num_rows = x.shape[0]
    if num_rows % config.block_m:  # every row tile's load inside the array
        x = jnp.pad(x, ((0, -num_rows % config.block_m), (0, 0)))
    width = w.shape[1] if transpose_rhs else w.shape[2]
    kernel = plgpu.kernel(
        functools.partial(
            _kernel,
            config=config,
            transpose_rhs=transpose_rhs,
            num_row_tiles=pl.cdiv(x.shape[0], config.block_m) + w.shape[0] - 1,
            scaled=factor is not None,
        ),
        out_type=jax.ShapeDtypeStruct((x.shape[0], width), out_dtype),
        grid=(_num_sms(),),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        kernel_name="grouped_matmul_ws_transposed" if transpose_rhs else "grouped_matmul_ws",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    factor = jnp.ones((w.shape[0],), jnp.float32) if factor is None else factor.astype(jnp.float32)
    return kernel(group_sizes.astype(jnp.int32), factor, x, w)[:num_rows]


def supports_transposed(x_shape, dy_shape, dtype, *, config: Config = Config()) -> bool:
    """Whether :func:`transposed_grouped_matmul` takes ``x [N, K]`` and ``dy [N, M]``: 16-bit floats, ``K`` a
    multiple of ``block_m`` and ``M`` of ``2 * block_n``."""
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES] or len(x_shape) != 2 or len(dy_shape) != 2:
        return False
    return x_shape[0] == dy_shape[0] and x_shape[1] % config.block_m == 0 and dy_shape[1] % (2 * config.block_n) == 0


def _transposed_kernel(
    sizes_ref, starts_ref, x_ref, dy_ref, out_ref, *, config: Config, num_groups: int, num_out_tiles: int
):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    depth, width = x_ref.shape[1], dy_ref.shape[1]
    block_m, block_n, block_k = config.block_m, config.block_n, config.block_k
    band = 2 * block_n
    num_bands = width // band
    tiled, dy_tiled = _swizzled(block_m, x_ref.dtype), _swizzled(block_n, dy_ref.dtype)

    def pipeline(body, compute_context, num_steps):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(num_steps,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((block_k, block_m), lambda r: (r, 0), transforms=tiled, memory_space=plgpu.SMEM),
                plgpu.BlockSpec((block_k, band), lambda r: (r, 0), transforms=dy_tiled, memory_space=plgpu.SMEM),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=config.max_concurrent_steps,
            compute_context=compute_context,
        )

    nothing = lambda *_, **__: None
    x_view = x_ref.at[pl.ds(0, block_k), pl.ds(0, block_m)]
    dy_view = dy_ref.at[pl.ds(0, block_k), pl.ds(0, band)]

    @functools.partial(
        pl.run_scoped,
        # A static grid as long as the stages: the allocations hold every stage's buffers, as the dynamic
        # pipelines below use them (a shorter static grid would clip the stages to its length).
        allocations=pipeline(nothing, nothing, config.max_concurrent_steps).get_allocations(x_view, dy_view),
        out_smem=plgpu.SMEM((2, block_m, block_n), out_ref.dtype),
        collective_axes="wg",
    )
    def _scope(allocations, out_smem):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((num_groups * num_out_tiles,), collective_axes="sm")
        def _items(loop):
            group = lax.div(loop.index[0], jnp.int32(num_out_tiles))
            tile, band_index = plgpu.planar_snake(
                lax.rem(loop.index[0], jnp.int32(num_out_tiles)),
                (depth // block_m, num_bands),
                1,
                config.grid_tile_width,
            )
            start, size = starts_ref[group], sizes_ref[group]
            first_chunk = lax.div(start, jnp.int32(block_k))
            num_chunks = lax.div(start + size + block_k - 1, jnp.int32(block_k)) - first_chunk
            own_columns = pl.ds(band_index * band + wg * block_n, block_n)

            def store(values):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # this buffer's previous store has read it
                out_smem[wg] = values.astype(out_ref.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem.at[wg], out_ref.at[group, pl.ds(tile * block_m, block_m), own_columns])

            def compute_context(run_pipeline):
                accumulator = plgpu.ACC((block_m, block_n), jnp.float32)  # pyright: ignore[reportPrivateImportUsage]

                @functools.partial(pl.run_scoped, acc=accumulator)
                def _acc(acc):
                    run_pipeline(acc)
                    store(acc[...])

            def multiply(index, x_smem, dy_smem, acc):
                chunk = index[0]
                dy_half = dy_smem.at[:, pl.ds(wg * block_n, block_n)]

                @pl.when((chunk == 0) | (chunk == num_chunks - 1))
                def _mask():  # the chunk holds other groups' rows: zero them in this warpgroup's half
                    rows = (first_chunk + chunk) * block_k + plgpu.layout_cast(
                        lax.broadcasted_iota(jnp.int32, (block_k, block_n), 0), plgpu.Layout.WGMMA
                    )
                    mine = (rows >= start) & (rows < start + size)
                    dy_half[...] = jnp.where(mine, dy_half[...], jnp.zeros((), dy_ref.dtype))
                    plgpu.commit_smem()

                plgpu.wgmma(acc, x_smem.transpose((1, 0)), dy_half)
                plgpu.wgmma_wait(0)
                return acc

            @pl.when(size > 0)
            def _run():
                # A static length past the array's end for later groups: the pipeline loads only its num_chunks chunks.
                rows = pl.ds(pl.multiple_of(first_chunk * block_k, block_k), x_ref.shape[0])
                pipeline(multiply, compute_context, num_chunks)(
                    x_ref.at[rows, pl.ds(tile * block_m, block_m)],
                    dy_ref.at[rows, pl.ds(band_index * band, band)],
                    allocations=allocations,
                )

            @pl.when((size == 0) & (wg < 2))
            def _empty():
                store(plgpu.layout_cast(jnp.zeros((block_m, block_n), jnp.float32), plgpu.Layout.WGMMA))

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def transposed_grouped_matmul(x, dy, group_sizes, *, config: Config = Config()):
    """See the module docstring: ``[S, K, M]`` in ``x.dtype``. ``K`` and ``M`` must tile
    (:func:`supports_transposed`); ``N`` off a multiple of ``block_k`` costs padded copies of ``x`` and ``dy``."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if not supports_transposed(x.shape, dy.shape, x.dtype, config=config) or x.dtype != dy.dtype:
        raise ValueError(f"mosaic_ws takes 16-bit x [N, K] and dy [N, M] that tile {config}; got {x.shape}, {dy.shape}")
    if group_sizes.ndim != 1:
        raise ValueError(f"group_sizes must have shape [S], got {group_sizes.shape}")
    num_groups = group_sizes.shape[0]
    if x.shape[0] % config.block_k:  # every chunk's load inside the arrays
        pad = ((0, -x.shape[0] % config.block_k), (0, 0))
        x, dy = jnp.pad(x, pad), jnp.pad(dy, pad)
    sizes = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    depth, width = x.shape[1], dy.shape[1]
    kernel = plgpu.kernel(
        functools.partial(
            _transposed_kernel,
            config=config,
            num_groups=num_groups,
            num_out_tiles=(depth // config.block_m) * (width // (2 * config.block_n)),
        ),
        out_type=jax.ShapeDtypeStruct((num_groups, depth, width), x.dtype),
        grid=(_num_sms(),),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        kernel_name="transposed_grouped_matmul_ws",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return kernel(sizes, starts, x, dy)

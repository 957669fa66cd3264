"""The expert MLP's first half in one Triton kernel: gathered rows, the gate and up products, SwiGLU.

``swiglu_matmul(x [T, K], w_in [S, K, 2H], group_sizes [S], row_tokens [N]) -> [N, H]``: row ``i`` is token
``row_tokens[i]`` of ``x`` (``row_tokens=None``: row ``i`` of ``x``), the rows grouped as
``triton.grouped_matmul`` groups them; each row leaves as ``silu(x_i @ gate_s) * (x_i @ up_s)`` with
``gate_s = w_in[s, :, :H]`` and ``up_s = w_in[s, :, H:]``.

Why one kernel: unfused, the MoE layer writes the gathered rows ``[N, K]``, reads them back, writes the gate and
up products ``[N, 2H]`` and reads them again for the SwiGLU -- passes over the largest buffers of a prefill's
MoE layer, and two kernels per layer at decode (``docs/kernels.md``). Here the rows are read from the tokens in place, both products share
each loaded row tile, and only the activation ``[N, H]`` is written. The work items are
``triton.grouped_matmul``'s: cost follows the rows received, padding rows are never written, and every row runs
the same instruction sequence (placement-invariant).

The gate and up products are rounded to ``x.dtype`` before the SwiGLU, as the two-kernel path rounds them, and
the SwiGLU runs in float32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_eplb_jax.moe._gmm import triton

__all__ = ["default_config", "supports", "swiglu_matmul"]


def _blocks(config: triton.Config, depth: int, hidden: int) -> tuple[int, int]:
    """``(block_k, block_cols)`` clipped to the matrix; ``Config.block_cols`` counts both products' columns, so
    each accumulator holds half of them."""
    return min(config.block_k, depth), min(max(16, config.block_cols // 2), hidden)


def default_config(num_rows: int, hidden: int, num_groups: int) -> triton.Config:
    """``triton.default_config`` for the two products' ``2 * hidden`` columns, four stages deep with its
    training-size 128 x 256 tiles; from one to four rows per group (decode at batch 8-32 for top-8 of 64) 16-row
    tiles 128 columns wide per product, 64 deep and four stages (the measured tilings: ``docs/kernels.md``)."""
    if num_groups < num_rows <= 4 * num_groups:
        return triton.Config(block_rows=16, block_k=64, block_cols=256, num_warps=4, num_stages=4)
    config = triton.default_config(num_rows, 2 * hidden, num_groups)
    return dataclasses.replace(config, num_stages=4) if config.block_rows == 128 else config


def supports(num_rows: int, depth: int, hidden: int, num_groups: int) -> bool:
    """Whether ``swiglu_matmul`` tiles ``num_rows`` rows of ``depth`` into ``2 * hidden`` columns over ``num_groups``
    groups with its default tiling."""
    block_k, block_cols = _blocks(default_config(num_rows, hidden, num_groups), depth, hidden)
    return triton.tiles(block_k, depth) and triton.tiles(block_cols, hidden)


def _swiglu_kernel(x_ref, w_ref, sizes_ref, tokens_ref, out_ref, **static):
    block_rows, block_k, block_cols = static["block_rows"], static["block_k"], static["block_cols"]
    depth, hidden = static["depth"], static["hidden"]
    live, group, first_row, start, end = triton.work_item(sizes_ref, pl.program_id(0), block_rows)
    col = pl.program_id(1)

    @pl.when(live)
    def _():
        rows = first_row + jnp.arange(block_rows, dtype=jnp.int32)
        mine = (rows >= start) & (rows < end)
        mask = jnp.broadcast_to(mine[:, None], (block_rows, block_k))
        if static["gather"]:  # x flattened: one index array per tile, which both Triton and the interpreter take
            source = plgpu.load(tokens_ref.at[pl.ds(first_row, block_rows)], mask=mine, other=0)
            source = source[:, None] * depth + jnp.arange(block_k, dtype=jnp.int32)[None, :]

        def step(k, accs):
            if static["gather"]:
                a = plgpu.load(x_ref.at[source + k * block_k], mask=mask, other=0)
            else:
                a = plgpu.load(x_ref.at[pl.ds(first_row, block_rows), pl.ds(k * block_k, block_k)], mask=mask, other=0)
            weight_rows = pl.ds(group * depth + k * block_k, block_k)
            gate = w_ref[weight_rows, pl.ds(col * block_cols, block_cols)]
            up = w_ref[weight_rows, pl.ds(hidden + col * block_cols, block_cols)]
            dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=static["precision"])
            return accs[0] + dot(a, gate), accs[1] + dot(a, up)

        zeros = jnp.zeros((block_rows, block_cols), jnp.float32)
        gate, up = jax.lax.fori_loop(0, depth // block_k, step, (zeros, zeros))
        gate = gate.astype(out_ref.dtype).astype(jnp.float32)
        up = up.astype(out_ref.dtype).astype(jnp.float32)
        act = gate * jax.nn.sigmoid(gate) * up
        plgpu.store(
            out_ref.at[pl.ds(first_row, block_rows), pl.ds(col * block_cols, block_cols)],
            act.astype(out_ref.dtype),
            mask=jnp.broadcast_to(mine[:, None], (block_rows, block_cols)),
        )


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def swiglu_matmul(x, w_in, group_sizes, row_tokens=None, *, config: triton.Config | None = None, interpret=False):
    """See the module docstring. ``row_tokens``: ``[N]`` int32 token of each row (``None``: ``N = T``, row ``i`` is
    ``x[i]``); entries of padding rows are never read. ``K`` and ``H`` must be multiples of the (clipped,
    power-of-two) blocks. Returns ``[N, H]`` in ``x.dtype``, padding rows unwritten."""
    if x.ndim != 2 or w_in.ndim != 3 or x.shape[1] != w_in.shape[1] or w_in.shape[2] % 2:
        raise ValueError(f"need x [T, K] and w_in [S, K, 2H] with the same K, got {x.shape} and {w_in.shape}")
    if group_sizes.shape != (w_in.shape[0],):
        raise ValueError(f"group_sizes must have shape [S]=({w_in.shape[0]},), got {group_sizes.shape}")
    if x.dtype != w_in.dtype:
        raise ValueError(f"x and w_in must share a dtype, got {x.dtype} and {w_in.dtype}")
    if row_tokens is not None and row_tokens.ndim != 1:
        raise ValueError(f"row_tokens must have shape [N], got {row_tokens.shape}")
    num_rows = x.shape[0] if row_tokens is None else row_tokens.shape[0]
    depth, hidden = x.shape[1], w_in.shape[2] // 2
    config = config or default_config(num_rows, hidden, w_in.shape[0])
    block_k, block_cols = _blocks(config, depth, hidden)
    triton.check_blocks(block_k=(block_k, depth), block_cols=(block_cols, hidden))
    gather = row_tokens is not None
    if gather and x.size >= 2**31:
        raise ValueError(f"x must have fewer than 2**31 elements to gather rows from it, got {x.shape}")
    kernel = functools.partial(
        _swiglu_kernel,
        block_rows=config.block_rows,
        block_k=block_k,
        block_cols=block_cols,
        depth=depth,
        hidden=hidden,
        gather=gather,
        precision=triton.precision(x.dtype),
    )
    tokens = row_tokens.astype(jnp.int32) if gather else jnp.zeros((1,), jnp.int32)
    whole = pl.no_block_spec
    return pl.pallas_call(
        kernel,
        grid=(triton.max_items(num_rows, w_in.shape[0], config.block_rows), hidden // block_cols),
        in_specs=[whole] * 4,
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((num_rows, hidden), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="swiglu_matmul",
    )(x.reshape(-1) if gather else x, w_in.reshape(-1, w_in.shape[2]), triton.padded_sizes(group_sizes), tokens)

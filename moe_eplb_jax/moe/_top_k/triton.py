"""The router's top-k experts and their weights at decode sizes, in one Pallas (Triton) kernel.

``top_k_take(choice [T, E], taken [T, E], k) -> (ids [T, k] int32, taken_at [T, k])``: ``ids`` is
``jax.lax.top_k(choice, k)[1]`` -- the largest first in IEEE total order (``-NaN < -inf < -0 < +0 < inf < NaN``),
ties to the lower index -- and ``taken_at`` is ``take_along_axis(taken, ids)``, bit for bit. Optionally, as the
router goes on: ``renormalize`` divides each row's values by their sum (added in place order) plus ``1e-20``,
``scale`` multiplies them, and ``valid [T]`` turns the ids of the rows it marks false into ``-1``. The XLA form
(``moe._ranks``' counted top-k, the gather, the sum, the mask) is four or five kernels in every MoE layer of a
decode step; here a program holds ``Config.block_rows`` rows of both in registers and picks the ``k`` places in
``k`` rounds (the largest key still free, the lowest index among equals): one launch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_eplb_jax._checks import check_powers_of_two
from moe_eplb_jax._kernels import join_varying, traced_zero
from moe_eplb_jax.moe._ranks import ordered_keys

__all__ = ["MAX_WIDTH", "Config", "applies", "probe", "top_k_take"]

MAX_WIDTH = 1024  # a row of keys in one program's registers
_INT32_MIN = np.iinfo(np.int32).min


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Tiling: ``block_rows`` rows per program on ``num_warps`` warps (powers of two). Each of the ``k`` rounds waits
    on three row reductions, so more programs of fewer rows finish sooner (``benchmarks/RESULTS.md``)."""

    block_rows: int = 16
    num_warps: int = 4

    def __post_init__(self):
        check_powers_of_two(self)


def applies(shape, k: int, choice_dtype, taken_dtype) -> bool:
    """Whether the kernel takes ``[T, E]`` float32 choices and 32-bit scores for ``1 <= k <= E <= MAX_WIDTH``."""
    if len(shape) != 2 or jnp.dtype(choice_dtype) != jnp.float32 or jnp.dtype(taken_dtype).itemsize != 4:
        return False
    return shape[0] >= 1 and 1 <= k <= shape[1] <= MAX_WIDTH


def _kernel(choice_ref, taken_ref, valid_ref, ids_ref, out_ref, **static):
    num_rows, width, padded, block_rows, k = (static[n] for n in ("num_rows", "width", "padded", "block_rows", "k"))
    first = pl.program_id(0) * block_rows
    first_col = traced_zero()  # the masked columns past the width lie outside the arrays
    rows = first + jnp.arange(block_rows, dtype=jnp.int32)
    cols = jnp.arange(padded, dtype=jnp.int32)
    live = (rows < num_rows)[:, None] & (cols < width)[None, :]
    window = (pl.ds(first, block_rows), pl.ds(first_col, padded))
    keys = ordered_keys(plgpu.load(choice_ref.at[window], mask=live, other=0))  # lax.top_k's order, as int32
    taken = plgpu.load(taken_ref.at[window], mask=live, other=0)
    places = jnp.arange(static["places"], dtype=jnp.int32)[None, :]
    ids = jnp.zeros((block_rows, static["places"]), jnp.int32)
    words = jnp.zeros((block_rows, static["places"]), jnp.int32)
    total = jnp.zeros((block_rows,), jnp.float32)
    free = live
    for place in range(k):
        best = jnp.max(jnp.where(free, keys, jnp.int32(_INT32_MIN)), axis=1)
        index = jnp.min(jnp.where(free & (keys == best[:, None]), cols, jnp.int32(padded)), axis=1)
        picked = cols[None, :] == index[:, None]
        word = jnp.sum(jnp.where(picked, taken, 0), axis=1)  # the one picked word: an exact copy of its bits
        ids = jnp.where(places == place, index[:, None], ids)
        words = jnp.where(places == place, word[:, None], words)
        if static["renormalize"]:
            total = total + jax.lax.bitcast_convert_type(word, jnp.float32)  # in place order
        free = free & ~picked
    out = words
    if static["renormalize"] or static["scale"] != 1.0:
        values = jax.lax.bitcast_convert_type(words, jnp.float32)
        if static["renormalize"]:
            values = values / (total + jnp.float32(1e-20))[:, None]
        if static["scale"] != 1.0:
            values = values * jnp.float32(static["scale"])
        out = jax.lax.bitcast_convert_type(values, jnp.int32)
    row_live = rows < num_rows
    valid = plgpu.load(valid_ref.at[pl.ds(first, block_rows)], mask=row_live, other=0)
    ids = jnp.where((valid != 0)[:, None], ids, jnp.int32(-1))
    stored = row_live[:, None] & (places < k)
    plgpu.store(ids_ref.at[pl.ds(first, block_rows), pl.ds(first_col, static["places"])], ids, mask=stored)
    plgpu.store(out_ref.at[pl.ds(first, block_rows), pl.ds(first_col, static["places"])], out, mask=stored)


@functools.partial(jax.jit, static_argnames=("k", "renormalize", "scale", "config", "interpret"))
def top_k_take(
    choice,
    taken,
    k: int,
    *,
    valid=None,
    renormalize: bool = False,
    scale: float = 1.0,
    config: Config = Config(),
    interpret: bool = False,
):
    """See the module docstring. ``choice [T, E]`` float32, ``taken [T, E]`` a 32-bit type (float32 with
    ``renormalize`` or ``scale``), ``valid [T]`` bool or ``None``; ``applies`` must hold."""
    if choice.shape != taken.shape or not applies(choice.shape, k, choice.dtype, taken.dtype):
        raise ValueError(
            f"top_k_take takes float32 choices and 32-bit scores of one shape [T, E <= {MAX_WIDTH}] and "
            f"1 <= k <= E, got {choice.dtype} {choice.shape}, {taken.dtype} {taken.shape}, k={k}"
        )
    if (renormalize or scale != 1.0) and taken.dtype != jnp.float32:
        raise ValueError(f"top_k_take renormalizes and scales float32 values only, got {taken.dtype}")
    num_rows, width = choice.shape
    if valid is not None and valid.shape != (num_rows,):
        raise ValueError(f"valid must have shape [{num_rows}], got {valid.shape}")
    valid = jnp.ones((num_rows,), jnp.int32) if valid is None else valid.astype(jnp.int32)
    padded = max(16, pl.next_power_of_2(width))
    block_rows = min(config.block_rows, max(16, pl.next_power_of_2(num_rows)))
    as_int = lambda a: jax.lax.bitcast_convert_type(a, jnp.int32)
    (choice, words, valid), out_struct = join_varying(choice, as_int(taken), valid)
    kernel = functools.partial(
        _kernel,
        num_rows=num_rows,
        width=width,
        padded=padded,
        block_rows=block_rows,
        k=k,
        places=max(16, pl.next_power_of_2(k)),
        renormalize=renormalize,
        scale=float(scale),
    )
    ids, values = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_rows, block_rows),),
        in_specs=[pl.no_block_spec] * 3,
        out_specs=[pl.no_block_spec] * 2,
        out_shape=[out_struct((num_rows, k), jnp.int32)] * 2,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps),
        interpret=interpret,
        name="top_k_take",
    )(choice, words, valid)
    return ids, jax.lax.bitcast_convert_type(values, taken.dtype)


def probe() -> bool:
    """Whether the kernel compiles here and equals ``lax.top_k`` and the gather on a small case (outside a trace)."""
    rng = np.random.default_rng(0)
    choice = rng.standard_normal((40, 24)).astype(np.float32)
    choice[3, :5] = choice[3, 5]  # ties
    taken = rng.standard_normal((40, 24)).astype(np.float32)
    spec = jax.ShapeDtypeStruct(choice.shape, jnp.float32)
    call = jax.jit(functools.partial(top_k_take, k=6)).lower(spec, spec).compile()
    ids, values = (np.asarray(a) for a in call(choice, taken))
    want = np.asarray(jax.lax.top_k(choice, 6)[1])
    return bool((ids == want).all() and (values == np.take_along_axis(taken, want, axis=1)).all())

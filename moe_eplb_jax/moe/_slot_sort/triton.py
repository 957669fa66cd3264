"""A stable sort of one rank's assignments by slot at decode sizes, in one Pallas (Triton) kernel.

``slot_sort(physical [N], num_slots, top_k) -> (order [N], inverse [N], tokens [N])``: ``order`` is
``jnp.argsort(key, stable=True)`` of ``key = physical`` with ``-1`` (sent nowhere) as ``num_slots`` -- the
assignments of slot 0, then slot 1, ..., the unsent last --, ``inverse`` its inverse permutation and ``tokens``
``order // top_k``, each row's token. The XLA form (``moe._ranks``, counted where the pairs are few) is four or
five kernels of a microsecond or two in every MoE layer of a decode step; here each entry's place is the count of
the entries before it in the order, one program per ``Config.block`` entries, and the three outputs are stored
from it (``order`` and ``tokens`` scattered to the place): one launch.

An entry's key and index pack into one int32, ``key * n + index`` (``n`` the entries padded to a power of two),
so the stable order is the order of the packed values and a place is one comparison per pair.
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
from moe_eplb_jax._kernels import join_varying

__all__ = ["MAX_ENTRIES", "Config", "applies", "probe", "slot_sort"]

MAX_ENTRIES = 2048  # past it the pairs outgrow a decode step's sort: XLA's sort serves (moe._ranks.MAX_PAIRS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Tiling: ``block`` entries placed per program, compared with ``chunk`` entries per loop step, on
    ``num_warps`` warps (powers of two). Small blocks spread the pairs over many programs: at 2,048 entries 64
    programs of 16 steps, where 256-entry blocks would leave 8 programs of 64 steps on a card of 132 SMs."""

    block: int = 32
    chunk: int = 128
    num_warps: int = 4

    def __post_init__(self):
        check_powers_of_two(self)


def _padded(num_entries: int) -> int:
    return max(32, pl.next_power_of_2(num_entries))


def applies(num_entries: int, num_slots: int) -> bool:
    """Whether the kernel takes ``num_entries`` assignments over ``num_slots`` slots: at most ``MAX_ENTRIES``, and
    every packed ``key * n + index`` (keys up to ``num_slots + 1``) inside int32."""
    padded = _padded(max(num_entries, 1))
    return 0 < num_entries <= MAX_ENTRIES and (num_slots + 2) * padded <= np.iinfo(np.int32).max


def _kernel(physical_ref, order_ref, inverse_ref, tokens_ref, *, num_entries, num_slots, padded, block, chunk, top_k):
    def packed_keys(first, size):
        """Entries ``[first, first + size)`` packed: unsent ones keyed ``num_slots``, padding ``num_slots + 1``."""
        index = first + jnp.arange(size, dtype=jnp.int32)
        slot = plgpu.load(physical_ref.at[pl.ds(first, size)], mask=index < num_entries, other=num_slots + 1)
        return jnp.where(slot < 0, jnp.int32(num_slots), slot) * padded + index, index

    mine, index = packed_keys(pl.program_id(0) * block, block)

    def count(step, place):
        others, _ = packed_keys(step * chunk, chunk)
        return place + jnp.sum((others[None, :] < mine[:, None]).astype(jnp.int32), axis=1)

    place = jax.lax.fori_loop(0, padded // chunk, count, jnp.zeros((block,), jnp.int32))
    real = index < num_entries  # padding entries sort last: their places are past the real ones
    plgpu.store(inverse_ref.at[pl.ds(pl.program_id(0) * block, block)], place, mask=real)
    plgpu.store(order_ref.at[place], index, mask=real)
    plgpu.store(tokens_ref.at[place], index // top_k, mask=real)


@functools.partial(jax.jit, static_argnames=("num_slots", "top_k", "config", "interpret"))
def slot_sort(physical, num_slots: int, top_k: int, *, config: Config = Config(), interpret: bool = False):
    """See the module docstring. ``physical [N]`` int32 slots in ``[0, num_slots)`` or ``-1``; ``applies(N,
    num_slots)`` must hold."""
    (num_entries,) = physical.shape
    if not applies(num_entries, num_slots):
        raise ValueError(
            f"slot_sort takes 1 to {MAX_ENTRIES} entries over slots that pack into int32, got {num_entries}"
        )
    padded = _padded(num_entries)
    block, chunk = min(config.block, padded), min(config.chunk, padded)
    (physical,), out_struct = join_varying(physical.astype(jnp.int32))
    kernel = functools.partial(
        _kernel,
        num_entries=num_entries,
        num_slots=num_slots,
        padded=padded,
        block=block,
        chunk=chunk,
        top_k=top_k,
    )
    return tuple(
        pl.pallas_call(
            kernel,
            grid=(padded // block,),
            in_specs=[pl.no_block_spec],
            out_specs=[pl.no_block_spec] * 3,
            out_shape=[out_struct((num_entries,), jnp.int32)] * 3,
            compiler_params=plgpu.CompilerParams(num_warps=config.num_warps),
            interpret=interpret,
            name="slot_sort",
        )(physical)
    )


def probe() -> bool:
    """Whether the kernel compiles here and sorts a small case as ``argsort`` does (outside any trace)."""
    physical = np.random.default_rng(0).integers(-1, 12, 300).astype(np.int32)
    spec = jax.ShapeDtypeStruct(physical.shape, jnp.int32)
    call = jax.jit(functools.partial(slot_sort, num_slots=12, top_k=4)).lower(spec).compile()
    order, inverse, tokens = (np.asarray(a) for a in call(physical))
    want = np.argsort(np.where(physical < 0, 12, physical), kind="stable")
    return bool((order == want).all() and (inverse[want] == np.arange(300)).all() and (tokens == want // 4).all())

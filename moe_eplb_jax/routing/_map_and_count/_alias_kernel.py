"""The Pallas kernel that builds mode ``"lp"``'s packed alias table per call: one program per expert.

``alias_kernel(values [E, S], log2phy [E, S], logcnt [E])`` -> the flat table of
:func:`._alias.pack_words`, equal to it word for word (the jnp functions of
:mod:`._alias` run inside the program on one expert's row). A kernel of its own
because XLA's ops for the same build are many small launches per call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_eplb_jax.routing._map_and_count import _alias
from moe_eplb_jax.routing._map_and_count._triton_ops import take

__all__ = ["alias_kernel"]


def _alias_kernel(values_ref, log2phy_ref, logcnt_ref, table_ref, *, num_logical, width, lanes, experts, compact):
    """Program ``e`` writes expert ``e``'s head pair and buckets of the packed table (:func:`_alias.pack_words`), its
    row held in registers (bisections through ``tt.gather``, ``bit_length(count)`` steps each)."""
    expert = pl.program_id(0)
    others = jnp.arange(experts, dtype=jnp.int32)
    earlier = plgpu.load(logcnt_ref.at[jnp.minimum(others, num_logical - 1)], mask=others < expert, other=0)
    offset = jnp.sum(jnp.where(others < expert, jnp.clip(earlier, 1, width), 0))
    count = jnp.clip(logcnt_ref[expert], 1, width)
    index = jnp.arange(lanes, dtype=jnp.int32)
    at = expert * width + jnp.minimum(index, width - 1)
    values = plgpu.load(values_ref.at[at], mask=index < count, other=0.0)
    slots = plgpu.load(log2phy_ref.at[at], mask=index < count, other=0)
    masses = _alias.integer_masses(values, index, count, width)
    read_from = lambda row: lambda at: take(row, jnp.clip(at, 0, lanes - 1))
    steps = sum((count >= 1 << bit).astype(jnp.int32) for bit in range(int(width).bit_length()))  # bit_length
    words = _alias.row_words(masses, slots, index, count, read_from, steps)
    # Lanes past the row point at distinct spare entries past the table (interpret mode's masked scatter writes
    # back what it read, which must not land on an entry another lane writes).
    spare = table_ref.shape[0] - 2 * lanes + 2 * index
    live = index < count
    if compact:
        plgpu.store(
            table_ref.at[jnp.where(live, 2 * num_logical + offset + index, spare)],
            _alias.compact_words(words, slots),
            mask=live,
        )
    else:
        pair = jnp.where(live, 2 * (num_logical + offset + index), spare)
        plgpu.store(table_ref.at[pair], words, mask=live)
        plgpu.store(table_ref.at[pair + 1], slots, mask=live)
    head = _alias.alias_head(log2phy_ref[expert * width], count, offset)
    plgpu.store(
        table_ref.at[jnp.where(index < 2, 2 * expert + index, spare)],
        jnp.where(index == 0, head, offset),
        mask=index < 2,
    )


def alias_kernel(
    values,
    log2phy,
    logcnt,
    *,
    compact: bool = False,
    out_struct: Callable[..., jax.ShapeDtypeStruct] = jax.ShapeDtypeStruct,
    interpret: bool = False,
    num_warps: int = 4,
):
    """:func:`_alias.alias_words`, packed (:func:`_alias.pack_words`, ``compact`` or not), a program per expert:
    flat ``[packed_size + 2 lanes]`` int32, the table and then a spare tail never read (``lanes = max(32,
    2**ceil(log2 S))``); entries past the last live bucket are left unwritten (never read)."""
    num_logical, width = log2phy.shape
    lanes = max(32, pl.next_power_of_2(width))
    return pl.pallas_call(
        functools.partial(
            _alias_kernel,
            num_logical=num_logical,
            width=width,
            lanes=lanes,
            experts=max(32, pl.next_power_of_2(num_logical)),
            compact=compact,
        ),
        grid=(num_logical,),
        in_specs=[pl.no_block_spec] * 3,
        out_specs=pl.no_block_spec,
        out_shape=out_struct((_alias.packed_size(num_logical, width, compact) + 2 * lanes,), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="alias_table",
    )(values.astype(jnp.float32).reshape(-1), log2phy.astype(jnp.int32).reshape(-1), logcnt)

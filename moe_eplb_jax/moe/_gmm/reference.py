"""The jnp grouped matmuls: ``dense`` (exact, placement-invariant; the CPU path and the oracle) and XLA's ``ragged_dot``.

Rows ``[start_s, start_s + group_sizes[s])`` are multiplied by ``w[s]``; rows
past ``sum(group_sizes)`` are padding and come out zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["dense", "ragged_dot", "row_invariant_dot", "select_own_slot", "slot_of_row", "transposed_dense"]

_ROW_TILE = 64


def slot_of_row(group_sizes, num_rows: int):
    """``[num_rows]`` int32 slot of each row of a slot-sorted buffer (``S`` for padding rows)."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    row = jnp.arange(num_rows, dtype=jnp.int32)
    return jnp.sum(row[:, None] >= ends[None, :], axis=1, dtype=jnp.int32)


def select_own_slot(every, group_sizes):
    """From ``every [S, N, M]`` (each row's result under every slot) keeps each row's own slot -> ``[N, M]``.

    Row ``n`` belongs to slot ``s`` when it lies in that slot's run of
    ``group_sizes``; padding rows (past the last run) get zero.
    """
    num_slots = every.shape[0]
    slot = slot_of_row(group_sizes, every.shape[1])
    mine = jnp.take_along_axis(every, jnp.minimum(slot, num_slots - 1)[None, :, None], axis=0)[0]
    return jnp.where((slot < num_slots)[:, None], mine, jnp.zeros((), every.dtype))


def _every_slot(x, w):
    """``x [N, K]`` times each of ``w [S, K, M]`` -> ``[S, N, M]`` float32, each row rounded alike wherever it sits.

    XLA:CPU picks its dot kernel by the row count, and some round a row by
    where it sits; as one batched dot over whole tiles of 64 rows every row
    rounds alike, wherever it sits and however many rows came (jax 0.11 and
    0.12; a plain ``[N, K] @ [K, M]`` dot does not on 0.12).
    """
    rows = x.shape[0]
    tiled = jnp.pad(x, ((0, -rows % _ROW_TILE), (0, 0)))
    return jnp.einsum("nk,skm->snm", tiled, w, preferred_element_type=jnp.float32)[:, :rows]


def dense(x, w, group_sizes):
    """Every row times every slot's weights (``S`` times the work, an ``[S, N, M]`` intermediate), each row keeping
    its own slot's result: a plain dot product with its expert's weights wherever it sits, bit for bit."""
    return select_own_slot(_every_slot(x, w), group_sizes)


def row_invariant_dot(x, w):
    """``x [N, K] @ w [K, M]`` in float32, each row's result the same however many rows come and wherever it
    sits (the router's logits: the same on any EP size)."""
    return _every_slot(x, w[None])[0]


def ragged_dot(x, w, group_sizes):
    """``jax.lax.ragged_dot`` with float32 accumulation. Its portable lowering contracts over ``(slot, K)`` jointly,
    so a row's rounding can depend on its slot index (not placement-invariant); on GPU it expands densely."""
    return jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32)


def transposed_dense(x, dy, group_sizes):
    """Per group ``x_s^T @ dy_s`` -> ``[S, K, M]`` float32: the weight gradient's oracle."""
    num_slots = group_sizes.shape[0]
    mine = slot_of_row(group_sizes, x.shape[0])[:, None] == jnp.arange(num_slots, dtype=jnp.int32)[None, :]
    masked = jnp.where(mine.T[:, :, None], x[None].astype(jnp.float32), 0.0)
    return jnp.einsum("snk,nm->skm", masked, dy.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)

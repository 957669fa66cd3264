"""One EP rank's dispatch and combine: every slot is here, so one sort and two gathers, no plan and no exchange.

``gather_local`` lists every assignment's row grouped by slot; ``combine_local`` takes the grouped results back
and sums each token's ``k`` of them with its router weights. Both are gathers in the forward pass and in the
backward pass (their own VJPs): autodiff would broadcast each token to its ``k`` rows, permute, mask, and
transpose all of it into several passes over ``[T * k, D]`` buffers, and a scatter-add where a gather does.

Placement-invariant numerics: a row is the token's unchanged activation, and every sum over a token's ``k``
assignments (its output, its input gradient) runs in float32 in router order ``j = 0 .. k - 1``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moe_eplb_jax._kernels import pallas_default
from moe_eplb_jax.moe._ranks import stable_argsort

__all__ = ["combine_local", "gather_local", "gather_rows", "sort_local"]


def sort_local(physical_ids, num_slots: int, *, group_sizes=None):
    """``(order, inverse, group_sizes, tokens)``: the assignments ``[T * k]`` by slot (unsent last), its inverse,
    the rows of each slot (``map_and_count``'s load where the caller has it) and each sorted row's token
    (``order // k``). At decode sizes on a GPU one kernel sorts (``_slot_sort``); elsewhere the sort is counted
    where the pairs are few (``_ranks``), or XLA's."""
    if physical_ids.ndim != 2:
        raise ValueError(f"physical_ids must have shape [T, k], got {physical_ids.shape}")
    if group_sizes is not None and group_sizes.shape != (num_slots,):
        raise ValueError(f"group_sizes must have shape [{num_slots}], got {group_sizes.shape}")
    flat = physical_ids.reshape(-1).astype(jnp.int32)
    key = jnp.where(flat < 0, jnp.int32(num_slots), flat)
    top_k = physical_ids.shape[1]
    if group_sizes is None:
        group_sizes = (key[:, None] == jnp.arange(num_slots, dtype=jnp.int32)[None, :]).sum(0, dtype=jnp.int32)
    if _slot_sort_serves(flat.shape[0], num_slots):
        from moe_eplb_jax.moe._slot_sort import triton as slot_sort

        order, inverse, tokens = slot_sort.slot_sort(flat, num_slots, top_k)
    else:
        order, inverse = stable_argsort(key)
        tokens = order // jnp.int32(top_k)
    return order, inverse, group_sizes.astype(jnp.int32), tokens


def _slot_sort_serves(num_entries: int, num_slots: int) -> bool:
    """Whether the one-kernel sort serves: a GPU where its probe passed, and a size it takes."""
    from moe_eplb_jax.moe._slot_sort import triton as slot_sort

    return slot_sort.applies(num_entries, num_slots) and pallas_default("slot_sort", slot_sort.probe)


def gather_rows(x, order, inverse, group_sizes, top_k: int):
    """``[T * k, D]``: row ``i`` is token ``order[i] // top_k`` of ``x [T, D]``, rows past the groups zero; its
    gradient sums each token's ``k`` row gradients in float32 in router order (gathers, no scatter-add)."""
    rows = x.shape[0] * top_k if x.ndim == 2 else None
    if rows is None or order.shape != (rows,) or inverse.shape != (rows,):
        raise ValueError(
            f"need x [T, D] and order, inverse [T * {top_k}], got {x.shape}, {order.shape} and {inverse.shape}"
        )
    return _gather(x, order, inverse, jnp.sum(group_sizes), top_k)


def gather_local(x, physical_ids, num_slots: int, *, group_sizes=None):
    """Every assignment's row, grouped by slot: :func:`sort_local`, then :func:`gather_rows`.

    Args:
      x: ``[T, D]`` the rank's tokens.
      physical_ids: ``[T, k]`` slot of each assignment (``-1``: sent nowhere).
      num_slots: the rank's slots ``S``.
      group_sizes: ``[S]`` the assignments of each slot, where the caller has counted them already
        (``map_and_count``'s load); counted here when ``None``.

    Returns:
      ``(rows [T * k, D], order [T * k], inverse [T * k], group_sizes [S])``: the rows of slot 0, then slot 1, ...
      in assignment order, the unsent ones last (zero rows); row ``i`` is assignment ``order[i]`` and assignment
      ``a`` sits in row ``inverse[a]``. ``combine_local(y, order, inverse, ...)`` takes the grouped results back.
    """
    if x.ndim != 2 or physical_ids.ndim != 2 or x.shape[0] != physical_ids.shape[0]:
        raise ValueError(f"x must have shape [T={physical_ids.shape[0]}, D], got {x.shape}")
    order, inverse, group_sizes, _ = sort_local(physical_ids, num_slots, group_sizes=group_sizes)
    return gather_rows(x, order, inverse, group_sizes, physical_ids.shape[1]), order, inverse, group_sizes


def combine_local(y, order, inverse, physical_ids, weights, *, out_dtype=None):
    """``gather_local``'s inverse and the weighted sum: ``[T, D]``, ``sum_j weights[t, j] * y_j`` added in router
    order ``j = 0..k-1`` in float32, unsent assignments adding zero.

    Args:
      y: ``[T * k, D]`` results in ``gather_local``'s row order.
      order, inverse: ``gather_local``'s.
      physical_ids: ``[T, k]`` as given to ``gather_local``.
      weights: ``[T, k]`` router weights.
      out_dtype: the result's dtype (default ``y.dtype``).
    """
    if weights.shape != physical_ids.shape or y.shape[0] != physical_ids.size:
        raise ValueError(f"y must have {physical_ids.size} rows and weights shape {physical_ids.shape}")
    if order.shape != (y.shape[0],) or inverse.shape != (y.shape[0],):
        raise ValueError(f"order and inverse must have shape [{y.shape[0]}], got {order.shape} and {inverse.shape}")
    # Which assignments went anywhere, as a mask beside the sum rather than a count of them (a kernel of its own).
    return _combine(y, weights, order, inverse, physical_ids >= 0).astype(out_dtype or y.dtype)


def _token_sum(rows, inverse, sent, top_k: int, scale=None):
    """``[T, D]`` float32: for each token ``t``, ``sum_j scale[t, j] * rows[inverse[t k + j]]`` over its real
    assignments (``sent [T, k]`` bool), in order ``j``."""
    tokens = inverse.shape[0] // top_k
    at = inverse.reshape(tokens, top_k)

    def term(j):
        row = jnp.where(sent[:, j, None], rows[at[:, j]].astype(jnp.float32), 0.0)
        return row if scale is None else scale[:, j, None].astype(jnp.float32) * row

    total = term(0)
    for j in range(1, top_k):  # fixed order: the sum never depends on where experts live
        total = total + term(j)
    return total


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _gather(x, order, inverse, sent, top_k):
    live = jnp.arange(order.shape[0], dtype=jnp.int32) < sent
    return jnp.where(live[:, None], x[order // jnp.int32(top_k)], jnp.zeros((), x.dtype))


def _gather_fwd(x, order, inverse, sent, top_k):
    return _gather(x, order, inverse, sent, top_k), (inverse, sent)


def _gather_bwd(top_k, residuals, grad):
    # A token's gradient is the sum of its k rows' gradients: k gathers summed, where autodiff scatter-adds.
    inverse, sent = residuals
    assigned = inverse.reshape(-1, top_k) < sent  # the rows past the sent ones are the unsent assignments'
    return _token_sum(grad, inverse, assigned, top_k).astype(grad.dtype), None, None, None


_gather.defvjp(_gather_fwd, _gather_bwd)


@jax.custom_vjp
def _combine(y, weights, order, inverse, sent):
    return _token_sum(y, inverse, sent, weights.shape[1], weights)


def _combine_fwd(y, weights, order, inverse, sent):
    return _combine(y, weights, order, inverse, sent), (y, weights, order, inverse, sent)


def _combine_bwd(residuals, grad):
    y, weights, order, inverse, sent = residuals
    top_k = weights.shape[1]
    grad = grad.astype(jnp.float32)
    # Row i carries assignment order[i] = (t, j): its gradient is weights[t, j] * grad[t], a gather of grad.
    live = jnp.arange(order.shape[0], dtype=jnp.int32) < jnp.sum(sent, dtype=jnp.int32)
    scale = weights.reshape(-1)[order].astype(jnp.float32)
    dy = jnp.where(live[:, None], scale[:, None] * grad[order // jnp.int32(top_k)], 0.0).astype(y.dtype)
    at = inverse.reshape(weights.shape)
    products = jnp.sum(grad[:, None, :] * y[at].astype(jnp.float32), axis=-1)  # [T, k]: one gather-reduce
    dweights = jnp.where(sent, products, 0.0).astype(weights.dtype)
    return dy, dweights, None, None, None


_combine.defvjp(_combine_fwd, _combine_bwd)

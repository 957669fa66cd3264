"""Dropless token dispatch and combine over an expert-parallel mesh axis.

Every function here runs per rank, inside ``jax.shard_map`` over the EP axis
``axis_name`` with ``G`` ranks. A rank holds ``T`` tokens, each routed to ``k``
physical slots (``physical_ids [T, k]``; ``-1``: sent nowhere); slot ``p``
lives on rank ``p // slots_per_rank``. Shapes depend only on ``T, k, G`` and the
capacity -- never on the routing or the placement, so nothing recompiles when
either changes.

:func:`exchange_apply` is the layer's path: the ``A = T * k`` assignments are
sorted by destination once (``[A]``), then sent in rounds of ``C`` rows per
(source, destination) pair -- round ``r`` sends rows ``[r C, (r + 1) C)`` of each
destination's run (``[G, C, D]``), the receiver computes its ``G C`` rows and
sends the results back, and the source writes them into its ``[A, D]``
results. Every rank runs as many rounds as the fullest pair needs (a
``pmax``): one when the routing fits the capacity, more under skew, never a
dropped token. Memory is ``O(A D + G C D)`` per rank. Without a capacity
``C = A``: one round of the worst case (every assignment to one rank).
Round 0 is ordinary autodiff; the overflow rounds sit in a ``custom_vjp``
whose backward recomputes each round's forward before applying its VJP, so
training memory stays linear too (an overflow round costs one more forward).

:func:`dispatch` / :func:`combine` are the one-shot form (a ``[G, A, D]``
buffer, optionally moved in rounds by :func:`exchange`), kept for callers that
compute between the two themselves.

Placement-invariant numerics: an assignment's row is the token's unchanged
activation, it meets the same expert bytes wherever the expert lives, and the
combine adds the ``k`` results in router order (``k = 0, 1, ...``), never in an
order that depends on slots or ranks.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moe_eplb_jax.moe._ranks import inverse_permutation, stable_argsort

__all__ = [
    "DispatchPlan",
    "RoundPlan",
    "combine",
    "dispatch",
    "exchange",
    "apply_by_slot",
    "exchange_apply",
    "inverse_permutation",
    "permute_rows",
    "plan_dispatch",
    "plan_rounds",
    "sort_by_slot",
    "unsort",
]


class DispatchPlan(NamedTuple):
    """Where each of the ``A = T * k`` assignments of this rank went.

    Attributes:
      dest: ``[A]`` int32, destination rank of each assignment (``G`` for an
        assignment to no slot, id ``-1``, which is never sent).
      pos: ``[A]`` int32, its row in the destination's receive buffer.
      send_src: ``[G, A]`` int32, the assignment sent in each row of the send
        buffer (``-1`` for an empty row).
      send_slot: ``[G, A]`` int32, the destination-local slot of each row
        (``-1`` for an empty row).
      rounds: int32 scalar, exchange rounds (``dispatch`` fills it; 1 without a capacity).
    """

    dest: jax.Array
    pos: jax.Array
    send_src: jax.Array
    send_slot: jax.Array
    rounds: jax.Array | None = None


def _check(physical_ids, slots_per_rank: int, num_ranks: int) -> None:
    if physical_ids.ndim != 2:
        raise ValueError(f"physical_ids must have shape [T, k], got {physical_ids.shape}")
    if not jnp.issubdtype(physical_ids.dtype, jnp.integer):
        raise ValueError(f"physical_ids must be integers, got dtype {physical_ids.dtype}")
    if slots_per_rank < 1 or num_ranks < 1:
        raise ValueError(f"need slots_per_rank >= 1 and num_ranks >= 1, got {slots_per_rank}, {num_ranks}")


def plan_dispatch(physical_ids, *, slots_per_rank: int, num_ranks: int) -> DispatchPlan:
    """Plans the send buffer of one rank from its ``physical_ids [T, k]`` (ids in ``[0, G * slots_per_rank)``,
    or ``-1``: an assignment to no slot, not sent).

    Rows for destination ``g`` hold the assignments bound for ``g`` in
    assignment order (token-major, then ``k``), packed at the front.
    """
    _check(physical_ids, slots_per_rank, num_ranks)
    flat = physical_ids.reshape(-1).astype(jnp.int32)
    num_assign = flat.shape[0]
    dest = jnp.where(flat >= 0, flat // jnp.int32(slots_per_rank), jnp.int32(num_ranks))  # unsent: sorted last
    local = flat % jnp.int32(slots_per_rank)
    # Stable sort by destination: each destination's assignments become one contiguous run, in order.
    order, _ = stable_argsort(dest)
    onehot = dest[:, None] == jnp.arange(num_ranks, dtype=jnp.int32)[None, :]
    counts = onehot.sum(0, dtype=jnp.int32)  # [G]
    starts = jnp.cumsum(counts) - counts
    row = jnp.arange(num_assign, dtype=jnp.int32)
    valid = row[None, :] < counts[:, None]  # [G, A]
    src = order[jnp.clip(starts[:, None] + row[None, :], 0, num_assign - 1)]
    send_src = jnp.where(valid, src, -1)
    send_slot = jnp.where(valid, local[jnp.maximum(send_src, 0)], -1)
    # pos of assignment order[i] is i - starts[dest]: invert the sort with a scatter of unique indices.
    sorted_pos = row - starts[dest[order]]
    pos = jnp.zeros((num_assign,), jnp.int32).at[order].set(sorted_pos, unique_indices=True)
    return DispatchPlan(dest=dest, pos=pos, send_src=send_src, send_slot=send_slot)


def _rounds_loop(buf, rounds, capacity: int, axis_name):
    """``all_to_all`` of the first ``rounds * capacity`` rows of every ``[G, A, ...]`` block; other rows zero."""
    out = jnp.zeros_like(buf)

    def body(r, out):
        # Past the end, dynamic_slice and dynamic_update_slice clamp alike: the last round re-sends
        # overlapping rows to the same place.
        chunk = jax.lax.dynamic_slice_in_dim(buf, r * capacity, capacity, axis=1)
        got = jax.lax.all_to_all(chunk, axis_name, 0, 0)
        return jax.lax.dynamic_update_slice_in_dim(out, got, r * capacity, axis=1)

    return jax.lax.fori_loop(0, rounds, body, out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _exchange_rounds(buf, rounds, capacity, axis_name):
    return _rounds_loop(buf, rounds, capacity, axis_name)


def _exchange_fwd(buf, rounds, capacity, axis_name):
    return _rounds_loop(buf, rounds, capacity, axis_name), rounds


def _exchange_bwd(capacity, axis_name, rounds, grad):
    # all_to_all is its own transpose; so is a round-by-round all_to_all of the same rows.
    return _rounds_loop(grad, rounds, capacity, axis_name), None


_exchange_rounds.defvjp(_exchange_fwd, _exchange_bwd)


def exchange(buf, *, axis_name, rounds=None, capacity: int | None = None) -> jax.Array:
    """Sends block ``g`` of ``buf [G, A, ...]`` to rank ``g``; returns the blocks received, by source.

    Without ``capacity``: one ``all_to_all``. With it: ``rounds`` rounds of
    ``capacity`` rows per block (rows past ``rounds * capacity`` are not sent
    and come back zero); differentiable either way.
    """
    if capacity is None:
        return jax.lax.all_to_all(buf, axis_name, 0, 0)
    if capacity < 1 or capacity > buf.shape[1]:
        raise ValueError(f"capacity must be in [1, A={buf.shape[1]}], got {capacity}")
    if not jnp.issubdtype(buf.dtype, jnp.floating):
        return _rounds_loop(buf, rounds, capacity, axis_name)
    return _exchange_rounds(buf, rounds, capacity, axis_name)


def dispatch(x, physical_ids, *, slots_per_rank: int, axis_name, num_ranks: int, capacity: int | None = None):
    """Sends every assignment's token row to the rank owning its slot.

    Args:
      x: ``[T, D]`` tokens of this rank.
      physical_ids: ``[T, k]`` physical slot of each assignment.
      slots_per_rank: ``P / G``.
      axis_name: the EP mesh axis (``G`` ranks).
      num_ranks: ``G``, the size of ``axis_name``.
      capacity: rows per (source, destination) pair and round (``None``: one
        round of the worst case, ``A`` rows). See the module docstring.

    Returns:
      ``(recv_x [G * A, D], recv_slot [G * A] int32, plan)``: the rows this rank
      must compute, each with its local slot (``-1``: an empty row, whose
      content is zero), and the plan ``combine`` needs.
    """
    if x.ndim != 2 or x.shape[0] != physical_ids.shape[0]:
        raise ValueError(f"x must have shape [T={physical_ids.shape[0]}, D], got {x.shape}")
    plan = plan_dispatch(physical_ids, slots_per_rank=slots_per_rank, num_ranks=num_ranks)
    top_k = physical_ids.shape[1]
    rounds = jnp.ones((), jnp.int32)
    if capacity is not None:
        fullest = jax.lax.pmax(jnp.max(jnp.sum(plan.send_src >= 0, axis=1, dtype=jnp.int32)), axis_name)
        rounds = jnp.maximum((fullest + capacity - 1) // capacity, 1).astype(jnp.int32)
    plan = plan._replace(rounds=rounds)
    token = jnp.maximum(plan.send_src, 0) // jnp.int32(top_k)
    send_x = jnp.where((plan.send_src >= 0)[..., None], x[token], jnp.zeros((), x.dtype))  # [G, A, D]
    recv_x = exchange(send_x, axis_name=axis_name, rounds=rounds, capacity=capacity)
    recv_slot = exchange(plan.send_slot + 1, axis_name=axis_name, rounds=rounds, capacity=capacity) - 1
    return recv_x.reshape(-1, x.shape[1]), recv_slot.reshape(-1), plan


def _weighted_sum(per_assign, weights):
    w = weights.astype(jnp.float32)
    out = w[:, 0, None] * per_assign[:, 0]
    for j in range(1, weights.shape[1]):  # fixed order: the sum never depends on where experts live
        out = out + w[:, j, None] * per_assign[:, j]
    return out


def combine(y, plan: DispatchPlan, weights, *, axis_name, out_dtype=None, capacity: int | None = None):
    """Returns expert outputs to their tokens and sums them with the router weights.

    Args:
      y: ``[G * A, D]`` expert output of every received row (rows as ``dispatch`` returned them).
      plan: the ``DispatchPlan`` from ``dispatch``.
      weights: ``[T, k]`` router weight of each assignment (summed in float32).
      axis_name: the EP mesh axis.
      out_dtype: dtype of the result (default: ``y.dtype``).
      capacity: the ``capacity`` given to ``dispatch``.

    Returns:
      ``[T, D]``: ``sum_j weights[t, j] * y_j`` added in router order ``j = 0..k-1``.
    """
    num_ranks, num_assign = plan.send_src.shape
    tokens, top_k = weights.shape
    if y.shape[0] != num_ranks * num_assign:
        raise ValueError(f"y must have {num_ranks * num_assign} rows (G * A), got shape {y.shape}")
    back = exchange(y.reshape(num_ranks, num_assign, -1), axis_name=axis_name, rounds=plan.rounds, capacity=capacity)
    sent = (plan.dest < num_ranks)[:, None]  # an assignment to no slot (id -1) was never sent: it adds zero
    per_assign = jnp.where(sent, back[plan.dest, plan.pos], 0).reshape(tokens, top_k, -1).astype(jnp.float32)
    return _weighted_sum(per_assign, weights).astype(out_dtype or y.dtype)


class RoundPlan(NamedTuple):
    """This rank's assignments sorted by destination, and the rounds every rank runs.

    Attributes:
      order: ``[A]`` int32, the assignments by destination rank (stable: assignment order within a
        destination), those to no slot (id ``-1``) last.
      starts: ``[G]`` int32, where each destination's run starts in ``order``.
      counts: ``[G]`` int32, its length (the assignments this rank sends there).
      local: ``[A]`` int32, each assignment's destination-local slot.
      overflow: ``[A]`` bool, assignments sent after round 0 (``capacity`` or more ahead of them in their run).
      rounds: int32 scalar, rounds of ``capacity`` rows per pair that the fullest pair of the EP group needs
        (at least 1; the same on every rank).
    """

    order: jax.Array
    starts: jax.Array
    counts: jax.Array
    local: jax.Array
    overflow: jax.Array
    rounds: jax.Array


def plan_rounds(physical_ids, *, slots_per_rank: int, num_ranks: int, capacity: int, axis_name) -> RoundPlan:
    """Plans :func:`exchange_apply`'s rounds of ``capacity`` rows per (source, destination) pair."""
    _check(physical_ids, slots_per_rank, num_ranks)
    flat = physical_ids.reshape(-1).astype(jnp.int32)
    num_assign = flat.shape[0]
    dest = jnp.where(flat >= 0, flat // jnp.int32(slots_per_rank), jnp.int32(num_ranks))  # unsent: sorted last
    order, place = stable_argsort(dest)
    counts = (dest[:, None] == jnp.arange(num_ranks, dtype=jnp.int32)[None, :]).sum(0, dtype=jnp.int32)
    starts = (jnp.cumsum(counts) - counts).astype(jnp.int32)
    # Each assignment's place in its destination's run (unsent ones: meaningless, masked below).
    place = place - jnp.concatenate([starts, jnp.zeros((1,), jnp.int32)])[dest]
    if capacity >= num_assign:  # one round holds the worst case: no collective to agree on the count
        rounds = jnp.ones((), jnp.int32)
    else:
        fullest = jax.lax.pmax(jnp.max(counts), axis_name)
        rounds = jnp.maximum((fullest + capacity - 1) // capacity, 1).astype(jnp.int32)
    return RoundPlan(
        order=order,
        starts=starts,
        counts=counts,
        local=flat % jnp.int32(slots_per_rank),
        overflow=(dest < num_ranks) & (place >= capacity),
        rounds=rounds,
    )


def _round_sources(plan: RoundPlan, r, capacity: int):
    """``[G, C]`` int32: the assignment sent in each row of round ``r`` (``-1``: an empty row)."""
    within = r * capacity + jnp.arange(capacity, dtype=jnp.int32)[None, :]
    index = jnp.clip(plan.starts[:, None] + within, 0, plan.order.shape[0] - 1)
    return jnp.where(within < plan.counts[:, None], plan.order[index], -1)


def _round(fn, params, x, plan: RoundPlan, src, *, top_k: int, axis_name):
    """One round: send the rows of ``src [G, C]``, ``fn`` on the ``G * C`` rows received, results back ``[G, C, D']``."""
    num_ranks, capacity = src.shape
    live = src >= 0
    safe = jnp.maximum(src, 0)
    send_x = jnp.where(live[..., None], x[safe // jnp.int32(top_k)], jnp.zeros((), x.dtype))
    send_slot = jnp.where(live, plan.local[safe], -1)
    recv_x = jax.lax.all_to_all(send_x, axis_name, 0, 0)
    recv_slot = jax.lax.all_to_all(send_slot + 1, axis_name, 0, 0) - 1  # empty rows: 0 on the wire, -1 here
    y = fn(params, recv_x.reshape(num_ranks * capacity, -1), recv_slot.reshape(-1))
    return jax.lax.all_to_all(y.reshape(num_ranks, capacity, -1), axis_name, 0, 0)


def _write(results, src, back):
    """``results [A, D']`` with row ``src[g, c]`` set to ``back[g, c]`` (empty rows: distinct indices past ``A``, dropped)."""
    num_assign = results.shape[0]
    spare = num_assign + jnp.arange(src.size, dtype=jnp.int32).reshape(src.shape)
    index = jnp.where(src >= 0, src, spare).reshape(-1)
    return results.at[index].set(back.reshape(src.size, -1), mode="drop", unique_indices=True)


def _split_float(params):
    """``(float leaves, rebuild, treedef, is_float)``: the leaves a gradient flows to, ``rebuild(float leaves)
    -> params``, and which of the flattened leaves are float."""
    leaves, treedef = jax.tree.flatten(params)
    is_float = [jnp.issubdtype(leaf.dtype, jnp.inexact) for leaf in leaves]

    def rebuild(floats):
        it = iter(floats)
        return treedef.unflatten([next(it) if f else leaf for leaf, f in zip(leaves, is_float)])

    return [leaf for leaf, f in zip(leaves, is_float) if f], rebuild, treedef, is_float


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _overflow_rounds(fn, capacity, top_k, axis_name, params, x, plan, results):
    """``results`` with the rows of rounds ``1 .. plan.rounds - 1`` written in (a loop of dynamic length)."""

    def body(r, results):
        src = _round_sources(plan, r, capacity)
        return _write(results, src, _round(fn, params, x, plan, src, top_k=top_k, axis_name=axis_name))

    return jax.lax.fori_loop(1, plan.rounds, body, results)


def _overflow_fwd(fn, capacity, top_k, axis_name, params, x, plan, results):
    return _overflow_rounds(fn, capacity, top_k, axis_name, params, x, plan, results), (params, x, plan)


def _overflow_bwd(fn, capacity, top_k, axis_name, saved, grad):
    # Rematerialised: each round's forward runs again (nothing of it was kept) and its VJP is applied; the
    # gradients accumulate in float32 over the rounds.
    params, x, plan = saved
    floats, rebuild, treedef, is_float = _split_float(params)

    def body(r, acc):
        d_floats, d_x = acc
        src = _round_sources(plan, r, capacity)

        def forward(floats, x):
            return _round(fn, rebuild(floats), x, plan, src, top_k=top_k, axis_name=axis_name)

        back, vjp = jax.vjp(forward, floats, x)
        cotangent = jnp.where((src >= 0)[..., None], grad[jnp.maximum(src, 0)], 0).astype(back.dtype)
        g_floats, g_x = vjp(cotangent)
        d_floats = [a + g.astype(jnp.float32) for a, g in zip(d_floats, g_floats)]
        return d_floats, d_x + g_x.astype(jnp.float32)

    zeros = ([jnp.zeros(f.shape, jnp.float32) for f in floats], jnp.zeros(x.shape, jnp.float32))
    d_floats, d_x = jax.lax.fori_loop(1, plan.rounds, body, zeros)
    it = iter(f.astype(leaf.dtype) for f, leaf in zip(d_floats, floats))
    leaves = jax.tree.leaves(params)
    d_params = treedef.unflatten(
        [next(it) if f else np.zeros(leaf.shape, jax.dtypes.float0) for leaf, f in zip(leaves, is_float)]
    )
    d_plan = jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), plan)
    d_results = jnp.where(plan.overflow[:, None], jnp.zeros((), grad.dtype), grad)  # overwritten rows: no gradient
    return d_params, d_x.astype(x.dtype), d_plan, d_results


_overflow_rounds.defvjp(_overflow_fwd, _overflow_bwd)


def exchange_apply(
    fn,
    params,
    x,
    physical_ids,
    weights,
    *,
    slots_per_rank: int,
    axis_name,
    num_ranks: int,
    capacity: int | None = None,
    out_dtype=None,
):
    """Computes ``fn`` on every assignment's row at the rank owning its slot, in rounds; sums in router order.

    Args:
      fn: ``fn(params, rows [N, D], row_slot [N]) -> [N, D']``, per row (``row_slot``: the local slot,
        ``-1`` for an empty row, whose content is zero and whose result is never read); ``N = G * C``.
      params: ``fn``'s pytree (its float leaves get gradients).
      x: ``[T, D]`` tokens of this rank.
      physical_ids: ``[T, k]`` physical slot of each assignment (``-1``: sent nowhere, adds zero).
      weights: ``[T, k]`` router weight of each assignment (summed in float32).
      slots_per_rank: ``P / G``.
      axis_name: the EP mesh axis (``G`` ranks); num_ranks: ``G``.
      capacity: ``C``, rows per (source, destination) pair and round, in ``[1, A]`` (``None``: ``A``, one round
        of the worst case). See the module docstring.
      out_dtype: dtype of the result (default: ``fn``'s).

    Returns:
      ``[T, D']``: ``sum_j weights[t, j] * fn(row of assignment (t, j))`` added in router order ``j = 0..k-1``.
    """
    if x.ndim != 2 or x.shape[0] != physical_ids.shape[0] or weights.shape != physical_ids.shape:
        raise ValueError(
            f"x must be [T, D] and weights [T, k] with physical_ids {physical_ids.shape}, got {x.shape}, "
            f"{weights.shape}"
        )
    num_assign = physical_ids.size
    capacity = num_assign if capacity is None else capacity
    if not 1 <= capacity <= num_assign:
        raise ValueError(f"capacity must be in [1, A={num_assign}], got {capacity}")
    top_k = physical_ids.shape[1]
    plan = plan_rounds(
        physical_ids, slots_per_rank=slots_per_rank, num_ranks=num_ranks, capacity=capacity, axis_name=axis_name
    )
    src = _round_sources(plan, 0, capacity)
    back = _round(fn, params, x, plan, src, top_k=top_k, axis_name=axis_name)
    results = _write(jnp.zeros((num_assign, back.shape[-1]), back.dtype), src, back)
    if capacity < num_assign:  # rounds past the first happen only under skew beyond the capacity
        results = jnp.asarray(_overflow_rounds(fn, capacity, top_k, axis_name, params, x, plan, results))
    per_assign = results.reshape(*weights.shape, -1).astype(jnp.float32)  # unsent rows stayed zero
    return _weighted_sum(per_assign, weights).astype(out_dtype or back.dtype)


def sort_by_slot(recv_slot, num_slots: int):
    """Groups received rows by local slot for a grouped matmul.

    Returns ``(order [N], group_sizes [num_slots])``: ``rows[order]`` lists the
    rows of slot 0, then slot 1, ... in arrival order, empty rows (slot ``-1``)
    last; ``group_sizes`` counts each slot's rows.
    """
    order, _, group_sizes = _sorted_by_slot(recv_slot, num_slots)
    return order, group_sizes


def _sorted_by_slot(recv_slot, num_slots: int):
    """``sort_by_slot``'s ``(order, inverse, group_sizes)``."""
    key = jnp.where(recv_slot < 0, jnp.int32(num_slots), recv_slot.astype(jnp.int32))
    order, inverse = stable_argsort(key)
    onehot = key[:, None] == jnp.arange(num_slots, dtype=jnp.int32)[None, :]
    return order, inverse, onehot.sum(0, dtype=jnp.int32)


def apply_by_slot(fn, rows, row_slot, num_slots: int):
    """``fn(rows grouped by slot [N, D], group_sizes [num_slots]) -> [N, D']`` with its results back in arrival
    order: the received rows' grouped MLP (:func:`sort_by_slot`, then both permutations as gathers, the inverse
    computed once)."""
    order, inverse, group_sizes = _sorted_by_slot(row_slot, num_slots)
    return _permute(fn(_permute(rows, order, inverse), group_sizes), inverse, order)


def unsort(sorted_rows, order):
    """Inverse of ``rows[order]``: puts sorted rows back in arrival order (a gather; so is its gradient)."""
    return _permute(sorted_rows, inverse_permutation(order), order)


def permute_rows(x, order):
    """``x[order]`` for ``order`` a permutation of ``x``'s rows, differentiated by the gather with its inverse.

    Autodiff would transpose the gather into a scatter-add, atomic on a GPU and several times slower than a gather
    of the same rows; a permutation's transpose is the inverse permutation.
    """
    if x.ndim < 1 or order.shape != (x.shape[0],):
        raise ValueError(f"order must be a permutation of x's {x.shape[:1]} rows, got shape {order.shape}")
    return _permute(x, order, inverse_permutation(order))


@jax.custom_vjp
def _permute(x, order, inverse):
    return x[order]


def _permute_fwd(x, order, inverse):
    return x[order], inverse


def _permute_bwd(inverse, grad):
    return grad[inverse], None, None


_permute.defvjp(_permute_fwd, _permute_bwd)

"""The one sequential step of the quota search: laying demands against supplies.

For ``C`` candidate targets at once, :func:`fill_layout` walks the ``G``
supply ranks in order. A rank starting at position ``x`` on the demand axis,
inside demand ``j`` (``j = #{boundaries <= x}``), ends at
``min(x + supply, d_pad[j + S - 1])``: it takes at most ``S`` experts and stops
at a demand boundary rather than start another. The walk also checks the plan
it lays out, so that no ``[C, E, G]`` table is needed afterwards: every piece
(the overlap of one rank's interval with one demand) must hold at least
``min_replica_tokens`` tokens and no demand may be split over more than
``max_replicas - 1`` ranks. The ``S``-expert limit per rank holds by
construction.

Two implementations give the same integers: ``"xla"`` (a ``lax.scan`` over the
ranks; on GPU every step is a few kernel launches) and ``"pallas"`` (one
Triton kernel whose loop runs over the ranks with all candidates in one vector,
so the whole walk is a single launch). Under ``vmap`` the Pallas version folds
the batch into its candidate vector (``custom_vmap``), so it stays one launch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["fill_layout", "IMPLEMENTATIONS", "default_implementation"]

IMPLEMENTATIONS = ("xla", "pallas")


def default_implementation() -> str:
    """``"pallas"`` on GPU, ``"xla"`` elsewhere."""
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def _step(x, j, cnt, bad, supply, window, num_spare, min_replica_tokens, max_replicas):
    """One supply rank for every candidate; ``window [S][C]`` are ``d_pad[j + o]`` for ``o < S``.

    ``window[-1]`` is the cap. Returns the new ``(x, j, cnt, bad)``; ``cnt`` is the
    number of ranks that already took a piece of demand ``j``.
    """
    end = jnp.minimum(x + supply, window[-1])
    passed = jnp.zeros_like(j)
    lower = x
    for o in range(num_spare):
        piece = jnp.minimum(window[o], end) - lower
        taken = piece > 0
        bad = bad | (taken & (piece < min_replica_tokens))
        held_before = cnt if o == 0 else jnp.zeros_like(cnt)
        bad = bad | (taken & (held_before + 1 > max_replicas - 1))
        passed = passed + (window[o] <= end).astype(j.dtype)
        lower = window[o]
    # The demand the rank stops in: it took a piece of it iff that demand starts below ``end``.
    cnt_next = jnp.zeros_like(cnt)
    lower = x
    for o in range(num_spare):
        piece = jnp.minimum(window[o], end) - lower
        continues = passed == o
        cnt_next = jnp.where(continues, (cnt if o == 0 else 0) + (piece > 0).astype(cnt.dtype), cnt_next)
        lower = window[o]
    return end, j + passed, cnt_next, bad


def _fill_xla(d_pad, supply, j0, *, num_spare, min_replica_tokens, max_replicas):
    offsets = jnp.arange(num_spare, dtype=jnp.int32)

    def body(carry, s):
        x, j, cnt, bad = carry
        index = jnp.minimum(j[:, None] + offsets[None, :], d_pad.shape[1] - 1)
        win = jnp.take_along_axis(d_pad, index, axis=1)  # [C, S]
        window = [win[:, o] for o in range(num_spare)]
        return _step(x, j, cnt, bad, s, window, num_spare, min_replica_tokens, max_replicas), x

    zeros = jnp.zeros_like(j0)
    (x_end, _, _, bad), s_lo = jax.lax.scan(body, (zeros, j0, zeros, jnp.zeros(j0.shape, bool)), supply.T)
    return s_lo.T, x_end, ~bad


def _fill_kernel(d_ref, supply_ref, j0_ref, s_lo_ref, x_end_ref, bad_ref, *, lanes, width, num_ranks, num_spare,
                 min_replica_tokens, max_replicas):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    row = jnp.arange(lanes, dtype=jnp.int32) * width
    j0 = plgpu.load(j0_ref.at[pl.ds(0, lanes)])

    def body(r, carry):
        x, j, cnt, bad = carry
        s = plgpu.load(supply_ref.at[pl.ds(r * lanes, lanes)])
        window = [d_ref[row + jnp.minimum(j + o, width - 1)] for o in range(num_spare)]
        plgpu.store(s_lo_ref.at[pl.ds(r * lanes, lanes)], x)
        return _step(x, j, cnt, bad, s, window, num_spare, min_replica_tokens, max_replicas)

    zeros = jnp.zeros_like(j0)
    x, _, _, bad = jax.lax.fori_loop(0, num_ranks, body, (zeros, j0, zeros, zeros < 0))
    plgpu.store(x_end_ref.at[pl.ds(0, lanes)], x)
    plgpu.store(bad_ref.at[pl.ds(0, lanes)], bad.astype(jnp.int32))


def _fill_pallas_flat(d_pad, supply, j0, *, num_spare, min_replica_tokens, max_replicas, interpret):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    num_cand, width = d_pad.shape
    num_ranks = supply.shape[1]
    lanes = max(int(pl.next_power_of_2(num_cand)), 16)
    pad = lanes - num_cand
    if pad:  # extra lanes repeat the last candidate; their results are dropped
        d_pad = jnp.concatenate([d_pad, jnp.broadcast_to(d_pad[-1:], (pad, width))])
        supply = jnp.concatenate([supply, jnp.broadcast_to(supply[-1:], (pad, num_ranks))])
        j0 = jnp.concatenate([j0, jnp.broadcast_to(j0[-1:], (pad,))])
    kernel = functools.partial(_fill_kernel, lanes=lanes, width=width, num_ranks=num_ranks, num_spare=num_spare,
                               min_replica_tokens=min_replica_tokens, max_replicas=max_replicas)
    whole = pl.no_block_spec
    s_lo, x_end, bad = pl.pallas_call(
        kernel,
        in_specs=[whole] * 3,
        out_specs=[whole] * 3,
        out_shape=[jax.ShapeDtypeStruct((num_ranks * lanes,), jnp.int32),
                   jax.ShapeDtypeStruct((lanes,), jnp.int32),
                   jax.ShapeDtypeStruct((lanes,), jnp.int32)],
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="quota_fill",
    )(d_pad.reshape(-1), supply.T.reshape(-1), j0)
    s_lo = s_lo.reshape(num_ranks, lanes).T[:num_cand]
    return s_lo, x_end[:num_cand], bad[:num_cand] == 0


@functools.lru_cache(maxsize=None)
def _pallas_fill(num_spare, min_replica_tokens, max_replicas, interpret):
    """The Pallas walk with a ``vmap`` rule that folds batch axes into the candidate lanes (still one launch)."""
    flat = functools.partial(_fill_pallas_flat, num_spare=num_spare, min_replica_tokens=min_replica_tokens,
                             max_replicas=max_replicas, interpret=interpret)

    @jax.custom_batching.custom_vmap
    def fill(d_pad, supply, j0):
        return flat(d_pad, supply, j0)

    @fill.def_vmap
    def _rule(axis_size, in_batched, d_pad, supply, j0):
        args = [a if b else jnp.broadcast_to(a, (axis_size,) + a.shape)
                for a, b in zip((d_pad, supply, j0), in_batched)]
        num_cand = args[0].shape[1]
        merged = [a.reshape((axis_size * num_cand,) + a.shape[2:]) for a in args]
        out = fill(*merged)  # recursive: nested vmaps fold in turn
        out = [o.reshape((axis_size, num_cand) + o.shape[1:]) for o in out]
        return out, [True, True, True]

    return fill


def fill_layout(d_pad, supply, j0, *, num_spare: int, min_replica_tokens: int, max_replicas: int,
                implementation: str = "xla", interpret: bool = False):
    """Walks the supply ranks for ``C`` candidates at once.

    ``d_pad [C, n + S]`` int32: cumulative demand boundaries in demand order
    (non-decreasing), followed by ``S = num_spare`` copies of the total;
    ``supply [C, G]`` int32 slack of each rank in supply order; ``j0 [C]`` int32
    the index of the first demand with tokens. Returns ``(s_lo [C, G], x_end [C],
    ok [C])``: where each rank's interval starts on the demand axis, where the
    last one ends, and whether every piece is at least ``min_replica_tokens`` and
    no demand is split over more than ``max_replicas - 1`` ranks (the caller
    checks that ``x_end`` reached the total).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    opts = dict(num_spare=num_spare, min_replica_tokens=min_replica_tokens, max_replicas=max_replicas)
    if implementation == "xla":
        return _fill_xla(d_pad, supply, j0, **opts)
    return _pallas_fill(num_spare, min_replica_tokens, max_replicas, bool(interpret))(d_pad, supply, j0)

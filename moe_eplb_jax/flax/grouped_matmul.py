"""Grouped matmuls for the MoE layer: rows sorted by slot times per-slot weights.

``matmul(x [N, K], w [S, K, M], group_sizes [S]) -> [N, M] float32``: rows
``[start_s, start_s + group_sizes[s])`` are multiplied by ``w[s]``; rows past
``sum(group_sizes)`` are padding (their content is unspecified; callers mask
them).

* ``"dense"`` -- every row times every slot's weights (one batched product),
  then each row keeps its own slot's result. ``S`` times the real work, but a
  row's result is a plain dot product with its expert's weights, whatever its
  position or slot index: placement-invariant, bit for bit. The CPU default.
* ``"ragged_dot"`` -- ``jax.lax.ragged_dot``. Its portable lowering contracts
  over ``(slot, K)`` jointly, so a row's rounding can depend on its slot index:
  NOT placement-invariant. On GPU XLA (0.11) also expands it densely.

Neither skips work for rows a rank did not receive: compute per rank is that
of the worst case. A grouped kernel whose cost follows the real row count
(GPU) is not written yet.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["dense", "ragged_dot", "get", "available"]


def dense(x, w, group_sizes):
    """Exact grouped matmul: ``x @ w[s]`` for every slot ``s``, each row keeping its own slot's result."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    row = jnp.arange(x.shape[0], dtype=jnp.int32)
    slot = jnp.sum(row[:, None] >= ends[None, :], axis=1, dtype=jnp.int32)  # [N]; S for padding rows
    every = jnp.einsum("nk,skm->snm", x, w, preferred_element_type=jnp.float32)
    mine = jnp.take_along_axis(every, jnp.minimum(slot, w.shape[0] - 1)[None, :, None], axis=0)[0]
    return jnp.where((slot < w.shape[0])[:, None], mine, 0.0)


def ragged_dot(x, w, group_sizes):
    """``jax.lax.ragged_dot`` with float32 accumulation (the reference and CPU path)."""
    return jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32)


_IMPLEMENTATIONS = {"dense": dense, "ragged_dot": ragged_dot}


def available() -> list[str]:
    return sorted(_IMPLEMENTATIONS)


def get(name: str):
    """The grouped matmul called ``name``; ``ValueError`` listing the known names otherwise."""
    try:
        return _IMPLEMENTATIONS[name]
    except KeyError:
        raise ValueError(f"unknown grouped matmul {name!r}; known: {available()}") from None

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
* ``"pallas"`` -- a Triton grouped matmul (GPU; ``_gmm_pallas``): work items
  of ``64`` rows inside one group, items past the real row count return at
  once, so the cost follows the rows the rank received. Placement-invariant
  by construction (one instruction sequence per row). Where the kernel cannot
  run (no GPU, Pallas' Triton backend missing or failing to compile: a
  first-use probe, :func:`moe_eplb_jax._kernels.probed`) ``"dense"`` serves
  instead, with one warning. Checked in interpret mode on CPU
  (``"pallas_interpret"``).

``dense`` and ``ragged_dot`` do not skip work for rows a rank did not
receive: per-rank compute is that of the worst case, whatever the balance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moe_eplb_jax._kernels import probed

__all__ = ["dense", "ragged_dot", "select_own_slot", "slot_of_row", "get", "available"]


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


def dense(x, w, group_sizes):
    """Exact grouped matmul: ``x @ w[s]`` for every slot ``s``, each row keeping its own slot's result."""
    every = jnp.einsum("nk,skm->snm", x, w, preferred_element_type=jnp.float32)
    return select_own_slot(every, group_sizes)


def ragged_dot(x, w, group_sizes):
    """``jax.lax.ragged_dot`` with float32 accumulation (the reference and CPU path)."""
    return jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32)


def _pallas(x, w, group_sizes):
    if not probed("grouped_matmul", _probe_pallas):
        return dense(x, w, group_sizes)
    from moe_eplb_jax.moe import _gmm_pallas

    return _gmm_pallas.grouped_matmul(x, w, group_sizes)


def _probe_pallas() -> bool:
    """Whether the Triton kernel, compiled ahead of time and run outside any trace, matches a float64 product.

    The reference is numpy's: XLA's own float32 matmul runs at TF32 on recent
    GPUs, further from the truth than the kernel's full-precision one.
    """
    from moe_eplb_jax.moe import _gmm_pallas  # raises where Pallas' Triton backend is missing

    rng = np.random.default_rng(0)
    sizes = np.asarray([10, 0, 30], np.int32)  # then 8 padding rows, never compared
    x = rng.standard_normal((48, 32)).astype(np.float32)
    w = rng.standard_normal((3, 32, 32)).astype(np.float32)
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, w, sizes)]
    got = np.asarray(jax.jit(_gmm_pallas.grouped_matmul).lower(*specs).compile()(x, w, sizes))
    slot = np.repeat(np.arange(3), sizes)
    want = np.einsum("nk,nkm->nm", x[:40].astype(np.float64), w[slot].astype(np.float64))
    return np.allclose(got[:40], want, rtol=1e-4, atol=1e-4)


def _pallas_interpret(x, w, group_sizes):
    from moe_eplb_jax.moe import _gmm_pallas

    return _gmm_pallas.grouped_matmul(x, w, group_sizes, interpret=True)


_IMPLEMENTATIONS = {"dense": dense, "ragged_dot": ragged_dot, "pallas": _pallas, "pallas_interpret": _pallas_interpret}


def available() -> list[str]:
    return sorted(_IMPLEMENTATIONS)


def get(name: str):
    """The grouped matmul called ``name``; ``ValueError`` listing the known names otherwise."""
    try:
        return _IMPLEMENTATIONS[name]
    except KeyError:
        raise ValueError(f"unknown grouped matmul {name!r}; known: {available()}") from None

"""Expert computation of the MoE layer: the grouped expert MLP and replica-tied gradients.

* ``expert_mlp`` -- a SwiGLU MLP over rows sorted by local slot, float
  (``w_in [S, D, 2H]``, ``w_out [S, H, D]``, through a ``grouped_matmul``) or
  quantized (``moe_eplb_jax.quant`` pytrees, through a ``quantized_grouped_matmul``
  that reads the packed weights; other ``quant_impl`` values through ``quant.expert_mlp``).
* ``tie_replicas`` -- identity whose gradient sums over an expert's replicas,
  so replicas stay bit-identical through training.
* ``shared_mlp`` / ``waterfill_shared_mlp`` -- the shared expert (weights
  replicated on every rank: ``w_in [D, 2H]``, ``w_out [H, D]``) on each rank's
  own tokens, or, by Waterfill, on the ranks the routed experts left slack
  (the same rows through the same weights: the same outputs, moved work).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moe_eplb_jax import quant
from moe_eplb_jax._kernels import fused_unless_differentiated
from moe_eplb_jax.moe import dispatch as _dispatch
from moe_eplb_jax.moe import grouped_matmul as _gmm
from moe_eplb_jax.moe import quantized_matmul as _qmm
from moe_eplb_jax.routing import waterfill_assign

__all__ = ["expert_mlp", "reads_token_rows", "shared_mlp", "tie_replicas", "waterfill_shared_mlp"]


# ------------------------------------------------------------------ replicas
def tie_replicas(w, phy2log, *, num_logical: int | None = None):
    """Identity on expert weights ``w [P, ...]`` whose gradient is summed over the replicas of each expert.

    Every replica of an expert then gets the same gradient (the expert's
    total) and, from the same optimizer state, the same update: replicas stay
    bit-identical through training, so any replica can serve any token.

    Args:
      w: ``[P, ...]`` weights of the ``P`` physical slots (an array or a pytree of them).
      phy2log: ``[P]`` int32 logical expert of each slot.
      num_logical: the number of logical experts ``E``, when known. ``E == P``
        gives every expert exactly one replica (each has at least one), so there
        is nothing to tie and the gradient passes through untouched.
    """
    if num_logical is not None and (
        isinstance(num_logical, bool) or not isinstance(num_logical, int) or num_logical < 1
    ):
        raise ValueError(f"num_logical must be a positive int or None, got {num_logical!r}")
    untied = lambda leaf: num_logical is not None and num_logical == leaf.shape[0]
    return jax.tree.map(lambda leaf: leaf if untied(leaf) else _tied(leaf, phy2log), w)


@jax.custom_vjp
def _tied(w, phy2log):
    return w


def _tie_fwd(w, phy2log):
    return w, phy2log


def _tie_bwd(phy2log, grad):
    num_logical = grad.shape[0]  # an upper bound on the expert ids held by P slots
    # float32 sums: a bf16 scatter-add rounds per replica and runs as slow atomics
    total = jax.ops.segment_sum(grad.astype(jnp.float32), phy2log, num_segments=num_logical)
    return total[phy2log].astype(grad.dtype), None


_tied.defvjp(_tie_fwd, _tie_bwd)


# ----------------------------------------------------------------- experts
def expert_mlp(
    x,
    experts,
    group_sizes,
    *,
    implementation: str = "auto",
    quant_impl: str = "auto",
    activation_scaling: str = "dynamic",
    axis_name=None,
    row_tokens=None,
):
    """Gated (SwiGLU) MLP of rows grouped by slot.

    Args:
      x: ``[N, D]`` rows sorted by slot; rows past ``sum(group_sizes)`` are padding (zero). With ``row_tokens``:
        ``[T, D]`` tokens, row ``i`` being ``x[row_tokens[i]]``.
      experts: the ``S`` local slots' weights: ``{"w_in": [S, D, 2H], "w_out": [S, H, D]}`` (float), or
        ``{"gate": q [S, H, D], "up": q [S, H, D], "down": q [S, D, H]}`` quantized pytrees of
        ``moe_eplb_jax.quant`` (contraction axis last).
      group_sizes: ``[S]`` int32 rows per slot.
      implementation: a name in ``grouped_matmul.IMPLEMENTATIONS``. Float experts: the grouped matmul
        (``"auto"``: the GPU kernels on a GPU, the exact ``"dense"`` elsewhere). Quantized experts with
        ``quant_impl="auto"``: a ``quantized_grouped_matmul`` per projection, ragged (each row through its own
        slot only) -- the Triton kernel on a GPU (``"auto"``, ``"pallas"``, ``"triton"``, ``"mosaic"``), its
        interpreter for ``"pallas_interpret"``, the exact jnp reference for ``"dense"``, ``"ragged_dot"`` and
        ``"auto"`` off a GPU.
      quant_impl, activation_scaling: quantized experts. ``quant_impl`` other than ``"auto"`` runs
        ``quant.expert_mlp`` with that impl densely (every row through every local slot). Dynamic
        activation scales cover exactly the real rows, max-reduced over ``axis_name``, so they do not
        depend on the placement.
      row_tokens: ``[N]`` int32 token of each row (valid indices for padding rows too), or ``None``. Float
        experts on a Triton backend read the rows from the tokens inside the first kernel (the gate and up
        products and the SwiGLU are one kernel wherever the rows come from, when nothing differentiates the
        call); elsewhere the rows are gathered first.

    Returns:
      ``[N, D]`` in ``x.dtype``; padding rows hold unspecified values.
    """
    if row_tokens is not None and "gate" in experts:
        x = x[row_tokens]
    if "gate" in experts and quant_impl == "auto":
        return _quantized_mlp(x, experts, group_sizes, implementation, activation_scaling, axis_name)
    if "gate" in experts:
        # Each slot sees its own rows and zeros elsewhere: zero rows add nothing to the dynamic activation
        # scales (max|x|), which then cover exactly the real rows, whatever the placement.
        mine = _gmm.slot_of_row(group_sizes, x.shape[0])[None, :] == jnp.arange(group_sizes.shape[0])[:, None]
        every = jnp.where(mine[..., None], x[None], jnp.zeros((), x.dtype))
        y = quant.expert_mlp(
            every,
            experts["gate"],
            experts["up"],
            experts["down"],
            impl=quant_impl,
            activation_scaling=activation_scaling,
            axis_name=axis_name,
            compute_dtype=x.dtype,  # weight-only formats decode to the activations' dtype: float32 stays float32
        )
        return _gmm.select_own_slot(y, group_sizes).astype(x.dtype)
    matmul = _gmm.get(implementation)
    w_in, w_out = experts["w_in"], experts["w_out"]
    hidden = w_out.shape[1]

    def swiglu(x, w_in, group_sizes, row_tokens):
        rows = x if row_tokens is None else x[row_tokens]
        h = matmul(rows, w_in, group_sizes).astype(jnp.float32)  # the gate in float32 whatever the kernel wrote
        return (jax.nn.silu(h[:, :hidden]) * h[:, hidden:]).astype(x.dtype)

    backend = _swiglu_backend(x, w_in, implementation, row_tokens)
    if backend is not None:
        fused = functools.partial(_gmm.swiglu_matmul, backend=backend)
        swiglu = fused_unless_differentiated(fused, swiglu)
    act = swiglu(x, w_in, group_sizes, row_tokens)
    # No masking of the padding rows here: callers never read them (and on XLA:CPU, fusing a mask into
    # the matmul may change how real rows round).
    return matmul(act, w_out, group_sizes).astype(x.dtype)


def _swiglu_backend(x, w_in, implementation: str, row_tokens) -> str | None:
    num_rows = x.shape[0] if row_tokens is None else row_tokens.shape[0]
    if x.dtype != w_in.dtype:
        return None
    tokens = None if row_tokens is None else x.shape[0]
    return _gmm.swiglu_backend(implementation, num_rows, w_in.shape, x.dtype, tokens=tokens)


def reads_token_rows(x, experts, num_rows: int, *, implementation: str = "auto") -> bool:
    """Whether ``expert_mlp(x, experts, ..., row_tokens=[num_rows])`` reads its rows from the tokens inside its
    first kernel (float experts on a kernel that fuses the gather) rather than gathering them first: where it
    does, a caller saves writing and reading the ``[num_rows, D]`` rows."""
    if "w_in" not in experts:  # quantized experts gather first on every path
        return False
    row_tokens = jax.ShapeDtypeStruct((num_rows,), jnp.int32)
    return _swiglu_backend(x, experts["w_in"], implementation, row_tokens) is not None


_QUANTIZED_BACKEND = {"pallas_interpret": "pallas_interpret", "dense": "reference", "ragged_dot": "reference"}


def _quantized_mlp(x, experts, group_sizes, implementation, activation_scaling, axis_name):
    """``down(silu(gate(x)) * up(x))`` ragged: one quantized grouped matmul per projection, float32 between them
    (the down projection's activations quantized or cast from it, as ``quant.expert_mlp`` does)."""
    if implementation not in _gmm.IMPLEMENTATIONS:
        raise ValueError(f"unknown grouped matmul {implementation!r}; known: {_gmm.available()}")
    matmul = functools.partial(
        _qmm.quantized_grouped_matmul,
        group_sizes=group_sizes,
        implementation=_QUANTIZED_BACKEND.get(implementation, "auto"),
        compute_dtype=x.dtype,  # weight-only formats decode to the activations' dtype: float32 stays float32
        activation_scaling=activation_scaling,
        axis_name=axis_name,
    )
    hidden = jax.nn.silu(matmul(x, experts["gate"])) * matmul(x, experts["up"])
    # The kernel rounds its float32 sums to the rows' dtype as it stores them: no float32 [N, D] round trip.
    return matmul(hidden, experts["down"], out_dtype=x.dtype)


# ------------------------------------------------------------ shared expert
def shared_mlp(x, shared, group_sizes=None, *, implementation: str = "auto"):
    """The shared expert on rows ``x [N, D]`` -> ``[N, D]`` in ``x.dtype`` (an ``expert_mlp`` of one slot).

    ``shared``: ``{"w_in": [D, 2H], "w_out": [H, D]}``. ``group_sizes``: ``[1]``
    real rows first (``None``: all ``N``); rows past it hold unspecified values.
    """
    w_in, w_out = shared["w_in"], shared["w_out"]
    if group_sizes is None:
        group_sizes = jnp.full((1,), x.shape[0], jnp.int32)
    rows = x.astype(w_in.dtype)
    y = expert_mlp(rows, {"w_in": w_in[None], "w_out": w_out[None]}, group_sizes, implementation=implementation)
    return y.astype(x.dtype)


def waterfill_shared_mlp(
    x,
    valid,
    routed_rows,
    shared,
    *,
    axis_name,
    num_ranks: int,
    routed_cost: float = 1.0,
    implementation: str = "auto",
    capacity: int | None = None,
):
    """The shared expert by Waterfill, per rank inside ``shard_map`` over the EP axis ``axis_name``.

    Args:
      x: ``[T, D]`` this rank's tokens; ``valid [T]`` bool (padding: computed nowhere, output zero).
      routed_rows: ``[G]`` routed-expert rows each rank computes this pass (the same on every rank).
      shared: the replicated ``{"w_in": [D, 2H], "w_out": [H, D]}``.
      num_ranks: ``G``; ``routed_cost``: a routed row's cost in shared rows (hidden widths' ratio).
      implementation: the grouped matmul of the received rows (``"pallas"``: cost follows them;
        ``"dense"`` computes every row of the round's buffer, ``G * C``).
      capacity: exchange rows per rank pair and round (``moe.dispatch.exchange_apply``: memory linear in
        tokens, never a dropped token; ``None``: one round of the worst case).

    The EP group's valid tokens are poured over the ranks above the routed
    load (``routing.waterfill_assign``, every rank a candidate, own rank
    first): each token's row goes to the rank drawn for it, through the same
    weights, and comes back. Returns ``(out [T, D] in x.dtype, work [G] int32)``:
    the output (the same rows as :func:`shared_mlp`'s for valid tokens) and
    the shared rows each rank computed.
    """
    num_tokens = x.shape[0]
    rank = jax.lax.axis_index(axis_name).astype(jnp.int32)
    total = jax.lax.psum(jnp.sum(valid, dtype=jnp.int32), axis_name)
    candidates = (rank + jnp.arange(num_ranks, dtype=jnp.int32))[None, :] % num_ranks
    dest, work = waterfill_assign(
        jnp.broadcast_to(candidates, (num_tokens, num_ranks)),
        routed_rows.astype(jnp.float32) * jnp.float32(routed_cost),
        token_offset=rank * num_tokens,
        total=total,
        valid=valid,
    )

    def rows_mlp(shared, rows, row_slot):
        mlp = lambda rows, sizes: shared_mlp(rows, shared, sizes, implementation=implementation)
        return _dispatch.apply_by_slot(mlp, rows, row_slot, 1)

    out = _dispatch.exchange_apply(
        rows_mlp,
        shared,
        x,
        dest[:, None],  # one slot per rank: the destination rank is the slot
        jnp.ones((num_tokens, 1), jnp.float32),  # a weight of 1 adds the row unchanged
        slots_per_rank=1,
        axis_name=axis_name,
        num_ranks=num_ranks,
        capacity=capacity,
        out_dtype=x.dtype,
    )
    return out, jax.lax.psum(work, axis_name)

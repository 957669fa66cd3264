"""Expert computation of the MoE layer: the grouped expert MLP and replica-tied gradients.

* ``expert_mlp`` -- a SwiGLU MLP over rows sorted by local slot, float
  (``w_in [S, D, 2H]``, ``w_out [S, H, D]``, through a ``grouped_matmul``) or
  quantized (``moe_eplb_jax.quant`` pytrees, through ``quant.expert_mlp``).
* ``tie_replicas`` -- identity whose gradient sums over an expert's replicas,
  so replicas stay bit-identical through training.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moe_eplb_jax.flax import grouped_matmul as _gmm

__all__ = ["QuantizedExperts", "expert_mlp", "tie_replicas"]


class QuantizedExperts(nnx.Variable):
    """A quantized expert projection (a ``moe_eplb_jax.quant`` pytree, every leaf ``[P, ...]``). Frozen."""


# ------------------------------------------------------------------ replicas
@jax.custom_vjp
def tie_replicas(w, phy2log):
    """Identity on expert weights ``w [P, ...]`` whose gradient is summed over the replicas of each expert.

    Every replica of an expert then gets the same gradient (the expert's
    total) and, from the same optimizer state, the same update: replicas stay
    bit-identical through training, so any replica can serve any token.
    """
    return w


def _tie_fwd(w, phy2log):
    return w, phy2log


def _tie_bwd(phy2log, grad):
    num_logical = grad.shape[0]  # an upper bound on the expert ids held by P slots
    total = jax.ops.segment_sum(grad, phy2log, num_segments=num_logical)
    return total[phy2log], None


tie_replicas.defvjp(_tie_fwd, _tie_bwd)


# ----------------------------------------------------------------- experts
def expert_mlp(
    x,
    experts,
    group_sizes,
    *,
    implementation: str = "dense",
    quant_impl: str = "auto",
    activation_scaling: str = "dynamic",
    axis_name=None,
):
    """Gated (SwiGLU) MLP of rows grouped by slot.

    Args:
      x: ``[N, D]`` rows sorted by slot; rows past ``sum(group_sizes)`` are padding (zero).
      experts: the ``S`` local slots' weights: ``{"w_in": [S, D, 2H], "w_out": [S, H, D]}`` (float), or
        ``{"gate": q [S, H, D], "up": q [S, H, D], "down": q [S, D, H]}`` quantized pytrees of
        ``moe_eplb_jax.quant`` (contraction axis last).
      group_sizes: ``[S]`` int32 rows per slot.
      implementation: float path -- a name in ``grouped_matmul``: ``"dense"`` (exact,
        placement-invariant; the default), ``"pallas"`` (GPU; cost follows the real row
        count; not yet validated on a GPU) or ``"ragged_dot"``. Quantized experts always
        run densely: every row through every local slot's ``quant.expert_mlp``.
      quant_impl, activation_scaling: passed to ``quant.expert_mlp`` (dynamic activation
        scales are max-reduced over ``axis_name``, so they do not depend on the placement).

    Returns:
      ``[N, D]`` in ``x.dtype``; padding rows hold unspecified values.
    """
    if "gate" in experts:
        from moe_eplb_jax import quant

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
        )
        return _gmm.select_own_slot(y, group_sizes).astype(x.dtype)
    matmul = _gmm.get(implementation)
    w_in, w_out = experts["w_in"], experts["w_out"]
    hidden = w_out.shape[1]
    h = matmul(x, w_in, group_sizes)  # float32
    act = (jax.nn.silu(h[:, :hidden]) * h[:, hidden:]).astype(x.dtype)
    # No masking of the padding rows here: callers never read them (and on XLA:CPU, fusing a mask into
    # the matmul may change how real rows round).
    return matmul(act, w_out, group_sizes).astype(x.dtype)


def _gated_mlp(x, w_in, w_out):
    hidden = w_out.shape[0]
    h = jnp.dot(x, w_in, preferred_element_type=jnp.float32)
    act = (jax.nn.silu(h[:, :hidden]) * h[:, hidden:]).astype(x.dtype)
    return jnp.dot(act, w_out, preferred_element_type=jnp.float32).astype(x.dtype)

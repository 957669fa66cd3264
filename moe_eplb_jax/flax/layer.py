"""A reference expert-parallel MoE layer (Flax NNX) with physical expert slots.

Shapes: ``D`` model width, ``H`` expert hidden width, ``E`` logical experts,
``P = E + R`` physical slots, ``G`` EP ranks (the size of the mesh axis
``axis``), ``k`` experts per token, ``S = R + 1`` replicas at most.

The forward pass, per rank of the EP axis (``jax.shard_map``)::

    router logits [T, E] -> top-k logical ids [T, k] + weights [T, k]
    map_and_count(ids, log2phy, logcnt) -> physical ids [T, k] + load [P] (psum over EP)
    dispatch (all_to_all, dropless) -> rows of this rank's P/G slots
    gated MLP per slot (grouped matmul)      -> combine (all_to_all back, sum in router order)

plus an optional shared expert applied to every token. Expert weights are
stored per physical slot, ``w_in [P, D, 2H]`` and ``w_out [P, H, D]``, sharded
over ``axis``; replicas of an expert hold identical bytes. The placement tables
(``phy2log [P]``, ``log2phy [E, S]``, ``logcnt [E]``) are ``EplbTable``
variables -- inputs of the compiled function, never constants in it, so a
rearrangement never recompiles -- and the tokens per slot of every forward
pass are added to the ``ExpertLoad`` variable, which the controller reads.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from moe_eplb_jax.flax import grouped_matmul as _gmm
from moe_eplb_jax.placement import Placement
from moe_eplb_jax.sharding import dispatch as _dispatch

__all__ = ["EplbTable", "ExpertLoad", "QuantizedExperts", "MoELayer", "route", "expert_mlp", "moe_apply", "tie_replicas"]


class EplbTable(nnx.Variable):
    """A placement table of one MoE layer (int32). Not a parameter: optimizers skip it."""


class QuantizedExperts(nnx.Variable):
    """A quantized expert projection (a ``moe_eplb_jax.quant`` pytree, every leaf ``[P, ...]``). Frozen."""


class ExpertLoad(nnx.Variable):
    """Tokens routed to each physical slot ``[P]`` (int32) since the controller last read it."""


def _map_and_count(*args, **kwargs):
    from moe_eplb_jax.pallas import map_and_count  # resolved at call time: the kernel package is optional here

    return map_and_count(*args, **kwargs)


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


# --------------------------------------------------------------------- router
def route(x, router_w, *, top_k: int, num_groups: int = 1, topk_groups: int | None = None, bias=None):
    """Softmax top-k routing, optionally group-limited (DeepSeek-V3 style).

    Args:
      x: ``[T, D]`` tokens.
      router_w: ``[D, E]`` router weights.
      top_k: experts per token.
      num_groups: expert groups (``E`` divisible by it); with ``topk_groups``
        set, a token picks its experts only from its ``topk_groups`` groups with
        the highest best-expert score.
      bias: optional ``[E]`` added to the router logits.

    Returns:
      ``(ids [T, k] int32, weights [T, k] float32)`` -- weights renormalised to sum to 1.
    """
    num_experts = router_w.shape[1]
    logits = jnp.dot(x.astype(jnp.float32), router_w.astype(jnp.float32))
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)[None, :]
    scores = jax.nn.softmax(logits, axis=-1)
    if topk_groups is not None and topk_groups < num_groups:
        per_group = scores.reshape(scores.shape[0], num_groups, num_experts // num_groups)
        _, keep = jax.lax.top_k(per_group.max(-1), topk_groups)  # [T, topk_groups]
        group_mask = (keep[:, :, None] == jnp.arange(num_groups)[None, None, :]).any(1)  # [T, groups]
        mask = jnp.repeat(group_mask, num_experts // num_groups, axis=1)
        scores = jnp.where(mask, scores, -1.0)  # below any softmax score: never picked
    top, ids = jax.lax.top_k(scores, top_k)
    weights = top / top.sum(-1, keepdims=True)
    return ids.astype(jnp.int32), weights


# ----------------------------------------------------------------- experts
def expert_mlp(x, experts, group_sizes, *, implementation: str = "dense", quant_impl: str = "auto",
               activation_scaling: str = "dynamic", axis_name=None):
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
        y = quant.expert_mlp(every, experts["gate"], experts["up"], experts["down"], impl=quant_impl,
                             activation_scaling=activation_scaling, axis_name=axis_name)
        return _gmm.select_own_slot(y, group_sizes).astype(x.dtype)
    matmul = _gmm.get(implementation)
    w_in, w_out = experts["w_in"], experts["w_out"]
    hidden = w_out.shape[1]
    h = matmul(x, w_in, group_sizes)  # float32
    act = (jax.nn.silu(h[:, :hidden]) * h[:, hidden:]).astype(x.dtype)
    # No masking of the padding rows here: callers never read them (and on XLA:CPU, fusing a mask into
    # the matmul may change how real rows round).
    return matmul(act, w_out, group_sizes).astype(x.dtype)


# ----------------------------------------------------------------- forward
def moe_apply(
    x,
    router_w,
    router_bias,
    experts,
    log2phy,
    logcnt,
    *,
    top_k: int,
    mesh: jax.sharding.Mesh,
    axis: str = "ep",
    num_groups: int = 1,
    topk_groups: int | None = None,
    routing: str = "hash",
    matmul: str = "dense",
    map_implementation: str | None = None,
    quant_impl: str = "auto",
    activation_scaling: str = "dynamic",
):
    """The routed-expert part of the layer as a pure function.

    Args:
      x: ``[T, D]`` tokens, ``T`` divisible by ``G``; sharded (or resharded) over ``axis``.
      router_w: ``[D, E]``; ``router_bias [E]``.
      experts: expert weights with leading ``[P]`` slot axes sharded over ``axis``
        (see ``expert_mlp``: float ``w_in``/``w_out`` or quantized ``gate``/``up``/``down``).
      log2phy: ``[E, S]`` int32 (-1 padded); ``logcnt [E]`` int32.

    Returns:
      ``(out [T, D] in x.dtype, load [P] int32)`` -- load counts every token's
      ``k`` assignments per physical slot, summed over the EP axis.
    """
    num_ranks = mesh.shape[axis]
    num_physical = jax.tree.leaves(experts)[0].shape[0]
    slots_per_rank = num_physical // num_ranks

    def per_rank(x, router_w, router_bias, experts, log2phy, logcnt):
        ids, weights = route(
            x, router_w, top_k=top_k, num_groups=num_groups, topk_groups=topk_groups, bias=router_bias
        )
        physical, load = _map_and_count(
            ids, log2phy, logcnt, num_physical=num_physical, mode=routing, implementation=map_implementation
        )
        load = jax.lax.psum(load.astype(jnp.int32), axis)
        rows, row_slot, plan = _dispatch.dispatch(
            x, physical, slots_per_rank=slots_per_rank, axis_name=axis, num_ranks=num_ranks
        )
        order, group_sizes = _dispatch.sort_by_slot(row_slot, slots_per_rank)
        y = expert_mlp(rows[order], experts, group_sizes, implementation=matmul, quant_impl=quant_impl,
                       activation_scaling=activation_scaling, axis_name=axis)
        y = _dispatch.unsort(y, order)
        return _dispatch.combine(y, plan, weights, axis_name=axis, out_dtype=x.dtype), load

    sharded = PS(axis)
    return jax.shard_map(
        per_rank,
        mesh=mesh,
        in_specs=(sharded, PS(), PS(), sharded, PS(), PS()),
        out_specs=(sharded, PS()),
        # The Pallas map_and_count (GPU) declares outputs without a varying-axes type; jax 0.11
        # rejects that under check_vma=True.
        check_vma=False,
    )(x, router_w, router_bias, experts, log2phy, logcnt)


def _gated_mlp(x, w_in, w_out):
    hidden = w_out.shape[0]
    h = jnp.dot(x, w_in, preferred_element_type=jnp.float32)
    act = (jax.nn.silu(h[:, :hidden]) * h[:, hidden:]).astype(x.dtype)
    return jnp.dot(act, w_out, preferred_element_type=jnp.float32).astype(x.dtype)


def _put(value, mesh, spec):
    value = np.asarray(value)
    sharding = NamedSharding(mesh, spec)
    # make_array_from_callback works alike in one process and under jax.distributed.
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


# -------------------------------------------------------------------- module
class MoELayer(nnx.Module):
    """Expert-parallel MoE layer with ``P`` physical slots (see the module docstring).

    Args:
      dim: model width ``D``.
      hidden: expert hidden width ``H`` (gated MLP: ``w_in [P, D, 2H]``, ``w_out [P, H, D]``).
      num_experts: logical experts ``E``.
      top_k: experts per token.
      mesh: the device mesh; ``axis`` names its EP axis (``G`` ranks, ``P % G == 0``).
      num_physical: ``P`` (default ``E``: no redundant slots).
      num_groups, topk_groups: group-limited routing (``topk_groups=None``: plain top-k).
      shared_hidden: width of a shared expert applied to every token (0: none).
      dtype: activation and expert-weight dtype (e.g. ``jnp.bfloat16``).
      routing: replica routing mode for ``map_and_count`` (``"hash"``...).
      matmul: grouped matmul implementation (``"dense"``, ``"pallas"``, ``"ragged_dot"``).
      map_implementation: ``map_and_count`` implementation (None: its default).
      rngs: ``nnx.Rngs`` for the initial weights.

    Replicas start with identical weights: slot ``p`` holds expert ``p mod E``.
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        num_experts: int,
        top_k: int,
        *,
        mesh: jax.sharding.Mesh,
        axis: str = "ep",
        num_physical: int | None = None,
        num_groups: int = 1,
        topk_groups: int | None = None,
        shared_hidden: int = 0,
        dtype: Any = jnp.float32,
        routing: str = "hash",
        matmul: str = "dense",
        map_implementation: str | None = None,
        rngs: nnx.Rngs,
    ):
        num_physical = num_experts if num_physical is None else num_physical
        if min(dim, hidden, num_experts, top_k) < 1:
            raise ValueError(f"dim, hidden, num_experts, top_k must be positive, got {dim}, {hidden}, {num_experts}, {top_k}")
        if top_k > num_experts:
            raise ValueError(f"top_k={top_k} is larger than num_experts={num_experts}")
        if axis not in mesh.shape:
            raise ValueError(f"mesh has no axis {axis!r}; its axes are {tuple(mesh.shape)}")
        if num_physical < num_experts or num_physical % mesh.shape[axis]:
            raise ValueError(
                f"num_physical={num_physical} must be >= num_experts={num_experts} and divisible by the "
                f"EP size {mesh.shape[axis]} of mesh axis {axis!r}"
            )
        if num_experts % num_groups:
            raise ValueError(f"num_experts={num_experts} is not divisible by num_groups={num_groups}")
        if topk_groups is not None and not 1 <= topk_groups <= num_groups:
            raise ValueError(f"topk_groups={topk_groups} must be in [1, num_groups={num_groups}]")
        if topk_groups is not None and topk_groups * (num_experts // num_groups) < top_k:
            raise ValueError(f"topk_groups={topk_groups} groups hold fewer than top_k={top_k} experts")
        _gmm.get(matmul)  # validates the name
        self.mesh, self.axis = mesh, axis
        self.top_k, self.num_groups, self.topk_groups = top_k, num_groups, topk_groups
        self.routing, self.matmul, self.map_implementation = routing, matmul, map_implementation
        self.num_experts, self.num_physical = num_experts, num_physical
        self.quant_format, self.quant_impl, self.activation_scaling = None, "auto", "dynamic"

        keys = [rngs.params() for _ in range(5)]
        placement = Placement.linear(1, num_experts, num_physical)
        phy2log = placement.phy2log[0]
        w_in = jax.random.normal(keys[0], (num_experts, dim, 2 * hidden), jnp.float32) * dim**-0.5
        w_out = jax.random.normal(keys[1], (num_experts, hidden, dim), jnp.float32) * hidden**-0.5
        slots = NamedSharding(mesh, PS(axis))
        self.router = nnx.Param(_put(np.asarray(jax.random.normal(keys[2], (dim, num_experts)) * dim**-0.5), mesh, PS()))
        self.router_bias = nnx.Param(_put(np.zeros(num_experts, np.float32), mesh, PS()))
        self.w_in = nnx.Param(_put(np.asarray(w_in.astype(dtype))[phy2log], mesh, slots.spec))
        self.w_out = nnx.Param(_put(np.asarray(w_out.astype(dtype))[phy2log], mesh, slots.spec))
        if shared_hidden:
            s_in = jax.random.normal(keys[3], (dim, 2 * shared_hidden), jnp.float32) * dim**-0.5
            s_out = jax.random.normal(keys[4], (shared_hidden, dim), jnp.float32) * shared_hidden**-0.5
            self.shared_in = nnx.Param(_put(np.asarray(s_in.astype(dtype)), mesh, PS()))
            self.shared_out = nnx.Param(_put(np.asarray(s_out.astype(dtype)), mesh, PS()))
        else:
            self.shared_in = self.shared_out = None
        self.phy2log = EplbTable(_put(placement.phy2log[0], mesh, PS()))
        self.log2phy = EplbTable(_put(placement.log2phy[0], mesh, PS()))
        self.logcnt = EplbTable(_put(placement.logcnt[0], mesh, PS()))
        self.expert_load = ExpertLoad(_put(np.zeros(num_physical, np.int32), mesh, PS()))

    def __call__(self, x):
        """``x [..., D]`` (leading sizes multiply to a multiple of ``G``) -> ``[..., D]``."""
        lead, dim = x.shape[:-1], x.shape[-1]
        tokens = x.reshape(-1, dim)
        if tokens.shape[0] % self.mesh.shape[self.axis]:
            raise ValueError(
                f"{tokens.shape[0]} tokens are not divisible by the EP size {self.mesh.shape[self.axis]}"
            )
        phy2log = self.phy2log.get_value()
        if self.quant_format is None:
            experts = {name: tie_replicas(var.get_value(), phy2log) for name, var in self.eplb_expert_variables().items()}
        else:  # quantized experts are frozen (serving): nothing to tie
            experts = {name: var.get_value() for name, var in self.eplb_expert_variables().items()}
        out, load = moe_apply(
            tokens, self.router.get_value(), self.router_bias.get_value(), experts,
            self.log2phy.get_value(), self.logcnt.get_value(),
            top_k=self.top_k, mesh=self.mesh, axis=self.axis, num_groups=self.num_groups,
            topk_groups=self.topk_groups, routing=self.routing, matmul=self.matmul,
            map_implementation=self.map_implementation, quant_impl=self.quant_impl,
            activation_scaling=self.activation_scaling,
        )
        self.expert_load.set_value(self.expert_load.get_value() + load)
        if self.shared_in is not None:
            shared_in, shared_out = self.shared_in.get_value(), self.shared_out.get_value()
            out = out + _gated_mlp(tokens.astype(shared_in.dtype), shared_in, shared_out).astype(out.dtype)
        return out.reshape(*lead, dim)

    # ------------------------------------------------- the EPLB protocol
    def eplb_num_logical_experts(self) -> int:
        return self.num_experts

    def eplb_expert_variables(self) -> dict[str, nnx.Variable]:
        if self.quant_format is None:
            return {"w_in": self.w_in, "w_out": self.w_out}
        return {"gate": self.q_gate, "up": self.q_up, "down": self.q_down}

    # ------------------------------------------------------ quantization
    def quantize(self, fmt: str, *, impl: str = "auto", activation_scaling: str = "dynamic") -> None:
        """Replaces the float expert weights by quantized ones (serving; e.g. ``"fp8"``, ``"mxfp4"``).

        Every slot is quantized on its own, so replicas stay bit-identical.
        ``impl`` and ``activation_scaling`` go to ``moe_eplb_jax.quant.expert_mlp``;
        dynamic activation scales are max-reduced over the EP axis. The
        quantized pytrees (weights and scales, all ``[P, ...]``) are what the
        controller moves.
        """
        from moe_eplb_jax import quant

        if self.quant_format is not None:
            raise ValueError(f"layer is already quantized ({self.quant_format!r})")
        if fmt not in quant.FORMATS:
            raise ValueError(f"unknown quantized format {fmt!r}; known: {sorted(quant.FORMATS)}")
        if impl not in quant.IMPLS:
            raise ValueError(f"unknown quant impl {impl!r}; known: {list(quant.IMPLS)}")
        hidden = self.w_out.get_value().shape[1]
        w_in = np.asarray(self.w_in.get_value(), np.float32)
        w_out = np.asarray(self.w_out.get_value(), np.float32)
        # quant wants the contraction axis last: gate/up [P, H, D], down [P, D, H].
        gate = np.ascontiguousarray(np.swapaxes(w_in[:, :, :hidden], 1, 2))
        up = np.ascontiguousarray(np.swapaxes(w_in[:, :, hidden:], 1, 2))
        down = np.ascontiguousarray(np.swapaxes(w_out, 1, 2))
        q = quant.quantize_mlp(jnp.asarray(gate), jnp.asarray(up), jnp.asarray(down), fmt)
        slots = PS(self.axis)
        placed = [jax.tree.map(lambda leaf: _put(np.asarray(leaf), self.mesh, slots), t) for t in q]
        self.q_gate, self.q_up, self.q_down = (QuantizedExperts(t) for t in placed)
        self.w_in = self.w_out = None
        self.quant_format, self.quant_impl, self.activation_scaling = fmt, impl, activation_scaling

    def eplb_load_variable(self) -> nnx.Variable:
        return self.expert_load

    def eplb_get_placement(self):
        return self.phy2log.get_value(), self.log2phy.get_value(), self.logcnt.get_value()

    def eplb_set_placement(self, phy2log, log2phy, logcnt) -> None:
        for var, value in ((self.phy2log, phy2log), (self.log2phy, log2phy), (self.logcnt, logcnt)):
            if tuple(np.shape(value)) != tuple(var.get_value().shape):
                raise ValueError(f"placement table must have shape {tuple(var.get_value().shape)}, got {np.shape(value)}")
        self.phy2log.set_value(_put(np.asarray(phy2log, np.int32), self.mesh, PS()))
        self.log2phy.set_value(_put(np.asarray(log2phy, np.int32), self.mesh, PS()))
        self.logcnt.set_value(_put(np.asarray(logcnt, np.int32), self.mesh, PS()))

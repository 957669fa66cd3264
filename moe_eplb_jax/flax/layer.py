"""A reference expert-parallel MoE layer (Flax NNX) with physical expert slots.

Shapes: ``D`` model width, ``H`` expert hidden width, ``E`` logical experts,
``P = E + R`` physical slots, ``G`` EP ranks (the size of the mesh axis
``axis``), ``k`` experts per token, ``S = R + 1`` replicas at most.

The forward pass, per rank of the EP axis (``jax.shard_map``)::

    router logits [T, E] -> top-k logical ids [T, k] + weights [T, k]
    map_and_count(ids, log2phy, logcnt) -> physical ids [T, k] + this rank's load [P]
    dispatch (all_to_all, dropless) -> rows of this rank's P/G slots
    gated MLP per slot (grouped matmul)      -> combine (all_to_all back, sum in router order)

plus an optional shared expert applied to every token. Expert weights are
stored per physical slot, ``w_in [P, D, 2H]`` and ``w_out [P, H, D]``, sharded
over ``axis`` (or, after ``MoELayer.quantize(fmt)``, quantized pytrees of
``moe_eplb_jax.quant``); replicas of an expert hold identical bytes, and in
training ``tie_replicas`` gives every replica the expert's summed gradient so
they stay identical. The placement tables
(``phy2log [P]``, ``log2phy [E, S]``, ``logcnt [E]``, and ``route_lookup``,
the Pallas kernel's lookup table of them, rebuilt whenever they change so no
forward pass rebuilds it) are ``EplbTable`` variables -- inputs of the
compiled function, never constants in it, so a rearrangement never
recompiles -- and the tokens per slot of every forward
pass are added to the ``ExpertLoad`` variable, which the controller reads.

Loads are not summed over the EP axis in the forward pass (``load_reduce=
"none"``, the default): each rank adds its own counts to its row of a
``[G, P]`` load sharded over ``axis``, so the step has no collective for
them; the controller sums the rows when it reads its window (at
rearrangement or logging). ``load_reduce="psum"`` gives the replicated
``[P]`` total every pass instead, at one small all-reduce per layer per pass.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from moe_eplb_jax.flax import grouped_matmul as _gmm
from moe_eplb_jax.flax.experts import QuantizedExperts, _gated_mlp, expert_mlp, tie_replicas
from moe_eplb_jax.pallas import lookup_table, map_and_count
from moe_eplb_jax.placement import Placement
from moe_eplb_jax.sharding import dispatch as _dispatch
from moe_eplb_jax.sharding.mesh import put_host

__all__ = [
    "EplbTable",
    "ExpertLoad",
    "QuantizedExperts",
    "MoELayer",
    "ROUTER_SCORINGS",
    "route",
    "expert_mlp",
    "moe_apply",
    "tie_replicas",
]


class EplbTable(nnx.Variable):
    """A placement table of one MoE layer (int32). Not a parameter: optimizers skip it."""


class ExpertLoad(nnx.Variable):
    """Tokens routed to each physical slot since the controller last read it (int32).

    ``[G, P]`` (row ``g``: counted on EP rank ``g``; sharded over the EP axis)
    with ``load_reduce="none"``, ``[P]`` (replicated) with ``"psum"``.
    """


def _map_and_count(*args, **kwargs):
    return map_and_count(*args, **kwargs)  # one indirection: tests may swap the kernel


LOAD_REDUCTIONS = ("none", "psum")


# --------------------------------------------------------------------- router
ROUTER_SCORINGS = ("softmax", "sigmoid")


def route(
    x,
    router_w,
    *,
    top_k: int,
    num_groups: int = 1,
    topk_groups: int | None = None,
    bias=None,
    scoring: str = "softmax",
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
):
    """Top-k routing in the two styles of released MoE models.

    ``scoring="softmax"`` (Qwen3-MoE; group-limited as DeepSeek-V2): scores
    are ``softmax(logits + bias)``; a group's score is its best expert's.
    ``scoring="sigmoid"`` (DeepSeek-V3): scores are ``sigmoid(logits)``;
    ``bias`` (the checkpoint's ``e_score_correction_bias``) is added for the
    choice of experts only, a group's score is the sum of its two best biased
    scores, and the weights come from the unbiased scores.

    Args:
      x: ``[T, D]`` tokens.
      router_w: ``[D, E]`` router weights.
      top_k: experts per token.
      num_groups: expert groups (``E`` divisible by it); with ``topk_groups``
        set, a token picks its experts only from its ``topk_groups`` groups
        with the highest group score.
      bias: optional ``[E]`` router bias (see ``scoring``).
      renormalize: divide the ``k`` weights by their sum (Qwen3's
        ``norm_topk_prob``; DeepSeek-V3 sets it).
      routed_scaling_factor: multiplies the weights after renormalisation
        (DeepSeek-V3: 2.5).

    Returns:
      ``(ids [T, k] int32, weights [T, k] float32)``.
    """
    if scoring not in ROUTER_SCORINGS:
        raise ValueError(f"scoring must be one of {ROUTER_SCORINGS}, got {scoring!r}")
    num_experts = router_w.shape[1]
    logits = jnp.dot(x.astype(jnp.float32), router_w.astype(jnp.float32))
    bias = None if bias is None else bias.astype(jnp.float32)[None, :]
    if scoring == "softmax":
        scores = jax.nn.softmax(logits if bias is None else logits + bias, axis=-1)
        choice = scores
    else:
        scores = jax.nn.sigmoid(logits)
        choice = scores if bias is None else scores + bias
    if topk_groups is not None and topk_groups < num_groups:
        per_group = choice.reshape(choice.shape[0], num_groups, num_experts // num_groups)
        if scoring == "softmax":
            group_score = per_group.max(-1)
        else:
            group_score = jax.lax.top_k(per_group, min(2, per_group.shape[-1]))[0].sum(-1)
        _, keep = jax.lax.top_k(group_score, topk_groups)  # [T, topk_groups]
        group_mask = (keep[:, :, None] == jnp.arange(num_groups)[None, None, :]).any(1)  # [T, groups]
        mask = jnp.repeat(group_mask, num_experts // num_groups, axis=1)
        choice = jnp.where(mask, choice, -jnp.inf)  # never picked
    _, ids = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdims=True) + jnp.float32(1e-20))
    if routed_scaling_factor != 1.0:
        weights = weights * jnp.float32(routed_scaling_factor)
    return ids.astype(jnp.int32), weights


# ----------------------------------------------------------------- forward
def moe_apply(
    x,
    router_w,
    router_bias,
    experts,
    log2phy,
    logcnt,
    valid=None,
    record=True,
    *,
    top_k: int,
    mesh: jax.sharding.Mesh,
    axis: str = "ep",
    num_groups: int = 1,
    topk_groups: int | None = None,
    scoring: str = "softmax",
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    routing: str = "hash",
    matmul: str = "dense",
    map_implementation: str | None = None,
    quant_impl: str = "auto",
    activation_scaling: str = "dynamic",
    capacity_factor: float | None = None,
    load_reduce: str = "none",
    lookup=None,
):
    """The routed-expert part of the layer as a pure function.

    Args:
      x: ``[T, D]`` tokens, ``T`` divisible by ``G``; sharded (or resharded) over ``axis``.
      router_w: ``[D, E]``; ``router_bias [E]``.
      num_groups, topk_groups, scoring, renormalize, routed_scaling_factor:
        the router style, see ``route``.
      experts: expert weights with leading ``[P]`` slot axes sharded over ``axis``
        (see ``expert_mlp``: float ``w_in``/``w_out`` or quantized ``gate``/``up``/``down``).
      log2phy: ``[E, S]`` int32 (-1 padded); ``logcnt [E]`` int32.
      lookup: optional ``moe_eplb_jax.pallas.lookup_table(log2phy, logcnt)``,
        kept with the placement so the Pallas ``map_and_count`` does not
        rebuild it every pass (``map_and_count(lookup=...)``).
      valid: optional ``[T]`` bool, sharded like ``x``: ``False`` marks padding
        (an unused cache position, a finished request), which is neither sent
        to an expert nor counted; its routed output is zero. ``None``: every
        token is real.
      record: count the load (a Python or traced bool; ``False`` gives a zero
        load, e.g. for a warm-up pass, without recompiling).
      capacity_factor: ``None`` exchanges the worst-case buffer in one
        ``all_to_all``; a factor ``f`` exchanges it in rounds of
        ``ceil(f * A / G)`` rows per rank pair (``A = T_rank * k``), as many as
        the fullest pair needs: about ``f / G`` of the bytes when balanced, still
        dropless, same results.
      load_reduce: ``"none"`` (default): no collective for the load; each rank
        returns its own counts, ``load [G, P]`` sharded over ``axis`` (row
        ``g``: the assignments of rank ``g``'s tokens), to be summed over ``G``
        when read (``load.sum(0)``; ``EplbController`` does it at
        rearrangement). ``"psum"``: ``load [P]``, summed over the EP axis in
        the step (one all-reduce of ``P`` ints), replicated.

    Returns:
      ``(out [T, D] in x.dtype, load int32)`` -- load counts every valid
      token's ``k`` assignments per physical slot: ``[G, P]`` per rank or
      ``[P]`` summed, as ``load_reduce`` says.
    """
    if load_reduce not in LOAD_REDUCTIONS:
        raise ValueError(f"load_reduce must be one of {LOAD_REDUCTIONS}, got {load_reduce!r}")
    _check_apply(x, router_w, router_bias, experts, log2phy, logcnt, top_k=top_k, mesh=mesh, axis=axis)
    num_ranks = mesh.shape[axis]
    num_physical = jax.tree.leaves(experts)[0].shape[0]
    slots_per_rank = num_physical // num_ranks
    capacity = _capacity(x.shape[0] // num_ranks * top_k, num_ranks, capacity_factor)
    valid = _check_valid(valid, x.shape[0])
    record = jnp.asarray(record)
    if record.shape != () or record.dtype != jnp.bool_:
        raise ValueError(f"record must be a boolean scalar, got shape {record.shape} dtype {record.dtype}")

    def per_rank(x, router_w, router_bias, experts, log2phy, logcnt, valid, record, lookup):
        ids, weights = route(
            x,
            router_w,
            top_k=top_k,
            num_groups=num_groups,
            topk_groups=topk_groups,
            bias=router_bias,
            scoring=scoring,
            renormalize=renormalize,
            routed_scaling_factor=routed_scaling_factor,
        )
        # map_and_count neither maps nor counts an id outside [0, E): padding goes nowhere.
        ids = jnp.where(valid[:, None], ids, jnp.int32(-1))
        physical, load = _map_and_count(
            ids,
            log2phy,
            logcnt,
            num_physical=num_physical,
            record=record,
            mode=routing,
            implementation=map_implementation,
            lookup=lookup,
        )
        load = load.astype(jnp.int32)
        load = jax.lax.psum(load, axis) if load_reduce == "psum" else load[None]
        out = _routed_experts(
            x,
            physical,
            weights,
            experts,
            axis=axis,
            num_ranks=num_ranks,
            slots_per_rank=slots_per_rank,
            capacity=capacity,
            matmul=matmul,
            quant_impl=quant_impl,
            activation_scaling=activation_scaling,
        )
        return out, load

    sharded = PS(axis)
    return jax.shard_map(
        per_rank,
        mesh=mesh,
        in_specs=(sharded, PS(), PS(), sharded, PS(), PS(), sharded, PS(), PS()),
        out_specs=(sharded, PS() if load_reduce == "psum" else sharded),
        # The Pallas map_and_count (GPU) declares outputs without a varying-axes type; jax 0.11
        # rejects that under check_vma=True.
        check_vma=False,
    )(x, router_w, router_bias, experts, log2phy, logcnt, valid, record, lookup)


def _check_valid(valid, num_tokens: int):
    """``valid`` as a ``[T]`` bool array (all ``True`` for ``None``)."""
    if valid is None:
        return jnp.ones((num_tokens,), jnp.bool_)
    valid = jnp.asarray(valid)
    if valid.shape != (num_tokens,) or valid.dtype != jnp.bool_:
        raise ValueError(
            f"valid must be a [T] = ({num_tokens},) bool mask, got shape {valid.shape} dtype {valid.dtype}"
        )
    return valid


def _routed_experts(
    x, physical, weights, experts, *, axis, num_ranks, slots_per_rank, capacity, matmul, quant_impl, activation_scaling
):
    """Per rank, inside ``shard_map``: dispatch by physical slot -> grouped expert MLP -> combine.

    Separate from ``moe_apply``'s routing so that ``benchmarks/moe_step.py``
    can time the same exchange and compute with the EPLB mapping and counting
    left out.
    """
    rows, row_slot, plan = _dispatch.dispatch(
        x, physical, slots_per_rank=slots_per_rank, axis_name=axis, num_ranks=num_ranks, capacity=capacity
    )
    order, group_sizes = _dispatch.sort_by_slot(row_slot, slots_per_rank)
    y = expert_mlp(
        rows[order],
        experts,
        group_sizes,
        implementation=matmul,
        quant_impl=quant_impl,
        activation_scaling=activation_scaling,
        axis_name=axis,
    )
    y = _dispatch.unsort(y, order)
    return _dispatch.combine(y, plan, weights, axis_name=axis, out_dtype=x.dtype, capacity=capacity)


def _capacity(num_assign: int, num_ranks: int, factor: float | None) -> int | None:
    if factor is None:
        return None
    if not factor > 0:
        raise ValueError(f"capacity_factor must be positive or None, got {factor}")
    return int(min(num_assign, max(1, -(-int(np.ceil(factor * num_assign)) // num_ranks))))


def _check_apply(x, router_w, router_bias, experts, log2phy, logcnt, *, top_k, mesh, axis):
    if axis not in mesh.shape:
        raise ValueError(f"mesh has no axis {axis!r}; its axes are {tuple(mesh.shape)}")
    num_ranks = mesh.shape[axis]
    if x.ndim != 2 or x.shape[0] % num_ranks:
        raise ValueError(f"x must have shape [T, D] with T divisible by the EP size {num_ranks}, got {x.shape}")
    if router_w.ndim != 2 or router_w.shape[0] != x.shape[1]:
        raise ValueError(f"router_w must have shape [D={x.shape[1]}, E], got {router_w.shape}")
    num_logical = router_w.shape[1]
    if router_bias.shape != (num_logical,):
        raise ValueError(f"router_bias must have shape [E]=({num_logical},), got {router_bias.shape}")
    if not 1 <= top_k <= num_logical:
        raise ValueError(f"top_k={top_k} must be in [1, E={num_logical}]")
    leaves = jax.tree.leaves(experts)
    if not leaves or len({leaf.shape[0] for leaf in leaves}) != 1:
        raise ValueError("experts must be a non-empty pytree whose leaves share a leading [P] slot axis")
    num_physical = leaves[0].shape[0]
    if num_physical < num_logical or num_physical % num_ranks:
        raise ValueError(f"P={num_physical} slots must be >= E={num_logical} and divisible by the EP size {num_ranks}")
    width = num_physical - num_logical + 1
    if log2phy.shape != (num_logical, width) or logcnt.shape != (num_logical,):
        raise ValueError(
            f"log2phy must have shape [E, P - E + 1]=({num_logical}, {width}) and logcnt [E]=({num_logical},), "
            f"got {log2phy.shape} and {logcnt.shape}"
        )


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
      scoring, renormalize, routed_scaling_factor: the router style (see
        ``route``): ``"softmax"`` (Qwen3-MoE; ``router_bias`` is added to the
        logits) or ``"sigmoid"`` (DeepSeek-V3; ``router_bias`` is the
        score-correction bias, used to choose experts only).
      shared_hidden: width of a shared expert applied to every token (0: none).
      dtype: activation and expert-weight dtype (e.g. ``jnp.bfloat16``).
      routing: replica routing mode for ``map_and_count`` (``"hash"``...).
      matmul: grouped matmul implementation (``"dense"``, ``"pallas"``, ``"ragged_dot"``).
      map_implementation: ``map_and_count`` implementation (None: its default).
      capacity_factor: exchange tokens in rounds of this factor times the
        balanced share (``None``: one worst-case exchange); see ``moe_apply``.
      load_reduce: ``"none"`` (default): ``expert_load`` is ``[G, P]``, each
        rank adding its own counts to its row, no collective in the step (the
        controller sums the rows when it reads them); ``"psum"``: ``[P]``,
        summed over the EP axis every forward pass (replicated: readable
        directly after each pass, at one small all-reduce per pass).
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
        scoring: str = "softmax",
        renormalize: bool = True,
        routed_scaling_factor: float = 1.0,
        shared_hidden: int = 0,
        dtype: Any = jnp.float32,
        routing: str = "hash",
        matmul: str = "dense",
        map_implementation: str | None = None,
        capacity_factor: float | None = None,
        load_reduce: str = "none",
        rngs: nnx.Rngs,
    ):
        num_physical = num_experts if num_physical is None else num_physical
        if min(dim, hidden, num_experts, top_k) < 1:
            raise ValueError(
                f"dim, hidden, num_experts, top_k must be positive, got {dim}, {hidden}, {num_experts}, {top_k}"
            )
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
        if scoring not in ROUTER_SCORINGS:
            raise ValueError(f"scoring must be one of {ROUTER_SCORINGS}, got {scoring!r}")
        if not (np.isfinite(routed_scaling_factor) and routed_scaling_factor > 0):
            raise ValueError(f"routed_scaling_factor must be positive and finite, got {routed_scaling_factor!r}")
        _gmm.get(matmul)  # validates the name
        _capacity(1, 1, capacity_factor)  # validates the factor
        if load_reduce not in LOAD_REDUCTIONS:
            raise ValueError(f"load_reduce must be one of {LOAD_REDUCTIONS}, got {load_reduce!r}")
        self.capacity_factor, self.load_reduce = capacity_factor, load_reduce
        self.mesh, self.axis = mesh, axis
        self.top_k, self.num_groups, self.topk_groups = top_k, num_groups, topk_groups
        self.scoring, self.renormalize = scoring, bool(renormalize)
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.routing, self.matmul, self.map_implementation = routing, matmul, map_implementation
        self.num_experts, self.num_physical = num_experts, num_physical
        self.quant_format, self.quant_impl, self.activation_scaling = None, "auto", "dynamic"

        keys = [rngs.params() for _ in range(5)]
        placement = Placement.linear(1, num_experts, num_physical)
        phy2log = placement.phy2log[0]
        w_in = jax.random.normal(keys[0], (num_experts, dim, 2 * hidden), jnp.float32) * dim**-0.5
        w_out = jax.random.normal(keys[1], (num_experts, hidden, dim), jnp.float32) * hidden**-0.5
        slots = NamedSharding(mesh, PS(axis))
        self.router = nnx.Param(
            put_host(np.asarray(jax.random.normal(keys[2], (dim, num_experts)) * dim**-0.5), mesh, PS())
        )
        self.router_bias = nnx.Param(put_host(np.zeros(num_experts, np.float32), mesh, PS()))
        self.w_in = nnx.Param(put_host(np.asarray(w_in.astype(dtype))[phy2log], mesh, slots.spec))
        self.w_out = nnx.Param(put_host(np.asarray(w_out.astype(dtype))[phy2log], mesh, slots.spec))
        if shared_hidden:
            s_in = jax.random.normal(keys[3], (dim, 2 * shared_hidden), jnp.float32) * dim**-0.5
            s_out = jax.random.normal(keys[4], (shared_hidden, dim), jnp.float32) * shared_hidden**-0.5
            self.shared_in = nnx.Param(put_host(np.asarray(s_in.astype(dtype)), mesh, PS()))
            self.shared_out = nnx.Param(put_host(np.asarray(s_out.astype(dtype)), mesh, PS()))
        else:
            self.shared_in = self.shared_out = None
        self.phy2log = EplbTable(put_host(placement.phy2log[0], mesh, PS()))
        self.log2phy = EplbTable(put_host(placement.log2phy[0], mesh, PS()))
        self.logcnt = EplbTable(put_host(placement.logcnt[0], mesh, PS()))
        self.route_lookup = EplbTable(_route_lookup(placement.log2phy[0], placement.logcnt[0], mesh))
        if load_reduce == "psum":
            self.expert_load = ExpertLoad(put_host(np.zeros(num_physical, np.int32), mesh, PS()))
        else:  # one row per EP rank, each on its rank: the forward pass adds to it without communication
            load = np.zeros((mesh.shape[axis], num_physical), np.int32)
            self.expert_load = ExpertLoad(put_host(load, mesh, PS(axis)))

    def __call__(self, x, *, valid=None, record=True):
        """``x [..., D]`` (leading sizes multiply to a multiple of ``G``) -> ``[..., D]``.

        ``valid``: optional bool mask of ``x``'s leading shape; ``False`` marks
        padding, which no routed expert computes (the shared expert still
        does) and no load counts. ``record``: count this pass's load (a Python
        or traced bool).
        """
        lead, dim = x.shape[:-1], x.shape[-1]
        tokens = x.reshape(-1, dim)
        if valid is not None:
            if tuple(valid.shape) != tuple(lead):
                raise ValueError(f"valid must have x's leading shape {tuple(lead)}, got {tuple(valid.shape)}")
            valid = valid.reshape(-1)
        if tokens.shape[0] % self.mesh.shape[self.axis]:
            raise ValueError(f"{tokens.shape[0]} tokens are not divisible by the EP size {self.mesh.shape[self.axis]}")
        phy2log = self.phy2log.get_value()
        if self.quant_format is None:
            experts = {
                name: tie_replicas(var.get_value(), phy2log) for name, var in self.eplb_expert_variables().items()
            }
        else:  # quantized experts are frozen (serving): nothing to tie
            experts = {name: var.get_value() for name, var in self.eplb_expert_variables().items()}
        out, load = moe_apply(
            tokens,
            self.router.get_value(),
            self.router_bias.get_value(),
            experts,
            self.log2phy.get_value(),
            self.logcnt.get_value(),
            valid,
            record,
            top_k=self.top_k,
            mesh=self.mesh,
            axis=self.axis,
            num_groups=self.num_groups,
            topk_groups=self.topk_groups,
            scoring=self.scoring,
            renormalize=self.renormalize,
            routed_scaling_factor=self.routed_scaling_factor,
            routing=self.routing,
            matmul=self.matmul,
            map_implementation=self.map_implementation,
            quant_impl=self.quant_impl,
            activation_scaling=self.activation_scaling,
            capacity_factor=self.capacity_factor,
            load_reduce=self.load_reduce,
            lookup=self.route_lookup.get_value(),
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
        placed = [jax.tree.map(lambda leaf: put_host(np.asarray(leaf), self.mesh, slots), t) for t in q]
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
                raise ValueError(
                    f"placement table must have shape {tuple(var.get_value().shape)}, got {np.shape(value)}"
                )
        route_lookup = _route_lookup(log2phy, logcnt, self.mesh)  # before any table changes
        self.phy2log.set_value(put_host(np.asarray(phy2log, np.int32), self.mesh, PS()))
        self.log2phy.set_value(put_host(np.asarray(log2phy, np.int32), self.mesh, PS()))
        self.logcnt.set_value(put_host(np.asarray(logcnt, np.int32), self.mesh, PS()))
        self.route_lookup.set_value(route_lookup)


def _route_lookup(log2phy, logcnt, mesh):
    """``lookup_table`` of one layer's placement, replicated on ``mesh`` (built once per placement)."""
    return put_host(np.asarray(lookup_table(np.asarray(log2phy, np.int32), np.asarray(logcnt, np.int32))), mesh, PS())

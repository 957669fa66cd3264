"""A reference expert-parallel MoE layer (Flax NNX) with physical expert slots.

Shapes: ``D`` model width, ``H`` expert hidden width, ``E`` logical experts,
``P = E + R`` physical slots, ``G`` EP ranks (the size of the mesh axis
``axis``), ``k`` experts per token, ``S = R + 1`` replicas at most.

The forward pass, per device (``jax.shard_map``)::

    router logits [T, E] -> top-k logical ids [T, k] + weights [T, k]
    map_and_count(ids, log2phy, logcnt, mode=routing) -> physical ids [T, k] + this rank's load [P]
    dispatch (all_to_all over EP, dropless) -> rows of this rank's P/G slots
    gated MLP per slot (grouped matmul)      -> combine (all_to_all back, sum in router order)

plus an optional shared expert applied to every token (on its own rank,
``shared_expert="local"``, or where the routed experts left slack,
``"waterfill"``). Expert weights are
stored per physical slot, ``w_in [P, D, 2H]`` and ``w_out [P, H, D]``, sharded
over ``axis`` (or, after ``MoELayer.quantize(fmt)``, quantized pytrees of
``moe_eplb_jax.quant``); replicas of an expert hold identical bytes, and in
training ``tie_replicas`` gives every replica the expert's summed gradient so
they stay identical. The placement tables
(``phy2log [P]``, ``log2phy [E, S]``, ``logcnt [E]``, ``replica_shares [E, S]``
(``"lp"``), and ``route_lookup``, the Pallas kernel's lookup table of them,
rebuilt whenever they change so no forward pass rebuilds it) are
``EplbTable`` variables -- inputs of the compiled function, never constants
in it, so a rearrangement never recompiles -- and the tokens per slot of
every forward pass are added to the ``ExpertLoad`` variable, which the
controller reads.

Replica routing (``routing``, the L2 modes of ``moe_eplb_jax.routing``), and
what each guarantees. Replicas hold the same bytes and every token's ``k``
results are summed in router order, so in every mode a token's output is that
of the plain expert MLP -- bit for bit under any placement and mode with a
placement-invariant matmul (``"dense"``, ``"pallas"``); what a mode decides is
only which replica computes it (the load):

* ``"hash"``: replica ``h(t) mod c`` of the rank-local token index: stateless.
* ``"round_robin"``: replica ``t mod c``.
* ``"lp"``: replicas drawn (by the token hash, Walker's alias method) with the
  layer's ``replica_shares``, solved at each rearrangement from the window's
  loads (``moe_eplb_jax.routing.routing_tables``); equal shares until then.
* ``"quota"``: per batch, inside the step: each rank counts its valid tokens
  per expert, the counts are all-gathered over EP, every rank plans the same
  integer quotas over the replicas the placement holds
  (``routing.plan_fixed_quotas``: per-batch LP shares, rounded, locality
  first) and routes its tokens by its row in token order. The realised load
  is the plan's. The replicas themselves change only when the controller
  moves weights (the ``"online"`` policy's spare-slot refresh).

Every mode is a deterministic function of the batch and the placement tables.

Meshes with batch axes (``("data", "ep")``, ``("fsdp", "ep")``, ...): tokens
are sharded over every batch axis and ``axis``, expert weights over ``axis``
only, so each device computes only its own tokens; dispatch, combine and the
quota counts stay inside the device's EP group (the devices sharing its batch
coordinates).

Loads are not summed over the EP axis in the forward pass (``load_reduce=
"none"``, the default): each rank adds its own counts to its row of a
``[G, P]`` load sharded over ``axis`` (summed over the batch axes first, one
all-reduce of ``P`` ints over them where the mesh has any), so a 1-D EP step
has no collective for them; the controller sums the rows when it reads its
window (at rearrangement or logging). ``load_reduce="psum"`` gives the
replicated ``[P]`` total every pass instead, at one small all-reduce per
layer per pass.
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
from moe_eplb_jax.flax.experts import QuantizedExperts, expert_mlp, shared_mlp, tie_replicas, waterfill_shared_mlp
from moe_eplb_jax.pallas import lookup_table, map_and_count
from moe_eplb_jax.placement import Placement
from moe_eplb_jax.routing import batch_quotas, check_routing, equal_shares
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
    """A placement table of one MoE layer (int32; float32 ``replica_shares``). Not a parameter: optimizers skip it."""


class ExpertLoad(nnx.Variable):
    """Tokens routed to each physical slot since the controller last read it (int32).

    ``[G, P]`` (row ``g``: counted on EP rank ``g``, summed over the mesh's
    batch axes; sharded over the EP axis, replicated over the batch axes) with
    ``load_reduce="none"``, ``[P]`` (replicated) with ``"psum"``.
    """


def _map_and_count(*args, **kwargs):
    return map_and_count(*args, **kwargs)  # one indirection: tests may swap the kernel


LOAD_REDUCTIONS = ("none", "psum")
SHARED_EXPERTS = ("local", "waterfill")


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
    batch_axes: tuple[str, ...] | None = None,
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
    replica_shares=None,
    shared=None,
    shared_expert: str = "local",
):
    """The MoE layer's forward pass as a pure function (routed experts, and the shared expert if given).

    Args:
      x: ``[T, D]`` tokens, ``T`` divisible by ``B * G`` (``B``: the product of
        the batch axes' sizes); sharded (or resharded) over ``batch_axes`` and ``axis``.
      router_w: ``[D, E]``; ``router_bias [E]``.
      num_groups, topk_groups, scoring, renormalize, routed_scaling_factor:
        the router style, see ``route``.
      experts: expert weights with leading ``[P]`` slot axes sharded over ``axis``
        (see ``expert_mlp``: float ``w_in``/``w_out`` or quantized ``gate``/``up``/``down``).
      log2phy: ``[E, S]`` int32 (-1 padded); ``logcnt [E]`` int32.
      batch_axes: the mesh axes that shard tokens besides ``axis`` (``None``:
        every other axis of ``mesh``). Each device computes only its own
        tokens; its EP group is the ``G`` devices sharing its batch coordinates.
      routing: the replica routing mode, one of ``moe_eplb_jax.routing.ROUTING_MODES``
        (see the module docstring for what each guarantees).
      lookup: optional ``moe_eplb_jax.pallas.lookup_table(log2phy, logcnt[,
        replica_shares=...])``, kept with the placement so the Pallas
        ``map_and_count`` does not rebuild it every pass (``map_and_count(lookup=...)``).
      replica_shares: ``[E, S]`` float32 weights of each expert's replicas, read
        with ``routing="lp"`` only (``None``: equal shares).
      valid: optional ``[T]`` bool, sharded like ``x``: ``False`` marks padding
        (an unused cache position, a finished request), which is neither sent
        to an expert (routed or shared-by-Waterfill) nor counted, nor counted in
        the ``"quota"`` plan; its routed output is zero. ``None``: every token is real.
      record: count the load (a Python or traced bool; ``False`` gives a zero
        load, e.g. for a warm-up pass, without recompiling).
      capacity_factor: ``None`` exchanges the worst-case buffer in one
        ``all_to_all``; a factor ``f`` exchanges it in rounds of
        ``ceil(f * A / G)`` rows per rank pair (``A = T_rank * k``), as many as
        the fullest pair needs: about ``f / G`` of the bytes when balanced, still
        dropless, same results.
      load_reduce: ``"none"`` (default): no collective over EP for the load;
        each rank returns its own counts (summed over the batch axes), ``load
        [G, P]`` sharded over ``axis`` (row ``g``: the assignments of EP rank
        ``g``'s tokens), to be summed over ``G`` when read (``load.sum(0)``;
        ``EplbController`` does it at rearrangement). ``"psum"``: ``load [P]``,
        summed over every axis in the step (one all-reduce of ``P`` ints), replicated.
      shared: optional replicated shared-expert weights ``{"w_in": [D, 2H_s], "w_out": [H_s, D]}``,
        applied to every token and added to the routed output.
      shared_expert: where the shared expert runs: ``"local"`` (each rank its own
        tokens, padding included) or ``"waterfill"`` (valid tokens moved to the
        ranks with slack above the routed load, ``waterfill_shared_mlp``; same
        outputs for valid tokens, zero for padding).

    Returns:
      ``(out [T, D] in x.dtype, load int32)`` -- load counts every valid
      token's ``k`` assignments per physical slot: ``[G, P]`` per rank or
      ``[P]`` summed, as ``load_reduce`` says.
    """
    if load_reduce not in LOAD_REDUCTIONS:
        raise ValueError(f"load_reduce must be one of {LOAD_REDUCTIONS}, got {load_reduce!r}")
    check_routing(routing)
    if shared_expert not in SHARED_EXPERTS:
        raise ValueError(f"shared_expert must be one of {SHARED_EXPERTS}, got {shared_expert!r}")
    batch_axes = _batch_axes(mesh, axis, batch_axes)
    _check_apply(
        x, router_w, router_bias, experts, log2phy, logcnt, top_k=top_k, mesh=mesh, axis=axis, batch_axes=batch_axes
    )
    num_ranks = mesh.shape[axis]
    num_physical = jax.tree.leaves(experts)[0].shape[0]
    slots_per_rank = num_physical // num_ranks
    tokens_per_device = x.shape[0] // (num_ranks * _size(mesh, batch_axes))
    capacity = _capacity(tokens_per_device * top_k, num_ranks, capacity_factor)
    valid = _check_valid(valid, x.shape[0])
    record = jnp.asarray(record)
    if record.shape != () or record.dtype != jnp.bool_:
        raise ValueError(f"record must be a boolean scalar, got shape {record.shape} dtype {record.dtype}")
    if routing == "lp":
        replica_shares = _check_shares(replica_shares, logcnt, log2phy.shape)
    else:
        replica_shares = None  # read by "lp" only
    routed_cost = 1.0  # a routed row's cost in shared-expert rows (their hidden widths' ratio)
    if shared is not None:
        _check_shared(shared, x.shape[1])
        routed_cost = _expert_hidden(experts) / shared["w_out"].shape[0]

    def per_rank(x, router_w, router_bias, experts, log2phy, logcnt, valid, record, lookup, replica_shares, shared):
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
        physical, load = _map_replicas(
            ids,
            log2phy,
            logcnt,
            record,
            lookup,
            replica_shares,
            routing=routing,
            num_physical=num_physical,
            axis=axis,
            implementation=map_implementation,
        )
        if load_reduce == "psum":
            load = jax.lax.psum(load, (*batch_axes, axis))
        else:
            load = (jax.lax.psum(load, batch_axes) if batch_axes else load)[None]
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
        if shared is not None and shared_expert == "local":
            out = out + shared_mlp(x, shared).astype(out.dtype)
        elif shared is not None:
            owner = jnp.where(physical >= 0, physical // slots_per_rank, num_ranks)
            sent = jnp.sum(owner[..., None] == jnp.arange(num_ranks)[None, None, :], axis=(0, 1), dtype=jnp.int32)
            shared_out, _ = waterfill_shared_mlp(
                x,
                valid,
                jax.lax.psum(sent, axis),
                shared,
                axis_name=axis,
                num_ranks=num_ranks,
                routed_cost=routed_cost,
                implementation=matmul,
                capacity=_capacity(tokens_per_device, num_ranks, capacity_factor),
            )
            out = out + shared_out.astype(out.dtype)
        return out, load

    tokens, rep = PS((*batch_axes, axis)), PS()
    return jax.shard_map(
        per_rank,
        mesh=mesh,
        in_specs=(tokens, rep, rep, PS(axis), rep, rep, tokens, rep, rep, rep, rep),
        out_specs=(tokens, rep if load_reduce == "psum" else PS(axis)),
        # The Pallas map_and_count (GPU) declares outputs without a varying-axes type; jax 0.11
        # rejects that under check_vma=True.
        check_vma=False,
    )(x, router_w, router_bias, experts, log2phy, logcnt, valid, record, lookup, replica_shares, shared)


def _map_replicas(ids, log2phy, logcnt, record, lookup, replica_shares, *, routing, num_physical, axis, implementation):
    """Per rank: logical ids ``[T, k]`` (``-1``: padding) -> physical slots ``[T, k]`` and this rank's load ``[P]``.

    The one place a routing mode turns into ``map_and_count``'s inputs
    (``"quota"`` plans its quotas here, with an all-gather over ``axis``);
    ``benchmarks/moe_step.py`` calls it to route exactly as the layer does.
    """
    per_mode = {}
    if routing == "lp":
        per_mode = {"replica_shares": replica_shares}
    elif routing == "quota":
        per_mode = {"quotas": batch_quotas(ids, log2phy, logcnt, axis_name=axis, num_physical=num_physical)}
    physical, load = _map_and_count(
        ids,
        log2phy,
        logcnt,
        num_physical=num_physical,
        record=record,
        mode=routing,
        implementation=implementation,
        lookup=lookup,
        **per_mode,
    )
    return physical, load.astype(jnp.int32)


def _batch_axes(mesh, axis, batch_axes) -> tuple[str, ...]:
    """The token-sharding axes besides ``axis`` (default: every other mesh axis), validated."""
    if axis not in mesh.shape:
        raise ValueError(f"mesh has no axis {axis!r}; its axes are {tuple(mesh.shape)}")
    if batch_axes is None:
        return tuple(name for name in mesh.axis_names if name != axis)
    batch_axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
    for name in batch_axes:
        if name not in mesh.shape or name == axis:
            raise ValueError(f"batch_axes must name mesh axes other than {axis!r}; mesh axes {tuple(mesh.shape)}")
    if len(set(batch_axes)) != len(batch_axes):
        raise ValueError(f"batch_axes names an axis twice: {batch_axes}")
    return batch_axes


def _size(mesh, axes) -> int:
    return int(np.prod([mesh.shape[name] for name in axes], dtype=np.int64))


def _check_shares(replica_shares, logcnt, table_shape):
    """``replica_shares`` as ``[E, S]`` float32 (equal shares for ``None``)."""
    if replica_shares is None:
        width = table_shape[1]
        live = jnp.arange(width, dtype=jnp.int32)[None, :] < logcnt[:, None]
        return jnp.where(live, 1.0 / jnp.maximum(logcnt, 1).astype(jnp.float32)[:, None], 0.0).astype(jnp.float32)
    if tuple(np.shape(replica_shares)) != tuple(table_shape):
        raise ValueError(
            f"replica_shares must have shape [E, S] = {tuple(table_shape)}, got {np.shape(replica_shares)}"
        )
    if not jnp.issubdtype(jnp.asarray(replica_shares).dtype, jnp.floating):
        raise ValueError(f"replica_shares must be floats, got dtype {jnp.asarray(replica_shares).dtype}")
    return jnp.asarray(replica_shares).astype(jnp.float32)


def _check_shared(shared, dim: int) -> None:
    if not isinstance(shared, dict) or set(shared) != {"w_in", "w_out"}:
        raise ValueError("shared must be {'w_in': [D, 2H], 'w_out': [H, D]}")
    w_in, w_out = shared["w_in"], shared["w_out"]
    hidden = w_out.shape[0] if w_out.ndim == 2 else -1
    if w_in.shape != (dim, 2 * hidden) or w_out.shape != (hidden, dim):
        raise ValueError(f"shared w_in must be [D={dim}, 2H] and w_out [H, D={dim}], got {w_in.shape}, {w_out.shape}")


def _expert_hidden(experts) -> int:
    """``H`` of the routed experts: ``w_out [P, H, D]``, or the quantized ``gate [P, H, D]``."""
    return int(experts["w_out"].shape[1] if "w_out" in experts else experts["gate"].shape[1])


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


def _check_apply(x, router_w, router_bias, experts, log2phy, logcnt, *, top_k, mesh, axis, batch_axes):
    num_ranks = mesh.shape[axis]
    num_devices = num_ranks * _size(mesh, batch_axes)
    if x.ndim != 2 or x.shape[0] % num_devices:
        raise ValueError(
            f"x must have shape [T, D] with T divisible by the EP size {num_ranks} times the batch axes' size "
            f"{num_devices // num_ranks}, got {x.shape}"
        )
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
      shared_expert: where the shared expert runs: ``"local"`` (each rank its
        own tokens) or ``"waterfill"`` (tokens of overloaded ranks computed on
        ranks with slack; same outputs; see ``moe_apply``).
      dtype: activation and expert-weight dtype (e.g. ``jnp.bfloat16``).
      routing: replica routing mode, one of ``moe_eplb_jax.routing.ROUTING_MODES``
        (``"hash"``, ``"round_robin"``, ``"lp"``, ``"quota"``; see the module
        docstring); ``eplb_set_routing`` switches it later.
      batch_axes: mesh axes sharding tokens besides ``axis`` (``None``: every
        other mesh axis); see ``moe_apply``.
      matmul: grouped matmul implementation (``"dense"``, ``"pallas"``, ``"ragged_dot"``).
      map_implementation: ``map_and_count`` implementation (None: its default).
      capacity_factor: exchange tokens in rounds of this factor times the
        balanced share (``None``: one worst-case exchange); see ``moe_apply``.
      load_reduce: ``"none"`` (default): ``expert_load`` is ``[G, P]``, each
        rank adding its own counts to its row, no collective in the step (the
        controller sums the rows when it reads them); ``"psum"``: ``[P]``,
        summed over the EP axis every forward pass (replicated: readable
        directly after each pass, at one small all-reduce per pass).
        On a mesh with batch axes the rows are also summed over them.
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
        shared_expert: str = "local",
        dtype: Any = jnp.float32,
        routing: str = "hash",
        batch_axes: tuple[str, ...] | None = None,
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
        check_routing(routing)
        if shared_expert not in SHARED_EXPERTS:
            raise ValueError(f"shared_expert must be one of {SHARED_EXPERTS}, got {shared_expert!r}")
        self.batch_axes = _batch_axes(mesh, axis, batch_axes)
        self.shared_expert = shared_expert
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
        shares = equal_shares(placement.logcnt[0], placement.log2phy.shape[2])
        self.replica_shares = EplbTable(put_host(shares, mesh, PS()))
        self.route_lookup = EplbTable(self._lookup(routing, placement.log2phy[0], placement.logcnt[0], shares))
        if load_reduce == "psum":
            self.expert_load = ExpertLoad(put_host(np.zeros(num_physical, np.int32), mesh, PS()))
        else:  # one row per EP rank, each on its rank: the forward pass adds to it without communication
            load = np.zeros((mesh.shape[axis], num_physical), np.int32)
            self.expert_load = ExpertLoad(put_host(load, mesh, PS(axis)))

    def __call__(self, x, *, valid=None, record=True):
        """``x [..., D]`` (leading sizes multiply to a multiple of ``G`` times the batch axes' size) -> ``[..., D]``.

        ``valid``: optional bool mask of ``x``'s leading shape; ``False`` marks
        padding, which no routed expert computes (the local shared expert
        still does; Waterfill does not) and no load counts. ``record``: count
        this pass's load (a Python or traced bool).
        """
        lead, dim = x.shape[:-1], x.shape[-1]
        tokens = x.reshape(-1, dim)
        if valid is not None:
            if tuple(valid.shape) != tuple(lead):
                raise ValueError(f"valid must have x's leading shape {tuple(lead)}, got {tuple(valid.shape)}")
            valid = valid.reshape(-1)
        num_devices = self.mesh.shape[self.axis] * _size(self.mesh, self.batch_axes)
        if tokens.shape[0] % num_devices:
            raise ValueError(
                f"{tokens.shape[0]} tokens are not divisible by the EP size {self.mesh.shape[self.axis]} "
                f"times the batch axes' size {num_devices // self.mesh.shape[self.axis]}"
            )
        phy2log = self.phy2log.get_value()
        if self.quant_format is None:
            experts = {
                name: tie_replicas(var.get_value(), phy2log) for name, var in self.eplb_expert_variables().items()
            }
        else:  # quantized experts are frozen (serving): nothing to tie
            experts = {name: var.get_value() for name, var in self.eplb_expert_variables().items()}
        shared = None
        if self.shared_in is not None and self.shared_out is not None:
            shared = {"w_in": self.shared_in.get_value(), "w_out": self.shared_out.get_value()}
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
            batch_axes=self.batch_axes,
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
            replica_shares=self.replica_shares.get_value(),
            shared=shared,
            shared_expert=self.shared_expert,
        )
        self.expert_load.set_value(self.expert_load.get_value() + load)
        return out.reshape(*lead, dim)

    # ------------------------------------------------- the EPLB protocol
    def eplb_num_logical_experts(self) -> int:
        return self.num_experts

    def eplb_expert_variables(self) -> dict[str, nnx.Variable]:
        if self.quant_format is None:
            variables = {"w_in": self.w_in, "w_out": self.w_out}
        else:
            variables = {"gate": self.q_gate, "up": self.q_up, "down": self.q_down}
        return {name: var for name, var in variables.items() if var is not None}

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

        w_in_var, w_out_var = self.w_in, self.w_out
        if self.quant_format is not None or w_in_var is None or w_out_var is None:
            raise ValueError(f"layer is already quantized ({self.quant_format!r})")
        if fmt not in quant.FORMATS:
            raise ValueError(f"unknown quantized format {fmt!r}; known: {sorted(quant.FORMATS)}")
        if impl not in quant.IMPLS:
            raise ValueError(f"unknown quant impl {impl!r}; known: {list(quant.IMPLS)}")
        hidden = w_out_var.get_value().shape[1]
        w_in = np.asarray(w_in_var.get_value(), np.float32)
        w_out = np.asarray(w_out_var.get_value(), np.float32)
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

    def eplb_set_placement(self, phy2log, log2phy, logcnt, *, replica_shares=None) -> None:
        """Installs a new placement (and, for ``"lp"``, its replica shares), checked before anything changes.

        ``replica_shares``: ``[E, S]`` finite non-negative weights of each
        expert's replicas (``moe_eplb_jax.routing.routing_tables``); ``None``:
        equal shares. Kept whatever the mode, read by ``"lp"``.
        """
        for var, value in ((self.phy2log, phy2log), (self.log2phy, log2phy), (self.logcnt, logcnt)):
            if tuple(np.shape(value)) != tuple(var.get_value().shape):
                raise ValueError(
                    f"placement table must have shape {tuple(var.get_value().shape)}, got {np.shape(value)}"
                )
        log2phy, logcnt = np.asarray(log2phy, np.int32), np.asarray(logcnt, np.int32)
        if replica_shares is None:
            shares = equal_shares(logcnt, log2phy.shape[1])
        else:
            shares = np.asarray(replica_shares)
            if shares.shape != log2phy.shape or not np.issubdtype(shares.dtype, np.floating):
                raise ValueError(
                    f"replica_shares must be floats of shape [E, S] = {log2phy.shape}, got {shares.dtype} {shares.shape}"
                )
            if not np.all(np.isfinite(shares)) or np.any(shares < 0):
                raise ValueError("replica_shares must be finite and non-negative")
            shares = shares.astype(np.float32)
        route_lookup = self._lookup(self.routing, log2phy, logcnt, shares)  # before any table changes
        self.phy2log.set_value(put_host(np.asarray(phy2log, np.int32), self.mesh, PS()))
        self.log2phy.set_value(put_host(log2phy, self.mesh, PS()))
        self.logcnt.set_value(put_host(logcnt, self.mesh, PS()))
        self.replica_shares.set_value(put_host(shares, self.mesh, PS()))
        self.route_lookup.set_value(route_lookup)

    def eplb_set_routing(self, routing: str) -> None:
        """Switches the replica routing mode (one of ``moe_eplb_jax.routing.ROUTING_MODES``).

        The mode is static configuration: the next jitted call compiles once
        for it; the weights, tables and loads stay as they are.
        """
        check_routing(routing)
        if routing == self.routing:
            return
        tables = (self.log2phy, self.logcnt, self.replica_shares)
        route_lookup = self._lookup(routing, *(np.asarray(t.get_value()) for t in tables))
        self.routing = routing
        self.route_lookup.set_value(route_lookup)  # "lp"'s carries the alias table: another shape

    def _lookup(self, routing, log2phy, logcnt, shares):
        """``lookup_table`` of this layer's placement for ``routing``, replicated (built once per placement).

        For ``"lp"`` it carries the shares' alias table too, so the Pallas
        kernel builds none per call.
        """
        log2phy, logcnt = np.asarray(log2phy, np.int32), np.asarray(logcnt, np.int32)
        if routing == "lp":
            table = lookup_table(log2phy, logcnt, replica_shares=np.asarray(shares), num_physical=self.num_physical)
        else:
            table = lookup_table(log2phy, logcnt)
        return put_host(np.asarray(table), self.mesh, PS())

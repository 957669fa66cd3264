"""The expert-parallel MoE forward pass as a pure function: route, map to replicas, dispatch, experts, combine.

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
``"waterfill"``). The router's style is a ``RouterConfig``, how the pass runs
(kernels, exchange, load layout, shared-expert placement, batch axes) a
``DispatchConfig`` (``moe.config``). Expert weights are stored per physical
slot, ``w_in [P, D, 2H]`` and ``w_out [P, H, D]``, sharded over ``axis`` (or
quantized pytrees of ``moe_eplb_jax.quant``); replicas of an expert hold
identical bytes, and in training ``tie_replicas`` gives every replica the
expert's summed gradient so they stay identical. The placement tables
(``log2phy [E, S]``, ``logcnt [E]``, ``replica_shares [E, S]`` of a mode that
reads shares, and ``lookup``, the Pallas kernel's lookup table of them, built
once per placement) are inputs of the compiled function, never constants in
it, so a rearrangement never recompiles.

Replica routing (``routing``, a mode of ``moe_eplb_jax.routing.MODES``), and
what each guarantees. Replicas hold the same bytes and every token's ``k``
results are summed in router order, so in every mode a token's output is that
of the plain expert MLP -- bit for bit under any placement and mode with a
placement-invariant matmul (``"dense"``, the Triton kernels); what a mode decides is
only which replica computes it (the load):

* ``"hash"``: replica ``floor(h(u) c / 2**32)`` (the hash's high bits) of
  the token's global position ``u`` (its index among every rank's tokens of
  the batch): stateless, and spread over the replicas however few tokens each
  rank holds (decode).
* ``"round_robin"``: replica ``u mod c``.
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

Loads are not summed over the EP axis in the forward pass
(``DispatchConfig.load_reduce="none"``, the default): each rank adds its own counts to its row of a
``[G, P]`` load sharded over ``axis`` (summed over the batch axes first, one
all-reduce of ``P`` ints over them where the mesh has any), so a 1-D EP step
has no collective for them; the controller sums the rows when it reads its
window (at rearrangement or logging). ``"psum"`` gives the
replicated ``[P]`` total every pass instead, at one small all-reduce per
layer per pass.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as PS

from moe_eplb_jax import quant
from moe_eplb_jax._kernels import fused_unless_differentiated
from moe_eplb_jax.moe import dispatch as _dispatch
from moe_eplb_jax.moe import local as _local
from moe_eplb_jax.moe.config import DispatchConfig, RouterConfig, axes_size
from moe_eplb_jax.moe.experts import expert_mlp, reads_token_rows, shared_mlp, waterfill_shared_mlp
from moe_eplb_jax.moe.router import route
from moe_eplb_jax.routing import RoutingMode, batch_quotas, map_and_count, routing_mode

__all__ = ["map_replicas", "moe_apply", "routed_experts"]


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
    router: RouterConfig,
    mesh: jax.sharding.Mesh,
    axis: str = "ep",
    routing: str | RoutingMode = "hash",
    dispatch: DispatchConfig = DispatchConfig(),
    lookup=None,
    replica_shares=None,
    shared=None,
):
    """The MoE layer's forward pass as a pure function (routed experts, and the shared expert if given).

    Args:
      x: ``[T, D]`` tokens, ``T`` divisible by ``B * G`` (``B``: the product of
        the batch axes' sizes); sharded (or resharded) over the batch axes and ``axis``.
      router_w: ``[D, E]``; ``router_bias [E]``.
      experts: expert weights with leading ``[P]`` slot axes sharded over ``axis``
        (see ``expert_mlp``: float ``w_in``/``w_out`` or quantized ``gate``/``up``/``down``).
      log2phy: ``[E, S]`` int32 (-1 padded); ``logcnt [E]`` int32.
      valid: optional ``[T]`` bool, sharded like ``x``: ``False`` marks padding
        (an unused cache position, a finished request), which is neither sent
        to an expert (routed or shared-by-Waterfill) nor counted, nor counted in
        the ``"quota"`` plan; its routed output is zero. ``None``: every token is real.
      record: count the load (a Python or traced bool; ``False`` gives a zero
        load, e.g. for a warm-up pass, without recompiling).
      router: the router's style (``RouterConfig``, see ``route``).
      mesh: the device mesh; ``axis`` names its EP axis (``G`` ranks). Each
        device computes only its own tokens; its EP group is the ``G`` devices
        sharing its batch coordinates (``DispatchConfig.batch_axes``).
      routing: the replica routing mode, a name of ``moe_eplb_jax.routing.ROUTING_MODES``
        or its ``RoutingMode`` (see the module docstring for what each guarantees).
      dispatch: how the pass runs (``DispatchConfig``: grouped matmul, ``map_and_count``
        implementation, quantized MLP, exchange capacity, load layout, shared-expert
        placement, batch axes).
      lookup: optional ``routing.lookup_table(log2phy, logcnt[, replica_shares=...])``
        (``routing.mode_lookup``), kept with the placement so the Pallas
        ``map_and_count`` does not rebuild it every pass.
      replica_shares: ``[E, S]`` float32 weights of each expert's replicas, read
        by a mode that reads shares (``"lp"``) only (``None``: equal shares).
      shared: optional replicated shared-expert weights ``{"w_in": [D, 2H_s], "w_out": [H_s, D]}``,
        applied to every token and added to the routed output.

    Returns:
      ``(out [T, D] in x.dtype, load int32)`` -- load counts every valid
      token's ``k`` assignments per physical slot: ``[G, P]`` per rank (row
      ``g``: the assignments of EP rank ``g``'s tokens, summed over the batch
      axes; sharded over ``axis``) or ``[P]`` summed and replicated, as
      ``dispatch.load_reduce`` says.
    """
    mode = routing_mode(routing)
    if not isinstance(router, RouterConfig):
        raise ValueError(f"router must be a RouterConfig, got {type(router).__name__}")
    if not isinstance(dispatch, DispatchConfig):
        raise ValueError(f"dispatch must be a DispatchConfig, got {type(dispatch).__name__}")
    batch_axes = dispatch.token_axes(mesh, axis)
    _check_apply(x, router_w, router_bias, experts, log2phy, logcnt, router=router, mesh=mesh, axis=axis)
    _check_tokens(x, mesh, axis, batch_axes)
    valid = _check_valid(valid, x.shape[0])
    record = jnp.asarray(record)
    if record.shape != () or record.dtype != jnp.bool_:
        raise ValueError(f"record must be a boolean scalar, got shape {record.shape} dtype {record.dtype}")
    replica_shares = _check_shares(replica_shares, logcnt, log2phy.shape) if mode.shares else None
    if shared is not None:
        _check_shared(shared, x.shape[1])
    per_rank = functools.partial(
        _per_rank,
        router=router,
        dispatch=dispatch,
        mode=mode,
        axis=axis,
        batch_axes=batch_axes,
        num_ranks=mesh.shape[axis],
        num_physical=jax.tree.leaves(experts)[0].shape[0],
    )
    tokens, rep = PS((*batch_axes, axis)), PS()
    return jax.shard_map(
        per_rank,
        mesh=mesh,
        in_specs=(tokens, rep, rep, PS(axis), rep, rep, tokens, rep, rep, rep, rep),
        out_specs=(tokens, rep if dispatch.load_reduce == "psum" else PS(axis)),
        # The Pallas map_and_count (GPU) declares outputs without a varying-axes type; jax 0.11
        # rejects that under check_vma=True.
        check_vma=False,
    )(x, router_w, router_bias, experts, log2phy, logcnt, valid, record, lookup, replica_shares, shared)


def _per_rank(
    x,
    router_w,
    router_bias,
    experts,
    log2phy,
    logcnt,
    valid,
    record,
    lookup,
    replica_shares,
    shared,
    *,
    router,
    dispatch,
    mode,
    axis,
    batch_axes,
    num_ranks,
    num_physical,
):
    """``moe_apply`` on one device's tokens, inside ``shard_map``: ``(out [T, D], load)``."""
    # map_and_count neither maps nor counts an id outside [0, E): padding (ids -1) goes nowhere.
    ids, weights = route(x, router_w, router, bias=router_bias, valid=valid)
    # On one rank every counted assignment is a row of this rank's grouped matmul: the load, counted whether or
    # not it is recorded, is the matmul's group sizes too (no second count), and recording only gates it.
    one_rank = num_ranks == 1
    physical, counts = map_replicas(
        ids,
        log2phy,
        logcnt,
        routing=mode,
        num_physical=num_physical,
        axis=axis,
        batch_axes=batch_axes,
        record=True if one_rank else record,
        lookup=lookup,
        replica_shares=replica_shares,
        implementation=dispatch.map_implementation,
    )
    load = jnp.where(record, counts, jnp.zeros_like(counts)) if one_rank else counts
    if dispatch.load_reduce == "psum":
        load = jax.lax.psum(load, (*batch_axes, axis))
    else:
        load = (jax.lax.psum(load, batch_axes) if batch_axes else load)[None]
    out = routed_experts(
        x,
        physical,
        weights,
        experts,
        axis=axis,
        num_ranks=num_ranks,
        dispatch=dispatch,
        group_sizes=counts if one_rank else None,
    )
    if shared is not None:
        out = out + _shared_expert(x, valid, physical, experts, shared, dispatch, axis, num_ranks).astype(out.dtype)
    return out, load


def map_replicas(
    ids,
    log2phy,
    logcnt,
    *,
    routing: str | RoutingMode,
    num_physical: int,
    axis: str,
    batch_axes: tuple[str, ...] = (),
    record=True,
    lookup=None,
    replica_shares=None,
    implementation: str | None = None,
):
    """Per rank, inside ``shard_map`` over ``axis``: logical ids ``[T, k]`` (``-1``: padding) -> physical slots
    ``[T, k]`` int32 and this rank's load ``[P]`` int32, as ``moe_apply`` routes.

    The one place a routing mode turns into ``map_and_count``'s inputs: a mode that reads shares gets
    ``replica_shares``; one that reads quotas plans them here, per batch (an all-gather over ``axis``). The
    tokens' positions are global (this device's index over ``(*batch_axes, axis)``, the order the tokens are
    sharded in, times ``T``), so hashing spreads the replicas over every rank's tokens, not each rank's alone.
    """
    mode = routing_mode(routing)
    tables = {}
    if mode.shares:
        tables["replica_shares"] = replica_shares
    if mode.quotas:
        tables["quotas"] = batch_quotas(ids, log2phy, logcnt, axis_name=axis, num_physical=num_physical)
    token_offset = jax.lax.axis_index((*batch_axes, axis)) * ids.shape[0]
    physical, load = map_and_count(
        ids,
        log2phy,
        logcnt,
        num_physical=num_physical,
        token_offset=token_offset,
        record=record,
        mode=mode.name,
        implementation=implementation,
        lookup=lookup,
        **tables,
    )
    return physical, load.astype(jnp.int32)


def _local_mlp(mlp, x, experts, order, inverse, group_sizes, tokens, top_k: int, implementation: str):
    """The grouped MLP of one rank's assignment rows ``[T * k, D]``: read from the tokens inside the MLP's first
    kernel where it can (``expert_mlp(row_tokens=)``, when nothing differentiates the call), else gathered first."""

    def gathered(x, experts, order, inverse, group_sizes, tokens):
        rows = _local.gather_rows(x, order, inverse, group_sizes, top_k)
        return mlp(rows, experts, group_sizes=group_sizes)

    if not reads_token_rows(x, experts, order.shape[0], implementation=implementation):
        return gathered(x, experts, order, inverse, group_sizes, tokens)

    def from_tokens(x, experts, order, inverse, group_sizes, tokens):
        return mlp(x, experts, group_sizes=group_sizes, row_tokens=tokens)

    return fused_unless_differentiated(from_tokens, gathered)(x, experts, order, inverse, group_sizes, tokens)


def routed_experts(
    x, physical, weights, experts, *, axis: str, num_ranks: int, dispatch: DispatchConfig, group_sizes=None
):
    """Per rank, inside ``shard_map`` over ``axis``: dispatch by physical slot -> grouped expert MLP -> combine.

    ``x [T, D]``, ``physical [T, k]`` (``-1``: sent nowhere), ``weights [T, k]``, ``experts`` this rank's
    ``P / G`` slots -> ``[T, D]`` in ``x.dtype``. ``moe_apply``'s exchange and compute without its routing (what
    ``benchmarks/moe_step.py`` times with the EPLB mapping and counting left out). Over several ranks the rows
    move in rounds of ``dispatch.capacity`` rows per rank pair (``dispatch.exchange_apply``), each round's rows
    through the grouped MLP on their own. ``group_sizes``: on one rank, each slot's assignments where the caller
    has counted them (``map_and_count``'s load, every assignment counted).
    """
    slots_per_rank = jax.tree.leaves(experts)[0].shape[0]
    mlp = functools.partial(
        expert_mlp,
        implementation=dispatch.matmul,
        quant_impl=dispatch.quant_impl,
        activation_scaling=dispatch.activation_scaling,
        axis_name=axis,
    )
    if num_ranks == 1:  # every slot is here: no plan, no exchange, one sort
        order, inverse, group_sizes, tokens = _local.sort_local(physical, slots_per_rank, group_sizes=group_sizes)
        y = _local_mlp(mlp, x, experts, order, inverse, group_sizes, tokens, physical.shape[1], dispatch.matmul)
        return _local.combine_local(y, order, inverse, physical, weights, out_dtype=x.dtype)

    def grouped(experts, rows, row_slot):
        return _dispatch.apply_by_slot(
            lambda rows, sizes: mlp(rows, experts, group_sizes=sizes), rows, row_slot, slots_per_rank
        )

    capacity = dispatch.capacity(physical.size, num_ranks)
    if isinstance(experts.get("gate"), quant.Fp8Experts) and dispatch.activation_scaling == "dynamic":
        # A dynamic activation scale (fp8 W8A8) is a max over every row the MLP sees: one round holds them all,
        # so it stays independent of how rows would split into rounds (that is, of the placement). The other
        # formats are weight-only and go in rounds.
        capacity = None
    return _dispatch.exchange_apply(
        grouped,
        experts,
        x,
        physical,
        weights,
        slots_per_rank=slots_per_rank,
        axis_name=axis,
        num_ranks=num_ranks,
        capacity=capacity,
        out_dtype=x.dtype,
    )


def _shared_expert(x, valid, physical, experts, shared, dispatch, axis, num_ranks):
    """Per rank: the shared expert's output for this rank's tokens, where ``dispatch.shared_expert`` says."""
    if dispatch.shared_expert == "local":
        return shared_mlp(x, shared)
    slots_per_rank = jax.tree.leaves(experts)[0].shape[0]
    owner = jnp.where(physical >= 0, physical // slots_per_rank, num_ranks)
    sent = jnp.sum(owner[..., None] == jnp.arange(num_ranks)[None, None, :], axis=(0, 1), dtype=jnp.int32)
    out, _ = waterfill_shared_mlp(
        x,
        valid,
        jax.lax.psum(sent, axis),
        shared,
        axis_name=axis,
        num_ranks=num_ranks,
        routed_cost=_expert_hidden(experts) / shared["w_out"].shape[0],  # a routed row in shared rows
        implementation=dispatch.matmul,
        capacity=dispatch.capacity(x.shape[0], num_ranks),
    )
    return out


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


def _check_tokens(x, mesh, axis, batch_axes) -> None:
    num_devices = mesh.shape[axis] * axes_size(mesh, batch_axes)
    if x.shape[0] % num_devices:
        raise ValueError(
            f"x must have shape [T, D] with T divisible by the EP size {mesh.shape[axis]} times the batch axes' "
            f"size {num_devices // mesh.shape[axis]}, got {x.shape}"
        )


def _check_apply(x, router_w, router_bias, experts, log2phy, logcnt, *, router, mesh, axis):
    num_ranks = mesh.shape[axis]
    if x.ndim != 2:
        raise ValueError(f"x must have shape [T, D], got {x.shape}")
    if router_w.ndim != 2 or router_w.shape[0] != x.shape[1]:
        raise ValueError(f"router_w must have shape [D={x.shape[1]}, E], got {router_w.shape}")
    num_logical = router_w.shape[1]
    if router_bias.shape != (num_logical,):
        raise ValueError(f"router_bias must have shape [E]=({num_logical},), got {router_bias.shape}")
    router.check_experts(num_logical)
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

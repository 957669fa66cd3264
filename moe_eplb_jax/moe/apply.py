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
placement-invariant matmul (``"dense"``, the Triton kernels); what a mode decides is
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

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as PS

from moe_eplb_jax.moe import dispatch as _dispatch
from moe_eplb_jax.moe.experts import expert_mlp, shared_mlp, waterfill_shared_mlp
from moe_eplb_jax.moe.router import route
from moe_eplb_jax.routing import batch_quotas, check_routing, map_and_count

__all__ = ["LOAD_REDUCTIONS", "SHARED_EXPERTS", "moe_apply"]

LOAD_REDUCTIONS = ("none", "psum")
SHARED_EXPERTS = ("local", "waterfill")


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
    matmul: str = "auto",
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
      lookup: optional ``moe_eplb_jax.routing._map_and_count.lookup_table(log2phy, logcnt[,
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
    physical, load = map_and_count(
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

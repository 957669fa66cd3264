"""Move expert slots between EP ranks so that they follow a new placement, bit for bit.

``rearrange_experts(experts, old_phy2log, new_phy2log, mesh=mesh)`` moves
every leaf of an expert pytree -- ``[P, ...]`` (one layer, tables ``[P]``) or
``[L, P, ...]`` (tables ``[L, P]``), the slot axis sharded over the EP mesh
axis -- sending only the slots whose expert changes, each as one packed row
of unsigned integers. ``execute_plan`` runs a :class:`TransportPlan`;
``prepare_move`` does a move's host work (validation, the plan's streaming
order, the table upload, the executor) ahead and returns a
:class:`PreparedMove` to call when the move is due. The executor
(``_executor``) picks its schedule by shape: an NVLink put kernel on GPUs of
one process, pipelined ``ppermute`` chunks elsewhere.

Why one jitted ``shard_map`` with bucketed table shapes: a later move of
similar size reuses the compiled executor, and validation happens on the host
before any device work, so bad input leaves the experts untouched.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from moe_eplb_jax.transport import _executor
from moe_eplb_jax.transport.mesh import axis_size
from moe_eplb_jax.transport.packing import leaf_layout
from moe_eplb_jax.transport.plan import TransportPlan, plan_rearrangement

__all__ = [
    "rearrange_experts",
    "execute_plan",
    "prepare_move",
    "PreparedMove",
    "executor_trace_count",
    "row_bytes",
]


def rearrange_experts(
    experts: Any,
    old_phy2log,
    new_phy2log,
    *,
    mesh: Mesh,
    axis: str = "ep",
    layer: int | None = None,
    num_logical: int | None = None,
    donate: bool = True,
) -> Any:
    """Moves expert slots so that ``experts`` follows ``new_phy2log`` instead of ``old_phy2log``.

    ``experts`` is a pytree of ``jax.Array`` leaves with a leading slot axis
    ``[P, ...]`` (tables ``[P]``) or leading ``[L, P, ...]`` axes (tables
    ``[L, P]``), the slot axis sharded over mesh axis ``axis``; 0-d leaves
    (such as an optax step count) pass through unchanged. Parameters,
    quantisation scales and optimizer state can go in one pytree: one plan
    moves them all. The tables may also be ``Placement`` objects. Afterwards
    slot ``p`` holds the bytes some slot ``q`` with
    ``old_phy2log[q] == new_phy2log[p]`` held before (bit for bit, any dtype:
    subnormals, signed zeros and NaN payloads included); slots whose expert is
    unchanged are not written. With ``layer`` set, only that layer of an
    ``[L, P]`` placement moves; ``num_logical``, when given, bounds the ids.

    Everything is validated before any device work; on ``ValueError`` the input
    is untouched. With ``donate`` (default) the input buffers are reused for
    the result and must not be used afterwards; ``donate=False`` keeps them
    (the extra memory of a second copy buys an atomic move: the old experts
    stay valid until the caller adopts the result).
    Returns a pytree of the same structure, shapes, dtypes and shardings.
    """
    num_ranks = axis_size(mesh, axis)
    plan = plan_rearrangement(old_phy2log, new_phy2log, num_ranks, layer=layer, num_logical=num_logical)
    return execute_plan(experts, plan, mesh=mesh, axis=axis, donate=donate)


def row_bytes(experts: Any, *, layered: bool = False) -> int:
    """Bytes one slot holds in ``experts``: the sum over its leaves of one slot's row.

    Leaves are ``[P, ...]`` (``layered``: ``[L, P, ...]``); 0-d leaves (an
    optimizer's step count) hold nothing per slot. ``ValueError`` for a leaf
    without the slot axes or of a dtype that cannot move as bytes.
    """
    lead = 2 if layered else 1
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(experts)[0]:
        if np.ndim(leaf) == 0:
            continue
        name = "experts" + jax.tree_util.keystr(path)
        if np.ndim(leaf) < lead:
            raise ValueError(f"{name} has shape {np.shape(leaf)}; it needs {lead} leading slot axes")
        total += leaf_layout(leaf.dtype, np.shape(leaf)[lead:], name=name).row_bytes
    return total


def execute_plan(experts: Any, plan: TransportPlan, *, mesh: Mesh, axis: str = "ep", donate: bool = True) -> Any:
    """Runs a precomputed :class:`TransportPlan` on ``experts`` (see :func:`rearrange_experts`).

    The same as ``prepare_move(experts, plan, ...)(experts)``: to keep the
    host work off the critical path, call :func:`prepare_move` ahead and the
    move when due. A plan ordered by ``streaming.order_for_streaming`` runs in its
    chunks; any other is ordered here (up to 8 chunks per round).
    """
    move = prepare_move(experts, plan, mesh=mesh, axis=axis, donate=donate)
    return move._run(experts)  # validated just now by prepare_move


def prepare_move(
    experts: Any, plan: TransportPlan, *, mesh: Mesh, axis: str = "ep", donate: bool = True
) -> PreparedMove:
    """Everything of :func:`execute_plan` but the move: a :class:`PreparedMove` to call when the move is due.

    Validates ``experts`` (only their structure, shapes, dtypes and shardings
    are used) against the plan and the mesh, orders the plan for streaming,
    uploads its index tables to the mesh and picks (and compiles, on first
    use) the executor -- host work a server can do while the model still runs
    (e.g. right after planning). Arguments as in :func:`rearrange_experts`;
    ``ValueError`` on bad input, before any device work.
    """
    if not isinstance(plan, TransportPlan):
        raise ValueError(f"plan must be a TransportPlan, got {type(plan).__name__}")
    if not isinstance(donate, bool | np.bool_):
        raise ValueError(f"donate must be a bool, got {donate!r}")
    num_ranks = axis_size(mesh, axis)
    if plan.num_ranks != num_ranks:
        raise ValueError(f"plan is for {plan.num_ranks} ranks but mesh axis {axis!r} has {num_ranks}")
    leaves, layouts, specs, positions = _check_leaves(experts, plan, mesh, axis)
    treedef = jax.tree_util.tree_structure(experts)
    signature = tuple((leaf.shape, leaf.dtype, spec) for leaf, spec in zip(leaves, specs))
    if plan.is_empty or not leaves:
        return PreparedMove(plan, mesh, treedef, tuple(positions), signature, bool(donate), "", None, None)
    _check_donation(leaves, donate)
    plan = _executor.stream_order(plan)
    schedule, run, tables = _executor.build(plan, leaves, layouts, specs, mesh, axis, bool(donate))
    return PreparedMove(plan, mesh, treedef, tuple(positions), signature, bool(donate), schedule, tables, run)


class PreparedMove(NamedTuple):
    """A rearrangement ready to run: ``move(experts)`` returns the moved pytree (see :func:`prepare_move`).

    ``experts`` must have the structure, shapes, dtypes and shardings the move
    was prepared with (checked: ``ValueError`` before any device work) and hold
    the old placement's experts; with ``donate`` their buffers are reused. The
    index tables stay on the mesh, so a move may run more than once (e.g.
    forth and back with the reverse plan's move).
    """

    plan: TransportPlan  # as ordered for the schedule
    mesh: Mesh
    treedef: Any
    positions: tuple  # flat positions of the moving leaves (0-d leaves pass through)
    signature: tuple  # (shape, dtype, partition spec without trailing Nones) per moving leaf
    donate: bool
    schedule: str  # "put", "stream_pallas_copies" or "stream_xla_copies" ("" when nothing moves)
    tables: jax.Array | None  # None: nothing moves
    run: Any

    def __call__(self, experts: Any) -> Any:
        self._check(experts)
        return self._run(experts)

    def _check(self, experts: Any) -> None:
        """``ValueError`` unless ``experts`` matches the prepared signature and no leaf was deleted."""
        flat, treedef = jax.tree_util.tree_flatten(experts)
        if treedef != self.treedef:
            raise ValueError(f"experts has the structure {treedef}, but the move was prepared for {self.treedef}")
        leaves = [flat[i] for i in self.positions]

        def name(i):  # the leaf's path, for errors only (flattening with paths costs host time)
            return "experts" + jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(experts)[0][i][0])

        for i, (leaf, (shape, dtype, spec)) in zip(self.positions, zip(leaves, self.signature)):
            if not isinstance(leaf, jax.Array) or isinstance(leaf, Tracer):
                raise ValueError(f"{name(i)} must be a concrete jax.Array, got {type(leaf).__name__}")
            sharding = leaf.sharding
            if (
                leaf.shape != shape
                or leaf.dtype != dtype
                or not isinstance(sharding, NamedSharding)
                or _trimmed(sharding.spec) != spec
                or not (sharding.mesh is self.mesh or _same_mesh(sharding.mesh, self.mesh))
            ):
                raise ValueError(
                    f"{name(i)} is {leaf.dtype}{list(leaf.shape)} with {sharding}; the move "
                    f"was prepared for {dtype}{list(shape)} with spec {spec} on {self.mesh}"
                )
            if leaf.is_deleted():
                raise ValueError(f"{name(i)} was deleted (donated to an earlier call?)")
        if self.run is not None:
            _check_donation(leaves, self.donate)

    def _run(self, experts: Any) -> Any:
        """The move itself, on experts already checked."""
        if self.run is None:
            return experts
        flat, treedef = jax.tree_util.tree_flatten(experts)
        leaves = [flat[i] for i in self.positions]
        for position, moved in zip(self.positions, self.run(self.tables, leaves)):
            flat[position] = moved
        return jax.tree_util.tree_unflatten(treedef, flat)


def executor_trace_count() -> int:
    """How many times an executor has been traced (= compiled) in this process: a recompilation probe."""
    return _executor.trace_count()


# ----------------------------------------------------------------- validation
def _spec_entry(spec: PartitionSpec, dim: int):
    entries = tuple(spec) + (None,) * max(0, dim + 1 - len(spec))
    entry = entries[dim]
    if isinstance(entry, tuple) and len(entry) == 1:
        entry = entry[0]
    return entry


def _check_donation(leaves, donate: bool) -> None:
    if donate and len({id(leaf) for leaf in leaves}) < len(leaves):
        raise ValueError("an array appears twice in experts: it cannot be donated twice (pass donate=False)")


def _trimmed(spec: PartitionSpec, ndim: int | None = None) -> PartitionSpec:
    """``spec`` without trailing ``None`` entries: one spelling per sharding."""
    entries = [_spec_entry(spec, d) for d in range(len(spec) if ndim is None else ndim)]
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def _names(entry) -> tuple:
    if entry is None:
        return ()
    return entry if isinstance(entry, tuple) else (entry,)


def _same_mesh(a, b: Mesh) -> bool:
    return (
        tuple(a.axis_names) == tuple(b.axis_names)
        and a.devices.shape == b.devices.shape
        and all(x.id == y.id for x, y in zip(a.devices.flat, b.devices.flat))
    )


def _check_leaves(experts: Any, plan: TransportPlan, mesh: Mesh, axis: str):
    """Validates every leaf against the plan and mesh; returns (moving leaves, layouts, specs, positions).

    0-d leaves (an optimizer's step count) hold nothing per expert and pass
    through; every other leaf must have the slot axes.
    """
    with_path, _ = jax.tree_util.tree_flatten_with_path(experts)
    lead_shape = (plan.num_layers, plan.num_slots) if plan.layered else (plan.num_slots,)
    slot_dim = len(lead_shape) - 1
    leaves, layouts, specs, positions = [], [], [], []
    for position, (path, leaf) in enumerate(with_path):
        name = "experts" + jax.tree_util.keystr(path)
        if np.ndim(leaf) == 0 and not isinstance(leaf, Tracer):
            continue
        if not isinstance(leaf, jax.Array) or isinstance(leaf, Tracer):
            raise ValueError(f"{name} must be a concrete jax.Array, got {type(leaf).__name__}")
        if leaf.is_deleted():
            raise ValueError(f"{name} was deleted (donated to an earlier call?)")
        if leaf.shape[: len(lead_shape)] != lead_shape:
            raise ValueError(
                f"{name} has shape {leaf.shape}; its leading axes must be the slot axes {lead_shape} of the placement"
            )
        sharding = leaf.sharding
        if not isinstance(sharding, NamedSharding) or not _same_mesh(sharding.mesh, mesh):
            raise ValueError(f"{name} must be sharded with a NamedSharding on the given mesh, got {sharding}")
        spec = sharding.spec
        if _spec_entry(spec, slot_dim) != axis:
            raise ValueError(f"{name}: slot axis {slot_dim} must be sharded over mesh axis {axis!r}, spec is {spec}")
        if plan.layered and _spec_entry(spec, 0) is not None:
            raise ValueError(f"{name}: the layer axis must not be sharded, spec is {spec}")
        for dim in range(len(lead_shape), leaf.ndim):
            if axis in _names(_spec_entry(spec, dim)):
                raise ValueError(f"{name}: only the slot axis may be sharded over {axis!r}, spec is {spec}")
        local_shape = sharding.shard_shape(leaf.shape)
        layouts.append(leaf_layout(leaf.dtype, local_shape[len(lead_shape) :], name=name))
        specs.append(_trimmed(spec, leaf.ndim))
        leaves.append(leaf)
        positions.append(position)
    return leaves, layouts, specs, positions

"""The collective executor: move expert slots between EP ranks as packed byte rows.

``rearrange_experts`` validates the placements and the expert pytree, plans
the move on the host (:func:`plan_rearrangement`) and runs one jitted
``shard_map``. Per rank, inside it:

1. every leaf's local shard ``[L, P / G, ...]`` is viewed as rows
   ``[L * P / G, m_i]`` -- on GPU as ``uint32`` words (4 bytes per element
   moved: pack and scatter run ~2x faster than in 1-byte dtypes), on CPU in
   the leaf's own dtype (float8_e5m2 as ``uint8``); see ``packing``;
2. for each round ``d = 1 .. G - 1`` the rows to send to rank ``(r + d) % G``
   are gathered from every leaf and concatenated into one packed ``[C, B]``
   buffer of bytes (or words) -- only the rows that move -- and
   ``ppermute``-d, in chunks sent one after another (about 8 transfers per
   rank by default, so only one small send buffer is alive at a time);
3. local copies are gathered from the old rows; an optimisation barrier ends
   all reads of the old rows before any write;
4. every written row is scattered in place: local copies, then received rows,
   then duplicates (one received row may fill several slots of an expert).

With ``schedule="serial"`` the peak extra device memory is the received rows
plus one send chunk (XLA's temp size: 1.17x the bytes moved per rank on
2xH200, see ``benchmarks/RESULTS.md``).

``schedule="stream"`` (what ``"auto"`` picks without the put kernel) pipelines instead: the host reorders the
plan (``plan.order_for_streaming``) so that no row is overwritten before every
chunk that sends its old bytes; then per chunk ``c`` the executor packs chunk
``c + 1`` and starts its transfer, and writes the rows received in chunk ``c``
-- the writes and the next pack depend on no transfer still in flight, so XLA
may run them during it, and only about four chunks of packed rows are alive
(0.52x the bytes moved). The copies that run beside a transfer use the Pallas
row-copy kernels (``_row_copy``, ``copy_programs`` programs): XLA's gathers and
scatters fill every SM and slowed the NCCL transfer by about as much as they
overlapped it, a bounded grid leaves the transfer its bandwidth. The first
pack and the last writes, which overlap nothing, stay XLA's (fastest alone).

``schedule="put"`` (GPUs of one process; what the default ``"auto"``
picks there) keeps the streaming order but moves each chunk with one Pallas
Mosaic GPU kernel (``_nvlink``): the chunk's packed send rows of every round
are copied straight into their final rows on the peers over NVLink, while a
few of the kernel's programs pack the next chunk -- no receive buffer, no
unpack, one kernel per chunk instead of one NCCL transfer per round and
chunk (0.86-0.90 of a raw ``ppermute`` of the same bytes on 2xH200 vs
0.81-0.84 for the stream schedule; 0.26x the bytes moved in extra memory).
Elsewhere (CPU) the same data flow runs as a ``ppermute`` of the packed rows
and their destinations plus a scatter, so the schedule's logic is tested
everywhere.

All index tables are array arguments with bucketed shapes, so a later plan
with the same capacities reuses the compiled executor. ``prepare_move`` does
the host work of a move (validation, the plan's ordering, the table upload:
about a millisecond on 2xH200) ahead of time; the returned ``PreparedMove``
only checks the pytree and dispatches. The expert buffers are
donated (after validation), so the rows are updated in place.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from moe_eplb_jax.sharding import _nvlink
from moe_eplb_jax.sharding._row_copy import gather_rows, offsets_fit, scatter_rows
from moe_eplb_jax.sharding.mesh import axis_size, put_host
from moe_eplb_jax.sharding.packing import (
    from_row_view,
    leaf_layout,
    pack_rows,
    row_view,
    unpack_leaf,
    wire_dtype,
    wire_offsets,
)
from moe_eplb_jax.sharding.plan import TransportPlan, check_chunk_weights, order_for_streaming, plan_rearrangement

__all__ = [
    "rearrange_experts",
    "execute_plan",
    "prepare_move",
    "PreparedMove",
    "executor_trace_count",
    "row_bytes",
    "DEFAULT_MAX_CHUNK_BYTES",
    "SCHEDULES",
]

# Default chunking (max_chunk_bytes=None): split each rank's sends into about this many transfers, so the
# one send chunk alive at a time adds ~1/8 of the bytes moved to the received rows (measured: fewer,
# larger transfers are not faster on 2xH200, see benchmarks/RESULTS.md).
DEFAULT_TRANSFERS_PER_RANK = 8
DEFAULT_MAX_CHUNK_BYTES = None
# "serial": every read of the old rows (all sends) before any write. "stream": the plan is reordered
# (plan.order_for_streaming) so chunk c's received rows are written while chunk c + 1 is in flight.
# "put": the stream order, each chunk moved by one kernel writing the peers' rows over NVLink (_nvlink).
SCHEDULES = ("serial", "stream", "put")
# The default, "auto": "put" where its kernel can run (GPUs of one process, rows of a multiple of 128 bytes),
# else "stream". On 2xH200, moving 50% of a DeepSeek-sized layer set: put 7.8 ms at 0.26x extra memory, stream
# 8.4 ms at 0.52x, serial 9.7 ms at 1.17x (benchmarks/RESULTS.md).
DEFAULT_SCHEDULE = "auto"
# None: XLA gathers / scatters pack and write the rows; an int: the Pallas row-copy kernels with that many
# programs (GPU word rows only).
DEFAULT_COPY_PROGRAMS = 48
# Kernel options of the Pallas row copies (sharding._row_copy): words per work item, warps per program.
COPY_KERNEL_OPTIONS = {"block": 4096, "num_warps": 4}
# The put schedule's kernel (sharding._nvlink): programs (None: one per SM), how many of them pack the next
# chunk, and TMA buffers per program.
PUT_KERNEL_OPTIONS = {
    "num_programs": None,
    "pack_programs": _nvlink.DEFAULT_PACK_PROGRAMS,
    "stages": _nvlink.DEFAULT_STAGES,
}


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
    max_chunk_bytes: int | None = DEFAULT_MAX_CHUNK_BYTES,
    compiler_options: dict | None = None,
    schedule: str = DEFAULT_SCHEDULE,
    copy_programs: int | None = DEFAULT_COPY_PROGRAMS,
    chunk_weights=None,
) -> Any:
    """Moves expert slots so that ``experts`` follows ``new_phy2log`` instead of ``old_phy2log``.

    ``experts`` is a pytree of ``jax.Array`` leaves with a leading slot axis
    ``[P, ...]`` (tables ``[P]``) or leading ``[L, P, ...]`` axes (tables
    ``[L, P]``), the slot axis sharded over mesh axis ``axis``; 0-d leaves
    (such as an optax step count) pass through unchanged. Parameters,
    quantisation scales and optimizer state can go in one pytree: one plan
    moves them all. The tables may also be ``Placement`` objects. Afterwards
    slot ``p`` holds the bytes some slot ``q`` with
    ``old_phy2log[q] == new_phy2log[p]`` held before (bit for bit, any dtype);
    slots whose expert is unchanged are not written. With ``layer`` set, only
    that layer of an ``[L, P]`` placement moves.

    Everything is validated before any device work; on ``ValueError`` the input
    is untouched. With ``donate`` (default) the input buffers are reused for
    the result and must not be used afterwards. ``max_chunk_bytes`` splits each
    round's transfer into chunks of at most that many packed bytes (less peak
    memory, more collectives; default: about 8 transfers per rank in all);
    ``compiler_options`` go to XLA for the executor. ``schedule`` (one of
    ``SCHEDULES``, or ``"auto"``, the default: ``"put"`` where its kernel can
    run, else ``"stream"``): ``"stream"`` reorders the plan so each chunk's
    received rows are written while the next chunk is in flight (less memory:
    about four chunks; plans with a cycle of moves longer than a chunk run
    serially); ``"serial"`` packs every chunk before writing any row;
    ``"put"`` keeps the stream order but moves each chunk with one kernel
    that writes the packed rows straight into the peers' rows over NVLink
    (every device of the mesh in this process, rows of a multiple of 128
    bytes: ``ValueError`` otherwise; on CPU an equivalent ``ppermute`` +
    scatter, for tests).
    ``copy_programs`` (stream schedule): pack the send rows and write the received rows that
    overlap a transfer with the Pallas row-copy kernels (``sharding._row_copy``)
    of that many programs -- a bounded share of the GPU, so the copies slow the
    transfer less than XLA's gathers and scatters, which fill every SM -- or
    ``None`` for XLA's. Used only where the rows are ``uint32`` words (GPU);
    the first pack and the last writes, which overlap nothing, stay XLA's.
    ``chunk_weights`` (stream schedule): relative sizes of the chunks, one per
    chunk (overrides their number), e.g. ``(1, 4, 4, 4, 1)`` for a small first
    pack and last write; ``None``: equal chunks.
    Returns a pytree of the same structure, shapes, dtypes and shardings.
    """
    num_ranks = axis_size(mesh, axis)
    plan = plan_rearrangement(old_phy2log, new_phy2log, num_ranks, layer=layer, num_logical=num_logical)
    return execute_plan(
        experts,
        plan,
        mesh=mesh,
        axis=axis,
        donate=donate,
        max_chunk_bytes=max_chunk_bytes,
        compiler_options=compiler_options,
        schedule=schedule,
        copy_programs=copy_programs,
        chunk_weights=chunk_weights,
    )


def row_bytes(experts: Any, plan: TransportPlan, *, mesh: Mesh, axis: str = "ep") -> int:
    """Bytes of one packed slot row of ``experts`` (the sum over leaves of one slot's bytes)."""
    _, layouts, _, _ = _check_leaves(experts, plan, mesh, axis)
    return sum(layout.row_bytes for layout in layouts)


def execute_plan(
    experts: Any,
    plan: TransportPlan,
    *,
    mesh: Mesh,
    axis: str = "ep",
    donate: bool = True,
    max_chunk_bytes: int | None = DEFAULT_MAX_CHUNK_BYTES,
    compiler_options: dict | None = None,
    schedule: str = DEFAULT_SCHEDULE,
    copy_programs: int | None = DEFAULT_COPY_PROGRAMS,
    chunk_weights=None,
) -> Any:
    """Runs a precomputed :class:`TransportPlan` on ``experts`` (see :func:`rearrange_experts`).

    The same as ``prepare_move(experts, plan, ...)(experts)``: to keep the
    host work (validation, the plan's ordering, the table upload) off the
    critical path, call :func:`prepare_move` ahead and the move when due.
    """
    move = prepare_move(
        experts,
        plan,
        mesh=mesh,
        axis=axis,
        donate=donate,
        max_chunk_bytes=max_chunk_bytes,
        compiler_options=compiler_options,
        schedule=schedule,
        copy_programs=copy_programs,
        chunk_weights=chunk_weights,
    )
    return move._run(experts)  # validated just now by prepare_move


def prepare_move(
    experts: Any,
    plan: TransportPlan,
    *,
    mesh: Mesh,
    axis: str = "ep",
    donate: bool = True,
    max_chunk_bytes: int | None = DEFAULT_MAX_CHUNK_BYTES,
    compiler_options: dict | None = None,
    schedule: str = DEFAULT_SCHEDULE,
    copy_programs: int | None = DEFAULT_COPY_PROGRAMS,
    chunk_weights=None,
) -> PreparedMove:
    """Everything of :func:`execute_plan` but the move: a :class:`PreparedMove` to call when the move is due.

    Validates ``experts`` (only their structure, shapes, dtypes and shardings
    are used) against the plan and the mesh, orders the plan for the schedule,
    uploads its index tables to the mesh and picks the executor -- about a
    millisecond of host work per move on 2xH200 that a server can do while the
    model still runs (e.g. right after planning). Arguments as in
    :func:`rearrange_experts`; ``ValueError`` on bad input, before any device
    work.
    """
    if schedule not in SCHEDULES + ("auto",):
        raise ValueError(f"schedule must be 'auto' or one of {SCHEDULES}, got {schedule!r}")
    if max_chunk_bytes is not None and (not isinstance(max_chunk_bytes, (int, np.integer)) or max_chunk_bytes < 1):
        raise ValueError(f"max_chunk_bytes must be a positive integer or None, got {max_chunk_bytes!r}")
    if copy_programs is not None and (not isinstance(copy_programs, (int, np.integer)) or copy_programs < 1):
        raise ValueError(f"copy_programs must be a positive integer or None, got {copy_programs!r}")
    if chunk_weights is not None:  # checked here: the stream ordering's ValueError means "run serially"
        chunk_weights = check_chunk_weights(chunk_weights, "chunk_weights")
    if not isinstance(plan, TransportPlan):
        raise ValueError(f"plan must be a TransportPlan, got {type(plan).__name__}")
    num_ranks = axis_size(mesh, axis)
    if plan.num_ranks != num_ranks:
        raise ValueError(f"plan is for {plan.num_ranks} ranks but mesh axis {axis!r} has {num_ranks}")
    leaves, layouts, specs, positions = _check_leaves(experts, plan, mesh, axis)
    treedef = jax.tree_util.tree_structure(experts)
    signature = tuple((leaf.shape, leaf.dtype, spec) for leaf, spec in zip(leaves, specs))
    if plan.is_empty or not leaves:
        return PreparedMove(plan, mesh, treedef, tuple(positions), signature, bool(donate), None, None)
    _check_donation(leaves, donate)
    schedule = resolve_schedule(schedule, layouts, mesh, axis)
    put = _put_kind(schedule, layouts, mesh)
    num_chunks = _num_chunks(plan, layouts, max_chunk_bytes, schedule)
    plan, chunk_bounds = _streamed(plan, num_chunks, chunk_weights) if schedule != "serial" else (plan, ())
    if put and not chunk_bounds:  # a cycle longer than a chunk: one chunk, every send packed before any write
        chunk_bounds = (0, plan.capacities[0])
    tables, table_layout = device_tables(plan, mesh, axis, sender_destinations=bool(put))
    options = tuple(sorted((compiler_options or {}).items()))
    copy_programs = _copy_programs(copy_programs, leaves, layouts, plan) if chunk_bounds and not put else 0
    run = _executor(
        mesh,
        axis,
        tuple(specs),
        tuple(layouts),
        2 if plan.layered else 1,
        bool(donate),
        num_chunks,
        options,
        chunk_bounds,
        table_layout,
        copy_programs,
        put,
    )
    return PreparedMove(plan, mesh, treedef, tuple(positions), signature, bool(donate), tables, run)


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
            if not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer):
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


def device_tables(plan: TransportPlan, mesh: Mesh, axis: str = "ep", *, sender_destinations: bool = False):
    """The plan's index tables as one int32 array ``[G, T]`` on the mesh, and where each sits in it.

    One array, so a call costs one small host-to-device copy per device, not
    six (host time is on the critical path of every move). The layout --
    ``((name, start, shape), ...)`` -- is static: it keys the executor. With
    ``sender_destinations`` (the put schedule) also ``send_dst [G, G - 1, C]``:
    the receiver's row for each row a rank sends (its ``recv_dst`` entry).
    """
    tables = plan.device_tables()
    if sender_destinations:
        rounds = np.arange(1, plan.num_ranks)
        receiver = (np.arange(plan.num_ranks)[:, None] + rounds[None, :]) % plan.num_ranks  # [G, G - 1]
        tables["send_dst"] = plan.recv_dst[receiver, rounds[None, :] - 1]
    layout, parts, start = [], [], 0
    for name, table in tables.items():
        size = int(np.prod(table.shape[1:]))
        layout.append((name, start, tuple(int(d) for d in table.shape[1:])))
        parts.append(np.asarray(table, dtype=np.int32).reshape(table.shape[0], size))
        start += size
    return put_host(np.concatenate(parts, axis=1), mesh, PartitionSpec(axis)), tuple(layout)


def _streamed(plan: TransportPlan, num_chunks: int, weights=None) -> tuple[TransportPlan, tuple]:
    """``(plan ordered for the stream schedule, its chunk bounds)``, or ``(plan, ())``: run it serially.

    A plan already ordered (``order_for_streaming`` called by the caller, e.g.
    off the critical path) is used as it is, whatever ``num_chunks``.
    """
    if plan.chunk_bounds:
        return plan, plan.chunk_bounds
    try:
        ordered = order_for_streaming(plan, len(weights) if weights else num_chunks, weights=weights)
    except ValueError:  # a cycle of moves longer than a chunk: it cannot be streamed in these chunks
        return plan, ()
    return ordered, ordered.chunk_bounds


def resolve_schedule(schedule: str, layouts, mesh: Mesh, axis: str = "ep") -> str:
    """``schedule``, with ``"auto"`` made ``"put"`` where the NVLink kernel can move these rows, else ``"stream"``.

    ``"auto"`` picks the kernel only on meshes whose other axes have size 1
    (the configuration measured on GPUs); ``"put"`` by name runs it on any
    mesh, each group of the other axes moving among its own ranks.
    """
    if schedule != "auto":
        return schedule
    devices = list(mesh.devices.flat)
    one_axis = all(size == 1 for name, size in mesh.shape.items() if name != axis)
    return "put" if one_axis and _kernel_moves(layouts, devices) else "stream"  # _kernel_moves: GPUs only


def _put_kind(schedule: str, layouts, mesh: Mesh) -> str:
    """``""`` (not the put schedule), ``"kernel"`` (GPUs: the NVLink kernel) or ``"emulated"`` (no GPU).

    ``ValueError`` where the kernel cannot run on GPUs: devices of other
    processes, or rows that are not a multiple of 128 bytes.
    """
    if schedule != "put":
        return ""
    devices = list(mesh.devices.flat)
    if not _all_gpus(devices):
        return "emulated"
    if not _kernel_moves(layouts, devices):
        raise ValueError(
            "schedule='put' needs every device of the mesh in this process and slot rows of a multiple of 128 "
            f"bytes per leaf (got {[layout.row_bytes for layout in layouts]} bytes, "
            f"{jax.local_device_count()} of {jax.device_count()} devices local); use schedule='stream'"
        )
    return "kernel"


def _all_gpus(devices) -> bool:
    return all(d.platform == "gpu" for d in devices)


def _kernel_moves(layouts, devices) -> bool:
    """Whether the put kernel can move these rows (uint32 words of a multiple of 128 bytes) between ``devices``."""
    widths = [layout.row_bytes // 4 for layout in layouts]
    return wire_dtype(layouts) == np.uint32 and _nvlink.can_put(widths, devices)


def _copy_programs(copy_programs, leaves, layouts, plan) -> int:
    """Programs of the Pallas row-copy kernels, or 0: XLA copies (no word rows, or int32 offsets overflow)."""
    if not copy_programs or wire_dtype(layouts) != np.uint32:
        return 0
    rows = int(np.prod(leaves[0].sharding.shard_shape(leaves[0].shape)[: 2 if plan.layered else 1]))
    widths = [layout.row_bytes // 4 for layout in layouts]
    return int(copy_programs) if offsets_fit(rows, widths, max(plan.capacities)) else 0


def _num_chunks(plan: TransportPlan, layouts, max_chunk_bytes: int | None, schedule: str = "serial") -> int:
    """Chunks per round: enough that one chunk's packed rows fit in ``max_chunk_bytes``.

    By default the serial schedule sends about ``DEFAULT_TRANSFERS_PER_RANK``
    transfers in all; the stream and put schedules take that many steps (each
    step sends one chunk of every round).
    """
    capacity = plan.capacities[0]
    if capacity == 0:
        return 1
    if max_chunk_bytes is None:
        rounds = 1 if schedule != "serial" else max(1, plan.num_ranks - 1)
        return max(1, min(capacity, -(-DEFAULT_TRANSFERS_PER_RANK // rounds)))
    row = max(1, sum(layout.row_bytes for layout in layouts))
    rows_per_chunk = max(1, int(max_chunk_bytes) // row)
    return max(1, min(capacity, -(-capacity // rows_per_chunk)))


def _num_sms(mesh: Mesh) -> int:
    """Streaming multiprocessors of the mesh's first device (132 where the device does not say)."""
    return int(getattr(mesh.devices.flat[0], "core_count", 0) or 132)


def executor_trace_count() -> int:
    """How many times an executor has been traced (= compiled) in this process: a recompilation probe."""
    return _TRACES[0]


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


def _same_mesh(a: Mesh, b: Mesh) -> bool:
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
    word_view = WORD_VIEW if WORD_VIEW is not None else mesh.devices.flat[0].platform == "gpu"
    for position, (path, leaf) in enumerate(with_path):
        name = "experts" + jax.tree_util.keystr(path)
        if np.ndim(leaf) == 0 and not isinstance(leaf, jax.core.Tracer):
            continue
        if not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer):
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
        layouts.append(leaf_layout(leaf.dtype, local_shape[len(lead_shape) :], name=name, word_view=word_view))
        specs.append(_trimmed(spec, leaf.ndim))
        leaves.append(leaf)
        positions.append(position)
    return leaves, layouts, specs, positions


# ------------------------------------------------------------------ executor
_EXECUTORS: dict = {}
# Move rows as uint32 words (True), in their own dtype (False), or words on GPU only (None).
WORD_VIEW: bool | None = None
# Transfers in flight (packed send chunks alive) per rank. 2 would let packing overlap the previous
# transfer, but XLA did not overlap them on 2xH200 (same time, more memory): 1.
PIPELINE_DEPTH = 1
_TRACES = [0]


def _executor(
    mesh,
    axis,
    specs,
    layouts,
    num_lead,
    donate,
    num_chunks,
    options,
    chunk_bounds,
    table_layout,
    copy_programs=0,
    put="",
):
    """The jitted executor: serial (no ``chunk_bounds``), stream or put (``put``: ``_put_kind``) schedule.

    It takes ``(tables, leaves)``: the one table array of :func:`device_tables`
    (laid out as ``table_layout``) and the moving leaves.
    """
    copy = (copy_programs, tuple(sorted(COPY_KERNEL_OPTIONS.items()))) if copy_programs else (0, ())
    chunk_bounds = tuple(int(b) for b in chunk_bounds)
    key = (
        mesh,
        axis,
        specs,
        layouts,
        num_lead,
        donate,
        0 if chunk_bounds else num_chunks,
        options,
        0 if chunk_bounds else PIPELINE_DEPTH,
        chunk_bounds,
        table_layout,
        copy,
        (
            put,
            PUT_KERNEL_OPTIONS.get("num_programs") or _num_sms(mesh),
            PUT_KERNEL_OPTIONS["pack_programs"],
            PUT_KERNEL_OPTIONS["stages"],
        )
        if put
        else (),
    )
    if key not in _EXECUTORS:
        _EXECUTORS[key] = _build_executor(*key)
    return _EXECUTORS[key]


def _build_executor(
    mesh, axis, specs, layouts, num_lead, donate, num_chunks, options, depth, chunk_bounds, table_layout, copy, put
):
    num_ranks = int(mesh.shape[axis])
    copy_programs, kernel_options = copy[0], dict(copy[1])

    starts = {name: (start, shape[-1]) for name, start, shape in table_layout}  # flat start, row width

    # `rows` / `dst`: (the local table array [1, T], table name, round d, chunk slice). overlapped=False:
    # nothing runs beside this copy (the first pack, the last writes): XLA's full-GPU copies, which take the
    # slice; the Pallas kernels read their window of the table in place (a sliced operand would be copied
    # into a buffer of its own first: a device memcpy and one more launch per copy).
    def window(ref):  # (flat table, index_start, index_count) of row d - 1, positions part, of a [G - 1, C] table
        table, name, d, part = ref
        start, width = starts[name]
        return table[0], start + (d - 1) * width + part.start, part.stop - part.start

    def sliced(ref):  # the same window as a slice (XLA's copies take their indices as an operand)
        table, start, count = window(ref)
        return table[start : start + count]

    def pack(current, rows, overlapped=True):  # the send rows of every leaf, packed: [C, B]
        if copy_programs and overlapped:
            table, start, count = window(rows)
            return gather_rows(
                current, table, num_programs=copy_programs, index_start=start, index_count=count, **kernel_options
            )
        return pack_rows(current, layouts, sliced(rows))

    def write_received(current, buf, dst, overlapped=True):  # received rows into rows dst (out of range: padding)
        if copy_programs and overlapped:
            table, start, count = window(dst)
            return scatter_rows(
                current, buf, table, num_programs=copy_programs, index_start=start, index_count=count, **kernel_options
            )
        dst = sliced(dst)
        return [
            r.at[dst].set(unpack_leaf(buf, layouts, i), mode="drop", unique_indices=True) for i, r in enumerate(current)
        ]

    def open_rows(table, leaves):  # {name: table} of the local [1, T] table array (static slices), row views
        _TRACES[0] += 1
        tables = {
            name: table[0, start : start + int(np.prod(shape))].reshape(shape) for name, start, shape in table_layout
        }
        num_rows = int(np.prod(leaves[0].shape[:num_lead]))
        return tables, [row_view(leaf, layout, num_rows) for leaf, layout in zip(leaves, layouts)]

    def write_copies(rows, copied, tables):  # local copies (read from the old rows) into their slots
        return [r.at[tables["copy_dst"]].set(c, mode="drop", unique_indices=True) for r, c in zip(rows, copied)]

    def close_rows(rows, tables, leaves):  # duplicate slots filled, then the leaves' own shapes
        dup_dst, dup_src = tables["dup_dst"], tables["dup_src"]  # [D]
        if dup_dst.shape[0]:  # further slots of a received expert, from its first (just written) slot
            rows = [r.at[dup_dst].set(r[dup_src], mode="drop", unique_indices=True) for r in rows]
        return [from_row_view(r, layout, leaf.shape) for r, layout, leaf in zip(rows, layouts, leaves)]

    def serial(table, leaves):
        tables, rows = open_rows(table, leaves)
        send_rows = tables["send_rows"]  # [G - 1, C]
        copy_dst, copy_src = tables["copy_dst"], tables["copy_src"]  # [K]

        # Transfers: round by round, chunk by chunk. The gather of transfer j waits for transfer
        # j - depth to arrive, so at most `depth` packed send chunks are alive.
        capacity = send_rows.shape[-1]
        chunk = -(-capacity // num_chunks) if capacity else 0
        steps = [(d, start) for d in range(1, num_ranks) for start in range(0, capacity, chunk or 1)]
        gate, outgoing, incoming, dsts = rows, [], [], []
        for j, (d, start) in enumerate(steps):
            if j >= depth:
                _, gate = jax.lax.optimization_barrier((incoming[j - depth], gate))
            perm = [(r, (r + d) % num_ranks) for r in range(num_ranks)]
            outgoing.append(
                pack(gate, (table, "send_rows", d, slice(start, min(start + chunk, capacity))), overlapped=False)
            )  # moving rows
            incoming.append(jax.lax.ppermute(outgoing[-1], axis, perm))
            dsts.append((table, "recv_dst", d, slice(start, min(start + chunk, capacity))))
        copied = [r[copy_src] for r in gate] if copy_dst.shape[0] else None
        # Every read of the old rows (the last sends, local copies) happens before any row is written;
        # earlier sends precede the gate already. Writes may overlap the last transfers.
        _, copied, rows = jax.lax.optimization_barrier((outgoing[-depth:], copied, gate))

        if copied is not None:
            rows = write_copies(rows, copied, tables)
        for dst, buf in zip(dsts, incoming):  # serial: the copies run beside no transfer, XLA's are fastest
            rows = write_received(rows, buf, dst, overlapped=False)
        return close_rows(rows, tables, leaves)

    def stream(table, leaves):
        # Pipeline per rank: pack chunk c + 1 and start its transfers, then write the rows received in
        # chunk c. The plan is ordered (plan.order_for_streaming) so that no row written in chunk c is read
        # by a later chunk; the only order to enforce is that chunk c + 1's packs (and the local copies'
        # gather) read the rows before chunk c's writes -- an optimisation barrier, not a data dependency
        # on any transfer, so the writes and the next pack may overlap the transfers in flight.
        tables, rows = open_rows(table, leaves)
        copy_dst, copy_src = tables["copy_dst"], tables["copy_src"]
        capacity = tables["send_rows"].shape[-1]
        # Chunk c covers positions chunk_bounds[c]:chunk_bounds[c + 1]; positions past the last bound (a plan
        # padded after ordering) are padding only.
        steps = len(chunk_bounds) - 1 if num_ranks > 1 and capacity else 0
        rounds = range(1, num_ranks)
        part = lambda c: slice(chunk_bounds[c], chunk_bounds[c + 1])

        def send(c, current):  # chunk c of every round, packed from the current rows, on its way
            packed = [pack(current, (table, "send_rows", d, part(c)), overlapped=c > 0) for d in rounds]
            perms = [[(r, (r + d) % num_ranks) for r in range(num_ranks)] for d in rounds]
            return packed, [jax.lax.ppermute(p, axis, perm) for p, perm in zip(packed, perms)]

        copied = [r[copy_src] for r in rows] if copy_dst.shape[0] else None
        incoming = send(0, rows)[1] if steps else []
        for c in range(steps):
            packed_next, incoming_next = send(c + 1, rows) if c + 1 < steps else ([], [])
            rows, _ = jax.lax.optimization_barrier((rows, (packed_next, copied if c == 0 else None)))
            for d, buf in zip(rounds, incoming):
                rows = write_received(rows, buf, (table, "recv_dst", d, part(c)), overlapped=c + 1 < steps)
            incoming = incoming_next
        if copied is not None and not steps:  # nothing sent: the copies still read before any write
            rows, copied = jax.lax.optimization_barrier((rows, copied))
        if copied is not None:  # last: the old bytes of a copy's destination may have been sent
            rows = write_copies(rows, copied, tables)
        return close_rows(rows, tables, leaves)

    def put_schedule(table, leaves):
        # Per chunk c: pack the chunk's send rows of every round, then one kernel writes them into their rows
        # on the receivers. The plan's streaming order means no row written in chunk c is read by a later
        # chunk; within chunk c every rank has packed (read) its rows before any peer writes, because the
        # kernel starts with a cross-device barrier and each rank's pack precedes its kernel.
        # The kernel of chunk c also packs chunk c + 1 on a few programs, beside its writes (only chunk 0 is
        # packed alone, by XLA): rows packed for c + 1 are not written in c (the streaming order).
        kind, num_programs, pack_programs, stages = put
        tables, rows = open_rows(table, leaves)
        copy_dst, copy_src = tables["copy_dst"], tables["copy_src"]
        send_rows, send_dst = tables["send_rows"], tables["send_dst"]  # [G - 1, C]
        steps = len(chunk_bounds) - 1 if num_ranks > 1 and send_rows.shape[-1] else 0
        offsets = wire_offsets(layouts)
        part = lambda c: slice(chunk_bounds[c], chunk_bounds[c + 1])
        copied = [r[copy_src] for r in rows] if copy_dst.shape[0] else None
        if copied is not None:  # the local copies read the old rows before any kernel writes them in place
            rows, copied = jax.lax.optimization_barrier((rows, copied))
        packed = pack_rows(rows, layouts, send_rows[:, part(0)].reshape(-1)) if steps else None
        for c in range(steps):
            per_round = part(c).stop - part(c).start
            dst = send_dst[:, part(c)].reshape(-1)  # [(G - 1) * per_round]: rows on the receivers
            following = send_rows[:, part(c + 1)].reshape(-1) if c + 1 < steps else None
            if kind == "kernel":
                rows, packed = _nvlink.put_rows(
                    packed,
                    dst,
                    rows,
                    following,
                    axis=axis,
                    num_ranks=num_ranks,
                    rows_per_round=per_round,
                    offsets=offsets,
                    num_programs=num_programs,
                    pack_programs=pack_programs,
                    stages=stages,
                )
                continue
            # The same data flow with collectives (no GPU): rows and their destinations, then a scatter.
            for d in range(1, num_ranks):
                mine = slice((d - 1) * per_round, d * per_round)
                perm = [(r, (r + d) % num_ranks) for r in range(num_ranks)]
                got, where = jax.lax.ppermute((packed[mine], dst[mine]), axis, perm)
                rows = [
                    r.at[where].set(unpack_leaf(got, layouts, i), mode="drop", unique_indices=True)
                    for i, r in enumerate(rows)
                ]
            packed = pack_rows(rows, layouts, following) if following is not None else None
        if copied is not None:
            rows = write_copies(rows, copied, tables)
        return close_rows(rows, tables, leaves)

    table_spec = PartitionSpec(axis)
    body = put_schedule if put else stream if chunk_bounds else serial
    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(table_spec, list(specs)),
        out_specs=list(specs),
        check_vma=not (put and put[0] == "kernel"),
    )
    # Explicit shardings: leaves whose specs differ only in spelling (trailing None) hit the same cache entry.
    leaf_shardings = [NamedSharding(mesh, spec) for spec in specs]
    table_shardings = NamedSharding(mesh, table_spec)
    return jax.jit(
        mapped,
        in_shardings=(table_shardings, leaf_shardings),
        out_shardings=leaf_shardings,
        donate_argnums=(1,) if donate else (),
        compiler_options=dict(options) or None,
    )

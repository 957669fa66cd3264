"""The jitted executor of a move: per EP rank, pack the rows that leave, move them, write the rows that arrive.

It takes the plan's index tables as one int32 array ``[G, T]``
(:func:`device_tables`) and the moving leaves; per rank each leaf's shard
``[L, P / G, ...]`` is viewed as rows ``[L * P / G, m]`` of unsigned integers
(``packing``), so every op between the entry and exit bitcasts is an integer
op. The plan is ordered for streaming (:func:`stream_order`): no row is
overwritten before every chunk that sends its old bytes has been packed. Then,
chunk by chunk, one of two schedules, picked by shape:

* ``put`` -- every device a GPU of this process, one EP axis, word rows of a
  multiple of 128 bytes: one Mosaic GPU kernel per chunk writes the chunk's
  packed rows straight into their final rows on the peers over NVLink and
  packs the next chunk beside (``_nvlink``). No receive buffer, no NCCL.
* ``stream`` -- elsewhere: chunk ``c + 1`` is packed and ``ppermute``-d while
  the rows of chunk ``c`` are written; on GPUs with word rows the copies beside
  a transfer are bounded-grid Pallas kernels (``_row_copy``) that leave the
  transfer its bandwidth, XLA's gathers / scatters elsewhere.

Local copies read the old rows before any write and land last; duplicates
(further slots of a received expert) are copied from its first slot at the
end. A kernel that is missing or fails to compile here is replaced by the next
candidate (put, stream with Pallas copies, stream with XLA copies), with one
warning per kernel and process.
"""

from __future__ import annotations

import warnings

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from moe_eplb_jax.transport import _nvlink, _row_copy
from moe_eplb_jax.transport.mesh import put_host
from moe_eplb_jax.transport.packing import from_row_view, pack_rows, row_view, unpack_leaf, wire_dtype, wire_offsets
from moe_eplb_jax.transport.plan import TransportPlan
from moe_eplb_jax.transport.streaming import order_for_streaming

__all__ = ["SCHEDULES", "build", "device_tables", "stream_order", "trace_count"]

# What a move runs, best first: the NVLink put kernel, the stream schedule with Pallas row copies, with XLA's.
SCHEDULES = ("put", "stream_pallas_copies", "stream_xla_copies")

_EXECUTORS: dict = {}  # (mesh, axis, specs, layouts, lead axes, donate, chunks, table layout, schedule, config) -> run
_FAILED_KERNELS: set = set()  # kernels that could not run here (warned once)
_TRACES = [0]


def trace_count() -> int:
    """How many times an executor has been traced (= compiled) in this process."""
    return _TRACES[0]


def stream_order(plan: TransportPlan) -> TransportPlan:
    """``plan`` ordered for streaming in up to 8 chunks per round (fewer where a cycle of moves needs them).

    A plan already ordered (``order_for_streaming`` called ahead) is used as
    it is. Eight chunks: a rank's packed chunks in flight then hold a few
    eighths of the bytes moved, and fewer, larger transfers do not pay
    (``docs/transport.md``).
    """
    if plan.chunk_bounds:
        return plan
    chunks = min(plan.capacities[0], 8)
    while chunks > 1:
        try:
            return order_for_streaming(plan, chunks)
        except ValueError:  # a cycle of moves longer than a chunk: larger chunks
            chunks //= 2
    return order_for_streaming(plan, 1)  # one chunk holds every cycle


def device_tables(plan: TransportPlan, mesh: Mesh, axis: str, *, sender_destinations: bool) -> tuple[jax.Array, tuple]:
    """The plan's index tables as one int32 array ``[G, T]`` on the mesh, and where each sits in it.

    One array, so a move costs one small host-to-device copy per device, not
    six. The layout -- ``((name, start, shape), ...)`` -- is static: it keys
    the executor. With ``sender_destinations`` (the put schedule) also
    ``send_dst [G, G - 1, C]``: the receiver's row for each row a rank sends.
    """
    tables = plan.device_tables()
    if sender_destinations:
        tables["send_dst"] = plan.send_dst
    layout, parts, start = [], [], 0
    for name, table in tables.items():
        size = int(np.prod(table.shape[1:]))
        layout.append((name, start, tuple(int(d) for d in table.shape[1:])))
        parts.append(np.asarray(table, dtype=np.int32).reshape(table.shape[0], size))
        start += size
    return put_host(np.concatenate(parts, axis=1), mesh, PartitionSpec(axis)), tuple(layout)


def _on_gpus(mesh: Mesh) -> bool:
    return all(d.platform == "gpu" for d in mesh.devices.flat)


def _candidates(plan: TransportPlan, leaves, layouts, mesh: Mesh, axis: str) -> list[tuple[str, object]]:
    """``[(schedule, kernel config)]`` that may move these rows on this mesh, best first."""
    out: list[tuple[str, object]] = []
    if _on_gpus(mesh) and wire_dtype(layouts) == np.uint32:
        widths = [layout.row_bytes // 4 for layout in layouts]
        one_axis = all(size == 1 for name, size in mesh.shape.items() if name != axis)
        if one_axis and _nvlink.can_put(widths, mesh.devices.flat):
            out.append(("put", _nvlink.config_for(mesh.devices.flat[0])))
        rows = int(np.prod(leaves[0].sharding.shard_shape(leaves[0].shape)[: 2 if plan.layered else 1]))
        if _row_copy.offsets_fit(rows, widths, plan.capacities[0]):
            out.append(("stream_pallas_copies", _row_copy.Config()))
    out.append(("stream_xla_copies", None))
    return out


def build(plan: TransportPlan, leaves, layouts, specs, mesh: Mesh, axis: str, donate: bool):
    """``(schedule, run, tables)`` for an ordered plan: the first candidate that compiles here, and its tables.

    ``run(tables, leaves)`` is the jitted executor (cached: a later plan of
    the same shapes reuses it without tracing).
    """
    candidates = [c for c in _candidates(plan, leaves, layouts, mesh, axis) if c[0] not in _FAILED_KERNELS]
    base = (mesh, axis, tuple(specs), tuple(layouts), 2 if plan.layered else 1, bool(donate), plan.chunk_bounds)
    for name, config in candidates:
        tables, table_layout = device_tables(plan, mesh, axis, sender_destinations=name == "put")
        key = base + (table_layout, name, config)
        if key in _EXECUTORS:
            return name, _EXECUTORS[key], tables
        run = _jitted(*key)
        if config is not None:  # a Pallas kernel: compile now, so a backend that cannot run it is found here
            try:
                run.lower(tables, leaves).compile()
            except Exception as err:  # any failure to lower or compile: the next candidate
                _FAILED_KERNELS.add(name)
                warnings.warn(
                    f"moe_eplb_jax.transport: the {name} schedule cannot run here ({type(err).__name__}: "
                    f"{str(err)[:300]}); moving experts with the next of {SCHEDULES} instead",
                    RuntimeWarning,
                    stacklevel=3,
                )
                continue
        _EXECUTORS[key] = run
        return name, run, tables
    raise AssertionError("the XLA schedule is always a candidate")


def _jitted(mesh, axis, specs, layouts, num_lead, donate, chunk_bounds, table_layout, schedule, config):
    """The jitted ``shard_map`` of one schedule; it takes ``(tables [G, T], leaves)``."""
    num_ranks = int(mesh.shape[axis])
    starts = {name: (start, shape[-1]) for name, start, shape in table_layout}  # flat start, row width
    steps = len(chunk_bounds) - 1

    def part(c):
        return slice(chunk_bounds[c], chunk_bounds[c + 1])

    # A table window is (the local table array [1, T], table name, round d, positions): XLA's copies take it as
    # a sliced operand; the Pallas kernels read it in place (a sliced operand would cost a copy and a launch).
    def window(table, name, d, positions):
        start, width = starts[name]
        return table[0], start + (d - 1) * width + positions.start, positions.stop - positions.start

    def pack(current, table, d, positions, overlapped):  # the send rows of every leaf, packed: [C, B]
        flat, start, count = window(table, "send_rows", d, positions)
        if schedule == "stream_pallas_copies" and overlapped:
            return _row_copy.gather_rows(current, flat, config=config, index_start=start, index_count=count)
        return pack_rows(current, layouts, flat[start : start + count])

    def write_received(current, buf, table, d, positions, overlapped):  # rows past the views are padding
        flat, start, count = window(table, "recv_dst", d, positions)
        if schedule == "stream_pallas_copies" and overlapped:
            return _row_copy.scatter_rows(current, buf, flat, config=config, index_start=start, index_count=count)
        dst = flat[start : start + count]
        return [
            r.at[dst].set(unpack_leaf(buf, layouts, i), mode="drop", unique_indices=True) for i, r in enumerate(current)
        ]

    def open_rows(table, leaves):  # {name: table} of the local [1, T] table array (static slices), row views
        _TRACES[0] += 1
        tables = {
            name: table[0, start : start + int(np.prod(shape))].reshape(shape) for name, start, shape in table_layout
        }
        num_rows = int(np.prod(leaves[0].shape[:num_lead]))
        copied = None
        rows = [row_view(leaf, layout, num_rows) for leaf, layout in zip(leaves, layouts)]
        if tables["copy_dst"].shape[0]:  # local copies read the old rows before anything is written
            copied = [r[tables["copy_src"]] for r in rows]
            rows, copied = jax.lax.optimization_barrier((rows, copied))
        return tables, rows, copied

    def close_rows(rows, copied, tables, leaves):  # local copies, duplicates, then the leaves' own shapes
        if copied is not None:
            rows = [r.at[tables["copy_dst"]].set(c, mode="drop", unique_indices=True) for r, c in zip(rows, copied)]
        dup_dst, dup_src = tables["dup_dst"], tables["dup_src"]
        if dup_dst.shape[0]:  # further slots of a received expert, from its first (just written) slot
            rows = [r.at[dup_dst].set(r[dup_src], mode="drop", unique_indices=True) for r in rows]
        return [from_row_view(r, layout, leaf.shape) for r, layout, leaf in zip(rows, layouts, leaves)]

    def stream(table, leaves):
        # Per chunk c: pack chunk c + 1 and start its transfers, then write the rows received in chunk c. The
        # streaming order means no row written in chunk c is read by a later chunk, so the one order to enforce
        # is that chunk c + 1's packs read the rows before chunk c's writes: an optimisation barrier, not a
        # dependency on a transfer in flight, so the writes and the next pack may overlap it.
        tables, rows, copied = open_rows(table, leaves)
        moving = steps if num_ranks > 1 and tables["send_rows"].shape[-1] else 0
        rounds = range(1, num_ranks)

        def send(c, current):  # chunk c of every round, packed from the current rows, on its way
            packed = [pack(current, table, d, part(c), overlapped=c > 0) for d in rounds]
            perms = [[(r, (r + d) % num_ranks) for r in range(num_ranks)] for d in rounds]
            return packed, [jax.lax.ppermute(p, axis, perm) for p, perm in zip(packed, perms)]

        incoming = send(0, rows)[1] if moving else []
        for c in range(moving):
            packed_next, incoming_next = send(c + 1, rows) if c + 1 < moving else ([], [])
            rows, _ = jax.lax.optimization_barrier((rows, packed_next))
            for d, buf in zip(rounds, incoming):
                rows = write_received(rows, buf, table, d, part(c), overlapped=c + 1 < moving)
            incoming = incoming_next
        return close_rows(rows, copied, tables, leaves)

    def put(table, leaves):
        # Per chunk c, one kernel writes chunk c's packed rows of every round into their rows on the receivers
        # and packs chunk c + 1 beside (only chunk 0 is packed alone, by XLA). The kernel starts with a
        # cross-device barrier, so every rank has packed chunk c before a peer writes into it; the streaming
        # order means rows packed for chunk c + 1 are not written in chunk c.
        tables, rows, copied = open_rows(table, leaves)
        send_rows, send_dst = tables["send_rows"], tables["send_dst"]  # [G - 1, C]
        offsets = wire_offsets(layouts)
        packed = pack_rows(rows, layouts, send_rows[:, part(0)].reshape(-1)) if send_rows.shape[-1] else None
        for c in range(steps if packed is not None else 0):
            following = send_rows[:, part(c + 1)].reshape(-1) if c + 1 < steps else None
            rows, packed = _nvlink.put_rows(
                packed,
                send_dst[:, part(c)].reshape(-1),
                rows,
                following,
                axis=axis,
                num_ranks=num_ranks,
                rows_per_round=part(c).stop - part(c).start,
                offsets=offsets,
                config=config,
            )
        return close_rows(rows, copied, tables, leaves)

    table_spec = PartitionSpec(axis)
    mapped = jax.shard_map(
        put if schedule == "put" else stream,
        mesh=mesh,
        in_specs=(table_spec, list(specs)),
        out_specs=list(specs),
        check_vma=schedule != "put",  # the kernel's peer writes are not visible to the type system
    )
    # Explicit shardings: leaves whose specs differ only in spelling (trailing None) hit the same cache entry.
    leaf_shardings = [NamedSharding(mesh, spec) for spec in specs]
    return jax.jit(
        mapped,
        in_shardings=(NamedSharding(mesh, table_spec), leaf_shardings),
        out_shardings=leaf_shardings,
        donate_argnums=(1,) if donate else (),
    )

"""The Pallas Mosaic GPU put kernel: TMA bulk copies HBM -> shared memory -> the peer's HBM (see the package)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_eplb_jax.transport._nvlink.config import Config

__all__ = ["put_rows_mosaic"]


def put_rows_mosaic(
    staged,
    dst,
    row_views,
    next_rows,
    *,
    axis: str,
    num_ranks: int,
    rows_per_round: int,
    offsets,
    widths: tuple[int, ...],
    chunks: tuple[int, ...],
    config: Config,
    local: bool,
    interpret,
):
    """The kernel on checked inputs (``api.put_rows``): ``(row views, next staged buffer or None)``."""
    packing = next_rows is not None
    kernel = _Kernel(
        axis=axis,
        num_ranks=num_ranks,
        rows_per_round=rows_per_round,
        num_rows=int(row_views[0].shape[0]),
        widths=widths,
        chunks=chunks,
        offsets=tuple(int(o) for o in offsets),
        num_programs=config.num_programs,
        stages=config.stages,
        pack_programs=config.pack_programs if packing else 0,
        num_staged=int(staged.shape[0]),
        num_next=int(next_rows.shape[0]) if packing else 0,
        packing=packing,
        local=local,
        interpret=bool(interpret),
    )

    def body(staged_ref, dst_ref, *refs):
        _kernel_body(kernel, staged_ref, dst_ref, *refs)

    # The row views go in as mutable refs: the kernel writes them in place (mpmd_map aliases a written Ref
    # input to its output), with no copy of the leaves.
    refs = [jax.new_ref(v) for v in row_views]
    out_type = jax.ShapeDtypeStruct((kernel.num_next, int(staged.shape[1])), staged.dtype) if packing else ()
    inputs = (staged, dst) + ((next_rows,) if packing else ())
    next_staged = plgpu.kernel(
        body,
        out_type=out_type,
        grid=(1 if interpret else kernel.num_programs,),
        grid_names=("programs",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )(*inputs, *refs)
    return [jax.freeze(r) for r in refs], (next_staged if packing else None)


@dataclasses.dataclass(frozen=True)
class _Kernel:
    """The static shape of one :func:`put_rows` call, which the kernel body is traced with.

    ``pack_programs`` is 0 without rows to pack; the programs that do not
    pack write this chunk (``put_programs``).
    """

    axis: str
    num_ranks: int
    rows_per_round: int
    num_rows: int  # rows of each row view
    widths: tuple[int, ...]  # words per row of each leaf
    chunks: tuple[int, ...]  # words per TMA copy of each leaf
    offsets: tuple[int, ...]  # first word of each leaf in a packed row
    num_programs: int
    stages: int
    pack_programs: int
    num_staged: int
    num_next: int
    packing: bool  # next_rows given: pack_programs of the programs pack them
    local: bool
    interpret: bool

    @property
    def put_programs(self) -> int:
        return self.num_programs - self.pack_programs


def _kernel_body(k: _Kernel, staged_ref, dst_ref, *refs):
    """Each program's share of this chunk's writes (or of the next chunk's packing), then the completion
    signal: every program releases a semaphore on every peer, program 0 waits for all of theirs."""
    num_leaves = len(k.widths)
    if k.packing:
        next_ref, row_refs, next_out = refs[0], refs[1 : 1 + num_leaves], refs[1 + num_leaves]
    else:
        next_ref, row_refs, next_out = None, refs[:num_leaves], None

    @functools.partial(
        pl.run_scoped,
        buf=plgpu.SMEM((k.stages, max(k.chunks)), jnp.uint32),
        loaded=[plgpu.Barrier(num_arrivals=1, num_barriers=k.stages) for _ in range(num_leaves)],
    )
    def _copies(buf, loaded):
        if k.interpret:  # checks on CPU: one program, running each program's share in turn
            for program in range(k.put_programs):
                _write_peers(k, staged_ref, dst_ref, row_refs, program, buf, loaded)
            for program in range(k.pack_programs):
                _pack_next(k, next_ref, next_out, row_refs, program, buf, loaded)
        else:
            program = lax.axis_index("programs")

            @pl.when(program < k.put_programs)
            def _():
                _write_peers(k, staged_ref, dst_ref, row_refs, program, buf, loaded)

            if k.packing:

                @pl.when(program >= k.put_programs)
                def _():
                    _pack_next(k, next_ref, next_out, row_refs, program - k.put_programs, buf, loaded)

        plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # every store has landed, not just left SMEM

    if k.local:
        return
    done = pl.get_global(plgpu.SemaphoreType.REGULAR)  # zeroed by XLA before every launch
    me = lax.axis_index(k.axis)
    for d in range(1, k.num_ranks):  # release.sys: this program's writes are visible before the signal
        pl.semaphore_signal(done, 1, device_id={k.axis: lax.rem(me + d, k.num_ranks)})

    # One waiter suffices (the kernel ends when every program ends); the other programs stay free, so a
    # program not yet resident can still be scheduled (no cross-GPU deadlock on occupancy).
    @pl.when(lax.axis_index("programs") == 0)
    def _():
        pl.semaphore_wait(done, k.num_programs * (k.num_ranks - 1), decrement=False)


def _write_peers(k: _Kernel, staged_ref, dst_ref, row_refs, program, buf, loaded):
    """This chunk's packed rows into their rows on the receivers (padding rows skipped)."""

    def target(row_ref, row):  # the receiving rank's row view of packed row `row` (its round)
        if k.local:  # no mesh needed (interpreter checks)
            return row_ref
        receiver = lax.rem(lax.axis_index(k.axis) + 1 + lax.div(row, k.rows_per_round), k.num_ranks)
        return plgpu.remote_ref(row_ref, {k.axis: receiver})  # pyright: ignore[reportArgumentType]

    def is_real(row):  # padding rows name destinations past the receiver's rows
        return (dst_ref[row] >= 0) & (dst_ref[row] < k.num_rows)

    for leaf, (row_ref, chunk, offset) in enumerate(zip(row_refs, k.chunks, k.offsets)):

        def packed(row, col, chunk=chunk, offset=offset):  # this leaf's words of packed row `row`
            return staged_ref.at[row, pl.ds(offset + col, chunk)]

        def on_receiver(row, col, row_ref=row_ref, chunk=chunk):  # where they go on the receiving rank
            return target(row_ref, row).at[dst_ref[row], pl.ds(col, chunk)]

        _copy_loop(
            program,
            k.put_programs,
            k.num_staged,
            chunk,
            k.widths[leaf] // chunk,
            packed,
            on_receiver,
            is_real,
            buf,
            loaded[leaf],
            k.stages,
        )


def _pack_next(k: _Kernel, rows_ref, out_ref, row_refs, program, buf, loaded):
    """The next chunk's rows, from the local row views, into the next staged buffer."""
    assert rows_ref is not None and out_ref is not None
    for leaf, (row_ref, chunk, offset) in enumerate(zip(row_refs, k.chunks, k.offsets)):

        def local_row(row, col, row_ref=row_ref, chunk=chunk):  # local row next_rows[row] of this leaf
            return row_ref.at[rows_ref[row], pl.ds(col, chunk)]

        def next_packed(row, col, chunk=chunk, offset=offset):  # its place in the next staged buffer
            return out_ref.at[row, pl.ds(offset + col, chunk)]

        _copy_loop(
            program,
            k.pack_programs,
            k.num_next,
            chunk,
            k.widths[leaf] // chunk,
            local_row,
            next_packed,
            lambda row: row >= 0,
            buf,
            loaded[leaf],
            k.stages,
        )


def _copy_loop(program, programs, rows, chunk, per_row, source, dest, valid, buf, loaded, stages):
    """Copies items ``program, program + programs, ...`` of ``rows * per_row``: TMA in, TMA out.

    Each item is ``chunk`` words of one row (``source(row, col)`` ->
    ``dest(row, col)``), skipped where ``valid(row)`` is false; ``stages``
    shared-memory buffers of ``buf`` cycle, each guarded by its barrier of
    ``loaded``.
    """
    count = lax.div(rows * per_row - program + (programs - 1), programs)

    def locate(step):  # (row, first word in the leaf's row)
        item = program + step * programs
        return lax.div(item, per_row), lax.rem(item, per_row) * chunk

    def load(step):
        row, col = locate(step)
        slot = lax.rem(step, stages)

        @pl.when(valid(row))
        def _():
            # PROMISE_IN_BOUNDS: a plain contiguous bulk copy (no tensor map, no box limit).
            plgpu.copy_gmem_to_smem(
                source(row, col),
                buf.at[slot, pl.ds(0, chunk)],
                loaded.at[slot],
                oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS,
            )

    for s in range(stages):  # prologue: every buffer loading

        @pl.when(s < count)
        def _(s=s):
            load(s)

    @pl.loop(0, count)
    def _step(step):
        row, col = locate(step)
        slot = lax.rem(step, stages)

        @pl.when(valid(row))
        def _():
            plgpu.barrier_wait(loaded.at[slot])
            plgpu.copy_smem_to_gmem(buf.at[slot, pl.ds(0, chunk)], dest(row, col))
            # The previous step's buffer is refilled below: its store must have read it (this step's
            # store may still be reading its own).
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)

        @pl.when(~valid(row))  # no store this step: the last one may be the previous step's
        def _():
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        refill = step - 1 + stages

        @pl.when((step >= 1) & (refill < count))
        def _():
            load(refill)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the next loop's prologue reuses every buffer

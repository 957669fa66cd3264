"""Expert transport benchmark: rearrange_experts vs a raw ppermute of the same bytes, executor variants side by side.

A DeepSeek-V3-like MoE (58 layers, 256 experts on 288 slots) with experts
shrunk to fit: per slot an fp8 (e4m3) w13 ``[2 * inter, hidden]`` with
float8_e8m0fnu block scales ``[2 * inter, hidden / 32]`` and a bf16 w2
``[hidden, inter]``. Placement changes swap slots between ranks (experts with
one replica, so every swap moves two rows) to move ~10% and ~50% of the slots;
each iteration draws fresh swaps with the same per-rank counts, so plans differ
but capacities do not (the executor must not recompile).

Printed side by side per (variant, fraction, chunks): bytes moved per rank,
median time, GB/s, raw ppermute of the same number of uint8 bytes (with the
default XLA options, and with the variant's), the ratios, peak extra device
memory (``memory_stats`` and XLA's static temp size) over bytes moved,
compiles, host planning time; and the floor of a chunked executor: the same
bytes in as many chained ppermutes as it issues. Correctness: per-slot hashes
after each first move are checked against the expected source slots; all
dtypes byte-exact (every schedule).

Variants are '+'-joined parts (``--variants default stream+lhs words+d2``):
  own | words    rows in their own dtype / as uint32 words (default: words on GPU)
  dN             serial schedule with N transfers in flight (default 1)
  stream|serial|put  the schedule (stream: plan reordered, chunk c written while chunk c + 1 is in flight;
                 put: the stream order, each chunk packed and written into the peers' rows by one NVLink
                 kernel; default: the library's)
  cN             N chunks per round for this variant (else --chunks)
  pN             pack and write rows with the Pallas row-copy kernels of N programs (copy_programs=N)
  bN / wN        those kernels' words per work item / warps (transport.COPY_KERNEL_OPTIONS)
  packN / stN / npN  the put kernel's packing programs / TMA stages / programs (transport.PUT_KERNEL_OPTIONS)
  taperN         stream schedule in uneven chunks: weights (1, N, ..., N, 1) (chunk_weights)
  cwA_B_..       stream schedule in chunks of these relative sizes (chunk_weights=(A, B, ...))
  xla            XLA gathers / scatters (copy_programs=None; the default unless the library's changes)
  prepared       prepare_move before the clock starts (validation, table upload), then time the move alone
                 (what a server that prepares the move while the model runs pays at the step boundary)
  XLA options:   lhs (latency-hiding scheduler), memcpy (local p2p by cudaMemcpy, not NCCL kernels),
                 ovlN (N collectives in flight, parallel_collective_overlap_limit), noprio (async
                 stream not highest priority), symm (collective-permute in symmetric memory), nocb (no
                 CUDA-graph command buffers), or any name=value (an xla_gpu_* DebugOptions field, e.g.
                 xla_gpu_nccl_p2p_max_nchannels=32)
A variant that fails (an option XLA rejects) prints its error and the run goes on.

--timeline profiles a few calls of each variant (jax.profiler, CUPTI records of GPU 0) and prints, per
call, the wall span of the device work, the busy time of the transfer kernels (NCCL / peer memcpy) and
of the other kernels (pack, scatter), and how much of the two overlapped. Every run also summarises the
executor's HLO: the longest chain of transfers each waiting for an earlier one (the program's data
dependencies) and, per async transfer, the compute ops XLA scheduled between its start and done. So one
run says whether a variant overlapped, and if not, whether the program or XLA's schedule forbade it, or
the GPU serialised what the schedule allowed (--hlo-dir keeps each compiled HLO, gzipped).

  PYTHONPATH=. python3 benchmarks/transport.py                  # library defaults, all devices
  PYTHONPATH=. python3 benchmarks/transport.py --fractions 0.5 --variants default stream stream+lhs \\
      --timeline --hlo-dir /tmp/hlo
  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
      PYTHONPATH=. python3 benchmarks/transport.py --layers 4 --hidden 256 --inter 32 --iters 2 \\
      --variants default stream --timeline   # smoke (no GPU plane: the timeline says so)
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from _overlap import hlo_summary, timeline
from jax.sharding import NamedSharding, PartitionSpec

from moe_eplb_jax import sharding as eps
from moe_eplb_jax.sharding import packing
from moe_eplb_jax.sharding import transport as _transport
from moe_eplb_jax.sharding.plan import order_for_streaming


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=None, help="EP ranks (default: all devices)")
    p.add_argument("--layers", type=int, default=58)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--slots", type=int, default=288)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=128)
    p.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.5])
    p.add_argument(
        "--chunks",
        type=int,
        nargs="+",
        default=[0],
        help="chunks per round, in order of rising memory; 0: the library's default chunking",
    )
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--variants", nargs="+", default=["default"], help="executor variants (see above)")
    p.add_argument("--timeline", action="store_true", help="profile each variant: overlap of transfers and copies")
    p.add_argument("--timeline-calls", type=int, default=4, help="profiled calls per variant (even)")
    p.add_argument("--hlo-dir", default=None, help="write each compiled executor's HLO text here (gzipped)")
    p.add_argument("--no-extras", action="store_true", help="skip the dtype check and the component times")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the table rows here")
    return p.parse_args()


OPTION_ALIASES = {
    "lhs": ("xla_gpu_enable_latency_hiding_scheduler", True),
    "memcpy": ("xla_gpu_use_memcpy_local_p2p", True),
    "noprio": ("xla_gpu_enable_highest_priority_async_stream", False),
    "symm": ("xla_gpu_collective_permute_mode", "symmetric"),
    "nocb": ("xla_gpu_enable_command_buffer", ""),
}


_DEFAULT_KERNEL = dict(_transport.COPY_KERNEL_OPTIONS)
_DEFAULT_PUT = dict(_transport.PUT_KERNEL_OPTIONS)


def parse_variant(name):
    """``(row view, depth, schedule, chunks or None, compiler options, copy programs)`` of a variant name."""
    view, depth, schedule, chunks, options = (
        _transport.WORD_VIEW,
        _transport.PIPELINE_DEPTH,
        _transport.DEFAULT_SCHEDULE,
        None,
        {},
    )
    programs = _transport.DEFAULT_COPY_PROGRAMS
    kernel = dict(_DEFAULT_KERNEL)
    for part in name.split("+"):
        if part == "default":
            continue
        if part in ("own", "words"):
            view = part == "words"
        elif part in ("stream", "serial", "put"):
            schedule = part
        elif re.fullmatch(r"d\d+", part):
            depth = int(part[1:])
        elif re.fullmatch(r"c\d+", part):
            chunks = int(part[1:])
        elif re.fullmatch(r"p\d+", part):
            programs = int(part[1:])
        elif re.fullmatch(r"taper\d+", part):
            kernel["taper"] = int(part[5:])
        elif re.fullmatch(r"cw\d+(_\d+)+", part):
            kernel["weights"] = tuple(int(w) for w in part[2:].split("_"))
        elif re.fullmatch(r"(pack|st|np)\d+", part):  # the put kernel: packing programs, stages, programs
            key = {"pack": "pack_programs", "st": "stages", "np": "num_programs"}[re.match(r"[a-z]+", part)[0]]
            kernel["put_" + key] = int(re.search(r"\d+", part)[0])
        elif re.fullmatch(r"[bw]\d+", part):
            kernel[{"b": "block", "w": "num_warps"}[part[0]]] = int(part[1:])
        elif part == "xla":
            programs = None
        elif part == "prepared":
            kernel["prepared"] = True
        elif re.fullmatch(r"ovl\d+", part):
            options["xla_gpu_experimental_parallel_collective_overlap_limit"] = int(part[3:])
        elif part in OPTION_ALIASES:
            key, value = OPTION_ALIASES[part]
            options[key] = value
        elif "=" in part:
            key, value = part.split("=", 1)
            low = value.lower()
            options[key] = (
                True if low == "true" else False if low == "false" else int(value) if value.isdigit() else value
            )
        else:
            raise SystemExit(f"unknown variant part {part!r} in {name!r}")
    return view, depth, schedule, chunks, options, (programs, kernel)


# ------------------------------------------------------------------ placements
def initial_placement(rng, layers, experts, slots):
    rows = []
    for _ in range(layers):
        extra = rng.choice(experts, slots - experts, replace=False)
        rows.append(rng.permutation(np.concatenate([np.arange(experts), extra])))
    return np.stack(rows)


def swap_placement(rng, phy2log, num_ranks, fraction):
    """Swaps single-replica experts between slots of different ranks; the same count for every rank pair."""
    layers, slots = phy2log.shape
    per_rank = slots // num_ranks
    pairs = [(a, b) for a in range(num_ranks) for b in range(a + 1, num_ranks)]
    per_pair = max(1, round(fraction * slots / (2 * len(pairs))))
    new = phy2log.copy()
    for lyr in range(layers):
        counts = np.bincount(phy2log[lyr], minlength=phy2log.max() + 1)
        free = [
            list(rng.permutation([p for p in range(r * per_rank, (r + 1) * per_rank) if counts[phy2log[lyr, p]] == 1]))
            for r in range(num_ranks)
        ]
        for a, b in pairs:
            for _ in range(per_pair):
                if not free[a] or not free[b]:
                    raise SystemExit(f"fraction {fraction} too large for {num_ranks} ranks: not enough movable slots")
                p, q = free[a].pop(), free[b].pop()
                new[lyr, p], new[lyr, q] = phy2log[lyr, q], phy2log[lyr, p]
    return new


# --------------------------------------------------------------------- experts
def make_experts(mesh, layers, slots, hidden, inter, seed):
    """Random expert bytes, written layer by layer into place (keeps the allocation peak at the experts)."""
    shapes = {
        "w13": ((2 * inter, hidden), jnp.float8_e4m3fn),
        "w13_scale": ((2 * inter, hidden // 32), jnp.float8_e8m0fnu),
        "w2": ((hidden, inter), jnp.bfloat16),
    }
    out = {}
    for i, (name, (row, dtype)) in enumerate(shapes.items()):
        shape = (layers, slots) + row
        sharding = eps.slot_sharding(mesh, len(shape), layered=True)
        uint = jnp.uint16 if jnp.dtype(dtype).itemsize == 2 else jnp.uint8
        leaf = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()

        def fill(leaf, key, lyr, row=row, dtype=dtype, uint=uint):
            bits = jax.random.bits(key, (1, slots) + row, uint)
            start = (lyr,) + (jnp.int32(0),) * (len(row) + 1)
            return jax.lax.dynamic_update_slice(leaf, jax.lax.bitcast_convert_type(bits, dtype), start)

        fill = jax.jit(fill, donate_argnums=0, out_shardings=sharding)
        for lyr in range(layers):
            leaf = fill(leaf, jax.random.key(seed * 1000 + i * 100 + lyr), jnp.int32(lyr))
        out[name] = leaf
    return out


def slot_hashes(mesh, experts):
    """``[L, P]`` uint32 hash of each slot's bytes (position-weighted sum of the bytes)."""

    @jax.jit
    def one(x):
        # same-width unsigned view (free), widened inside the fused reduction: no copy of the leaf
        uint = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(x.dtype).itemsize]
        u = jax.lax.bitcast_convert_type(x, uint).reshape(x.shape[0], x.shape[1], -1)
        w = (jnp.arange(u.shape[-1], dtype=jnp.uint32) * jnp.uint32(2654435761)) | jnp.uint32(1)
        return jnp.sum(u.astype(jnp.uint32) * w[None, None, :], axis=-1, dtype=jnp.uint32)

    total = None
    for k in sorted(experts):
        h = np.asarray(one(experts[k]))
        total = h if total is None else total * np.uint32(31) + h
    return total


def check_move(before, after, old, new):
    for lyr in range(old.shape[0]):
        for p in range(old.shape[1]):
            if old[lyr, p] == new[lyr, p]:
                ok = after[lyr, p] == before[lyr, p]
            else:
                ok = after[lyr, p] in set(before[lyr, old[lyr] == new[lyr, p]].tolist())
            if not ok:
                return False
    return True


# ----------------------------------------------------------------------- raw
def raw_ppermute(mesh, nbytes_per_rank, iters, options=None):
    """Median seconds of one ``ppermute`` of ``nbytes_per_rank`` uint8 bytes per rank, and the jitted call."""
    num_ranks = mesh.shape["ep"]
    sharding = NamedSharding(mesh, PartitionSpec("ep"))
    buf = jax.jit(
        lambda: jax.random.bits(jax.random.key(1), (num_ranks * nbytes_per_rank,), jnp.uint8), out_shardings=sharding
    )()
    perm = [(r, (r + 1) % num_ranks) for r in range(num_ranks)]
    fn = jax.jit(
        jax.shard_map(
            lambda x: jax.lax.ppermute(x, "ep", perm),
            mesh=mesh,
            in_specs=PartitionSpec("ep"),
            out_specs=PartitionSpec("ep"),
        ),
        compiler_options=dict(options) if options else None,
    )
    fn(buf).block_until_ready()
    times, returned = [], []
    for _ in range(iters):
        t = time.perf_counter()
        out = fn(buf)
        returned.append(time.perf_counter() - t)
        out.block_until_ready()
        times.append(time.perf_counter() - t)
    RAW_RETURNED.append(statistics.median(returned))
    return statistics.median(times), fn, buf


RAW_RETURNED = []  # host ms until each raw ppermute call returned (its dispatch), for the report


def raw_ppermute_chunked(mesh, nbytes_per_rank, chunks, iters):
    """Median seconds of ``chunks`` ppermutes of ``nbytes_per_rank / chunks`` bytes, one after another.

    The transfers alone as a chunked executor issues them (each waits for the previous one through an
    optimisation barrier, so XLA neither merges nor overlaps them): the floor for any chunked schedule.
    """
    num_ranks = mesh.shape["ep"]
    size = nbytes_per_rank // chunks
    sharding = NamedSharding(mesh, PartitionSpec("ep"))
    buf = jax.jit(
        lambda: jax.random.bits(jax.random.key(2), (num_ranks * chunks, size), jnp.uint8), out_shardings=sharding
    )()
    perm = [(r, (r + 1) % num_ranks) for r in range(num_ranks)]

    def local(x):
        outs, piece = [], x[0]
        for i in range(chunks):
            outs.append(jax.lax.ppermute(piece, "ep", perm))
            if i + 1 < chunks:
                piece, _ = jax.lax.optimization_barrier((x[i + 1], outs[-1]))
        return outs

    fn = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=PartitionSpec("ep"), out_specs=[PartitionSpec("ep")] * chunks)
    )
    jax.block_until_ready(fn(buf))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(buf))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def streamable(plan, num_chunks):
    try:
        return order_for_streaming(plan, num_chunks)
    except ValueError:
        return None


def dtype_check(mesh, rng, schedule="serial", copy_programs=None, row_elements=6):
    """Byte-exact contract on this backend for every supported dtype (random bytes, NaN payloads included).

    ``row_elements`` per slot and leaf: 6 makes some rows a non-multiple of 4 bytes (byte rows on the wire);
    8 makes every row whole words (the path of the Pallas row copies).
    """
    import ml_dtypes

    num_ranks = mesh.shape["ep"]
    layers, experts, slots = 2, 4 * num_ranks, 6 * num_ranks
    dtypes = [
        np.float32,
        ml_dtypes.bfloat16,
        ml_dtypes.float8_e4m3fn,
        ml_dtypes.float8_e5m2,
        ml_dtypes.float8_e8m0fnu,
        ml_dtypes.float4_e2m1fn,
        np.int8,
        np.uint8,
        np.int32,
    ]
    ckpt = {}
    for i, dt in enumerate(dtypes):
        width = max(1, jax.dtypes.itemsize_bits(np.dtype(dt)) // 8)
        raw = rng.integers(0, 256, (layers, experts, row_elements * width), dtype=np.uint8)
        if jax.dtypes.itemsize_bits(np.dtype(dt)) == 4:
            raw &= 0x0F
        ckpt[f"leaf{i}"] = raw.view(dt)
    old = np.stack([rng.permutation(np.arange(slots) % experts) for _ in range(layers)])
    new = np.stack(
        [
            rng.permutation(np.concatenate([np.arange(experts), rng.integers(0, experts, slots - experts)]))
            for _ in range(layers)
        ]
    )
    take = lambda tab: {k: v[np.arange(layers)[:, None], tab] for k, v in ckpt.items()}
    plan = eps.plan_rearrangement(old, new, num_ranks)
    if schedule != "serial":  # as many chunks as the plan's cycles allow, so the streaming order is used
        plan = next(p for p in (streamable(plan, n) for n in (4, 2, 1)) if p is not None)
    moved = eps.execute_plan(
        eps.shard_slots(take(old), mesh, layered=True), plan, mesh=mesh, schedule=schedule, copy_programs=copy_programs
    )
    expect = take(new)
    from moe_eplb_jax.sharding.packing import byte_rows_numpy

    return all(np.array_equal(byte_rows_numpy(np.asarray(moved[k]), 2), byte_rows_numpy(expect[k], 2)) for k in ckpt)


def component_times(mesh, experts, capacity, iters):
    """Median ms of the local parts alone: packing ``capacity`` rows, scattering them back (donates experts)."""
    names = sorted(experts)
    leaves = [experts[k] for k in names]
    probe = eps.plan_rearrangement(
        np.zeros((leaves[0].shape[0], leaves[0].shape[1]), np.int32),
        np.zeros((leaves[0].shape[0], leaves[0].shape[1]), np.int32),
        mesh.shape["ep"],
    )
    _, layouts, specs, _ = _transport._check_leaves(dict(zip(names, leaves)), probe, mesh, "ep")
    num_rows = leaves[0].shape[0] * leaves[0].shape[1] // mesh.shape["ep"]
    idx = jnp.asarray(np.random.default_rng(0).permutation(num_rows)[:capacity].astype(np.int32))

    def pack(*ls):
        rows = [packing.row_view(x, lay, num_rows) for x, lay in zip(ls, layouts)]
        return packing.pack_rows(rows, layouts, idx)

    def scatter(buf, *ls):
        out = []
        for i, (x, lay) in enumerate(zip(ls, layouts)):
            r = packing.row_view(x, lay, num_rows)
            upd = packing.unpack_leaf(buf, layouts, i)
            out.append(packing.from_row_view(r.at[idx].set(upd, unique_indices=True), lay, x.shape))
        return out

    spec = PartitionSpec("ep")
    pack_fn = jax.jit(jax.shard_map(pack, mesh=mesh, in_specs=tuple(specs), out_specs=spec))
    scatter_fn = jax.jit(
        jax.shard_map(scatter, mesh=mesh, in_specs=(spec,) + tuple(specs), out_specs=list(specs)),
        donate_argnums=tuple(range(1, len(leaves) + 1)),
    )
    out = {}
    buf = pack_fn(*leaves)
    buf.block_until_ready()
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        pack_fn(*leaves).block_until_ready()
        ts.append(time.perf_counter() - t)
    out["pack"] = statistics.median(ts) * 1e3
    ts = []
    for _ in range(iters + 1):
        t = time.perf_counter()
        leaves = scatter_fn(buf, *leaves)
        jax.block_until_ready(leaves)
        ts.append(time.perf_counter() - t)
    out["scatter"] = statistics.median(ts[1:]) * 1e3
    return out, dict(zip(names, leaves))


def mem_in_use(devices):
    stats = [d.memory_stats() or {} for d in devices]
    return max(s.get("bytes_in_use", 0) for s in stats), max(s.get("peak_bytes_in_use", 0) for s in stats)


# ----------------------------------------------------------------------- main
def run_config(args, ctx, variant, fraction, chunks):
    """Times one (variant, fraction, chunks); returns the result row (``ctx`` carries experts and placement)."""
    mesh, devices, row, num_ranks = ctx["mesh"], ctx["devices"], ctx["row"], ctx["mesh"].shape["ep"]
    view, depth, schedule, own_chunks, options, (programs, kernel) = parse_variant(variant)
    taper = kernel.pop("taper", None)
    prepared = kernel.pop("prepared", False)
    fixed_weights = kernel.pop("weights", None)
    _transport.PUT_KERNEL_OPTIONS = dict(
        _DEFAULT_PUT, **{k[4:]: kernel.pop(k) for k in list(kernel) if k.startswith("put_")}
    )
    _transport.COPY_KERNEL_OPTIONS = kernel
    chunks = own_chunks if own_chunks is not None else chunks
    _transport.WORD_VIEW, _transport.PIPELINE_DEPTH = view, depth
    opts = tuple(sorted(options.items()))
    times, plan_s, compiles, res = [], [], [], dict(view=variant, fraction=fraction, options=options)
    dispatch, host_check, host_tables, prepare_s = [], [], [], []
    for it in range(args.iters + 1):
        old = ctx["phy2log"]
        new = swap_placement(ctx["rng"], old, num_ranks, fraction)
        t0 = time.perf_counter()
        plan = eps.plan_rearrangement(old, new, num_ranks)
        max_chunk = -(-plan.capacities[0] // chunks) * row if chunks else None
        leaves, layouts, specs, _ = _transport._check_leaves(ctx["experts"], plan, mesh, "ep")
        schedule = _transport.resolve_schedule(schedule, layouts, mesh)  # "auto": "put" on GPUs, else "stream"
        nch = _transport._num_chunks(plan, layouts, max_chunk, schedule)
        weights = (1,) + (taper,) * (nch - 2) + (1,) if taper and nch > 2 else fixed_weights
        nch = len(weights) if weights else nch
        if schedule != "serial":  # host work: reorder the plan off the device's critical path
            plan = order_for_streaming(plan, nch, weights=weights)
        plan_s.append(time.perf_counter() - t0)
        if it == 0:
            before_hash = slot_hashes(mesh, ctx["experts"])
            put = _transport._put_kind(schedule, layouts, mesh)
            tables, table_layout = _transport.device_tables(plan, mesh, "ep", sender_destinations=bool(put))
            fn = _transport._executor(
                mesh,
                "ep",
                tuple(specs),
                tuple(layouts),
                2,
                True,
                nch,
                opts,
                plan.chunk_bounds,
                table_layout,
                0 if put else _transport._copy_programs(programs, leaves, layouts, plan),
                put,
            )
            compiled = fn.lower(tables, leaves).compile()
            res["extra_static"] = compiled.memory_analysis().temp_size_in_bytes
            text = compiled.as_text()
            res["hlo"] = hlo_summary(fn.lower(tables, leaves).as_text(dialect="hlo"), text)
            if args.hlo_dir:
                os.makedirs(args.hlo_dir, exist_ok=True)
                with gzip.open(os.path.join(args.hlo_dir, f"{variant}_{fraction}_{chunks}.hlo.txt.gz"), "wt") as f:
                    f.write(text)
            in_use, _ = mem_in_use(devices)
        size0 = eps.executor_trace_count()
        t = time.perf_counter()  # host parts of execute_plan alone (not on the clock below)
        leaves, layouts, specs, _ = _transport._check_leaves(ctx["experts"], plan, mesh, "ep")
        host_check.append(time.perf_counter() - t)
        t = time.perf_counter()
        tables, table_layout = _transport.device_tables(plan, mesh, "ep", sender_destinations=schedule == "put")
        host_tables.append(time.perf_counter() - t)
        move_kwargs = dict(
            mesh=mesh, max_chunk_bytes=max_chunk, compiler_options=options, schedule=schedule, copy_programs=programs
        )
        if prepared:  # validation and the table upload before the clock starts
            t = time.perf_counter()
            move = eps.prepare_move(ctx["experts"], plan, **move_kwargs)
            prepare_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            ctx["experts"] = move(ctx["experts"])
        else:
            t = time.perf_counter()
            ctx["experts"] = eps.execute_plan(ctx["experts"], plan, **move_kwargs)
        returned = time.perf_counter() - t  # host: validation, tables, dispatch (the device may still run)
        jax.block_until_ready(ctx["experts"])
        dt = time.perf_counter() - t
        compiles.append(eps.executor_trace_count() - size0)
        if it == 0:
            _, peak = mem_in_use(devices)
            res["extra_measured"] = peak - in_use
            res["correct"] = check_move(before_hash, slot_hashes(mesh, ctx["experts"]), old, new)
        else:
            times.append(dt)
            dispatch.append(returned)
        ctx["phy2log"] = new
    moved = plan.bytes_moved(row)
    med = statistics.median(times)
    res.update(
        chunks=nch,
        moved=moved,
        time_ms=med * 1e3,
        gbps=moved / med / 1e9,
        extra_measured=res["extra_measured"] / moved,
        extra_static=res["extra_static"] / moved,
        recompiles_after_first=sum(compiles[1:]),
        first_compiles=compiles[0],
        plan_ms=statistics.median(plan_s) * 1e3,
        capacity=plan.capacities[0],
        schedule=schedule,
        returned_ms=statistics.median(dispatch) * 1e3,
        host_check_ms=statistics.median(host_check) * 1e3,
        host_tables_ms=statistics.median(host_tables) * 1e3,
        prepare_ms=statistics.median(prepare_s) * 1e3 if prepare_s else None,
        streamed_chunk_bounds=plan.chunk_bounds,
    )
    if args.timeline:  # the last move forth and back (even calls: the placement ends where it was)
        back = eps.plan_rearrangement(ctx["phy2log"], old, num_ranks)
        back = order_for_streaming(back, nch, weights=weights) if schedule != "serial" else back
        plans = (back, plan)
        moves = [eps.prepare_move(ctx["experts"], p, **move_kwargs) for p in plans] if prepared else None

        def call(i):
            if prepared:
                ctx["experts"] = moves[i % 2](ctx["experts"])
            else:
                ctx["experts"] = eps.execute_plan(ctx["experts"], plans[i % 2], **move_kwargs)
            return ctx["experts"]

        call(0), call(1)  # warm: the reverse plan has the same capacities
        size0 = eps.executor_trace_count()
        res["timeline"] = timeline(call, 2 * max(1, args.timeline_calls // 2))
        res["recompiles_after_first"] += eps.executor_trace_count() - size0
    return res


def main():
    args = parse_args()
    mesh = eps.ep_mesh(args.ranks)
    num_ranks = mesh.shape["ep"]
    devices = list(mesh.devices.flat)
    rng = np.random.default_rng(args.seed)
    print(f"devices: {num_ranks} x {devices[0].device_kind}; jax {jax.__version__}", flush=True)
    for v in args.variants:
        parse_variant(v)  # bad names stop here, before any work

    initial = initial_placement(rng, args.layers, args.experts, args.slots)
    experts = make_experts(mesh, args.layers, args.slots, args.hidden, args.inter, args.seed)
    jax.block_until_ready(experts)
    probe = eps.plan_rearrangement(initial, initial, num_ranks)
    row = eps.row_bytes(experts, probe, mesh=mesh)
    per_rank = args.layers * args.slots // num_ranks * row
    print(f"row {row} B/slot, experts {per_rank / 2**30:.2f} GiB per rank", flush=True)
    ctx = dict(mesh=mesh, devices=devices, row=row, rng=rng, experts=experts, phy2log=initial)

    results = []
    defaults = _transport.WORD_VIEW, _transport.PIPELINE_DEPTH
    for variant in args.variants:
        for fraction in args.fractions:
            for chunks in args.chunks:
                try:
                    res = run_config(args, ctx, variant, fraction, chunks)
                except Exception as e:
                    traceback.print_exc()
                    res = dict(view=variant, fraction=fraction, error=f"{type(e).__name__}: {str(e)[:300]}")
                    if any(leaf.is_deleted() for leaf in jax.tree.leaves(ctx["experts"])):  # start afresh
                        ctx["experts"] = make_experts(mesh, args.layers, args.slots, args.hidden, args.inter, args.seed)
                        ctx["phy2log"] = initial
                finally:
                    _transport.WORD_VIEW, _transport.PIPELINE_DEPTH = defaults
                    _transport.COPY_KERNEL_OPTIONS = dict(_DEFAULT_KERNEL)
                    _transport.PUT_KERNEL_OPTIONS = dict(_DEFAULT_PUT)
                results.append(res)
                print(json.dumps(res, default=str), flush=True)  # every row at once: a later hang loses none
    ok = [r for r in results if "error" not in r]

    # Raw ppermute last: its buffers would otherwise raise the memory peak seen by later configurations.
    raw, raw_timeline = {}, None
    for r in ok:
        for opts in ((), tuple(sorted(r["options"].items()))):
            key = (r["moved"], opts)
            if key not in raw:
                try:
                    seconds, fn, buf = raw_ppermute(mesh, r["moved"], max(5, args.iters), dict(opts))
                    if args.timeline and not opts and r["moved"] == max(x["moved"] for x in ok):
                        raw_timeline = timeline(lambda i: fn(buf), 4)
                    del fn, buf
                    raw[key] = seconds
                except Exception as e:
                    print(f"raw ppermute with {opts}: {type(e).__name__}: {e}", flush=True)
                    raw[key] = float("nan")
        own = raw[(r["moved"], tuple(sorted(r["options"].items())))]
        r.update(
            raw_ms=raw[(r["moved"], ())] * 1e3,
            raw_same_ms=own * 1e3,
            ratio=raw[(r["moved"], ())] / (r["time_ms"] / 1e3),
            ratio_same=own / (r["time_ms"] / 1e3),
        )
    extras = {}
    if ok:  # the floor of chunked transfers, at the largest move and the first variant's chunks
        largest = max(ok, key=lambda r: r["moved"])
        chunks = largest["chunks"] * (num_ranks - 1)
        seconds = raw_ppermute_chunked(mesh, largest["moved"], chunks, max(5, args.iters))
        extras[f"raw ppermute of {largest['moved'] / 2**20:.0f} MiB in {chunks} chained transfers ms"] = (
            f"{seconds * 1e3:.2f} (one transfer: {raw[(largest['moved'], ())] * 1e3:.2f})"
        )
    if not args.no_extras:
        for schedule in ("serial", "stream", "put"):  # put: the kernel on GPUs, its emulation elsewhere
            # put: rows of a multiple of 128 bytes for every dtype (fp4: 256 elements)
            extras[f"dtype check ({schedule})"] = dtype_check(
                mesh, rng, schedule, row_elements=256 if schedule == "put" else 6
            )
            if schedule == "put":
                continue
            extras[f"dtype check ({schedule}, word rows, Pallas copies)"] = dtype_check(
                mesh, rng, schedule, copy_programs=16, row_elements=8
            )
        if ok:
            for words in (False, True):
                _transport.WORD_VIEW = words
                times, ctx["experts"] = component_times(mesh, ctx["experts"], ok[-1]["capacity"], max(5, args.iters))
                for k, v in times.items():
                    extras[f"{k} ({'words' if words else 'own dtype'}) ms"] = round(v, 3)
            _transport.WORD_VIEW = defaults[0]
    report(args, num_ranks, devices, row, results, raw_timeline, extras)


def report(args, num_ranks, devices, row, results, raw_timeline, extras):
    print(
        f"\n## transport: {num_ranks} x {devices[0].device_kind}, {args.layers} layers x {args.slots} slots, "
        f"row {row} B (fp8 w13 + e8m0 scales + bf16 w2), iters {args.iters}"
    )
    print(
        "(raw: one ppermute of the same bytes, default XLA options / the variant's options; peak extra from "
        "memory_stats is a running maximum, valid while it rises; 'static' is XLA's temp size)"
    )
    print(
        "| variant | moved | chunks | MiB/rank | ours ms | ours GB/s | raw ms | ours/raw | raw ms (same opts) | "
        "ours/raw (same opts) | peak extra / moved (stats, static) | recompiles | correct | plan ms |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        if "error" in r:
            print(f"| {r['view']} | {r['fraction']:.0%} | failed: {r['error']} |")
            continue
        print(
            f"| {r['view']} | {r['fraction']:.0%} | {r['chunks']} | {r['moved'] / 2**20:.0f} | {r['time_ms']:.2f} | "
            f"{r['gbps']:.0f} | {r['raw_ms']:.2f} | {r['ratio']:.2f} | {r['raw_same_ms']:.2f} | "
            f"{r['ratio_same']:.2f} | {r['extra_measured']:.2f}, {r['extra_static']:.2f} | "
            f"{r['recompiles_after_first']} | {r['correct']} | {r['plan_ms']:.0f} |"
        )
    print(
        "\n### schedule (longest chain of transfers each waiting for an earlier one, of all transfers: N of N is "
        "strictly serial; async transfers, those marked sync, compute ops XLA placed between each start and done)"
    )
    for r in results:
        if "hlo" in r:
            h = r["hlo"]
            print(
                f"- {r['view']} {r['fraction']:.0%}: chain {h['longest_chain']} of {h['transfers']}; "
                f"{h['async_pairs']} async, {h['is_sync']} marked sync; ops between start/done "
                f"{h['compute_ops_between_start_and_done']}"
            )
    if args.timeline:
        print("\n### timeline (GPU 0, median per call, ms; profiled without command buffers)")
        print(
            "| variant | moved | span | transfer busy | kernel busy | copy busy | transfer || other | idle | verdict |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        rows = [(r["view"], f"{r['fraction']:.0%}", r.get("timeline")) for r in results if "timeline" in r]
        rows.append(("raw ppermute", "largest", raw_timeline))
        for name, frac, t in rows:
            if t is None:
                print(f"| {name} | {frac} | no GPU trace |")
                continue
            other = t["kernel_ms"] + t["copy_ms"]
            verdict = (
                "overlapped"
                if t["overlap_ms"] > 0.5 * min(t["transfer_ms"], other)
                else "serialised"
                if t["overlap_ms"] < 0.1 * min(t["transfer_ms"], other)
                else "partly"
            )
            print(
                f"| {name} | {frac} | {t['span_ms']:.2f} | {t['transfer_ms']:.2f} | {t['kernel_ms']:.2f} | "
                f"{t['copy_ms']:.2f} | {t['overlap_ms']:.2f} | {t['idle_ms']:.2f} | {verdict} |"
            )
        for name, frac, t in rows:
            if t is not None:
                print(
                    f"- {name} {frac}: calls found {t['calls_found']}, streams {t['streams']}, "
                    f"largest {t['top_ms_per_call']}"
                )
        if raw_timeline is not None:  # device time only: no host work (validation, tables) in either
            largest = max(r["moved"] for r in results if "moved" in r)
            ratios = [
                f"{r['view']} {raw_timeline['span_ms'] / r['timeline']['span_ms']:.2f}"
                for r in results
                if r.get("timeline") and r["moved"] == largest
            ]
            print(f"device span of the raw ppermute / of ours ({largest / 2**20:.0f} MiB/rank): " + ", ".join(ratios))
            work = [
                f"{r['view']} {raw_timeline['span_ms'] / (r['timeline']['span_ms'] - r['timeline']['lead_ms']):.2f}"
                f" (lead {r['timeline']['lead_ms']:.2f} ms)"
                for r in results
                if r.get("timeline") and r["moved"] == largest
            ]
            print(
                "device work (first kernel to last; the lead before it is the launch after the table upload), "
                "raw / ours: " + ", ".join(work)
            )
        print(
            "host: ms until the call returned (execute_plan: validation, tables, dispatch; prepared: the move's "
            "checks and dispatch): "
            + ", ".join(f"{r['view']} {r['returned_ms']:.2f}" for r in results if "returned_ms" in r)
            + "; raw ppermute "
            + ", ".join(f"{x * 1e3:.2f}" for x in RAW_RETURNED)
        )
        print(
            "host: ms of validation / table upload alone (prepare_move): "
            + ", ".join(
                f"{r['view']} {r['host_check_ms']:.2f} / {r['host_tables_ms']:.2f}"
                + (f" ({r['prepare_ms']:.2f})" if r.get("prepare_ms") else "")
                for r in results
                if "host_check_ms" in r
            )
        )
    for k, v in extras.items():
        print(f"{k}: {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()

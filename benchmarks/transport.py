"""Expert transport benchmark: the library's move vs a raw ppermute of the same bytes vs the link's limit.

A DeepSeek-V3-like MoE (58 layers, 256 experts on 288 slots) with experts
shrunk to fit: per slot an fp8 (e4m3) w13 ``[2 * inter, hidden]`` with
float8_e8m0fnu block scales ``[2 * inter, hidden / 32]`` and a bf16 w2
``[hidden, inter]``. Placement changes swap single-replica experts between
slots of different ranks to move ~10% and ~50% of the slots; every timed
iteration draws fresh swaps with the same per-rank counts, so the plans differ
but their capacities do not (nothing may recompile).

Printed side by side per fraction, for the library's defaults (the schedule it
picks is printed too): the most bytes any rank sends or receives; the prepared
move (``prepare_move`` before the clock, then the move: what a server that
prepares while the model runs pays at the step boundary) and ``execute_plan``
(host work on the clock), median ms and GB/s; one raw ``ppermute`` of the same
number of uint8 bytes; the physical limit (those bytes at ``--link-gbps``, by
default NV18 NVLink between two H200s, ~450 GB/s per direction); the ratios;
XLA's temp memory of the executor over the bytes moved; recompilations after
the first move. ``--timeline`` adds device time from the profiler: the span of
a move's kernels (first to last) against the raw ppermute's. Correctness:
per-slot hashes after the first move of each fraction, and every dtype with
special values (subnormals, signed zeros, NaN payloads) byte-exact through the
default schedule for word rows and for odd-byte rows.

  PYTHONPATH=. python3 benchmarks/transport.py                      # every device of this machine
  PYTHONPATH=. python3 benchmarks/transport.py --fractions 0.5 --iters 6 --timeline
  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
      PYTHONPATH=. python3 benchmarks/transport.py --layers 4 --hidden 256 --inter 32 --iters 2   # smoke

``--resize G:G'`` (e.g. ``2:1``) also times a move between EP sizes (``resize_experts``) from the first ``G``
devices to the first ``G'``, the placement for ``G'`` solved from log-normal loads by ``--resize-policy`` and the
old one by ``balanced``: the busiest device's bytes, the move with its host work (union arrays, tables) on the
clock, one raw ``ppermute`` of the same bytes on the union of the devices, and per-slot hashes checked (every new slot holds the bytes of an old slot of its expert):

  PYTHONPATH=. python3 benchmarks/transport.py --fractions --resize 2:1 --iters 6
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.profiler import ProfileData
from jax.sharding import NamedSharding, PartitionSpec

from moe_eplb_jax import transport as eps
from moe_eplb_jax.transport.packing import byte_rows_numpy


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=None, help="EP ranks (default: all devices)")
    p.add_argument("--layers", type=int, default=58)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--slots", type=int, default=288)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=128)
    p.add_argument("--fractions", type=float, nargs="*", default=[0.1, 0.5])
    p.add_argument("--resize", nargs="*", default=[], metavar="G:G'", help="moves between EP sizes, e.g. 2:1")
    p.add_argument("--resize-policy", default="balanced", help="the policy of the placement for G' (or fill)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--link-gbps", type=float, default=450.0, help="per-direction link bandwidth, the limit")
    p.add_argument("--timeline", action="store_true", help="also device time from the profiler (GPU)")
    p.add_argument("--no-dtype-check", action="store_true", help="skip the byte-exact check of every dtype")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the table rows here")
    return p.parse_args()


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


def slot_hashes(experts):
    """``[L, P]`` uint32 hash of each slot's bytes (position-weighted sum of the bytes)."""

    @jax.jit
    def one(x):
        # same-width unsigned view, widened inside the fused reduction: no copy of the leaf
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
    """Whether every slot holds the bytes of a slot that held its new expert (unchanged slots: their own)."""
    for lyr in range(old.shape[0]):
        for p in range(old.shape[1]):
            if old[lyr, p] == new[lyr, p]:
                ok = after[lyr, p] == before[lyr, p]
            else:
                ok = after[lyr, p] in set(before[lyr, old[lyr] == new[lyr, p]].tolist())
            if not ok:
                return False
    return True


def dtype_check(mesh, rng, row_elements):
    """Byte-exact contract on this backend for every supported dtype, special values drawn often.

    Half of the elements of each float leaf are subnormals, signed zeros, infinities or NaNs with payloads.
    ``row_elements`` per slot and leaf: 256 makes every row a multiple of 128 bytes (the put kernel's rows on
    GPUs); 6 makes some rows odd bytes (byte rows, XLA's copies).
    """
    num_ranks = mesh.shape["ep"]
    layers, experts, slots = 2, 4 * num_ranks, 6 * num_ranks
    dtypes = [
        np.float32,
        ml_dtypes.bfloat16,
        np.float16,
        ml_dtypes.float8_e4m3fn,
        ml_dtypes.float8_e5m2,
        ml_dtypes.float8_e8m0fnu,
        ml_dtypes.float4_e2m1fn,
        np.int8,
        np.int32,
    ]
    ckpt = {f"leaf{i}": special_bytes(rng, dt, (layers, experts, row_elements)) for i, dt in enumerate(dtypes)}
    old = np.stack([rng.permutation(np.arange(slots) % experts) for _ in range(layers)])
    new = np.stack(
        [
            rng.permutation(np.concatenate([np.arange(experts), rng.integers(0, experts, slots - experts)]))
            for _ in range(layers)
        ]
    )
    take = lambda tab: {k: v[np.arange(layers)[:, None], tab] for k, v in ckpt.items()}
    experts_now = eps.shard_slots(take(old), mesh, layered=True)
    move = eps.prepare_move(experts_now, eps.plan_rearrangement(old, new, num_ranks), mesh=mesh)
    moved, expect = move(experts_now), take(new)
    exact = all(np.array_equal(byte_rows_numpy(np.asarray(moved[k]), 2), byte_rows_numpy(expect[k], 2)) for k in ckpt)
    return move.schedule, exact


def special_bytes(rng, dtype, shape):
    """Random bytes as ``dtype``; for floats half the elements have an all-zero or all-ones exponent field."""
    dtype = np.dtype(dtype)
    bits = jax.dtypes.itemsize_bits(dtype)
    unsigned = {8: np.uint8, 16: np.uint16, 32: np.uint32}[max(8, bits)]
    raw = rng.integers(0, 256, tuple(shape) + (np.dtype(unsigned).itemsize,), dtype=np.uint8).view(unsigned)[..., 0]
    if dtype.kind in "fV":  # subnormals, NaNs with payloads / infinities, signed zeros, random
        info = ml_dtypes.finfo(dtype)
        top = unsigned(((1 << info.nexp) - 1) << info.nmant)
        sign = ~unsigned((1 << (info.nexp + info.nmant)) - 1)
        kind = rng.integers(0, 4, shape)
        raw = np.select([kind == 0, kind == 1, kind == 2], [raw & ~top, raw | top, raw & sign], raw).astype(unsigned)
    if bits == 4:
        raw &= np.uint8(0x0F)
    return raw.view(dtype).reshape(shape)


# ----------------------------------------------------------------------- raw
def raw_ppermute(mesh, nbytes_per_rank):
    """One ``ppermute`` of ``nbytes_per_rank`` uint8 bytes per rank to the next rank: the jitted call, its input."""
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
        )
    )
    return fn, buf


def time_raw_ppermute(mesh, nbytes_per_rank, iters, timeline):
    """``(median host ms, device ms or None)`` of one raw ppermute of ``nbytes_per_rank`` bytes per rank."""
    fn, buf = raw_ppermute(mesh, nbytes_per_rank)
    host = median_seconds(lambda: fn(buf), iters) * 1e3
    span = device_span_seconds(lambda: fn(buf)) if timeline else None
    return host, None if span is None else span * 1e3


def median_seconds(call, iters):
    call()  # warm
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def device_span_seconds(call, calls=4, gap_ms=5.0):
    """Median device time of ``call()`` from its first GPU kernel to its last (profiler), or None off the GPU."""
    directory = tempfile.mkdtemp(prefix="transport_trace_")
    with jax.profiler.trace(directory):
        for _ in range(calls):
            jax.block_until_ready(call())
            time.sleep(0.03)
    paths = sorted(glob.glob(f"{directory}/**/*.xplane.pb", recursive=True))
    events = []
    for plane in ProfileData.from_file(paths[-1]).planes if paths else []:
        if plane.name.startswith("/device:GPU:0"):
            for line in plane.lines:
                if line.name.startswith("Stream"):
                    events += [(e.start_ns, e.end_ns, e.name) for e in line.events if "memcpy" not in e.name.lower()]
    if not events:
        return None
    spans, start, end = [], None, None
    for a, b, _ in sorted(events):  # calls are separated by idle gaps longer than gap_ms
        if end is not None and a > end + gap_ms * 1e6:
            spans.append(end - start)
            start = None
        start = a if start is None else start
        end = b if end is None else max(end, b)
    spans.append(end - start)
    return statistics.median(spans) * 1e-9


# ----------------------------------------------------------------------- main
def run_fraction(args, ctx, fraction):
    """Times moves of ``fraction`` of the slots (prepared and not); returns the result row."""
    mesh, num_ranks = ctx["mesh"], ctx["mesh"].shape["ep"]
    prepared_s, executed_s, plan_s, traces = [], [], [], []
    res = dict(fraction=fraction)
    for it in range(2 * args.iters + 1):
        old = ctx["phy2log"]
        new = swap_placement(ctx["rng"], old, num_ranks, fraction)
        t = time.perf_counter()
        plan = eps.plan_rearrangement(old, new, num_ranks)
        plan_s.append(time.perf_counter() - t)
        before = eps.executor_trace_count()
        if it % 2 == 0:  # prepared: validation, ordering, table upload before the clock
            move = eps.prepare_move(ctx["experts"], plan, mesh=mesh)
            if it == 0:
                res["schedule"] = move.schedule
                leaves = [ctx["experts"][k] for k in sorted(ctx["experts"])]
                compiled = move.run.lower(move.tables, leaves).compile()
                res["extra_static"] = compiled.memory_analysis().temp_size_in_bytes
                hashes = slot_hashes(ctx["experts"])
            t = time.perf_counter()
            ctx["experts"] = move(ctx["experts"])
            jax.block_until_ready(ctx["experts"])
            if it:
                prepared_s.append(time.perf_counter() - t)
            else:
                res["correct"] = check_move(hashes, slot_hashes(ctx["experts"]), old, new)
        else:
            t = time.perf_counter()
            ctx["experts"] = eps.execute_plan(ctx["experts"], plan, mesh=mesh)
            jax.block_until_ready(ctx["experts"])
            executed_s.append(time.perf_counter() - t)
        if it:
            traces.append(eps.executor_trace_count() - before)
        ctx["phy2log"] = new
    moved = plan.bytes_moved(ctx["row"])
    prepared, executed = statistics.median(prepared_s), statistics.median(executed_s)
    res.update(
        moved=moved,
        time_ms=prepared * 1e3,
        gbps=moved / prepared / 1e9,
        execute_plan_ms=executed * 1e3,
        extra_static=res["extra_static"] / moved,
        recompiles_after_first=sum(traces),
        plan_ms=statistics.median(plan_s) * 1e3,
        limit_ms=moved / (args.link_gbps * 1e9) * 1e3,
    )
    if args.timeline:  # the same move forth and back, prepared (its capacities are the same both ways)
        back = eps.plan_rearrangement(ctx["phy2log"], old, num_ranks)
        moves = [eps.prepare_move(ctx["experts"], p, mesh=mesh) for p in (back, plan)]
        state = {"i": 0}

        def call():
            ctx["experts"] = moves[state["i"] % 2](ctx["experts"])
            state["i"] += 1
            return ctx["experts"]

        call(), call()
        span = device_span_seconds(call)
        res["device_ms"] = None if span is None else span * 1e3
    return res


def run_resize(args, spec, rng):
    """Times ``resize_experts`` from the first ``G`` devices to the first ``G'`` (``spec`` is ``"G:G'"``)."""
    from moe_eplb_jax import policy

    num_ranks, new_num_ranks = (int(x) for x in spec.split(":"))
    devices = jax.devices()
    if max(num_ranks, new_num_ranks) > len(devices) or args.slots % num_ranks or args.slots % new_num_ranks:
        raise SystemExit(f"--resize {spec}: needs {max(num_ranks, new_num_ranks)} devices and P divisible by both")
    mesh, new_mesh = eps.ep_mesh(num_ranks), eps.ep_mesh(new_num_ranks)
    union = eps.ep_mesh(max(num_ranks, new_num_ranks))
    weight = rng.lognormal(0, 1, (args.layers, args.experts))
    old = policy.get("balanced")(weight, args.slots, 1, 1, num_ranks)[0]
    new = policy.resize_placement(
        weight,
        old,
        num_ranks=num_ranks,
        new_num_ranks=new_num_ranks,
        new_num_physical=args.slots,
        policy=args.resize_policy,
    ).phy2log
    experts = make_experts(mesh, args.layers, args.slots, args.hidden, args.inter, args.seed)
    row = eps.row_bytes(experts, eps.plan_rearrangement(old, old, num_ranks), mesh=mesh)
    t = time.perf_counter()
    plan = eps.plan_for_meshes(old, new, mesh=mesh, new_mesh=new_mesh)
    plan_ms = (time.perf_counter() - t) * 1e3
    moved = plan.bytes_moved(row)
    before = slot_hashes(experts)
    out = eps.execute_resize(experts, plan, mesh=mesh, new_mesh=new_mesh)
    after = slot_hashes(out)
    correct = all(
        after[lyr, p] in set(before[lyr, old[lyr] == new[lyr, p]].tolist())
        for lyr in range(old.shape[0])
        for p in range(new.shape[1])
    )
    del out
    move = functools.partial(eps.execute_resize, experts, plan, mesh=mesh, new_mesh=new_mesh)
    seconds = median_seconds(move, args.iters)
    res = dict(
        resize=spec,
        policy=args.resize_policy,
        rows_moved=plan.rows_moved,
        moved=moved,
        time_ms=seconds * 1e3,
        gbps=moved / seconds / 1e9,
        plan_ms=plan_ms,
        limit_ms=moved / (args.link_gbps * 1e9) * 1e3,
        correct=correct,
    )
    del experts, move
    res["raw_ms"], _ = time_raw_ppermute(union, moved, max(5, args.iters), False)
    return res


def main():
    args = parse_args()
    mesh = eps.ep_mesh(args.ranks)
    num_ranks = mesh.shape["ep"]
    if num_ranks < 2:
        raise SystemExit("the transport benchmark moves experts between ranks: it needs 2 or more devices")
    devices = list(mesh.devices.flat)
    rng = np.random.default_rng(args.seed)
    print(f"devices: {num_ranks} x {devices[0].device_kind}; jax {jax.__version__}", flush=True)
    initial = initial_placement(rng, args.layers, args.experts, args.slots)
    experts = make_experts(mesh, args.layers, args.slots, args.hidden, args.inter, args.seed)
    jax.block_until_ready(experts)
    row = eps.row_bytes(experts, layered=True)
    print(f"row {row} B/slot, experts {args.layers * args.slots // num_ranks * row / 2**30:.2f} GiB per rank")
    ctx = dict(mesh=mesh, row=row, rng=rng, experts=experts, phy2log=initial)
    results = []
    for fraction in args.fractions:
        results.append(run_fraction(args, ctx, fraction))
        print(json.dumps(results[-1]), flush=True)  # every row at once: a later hang loses none
    del ctx, experts
    resizes = []
    for spec in args.resize:
        resizes.append(run_resize(args, spec, rng))
        print(json.dumps(resizes[-1]), flush=True)
    for r in results:  # raw ppermute last: its buffers would otherwise raise the memory seen by the moves
        r["raw_ms"], r["raw_device_ms"] = time_raw_ppermute(mesh, r["moved"], max(5, args.iters), args.timeline)
        r["ratio"] = r["raw_ms"] / r["time_ms"]
    checks = []
    if not args.no_dtype_check:
        checks = [(elements, *dtype_check(mesh, rng, elements)) for elements in (256, 6)]
    report(args, num_ranks, devices, row, results, checks)
    report_resizes(args, devices, row, resizes)


def report_resizes(args, devices, row, resizes):
    if not resizes:
        return
    print(
        f"\n## resize: {devices[0].device_kind}, {args.layers} layers x {args.slots} slots, row {row} B, "
        f"iters {args.iters}, jax {jax.__version__}"
    )
    print(
        "| G -> G' | policy | rows moved | MiB busiest | ms (host work on the clock) | GB/s | raw ppermute ms | "
        f"raw / ours | limit ms ({args.link_gbps:.0f} GB/s) | host planning ms | correct |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in resizes:
        print(
            f"| {r['resize'].replace(':', ' -> ')} | {r['policy']} | {r['rows_moved']} | {r['moved'] / 2**20:.0f} | "
            f"{r['time_ms']:.2f} | {r['gbps']:.0f} | {r['raw_ms']:.2f} | {r['raw_ms'] / r['time_ms']:.2f} | "
            f"{r['limit_ms']:.2f} | {r['plan_ms']:.0f} | {r['correct']} |"
        )


def report(args, num_ranks, devices, row, results, checks):
    print(
        f"\n## transport: {num_ranks} x {devices[0].device_kind}, {args.layers} layers x {args.slots} slots, "
        f"row {row} B (fp8 w13 + e8m0 scales + bf16 w2), iters {args.iters}, jax {jax.__version__}"
    )
    print(
        "| moved | schedule | MiB/rank | prepared ms | GB/s | execute_plan ms | raw ppermute ms | prepared / raw | "
        f"limit ms ({args.link_gbps:.0f} GB/s) | limit / prepared | extra memory / moved | recompiles | correct |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(
            f"| {r['fraction']:.0%} | {r['schedule']} | {r['moved'] / 2**20:.0f} | {r['time_ms']:.2f} | "
            f"{r['gbps']:.0f} | {r['execute_plan_ms']:.2f} | {r['raw_ms']:.2f} | {r['ratio']:.2f} | "
            f"{r['limit_ms']:.2f} | {r['limit_ms'] / r['time_ms']:.2f} | {r['extra_static']:.2f} | "
            f"{r['recompiles_after_first']} | {r['correct']} |"
        )
    if args.timeline:
        print("\ndevice time, first kernel to last (profiler, GPU 0), ours / raw ppermute:")
        for r in results:
            if r.get("device_ms") is None or r.get("raw_device_ms") is None:
                print(f"- {r['fraction']:.0%}: no GPU trace")
            else:
                ratio = r["raw_device_ms"] / r["device_ms"]
                print(
                    f"- {r['fraction']:.0%}: {r['device_ms']:.2f} ms / {r['raw_device_ms']:.2f} ms (raw / ours {ratio:.2f})"
                )
    print(f"host planning: {', '.join(f'{r["fraction"]:.0%} {r["plan_ms"]:.0f} ms' for r in results)}")
    for elements, schedule, exact in checks:
        print(f"dtype check ({elements} elements per row, {schedule}): {exact}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()

"""Expert transport benchmark: rearrange_experts vs a raw ppermute of the same bytes.

A DeepSeek-V3-like MoE (58 layers, 256 experts on 288 slots) with experts
shrunk to fit: per slot an fp8 (e4m3) w13 ``[2 * inter, hidden]`` with
float8_e8m0fnu block scales ``[2 * inter, hidden / 32]`` and a bf16 w2
``[hidden, inter]``. Placement changes swap slots between ranks (experts with
one replica, so every swap moves two rows) to move ~10% and ~50% of the slots;
each iteration draws fresh swaps with the same per-rank counts, so plans differ
but capacities do not (the executor must not recompile).

Printed side by side per (fraction, chunks): bytes moved per rank, median time,
GB/s, raw ppermute of the same number of uint8 bytes, the ratio, peak extra
device memory (measured from ``memory_stats`` and XLA's static temp size) over
bytes moved, compiles. Correctness: per-slot hashes after each first move are
checked against the expected source slots.

  PYTHONPATH=. python3 benchmarks/transport.py                  # library defaults, all devices
  PYTHONPATH=. python3 benchmarks/transport.py --ranks 8 --chunks 8 4 1 --variants own+d1 words+d1 words+d2+lhs
  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
      PYTHONPATH=. python3 benchmarks/transport.py --layers 4 --hidden 256 --inter 32 --iters 2   # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from moe_eplb_jax import sharding as eps
from moe_eplb_jax.sharding import packing
from moe_eplb_jax.sharding import transport as _transport


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=None, help="EP ranks (default: all devices)")
    p.add_argument("--layers", type=int, default=58)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--slots", type=int, default=288)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=128)
    p.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.5])
    p.add_argument("--chunks", type=int, nargs="+", default=[0],
                   help="chunks per round, in order of rising memory; 0: the library's default chunking")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--variants", nargs="+", default=["default"],
                   help="executor variants, '+'-joined: own|words (rows in their dtype / as uint32 words), "
                        "dN (N transfers in flight), lhs (XLA latency-hiding scheduler); default: the library's")
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
        free = [list(rng.permutation([p for p in range(r * per_rank, (r + 1) * per_rank)
                                      if counts[phy2log[lyr, p]] == 1])) for r in range(num_ranks)]
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
def raw_ppermute(mesh, nbytes_per_rank, iters):
    num_ranks = mesh.shape["ep"]
    sharding = NamedSharding(mesh, PartitionSpec("ep"))
    buf = jax.jit(lambda: jax.random.bits(jax.random.key(1), (num_ranks * nbytes_per_rank,), jnp.uint8),
                  out_shardings=sharding)()
    perm = [(r, (r + 1) % num_ranks) for r in range(num_ranks)]
    fn = jax.jit(jax.shard_map(lambda x: jax.lax.ppermute(x, "ep", perm), mesh=mesh,
                               in_specs=PartitionSpec("ep"), out_specs=PartitionSpec("ep")))
    fn(buf).block_until_ready()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn(buf).block_until_ready()
        times.append(time.perf_counter() - t)
    del buf
    return statistics.median(times)


def dtype_check(mesh, rng):
    """Byte-exact contract on this backend for every supported dtype (random bytes, NaN payloads included)."""
    import ml_dtypes

    num_ranks = mesh.shape["ep"]
    layers, experts, slots = 2, 4 * num_ranks, 6 * num_ranks
    dtypes = [np.float32, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
              ml_dtypes.float8_e8m0fnu, ml_dtypes.float4_e2m1fn, np.int8, np.uint8, np.int32]
    ckpt = {}
    for i, dt in enumerate(dtypes):
        width = max(1, jax.dtypes.itemsize_bits(np.dtype(dt)) // 8)
        raw = rng.integers(0, 256, (layers, experts, 6 * width), dtype=np.uint8)
        if jax.dtypes.itemsize_bits(np.dtype(dt)) == 4:
            raw &= 0x0F
        ckpt[f"leaf{i}"] = raw.view(dt)
    old = np.stack([rng.permutation(np.arange(slots) % experts) for _ in range(layers)])
    new = np.stack([rng.permutation(np.concatenate([np.arange(experts), rng.integers(0, experts, slots - experts)]))
                    for _ in range(layers)])
    take = lambda tab: {k: v[np.arange(layers)[:, None], tab] for k, v in ckpt.items()}  # noqa: E731
    moved = eps.rearrange_experts(eps.shard_slots(take(old), mesh, layered=True), old, new, mesh=mesh)
    expect = take(new)
    from moe_eplb_jax.sharding.packing import byte_rows_numpy

    return all(np.array_equal(byte_rows_numpy(np.asarray(moved[k]), 2), byte_rows_numpy(expect[k], 2)) for k in ckpt)


def component_times(mesh, experts, capacity, iters):
    """Median ms of the local parts alone: packing ``capacity`` rows, scattering them back (donates experts)."""
    names = sorted(experts)
    leaves = [experts[k] for k in names]
    probe = eps.plan_rearrangement(np.zeros((leaves[0].shape[0], leaves[0].shape[1]), np.int32),
                                   np.zeros((leaves[0].shape[0], leaves[0].shape[1]), np.int32), mesh.shape["ep"])
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
    scatter_fn = jax.jit(jax.shard_map(scatter, mesh=mesh, in_specs=(spec,) + tuple(specs), out_specs=list(specs)),
                         donate_argnums=tuple(range(1, len(leaves) + 1)))
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
def main():
    args = parse_args()
    mesh = eps.ep_mesh(args.ranks)
    num_ranks = mesh.shape["ep"]
    devices = list(mesh.devices.flat)
    rng = np.random.default_rng(args.seed)
    print(f"devices: {num_ranks} x {devices[0].device_kind}; jax {jax.__version__}", flush=True)

    phy2log = initial_placement(rng, args.layers, args.experts, args.slots)
    experts = make_experts(mesh, args.layers, args.slots, args.hidden, args.inter, args.seed)
    jax.block_until_ready(experts)
    probe = eps.plan_rearrangement(phy2log, phy2log, num_ranks)
    row = eps.row_bytes(experts, probe, mesh=mesh)
    per_rank = args.layers * args.slots // num_ranks * row
    print(f"row {row} B/slot, experts {per_rank / 2**30:.2f} GiB per rank", flush=True)

    results = []
    default_word_view, default_depth = _transport.WORD_VIEW, _transport.PIPELINE_DEPTH
    configs = [(v, f, c) for v in args.variants for f in args.fractions for c in args.chunks]
    for view, fraction, chunks in configs:
        parts = view.split("+")
        _transport.WORD_VIEW = True if "words" in parts else False if "own" in parts else default_word_view
        depths = [int(x[1:]) for x in parts if x[:1] == "d" and x[1:].isdigit()]
        _transport.PIPELINE_DEPTH = depths[0] if depths else default_depth
        options = {"xla_gpu_enable_latency_hiding_scheduler": True} if "lhs" in parts else None
        times, plan_s, compiles, checked, extra_measured, temp = [], [], [], None, None, None
        for it in range(args.iters + 1):
            new = swap_placement(rng, phy2log, num_ranks, fraction)
            t0 = time.perf_counter()
            plan = eps.plan_rearrangement(phy2log, new, num_ranks)
            plan_s.append(time.perf_counter() - t0)
            c = plan.capacities[0]
            max_chunk = -(-c // chunks) * row if chunks else None
            if it == 0:
                before_hash = slot_hashes(mesh, experts)
                # static temp size of the compiled executor
                leaves, layouts, specs, _ = _transport._check_leaves(experts, plan, mesh, "ep")
                nch = _transport._num_chunks(plan, layouts, max_chunk)
                chunks_used = nch
                fn = _transport._executor(mesh, "ep", tuple(specs), tuple(layouts), 2, True, nch,
                                          tuple(sorted((options or {}).items())))
                tables = {k: jax.device_put(v, NamedSharding(mesh, PartitionSpec("ep")))
                          for k, v in plan.device_tables().items()}
                temp = fn.lower(tables, leaves).compile().memory_analysis().temp_size_in_bytes
                in_use, _ = mem_in_use(devices)
            size0 = eps.executor_trace_count()
            t = time.perf_counter()
            experts = eps.execute_plan(experts, plan, mesh=mesh, max_chunk_bytes=max_chunk, compiler_options=options)
            jax.block_until_ready(experts)
            dt = time.perf_counter() - t
            compiles.append(eps.executor_trace_count() - size0)
            if it == 0:
                _, peak = mem_in_use(devices)
                extra_measured = peak - in_use
                checked = check_move(before_hash, slot_hashes(mesh, experts), phy2log, new)
            else:
                times.append(dt)
            phy2log = new
        moved = plan.bytes_moved(row)
        med = statistics.median(times)
        res = dict(view=view, fraction=fraction, chunks=chunks_used, moved=moved, time_ms=med * 1e3, gbps=moved / med / 1e9,
                   extra_measured=extra_measured / moved, extra_static=temp / moved,
                   recompiles_after_first=sum(compiles[1:]), first_compiles=compiles[0], correct=checked,
                   plan_ms=statistics.median(plan_s) * 1e3, capacity=plan.capacities[0])
        results.append(res)
        print(json.dumps(res), flush=True)

    # Raw ppermute last: its buffers would otherwise raise the memory peak seen by later configurations.
    raw_by_size = {}
    for r in results:
        if r["moved"] not in raw_by_size:
            raw_by_size[r["moved"]] = raw_ppermute(mesh, r["moved"], max(5, args.iters))
        raw = raw_by_size[r["moved"]]
        r.update(raw_ms=raw * 1e3, raw_gbps=r["moved"] / raw / 1e9, ratio=raw / (r["time_ms"] / 1e3))
    _transport.WORD_VIEW, _transport.PIPELINE_DEPTH = default_word_view, default_depth
    dtype_ok = dtype_check(mesh, rng)
    components = {}
    for words in (False, True):
        _transport.WORD_VIEW = words
        times, experts = component_times(mesh, experts, results[-1]["capacity"], max(5, args.iters))
        for k, v in times.items():
            components[f"{k} ({'words' if words else 'own dtype'})"] = v
    _transport.WORD_VIEW = default_word_view

    print(f"\n## transport: {num_ranks} x {devices[0].device_kind}, {args.layers} layers x {args.slots} slots, "
          f"row {row} B (fp8 w13 + e8m0 scales + bf16 w2), iters {args.iters}")
    print("(peak extra from memory_stats is a running maximum: valid while it rises; 'static' is XLA's temp size)")
    print("| view | moved | chunks | MiB/rank | ours ms | ours GB/s | raw ppermute ms | raw GB/s | ours/raw | "
          "peak extra / moved (stats, static) | recompiles | correct | plan ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['view']} | {r['fraction']:.0%} | {r['chunks']} | {r['moved'] / 2**20:.0f} | {r['time_ms']:.2f} | "
              f"{r['gbps']:.0f} | {r['raw_ms']:.2f} | {r['raw_gbps']:.0f} | {r['ratio']:.2f} | "
              f"{r['extra_measured']:.2f}, {r['extra_static']:.2f} | {r['recompiles_after_first']} | "
              f"{r['correct']} | {r['plan_ms']:.0f} |")
    print("components at the last capacity (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in components.items()))
    print(f"dtype check on this backend (all dtypes, NaN payloads, byte-exact): {dtype_ok}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

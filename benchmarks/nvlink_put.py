"""Does a Pallas Mosaic GPU kernel that writes straight into the peer GPU's memory beat ``ppermute`` (NCCL)?

Two local GPUs, one process, mesh axis ``"ep"``. Each device holds ``x: [R, W] uint32`` and the kernel writes
into the *other* device's output buffer over NVLink, through ``plgpu.remote_ref(out_ref, peer)``. No NVSHMEM:
with one process and several local GPUs, Mosaic GPU takes the peers' buffer addresses from XLA's "collective
metadata" (the lowered custom call says ``uses_xla_collective_metadata = true``). Variants, per device:

``put_all``   the whole ``[R, W]`` buffer goes to the same rows of the peer's output (the bytes a
              ``ppermute`` moves); checked against the ``ppermute`` output.
``put_rows``  only rows ``src_rows[n]`` go, into rows ``dst_rows[n]`` of the peer's output (both tables are
              the sender's): the sender gathers by index from its own HBM and scatters by index straight into
              the peer's HBM, with no pack/unpack buffer (what a rearrangement of expert rows needs).
              Checked on device against ``take`` + ``ppermute`` + scatter, and for a sample of rows against a
              numpy model. Output rows not named in ``dst_rows`` are left unwritten and not compared.
``ppermute``  ``jax.lax.ppermute`` of the same bytes (perm [(0, 1), (1, 0)]), the baseline.

The kernel (Lane lowering semantics, one warpgroup per program, ``--programs`` programs, ~one per SM): each
program takes every ``programs``-th chunk of ``chunk`` consecutive words of a row, moves it HBM -> SMEM with a
TMA bulk copy (``copy_gmem_to_smem``, ``stages`` SMEM buffers in flight) and SMEM -> peer HBM with a TMA bulk
store (``copy_smem_to_gmem`` to the remote ref). When its stores are complete (``wait_smem_to_gmem(0)``), it
adds 1 to a semaphore on the peer (``pl.semaphore_signal(..., device_id=peer)``, a ``red.release.sys``);
program 0 of each device waits until the peer's ``programs`` signals have arrived, so the output is complete
when the kernel returns. Nothing multicast is used (no ``multimem``, no ``semaphore_signal_multicast``).

Run (a machine with 2 GPUs)::

    PYTHONPATH=. python3 benchmarks/nvlink_put.py            # ~2 GiB per device: R=4096, W=133120
    PYTHONPATH=. python3 benchmarks/nvlink_put.py --small    # R=64: quick compile / correctness check
    PYTHONPATH=. python3 benchmarks/nvlink_put.py --configs 10240x4,6656x6,5120x8 --device-time

Without a GPU (fakes 2 CPU devices)::

    PYTHONPATH=. python3 benchmarks/nvlink_put.py --lower-only [--small]

``--lower-only`` (1) runs the copy pipeline on tiny shapes under the Mosaic GPU CPU interpreter with race
detection (writing the device's own output: the interpreter has no remote refs or semaphores), and (2)
``jax.export``s every kernel for platform "cuda" and reports what the custom call carries. It does not run
ptxas or the kernel.

Output per variant and configuration: bytes per device, ms (median of ``--reps`` host-timed calls, each
``block_until_ready``), GB/s (bytes sent per device / time; both directions run at once), the ratio to the
``ppermute`` of the same bytes, optionally device time from the profiler, whether the bytes are right; then
one side-by-side table.

Verified on 2xH200 (2026-11-30, sixth session; figures in ``benchmarks/RESULTS.md``): the kernel compiles and
runs without NVSHMEM, every byte arrives (checked against the ppermute and a numpy model), and it moves bytes
as fast as the ppermute (device time 5.93 vs 5.99 ms for 2080 MiB; by row index faster than take + ppermute +
scatter). The library's executor builds on it (``moe_eplb_jax/sharding/_nvlink.py``). The risks written down
before the first GPU run, kept for whoever changes the kernel:

* Peer addresses: collective metadata is used when ``jax.device_count() == jax.local_device_count() > 1`` or
  NVSHMEM is not enabled (jax/experimental/mosaic/gpu/core.py). Keep ``--xla_gpu_experimental_enable_nvshmem``
  out of XLA_FLAGS. The raw peer pointers need CUDA peer access between the two GPUs; an "illegal address"
  error would point there.
* The semaphore is a GMEM scratch that an XLA op zeroes before every launch; the cross-device barrier XLA runs
  before the kernel (``CompilerParams.skip_device_barrier=False``, the default, kept) stops the peer from
  signalling, or writing into our output, before that. Its cost is inside the timed region.
* TMA: the copies are plain bulk copies (no tensor map) because the slices are contiguous and ``oob_mode`` is
  not ZEROS (launch_context.py ``is_simple_contiguous_copy``); they need 16-byte sizes and addresses, and the
  Lane-semantics barrier arrival splits the bytes over 128 threads, so chunks are multiples of 32 words.
  Tensor-map TMA would cap boxes at 256 elements per dimension.
* SMEM: stages * chunk * 4 bytes + barriers must fit in 232,448 bytes (the lowering checks).
* Only program 0 waits, so deadlock-freedom needs just one resident program per GPU; the others may be
  queued behind other work.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

AXIS = "ep"
DEFAULT_ROWS, DEFAULT_WORDS = 4096, 133120  # 532,480-byte rows, 2.03 GiB per device
SMALL_ROWS = 64
SMEM_BYTES = 227 * 1024  # usable shared memory per block on H100/H200
NVLINK_GBPS = 450.0  # H200 NVLink 4: ~450 GB/s per direction per GPU


# ------------------------------------------------------------------------------------------ arguments
def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", type=int, default=None, help=f"R, rows per device (default {DEFAULT_ROWS})")
    p.add_argument("--words", type=int, default=DEFAULT_WORDS, help="W, uint32 words per row")
    p.add_argument("--small", action="store_true", help=f"R={SMALL_ROWS} unless --rows is given")
    p.add_argument("--fraction", type=float, default=0.5, help="put_rows moves round(fraction * R) rows")
    p.add_argument(
        "--configs",
        default=None,
        help="kernel configurations CHUNK_WORDSxSTAGES, comma separated (default: one, chosen from W)",
    )
    p.add_argument("--programs", type=int, default=None, help="grid size (default: the GPU's SM count, else 132)")
    p.add_argument("--variants", default="put_all,put_rows", help="which kernel variants to run")
    p.add_argument("--reps", type=int, default=20, help="timed calls per measurement (median)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device-time", action="store_true", help="also read device time from the profiler")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--lower-only",
        action="store_true",
        help="no GPU: fake 2 CPU devices and only check that the kernels lower for 'cuda'",
    )
    args = p.parse_args(argv)
    if args.rows is None:
        args.rows = SMALL_ROWS if args.small else DEFAULT_ROWS
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = set(args.variants) - {"put_all", "put_rows"}
    if bad:
        p.error(f"unknown variants {sorted(bad)}")
    args.configs = parse_configs(args.configs) if args.configs else [default_config(args.words)]
    for chunk, stages in args.configs:
        check_config(p, args.words, chunk, stages)
    return args


def parse_configs(text):
    """'10240x4,6656x6' -> [(10240, 4), (6656, 6)]."""
    out = []
    for item in text.split(","):
        chunk, _, stages = item.strip().lower().partition("x")
        out.append((int(chunk), int(stages or 4)))
    return out


def default_config(words, max_chunk_bytes=40 * 1024, stages=4):
    """The largest chunk (words) that divides a row, is a multiple of 32 words and is <= max_chunk_bytes."""
    best = None
    for chunk in range(32, min(words, max_chunk_bytes // 4) + 1, 32):
        if words % chunk == 0:
            best = chunk
    if best is None:
        raise SystemExit(f"no chunk size of <= {max_chunk_bytes} bytes divides W={words}; pass --configs")
    return best, stages


def check_config(parser, words, chunk, stages):
    # Lane semantics: every thread of the warpgroup arrives on the TMA barrier with bytes / 128, so a chunk
    # must be a multiple of 128 bytes (32 words); TMA itself needs 16-byte multiples.
    if words % chunk or chunk % 32:
        parser.error(f"chunk {chunk} words must divide W={words} and be a multiple of 32 words (128 bytes)")
    if words * 4 % 16:
        parser.error("a row must be a multiple of 16 bytes (TMA addresses)")
    if stages < 2 or stages * chunk * 4 > SMEM_BYTES:
        parser.error(f"{stages} stages x {chunk * 4} bytes do not fit in {SMEM_BYTES} bytes of SMEM (or < 2 stages)")


def configure_platform(lower_only: bool):
    """Must run before jax is imported: --lower-only fakes two CPU devices."""
    if not lower_only:
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=2").strip()


# ------------------------------------------------------------------------------------------ the kernel
def make_put(*, rows_out, words, chunk_words, stages, programs, moved_rows, indexed, local=False, interpret=None):
    """Per-device function (call it inside shard_map over AXIS) that writes rows into the peer's output.

    indexed=False: ``f(x) -> out``; the peer's ``out[i] = x[i]`` for every row i (moved_rows = R).
    indexed=True:  ``f(x, src_rows, dst_rows) -> out``; the peer's ``out[dst_rows[k]] = x[src_rows[k]]``
    for k < moved_rows. Other rows of ``out`` are not written.
    local=True: write the *own* output and leave out the semaphore handshake -- only for checking the copy
    pipeline (chunk indexing, buffers, barriers) under the CPU interpreter, which has no remote refs or
    semaphores. ``interpret`` is passed to ``plgpu.kernel``.
    """
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    chunks_per_row = words // chunk_words
    total_chunks = moved_rows * chunks_per_row  # static: the same on both devices

    def body(*refs):
        if indexed:
            x_ref, src_ref, dst_ref, out_ref = refs
        else:
            (x_ref, out_ref), src_ref, dst_ref = refs, None, None
        if local:
            peer_out = out_ref
        else:
            # One semaphore per device (global scope: shared by all programs), zeroed before every launch.
            done = pl.get_global(plgpu.SemaphoreType.REGULAR)
            peer = 1 - lax.axis_index(AXIS)
            peer_out = plgpu.remote_ref(out_ref, peer)  # our writes land in the other GPU's output buffer
        pid = lax.axis_index("programs")
        # This program moves chunks pid, pid + programs, pid + 2 * programs, ...
        my_count = lax.div(total_chunks - pid + (programs - 1), programs)

        def locate(step):
            """(source row, destination row, first word) of this program's step-th chunk."""
            chunk = pid + step * programs
            i, j = lax.div(chunk, chunks_per_row), lax.rem(chunk, chunks_per_row)
            src = src_ref[i] if indexed else i
            dst = dst_ref[i] if indexed else i
            return src, dst, j * chunk_words

        @functools.partial(
            pl.run_scoped,
            buf=plgpu.SMEM((stages, chunk_words), jnp.uint32),
            loaded=plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        )
        def _pipeline(buf, loaded):
            def load(step):
                slot = lax.rem(step, stages)
                src, _, col = locate(step)
                # PROMISE_IN_BOUNDS keeps this a plain contiguous bulk copy (no tensor map, no 256-element
                # box limit); ZEROS (the default) would force a tensor-map TMA.
                plgpu.copy_gmem_to_smem(
                    x_ref.at[src, pl.ds(col, chunk_words)],
                    buf.at[slot],
                    loaded.at[slot],
                    oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS,
                )

            for s in range(stages):  # prologue: fill every buffer

                @pl.when(s < my_count)
                def _():
                    load(s)

            @pl.loop(0, my_count)
            def _step(step):
                slot = lax.rem(step, stages)
                plgpu.barrier_wait(loaded.at[slot])
                _, dst, col = locate(step)
                plgpu.copy_smem_to_gmem(buf.at[slot], peer_out.at[dst, pl.ds(col, chunk_words)])
                # Refill the buffer of the *previous* step: allow this step's store to keep reading SMEM
                # while we wait only for the older one (a release delayed by one step).
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                refill = step - 1 + stages

                @pl.when((step >= 1) & (refill < my_count))
                def _():
                    load(refill)

            # Every store of this program has landed (not just left SMEM) before we tell the peer.
            plgpu.wait_smem_to_gmem(0, wait_read_only=False)

        if local:
            return
        pl.semaphore_signal(done, 1, device_id=peer)  # release.sys: our writes are visible before the signal

        # The kernel ends when all programs end, so one waiter suffices; keeping the others free means a
        # program that is not yet resident can still be scheduled (no cross-GPU deadlock on occupancy).
        @pl.when(pid == 0)
        def _():
            pl.semaphore_wait(done, programs, decrement=False)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((rows_out, words), jnp.uint32),
        grid=(programs,),
        grid_names=("programs",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )
    return kernel


# ------------------------------------------------------------------------------------------ jitted functions
def build_functions(mesh, args, chunk_words, stages, programs, moved_rows):
    """{name: jitted function of global sharded arrays} for the kernels and the ppermute baselines."""
    import jax
    from jax.sharding import PartitionSpec as P

    R, W = args.rows, args.words
    perm = [(0, 1), (1, 0)]

    def smap(fn, n_in):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(AXIS),) * n_in, out_specs=P(AXIS), check_vma=False))

    put_all = make_put(
        rows_out=R, words=W, chunk_words=chunk_words, stages=stages, programs=programs, moved_rows=R, indexed=False
    )
    put_rows = make_put(
        rows_out=R,
        words=W,
        chunk_words=chunk_words,
        stages=stages,
        programs=programs,
        moved_rows=moved_rows,
        indexed=True,
    )
    return {
        "put_all": smap(put_all, 1),
        "put_rows": smap(put_rows, 3),
        "ppermute": smap(lambda x: jax.lax.ppermute(x, AXIS, perm), 1),
        # Reference for put_rows (not timed): pack, send rows and the sender's dst_rows, scatter into zeros.
        "rows_reference": smap(
            lambda x, s, d: (
                jax.numpy.zeros_like(x).at[jax.lax.ppermute(d, AXIS, perm)].set(jax.lax.ppermute(x[s], AXIS, perm))
            ),
            3,
        ),
    }


# ------------------------------------------------------------------------------------------ --lower-only
# Tiny cases for the interpreter: (R, W, chunk words, stages, programs, moved rows). They cover more programs
# than chunks, fewer chunks per program than stages, one program, and a ragged last round.
INTERPRET_CASES = ((6, 128, 32, 3, 5, 4), (6, 128, 32, 2, 30, 1), (6, 128, 64, 4, 2, 6), (6, 128, 128, 2, 1, 3))


def interpret_check(seed):
    """Runs the copy pipeline on CPU under the Mosaic GPU interpreter, race detection on.

    The interpreter has no remote refs or semaphores, so the kernels are built with ``local=True`` (each device
    writes its own output, no handshake): this checks chunk indexing, buffer reuse and barriers, not NVLink.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as interp  # private; may move
    from jax.experimental.pallas import mosaic_gpu as plgpu

    rng = np.random.default_rng(seed)
    ok = True
    for R, W, chunk, stages, programs, moved in INTERPRET_CASES:
        params = plgpu.InterpretGPUParams(detect_races=True)
        x = jax.random.bits(jax.random.key(seed), (R, W), jnp.uint32)
        src = rng.choice(R, moved, replace=False).astype(np.int32)
        dst = rng.permutation(R)[:moved].astype(np.int32)
        common = dict(
            rows_out=R, words=W, chunk_words=chunk, stages=stages, programs=programs, local=True, interpret=params
        )
        y_all = np.asarray(make_put(moved_rows=R, indexed=False, **common)(x))
        y_rows = np.asarray(make_put(moved_rows=moved, indexed=True, **common)(x, jnp.asarray(src), jnp.asarray(dst)))
        xn = np.asarray(x)
        case_ok = (
            np.array_equal(y_all, xn) and np.array_equal(y_rows[dst], xn[src]) and not interp.get_races().races_found
        )
        ok &= case_ok
        print(
            f"[interpret] R={R} W={W} chunk={chunk} stages={stages} programs={programs} moved={moved}: "
            f"bytes {'ok' if case_ok else 'WRONG'}, races found: {interp.get_races().races_found}"
        )
    return ok


def lower_only(args):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
    programs = args.programs or 132
    moved = max(1, round(args.fraction * args.rows))
    sharded = NamedSharding(mesh, P(AXIS))
    x = jax.ShapeDtypeStruct((2 * args.rows, args.words), jnp.uint32, sharding=sharded)
    idx = jax.ShapeDtypeStruct((2 * moved,), jnp.int32, sharding=sharded)
    print(f"jax {jax.__version__}, devices {jax.devices()}, R={args.rows} W={args.words} programs={programs}")
    try:
        ok = interpret_check(args.seed)
    except Exception as e:  # the interpreter is young; its failure must not hide the lowering result
        ok = False
        print(f"[interpret] FAILED {type(e).__name__}: {str(e).strip()[:1000]}")
    for chunk, stages in args.configs:
        fns = build_functions(mesh, args, chunk, stages, programs, moved)
        cases = {"put_all": (x,), "put_rows": (x, idx, idx), "ppermute": (x,)}
        for name, avals in cases.items():
            if name.startswith("put") and name not in args.variants:
                continue
            label = f"{name} chunk={chunk} stages={stages}" if name != "ppermute" else name
            try:
                exp = jax.export.export(fns[name], platforms=["cuda"])(*avals)
                text = exp.mlir_module()
                print(f"[lower-only] {label}: exported for cuda OK; " + describe_module(text))
            except Exception as e:  # report every failure, keep going
                ok = False
                msg = str(e).strip().splitlines()
                print(f"[lower-only] {label}: FAILED {type(e).__name__}: {msg[0] if msg else ''}")
                for line in msg[1:6]:
                    print(f"    {line}")
    print(
        "lower-only:",
        "interpreter checks passed and all kernels lowered for cuda" if ok else "SOMETHING FAILED (see above)",
    )
    return 0 if ok else 1


def describe_module(text: str) -> str:
    """What the exported StableHLO says about the Mosaic GPU custom call (collective metadata, replica ids)."""
    facts = []
    if "mosaic_gpu_v2" in text:
        facts.append("custom_call mosaic_gpu_v2")
        for key in (
            "uses_xla_collective_metadata = true",
            "xla_replica_ids",
            "symmetric_memory_parameters",
            "skip_device_barrier = false",
        ):
            if key in text:
                facts.append(key.split(" =")[0] + ("" if "=" not in key else "=" + key.split("= ")[1]))
    if "collective_permute" in text:
        facts.append("collective_permute")
    return ", ".join(facts) or "no custom call / collective found"


# ------------------------------------------------------------------------------------------ GPU run
def make_inputs(mesh, args, moved, seed):
    """Fresh random x (on device, never all zeros) and per-device row tables (distinct destinations)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sharded = NamedSharding(mesh, P(AXIS))
    x = jax.jit(lambda k: jax.random.bits(k, (2 * args.rows, args.words), jnp.uint32), out_shardings=sharded)(
        jax.random.key(seed)
    )
    rng = np.random.default_rng(seed)
    src = np.concatenate([rng.choice(args.rows, moved, replace=False) for _ in range(2)]).astype(np.int32)
    dst = np.concatenate([rng.permutation(args.rows)[:moved] for _ in range(2)]).astype(np.int32)
    return x, jax.device_put(src, sharded), jax.device_put(dst, sharded), src, dst


def check_put_all(fns, x):
    import jax
    import jax.numpy as jnp

    got, want = fns["put_all"](x), fns["ppermute"](x)
    same = bool(jax.jit(lambda a, b: jnp.array_equal(a, b))(got, want))
    nonzero = bool(jax.jit(lambda a: jnp.any(a != 0))(got))
    return same and nonzero


def check_put_rows(fns, x, src_d, dst_d, src, dst, rows, moved, seed, samples=32):
    """Device-side: dst rows equal take+ppermute's. Host-side numpy model on a sample of rows."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    got = fns["put_rows"](x, src_d, dst_d)
    want = fns["rows_reference"](x, src_d, dst_d)
    # Sender e's dst_rows name rows of the *receiver's* (1 - e) output: global row (1 - e) * rows + dst.
    gdst = jnp.asarray(dst.reshape(2, moved) + (np.arange(2)[::-1] * rows)[:, None]).reshape(-1)
    same = bool(jax.jit(lambda a, b, d: jnp.array_equal(a[d], b[d]))(got, want, gdst))
    # numpy model: device d's out[dst_d[k]] == device (1-d)'s x[src_(1-d)[k]]
    rng = np.random.default_rng(seed + 1)
    ok_model = True
    for d in range(2):
        e = 1 - d  # the sender
        for k in rng.choice(moved, min(samples, moved), replace=False):
            expected = np.asarray(x[e * rows + src[e * moved + k]])
            actual = np.asarray(got[d * rows + dst[e * moved + k]])
            ok_model &= bool(np.array_equal(actual, expected)) and bool(expected.any())
    return same and ok_model


def timed(fn, fargs, args):
    """(median host-timed seconds, device seconds or None)."""
    from _timing import device_seconds, median_seconds  # benchmarks/ is on sys.path when run as a script

    t = median_seconds(fn, *fargs, reps=args.reps, warmup=args.warmup)
    dev = None
    if args.device_time:
        try:
            dev, _ = device_seconds(fn, *fargs, calls=args.reps, warmup=1)
        except Exception as e:  # optional: say why and carry on
            print(f"  (device time unavailable: {type(e).__name__}: {e})")
    return t, dev


def run_gpu(args):
    import jax

    if jax.device_count() != 2 or jax.local_device_count() != 2:
        print(f"needs exactly 2 local GPUs in one process; found {jax.devices()}")
        return 2
    mesh = jax.make_mesh((2,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
    dev0 = jax.devices()[0]
    programs = args.programs or getattr(dev0, "core_count", None) or 132
    moved = max(1, round(args.fraction * args.rows))
    row_bytes = args.words * 4
    print(
        f"{jax.device_count()} x {dev0.device_kind}, jax {jax.__version__}; R={args.rows} rows x {row_bytes} B "
        f"= {args.rows * row_bytes / 2**30:.3f} GiB per device; put_rows moves {moved} rows; programs={programs}",
        flush=True,
    )
    x, src_d, dst_d, src, dst = make_inputs(mesh, args, moved, args.seed)
    results = []

    def record(name, config, nbytes, base_t, fn, fargs, correct):
        t, dev = timed(fn, fargs, args)
        row = dict(
            name=name,
            config=config,
            bytes=nbytes,
            ms=t * 1e3,
            gbps=nbytes / t / 1e9,
            ratio=(base_t / t) if base_t else 1.0,
            dev_ms=None if dev is None else dev * 1e3,
            correct=correct,
        )
        results.append(row)
        dev_txt = "" if dev is None else f", device {dev * 1e3:.3f} ms ({nbytes / dev / 1e9:.1f} GB/s)"
        print(
            f"  {name:<9} {config:<14} {nbytes / 2**20:9.1f} MiB {t * 1e3:9.3f} ms {row['gbps']:7.1f} GB/s "
            f"x{row['ratio']:.2f} vs ppermute{dev_txt}, correct={correct}",
            flush=True,
        )
        return t

    # Baselines first: ppermute of all rows and of the moved rows' bytes.
    base = build_functions(mesh, args, *args.configs[0], programs, moved)
    t_all = record("ppermute", "all rows", args.rows * row_bytes, None, base["ppermute"], (x,), True)
    x_moved = jax.jit(
        lambda a: a.reshape(2, args.rows, -1)[:, :moved].reshape(2 * moved, -1), out_shardings=x.sharding
    )(x)
    t_rows = record("ppermute", f"{moved} rows", moved * row_bytes, None, base["ppermute"], (x_moved,), True)

    for chunk, stages in args.configs:
        config = f"{chunk}x{stages}"
        fns = build_functions(mesh, args, chunk, stages, programs, moved)
        for name in args.variants:
            try:
                if name == "put_all":
                    ok = check_put_all(fns, x)
                    record(name, config, args.rows * row_bytes, t_all, fns[name], (x,), ok)
                else:
                    ok = check_put_rows(fns, x, src_d, dst_d, src, dst, args.rows, moved, args.seed)
                    record(name, config, moved * row_bytes, t_rows, fns[name], (x, src_d, dst_d), ok)
            except Exception as e:  # one failing configuration must not hide the others
                print(f"  {name} {config}: FAILED {type(e).__name__}: {str(e)[:2000]}", flush=True)
                results.append(
                    dict(
                        name=name,
                        config=config,
                        bytes=0,
                        ms=float("nan"),
                        gbps=float("nan"),
                        ratio=float("nan"),
                        dev_ms=None,
                        correct=False,
                    )
                )

    print_table(results)
    return 0 if all(r["correct"] for r in results) else 1


def print_table(results):
    print(
        f"\n=== NVLink put vs ppermute (2 GPUs, bidirectional; GB/s = bytes sent per device / time; "
        f"ceiling ~{NVLINK_GBPS:.0f} GB/s per direction) ==="
    )
    print(
        f"{'variant':<9} {'config':<14} {'MiB/dev':>9} {'ms':>9} {'GB/s':>7} {'vs ppermute':>11} "
        f"{'dev ms':>8} {'correct':>7}"
    )
    for r in results:
        dev = "-" if r["dev_ms"] is None else f"{r['dev_ms']:.3f}"
        print(
            f"{r['name']:<9} {r['config']:<14} {r['bytes'] / 2**20:9.1f} {r['ms']:9.3f} {r['gbps']:7.1f} "
            f"{r['ratio']:11.2f} {dev:>8} {str(r['correct']):>7}"
        )


def main(argv=None):
    args = parse_args(argv)
    configure_platform(args.lower_only)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for _timing
    return lower_only(args) if args.lower_only else run_gpu(args)


if __name__ == "__main__":
    sys.exit(main())

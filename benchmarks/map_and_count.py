"""Benchmark: fused replica routing + load counting (``moe_eplb_jax.pallas.map_and_count``).

For T in {4096, 65536, 262144} tokens x top-8, P in {288, 512} slots (E = 256)
and every mode, prints side by side (microseconds per call):

* ``pallas``   -- the Triton kernel (``implementation="pallas"``), with the
  lookup table and thresholds built from the traced tables on every call (the
  kernels of each call are printed under its row);
* ``prepared`` -- the same with the lookup table built once per placement and
  passed in (``map_and_count(lookup=...)``, as ``MoELayer`` runs it);
* ``+words``   -- ``shares`` only: the prepared table with the alias words
  too (``lookup_table(..., replica_shares=..., num_physical=P)``: shares kept
  per placement, so no table is built per call);
* ``xla_best`` -- the best pure-XLA version here: the reference mapping plus a
  factorized one-hot histogram (``onehot_hi^T @ onehot_lo`` on the tensor cores);
* ``xla_ref``  -- the ``"xla"`` implementation: gather + ``jnp.bincount``
  (+ a stable argsort for ``resolved``);
* ``copy``     -- one XLA elementwise pass over the ids (read ids, write ids):
  the practical floor at this size;
* ``hbm``      -- bytes (ids read + ids written) / measured large-copy bandwidth.

Timing: each measurement is one jitted executable applying the op to ``REPS``
different input arrays (so they do not all sit in L2), run ``TRIALS`` times;
on GPU the time is the device time of its kernels from the profiler
(``_timing.device_seconds``, no host dispatch or sync), divided by ``REPS``;
elsewhere the host-timed median.

Run on a GPU machine: ``PYTHONPATH=. python3 benchmarks/map_and_count.py [--quick] [--sweep] [--setup]
[--sizes 4096,262144] [--modes resolved]`` (``--sweep`` first times the kernel options of ``SWEEP`` side by
side; ``--setup`` the ways of summing the thresholds, whole calls; ``--modes`` / ``--sizes`` limit the table).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from moe_eplb_jax.pallas import _reference, _triton
from moe_eplb_jax.pallas.map_and_count import _build_mode_table, lookup_table, map_and_count
from moe_eplb_jax.placement import Placement

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import device_seconds

REPS = 8
TRIALS = 10
NUM_LOGICAL = 256


LAST_KERNELS = {}  # the last timed call's device seconds per kernel name (GPU only)


def timed(fn, args_list, trials=TRIALS):
    """Seconds per op of ``fn`` applied to each element of ``args_list`` inside one jitted call.

    On GPU: kernel time from the profiler (CUPTI records, no host overhead), summed over the
    kernels of one call and divided by the number of ops; elsewhere: host-timed median of ``trials``.
    """
    many = jax.jit(lambda all_args: [fn(*a) for a in all_args])
    jax.block_until_ready(many(args_list))  # compile + warm up
    device, per_kernel = device_seconds(many, args_list, calls=trials, warmup=1)
    if device is not None:
        LAST_KERNELS.clear()
        LAST_KERNELS.update({name: seconds / len(args_list) for name, seconds in per_kernel.items()})
        return device / len(args_list)
    samples = []
    for _ in range(trials):
        start = time.perf_counter()
        jax.block_until_ready(many(args_list))
        samples.append((time.perf_counter() - start) / len(args_list))
    return statistics.median(samples)


def copy_bandwidth(log2_elements=28):
    """Bytes read + written per second by one large elementwise pass (default 1 GiB int32 in, 1 GiB out)."""
    x = jnp.arange(1 << log2_elements, dtype=jnp.int32)
    seconds = timed(lambda a: a + jnp.int32(1), [(x,)], trials=10)
    return 2 * x.nbytes / seconds


def factorized_histogram(physical_ids, counted, num_physical):
    """Pure-XLA histogram: ``onehot_hi^T @ onehot_lo`` (bf16 one-hots, f32 accumulation: exact below 2**24)."""
    hi_bits, lo_bits = _triton._split_bins(num_physical)
    bins = jnp.where(counted, physical_ids, -1).reshape(-1)
    hi = jnp.where(bins >= 0, bins >> lo_bits, -1)
    lo = bins & ((1 << lo_bits) - 1)
    rows = (hi[:, None] == jnp.arange(1 << hi_bits, dtype=jnp.int32)[None, :]).astype(jnp.bfloat16)
    cols = (lo[:, None] == jnp.arange(1 << lo_bits, dtype=jnp.int32)[None, :]).astype(jnp.bfloat16)
    hist = jnp.einsum("nh,nl->hl", rows, cols, preferred_element_type=jnp.float32)
    return hist.reshape(-1)[:num_physical].astype(jnp.int32)


def make_case(rng, num_tokens, top_k, num_physical, mode):
    redundant = num_physical - NUM_LOGICAL
    # Hot experts get the redundant slots (skewed, as a policy would place them).
    popularity = rng.lognormal(0.0, 1.0, NUM_LOGICAL)
    extra = rng.choice(NUM_LOGICAL, size=redundant, p=popularity / popularity.sum())
    phy2log = np.concatenate([np.arange(NUM_LOGICAL), extra])
    rng.shuffle(phy2log)
    placement = Placement.from_phy2log(phy2log, NUM_LOGICAL)
    log2phy, logcnt = placement.log2phy[0], placement.logcnt[0]
    width = log2phy.shape[1]
    kw = {}
    if mode == "shares":
        kw["replica_shares"] = rng.random((NUM_LOGICAL, width)).astype(np.float32) + 0.1
    if mode == "resolved":
        demand = num_tokens * top_k * popularity / popularity.sum()
        split = rng.random((NUM_LOGICAL, width)) * (np.arange(width)[None, :] < logcnt[:, None])
        kw["resolved"] = np.floor(demand[:, None] * split / split.sum(1, keepdims=True)).astype(np.int32)
    ids = [
        rng.choice(NUM_LOGICAL, size=(num_tokens, top_k), p=popularity / popularity.sum()).astype(np.int32)
        for _ in range(REPS)
    ]
    return (
        jnp.asarray(log2phy),
        jnp.asarray(logcnt),
        {k: jnp.asarray(v) for k, v in kw.items()},
        [jnp.asarray(i) for i in ids],
    )


def run_case(rng, num_tokens, top_k, num_physical, mode, bandwidth, log):
    log2phy, logcnt, kw, ids = make_case(rng, num_tokens, top_k, num_physical, mode)
    valid = num_tokens - 3

    # The placement tables and the shares / quotas are arguments, as in use (a model passes its EplbState's
    # tables; shares change per batch): what the wrapper builds from them runs on the device and is timed. (Up to
    # the sixth session they were closed over, so XLA folded those small ops into constants.)
    def ours(impl):
        return lambda x, log2phy, logcnt, kw, lookup=None: map_and_count(
            x,
            log2phy,
            logcnt,
            num_physical=num_physical,
            num_valid_tokens=valid,
            mode=mode,
            implementation=impl,
            lookup=lookup,
            **kw,
        )

    def xla_best(x, log2phy, logcnt, kw):
        phys, _ = ours("xla")(x, log2phy, logcnt, kw)  # the bincount is dead code here and is removed
        counted = (phys >= 0) & (jnp.arange(num_tokens, dtype=jnp.int32)[:, None] < valid)
        return phys, factorized_histogram(phys, counted, num_physical)

    # "prepared": the lookup table built once per placement (as a model keeps it), passed in; "words": with
    # shares' alias words in it too.
    lookup = jax.jit(lookup_table)(log2phy, logcnt)
    words = (
        jax.jit(functools.partial(lookup_table, replica_shares=kw["replica_shares"], num_physical=num_physical))(
            log2phy, logcnt
        )
        if mode == "shares"
        else None
    )
    # Correctness first: every column must agree on a fresh input.
    ref_phys, ref_load = ours("xla")(ids[0], log2phy, logcnt, kw)
    for name, fn in (
        ("pallas", ours("pallas")),
        ("xla_best", xla_best),
        ("prepared", functools.partial(ours("pallas"), lookup=lookup)),
        *((("words", functools.partial(ours("pallas"), lookup=words)),) if words is not None else ()),
    ):
        phys, load = jax.jit(fn)(ids[0], log2phy, logcnt, kw)
        if not (np.array_equal(phys, ref_phys) and np.array_equal(load, ref_load)):
            raise SystemExit(f"MISMATCH {name} T={num_tokens} P={num_physical} mode={mode}")

    args = [(x, log2phy, logcnt, kw) for x in ids]
    row = {"T": num_tokens, "k": top_k, "P": num_physical, "mode": mode}
    row["pallas"] = timed(ours("pallas"), args)
    if LAST_KERNELS:  # where a call's device time goes: the kernel and XLA's set-up of its inputs
        print("    " + ", ".join(f"{name[:28]} {t * 1e6:.2f}" for name, t in LAST_KERNELS.items()), flush=True)
    row["prepared"] = timed(ours("pallas"), [a + (lookup,) for a in args])
    row["words"] = timed(ours("pallas"), [a + (words,) for a in args]) if words is not None else None
    row["xla_best"] = timed(xla_best, args)
    row["xla_ref"] = timed(ours("xla"), args)
    row["copy"] = timed(lambda x, *_: x + jnp.int32(1), args)
    row["hbm"] = 2 * ids[0].nbytes / bandwidth
    log.write(json.dumps(row) + "\n")
    log.flush()
    return row


def variant_case(mode, num_tokens, num_physical):
    """The draws of one sweep case, ``(log2phy, logcnt, values, ids, thresholds, limits)``: they depend on (mode,
    T, P) only, so the variants of one case run on the same placement and ids. ``values``: the shares / quotas
    (``None`` for hash / round robin); ``thresholds`` built from them as the wrapper does."""
    mode_index = ("hash", "round_robin", "shares", "resolved").index(mode)
    case_rng = np.random.default_rng([num_tokens, num_physical, mode_index])
    log2phy, logcnt, kw, ids = make_case(case_rng, num_tokens, 8, num_physical, mode)
    width = log2phy.shape[1]
    values = kw.get("replica_shares", kw.get("resolved"))
    thresholds = (
        jnp.zeros((NUM_LOGICAL, width), jnp.int32)
        if values is None
        else _build_mode_table(mode, values, log2phy, logcnt)
    )
    limits = jnp.asarray([(num_tokens - 3) * 8] * 2, jnp.int32)
    return log2phy, logcnt, values, ids, thresholds, limits


def time_variant(rng, mode, options, count=True, num_tokens=262144, num_physical=288):
    """Checks one kernel configuration against the reference on :func:`variant_case`'s draws, then times it
    (seconds, or None). (The search's cost depends on the replica counts drawn, so variants share the draws.)
    """
    del rng
    # "setup": the tables built inside the timed call, as the public wrapper builds them ("thresholds": shares'
    # alias words by their Pallas kernel, resolved's thresholds), for resolved also the raw quotas passed on
    # ("quotas": the boundary programs sum them, the product is dead); "words": shares' alias words read from a
    # prepared lookup table (built outside the timed call).
    options = dict(options)
    setup = options.pop("setup", None)
    log2phy, logcnt, values, ids, thresholds, limits = variant_case(mode, num_tokens, num_physical)
    compact = options.get("compact", True)  # (a two-word table for "compact": False)
    prepared = (
        jax.jit(functools.partial(lookup_table, replica_shares=values, num_physical=num_physical if compact else None))(
            log2phy, logcnt
        )
        if setup == "words"
        else None
    )

    def fn(x, log2phy, logcnt, thresholds):  # tables traced, as in use: what the wrapper builds is timed
        quotas = shares = None
        if setup == "thresholds" and mode == "shares":  # as the public call: the words by their Pallas kernel
            shares = thresholds
        elif setup in ("thresholds", "quotas"):  # `thresholds` holds the quotas here
            quotas = thresholds if setup == "quotas" else None
            thresholds = _build_mode_table(mode, thresholds, log2phy, logcnt, limit=x.size)
        return _triton.map_and_count_triton(
            x,
            log2phy,
            logcnt,
            thresholds,
            limits,
            num_physical=num_physical,
            mode=mode,
            count=count,
            interpret=jax.default_backend() != "gpu",
            quotas=quotas,
            shares=shares,
            lookup=prepared,
            **options,
        )

    if setup in ("thresholds", "quotas"):
        thresholds = jnp.asarray(values)

    try:
        got = jax.jit(fn)(ids[0], log2phy, logcnt, thresholds)
        want = _reference.map_and_count_reference(
            ids[0],
            log2phy,
            logcnt,
            thresholds
            if setup in (None, "words")
            else _build_mode_table(mode, thresholds, log2phy, logcnt, limit=ids[0].size),
            limits,
            num_physical=num_physical,
            mode=mode,
        )
        if not np.array_equal(got[0], want[0]) or (count and not np.array_equal(got[1], want[1])):
            print(f"  {mode} {options} count={count}: WRONG RESULT", flush=True)
            return None
        seconds = timed(fn, [(x, log2phy, logcnt, thresholds) for x in ids])
    except Exception as e:  # a configuration Triton cannot compile: report and go on
        print(f"  {mode} {options} count={count}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None
    kernels = ", ".join(f"{name[:24]} {t * 1e6:.2f}" for name, t in list(LAST_KERNELS.items())[:6])
    shown = options if setup is None else {**options, "setup": setup}
    print(
        f"  T={num_tokens:<7} P={num_physical} {mode:<11} {str(shown):<62} count={count!s:<5} "
        f"{seconds * 1e6:8.2f} us  [{kernels}]",
        flush=True,
    )
    return seconds


def pallas_copy(x, block=2048, num_warps=4):
    """The Pallas floor: a Triton kernel that reads the ids and writes ids + 1 (same bytes as the mapping)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    flat = x.reshape(-1)

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1

    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(flat.size, block),),
        in_specs=[pl.BlockSpec((block,), lambda i: (i,))],
        out_specs=pl.BlockSpec((block,), lambda i: (i,)),
        out_shape=jax.ShapeDtypeStruct(flat.shape, flat.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps),
        interpret=jax.default_backend() != "gpu",
    )(flat)
    return out.reshape(x.shape)


def gather_probe(x, table, *, rows_bits, bucket_major, tile=8192, sub=4096, num_warps=16):
    """Diagnostic: one load per entry from ``table`` at (expert, the token hash's top ``rows_bits`` bits), stored.

    ``rows_bits = 0`` is the head table's access (one word per expert); more bits spread a warp's loads over more
    of the table, as a per-expert bucket table does (expert-major rows, or ``bucket_major``: ``[2**bits, E]``).
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    flat = x.reshape(-1)
    num_flat = flat.size

    def kernel(ids_ref, table_ref, out_ref):
        program = pl.program_id(0)

        def step(index, carry):
            start = pl.multiple_of(program * tile + index * sub, sub)
            at = start + jnp.arange(sub, dtype=jnp.int32)
            ids = plgpu.load(ids_ref.at[pl.ds(start, sub)], mask=at < num_flat, other=0)
            hashed = (at.astype(jnp.uint32) // jnp.uint32(8)) * jnp.uint32(2654435769)
            bucket = (hashed >> (32 - rows_bits)).astype(jnp.int32) if rows_bits else jnp.zeros_like(ids)
            where = bucket * NUM_LOGICAL + ids if bucket_major else (ids << rows_bits) + bucket
            plgpu.store(out_ref.at[pl.ds(start, sub)], plgpu.load(table_ref.at[where]), mask=at < num_flat)
            return carry

        jax.lax.fori_loop(0, tile // sub, step, 0)

    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_flat, tile),),
        in_specs=[pl.no_block_spec] * 2,
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct(flat.shape, jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps),
        interpret=jax.default_backend() != "gpu",
    )(flat, table)


SWEEP = [  # (mode, T, P, options): T x 8 entries; the defaults first in each group; "count": False skips counting
    # Seventeenth session, last call: where resolved's decode time goes (kernel by kernel), and counting by
    # per-entry atomics past 32768 slots (P = 40000) against the histogram (P = 512).
    ("resolved", 4096, 288, {}),
    ("resolved", 4096, 512, {}),
    ("resolved", 4096, 512, {"count": False}),
    ("resolved", 4096, 512, {"search": "while"}),
    ("resolved", 4096, 512, {"linear_search": 0}),
    ("resolved", 4096, 512, {"tables": "shared"}),
    ("resolved", 4096, 512, {"tile": 1024}),
    ("hash", 4096, 512, {}),
    ("hash", 262144, 512, {}),
    ("hash", 262144, 40000, {}),
    ("round_robin", 262144, 40000, {}),
    ("hash", 4096, 40000, {}),
]


def sweep(rng, probe=False):
    """Kernel options side by side (device time per call, each checked against the reference); no defaults change.

    ``probe``: first the gather probe (:func:`gather_probe`) at a few table sizes."""
    print("sweep (k=8; device time per call):", flush=True)
    flat = jnp.asarray(rng.integers(0, NUM_LOGICAL, size=(REPS, 262144, 8)), jnp.int32)
    us = timed(functools.partial(pallas_copy, block=2048, num_warps=4), [(x,) for x in flat]) * 1e6
    print(f"  pallas copy of 262144 x 8 (block 2048, 4 warps): {us:.2f} us", flush=True)
    probes = ((0, False), (2, False), (4, False), (6, False), (8, False), (6, True), (8, True)) if probe else ()
    for rows_bits, bucket_major in probes:
        table = jnp.arange(NUM_LOGICAL << rows_bits, dtype=jnp.int32)
        us = (
            timed(
                functools.partial(gather_probe, rows_bits=rows_bits, bucket_major=bucket_major),
                [(x, table) for x in flat],
            )
            * 1e6
        )
        print(
            f"  gather probe 262144 x 8, {NUM_LOGICAL} x 2**{rows_bits} words"
            f"{' bucket-major' if bucket_major else ''}: {us:.2f} us",
            flush=True,
        )
    del flat
    for mode, num_tokens, num_physical, options in SWEEP:
        options = dict(options)
        count = options.pop("count", True)
        time_variant(rng, mode, options, count=count, num_tokens=num_tokens, num_physical=num_physical)


def setup_sweep(rng, num_tokens=262144):
    """The whole public call (tables traced) with each way of building the thresholds' prefix sums."""
    public = sys.modules["moe_eplb_jax.pallas.map_and_count"]  # the module (the package re-exports the function)

    print("set-up sweep (262144 x 8; device time per call, every kernel):", flush=True)
    default = public._THRESHOLD_SUMS
    for mode in ("shares", "resolved"):
        for num_physical in (288, 512):
            log2phy, logcnt, kw, ids = make_case(rng, num_tokens, 8, num_physical, mode)
            for sums in ("matmul", "cumsum"):
                public._THRESHOLD_SUMS = sums
                fn = lambda x, log2phy, logcnt, kw: map_and_count(
                    x,
                    log2phy,
                    logcnt,
                    num_physical=num_physical,
                    num_valid_tokens=num_tokens - 3,
                    mode=mode,
                    implementation="pallas",
                    **kw,
                )
                seconds = timed(fn, [(x, log2phy, logcnt, kw) for x in ids])
                kernels = ", ".join(f"{name[:26]} {t * 1e6:.2f}" for name, t in LAST_KERNELS.items())
                print(f"  {mode:<9} P={num_physical} sums={sums:<7} {seconds * 1e6:7.2f} us  [{kernels}]", flush=True)
    public._THRESHOLD_SUMS = default


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="hash mode, largest size only")
    parser.add_argument("--sizes", default="4096,65536,262144", help="comma-separated token counts")
    parser.add_argument("--sweep", action="store_true", help="time many kernel options first (defaults unchanged)")
    parser.add_argument("--no-table", action="store_true", help="skip the side-by-side table")
    parser.add_argument("--setup", action="store_true", help="time the ways of building the thresholds first")
    parser.add_argument("--probe", action="store_true", help="with --sweep: the gather probe first")
    parser.add_argument("--modes", default="hash,round_robin,shares,resolved", help="comma-separated modes")
    args = parser.parse_args()
    out_dir = os.environ.get("OUT", ".")
    print(f"jax {jax.__version__}, devices {jax.devices()}", flush=True)
    bandwidth = copy_bandwidth(20 if jax.default_backend() == "cpu" else 28)
    print(f"copy bandwidth (read+write, 1 GiB int32 elementwise): {bandwidth / 1e12:.2f} TB/s", flush=True)
    rng = np.random.default_rng(2026_11_30)
    if args.setup:
        setup_sweep(rng)
    if args.sweep:
        sweep(rng, probe=args.probe)
    if args.no_table:
        return
    print(f"kernel options used below: {_triton.DEFAULTS}", flush=True)
    sizes = [262144] if args.quick else [int(t) for t in args.sizes.split(",")]
    modes = ["hash"] if args.quick else args.modes.split(",")
    rows = []
    with open(os.path.join(out_dir, "map_and_count.jsonl"), "w") as log:
        for num_physical in (288, 512):
            for num_tokens in sizes:
                for mode in modes:
                    row = run_case(rng, num_tokens, 8, num_physical, mode, bandwidth, log)
                    rows.append(row)
                    print(_format(row), flush=True)
    print(
        "\nmap_and_count, E=256, top-8, microseconds per call (median); ratios: xla_ref/pallas, pallas/hbm, "
        "prepared/hbm ('prepared': lookup table built once per placement and passed in; '+words': shares' alias "
        "words in it too)"
    )
    print(
        f"{'T':>7} {'P':>4} {'mode':<12}{'pallas':>9}{'prepared':>9}{'+words':>8}{'xla_best':>10}{'xla_ref':>10}"
        f"{'copy':>8}{'hbm':>7}{'ref/pal':>9}{'pal/hbm':>9}{'pre/hbm':>9}{'wds/hbm':>9}"
    )
    for row in rows:
        print(_format(row))


def _format(row):
    us = {k: row[k] * 1e6 for k in ("pallas", "prepared", "xla_best", "xla_ref", "copy", "hbm")}
    words = "--" if row.get("words") is None else f"{row['words'] * 1e6:.2f}"
    words_ratio = "--" if row.get("words") is None else f"{row['words'] * 1e6 / us['hbm']:.1f}"
    return (
        f"{row['T']:>7} {row['P']:>4} {row['mode']:<12}{us['pallas']:>9.2f}{us['prepared']:>9.2f}{words:>8}"
        f"{us['xla_best']:>10.2f}{us['xla_ref']:>10.2f}{us['copy']:>8.2f}{us['hbm']:>7.2f}"
        f"{us['xla_ref'] / us['pallas']:>9.1f}{us['pallas'] / us['hbm']:>9.1f}{us['prepared'] / us['hbm']:>9.1f}"
        f"{words_ratio:>9}"
    )


if __name__ == "__main__":
    sys.exit(main())

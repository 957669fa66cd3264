"""Benchmark: fused replica routing + load counting (``moe_eplb_jax.routing.map_and_count``).

For T in {4096, 65536, 262144} tokens x top-8, P in {288, 512} slots (E = 256)
and every mode, prints side by side (microseconds per call):

* ours: ``pallas`` -- the default kernels (``implementation="pallas"``,
  ``MapAndCountConfig.default`` by size), with the lookup table (and the mode's table)
  built from the traced tables on every call (the kernels of each call are
  printed under its row); ``prepared`` -- the lookup table built once per
  placement and passed in (``map_and_count(lookup=...)``, as ``MoELayer`` runs
  it); ``+words`` -- ``lp`` only: the alias words in it too
  (``lookup_table(..., replica_shares=..., num_physical=P)``);
* baselines: ``xla_best`` -- the reference mapping plus a factorized one-hot
  histogram (``onehot_hi^T @ onehot_lo`` on the tensor cores); ``xla_ref`` --
  the ``"xla"`` implementation: gather + ``jnp.bincount`` (+ a stable argsort
  for ``quota``);
* limits: ``copy`` -- one XLA elementwise pass over the ids (read ids, write
  ids), the practical floor; ``hbm`` -- bytes (ids read + ids written) /
  measured large-copy bandwidth.

Timing: each measurement is one jitted executable applying the op to ``REPS``
different input arrays (so they do not all sit in L2), run ``TRIALS`` times;
on GPU the time is the device time of its kernels from the profiler
(``_timing.device_seconds``, no host dispatch or sync), divided by ``REPS``;
elsewhere the host-timed median. Every column is checked equal to the
reference on fresh inputs first.

GPU: ``PYTHONPATH=. python3 benchmarks/map_and_count.py [--sizes 4096,262144] [--modes quota]``; CPU smoke
run (Pallas interpret mode): ``PYTHONPATH=. python3 benchmarks/map_and_count.py --sizes 64 --physical 288``.
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

from moe_eplb_jax.placement import Placement
from moe_eplb_jax.routing import ROUTING_MODES, MapAndCountConfig, lookup_table, map_and_count, routing_mode

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
    bits = max(8, int(num_physical - 1).bit_length())  # both factors >= 16: the tensor cores' minimum
    lo_bits = (bits + 1) // 2
    hi_bits = bits - lo_bits
    bins = jnp.where(counted, physical_ids, -1).reshape(-1)
    hi = jnp.where(bins >= 0, bins >> lo_bits, -1)
    lo = bins & ((1 << lo_bits) - 1)
    rows = (hi[:, None] == jnp.arange(1 << hi_bits, dtype=jnp.int32)[None, :]).astype(jnp.bfloat16)
    cols = (lo[:, None] == jnp.arange(1 << lo_bits, dtype=jnp.int32)[None, :]).astype(jnp.bfloat16)
    hist = jnp.einsum("nh,nl->hl", rows, cols, preferred_element_type=jnp.float32)
    return hist.reshape(-1)[:num_physical].astype(jnp.int32)


def make_case(rng, num_tokens, top_k, num_physical, mode):
    """A skewed placement (hot experts replicated), the mode's shares / quotas and ``REPS`` id arrays."""
    redundant = num_physical - NUM_LOGICAL
    popularity = rng.lognormal(0.0, 1.0, NUM_LOGICAL)
    extra = rng.choice(NUM_LOGICAL, size=redundant, p=popularity / popularity.sum())
    phy2log = np.concatenate([np.arange(NUM_LOGICAL), extra])
    rng.shuffle(phy2log)
    placement = Placement.from_phy2log(phy2log, NUM_LOGICAL)
    log2phy, logcnt = placement.log2phy[0], placement.logcnt[0]
    width = log2phy.shape[1]
    kw = {}
    if mode == "lp":
        kw["replica_shares"] = rng.random((NUM_LOGICAL, width)).astype(np.float32) + 0.1
    if mode == "quota":
        demand = num_tokens * top_k * popularity / popularity.sum()
        split = rng.random((NUM_LOGICAL, width)) * (np.arange(width)[None, :] < logcnt[:, None])
        kw["quotas"] = np.floor(demand[:, None] * split / split.sum(1, keepdims=True)).astype(np.int32)
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
    # tables; shares and quotas change per batch): what the wrapper builds from them runs on the device and is timed.
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

    lookup = jax.jit(lookup_table)(log2phy, logcnt)
    words = None
    if mode == "lp":
        build = functools.partial(lookup_table, replica_shares=kw["replica_shares"], num_physical=num_physical)
        words = jax.jit(build)(log2phy, logcnt)
    ref_phys, ref_load = jax.jit(ours("xla"))(ids[0], log2phy, logcnt, kw)
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
    if LAST_KERNELS:  # where a call's device time goes: the kernels and XLA's set-up of their inputs
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="4096,65536,262144", help="comma-separated token counts (x top-8)")
    parser.add_argument("--physical", default="288,512", help="comma-separated slot counts P (E = 256)")
    parser.add_argument("--modes", default=",".join(ROUTING_MODES), help="comma-separated modes")
    args = parser.parse_args()
    out_dir = os.environ.get("OUT", ".")
    print(f"jax {jax.__version__}, devices {jax.devices()}", flush=True)
    bandwidth = copy_bandwidth(20 if jax.default_backend() == "cpu" else 28)
    print(f"copy bandwidth (read+write, int32 elementwise): {bandwidth / 1e12:.2f} TB/s", flush=True)
    rng = np.random.default_rng(2026_11_30)
    sizes = [int(t) for t in args.sizes.split(",")]
    modes = args.modes.split(",")
    rows = []
    with open(os.path.join(out_dir, "map_and_count.jsonl"), "w") as log:
        for num_physical in (int(p) for p in args.physical.split(",")):
            for num_tokens in sizes:
                for mode in modes:
                    print(
                        f"  {mode} T={num_tokens} P={num_physical}: {MapAndCountConfig.default(routing_mode(mode).kernel, num_tokens * 8)}"
                    )
                    row = run_case(rng, num_tokens, 8, num_physical, mode, bandwidth, log)
                    rows.append(row)
                    print(_format(row), flush=True)
    print(
        "\nmap_and_count, E=256, top-8, microseconds per call; ours: pallas (tables built per call), prepared "
        "(lookup table kept per placement), +words (lp: alias words kept too); baselines: xla_best, xla_ref; "
        "limits: copy, hbm. Ratios: xla_ref/pallas, pallas/hbm, prepared/hbm, +words/hbm"
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

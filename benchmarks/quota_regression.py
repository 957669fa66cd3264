"""Benchmark: ``map_and_count(mode="quota")`` over boundary positions, before and after the kernel clean-up.

Times, on one GPU and in one run, the same draws through several versions of the package, each checked
byte-for-byte against its own jnp reference first (the versions hash the quota fallback differently):

* ``9d81a6f``: the package before the clean-up (``eaa73e9``); ``merged``: the package right after it was merged
  (``6166fd6``) -- read-only snapshots (``git archive``) in the ignored folder ``.snapshots/``, made on first
  use where git is available (``--snapshots`` makes them only); on a machine without the repository, carry
  ``.snapshots`` with the checkout;
* ``current``: this checkout's package (its run comes first: the others run only where it succeeded);
* ``eager_hash``: this checkout's package with the hash fallback computed before the boundary search (so it
  is live across the search's loops), built in a temporary folder by one textual replacement -- a variant
  that exists only here.

Each version runs in its own subprocess (``PYTHONPATH`` its package root). Cases: 65536 and 262144 tokens x
top-8, E = 256, P = 288 / 512 (a skewed placement, quotas splitting each expert's demand), the last 3 tokens
padding, the lookup table prepared once per placement (``map_and_count(lookup=...)``). Each measurement is
one jitted executable mapping ``REPS`` id arrays, run ``CALLS`` times; on GPU the time is the device time of
its kernels (:func:`_timing.device_seconds`) per call, split into the map kernel, the boundary kernel and the
tile counts. The table comes last.

GPU: ``python3 benchmarks/quota_regression.py`` (about 3 minutes on an H200); CPU smoke run (Pallas interpret
mode, a tiny size, the positions path forced): ``python3 benchmarks/quota_regression.py --small``.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SNAPSHOTS = os.path.join(ROOT, ".snapshots")
# name -> the commit its snapshot comes from: before the clean-up, and the merge that brought it into main.
SNAPSHOT_COMMITS = {"9d81a6f": "9d81a6f", "merged": "6166fd6"}
VERSIONS = ("current", "9d81a6f", "merged", "eager_hash")  # "current" first: the others run where it succeeded
# eager_hash: the line of _triton.py it replaces, and with what.
LAZY_HASH = "            by_hash = lambda: hash_replica(hashed, count)\n"
EAGER_HASH = "            by_hash_value = hash_replica(hashed, count)\n            by_hash = lambda: by_hash_value\n"
TOP_K = 8
PADDING = 3  # trailing tokens past num_valid_tokens
LARGE = {"experts": 256, "tokens": (65536, 262144), "physical": (288, 512), "reps": 8, "calls": 10}
SMALL = {"experts": 16, "tokens": (40,), "physical": (20, 33), "reps": 2, "calls": 2}
KERNELS = ("map_and_count", "boundary_positions", "tile_counts")


def make_snapshots():
    """``.snapshots/<name>/moe_eplb_jax`` for each of :data:`SNAPSHOT_COMMITS` not there yet (needs git)."""
    os.makedirs(SNAPSHOTS, exist_ok=True)
    with open(os.path.join(SNAPSHOTS, ".gitignore"), "w") as f:
        f.write("*\n")  # the folder ignores itself: nothing in it is ever committed
    for name, commit in SNAPSHOT_COMMITS.items():
        target = os.path.join(SNAPSHOTS, name)
        if os.path.isdir(os.path.join(target, "moe_eplb_jax")):
            continue
        try:
            archive = subprocess.run(
                ["git", "-C", ROOT, "archive", "--format=tar", commit, "moe_eplb_jax"],
                check=True,
                capture_output=True,
            ).stdout
        except (OSError, subprocess.CalledProcessError) as error:
            print(f"snapshot {name} ({commit}) not made: {error}", flush=True)
            continue
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(target, filter="data")
        print(f"snapshot {name}: {commit} -> {target}", flush=True)


def version_root(name, scratch):
    """The folder to put on ``PYTHONPATH`` for ``name``, or ``(None, why)``."""
    if name == "current":
        return ROOT, None
    if name == "eager_hash":
        target = os.path.join(scratch, name)
        shutil.copytree(os.path.join(ROOT, "moe_eplb_jax"), os.path.join(target, "moe_eplb_jax"))
        path = os.path.join(target, "moe_eplb_jax", "routing", "_map_and_count", "_triton.py")
        with open(path) as f:
            text = f.read()
        if text.count(LAZY_HASH) != 1:
            return None, "the lazy hash line of _triton.py is not there"
        with open(path, "w") as f:
            f.write(text.replace(LAZY_HASH, EAGER_HASH))
        return target, None
    root = os.path.join(SNAPSHOTS, name)
    if not os.path.isdir(os.path.join(root, "moe_eplb_jax")):
        return None, f"no snapshot in {root} (run --snapshots where git is, or carry .snapshots)"
    return root, None


def make_case(num_tokens, num_physical, *, experts, reps):
    """A skewed placement (hot experts replicated), quotas splitting each expert's demand, ``reps`` id arrays:
    numpy only, seeded by the case, so every version draws the same."""
    rng = np.random.default_rng([2026, 12, num_tokens, num_physical])
    popularity = rng.lognormal(0.0, 1.0, experts)
    chance = popularity / popularity.sum()
    phy2log = np.concatenate([np.arange(experts), rng.choice(experts, size=num_physical - experts, p=chance)])
    rng.shuffle(phy2log)
    width = num_physical - experts + 1
    logcnt = np.bincount(phy2log, minlength=experts).astype(np.int32)
    log2phy = np.full((experts, width), -1, np.int32)
    for expert in range(experts):
        slots = np.flatnonzero(phy2log == expert)
        log2phy[expert, : slots.size] = slots
    demand = num_tokens * TOP_K * chance
    split = rng.random((experts, width)) * (np.arange(width)[None, :] < logcnt[:, None])
    quotas = np.floor(demand[:, None] * split / split.sum(1, keepdims=True)).astype(np.int32)
    ids = [rng.choice(experts, size=(num_tokens, TOP_K), p=chance).astype(np.int32) for _ in range(reps)]
    return log2phy, logcnt, quotas, ids


def digest(phys, load):
    return hashlib.sha256(np.asarray(phys).tobytes() + np.asarray(load).tobytes()).hexdigest()


def worker(name, root, sizes, results, reference):
    """One version: check each case against its own reference digests, then time it."""
    import jax

    import moe_eplb_jax
    from moe_eplb_jax.routing import lookup_table, map_and_count

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from _timing import device_seconds

    where = os.path.dirname(os.path.abspath(moe_eplb_jax.__file__))
    if where != os.path.join(root, "moe_eplb_jax"):
        raise SystemExit(f"{name}: imported moe_eplb_jax from {where}, not from {root}")
    options = {}
    if sizes is SMALL:  # the positions path at a tiny size (the default above 65536 entries)
        try:  # a version with a public tiling
            from moe_eplb_jax.routing import MapAndCountConfig

            options["config"] = MapAndCountConfig(quota_path="positions")
        except ImportError:  # earlier versions: their kernel module's own switch
            from moe_eplb_jax.routing._map_and_count import _triton

            if hasattr(_triton, "default_config"):
                import dataclasses

                sized = _triton.default_config
                _triton.default_config = lambda mode, n: dataclasses.replace(sized(mode, n), quota_path="positions")
            else:
                _triton._POSITIONS_FROM = 0
    print(f"{name}: jax {jax.__version__}, {jax.devices()[0].device_kind}, package {where}", flush=True)
    known = {}
    for num_tokens in sizes["tokens"]:
        for num_physical in sizes["physical"]:
            log2phy, logcnt, quotas, ids = make_case(
                num_tokens, num_physical, experts=sizes["experts"], reps=sizes["reps"]
            )
            key = f"{num_tokens}x{num_physical}"

            def route(x, log2phy, logcnt, quotas, lookup, implementation="pallas", shape=(num_tokens, num_physical)):
                return map_and_count(
                    x,
                    log2phy,
                    logcnt,
                    num_physical=shape[1],
                    num_valid_tokens=shape[0] - PADDING,
                    mode="quota",
                    quotas=quotas,
                    implementation=implementation,
                    lookup=lookup,
                    **(options if implementation == "pallas" else {}),
                )

            lookup = jax.jit(lookup_table)(log2phy, logcnt)
            args = jax.device_put([(x, log2phy, logcnt, quotas, lookup) for x in ids])  # no copy in the timing
            many = jax.jit(lambda all_args: [route(*a) for a in all_args])
            if "boundary_positions" not in str(jax.make_jaxpr(many)(args)):
                raise SystemExit(f"{name} {key}: mode 'quota' did not take the boundary-positions path")
            got = [digest(*out) for out in many(args)]
            check = jax.jit(lambda *a: route(*a, implementation="xla"))
            known[key] = [digest(*check(*a)) for a in args]  # this version's own reference
            status = "ok" if got == known[key] else "MISMATCH"
            seconds, per_kernel = device_seconds(many, args, calls=sizes["calls"], warmup=1)
            if seconds is None:  # no GPU: host time of the whole call
                start = time.perf_counter()
                for _ in range(sizes["calls"]):
                    jax.block_until_ready(many(args))
                seconds = (time.perf_counter() - start) / sizes["calls"]
            row = {"version": name, "T": num_tokens, "P": num_physical, "check": status}
            row["total"] = seconds / len(args)
            for kernel in KERNELS:
                row[kernel] = per_kernel.get(kernel, 0.0) / len(args) if per_kernel else None
            kernels = ", ".join(f"{kernel} {t / len(args) * 1e6:.2f}" for kernel, t in per_kernel.items())
            print(
                f"  {name} {key}: {status}, {row['total'] * 1e6:.2f} us per call ({kernels or 'host time'})", flush=True
            )
            with open(results, "a") as f:
                f.write(json.dumps(row) + "\n")
    if name == "current":
        with open(reference, "w") as f:
            json.dump(known, f)


def print_table(rows, skipped, small):
    unit = "us (device time)" if not small else "us (host time, interpret mode: no meaning)"
    print(f"\nmap_and_count mode='quota', lookup prepared, top-{TOP_K}, per call, {unit}")
    print(
        f"{'T':>7} {'P':>4} {'version':<11} {'check':<8} {'total':>7} {'map':>7} {'bounds':>7} {'counts':>7} {'vs old':>7}"
    )
    old = {(r["T"], r["P"]): r["total"] for r in rows if r["version"] == "9d81a6f"}
    for row in sorted(rows, key=lambda r: (r["T"], r["P"], VERSIONS.index(r["version"]))):
        cells = [row["total"]] + [row[kernel] for kernel in KERNELS]
        text = " ".join("     --" if c is None else f"{c * 1e6:7.2f}" for c in cells)
        base = old.get((row["T"], row["P"]))
        versus = f"{(row['total'] - base) * 1e6:+7.2f}" if base is not None else "     --"
        print(f"{row['T']:>7} {row['P']:>4} {row['version']:<11} {row['check']:<8} {text} {versus}")
    for name, why in skipped:
        print(f"  {name}: not run: {why}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny sizes, CPU interpret mode (a smoke run)")
    parser.add_argument("--snapshots", action="store_true", help="only make the .snapshots/ folders (needs git)")
    parser.add_argument("--versions", default=",".join(VERSIONS), help="comma-separated, from " + ",".join(VERSIONS))
    parser.add_argument("--timeout", type=float, default=130.0, help="seconds per version's subprocess")
    parser.add_argument("--worker", nargs=4, metavar=("NAME", "ROOT", "RESULTS", "REFERENCE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = SMALL if args.small else LARGE
    if args.worker:
        worker(args.worker[0], args.worker[1], sizes, args.worker[2], args.worker[3])
        return
    make_snapshots()
    if args.snapshots:
        return
    versions = [v for v in VERSIONS if v in args.versions.split(",")]
    if "current" not in versions:
        versions.insert(0, "current")  # the others run only where it succeeded
    scratch = tempfile.mkdtemp(prefix="quota_regression_")
    results, reference = os.path.join(scratch, "rows.jsonl"), os.path.join(scratch, "reference.json")
    skipped = []
    for name in versions:
        root, why = version_root(name, scratch)
        if root is None:
            skipped.append((name, why))
            continue
        env = {**os.environ, "PYTHONPATH": root}
        command = [sys.executable, os.path.abspath(__file__), "--worker", name, root, results, reference]
        command += ["--small"] if args.small else []
        try:
            done = subprocess.run(command, env=env, timeout=args.timeout)
            if done.returncode:
                skipped.append((name, f"exit status {done.returncode}"))
        except subprocess.TimeoutExpired:
            skipped.append((name, f"over {args.timeout:.0f} s"))
        if name == "current" and not os.path.exists(reference):
            skipped += [(other, "no reference (current failed)") for other in versions[1:]]
            break
    rows = []
    if os.path.exists(results):
        with open(results) as f:
            rows = [json.loads(line) for line in f]
    shutil.rmtree(scratch, ignore_errors=True)
    print_table(rows, skipped, args.small)
    if any(row["check"] != "ok" for row in rows):
        raise SystemExit("some version's outputs differ from the reference")


if __name__ == "__main__":
    main()

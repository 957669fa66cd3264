"""Does a row copy slow a concurrent ppermute down, and does a copy kernel with a bounded grid avoid it?

The transport executor's pack (gather of moving rows) and scatter (of received
rows) can run while a transfer is in flight, but on 2xH200 the NCCL kernels
slowed down by about as much as they overlapped (benchmarks/RESULTS.md,
"Overlapped schedule"). This script measures that interference directly, per
copy implementation, in one run: on a 2-GPU mesh, inside one jitted
``shard_map`` per variant,

* ``transfer``: one ``ppermute`` of ``--transfer-mib`` per rank, alone;
* ``<copy>``: a gather of ``--copy-mib`` of rows (532,480-byte expert rows as
  uint32 words) into a packed buffer, alone, by XLA (``xla``) or by the Pallas
  kernel ``sharding._row_copy.gather_rows`` with N programs (``pallasN``);
* ``transfer + <copy>``: both, independent (XLA may run the copy during the
  transfer).

``scatter...`` rows write the gathered rows back in place; the leaf is not
donated here, so they include XLA's copy of the whole leaf (span >> kernels):
a check that the kernel runs, not a figure (the executor donates; see
``benchmarks/transport.py``).

For each: the device span per call (profiler timeline of GPU 0), the transfer
kernels' busy time, and the overlap. "Interference" = span(both) -
max(span(transfer), span(copy)); 0 would be perfect overlap, span(copy) is no
overlap at all.

Run: ``PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/copy_overlap.py`` on ``nvidia-h200-x2``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

sys.path.insert(0, os.path.dirname(__file__))
from _overlap import timeline

ROW_WORDS = 532480 // 4  # one DeepSeek-like expert slot of benchmarks/transport.py, as uint32 words


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--transfer-mib", type=int, default=512)
    parser.add_argument("--copy-mib", type=int, default=256)
    parser.add_argument("--programs", default="8,16,32,66,132")
    parser.add_argument("--blocks", default="4096", help="words per work item (comma-separated)")
    parser.add_argument("--warps", default="4", help="warps per program (comma-separated)")
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from moe_eplb_jax.sharding._row_copy import gather_rows, scatter_rows

    devices = jax.devices()[:2]
    mesh = jax.make_mesh((len(devices),), ("ep",), devices=devices)
    spec = PartitionSpec("ep")
    shard = NamedSharding(mesh, spec)
    g = len(devices)
    copy_rows = max(1, args.copy_mib * 2**20 // (ROW_WORDS * 4))
    leaf_rows = 3 * copy_rows
    transfer_words = args.transfer_mib * 2**20 // 4
    make = jax.jit(
        lambda k: jax.random.bits(jax.random.key(k), (g * transfer_words,), jnp.uint32),
        static_argnums=0,
        out_shardings=shard,
    )
    send = make(1)
    leaf = jax.jit(
        lambda: jax.random.bits(jax.random.key(2), (g * leaf_rows, ROW_WORDS), jnp.uint32), out_shardings=shard
    )()
    rng = np.random.default_rng(0)
    rows = jax.device_put(
        np.concatenate([rng.permutation(leaf_rows)[:copy_rows] for _ in range(g)]).astype(np.int32), shard
    )
    perm = [(r, (r + 1) % g) for r in range(g)]
    print(
        f"jax {jax.__version__}, {g} x {devices[0].device_kind}; transfer {args.transfer_mib} MiB/rank, "
        f"copy {copy_rows} rows = {copy_rows * ROW_WORDS * 4 / 2**20:.0f} MiB/rank",
        flush=True,
    )

    def copy_fn(kind):  # xla | pallas<programs>b<block>w<warps> | scatter<programs>b<block>w<warps>
        if kind == "xla":
            return lambda v, r: v[r]
        name, n, block, warps = re.fullmatch(r"([a-z]+)(\d+)b(\d+)w(\d+)", kind).groups()
        options = dict(num_programs=int(n), block=int(block), num_warps=int(warps))
        if name == "scatter":
            return lambda v, r: scatter_rows([v], v[: r.shape[0]], r, **options)[0]
        return lambda v, r: gather_rows([v], r, **options)

    def variant(transfer, kind):
        def local(x, v, r):
            out = []
            if transfer:
                out.append(jax.lax.ppermute(x, "ep", perm))
            if kind:
                out.append(copy_fn(kind)(v, r))
            return out

        n_out = int(transfer) + int(bool(kind))
        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=[spec] * n_out))

    kinds = (
        ["xla"]
        + [
            f"pallas{n}b{b}w{w}"
            for n in args.programs.split(",")
            for b in args.blocks.split(",")
            for w in args.warps.split(",")
        ]
        + [f"scatter{args.programs.split(',')[-1]}b4096w4"]
    )
    results = {}
    for transfer in (True, False):
        for kind in [None] + kinds:
            if not transfer and kind is None:
                continue
            name = " + ".join(([f"transfer {args.transfer_mib} MiB"] if transfer else []) + ([kind] if kind else []))
            try:
                fn = variant(transfer, kind)
                if kind and not kind.startswith("scatter"):  # check the copy once
                    got = fn(send, leaf, rows)[-1]
                    want = jax.jit(jax.shard_map(lambda v, r: v[r], mesh=mesh, in_specs=(spec, spec), out_specs=spec))(
                        leaf, rows
                    )
                    if not bool(jnp.array_equal(got, want)):
                        print(f"{name}: WRONG COPY", flush=True)
                        continue
                jax.block_until_ready(fn(send, leaf, rows))
                summary = timeline(lambda i: fn(send, leaf, rows), args.calls, gap_ms=2.0)
                if summary is None:  # no GPU timeline (CPU): the code ran, nothing to time
                    print(f"{name}: ran (no device timeline)", flush=True)
                    continue
            except Exception as e:  # report and go on
                print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            results[name] = summary
            print(
                f"{name:<46} span {summary['span_ms']:7.3f} ms  transfer busy {summary['transfer_ms']:7.3f}  "
                f"kernels {summary['kernel_ms']:7.3f}  overlap {summary['overlap_ms']:7.3f}",
                flush=True,
            )
    base = results.get(f"transfer {args.transfer_mib} MiB")
    if base:
        print("\ninterference = span(both) - max(span(transfer), span(copy)); copy alone for scale")
        for kind in kinds:
            both = results.get(f"transfer {args.transfer_mib} MiB + {kind}")
            alone = results.get(kind)
            if both and alone:
                extra = both["span_ms"] - max(base["span_ms"], alone["span_ms"])
                print(
                    f"  {kind:<22} copy alone {alone['span_ms']:6.3f} ms  interference {extra:6.3f} ms "
                    f"({extra / alone['span_ms']:.2f} of the copy)",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()

"""MoE layer step time per replica-routing mode under Zipf-skewed routing, against the uniform-routing ideal.

    PYTHONPATH=. python3 benchmarks/moe_step.py --ranks 2                       # 2 GPUs (4 when lent)
    PYTHONPATH=. python3 benchmarks/moe_step.py --ranks 8 --matmul pallas,dense --capacity-factor 1.25  # EP8
                                                                  # (issue 8; benchmarks/multi_gpu.py runs it)
    PYTHONPATH=. python3 benchmarks/moe_step.py --cpu-devices 8 --small --matmul dense --capacity-factor none

For each grouped-matmul implementation / exchange and each Zipf skew ``s`` (``--skews``, default 1.5, 2, 3:
token ``t``'s top-k experts drawn by Gumbel top-k from popularity ``∝ rank**-s`` over a fixed random expert
order, imposed exactly by a one-hot router), the forward step time of one expert-parallel MoE layer through
``moe_eplb_jax.moe.moe_apply`` (route + replica routing + dispatch all_to_all + grouped expert MLP +
combine), one row per routing case, side by side in one run:

* ``initial / hash``: experts in id order, redundant slots on the coldest experts (no EPLB: the hot experts share
  the first rank);
* ``EPLB / hash``, ``EPLB / round_robin``, ``EPLB / lp``, ``EPLB / quota``: the ``balanced`` policy's placement
  for the batch's load; ``lp`` with the LP replica shares of that load (``routing.routing_tables``), ``quota``
  planning its quotas per batch inside the step (all_gather of the per-rank counts + ``plan_fixed_quotas`` +
  ``map_and_count(mode="quota")``);
* ``online / quota``: home experts plus spare slots filled by the ``online`` policy (UltraEP's layout), quotas per
  batch;
* ``uniform (ideal)``: every expert gets ``T*k/E`` tokens (a one-hot router) on a placement where every rank
  holds as many single-replica slots and as many halves of two-replica experts (hash routing).

Printed: ms, ratio to the ideal, the balancedness of the load each case recorded, and whether every case's
outputs are bit-identical (they compute the same tokens) and its load sums exact; per matmul / exchange, the
compiled step's temporary buffers on one device (XLA's ``memory_analysis``): the worst case holds ``[G, A, D]``
exchange buffers and ``G * A`` MLP rows, a capacity factor ``[A, D]`` and ``G * C`` rows.

Then the EPLB bookkeeping of one step per mode in ``--book-modes`` (first matmul / exchange listed, middle
skew; ``hash`` on the EPLB placement, ``quota`` on the online one): (a) the EPLB step -- ``moe_apply`` mapping
and counting per rank (each rank keeps its own ``[G, P]`` row, summed only at rearrangement; for ``quota`` also
the all_gather of counts and the per-batch plan) plus ``EplbState.record`` / ``end_step`` with the state
donated, as ``EplbController.step`` does -- against (b) the same step with the placement fixed and no EPLB work:
the slots come from one gather ``log2phy[ids, replica]`` (``replica`` precomputed from (a)'s routing, so both
steps exchange and multiply the same rows; checked: bit-identical outputs), no counting, no state, no plan.
(a) - (b) is the bookkeeping (for ``quota``: all_gather + plan + reroute + counting), printed as ms and % of (a)
in device time (kernel time from the profiler's CUPTI records, ``_timing.device_seconds``; all kernels of GPU 0,
and without the NCCL kernels, whose time includes waiting for the peer) beside host wall-clock time, the device
time of (a) by kernel name, and (a'): (a) with the load psum'd over EP every step (``load_reduce="psum"``)
into a replicated window. Device columns read "n/a" on CPU.

``dense`` costs the worst case whatever the routing, so only an implementation whose cost follows the rows a
rank received (``pallas``) can show the balance in step time.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
import traceback
from typing import Any

import numpy as np


def _args():
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=None, help="EP ranks (default: every device)")
    p.add_argument("--cpu-devices", type=int, default=0, help="simulate this many CPU devices")
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--redundant", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--skews", default="1.5,2,3", help="comma-separated Zipf exponents of the expert popularity")
    p.add_argument(
        "--cases",
        default=",".join(CASES),
        help=f"comma-separated routing cases (placement/mode) out of {','.join(CASES)}; the ideal always runs",
    )
    p.add_argument("--matmul", default="dense,pallas", help="comma-separated grouped matmul implementations")
    p.add_argument("--map-impl", default=None, help="map_and_count implementation (None: its default)")
    p.add_argument(
        "--capacity-factor",
        default="none,1.25",
        help="comma-separated exchange capacity factors ('none': one worst-case all_to_all)",
    )
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--window", type=int, default=1000, help="EplbState window (steps) in the bookkeeping step")
    p.add_argument("--book-modes", default="hash,quota", help="bookkeeping rows: comma-separated routing modes")
    p.add_argument(
        "--book-reps",
        type=int,
        default=3,
        help="bookkeeping: interleaved (a)/(b) profiler runs of --iters calls each; medians reported",
    )
    p.add_argument("--json", default=None, help="write the table rows here")
    return p.parse_args()


# (placement, routing mode) of each row; the ideal runs on its own.
CASES = ("initial/hash", "EPLB/hash", "EPLB/round_robin", "EPLB/lp", "EPLB/quota", "online/quota")


def zipf_ids(num_tokens: int, num_experts: int, top_k: int, skew: float, seed: int):
    """``[T, k]`` distinct expert ids per token: Gumbel top-k of popularity ``∝ rank**-skew`` (random order)."""
    rng = np.random.default_rng(seed)
    rank = np.empty(num_experts)
    rank[rng.permutation(num_experts)] = np.arange(1, num_experts + 1)
    keys = -skew * np.log(rank)[None, :] + rng.gumbel(size=(num_tokens, num_experts))
    return np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k]


def even_placement(num_experts: int, num_physical: int, num_ranks: int):
    """A placement under which equal expert loads give equal rank loads (hash routing, in expectation).

    Experts ``0 .. R-1`` get two replicas, the rest one; each rank takes an equal share of the two-replica slots
    (never both replicas of one expert) and of the one-replica slots. ``Placement.linear`` where ``R`` or the
    share does not divide (then the ideal's balancedness, printed, is below 1).
    """
    from moe_eplb_jax.placement import Placement

    redundant = num_physical - num_experts
    doubles = np.concatenate([np.arange(redundant), np.arange(redundant)])
    singles = np.arange(redundant, num_experts)
    if redundant > num_experts or doubles.size % num_ranks or singles.size % num_ranks:
        return Placement.linear(1, num_experts, num_physical, num_ranks=num_ranks)
    rows = zip(np.split(doubles, num_ranks), np.split(singles, num_ranks))
    phy2log = np.concatenate([np.concatenate(pair) for pair in rows])
    return Placement.from_phy2log(phy2log[None], num_experts, num_ranks=num_ranks)


@dataclasses.dataclass
class Bench:
    """What every case shares, built once the device count is set: the mesh, the shapes, the expert weights."""

    args: argparse.Namespace
    mesh: Any
    ranks: int
    E: int
    P: int
    D: int
    H: int
    K: int
    T: int
    dtype: Any
    rng: np.random.Generator
    w_in: np.ndarray
    w_out: np.ndarray
    router: Any
    bias: Any
    top_k: Any

    def one_hot_tokens(self, picks):
        """Tokens whose top-k under the identity router are exactly ``picks``."""
        from jax.sharding import PartitionSpec as PS

        from moe_eplb_jax.transport import put_host

        host = 0.01 * self.rng.standard_normal((self.T, self.D)).astype(np.float32)
        np.put_along_axis(host, picks, 8.0, axis=1)
        return put_host(host.astype(self.dtype), self.mesh, PS("ep"))

    def operands(self, placement, routing, tokens, load=None):
        """(positional moe_apply operands, lookup, replica_shares) of one case."""
        from jax.sharding import PartitionSpec as PS

        from moe_eplb_jax.routing import mode_lookup, routing_mode, routing_tables
        from moe_eplb_jax.transport import put_host

        mesh, phy = self.mesh, placement.phy2log[0]
        experts = {
            "w_in": put_host(self.w_in[phy].astype(self.dtype), mesh, PS("ep")),
            "w_out": put_host(self.w_out[phy].astype(self.dtype), mesh, PS("ep")),
        }
        log2phy, logcnt = placement.log2phy[0], placement.logcnt[0]
        shares = None
        if routing_mode(routing).shares:  # the shares a controller installs with the placement
            if load is None:
                raise ValueError(f"routing {routing!r} needs the load its shares are solved from")
            shares = routing_tables(routing, load[None], placement, num_ranks=self.ranks)[0]["replica_shares"]
        # The lookup carries the shares.
        lookup = mode_lookup(routing, log2phy, logcnt, replica_shares=shares, num_physical=self.P)
        shares = None if shares is None else put_host(shares, mesh, PS())
        put = functools.partial(put_host, mesh=mesh)
        return (tokens, self.router, self.bias, experts, put(log2phy), put(logcnt), put(lookup), shares)

    def dispatch_config(self, matmul, factor, load_reduce="none"):
        from moe_eplb_jax import moe

        # one_round_rows=0: a factor's rounds at every size, the mechanism this script measures.
        return moe.DispatchConfig(
            matmul=matmul,
            map_implementation=self.args.map_impl,
            capacity_factor=factor,
            one_round_rows=0,
            load_reduce=load_reduce,
        )

    def stepper(self, routing, matmul, factor, load_reduce="none"):
        from moe_eplb_jax import moe

        def step(x, router, bias, experts, log2phy, logcnt, lookup, shares):
            return moe.moe_apply(
                x,
                router,
                bias,
                experts,
                log2phy,
                logcnt,
                router=self.top_k,
                mesh=self.mesh,
                routing=routing,
                dispatch=self.dispatch_config(matmul, factor, load_reduce),
                lookup=lookup,
                replica_shares=shares,
            )

        return step

    def bench(self, fn, ops):
        import jax

        out = jax.block_until_ready(fn(*ops))
        times = []
        for _ in range(self.args.iters):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*ops))
            times.append(time.perf_counter() - t0)
        return float(np.median(times)), out

    def balancedness(self, load):
        from moe_eplb_jax import metrics

        return float(metrics.balancedness(metrics.rank_load(_total(load)[None], self.ranks)))


def _total(load):
    """moe_apply returns per-rank rows [G, P] (no psum in the step), or [P] with "psum"."""
    load = np.asarray(load)
    return load.sum(0) if load.ndim == 2 else load


def _setup(args) -> Bench:
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as PS

    from moe_eplb_jax import moe
    from moe_eplb_jax.transport import put_host

    ranks = args.ranks or jax.device_count()
    mesh = jax.make_mesh((ranks,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:ranks])
    E, P, D, H, K = args.experts, args.experts + args.redundant, args.dim, args.hidden, args.top_k
    if D < E:
        raise ValueError(f"--dim ({D}) must be at least --experts ({E}): a one-hot router imposes the routing")
    rng = np.random.default_rng(0)
    w_in = rng.standard_normal((E, D, 2 * H)).astype(np.float32) * D**-0.5
    w_out = rng.standard_normal((E, H, D)).astype(np.float32) * H**-0.5
    return Bench(
        args=args,
        mesh=mesh,
        ranks=ranks,
        E=E,
        P=P,
        D=D,
        H=H,
        K=K,
        T=args.tokens * ranks,
        dtype=jnp.bfloat16,
        rng=rng,
        w_in=w_in,
        w_out=w_out,
        router=put_host(np.eye(D, E, dtype=np.float32), mesh, PS()),
        bias=put_host(np.zeros(E, np.float32), mesh, PS()),
        top_k=moe.RouterConfig(top_k=K),
    )


def _batches(b: Bench, skews, online_ok: bool):
    """Per skew: the batch, its load and the placements fitted to it (the same for every matmul / exchange)."""
    from moe_eplb_jax.config import EplbConfig
    from moe_eplb_jax.placement import Placement
    from moe_eplb_jax.policy import compute_placement

    E, P = b.E, b.P
    initial = Placement.from_phy2log(
        np.concatenate([np.arange(E), np.arange(E - 1, E - 1 - (P - E), -1)])[None], E, num_ranks=b.ranks
    )
    batches = {}
    for skew in skews:
        ids = zipf_ids(b.T, E, b.K, skew, seed=int(skew * 1000))
        load = np.bincount(ids.ravel(), minlength=E).astype(np.float64)
        placements = {"initial": initial}
        for name, policy in (("EPLB", "balanced"), ("online", "online")):
            if name == "online" and not online_ok:
                continue
            config = EplbConfig(num_redundant_experts=P - E, num_gpus=b.ranks, policy=policy)
            placements[name] = compute_placement(load[None], config)
        batches[skew] = (b.one_hot_tokens(ids), load, placements)
    return batches


def _exchange_label(matmul, factor) -> str:
    return f"{matmul}/{'worst' if factor is None else f'cf{factor:g}'}"


def _step_row(b: Bench, matmul, factor, cases, batches, uniform_ops) -> dict[str, Any] | None:
    """One matmul / exchange: the ideal's step, then every case at every skew (``None`` where the ideal failed)."""
    import jax

    jitted = {mode: jax.jit(b.stepper(mode, matmul, factor)) for mode in {c.split("/")[1] for c in cases} | {"hash"}}
    try:
        t_uni, (_, load_uni) = b.bench(jitted["hash"], uniform_ops)
    except Exception:  # one implementation failing must not hide the others' figures
        traceback.print_exc()
        return None
    temp = _temp_bytes(jitted["hash"], uniform_ops)
    print(f"{_exchange_label(matmul, factor)}: per-rank temporary buffers {_mib(temp)}", flush=True)
    per_skew = {}
    for skew, (tokens, load, placements) in batches.items():
        found, reference, same, loads_ok = {}, None, True, True
        for case in cases:
            where, mode = case.split("/")
            try:
                t, (out, case_load) = b.bench(jitted[mode], b.operands(placements[where], mode, tokens, load))
            except Exception:  # one case failing must not hide the others
                traceback.print_exc()
                found[case] = None
                continue
            out = np.asarray(out).view(np.uint16)
            reference = out if reference is None else reference
            same = same and bool(np.array_equal(out, reference))
            loads_ok = loads_ok and int(_total(case_load).sum()) == b.T * b.K
            found[case] = (t, b.balancedness(case_load))
        per_skew[skew] = dict(cases=found, same=same, loads_ok=loads_ok)
        print(f"{_exchange_label(matmul, factor)} skew {skew:g}: {per_skew[skew]}", flush=True)  # a cut run shows it
    return dict(t_uni=t_uni, b_uni=b.balancedness(load_uni), temp_bytes=temp, skews=per_skew)


def _temp_bytes(jitted, ops) -> int | None:
    """The compiled step's temporary buffers on one device (XLA's ``memory_analysis``; ``None`` if unreported):
    the exchange buffers and the expert MLP's rows, which a capacity factor sizes by the capacity."""
    try:
        return int(jitted.lower(*ops).compile().memory_analysis().temp_size_in_bytes)
    except Exception:  # a backend without the analysis must not hide the step times
        return None


def _mib(nbytes) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**20:.2f} MiB"


def _print_steps(b: Bench, rows, device_kind: str):
    args = b.args
    print(
        f"\n=== MoE step ({b.ranks} x {device_kind}; T={args.tokens}/rank, D={b.D}, H={b.H}, E={b.E}, "
        f"P={b.P}, top-{b.K}, bf16, map_and_count={args.map_impl or 'default'}) ==="
    )
    print("matmul/exchange: 'worst' = one worst-case all_to_all; 'cfX' = rounds of X times the balanced share")
    print(
        f"{'matmul/exchange':18s} {'skew':>5s} {'placement / routing':22s} {'step ms':>9s} {'vs ideal':>9s} {'bal.':>7s}"
    )
    for label, r in rows:
        if r is None:
            print(f"{label:18s} FAILED (traceback above)")
            continue
        for skew, found in r["skews"].items():
            for case, tb in found["cases"].items():
                if tb is None:
                    print(f"{label:18s} {skew:5g} {case:22s} FAILED (traceback above)")
                    continue
                t, bal = tb
                print(f"{label:18s} {skew:5g} {case:22s} {t * 1e3:9.3f} {t / r['t_uni']:9.3f} {bal:7.3f}")
            print(
                f"{label:18s} {skew:5g} outputs bit-identical across cases: {found['same']}; "
                f"load sums exact: {found['loads_ok']}"
            )
        print(f"{label:18s} {'-':>5s} {'uniform (ideal)':22s} {r['t_uni'] * 1e3:9.3f} {1.0:9.3f} {r['b_uni']:7.3f}")
        print(f"{label:18s} per-rank temporary buffers of the compiled step: {_mib(r['temp_bytes'])}")


def main():
    args = _args()
    if args.cpu_devices:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.cpu_devices}"
    if args.small:
        args.tokens, args.dim, args.hidden, args.experts, args.redundant, args.iters = 256, 64, 32, 16, 8, 3
    import jax  # after the device count is set

    try:  # run as a script: benchmarks/ is on sys.path
        from _bookkeeping import bookkeeping, print_bookkeeping
    except ImportError:
        from benchmarks._bookkeeping import bookkeeping, print_bookkeeping

    b = _setup(args)
    skews = [float(s) for s in args.skews.split(",")]
    cases = [c for c in args.cases.split(",") if c]
    if set(cases) - set(CASES):
        raise ValueError(f"--cases takes names out of {CASES}, got {args.cases!r}")
    online_ok = b.E % b.ranks == 0 and (b.P - b.E) % b.ranks == 0 and b.P > b.E
    if not online_ok and "online/quota" in cases:
        print(f"online/quota skipped: E={b.E} and R={b.P - b.E} must be positive multiples of the EP size {b.ranks}")
        cases.remove("online/quota")
    x_uni = b.one_hot_tokens((np.arange(b.T)[:, None] * b.K + np.arange(b.K)[None, :]) % b.E)
    uniform_ops = b.operands(even_placement(b.E, b.P, b.ranks), "hash", x_uni)
    batches = _batches(b, skews, online_ok)

    factors = [None if f == "none" else float(f) for f in args.capacity_factor.split(",")]
    rows = [
        (_exchange_label(m, f), _step_row(b, m, f, cases, batches, uniform_ops))
        for m in args.matmul.split(",")
        for f in factors
    ]
    book = {}
    tokens, load, placements = batches[skews[len(skews) // 2]]  # the middle skew
    for routing in [m for m in args.book_modes.split(",") if m]:
        where = "online" if routing == "quota" and online_ok else "EPLB"
        try:
            ops = b.operands(placements[where], routing, tokens, load)
            matmul, factor = args.matmul.split(",")[0], factors[0]
            book[routing] = (where, bookkeeping(b, routing, ops, matmul, factor, _exchange_label(matmul, factor)))
        except Exception:  # must not hide the step-time rows
            traceback.print_exc()
            book[routing] = (where, None)

    device_kind = jax.devices()[0].device_kind
    _print_steps(b, rows, device_kind)
    for routing, (where, row) in book.items():
        print_bookkeeping(routing, where, row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    ranks=b.ranks,
                    device=device_kind,
                    skews=skews,
                    rows={label: r for label, r in rows},
                    bookkeeping={routing: row for routing, (_, row) in book.items()},
                ),
                f,
                indent=1,
            )
    ok = all(r is not None for _, r in rows) and all(
        f["same"] and f["loads_ok"] and all(v is not None for v in f["cases"].values())
        for _, r in rows
        if r is not None
        for f in r["skews"].values()
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

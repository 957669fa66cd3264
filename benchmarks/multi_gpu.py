"""Issue 8 in one device call: raw collectives, expert transport, MoE step, online planner, two-process serving.

GPU (one call on kind ``nvidia-h200-x8``, ``run`` tool ``timeout_s=600``; whole script <= ``--budget`` 530 s)::

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/multi_gpu.py --out $OUT

On ``nvidia-h200-x4`` the same command uses the 4 GPUs it finds (EP4, serving 2 x 2; run 2026-11-30, all
parts ok, ``benchmarks/RESULTS.md``). With a 420 s call limit add ``--budget 400`` (the later parts then get
less time or are skipped, and say so). The device tool brings back only a few files from ``$OUT`` (on the x4
run five of the thirteen logs stayed behind), so keep the logs in one archive::

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/multi_gpu.py --out /tmp/mg > $OUT/multi_gpu.txt 2>&1; \
        tar czf $OUT/logs.tgz -C /tmp/mg .

CPU smoke run (8 simulated CPU devices, tiny shapes, ~2 minutes on a 2-core machine)::

    PYTHONPATH=. .venv/bin/python benchmarks/multi_gpu.py --cpu-smoke --out /tmp/multi_gpu

Each part runs in its own subprocess (a clean JAX; a failure or time-out in one loses nothing else), with
its own time-out, its full log at ``<out>/<part>.log`` (and a ``.json`` where the script writes one):

``collectives``  raw ppermute (ring), all_to_all and all_gather of uint8 bytes over the EP axis at a few
                 sizes: GB/s sent off-rank per rank against the NVLink ceiling (this file, ``--collectives``).
``transport``    ``benchmarks/transport.py`` at EP = every GPU: rearrange_experts of a DeepSeek-V3-shaped
                 58 x 288-slot model (10% / 50% of slots moved) vs a raw ppermute of the same bytes, with the
                 library's default schedule (on one host the NVLink put kernel: every rank writing to every peer).
``moe_step``     ``benchmarks/moe_step.py`` at EP = every GPU, Zipf routing: every replica-routing mode of the
                 MoE layer (initial / EPLB placement, hash / round_robin / lp / quota, online placement with
                 quota) vs uniform routing (the ideal), grouped matmul ``pallas`` (cost follows rows) and ``dense``.
``online``       ``benchmarks/online_ep.py``: all_gather of per-rank counts + ``plan_quotas`` + quota
                 reroute, per layer, at EP = every GPU (E = 256, 4 spare slots per rank).
``serve``        ``examples/serve.py`` as two processes (``jax.distributed`` on localhost, a free port, half
                 of the GPUs each via ``CUDA_VISIBLE_DEVICES``): both must print the same summary; then one
                 process on every GPU, whose summary should match too.

The last lines printed are a table with one line per part: ok / FAILED / TIMEOUT / skipped, wall seconds,
and the headline figure. Exit status 0 only when every chosen part is ok.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("collectives", "transport", "moe_step", "online", "serve")
# Per-part time-outs in seconds (GPU; the CPU smoke run uses its own). Their sum stays under the budget.
GPU_TIMEOUTS = dict(collectives=40, transport=160, moe_step=170, online=70, serve=110)
CPU_TIMEOUTS = dict(collectives=60, transport=90, moe_step=120, online=60, serve=150)
NCCL_SAFE = dict(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
NVLINK_GBPS = 450.0  # H200 NVLink 4, 18 links: ~450 GB/s per direction per GPU (PLATFORM.md)


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--cpu-smoke", action="store_true", help="8 simulated CPU devices, tiny shapes")
    p.add_argument(
        "--out",
        default=os.environ.get("OUT") or os.path.join(tempfile.gettempdir(), "multi_gpu"),
        help="folder for the logs (default: $OUT when set, else <tmp>/multi_gpu)",
    )
    p.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: every GPU nvidia-smi lists)")
    p.add_argument("--budget", type=float, default=530.0, help="seconds for all parts together")
    p.add_argument(
        "--timeout",
        action="append",
        default=[],
        metavar="PART=SECONDS",
        help="override one part's time-out (repeatable)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--collectives", action="store_true", help=argparse.SUPPRESS)  # the in-file part
    p.add_argument(
        "--sizes-mib",
        type=float,
        nargs="+",
        default=None,
        help="collectives: MiB per rank (default 64 256 1024; smoke 1 4)",
    )
    args = p.parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    unknown = set(parts) - set(PARTS)
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}; known: {', '.join(PARTS)}")
    args.parts = parts
    args.timeouts = dict(CPU_TIMEOUTS if args.cpu_smoke else GPU_TIMEOUTS)
    for item in args.timeout:
        name, _, seconds = item.partition("=")
        if name not in PARTS or not seconds.replace(".", "", 1).isdigit():
            p.error(f"--timeout takes PART=SECONDS with PART in {', '.join(PARTS)}, got {item!r}")
        args.timeouts[name] = float(seconds)
    return args


# ------------------------------------------------------------------ the collectives part (runs in a subprocess)
def collectives_main(sizes_mib, out):
    """Raw ppermute / all_to_all / all_gather of random uint8 bytes over every device; checks the bytes landed."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as PS

    G = jax.device_count()
    mesh = jax.make_mesh((G,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    print(f"devices: {G} x {jax.devices()[0].device_kind}; jax {jax.__version__}", flush=True)
    ring = [(r, (r + 1) % G) for r in range(G)]
    ops = {  # name -> (per-rank function of a [G, n] block, bytes sent off-rank per rank for n bytes per block)
        "ppermute (ring)": (lambda x: jax.lax.ppermute(x, "ep", ring), lambda n: G * n),
        "all_to_all": (lambda x: jax.lax.all_to_all(x, "ep", 0, 0, tiled=True), lambda n: (G - 1) * n),
        "all_gather": (lambda x: jax.lax.all_gather(x[:1], "ep", tiled=True), lambda n: (G - 1) * n),
    }

    def sums(x):  # [G*G, n] uint8 -> per-block checksums [G*G] (uint32, position weighted)
        w = (jnp.arange(x.shape[-1], dtype=jnp.uint32) * jnp.uint32(2654435761)) | jnp.uint32(1)
        return jnp.sum(x.astype(jnp.uint32) * w[None, :], axis=-1, dtype=jnp.uint32)

    sums = jax.jit(sums)
    rows = []
    for mib in sizes_mib:
        n = max(1, int(mib * 2**20) // G)  # bytes per block; G blocks per rank
        sharding = NamedSharding(mesh, PS("ep"))
        x = jax.jit(lambda key: jax.random.bits(key, (G * G, n), jnp.uint8), out_shardings=sharding)(
            jax.random.key(int(mib * 16) + 1)
        )
        before = np.asarray(sums(x)).reshape(G, G)  # [rank, block]
        for name, (fn, sent) in ops.items():
            f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=PS("ep"), out_specs=PS("ep")))
            y = f(x)
            after = np.asarray(sums(y)).reshape(G, -1)
            if name.startswith("ppermute"):
                ok = np.array_equal(after, np.roll(before, 1, axis=0))
            elif name == "all_to_all":
                ok = np.array_equal(after, before.T)
            else:
                ok = np.array_equal(after, np.tile(before[:, 0], (G, 1)))
            del y
            times = []
            for _ in range(10):
                t0 = time.perf_counter()
                jax.block_until_ready(f(x))
                times.append(time.perf_counter() - t0)
            t = statistics.median(times)
            gbps = sent(n) / t / 1e9
            rows.append(
                dict(
                    op=name,
                    mib_per_rank=G * n / 2**20,
                    sent_bytes=sent(n),
                    ms=t * 1e3,
                    gbps=gbps,
                    of_nvlink=gbps / NVLINK_GBPS,
                    correct=bool(ok),
                )
            )
            print(json.dumps(rows[-1]), flush=True)
        del x
    print(
        f"\n=== raw collectives, {G} x {jax.devices()[0].device_kind} (uint8, median of 10; GB/s = bytes sent "
        f"off-rank per rank / time; ceiling {NVLINK_GBPS:.0f} GB/s per direction, NVLink) ==="
    )
    print(f"{'op':<18} {'MiB/rank':>9} {'ms':>9} {'GB/s':>9} {'of ceiling':>10} {'bytes ok':>8}")
    for r in rows:
        print(
            f"{r['op']:<18} {r['mib_per_rank']:9.1f} {r['ms']:9.3f} {r['gbps']:9.1f} {r['of_nvlink']:10.2f} "
            f"{str(r['correct']):>8}"
        )
    with open(os.path.join(out, "collectives.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0 if all(r["correct"] for r in rows) else 1


# --------------------------------------------------------------------------- the orchestrator
def _gpu_count():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        return sum(1 for line in out.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.SubprocessError):  # no nvidia-smi: count the device nodes
        return sum(1 for name in os.listdir("/dev") if name[len("nvidia") :].isdigit() and name.startswith("nvidia"))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(cpu_smoke, devices=None, visible=None, gpus=None):
    env = dict(os.environ)
    env.update(NCCL_SAFE)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if cpu_smoke:
        env["JAX_PLATFORMS"] = "cpu"
        if devices:
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
        else:
            env.pop("XLA_FLAGS", None)  # the script sets its own device count
    if visible is None and not cpu_smoke and gpus:
        visible = ",".join(str(i) for i in range(gpus))
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return env


def _script(name):
    return os.path.join(ROOT, name)


def plan_part(part, args, ranks):
    """The subprocess(es) of one part: a list of (label, argv, env) run side by side."""
    py, smoke, out = sys.executable, args.cpu_smoke, args.out
    if part == "collectives":
        sizes = args.sizes_mib or ([1, 4] if smoke else [64, 256, 1024])
        cmd = [py, os.path.abspath(__file__), "--collectives", "--out", out, "--sizes-mib", *map(str, sizes)]
        return [("collectives", cmd, _env(smoke, devices=ranks, gpus=ranks))]
    if part == "transport":
        cmd = [
            py,
            _script("benchmarks/transport.py"),
            "--ranks",
            str(ranks),
            "--json",
            os.path.join(out, "transport.json"),
        ]
        if smoke:
            cmd += ["--layers", "4", "--hidden", "256", "--inter", "32", "--iters", "2"]
        return [("transport", cmd, _env(smoke, devices=ranks, gpus=ranks))]
    if part == "moe_step":
        cmd = [
            py,
            _script("benchmarks/moe_step.py"),
            "--ranks",
            str(ranks),
            "--capacity-factor",
            "1.25",
            "--book-reps",
            "1",
            "--json",
            os.path.join(out, "moe_step.json"),
        ]  # 1 rep: fits its time-out
        cmd += (
            ["--cpu-devices", str(ranks), "--small", "--matmul", "dense,pallas_interpret", "--skews", "2"]
            if smoke
            else ["--matmul", "pallas,dense", "--iters", "10"]
        )
        return [("moe_step", cmd, _env(smoke, gpus=ranks))]
    if part == "online":
        cmd = [
            py,
            _script("benchmarks/online_ep.py"),
            "--ranks",
            str(ranks),
            "--json",
            os.path.join(out, "online_ep.json"),
        ]
        cmd += ["--cpu-devices", str(ranks), "--small", "--planners", "pallas,xla"] if smoke else []
        return [("online", cmd, _env(smoke, gpus=ranks))]
    if part == "serve":
        port, half = _free_port(), ranks // 2
        procs = []
        for i in range(2):
            cmd = [
                py,
                _script("examples/serve.py"),
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
                "--devices",
                str(half) if smoke else "0",
            ]
            visible = None if smoke else ",".join(str(d) for d in range(i * half, (i + 1) * half))
            procs.append((f"serve.p{i}", cmd, _env(smoke, visible=visible)))
        return procs
    raise ValueError(f"unknown part {part!r}")


_LIVE = []  # the process groups started here and not yet reaped


def _killpg(pid, sig):
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def _stop(procs):
    """Ends the still-running processes of ``procs`` (SIGTERM, then SIGKILL after 5 s); returns them."""
    running = [p for p in procs if p.poll() is None]
    for p in running:  # only the processes started here, each by its own process group
        _killpg(p.pid, signal.SIGTERM)
    deadline = time.perf_counter() + 5
    for p in running:
        try:
            p.wait(timeout=max(deadline - time.perf_counter(), 0.1))
        except subprocess.TimeoutExpired:
            _killpg(p.pid, signal.SIGKILL)
            p.wait()
    for p in procs:
        if p in _LIVE:
            _LIVE.remove(p)
    return running


def _on_signal(signum, frame):  # the orchestrator itself is being stopped: take the parts down with it
    _stop(list(_LIVE))
    sys.exit(128 + signum)


def _run_group(group, timeout, out):
    """Runs the (label, argv, env) processes side by side; returns (rc or 'timeout', wall seconds)."""
    start, procs, logs = time.perf_counter(), [], []
    for label, cmd, env in group:
        log = open(os.path.join(out, f"{label}.log"), "w")  # noqa: SIM115 -- closed after the process ends
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        logs.append(log)
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )
        _LIVE.append(procs[-1])
    status = 0
    # Poll: a process that fails ends the group at once (its peer may be waiting for it forever).
    while None in [p.poll() for p in procs]:  # a list, not any(): every process gets polled
        if time.perf_counter() - start > timeout:
            status = "timeout"
            break
        if any(p.returncode not in (None, 0) for p in procs):
            break
        time.sleep(0.2)
    if status == 0:
        status = next((p.returncode for p in procs if p.returncode not in (None, 0)), 0)
    running = _stop(procs)
    if running and status == 0:
        status = "timeout"
    for log in logs:
        log.close()
    return status, time.perf_counter() - start


def _read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read().replace("\r", "\n")
    except OSError:
        return ""


def _load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _section(text, marker, fallback=15):
    """The log from the last line that starts with ``marker`` on (the script's table), else its tail."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    starts = [i for i, ln in enumerate(lines) if ln.startswith(marker)]
    return lines[starts[-1] :] if starts else lines[-fallback:]


SUMMARY_FIELDS = ("EP ranks", "balancedness", "rearrangement:")


def _summary_lines(text):
    """A serve process's summary: the lines every process must agree on.

    Only the lines ``examples/serve.py`` prints for its result are kept: the log interleaves stderr, and
    runtime messages (a process's coordination-service warnings at shut-down, Gloo lines) differ per
    process; the throughput line is timing, which differs too.
    """
    lines = _section(text, "=== summary", fallback=0)
    return [ln for ln in lines[1:] if ln.startswith(SUMMARY_FIELDS)]


def headline(part, out, text):
    """(ok, headline) of a finished part, from its .json (or log)."""
    if part == "collectives":
        rows = _load_json(os.path.join(out, "collectives.json")) or []
        if not rows:
            return False, "no figures"
        big = max(r["mib_per_rank"] for r in rows)
        best = {r["op"]: r for r in rows if r["mib_per_rank"] == big}
        fig = ", ".join(f"{op.split()[0]} {r['gbps']:.3g}" for op, r in best.items())
        return all(r["correct"] for r in rows), f"{big:.0f} MiB/rank GB/s: {fig} (ceiling {NVLINK_GBPS:.0f})"
    if part == "transport":
        rows = _load_json(os.path.join(out, "transport.json")) or []
        if not rows:
            return False, "no figures"
        checks = re.findall(r"^dtype check \(.*\): (True|False)$", text, flags=re.MULTILINE)
        dtype_ok = bool(checks) and all(c == "True" for c in checks)
        fig = "; ".join(
            f"{r['schedule']} {r['fraction']:.0%}: {r['time_ms']:.3g} ms vs raw {r['raw_ms']:.3g} ms ({r['ratio']:.2f})"
            for r in rows
        )
        ok = all(r["correct"] and r["recompiles_after_first"] == 0 for r in rows) and dtype_ok
        return ok, f"{fig}; moves correct, dtypes exact: {ok}"
    if part == "moe_step":
        res = _load_json(os.path.join(out, "moe_step.json"))
        if not res:
            return False, "no figures"
        figs, ok = [], True
        for label, r in res["rows"].items():
            if r is None:
                ok = False
                figs.append(f"{label} FAILED")
                continue
            for skew, found in r["skews"].items():
                cases = found["cases"]
                ok = ok and found["same"] and found["loads_ok"] and all(v is not None for v in cases.values())
                ratios = ", ".join(f"{c} {v[0] / r['t_uni']:.2f}" for c, v in cases.items() if v is not None)
                figs.append(f"{label} skew {skew}: {ratios} x ideal")
        return ok, "; ".join(figs[:3]) + f"; same outputs+loads: {ok}"
    if part == "online":
        r = _load_json(os.path.join(out, "online_ep.json"))
        if not r:
            return False, "no figures"
        ok = bool(r["correct"]) and all(r["correct"].values())
        chains = ", ".join(
            f"{k.rsplit(' ', 1)[-1]} {v:.3f}" for k, v in r["per_layer_ms"].items() if k.startswith("all_gather + plan")
        )
        finals = ", ".join(f"{v:.4f}" for v in r["final_imbalance"].values())
        return ok, (
            f"ms/layer: {chains} (target 0.1, UltraEP 0.11); imbalance {r['initial_imbalance']:.3f} -> "
            f"{finals}; routed == plan: {ok}"
        )
    if part == "serve":
        a = _summary_lines(_read(os.path.join(out, "serve.p0.log")))
        b = _summary_lines(_read(os.path.join(out, "serve.p1.log")))
        same = bool(a) and a == b
        bal = next((ln.split("(measured)")[1].split("(")[0].strip() for ln in a if "(measured)" in ln), "?")
        return same, f"2 processes print the same summary: {same}; balancedness {bal}"
    raise ValueError(part)


JSONS = dict(online="online_ep.json")
MARKERS = dict(
    collectives="=== raw collectives",
    transport="## transport",
    moe_step="=== MoE step",
    online="=== online planner",
    serve="=== summary",
)


def main(argv=None):
    args = _args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.collectives:
        return collectives_main(args.sizes_mib or [1, 4], args.out)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _on_signal)
    if args.cpu_smoke:
        ranks = 8
    else:
        ranks = args.gpus or _gpu_count()
        if ranks < 2:
            print("no GPUs found (nvidia-smi -L); use --cpu-smoke on a machine without GPUs", file=sys.stderr)
            return 2
    if "serve" in args.parts and ranks % 2:
        print(f"serve needs an even number of devices, got {ranks}: skipping it")
        args.parts.remove("serve")
    print(
        f"multi_gpu: {ranks} {'simulated CPU devices' if args.cpu_smoke else 'GPUs'}; parts {args.parts}; "
        f"budget {args.budget:.0f} s; logs in {args.out}",
        flush=True,
    )
    t_start, results = time.perf_counter(), []
    for part in args.parts:
        group = plan_part(part, args, ranks)
        if args.dry_run:
            for label, cmd, env in group:
                extra = {k: env[k] for k in ("JAX_PLATFORMS", "XLA_FLAGS", "CUDA_VISIBLE_DEVICES") if k in env}
                print(f"[{label}] {' '.join(f'{k}={v}' for k, v in extra.items())} {' '.join(cmd)}")
            continue
        left = args.budget - (time.perf_counter() - t_start)
        timeout = min(args.timeouts[part], left)
        if left < 15:
            results.append(dict(part=part, status="skipped", wall=0.0, headline=f"budget left {left:.0f} s"))
            continue
        stale = os.path.join(args.out, JSONS.get(part, f"{part}.json"))
        if os.path.exists(stale):  # a figure from an earlier run must not pass for this one's
            os.remove(stale)
        print(f"\n--- {part} (time-out {timeout:.0f} s) ---", flush=True)
        rc, wall = _run_group(group, timeout, args.out)
        text = _read(os.path.join(args.out, f"{group[0][0]}.log"))
        if part == "serve":
            reference = None  # one process on every device: its summary should equal the two processes'
            left = args.budget - (time.perf_counter() - t_start)
            if rc == 0 and left > 30:
                py = sys.executable
                cmd = [py, _script("examples/serve.py"), "--devices", str(ranks) if args.cpu_smoke else "0"]
                env = _env(args.cpu_smoke, gpus=ranks)
                rc1, wall1 = _run_group([("serve.single", cmd, env)], min(left, 90), args.out)
                single = _summary_lines(_read(os.path.join(args.out, "serve.single.log")))
                reference = rc1 == 0 and single == _summary_lines(text)
                wall += wall1
        for line in _section(text, MARKERS[part]):
            print(line)
        try:
            ok, head = headline(part, args.out, text)
        except Exception as err:
            ok, head = False, f"no headline ({type(err).__name__}: {err})"
        if part == "serve" and rc == 0:
            head += f"; = one process on all {ranks}: {reference}"
        status = "ok" if rc == 0 and ok else "TIMEOUT" if rc == "timeout" else "FAILED"
        if rc not in (0, "timeout"):
            head = f"exit {rc}; " + head
        results.append(dict(part=part, status=status, wall=wall, headline=head))
    if args.dry_run:
        return 0
    total = time.perf_counter() - t_start
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(dict(ranks=ranks, cpu_smoke=args.cpu_smoke, total_s=total, parts=results), f, indent=1)
    print(
        f"\n=== multi_gpu summary: {ranks} {'simulated CPU devices' if args.cpu_smoke else 'GPUs'}, "
        f"{total:.0f} s in all; logs in {args.out} ==="
    )
    print(f"{'part':<12} {'status':<8} {'wall s':>7}  headline")
    for r in results:
        print(f"{r['part']:<12} {r['status']:<8} {r['wall']:7.1f}  {r['headline']}")
    return 0 if results and all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

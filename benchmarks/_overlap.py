"""Why a collective executor did or did not overlap its transfers with its copies (benchmarks/transport.py).

``hlo_summary``: what XLA may overlap (data dependencies between transfers in the
lowered HLO) and what it scheduled to overlap (compute ops between each async
collective's start and done in the compiled HLO). ``timeline``: what the GPU did
(CUPTI records via ``jax.profiler``, like ``_timing.device_seconds``): per call,
busy time of the transfer kernels, of the other kernels, and their overlap.
"""

from __future__ import annotations

import glob
import re
import statistics
import tempfile
import time

import jax

# ------------------------------------------------------------------------ HLO
_PLUMBING = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "opt-barrier",
    "partition-id",
    "replica-id",
}


def _balanced(text, i):
    """Index just past the parenthesis group opening at ``text[i]``."""
    depth = 0
    for j in range(i, len(text)):
        depth += {"(": 1, ")": -1}.get(text[j], 0)
        if depth == 0:
            return j + 1
    return len(text)


def _instructions(text):
    """``{computation: [(name, opcode, operands, line)]}`` of an HLO module's text, in (scheduled) order."""
    comps, current = {}, None
    for line in text.splitlines():
        if line[:1] not in (" ", "") and line.rstrip().endswith("{"):
            head = re.match(r"^(ENTRY )?%?([\w.\-]+)", line)
            current = "ENTRY" if head.group(1) else head.group(2)
            comps[current] = []
            continue
        m = re.match(r"^\s+(?:ROOT )?%?([\w.\-]+) = (.*)$", line)
        if current is None or not m:
            continue
        rest = m.group(2)
        i = _balanced(rest, 0) if rest.startswith("(") else rest.find(" ")  # past the result type
        op = re.match(r"\s*([a-z][a-z0-9\-]*)\(", rest[i:]) if i >= 0 else None
        if not op:
            continue
        start = i + op.end() - 1
        inner = re.sub(r"\[[^\]]*\]|\{[^}]*\}", "", rest[start + 1 : _balanced(rest, start) - 1])
        operands = [tok.split()[-1].lstrip("%") for tok in inner.split(",") if tok.strip()]
        comps[current].append((m.group(1), op.group(1), operands, line))
    return comps


def hlo_summary(lowered, compiled):
    """What XLA may and did overlap, per transfer (collective-permute) of the executor.

    From the HLO as lowered (data dependencies, optimisation barriers included): the longest chain of
    transfers each waiting for an earlier one -- N of N transfers means strictly one after another. From
    the compiled HLO (XLA's schedule): the transfers run async, those marked synchronous, and per async
    transfer the compute ops scheduled between its start and its done (0: nothing can overlap it).
    """
    chain, count = 0, 0
    for ins in _instructions(lowered).values():
        cps = [name for name, op, _, _ in ins if op == "collective-permute"]
        if not cps:
            continue
        by_name = {name: operands for name, _, operands, _ in ins}
        memo = {}

        def depth(name):  # transfers on the longest chain ending at `name` (itself included if a transfer)
            if name not in memo:
                memo[name] = 0
                memo[name] = max((depth(o) for o in by_name.get(name, ())), default=0) + (name in cps_set)
            return memo[name]

        cps_set = set(cps)
        count += len(cps)
        chain = max(chain, max(depth(name) for name in cps))
    comps = _instructions(compiled)
    with_cp = {c for c, ins in comps.items() if any(op.startswith("collective-permute") for _, op, _, _ in ins)}
    between, sync, pairs = [], 0, 0
    for ins in comps.values():
        ops = {name: op for name, op, _, _ in ins}
        for i, (name, op, _, line) in enumerate(ins):
            if not (
                op == "collective-permute-start"
                or (op == "async-start" and any(re.search(rf"calls=%?{re.escape(c)}\b", line) for c in with_cp))
            ):
                continue
            pairs += 1
            sync += '"is_sync":true' in line
            done = next((j for j in range(i + 1, len(ins)) if ins[j][1].endswith("-done") and name in ins[j][2]), None)
            if done is not None:
                between.append(
                    sum(
                        1
                        for n, _, _, _ in ins[i + 1 : done]
                        if ops[n] not in _PLUMBING and not ops[n].endswith(("-start", "-done"))
                    )
                )
    return {
        "transfers": count,
        "longest_chain": chain,
        "async_pairs": pairs,
        "is_sync": sync,
        "compute_ops_between_start_and_done": between,
    }


# ------------------------------------------------------------------- timeline
def _union(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _length(intervals):
    return sum(b - a for a, b in intervals)


def _intersection(x, y):
    i = j = 0
    total = 0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0, hi - lo)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def _kind(name):
    low = name.lower()
    if "nccl" in low or "sendrecv" in low or ("memcpy" in low and any(k in low for k in ("p2p", "ptop", "peer"))):
        return "transfer"
    return "copy" if "memcpy" in low or "memset" in low else "kernel"


def timeline(calls_fn, calls, gap_ms=5.0):
    """Profiles ``calls_fn(i)`` for ``i < calls`` (each synchronised, 30 ms apart); :func:`summarise` of GPU 0."""
    from jax.profiler import ProfileData

    directory = tempfile.mkdtemp(prefix="transport_trace_")
    with jax.profiler.trace(directory):
        for i in range(calls):
            jax.block_until_ready(calls_fn(i))
            time.sleep(0.03)
    paths = sorted(glob.glob(f"{directory}/**/*.xplane.pb", recursive=True))
    events = []  # (start_ns, end_ns, name, stream)
    for plane in ProfileData.from_file(paths[-1]).planes if paths else []:
        if plane.name.startswith("/device:GPU:0"):
            for line in plane.lines:
                if line.name.startswith("Stream"):  # kernel and memcpy records live on the stream lines
                    events += [(e.start_ns, e.end_ns, e.name, line.name) for e in line.events]
    return summarise(events, gap_ms)


def summarise(events, gap_ms=5.0):
    """Per call (median over calls) of ``(start_ns, end_ns, name, stream)`` device events.

    Events are grouped into calls by idle gaps longer than ``gap_ms``. Per call: the wall span of the
    device work; busy time (union of intervals) of transfers (NCCL kernels, peer memcpys), of other
    kernels, of other copies; the time transfers and anything else ran at the same time; idle time
    inside the span. Also the streams each kind used and the largest events. ``None`` without events.
    """
    if not events:
        return None
    events = sorted((a, b, _kind(name), name, stream) for a, b, name, stream in events)
    groups, end = [], None
    for ev in events:
        if end is None or ev[0] > end + gap_ms * 1e6:
            groups.append([])
            end = ev[1]
        groups[-1].append(ev)
        end = max(end, ev[1])
    rows = []
    for g in groups:
        by = {k: _union([(a, b) for a, b, kind, _, _ in g if kind == k]) for k in ("transfer", "kernel", "copy")}
        span = max(e[1] for e in g) - g[0][0]
        # Before the first kernel or transfer: the table upload, then the wait for the launch (host work).
        work_start = min((a for a, _, kind, _, _ in g if kind != "copy"), default=g[0][0])
        rows.append(
            {
                "span": span * 1e-6,
                "transfer": _length(by["transfer"]) * 1e-6,
                "kernel": _length(by["kernel"]) * 1e-6,
                "copy": _length(by["copy"]) * 1e-6,
                "overlap": _intersection(by["transfer"], _union(by["kernel"] + by["copy"])) * 1e-6,
                "idle": (span - _length(_union([(a, b) for a, b, *_ in g]))) * 1e-6,
                "lead": (work_start - g[0][0]) * 1e-6,
            }
        )
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    # The call whose span is the median: its events in order (ms from its first event), to read gaps from.
    middle = sorted(range(len(rows)), key=lambda i: rows[i]["span"])[len(rows) // 2]
    t0 = groups[middle][0][0]
    call_events = [
        (round((a - t0) * 1e-6, 4), round((b - a) * 1e-6, 4), kind, name[:48], stream)
        for a, b, kind, name, stream in groups[middle]
    ]
    per_name = {}
    for a, b, kind, name, stream in events:
        key = (kind, name[:60], stream)
        per_name[key] = per_name.get(key, 0.0) + (b - a) * 1e-6 / len(groups)
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:6]
    streams = {k: sorted({s for _, _, kind, _, s in events if kind == k}) for k in ("transfer", "kernel", "copy")}
    return {
        "calls_found": len(groups),
        **{f"{k}_ms": round(v, 3) for k, v in med.items()},
        "streams": streams,
        "top_ms_per_call": [(k[0], k[1], k[2], round(v, 3)) for k, v in top],
        "events_of_median_call": call_events,
    }

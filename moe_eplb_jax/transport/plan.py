"""Host-side move planning: what each EP rank sends, receives and copies.

Given the slot -> expert tables before and after a placement change
(``phy2log [L, P]``, or ``[P]`` for one layer) and the number of EP ranks
``G`` (slot ``p`` lives on rank ``p // (P / G)``), the plan says:

* which slots are written -- only those whose expert changes;
* local copies -- an expert already held on the destination rank is copied
  from that rank's old slot;
* sends -- every other (layer, expert) a rank needs is received exactly once,
  from one of the ranks holding it, written into the first slot that needs
  it, and copied from there into the rank's other slots that need it
  ("duplicates"). Senders are chosen to even out the rows each rank sends in
  each round.

Rows are addressed by a rank's *local row* index ``l * (P / G) + j`` (slot
``j`` of the rank, layer ``l``), i.e. the flattened leading ``[L, P / G]`` axes
of a rank's shard. Transfers run in ``G - 1`` rounds; in round ``d`` every
rank ``r`` sends to ``(r + d) % G``.

The tables are padded to capacities from a small set of buckets (exact below
32, then 16 steps per octave: at most 1/16 padding), so the executor compiled
for one plan serves later plans of similar size. The plan is a pure function
of its inputs: every process computes the same plan.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moe_eplb_jax._checks import INT32_MAX, check_int

__all__ = [
    "TransportPlan",
    "plan_rearrangement",
    "plan_layer_by_layer",
    "bucket_capacity",
    "validate_placements",
]


def bucket_capacity(count: int) -> int:
    """The padded capacity for ``count`` rows: exact below 32, then 16 steps per octave (<= 1/16 padding)."""
    count = int(count)
    if count < 32:
        return count
    step = 1 << (count.bit_length() - 5)
    return -(-count // step) * step


@dataclasses.dataclass(frozen=True)
class TransportPlan:
    """Index tables of one rearrangement (numpy, identical on every process).

    Shapes (``G`` ranks, ``C`` send capacity, ``D`` duplicate capacity, ``K``
    copy capacity; padding rows hold index 0 for reads and distinct rows
    ``>= num_local_rows`` -- out of range, hence dropped -- for writes):

    * ``send_rows [G, G - 1, C]`` -- local rows rank ``r`` sends in round
      ``d`` (index ``d - 1``) to rank ``(r + d) % G``; ``send_count [G, G - 1]``.
    * ``recv_dst [G, G - 1, C]`` -- the local row rank ``r`` writes with the
      ``i``-th row it receives in round ``d`` (from rank ``(r - d) % G``).
    * ``dup_dst [G, D]``, ``dup_src [G, D]`` -- after the receives, row
      ``dup_src`` (just written) is copied to ``dup_dst``; ``dup_count [G]``.
    * ``copy_dst [G, K]``, ``copy_src [G, K]`` -- local copies from the old
      rows (an expert the rank already holds); ``copy_count [G]``.
    * ``written [L, P]`` -- slots whose expert changes (the only slots written).
    * ``moves [M, 4]`` -- one row per received (layer, expert):
      ``(layer, expert, source slot, destination rank)``.
    * ``chunk_bounds`` -- ``()``, or for a plan reordered by
      ``streaming.order_for_streaming`` the first position of each chunk of a round
      and, last, the end of the last chunk (position ``i`` belongs to chunk
      ``c`` when ``bounds[c] <= i < bounds[c + 1]``; every row is received in
      a chunk no earlier than every chunk that sends its old bytes).
    """

    num_ranks: int
    num_layers: int
    num_slots: int
    layered: bool
    send_rows: np.ndarray
    send_count: np.ndarray
    recv_dst: np.ndarray
    dup_dst: np.ndarray
    dup_src: np.ndarray
    dup_count: np.ndarray
    copy_dst: np.ndarray
    copy_src: np.ndarray
    copy_count: np.ndarray
    written: np.ndarray
    moves: np.ndarray
    chunk_bounds: tuple = ()

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.num_ranks

    @property
    def num_local_rows(self) -> int:
        """Rows of one rank's shard: ``L * P / G``."""
        return self.num_layers * self.slots_per_rank

    @property
    def capacities(self) -> tuple[int, int, int]:
        """``(C, D, K)``: the padded send, duplicate and copy capacities (they fix the compiled shapes)."""
        return int(self.send_rows.shape[-1]), int(self.dup_dst.shape[-1]), int(self.copy_dst.shape[-1])

    @property
    def is_empty(self) -> bool:
        """True when no slot changes: nothing is sent, copied or written."""
        return not self.written.any()

    @property
    def rows_sent(self) -> np.ndarray:
        """``[G]`` rows each rank sends (unpadded)."""
        return self.send_count.sum(axis=1)

    @property
    def rows_received(self) -> np.ndarray:
        """``[G]`` rows each rank receives (unpadded): each missing (layer, expert) once."""
        received = np.zeros(self.num_ranks, dtype=np.int64)
        for d in range(1, self.num_ranks):
            received += np.roll(self.send_count[:, d - 1], d)
        return received

    def bytes_moved(self, row_bytes: int) -> int:
        """The most bytes any rank sends or receives, for rows of ``row_bytes`` bytes."""
        if self.num_ranks == 1:
            return 0
        return int(max(self.rows_sent.max(), self.rows_received.max())) * int(row_bytes)

    def padded(self, *, send: int = 0, dup: int = 0, copy: int = 0) -> TransportPlan:
        """The same plan with capacities raised to at least ``(send, dup, copy)``.

        Padding to fixed bounds gives every later plan the same compiled shapes
        (a server that must never recompile pads every plan to one bound).
        """
        (c, d, k), rows = self.capacities, self.num_local_rows
        new_c, new_d, new_k = max(c, int(send)), max(d, int(dup)), max(k, int(copy))
        if (new_c, new_d, new_k) == (c, d, k):
            return self
        g, rounds = self.num_ranks, self.num_ranks - 1
        send_rows = np.zeros((g, rounds, new_c), dtype=np.int32)
        send_rows[..., :c] = self.send_rows
        # Real write rows are < rows; padding is rebuilt distinct and out of range.
        recv_dst = np.tile(rows + np.arange(rounds * new_c, dtype=np.int32).reshape(rounds, new_c), (g, 1, 1))
        recv_dst[..., :c] = np.where(self.recv_dst < rows, self.recv_dst, recv_dst[..., :c])

        def grow(table, capacity, write):
            count = table.shape[1]
            if not write:
                out = np.zeros((g, capacity), dtype=np.int32)
                out[:, :count] = table
                return out
            out = np.tile(rows + np.arange(capacity, dtype=np.int32), (g, 1))
            out[:, :count] = np.where(table < rows, table, out[:, :count])
            return out

        return dataclasses.replace(
            self,
            send_rows=send_rows,
            recv_dst=recv_dst,
            dup_dst=grow(self.dup_dst, new_d, True),
            dup_src=grow(self.dup_src, new_d, False),
            copy_dst=grow(self.copy_dst, new_k, True),
            copy_src=grow(self.copy_src, new_k, False),
        )

    @property
    def send_dst(self) -> np.ndarray:
        """``[G, G - 1, C]``: the receiver's row for each row rank ``r`` sends in round ``d`` (padding: out of range)."""
        rounds = np.arange(1, self.num_ranks)
        receiver = (np.arange(self.num_ranks)[:, None] + rounds[None, :]) % self.num_ranks  # [G, G - 1]
        return self.recv_dst[receiver, rounds[None, :] - 1]

    def device_tables(self) -> dict[str, np.ndarray]:
        """The int32 tables the executor takes, each with a leading rank axis ``[G, ...]``."""
        return {
            "send_rows": self.send_rows,
            "recv_dst": self.recv_dst,
            "dup_dst": self.dup_dst,
            "dup_src": self.dup_src,
            "copy_dst": self.copy_dst,
            "copy_src": self.copy_src,
        }


def _as_phy2log(name: str, value) -> np.ndarray:
    arr = np.asarray(getattr(value, "phy2log", value))  # a Placement, or the table itself
    if arr.ndim not in (1, 2):
        raise ValueError(f"{name} must have shape [P] or [L, P], got {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integer expert ids, got dtype {arr.dtype}")
    return arr


def validate_placements(old_phy2log, new_phy2log, num_ranks: int, *, num_logical: int | None = None):
    """Checks two placements for a move; returns them as ``int64 [L, P]`` plus ``layered``.

    Raises ``ValueError`` for wrong shapes, ids outside ``[0, num_logical)``
    (or, without ``num_logical``, outside int32), ``P`` not divisible by
    ``num_ranks`` and a new placement naming an expert that no old slot of
    that layer holds. Memory follows the slots, never the largest id.
    """
    old = _as_phy2log("old_phy2log", old_phy2log)
    new = _as_phy2log("new_phy2log", new_phy2log)
    if old.shape != new.shape:
        raise ValueError(f"old_phy2log has shape {old.shape} but new_phy2log has shape {new.shape}")
    layered = old.ndim == 2
    if not layered:
        old, new = old[None], new[None]
    num_layers, num_slots = old.shape
    if num_layers == 0 or num_slots == 0:
        raise ValueError(f"placements must have at least one layer and one slot, got shape {old.shape}")
    num_ranks = check_int("num_ranks", num_ranks, minimum=1)
    if num_slots % num_ranks:
        raise ValueError(f"{num_slots} physical slots are not divisible by {num_ranks} ranks")
    bound = INT32_MAX + 1 if num_logical is None else check_int("num_logical", num_logical, minimum=1)
    for name, table in (("old_phy2log", old), ("new_phy2log", new)):
        bad = (table < 0) | (table >= bound)  # before any cast: a uint64 id must not wrap into range
        if bad.any():
            layer, slot = np.argwhere(bad)[0]
            where = f"[{layer}, {slot}]" if layered else f"[{slot}]"
            raise ValueError(f"{name}{where} = {table[layer, slot]} is outside the expert id range [0, {bound})")
    old, new = old.astype(np.int64), new.astype(np.int64)
    # Membership per layer by (layer, id) keys: sorted search over the slots, no [L, max id + 1] table.
    keys = np.arange(num_layers, dtype=np.int64)[:, None] * (INT32_MAX + 1)
    held = np.sort((old + keys).ravel())
    wanted = new + keys
    found = np.searchsorted(held, wanted).clip(max=held.size - 1)
    missing = held[found] != wanted
    if missing.any():
        layer, slot = np.argwhere(missing)[0]
        where = f"[{layer}, {slot}]" if layered else f"[{slot}]"
        raise ValueError(
            f"new_phy2log{where} = {new[layer, slot]} names an expert that no slot of old_phy2log holds"
            + (f" in layer {layer}" if layered else "")
        )
    return old, new, layered


def _pad(rows: list[list[int]], capacity: int, *, write_bound: int | None = None) -> np.ndarray:
    """Pads ragged index lists to ``int32 [len(rows), capacity]``.

    Read tables pad with row 0. Write tables (``write_bound`` = rows per rank)
    pad with distinct out-of-range rows ``write_bound + column``: the scatter
    drops them and may still promise unique indices.
    """
    if write_bound is None:
        out = np.zeros((len(rows), capacity), dtype=np.int32)
    else:
        out = np.tile(write_bound + np.arange(capacity, dtype=np.int32), (len(rows), 1))
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def plan_rearrangement(
    old_phy2log, new_phy2log, num_ranks: int, *, layer: int | None = None, num_logical: int | None = None
) -> TransportPlan:
    """Plans moving experts from ``old_phy2log`` to ``new_phy2log`` on ``num_ranks`` EP ranks.

    Both tables are ``[P]`` (one layer) or ``[L, P]``. With ``layer`` set, only
    that layer moves (the others keep the old placement), so moving layers one
    at a time gives the same result as moving all at once. ``num_logical``,
    when given, bounds the expert ids. See :class:`TransportPlan`.
    """
    old, new, layered = validate_placements(old_phy2log, new_phy2log, num_ranks, num_logical=num_logical)
    num_layers, num_slots = old.shape
    if layer is not None:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < num_layers:
            raise ValueError(f"layer must be an integer in [0, {num_layers}), got {layer!r}")
        keep = np.arange(num_layers) != layer
        new = np.where(keep[:, None], old, new)

    num_ranks = int(num_ranks)
    per_rank = num_slots // num_ranks
    num_rows = num_layers * per_rank
    rounds = num_ranks - 1
    written = old != new

    sends = [[[] for _ in range(rounds)] for _ in range(num_ranks)]  # sends[h][d - 1]: local rows
    recvs = [[[] for _ in range(rounds)] for _ in range(num_ranks)]  # recvs[r][d - 1]: first dst row
    dups = [[] for _ in range(num_ranks)]  # dups[r]: (dst row, first dst row of the same received expert)
    copies = [[] for _ in range(num_ranks)]  # copies[r]: (dst row, src row)
    moves = []
    sent_total = [0] * num_ranks

    rank_of_slot = np.arange(num_slots) // per_rank
    for lyr in np.flatnonzero(written.any(axis=1)).tolist():
        o, n = old[lyr], new[lyr]
        # first_slot[e][r]: the lowest old slot of rank r holding expert e (-1 if none)
        width = int(max(o.max(), n.max())) + 1
        table = np.full((width, num_ranks), num_slots, dtype=np.int64)
        np.minimum.at(table, (o, rank_of_slot), np.arange(num_slots))
        first_slot = np.where(table == num_slots, -1, table).tolist()
        base = lyr * per_rank
        first_dst = {}  # (rank, expert) -> the row that receives it
        for p, expert in zip(np.flatnonzero(written[lyr]).tolist(), n[written[lyr]].tolist()):
            rank = p // per_rank
            dst_row = base + p - rank * per_rank
            holds = first_slot[expert]
            if holds[rank] >= 0:
                copies[rank].append((dst_row, base + holds[rank] - rank * per_rank))
                continue
            key = (rank, expert)
            if key in first_dst:
                dups[rank].append((dst_row, first_dst[key]))
                continue
            # Spread: the holder with the fewest rows in this round, then in total, then the nearest.
            best, best_key = -1, None
            for h in range(num_ranks):
                if holds[h] >= 0:
                    d = (rank - h) % num_ranks
                    h_key = (len(sends[h][d - 1]), sent_total[h], d)
                    if best_key is None or h_key < best_key:
                        best, best_key = h, h_key
            d = (rank - best) % num_ranks
            src_slot = holds[best]
            sends[best][d - 1].append(base + src_slot - best * per_rank)
            recvs[rank][d - 1].append(dst_row)
            sent_total[best] += 1
            first_dst[key] = dst_row
            moves.append((lyr, expert, src_slot, rank))

    send_count = np.array([[len(s) for s in per] for per in sends], dtype=np.int64).reshape(num_ranks, rounds)
    capacity = bucket_capacity(int(send_count.max()) if send_count.size else 0)
    dup_cap = bucket_capacity(max(len(x) for x in dups))
    copy_cap = bucket_capacity(max(len(c) for c in copies))

    send_rows = np.zeros((num_ranks, rounds, capacity), dtype=np.int32)
    # Padding of received rows: distinct out-of-range rows, dropped by the scatter.
    recv_dst = np.tile(
        num_rows + np.arange(rounds * capacity, dtype=np.int32).reshape(rounds, capacity), (num_ranks, 1, 1)
    )
    for r in range(num_ranks):
        for d in range(rounds):
            send_rows[r, d, : len(sends[r][d])] = sends[r][d]
            recv_dst[r, d, : len(recvs[r][d])] = recvs[r][d]
    dup_dst = _pad([[x[0] for x in xr] for xr in dups], dup_cap, write_bound=num_rows)
    dup_src = _pad([[x[1] for x in xr] for xr in dups], dup_cap)
    copy_dst = _pad([[c[0] for c in cr] for cr in copies], copy_cap, write_bound=num_rows)
    copy_src = _pad([[c[1] for c in cr] for cr in copies], copy_cap)

    return TransportPlan(
        num_ranks=num_ranks,
        num_layers=num_layers,
        num_slots=num_slots,
        layered=layered,
        send_rows=send_rows,
        send_count=send_count,
        recv_dst=recv_dst,
        dup_dst=dup_dst,
        dup_src=dup_src,
        dup_count=np.array([len(x) for x in dups], dtype=np.int64),
        copy_dst=copy_dst,
        copy_src=copy_src,
        copy_count=np.array([len(c) for c in copies], dtype=np.int64),
        written=written,
        moves=np.array(moves, dtype=np.int64).reshape(-1, 4),
    )


def plan_layer_by_layer(
    old_phy2log, new_phy2log, num_ranks: int, *, num_logical: int | None = None
) -> list[tuple[int, TransportPlan]]:
    """One plan per layer that changes, ``[(layer, plan), ...]``, all padded to the same capacities.

    Running them in order (e.g. one between two forward steps) gives the same
    result as moving all layers at once, and they share one compiled executor.
    """
    old, new, layered = validate_placements(old_phy2log, new_phy2log, num_ranks, num_logical=num_logical)
    if not layered:
        raise ValueError("plan_layer_by_layer needs [L, P] placements")
    changed = np.flatnonzero((old != new).any(axis=1)).tolist()
    plans = [(layer, plan_rearrangement(old, new, num_ranks, layer=layer)) for layer in changed]
    if not plans:
        return []
    send, dup, copy = (max(plan.capacities[i] for _, plan in plans) for i in range(3))
    return [(layer, plan.padded(send=send, dup=dup, copy=copy)) for layer, plan in plans]

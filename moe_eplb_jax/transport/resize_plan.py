"""Host-side planning of a move between EP sizes: ``G`` ranks and ``P`` slots to ``G'`` ranks and ``P'`` slots.

The devices of both groups form one *union* (members in a fixed order: the
old ranks that survive, in old rank order, then the new ranks on devices new
to the group, in new rank order). Member ``u`` reads its old shard (``L * P /
G`` rows, ``l * P / G + j``; none for a new device) and writes its new shard
(``L * P' / G'`` rows, ``l * P' / G' + j'``; none for a device that leaves).
Each new slot is filled once:

* a local copy -- its device held the expert (in that layer) before;
* a receive -- from a surviving member that held it, each (member, layer,
  expert) received once, from the holder with the fewest rows in that round
  (then in total, then the nearest); further slots of it on that device are
  duplicates of the first;
* a reload -- no surviving member holds it (its ranks were lost): its rows
  come from the host (a checkpoint), once per (member, layer, expert), only
  when the caller offers to reload.

Transfers run in ``U - 1`` rounds; in round ``d`` member ``u`` sends to ``(u +
d) % U``. Table shapes are padded to ``bucket_capacity``. The plan is a pure
function of its inputs: every process computes the same plan.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moe_eplb_jax._checks import check_int
from moe_eplb_jax.policy.resize import rank_map
from moe_eplb_jax.transport.plan import bucket_capacity

__all__ = ["ResizePlan", "plan_resize", "missing_experts", "union_members"]


@dataclasses.dataclass(frozen=True)
class ResizePlan:
    """Index tables of one move between EP sizes (numpy, identical on every process).

    ``members [U, 2]``: each union member's ``(old rank, new rank)``, ``-1``
    where it has none. Per member (leading axis ``U``; ``C`` / ``K`` / ``D`` /
    ``Q`` padded capacities; write padding is distinct rows ``>=
    new_local_rows``, dropped; read padding is row 0):

    * ``send_rows [U, U - 1, C]`` old rows member ``u`` sends in round ``d``
      (index ``d - 1``) to member ``(u + d) % U``; ``send_count [U, U - 1]``;
    * ``recv_dst [U, U - 1, C]`` the new row member ``u`` writes with the
      ``i``-th row it receives in round ``d`` (from member ``(u - d) % U``);
    * ``copy_src`` / ``copy_dst [U, K]`` local copies, old row to new row;
    * ``reload_dst [U, Q]`` new rows written from the host, and
      ``reload_experts [U, Q, 2]`` the ``(layer, expert)`` each reads
      (``-1`` padding); ``reload_count [U]``;
    * ``dup_src`` / ``dup_dst [U, D]`` further slots of a received or
      reloaded expert, copied from its first new row at the end.

    ``moves [M, 4]``: ``(layer, expert, old slot, new rank)`` per received
    row; ``missing [K, 2]``: ``(layer, expert)`` no surviving rank holds
    (each reloaded once on every device that needs it: ``reload_count.sum() >= K``).
    """

    num_ranks: int
    new_num_ranks: int
    num_layers: int
    num_slots: int
    new_num_slots: int
    layered: bool
    members: np.ndarray
    send_rows: np.ndarray
    send_count: np.ndarray
    recv_dst: np.ndarray
    copy_src: np.ndarray
    copy_dst: np.ndarray
    copy_count: np.ndarray
    reload_dst: np.ndarray
    reload_experts: np.ndarray
    reload_count: np.ndarray
    dup_src: np.ndarray
    dup_dst: np.ndarray
    dup_count: np.ndarray
    moves: np.ndarray
    missing: np.ndarray

    @property
    def num_members(self) -> int:
        return int(self.members.shape[0])

    @property
    def old_local_rows(self) -> int:
        """Rows of one old shard: ``L * P / G``."""
        return self.num_layers * (self.num_slots // self.num_ranks)

    @property
    def new_local_rows(self) -> int:
        """Rows of one new shard: ``L * P' / G'``."""
        return self.num_layers * (self.new_num_slots // self.new_num_ranks)

    @property
    def capacities(self) -> tuple[int, int, int, int]:
        """``(C, K, Q, D)``: send, copy, reload and duplicate capacities (they fix the compiled shapes)."""
        send, copy, reload, dup = (
            int(t.shape[-1]) for t in (self.send_rows, self.copy_dst, self.reload_dst, self.dup_dst)
        )
        return send, copy, reload, dup

    @property
    def rows_sent(self) -> np.ndarray:
        """``[U]`` rows each member sends over the network."""
        return self.send_count.sum(axis=1)

    @property
    def rows_received(self) -> np.ndarray:
        """``[U]`` rows each member receives over the network (each missing (layer, expert) once)."""
        return self.recv_count.sum(axis=1)

    @property
    def recv_count(self) -> np.ndarray:
        """``[U, U - 1]`` rows member ``u`` receives in round ``d`` (index ``d - 1``), from member ``(u - d) % U``."""
        rounds = np.arange(1, self.num_members)
        senders = (np.arange(self.num_members)[:, None] - rounds[None, :]) % self.num_members
        return self.send_count[senders, rounds[None, :] - 1]

    @property
    def rows_moved(self) -> int:
        """Rows that cross the network, in total."""
        return int(self.send_count.sum())

    def bytes_moved(self, row_bytes: int) -> int:
        """The most bytes any member sends or receives, for rows of ``row_bytes`` bytes."""
        if self.num_members == 1:
            return 0
        return int(max(self.rows_sent.max(), self.rows_received.max())) * int(row_bytes)

    def padded(self, send: int = 0, copy: int = 0, reload: int = 0, dup: int = 0) -> ResizePlan:
        """The same plan with its tables padded to at least these capacities, so that plans of several layers
        share one compiled executor (padding as :func:`plan_resize` pads: reads of row 0, dropped writes)."""
        caps = [max(a, b) for a, b in zip((send, copy, reload, dup), self.capacities)]
        if tuple(caps) == self.capacities:
            return self
        send, copy, reload, dup = caps
        rows, num_members = self.new_local_rows, self.num_members

        def grow(table, width, counts, pad):  # entries past each count are padding: rebuilt at the new width
            out = np.broadcast_to(pad, table.shape[:-1] + (width,)).copy()
            live = np.arange(width) < counts[..., None]
            out[..., : table.shape[-1]] = np.where(live[..., : table.shape[-1]], table, out[..., : table.shape[-1]])
            return out.astype(table.dtype)

        writes = lambda width: rows + np.arange(width, dtype=np.int32)
        rounds_pad = rows + np.arange((num_members - 1) * send, dtype=np.int32).reshape(num_members - 1, send)
        experts = np.full((num_members, reload, 2), -1, np.int64)
        experts[:, : self.reload_experts.shape[1]] = self.reload_experts
        return dataclasses.replace(
            self,
            send_rows=grow(self.send_rows, send, self.send_count, np.int32(0)),
            recv_dst=grow(self.recv_dst, send, self.recv_count, rounds_pad),
            copy_src=grow(self.copy_src, copy, self.copy_count, np.int32(0)),
            copy_dst=grow(self.copy_dst, copy, self.copy_count, writes(copy)),
            reload_dst=grow(self.reload_dst, reload, self.reload_count, writes(reload)),
            reload_experts=experts,
            dup_src=grow(self.dup_src, dup, self.dup_count, np.int32(0)),
            dup_dst=grow(self.dup_dst, dup, self.dup_count, writes(dup)),
        )

    def device_tables(self) -> dict[str, np.ndarray]:
        """The int32 tables the executor takes, each with a leading member axis ``[U, ...]``."""
        return {
            "send_rows": self.send_rows,
            "recv_dst": self.recv_dst,
            "copy_src": self.copy_src,
            "copy_dst": self.copy_dst,
            "reload_dst": self.reload_dst,
            "dup_src": self.dup_src,
            "dup_dst": self.dup_dst,
        }


def union_members(mapping: np.ndarray, new_num_ranks: int, lost: set[int]) -> np.ndarray:
    """``[U, 2]`` ``(old rank, new rank)`` of the union's members (see the module docstring)."""
    survivors = [(r, int(mapping[r])) for r in range(mapping.size) if r not in lost]
    taken = {new for _, new in survivors if new >= 0}
    joining = [(-1, n) for n in range(new_num_ranks) if n not in taken]
    return np.array(survivors + joining, dtype=np.int64).reshape(-1, 2)


def _tables(name: str, table, num_ranks: int) -> np.ndarray:
    arr = np.asarray(getattr(table, "phy2log", table))  # a Placement, or the table itself
    if arr.ndim not in (1, 2) or arr.size == 0:
        raise ValueError(f"{name} must have shape [P] or [L, P] with at least one slot, got {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integer expert ids, got dtype {arr.dtype}")
    if arr.shape[-1] % num_ranks:
        raise ValueError(f"{name} has {arr.shape[-1]} slots, not divisible by {num_ranks} ranks")
    if arr.min() < 0:
        where = tuple(int(i) for i in np.argwhere(arr < 0)[0])
        raise ValueError(f"{name}{list(where)} = {arr[where]} is not an expert id")
    return arr.astype(np.int64)


def missing_experts(old_phy2log, num_ranks: int, new_phy2log=None, *, lost_ranks=()) -> np.ndarray:
    """``[K, 2]`` ``(layer, expert)`` pairs held only by ``lost_ranks`` (and, given, named by ``new_phy2log``).

    These are the experts a move can only get from a checkpoint: no surviving
    rank holds a replica. ``old_phy2log`` is ``[L, P]`` (or ``[P]``: layer 0).
    """
    num_ranks = check_int("num_ranks", num_ranks, minimum=1)
    old = np.atleast_2d(_tables("old_phy2log", old_phy2log, num_ranks))
    lost = _lost(lost_ranks, num_ranks)
    per_rank = old.shape[1] // num_ranks
    alive = ~np.isin(np.arange(old.shape[1]) // per_rank, sorted(lost))
    width = int(old.max()) + 1
    if new_phy2log is not None:
        new = np.atleast_2d(np.asarray(getattr(new_phy2log, "phy2log", new_phy2log)))
        if new.shape[0] != old.shape[0] or new.dtype.kind not in "iu" or (new.size and new.min() < 0):
            raise ValueError(f"new_phy2log must be expert ids for {old.shape[0]} layers, got {new.dtype} {new.shape}")
        width = max(width, int(new.max()) + 1)
    held = np.zeros((old.shape[0], width), dtype=bool)
    rows = np.arange(old.shape[0])[:, None]
    held[np.broadcast_to(rows, old.shape)[:, alive], old[:, alive]] = True
    wanted = np.zeros_like(held)
    wanted[rows, old if new_phy2log is None else new] = True
    return np.argwhere(wanted & ~held).astype(np.int64)


def _lost(lost_ranks, num_ranks: int) -> set[int]:
    try:
        return {check_int("lost_ranks entry", r, minimum=0, maximum=num_ranks - 1) for r in lost_ranks}
    except TypeError:
        raise ValueError(f"lost_ranks must be a sequence of old rank ids, got {lost_ranks!r}") from None


def _missing_error(missing: np.ndarray, lost: set[int], layered: bool) -> ValueError:
    shown = ", ".join(f"(layer {lyr}, expert {e})" if layered else f"expert {e}" for lyr, e in missing[:16].tolist())
    more = f" and {len(missing) - 16} more" if len(missing) > 16 else ""
    return ValueError(
        f"{len(missing)} experts of the new placement have no replica outside the lost ranks {sorted(lost)}: "
        f"{shown}{more}. Pass reload= (e.g. transport.reload_from(checkpoint)) to load them from host arrays, "
        "or choose a placement without them"
    )


def plan_resize(
    old_phy2log,
    new_phy2log,
    num_ranks: int,
    new_num_ranks: int,
    *,
    new_rank_of_old,
    lost_ranks=(),
    reload: bool = False,
    num_logical: int | None = None,
) -> ResizePlan:
    """Plans moving experts from ``old_phy2log`` on ``num_ranks`` ranks to ``new_phy2log`` on ``new_num_ranks``.

    Tables are ``[L, P]`` and ``[L, P']`` (or ``[P]`` and ``[P']``: one
    layer); ``new_rank_of_old [G]`` is the new rank of each old rank's device
    (``-1``: it leaves); ``lost_ranks`` are old ranks whose bytes are gone.
    An expert of the new placement that only lost ranks held is reloaded from
    the host when ``reload``, else ``ValueError`` naming the experts (nothing
    else is checked after that). See :class:`ResizePlan`.
    """
    num_ranks = check_int("num_ranks", num_ranks, minimum=1)
    new_num_ranks = check_int("new_num_ranks", new_num_ranks, minimum=1)
    old = _tables("old_phy2log", old_phy2log, num_ranks)
    new = _tables("new_phy2log", new_phy2log, new_num_ranks)
    if old.ndim != new.ndim or (old.ndim == 2 and old.shape[0] != new.shape[0]):
        raise ValueError(f"old_phy2log {old.shape} and new_phy2log {new.shape} must both be [P] or [L, *] tables")
    layered = old.ndim == 2
    old, new = np.atleast_2d(old), np.atleast_2d(new)
    if num_logical is not None:
        num_logical = check_int("num_logical", num_logical, minimum=1)
        for name, table in (("old_phy2log", old), ("new_phy2log", new)):
            if table.max() >= num_logical:
                where = tuple(int(i) for i in np.argwhere(table >= num_logical)[0])
                raise ValueError(f"{name}{list(where)} = {table[where]} is outside the expert range [0, {num_logical})")
    lost = _lost(lost_ranks, num_ranks)
    if new_rank_of_old is None:
        raise ValueError("new_rank_of_old is required: the new rank of each old rank's device, -1 where it leaves")
    mapping = rank_map(num_ranks, new_num_ranks, new_rank_of_old=new_rank_of_old, lost_ranks=sorted(lost))
    missing = missing_experts(old, num_ranks, new, lost_ranks=lost)
    if missing.size and not reload:
        raise _missing_error(missing, lost, layered)

    members = union_members(mapping, new_num_ranks, lost)
    num_members, rounds = members.shape[0], members.shape[0] - 1
    num_layers, num_slots = old.shape
    per_rank, new_per_rank = num_slots // num_ranks, new.shape[1] // new_num_ranks
    new_rows = num_layers * new_per_rank
    member_of_old = {int(o): u for u, (o, _) in enumerate(members.tolist()) if o >= 0}
    member_of_new = {int(n): u for u, (_, n) in enumerate(members.tolist()) if n >= 0}

    sends = [[[] for _ in range(rounds)] for _ in range(num_members)]  # sends[u][d - 1]: old rows
    recvs = [[[] for _ in range(rounds)] for _ in range(num_members)]  # recvs[u][d - 1]: new rows
    copies = [[] for _ in range(num_members)]  # (src old row, dst new row)
    reloads = [[] for _ in range(num_members)]  # (dst new row, layer, expert)
    dups = [[] for _ in range(num_members)]  # (src new row, dst new row)
    moves, sent_total = [], [0] * num_members

    for layer in range(num_layers):
        # holders[e]: {member: its first old row holding expert e in this layer}
        holders: dict[int, dict[int, int]] = {}
        for p, expert in enumerate(old[layer].tolist()):
            u = member_of_old.get(p // per_rank)
            if u is not None:
                holders.setdefault(expert, {}).setdefault(u, layer * per_rank + p % per_rank)
        first_row = {}  # (member, expert) -> the new row that received or reloaded it
        for p, expert in enumerate(new[layer].tolist()):
            v = member_of_new[p // new_per_rank]
            dst = layer * new_per_rank + p % new_per_rank
            held = holders.get(expert, {})
            if v in held:
                copies[v].append((held[v], dst))
            elif (v, expert) in first_row:
                dups[v].append((first_row[(v, expert)], dst))
            elif not held:
                reloads[v].append((dst, layer, expert))
                first_row[(v, expert)] = dst
            else:
                h = min(
                    held, key=lambda h: (len(sends[h][(v - h) % num_members - 1]), sent_total[h], (v - h) % num_members)
                )
                d = (v - h) % num_members
                sends[h][d - 1].append(held[h])
                recvs[v][d - 1].append(dst)
                sent_total[h] += 1
                first_row[(v, expert)] = dst
                old_rank = int(members[h, 0])
                moves.append((layer, expert, old_rank * per_rank + held[h] - layer * per_rank, int(members[v, 1])))

    return ResizePlan(
        num_ranks=num_ranks,
        new_num_ranks=new_num_ranks,
        num_layers=num_layers,
        num_slots=num_slots,
        new_num_slots=int(new.shape[1]),
        layered=layered,
        members=members,
        moves=np.array(moves, dtype=np.int64).reshape(-1, 4),
        missing=missing,
        **_index_tables(sends, recvs, copies, reloads, dups, new_rows),
    )


def _index_tables(sends, recvs, copies, reloads, dups, new_rows: int) -> dict[str, np.ndarray]:
    """The per-member lists as padded int32 tables (write padding: distinct rows ``>= new_rows``, dropped)."""
    num_members, rounds = len(sends), len(sends) - 1
    send_count = np.array([[len(s) for s in per] for per in sends], dtype=np.int64).reshape(num_members, rounds)
    capacity = bucket_capacity(int(send_count.max()) if send_count.size else 0)
    send_rows = np.zeros((num_members, rounds, capacity), dtype=np.int32)
    padding = new_rows + np.arange(rounds * capacity, dtype=np.int32).reshape(rounds, capacity)
    recv_dst = np.tile(padding, (num_members, 1, 1))
    for u in range(num_members):
        for d in range(rounds):
            send_rows[u, d, : len(sends[u][d])] = sends[u][d]
            recv_dst[u, d, : len(recvs[u][d])] = recvs[u][d]

    def pad(lists, column, *, write):
        cap = bucket_capacity(max((len(x) for x in lists), default=0))
        if write:
            out = np.tile(new_rows + np.arange(cap, dtype=np.int32), (num_members, 1))
        else:
            out = np.zeros((num_members, cap), np.int32)
        for u, items in enumerate(lists):
            out[u, : len(items)] = [item[column] for item in items]
        return out

    reload_experts = np.full((num_members, bucket_capacity(max(len(x) for x in reloads)), 2), -1, dtype=np.int64)
    for u, items in enumerate(reloads):
        for k, (_, layer, expert) in enumerate(items):
            reload_experts[u, k] = (layer, expert)
    return dict(
        send_rows=send_rows,
        send_count=send_count,
        recv_dst=recv_dst,
        copy_src=pad(copies, 0, write=False),
        copy_dst=pad(copies, 1, write=True),
        copy_count=np.array([len(x) for x in copies], dtype=np.int64),
        reload_dst=pad(reloads, 0, write=True),
        reload_experts=reload_experts,
        reload_count=np.array([len(x) for x in reloads], dtype=np.int64),
        dup_src=pad(dups, 0, write=False),
        dup_dst=pad(dups, 1, write=True),
        dup_count=np.array([len(x) for x in dups], dtype=np.int64),
    )

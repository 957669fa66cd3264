"""``order_for_streaming``: a plan's transfers placed in chunks so the executor may overwrite rows while it sends.

The executor streams each round in chunks and writes the rows received in one chunk before later chunks are
packed; this module orders a ``TransportPlan`` (``plan.py``) so that no row's old bytes are sent after the chunk
that overwrites it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moe_eplb_jax.transport.plan import TransportPlan, bucket_capacity

__all__ = ["order_for_streaming"]


def order_for_streaming(plan: TransportPlan, num_chunks: int) -> TransportPlan:
    """The same moves, reordered so that the executor may overwrite rows while later chunks are still sent.

    The executor sends each round in ``num_chunks`` chunks of ``ceil(C /
    num_chunks)`` positions and writes the rows received in chunk ``c`` right
    after packing chunk ``c + 1``, so chunk ``c + 2`` is packed from rows that
    chunk ``c`` may have overwritten. That is exact if no row's old bytes are
    sent in a later chunk than the one that overwrites the row; this function
    places every transfer so. Transfers form chains (row ``b`` receives the
    old bytes of row ``a``, whose old bytes another row received...) that may
    close into cycles (a swap is a cycle of two); a transfer is placed no
    earlier than every transfer that reads its destination row, a cycle all in
    one chunk. Chunks fill greedily; where a dependency leaves a chunk short,
    padding follows and the capacity may grow (then to ``bucket_capacity``
    chunks, so later plans share shapes). Swaps, and every plan whose chains
    fit, keep ``num_chunks * ceil(C / num_chunks)`` positions per round.

    Local copies and duplicates are unaffected (the executor reads copy
    sources before the first write and writes copies and duplicates last).
    Returns a plan with ``chunk_bounds`` set; the input is not modified.
    Raises ``ValueError`` where a cycle has more transfers in one round than a
    chunk holds (one chunk, ``num_chunks=1``, always fits).
    """
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, (int, np.integer)) or num_chunks < 1:
        raise ValueError(f"num_chunks must be a positive integer, got {num_chunks!r}")
    if not isinstance(plan, TransportPlan):
        raise ValueError(f"plan must be a TransportPlan, got {type(plan).__name__}")
    g, rounds, capacity, rows = plan.num_ranks, plan.num_ranks - 1, plan.capacities[0], plan.num_local_rows
    num_chunks = int(num_chunks)
    chunk = max(1, -(-capacity // num_chunks))
    if rounds == 0 or capacity == 0:
        return dataclasses.replace(plan, chunk_bounds=tuple(c * chunk for c in range(num_chunks + 1)))

    # Transfers, read at the receivers (real entries: rows < num_local_rows, wherever they sit).
    recv_rank, k, pos = np.nonzero(plan.recv_dst < rows)
    send_rank = (recv_rank - (k + 1)) % g
    src = plan.send_rows[send_rank, k, pos].astype(np.int64)
    dst = plan.recv_dst[recv_rank, k, pos].astype(np.int64)
    lists = (send_rank * rounds + k).tolist()  # the (sender, round) list each transfer goes in
    count = len(lists)
    # parent[t]: the transfer that overwrites the row t reads (-1: the row is not received).
    by_dst = np.full(g * rows, -1, dtype=np.int64)
    by_dst[recv_rank * rows + dst] = np.arange(count)
    parent = by_dst[send_rank * rows + src].tolist()
    pending = np.bincount([p for p in parent if p >= 0], minlength=count).tolist()  # unplaced readers

    fill = [[] for _ in range(g * rounds)]  # fill[list][chunk]: positions taken
    chunk_of, slot, lower = [-1] * count, [0] * count, [0] * count

    def fits(lst, c, need):
        f = fill[lst]
        return (f[c] if c < len(f) else 0) + need <= chunk

    def take(t, c):
        f = fill[lists[t]]
        f.extend([0] * (c + 1 - len(f)))
        slot[t], chunk_of[t] = c * chunk + f[c], c  # past num_chunks where dependencies need more
        f[c] += 1

    def placed(t):  # the transfer overwriting the row t reads may not come before t
        p = parent[t]
        if p >= 0:
            lower[p] = max(lower[p], chunk_of[t])
            pending[p] -= 1
            return p if pending[p] == 0 else None
        return None

    # Readers first (the functional graph's trees, leaves up) ...
    ready = [t for t in range(count) if pending[t] == 0]
    while ready:
        t = ready.pop()
        c = lower[t]
        while not fits(lists[t], c, 1):
            c += 1
        take(t, c)
        p = placed(t)
        if p is not None:
            ready.append(p)
    # ... then the cycles left (every node left is on one): each in one chunk.
    for start in range(count):
        if chunk_of[start] >= 0:
            continue
        cycle, t = [start], parent[start]
        while t != start:
            cycle.append(t)
            t = parent[t]
        need = {}
        for t in cycle:
            need[lists[t]] = need.get(lists[t], 0) + 1
        if max(need.values()) > chunk:  # e.g. a rotation of many slots: it cannot be split
            raise ValueError(
                f"a cycle of {max(need.values())} transfers in one round does not fit in chunks of "
                f"{chunk} rows: use fewer chunks"
            )
        c = max(lower[t] for t in cycle)
        while not all(fits(lst, c, n) for lst, n in need.items()):
            c += 1
        for t in cycle:
            take(t, c)

    used = max(chunk_of, default=-1) + 1
    chunks = int(num_chunks) if used <= num_chunks else bucket_capacity(used)
    all_bounds = tuple(c * chunk for c in range(chunks + 1))
    new_capacity = all_bounds[-1]
    send_rows = np.zeros((g, rounds, new_capacity), dtype=np.int32)
    padding = rows + np.arange(rounds * new_capacity, dtype=np.int32).reshape(rounds, new_capacity)
    recv_dst = np.tile(padding, (g, 1, 1))  # distinct out-of-range rows, dropped by the scatter
    send_rows[send_rank, k, slot] = src
    recv_dst[recv_rank, k, slot] = dst
    return dataclasses.replace(plan, send_rows=send_rows, recv_dst=recv_dst, chunk_bounds=all_bounds)

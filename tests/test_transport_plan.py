"""Host move planning: minimal, correct, spread, bucketed, validated."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from moe_eplb_jax.transport import TransportPlan, bucket_capacity, plan_rearrangement
from moe_eplb_jax.transport.streaming import order_for_streaming


def apply_plan(plan: TransportPlan, content: np.ndarray) -> np.ndarray:
    """Pure numpy oracle of the executor: ``content [L, P, ...]`` after the plan's sends, copies, duplicates."""
    g, per_rank, rows = plan.num_ranks, plan.slots_per_rank, plan.num_local_rows
    layers = content.shape[0]
    local = [content[:, r * per_rank : (r + 1) * per_rank].reshape((rows,) + content.shape[2:]) for r in range(g)]
    new = [x.copy() for x in local]
    for r in range(g):  # every read is of the old rows
        for d in range(1, g):
            sender = (r - d) % g
            got = local[sender][plan.send_rows[sender, d - 1]]
            keep = plan.recv_dst[r, d - 1] < rows
            new[r][plan.recv_dst[r, d - 1][keep]] = got[keep]
        keep = plan.copy_dst[r] < rows
        new[r][plan.copy_dst[r][keep]] = local[r][plan.copy_src[r][keep]]
    for r in range(g):  # duplicates read the rows just written
        keep = plan.dup_dst[r] < rows
        new[r][plan.dup_dst[r][keep]] = new[r][plan.dup_src[r][keep]]
    out = np.stack([x.reshape((layers, per_rank) + content.shape[2:]) for x in new], axis=1)
    return out.reshape(content.shape)


def apply_streamed(plan: TransportPlan, content: np.ndarray) -> np.ndarray:
    """Numpy oracle of the executor's stream schedule: chunk c + 1 is packed before chunk c is written."""
    g, per_rank, rows, bounds = plan.num_ranks, plan.slots_per_rank, plan.num_local_rows, plan.chunk_bounds
    layers = content.shape[0]
    local = [
        content[:, r * per_rank : (r + 1) * per_rank].reshape((rows,) + content.shape[2:]).copy() for r in range(g)
    ]
    copied = [local[r][plan.copy_src[r]] for r in range(g)]  # copies read the old rows first
    capacity = plan.capacities[0]
    steps = len(bounds) - 1 if capacity and g > 1 else 0

    def pack(c):  # [sender][round]: the rows as they are now
        return [[local[h][plan.send_rows[h, d - 1, bounds[c] : bounds[c + 1]]] for d in range(1, g)] for h in range(g)]

    packed = pack(0) if steps else None
    for c in range(steps):
        following = pack(c + 1) if c + 1 < steps else None
        for r in range(g):
            for d in range(1, g):
                dst = plan.recv_dst[r, d - 1, bounds[c] : bounds[c + 1]]
                local[r][dst[dst < rows]] = packed[(r - d) % g][d - 1][dst < rows]
        packed = following
    for r in range(g):  # copies, then duplicates, last
        keep = plan.copy_dst[r] < rows
        local[r][plan.copy_dst[r][keep]] = copied[r][keep]
    for r in range(g):
        keep = plan.dup_dst[r] < rows
        local[r][plan.dup_dst[r][keep]] = local[r][plan.dup_src[r][keep]]
    out = np.stack([x.reshape((layers, per_rank) + content.shape[2:]) for x in local], axis=1)
    return out.reshape(content.shape)


def apply_put(plan: TransportPlan, content: np.ndarray) -> np.ndarray:
    """Numpy oracle of the executor's put schedule: per chunk every sender writes its packed rows into the
    receivers' rows (``send_dst``) while packing the next chunk, which the chunk's writes may not touch."""
    g, per_rank, rows, bounds = plan.num_ranks, plan.slots_per_rank, plan.num_local_rows, plan.chunk_bounds
    layers = content.shape[0]
    local = [
        content[:, r * per_rank : (r + 1) * per_rank].reshape((rows,) + content.shape[2:]).copy() for r in range(g)
    ]
    copied = [local[r][plan.copy_src[r]] for r in range(g)]
    send_dst = plan.send_dst
    steps = len(bounds) - 1 if plan.capacities[0] and g > 1 else 0

    def pack(c):  # [sender, round]: the rows of chunk c as they are now, and which are real (not padding)
        part = slice(bounds[c], bounds[c + 1])
        return [
            [(local[h][plan.send_rows[h, d, part]], send_dst[h, d, part] < rows) for d in range(g - 1)]
            for h in range(g)
        ]

    packed = pack(0) if steps else None
    for c in range(steps):
        following = pack(c + 1) if c + 1 < steps else None
        for h in range(g):
            for d in range(1, g):
                dst = send_dst[h, d - 1, bounds[c] : bounds[c + 1]]
                mine, real = packed[h][d - 1]
                local[(h + d) % g][dst[real]] = mine[real]
        if following is not None:  # packed beside the writes: they did not change a real row of it
            for got, want in zip(sum(following, []), sum(pack(c + 1), [])):
                np.testing.assert_array_equal(got[0][got[1]], want[0][want[1]])
        packed = following
    for r in range(g):
        keep = plan.copy_dst[r] < rows
        local[r][plan.copy_dst[r][keep]] = copied[r][keep]
    for r in range(g):
        keep = plan.dup_dst[r] < rows
        local[r][plan.dup_dst[r][keep]] = local[r][plan.dup_src[r][keep]]
    out = np.stack([x.reshape((layers, per_rank) + content.shape[2:]) for x in local], axis=1)
    return out.reshape(content.shape)


def chunk_rows(plan: TransportPlan) -> int:
    return int(np.diff(plan.chunk_bounds).max())


def transfers(plan: TransportPlan) -> list[tuple[int, int, int, int]]:
    """Sorted ``(sender, source row, receiver, destination row)`` of every real transfer."""
    out = []
    for r, k, i in zip(*np.nonzero(plan.recv_dst < plan.num_local_rows)):
        h = (r - k - 1) % plan.num_ranks
        out.append((int(h), int(plan.send_rows[h, k, i]), int(r), int(plan.recv_dst[r, k, i])))
    return sorted(out)


@st.composite
def placements(draw):
    num_ranks = draw(st.sampled_from([1, 2, 4, 8]))
    per_rank = draw(st.integers(1, 4))
    num_slots = num_ranks * per_rank
    num_experts = draw(st.integers(1, num_slots))
    num_layers = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)

    def placement():
        extra = rng.integers(0, num_experts, num_slots - num_experts)
        return np.stack([rng.permutation(np.concatenate([np.arange(num_experts), extra])) for _ in range(num_layers)])

    old, new = placement(), placement()
    keep = rng.random(new.shape) < draw(st.floats(0, 1))  # some slots keep their expert
    return num_ranks, old, np.where(keep, old, new)


@given(placements())
def test_plan_reaches_the_new_placement(case):
    num_ranks, old, new = case
    plan = plan_rearrangement(old, new, num_ranks)
    # content of a slot = its expert id: after the plan every slot holds the new expert
    np.testing.assert_array_equal(apply_plan(plan, old), new)
    np.testing.assert_array_equal(plan.written, old != new)
    per_rank = old.shape[1] // num_ranks
    # each rank receives each (layer, expert) at most once, only if it held none, from a rank that held it
    seen = set()
    for layer, expert, src_slot, dst_rank in plan.moves:
        assert (layer, expert, dst_rank) not in seen
        seen.add((layer, expert, dst_rank))
        assert old[layer, src_slot] == expert
        assert src_slot // per_rank != dst_rank
        assert expert not in old[layer, dst_rank * per_rank : (dst_rank + 1) * per_rank]
    assert plan.rows_sent.sum() == plan.rows_received.sum() == len(plan.moves)
    # slots are written once and unchanged slots never
    written = np.concatenate([plan.recv_dst.reshape(num_ranks, -1), plan.copy_dst, plan.dup_dst], axis=1)
    for r in range(num_ranks):
        rows = written[r][written[r] < plan.num_local_rows]
        assert len(rows) == len(set(rows.tolist())) == plan.written[:, r * per_rank : (r + 1) * per_rank].sum()


@given(placements())
def test_moving_layer_by_layer_equals_moving_all(case):
    num_ranks, old, new = case
    content = old.copy()
    for layer in range(old.shape[0]):
        plan = plan_rearrangement(old, new, num_ranks, layer=layer)
        assert not plan.written[np.arange(old.shape[0]) != layer].any()
        content = apply_plan(plan, content)
    np.testing.assert_array_equal(content, new)


def test_unchanged_placement_moves_nothing(rng):
    old = np.stack([rng.permutation(np.arange(16) % 12) for _ in range(3)])
    plan = plan_rearrangement(old, old, 4)
    assert plan.is_empty and plan.capacities == (0, 0, 0)
    assert plan.moves.shape == (0, 4) and plan.bytes_moved(1000) == 0
    assert not plan.written.any()


def test_local_copy_instead_of_send():
    # rank 0 holds expert 2 in slot 1 and needs it in slot 0 as well: a local copy, nothing sent
    old = np.array([0, 2, 1, 3])
    new = np.array([2, 2, 1, 3])
    plan = plan_rearrangement(old, new, 2)
    assert plan.rows_sent.sum() == 0 and plan.copy_count.tolist() == [1, 0]
    assert plan.copy_dst[0, 0] == 0 and plan.copy_src[0, 0] == 1


def test_received_once_then_duplicated():
    # rank 1 needs expert 0 in both of its slots; it arrives once and is copied
    old = np.array([0, 1, 2, 3])
    new = np.array([0, 1, 0, 0])
    plan = plan_rearrangement(old, new, 2)
    assert plan.rows_received.tolist() == [0, 1]
    assert plan.dup_count.tolist() == [0, 1]
    np.testing.assert_array_equal(apply_plan(plan, old[None])[0], new)


def test_senders_spread_over_holders():
    # expert 0 lives on ranks 0 and 1; ranks 2 and 3 both need it: one row from each holder
    old = np.array([0, 1, 0, 2, 3, 4, 5, 6])
    new = np.array([0, 1, 0, 2, 0, 4, 0, 6])
    plan = plan_rearrangement(old, new, 4)
    assert sorted(plan.moves[:, 2] // 2) == [0, 1]
    assert plan.rows_sent.tolist() == [1, 1, 0, 0]


def test_bucket_capacity():
    sizes = np.arange(0, 5000)
    caps = np.array([bucket_capacity(n) for n in sizes])
    assert np.all(caps >= sizes) and np.all(np.diff(caps) >= 0)
    np.testing.assert_array_equal(caps[:32], sizes[:32])
    assert np.all(caps[32:] <= sizes[32:] * 17 / 16)
    assert len(set(caps[1000:2000].tolist())) <= 17  # few shapes per octave


def test_plans_are_deterministic_and_padded(rng):
    old = np.stack([rng.permutation(32) for _ in range(4)])
    new = np.stack([rng.permutation(32) for _ in range(4)])
    a, b = plan_rearrangement(old, new, 4), plan_rearrangement(old.copy(), new.copy(), 4)
    for name in ("send_rows", "recv_dst", "dup_dst", "dup_src", "copy_dst", "copy_src", "moves"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    c, d, k = a.capacities
    big = a.padded(send=c + 7, dup=d + 3, copy=k + 5)
    assert big.capacities == (c + 7, d + 3, k + 5)
    assert a.padded(send=1) is a
    content = old[..., None] * 10 + np.arange(3)  # rows that identify their expert
    np.testing.assert_array_equal(apply_plan(big, content), apply_plan(a, content))
    for table in (big.recv_dst.reshape(4, -1), big.dup_dst, big.copy_dst):  # padding: distinct, out of range
        for row in table:
            assert len(set(row.tolist())) == row.size


@pytest.mark.parametrize(
    "old, new, ranks, kwargs, match",
    [
        (np.zeros((2, 4)), np.zeros((2, 4)), 2, {}, "integer expert ids"),
        (np.zeros((2, 2, 4), int), np.zeros((2, 2, 4), int), 2, {}, r"shape \[P\] or \[L, P\]"),
        (np.arange(4), np.arange(8), 2, {}, "has shape"),
        (np.arange(6), np.arange(6), 4, {}, "not divisible by 4 ranks"),
        (np.array([0, 1, 2, -1]), np.array([0, 1, 2, 0]), 2, {}, r"old_phy2log\[3\] = -1"),
        (np.array([0, 1, 2, 3]), np.array([0, 1, 2, 7]), 2, {"num_logical": 4}, r"new_phy2log\[3\] = 7"),
        (np.array([[0, 1, 2, 3]]), np.array([[0, 1, 2, 2]]), 2, {"num_logical": 3}, r"old_phy2log\[0, 3\] = 3"),
        (np.array([[0, 1, 1, 3]]), np.array([[0, 1, 2, 3]]), 2, {}, r"no slot of old_phy2log holds in layer 0"),
        (np.arange(4), np.arange(4), 0, {}, "num_ranks must be >= 1"),
        (np.arange(4)[None], np.arange(4)[None], 2, {"layer": 1}, r"layer must be an integer in \[0, 1\)"),
    ],
)
def test_bad_placements_raise(old, new, ranks, kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_rearrangement(old, new, ranks, **kwargs)


# ------------------------------------------------------------ stream order
@given(placements(), st.sampled_from([1, 2, 3, 8]))
def test_streaming_order_moves_the_same_rows_and_is_exact(case, num_chunks):
    num_ranks, old, new = case
    plan = plan_rearrangement(old, new, num_ranks)
    try:
        ordered = order_for_streaming(plan, num_chunks)
    except ValueError as e:  # only a cycle longer than a chunk, never with one chunk
        assert num_chunks > 1 and "cycle" in str(e)
        return
    assert chunk_rows(ordered) == max(1, -(-plan.capacities[0] // num_chunks))
    assert ordered.capacities[0] >= plan.capacities[0] and ordered.capacities[1:] == plan.capacities[1:]
    assert transfers(ordered) == transfers(plan)
    np.testing.assert_array_equal(ordered.send_count, plan.send_count)
    for row in ordered.recv_dst.reshape(num_ranks, -1):  # padding stays distinct and out of range
        assert len(set(row.tolist())) == row.size
    np.testing.assert_array_equal(apply_streamed(ordered, old), new)
    np.testing.assert_array_equal(apply_put(ordered, old), new)
    np.testing.assert_array_equal(apply_plan(ordered, old), new)


def swap_placements(rng, layers=8, per_rank=16, count=4):
    old = np.stack([rng.permutation(2 * per_rank) for _ in range(layers)])
    new = old.copy()
    for layer in range(layers):
        a = rng.choice(per_rank, count, replace=False)
        b = per_rank + rng.choice(per_rank, count, replace=False)
        new[layer, a], new[layer, b] = old[layer, b], old[layer, a]
    return old, new


def test_swaps_stream_without_padding_and_need_the_order(rng):
    old, new = swap_placements(rng)
    plan = plan_rearrangement(old, new, 2)
    ordered = order_for_streaming(plan, 4)
    assert ordered.capacities == plan.capacities == (32, 0, 0)  # swaps (2-cycles) leave no gaps
    assert chunk_rows(ordered) == 8
    # every swap in one chunk: each row is received in the chunk that sends its old bytes
    chunk_of = {}
    for _h, _src, r, dst in transfers(ordered):
        i = int(np.flatnonzero(ordered.recv_dst[r, 0] == dst)[0])
        chunk_of[(r, dst)] = i // chunk_rows(ordered)
    for (r, dst), c in chunk_of.items():
        sender_pos = np.flatnonzero(ordered.send_rows[r, 0] == dst)
        assert c == sender_pos[0] // chunk_rows(ordered)
    np.testing.assert_array_equal(apply_streamed(ordered, old), new)
    # the planner's own order (a swap's two transfers at different positions), run in the stream schedule
    # in chunks of one row, reads rows already overwritten
    unordered = dataclasses.replace(plan, chunk_bounds=tuple(range(plan.capacities[0] + 1)))
    assert not np.array_equal(apply_streamed(unordered, old), new)
    with pytest.raises(AssertionError):  # the put schedule would pack rows its kernel is writing
        apply_put(unordered, old)
    np.testing.assert_array_equal(apply_streamed(order_for_streaming(plan, 32), old), new)  # chunks of 1


def test_chains_and_cycles_are_ordered():
    old = np.array([0, 1, 2, 3])  # two ranks of two slots
    new = np.array([2, 1, 0, 3])  # a 2-cycle: slot 0 <-> slot 2
    ordered = order_for_streaming(plan_rearrangement(old, new, 2), 1)
    np.testing.assert_array_equal(apply_streamed(ordered, old[None])[0], new)
    # a rotation 0 -> 2 -> 1 -> 3 -> 0 over two ranks: a 4-cycle, two transfers per round, one chunk only
    rot = np.array([3, 2, 0, 1])
    plan = plan_rearrangement(old, rot, 2)
    with pytest.raises(ValueError, match="cycle of 2 transfers"):
        order_for_streaming(plan, 2)
    np.testing.assert_array_equal(apply_streamed(order_for_streaming(plan, 1), old[None])[0], rot)
    # a chain: slot 2's old expert goes to slot 1, then slot 2 receives slot 0's (slot 1's expert is dropped)
    chain_new = np.array([0, 2, 0, 3])
    plan = plan_rearrangement(old, chain_new, 2)
    for n in (1, 2):
        np.testing.assert_array_equal(apply_streamed(order_for_streaming(plan, n), old[None])[0], chain_new)


def test_streaming_order_of_a_plan_without_transfers():
    plan = plan_rearrangement(np.array([0, 1, 2, 3]), np.array([1, 1, 2, 2]), 2).padded(send=4)  # copies only
    ordered = order_for_streaming(plan, 2)
    assert ordered.capacities == (4, 0, 1) and chunk_rows(ordered) == 2 and transfers(ordered) == []
    np.testing.assert_array_equal(apply_streamed(ordered, np.arange(4)[None])[0], [1, 1, 2, 2])


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_streaming_order_rejects_bad_chunks(bad):
    plan = plan_rearrangement(np.arange(4), np.array([2, 1, 0, 3]), 2)
    with pytest.raises(ValueError, match="num_chunks must be a positive integer"):
        order_for_streaming(plan, bad)
    with pytest.raises(ValueError, match="must be a TransportPlan"):
        order_for_streaming("plan", 1)

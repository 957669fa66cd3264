"""Expert transport on a CPU mesh: rearranging equals loading the permuted checkpoint, byte for byte."""

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from _bytes import random_bytes
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from moe_eplb_jax import Placement
from moe_eplb_jax import transport as eps
from moe_eplb_jax.transport import _executor, _nvlink, _row_copy
from moe_eplb_jax.transport.packing import byte_rows_numpy
from moe_eplb_jax.transport.streaming import order_for_streaming

DTYPES = [
    np.float32,
    ml_dtypes.bfloat16,
    np.float16,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e8m0fnu,
    ml_dtypes.float4_e2m1fn,
    np.int8,
    np.uint8,
    np.int32,
]


def checkpoint(rng, layers, experts, dtypes=DTYPES, row=(2, 4)):
    """``{name: [L, E, *row]}``: one random row of bytes per (layer, logical expert)."""
    return {f"{np.dtype(d).name}": random_bytes(rng, d, (layers, experts) + row) for d in dtypes}


def load(ckpt, phy2log):
    """The expert arrays a placement gives when loaded from the checkpoint: ``[L, P, ...]`` or ``[P, ...]``."""
    table = np.atleast_2d(phy2log)
    out = {k: v[np.arange(table.shape[0])[:, None], table] for k, v in ckpt.items()}
    return out if np.ndim(phy2log) == 2 else {k: v[0] for k, v in out.items()}


def assert_bytes_equal(actual, expected, num_lead):
    assert set(actual) == set(expected)
    for k in expected:
        got = np.asarray(actual[k])
        assert got.dtype == expected[k].dtype and got.shape == expected[k].shape, k
        np.testing.assert_array_equal(byte_rows_numpy(got, num_lead), byte_rows_numpy(expected[k], num_lead), k)


def random_placement(rng, layers, experts, slots):
    extra = rng.integers(0, experts, slots - experts)
    return np.stack([rng.permutation(np.concatenate([np.arange(experts), extra])) for _ in range(layers)])


@functools.cache
def mesh_of(num_ranks):
    return eps.ep_mesh(num_ranks)


# ------------------------------------------------------------------ contract
FLOATS = [
    np.float32,
    ml_dtypes.bfloat16,
    np.float16,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e8m0fnu,
    ml_dtypes.float4_e2m1fn,
]


@pytest.fixture
def as_if_on_gpus(monkeypatch):
    """The executor's GPU-only candidates on this CPU: the Pallas row copies (interpret mode here), not the put
    kernel (the Mosaic GPU interpreter has no peer writes); a fresh record of kernels that failed."""
    monkeypatch.setattr(_executor, "_on_gpus", lambda mesh: True)
    monkeypatch.setattr(_nvlink, "can_put", lambda widths, devices: False)
    monkeypatch.setattr(_executor, "_FAILED_KERNELS", set())


@st.composite
def moves(draw):
    num_ranks = draw(st.sampled_from([1, 2, 4, 8]))
    layered = draw(st.booleans())
    num_slots = 3 * num_ranks
    num_experts = draw(st.integers(max(1, num_slots // 3), num_slots))
    seed = draw(st.integers(0, 2**31 - 1))
    keep = draw(st.floats(0, 0.9))
    row = draw(st.sampled_from([(2, 4), (2, 3)]))  # every row whole uint32 words / some rows odd bytes
    num_chunks = draw(st.sampled_from([None, 1, 2, 3]))  # None: the executor's own ordering
    return num_ranks, layered, num_experts, seed, keep, row, num_chunks


def check_move(case, dtypes):
    """Moves a random checkpoint of ``dtypes`` (special values drawn often) to a random placement; bytes equal."""
    num_ranks, layered, num_experts, seed, keep, row, num_chunks = case
    rng = np.random.default_rng(seed)
    layers, num_slots = (2 if layered else 1), 3 * num_ranks
    ckpt = checkpoint(rng, layers, num_experts, dtypes=dtypes, row=row)
    old = random_placement(rng, layers, num_experts, num_slots)
    new = random_placement(rng, layers, num_experts, num_slots)
    new = np.where(rng.random(new.shape) < keep, old, new)
    if not layered:
        old, new = old[0], new[0]
    mesh = mesh_of(num_ranks)
    experts = eps.shard_slots(load(ckpt, old), mesh, layered=layered)
    # few compiled executors: every plan padded to the largest possible capacities
    rows = layers * 3
    plan = eps.plan_rearrangement(old, new, num_ranks).padded(send=rows, dup=rows, copy=rows)
    if num_chunks is not None:
        plan = streamable(plan, num_chunks) or plan
    moved = eps.execute_plan(experts, plan, mesh=mesh)
    assert_bytes_equal(moved, load(ckpt, new), 2 if layered else 1)
    for k, leaf in moved.items():
        assert leaf.sharding.is_equivalent_to(experts[k].sharding, leaf.ndim)


@settings(max_examples=8)
@given(moves())
def test_rearranged_bytes_equal_permuted_checkpoint(case):
    """Every float dtype's subnormals, signed zeros and NaN payloads (and integers, bools) arrive bit for bit."""
    check_move(case, FLOATS + [np.int8, np.uint8, np.int32, np.bool_])


@pytest.mark.slow
@settings(max_examples=6)
@given(moves())
def test_rearranged_bytes_equal_permuted_checkpoint_with_pallas_copies(case):
    """The same contract through the stream schedule's Pallas row copies (interpret mode on this CPU)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_executor, "_on_gpus", lambda mesh: True)
        patch.setattr(_nvlink, "can_put", lambda widths, devices: False)
        check_move(case, FLOATS)


SUB_BYTE = [ml_dtypes.float4_e2m1fn, ml_dtypes.int4, ml_dtypes.uint4, ml_dtypes.int2, ml_dtypes.uint2]
ONE_BYTE = [
    np.uint8,
    np.int8,
    np.bool_,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e8m0fnu,
    ml_dtypes.float8_e4m3fnuz,
    ml_dtypes.float8_e5m2fnuz,
    ml_dtypes.float8_e4m3b11fnuz,
    ml_dtypes.float8_e3m4,
    ml_dtypes.float8_e4m3,
]
WIDER = [ml_dtypes.bfloat16, np.float16, np.float32, np.int32]


@st.composite
def mixed_leaf(draw, dtypes):
    """``(dtype, row shape)``: rows of 1 to 8 bytes (sub-byte elements fill whole bytes), words or not."""
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    width = jax.dtypes.itemsize_bits(dtype)
    row_bytes = draw(st.sampled_from([1, 2, 3, 4, 6, 8]).filter(lambda b: b * 8 % width == 0))
    elements = row_bytes * 8 // width
    split = draw(st.booleans()) and elements % 2 == 0
    return dtype, ((2, elements // 2) if split else (elements,))


@st.composite
def mixed_moves(draw, max_ranks=8, max_per_rank=3):
    """A move of a pytree that mixes a sub-byte leaf, a byte leaf and up to two more of any dtype, with 1 to
    ``max_per_rank`` slots per rank."""
    num_ranks = draw(st.sampled_from([g for g in (1, 2, 4, 8) if g <= max_ranks]))
    per_rank = draw(st.integers(1, max_per_rank))
    num_slots = num_ranks * per_rank
    leaves = [draw(mixed_leaf(SUB_BYTE)), draw(mixed_leaf(ONE_BYTE))]
    leaves += draw(st.lists(mixed_leaf(SUB_BYTE + ONE_BYTE + WIDER), max_size=2))
    order = draw(st.permutations(range(len(leaves))))
    return dict(
        num_ranks=num_ranks,
        num_slots=num_slots,
        num_experts=draw(st.integers(max(1, num_slots // 2), num_slots)),
        layered=draw(st.booleans()),
        leaves=[leaves[i] for i in order],
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def check_mixed_move(case):
    """Moves a random pytree of mixed leaves to a random placement and back; bytes equal both ways."""
    rng = np.random.default_rng(case["seed"])
    layered, num_ranks, num_experts, num_slots = (
        case["layered"],
        case["num_ranks"],
        case["num_experts"],
        case["num_slots"],
    )
    layers = 2 if layered else 1
    ckpt = {
        f"{i}_{dtype.name}": random_bytes(rng, dtype, (layers, num_experts) + row)
        for i, (dtype, row) in enumerate(case["leaves"])
    }
    old = random_placement(rng, layers, num_experts, num_slots)
    new = random_placement(rng, layers, num_experts, num_slots)
    if not layered:
        old, new = old[0], new[0]
    mesh = mesh_of(num_ranks)
    moved = eps.rearrange_experts(eps.shard_slots(load(ckpt, old), mesh, layered=layered), old, new, mesh=mesh)
    assert_bytes_equal(moved, load(ckpt, new), 2 if layered else 1)
    back = eps.rearrange_experts(moved, new, old, mesh=mesh)
    assert_bytes_equal(back, load(ckpt, old), 2 if layered else 1)


@pytest.mark.parametrize("layered", [False, True], ids=["[P]", "[L, P]"])
def test_every_dtype_in_one_pytree_with_one_slot_per_rank(layered, rng):
    """Every sub-byte, byte, 16-bit and 32-bit dtype in one pytree, rows of words and of odd bytes, on ranks
    that hold one slot each: the bitcasts of the packing step compile (XLA folded a widening and a narrowing
    bitcast into one of the wrong shape where the gather between them vanished) and every byte arrives."""
    shapes = {2: (12,), 4: (2, 3), 8: (3,), 16: (3,), 32: (1,)}
    dtypes = SUB_BYTE + ONE_BYTE + WIDER
    leaves = [(np.dtype(d), shapes[jax.dtypes.itemsize_bits(np.dtype(d))]) for d in dtypes]
    leaves += [(np.dtype(ml_dtypes.float4_e2m1fn), (8,)), (np.dtype(ml_dtypes.bfloat16), (2,))]  # word rows
    check_mixed_move(
        dict(num_ranks=4, num_slots=4, num_experts=3, layered=layered, leaves=leaves, seed=int(rng.integers(2**31)))
    )


@settings(max_examples=6)
@given(mixed_moves(max_ranks=4, max_per_rank=2))
def test_mixed_pytrees_move_exactly(case):
    check_mixed_move(case)


@pytest.mark.slow
@settings(max_examples=40)
@given(mixed_moves())
def test_mixed_pytrees_move_exactly_many(case):
    check_mixed_move(case)


@pytest.mark.slow
@settings(max_examples=10)
@given(mixed_moves(max_ranks=4))
def test_mixed_pytrees_move_exactly_with_pallas_copies(case):
    """The same through the stream schedule's Pallas row copies where every leaf's rows are words."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_executor, "_on_gpus", lambda mesh: True)
        patch.setattr(_nvlink, "can_put", lambda widths, devices: False)
        check_mixed_move(case)


def float_ops(hlo: str) -> set[str]:
    """Opcodes of the HLO instructions that produce a float (fusions aside: their bodies are listed too)."""
    floats = re.compile(r"\b(?:bf16|f16|f32|f64|f8e\w+|f4e\w+)\[")
    found = set()
    for line in hlo.splitlines():
        m = re.match(r"\s+(?:ROOT )?%?[\w.\-]+ = (.*?) ([a-z][a-z0-9\-]*)\(", line)
        if m and floats.search(m.group(1)) and m.group(2) != "fusion":
            found.add(m.group(2))
    return found


@pytest.mark.parametrize("layered", [False, True], ids=["[P]", "[L, P]"])
def test_no_float_op_touches_expert_bytes(layered, rng):
    """The compiled executor sees the leaves' float dtypes in its parameters and the bitcasts into and out of
    unsigned row views only: no gather, scatter, select, concatenate or copy of a float (XLA:CPU flushes
    bfloat16 subnormals in float ops on some CPUs; integer ops are exact everywhere)."""
    layers, num_ranks = (2 if layered else 1), 2
    ckpt = checkpoint(rng, layers, 8, dtypes=FLOATS, row=(2, 3))
    ckpt.update({f"{k}_words": v for k, v in checkpoint(rng, layers, 8, dtypes=FLOATS, row=(2, 4)).items()})
    old, new = random_placement(rng, layers, 8, 8), random_placement(rng, layers, 8, 8)
    if not layered:
        old, new = old[0], new[0]
    experts = eps.shard_slots(load(ckpt, old), mesh_of(num_ranks), layered=layered)
    move = eps.prepare_move(experts, eps.plan_rearrangement(old, new, num_ranks), mesh=mesh_of(num_ranks))
    leaves = [experts[k] for k in sorted(experts)]
    hlo = move.run.lower(move.tables, leaves).compile().as_text()
    assert float_ops(hlo) <= {"parameter", "bitcast-convert", "bitcast", "tuple", "get-tuple-element"}
    assert "bitcast-convert" in float_ops(hlo)  # (the scan sees the floats where they are)
    assert_bytes_equal(move(experts), load(ckpt, new), 2 if layered else 1)


@pytest.mark.gpu
def test_on_the_gpu_no_float_op_and_no_copy_of_the_leaves(rng):
    """On this machine's GPUs (one is enough: a move within one rank is local copies): the executor moves
    unsigned integers only, and its temporary memory is the rows it moves, not a copy of the leaves (the
    bitcasts into and out of the row views are free)."""
    num_ranks, layers, per_rank = jax.device_count(), 4, 16
    num_slots = num_ranks * per_rank
    ckpt = checkpoint(rng, layers, num_slots, dtypes=FLOATS, row=(8, 256))
    old = np.stack([rng.permutation(num_slots) for _ in range(layers)])
    new = old.copy()
    new[:, [0, 1]] = old[:, [1, 0]]  # one swap per layer, inside rank 0: local copies only
    if num_ranks > 1:
        new[:, [2, per_rank + 2]] = old[:, [per_rank + 2, 2]]  # and one across ranks
    mesh = eps.ep_mesh(num_ranks)
    experts = eps.shard_slots(load(ckpt, old), mesh, layered=True)
    move = eps.prepare_move(experts, eps.plan_rearrangement(old, new, num_ranks), mesh=mesh)
    compiled = move.run.lower(move.tables, [experts[k] for k in sorted(experts)]).compile()
    assert float_ops(compiled.as_text()) <= {"parameter", "bitcast-convert", "bitcast", "tuple", "get-tuple-element"}
    leaf_bytes = sum(leaf.addressable_shards[0].data.nbytes for leaf in experts.values())
    assert compiled.memory_analysis().temp_size_in_bytes < 0.25 * leaf_bytes
    assert_bytes_equal(move(experts), load(ckpt, new), 2)


MIXED_DTYPES = [ml_dtypes.bfloat16, ml_dtypes.float8_e5m2, ml_dtypes.float4_e2m1fn, np.float32]


def layered_move(rng, num_ranks, layers, *, dtypes=MIXED_DTYPES, row=(3, 2)):
    """A checkpoint of 3 experts and 4 slots per rank, two random placements, the experts sharded as the first."""
    num_experts, num_slots = 3 * num_ranks, 4 * num_ranks
    ckpt = checkpoint(rng, layers, num_experts, dtypes=dtypes, row=row)
    old = random_placement(rng, layers, num_experts, num_slots)
    new = random_placement(rng, layers, num_experts, num_slots)
    mesh = mesh_of(num_ranks)
    return ckpt, old, new, mesh, eps.shard_slots(load(ckpt, old), mesh, layered=True)


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
def test_rearrange_experts_on_every_mesh_size(num_ranks, rng):
    ckpt, old, new, mesh, experts = layered_move(rng, num_ranks, 3)
    plan = eps.plan_rearrangement(old, new, num_ranks)
    assert plan.bytes_moved(eps.row_bytes(experts, layered=True)) == (
        max(plan.rows_sent.max(), plan.rows_received.max()) * (12 + 6 + 3 + 24) if num_ranks > 1 else 0
    )
    move = eps.prepare_move(experts, plan, mesh=mesh)
    assert move.schedule == "stream_xla_copies"  # no GPU here
    assert len(move.plan.chunk_bounds) - 1 == (max(1, min(8, plan.capacities[0])) if num_ranks > 1 else 1) or (
        streamable(plan, min(8, plan.capacities[0])) is None  # a cycle longer than 8 chunks allow: fewer, larger
    )
    assert_bytes_equal(move(experts), load(ckpt, new), 2)
    # a plan ordered ahead runs in its own chunks: as many as the plan's cycles allow
    ordered = next(p for p in map(functools.partial(streamable, plan), (4, 3, 2, 1)) if p is not None)
    experts = eps.shard_slots(load(ckpt, old), mesh, layered=True)
    move = eps.prepare_move(experts, ordered, mesh=mesh)
    assert move.plan.chunk_bounds == ordered.chunk_bounds
    assert_bytes_equal(move(experts), load(ckpt, new), 2)


def test_a_cycle_longer_than_a_chunk_streams_in_larger_chunks(rng):
    """Two ranks whose slots rotate through a cycle that alternates between them: four transfers of one round in
    one cycle per layer, more than 8 chunks of the plan hold, so the executor orders the plan in fewer, larger
    chunks (the same bytes arrive)."""
    layers, cycle = 2, [0, 4, 1, 5, 2, 6, 3, 7]  # slot cycle[i + 1] receives slot cycle[i]'s expert
    ckpt = checkpoint(rng, layers, 8, dtypes=[ml_dtypes.bfloat16], row=(2,))
    old = np.stack([rng.permutation(8) for _ in range(layers)])
    new = old.copy()
    new[:, np.roll(cycle, -1)] = old[:, cycle]
    plan = eps.plan_rearrangement(old, new, 2)
    assert plan.capacities[0] == 8 and streamable(plan, 8) is None and streamable(plan, 4) is None
    experts = eps.shard_slots(load(ckpt, old), mesh_of(2), layered=True)
    move = eps.prepare_move(experts, plan, mesh=mesh_of(2))
    assert move.plan.chunk_bounds == (0, 4, 8)  # two chunks of a whole cycle each
    assert_bytes_equal(move(experts), load(ckpt, new), 2)


@pytest.mark.parametrize("num_ranks", [2, pytest.param(8, marks=pytest.mark.slow)])
def test_pallas_row_copies_move_the_same_bytes(num_ranks, rng, as_if_on_gpus):
    """On GPUs the stream schedule packs and writes word rows with the Pallas kernels (interpret mode here)."""
    ckpt, old, new, mesh, experts = layered_move(rng, num_ranks, 2, row=(4, 2))
    move = eps.prepare_move(experts, eps.plan_rearrangement(old, new, num_ranks), mesh=mesh)
    assert move.schedule == "stream_pallas_copies"
    assert_bytes_equal(move(experts), load(ckpt, new), 2)
    odd_rows = checkpoint(rng, 2, 3 * num_ranks, dtypes=[ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn], row=(3,))
    odd = eps.shard_slots(load(odd_rows, old), mesh, layered=True)
    assert eps.prepare_move(odd, eps.plan_rearrangement(old, new, num_ranks), mesh=mesh).schedule == (
        "stream_xla_copies"  # byte rows: XLA's copies
    )


def test_kernels_that_cannot_run_fall_back_with_one_warning_each(rng, monkeypatch, as_if_on_gpus):
    """As if on GPUs whose Pallas backends are missing: the put kernel does not lower here (no GPU), the row
    copies raise as a jax without Pallas' Triton backend would; the move runs with XLA's copies, exactly, after
    one warning per kernel, and later moves warn no more."""
    monkeypatch.setattr(_nvlink, "can_put", lambda widths, devices: True)

    def missing(*args, **kwargs):
        raise ImportError("cannot import name 'triton' from 'jax.experimental.pallas'")

    monkeypatch.setattr(_row_copy, "gather_rows", missing)
    ckpt, old, new, mesh, experts = layered_move(rng, 2, 2, dtypes=[ml_dtypes.bfloat16, np.float32], row=(64,))
    with pytest.warns(RuntimeWarning) as caught:
        move = eps.prepare_move(experts, eps.plan_rearrangement(old, new, 2), mesh=mesh)
    messages = [str(w.message) for w in caught if "moe_eplb_jax.transport" in str(w.message)]
    assert len(messages) == 2
    assert "the put schedule cannot run here" in messages[0]
    assert "the stream_pallas_copies schedule cannot run here (ImportError" in messages[1]
    assert move.schedule == "stream_xla_copies"
    moved = move(experts)
    assert_bytes_equal(moved, load(ckpt, new), 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        back = eps.rearrange_experts(moved, new, old, mesh=mesh)
    assert_bytes_equal(back, load(ckpt, old), 2)


def test_prepared_move_forth_and_back(rng):
    """prepare_move ahead, run when due: the same bytes as execute_plan; a move may run again (forth and back)."""
    ckpt, old, new, mesh, experts = layered_move(rng, 4, 2, row=(4, 2))
    forth = eps.prepare_move(experts, eps.plan_rearrangement(old, new, 4), mesh=mesh)
    back = eps.prepare_move(experts, eps.plan_rearrangement(new, old, 4), mesh=mesh)
    assert isinstance(forth, eps.PreparedMove) and forth.tables is not None
    for _ in range(2):
        experts = forth(experts)
        assert_bytes_equal(experts, load(ckpt, new), 2)
        experts = back(experts)
        assert_bytes_equal(experts, load(ckpt, old), 2)


def test_prepared_move_checks_the_experts_it_gets(rng):
    """A prepared move refuses experts of another structure, shape, dtype or sharding, and deleted ones."""
    ckpt, old, new, mesh, experts = layered_move(rng, 2, 2, dtypes=[np.float32, ml_dtypes.bfloat16])
    move = eps.prepare_move(experts, eps.plan_rearrangement(old, new, 2), mesh=mesh)
    other_mesh = eps.shard_slots(load(ckpt, old), mesh_of(4), layered=True)
    bad = [
        ({"float32": experts["float32"]}, "structure"),
        ({**experts, "float32": experts["float32"][:, :4]}, "experts\\['float32'\\] is float32\\[2, 4, 3, 2\\]"),
        ({**experts, "bfloat16": experts["float32"]}, "experts\\['bfloat16'\\] .* prepared for bfloat16"),
        (other_mesh, "prepared for"),
    ]
    for value, message in bad:
        with pytest.raises(ValueError, match=message):
            move(value)
    moved = move(experts)  # (no host read of experts before: on CPU it would keep the buffers from donation)
    with pytest.raises(ValueError, match="deleted"):
        move(experts)
    assert_bytes_equal(moved, load(ckpt, new), 2)  # the refusals left the old experts as they were
    same = eps.prepare_move(moved, eps.plan_rearrangement(new, new, 2), mesh=mesh)  # nothing moves: identity
    assert same.tables is None and same(moved) is moved


def streamable(plan, num_chunks):
    """``plan`` ordered in ``num_chunks`` chunks, or None where a cycle of moves does not fit in one."""
    try:
        return order_for_streaming(plan, num_chunks)
    except ValueError:
        return None


def test_unchanged_placement_moves_nothing(rng):
    ckpt = checkpoint(rng, 2, 8, dtypes=[np.float32])
    old = random_placement(rng, 2, 8, 8)
    experts = eps.shard_slots(load(ckpt, old), mesh_of(4), layered=True)
    before = eps.executor_trace_count()
    plan = eps.plan_rearrangement(old, old.copy(), 4)
    assert plan.is_empty and plan.bytes_moved(32) == 0
    moved = eps.rearrange_experts(experts, old, old.copy(), mesh=mesh_of(4))
    assert moved["float32"] is experts["float32"] and not experts["float32"].is_deleted()
    assert eps.executor_trace_count() == before
    assert_bytes_equal(moved, load(ckpt, old), 2)


def swaps(rng, phy2log, per_rank, count):
    """Swaps ``count`` random slot pairs between rank 0 and rank 1 in every layer."""
    new = phy2log.copy()
    for layer in range(phy2log.shape[0]):
        a = rng.choice(per_rank, count, replace=False)
        b = per_rank + rng.choice(per_rank, count, replace=False)
        new[layer, a], new[layer, b] = phy2log[layer, b], phy2log[layer, a]
    return new


def test_same_buckets_do_not_recompile(rng):
    mesh = mesh_of(2)
    ckpt = checkpoint(rng, 2, 16, dtypes=[ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn])
    old = np.stack([rng.permutation(16) for _ in range(2)])
    experts = eps.shard_slots(load(ckpt, old), mesh, layered=True)
    new = swaps(rng, old, 8, 3)
    experts = eps.rearrange_experts(experts, old, new, mesh=mesh)
    traces = eps.executor_trace_count()
    for _ in range(3):  # different plans, same capacities
        old, new = new, swaps(rng, new, 8, 3)
        experts = eps.rearrange_experts(experts, old, new, mesh=mesh)
    assert eps.executor_trace_count() == traces
    assert_bytes_equal(experts, load(ckpt, new), 2)


def test_layer_by_layer_equals_all_at_once(rng):
    mesh = mesh_of(4)
    layers = 3
    ckpt = checkpoint(rng, layers, 6, dtypes=[ml_dtypes.float8_e5m2, np.int32])
    old, new = random_placement(rng, layers, 6, 8), random_placement(rng, layers, 6, 8)
    experts = eps.shard_slots(load(ckpt, old), mesh, layered=True)
    for layer in range(layers):
        experts = eps.rearrange_experts(experts, old, new, mesh=mesh, layer=layer)
        partial = np.where(np.arange(layers)[:, None] <= layer, new, old)
        assert_bytes_equal(experts, load(ckpt, partial), 2)
    everything = eps.rearrange_experts(eps.shard_slots(load(ckpt, old), mesh, layered=True), old, new, mesh=mesh)
    for k in ckpt:
        np.testing.assert_array_equal(
            byte_rows_numpy(np.asarray(experts[k]), 2), byte_rows_numpy(np.asarray(everything[k]), 2)
        )


def test_layer_plans_share_one_executor(rng):
    mesh = mesh_of(2)
    layers = 4
    ckpt = checkpoint(rng, layers, 6, dtypes=[ml_dtypes.bfloat16], row=(2, 2))
    old, new = random_placement(rng, layers, 6, 8), random_placement(rng, layers, 6, 8)
    new[1] = old[1]  # an unchanged layer gets no plan
    plans = eps.plan_layer_by_layer(old, new, 2)
    assert [layer for layer, _ in plans] == [0, 2, 3]
    assert len({plan.capacities for _, plan in plans}) == 1
    experts = eps.shard_slots(load(ckpt, old), mesh, layered=True)
    experts = eps.execute_plan(experts, plans[0][1], mesh=mesh)
    traces = eps.executor_trace_count()
    for _, plan in plans[1:]:
        experts = eps.execute_plan(experts, plan, mesh=mesh)
    assert eps.executor_trace_count() == traces
    assert_bytes_equal(experts, load(ckpt, new), 2)
    with pytest.raises(ValueError, match=r"needs \[L, P\]"):
        eps.plan_layer_by_layer(old[0], new[0], 2)


def test_donation_and_keep(rng):
    mesh = mesh_of(2)
    ckpt = checkpoint(rng, 1, 4, dtypes=[np.float32])
    old, new = np.array([0, 1, 2, 3]), np.array([2, 1, 0, 3])
    kept = eps.shard_slots(load(ckpt, old), mesh)
    moved = eps.rearrange_experts(kept, old, new, mesh=mesh, donate=False)
    assert not kept["float32"].is_deleted()
    assert_bytes_equal(kept, load(ckpt, old), 1)
    assert_bytes_equal(moved, load(ckpt, new), 1)
    donated = eps.shard_slots(load(ckpt, old), mesh)
    eps.rearrange_experts(donated, old, new, mesh=mesh)
    assert donated["float32"].is_deleted()


def test_two_axis_mesh(rng):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "ep"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    ckpt = checkpoint(rng, 2, 8, dtypes=[ml_dtypes.bfloat16], row=(4, 2))
    old, new = random_placement(rng, 2, 8, 8), random_placement(rng, 2, 8, 8)
    # slots over "ep", a trailing axis over "dp"
    sharding = NamedSharding(mesh, PartitionSpec(None, "ep", "dp"))
    host = load(ckpt, old)["bfloat16"]
    leaf = jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])
    moved = eps.rearrange_experts({"bfloat16": leaf}, old, new, mesh=mesh)
    assert moved["bfloat16"].sharding.is_equivalent_to(sharding, 4)
    assert_bytes_equal(moved, load(ckpt, new), 2)


# -------------------------------------------------------------- bad input
def bad_cases(mesh):
    good = np.array([[0, 1, 2, 3, 0, 1, 2, 3]])
    return {
        "wrong placement shape": (dict(new_phy2log=good[:, :4]), "has shape"),
        "ids out of range": (
            dict(new_phy2log=np.array([[0, 1, 2, 3, 0, 1, 2, 9]]), num_logical=4),
            r"new_phy2log\[0, 7\] = 9",
        ),
        "expert held by no old slot": (
            dict(old_phy2log=np.array([[0, 1, 2, 2, 0, 1, 2, 2]]), new_phy2log=np.array([[0, 1, 2, 3, 0, 1, 2, 3]])),
            "no slot of old_phy2log holds",
        ),
        "placement for another P": (dict(old_phy2log=good[:, :4], new_phy2log=good[:, :4]), "leading axes"),
        "not divisible": (
            dict(mesh=Mesh(np.array(jax.devices()[:3]), ("ep",)), old_phy2log=good, new_phy2log=good[:, ::-1]),
            "not divisible by 3 ranks",
        ),
        "no such axis": (dict(axis="tp"), "no axis 'tp'"),
        "one layer tables for [L, P] leaves": (dict(old_phy2log=good[0], new_phy2log=good[0, ::-1]), "leading axes"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "wrong placement shape",
        "ids out of range",
        "expert held by no old slot",
        "placement for another P",
        "not divisible",
        "no such axis",
        "one layer tables for [L, P] leaves",
    ],
)
def test_bad_input_raises_and_leaves_experts_untouched(case, rng):
    mesh = mesh_of(2)
    ckpt = checkpoint(rng, 1, 4, dtypes=[ml_dtypes.float8_e5m2, np.float32])
    good = np.array([[0, 1, 2, 3, 0, 1, 2, 3]])
    experts = eps.shard_slots(load(ckpt, good), mesh, layered=True)
    overrides, match = bad_cases(mesh)[case]
    kwargs = dict(old_phy2log=good, new_phy2log=good[:, ::-1], mesh=mesh)
    kwargs.update(overrides)
    traces = eps.executor_trace_count()
    with pytest.raises(ValueError, match=match):
        eps.rearrange_experts(experts, **kwargs)
    assert eps.executor_trace_count() == traces
    assert not any(leaf.is_deleted() for leaf in experts.values())
    assert_bytes_equal(experts, load(ckpt, good), 2)


def test_bad_leaves_raise_and_nothing_is_donated(rng):
    mesh = mesh_of(2)
    old, new = np.array([0, 1, 2, 3]), np.array([3, 2, 1, 0])
    good = eps.shard_slots({"w": random_bytes(rng, np.float32, (4, 3))}, mesh)["w"]
    replicated = jax.device_put(np.ones((4, 3), np.float32), NamedSharding(mesh, PartitionSpec()))
    on_trailing = jax.device_put(np.ones((4, 2), np.float32), NamedSharding(mesh, PartitionSpec(None, "ep")))
    cases = {
        "slot axis .* sharded over mesh axis 'ep'": replicated,
        "only the slot axis may be sharded|slot axis": on_trailing,
        "leading axes must be the slot axes": eps.shard_slots({"w": np.ones((8, 3), np.float32)}, mesh)["w"],
        "multiple of 2": eps.shard_slots({"w": random_bytes(rng, ml_dtypes.float4_e2m1fn, (4, 3))}, mesh)["w"],
        "concrete jax.Array": np.ones((4, 3), np.float32),
        "NamedSharding on the given mesh": jax.device_put(np.ones((4, 3), np.float32), jax.devices()[0]),
    }
    for match, bad in cases.items():
        with pytest.raises(ValueError, match=match):
            eps.rearrange_experts({"good": good, "bad": bad}, old, new, mesh=mesh)
        assert not good.is_deleted()
    with pytest.raises(ValueError, match="appears twice"):
        eps.rearrange_experts({"a": good, "b": good}, old, new, mesh=mesh)
    with pytest.raises(ValueError, match="donate must be a bool, got 'no'"):
        eps.rearrange_experts({"good": good}, old, new, mesh=mesh, donate="no")
    with pytest.raises(ValueError, match="layer must be an integer"):
        eps.rearrange_experts({"good": good}, old[None], new[None], mesh=mesh, layer=True)
    with pytest.raises(ValueError, match="plan must be a TransportPlan"):
        eps.prepare_move({"good": good}, "plan", mesh=mesh)
    with pytest.raises(ValueError, match="plan is for 4 ranks but mesh axis 'ep' has 2"):
        eps.prepare_move({"good": good}, eps.plan_rearrangement(np.arange(4), np.arange(4)[::-1], 4), mesh=mesh)
    assert not good.is_deleted()


# -------------------------------------------------------- schedule structure
def transfer_chain(hlo: str) -> tuple[int, int]:
    """``(longest chain of collective-permutes each depending on an earlier one, their number)`` in HLO text."""
    operands, transfers = {}, set()
    for line in hlo.splitlines():
        m = re.match(r"\s+(?:ROOT )?%?([\w.\-]+) = .*? ([a-z][a-z0-9\-]*)\(([^)]*)\)", line)
        if m:
            operands[m.group(1)] = re.findall(r"%?([A-Za-z_][\w.\-]*)", m.group(3))
            if m.group(2) == "collective-permute":
                transfers.add(m.group(1))
    memo = {}

    def depth(name):
        if name not in memo:
            memo[name] = 0
            memo[name] = max((depth(o) for o in operands.get(name, ())), default=0) + (name in transfers)
        return memo[name]

    return max(map(depth, transfers), default=0), len(transfers)


def test_transfers_wait_only_where_the_schedule_says(rng):
    """Chunk c + 1's transfer does not depend on chunk c's (only on chunk c - 1's, whose rows are written
    before c + 1 is packed): the longest chain of dependent transfers is half of them."""
    mesh = mesh_of(2)
    ckpt = checkpoint(rng, 4, 16, dtypes=[np.float32])
    old = np.stack([rng.permutation(16) for _ in range(4)])
    plan = order_for_streaming(eps.plan_rearrangement(old, swaps(rng, old, 8, 4), 2), 8)  # 8 chunks of 2 rows
    experts = eps.shard_slots(load(ckpt, old), mesh, layered=True)
    leaves, layouts, specs, _ = eps.transport._check_leaves(experts, plan, mesh, "ep")
    tables, table_layout = _executor.device_tables(plan, mesh, "ep", sender_destinations=False)
    key = (
        mesh,
        "ep",
        tuple(specs),
        tuple(layouts),
        2,
        True,
        plan.chunk_bounds,
        table_layout,
        "stream_xla_copies",
        None,
    )
    assert transfer_chain(_executor._jitted(*key).lower(tables, leaves).as_text(dialect="hlo")) == (4, 8)


# ---------------------------------------------------------- optimizer state
def test_adam_state_moves_with_params(rng):
    """Moving params and Adam moments gives the next update of a model built from the permuted checkpoint."""
    mesh = mesh_of(4)
    layers, num_experts, num_slots = 2, 6, 8
    ckpt = {
        "w": rng.standard_normal((layers, num_experts, 3, 4)).astype(np.float32),
        "b": rng.standard_normal((layers, num_experts, 4)).astype(np.float32),
    }
    old = random_placement(rng, layers, num_experts, num_slots)
    new = random_placement(rng, layers, num_experts, num_slots)
    opt = optax.adam(1e-2)

    def loss(params):  # per-slot terms only: a slot's gradient depends on its own expert
        return jnp.sum(jnp.sin(params["w"]) * params["w"]) + jnp.sum(params["b"] ** 2)

    @jax.jit
    def step(params, state):
        updates, state = opt.update(jax.grad(loss)(params), state, params)
        return optax.apply_updates(params, updates), state, updates

    def model(phy2log):
        params = eps.shard_slots(load(ckpt, phy2log), mesh, layered=True)
        params, state, _ = step(params, opt.init(params))
        return params, state

    with jax.numpy_dtype_promotion("standard"):  # optax relies on implicit promotion
        check_adam(mesh, ckpt, old, new, model, step)


def check_adam(mesh, ckpt, old, new, model, step):
    params, state = model(old)
    # the whole optax state moves with the params; its 0-d step count passes through
    num_experts = ckpt["w"].shape[1]
    moved = eps.rearrange_experts(
        {"params": params, "opt": state},
        Placement.from_phy2log(old, num_experts),
        Placement.from_phy2log(new, num_experts),
        mesh=mesh,
    )
    assert moved["opt"][0].count is state[0].count
    state = moved["opt"]
    _, _, updates = step(moved["params"], state)

    ref_params, ref_state = model(new)
    _, _, ref_updates = step(ref_params, ref_state)
    ours, ref = (
        jax.tree.leaves((moved["params"], updates, state)),
        jax.tree.leaves((ref_params, ref_updates, ref_state)),
    )
    assert len(ours) == len(ref) == 2 + 2 + 5
    for a, b in zip(ours, ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

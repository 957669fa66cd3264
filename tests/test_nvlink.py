"""The put schedule's NVLink kernel: copy pipeline (CPU interpreter), lowering, one parity body for the kernel
(2+ GPUs) and its jnp reference (simulated devices), real moves on 2+ GPUs."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _bytes import random_bytes
from jax.sharding import NamedSharding, PartitionSpec

from moe_eplb_jax import transport as eps
from moe_eplb_jax.transport import _executor, _nvlink
from moe_eplb_jax.transport.packing import byte_rows_numpy
from moe_eplb_jax.transport.streaming import order_for_streaming


def numpy_put(views, staged, dst, offsets):
    """The kernel's effect on one rank's own rows (``local=True``): row dst[k] of leaf i = staged[k, leaf i's words]."""
    out = [np.array(v) for v in views]
    for k, row in enumerate(dst):
        if 0 <= row < out[0].shape[0]:
            for v, offset in zip(out, offsets):
                v[row] = staged[k, offset : offset + v.shape[1]]
    return out


def test_copy_words():
    assert _nvlink.copy_words(65536) == 8192  # the largest multiple of 32 words dividing 65536 within 40 KiB
    assert _nvlink.copy_words(133120) == 10240
    assert _nvlink.copy_words(96) == 96
    assert _nvlink.copy_words(48) == 0  # not a multiple of 128 bytes: no TMA copy of whole rows
    assert _nvlink.copy_words(65536, max_copy_bytes=4096) == 1024
    assert not _nvlink.can_put([64], jax.devices()[:2]) or jax.default_backend() == "gpu"


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(num_programs=0), "num_programs must be an int >= 1"),
        (dict(stages=1), "stages must be at least 2"),
        (dict(stages=8, max_copy_bytes=40 * 1024), "exceeds .* shared memory"),
        (dict(num_programs=16, pack_programs=16), "pack_programs .* must leave writing programs"),
        (dict(pack_programs=2.5), "pack_programs must be an int >= 1"),
    ],
)
def test_config_validation_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        _nvlink.Config(**fields)


def test_config_for_a_device_takes_one_program_per_sm():
    class Device:
        core_count = 78

    assert _nvlink.config_for(Device()) == _nvlink.Config(num_programs=78)
    assert _nvlink.config_for(object()) == _nvlink.Config()  # a device that does not say: an H200's 132


@pytest.mark.parametrize(
    "programs, pack_programs, stages",
    [
        (2, 1, 2),
        (4, 1, 2),
        (3, None, 2),
        *(pytest.param(*case, marks=pytest.mark.slow) for case in [(8, 3, 3), (20, 9, 4)]),
    ],
)
def test_copy_pipeline_under_the_interpreter(programs, pack_programs, stages, rng):
    """Local mode (the rank's own rows; the interpreter has no remote refs): rows, chunks, padding, and the
    next chunk packed by the other programs (from the rows as they were), race-free."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as interp  # private; may move
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except ImportError:
        pytest.skip("the Mosaic GPU interpreter is not available")
    widths, num_rows = [64, 32, 96], 9
    offsets = np.cumsum([0] + widths[:-1]).tolist()
    views = [rng.integers(0, 2**32, (num_rows, w), dtype=np.uint32) for w in widths]
    staged = rng.integers(0, 2**32, (6, sum(widths)), dtype=np.uint32)
    dst = np.array([4, num_rows + 3, 0, 8, num_rows, 2], np.int32)  # two padding rows (out of range)
    following = np.array([1, 3, 5, 6, 7], np.int32)  # rows not written by this call
    got, packed = _nvlink.put_rows(
        jnp.asarray(staged),
        jnp.asarray(dst),
        [jnp.asarray(v) for v in views],
        None if pack_programs is None else jnp.asarray(following),
        axis="ep",
        num_ranks=2,
        rows_per_round=6,
        offsets=offsets,
        config=_nvlink.Config(num_programs=programs, pack_programs=pack_programs or 1, stages=stages),
        local=True,
        interpret=plgpu.InterpretGPUParams(detect_races=True),
    )
    assert not interp.get_races().races_found
    for g, want in zip(got, numpy_put(views, staged, dst, offsets)):
        np.testing.assert_array_equal(np.asarray(g), want)
    if pack_programs is None:
        assert packed is None
    else:
        np.testing.assert_array_equal(np.asarray(packed), np.concatenate([v[following] for v in views], axis=1))


def test_kernel_lowers_for_cuda_with_peer_addresses():
    """On CPU: the shard_mapped kernel exports for CUDA, takes peer addresses from XLA's collective metadata and
    writes the row views in place (aliased)."""
    mesh = jax.make_mesh((2,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    widths, rows, per_round = [2048, 64, 2048], 32, 8
    offsets = np.cumsum([0] + widths[:-1]).tolist()

    def move(staged, dst, following, *views):
        return _nvlink.put_rows(
            staged, dst, list(views), following, axis="ep", num_ranks=2, rows_per_round=per_round, offsets=offsets
        )

    spec = PartitionSpec("ep")
    fn = jax.jit(
        jax.shard_map(move, mesh=mesh, in_specs=(spec,) * 6, out_specs=([spec] * 3, spec), check_vma=False),
        donate_argnums=(3, 4, 5),
    )
    shard = NamedSharding(mesh, spec)
    args = [
        jax.ShapeDtypeStruct((2 * per_round, sum(widths)), jnp.uint32, sharding=shard),
        jax.ShapeDtypeStruct((2 * per_round,), jnp.int32, sharding=shard),
        jax.ShapeDtypeStruct((2 * per_round,), jnp.int32, sharding=shard),
    ] + [jax.ShapeDtypeStruct((2 * rows, w), jnp.uint32, sharding=shard) for w in widths]
    text = jax.export.export(fn, platforms=["cuda"])(*args).mlir_module()
    assert "mosaic_gpu_v2" in text and "uses_xla_collective_metadata = true" in text
    assert text.count("output_operand_alias") >= 3


def test_candidates_put_only_where_the_kernel_runs(monkeypatch):
    """The put kernel is a candidate on GPUs of this process, one EP axis, rows of a multiple of 128 bytes; the
    Pallas row copies wherever the rows are words on GPUs; XLA's copies always, last."""
    mesh = eps.ep_mesh(2)
    rows = lambda *row: {"w": np.zeros((2, 4) + row, np.uint8)}

    def candidates(experts, grid=mesh):
        experts = eps.shard_slots(experts, grid, layered=True) if grid is mesh else experts
        plan = eps.plan_rearrangement(np.zeros((2, 4), int), np.zeros((2, 4), int), 2)
        leaves, layouts, _, _ = eps.transport._check_leaves(experts, plan, grid, "ep")
        return [name for name, _ in _executor._candidates(plan, leaves, layouts, grid, "ep")]

    if jax.default_backend() != "gpu":
        assert candidates(rows(256)) == ["stream_xla_copies"]  # no GPUs: XLA's copies only
        monkeypatch.setattr(_executor, "_on_gpus", lambda mesh: True)  # as if on GPUs
        monkeypatch.setattr(_nvlink, "can_put", lambda widths, devices: all(_nvlink.copy_words(w) for w in widths))
    assert candidates(rows(256)) == ["put", "stream_pallas_copies", "stream_xla_copies"]
    assert candidates(rows(24)) == ["stream_pallas_copies", "stream_xla_copies"]  # 24 bytes: no TMA copy
    assert candidates(rows(6)) == ["stream_xla_copies"]  # byte rows
    grid = jax.make_mesh((2, 2), ("dp", "ep"), devices=jax.devices()[:4], axis_types=(jax.sharding.AxisType.Auto,) * 2)
    host = np.zeros((2, 4, 256), np.uint8)
    leaf = jax.device_put(host, jax.sharding.NamedSharding(grid, PartitionSpec(None, "ep")))
    assert candidates({"w": leaf}, grid) == ["stream_pallas_copies", "stream_xla_copies"]  # another axis of size 2


# ------------------------------------------------------------------ GPUs
DTYPES = [
    ml_dtypes.bfloat16,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e8m0fnu,
    ml_dtypes.float4_e2m1fn,
    np.float32,
]


@pytest.mark.gpu
@pytest.mark.parametrize("num_chunks", [None, 5])
def test_put_schedule_moves_exact_bytes_between_gpus(num_chunks, rng):
    """Every dtype (random bytes, special values), several chunks, a second move of the same capacities (no
    recompilation), forth and back."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    num_ranks = 2
    layers, experts, slots = 3, 6, 8
    mesh = eps.ep_mesh(num_ranks)
    ckpt = {f"leaf{i}": random_bytes(rng, dt, (layers, experts, 256)) for i, dt in enumerate(DTYPES)}
    take = lambda table: {k: v[np.arange(layers)[:, None], table] for k, v in ckpt.items()}
    old = np.stack([rng.permutation(np.arange(slots) % experts) for _ in range(layers)])
    new = np.stack(
        [
            rng.permutation(np.concatenate([np.arange(experts), rng.integers(0, experts, slots - experts)]))
            for _ in range(layers)
        ]
    )

    def plan(a, b):  # default chunks, or num_chunks ordered ahead
        plan = eps.plan_rearrangement(a, b, num_ranks).padded(send=layers * 4, dup=layers * 4, copy=layers * 4)
        return plan if num_chunks is None else order_for_streaming(plan, num_chunks)

    experts_now = eps.shard_slots(take(old), mesh, layered=True)
    move = eps.prepare_move(experts_now, plan(old, new), mesh=mesh)
    assert move.schedule == "put"
    moved = move(experts_now)
    for k in ckpt:
        np.testing.assert_array_equal(byte_rows_numpy(np.asarray(moved[k]), 2), byte_rows_numpy(take(new)[k], 2), k)
    traces = eps.executor_trace_count()
    returned = eps.execute_plan(moved, plan(new, old), mesh=mesh)
    for k in ckpt:
        np.testing.assert_array_equal(byte_rows_numpy(np.asarray(returned[k]), 2), byte_rows_numpy(take(old)[k], 2), k)
    if num_chunks is None:  # same capacities, default chunking: the compiled executor is reused
        assert eps.executor_trace_count() == traces


@pytest.mark.parametrize(
    "implementation, num_ranks",
    [("xla", 2), ("xla", 4), pytest.param("mosaic", 2, marks=pytest.mark.gpu)],
)
def test_put_writes_the_peers_rows(implementation, num_ranks, rng):
    """One body for every implementation (the kernel on 2 GPUs, the jnp reference on simulated devices): rank
    r's packed row k of round d lands in row dst[k] of rank (r + d) % G, padding skipped, every other row
    unchanged; the rows to pack beside come out packed."""
    if jax.device_count() < num_ranks:
        pytest.skip(f"needs {num_ranks} devices")
    mesh = jax.make_mesh(
        (num_ranks,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:num_ranks]
    )
    widths, rows, per_round = [2048, 64, 4096], 40, 16 // (num_ranks - 1)
    offsets = np.cumsum([0] + widths[:-1]).tolist()
    views = [rng.integers(0, 2**32, (num_ranks, rows, w), dtype=np.uint32) for w in widths]
    rounds = num_ranks - 1
    staged = rng.integers(0, 2**32, (num_ranks, rounds * per_round, sum(widths)), dtype=np.uint32)
    # Per receiver, distinct destinations over all its senders, some of them padding (past its rows).
    receives = [rng.permutation(rows + 8)[: rounds * per_round] for _ in range(num_ranks)]
    dst = np.zeros((num_ranks, rounds * per_round), np.int32)
    for receiver in range(num_ranks):
        for d in range(1, num_ranks):
            sender = (receiver - d) % num_ranks
            dst[sender, (d - 1) * per_round : d * per_round] = receives[receiver][(d - 1) * per_round : d * per_round]
    # Rows to pack beside the writes: rows no peer writes into this rank.
    following = np.stack([rng.permutation(np.setdiff1d(np.arange(rows), receives[r]))[:12] for r in range(num_ranks)])

    def move(staged, dst, following, *views):
        return _nvlink.put_rows(
            staged,
            dst,
            list(views),
            following,
            axis="ep",
            num_ranks=num_ranks,
            rows_per_round=per_round,
            offsets=offsets,
            config=_nvlink.Config(num_programs=24, pack_programs=5),
            implementation=implementation,
        )

    spec = PartitionSpec("ep")
    fn = jax.jit(jax.shard_map(move, mesh=mesh, in_specs=(spec,) * 6, out_specs=([spec] * 3, spec), check_vma=False))
    shard = NamedSharding(mesh, spec)
    put = lambda x: jax.device_put(x.reshape((-1,) + x.shape[2:]), shard)
    got, packed = fn(put(staged), put(dst.astype(np.int32)), put(following.astype(np.int32)), *[put(v) for v in views])
    for rank in range(num_ranks):
        want = [v[rank] for v in views]
        for d in range(1, num_ranks):
            sender, part = (rank - d) % num_ranks, slice((d - 1) * per_round, d * per_round)
            want = numpy_put(want, staged[sender, part], dst[sender, part], offsets)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g).reshape((num_ranks, rows, -1))[rank], w)
        np.testing.assert_array_equal(
            np.asarray(packed).reshape(num_ranks, 12, -1)[rank],
            np.concatenate([v[rank][following[rank]] for v in views], axis=1),
        )


def test_put_refuses_an_unknown_implementation():
    with pytest.raises(ValueError, match="implementation must be one of"):
        _nvlink.put_rows(
            jnp.zeros((1, 32), jnp.uint32),
            jnp.zeros((1,), jnp.int32),
            [jnp.zeros((2, 32), jnp.uint32)],
            axis="ep",
            num_ranks=2,
            rows_per_round=1,
            offsets=[0],
            implementation="nccl",
        )


def test_put_executor_lowers_to_kernels_without_collectives_or_floats():
    """The put executor (exported for CUDA on this machine): one Mosaic GPU kernel per chunk, no
    collective-permute, the leaves aliased in place, and no op on a float but the bitcasts into and out of the
    unsigned row views."""
    rng = np.random.default_rng(0)
    mesh = eps.ep_mesh(2)
    layers, slots = 3, 8
    experts = {"w": np.zeros((layers, slots, 64), np.float32), "s": np.zeros((layers, slots, 256), jnp.bfloat16)}
    experts = eps.shard_slots(experts, mesh, layered=True)
    old = np.stack([rng.permutation(slots) for _ in range(layers)])
    new = np.stack([np.roll(row, 4) for row in old])  # every slot changes rank: all rows move
    plan = order_for_streaming(eps.plan_rearrangement(old, new, 2), 4)
    leaves, layouts, specs, _ = eps.transport._check_leaves(experts, plan, mesh, "ep")
    tables, table_layout = _executor.device_tables(plan, mesh, "ep", sender_destinations=True)
    key = (mesh, "ep", tuple(specs), tuple(layouts), 2, True, plan.chunk_bounds, table_layout, "put", _nvlink.Config())
    text = jax.export.export(_executor._jitted(*key), platforms=["cuda"])(tables, leaves).mlir_module()
    steps = len(plan.chunk_bounds) - 1
    assert steps > 1 and text.count("stablehlo.custom_call @mosaic_gpu_v2") == steps
    assert "collective_permute" not in text
    assert "uses_xla_collective_metadata = true" in text
    produced = []  # (op, result types) of every StableHLO op
    for line in text.splitlines():
        op = re.search(r"(stablehlo\.[a-z_]+|func\.call|call)\b", line)
        if op and " : " in line:
            signature = line.rsplit(" : ", 1)[1]
            produced.append((op.group(1), signature.split("->")[-1]))
    floats = re.compile(r"x(?:bf16|f16|f32|f64|f8E\w+|f4E\w+)>")
    float_ops = {op for op, result in produced if floats.search(result)}
    assert float_ops == {"stablehlo.bitcast_convert"}, float_ops  # the leaves' bitcasts out of the row views

"""The put schedule's NVLink kernel: copy pipeline (CPU interpreter), lowering, and real moves on 2+ GPUs."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from moe_eplb_jax import sharding as eps
from moe_eplb_jax.sharding import _nvlink
from moe_eplb_jax.sharding.packing import byte_rows_numpy


def numpy_put(views, staged, dst, offsets):
    """The kernel's effect on one rank's own rows (``local=True``): row dst[k] of leaf i = staged[k, leaf i's words]."""
    out = [np.array(v) for v in views]
    for k, row in enumerate(dst):
        if 0 <= row < out[0].shape[0]:
            for v, offset in zip(out, offsets):
                v[row] = staged[k, offset : offset + v.shape[1]]
    return out


def test_chunk_words():
    assert _nvlink.put_chunk_words(65536) == 8192  # the largest multiple of 32 words dividing 65536 within 40 KiB
    assert _nvlink.put_chunk_words(133120) == 10240
    assert _nvlink.put_chunk_words(96) == 96
    assert _nvlink.put_chunk_words(48) == 0  # not a multiple of 128 bytes: no TMA copy of whole rows
    assert not _nvlink.can_put([64], jax.devices()[:2]) or jax.default_backend() == "gpu"


@pytest.mark.parametrize("programs, pack_programs, stages", [(2, 1, 2), (4, 1, 2), (8, 3, 3), (20, 9, 4), (3, None, 2)])
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
        num_programs=programs,
        pack_programs=pack_programs or 0,
        stages=stages,
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


def test_put_schedule_rejects_rows_it_cannot_copy(monkeypatch):
    """On GPUs, rows that are not a multiple of 128 bytes: ValueError naming the sizes, before any device work."""
    layouts = [eps.packing.leaf_layout(np.float32, (6,), word_view=True)]
    mesh = jax.make_mesh((2,), ("ep",), devices=jax.devices()[:2])
    if jax.default_backend() != "gpu":
        assert eps.transport._put_kind("put", layouts, mesh) == "emulated"
        monkeypatch.setattr(eps.transport, "_all_gpus", lambda devices: True)  # as if on GPUs
    with pytest.raises(ValueError, match=r"multiple of 128 bytes.*\[24\] bytes"):
        eps.transport._put_kind("put", layouts, mesh)
    assert eps.transport._put_kind("stream", layouts, mesh) == ""


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
@pytest.mark.parametrize("chunk_rows", [None, 3])
def test_put_schedule_moves_exact_bytes_between_gpus(chunk_rows, rng):
    """Every dtype (random bytes, NaN payloads), several chunks, a second move of the same capacities (no
    recompilation), forth and back."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    num_ranks = 2
    layers, experts, slots = 3, 6, 8
    mesh = eps.ep_mesh(num_ranks)
    ckpt = {}
    for i, dt in enumerate(DTYPES):
        raw = rng.integers(0, 256, (layers, experts, 256 if dt != np.float32 else 1024), dtype=np.uint8)
        if dt == ml_dtypes.float4_e2m1fn:
            raw &= 0x0F
        ckpt[f"leaf{i}"] = raw.view(dt) if dt != np.float32 else raw.view(np.float32)
    take = lambda table: {k: v[np.arange(layers)[:, None], table] for k, v in ckpt.items()}
    old = np.stack([rng.permutation(np.arange(slots) % experts) for _ in range(layers)])
    new = np.stack(
        [
            rng.permutation(np.concatenate([np.arange(experts), rng.integers(0, experts, slots - experts)]))
            for _ in range(layers)
        ]
    )
    experts_now = eps.shard_slots(take(old), mesh, layered=True)
    plan = eps.plan_rearrangement(old, new, num_ranks).padded(send=layers * 4, dup=layers * 4, copy=layers * 4)
    row = eps.row_bytes(experts_now, plan, mesh=mesh)
    chunk_bytes = None if chunk_rows is None else chunk_rows * row
    # default chunks: the default schedule ("auto": put on GPUs of one process); else put by name
    schedule = {} if chunk_rows is None else {"schedule": "put"}
    before = set(eps.transport._EXECUTORS)
    moved = eps.execute_plan(experts_now, plan, mesh=mesh, max_chunk_bytes=chunk_bytes, **schedule)
    assert [key[-1][0] for key in set(eps.transport._EXECUTORS) - before] in ([], ["kernel"])
    for k in ckpt:
        np.testing.assert_array_equal(byte_rows_numpy(np.asarray(moved[k]), 2), byte_rows_numpy(take(new)[k], 2), k)
    traces = eps.executor_trace_count()
    back = eps.plan_rearrangement(new, old, num_ranks).padded(send=layers * 4, dup=layers * 4, copy=layers * 4)
    returned = eps.execute_plan(moved, back, mesh=mesh, schedule="put", max_chunk_bytes=chunk_bytes)
    for k in ckpt:
        np.testing.assert_array_equal(byte_rows_numpy(np.asarray(returned[k]), 2), byte_rows_numpy(take(old)[k], 2), k)
    if chunk_rows is None:  # same capacities, default chunking: the compiled executor is reused
        assert eps.executor_trace_count() == traces


@pytest.mark.gpu
def test_put_kernel_writes_the_peers_rows(rng):
    """The kernel alone on 2 GPUs: rank r's packed row k lands in row dst[k] of rank 1 - r, padding skipped,
    every other row unchanged."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    mesh = jax.make_mesh((2,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    widths, rows, per_round = [2048, 64, 4096], 40, 16
    offsets = np.cumsum([0] + widths[:-1]).tolist()
    views = [rng.integers(0, 2**32, (2, rows, w), dtype=np.uint32) for w in widths]
    staged = rng.integers(0, 2**32, (2, per_round, sum(widths)), dtype=np.uint32)
    dst = np.stack([rng.permutation(rows + 8)[:per_round] for _ in range(2)]).astype(np.int32)  # some padding

    # rows to pack beside the writes: rows no peer writes (dst's real rows are excluded)
    following = np.stack([rng.permutation(np.setdiff1d(np.arange(rows), dst[1 - r]))[:12] for r in range(2)])

    def move(staged, dst, following, *views):
        return _nvlink.put_rows(
            staged,
            dst,
            list(views),
            following,
            axis="ep",
            num_ranks=2,
            rows_per_round=per_round,
            offsets=offsets,
            num_programs=24,
            pack_programs=5,
        )

    spec = PartitionSpec("ep")
    fn = jax.jit(jax.shard_map(move, mesh=mesh, in_specs=(spec,) * 6, out_specs=([spec] * 3, spec), check_vma=False))
    shard = NamedSharding(mesh, spec)
    put = lambda x: jax.device_put(x.reshape((-1,) + x.shape[2:]), shard)
    got, packed = fn(put(staged), put(dst), put(following.astype(np.int32)), *[put(v) for v in views])
    for rank in range(2):
        want = numpy_put([v[rank] for v in views], staged[1 - rank], dst[1 - rank], offsets)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g).reshape((2, rows, -1))[rank], w)
        np.testing.assert_array_equal(
            np.asarray(packed).reshape(2, 12, -1)[rank],
            np.concatenate([v[rank][following[rank]] for v in views], axis=1),
        )


def test_auto_schedule_picks_put_only_where_the_kernel_runs(monkeypatch):
    words = [eps.packing.leaf_layout(np.uint8, (256,), word_view=True)]
    odd = [eps.packing.leaf_layout(np.uint8, (256,), word_view=True), eps.packing.leaf_layout(np.uint8, (12,))]
    mesh = jax.make_mesh((2,), ("ep",), devices=jax.devices()[:2])
    resolve = eps.transport.resolve_schedule
    assert resolve("serial", words, mesh) == "serial" and resolve("put", odd, mesh) == "put"  # explicit: kept
    if jax.default_backend() != "gpu":
        assert resolve("auto", words, mesh) == "stream"  # no GPUs: the NCCL-free emulation is never automatic
        monkeypatch.setattr(eps.transport, "_all_gpus", lambda devices: True)
        monkeypatch.setattr(_nvlink, "can_put", lambda widths, devices: all(_nvlink.put_chunk_words(w) for w in widths))
    assert resolve("auto", words, mesh) == "put"
    assert resolve("auto", odd, mesh) == "stream"  # a 12-byte row: no TMA copies, not uint32 words
    grid = jax.make_mesh((2, 2), ("dp", "ep"), devices=jax.devices()[:4])
    assert resolve("auto", words, grid, "ep") == "stream"  # another axis of size 2: not measured, not automatic


def test_put_executor_lowers_to_kernels_without_collectives(monkeypatch):
    """The put executor's kernel path (traced on CPU only here, exported for CUDA): one Mosaic GPU kernel per
    chunk, no collective-permute, the leaves aliased in place."""
    monkeypatch.setattr(eps.transport, "_all_gpus", lambda devices: True)  # as if on GPUs
    monkeypatch.setattr(_nvlink, "can_put", lambda widths, devices: all(_nvlink.put_chunk_words(w) for w in widths))
    rng = np.random.default_rng(0)
    mesh = eps.ep_mesh(2)
    layers, slots = 3, 8
    experts = {"w": np.zeros((layers, slots, 64), np.float32), "s": np.zeros((layers, slots, 128), np.uint8)}
    monkeypatch.setattr(eps.transport, "WORD_VIEW", True)
    experts = eps.shard_slots(experts, mesh, layered=True)
    old = np.stack([rng.permutation(slots) for _ in range(layers)])
    new = np.stack([np.roll(row, 4) for row in old])  # every slot changes rank: all rows move
    plan = eps.plan_rearrangement(old, new, 2)
    move = eps.prepare_move(experts, plan, mesh=mesh, max_chunk_bytes=3 * (64 * 4 + 128))  # 3 rows a chunk
    leaves = [experts[k] for k in sorted(experts)]
    text = jax.export.export(move.run, platforms=["cuda"])(move.tables, leaves).mlir_module()
    steps = len(move.plan.chunk_bounds) - 1
    assert steps > 1 and text.count("stablehlo.custom_call @mosaic_gpu_v2") == steps
    assert "collective_permute" not in text
    assert "uses_xla_collective_metadata = true" in text

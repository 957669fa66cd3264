"""Tests of ``moe_eplb_jax.transport._row_copy`` (bounded-grid row gather / scatter kernels).

One test body per behaviour, run against every implementation (``IMPLEMENTATIONS``: the Pallas kernels and
the jnp reference) and compared with numpy oracles written row by row. On CPU the kernels run in Pallas
interpret mode (slow: shapes stay small); the ``gpu``-marked tests run the compiled Triton kernels, and the
last test lowers both kernels to Triton IR for an H100/H200 on this machine.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_eplb_jax.transport._row_copy import IMPLEMENTATIONS, Config, gather_rows, scatter_rows

P = jax.sharding.PartitionSpec


# ----------------------------------------------------------------- helpers
def random_views(rng, num_rows, widths):
    return [rng.integers(0, 2**32, (num_rows, width), dtype=np.uint32) for width in widths]


def random_dst(rng, num_rows, num_selected):
    """``[C]`` int32: distinct in-range rows, padded with distinct out-of-range rows (past N and negative)."""
    inside = rng.permutation(num_rows)[: min(num_rows, num_selected)]
    pads = num_selected - inside.size
    outside = np.concatenate([num_rows + np.arange(pads - pads // 2), -1 - np.arange(pads // 2)])
    return rng.permutation(np.concatenate([inside, outside])).astype(np.int32)


def gather_oracle(views, rows):
    return np.concatenate([np.asarray(v)[np.asarray(rows)] for v in views], axis=1)


def scatter_oracle(views, packed, dst):
    """Row by row: packed row c goes to row dst[c] of every view when 0 <= dst[c] < N."""
    out, offset = [np.array(v, copy=True) for v in views], 0
    for view in out:
        width = view.shape[1]
        for c, row in enumerate(np.asarray(dst)):
            if 0 <= row < view.shape[0]:
                view[row] = packed[c, offset : offset + width]
        offset += width
    return out


def assert_views_equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == jnp.uint32
        np.testing.assert_array_equal(np.asarray(g), w)


# (widths, N, C, num_programs, block): one leaf of one word, odd widths wider than a block, more programs
# than work items, several rows per work item (narrow leaves), several column blocks per row.
CASES = [
    ((1,), 1, 1, 8, 128),
    ((1,), 16, 17, 3, 128),
    ((7, 4099), 5, 3, 3, 1024),
    ((7, 4099), 1, 3, 1, 128),
    ((65, 2048, 3), 16, 17, 8, 128),
    ((65, 2048, 3), 5, 17, 3, 1024),
]


def case_id(case):
    widths, num_rows, num_selected, num_programs, block = case
    return f"m{'-'.join(map(str, widths))}_N{num_rows}_C{num_selected}_p{num_programs}_b{block}"


# ------------------------------------------------------------ vs the oracles
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_gather_matches_reference(implementation, case, rng):
    widths, num_rows, num_selected, num_programs, block = case
    views = random_views(rng, num_rows, widths)
    rows = rng.integers(0, num_rows, num_selected).astype(np.int32)
    rows[-1] = 0  # a padding entry
    got = gather_rows(views, rows, config=Config(num_programs=num_programs, block=block), implementation=implementation)
    assert got.shape == (num_selected, sum(widths)) and got.dtype == jnp.uint32
    np.testing.assert_array_equal(np.asarray(got), gather_oracle(views, rows))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.concatenate([v[rows] for v in views], axis=1)))


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_scatter_matches_reference(implementation, case, rng):
    widths, num_rows, num_selected, num_programs, block = case
    views = random_views(rng, num_rows, widths)
    packed = rng.integers(0, 2**32, (num_selected, sum(widths)), dtype=np.uint32)
    dst = random_dst(rng, num_rows, num_selected)
    config = Config(num_programs=num_programs, block=block)
    got = scatter_rows([jnp.asarray(v) for v in views], packed, dst, config=config, implementation=implementation)
    assert_views_equal(got, scatter_oracle(views, packed, dst))
    untouched = np.setdiff1d(np.arange(num_rows), dst)
    for g, v in zip(got, views):  # rows not named in dst keep their bytes
        np.testing.assert_array_equal(np.asarray(g)[untouched], v[untouched])
    # The documented jnp equivalent (with non-negative padding: .at[] wraps negative indices around).
    dst_nonneg = np.where(dst < 0, num_rows - dst, dst).astype(np.int32)
    offsets = np.cumsum((0,) + widths)
    want = [
        jnp.asarray(v).at[dst_nonneg].set(packed[:, offsets[i] : offsets[i + 1]], mode="drop", unique_indices=True)
        for i, v in enumerate(views)
    ]
    assert_views_equal(got, [np.asarray(w) for w in want])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_gather_then_scatter_round_trip(implementation, rng):
    """Rows gathered from one set of views and scattered into another land bit-exactly."""
    widths, num_rows = (7, 300), 12
    source, target = random_views(rng, num_rows, widths), random_views(rng, num_rows, widths)
    rows = rng.permutation(num_rows)[:5].astype(np.int32)
    dst = rng.permutation(num_rows)[:5].astype(np.int32)
    opts = dict(config=Config(num_programs=2, block=128), implementation=implementation)
    packed = gather_rows(source, rows, **opts)
    got = scatter_rows(target, packed, dst, **opts)
    for g, s in zip(got, source):
        np.testing.assert_array_equal(np.asarray(g)[dst], s[rows])


@pytest.mark.parametrize("start, count", [(0, 3), (5, 4), (9, None), (12, 0)])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_index_window_equals_slice(implementation, start, count, rng):
    """index_start / index_count read a window of a longer table: the same as passing the slice."""
    widths, num_rows = (5, 130), 9
    table = rng.integers(0, num_rows, 12).astype(np.int32)
    window = table[start:] if count is None else table[start : start + count]
    views = random_views(rng, num_rows, widths)
    opts = dict(config=Config(num_programs=3, block=128), implementation=implementation)
    opts.update(index_start=start, index_count=count)
    got = gather_rows(views, table, **opts)
    np.testing.assert_array_equal(np.asarray(got), gather_oracle(views, window).reshape(len(window), sum(widths)))
    dst_table = np.concatenate([random_dst(rng, num_rows, 6), random_dst(rng, num_rows, 6)])
    dst = dst_table[start:] if count is None else dst_table[start : start + count]
    packed = rng.integers(0, 2**32, (len(dst), sum(widths)), dtype=np.uint32)
    got = scatter_rows([jnp.asarray(v) for v in views], packed, dst_table, **opts)
    assert_views_equal(got, scatter_oracle(views, packed, dst))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_empty_selection(implementation, rng):
    views = random_views(rng, 4, (3, 5))
    assert gather_rows(views, np.zeros((0,), np.int32), implementation=implementation).shape == (0, 8)
    got = scatter_rows(views, np.zeros((0, 8), np.uint32), np.zeros((0,), np.int32), implementation=implementation)
    assert_views_equal(got, views)


# ------------------------------------------------------------- jit, shard_map
def test_jit_with_donated_views(rng):
    widths, num_rows, num_selected = (7, 4099), 5, 4
    views = random_views(rng, num_rows, widths)
    packed = rng.integers(0, 2**32, (num_selected, sum(widths)), dtype=np.uint32)
    dst = random_dst(rng, num_rows, num_selected)
    scatter = jax.jit(
        lambda v, p, d: scatter_rows(v, p, d, config=Config(num_programs=3, block=1024)), donate_argnums=0
    )
    gather = jax.jit(lambda v, r: gather_rows(v, r, config=Config(num_programs=3, block=1024)))
    lowered = scatter.lower([jax.ShapeDtypeStruct(v.shape, v.dtype) for v in views], packed, dst).as_text()
    assert lowered.count("tf.aliasing_output") == len(widths)  # each donated view is aliased to its output
    donated = [jnp.asarray(v) for v in views]
    got = scatter(donated, packed, dst)
    assert all(v.is_deleted() for v in donated)  # the buffers were donated (and reused for the outputs)
    assert_views_equal(got, scatter_oracle(views, packed, dst))
    rows = rng.integers(0, num_rows, num_selected).astype(np.int32)
    want = gather_oracle(scatter_oracle(views, packed, dst), rows)
    np.testing.assert_array_equal(np.asarray(gather(got, rows)), want)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_shard_map_per_shard(implementation, rng):
    mesh = jax.make_mesh((8,), ("ep",))
    sharded = jax.sharding.NamedSharding(mesh, P("ep"))
    widths, local_rows, local_selected = (1, 7), 4, 3
    views = random_views(rng, 8 * local_rows, widths)
    rows = rng.integers(0, local_rows, 8 * local_selected).astype(np.int32)  # local row indices
    packed = rng.integers(0, 2**32, (8 * local_selected, sum(widths)), dtype=np.uint32)
    dst = np.concatenate([random_dst(rng, local_rows, local_selected) for _ in range(8)])
    put = lambda x: jax.device_put(x, sharded)

    gather = jax.jit(
        jax.shard_map(
            lambda v, r: gather_rows(v, r, config=Config(num_programs=2, block=128), implementation=implementation),
            mesh=mesh,
            in_specs=(P("ep"), P("ep")),
            out_specs=P("ep"),
        )
    )
    scatter = jax.jit(
        jax.shard_map(
            lambda v, p, d: scatter_rows(
                v, p, d, config=Config(num_programs=2, block=128), implementation=implementation
            ),
            mesh=mesh,
            in_specs=(P("ep"), P("ep"), P("ep")),
            out_specs=P("ep"),
        )
    )
    got_packed = np.asarray(gather([put(v) for v in views], put(rows)))
    got_views = [np.asarray(v) for v in scatter([put(v) for v in views], put(packed), put(dst))]
    for rank in range(8):
        view_slice = slice(rank * local_rows, (rank + 1) * local_rows)
        sel_slice = slice(rank * local_selected, (rank + 1) * local_selected)
        local_views = [v[view_slice] for v in views]
        np.testing.assert_array_equal(got_packed[sel_slice], gather_oracle(local_views, rows[sel_slice]))
        want = scatter_oracle(local_views, packed[sel_slice], dst[sel_slice])
        for g, w in zip(got_views, want):
            np.testing.assert_array_equal(g[view_slice], w)


# ---------------------------------------------------------------- validation
def test_unknown_implementation_is_refused(rng):
    with pytest.raises(ValueError, match="implementation must be one of"):
        gather_rows(random_views(rng, 4, (3,)), np.array([0], np.int32), implementation="cuda")


def _valid_args(rng):
    views = random_views(rng, 4, (3, 5))
    return {"row_views": views, "rows": np.array([0, 3], np.int32)}


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(row_views=[a["row_views"][0].astype(np.int32)]), "row_views\\[0\\] must have dtype uint32"),
        (lambda a: a.update(row_views=[a["row_views"][0][:, 0]]), "row_views\\[0\\] must have 2 dimensions"),
        (lambda a: a.update(row_views=[a["row_views"][0], a["row_views"][1][:3]]), "same number of rows N"),
        (lambda a: a.update(row_views=[]), "at least one array"),
        (lambda a: a.update(row_views=a["row_views"][0]), "must be a sequence"),
        (lambda a: a.update(rows=a["rows"].astype(np.int64)), "rows must have dtype int32"),
        (lambda a: a.update(rows=a["rows"][None]), "rows must have 1 dimension"),
        (lambda a: a.update(row_views=[jax.ShapeDtypeStruct((2**16, 2**15), jnp.uint32)]), "int32 offsets"),
        (lambda a: a.update(index_start=1, index_count=2), "rows has 2 entries: too few for index_start=1"),
        (lambda a: a.update(index_start=3), "rows has 2 entries: too few for index_start=3"),
        (lambda a: a.update(index_start=-1), "index_start must be an int >= 0"),
        (lambda a: a.update(index_count=1.0), "index_count must be an int >= 0"),
        (lambda a: a.update(config=dict(num_programs=4)), "config must be a _row_copy.Config"),
    ],
)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_gather_validation_errors(implementation, change, message, rng):
    kwargs = _valid_args(rng)
    change(kwargs)
    with pytest.raises(ValueError, match=message):
        gather_rows(**kwargs, implementation=implementation)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(packed=a["packed"].astype(np.int32)), "packed must have dtype uint32"),
        (lambda a: a.update(packed=a["packed"][:, :7]), "packed has 7 columns but the row views' widths"),
        (lambda a: a.update(packed=a["packed"][:1]), "packed has 1 rows but dst has 2 entries"),
        (lambda a: a.update(packed=a["packed"][None]), "packed must have 2 dimensions"),
        (lambda a: a.update(dst=a["dst"].astype(np.uint32)), "dst must have dtype int32"),
        (lambda a: a.update(row_views=[v.astype(np.float32) for v in a["row_views"]]), "must have dtype uint32"),
        (lambda a: a.update(index_start=1), "packed has 2 rows but dst has 1 entries"),
    ],
)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_scatter_validation_errors(implementation, change, message, rng):
    views = random_views(rng, 4, (3, 5))
    kwargs = {
        "row_views": views,
        "packed": rng.integers(0, 2**32, (2, 8), dtype=np.uint32),
        "dst": np.array([1, 4], np.int32),
    }
    change(kwargs)
    with pytest.raises(ValueError, match=message):
        scatter_rows(**kwargs, implementation=implementation)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(num_programs=0), "num_programs must be an int >= 1"),
        (dict(num_programs=2.0), "num_programs must be an int >= 1"),
        (dict(num_programs=True), "num_programs must be an int >= 1"),
        (dict(block=1000), "block must be a power of two >= 128"),
        (dict(block=64), "block must be a power of two >= 128"),
        (dict(block=384), "block must be a power of two >= 128"),
        (dict(num_warps=0), "num_warps must be an int >= 1"),
        (dict(num_stages=-1), "num_stages must be an int >= 1"),
    ],
)
def test_config_validation_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        Config(**fields)


# ------------------------------------------------------------------ GPU only
@pytest.mark.gpu
@pytest.mark.parametrize("num_programs, block, num_warps", [(8, 4096, 4), (16, 1024, 2), (64, 4096, 8)])
def test_gpu_kernels_match_reference(num_programs, block, num_warps, rng):
    widths, num_rows, num_selected = (65536, 2048, 1, 7, 4099), 40, 24
    options = dict(config=Config(num_programs=num_programs, block=block, num_warps=num_warps), interpret=False)
    gather = jax.jit(lambda v, r: gather_rows(v, r, **options))
    scatter = jax.jit(lambda v, p, d: scatter_rows(v, p, d, **options), donate_argnums=0)
    for _ in range(2):  # fresh inputs each time
        views = random_views(rng, num_rows, widths)
        rows = rng.integers(0, num_rows, num_selected).astype(np.int32)
        np.testing.assert_array_equal(np.asarray(gather(views, rows)), gather_oracle(views, rows))
        packed = rng.integers(0, 2**32, (num_selected, sum(widths)), dtype=np.uint32)
        dst = random_dst(rng, num_rows, num_selected)
        got = scatter([jnp.asarray(v) for v in views], packed, dst)
        assert_views_equal(got, scatter_oracle(views, packed, dst))


# ------------------------------------------------------ Triton lowering on CPU
def test_kernels_lower_to_triton_ir(h100_lowering):
    """Lowers both kernels to Triton IR for an H100/H200 without a GPU (catches lowering breakage)."""
    spec = jax.ShapeDtypeStruct
    widths, num_rows, num_selected = (65536, 2048, 65536, 7), 32, 64
    options = dict(config=Config(num_programs=16, block=4096, num_warps=4), interpret=False)
    views = [spec((num_rows, width), jnp.uint32) for width in widths]
    disabled = h100_lowering

    gather = jax.export.export(
        jax.jit(lambda v, r: gather_rows(v, r, **options)), platforms=["cuda"], disabled_checks=disabled
    )(views, spec((num_selected,), jnp.int32))
    assert "xla.gpu.triton" in gather.mlir_module()
    assert gather.out_avals[0].shape == (num_selected, sum(widths))

    scatter = jax.export.export(
        jax.jit(lambda v, p, d: scatter_rows(v, p, d, **options), donate_argnums=0),
        platforms=["cuda"],
        disabled_checks=disabled,
    )(views, spec((num_selected, sum(widths)), jnp.uint32), spec((num_selected,), jnp.int32))
    module = scatter.mlir_module()
    assert "xla.gpu.triton" in module
    assert "output_operand_aliases" in module  # in place: each view's buffer is the kernel's output
    assert module.count("tf.aliasing_output") == len(widths)

"""Tests of the Pallas kernels behind ``map_and_count``: their tuning options, the bucket guide, the rank tiles of
``resolved`` and its boundary positions, and the lowering of every kernel to Triton IR on CPU.

Every option is checked against the reference (``implementation="xla"``'s function) on fresh random inputs: in
interpret mode on CPU, compiled on GPU. The public function's semantics are tested in ``test_map_and_count.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _map_and_count_data import random_ids, random_mode_inputs, random_placement
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_eplb_jax.pallas import MODES
from moe_eplb_jax.placement import Placement


# ------------------------------------------------------------ kernel options
@pytest.mark.parametrize(
    "options",
    [
        {"count_dtype": "float16", "sub": 32, "sub_resolved": 32},
        {"count_dtype": "int8", "sub": 512, "sub_resolved": 128, "tile": 1024},
        {"tile_resolved": 64, "sub_resolved": 16, "warps_resolved": 1, "tile": 128},
        {"tile_resolved": 4096, "sub_resolved": 256},
        {"count_method": "histogram", "tables": "shared", "sub": 64},
        {"count_method": "histogram", "tables": "head", "tile": 1024, "sub": 256},
        {"reduce": "atomic", "tile": 128, "sub": 64},
        {"reduce": "atomic", "layout": "replica_major", "tables": "shared"},
        {"linear_search": 16},
        {"linear_search": 3, "layout": "expert_major"},
        {"rank_running": "registers", "rank_chains": 1},
        {"rank_running": "memory", "tile_resolved": 256, "sub_resolved": 64, "rank_chains": 1},
        {"rank_chains": 2},
        {"rank_chains": 4, "tile_resolved": 512},
        {"rank_chains": 8, "tile_resolved": 256, "sub_resolved": 32},
        {"search": "while"},
        {"search": "while", "linear_search": 2},
        {"guide": 1},
        {"guide": 16, "search": "unrolled"},
        {"guide": 0},
        {"guide": 4, "tables": "global"},
        {"tile_bases": "matmul"},
        {"tile_bases": "matmul", "tile_resolved": 16, "sub_resolved": 16},
        {"tile_bases": "cumsum"},
        {"threshold_layout": "replica_major"},
        {"threshold_layout": "replica_major", "linear_search": 3},
        {"threshold_layout": "replica_major", "layout": "expert_major"},
        {"resolved_by": "positions"},
        {"resolved_by": "ranks"},
        {"resolved_by": "positions", "position_tile": 256, "position_groups": 1, "position_scan": 32},
        {
            "resolved_by": "positions",
            "position_tile": 64,
            "position_sub": 16,
            "position_groups": 3,
            "position_scan": 16,
            "search": "unrolled",
        },
        {"resolved_by": "positions", "threshold_layout": "replica_major", "guide": 8},
    ],
)
@pytest.mark.parametrize("mode", ["hash", "resolved"])
def test_kernel_options_match_reference(options, mode, rng):
    """The tuning knobs of the kernel (tile, sub-tile, one-hot dtype) never change the result."""
    from moe_eplb_jax.pallas import _reference, _triton
    from moe_eplb_jax.pallas.map_and_count import _build_thresholds

    placement = random_placement(rng, 16, 40)
    log2phy, logcnt = jnp.asarray(placement.log2phy[0]), jnp.asarray(placement.logcnt[0])
    ids = jnp.asarray(random_ids(rng, 300, 6, 16))
    limits = jnp.asarray([250 * 6, 280 * 6], jnp.int32)
    quotas = jnp.asarray(rng.integers(0, 60, (16, 25)).astype(np.int32))
    thresholds = _build_thresholds("resolved", quotas, logcnt, 25) if mode == "resolved" else jnp.zeros_like(log2phy)
    want = _reference.map_and_count_reference(ids, log2phy, logcnt, thresholds, limits, num_physical=40, mode=mode)
    got = _triton.map_and_count_triton(
        ids,
        log2phy,
        logcnt,
        thresholds,
        limits,
        num_physical=40,
        mode=mode,
        interpret=jax.default_backend() != "gpu",
        **options,
    )
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    with pytest.raises(ValueError, match="unknown kernel options"):
        _triton.map_and_count_triton(ids, log2phy, logcnt, thresholds, limits, num_physical=40, mode=mode, warps=2)
    with pytest.raises(ValueError, match="tile_resolved and sub_resolved must be powers of two"):
        _triton.map_and_count_triton(
            ids, log2phy, logcnt, thresholds, limits, num_physical=40, mode=mode, tile_resolved=96
        )
    for name, value in (
        ("layout", "row_major"),
        ("reduce", "psum"),
        ("tables", "texture"),
        ("threshold_layout", "column_major"),
        ("count_method", "sort"),
        ("rank_in_step", "ballot"),
        ("rank_running", "shared"),
        ("tile_bases", "scan"),
        ("search", "linear"),
        ("resolved_by", "sorted"),
        ("position_map", "bisect"),
        ("boundary_grid", "tiles"),
    ):
        with pytest.raises(ValueError, match=f"{name} must be one of"):
            _triton.map_and_count_triton(
                ids, log2phy, logcnt, thresholds, limits, num_physical=40, mode=mode, **{name: value}
            )
    if mode == "resolved":
        with pytest.raises(ValueError, match="rank_chains must be a power of two"):
            _triton.map_and_count_triton(
                ids, log2phy, logcnt, thresholds, limits, num_physical=40, mode=mode, rank_chains=3
            )
    with pytest.raises(ValueError, match="linear_search must be >= 0"):
        _triton.map_and_count_triton(
            ids, log2phy, logcnt, thresholds, limits, num_physical=40, mode=mode, linear_search=-1
        )
    with pytest.raises(ValueError, match="guide must be 0, 1, 2, 4, 8 or 16"):
        _triton.map_and_count_triton(ids, log2phy, logcnt, thresholds, limits, num_physical=40, mode=mode, guide=3)
    if mode == "resolved":
        for bad in ({"position_tile": 96}, {"position_scan": 48}, {"position_sub": 8}, {"position_groups": 0}):
            with pytest.raises(ValueError, match="position tile, step and scan must be powers of two"):
                _triton.map_and_count_triton(
                    ids, log2phy, logcnt, thresholds, limits, num_physical=40, mode=mode, resolved_by="positions", **bad
                )


@settings(max_examples=7)
@given(
    num_tokens=st.integers(1, 300),
    top_k=st.sampled_from([1, 3, 8]),
    num_logical=st.sampled_from([2, 9, 40]),
    extra_slots=st.integers(0, 30),
    mode=st.sampled_from(MODES),
    layout=st.sampled_from(["expert_major", "replica_major"]),
    reduce=st.sampled_from(["xla", "atomic"]),
    tables=st.sampled_from(["head", "global", "shared"]),
    linear_search=st.sampled_from([0, 2, 16]),
    guide=st.sampled_from([0, 1, 8]),
    threshold_layout=st.sampled_from(["expert_major", "replica_major"]),
    tile_bases=st.sampled_from(["matmul", "cumsum"]),
    rank_running=st.sampled_from(["registers", "memory"]),
    rank_chains=st.sampled_from([None, 1, 2]),
    search=st.sampled_from([None, "unrolled", "while"]),
    positions=st.sampled_from(
        [
            {},
            {"resolved_by": "ranks"},
            {"resolved_by": "positions"},
            {"resolved_by": "positions", "position_tile": 16, "position_groups": 2, "position_scan": 16},
            {"resolved_by": "positions", "position_tile": 64, "position_groups": 1},
        ]
    ),
    seed=st.integers(0, 2**31),
)
def test_kernel_option_combinations_match_reference(
    num_tokens,
    top_k,
    num_logical,
    extra_slots,
    mode,
    layout,
    reduce,
    tables,
    linear_search,
    guide,
    threshold_layout,
    tile_bases,
    rank_running,
    rank_chains,
    search,
    positions,
    seed,
):
    """Any combination of the kernel's layout / reduction / lookup / search / rank options gives the reference's
    ids and loads (Pallas in interpret mode on CPU, compiled on GPU)."""
    from moe_eplb_jax.pallas import _reference, _triton
    from moe_eplb_jax.pallas.map_and_count import _build_mode_table

    rng = np.random.default_rng(seed)
    placement = random_placement(rng, num_logical, num_logical + extra_slots)
    log2phy, logcnt = jnp.asarray(placement.log2phy[0]), jnp.asarray(placement.logcnt[0])
    ids = jnp.asarray(random_ids(rng, num_tokens, top_k, num_logical))
    extra = random_mode_inputs(rng, mode, placement, ids.size)
    values = extra.get("replica_shares", extra.get("resolved"))
    thresholds = (
        jnp.zeros_like(log2phy) if values is None else _build_mode_table(mode, jnp.asarray(values), log2phy, logcnt)
    )
    valid = int(rng.integers(0, num_tokens + 1)) * top_k
    limits = jnp.asarray([valid, valid], jnp.int32)
    num_physical = num_logical + extra_slots
    want = _reference.map_and_count_reference(
        ids, log2phy, logcnt, thresholds, limits, num_physical=num_physical, mode=mode
    )
    got = _triton.map_and_count_triton(
        ids,
        log2phy,
        logcnt,
        thresholds,
        limits,
        num_physical=num_physical,
        mode=mode,
        layout=layout,
        reduce=reduce,
        tables=tables,
        linear_search=linear_search,
        guide=guide,
        threshold_layout=threshold_layout,
        tile_bases=tile_bases,
        rank_running=rank_running,
        rank_chains=rank_chains,
        search=search,
        **positions,
        interpret=jax.default_backend() != "gpu",
    )
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


# Only the options a mode reads: the search's (linear_search, guide) for resolved; the placement tables' kind and
# layout for every mode but shares (which reads its own alias table).
_ROW_CASES = [
    (mode, tables, layout, linear_search, guide)
    for mode in MODES
    for tables, layout in [
        ("head", "expert_major"),
        ("global", "expert_major"),
        ("head", "replica_major"),
        ("shared", "replica_major"),
    ]
    for linear_search, guide in [(0, 0), (16, 0), (0, 1), (2, 8)]
    if (mode == "resolved" or (linear_search, guide) == (0, 0))
    and (mode != "shares" or (tables, layout) == ("head", "replica_major"))
]


@pytest.mark.parametrize("mode, tables, layout, linear_search, guide", _ROW_CASES)
@pytest.mark.parametrize("wide", [True, False], ids=["wide", "narrow"])
def test_wide_and_narrow_rows_match_reference(mode, wide, linear_search, guide, tables, layout, rng):
    """Experts with 1 to 20 replicas: the replica lookups, shares' alias words and resolved's threshold search
    (bisection bounded by each expert's replica count; or independent loads first, the search beyond; or the
    bucket guide, which the replica-major head tables use) give the reference's result, in either table
    layout."""
    from moe_eplb_jax.pallas import _reference, _triton
    from moe_eplb_jax.pallas.map_and_count import _build_mode_table

    # Per expert: wide rows cross the linear-search limit, narrow ones reach it.
    replicas = np.array([20, 17, 16, 3, 2, 1, 1, 4] if wide else [16, 9, 5, 3, 2, 1, 1, 4])
    phy2log = rng.permutation(np.repeat(np.arange(replicas.size), replicas))
    placement = Placement.from_phy2log(phy2log, replicas.size)
    # The table as wide as the most replicated expert needs (Placement pads it to P - E + 1).
    log2phy = jnp.asarray(placement.log2phy[0, :, : replicas.max()])
    logcnt = jnp.asarray(placement.logcnt[0])
    assert (log2phy.shape[1] > 16) == wide
    ids = jnp.asarray(random_ids(rng, 200, 4, replicas.size))
    extra = random_mode_inputs(rng, mode, placement, ids.size)
    values = extra.get("replica_shares", extra.get("resolved"))
    if mode == "resolved":  # quotas below demand: entries past an expert's last threshold fall back to hash
        values = values // 32
    thresholds = (
        jnp.zeros_like(log2phy)
        if values is None
        else _build_mode_table(mode, jnp.asarray(values[:, : log2phy.shape[1]]), log2phy, logcnt)
    )
    limits = jnp.asarray([190 * 4, 195 * 4], jnp.int32)
    num_physical = int(replicas.sum())
    want = _reference.map_and_count_reference(
        ids, log2phy, logcnt, thresholds, limits, num_physical=num_physical, mode=mode
    )
    got = _triton.map_and_count_triton(
        ids,
        log2phy,
        logcnt,
        thresholds,
        limits,
        num_physical=num_physical,
        mode=mode,
        tables=tables,
        layout=layout,
        linear_search=linear_search,
        guide=guide,
        interpret=jax.default_backend() != "gpu",
    )
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    replica_of = {
        int(slot): int(np.flatnonzero(placement.log2phy[0, e] == slot)[0])
        for e in range(replicas.size)
        for slot in placement.log2phy[0, e]
        if slot >= 0
    }
    used = {replica_of[int(p)] for p in np.asarray(got[0]).ravel() if p >= 0}
    assert max(used) >= 3  # late replicas were picked


# ------------------------------------------------------ Triton lowering on CPU
def test_pallas_kernels_lower_to_triton_ir(h100_lowering):
    """Lowers every mode's kernels to Triton IR for an H100/H200 without a GPU (catches lowering breakage)."""
    from moe_eplb_jax.pallas import _triton

    spec = jax.ShapeDtypeStruct
    cases = (
        [(m, {}) for m in MODES]  # the defaults
        + [("hash", {"count_method": m, "tables": "global"}) for m in _triton.COUNT_METHODS[1:]]
        + [(m, {"tables": t}) for m in ("hash", "resolved") for t in _triton.TABLES[1:]]
        + [
            (m, {"tables": t, "layout": "expert_major", "reduce": "xla", "rank_in_step": "compare"})
            for m in ("shares", "resolved")
            for t in _triton.TABLES
        ]
        + [
            ("shares", {"threshold_layout": "replica_major"}),
            ("shares", {"compact": False}),
            ("shares", {"compact": False, "word_heads": False}),
            ("resolved", {"guide": 8, "search": "unrolled"}),
            ("resolved", {"search": "while", "guide": 0}),
            ("resolved", {"rank_running": "registers", "rank_chains": 1}),
            ("resolved", {"rank_chains": 2}),
            ("resolved", {"rank_running": "memory", "sub_resolved": 64, "warps_resolved": 2}),
            ("resolved", {"resolved_by": "positions"}),
            ("resolved", {"resolved_by": "positions", "boundary_grid": "expert", "tables": "shared"}),
            ("resolved", {"resolved_by": "positions", "position_map": "search", "tables": "global"}),
            (
                "resolved",
                {
                    "resolved_by": "positions",
                    "position_groups": 1,
                    "position_tile": 1024,
                    "position_scan": 256,
                    "position_warps": 1,
                    "boundary_warps": 1,
                },
            ),
        ]
        # past 32768 slots the kernels count by per-entry atomics (no histogram in shared memory)
        + [(m, {"num_physical": 40000}) for m in MODES]
    )
    for mode, options in cases:

        def run(ids, log2phy, logcnt, thresholds, limits):  # the compiled path (interpret=False)
            return _triton.map_and_count_triton(
                ids, log2phy, logcnt, thresholds, limits, mode=mode, **{"num_physical": 288, **options}
            )

        exported = jax.export.export(
            jax.jit(run),
            platforms=["cuda"],
            disabled_checks=h100_lowering,
        )(
            spec((4096, 8), jnp.int32),
            spec((256, 33), jnp.int32),
            spec((256,), jnp.int32),
            spec((256, 33), jnp.int32),
            spec((2,), jnp.int32),
        )
        assert "xla.gpu.triton" in exported.mlir_module()
    # Large inputs switch to larger loop steps (LARGE_OPTIONS, by size): those kernels must lower too.
    for mode, least in {(m, least) for m, sizes in _triton.LARGE_OPTIONS.items() for least, _ in sizes}:
        big = jax.export.export(
            jax.jit(lambda *a, mode=mode: _triton.map_and_count_triton(*a, num_physical=288, mode=mode)),
            platforms=["cuda"],
            disabled_checks=h100_lowering,
        )(
            spec((least // 8, 8), jnp.int32),
            spec((256, 33), jnp.int32),
            spec((256,), jnp.int32),
            spec((256, 33), jnp.int32),
            spec((2,), jnp.int32),
        )
        assert "xla.gpu.triton" in big.mlir_module()
    # The guided path at a large size (2**21 entries, a 257-wide table): guide kernel + map kernel; resolved there
    # finds boundary positions (tile counts + boundaries + map: no guide over positions).
    for mode in ("shares", "resolved"):
        guided = jax.export.export(
            jax.jit(lambda *a, mode=mode: _triton.map_and_count_triton(*a, num_physical=512, mode=mode, guide=8)),
            platforms=["cuda"],
            disabled_checks=h100_lowering,
        )(
            spec((1 << 18, 8), jnp.int32),
            spec((256, 257), jnp.int32),
            spec((256,), jnp.int32),
            spec((256, 257), jnp.int32),
            spec((2,), jnp.int32),
        )
        assert guided.mlir_module().count("xla.gpu.triton") == (1 if mode == "shares" else 3)  # shares: no guide
    # Shares with its alias table built by the Pallas kernel (the public call's path): two kernels; with the words
    # in a prepared lookup table: one.
    for num_tokens, width in ((4096, 33), (1 << 18, 257)):
        tables = (spec((num_tokens, 8), jnp.int32), spec((256, width), jnp.int32), spec((256,), jnp.int32))
        for name, extra, kernels in (
            ("shares", spec((256, width), jnp.float32), 2),
            ("lookup", spec((3 * 256 * (1 + width),), jnp.int32), 1),
        ):
            exported = jax.export.export(
                jax.jit(
                    lambda ids, log2phy, logcnt, extra, limits, name=name: _triton.map_and_count_triton(
                        ids, log2phy, logcnt, None, limits, num_physical=512, mode="shares", **{name: extra}
                    )
                ),
                platforms=["cuda"],
                disabled_checks=h100_lowering,
            )(*tables, extra, spec((2,), jnp.int32))
            assert exported.mlir_module().count("xla.gpu.triton") == kernels, name
    # Resolved over positions with the boundary programs summing the raw quotas (the public call's path).
    summed = jax.export.export(
        jax.jit(
            lambda ids, log2phy, logcnt, quotas, limits: _triton.map_and_count_triton(
                ids,
                log2phy,
                logcnt,
                quotas,
                limits,
                num_physical=288,
                mode="resolved",
                resolved_by="positions",
                quotas=quotas,
            )
        ),
        platforms=["cuda"],
        disabled_checks=h100_lowering,
    )(
        spec((4096, 8), jnp.int32),
        spec((256, 33), jnp.int32),
        spec((256,), jnp.int32),
        spec((256, 33), jnp.int32),
        spec((2,), jnp.int32),
    )
    assert summed.mlir_module().count("xla.gpu.triton") == 3
    for chains in (1, 4):  # by ranks, the rank kernel's extra programs building the thresholds from the quotas
        fused = jax.export.export(
            jax.jit(
                lambda ids, log2phy, logcnt, quotas, limits, chains=chains: _triton.map_and_count_triton(
                    ids,
                    log2phy,
                    logcnt,
                    quotas,
                    limits,
                    num_physical=288,
                    mode="resolved",
                    resolved_by="ranks",
                    tile_bases="matmul",
                    rank_chains=chains,
                    quotas=quotas,
                )
            ),
            platforms=["cuda"],
            disabled_checks=h100_lowering,
        )(
            spec((4096, 8), jnp.int32),
            spec((256, 33), jnp.int32),
            spec((256,), jnp.int32),
            spec((256, 33), jnp.int32),
            spec((2,), jnp.int32),
        )
        assert fused.mlir_module().count("xla.gpu.triton") == 2


# ------------------------------------------------------------ bucket guide
def _guide_inputs(rng, replicas, width=None):
    """Resolved's thresholds [E, S] (zero and uneven quota rows), log2phy, the kernel's counts and lookup for a
    placement."""
    from moe_eplb_jax.pallas import _triton
    from moe_eplb_jax.pallas.map_and_count import _build_thresholds

    phy2log = rng.permutation(np.repeat(np.arange(replicas.size), replicas))
    placement = Placement.from_phy2log(phy2log, replicas.size)
    log2phy, logcnt = jnp.asarray(placement.log2phy[0]), jnp.asarray(placement.logcnt[0])
    if width is not None:  # a narrower table than Placement's P - E + 1
        log2phy = log2phy[:, :width]
    num_logical, width = log2phy.shape
    values = rng.integers(0, 40, (num_logical, width)).astype(np.int32)
    values[1, :] = 0  # no quota: every point past the total
    values[2, ::2] = 0  # zero quotas: equal thresholds
    thresholds = _build_thresholds("resolved", jnp.asarray(values), logcnt, width, limit=10**6)
    return thresholds, log2phy, jnp.clip(logcnt, 1, 0x7FFF), _triton.lookup_table(log2phy, logcnt)


def _guide_used(words, count, num_logical, width, factor, num_physical):
    """Mask of the guide entries a lookup can read (head words; each multi-replica expert's buckets)."""
    from moe_eplb_jax.pallas import _guide

    caps = jnp.asarray(words[1 : 2 * num_logical : 2])
    offset, _, end = map(np.asarray, _guide._layout(count, caps, width, factor, 2 * factor * num_physical))
    used = np.zeros(words.size, bool)
    used[: 2 * num_logical] = True
    for e in np.flatnonzero(np.asarray(count) > 1):
        size = 1 if end[e] == np.iinfo(np.int32).max else end[e] - offset[e]
        used[2 * num_logical + offset[e] : 2 * num_logical + offset[e] + size] = True
    return used


@pytest.mark.parametrize("factor", [1, 4, 16])
def test_guide_answers_every_point(factor, rng):
    """Decoding the guide as the map kernel does gives, for every point tried (random, bucket edges, every
    threshold and its neighbours, past the cap), the number of live thresholds <= the point: the slot itself
    where no threshold lies inside the bucket, -1 only where resolved passes them all, else a search range
    holding the answer. Experts that do not fit (counts summing past P) take one spare bucket."""
    from moe_eplb_jax.pallas import _guide

    replicas = np.array([9, 5, 3, 2, 1, 1, 4, 1, 2, 12])
    thresholds, log2phy, count, _ = _guide_inputs(rng, replicas)
    num_logical, width = thresholds.shape
    tight = factor == 16  # too few main buckets for everyone: the later experts fall back to spares
    num_physical = int(replicas.sum()) // (4 if tight else 1)
    words = np.asarray(_guide.guide_table(thresholds, log2phy, count, factor=factor, num_physical=num_physical)).astype(
        np.int64
    )
    assert words.size == _guide.guide_size(num_logical, num_physical, factor)
    thresholds, log2phy, count = map(np.asarray, (thresholds, log2phy, count))
    heads = words[: 2 * num_logical].reshape(num_logical, 2)
    offset, shift, cap = (
        heads[:, 0] & ((1 << _guide.OFFSET_BITS) - 1),
        (heads[:, 0] >> _guide.OFFSET_BITS) & 31,
        heads[:, 1],
    )
    spares = offset >= 2 * factor * num_physical
    assert spares.any() == tight
    kinds = set()
    for e in np.flatnonzero(count > 1):
        live = thresholds[e, : min(count[e], width)]
        top = int(live[-1]) + 50
        points = np.concatenate(
            [rng.integers(0, top, 300), live, live - 1, live + 1, np.arange(0, top, 1 << int(shift[e]))[:500]]
        )
        points = points[(points >= 0) & (points < top)]
        for point in points:
            want = int(np.sum(live <= point))
            word = words[2 * num_logical + offset[e] + (min(point, cap[e]) >> shift[e])]
            if word < 0:
                kinds.add("past")
                assert want >= count[e]
            elif word < 1 << 16:
                kinds.add("slot")
                assert word - 1 == log2phy[e, min(want, width - 1)]
            else:
                kinds.add("search")
                low, span = word & 0xFFFF, word >> 16
                assert low <= want <= low + span and np.all(live[low:want] <= point)
    assert kinds == {"slot", "search", "past"}


@pytest.mark.parametrize("factor", [1, 8])
def test_guide_kernel_matches_reference(factor, rng):
    """The Pallas guide kernel writes the jnp reference's words at every entry a lookup can read (interpret mode
    on CPU, compiled on GPU); with too few main buckets, too."""
    from moe_eplb_jax.pallas import _guide

    replicas = np.array([9, 5, 3, 2, 1, 1, 4, 1, 2, 12, 1, 7])
    for num_physical in (int(replicas.sum()), 12):
        thresholds, log2phy, count, lookup = _guide_inputs(rng, replicas)
        num_logical, width = thresholds.shape
        want = np.asarray(_guide.guide_table(thresholds, log2phy, count, factor=factor, num_physical=num_physical))
        got = np.asarray(
            jax.jit(
                functools.partial(
                    _guide.guide_kernel,
                    factor=factor,
                    num_logical=num_logical,
                    width=width,
                    num_physical=num_physical,
                    interpret=jax.default_backend() != "gpu",
                )
            )(lookup, thresholds.reshape(-1))
        )
        used = _guide_used(want, count, num_logical, width, factor, num_physical)
        np.testing.assert_array_equal(got[used], want[used])


def test_guide_kernel_with_saturated_quotas(rng):
    """Quotas summing past int32 (thresholds saturate at int32 max, as an uncapped build gives): the guide kernel
    still writes its reference's words -- a bucket ending at int32 max counts only live thresholds."""
    from moe_eplb_jax.pallas import _guide, _triton
    from moe_eplb_jax.pallas.map_and_count import _build_thresholds

    replicas = np.array([5, 3, 1, 2, 4])
    phy2log = rng.permutation(np.repeat(np.arange(replicas.size), replicas))
    placement = Placement.from_phy2log(phy2log, replicas.size)
    log2phy, logcnt = jnp.asarray(placement.log2phy[0]), jnp.asarray(placement.logcnt[0])
    num_logical, width = log2phy.shape
    quotas = rng.integers(2**29, 2**30, (num_logical, width)).astype(np.int32)
    thresholds = _build_thresholds("resolved", jnp.asarray(quotas), logcnt, width)  # no cap: saturating sums
    assert int(thresholds.max()) == np.iinfo(np.int32).max
    count = jnp.clip(logcnt, 1, 0x7FFF)
    num_physical = int(replicas.sum())
    want = np.asarray(_guide.guide_table(thresholds, log2phy, count, factor=4, num_physical=num_physical))
    got = np.asarray(
        _guide.guide_kernel(
            _triton.lookup_table(log2phy, logcnt),
            thresholds.reshape(-1),
            factor=4,
            num_logical=num_logical,
            width=width,
            num_physical=num_physical,
            interpret=jax.default_backend() != "gpu",
        )
    )
    used = _guide_used(want, count, num_logical, width, 4, num_physical)
    np.testing.assert_array_equal(got[used], want[used])


def test_guide_is_used_only_where_it_fits():
    """No guide by default; an explicit factor is used where it fits: shapes whose offsets or bucket sums would
    overflow their bits, non-default tables and slots past 16 bits get none; a bad factor is an error."""
    from moe_eplb_jax.pallas import _triton

    def factor(mode, num_logical, width, num_physical, **options):
        return _triton._guide_factor({**_triton.DEFAULTS, **options}, mode, num_logical, width, num_physical)

    assert factor("resolved", 256, 257, 512) == 0  # the default
    assert factor("resolved", 256, 33, 288) == 0
    assert factor("resolved", 256, 257, 512, guide=4) == 4
    assert factor("resolved", 256, 33, 288, guide=8) == 8
    assert factor("hash", 256, 257, 512, guide=8) == 0
    assert factor("shares", 256, 257, 512, guide=8) == 0  # shares reads its alias table: nothing to search
    assert factor("resolved", 256, 257, 512, layout="expert_major", guide=4) == 0
    assert factor("resolved", 256, 257, 512, tables="global", guide=4) == 0
    assert factor("resolved", 256, 257, 0xFFFF, guide=4) == 0
    assert factor("resolved", 1 << 14, 1 << 13, 1 << 14, guide=8) == 0  # bucket counts could overflow int32
    with pytest.raises(ValueError, match="guide must be"):
        factor("resolved", 256, 257, 512, guide=3)


def test_guided_kernel_matches_reference(rng):
    """The map kernel reading the guide (zero quotas, fallback spares) gives the reference's ids and loads, as
    does the search without it."""
    from moe_eplb_jax.pallas import _reference, _triton

    replicas = np.array([9, 5, 3, 2, 1, 1, 4, 1, 2, 12])
    thresholds, log2phy, _, _ = _guide_inputs(rng, replicas)
    logcnt = jnp.asarray(replicas)
    mode = "resolved"
    ids = jnp.asarray(random_ids(rng, 500, 4, replicas.size))
    limits = jnp.asarray([480 * 4, 490 * 4], jnp.int32)
    num_physical = int(replicas.sum())
    want = _reference.map_and_count_reference(
        ids, log2phy, logcnt, thresholds, limits, num_physical=num_physical, mode=mode
    )
    for options in ({"guide": 4}, {"guide": 16, "search": "unrolled"}, {"guide": 0}):
        got = _triton.map_and_count_triton(
            ids,
            log2phy,
            logcnt,
            thresholds,
            limits,
            num_physical=num_physical,
            mode=mode,
            interpret=jax.default_backend() != "gpu",
            **options,
        )
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


@pytest.mark.parametrize("tiles", [1, 7, 256, 257, 1000, 2048])
@pytest.mark.parametrize("how", ["cumsum", "matmul"])
def test_tile_bases_are_exclusive_sums(tiles, how, rng):
    """resolved's rank-tile bases are the exclusive sums down the tiles, exactly, by either method (the
    triangular product up to 256 tiles, the cumsum above), with counts whose sums approach 2**24."""
    from moe_eplb_jax.pallas import _triton

    bins = 64
    per_tile = rng.integers(0, (1 << 24) // tiles, (tiles, bins)).astype(np.int32)
    per_tile[:, 0] = (1 << 24) // tiles  # a column whose total is close to 2**24: odd sums must stay exact
    per_tile[:, 1] = 0
    want = np.cumsum(per_tile.astype(np.int64), axis=0) - per_tile
    got = _triton._tile_bases(jnp.asarray(per_tile), how, num_flat=1 << 24)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_rank_tile_bases_over_many_tiles_match_reference(rng):
    """With more than 256 rank tiles (the triangular product's limit) the default falls back to the cumsum inside
    the resolved kernel and gives the reference."""
    from moe_eplb_jax.pallas import _reference, _triton
    from moe_eplb_jax.pallas.map_and_count import _build_thresholds

    placement = random_placement(rng, 16, 40)
    log2phy, logcnt = jnp.asarray(placement.log2phy[0]), jnp.asarray(placement.logcnt[0])
    ids = jnp.asarray(random_ids(rng, 700, 8, 16))  # 5600 entries: 350 rank tiles of 16
    limits = jnp.asarray([690 * 8, 695 * 8], jnp.int32)
    quotas = jnp.asarray(rng.integers(0, 400, (16, 25)).astype(np.int32))
    thresholds = _build_thresholds("resolved", quotas, logcnt, 25)
    want = _reference.map_and_count_reference(
        ids, log2phy, logcnt, thresholds, limits, num_physical=40, mode="resolved"
    )
    got = _triton.map_and_count_triton(
        ids,
        log2phy,
        logcnt,
        thresholds,
        limits,
        num_physical=40,
        mode="resolved",
        interpret=jax.default_backend() != "gpu",
        tile_resolved=16,
        sub_resolved=16,
        tile=1024,
        sub=512,
        resolved_by="ranks",
    )
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def unruly_quotas(rng, quotas, *, huge):
    """``quotas`` with a tenth of them negative and a fraction ``huge`` far past any entry count (int32)."""
    odd = rng.random(quotas.shape)
    return np.where(
        odd < 0.1,
        -rng.integers(1, 2**31 - 1, quotas.shape),
        np.where(odd > 1 - huge, rng.integers(2**28, 2**31 - 1, quotas.shape), quotas),
    ).astype(np.int32)


def boundary_oracle(ids, thresholds, logcnt, rank_limit):
    """``[E, S]``: flat index of expert e's occurrence number ``thresholds[e, j]`` (0-based) among the entries before
    ``rank_limit``, for ``j < min(logcnt[e], S)``; ``int32 max`` where it has no such occurrence or ``j`` is past."""
    num_logical, width = thresholds.shape
    out = np.full((num_logical, width), np.iinfo(np.int32).max, np.int64)
    for e in range(num_logical):
        where = np.flatnonzero(ids[:rank_limit] == e)
        for j in range(min(max(int(logcnt[e]), 0), width)):
            if thresholds[e, j] < len(where):
                out[e, j] = where[thresholds[e, j]]
    return out


@settings(max_examples=8, deadline=None)
@given(
    num_flat=st.integers(1, 700),
    num_logical=st.sampled_from([1, 3, 16, 40]),
    width=st.sampled_from([1, 2, 5, 9]),
    tile=st.sampled_from([16, 32, 128, None]),
    groups=st.sampled_from([1, 2, 3, None]),
    scan=st.sampled_from([16, 64, None]),
    quota_scale=st.sampled_from([0.0, 0.3, 1.0, 3.0]),
    grid=st.sampled_from(["expert", "flat"]),
    programs=st.sampled_from([1, 3, 64]),
    from_quotas=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_boundary_positions_match_oracle(
    num_flat, num_logical, width, tile, groups, scan, quota_scale, grid, programs, from_quotas, seed
):
    """The boundary kernel (resolved by positions) finds, for every live quota threshold, the flat index of that
    occurrence of its expert -- across tile edges, with equal thresholds (zero quotas), thresholds past the demand,
    invalid ids, replica counts of 0 or above the width, a rank limit; rows past the count stay int32 max. Both
    grids: programs per expert, or one per live boundary (fewer programs than boundaries: each takes several).
    ``from_quotas``: the programs sum the raw quotas themselves (negative ones and ones far past the entry count
    among them), as the wrapper's thresholds are built."""
    from moe_eplb_jax.pallas import _positions
    from moe_eplb_jax.pallas.map_and_count import _build_thresholds

    rng = np.random.default_rng(seed)
    ids = rng.integers(-1, num_logical + 1, num_flat).astype(np.int32)
    logcnt = rng.integers(0, width + 2, num_logical).astype(np.int32)
    demand = num_flat / max(num_logical, 1)
    quotas = rng.integers(0, int(quota_scale * demand / width) + 2, (num_logical, width)).astype(np.int32)
    quotas = unruly_quotas(rng, quotas, huge=0.05)
    thresholds = np.asarray(
        _build_thresholds("resolved", jnp.asarray(quotas), jnp.asarray(logcnt), width, limit=num_flat)
    )
    rank_limit = int(rng.integers(0, num_flat + 1))
    limits = jnp.asarray([rank_limit, rank_limit], jnp.int32)
    got = _positions.boundary_positions(
        jnp.asarray(ids),
        jnp.asarray((quotas if from_quotas else thresholds).reshape(-1)),
        limits,
        jnp.asarray(logcnt),
        num_logical=num_logical,
        width=width,
        expert_bins=max(32, 1 << (num_logical - 1).bit_length()),
        tile=tile,
        groups=groups,
        scan=scan,
        grid=grid,
        programs=programs,
        quota_cap=num_flat if from_quotas else None,
        interpret=True,
    )
    got = np.asarray(got)[: num_logical * width].reshape(num_logical, width)
    np.testing.assert_array_equal(got, boundary_oracle(ids, thresholds, logcnt, rank_limit))


@pytest.mark.parametrize("grid", ["expert", "flat"])
def test_boundary_positions_exact_at_tile_edges(grid):
    """Thresholds that fall exactly on a tile's first or last occurrence of an expert (the running counts' steps),
    in tiles holding none of it between, and past its last occurrence."""
    from moe_eplb_jax.pallas import _positions

    tile = 16
    ids = np.full(8 * tile, 5, np.int32)
    ids[::3] = 0  # expert 0 every third entry: 6 per tile for the first tiles ...
    ids[2 * tile : 4 * tile] = 7  # ... none in tiles 2-3
    where = np.flatnonzero(ids == 0)
    per_tile = np.bincount(where // tile, minlength=8)
    edges = np.cumsum(per_tile)  # occurrence number edges[t] is the first one after tile t
    picks = sorted(
        {0, int(edges[0]) - 1, int(edges[0]), int(edges[1]), int(edges[3]), int(edges[4]) - 1, len(where) - 1}
    )
    thresholds = np.full((8, 8), np.iinfo(np.int32).max, np.int32)
    thresholds[0, : len(picks) + 1] = picks + [len(where)]  # the last is past the demand
    logcnt = np.zeros(8, np.int32)
    logcnt[0] = len(picks) + 1
    got = _positions.boundary_positions(
        jnp.asarray(ids),
        jnp.asarray(thresholds.reshape(-1)),
        jnp.asarray([ids.size, ids.size], jnp.int32),
        jnp.asarray(logcnt),
        num_logical=8,
        width=8,
        expert_bins=32,
        tile=tile,
        groups=2,
        scan=16,
        grid=grid,
        programs=5,
        interpret=True,
    )
    got = np.asarray(got)[:64].reshape(8, 8)
    np.testing.assert_array_equal(got[0, : len(picks)], where[picks])
    assert got[0, len(picks)] == np.iinfo(np.int32).max
    np.testing.assert_array_equal(got[1:], np.iinfo(np.int32).max)
    args = (
        jnp.asarray(ids),
        jnp.asarray(thresholds.reshape(-1)),
        jnp.asarray([ids.size, ids.size], jnp.int32),
        jnp.asarray(logcnt),
    )
    with pytest.raises(ValueError, match="groups and programs >= 1"):
        _positions.boundary_positions(*args, num_logical=8, width=8, expert_bins=32, grid=grid, programs=0)
    with pytest.raises(ValueError, match="the boundary grid must be"):
        _positions.boundary_positions(*args, num_logical=8, width=8, expert_bins=32, grid="tiles")
    with pytest.raises(ValueError, match="quota_cap must be >= 0"):  # sums of 8 quotas of 2**28 would not fit
        _positions.boundary_positions(*args, num_logical=8, width=8, expert_bins=32, quota_cap=2**28)


@settings(max_examples=7, deadline=None)
@given(
    num_tokens=st.integers(1, 200),
    top_k=st.sampled_from([1, 4, 8]),
    num_logical=st.sampled_from([1, 2, 5, 16]),
    extra_slots=st.integers(0, 12),
    sub=st.sampled_from([16, 32, 256]),
    quota_scale=st.sampled_from([0.0, 0.2, 1.0, 3.0]),
    position_map=st.sampled_from(["start", "search"]),
    boundary_grid=st.sampled_from(["expert", "flat"]),
    from_quotas=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_positions_map_matches_reference(
    num_tokens, top_k, num_logical, extra_slots, sub, quota_scale, position_map, boundary_grid, from_quotas, seed
):
    """The map kernel over boundary positions: with each expert's boundaries before the step looked up once per
    step (``position_map="start"``), entries before their expert's next boundary take it as their answer and the
    rest search on -- right with several boundaries in one step, a boundary on a step's first or last entry, zero
    quotas (equal positions), quotas past the demand, a rank limit inside a step; same as the plain search; the
    boundaries from the thresholds or from the raw quotas (``quotas=``)."""
    from moe_eplb_jax.pallas import _reference, _triton
    from moe_eplb_jax.pallas.map_and_count import _build_thresholds

    rng = np.random.default_rng(seed)
    placement = random_placement(rng, num_logical, num_logical + extra_slots)
    log2phy, logcnt = jnp.asarray(placement.log2phy[0]), jnp.asarray(placement.logcnt[0])
    width = log2phy.shape[1]
    ids = jnp.asarray(random_ids(rng, num_tokens, top_k, num_logical))
    demand = ids.size / num_logical
    quotas = rng.integers(0, int(quota_scale * demand / width) + 2, (num_logical, width)).astype(np.int32)
    thresholds = _build_thresholds("resolved", jnp.asarray(quotas), logcnt, width, limit=ids.size)
    valid = int(rng.integers(0, num_tokens + 1)) * top_k
    limits = jnp.asarray([int(rng.integers(0, valid + 1)), valid], jnp.int32)
    want = _reference.map_and_count_reference(
        ids, log2phy, logcnt, thresholds, limits, num_physical=num_logical + extra_slots, mode="resolved"
    )
    got = _triton.map_and_count_triton(
        ids,
        log2phy,
        logcnt,
        thresholds,
        limits,
        num_physical=num_logical + extra_slots,
        mode="resolved",
        interpret=jax.default_backend() != "gpu",
        resolved_by="positions",
        position_map=position_map,
        sub=sub,
        tile=sub,
        position_tile=16,
        boundary_grid=boundary_grid,
        quotas=quotas if from_quotas else None,
    )
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


# ------------------------------------------------------------ resolved in one kernel (look-back)
@pytest.mark.parametrize("programs, window", [(7, 16), (40, 16), (40, 1), (23, 4), (1, 16)])
@pytest.mark.parametrize("seed", range(2))
def test_lookback_walks_aggregates_and_inclusive_words(programs, window, seed):
    """The look-back of one program over a board where the earlier programs' words are a mix, per expert, of
    aggregates (their own counts: walk on) and inclusive sums (stop there): every lane gets the counts of all
    earlier programs, over several windows of them, and the program posts its inclusive word. (On a GPU the
    programs run at once, so a lane may meet any mix; interpret mode runs them in order and always meets an
    inclusive word first.)"""
    from jax.experimental import pallas as pl

    from moe_eplb_jax.pallas import _rank

    rng = np.random.default_rng(seed)
    bins = 32
    counts = rng.integers(0, 1000, (programs, bins)).astype(np.int32)
    inclusive = rng.random((programs - 1, bins)) < 0.1
    inclusive[:1] = True  # the first program posts its inclusive word at once
    board = np.where(inclusive, (np.cumsum(counts[:-1], axis=0) << 2) | 2, (counts[:-1] << 2) | 1)
    board = np.concatenate([board, np.zeros((1, bins), np.int64)]).astype(np.int32).reshape(-1)

    def kernel(board_in_ref, total_ref, board_ref, bases_ref):
        del board_in_ref
        bases_ref[...] = _rank.lookback_bases(
            board_ref, jnp.int32(programs - 1), total_ref[...], expert_bins=bins, window=window
        )

    board_out, bases = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(board.shape, jnp.int32), jax.ShapeDtypeStruct((bins,), jnp.int32)],
        input_output_aliases={0: 0},
        interpret=True,
    )(jnp.asarray(board), jnp.asarray(counts[-1]))
    want = counts[:-1].sum(axis=0)
    np.testing.assert_array_equal(np.asarray(bases), want)
    np.testing.assert_array_equal(np.asarray(board_out)[-bins:], ((want + counts[-1]) << 2) | 2)
    np.testing.assert_array_equal(np.asarray(board_out)[:-bins], board[:-bins])


@settings(max_examples=6, deadline=None)
@given(
    num_tokens=st.integers(1, 400),
    top_k=st.sampled_from([1, 2, 8]),
    num_logical=st.sampled_from([1, 5, 40]),
    extra_slots=st.integers(0, 20),
    rank_tile=st.sampled_from([64, 128, 256]),
    chains=st.sampled_from([1, 2]),
    rank_sub=st.sampled_from([16, 32]),
    seed=st.integers(0, 2**31),
)
def test_lookback_kernel_matches_reference(
    num_tokens, top_k, num_logical, extra_slots, rank_tile, chains, rank_sub, seed
):
    """``resolved`` by ranks in one kernel (``tile_bases="lookback"``) over many rank tiles -- each program's bases
    from the programs before it -- gives the reference's ids and loads, with padding and a record limit."""
    from moe_eplb_jax.pallas import _reference, _triton
    from moe_eplb_jax.pallas.map_and_count import _build_thresholds

    rng = np.random.default_rng(seed)
    placement = random_placement(rng, num_logical, num_logical + extra_slots)
    log2phy, logcnt = jnp.asarray(placement.log2phy[0]), jnp.asarray(placement.logcnt[0])
    ids = jnp.asarray(random_ids(rng, num_tokens, top_k, num_logical))
    extra = random_mode_inputs(rng, "resolved", placement, ids.size)
    thresholds = _build_thresholds("resolved", jnp.asarray(extra["resolved"]), logcnt, log2phy.shape[1])
    valid = int(rng.integers(0, num_tokens + 1)) * top_k
    limits = jnp.asarray([int(rng.integers(0, valid + 1)), valid], jnp.int32)
    want = _reference.map_and_count_reference(
        ids, log2phy, logcnt, thresholds, limits, num_physical=num_logical + extra_slots, mode="resolved"
    )
    options = {
        "tile_bases": "lookback",
        "tile_resolved": rank_tile,
        "sub_resolved": rank_sub,
        "rank_chains": chains,
        "resolved_by": "ranks",
    }
    got = _triton.map_and_count_triton(
        ids,
        log2phy,
        logcnt,
        thresholds,
        limits,
        num_physical=num_logical + extra_slots,
        mode="resolved",
        interpret=jax.default_backend() != "gpu",
        **options,
    )
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_lookback_refuses_inputs_its_words_cannot_count():
    """A board word holds ``count << 2``: forcing the one-kernel path on 2**29 entries or more is a clear error
    (traced shapes only: nothing that size is allocated)."""
    from moe_eplb_jax.pallas import _triton

    spec = jax.ShapeDtypeStruct
    with pytest.raises(ValueError, match="tile_bases='lookback' supports fewer than 2\\*\\*29 entries"):
        jax.eval_shape(
            functools.partial(
                _triton.map_and_count_triton,
                num_physical=40,
                mode="resolved",
                tile_bases="lookback",
                resolved_by="ranks",
            ),
            spec((1 << 26, 8), jnp.int32),
            spec((16, 25), jnp.int32),
            spec((16,), jnp.int32),
            spec((16, 25), jnp.int32),
            spec((2,), jnp.int32),
        )


@pytest.mark.parametrize("chains, tile_bases", [(1, "matmul"), (4, "matmul"), (4, "cumsum"), (2, "lookback")])
@pytest.mark.parametrize("seed", range(3))
def test_ranks_with_quotas_build_the_wrapper_thresholds(chains, tile_bases, seed):
    """By ranks with the raw quotas passed (as the public call does), the rank kernel's extra programs build the
    thresholds the wrapper would -- negative quotas, quotas far past the entry count, replica counts of 0 and past
    the table's width, a rank limit -- and the mapping equals the reference's (the look-back path keeps the
    wrapper's thresholds)."""
    from moe_eplb_jax.pallas import _reference, _triton
    from moe_eplb_jax.pallas.map_and_count import _build_thresholds

    rng = np.random.default_rng(seed)
    num_logical, width, num_tokens, top_k = 12, 7, 150, 4
    placement = random_placement(rng, num_logical, num_logical + 20)
    log2phy = jnp.asarray(placement.log2phy[0, :, :width])
    logcnt = placement.logcnt[0].copy()
    logcnt[:2] = [0, width + 3]
    ids = jnp.asarray(random_ids(rng, num_tokens, top_k, num_logical))
    quotas = rng.integers(0, 30, (num_logical, width))
    quotas = unruly_quotas(rng, quotas, huge=0.07)
    quotas[2] = 2**31 - 1 - np.arange(width)  # unclipped, their sums would overflow int32
    logcnt[2] = width
    thresholds = _build_thresholds("resolved", jnp.asarray(quotas), jnp.asarray(logcnt), width, limit=ids.size)
    limits = jnp.asarray([130 * top_k, 140 * top_k], jnp.int32)
    want = _reference.map_and_count_reference(
        ids, log2phy, jnp.asarray(logcnt), thresholds, limits, num_physical=num_logical + 20, mode="resolved"
    )
    got = _triton.map_and_count_triton(
        ids,
        log2phy,
        jnp.asarray(logcnt),
        jnp.zeros_like(thresholds) if tile_bases != "lookback" else thresholds,
        limits,
        num_physical=num_logical + 20,
        mode="resolved",
        interpret=jax.default_backend() != "gpu",
        quotas=jnp.asarray(quotas),
        resolved_by="ranks",
        tile_resolved=128,
        sub_resolved=32,
        rank_chains=chains,
        tile_bases=tile_bases,
        tile=128,
        sub=64,
    )
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))

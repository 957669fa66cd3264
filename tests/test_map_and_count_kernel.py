"""Tests of the Pallas kernels behind ``map_and_count``: their ``Config`` (tiling and mode ``"quota"``'s paths),
the alias table's forms, the rank look-back and boundary positions of ``"quota"``, and the lowering of every
kernel to Triton IR on CPU.

Every configuration runs through the shared parity body (``check_parity``: the oracle, or the reference above
4096 entries) on fresh random inputs: in interpret mode on CPU, compiled on GPU (more tilings and sizes, marked
``gpu``). The public function's semantics are tested in ``test_map_and_count.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _map_and_count_data import Case, check_parity, random_ids, random_mode_inputs
from _models import random_placement
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_eplb_jax.placement import Placement
from moe_eplb_jax.routing import ROUTING_MODES
from moe_eplb_jax.routing._map_and_count import (
    QUOTA_PATHS,
    Config,
    _alias,
    _positions,
    _rank,
    _tables,
    _triton,
    lookup_table,
)

INT32_MAX = np.iinfo(np.int32).max


# ------------------------------------------------------------ Config
def _slow(*values):
    return pytest.param(*values, marks=pytest.mark.slow)


def _gpu(*values):
    return pytest.param(*values, marks=pytest.mark.gpu)


CONFIGS = [  # (mode, config): every mode's default tiling and every quota path (fast lane); other tilings (slow);
    # larger tilings (GPU only)
    ("hash", Config()),
    _slow("hash", Config(tile=128, sub=16)),
    _slow("round_robin", Config(tile=1024, sub=1024, num_warps=8)),
    ("lp", Config()),
    _slow("lp", Config(tile=64, sub=32, alias_warps=1)),
    *[("quota", Config(quota_path=path)) for path in QUOTA_PATHS],
    _slow("quota", Config(quota_path="lookback", rank_tile=32)),
    _slow("quota", Config(quota_path="lookback", rank_tile=64, sub=16)),
    _slow("quota", Config(quota_path="ranks", rank_tile=64, tile=128, sub=32)),
    _slow("quota", Config(quota_path="positions", position_tile=16, position_scan=16, tile=64, sub=16)),
    _slow("quota", Config(quota_path="positions", position_tile=512, position_scan=64, tile=32768, sub=32768)),
    _gpu("round_robin", Config()),
    *[_gpu(mode, Config(tile=1024, sub=1024, num_warps=8)) for mode in ROUTING_MODES],
    *[_gpu(mode, Config(tile=4096, sub=4096, num_warps=16)) for mode in ROUTING_MODES],
    _gpu("quota", Config(quota_path="lookback", rank_tile=64)),
    _gpu("quota", Config(quota_path="ranks", rank_tile=128)),
    _gpu("quota", Config(quota_path="positions", position_tile=4096, position_scan=512, count_warps=8)),
]
SHAPES = [  # (T, k, E, P): padding, invalid ids; on a GPU also one entry, E = 512, 65536 entries
    (300, 6, 16, 40),
    _gpu((1, 1, 8, 8)),
    _gpu((333, 6, 512, 519)),
    _gpu((8192, 8, 256, 288)),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}k{}E{}P{}".format(*s))
@pytest.mark.parametrize("mode, config", CONFIGS, ids=lambda c: c if isinstance(c, str) else None)
def test_configs_match_reference(mode, config, shape, rng):
    """The tiling and the quota path never change the result (padding, invalid ids; the 32768-entry steps are too
    large for the boundary start words: their entries search)."""
    num_tokens, top_k = shape[:2]
    if config.quota_path == "ranks" and mode == "quota" and num_tokens * top_k > _rank.MAX_TILES * config.rank_tile:
        pytest.skip("too many rank tiles for one product")
    check_parity("pallas", Case.draw(rng, mode, *shape), config=config)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"tile": 96}, "Config.tile must be a power of two >= 16"),
        ({"sub": 8}, "Config.sub must be a power of two >= 16"),
        ({"tile": 64, "sub": 128}, "must not exceed Config.tile"),
        ({"rank_tile": 16}, "Config.rank_tile must be a power of two >= 32"),
        ({"position_scan": 48}, "Config.position_scan"),
        ({"num_warps": 3}, "Config.num_warps must be a power of two"),
        ({"alias_warps": True}, "Config.alias_warps"),
        ({"num_stages": 0}, "Config.num_stages"),
        ({"quota_path": "sorted"}, "Config.quota_path must be one of"),
    ],
)
def test_config_rejects_bad_fields(fields, message):
    with pytest.raises(ValueError, match=message):
        Config(**fields)


def test_default_config_follows_the_size():
    """Quota paths by size (one look-back kernel up to 32 rank tiles of 256, ranks up to 65536 entries, boundary
    positions above); larger loop steps from 2**19 entries, larger programs from 2**21 (not for quota)."""
    paths = {n: Config.default("quota", n).quota_path for n in (1, 8192, 8193, 65536, 65537, 1 << 21)}
    assert paths == {1: "lookback", 8192: "lookback", 8193: "ranks", 65536: "ranks", 65537: "positions"} | {
        1 << 21: "positions"
    }
    assert Config.default("hash", 0) == Config.default("hash", 1) == Config(tile=256, sub=256)
    assert Config.default("hash", 4096 * 8) == Config(tile=256, sub=256)
    assert Config.default("hash", 512 * 1024) == Config(tile=4096, sub=4096, num_warps=16)
    assert Config.default("round_robin", 512 * 300) == Config(tile=512, sub=256)
    assert Config.default("lp", 1 << 21) == Config(tile=8192, sub=4096, num_warps=16)
    big = Config.default("quota", 1 << 21)
    assert (big.tile, big.sub, big.position_tile, big.count_warps) == (4096, 4096, 4096, 8)


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(
    num_tokens=st.integers(1, 300),
    top_k=st.sampled_from([1, 3, 8]),
    num_logical=st.sampled_from([2, 9, 40]),
    extra_slots=st.integers(0, 30),
    mode=st.sampled_from(ROUTING_MODES),
    quota_path=st.sampled_from(QUOTA_PATHS),
    tile=st.sampled_from([16, 64, 256]),
    rank_tile=st.sampled_from([32, 64, 256]),
    position_tile=st.sampled_from([16, 64, 256]),
    seed=st.integers(0, 2**31),
)
def test_any_shape_and_config_matches_reference(
    num_tokens, top_k, num_logical, extra_slots, mode, quota_path, tile, rank_tile, position_tile, seed
):
    """Any shape, tiling and quota path gives the oracle's ids and loads."""
    rng = np.random.default_rng(seed)
    case = Case.draw(rng, mode, num_tokens, top_k, num_logical, num_logical + extra_slots, record=seed % 2 == 0)
    config = Config(
        tile=tile,
        sub=min(tile, 64),
        quota_path=quota_path,
        rank_tile=rank_tile,
        position_tile=position_tile,
        position_scan=16,
    )
    check_parity("pallas", case, config=config)


@pytest.mark.parametrize(
    "mode, config",
    [_slow(m, Config()) for m in ("hash", "round_robin")]  # one replica lookup, as lp's first step
    + [("lp", Config())]
    + [("quota", Config(quota_path=path)) for path in QUOTA_PATHS],
    ids=lambda c: c if isinstance(c, str) else c.quota_path,
)
@pytest.mark.parametrize("wide", [True, _slow(False)], ids=["wide", "narrow"])
def test_wide_and_narrow_rows_match_reference(mode, config, wide, rng):
    """Experts with 1 to 20 replicas: the replica lookups, the alias words and the quota search (bisection bounded by
    each expert's replica count) give the reference's result, and late replicas are picked."""
    replicas = np.array([20, 17, 16, 3, 2, 1, 1, 4] if wide else [16, 9, 5, 3, 2, 1, 1, 4])
    phy2log = rng.permutation(np.repeat(np.arange(replicas.size), replicas))
    placement = Placement.from_phy2log(phy2log, replicas.size)
    log2phy = placement.log2phy[0, :, : replicas.max()]  # as wide as the most replicated expert
    logcnt = placement.logcnt[0]
    ids = random_ids(rng, 200, 4, replicas.size)
    extra = {
        name: value[:, : log2phy.shape[1]] for name, value in random_mode_inputs(rng, mode, placement, 800).items()
    }
    if mode == "quota":  # quotas below demand: entries past an expert's last threshold fall back to hash
        extra["quotas"] //= 32
    case = Case(ids, log2phy, logcnt, int(replicas.sum()), mode, extra, num_valid=195)
    phys, _ = check_parity("pallas", case, config=config)
    replica_of = {int(slot): j for e in range(replicas.size) for j, slot in enumerate(log2phy[e]) if slot >= 0}
    assert max(replica_of[int(p)] for p in phys.ravel() if p >= 0) >= 3


# ------------------------------------------------------------ mode "lp": the alias table's forms
@pytest.mark.slow  # thousands of slots in interpret mode
@pytest.mark.parametrize("shape, num_physical", [((15, 4), 60), ((2200, 64), 4000), ((1500, 96), 2000)])
def test_alias_table_forms_match_reference(shape, num_physical, rng):
    """However the alias table lies -- one word per bucket (up to 2047 slots) or a (word, slot) pair, the expert's
    head word alone (every offset in its 17 bits) or the head pair (offsets past 2**17) -- built per call
    or prepared, it gives the reference's ids and loads."""
    num_logical, width = shape
    logcnt = np.full(num_logical, width, np.int32)
    logcnt[1::10] = rng.integers(1, width + 1, logcnt[1::10].size)
    log2phy = rng.integers(0, num_physical, (num_logical, width)).astype(np.int32)
    shares = rng.uniform(0.0, 1.0, (num_logical, width)).astype(np.float32)
    ids = rng.integers(-1, num_logical + 1, (500, 4)).astype(np.int32)
    ids[::2, 1] = 0  # the widest expert: buckets up to its last
    ids[1::2, 2] = num_logical - 1 - ids[1::2, 2] % 40  # the last experts: the largest offsets
    case = Case(ids, log2phy, logcnt, num_physical, "lp", {"replica_shares": shares}, num_valid=490)
    small = shape == (15, 4)
    assert _alias.word_heads_fit(num_logical, width) == small
    assert small or np.clip(logcnt, 1, width)[:-1].sum() >= 1 << _alias.HEAD_SHIFT
    # Traced: these random tables list slots twice, which only concrete tables are refused for.
    one_word = jax.jit(functools.partial(lookup_table, num_physical=num_physical))(
        log2phy, logcnt, replica_shares=shares
    )
    two_words = jax.jit(lookup_table)(log2phy, logcnt, replica_shares=shares)
    assert (one_word.size < two_words.size) == _alias.compact_fits(num_physical)
    lookups = [None, two_words] + ([one_word] if _alias.compact_fits(num_physical) else [])
    for lookup in lookups:
        check_parity(
            "pallas", case, lookup=lookup, message=f"lookup of {None if lookup is None else lookup.size} words"
        )


# ------------------------------------------------------------ Triton lowering on CPU
def _lowered(fn, *specs, h100_lowering):
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=h100_lowering)(*specs)
    return exported.mlir_module().count("xla.gpu.triton")


LOWERING_CASES = [  # (mode, T, S, P, prepared lookup, Triton kernels per call)
    ("hash", 4096, 33, 288, "plain", 1),
    ("round_robin", 4096, 33, 288, None, 1),
    ("lp", 4096, 33, 288, None, 2),  # the alias table's kernel, then the map kernel
    ("lp", 4096, 33, 288, "words", 1),
    ("lp", 4096, 33, 4000, None, 2),  # (word, slot) pairs
    ("quota", 512, 33, 288, None, 1),  # ranks, look-back and mapping in one kernel
    ("quota", 4096, 33, 288, None, 2),  # ranks (and thresholds), then the map kernel
    ("quota", 16384, 33, 288, None, 3),  # tile counts, boundary positions, the map kernel
    ("hash", 1 << 16, 33, 512, None, 1),  # 2**19 entries: 4096-entry steps
    ("lp", 1 << 18, 257, 512, "words", 1),  # 2**21 entries: 8192-entry programs
    ("quota", 1 << 18, 257, 512, None, 3),
    *[(mode, 4096, 33, 40000, None, 2 if mode == "lp" else 1) for mode in ("hash", "lp")],  # per-entry atomics
    ("quota", 16384, 33, 40000, None, 3),
    ("hash", 4096, 33, 70000, "plain", 1),  # slots past 16 bits: the wide lookup
    ("quota", 4096, 33, 70000, None, 2),
]


def test_kernels_lower_to_triton_ir(h100_lowering):
    """Lowers every mode's kernels -- every quota path, the alias table's forms, large inputs' tiling, per-entry
    atomics past 32768 slots, wide slots -- to Triton IR for an H100/H200 without a GPU (catches lowering breakage,
    e.g. of the hand-written rules in ``_triton_ops`` on a new JAX), and counts the kernels of each call."""
    spec = jax.ShapeDtypeStruct
    for mode, num_tokens, width, num_physical, prepared, kernels in LOWERING_CASES:
        num_logical = 256
        values = spec((num_logical, width), jnp.float32 if mode == "lp" else jnp.int32)
        lookup = None
        if prepared == "plain":
            lookup = spec((_tables.lookup_size(num_logical, width),), jnp.int32)
        elif prepared == "words":
            words = _alias.packed_size(num_logical, width, _alias.compact_fits(num_physical))
            lookup = spec((_tables.lookup_size(num_logical, width) + words,), jnp.int32)

        def run(ids, log2phy, logcnt, values, limits, lookup=None, mode=mode, num_physical=num_physical):
            return _triton.map_and_count_triton(
                ids,
                log2phy,
                logcnt,
                limits,
                num_physical=num_physical,
                mode=mode,
                quotas=values if mode == "quota" else None,
                shares=values if mode == "lp" else None,
                lookup=lookup,
            )

        specs = [
            spec((num_tokens, 8), jnp.int32),
            spec((num_logical, width), jnp.int32),
            spec((num_logical,), jnp.int32),
        ]
        specs += [values, spec((3,), jnp.int32)] + ([lookup] if lookup is not None else [])
        case = (mode, num_tokens, width, num_physical, prepared)
        assert _lowered(run, *specs, h100_lowering=h100_lowering) == kernels, case


# ------------------------------------------------------------ mode "quota": ranks and the look-back
@pytest.mark.parametrize("programs, window", [(7, 16), (40, 16), (40, 1), (23, 4), (1, 16)])
@pytest.mark.parametrize("seed", range(2))
def test_lookback_walks_aggregates_and_inclusive_words(programs, window, seed):
    """The look-back of one program over a board where the earlier programs' words are a mix, per expert, of
    aggregates (their own counts: walk on) and inclusive sums (stop there): every lane gets the counts of all
    earlier programs, over several windows of them, and the program posts its inclusive word. (On a GPU the
    programs run at once, so a lane may meet any mix; interpret mode runs them in order and always meets an
    inclusive word first.)"""
    from jax.experimental import pallas as pl

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


def test_paths_refuse_inputs_their_words_cannot_count():
    """Forcing a quota path past what its words hold is a clear error (traced shapes only: nothing is allocated): the
    look-back's board words hold ``count << 2``; the ranks' tile sums are one product over at most 256 tiles."""
    spec = jax.ShapeDtypeStruct

    def trace(num_tokens, config):
        run = functools.partial(_triton.map_and_count_triton, num_physical=40, mode="quota", config=config)
        return jax.eval_shape(
            lambda ids, log2phy, logcnt, limits, quotas: run(ids, log2phy, logcnt, limits, quotas=quotas),
            spec((num_tokens, 8), jnp.int32),
            spec((16, 25), jnp.int32),
            spec((16,), jnp.int32),
            spec((3,), jnp.int32),
            spec((16, 25), jnp.int32),
        )

    with pytest.raises(ValueError, match="fewer than 2\\*\\*29 entries"):
        trace(1 << 26, Config(quota_path="lookback"))
    with pytest.raises(ValueError, match="at most 256 rank tiles"):
        trace(257 * 32, Config(quota_path="ranks"))


def unruly_quotas(rng, quotas, *, huge):
    """``quotas`` with a tenth of them negative and a fraction ``huge`` far past any entry count (int32)."""
    odd = rng.random(quotas.shape)
    return np.where(
        odd < 0.1,
        -rng.integers(1, 2**31 - 1, quotas.shape),
        np.where(odd > 1 - huge, rng.integers(2**28, 2**31 - 1, quotas.shape), quotas),
    ).astype(np.int32)


@pytest.mark.parametrize("path", QUOTA_PATHS)
@pytest.mark.parametrize("seed", [0, _slow(1)])
def test_unruly_quotas_and_counts_match_reference(path, seed):
    """Negative quotas, quotas far past the entry count (unclipped, their sums would overflow int32), replica counts
    of 0 and past the table's width, a rank limit: each quota path sums the raw quotas as the reference's
    thresholds are built (inside jit such tables are accepted: only concrete ones are refused)."""
    rng = np.random.default_rng(seed)
    num_logical, width, num_tokens, top_k = 12, 7, 150, 4
    placement = random_placement(rng, num_logical, num_logical + 20)
    log2phy = placement.log2phy[0, :, :width]
    logcnt = placement.logcnt[0].copy()
    logcnt[:2] = [0, width + 3]
    ids = random_ids(rng, num_tokens, top_k, num_logical)
    quotas = unruly_quotas(rng, rng.integers(0, 30, (num_logical, width)), huge=0.07)
    quotas[2] = 2**31 - 1 - np.arange(width)
    logcnt[2] = width
    config = Config(quota_path=path, rank_tile=128, tile=128, sub=64, position_tile=64)
    case = Case(ids, log2phy, logcnt, num_logical + 20, "quota", {"quotas": quotas}, num_valid=140)
    check_parity("pallas", case, config=config)


def test_kernel_quotas_keep_their_sums_in_int32(rng):
    """Where a row's clipped quotas could sum past int32 (``S * cap >= 2**31 - 1``), the kernels get the steps of the
    thresholds instead: their clipped running sums are the thresholds, and every one fits int32."""
    num_logical, width, cap = 9, 8, 2**28
    logcnt = rng.integers(0, width + 2, num_logical).astype(np.int32)
    quotas = unruly_quotas(rng, rng.integers(0, 2**27, (num_logical, width)), huge=0.3)
    want = np.asarray(_tables.quota_thresholds(jnp.asarray(quotas), jnp.asarray(logcnt), cap=cap))
    steps = np.asarray(_tables.kernel_quotas(jnp.asarray(quotas), jnp.asarray(logcnt), cap=cap)).astype(np.int64)
    live = np.arange(width)[None, :] < logcnt[:, None]
    sums = np.minimum(np.cumsum(np.where(live, np.clip(steps, 0, cap), 0), axis=1), cap)
    np.testing.assert_array_equal(np.where(live, sums, INT32_MAX), want)
    assert np.cumsum(np.clip(steps, 0, cap), axis=1).max() < 2**31
    small = _tables.kernel_quotas(jnp.asarray(quotas), jnp.asarray(logcnt), cap=1000)
    np.testing.assert_array_equal(np.asarray(small), quotas)  # they fit: the quotas as they are


# ------------------------------------------------------------ mode "quota": boundary positions
def boundary_oracle(ids, thresholds, logcnt, rank_limit):
    """``[E, S]``: flat index of expert e's occurrence number ``thresholds[e, j]`` (0-based) among the entries before
    ``rank_limit``, for ``j < min(logcnt[e], S)``; ``int32 max`` where it has no such occurrence or ``j`` is past."""
    num_logical, width = thresholds.shape
    out = np.full((num_logical, width), INT32_MAX, np.int64)
    for e in range(num_logical):
        where = np.flatnonzero(ids[:rank_limit] == e)
        for j in range(min(max(int(logcnt[e]), 0), width)):
            if thresholds[e, j] < len(where):
                out[e, j] = where[thresholds[e, j]]
    return out


def _boundaries(ids, quotas, logcnt, rank_limit, *, tile, scan, programs):
    num_logical, width = quotas.shape
    got = _positions.boundary_positions(
        jnp.asarray(ids),
        jnp.asarray(quotas.reshape(-1)),
        jnp.asarray([rank_limit, rank_limit], jnp.int32),
        jnp.asarray(logcnt),
        num_logical=num_logical,
        width=width,
        expert_bins=max(32, 1 << (num_logical - 1).bit_length()),
        tile=tile,
        scan=scan,
        count_warps=4,
        num_warps=4,
        programs=programs,
        cap=ids.size,
        interpret=True,
        out_struct=jax.ShapeDtypeStruct,
    )
    return np.asarray(got)[: num_logical * width].reshape(num_logical, width)


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(
    num_flat=st.integers(1, 700),
    num_logical=st.sampled_from([1, 3, 16, 40]),
    width=st.sampled_from([1, 2, 5, 9]),
    tile=st.sampled_from([16, 32, 128]),
    scan=st.sampled_from([16, 64]),
    quota_scale=st.sampled_from([0.0, 0.3, 1.0, 3.0]),
    programs=st.sampled_from([1, 3, 64]),
    seed=st.integers(0, 2**31),
)
def test_boundary_positions_match_oracle(num_flat, num_logical, width, tile, scan, quota_scale, programs, seed):
    """The boundary kernel finds, for every live quota threshold, the flat index of that occurrence of its expert --
    across tile edges, with equal thresholds (zero quotas), thresholds past the demand, invalid ids, replica counts
    of 0 or above the width, a rank limit, negative quotas and ones far past the entry count, fewer programs than
    boundaries (each takes several); rows past the count stay int32 max."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(-1, num_logical + 1, num_flat).astype(np.int32)
    logcnt = rng.integers(0, width + 2, num_logical).astype(np.int32)
    demand = num_flat / max(num_logical, 1)
    quotas = rng.integers(0, int(quota_scale * demand / width) + 2, (num_logical, width)).astype(np.int32)
    quotas = np.asarray(_tables.kernel_quotas(unruly_quotas(rng, quotas, huge=0.05), logcnt, cap=num_flat))
    thresholds = np.asarray(_tables.quota_thresholds(jnp.asarray(quotas), jnp.asarray(logcnt), cap=num_flat))
    rank_limit = int(rng.integers(0, num_flat + 1))
    got = _boundaries(ids, quotas, logcnt, rank_limit, tile=tile, scan=scan, programs=programs)
    np.testing.assert_array_equal(got, boundary_oracle(ids, thresholds, logcnt, rank_limit))


def test_boundary_positions_exact_at_tile_edges():
    """Thresholds that fall exactly on a tile's first or last occurrence of an expert (the running counts' steps),
    in tiles holding none of it between, and past its last occurrence."""
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
    thresholds = np.asarray(picks + [len(where)])  # the last is past the demand
    quotas = np.zeros((8, 8), np.int32)
    quotas[0, : thresholds.size] = np.diff(thresholds, prepend=0)
    logcnt = np.zeros(8, np.int32)
    logcnt[0] = thresholds.size
    got = _boundaries(ids, quotas, logcnt, ids.size, tile=tile, scan=16, programs=5)
    np.testing.assert_array_equal(got[0, : len(picks)], where[picks])
    assert got[0, len(picks)] == INT32_MAX
    np.testing.assert_array_equal(got[1:], INT32_MAX)


@pytest.mark.slow
@settings(max_examples=7, deadline=None)
@given(
    num_tokens=st.integers(1, 200),
    top_k=st.sampled_from([1, 4, 8]),
    num_logical=st.sampled_from([1, 2, 5, 16]),
    extra_slots=st.integers(0, 12),
    sub=st.sampled_from([16, 32, 256]),
    quota_scale=st.sampled_from([0.0, 0.2, 1.0, 3.0]),
    seed=st.integers(0, 2**31),
)
def test_positions_map_matches_reference(num_tokens, top_k, num_logical, extra_slots, sub, quota_scale, seed):
    """The map kernel over boundary positions, each expert's boundaries before the step looked up once per step:
    entries before their expert's next boundary take it as their answer and the rest search on -- right with
    several boundaries in one step, a boundary on a step's first or last entry, zero quotas (equal positions),
    quotas past the demand, a rank limit inside a step."""
    rng = np.random.default_rng(seed)
    case = Case.draw(rng, "quota", num_tokens, top_k, num_logical, num_logical + extra_slots, record=seed % 2 == 0)
    width = case.log2phy.shape[1]
    demand = case.ids.size / num_logical
    case.extra["quotas"] = rng.integers(0, int(quota_scale * demand / width) + 2, (num_logical, width)).astype(np.int32)
    config = Config(quota_path="positions", tile=sub, sub=sub, position_tile=16)
    check_parity("pallas", case, config=config)

"""Pallas (Triton backend) kernels of ``map_and_count``.

One program maps one *tile* of ``tile`` consecutive flat (token, k) entries,
in a loop over *sub-tiles* of ``sub`` entries: load ids, gather ``logcnt`` and
``log2phy`` (tiny tables, cached), pick the replica, store the slot.

Lookups (``tables``): by default :func:`lookup_table` packs ``(first slot + 1)
| count << 16`` per expert ("head" table), so an entry costs one table load,
and ``log2phy`` after it, read only for entries sent to a later replica. It is
one flat array: built per call in one XLA fusion, or once per placement by the
caller (``map_and_count(lookup=...)``). ``log2phy`` lies replica-major by
default (``layout``: ``[S, E]``, so a warp's gather of replica ``j`` touches
one row's few cache lines); ``resolved``'s per-call thresholds are read
expert-major as they are built (``threshold_layout``: an expert's row side by
side, and no transposed copy per call). ``shares`` reads its packed alias
table (:mod:`._alias`: built per call by :func:`._alias.alias_kernel` from the
weights, or prepared after the lookup table): the expert's head word (its
bucket offset beside it only where offsets pass 17 bits), then for a
multi-replica expert its bucket's word (alias and own slot in it up to 2047
slots, else the own slot beside it) -- no search, and no placement lookup
table read.

Counting (``count_method``), each program counting its tile:

* ``"histogram"`` (default): per loop step, Triton's ``tt.histogram`` (warp
  ballots + ``popc``, shared-memory atomics across warps; see
  :mod:`._triton_ops`) into ``2**ceil(log2 P)`` bins. Then (``reduce``) by
  default one relaxed integer atomic per bin below ``P`` adds the program's
  counts to the ``[P]`` loads (zeroed by XLA, aliased): no partials and no
  second kernel. ``reduce="xla"``: the program stores its counts as int16
  into column ``program`` of ``[P, num_tiles]`` partials and XLA sums the
  rows. In interpret mode the histogram runs as jnp and the atomics as a
  scatter-add. Past ``_MAX_HISTOGRAM_BINS`` bins (``P > 32768``: the bins
  would not fit a block's shared memory) each counted entry instead adds
  itself to the loads with one integer atomic.
* ``"onehot"``: a slot ``p`` is split into ``(p >> lo_bits, p & lo)`` and each
  sub-tile builds two small one-hot matrices, ``[HI, sub]`` and ``[sub, LO]``
  (int8); their product is the sub-tile's ``[HI, LO]`` histogram on the tensor
  cores: ``HI + LO`` compares per entry instead of ``P``, exact.
* ``"atomic"`` / ``"atomic_warp"`` (GPU only: interpret mode loses updates of
  vector atomics with duplicate indices): one atomic add per entry (per
  distinct slot of a warp instruction) into the program's row of float32
  counters, zeroed by atomic exchange.

``resolved`` has two ways to its point (option ``resolved_by``), both then
running the threshold search (:mod:`._search`) in the same large programs as
the other modes. Above ``_POSITIONS_FROM`` entries
(default): the *boundary positions* (:mod:`._positions`: per-tile expert
counts, then for each live quota threshold the flat index where it runs out)
replace the thresholds, and the point is the entry's flat index -- no
per-entry rank. Up to it (decode sizes, where those two kernels' chains of
dependent loads take longer): every entry's rank among the earlier entries of
its expert (:mod:`._rank`: a rank kernel over *rank tiles*, then the tiles'
histograms summed down the tiles), and point = base[rank tile, e] + rank;
for the smallest inputs all in one kernel (:func:`_lookback_kernel`).
Over positions each loop step first looks up every expert's boundaries
before it (:func:`._positions.start_words`), so few entries search.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_eplb_jax._kernels import join_varying
from moe_eplb_jax.pallas import _alias, _guide
from moe_eplb_jax.pallas._positions import (
    boundary_positions,
    clipped_quotas,
    start_passed,
    start_table_fits,
    start_words,
)
from moe_eplb_jax.pallas._rank import (
    _SUB_RESOLVED,
    _WARPS_RESOLVED,
    _rank_in_chains,
    _rank_kernel,
    _rank_tile,
    _warp_aggregate,
    lookback_bases,
)
from moe_eplb_jax.pallas._reference import GOLDEN
from moe_eplb_jax.pallas._search import _LINEAR_SEARCH, _count_passed
from moe_eplb_jax.pallas._triton_ops import atomic_add_int, histogram, take

__all__ = ["map_and_count_triton", "default_tile", "lookup_table", "lookup_size"]

_INT32_MAX = np.iinfo(np.int32).max
_SUB = 256  # entries per sub-tile (hash, round_robin, shares)


def _split_bins(num_bins: int) -> tuple[int, int]:
    """``(hi_bits, lo_bits)`` with ``2**(hi+lo) >= num_bins`` and both factors >= 16 (tensor-core minimum)."""
    bits = max(8, int(num_bins - 1).bit_length())
    lo_bits = (bits + 1) // 2
    return bits - lo_bits, lo_bits


def _histogram_bins(num_physical: int) -> int:
    """Bins of the ``tt.histogram`` counters: a power of two, at least 32 (one per warp lane)."""
    return max(32, pl.next_power_of_2(num_physical))


def _partial_dtype(count_method: str, tile: int):
    """Dtype of the per-program counts XLA sums: float32 atomics (see the kernel), int16 where a tile fits."""
    if count_method.startswith("atomic"):
        return jnp.float32
    if count_method == "histogram" and tile <= np.iinfo(np.int16).max:
        return jnp.int16  # half the bytes for the final sum to read
    return jnp.int32


def default_tile(num_flat: int) -> int:
    """Entries per program: about 512 programs for large inputs, between 256 and 8192 entries each."""
    target = pl.next_power_of_2(max(1, pl.cdiv(num_flat, 512)))
    return int(min(max(target, _SUB), 8192))


def _iota(shape, dim):
    return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def _onehot_rows(bins, num, dtype):
    """``[num, n]``: row b marks entries whose bin is b (bins of -1 mark nothing)."""
    return (bins[None, :] == _iota((num, bins.shape[0]), 0)).astype(dtype)


def _onehot_cols(bins, num, dtype):
    """``[n, num]``: column b marks entries whose bin is b."""
    return (bins[:, None] == _iota((bins.shape[0], num), 1)).astype(dtype)


def _pair_histogram(bins, hi_bits, lo_bits, dtype, acc_dtype):
    """``[2**hi_bits, 2**lo_bits]`` counts of ``bins [n]`` (entries with bin < 0 are not counted)."""
    hi = jnp.where(bins >= 0, bins >> lo_bits, -1)
    lo = bins & ((1 << lo_bits) - 1)
    rows = _onehot_rows(hi, 1 << hi_bits, dtype)
    cols = _onehot_cols(lo, 1 << lo_bits, dtype)
    return jnp.dot(rows, cols, preferred_element_type=acc_dtype)


def _flat_index(layout, num_logical, width):
    """``(expert, j) -> `` the flat index of entry ``[expert, j]`` of an ``[E, S]`` table lying in ``layout``."""
    if layout == "replica_major":  # [S, E]: entry j of all experts in one row (fewer cache lines per gather)
        return lambda expert, j: j * num_logical + expert
    return lambda expert, j: expert * width + j  # [E, S]


def _map_kernel(
    ids_ref,
    tables_ref,
    thresholds_ref,
    guide_ref,
    base_ref,
    rank_ref,
    limits_ref,
    zeros_ref,
    phys_ref,
    hist_ref,
    *,
    mode,
    num_flat,
    top_k,
    num_logical,
    width,
    num_physical,
    tile,
    sub,
    bins,
    expert_bins,
    rank_tile,
    count_dtype,
    do_count,
    count_method,
    tables,
    layout,
    reduce,
    linear_search,
    guide,
    num_tiles,
    search,
    threshold_layout,
    by_positions,
    from_start,
    alias_at=0,
    lookback=False,
    per_entry=False,
    word_heads=False,
    compact=False,
):
    """``tables_ref`` is :func:`lookup_table`'s: per-expert counts (or head entries) at ``[0, E)``, then ``log2phy``
    at ``[E, E + E * S)``, in ``layout``; ``thresholds_ref`` the ``[E, S]`` thresholds, expert-major with the guide
    (a bucket's few thresholds lie side by side), else in ``threshold_layout`` (``shares``: its packed alias table,
    :func:`._alias.pack_words`, from entry ``alias_at`` on -- a prepared lookup table holds it after its own).
    ``lookback`` (called from
    :func:`_lookback_kernel`): ``base_ref`` is this program's ``[E_pad]`` bases, the program one rank tile.
    ``per_entry`` (``"histogram"`` counting with too many bins for shared memory): one integer atomic per counted
    entry into the ``[P]`` loads instead of the program's histogram."""
    del zeros_ref  # reduce="atomic": the zeroed load counters, aliased to hist_ref
    slot_at = num_logical
    program = pl.program_id(0)
    count_limit = limits_ref[0]
    rank_limit = limits_ref[1]
    hi_bits, lo_bits = bins
    num_bins = 1 << (hi_bits + lo_bits)
    if tables == "shared":  # the two tables held by the program; lookups go through shared memory (tt.gather)
        count_size, slot_size = pl.next_power_of_2(num_logical), pl.next_power_of_2(num_logical * width)
        at = jnp.arange(count_size, dtype=jnp.int32)
        count_table = plgpu.load(tables_ref.at[pl.ds(0, count_size)], mask=at < num_logical, other=1)
        at = jnp.arange(slot_size, dtype=jnp.int32)
        slot_table = plgpu.load(tables_ref.at[pl.ds(slot_at, slot_size)], mask=at < num_logical * width, other=-1)
        lookup_count = lambda expert: take(count_table, expert)
        lookup_slot = lambda index: take(slot_table, index)
    else:  # one global (L1-cached) load per entry and table; "head": the counts are (first slot + 1) | count << 16
        lookup_count = lambda expert: tables_ref[expert]
        lookup_slot = lambda index: tables_ref[slot_at + index]
    if tables == "head":  # replica counts (>= 1)
        count_of = lambda expert: lookup_count(expert) >> 16
    else:
        count_of = lambda expert: jnp.maximum(lookup_count(expert), 1)
    table_index = _flat_index(layout, num_logical, width)  # log2phy in the lookup table
    threshold_index = _flat_index(threshold_layout, num_logical, width)  # (with the guide: expert-major)
    row0 = program * num_bins  # atomic methods: this program's row of counters
    if do_count and count_method.startswith("atomic"):
        # Zeroed by atomic exchange, i.e. in L2 where the atomics add: a plain store is only ordered with the
        # other threads of the block (it may still sit in this SM's L1 when their atomics reach L2).
        plgpu.atomic_xchg(hist_ref, row0 + jnp.arange(num_bins, dtype=jnp.int32), jnp.zeros((num_bins,), jnp.float32))
        plgpu.debug_barrier()

    def step(index, carry):
        hist = carry
        start = pl.multiple_of(program * tile + index * sub, sub)  # aligned: 16-byte loads/stores
        flat = start + jnp.arange(sub, dtype=jnp.int32)
        inside = flat < num_flat
        ids = plgpu.load(ids_ref.at[pl.ds(start, sub)], mask=inside, other=-1)
        valid_id = (ids >= 0) & (ids < num_logical)
        expert = jnp.where(valid_id, ids, 0)
        if mode == "shares":  # its own table holds what it needs
            count = None
        elif tables == "head":  # count >= 1 already (the wrapper clips it)
            head = lookup_count(expert)
            count, first = head >> 16, (head & 0xFFFF) - 1
        else:
            count = count_of(expert)
        # Unsigned division and remainder: both operands are >= 0, and the signed forms add sign fix-ups.
        token = flat.astype(jnp.uint32) // jnp.uint32(top_k)
        hashed = token * jnp.uint32(GOLDEN)
        by_hash = lambda: (hashed % count.astype(jnp.uint32)).astype(jnp.int32)
        known = None  # lanes whose slot the guide gave

        if mode == "hash":
            replica = by_hash()
        elif mode == "round_robin":
            replica = (token % count.astype(jnp.uint32)).astype(jnp.int32)
        elif mode == "shares":  # the packed alias table (_alias.py): the expert's head word (and the offset beside
            # it where offsets pass 17 bits), then its bucket's word (holding its own slot, or with it beside) -- for
            # a single-replica expert the head's first slot instead
            head_at = alias_at + 2 * expert
            alias_head = plgpu.load(thresholds_ref.at[head_at], mask=valid_id, other=1 << _alias.HEAD_SHIFT)
            buckets, low = _alias.head_fields(alias_head)
            if word_heads:  # the head word alone holds the offset (_alias.word_heads_fit)
                offset = low
            else:
                offset = plgpu.load(thresholds_ref.at[head_at + 1], mask=valid_id, other=0)
            bucket, fraction = _alias.bucket_and_fraction(hashed, buckets)
            multi = valid_id & (buckets > 1)
            if compact:  # the bucket's one word
                word = plgpu.load(thresholds_ref.at[alias_at + 2 * num_logical + offset + bucket], mask=multi, other=0)
                bucket_slot = _alias.compact_slot(word, fraction)
            else:  # its (word, own slot) pair
                pair_at = alias_at + 2 * (num_logical + offset + bucket)
                word = plgpu.load(thresholds_ref.at[pair_at], mask=multi, other=0)
                own = plgpu.load(thresholds_ref.at[pair_at + 1], mask=multi, other=0)
                bucket_slot = _alias.alias_slot(word, own, fraction)
            shares_slot = jnp.where(multi, bucket_slot, low - 1)
            replica = jnp.zeros_like(expert)  # (unused: the slot is known)
        else:
            if by_positions:  # resolved, thresholds = boundary positions (_positions.py): the flat index
                point = jnp.where(flat < rank_limit, flat, _INT32_MAX)
            else:  # resolved: the rank among this expert's entries = earlier rank tiles + inside its rank tile
                if lookback:  # the program's own bases, from the look-back
                    before = take(base_ref, expert)
                else:  # lanes past the end (masked everywhere else) clamped too: this gather is not masked
                    before = base_ref[jax.lax.div(jnp.minimum(flat, num_flat - 1), rank_tile) * expert_bins + expert]
                inside_tile = plgpu.load(rank_ref.at[pl.ds(start, sub)], mask=inside, other=0)
                point = jnp.where(flat < rank_limit, before + inside_tile, _INT32_MAX)
            # A single-replica expert takes replica 0 whatever the thresholds: no search, no loads.
            searching = valid_id & (count > 1)
            at = functools.partial(threshold_index, expert)
            if guide:  # the bucket's word: the slot itself, or a short search's start and length (_guide.py)
                known, known_slot, passed = _guide.guide_passed(
                    guide_ref,
                    thresholds_ref,
                    at,
                    expert,
                    point,
                    count,
                    num_logical,
                    width,
                    searching,
                    dynamic=search == "while",
                )
            elif from_start:  # positions: each expert's boundaries before the step, then few entries search
                # (The per-step words built here, after the ids arrived: built between the ids' load and their
                # first use the map kernel took 18.7 us instead of 14.7 at 262144 x 8, P = 288, on an H200.)
                words = start_words(
                    thresholds_ref,
                    count_of,
                    start,
                    num_logical=num_logical,
                    width=width,
                    sub=sub,
                    dynamic=search == "while",
                )
                passed = start_passed(
                    words,
                    thresholds_ref,
                    at,
                    start,
                    flat,
                    point,
                    expert,
                    count,
                    searching,
                    width=width,
                    dynamic=search == "while",
                )
            else:
                passed = _count_passed(
                    thresholds_ref, at, point, width, count, searching, linear=linear_search, dynamic=search == "while"
                )
            # Entries beyond the expert's total quota fall back to hash.
            replica = jnp.where(passed < count, passed, by_hash())

        replica = jnp.clip(replica, 0, width - 1)
        if mode == "shares":  # (the placement's lookup table is not read)
            slot = shares_slot
        elif tables == "head":  # the table is read only for replicas beyond the first
            read = replica > 0 if known is None else (replica > 0) & ~known
            later = plgpu.load(tables_ref.at[slot_at + table_index(expert, replica)], mask=read, other=-1)
            slot = jnp.where(replica > 0, later, first)
        else:
            slot = lookup_slot(table_index(expert, replica))
        if known is not None:
            slot = jnp.where(known, known_slot, slot)
        mapped = valid_id & (slot >= 0) & (slot < num_physical)
        phys = jnp.where(mapped, slot, -1)
        plgpu.store(phys_ref.at[pl.ds(start, sub)], phys, mask=inside)
        if do_count:
            counted = jnp.where(mapped & (flat < count_limit), phys, -1)
            # float32 counters: jax 0.11.2 lowers an atomic add of an int32 *vector* to a float add (it tests the
            # tensor type, not its element type, for "integer"), which turns +1 into a flushed denormal. Counts
            # stay exact in float32 up to 2**24 per program, far above any tile.
            if count_method == "atomic":
                plgpu.atomic_add(
                    hist_ref, row0 + jnp.maximum(counted, 0), jnp.ones(counted.shape, jnp.float32), mask=counted >= 0
                )
            elif count_method == "atomic_warp":
                below, same = _warp_aggregate(counted)
                plgpu.atomic_add(
                    hist_ref,
                    row0 + jnp.maximum(counted, 0),
                    same.astype(jnp.float32),
                    mask=(below == 0) & (counted >= 0),
                )
            elif per_entry:  # into the loads themselves (a scatter-add in interpret mode: duplicates all count)
                atomic_add_int(hist_ref, jnp.maximum(counted, 0), jnp.ones_like(counted), counted >= 0)
            elif count_method == "histogram":
                hist = hist + histogram(counted, hist.shape[0])
            elif count_dtype == jnp.int8:
                hist = hist + _pair_histogram(counted, hi_bits, lo_bits, jnp.int8, jnp.int32)
            else:  # float16 one-hots, float32 sums: exact below 2**24 per sub-tile
                hist = hist + _pair_histogram(counted, hi_bits, lo_bits, count_dtype, jnp.float32).astype(jnp.int32)
        return hist

    if count_method == "histogram":
        hist = jnp.zeros((32 if per_entry else _histogram_bins(num_physical),), jnp.int32)
    else:
        hist = jnp.zeros((1 << hi_bits, 1 << lo_bits), jnp.int32)
    hist = jax.lax.fori_loop(0, tile // sub, step, hist)
    if count_method == "histogram" and reduce == "atomic":
        # One relaxed integer atomic add per bin below P into the [P] loads (zeroed by XLA, aliased). Each lane
        # its own address: lanes adding to one address in one instruction serialise (adding the empty bins >= P
        # onto bins below P cost 5 us at P = 288).
        if do_count and not per_entry:
            at = jnp.arange(hist.shape[0], dtype=jnp.int32)
            atomic_add_int(hist_ref, at, hist, at < num_physical)
    elif count_method == "histogram":  # column `program` of the [P, num_tiles] partials, as narrow ints
        at = jnp.arange(hist.shape[0], dtype=jnp.int32)
        # Bins >= P (always 0) go to distinct spare entries past the columns: no two lanes share an address.
        inside = at < num_physical
        offset = jnp.where(inside, at * num_tiles + program, num_physical * num_tiles + at)
        plgpu.store(hist_ref.at[offset], hist.astype(hist_ref.dtype), mask=inside)
    elif count_method == "onehot":
        hist_ref[0] = hist


def _lookback_kernel(
    ids_ref,
    tables_ref,
    thresholds_ref,
    guide_ref,
    limits_ref,
    zeros_ref,
    board_zeros_ref,
    phys_ref,
    hist_ref,
    rank_ref,
    rank_hist_ref,
    board_ref,
    *,
    rank_sub,
    chains,
    barrier,
    **map_options,
):
    """``resolved`` by ranks in one kernel (``tile_bases="lookback"``), a program per rank tile: its in-tile ranks
    (:func:`._rank._rank_in_chains`, into ``rank_ref``), the counts of the earlier tiles by a look-back over the
    zeroed ``board_ref`` (:func:`._rank.lookback_bases`) instead of XLA's sum over tiles between two kernels, then
    the map kernel's work on the same tile."""
    del board_zeros_ref  # aliased to board_ref (zeroed by XLA)
    program = pl.program_id(0)
    expert_bins = map_options["expert_bins"]
    total = _rank_in_chains(
        program,
        ids_ref,
        limits_ref[1],
        rank_ref,
        rank_hist_ref,
        num_flat=map_options["num_flat"],
        num_logical=map_options["num_logical"],
        tile=map_options["tile"],
        sub=rank_sub,
        expert_bins=expert_bins,
        chains=chains,
        barrier=barrier,
    )
    bases = lookback_bases(board_ref, program, total, expert_bins=expert_bins)
    if barrier:  # the ranks the block's other warps stored, read below
        plgpu.debug_barrier()
    _map_kernel(
        ids_ref,
        tables_ref,
        thresholds_ref,
        guide_ref,
        bases,
        rank_ref,
        limits_ref,
        zeros_ref,
        phys_ref,
        hist_ref,
        lookback=True,
        **map_options,
    )


def _rank_and_thresholds_kernel(
    ids_ref,
    limits_ref,
    quotas_ref,
    logcnt_ref,
    rank_ref,
    hist_ref,
    thresholds_ref,
    *,
    rank_tiles,
    width,
    cap,
    **rank_options,
):
    """:func:`._rank._rank_kernel` in programs ``[0, rank_tiles)``; program ``rank_tiles + e`` writes expert ``e``'s
    row of the ``resolved`` thresholds ``[E * S]`` from the raw quotas, as the wrapper builds them: the running
    sums of the live quotas clipped to ``[0, cap]`` (:func:`._positions.clipped_quotas`), capped at ``cap``,
    ``int32 max`` past the replica count."""
    program = pl.program_id(0)  # (read here: interpret mode cannot read it inside a pl.when)

    @pl.when(program < rank_tiles)
    def _():
        _rank_kernel(ids_ref, limits_ref, rank_ref, hist_ref, program=program, **rank_options)

    @pl.when(program >= rank_tiles)
    def _():
        expert = program - rank_tiles
        count = jnp.minimum(logcnt_ref[expert], width)
        lanes, quotas = clipped_quotas(quotas_ref, expert, count, width=width, cap=cap)
        live = lanes < count
        sums = jnp.minimum(jnp.cumsum(quotas), cap)
        # Lanes past the row point at distinct spare entries after the E * S thresholds (interpret mode's masked
        # scatter writes back what it read, which must not land on an entry another lane writes).
        inside = lanes < width
        at = jnp.where(inside, expert * width + lanes, thresholds_ref.shape[0] - lanes.shape[0] + lanes)
        plgpu.store(thresholds_ref.at[at], jnp.where(live, sums, _INT32_MAX), mask=inside)


def lookup_table(log2phy, logcnt, *, layout: str = "replica_major", tables: str = "head"):
    """The map kernel's lookup table of one placement: flat int32 ``[E + E * S]`` (``E + 2**ceil(log2(E * S))``
    for ``tables="shared"``).

    ``[0, E)``: per expert its count, or for ``tables="head"`` ``(first slot + 1) | count << 16``; then
    ``log2phy``, transposed to ``[S, E]`` for ``layout="replica_major"``. Built per call from the tables unless
    the caller passes one built once per placement (``map_and_count(lookup=...)``).
    """
    log2phy, logcnt = jnp.asarray(log2phy, jnp.int32), jnp.asarray(logcnt, jnp.int32)
    num_logical, width = log2phy.shape
    if layout == "replica_major":
        log2phy = log2phy.T  # [S, E]: log2phy.T[0] is still the first replicas
    first_slots = log2phy[0] if layout == "replica_major" else log2phy[:, 0]
    if tables == "head":  # (the kernel reads it only for num_physical < 0xFFFF: 16-bit slots)
        counts = _alias.head_word(first_slots, jnp.clip(logcnt, 1, 0x7FFF))
    else:
        counts = logcnt
    parts = [counts, log2phy.reshape(-1)]
    if tables == "shared":  # the kernel loads E + [0, 2**ceil(log2 E * S)): padded to stay inside
        parts.append(jnp.full((pl.next_power_of_2(num_logical * width) - num_logical * width,), -1, jnp.int32))
    return jnp.concatenate(parts)


# Tuned on one H200 (benchmarks/map_and_count.py --sweep, 2026-11-30, third to fifth sessions): counting with
# tt.histogram and (first slot, count) head tables beat every other combination at every size measured
# (262144 x 8 hash: 11.7 us vs 47 atomic / 56 one-hot; 4096 x 8: 4.2 vs 5.2; resolved 8192 x 8: 22.8 vs 27.4);
# replica-major tables (P = 512 shares 34.7 vs 44.3 us), per-bin atomics instead of partials + row sum
# (4096 x 8 hash 3.2 vs 5.2 us, 262144 x 8 P = 512 11.0 vs 13.5), match.any ranks (resolved rank kernel 26.7 vs
# 37.6 us). Ninth session (same draws): thresholds read expert-major, as built (262144 x 8 shares P = 288 15.6 vs
# 16.7 us, P = 512 22.7 vs 24.5; decode 4.8 vs 5.9), which leaves the bucket guide no gain (shares P = 512 24.0
# with it vs 22.7; resolved P = 288 54.8 vs 51.4, P = 512 58.8 vs 58.3): off by default; the rank tiles' sums as
# a triangular product at decode sizes (resolved 4096 x 8 P = 288 11.9 vs 13.6 us, P = 512 13.2 vs 15.2).
DEFAULTS = {
    "tile": None,
    "sub": _SUB,
    "tile_resolved": None,
    "sub_resolved": _SUB_RESOLVED,
    "warps_resolved": _WARPS_RESOLVED,
    "num_warps": 4,
    "num_stages": 3,
    "count_dtype": "int8",
    "count_method": "histogram",
    "tables": "head",
    "layout": "replica_major",
    "reduce": "atomic",
    "rank_in_step": "match",
    "linear_search": _LINEAR_SEARCH,
    "guide": 0,
    "rank_running": "memory",
    "search": None,
    "tile_bases": None,
    "threshold_layout": "expert_major",
    "rank_chains": None,
    "resolved_by": None,
    "position_tile": None,
    "position_groups": None,
    "position_sub": None,
    "position_scan": None,
    "position_warps": None,
    "boundary_warps": 4,
    "position_map": "start",
    "boundary_grid": None,
    "alias_warps": 4,
    "word_heads": True,
    "compact": True,
}
# shares (seventeenth session, H200, 262144 x 8, table kept, P = 288 / 512): head word + one-word buckets 9.6 /
# 10.4 us, head word + (word, slot) pairs 10.5 / 11.9, head pair + pairs 11.1 / 12.7; the pairs as one 64-bit
# gather each were slower still (13.5 at P = 512) and were removed.
# How the kernel counts: "histogram" (tt.histogram per loop step: warp ballots + popc, shared-memory atomics
# across warps; also in interpret mode, as jnp), "onehot" (factorised one-hot products on the tensor cores),
# "atomic" (one global atomic add per entry into the program's row of counters), "atomic_warp" (atomics
# aggregated over equal slots in a warp first). The atomic methods are GPU only (interpret mode loses duplicate
# updates of vector atomics).
COUNT_METHODS = ("histogram", "onehot", "atomic", "atomic_warp")
# Where the kernel looks up logcnt / log2phy: "head" (one load of (first slot + 1) | count << 16 per entry;
# log2phy is read only for entries sent to a later replica -- most experts have one; a second table of the
# second and third slots, loaded beside it, was slower on an H200), "global" (a cached
# global load per entry and table) or "shared" (the program loads both tables once and gathers from them with
# tt.gather, through shared memory; not faster on an H200).
TABLES = ("head", "global", "shared")
# How the [E, S] tables (log2phy, thresholds) lie in memory: "expert_major" (row e holds expert e's replicas) or
# "replica_major" (transposed: row j holds replica j of every expert, so a warp's gather of entry j for up to
# 32 experts touches the few cache lines of one row instead of one line per expert). log2phy follows "layout"
# (prepared once per placement), the per-call thresholds "threshold_layout".
LAYOUTS = ("expert_major", "replica_major")
# How the per-program histograms of count_method="histogram" become the loads: "xla" (each program stores its
# counts as column t of [P, num_tiles] int16 partials; XLA sums the rows) or "atomic" (each program adds its
# counts to the [P] loads with one integer atomic per bin: no partials, no second kernel).
REDUCES = ("xla", "atomic")
# resolved: from how many entries on the boundary positions (_positions.py) replace the per-entry ranks. H200,
# same draws (benchmarks/RESULTS.md, eleventh session): 262144 x 8 30.7 vs 52.3 us (P = 288), 38.9 vs 59.1
# (P = 512); 65536 x 8 22.6 vs 26.9; but 4096 x 8 10.2-10.6 vs 9.5 (P = 288), 12.4-13.5 vs 10.8 (P = 512): at
# decode the boundary kernel's chain of dependent loads (3.2-4.8 us) outlasts the rank kernel's four chains.
_POSITIONS_FROM = 1 << 16
# The options that name one of a few choices.
_CHOICES = {
    "count_method": COUNT_METHODS,
    "tables": TABLES,
    "layout": LAYOUTS,
    "threshold_layout": LAYOUTS,
    "reduce": REDUCES,
    "rank_in_step": ("compare", "match"),
    "rank_running": ("registers", "memory"),
    "tile_bases": (None, "cumsum", "matmul", "lookback"),
    "search": (None, "unrolled", "while"),
    "resolved_by": (None, "positions", "ranks"),
    "position_map": ("start", "search"),
    "boundary_grid": (None, "expert", "flat"),
}


def _check_choices(config):
    for name, choices in _CHOICES.items():
        if config[name] not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {config[name]!r}")


_MAX_SHARED_TABLE = 8192  # entries (32 KiB): larger tables stay in global memory
_MAX_HISTOGRAM_BINS = 32768  # tt.histogram's shared memory per program: 128 KiB (an H200 block may have 227)
# Larger inputs (GPU), per mode: (min entries, options), largest first (resolved: its mapping kernel; the rank
# kernel keeps its own tiles). One big loop step per program is fastest (H200, benchmarks/RESULTS.md
# "map_and_count"). With the loads counted by atomics, fewer programs add fewer atomics: hash / round_robin at
# 262144 x 8 take 8192-entry programs (9.7-10.7 us vs 10.2-11.3 with 4096), at 65536 x 8 4096-entry programs
# (4.8 us vs 6.4 with 2048 / 8 warps); shares / resolved, with more work per entry, take 4096-entry programs at
# both sizes (262144 x 8 resolved 57.9 us vs 63.6 with 8192; 65536 x 8 shares 8.6 vs 9.6 with 2048 / 8 warps).
# Shares by its packed alias table (fifteenth session) streams like hash: 8192-entry programs at 262144 x 8 map
# in 10.4 / 12.0 us at P = 288 / 512 vs 11.0 / 12.9 with 4096.
_STREAMING = (
    (1 << 21, {"tile": 8192, "sub": 4096, "num_warps": 16}),
    (1 << 19, {"tile": 4096, "sub": 4096, "num_warps": 16}),
)
_SEARCHING = ((1 << 19, {"tile": 4096, "sub": 4096, "num_warps": 16}),)
_GUIDED = {"sub": 1024}  # with the guide (fewer registers live per loop step): P = 512 shares 19.2 vs 26.5 us
# (eighth session, thresholds then transposed per call)
LARGE_OPTIONS = {"hash": _STREAMING, "round_robin": _STREAMING, "shares": _STREAMING, "resolved": _SEARCHING}


def _guide_factor(config, mode, num_logical, width, num_physical):
    """The guide's buckets per replica (0: no guide) for these options and shapes; checks the option."""
    guide = config["guide"]
    if guide not in (0, 1, 2, 4, 8, 16):
        raise ValueError(f"guide must be 0, 1, 2, 4, 8 or 16, got {guide!r}")
    # Offsets must fit their bits, and the experts' bucket counts (each below 2 * factor * width) their int32 sum.
    too_big = (
        _guide.guide_size(num_logical, num_physical, guide) >= 1 << _guide.OFFSET_BITS
        or num_logical * 2 * guide * width >= 1 << 31
    )
    # No search to guide; or the guide's kernel cannot read these tables; or a field would not fit its bits.
    if (
        mode != "resolved"
        or (config["layout"], config["tables"]) != ("replica_major", "head")
        or num_physical >= 0xFFFF
        or width >= _guide.MAX_WIDTH
        or too_big
    ):
        return 0
    return guide


def _tile_bases(per_tile, how, num_flat):
    """Exclusive prefix sums of the rank tiles' histograms ``[tiles, E_pad]`` down the tiles (int32).

    ``"cumsum"``: XLA's cumsum (reduce-window kernels: 3.8 us at 128 tiles, 6.8 at 2048 on an H200);
    ``"matmul"``: one float32 product with a strictly lower-triangular ``[tiles, tiles]`` matrix, exact (no sum
    exceeds the ``num_flat <= 2**24`` entries), for at most ``_MAX_MATMUL_TILES`` tiles -- decode sizes
    (4096 x 8 resolved: 1.6-1.9 us less per call than the cumsum on an H200); more tiles use the cumsum (two
    levels of such products above 256 tiles -- batched inside blocks, then across the blocks' totals -- were
    5-6.5 us slower than the cumsum at 2048 tiles: cuBLAS, a transposed copy, a slower map kernel).
    """
    tiles = per_tile.shape[0]
    if how == "matmul" and tiles <= _MAX_MATMUL_TILES and num_flat <= 1 << 24:
        earlier = (jnp.arange(tiles)[:, None] > jnp.arange(tiles)[None, :]).astype(jnp.float32)
        return jnp.dot(
            earlier,
            per_tile.astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
        ).astype(jnp.int32)
    return jnp.cumsum(per_tile, axis=0, dtype=jnp.int32) - per_tile


_MAX_MATMUL_TILES = 256  # the [tiles, tiles] matrix stays small
# tile_bases=None: one kernel with a look-back up to this many rank tiles, else the "matmul" sums (H200, same draws,
# twelfth session: 1024 x 8 (32 tiles) 7.15 / 7.90 us vs 7.70 / 8.67 at P = 288 / 512; but 4096 x 8 (128 tiles)
# 9.81 / 10.92 vs 9.38 / 10.52 and 8192 x 8 13.71 / 14.66 vs 13.19 / 14.48: one program doing its rank tile's
# ranks, look-back and mapping in turn outlasts the three kernels once there are enough tiles to fill the GPU).
_MAX_LOOKBACK_TILES = 32


def lookup_size(num_logical: int, width: int, *, tables: str = "head") -> int:
    """Entries of :func:`lookup_table`'s array for ``log2phy [num_logical, width]``."""
    slots = num_logical * width
    return num_logical + (pl.next_power_of_2(slots) if tables == "shared" else slots)


def map_and_count_triton(
    topk_ids,
    log2phy,
    logcnt,
    thresholds,
    limits,
    *,
    num_physical: int,
    mode: str,
    interpret: bool = False,
    count: bool = True,
    lookup=None,
    quotas=None,
    shares=None,
    **config,
):
    """Same contract as ``_reference.map_and_count_reference``.

    ``quotas`` (``resolved``, optional): the ``[E, S]`` integer quotas the ``thresholds`` were built from (capped
    at the entry count). The kernels then build what they need from them -- over boundary positions each
    boundary program sums its row, by ranks ``E`` extra programs of the rank kernel write the thresholds (not
    the look-back kernel) -- so under ``jit`` the wrapper's ``[E, S]`` threshold product is dead code (an H200
    ran it in 2.1 us at P = 512; 4096 x 8 resolved 11.3 vs 14.8 us, 262144 x 8 33.4 vs 38.2).

    ``shares`` (``shares``, optional): ``replica_shares [E, S]``; a Pallas kernel then builds the alias table
    (:func:`._alias.alias_kernel`) unless ``lookup`` holds it (after the lookup table, as the public
    ``lookup_table(..., replica_shares=...)`` appends it), and
    ``thresholds`` is ignored. Without it ``thresholds`` holds the words (tests, benchmarks).

    ``config`` overrides :data:`DEFAULTS` (tuning knobs, see the benchmark):
    ``tile`` entries per program (power of two), ``sub`` entries per loop
    step, ``num_warps`` / ``num_stages`` (Triton); for ``resolved`` also
    ``tile_resolved`` entries per rank tile (``None``: by size), ``sub_resolved`` entries per
    step of the rank kernel (the side of its pairwise compare) and
    ``warps_resolved`` (its warps); ``count_dtype`` of the one-hots
    (``"int8"``: int32 sums; ``"float16"``: float32 sums, exact below 2**24).
    ``count=False`` skips counting (diagnostics). ``count_method`` picks how a
    program counts (:data:`COUNT_METHODS`; interpret mode replaces the atomic
    methods by ``"histogram"``) and ``tables`` how it looks up the placement
    (:data:`TABLES`), ``layout`` how those tables lie in memory (:data:`LAYOUTS`),
    ``reduce`` how the programs' histograms become the loads (:data:`REDUCES`)
    and ``rank_in_step`` how ``resolved`` ranks entries inside a 32-entry step
    (``"match"``: ``match.any``, compiled one-warp 32-entry steps only, else
    ``"compare"``), ``rank_running`` where its rank kernel keeps the running
    per-expert counts (``"registers"``: ``tt.histogram`` / ``tt.gather``;
    ``"memory"``: the program's row of the histogram output); ``linear_search`` how many of a row's first thresholds
    ``resolved`` loads independently before bisecting the rest
    (0: bisection only); ``guide`` the bucket guide's buckets per replica
    (:mod:`._guide`: 1, 2, 4, 8 or 16; 0: none, every entry of a
    multi-replica expert searches, the default: with the thresholds
    read expert-major the guide's own kernel costs what it saves); ``search`` how the bisection steps (``"while"``: a
    loop that ends when every lane of the block has converged, ``"unrolled"``:
    all ``bit_length(S)`` steps, masked; ``None``: ``"while"`` with the guide
    and over positions, else ``"unrolled"``, the faster of each on an H200);
    ``rank_chains`` how many warps of a rank program each rank their own
    part of its tile (``None``: up to 4 where there are at most 256 rank
    tiles and 32-entry steps, else 1; more than 1 implies
    ``rank_running="memory"`` and, for compiled 32-entry steps, ``match.any``);
    ``resolved_by`` how ``resolved`` finds its points (``"positions"``:
    boundary positions, :mod:`._positions`; ``"ranks"``: per-entry ranks,
    :mod:`._rank`; ``None``: ranks up to ``_POSITIONS_FROM`` entries, else
    positions), and for the positions ``position_tile`` (entries per tile of
    the counts), ``position_sub`` / ``position_warps`` (the count kernel's
    step and warps), ``position_groups`` (boundary programs per expert),
    ``position_scan`` (entries per step of a tile scan; ``None`` for these:
    :func:`._positions.boundary_positions`' defaults), ``boundary_warps``
    (the boundary kernel's warps), ``alias_warps`` (the warps of ``shares``'
    per-call alias-table kernel), ``word_heads`` / ``compact`` (``shares``: read an
    expert's offset from its head word where every offset fits its 17 bits, else from the head pair; one word per
    bucket where ``num_physical <= 2047``, else a (word, slot) pair; a prepared table's size decides the
    latter), ``boundary_grid`` (``"flat"``: a program per
    live boundary; ``"expert"``: ``position_groups`` per expert; ``None``: the
    module's default) and ``position_map`` (``"start"``: each map step looks up
    every expert's boundaries before it once, and only entries past their
    expert's next boundary search; ``"search"``: every entry of a
    multi-replica expert searches); ``tile_bases`` how ``resolved`` sums its rank tiles' histograms
    (:func:`_tile_bases`: ``"cumsum"`` / ``"matmul"`` in XLA between the rank and map kernels; ``"lookback"``:
    one kernel, :func:`_lookback_kernel`, whose programs wait for the earlier ones -- as CUB's scans do, it
    relies on the GPU starting programs in order; ``None``: the look-back up to ``_MAX_LOOKBACK_TILES`` rank
    tiles, where every program is resident at once, else ``"matmul"``); ``threshold_layout`` how the search
    reads the thresholds (:data:`LAYOUTS`; always expert-major with the guide and for positions). For large
    inputs the defaults of a mode come from :data:`LARGE_OPTIONS` by size
    (options passed explicitly win). ``lookup``: :func:`lookup_table` of
    ``log2phy`` / ``logcnt`` built by the caller (with the default ``tables`` /
    ``layout``; other options rebuild it), else built here per call.
    """
    unknown = set(config) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown kernel options {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    num_tokens, top_k = topk_ids.shape
    num_logical, width = log2phy.shape
    num_flat = num_tokens * top_k
    given = {**DEFAULTS, **config}  # (before the size-based LARGE_OPTIONS, which depend on the guide)
    _check_choices(given)
    resolved_by = given["resolved_by"]
    if resolved_by is None:  # ranks at decode sizes, boundary positions above (H200: _POSITIONS_FROM)
        resolved_by = "positions" if num_flat > _POSITIONS_FROM else "ranks"
    by_positions = mode == "resolved" and resolved_by == "positions"
    # The guide's buckets cut the rank range: no guide over positions.
    guide = 0 if by_positions else _guide_factor(given, mode, num_logical, width, num_physical)
    large = next((options for least, options in LARGE_OPTIONS.get(mode, ()) if num_flat >= least), {})
    if guide and large:
        large = {**large, **_GUIDED}
    if interpret:
        large = {}
    config = {**DEFAULTS, **large, **config}
    sub = int(config["sub"])
    tile = default_tile(num_flat) if config["tile"] is None else int(config["tile"])
    tile = max(tile, sub)
    if tile & (tile - 1) or sub & (sub - 1) or sub < 16:
        raise ValueError(f"tile and sub must be powers of two (sub >= 16), got tile={tile} sub={sub}")
    rank_sub = int(config["sub_resolved"])
    rank_tile = _rank_tile(num_flat) if config["tile_resolved"] is None else int(config["tile_resolved"])
    rank_tile = max(rank_tile, rank_sub)
    if rank_tile & (rank_tile - 1) or rank_sub & (rank_sub - 1) or rank_sub < 16:
        raise ValueError(
            f"tile_resolved and sub_resolved must be powers of two (sub_resolved >= 16), got {rank_tile} and {rank_sub}"
        )
    if int(config["linear_search"]) < 0:
        raise ValueError(f"linear_search must be >= 0, got {config['linear_search']}")
    # The block's loop stops once all its lanes converged where most entries search little; resolved's ranks
    # spread over the whole row, and there the fixed unrolled steps were faster (H200, benchmarks/RESULTS.md);
    # with the guide few entries search, one or two steps: the loop; over boundary positions the loop too
    # (262144 x 8: 30.7 vs 32.7 us at P = 288, 38.0 vs 40.8 at P = 512).
    search = config["search"] or ("while" if guide or by_positions else "unrolled")
    running = config["rank_running"]
    # match.any ranks one entry per lane of one warp: only 32-entry steps of one-warp programs, compiled.
    one_per_lane = rank_sub == 32 and int(config["warps_resolved"]) == 1 and not interpret
    in_step = "match" if config["rank_in_step"] == "match" and one_per_lane else "compare"
    count_dtype = jnp.dtype(config["count_dtype"])
    count_method = config["count_method"]
    if interpret and count_method.startswith("atomic"):
        count_method = "histogram"
    tables, layout, threshold_layout = config["tables"], config["layout"], config["threshold_layout"]
    if guide or by_positions or mode == "shares":  # the guide reads an expert's thresholds side by side;
        threshold_layout = "expert_major"  # positions and the alias kernel's words come so
    reduce = config["reduce"] if count_method == "histogram" else "xla"
    # tt.histogram holds its bins in shared memory (4 bytes each): past _MAX_HISTOGRAM_BINS (P = 65535 asked for
    # 256 KiB, more than an H200 block may have) each counted entry adds itself to the loads by an atomic.
    per_entry = count_method == "histogram" and _histogram_bins(num_physical) > _MAX_HISTOGRAM_BINS
    if per_entry:
        reduce = "atomic"
    if mode == "shares":  # (its own table: the placement's lookup options do not apply)
        tables = DEFAULTS["tables"]
    if tables == "shared" and pl.next_power_of_2(log2phy.shape[0] * log2phy.shape[1]) > _MAX_SHARED_TABLE:
        tables = "global"
    if tables == "head" and num_physical >= 0xFFFF:  # slots must fit in 16 bits
        tables = "global"
    num_tiles = pl.cdiv(num_flat, tile)
    bins = _split_bins(num_physical)
    expert_bins = _histogram_bins(num_logical) if mode == "resolved" else 32
    hi, lo = 1 << bins[0], 1 << bins[1]
    if mode not in ("shares", "resolved") or shares is not None or thresholds is None:  # none passed in, or built here
        thresholds = jnp.zeros((1, 1), jnp.int32)
    alias_at = 0  # shares: where its words start in the thresholds' array
    # shares: one word per bucket where the slots fit 11 bits (_alias.compact_words; a prepared table says by its
    # size which it holds)
    compact = mode == "shares" and _alias.compact_fits(num_physical) and bool(config["compact"])
    if lookup is not None:
        lookup = jnp.asarray(lookup)
        plain = lookup_size(num_logical, width)
        wide, narrow = (plain + _alias.packed_size(num_logical, width, packing) for packing in (False, True))
        if lookup.shape not in ((plain,), (wide,), (narrow,)):
            raise ValueError(
                f"lookup must have shape ({plain},) or, with shares' alias words, ({wide},) or "
                f"({narrow},) for log2phy [{num_logical}, {width}], got {lookup.shape}"
            )
        if lookup.shape == (narrow,) and not _alias.compact_fits(num_physical):
            raise ValueError(
                f"lookup holds one-word buckets (built for num_physical <= {_alias.COMPACT_SLOTS}), "
                f"which cannot name the slots of num_physical = {num_physical}"
            )
        if mode == "shares" and lookup.shape != (plain,):  # prepared words: read from the lookup itself
            shares, alias_at, compact = None, plain, lookup.shape == (narrow,)
    # resolved from the raw quotas (capped at the entry count, as the wrapper's thresholds are, while their sums
    # fit int32): the boundary programs sum them over positions, the rank kernel's extra programs by ranks.
    from_quotas = mode == "resolved" and quotas is not None and width * num_flat < 2**31 - 1
    (ids, log2phy, logcnt, thresholds, limits, *rest), out_struct = join_varying(
        topk_ids.reshape(num_flat),
        log2phy,
        logcnt,
        thresholds,
        limits,
        *([jnp.asarray(quotas).astype(jnp.int32).reshape(-1)] if from_quotas else []),
        *([jnp.asarray(shares).astype(jnp.float32)] if shares is not None else []),
        *([] if lookup is None else [lookup]),
    )
    quotas = rest.pop(0) if from_quotas else None
    if shares is not None:
        thresholds = _alias.alias_kernel(
            rest.pop(0),
            log2phy,
            logcnt,
            compact=compact,
            out_struct=out_struct,
            interpret=interpret,
            num_warps=int(config["alias_warps"]),
        )
    elif mode == "shares" and not alias_at:  # the words [E, S] given (tests, benchmarks): packed here
        thresholds = _alias.pack_words(thresholds, log2phy, logcnt, compact=compact)
    lookup = rest[0] if rest else None
    if alias_at:
        thresholds = lookup
    params = plgpu.CompilerParams(num_warps=config["num_warps"], num_stages=config["num_stages"])
    whole = pl.no_block_spec

    lookback = False  # resolved by ranks in one kernel (below)
    if by_positions:  # the thresholds become their boundary positions
        thresholds = boundary_positions(
            ids,
            quotas if from_quotas else thresholds.reshape(-1),
            limits,
            logcnt,
            num_logical=num_logical,
            width=width,
            expert_bins=expert_bins,
            tile=config["position_tile"],
            groups=config["position_groups"],
            sub=config["position_sub"],
            scan=config["position_scan"],
            count_warps=config["position_warps"],
            num_warps=config["boundary_warps"],
            grid=config["boundary_grid"],
            programs=num_physical,
            quota_cap=num_flat if from_quotas else None,
            interpret=interpret,
            out_struct=out_struct,
        )
        base = rank = jnp.zeros_like(limits[:1])  # unused
    elif mode == "resolved":
        rank_tiles = pl.cdiv(num_flat, rank_tile)
        chains = config["rank_chains"]
        # Few rank tiles (decode sizes): each program's one-warp chain of steps is the critical path, so four
        # warps split it (4096 x 8, P = 512: rank kernel 2.62 vs 3.96 us). Many tiles: no gain (262144 x 8: 35.0
        # vs 24.8 with 4 chains; the GPU is busy anyway).
        if chains is None:  # as many of the 4 as leave each chain whole steps
            # (match.any needs 32-entry steps: other steps keep one chain)
            chains = max(1, min(4, rank_tile // rank_sub)) if rank_tiles <= 256 and rank_sub == 32 else 1
        chains = int(chains)
        if chains < 1 or chains & (chains - 1) or rank_tile // chains < rank_sub:
            raise ValueError(
                f"rank_chains must be a power of two with tile_resolved / rank_chains >= sub_resolved, "
                f"got {chains} for tiles of {rank_tile} and steps of {rank_sub}"
            )
        if chains > 1:  # chains always count in memory, and compiled 32-entry steps always use match.any
            running = "memory"
        tile_bases = config["tile_bases"]
        if tile_bases is None:  # few rank tiles (decode sizes): one kernel, its programs looking back
            tile_bases = "lookback" if rank_tiles <= _MAX_LOOKBACK_TILES and chains > 1 else "matmul"
        lookback = tile_bases == "lookback"
        if lookback and num_flat >= 1 << 29:  # a board word holds count << 2 in 32 bits
            raise ValueError(f"tile_bases='lookback' supports fewer than 2**29 entries, got {num_flat}")
        if lookback:  # ranks, bases and mapping in one kernel: a program per rank tile, one warp per chain
            tile, sub, num_tiles = rank_tile, min(sub, rank_tile), rank_tiles
            params = plgpu.CompilerParams(num_warps=chains, num_stages=config["num_stages"])
            base = rank = None
        else:
            # "memory": the histogram output is flat (each program gathers from and scatters to its own rows, the
            # first of which ends with the histogram).
            hist_spec = whole if running == "memory" else pl.BlockSpec((1, expert_bins), lambda i: (i, 0))
            hist_shape = (rank_tiles * chains * 2 * expert_bins,) if running == "memory" else (rank_tiles, expert_bins)
            rank_options = dict(
                num_flat=num_flat,
                num_logical=num_logical,
                tile=rank_tile,
                sub=rank_sub,
                expert_bins=expert_bins,
                in_step=in_step,
                running=running,
                barrier=not interpret,
                chains=chains,
            )
            rank_shapes = [out_struct((num_flat,), jnp.int32), out_struct(hist_shape, jnp.int32)]
            # With the quotas (and the counts in memory: no per-program block of the output), E more programs
            # build the thresholds beside the ranks: no [E, S] product between kernels (H200, 4096 x 8, P = 512:
            # a 2.1 us cuBLAS GEMM and a 0.3 us fusion).
            fused = from_quotas and running == "memory" and threshold_layout == "expert_major"
            outputs = pl.pallas_call(
                (
                    functools.partial(
                        _rank_and_thresholds_kernel, rank_tiles=rank_tiles, width=width, cap=num_flat, **rank_options
                    )
                    if fused
                    else functools.partial(_rank_kernel, **rank_options)
                ),
                grid=(rank_tiles + (num_logical if fused else 0),),
                in_specs=[whole] * (4 if fused else 2),
                out_specs=[whole, hist_spec] + ([whole] if fused else []),
                out_shape=rank_shapes
                + ([out_struct((num_logical * width + pl.next_power_of_2(width),), jnp.int32)] if fused else []),
                compiler_params=plgpu.CompilerParams(
                    num_warps=max(chains, int(config["warps_resolved"])), num_stages=config["num_stages"]
                ),
                interpret=interpret,
                name="expert_rank",
            )(ids, limits, *([quotas, logcnt] if fused else []))
            rank, per_tile = outputs[:2]
            if fused:  # flat, expert-major, with a spare tail never read (a slice would be a copy kernel)
                thresholds = outputs[2]
            per_tile = per_tile.reshape(rank_tiles, -1)[:, :expert_bins]
            base = _tile_bases(per_tile, tile_bases, num_flat).reshape(-1)
    else:
        base = rank = jnp.zeros_like(limits[:1])  # unused; share the inputs' manual axes

    map_options = dict(
        mode=mode,
        num_flat=num_flat,
        top_k=top_k,
        num_logical=num_logical,
        width=width,
        num_physical=num_physical,
        tile=tile,
        sub=sub,
        bins=bins,
        expert_bins=expert_bins,
        rank_tile=rank_tile,
        count_dtype=count_dtype,
        do_count=count,
        count_method=count_method,
        tables=tables,
        layout=layout,
        reduce=reduce,
        linear_search=int(config["linear_search"]),
        guide=guide,
        num_tiles=num_tiles,
        search=search,
        threshold_layout=threshold_layout,
        by_positions=by_positions,
        from_start=by_positions and config["position_map"] == "start" and start_table_fits(width, sub),
        alias_at=alias_at,
        per_entry=per_entry,
        compact=compact,
        word_heads=bool(config["word_heads"]) and _alias.word_heads_fit(num_logical, width),
    )
    # A prepared table is lookup_table's default kind; other kernel options (or slots past 16 bits) rebuild it.
    # Shares reads its own table only (none built per call).
    if mode == "shares":
        lookup = jnp.zeros_like(limits[:1])
    elif lookup is None or (layout, tables) != (DEFAULTS["layout"], DEFAULTS["tables"]):
        lookup = lookup_table(log2phy, logcnt, layout=layout, tables=tables)
    if threshold_layout == "replica_major":  # built expert-major: a transposed copy per call
        thresholds = thresholds.T
    thresholds = thresholds.reshape(-1)  # (positions: flat already, with a spare tail never read)
    if guide:
        guide_words = _guide.guide_kernel(
            lookup,
            thresholds,
            factor=guide,
            num_logical=num_logical,
            width=width,
            num_physical=num_physical,
            out_struct=out_struct,
            interpret=interpret,
        )
    else:
        guide_words = jnp.zeros_like(limits[:1])  # unused
    if count_method == "onehot":  # each program writes its [hi, lo] block
        hist_spec, hist_shape = pl.BlockSpec((1, hi, lo), lambda i: (i, 0, 0)), (num_tiles, hi, lo)
    elif count_method == "histogram" and reduce == "atomic":  # the loads themselves, zeroed here
        hist_spec, hist_shape = whole, (num_physical,)
    elif count_method == "histogram":  # [P, num_tiles]: program t writes column t (XLA then sums rows: fast)
        hist_spec, hist_shape = whole, (num_physical * num_tiles + _histogram_bins(num_physical),)
    else:  # each program zeroes and atomically fills its own flat row (float32 counters, see the kernel)
        hist_spec, hist_shape = whole, (num_tiles * hi * lo,)
    partial_dtype = jnp.int32 if reduce == "atomic" else _partial_dtype(count_method, tile)
    if reduce == "atomic":  # the loads start at zero (Pallas never zero-inits an output)
        (zeros, _), _ = join_varying(jnp.zeros(hist_shape, jnp.int32), limits)  # vary like the other inputs
    else:
        zeros = jnp.zeros_like(limits[:1])  # unused
    map_outputs = [out_struct((num_flat,), jnp.int32), out_struct(hist_shape, partial_dtype)]
    if lookback:  # scratch outputs: the in-tile ranks, the chains' counts, the look-back board (zeroed, aliased)
        (board_zeros, _), _ = join_varying(jnp.zeros((num_tiles * expert_bins,), jnp.int32), limits)
        # (inputs: ids, lookup, thresholds, guide, limits, zeros, board_zeros)
        aliases = {5: 1, 6: 4} if reduce == "atomic" else {6: 4}
        phys, partial, *_ = pl.pallas_call(
            functools.partial(_lookback_kernel, rank_sub=rank_sub, chains=chains, barrier=not interpret, **map_options),
            grid=(num_tiles,),
            in_specs=[whole] * 7,
            out_specs=[whole, hist_spec, whole, whole, whole],
            out_shape=map_outputs
            + [
                out_struct((num_flat,), jnp.int32),
                out_struct((num_tiles * chains * 2 * expert_bins,), jnp.int32),
                out_struct((num_tiles * expert_bins,), jnp.int32),
            ],
            input_output_aliases=aliases,
            compiler_params=params,
            interpret=interpret,
            name="map_and_count",
        )(ids, lookup, thresholds, guide_words, limits, zeros, board_zeros)
    else:
        phys, partial = pl.pallas_call(
            functools.partial(_map_kernel, **map_options),
            grid=(num_tiles,),
            in_specs=[whole] * 8,
            out_specs=[whole, hist_spec],
            out_shape=map_outputs,
            input_output_aliases={7: 1} if reduce == "atomic" else {},
            compiler_params=params,
            interpret=interpret,
            name="map_and_count",
        )(ids, lookup, thresholds, guide_words, base, rank, limits, zeros)
    if reduce == "atomic":
        return phys.reshape(num_tokens, top_k), partial
    if count_method == "histogram":  # a row reduction: XLA's column reductions of [num_tiles, P] were 2-3x slower
        load = jnp.sum(
            partial[: num_physical * num_tiles].reshape(num_physical, num_tiles).astype(jnp.int32),
            axis=1,
            dtype=jnp.int32,
        )
        return phys.reshape(num_tokens, top_k), load
    load = jnp.sum(partial.reshape(num_tiles, -1).astype(jnp.int32), axis=0, dtype=jnp.int32)[:num_physical]
    return phys.reshape(num_tokens, top_k), load

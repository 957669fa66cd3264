"""The Pallas (Triton) implementation of ``map_and_count``: the map kernel and its wrapper (tiling: :mod:`.config`).

``map_and_count_triton(topk_ids [T, k], log2phy [E, S], logcnt [E], limits [3], ...)`` ->
``(physical_ids [T, k], load [P])``, equal to :func:`.reference.map_and_count_reference`. A map program
handles ``tile`` consecutive flat (token, k) entries in loop steps of ``sub``: it loads the ids, looks each
replica up, stores the slot and counts the step's slots with ``tt.histogram``; at its end one relaxed integer
atomic per bin adds its counts to the loads -- one pass over the ids, one kernel. Mode ``"lp"`` reads its alias
table (:mod:`._alias`); mode ``"quota"`` first finds each entry's point (:mod:`._rank` up to 65536 entries,
:mod:`._positions` above). Why these designs beat the alternatives: docs/kernels.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_eplb_jax._kernels import join_varying
from moe_eplb_jax.routing._map_and_count import _alias, _positions, _rank, _tables
from moe_eplb_jax.routing._map_and_count._alias_kernel import alias_kernel
from moe_eplb_jax.routing._map_and_count._search import loads, upper_bound
from moe_eplb_jax.routing._map_and_count._triton_ops import atomic_add_int, histogram, take
from moe_eplb_jax.routing._map_and_count.config import Config
from moe_eplb_jax.routing._map_and_count.reference import hash_replica, hash_token

__all__ = ["map_and_count_triton"]

_INT32_MAX = np.iinfo(np.int32).max
_MAX_HISTOGRAM_BINS = 32768  # tt.histogram's bins live in a block's shared memory (128 KiB of an H200's 227)


def _histogram_bins(count: int) -> int:
    """Bins of a ``tt.histogram`` over ``[0, count)``: a power of two, at least 32 (one per warp lane)."""
    return max(32, pl.next_power_of_2(count))


def _map_kernel(
    ids_ref,
    lookup_ref,
    table_ref,
    base_ref,
    rank_ref,
    limits_ref,
    zeros_ref,
    phys_ref,
    load_ref,
    *,
    mode,
    num_flat,
    top_k,
    num_logical,
    width,
    num_physical,
    tile,
    sub,
    point_from,
    wide,
    per_entry,
    start_lookup,
    alias_at,
    word_heads,
    compact,
    rank_tile,
    expert_bins,
    store_load=False,
):
    """Maps and counts this program's ``tile`` entries.

    ``lookup_ref``: :func:`._tables.placement_lookup` (``wide``: :func:`._tables.wide_lookup`). ``table_ref``:
    ``"lp"``'s packed alias table from entry ``alias_at`` on; ``"quota"``'s flat expert-major thresholds, or
    boundary positions (``point_from="positions"``). ``"quota"``'s point: the flat index (positions), else
    ``base + in-tile rank`` (``"ranks"``: ``base_ref [tiles * E_pad]`` and ``rank_ref [N]``; ``"lookback"``:
    ``base_ref`` is this program's own ``[E_pad]`` bases, a value). ``per_entry``: each counted entry adds itself
    to the loads (too many bins for shared memory), else one atomic per bin at the end -- or, with ``store_load``
    (the only program: a decode step's few entries), one store of its histogram, ``zeros_ref`` then unused.
    """
    del zeros_ref  # aliased to load_ref (the loads start at zero), or unused
    program = pl.program_id(0)
    count_limit, rank_limit, token_offset = limits_ref[0], limits_ref[1], limits_ref[2]

    def head_of(expert):
        """``(count >= 1, first slot)`` from the lookup (``wide``: the count only; log2phy holds every slot)."""
        head = lookup_ref[expert]
        if wide:
            return jnp.maximum(head, 1), head
        return jax.lax.shift_right_logical(head, 16), (head & 0xFFFF) - 1

    def step(index, hist):
        start = pl.multiple_of(program * tile + index * sub, sub)  # aligned: 16-byte loads and stores
        flat = start + jnp.arange(sub, dtype=jnp.int32)
        inside = flat < num_flat
        ids = plgpu.load(ids_ref.at[pl.ds(start, sub)], mask=inside, other=-1)
        valid_id = (ids >= 0) & (ids < num_logical)
        expert = jnp.where(valid_id, ids, 0)
        # Unsigned division and remainder: both operands are >= 0, and the signed forms add sign fix-ups.
        position = flat.astype(jnp.uint32) // jnp.uint32(top_k) + token_offset.astype(jnp.uint32)
        hashed = hash_token(position)
        if mode == "lp":
            slot = _alias_slot(table_ref, expert, valid_id, hashed, num_logical, alias_at, word_heads, compact)
        else:
            count, first = head_of(expert)
            # Built where it is used: for "quota" after the search's loops (not live across them).
            by_hash = lambda: hash_replica(hashed, count)
            if mode == "hash":
                replica = by_hash()
            elif mode == "round_robin":
                replica = (position % count.astype(jnp.uint32)).astype(jnp.int32)
            else:
                if point_from == "positions":
                    point = jnp.where(flat < rank_limit, flat, _INT32_MAX)
                else:  # earlier rank tiles + the rank inside its own
                    if point_from == "lookback":
                        before = take(base_ref, expert)
                    else:  # lanes past the end clamped too: this gather is not masked
                        tile_of = jax.lax.div(jnp.minimum(flat, num_flat - 1), rank_tile)
                        before = base_ref[tile_of * expert_bins + expert]
                    in_tile = plgpu.load(rank_ref.at[pl.ds(start, sub)], mask=inside, other=0)
                    point = jnp.where(flat < rank_limit, before + in_tile, _INT32_MAX)
                searching = valid_id & (count > 1)  # one replica: replica 0 whatever the thresholds
                at = lambda j: expert * width + j
                if start_lookup:  # each expert's boundaries before the step first: few entries search
                    words = _positions.start_words(
                        table_ref, lambda e: head_of(e)[0], start, num_logical=num_logical, width=width, sub=sub
                    )
                    passed = _positions.start_passed(
                        words, table_ref, at, start, flat, point, expert, count, searching, width=width
                    )
                else:
                    passed = upper_bound(
                        loads(table_ref, at), point, width, count, searching, dynamic=point_from == "positions"
                    )
                replica = jnp.where(passed < count, passed, by_hash())  # past the expert's total quota: hash
            replica = jnp.clip(replica, 0, width - 1)
            later = plgpu.load(
                lookup_ref.at[num_logical + replica * num_logical + expert], mask=wide | (replica > 0), other=-1
            )
            slot = later if wide else jnp.where(replica > 0, later, first)
        mapped = valid_id & (slot >= 0) & (slot < num_physical)
        phys = jnp.where(mapped, slot, -1)
        plgpu.store(phys_ref.at[pl.ds(start, sub)], phys, mask=inside)
        counted = jnp.where(mapped & (flat < count_limit), phys, -1)
        if per_entry:  # (a scatter-add in interpret mode: duplicates all count)
            atomic_add_int(load_ref, jnp.maximum(counted, 0), jnp.ones_like(counted), counted >= 0)
            return hist
        return hist + histogram(counted, hist.shape[0])

    bins = 32 if per_entry else _histogram_bins(num_physical)
    hist = jax.lax.fori_loop(0, tile // sub, step, jnp.zeros((bins,), jnp.int32))
    if store_load:  # the loads' buffer holds every bin here: the bins past the slots are zero
        load_ref[...] = hist
    elif not per_entry:
        # Each lane its own address: lanes adding to one address in one instruction serialise.
        at = jnp.arange(bins, dtype=jnp.int32)
        atomic_add_int(load_ref, at, hist, at < num_physical)


def _alias_slot(table_ref, expert, valid_id, hashed, num_logical, alias_at, word_heads, compact):
    """Mode ``"lp"``: each entry's slot from the packed alias table (:func:`._alias.pack_words`): its expert's head
    word (and the offset beside it where offsets pass its 17 bits), then for a multi-replica expert its bucket's
    word (alias and own slot in one word up to 2047 slots, else a (word, own slot) pair)."""
    head_at = alias_at + 2 * expert
    head = plgpu.load(table_ref.at[head_at], mask=valid_id, other=1 << _alias.HEAD_SHIFT)
    buckets, low = _alias.head_fields(head)
    offset = low if word_heads else plgpu.load(table_ref.at[head_at + 1], mask=valid_id, other=0)
    bucket, fraction = _alias.bucket_and_fraction(hashed, buckets)
    multi = valid_id & (buckets > 1)
    if compact:
        word = plgpu.load(table_ref.at[alias_at + 2 * num_logical + offset + bucket], mask=multi, other=0)
        bucket_slot = _alias.compact_slot(word, fraction)
    else:
        pair_at = alias_at + 2 * (num_logical + offset + bucket)
        word = plgpu.load(table_ref.at[pair_at], mask=multi, other=0)
        own = plgpu.load(table_ref.at[pair_at + 1], mask=multi, other=0)
        bucket_slot = _alias.alias_slot(word, own, fraction)
    return jnp.where(multi, bucket_slot, low - 1)  # a single-replica expert: its head holds first slot + 1


def _lookback_kernel(
    ids_ref,
    lookup_ref,
    table_ref,
    limits_ref,
    zeros_ref,
    board_zeros_ref,
    phys_ref,
    load_ref,
    rank_ref,
    rank_hist_ref,
    board_ref,
    *,
    chains,
    compiled,
    **map_options,
):
    """Mode ``"quota"`` in one kernel, a program per rank tile: its in-tile ranks (:func:`._rank.rank_in_chains`),
    the earlier tiles' counts by a look-back over the zeroed board (:func:`._rank.lookback_bases`), then the map
    kernel's work on the same tile."""
    del board_zeros_ref  # aliased to board_ref
    program = pl.program_id(0)
    expert_bins = map_options["expert_bins"]
    total = _rank.rank_in_chains(
        program,
        ids_ref,
        limits_ref[1],
        rank_ref,
        rank_hist_ref,
        num_flat=map_options["num_flat"],
        num_logical=map_options["num_logical"],
        tile=map_options["tile"],
        expert_bins=expert_bins,
        chains=chains,
        compiled=compiled,
    )
    bases = _rank.lookback_bases(board_ref, program, total, expert_bins=expert_bins)
    if compiled:  # the ranks the block's other warps stored, read below
        plgpu.debug_barrier()
    _map_kernel(
        ids_ref, lookup_ref, table_ref, bases, rank_ref, limits_ref, zeros_ref, phys_ref, load_ref, **map_options
    )


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The static sizes of one call: flat entries, ``k``, ``E``, ``S``, ``P``."""

    num_flat: int
    top_k: int
    num_logical: int
    width: int
    num_physical: int

    @property
    def wide(self) -> bool:
        """Slots past a head word's 16 bits."""
        return self.num_physical >= _tables.WIDE

    @property
    def plain(self) -> int:
        """Words of the placement's own lookup table."""
        return _tables.lookup_size(self.num_logical, self.width)

    @property
    def expert_bins(self) -> int:
        return _histogram_bins(self.num_logical)


def map_and_count_triton(
    topk_ids,
    log2phy,
    logcnt,
    limits,
    *,
    num_physical: int,
    mode: str,
    quotas=None,
    shares=None,
    lookup=None,
    interpret: bool = False,
    config: Config | None = None,
):
    """Same contract as :func:`.reference.map_and_count_reference`, plus a prepared ``lookup`` and a tiling.

    ``mode`` is the kernel rule. ``quotas`` (``"quota"``): ``[E, S]`` int32 quotas. ``shares`` (``"lp"``):
    ``[E, S]`` float32 weights, from which a kernel builds the alias table -- unless ``lookup`` holds it
    (``lookup_table(..., replica_shares=)``). ``lookup``: the placement's lookup table built once per placement,
    else built here per call. ``config``: the kernels' tiling (default :meth:`.config.Config.default` by size).
    """
    num_tokens, top_k = topk_ids.shape
    num_logical, width = log2phy.shape
    layout = _Layout(num_tokens * top_k, top_k, num_logical, width, num_physical)
    config = Config.default(mode, layout.num_flat) if config is None else config
    prepared_words, compact = _alias_layout(mode, lookup, layout)
    values = _raw_values(mode, quotas, shares, logcnt, layout, prepared_words)
    (ids, log2phy, logcnt, limits, values, *rest), out_struct = join_varying(
        topk_ids.reshape(layout.num_flat), log2phy, logcnt, limits, values, *([] if lookup is None else [lookup])
    )
    unused = jnp.zeros_like(limits[:1])  # inputs a path does not read (sharing the others' manual axes)
    build = dict(interpret=interpret, out_struct=out_struct)
    lookup, table = _replica_tables(
        mode, values, log2phy, logcnt, rest[0] if rest else None, layout, config, prepared_words, compact, unused, build
    )
    base = rank = unused
    point_from, tiling = None, (config.tile, config.sub, config.num_warps)
    if mode == "quota":
        point_from = config.quota_path
        table, base, rank, tiling = _quota_points(ids, values, limits, logcnt, layout, config, unused, build)
    tile, sub, num_warps = tiling
    map_options = dict(
        mode=mode,
        num_flat=layout.num_flat,
        top_k=top_k,
        num_logical=layout.num_logical,
        width=layout.width,
        num_physical=num_physical,
        tile=tile,
        sub=sub,
        point_from=point_from,
        wide=layout.wide,
        per_entry=_histogram_bins(num_physical) > _MAX_HISTOGRAM_BINS,
        start_lookup=point_from == "positions" and _positions.start_table_fits(layout.width, sub),
        alias_at=layout.plain if prepared_words else 0,
        word_heads=_alias.word_heads_fit(layout.num_logical, layout.width),
        compact=compact,
        rank_tile=config.rank_tile,
        expert_bins=layout.expert_bins,
    )
    phys, load = _launch(ids, lookup, table, base, rank, limits, map_options, (num_warps, config.num_stages), build)
    return phys.reshape(num_tokens, top_k), load


def _alias_layout(mode, lookup, layout: _Layout) -> tuple[bool, bool]:
    """``(prepared, compact)``: whether ``lookup`` carries lp's alias words (its size says so, and in which
    layout), and whether the alias table holds one word per bucket."""
    lookup_shape = None if lookup is None else tuple(lookup.shape)
    if mode == "lp" and lookup_shape not in (None, (layout.plain,)):
        compact = lookup_shape == (layout.plain + _alias.packed_size(layout.num_logical, layout.width, True),)
        return True, compact
    return False, _alias.compact_fits(layout.num_physical)


def _raw_values(mode, quotas, shares, logcnt, layout: _Layout, prepared_words: bool):
    """The mode's table as the kernels read it: the raw quotas, flat (the kernels sum them); the weights the alias
    kernel reads; a placeholder word otherwise."""
    if mode == "quota":
        return _tables.kernel_quotas(jnp.asarray(quotas, jnp.int32), logcnt, cap=layout.num_flat).reshape(-1)
    if mode == "lp" and not prepared_words:
        return jnp.asarray(shares, jnp.float32)
    return jnp.zeros((1,), jnp.int32)  # not read


def _replica_tables(
    mode, values, log2phy, logcnt, lookup, layout: _Layout, config, prepared_words, compact, unused, build
):
    """``(lookup, table)`` for the map kernel: ``"lp"`` reads its alias table alone (prepared, else built by the alias
    kernel now); the other modes read the placement's lookup (prepared, else built now; the wide one for slots
    past 16 bits)."""
    if mode == "lp":
        if prepared_words:
            return unused, lookup
        return unused, alias_kernel(values, log2phy, logcnt, compact=compact, num_warps=config.alias_warps, **build)
    if layout.wide:  # head words cannot hold these slots
        return _tables.wide_lookup(log2phy, logcnt), unused
    return (_tables.placement_lookup(log2phy, logcnt) if lookup is None else lookup), unused


def _quota_points(ids, values, limits, logcnt, layout: _Layout, config: Config, unused, build):
    """Mode ``"quota"``: what the map kernel reads to find each entry's point along ``config.quota_path`` ->
    ``(table, base, rank, (tile, sub, num_warps))`` (the look-back path maps in its rank programs)."""
    common = dict(
        num_logical=layout.num_logical, width=layout.width, expert_bins=layout.expert_bins, cap=layout.num_flat
    )
    tiling = (config.tile, config.sub, config.num_warps)
    if config.quota_path == "positions":
        table = _positions.boundary_positions(
            ids,
            values,
            limits,
            logcnt,
            tile=config.position_tile,
            scan=config.position_scan,
            count_warps=config.count_warps,
            num_warps=config.boundary_warps,
            programs=layout.num_physical,
            **common,
            **build,
        )
        return table, unused, unused, tiling
    if config.quota_path == "ranks":
        rank, base, table = _rank.tile_ranks(ids, limits, values, logcnt, tile=config.rank_tile, **common, **build)
        return table, base, rank, tiling
    if layout.num_flat >= 1 << 29:
        raise ValueError(
            f"quota by look-back supports fewer than 2**29 entries (words of count << 2), got {layout.num_flat}"
        )
    values = values.reshape(layout.num_logical, layout.width)
    table = _tables.quota_thresholds(values, logcnt, cap=layout.num_flat).reshape(-1)
    rank_tile = config.rank_tile
    return table, unused, unused, (rank_tile, min(config.sub, rank_tile), min(4, rank_tile // _rank.STEP))


def _launch(ids, lookup, table, base, rank, limits, map_options, launch, build):
    """The map kernel's ``pallas_call`` (``launch``: its ``(num_warps, num_stages)``) -> ``(phys [N], load [P])``;
    on the look-back path, the one kernel that ranks, looks back and maps."""
    interpret, out_struct = build["interpret"], build["out_struct"]
    num_warps, num_stages = launch
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    num_flat, num_physical, expert_bins = (
        map_options["num_flat"],
        map_options["num_physical"],
        map_options["expert_bins"],
    )
    num_tiles = pl.cdiv(num_flat, map_options["tile"])
    (zeros, _), _ = join_varying(jnp.zeros((num_physical,), jnp.int32), limits)  # Pallas never zeroes an output
    whole = pl.no_block_spec
    outputs = [out_struct((num_flat,), jnp.int32), out_struct((num_physical,), jnp.int32)]
    if map_options["point_from"] == "lookback":
        # Scratch outputs: the in-tile ranks, the chains' counts, the look-back board (zeroed, aliased).
        (board_zeros, _), _ = join_varying(jnp.zeros((num_tiles * expert_bins,), jnp.int32), limits)
        phys, load, *_ = pl.pallas_call(
            functools.partial(_lookback_kernel, chains=num_warps, compiled=not interpret, **map_options),
            grid=(num_tiles,),
            in_specs=[whole] * 6,
            out_specs=[whole] * 5,
            out_shape=outputs
            + [
                out_struct((num_flat,), jnp.int32),
                out_struct((num_tiles * num_warps * 2 * expert_bins,), jnp.int32),
                out_struct((num_tiles * expert_bins,), jnp.int32),
            ],
            input_output_aliases={4: 1, 5: 4},
            compiler_params=params,
            interpret=interpret,
            name="map_and_count",
        )(ids, lookup, table, limits, zeros, board_zeros)
        return phys, load
    # One program (a decode step) stores its histogram, every bin of it: no zeroed buffer to fill and copy in
    # before the kernel.
    store_load = num_tiles == 1 and not map_options["per_entry"]
    if store_load:
        outputs[1] = out_struct((_histogram_bins(num_physical),), jnp.int32)
    phys, load = pl.pallas_call(
        functools.partial(_map_kernel, store_load=store_load, **map_options),
        grid=(num_tiles,),
        in_specs=[whole] * 7,
        out_specs=[whole, whole],
        out_shape=outputs,
        input_output_aliases={} if store_load else {6: 1},
        compiler_params=params,
        interpret=interpret,
        name="map_and_count",
    )(ids, lookup, table, base, rank, limits, base if store_load else zeros)
    return phys, load[:num_physical]

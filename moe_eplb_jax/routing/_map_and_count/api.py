"""Fused replica routing and load counting for one MoE layer.

``map_and_count`` maps the router's logical expert ids ``topk_ids [T, k]`` to
physical slots (one replica per (token, k) entry) and counts how many entries
each slot received. Semantics, identical for every implementation:

Positions. Entry ``(t, j)`` has flat index ``i = t * k + j`` and token index
``t = i // k``; its global position is ``u = (token_offset + t) mod 2**32``
(inside ``shard_map`` pass each rank's offset, say its index times ``T``, so
that every rank's tokens have their own positions: ``moe_apply`` does). ``h(u)
= (u * 2654435769) mod 2**32`` (uint32 arithmetic).

Validity. An id outside ``[0, E)`` maps to ``-1`` and is never counted. Tokens
with ``t >= num_valid_tokens`` (padding) are mapped but not counted. With
``record=False`` nothing is counted (``load`` is all zeros); ``record`` and
``num_valid_tokens`` may be traced, so changing them never recompiles.

Replica choice for an entry of expert ``e`` with ``c = logcnt[e]`` replicas
(``replica`` indexes ``log2phy[e]``; the slot is ``log2phy[e, replica]``), by
the mode's kernel rule (``routing.MODES[mode].kernel``):

* ``hash``: ``replica = floor(h(u) * c' / 2**32)`` with ``c' = min(c, 2**16 -
  1)``: the hash's high bits, which spread consecutive positions evenly over
  any replica count (its low bits repeat the position's, so ``h mod c`` would
  be round robin for ``c`` a power of two). Stateless.
* ``round_robin``: ``replica = u mod c`` (consecutive tokens take consecutive
  replicas; all k entries of a token use the same rule).
* ``lp``: ``replica_shares [E, S]`` holds non-negative weights of the first
  ``c`` replicas (say from :func:`moe_eplb_jax.routing.lp_shares`; entries
  beyond ``c`` are ignored, negative or non-finite weights count as 0, rows
  need not be normalised), and each replica receives its share of the
  expert's entries through Walker's alias method (:mod:`._alias`): constant
  work per entry. Integer work only, so every implementation and a prepared
  table agree bit for bit. Weights become integers ``q_j = floor(w_j *
  2**k)``, the power of two putting the row's largest weight in ``[2**(B-1),
  2**B)`` (``B = min(24, 30 - ceil(log2 S))``); with ``Q`` their sum and ``U =
  2**10``, replica ``j`` gets the mass ``m_j = floor(c * U * q_j / Q)``, except
  the last with ``q_j > 0``, which takes the rest of ``c * U``; a row with ``Q
  = 0`` is split equally. The expert's ``c`` buckets of ``U`` units are filled
  by Vose's sweep: light replicas (``m < U``) in index order each keep ``m``
  in their own bucket and are topped up by the current heavy replica (``m >
  U``, in index order); a heavy one whose excess runs out becomes light,
  keeps what it has left, and the next heavy one tops it up first. Entry
  ``(t, j)``: ``s = floor(h(u) * c / 2**16)``, bucket ``b = s >> 16``, fraction
  ``f = (s mod 2**16) >> 6``; the replica is ``b`` if ``f`` is below the
  bucket's own part, else the bucket's other replica. So replica loads follow
  ``m_j / (c * U)``; a zero-weight replica is never chosen. Needs ``S <=
  32767`` and ``num_physical <= 65535`` (slots in 16 bits).
* ``quota``: ``quotas [E, S]`` integer token quotas of the first ``c``
  replicas for THIS caller's tokens (in EP, source rank ``g`` passes row ``g``
  of :func:`moe_eplb_jax.routing.plan_quotas`' ``quota [G, E, S]``). Entries
  of expert ``e`` with ``t < num_valid_tokens`` are taken in flat order: the
  first ``quotas[e, 0]`` go to replica 0, the next ``quotas[e, 1]`` to replica
  1, and so on; entries beyond the total quota (demand above supply) and
  padding entries fall back to ``hash``. Negative quotas count as 0. Counts
  per replica equal the quotas exactly when demand equals supply.

Checks. Shapes, dtypes and static arguments are always checked. Where the ids
and tables are concrete (outside ``jit``) their values are checked too: ids
must fit int32, and the tables must agree -- ``0 <= logcnt[e] <= S``, the
first ``logcnt[e]`` entries of ``log2phy[e]`` distinct slots in ``[0, P)``
(across experts too), the rest ``-1``. Under ``jit`` values cannot be checked:
integer inputs wider than int32 saturate (an id or slot past int32 stays out
of range and maps to ``-1``), and the tables are assumed to agree -- tables
that do not route entries where they point (never outside ``[0, P)``).

Implementations: ``"xla"`` (pure jnp, :mod:`.reference`, the test oracle)
and ``"pallas"`` (Triton kernels, :mod:`._triton`, tiled by a :class:`.config.Config`;
on CPU Pallas interpret mode, slowly). Both give identical results for every input. The default is
``"pallas"`` on a GPU where a first-use probe of the kernels for the mode
agrees with ``"xla"``, else ``"xla"`` (:func:`moe_eplb_jax._kernels.pallas_default`).
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np

from moe_eplb_jax._checks import INT32_MAX, check_int, is_concrete, show
from moe_eplb_jax._kernels import pallas_default
from moe_eplb_jax.routing._map_and_count import _alias, _tables
from moe_eplb_jax.routing._map_and_count.config import QUOTA_PATHS, Config
from moe_eplb_jax.routing._map_and_count.reference import map_and_count_reference
from moe_eplb_jax.routing.modes import MODES, RoutingMode, routing_mode

__all__ = ["IMPLEMENTATIONS", "lookup_table", "map_and_count"]

IMPLEMENTATIONS = ("xla", "pallas")
_INT32 = np.iinfo(np.int32)


def map_and_count(
    topk_ids,
    log2phy,
    logcnt,
    *,
    num_physical: int,
    num_valid_tokens=None,
    token_offset=0,
    mode: str | RoutingMode = "hash",
    replica_shares=None,
    quotas=None,
    record=True,
    implementation: str | None = None,
    lookup=None,
    config: Config | None = None,
):
    """Maps logical expert ids to physical slots and counts the load per slot.

    Args:
      topk_ids: ``[T, k]`` integer logical expert ids (router top-k).
      log2phy: ``[E, S]`` integer replica slots of each logical expert, ``-1``
        padded (one layer of ``Placement.log2phy``; any ``S >= 1``).
      logcnt: ``[E]`` integer replicas per logical expert.
      num_physical: ``P``, the number of physical slots (static).
      num_valid_tokens: tokens ``t >= num_valid_tokens`` are padding (mapped, not
        counted). ``None`` means ``T``. A Python int or a traced int32 scalar.
      token_offset: the global position of token 0 (the module docstring): a
        Python int in ``[0, 2**31)`` or a traced integer scalar.
      mode: a routing mode (``routing.ROUTING_MODES``: ``"hash"``,
        ``"round_robin"``, ``"lp"``, ``"quota"``); its ``RoutingMode.kernel``
        rule picks the replicas.
      replica_shares: ``[E, S]`` float weights, only with a mode that reads shares (``"lp"``).
      quotas: ``[E, S]`` integer quotas, only with a mode that reads quotas (``"quota"``).
      record: count the load; a Python bool or a traced boolean scalar.
      implementation: ``"xla"``, ``"pallas"`` or ``None`` (the module docstring).
      lookup: optional, :func:`lookup_table` of these ``log2phy`` / ``logcnt``,
        built once per placement: the Pallas kernel then reads it instead of
        rebuilding it on every call (the XLA implementation ignores it). It
        must come from the same tables -- and, built with ``replica_shares``,
        from these shares: ``lp`` then reads its alias table from it and
        builds none per call.
      config: the Pallas kernels' tiling (:class:`.config.Config`; ``None``:
        ``Config.default`` by size); the XLA implementation ignores it.

    Returns:
      ``(physical_ids, load)``: ``[T, k]`` int32 slots (``-1`` for invalid
      ids) and ``[num_physical]`` int32 counts of valid, non-padding entries.

    Raises:
      ValueError: a shape, dtype, mode, size or implementation is wrong, or
        concrete ids or tables are not what the module docstring requires.
    """
    # Every check reads shapes, dtypes and concrete values only: nothing moves to the device before they all pass.
    (num_tokens, top_k), (num_logical, width) = _check_tables(topk_ids, log2phy, logcnt)
    num_physical = _check_num_physical(num_physical, num_logical)
    rule, mode_values = _check_mode(mode, replica_shares, quotas, num_logical, width, num_physical)
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
    if config is not None and not isinstance(config, Config):
        raise ValueError(f"config must be a map_and_count Config or None, got {type(config).__name__}")
    _check_flags(num_valid_tokens, record, num_tokens)
    _check_token_offset(token_offset)
    _check_lookup(lookup, num_logical, width, num_physical)
    _check_ids(topk_ids)
    _check_agreement(log2phy, logcnt, num_physical)

    topk_ids, log2phy, logcnt = (_saturated_int32(a) for a in (topk_ids, log2phy, logcnt))
    if num_tokens * top_k == 0:
        return jnp.full((num_tokens, top_k), -1, jnp.int32), jnp.zeros((num_physical,), jnp.int32)
    tables = {}
    if rule == "lp":
        tables["shares"] = jnp.asarray(mode_values).astype(jnp.float32)
    elif rule == "quota":
        tables["quotas"] = _saturated_int32(mode_values)
    limits = _limits(num_valid_tokens, record, num_tokens, top_k, token_offset)
    if implementation is None:
        probe = functools.partial(_probe_pallas, rule)
        implementation = "pallas" if pallas_default("map_and_count", probe, case=rule) else "xla"
    if implementation == "xla":
        return map_and_count_reference(
            topk_ids, log2phy, logcnt, limits, num_physical=num_physical, mode=rule, **tables
        )
    from moe_eplb_jax.routing._map_and_count import _triton  # imported lazily: needs Pallas' Triton backend

    return _triton.map_and_count_triton(
        topk_ids,
        log2phy,
        logcnt,
        limits,
        num_physical=num_physical,
        mode=rule,
        lookup=lookup,
        interpret=jax.default_backend() != "gpu",
        config=config,
        **tables,
    )


def lookup_table(log2phy, logcnt, *, replica_shares=None, num_physical=None):
    """The Pallas kernel's lookup table of one placement layer, to pass as ``map_and_count(lookup=...)``.

    Args:
      log2phy: ``[E, S]`` integer replica slots (``-1`` padded), as for ``map_and_count``.
      logcnt: ``[E]`` integer replicas per logical expert.
      replica_shares: optional ``[E, S]`` float weights of ``mode="lp"``:
        their alias table is then built here too, so the kernel does not
        build it per call.
      num_physical: optional, with ``replica_shares``: the calls' ``P``. Up to
        2047 the alias table then holds each bucket in one word (11-bit
        slots; the kernel's fastest form, also what it builds per call for
        such ``P``), and the table serves only calls with ``P <= 2047``;
        without it each bucket takes two words and the table serves any
        ``P``.

    Returns:
      ``[E * (1 + S)]`` int32: per expert ``(first slot + 1) | count << 16``,
      then ``log2phy`` transposed (``[S, E]``, flat); with ``replica_shares``
      ``[3 E (1 + S)]`` (``[E (3 + 2 S)]`` with ``num_physical <= 2047``), the
      alias table packed for the kernel after them. Placements (and a
      policy's replica shares) change only at rearrangement, so a model
      builds this then and keeps it. A table with the alias words serves
      every mode; one without them serves ``lp`` too, the kernel then building
      the words per call.

    Raises:
      ValueError: as :func:`map_and_count` for the same tables.
    """
    (num_logical, width) = _check_placement(log2phy, logcnt)
    if replica_shares is not None:
        _check_shares(replica_shares, num_logical, width)
    if num_physical is not None:
        if replica_shares is None:
            raise ValueError("num_physical is only used with replica_shares (it sizes the alias table's slots)")
        num_physical = _check_num_physical(num_physical, num_logical)
    _check_agreement(log2phy, logcnt, num_physical)
    log2phy, logcnt = _saturated_int32(log2phy), _saturated_int32(logcnt)
    if replica_shares is None:
        return _placement_table(log2phy, logcnt)
    compact = num_physical is not None and _alias.compact_fits(num_physical)
    return _alias_table(log2phy, logcnt, jnp.asarray(replica_shares).astype(jnp.float32), compact=compact)


# One compiled program per table shape: a rearrangement builds its layers' tables without compiling (their loops,
# run op by op, would trace and compile anew at every call).
@jax.jit
def _placement_table(log2phy, logcnt):
    return _tables.placement_lookup(log2phy, logcnt)


@functools.partial(jax.jit, static_argnames="compact")
def _alias_table(log2phy, logcnt, shares, *, compact: bool):
    words = _alias.alias_words(shares, log2phy, logcnt)
    return jnp.concatenate([_placement_table(log2phy, logcnt), _alias.pack_words(words, log2phy, logcnt, compact)])


# ------------------------------------------------------------------ validation
def _shape_dtype(value):
    """Shape and dtype without moving data (tracers, jax and numpy arrays all carry both)."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return tuple(value.shape), np.dtype(value.dtype)
    array = np.asarray(value)
    return array.shape, array.dtype


def _concrete(value):
    """``value`` as a numpy array where it is concrete, ``None`` where it is traced."""
    try:
        return np.asarray(value)
    except jax.errors.TracerArrayConversionError:
        return None


def _check_int_array(name, value, ndim):
    shape, dtype = _shape_dtype(value)
    if len(shape) != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {shape}")
    if not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"{name} must have an integer dtype, got {dtype}")
    return shape


def _check_tables(topk_ids, log2phy, logcnt):
    ids_shape = _check_int_array("topk_ids", topk_ids, 2)
    table_shape = _check_placement(log2phy, logcnt)
    if ids_shape[1] < 1:
        raise ValueError(f"topk_ids must have shape [T, k >= 1], got {ids_shape}")
    if ids_shape[0] * ids_shape[1] >= 2**31:
        raise ValueError(f"topk_ids has {ids_shape[0] * ids_shape[1]} entries; at most 2**31 - 1 are supported")
    return ids_shape, table_shape


def _check_placement(log2phy, logcnt):
    """``(E, S)`` of one layer's ``log2phy [E, S]`` and ``logcnt [E]``."""
    table_shape = _check_int_array("log2phy", log2phy, 2)
    count_shape = _check_int_array("logcnt", logcnt, 1)
    num_logical, width = table_shape
    if num_logical < 1 or width < 1:
        raise ValueError(f"log2phy must have shape [E >= 1, S >= 1], got {table_shape}")
    if count_shape != (num_logical,):
        raise ValueError(f"logcnt must have shape [E] = ({num_logical},), got {count_shape}")
    return table_shape


def _check_ids(topk_ids):
    """Concrete ids wider than int32 must fit it: cast, they would become other experts."""
    if np.can_cast(_shape_dtype(topk_ids)[1], np.int32):
        return
    ids = _concrete(topk_ids)
    if ids is not None and ids.size and (ids.min() < _INT32.min or ids.max() > _INT32.max):
        bad = ids.min() if ids.min() < _INT32.min else ids.max()
        raise ValueError(f"topk_ids holds {bad}, outside int32: ids must fit int32 (invalid ids are negative)")


def _check_agreement(log2phy, logcnt, num_physical):
    """Concrete tables must agree (module docstring); ``num_physical=None`` bounds the slots by int32 only."""
    table, counts = _concrete(log2phy), _concrete(logcnt)
    if table is None or counts is None:
        return
    num_logical, width = table.shape
    for e in np.flatnonzero((counts < 0) | (counts > width))[:1]:
        raise ValueError(f"logcnt[{e}] = {counts[e]} is outside [0, S = {width}] (log2phy's replica slots)")
    live = np.arange(width)[None, :] < counts[:, None]
    limit = _INT32.max if num_physical is None else num_physical
    for e, j in np.argwhere(live & ((table < 0) | (table >= limit)))[:1]:
        raise ValueError(
            f"log2phy[{e}, {j}] = {table[e, j]} is not a slot in [0, {limit}), but replica {j} < logcnt[{e}] = "
            f"{counts[e]} of expert {e}"
        )
    for e, j in np.argwhere(~live & (table != -1))[:1]:
        raise ValueError(f"log2phy[{e}, {j}] = {table[e, j]} past logcnt[{e}] = {counts[e]} must be -1 (padding)")
    slots, times = np.unique(table[live], return_counts=True)
    for slot in slots[times > 1][:1]:
        holders = sorted({int(e) for e in np.argwhere(table == slot)[:, 0]})
        raise ValueError(
            f"slot {slot} is listed more than once in log2phy (experts {holders}): a slot holds one replica"
        )


def _saturated_int32(value):
    """An integer array as int32, values past int32 saturated (never wrapped onto other ids or slots)."""
    dtype = _shape_dtype(value)[1]
    if np.can_cast(dtype, np.int32):
        return jnp.asarray(value).astype(jnp.int32)
    info = np.iinfo(dtype)
    low, high = max(info.min, _INT32.min), min(info.max, _INT32.max)
    if isinstance(value, jax.Array):
        return jnp.clip(value, low, high).astype(jnp.int32)
    return jnp.asarray(np.clip(np.asarray(value), low, high).astype(np.int32))  # before JAX truncates 64-bit ints


def _check_num_physical(num_physical, num_logical):
    if isinstance(num_physical, bool):
        raise ValueError("num_physical must be a Python int, got bool")
    try:
        num_physical = operator.index(num_physical)
    except TypeError:
        raise ValueError(f"num_physical must be a Python int, got {type(num_physical).__name__}") from None
    if num_physical < num_logical:
        raise ValueError(
            f"num_physical ({show(num_physical)}) must be at least the number of logical experts ({num_logical})"
        )
    if num_physical > _INT32.max:  # slot ids and counts are int32
        raise ValueError(f"num_physical ({show(num_physical)}) must be <= 2**31 - 1 (slot ids are int32)")
    return num_physical


def _check_mode(mode, replica_shares, quotas, num_logical, width, num_physical):
    """``(kernel rule, [E, S] table)`` of the mode: its shares or quotas, ``None`` where it reads neither."""
    spec = routing_mode(mode, field="mode")
    for name, value in (("replica_shares", replica_shares), ("quotas", quotas)):
        if value is not None and spec.table != name:
            users = " or ".join(f"mode={m.name!r}" for m in MODES.values() if m.table == name)
            raise ValueError(f"{name} is only used with {users}, got mode={spec.name!r}")
    if spec.kernel == "lp":
        if num_physical > _alias.MAX_SLOTS:
            raise ValueError(
                f"mode={spec.name!r} supports num_physical up to {_alias.MAX_SLOTS} (slots in 16 bits), got "
                f"{num_physical}"
            )
        return spec.kernel, _check_shares(replica_shares, num_logical, width, spec.name)
    if spec.kernel == "quota":
        return spec.kernel, _check_table_values("quotas", quotas, num_logical, width, spec.name, jnp.integer)
    return spec.kernel, None


def _check_table_values(name, value, num_logical, width, mode, kind):
    """``replica_shares`` / ``quotas``: present, ``[E, S]``, of a ``kind`` dtype."""
    if value is None:
        raise ValueError(f"mode={mode!r} needs {name} [E, S]")
    shape, dtype = _shape_dtype(value)
    if shape != (num_logical, width):
        raise ValueError(f"{name} must have shape [E, S] = {(num_logical, width)}, got {shape}")
    if not jnp.issubdtype(dtype, kind):
        raise ValueError(
            f"{name} must have {'a floating' if kind is jnp.floating else 'an integer'} dtype, got {dtype}"
        )
    return value


def _check_shares(replica_shares, num_logical, width, mode="lp"):
    _check_table_values("replica_shares", replica_shares, num_logical, width, mode, jnp.floating)
    if width > _alias.MAX_WIDTH:
        raise ValueError(
            f"mode={mode!r} supports at most {_alias.MAX_WIDTH} replicas per expert (log2phy's S), got S = {width}"
        )
    return replica_shares


def _check_lookup(lookup, num_logical, width, num_physical):
    if lookup is None:
        return
    shape, dtype = _shape_dtype(lookup)
    plain = _tables.lookup_size(num_logical, width)  # the placement's own table; then lp's in two layouts
    sizes = (plain, *(plain + _alias.packed_size(num_logical, width, compact) for compact in (False, True)))
    if shape not in [(size,) for size in sizes] or dtype != np.int32:
        raise ValueError(
            f"lookup must be lookup_table(log2phy, logcnt[, replica_shares=...]): int32 of shape "
            f"({sizes[0]},) or, with shares, ({sizes[1]},) or ({sizes[2]},), got shape {shape} "
            f"dtype {dtype}"
        )
    if shape == (sizes[2],) and not _alias.compact_fits(num_physical):
        raise ValueError(
            f"lookup was built with num_physical <= {_alias.COMPACT_SLOTS} (one-word buckets, 11-bit "
            f"slots): it cannot serve num_physical = {num_physical}"
        )


def _check_flags(num_valid_tokens, record, num_tokens):
    if num_valid_tokens is not None:
        if isinstance(num_valid_tokens, (int, np.integer)) and not isinstance(num_valid_tokens, bool):
            if not 0 <= num_valid_tokens <= num_tokens:
                raise ValueError(f"num_valid_tokens must be in [0, T={num_tokens}], got {num_valid_tokens}")
        shape, dtype = _shape_dtype(num_valid_tokens)
        if shape != () or not jnp.issubdtype(dtype, jnp.integer) or dtype == np.bool_:
            raise ValueError(f"num_valid_tokens must be an integer scalar, got shape {shape} dtype {dtype}")
    shape, dtype = _shape_dtype(record)
    if shape != () or dtype != np.bool_:
        raise ValueError(f"record must be a boolean scalar, got shape {shape} dtype {dtype}")


def _check_token_offset(token_offset) -> None:
    if hasattr(token_offset, "dtype"):
        if np.ndim(token_offset) != 0 or not jnp.issubdtype(token_offset.dtype, jnp.integer):
            raise ValueError(
                f"token_offset must be an integer scalar, got {token_offset.dtype}{list(np.shape(token_offset))}"
            )
        if is_concrete(token_offset):
            check_int("token_offset", int(token_offset), minimum=0, maximum=INT32_MAX)
        return
    check_int("token_offset", token_offset, minimum=0, maximum=INT32_MAX)


def _limits(num_valid_tokens, record, num_tokens, top_k, token_offset=0):
    """``[count_limit, rank_limit, token_offset]``: flat positions below the first two are counted / consume quota;
    the third is the global position of token 0."""
    if num_valid_tokens is None:
        num_valid = jnp.int32(num_tokens)
    else:
        num_valid = jnp.clip(jnp.asarray(num_valid_tokens).astype(jnp.int32), 0, num_tokens)
    rank_limit = num_valid * jnp.int32(top_k)
    count_limit = jnp.where(jnp.asarray(record), rank_limit, jnp.int32(0))
    return jnp.stack([count_limit, rank_limit, jnp.asarray(token_offset).astype(jnp.int32)])


# ------------------------------------------------------------ default choice
def _probe_pallas(rule: str) -> bool:
    """Compiles and runs the Pallas path of the kernel rule on small inputs (every ``"quota"`` path), ahead of time
    and outside any trace: whether it equals the XLA implementation."""
    from moe_eplb_jax.routing._map_and_count import (
        _triton,  # raises where Pallas' Triton backend or a JAX internal is missing
    )

    rng = np.random.default_rng(0)
    num_tokens, top_k, num_logical, num_physical = 64, 4, 16, 24
    phy2log = rng.permutation(np.concatenate([np.arange(num_logical), rng.integers(0, num_logical, 8)]))
    logcnt = np.bincount(phy2log, minlength=num_logical).astype(np.int32)
    log2phy = np.full((num_logical, int(logcnt.max())), -1, np.int32)
    for e in range(num_logical):
        log2phy[e, : logcnt[e]] = np.flatnonzero(phy2log == e)
    ids = rng.integers(-1, num_logical, (num_tokens, top_k)).astype(np.int32)
    limits = np.asarray([200, 220, 7], np.int32)
    if rule == "lp":
        values = rng.random(log2phy.shape).astype(np.float32)
    else:
        values = rng.integers(0, 30, log2phy.shape).astype(np.int32)
    args = (ids, log2phy, logcnt, values, limits)

    def run(backend, **options):
        def call(ids, log2phy, logcnt, values, limits):
            tables = {"shares": values} if rule == "lp" else {"quotas": values} if rule == "quota" else {}
            return backend(ids, log2phy, logcnt, limits, num_physical=num_physical, mode=rule, **tables, **options)

        return _compiled(call, args)

    want = run(map_and_count_reference)
    for path in QUOTA_PATHS if rule == "quota" else ("ranks",):
        config = Config(quota_path=path, tile=128, sub=64, rank_tile=128, position_tile=64)
        got = run(_triton.map_and_count_triton, interpret=jax.default_backend() != "gpu", config=config)
        if not all(np.array_equal(a, b) for a, b in zip(got, want)):
            return False
    return True


def _compiled(fn, args):
    """``fn(*args)`` compiled ahead of time and run on the numpy ``args``: concrete results even while a caller's
    trace is open."""
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    return [np.asarray(out) for out in jax.jit(fn).lower(*specs).compile()(*args)]

"""Fused replica routing and load counting for one MoE layer.

``map_and_count`` maps the router's logical expert ids ``topk_ids [T, k]`` to
physical slots (one replica per (token, k) entry) and counts how many entries
each slot received. Semantics, identical for every implementation:

Positions. Entry ``(t, j)`` has flat index ``i = t * k + j`` and token index
``t = i // k``. ``h(t) = (t * 2654435769) mod 2**32`` (uint32 arithmetic). Token
indices are local to the call: inside ``shard_map`` each rank hashes its own
``0..T-1``.

Validity. An id outside ``[0, E)`` maps to ``-1`` and is never counted. Tokens
with ``t >= num_valid_tokens`` (padding) are mapped but not counted. With
``record=False`` nothing is counted (``load`` is all zeros); ``record`` and
``num_valid_tokens`` may be traced, so changing them never recompiles.

Replica choice for an entry of expert ``e`` with ``c = logcnt[e]`` replicas
(``replica`` indexes ``log2phy[e]``; the slot is ``log2phy[e, replica]``):

* ``hash``: ``replica = h(t) mod c``. Stateless; spreads tokens uniformly.
* ``round_robin``: ``replica = t mod c`` (consecutive tokens take consecutive
  replicas; all k entries of a token use the same rule).
* ``shares``: ``replica_shares [E, S]`` holds non-negative weights of the first
  ``c`` replicas (entries beyond ``c`` are ignored; negative or non-finite
  weights count as 0; rows need not be normalised), and each replica receives
  its share of the expert's entries through Walker's alias method
  (:mod:`._alias`): constant work per entry. Integer work only, so every
  implementation and a prepared table agree bit for bit. Weights become
  integers ``q_j = floor(w_j * 2**k)``, the power of two putting the row's
  largest weight in ``[2**(B-1), 2**B)`` (``B = min(24, 30 - ceil(log2
  S))``); with ``Q`` their sum and ``U = 2**10``, replica ``j`` gets the mass
  ``m_j = floor(c * U * q_j / Q)``, except the last with ``q_j > 0``, which
  takes the rest of ``c * U``; a row with ``Q = 0`` is split equally. The
  expert's ``c`` buckets of ``U`` units are filled by Vose's sweep: light
  replicas (``m < U``) in index order each keep ``m`` in their own bucket and
  are topped up by the current heavy replica (``m > U``, in index order); a
  heavy one whose excess runs out becomes light, keeps what it has left, and
  the next heavy one tops it up first. Entry ``(t, j)``: ``s = floor(h(t) * c
  / 2**16)``, bucket ``b = s >> 16``, fraction ``f = (s mod 2**16) >> 6``; the
  replica is ``b`` if ``f`` is below the bucket's own part, else the bucket's
  other replica. So replica loads follow ``m_j / (c * U)``, the shares to
  within a mass unit (``2**-10`` of a bucket) and ``2**-(B-1)`` of the
  largest; a zero-weight replica is never chosen
  (nor one below ``2**-(B-1)`` of the row's largest weight: its ``q_j`` is 0).
  Needs ``S <= 32767`` and ``num_physical <= 65535`` (slots in 16 bits).
* ``resolved``: ``resolved [E, S]`` int32 token quotas of the first ``c``
  replicas for THIS caller's tokens (in EP, source rank ``g`` passes row ``g`` of
  a ``[G, E, S]`` plan). Entries of expert ``e`` with ``t < num_valid_tokens``
  are taken in flat order: the first ``quota[e, 0]`` go to replica 0, the next
  ``quota[e, 1]`` to replica 1, and so on; entries beyond the total quota
  (demand above supply) and padding entries fall back to ``hash``. Negative
  quotas count as 0. Counts per replica equal the quotas exactly when demand
  equals supply.

Implementations: ``"xla"`` (pure jnp, :mod:`._reference`, the CPU default and
the test oracle) and ``"pallas"`` (a Triton kernel, :mod:`._triton`, the GPU
default; on CPU it runs in Pallas interpret mode, slowly). Both give identical
results for every input.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np

from moe_eplb_jax.pallas import _alias, _reference

__all__ = ["map_and_count", "lookup_table", "MODES", "IMPLEMENTATIONS"]

MODES = ("hash", "round_robin", "shares", "resolved")
IMPLEMENTATIONS = ("xla", "pallas")
_NEVER = np.iinfo(np.int32).max  # a threshold no point passes


def map_and_count(
    topk_ids,
    log2phy,
    logcnt,
    *,
    num_physical: int,
    num_valid_tokens=None,
    mode: str = "hash",
    replica_shares=None,
    resolved=None,
    record=True,
    implementation: str | None = None,
    lookup=None,
    quotas=None,
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
      mode: ``"hash"``, ``"round_robin"``, ``"shares"`` or ``"resolved"``.
      replica_shares: ``[E, S]`` float weights, only with ``mode="shares"``.
      resolved: ``[E, S]`` integer quotas, only with ``mode="resolved"``.
      record: count the load; a Python bool or a traced boolean scalar.
      implementation: ``"xla"``, ``"pallas"`` or ``None`` (pallas on GPU, xla
        elsewhere).
      lookup: optional, :func:`lookup_table` of these ``log2phy`` / ``logcnt``,
        built once per placement: the Pallas kernel then reads it instead of
        rebuilding it on every call (one small XLA kernel less per call; the
        XLA implementation ignores it). It must come from the same tables --
        and, built with ``replica_shares``, from these shares: ``shares`` then
        reads its alias table from it and builds none per call.

    Returns:
      ``(physical_ids, load)``: ``[T, k]`` int32 slots (``-1`` for invalid
      ids) and ``[num_physical]`` int32 counts of valid, non-padding entries.

    Raises:
      ValueError: a shape, dtype, mode, size or implementation is wrong.
    """
    # The routing vocabulary (EplbConfig.routing, MoELayer): "lp" routes by replica shares, "quota" by quotas.
    mode = {"lp": "shares", "quota": "resolved"}.get(mode, mode)
    if quotas is not None:
        if resolved is not None:
            raise ValueError("pass the quotas once (quotas=...)")
        resolved = quotas
    # Every check reads shapes and dtypes only: nothing moves to the device before they all pass.
    (num_tokens, top_k), (num_logical, width) = _check_tables(topk_ids, log2phy, logcnt)
    num_physical = _check_num_physical(num_physical, num_logical)
    mode_values = _check_mode(mode, replica_shares, resolved, num_logical, width, num_physical)
    implementation = _check_implementation(implementation)
    _check_flags(num_valid_tokens, record, num_tokens)
    _check_lookup(lookup, num_logical, width, num_physical)

    topk_ids, log2phy, logcnt = (jnp.asarray(a).astype(jnp.int32) for a in (topk_ids, log2phy, logcnt))
    if num_tokens * top_k == 0:
        return jnp.full((num_tokens, top_k), -1, jnp.int32), jnp.zeros((num_physical,), jnp.int32)
    limits = _limits(num_valid_tokens, record, num_tokens, top_k)
    if mode == "shares":  # the alias table, integer work: built by each implementation (or prepared)
        mode_values = jnp.asarray(mode_values).astype(jnp.float32)  # converted once, for every implementation
        thresholds = _alias.alias_words(mode_values, log2phy, logcnt) if implementation == "xla" else None
    elif mode == "resolved":
        thresholds = _build_thresholds(mode, jnp.asarray(mode_values), logcnt, width, limit=num_tokens * top_k)
    else:
        thresholds = jnp.zeros((num_logical, width), jnp.int32)  # unused by hash / round_robin

    if implementation == "xla":
        return _reference.map_and_count_reference(
            topk_ids, log2phy, logcnt, thresholds, limits, num_physical=num_physical, mode=mode
        )
    from moe_eplb_jax.pallas import _triton  # imported lazily: pulls in Pallas

    # resolved: the raw quotas too, from which the kernels build what they read (so under jit the thresholds'
    # product above is dead code there).
    return _triton.map_and_count_triton(
        topk_ids,
        log2phy,
        logcnt,
        thresholds,
        limits,
        num_physical=num_physical,
        mode=mode,
        interpret=jax.default_backend() != "gpu",
        lookup=lookup,
        quotas=mode_values if mode == "resolved" else None,
        shares=mode_values if mode == "shares" else None,
    )


def lookup_table(log2phy, logcnt, *, replica_shares=None, num_physical=None):
    """The Pallas kernel's lookup table of one placement layer, to pass as ``map_and_count(lookup=...)``.

    Args:
      log2phy: ``[E, S]`` integer replica slots (``-1`` padded), as for ``map_and_count``.
      logcnt: ``[E]`` integer replicas per logical expert.
      replica_shares: optional ``[E, S]`` float weights of ``mode="shares"``:
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
      alias table packed for the kernel after them (per expert its head word
      and bucket offset, then per live bucket its alias word and slot, or
      one word holding both).
      Placements (and a policy's replica shares) change only at
      rearrangement, so a model builds this then and keeps it. A table with
      the alias words serves every mode; one without them serves ``shares``
      too, the kernel then building the words per call.
    """
    (num_logical, width) = _check_placement(log2phy, logcnt)
    if replica_shares is not None:
        _check_shares(replica_shares, num_logical, width)
    if num_physical is not None:
        if replica_shares is None:
            raise ValueError("num_physical is only used with replica_shares (it sizes the alias table's slots)")
        num_physical = _check_num_physical(num_physical, num_logical)
    from moe_eplb_jax.pallas import _triton  # imported lazily: pulls in Pallas

    table = _triton.lookup_table(log2phy, logcnt)
    if replica_shares is None:
        return table
    # Once per placement: the jnp build (the words the Pallas kernel builds per call, bit for bit).
    log2phy, logcnt = jnp.asarray(log2phy, jnp.int32), jnp.asarray(logcnt, jnp.int32)
    words = _alias.alias_words(jnp.asarray(replica_shares).astype(jnp.float32), log2phy, logcnt)
    compact = num_physical is not None and _alias.compact_fits(num_physical)
    return jnp.concatenate([table, _alias.pack_words(words, log2phy, logcnt, compact=compact)])


# ------------------------------------------------------------------ validation
def _shape_dtype(value):
    """Shape and dtype without moving data (tracers, jax and numpy arrays all carry both)."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return tuple(value.shape), np.dtype(value.dtype)
    array = np.asarray(value)
    return array.shape, array.dtype


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


def _check_num_physical(num_physical, num_logical):
    try:
        num_physical = operator.index(num_physical)
    except TypeError:
        raise ValueError(f"num_physical must be a Python int, got {type(num_physical).__name__}") from None
    if num_physical < num_logical:
        raise ValueError(
            f"num_physical ({num_physical}) must be at least the number of logical experts ({num_logical})"
        )
    return num_physical


def _check_mode(mode, replica_shares, resolved, num_logical, width, num_physical):
    """Returns the per-mode ``[E, S]`` input (shares or quotas), or ``None`` for hash / round_robin."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode != "shares" and replica_shares is not None:
        raise ValueError(f"replica_shares is only used with mode='shares', got mode={mode!r}")
    if mode != "resolved" and resolved is not None:
        raise ValueError(f"resolved is only used with mode='resolved', got mode={mode!r}")
    if mode in ("hash", "round_robin"):
        return None
    if mode == "shares":
        if num_physical > _alias.MAX_SLOTS:
            raise ValueError(
                f"mode='shares' supports num_physical up to {_alias.MAX_SLOTS} (slots in 16 bits), got {num_physical}"
            )
        return _check_shares(replica_shares, num_logical, width)
    return _check_table_values("resolved", resolved, num_logical, width, mode, jnp.integer)


def _check_table_values(name, value, num_logical, width, mode, kind):
    """``replica_shares`` / ``resolved``: present, ``[E, S]``, of a ``kind`` dtype."""
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


def _check_shares(replica_shares, num_logical, width):
    _check_table_values("replica_shares", replica_shares, num_logical, width, "shares", jnp.floating)
    if width > _alias.MAX_WIDTH:
        raise ValueError(
            f"mode='shares' supports at most {_alias.MAX_WIDTH} replicas per expert (log2phy's S), got S = {width}"
        )
    return replica_shares


def _check_lookup(lookup, num_logical, width, num_physical):
    if lookup is None:
        return
    shape, dtype = _shape_dtype(lookup)
    plain = num_logical * (1 + width)  # the placement's own table; then shares' alias table in two layouts
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


def _check_implementation(implementation):
    if implementation is None:
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
    return implementation


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


def _limits(num_valid_tokens, record, num_tokens, top_k):
    """``[count_limit, rank_limit]``: flat positions below them are counted / consume quota."""
    if num_valid_tokens is None:
        num_valid = jnp.int32(num_tokens)
    else:
        num_valid = jnp.clip(jnp.asarray(num_valid_tokens).astype(jnp.int32), 0, num_tokens)
    rank_limit = num_valid * jnp.int32(top_k)
    count_limit = jnp.where(jnp.asarray(record), rank_limit, jnp.int32(0))
    return jnp.stack([count_limit, rank_limit])


# ------------------------------------------------------------- mode tables
def _build_mode_table(mode, values, log2phy, logcnt, *, limit=None):
    """The ``[E, S]`` table ``shares`` / ``resolved`` read as the jnp implementation builds it (tests,
    benchmarks): the alias words (:func:`._alias.alias_words`) or the quota thresholds
    (:func:`_build_thresholds`)."""
    if mode == "shares":
        return _alias.alias_words(values, log2phy, logcnt)
    return _build_thresholds(mode, values, logcnt, log2phy.shape[1], limit=limit)


def _build_thresholds(mode, values, logcnt, width, *, limit=None, sums=None):
    """The ``[E, S]`` int32 non-decreasing thresholds of ``resolved``: the running sums of its quotas.

    ``mode`` must be ``"resolved"`` (``shares`` reads its alias words). Entries at or
    beyond ``logcnt[e]`` are ``int32 max`` so no point passes them. Computed
    once here, so every implementation compares the same integers. Built
    expert-major from ``values [E, S]`` as it lies (no transposed copy of it
    or of the result; the Pallas kernel reads them so by default, option
    ``threshold_layout``). The quotas and their sums are capped at ``limit``
    (the number of entries, a static int; ``None``: no cap), which changes no
    result -- every rank is below it.

    ``sums`` (a benchmark knob) says how the prefix sums along each row run:
    ``"matmul"`` (default: one float32 product with an upper-triangular
    ``[S, S]`` matrix -- at ``S = 257`` on an H200 2-3 us against 9 us for
    XLA's reduce-window ``jnp.cumsum``; quotas go in as they are where
    ``limit < 2**24`` (every input of fewer than ``2**24`` entries), else as
    two or three 11-bit limbs whose sums stay below ``2**24``; exact either
    way; rows wider than ``_MAX_MATMUL_WIDTH`` use ``jnp.cumsum``) or
    ``"cumsum"`` (``jnp.cumsum``).
    """
    if mode != "resolved":
        raise ValueError(f"thresholds are resolved's; got mode={mode!r} (shares reads its alias words)")
    sums = _THRESHOLD_SUMS if sums is None else sums
    if sums == "matmul" and width > _MAX_MATMUL_WIDTH:  # the [S, S] matrix grows as S**2
        sums = "cumsum"
    live = jnp.arange(width, dtype=jnp.int32)[None, :] < logcnt[:, None]  # [E, S]
    cap = _NEVER if limit is None else int(min(limit, _NEVER))
    quotas = jnp.where(live, jnp.clip(values.astype(jnp.int32), 0, cap), 0)  # [E, S]
    return jnp.where(live, _quota_sums(quotas, cap, sums), jnp.int32(_NEVER))


_THRESHOLD_SUMS = "matmul"
_MAX_MATMUL_WIDTH = 4096
_LIMB_BITS = 11  # resolved's quotas as limbs (caps from 2**24): sums of up to 8192 limbs stay below 2**24 (exact)


def _prefix_sums(values, sums):
    """Inclusive prefix sums of ``values [R, S]`` along ``S`` (``[R, S]``)."""
    if sums == "matmul":
        width = values.shape[1]
        upper = (jnp.arange(width)[:, None] <= jnp.arange(width)[None, :]).astype(jnp.float32)
        return jnp.dot(
            values.astype(jnp.float32), upper, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
        )
    return jnp.cumsum(values, axis=1, dtype=values.dtype)


def _quota_sums(quotas, cap, sums):
    """``min(prefix sums of quotas [E, S] along S, cap)`` as ``[E, S]``, exact, for quotas in ``[0, cap]``."""
    num_logical, width = quotas.shape
    if sums == "matmul" and cap < 2**24:
        # One product of the quotas themselves: a float32 sum of non-negative integers is exact while the true
        # sum is below 2**24 (every partial sum is too), and a larger one rounds to >= 2**24 > cap, so the capped
        # result is exact (capped in float32 first: an uncapped sum may not fit int32).
        return jnp.minimum(_prefix_sums(quotas, sums), jnp.float32(cap)).astype(jnp.int32)
    if sums == "matmul" and width * cap < 2**31:  # exact limbs (width <= 4096 < 8192), int32 total
        # As few 11-bit limbs as the cap needs (at most 3).
        num_limbs = -(-cap.bit_length() // _LIMB_BITS)
        mask = (1 << _LIMB_BITS) - 1
        limbs = jnp.concatenate([(quotas >> (_LIMB_BITS * i)) & mask for i in range(num_limbs)], axis=0)
        limb_sums = _prefix_sums(limbs, sums).astype(jnp.int32)  # [num_limbs * E, S]: integers < 2**24
        total = sum(limb_sums[i * num_logical : (i + 1) * num_logical] << (_LIMB_BITS * i) for i in range(num_limbs))
        return jnp.minimum(total, cap)
    # Saturating sums, associative for values in [0, cap]: min(a + b, cap) without overflowing int32.
    return jax.lax.associative_scan(lambda a, b: jnp.minimum(a, cap - b) + b, quotas, axis=1)

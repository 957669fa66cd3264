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
  weights count as 0; rows need not be normalised). With ``W`` the row total and
  ``C_j = floor(2**24 * (w_0 + ... + w_j) / W)`` (float32 sums), the token's
  point ``v = h(t) >> 8`` (``u = v / 2**24`` uniform in ``[0, 1)``) picks the
  replica ``#{j < c : C_j <= v}``. A zero-weight replica is never chosen; a row
  with ``W = 0`` falls back to ``hash``.
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

from moe_eplb_jax.pallas import _reference

__all__ = ["map_and_count", "MODES", "IMPLEMENTATIONS"]

MODES = ("hash", "round_robin", "shares", "resolved")
IMPLEMENTATIONS = ("xla", "pallas")
_POINT_SCALE = 1 << 24  # shares: the hash's top 24 bits are the uniform point
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

    Returns:
      ``(physical_ids, load)``: ``[T, k]`` int32 slots (``-1`` for invalid
      ids) and ``[num_physical]`` int32 counts of valid, non-padding entries.

    Raises:
      ValueError: a shape, dtype, mode, size or implementation is wrong.
    """
    # Every check reads shapes and dtypes only: nothing moves to the device before they all pass.
    (num_tokens, top_k), (num_logical, width) = _check_tables(topk_ids, log2phy, logcnt)
    num_physical = _check_num_physical(num_physical, num_logical)
    mode_values = _check_mode(mode, replica_shares, resolved, num_logical, width)
    implementation = _check_implementation(implementation)
    _check_flags(num_valid_tokens, record, num_tokens)

    topk_ids, log2phy, logcnt = (jnp.asarray(a).astype(jnp.int32) for a in (topk_ids, log2phy, logcnt))
    if num_tokens * top_k == 0:
        return jnp.full((num_tokens, top_k), -1, jnp.int32), jnp.zeros((num_physical,), jnp.int32)
    limits = _limits(num_valid_tokens, record, num_tokens, top_k)
    if mode_values is not None:
        thresholds = _build_thresholds(mode, jnp.asarray(mode_values), logcnt, width)
    else:
        thresholds = jnp.zeros((num_logical, width), jnp.int32)  # unused by hash / round_robin

    if implementation == "xla":
        return _reference.map_and_count_reference(
            topk_ids, log2phy, logcnt, thresholds, limits, num_physical=num_physical, mode=mode
        )
    from moe_eplb_jax.pallas import _triton  # imported lazily: pulls in Pallas

    return _triton.map_and_count_triton(
        topk_ids, log2phy, logcnt, thresholds, limits,
        num_physical=num_physical, mode=mode, interpret=jax.default_backend() != "gpu",
    )


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
    table_shape = _check_int_array("log2phy", log2phy, 2)
    count_shape = _check_int_array("logcnt", logcnt, 1)
    num_logical, width = table_shape
    if num_logical < 1 or width < 1:
        raise ValueError(f"log2phy must have shape [E >= 1, S >= 1], got {table_shape}")
    if count_shape != (num_logical,):
        raise ValueError(f"logcnt must have shape [E] = ({num_logical},), got {count_shape}")
    if ids_shape[1] < 1:
        raise ValueError(f"topk_ids must have shape [T, k >= 1], got {ids_shape}")
    if ids_shape[0] * ids_shape[1] >= 2**31:
        raise ValueError(f"topk_ids has {ids_shape[0] * ids_shape[1]} entries; at most 2**31 - 1 are supported")
    return ids_shape, table_shape


def _check_num_physical(num_physical, num_logical):
    try:
        num_physical = operator.index(num_physical)
    except TypeError:
        raise ValueError(f"num_physical must be a Python int, got {type(num_physical).__name__}") from None
    if num_physical < num_logical:
        raise ValueError(f"num_physical ({num_physical}) must be at least the number of logical experts ({num_logical})")
    return num_physical


def _check_mode(mode, replica_shares, resolved, num_logical, width):
    """Returns the per-mode ``[E, S]`` input (shares or quotas), or ``None`` for hash / round_robin."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode != "shares" and replica_shares is not None:
        raise ValueError(f"replica_shares is only used with mode='shares', got mode={mode!r}")
    if mode != "resolved" and resolved is not None:
        raise ValueError(f"resolved is only used with mode='resolved', got mode={mode!r}")
    if mode in ("hash", "round_robin"):
        return None
    name, value, kind = (("replica_shares", replica_shares, jnp.floating) if mode == "shares"
                         else ("resolved", resolved, jnp.integer))
    if value is None:
        raise ValueError(f"mode={mode!r} needs {name} [E, S]")
    shape, dtype = _shape_dtype(value)
    if shape != (num_logical, width):
        raise ValueError(f"{name} must have shape [E, S] = {(num_logical, width)}, got {shape}")
    if not jnp.issubdtype(dtype, kind):
        raise ValueError(f"{name} must have {'a floating' if mode == 'shares' else 'an integer'} dtype, got {dtype}")
    return value


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
def _build_thresholds(mode, values, logcnt, width):
    """The ``[E, S]`` int32 non-decreasing thresholds of ``shares`` / ``resolved`` (module docstring).

    Entries at or beyond ``logcnt[e]`` are ``int32 max`` so no point passes them.
    Computed once here, so every implementation compares the same integers.
    """
    live = jnp.arange(width, dtype=jnp.int32)[None, :] < logcnt[:, None]
    if mode == "shares":
        weights = values.astype(jnp.float32)
        weights = jnp.where(live & jnp.isfinite(weights) & (weights > 0), weights, jnp.float32(0))
        cumulative = jnp.cumsum(weights, axis=1)
        total = cumulative[:, -1:]
        scaled = jnp.floor(cumulative / jnp.where(total > 0, total, jnp.float32(1)) * jnp.float32(_POINT_SCALE))
        thresholds = jnp.clip(scaled, 0, _POINT_SCALE).astype(jnp.int32)
        # A row of all-zero weights gets thresholds 0: every point passes all c of them -> hash.
    else:
        quotas = jnp.where(live, jnp.maximum(values.astype(jnp.int32), 0), 0)
        thresholds = jnp.cumsum(quotas, axis=1, dtype=jnp.int32)
    return jnp.where(live, thresholds, jnp.int32(_NEVER))

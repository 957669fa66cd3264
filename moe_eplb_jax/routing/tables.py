"""The per-placement tables of each L2 routing mode, solved when the placement changes.

A controller calls :func:`routing_tables` at every rearrangement (after the
new placement is decided, before it is installed) and hands each layer its
dict: ``layer.eplb_set_placement(phy2log, log2phy, logcnt, **tables[l])``;
:func:`stacked_routing_tables` is the same as ``[L, ...]`` arrays per name,
as ``moe_eplb_jax.control.Rearrangement`` carries them.

* a mode that reads shares (``RoutingMode.shares``: ``"lp"``):
  ``{"replica_shares": [E, S] float32}`` -- the shares minimising the largest
  rank load of the window's logical loads on the new placement
  (``lp_shares``); the layer routes by them until the next rearrangement.
  A layer with no load yet (a fresh start) gets equal shares.
* the others: ``{}`` -- nothing to solve (``quota`` plans every batch inside
  the forward pass).

:func:`mode_lookup` builds a layer's ``map_and_count`` lookup table for its
mode, once per placement.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from moe_eplb_jax.routing._map_and_count import lookup_table
from moe_eplb_jax.routing.lp import lp_shares
from moe_eplb_jax.routing.modes import RoutingMode, routing_mode

__all__ = ["equal_shares", "mode_lookup", "routing_tables", "stacked_routing_tables"]


def equal_shares(logcnt, width: int) -> np.ndarray:
    """``[..., E, S]`` float32 shares splitting each expert equally over its ``logcnt [..., E]`` replicas."""
    logcnt = np.asarray(logcnt)
    live = np.arange(width) < logcnt[..., None]
    return (live / np.maximum(logcnt[..., None], 1)).astype(np.float32)


@functools.lru_cache(maxsize=16)
def _solver(num_physical: int, num_ranks: int):
    solve = functools.partial(lp_shares, num_physical=num_physical, num_ranks=num_ranks)
    return jax.jit(jax.vmap(lambda load, log2phy, logcnt: solve(load, log2phy, logcnt)[0]))


def routing_tables(routing: str | RoutingMode, logical_load, placement, *, num_ranks: int) -> list[dict]:
    """Per layer, the tables ``routing`` reads, for ``eplb_set_placement(..., **tables[layer])``.

    Args:
      routing: a routing mode (a name of ``routing.ROUTING_MODES``).
      logical_load: ``[L, E]`` non-negative tokens per logical expert (e.g. the
        controller's window, summed over ranks and replicas).
      placement: the ``moe_eplb_jax.placement.Placement`` being installed
        (``log2phy [L, E, S]``, ``logcnt [L, E]``).
      num_ranks: ``G``, the EP size.

    Returns:
      ``[{"replica_shares": [E, S] float32 numpy}, ...]`` for a mode that reads
      shares (``"lp"``; equal shares, :func:`equal_shares`, for a layer whose
      load is all zero), a list of ``L`` empty dicts otherwise.
    """
    mode = routing_mode(routing)
    log2phy, logcnt = np.asarray(placement.log2phy), np.asarray(placement.logcnt)
    num_layers, num_logical = logcnt.shape
    num_physical = int(np.asarray(placement.phy2log).shape[1])
    load = np.asarray(logical_load)
    if load.shape != (num_layers, num_logical):
        raise ValueError(f"logical_load must have shape [L, E] = ({num_layers}, {num_logical}), got {load.shape}")
    if load.dtype.kind not in "iuf":
        raise ValueError(f"logical_load must hold numbers, got dtype {load.dtype}")
    if not np.all(np.isfinite(load)) or np.any(load < 0):
        raise ValueError("logical_load must be finite and non-negative")
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, (int, np.integer)) or num_ranks < 1:
        raise ValueError(f"num_ranks must be a positive integer, got {num_ranks!r}")
    if num_physical % num_ranks:
        raise ValueError(f"num_ranks ({num_ranks}) must divide the placement's P = {num_physical} slots")
    if not mode.shares:
        return [{} for _ in range(num_layers)]
    shares = equal_shares(logcnt, log2phy.shape[2])
    busy = np.any(load > 0, axis=1)  # a layer with no load has nothing to balance: equal shares
    if busy.any():
        solved = _solver(num_physical, int(num_ranks))(
            jnp.asarray(load, jnp.float32), jnp.asarray(log2phy, jnp.int32), jnp.asarray(logcnt, jnp.int32)
        )
        shares[busy] = np.asarray(solved, np.float32)[busy]
    return [{"replica_shares": layer} for layer in shares]


def stacked_routing_tables(
    routing: str | RoutingMode, logical_load, placement, *, num_ranks: int
) -> dict[str, np.ndarray]:
    """:func:`routing_tables` stacked over the layers: table name -> ``[L, ...]`` numpy array (``{}`` when the mode
    has no tables). An all-zero ``logical_load`` gives a fresh start's tables (equal shares for ``"lp"``)."""
    per_layer = routing_tables(routing, logical_load, placement, num_ranks=num_ranks)
    return {name: np.stack([tables[name] for tables in per_layer]) for name in per_layer[0]}


def mode_lookup(routing: str | RoutingMode, log2phy, logcnt, *, replica_shares=None, num_physical: int) -> np.ndarray:
    """One layer's ``map_and_count`` lookup table for ``routing``, built once per placement (numpy int32).

    For a mode that reads shares it carries their alias table too (``replica_shares [E, S]``; ``None``: equal
    shares), so the Pallas kernel builds none per call; for the others the placement's table alone.
    """
    log2phy, logcnt = np.asarray(log2phy, np.int32), np.asarray(logcnt, np.int32)
    if not routing_mode(routing).shares:
        return np.asarray(lookup_table(log2phy, logcnt))
    shares = equal_shares(logcnt, log2phy.shape[1]) if replica_shares is None else np.asarray(replica_shares)
    return np.asarray(lookup_table(log2phy, logcnt, replica_shares=shares, num_physical=num_physical))

"""The protocol a Flax NNX MoE module implements to be balanced by EPLB.

A module is an EPLB MoE layer when it has these five methods (checked with
``isinstance(module, EplbMoE)``; no base class needed):

* ``eplb_num_logical_experts() -> int`` -- ``E``, what the router picks from;
* ``eplb_expert_variables() -> Mapping[str, nnx.Variable]`` -- every
  per-expert variable (weights, quantisation scales, ...), each with a leading
  physical-slot axis ``[P, ...]`` sharded over the EP mesh axis. Everything
  derived from per-expert state must live here (nothing cached elsewhere), so
  that moving these moves the expert;
* ``eplb_load_variable() -> nnx.Variable`` -- int32 tokens the layer routed
  to each slot since the controller last reset it (padding excluded); the
  layer adds to it in every forward pass. Either ``[G, P]``, row ``g`` counted
  on EP rank ``g`` and sharded over the EP axis (no collective in the step:
  the controller sums the rows when it reads its window), or ``[P]`` already
  summed over the EP ranks;
* ``eplb_get_placement() -> (phy2log [P], log2phy [E, S], logcnt [E])`` -- the
  tables the layer routes with (``S = P - E + 1``);
* ``eplb_set_placement(phy2log, log2phy, logcnt, **routing_tables) -> None``
  -- the hook that receives new tables, called for a layer only once its
  expert bytes have arrived. Routing modes with tables of their own (e.g.
  LP replica shares, ``[E, S]``) pass them as keyword arguments; hash and
  round-robin routing pass none. The layer must read the tables as inputs of
  its compiled function (variables), never bake them in, so a new placement
  never recompiles. It may raise (before changing anything): the controller
  then rolls the whole rearrangement back.

Replica routing (``EplbConfig.routing``, optional): a layer's mode is its
``routing`` attribute (a layer without one is taken to route by
``"hash"``), and ``eplb_set_routing(mode) -> None`` switches it (static
configuration: the next call compiles once). The controller calls it at
construction on every layer whose mode differs from its config's; a layer
that differs and has no ``eplb_set_routing`` is refused with ``ValueError``,
as is, for ``"lp"``, an ``eplb_set_placement`` without a ``replica_shares``
keyword.

Elastic EP (``EplbController.resize``, optional): ``eplb_resize(mesh, phy2log, log2phy, logcnt,
**routing_tables) -> None`` moves the layer to ``mesh`` with ``P' = len(phy2log)`` slots -- its tables, its
load variable (zeros of the new shape) and whatever the layer keeps of the EP size. The controller calls it once
the expert variables hold their ``[P', ...]`` arrays on ``mesh`` and every other array of the model its
replicated one; it may raise (before changing anything), and the controller then puts every variable and
attribute back. A layer without it cannot be resized (``ValueError`` before anything changes).

``moe_eplb_jax.flax.MoELayer`` is the reference implementation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

__all__ = ["EplbMoE"]


@runtime_checkable
class EplbMoE(Protocol):
    def eplb_num_logical_experts(self) -> int: ...

    def eplb_expert_variables(self) -> Mapping[str, Any]: ...

    def eplb_load_variable(self) -> Any: ...

    def eplb_get_placement(self) -> tuple[Any, Any, Any]: ...

    def eplb_set_placement(self, phy2log, log2phy, logcnt, **routing_tables) -> None: ...

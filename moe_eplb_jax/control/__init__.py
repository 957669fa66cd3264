"""The EPLB control loop: record loads, decide a placement, move the experts atomically, checkpoint.

* ``Balancer`` -- the functional API over plain pytrees (params, optax state,
  ``BalanceState``): ``record_step`` inside the jitted step, ``rearrange`` /
  ``decide`` + ``advance`` outside it (``functional``);
* ``Rearrangement``, ``Mover``, ``ExpertStore``, ``RearrangementError`` --
  layer-by-layer moves that complete or roll back, with one layer's memory
  (``moves``); the NNX ``EplbController`` runs them on its model's variables;
* ``LoadWindow`` -- the per-rank load window on the mesh (``window``);
* ``checkpoint`` -- the EPLB state as a validated Orbax item.
"""

from moe_eplb_jax.control import checkpoint
from moe_eplb_jax.control.functional import (
    Balancer,
    BalanceState,
    ExpertLayout,
    RouteTables,
    check_slot_leaf,
    rehearsal_load,
    rehearsal_targets,
)
from moe_eplb_jax.control.moves import ExpertStore, Mover, Rearrangement, RearrangementError
from moe_eplb_jax.control.window import LoadWindow, close_step, host_value

__all__ = [
    "BalanceState",
    "Balancer",
    "ExpertLayout",
    "ExpertStore",
    "LoadWindow",
    "Mover",
    "Rearrangement",
    "RearrangementError",
    "RouteTables",
    "check_slot_leaf",
    "checkpoint",
    "close_step",
    "host_value",
    "rehearsal_load",
    "rehearsal_targets",
]

"""The EPLB control loop: record loads, decide a placement, move the experts atomically, checkpoint.

* ``ControlLoop`` -- the loop, written once (``loop``): record -> due -> decide
  -> move -> commit, warmup, load files and checkpoint items; ``Schedule`` its
  host counters. Two adapters run it: the NNX ``EplbController``
  (``moe_eplb_jax.flax``) and ``Balancer``;
* ``Balancer`` -- the functional API over plain pytrees (params, optax state,
  ``BalanceState``): ``record_step`` inside the jitted step, ``rearrange`` /
  ``decide`` + ``advance`` outside it (``functional``, ``pytrees``);
* ``Rearrangement``, ``Mover``, ``ExpertStore``, ``RearrangementError`` --
  layer-by-layer moves that complete or roll back, with one layer's memory
  (``moves``);
* ``ExpertSource``, ``ResizeStore`` -- moves to a mesh of another EP size
  (``ControlLoop.resized``; ``elastic``);
* ``LoadWindow`` -- the per-rank load window on the mesh; ``close_step`` / ``step_loads`` + ``close_steps`` for
  a caller's own jitted step or loop (``window``);
* ``checkpoint`` -- the EPLB state as a validated Orbax item.
"""

from moe_eplb_jax.control import checkpoint
from moe_eplb_jax.control.elastic import ExpertSource, ResizeStore
from moe_eplb_jax.control.functional import Balancer
from moe_eplb_jax.control.loop import (
    ControlLoop,
    Run,
    Schedule,
    check_slot_leaf,
    rehearsal_load,
    rehearsal_targets,
)
from moe_eplb_jax.control.moves import ExpertStore, Mover, Rearrangement, RearrangementError
from moe_eplb_jax.control.pytrees import BalanceState, ExpertLayout, PytreeStore, RouteTables
from moe_eplb_jax.control.window import LoadWindow, close_step, close_steps, host_value, step_loads

__all__ = [
    "BalanceState",
    "Balancer",
    "ControlLoop",
    "ExpertLayout",
    "ExpertSource",
    "ExpertStore",
    "LoadWindow",
    "Mover",
    "PytreeStore",
    "Rearrangement",
    "RearrangementError",
    "ResizeStore",
    "RouteTables",
    "Run",
    "Schedule",
    "check_slot_leaf",
    "checkpoint",
    "close_step",
    "close_steps",
    "host_value",
    "step_loads",
    "rehearsal_load",
    "rehearsal_targets",
]

"""The EPLB controller: wraps a Flax NNX MoE model, records loads, rebalances, moves experts atomically.

    controller = EplbController(model, mesh, config, optimizer=optimizer)
    controller.warmup()                          # compile the mover and readers before the run
    for batch in data:
        train_step(model, optimizer, batch)      # the MoE layers add their loads
        report = controller.step()               # record; rearrange when due

The NNX adapter of ``moe_eplb_jax.control.ControlLoop``: the model's expert
variables and optimizer moments are its ``ExpertStore`` (``flax.store``), the
layers' load variables its loads. A step with nothing due is one jitted window
update on the device (no host sync, no transfer); every
``config.rearrange_interval`` steps it decides a placement from the window and
moves each layer atomically (``RearrangementError`` after a rollback), all at
one step boundary or ``overlap`` per step; nothing recompiles when tables change
(they are variables). ``config.routing`` reaches every layer
(``eplb_set_routing`` at construction). ``checkpoint_item()`` /
``restore_item(item)`` are the EPLB state as an Orbax item
(``moe_eplb_jax.control.checkpoint``); ``dump_loads(path)`` writes the window
as a load file for ``moe-eplb fit``. ``resize(new_mesh)`` moves the whole
model to a mesh of another EP size (scale out, scale in, a lost rank).

Everything is validated when the controller is built and before any byte
moves: a model with no MoE layer, expert variables without a ``[P]`` slot axis
sharded over the EP axis, an EP size that does not divide ``P``, a placement
for another model shape -- each raises ``ValueError`` and leaves the model
untouched.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np
from flax import nnx

from moe_eplb_jax.config import EplbConfig
from moe_eplb_jax.control import ControlLoop, ExpertSource
from moe_eplb_jax.flax.store import ModuleStore
from moe_eplb_jax.placement import Placement, check_layer_ids
from moe_eplb_jax.policy.online import home_layout
from moe_eplb_jax.state import EplbState

__all__ = ["EplbController"]


class EplbController:
    """Keeps the experts of every MoE layer of ``model`` balanced over the EP axis of ``mesh``.

    Args:
      model: an ``nnx.Module`` holding one or more modules that implement
        :class:`~moe_eplb_jax.flax.EplbMoE` (found anywhere in the graph). All
        layers share ``E`` and ``P``.
      mesh: the device mesh; ``axis`` is its EP axis (``G`` ranks).
      config: ``EplbConfig``; ``num_redundant_experts`` must be ``P - E`` and
        ``num_gpus`` must be ``G``.
      optimizer: an ``nnx.Optimizer`` of ``model`` (training): its per-expert
        state (Adam moments, ...) moves with the parameters.
      placement: a ``Placement`` or a placement file (``.json`` / ``.npz``) to
        start from (the experts are moved to it now), e.g. one fitted earlier.
      rebalance: ``False`` holds the placement (serving with a fitted
        placement): loads are still recorded, nothing moves.
      overlap: how rearrangements spread their moves over steps (``None``,
        ``"layer"`` or bytes per step, see ``EplbConfig.overlap``); default
        ``config.overlap``.

    Routing (``config.routing``): every layer is switched to the mode now
    (``eplb_set_routing``; no rebuild, its next call compiles once). With
    ``"lp"`` the controller owns the layers' replica shares: equal shares now
    (no load is known yet), then at every rearrangement -- and in
    ``apply_placement`` -- the shares minimising the largest rank load of the
    window's logical loads on the new placement
    (``moe_eplb_jax.routing.routing_tables``), handed to each layer with its
    placement row when its bytes have arrived; a rollback hands back the old
    ones; checkpoint items carry them. With ``"quota"`` the layers plan
    every batch themselves, and each rearrangement (every
    ``config.rearrange_interval`` steps) is the ``"online"`` policy's
    refresh of the spare slots: home experts stay in their slots (the first
    refresh puts them there unless the model starts on the policy's
    layout), only spare slots whose expert changes move bytes.
    """

    def __init__(
        self,
        model,
        mesh: jax.sharding.Mesh,
        config: EplbConfig,
        *,
        axis: str = "ep",
        optimizer=None,
        placement: Placement | str | os.PathLike | None = None,
        rebalance: bool = True,
        overlap: str | int | None = None,
    ):
        if not isinstance(config, EplbConfig):
            raise ValueError(f"config must be an EplbConfig, got {type(config).__name__}")
        if overlap is not None:
            config = dataclasses.replace(config, overlap=overlap)  # validated as a config field
        if axis not in mesh.shape:
            raise ValueError(f"mesh has no axis {axis!r}; its axes are {tuple(mesh.shape)}")
        if optimizer is not None and not isinstance(optimizer, nnx.Optimizer):
            raise ValueError(f"optimizer must be an nnx.Optimizer of the model, got {type(optimizer).__name__}")
        self.model, self.mesh, self.axis, self.config = model, mesh, axis, config
        self.optimizer, self.rebalance = optimizer, bool(rebalance)
        self._store = store = ModuleStore.of(model, mesh, axis, optimizer)
        self.layers, self.num_ranks = store.layers, int(mesh.shape[axis])
        self.num_logical, self.num_physical = store.num_logical, store.num_physical
        if config.num_redundant_experts != self.num_physical - self.num_logical:
            raise ValueError(
                f"config.num_redundant_experts={config.num_redundant_experts} but the model has "
                f"P - E = {self.num_physical} - {self.num_logical} = {self.num_physical - self.num_logical}"
            )
        if config.num_gpus != self.num_ranks:
            raise ValueError(f"config.num_gpus={config.num_gpus} but mesh axis {axis!r} has {self.num_ranks} ranks")
        config.num_physical(self.num_logical)  # P divides into the ranks, E into the groups where hierarchical
        if config.policy in ("online", "quota"):
            home_layout(self.num_logical, self.num_physical, self.num_ranks)
        to_switch = store.layers_to_switch(config.routing)
        self.layer_ids, self.num_hidden_layers = _layer_ids(model, len(self.layers))
        start = None
        if placement is not None:
            start = (
                placement if isinstance(placement, Placement) else Placement.load(placement, layer_ids=self.layer_ids)
            )
        sizes = dict(num_layers=len(self.layers), num_logical=self.num_logical, num_physical=self.num_physical)
        self._loop = loop = ControlLoop(config, mesh, axis, **sizes)
        if start is not None:
            loop.check_placement(start)
        self._run = loop.fresh(store.placement(self.num_ranks))
        self._zero_loads = store.zero_loads(mesh)
        self.last_report: dict[str, Any] | None = None
        previous = [(ref.module, getattr(ref.module, "routing", "hash")) for ref in to_switch]
        try:  # every check passed: now the layers change, and go back to their modes if this fails
            for ref in to_switch:
                ref.module.eplb_set_routing(config.routing)
            if self._run.tables:
                loop.install(store, self._run.placement, self._run.tables)
            if start is not None:
                self.apply_placement(start)
        except BaseException:
            for module, routing in previous:
                module.eplb_set_routing(routing)
            raise

    # ------------------------------------------------------------------ views
    @property
    def state(self) -> EplbState:
        """The load window on the mesh; replaced at every step (read it anew after a step)."""
        return self._run.state

    @property
    def placement(self) -> Placement:
        """The placement every layer routes with now (during an overlapped move: moved layers on the new one)."""
        return self._run.current

    @property
    def routing_tables(self) -> dict[str, np.ndarray]:
        """The routing tables every layer routes with now, name -> ``[L, ...]`` (``"lp"``: ``replica_shares
        [L, E, S]``; ``{}`` for the modes without tables)."""
        return self._run.current_tables

    @property
    def rearranging(self) -> bool:
        """True while an overlapped rearrangement has layers left to move."""
        return self._run.moving is not None

    @property
    def total_steps(self) -> int:
        """Steps closed so far (a host mirror of ``state.total_steps``)."""
        return self._run.schedule.total_steps

    @property
    def num_rearrangements(self) -> int:
        return self._run.schedule.num_rearrangements

    def window_slot_load(self) -> np.ndarray:
        """``[L, P]`` tokens per slot summed over the load window and the EP ranks (under the current placement).

        float64 on the host, summed in float32 on the device (no int32 wrap; see ``state.window_slot_load``).
        """
        return self._loop.window_slot_load(self._run.state)

    # ------------------------------------------------------------------ steps
    def step(self) -> dict[str, Any] | None:
        """Closes one step: records every layer's load, rearranges (or moves the next layers) when due.

        Call it once per training / serving step on every process. Returns a
        report dict on steps that log (``config.log_interval``) or finish a
        rearrangement, else ``None``. With nothing due it is one jitted update
        on the device: no host sync, no transfer. While an overlapped
        rearrangement is in progress the step's loads are not recorded (they
        fall under a placement that is changing; the window restarts when it
        completes).
        """
        report = self._loop.close(self._run, self._store.take_loads(self._zero_loads))
        report = self._loop.advance(self._run, self._store, report, rebalance=self.rebalance)
        if report is not None:
            self.last_report = report
        return report

    def device_window(self) -> tuple[EplbState, jax.Array]:
        """``(state, dummy)`` for steps a caller closes on the device itself, several per host round trip.

        Inside its jitted loop, after each forward pass, the caller applies
        ``control.close_step(state, loads, dummy=dummy)`` to every layer's load of that pass (layer order of
        :attr:`layers`, each load variable left at zero) -- or keeps each pass's ``control.step_loads`` row and
        applies ``control.close_steps`` to them after the loop, the same state in one write -- then hands the new
        state to :meth:`steps_closed`.
        ``state`` may be donated: the controller holds nothing else of it until then.
        """
        return self._run.state, self._loop.window.dummy(self._run.moving is not None)

    def steps_closed(self, state: EplbState, num_steps: int) -> dict[str, Any] | None:
        """After ``num_steps`` steps closed on the device from :meth:`device_window`: counts them, then
        rearranges (or moves the next layers) when due, as :meth:`step` does. A rearrangement due partway
        through happens here, at the end of the caller's loop. ``num_steps=0`` only takes the state back (a
        caller that closed nothing, having donated it)."""
        if isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)) or num_steps < 0:
            raise ValueError(f"num_steps must be an integer >= 0, got {num_steps!r}")
        report = self._loop.closed_on_device(self._run, state, int(num_steps))
        # The caller left the load variables at zero; these zeros carry the layers' own shardings, so the caller's
        # next call sees the inputs of its first and does not compile again.
        self._store.take_loads(self._zero_loads)
        if num_steps == 0:
            return None
        report = self._loop.advance(self._run, self._store, report, rebalance=self.rebalance)
        if report is not None:
            self.last_report = report
        return report

    def rearrange(self) -> dict[str, Any]:
        """Rearranges now, all layers at once (or finishes the overlapped rearrangement in progress).

        Computes a placement from the load window, moves the experts to it,
        resets the window; returns the report (also logged).
        """
        return self._loop.rearrange(self._run, self._store)

    def apply_placement(self, placement: Placement) -> dict[str, Any]:
        """Moves every layer's experts (and optimizer state) to ``placement`` and hands the layers its tables.

        Validated before any byte moves; atomic (``RearrangementError`` after a
        rollback on failure). With ``"lp"`` routing the layers get the shares
        solved for ``placement`` from the window's loads. The load window and
        counters are left as they are. Returns the move's summary
        (``slots_moved``, ``bytes_moved``, ``move_seconds``, ...).
        """
        return self._loop.apply(self._run, self._store, placement)

    def resize(
        self, new_mesh: jax.sharding.Mesh, *, placement: Placement | None = None, num_physical: int | None = None,
        policy: str | None = None, lost_ranks=(), reload: ExpertSource | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Moves the model to ``new_mesh``, an EP group of another size: scale out, scale in, or go on without
        lost ranks. Call it on every process, at a step boundary.

        The placement for ``G'`` ranks is ``placement`` or, by default, the
        policy's (``policy``, default ``config.policy``; ``"fill"`` keeps every
        slot a staying device holds and fills only the rest) for the window's
        load from the current placement, with ``num_physical`` slots (default:
        the fewest that divide into ``G'`` and hold every slot now). Then every
        layer's experts and optimizer moments move there byte for byte, the
        rest of the model and optimizer (replicated) is placed on ``new_mesh``,
        every layer gets its mesh and tables (``eplb_resize``), the load
        window keeps each step's logical load, and ``config`` becomes
        ``num_gpus = G'``, ``num_redundant_experts = P' - E``. ``lost_ranks``
        (ranks of the current mesh whose devices are gone) are never read: their
        experts come from surviving replicas, or from ``reload``
        (:meth:`expert_source` of a checkpoint), else a ``ValueError`` names
        them. Every check runs before anything changes; a failure later leaves
        the model exactly as it was (``RearrangementError``). The layers'
        loads since the last ``step()`` are dropped. The model's next call
        compiles once for the new mesh. Returns the report (``slots_kept``,
        ``rows_moved``, ``rows_reloaded``, ``bytes_moved``, balancedness).
        """
        options = dict(placement=placement, num_physical=num_physical, policy=policy, lost_ranks=lost_ranks)
        loop, report = self._loop.resize(self._run, self._store, new_mesh, reload=reload, **options)
        self._loop, self.mesh, self.config = loop, new_mesh, loop.config
        self.num_ranks, self.num_physical = loop.num_ranks, loop.num_physical
        self._zero_loads = self._store.zero_loads(new_mesh)
        self.last_report = report
        return report

    @staticmethod
    def expert_source(model, placement: Placement, *, optimizer=None) -> ExpertSource:
        """Experts to reload in :meth:`resize` from ``model`` (and ``optimizer``): a model of the same architecture
        holding a checkpoint (host arrays or this process's devices) whose slots follow ``placement``."""
        if not isinstance(placement, Placement):
            raise ValueError(f"placement must be a Placement, got {type(placement).__name__}")
        store = ModuleStore.of(model, None, "ep", optimizer)
        sizes = (len(store.layers), store.num_logical, store.num_physical)
        if sizes != (placement.num_layers, placement.num_logical, placement.num_physical):
            raise ValueError(
                f"the checkpoint model has (L, E, P) = {sizes}, its placement "
                f"{(placement.num_layers, placement.num_logical, placement.num_physical)}"
            )
        return ExpertSource(store.read, placement.to_numpy())

    def warmup(self, load=None) -> dict[str, Any]:
        """Compiles what a rearrangement runs -- the mover, the window readers, the tables' switch -- moving nothing.

        Plans the moves to the policy's placements for ``load`` (``[L, E]``;
        default: four skewed synthetic loads, ``control.rehearsal_load``),
        pads every later plan to their largest send capacity, runs these moves
        without keeping their results (one layer's memory at a time), reads
        the window, and hands every layer its current tables again. A later
        plan that needs more capacity, or an executor variant none of these
        needed (a longer chain of moves), still compiles once. It compiles the
        step's window update too, and every routing mode's table update (the
        ``"lp"`` shares' solve and the layers' lookup tables). Call it on
        every process before the run. Returns ``seconds``, the mover's
        ``send_capacity`` and the number of ``moves`` rehearsed.
        """
        current, tables = self.placement, self.routing_tables
        switch = lambda *_: self._loop.install(self._store, current, tables)
        return self._loop.warmup(self._store, self._run.state, current, load, switch, loads=self._zero_loads)

    # -------------------------------------------------------- files and state
    def save_placement(self, path, *, format: str = "moe_eplb_jax") -> None:
        """Writes the current placement (``.json`` / ``.npz``), e.g. to serve with it later.

        ``format="sglang"``: SGLang's expert-location JSON, a row per decoder
        block when the model says which blocks are MoE (``eplb_layer_ids``).
        """
        rows = {"layer_ids": self.layer_ids, "num_hidden_layers": self.num_hidden_layers} if format == "sglang" else {}
        self.placement.save(path, format=format, **rows)

    def dump_loads(self, path) -> None:
        """Writes the window's per-step logical loads ``[steps, L, E]`` as a load file (``moe-eplb fit`` reads it).

        The loads are summed over the EP ranks and mapped to logical experts
        through the placement they were recorded under.
        """
        run = self._run
        recorded_under = run.moving.old if run.moving is not None else run.placement
        rows = {"layer_ids": self.layer_ids, "num_hidden_layers": self.num_hidden_layers} if self.layer_ids else {}
        self._loop.dump_loads(run.state, recorded_under, path, **rows)

    def checkpoint_item(self) -> dict[str, np.ndarray]:
        """The EPLB state as an Orbax item (host numpy arrays; see ``moe_eplb_jax.control.checkpoint``).

        During an overlapped rearrangement the item holds the placement the
        layers route with now and drops the moved layers' window rows (they
        were recorded under those layers' old placement).
        """
        return self._loop.checkpoint_item(self._run)

    def restore_item(self, item) -> None:
        """Restores :meth:`checkpoint_item` output: the state, and the tables the layers route with.

        Every field is validated first (``ValueError`` naming it; nothing
        changes then). The model's expert variables must come from the
        checkpoint saved with it (they already follow that placement): nothing
        moves here. With ``"lp"`` routing the layers get the item's replica
        shares (the ones the saved run routed with). An overlapped
        rearrangement in progress is dropped.
        """
        self._loop.restore(self._run, self._store, item)


def _layer_ids(model, num_layers: int) -> tuple[tuple[int, ...] | None, int | None]:
    """The decoder block of each MoE layer and the number of blocks, where the model says (``eplb_layer_ids``)."""
    found = getattr(model, "eplb_layer_ids", None)
    if found is None:
        return None, None
    layer_ids, num_hidden_layers = found
    check_layer_ids(layer_ids, num_layers, num_hidden_layers)
    return tuple(int(i) for i in layer_ids), int(num_hidden_layers)

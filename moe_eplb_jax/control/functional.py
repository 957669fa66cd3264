"""EPLB over plain pytrees: params, optax state and a ``BalanceState``, for a functional (Linen/MaxText-style) step.

Record inside the jitted step, decide and move outside it::

    layout = ExpertLayout.match(params, r"layers/(\\d+)/experts/")   # which leaves are per-expert, per layer
    balancer = Balancer(config, mesh, layout)
    balance = balancer.init(params)          # load window (per-rank rows) + route tables [L, ...]
    schedule = balancer.schedule(balance)    # the step counters on the host: no device read per step

    @jax.jit
    def train_step(params, opt_state, balance, batch):
        t = balance.tables                  # layer l: moe_apply(..., t.log2phy[l], t.logcnt[l], lookup=t.lookup[l],
        ...                                 #   routing=config.routing, replica_shares=t.replica_shares[l])
        balance = balancer.record_step(balance, loads)   # loads: per layer [G, P] from moe_apply
        return params, opt_state, balance, loss

    for batch in data:
        params, opt_state, balance, loss = train_step(params, opt_state, balance, batch)
        schedule.tick()
        if schedule.due:
            params, opt_state, balance, report = balancer.rearrange(params, opt_state, balance)
            schedule.rearranged()

The pure adapter of ``moe_eplb_jax.control.ControlLoop``: its store is the
flattened pytrees (``pytrees.PytreeStore``). ``rearrange`` moves every
layer's experts and their optimizer moments (the optimizer-state leaves whose
path ends with an expert leaf's path) at one step boundary; with
``config.overlap`` set, ``decide`` then ``advance`` once per step moves a layer
(or a byte budget) at a time instead, each layer switching tables with its
bytes. ``config.routing`` is honoured: ``"lp"`` shares are solved from the
window at every rearrangement and switch with each layer's placement row;
``"quota"`` rearrangements are the ``"online"`` policy's spare-slot refreshes.
Moves are atomic (``control.moves``): on failure the inputs are untouched, and
``RearrangementError.restored`` holds ``(params, opt_state, balance)`` on the
old placement. Extra memory: the new copies of the layers moved in one call,
as long as the caller still holds its inputs (``advance`` keeps that to one
layer or the byte budget). ``resize`` moves everything to a mesh of another
EP size and returns a balancer for it::

    balancer, params, opt_state, balance, report = balancer.resize(params, opt_state, balance, new_mesh)
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np

from moe_eplb_jax.config import EplbConfig
from moe_eplb_jax.control.elastic import ExpertSource
from moe_eplb_jax.control.loop import ControlLoop, Schedule
from moe_eplb_jax.control.moves import Mover, Rearrangement, RearrangementError
from moe_eplb_jax.control.pytrees import BalanceState, ExpertLayout, PytreeStore, RouteTables
from moe_eplb_jax.control.window import LoadWindow, close_step, host_value
from moe_eplb_jax.placement import Placement

__all__ = ["Balancer"]


class Balancer:
    """The functional EPLB API for ``config`` on the EP axis ``axis`` of ``mesh`` (see the module docstring).

    Args:
      config: ``EplbConfig``; ``num_gpus`` must be the EP size. The train
        step routes with ``moe_apply(..., routing=config.routing)``; for
        ``"lp"`` it also passes ``replica_shares=balance.tables.replica_shares[l]``,
        which every rearrangement solves from the window's loads and
        installs with the layer's placement row. For ``"quota"`` the
        rearrangements are the ``"online"`` policy's spare-slot refreshes
        every ``config.rearrange_interval`` steps.
      mesh: the device mesh.
      layout: :class:`ExpertLayout`, which params leaves are each layer's experts.
      axis: the EP axis of ``mesh``.

    The methods are pure in the pytrees they take (they return new ones);
    the balancer itself only caches jitted functions and the mover's padded
    capacity (host state, the same on every process).
    """

    def __init__(self, config: EplbConfig, mesh: jax.sharding.Mesh, layout: ExpertLayout, *, axis: str = "ep"):
        if not isinstance(config, EplbConfig):
            raise ValueError(f"config must be an EplbConfig, got {type(config).__name__}")
        if axis not in mesh.shape:
            raise ValueError(f"mesh has no axis {axis!r}; its axes are {tuple(mesh.shape)}")
        if not isinstance(layout, ExpertLayout):
            raise ValueError(f"layout must be an ExpertLayout, got {type(layout).__name__}")
        if config.num_gpus != int(mesh.shape[axis]):
            raise ValueError(f"config.num_gpus={config.num_gpus} but mesh axis {axis!r} has {mesh.shape[axis]} ranks")
        self.config, self.mesh, self.layout, self.axis = config, mesh, layout, axis
        self.num_layers, self.num_ranks = len(layout.layers), int(mesh.shape[axis])
        self.num_physical = self.num_logical = 0
        self._loop: ControlLoop | None = None  # built when the first params show P

    @property
    def window(self) -> LoadWindow | None:
        return self._loop.window if self._loop is not None else None

    @property
    def mover(self) -> Mover | None:
        return self._loop.mover if self._loop is not None else None

    def _positions(self, params, opt_state) -> list:
        """Where each layer's expert leaves (and their optimizer mirrors) are, every leaf checked; fixes ``P`` (and
        builds the loop) at first use."""
        positions, num_physical = PytreeStore.positions_of(
            params, opt_state, self.layout, mesh=self.mesh, axis=self.axis
        )
        if self._loop is not None:
            if num_physical != self.num_physical:
                raise ValueError(f"expert leaves have P={num_physical} slots, this balancer P={self.num_physical}")
            return positions
        num_logical = num_physical - self.config.num_redundant_experts
        if num_logical < 1:
            raise ValueError(
                f"P={num_physical} slots leave no logical expert with num_redundant_experts="
                f"{self.config.num_redundant_experts}"
            )
        self.config.num_physical(num_logical)  # divisibility by the EP size and the expert groups
        self.num_physical, self.num_logical = num_physical, num_logical
        sizes = dict(num_layers=self.num_layers, num_logical=num_logical, num_physical=num_physical)
        self._loop = ControlLoop(self.config, self.mesh, self.axis, **sizes)
        return positions

    def _store(self, params, opt_state, placement: Placement, tables) -> PytreeStore:
        return PytreeStore(params, opt_state, placement, tables, self._positions(params, opt_state), self.mesh)

    def _ready(self) -> ControlLoop:
        if self._loop is None:
            raise ValueError("the balancer has not seen its params yet: call init(params) first")
        return self._loop

    def init(self, params, *, placement: Placement | None = None) -> BalanceState:
        """A fresh state for ``params``, whose experts are on ``placement`` (default: linear, slot ``p`` holds ``p mod E``).

        No load is known yet: ``"lp"`` starts from equal replica shares.
        """
        self._positions(params, ())
        loop = self._ready()
        if placement is None:
            placement = Placement.linear(self.num_layers, self.num_logical, self.num_physical)
        loop.check_placement(placement)
        return BalanceState(loop.window.fresh(), self._tables(placement))

    def _tables(self, placement: Placement, replica_shares=None) -> RouteTables:
        return RouteTables.build(placement, self.mesh, routing=self.config.routing, replica_shares=replica_shares)

    # ------------------------------------------------------------------ steps
    @staticmethod
    def record_step(balance: BalanceState, loads, *, dummy=False) -> BalanceState:
        """Records one step's loads (one ``[G, P]`` or ``[P]`` per layer) and closes the step; call it in the jitted step.

        ``dummy`` (may be traced) advances the counters without recording, e.g.
        on a step whose loads must not count. No collective: each rank writes
        its own rows.
        """
        return dataclasses.replace(balance, loads=close_step(balance.loads, loads, dummy=dummy))

    def schedule(self, balance: BalanceState) -> Schedule:
        """The step counters of ``balance`` on the host (one device read): ``tick()`` it once per step and ask
        ``due`` without reading the device; ``rearranged()`` when a rearrangement completes."""
        return Schedule.read(self.config, balance.loads)

    def is_due(self, balance: BalanceState) -> bool:
        """Whether a rearrangement is due (reads two counters from the device: a sync; see :meth:`schedule`)."""
        return self.schedule(balance).due

    def window_slot_load(self, balance: BalanceState) -> np.ndarray:
        """``[L, P]`` tokens per slot summed over the load window and the EP ranks (under the current placement).

        float64 on the host, summed in float32 on the device (no int32 wrap; see ``state.window_slot_load``).
        """
        return self._ready().window_slot_load(balance.loads)

    # ------------------------------------------------------------------ moves
    def decide(self, balance: BalanceState, *, placement: Placement | None = None) -> Rearrangement:
        """The rearrangement from the current placement to ``placement`` or, by default, the policy's for the window.

        It carries the routing tables of both sides (``"lp"``: the current
        shares, and the shares solved for the new placement from the window's
        logical loads), each layer switching to its new row with its bytes.
        """
        current, tables = balance.tables.placement(), balance.tables.host_tables(self.config.routing)
        return self._ready().decide(balance.loads, current, tables, placement=placement)

    def rearrange(self, params, opt_state, balance: BalanceState, *, placement: Placement | None = None):
        """Decides and moves every layer now: ``(params, opt_state, balance, report)``.

        ``report``: ``rearranged``, the balancedness of the window's load before
        and (predicted) after, and :meth:`Rearrangement.summary` (slots and
        bytes moved, seconds, GB/s).
        """
        move = self.decide(balance, placement=placement)
        params, opt_state, balance, move = self._move(params, opt_state, balance, move, at_once=True)
        return params, opt_state, *self._commit(balance, move)

    def advance(self, params, opt_state, balance: BalanceState, rearrangement: Rearrangement):
        """Moves the next layer (``config.overlap="layer"``), the next byte budget (an int) or every pending layer.

        Returns ``(params, opt_state, balance, rearrangement, report)``:
        ``report`` is ``None`` until the last layer has moved, then as for
        :meth:`rearrange` (the window is reset then). Each moved layer's tables
        switch with its bytes, so the model is consistent after every call.
        """
        params, opt_state, balance, move = self._move(params, opt_state, balance, rearrangement, at_once=False)
        if not move.done:
            return params, opt_state, balance, move, None
        balance, report = self._commit(balance, move)
        return params, opt_state, balance, move, report

    def _move(self, params, opt_state, balance, move: Rearrangement, *, at_once: bool):
        store = self._store(params, opt_state, move.current, move.current_tables)
        try:
            move = self._ready().move(store, move, at_once=at_once)
        except RearrangementError as error:
            restored = (*store.pytrees(), dataclasses.replace(balance, tables=self._updated(balance, store)))
            raise RearrangementError(str(error), restored) from error.__cause__
        return *store.pytrees(), dataclasses.replace(balance, tables=self._updated(balance, store)), move

    def _updated(self, balance: BalanceState, store: PytreeStore) -> RouteTables:
        shares = store.routing_tables.get("replica_shares")
        return balance.tables.updated(store.placement(), self.mesh, routing=self.config.routing, replica_shares=shares)

    def _commit(self, balance: BalanceState, move: Rearrangement) -> tuple[BalanceState, dict]:
        loads, report = self._ready().commit(balance.loads, move)
        return dataclasses.replace(balance, loads=loads), report

    # ----------------------------------------------------------------- resize
    def resize(
        self, params, opt_state, balance: BalanceState, new_mesh: jax.sharding.Mesh, *,
        placement: Placement | None = None, num_physical: int | None = None, policy: str | None = None,
        lost_ranks=(), reload: ExpertSource | None = None,
    ):  # fmt: skip
        """Moves everything to ``new_mesh``, an EP group of another size: ``(balancer, params, opt_state, balance,
        report)``, the balancer the one for ``new_mesh`` (this one stays valid for the inputs).

        As ``EplbController.resize``: the placement for ``G'`` ranks (default:
        the policy's for the window's load, keeping what each staying device
        holds), every layer's expert leaves and their optimizer mirrors moved
        byte for byte, every other leaf on the mesh (replicated) placed on
        ``new_mesh``, the window carried over, the route tables rebuilt;
        ``lost_ranks`` never read (experts only they held come from
        ``reload``, :meth:`expert_source`, else ``ValueError`` naming them).
        The inputs are never changed: on ``RearrangementError`` its
        ``restored`` holds them. The train step must route on ``new_mesh``
        (``moe_apply(mesh=...)``) and compiles once for it.
        """
        loop = self._ready()
        current = balance.tables.placement()
        store = self._store(params, opt_state, current, balance.tables.host_tables(self.config.routing))
        options = dict(placement=placement, num_physical=num_physical, policy=policy, lost_ranks=lost_ranks)
        try:
            new_loop, loads, new, tables, report = loop.resized(store, balance.loads, current, new_mesh, **options,
                                                                reload=reload)  # fmt: skip
            shares = tables.get("replica_shares")
            routes = RouteTables.build(new, new_mesh, routing=self.config.routing, replica_shares=shares)
        except RearrangementError as error:
            raise RearrangementError(str(error), (params, opt_state, balance)) from error.__cause__
        balancer = Balancer(new_loop.config, new_mesh, self.layout, axis=self.axis)
        balancer._loop, balancer.num_logical, balancer.num_physical = new_loop, self.num_logical, new.num_physical
        return balancer, *store.pytrees(), BalanceState(loads, routes), report

    def expert_source(self, params, opt_state, placement: Placement) -> ExpertSource:
        """Experts to reload in :meth:`resize` from a checkpoint's ``params`` / ``opt_state`` (host arrays or this
        process's devices, the same structure as the live ones) whose slots follow ``placement``."""
        if not isinstance(placement, Placement):
            raise ValueError(f"placement must be a Placement, got {type(placement).__name__}")
        placement = placement.to_numpy()
        positions, num_physical = PytreeStore.positions_of(params, opt_state, self.layout, mesh=None, axis=self.axis)
        if num_physical != placement.num_physical or len(positions) != placement.num_layers:
            raise ValueError(
                f"the checkpoint has {len(positions)} layers of P={num_physical} slots, its placement "
                f"{placement.num_layers} layers of P={placement.num_physical}"
            )
        store = PytreeStore(params, opt_state, placement, {}, positions)
        return ExpertSource(store.read, placement)

    def warmup(self, params, opt_state, balance: BalanceState, *, load=None) -> dict[str, Any]:
        """Compiles the mover and the readers a rearrangement uses, moving nothing.

        Plans the moves to the policy's placements for ``load`` (``[L, E]``;
        default: four ``rehearsal_load`` s), pads every later plan to
        their largest send capacity, runs these moves without keeping their
        results, and runs the window readers and the route-table build once.
        Returns ``seconds`` and the mover's ``send_capacity``.
        """
        current = balance.tables.placement()
        store = self._store(params, opt_state, current, balance.tables.host_tables(self.config.routing))

        def build(target, tables):  # what a rearrangement runs on the host: the lookup build
            shares = tables.get("replica_shares")
            balance.tables.updated(target, self.mesh, routing=self.config.routing, replica_shares=shares)

        return self._ready().warmup(store, balance.loads, current, load, build)

    # ------------------------------------------------------ files, checkpoints
    def dump_loads(self, balance: BalanceState, path: str | os.PathLike) -> None:
        """Writes the window's per-step logical loads ``[steps, L, E]`` as a load file ``moe-eplb fit`` reads."""
        self._ready().dump_loads(balance.loads, balance.tables.placement(), path)

    def checkpoint_item(self, balance: BalanceState) -> dict[str, np.ndarray]:
        """The Orbax item of ``balance`` (``moe_eplb_jax.control.checkpoint``)."""
        shares = np.asarray(host_value(balance.tables.replica_shares), np.float32)
        return self._ready().item(balance.loads, balance.tables.placement(), shares)

    def restore_item(self, item) -> BalanceState:
        """A ``BalanceState`` from a restored item, every field validated first (``ValueError`` naming it).

        The replica shares are the item's (the shares the saved run routed with).
        """
        snapshot, loads = self._ready().snapshot(item)
        return BalanceState(loads, self._tables(snapshot.placement, snapshot.replica_shares))

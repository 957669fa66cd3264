"""The EPLB control loop, written once: record -> due -> decide -> move -> commit, warmup, files, checkpoint items.

Two adapters run it: ``EplbController`` over an NNX model's variables and ``Balancer`` over plain pytrees. Each
supplies an ``ExpertStore`` (where every layer's per-expert pytree lives and how a layer takes its tables) and the
loads (the NNX layers' load variables, handed to :meth:`ControlLoop.close`; the functional step's
``Balancer.record_step`` inside its own jit). A step of the loop:

1. record: one jitted window update on the device (``LoadWindow.close``): no host sync, no transfer; the host
   keeps the counters (:class:`Schedule`) and reads the window only to decide, log, dump or checkpoint;
2. due: every ``config.rearrange_interval`` steps (the first after a quarter of it);
3. decide: the window's logical load ``[L, E]`` (the one all-reduce) -> the policy's placement -> the routing
   tables of the new placement (``"lp"``: shares solved from that load) -> a validated ``Rearrangement``;
4. move: layer by layer through the ``Mover``, atomic (any failure rolls every layer back, then
   ``RearrangementError``), all layers at one step boundary or ``config.overlap`` per step;
5. commit: the window restarts (``mark_rearranged``), the counters reset, the report is logged.

:meth:`ControlLoop.resized` moves the whole model to a mesh of another EP size (``control.elastic``): a new
placement from the current one and the window, every layer's experts and optimizer moments, the model's
replicated arrays, the window and the routing tables follow; the result is a loop on the new mesh.

A stateful adapter keeps a :class:`Run` (where the loop stands) and calls :meth:`ControlLoop.close` and
:meth:`ControlLoop.advance` per step; a pure one calls the phases with its own pytrees.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from moe_eplb_jax import metrics
from moe_eplb_jax._files import check_output_path
from moe_eplb_jax.config import EplbConfig
from moe_eplb_jax.control import checkpoint, elastic
from moe_eplb_jax.control.moves import ExpertStore, Mover, Rearrangement, RearrangementError, rollback_failed
from moe_eplb_jax.control.window import LoadWindow, host_value
from moe_eplb_jax.placement import Placement, check_placement_size
from moe_eplb_jax.policy import compute_placement
from moe_eplb_jax.routing import equal_shares, routing_mode, stacked_routing_tables
from moe_eplb_jax.sim.loadfile import save_load
from moe_eplb_jax.state import EplbState
from moe_eplb_jax.transport import replicate_to

__all__ = ["ControlLoop", "Run", "Schedule", "check_slot_leaf", "rehearsal_load", "rehearsal_targets"]

_log = logging.getLogger("moe_eplb_jax")


@dataclasses.dataclass
class Schedule:
    """The host's mirror of an ``EplbState``'s step counters: whether a rearrangement is due, read from no device.

    Every process closes every step (lock-step), so every host's mirror equals
    the device counters. ``steps``: since the last rearrangement.
    """

    config: EplbConfig
    steps: int = 0
    total_steps: int = 0
    num_rearrangements: int = 0

    @classmethod
    def read(cls, config: EplbConfig, state: EplbState) -> Schedule:
        """The counters of ``state`` (one read from the device: call it once, then :meth:`tick`)."""
        fields = ("step", "total_steps", "num_rearrangements")
        return cls(config, *(int(host_value(getattr(state, name))) for name in fields))

    def tick(self) -> None:
        """One step closed."""
        self.steps += 1
        self.total_steps += 1

    @property
    def due(self) -> bool:
        """Whether a rearrangement is due (``state.should_rearrange``)."""
        first = self.num_rearrangements == 0
        return self.steps >= (self.config.first_rearrangement_step if first else self.config.rearrange_interval)

    @property
    def logs(self) -> bool:
        """Whether this step logs the balance (``config.log_interval``)."""
        interval = self.config.log_interval
        return interval is not None and self.total_steps % interval == 0

    def rearranged(self) -> None:
        self.steps = 0
        self.num_rearrangements += 1


@dataclasses.dataclass
class Run:
    """Where a stateful adapter's loop stands.

    ``state``: the load window on the mesh (replaced at every step: the old
    one's arrays are donated to the update). ``placement`` / ``tables``: what
    the layers route with, or during an overlapped rearrangement (``moving``)
    what they routed with before it (:attr:`current` is what they route with
    now). ``tables``: routing table name -> ``[L, ...]`` (``{}`` but for ``"lp"``).
    """

    state: EplbState
    placement: Placement
    tables: dict[str, np.ndarray]
    schedule: Schedule
    moving: Rearrangement | None = None

    @property
    def current(self) -> Placement:
        return self.moving.current if self.moving is not None else self.placement

    @property
    def current_tables(self) -> dict[str, np.ndarray]:
        return self.moving.current_tables if self.moving is not None else dict(self.tables)


def check_slot_leaf(name: str, value, *, num_physical: int | None, mesh, axis: str) -> int:
    """``ValueError`` unless ``value`` is a ``jax.Array`` ``[P, ...]`` whose slot axis is sharded over ``axis``.

    Returns its ``P`` (which must equal ``num_physical`` when given). ``mesh=None``: any array ``[P, ...]``
    (host or device, e.g. a checkpoint's experts to reload from).
    """
    host = mesh is None and isinstance(value, np.ndarray)
    if not (host or isinstance(value, jax.Array)) or np.ndim(value) < 1:
        raise ValueError(f"expert leaf {name} must be a jax.Array with a leading slot axis [P, ...]")
    slots = int(np.shape(value)[0])
    if num_physical is not None and slots != num_physical:
        raise ValueError(f"expert leaf {name} has {slots} slots, its layers have P={num_physical}")
    if mesh is None or not isinstance(value, jax.Array):
        return slots
    spec = value.sharding.spec if isinstance(value.sharding, NamedSharding) else None
    first = spec[0] if spec is not None and len(spec) else None
    names = first if isinstance(first, tuple) else (first,)
    if int(mesh.shape[axis]) > 1 and axis not in names:
        raise ValueError(
            f"expert leaf {name} (shape {value.shape}) has no slot axis sharded over mesh axis {axis!r} "
            f"(sharding {value.sharding}); expected a leading [P, ...] axis with PartitionSpec({axis!r}, ...)"
        )
    return int(value.shape[0])


def rehearsal_load(num_layers: int, num_logical: int, seed: int = 0) -> np.ndarray:
    """``[L, E]`` a skewed synthetic load (Zipf 1.2 over a random expert order per layer) to rehearse with.

    The same on every process for one ``seed``: ``warmup`` plans moves to the
    placements of a few such loads to size and compile the mover before any
    real load is known.
    """
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, num_logical + 1) ** 1.2
    return np.stack([weights[rng.permutation(num_logical)] for _ in range(num_layers)]) * 1e4


def rehearsal_targets(config: EplbConfig, current: Placement, load=None) -> list[Placement]:
    """The placements ``warmup`` rehearses moves to: the policy's for ``load``, or for four rehearsal loads."""
    if load is not None:
        loads = [np.asarray(load, np.float64)]
    else:
        loads = [rehearsal_load(current.num_layers, current.num_logical, seed) for seed in range(4)]
    return [compute_placement(x, config, old_phy2log=current.phy2log) for x in loads]


class ControlLoop:
    """The loop for ``num_layers`` layers of ``num_logical`` experts in ``num_physical`` slots on ``axis`` of ``mesh``.

    Holds the jitted window updates (``window``) and the mover with its
    padded capacity (``mover``): host state, the same on every process. The
    phases take the window state, placement and tables they work on and
    return new ones; the stateful steps (:meth:`close`, :meth:`advance`,
    :meth:`rearrange`, :meth:`apply`, :meth:`restore`) update a :class:`Run`.
    """

    def __init__(
        self, config: EplbConfig, mesh: jax.sharding.Mesh, axis: str, *, num_layers: int, num_logical: int,
        num_physical: int,
    ):  # fmt: skip
        self.config, self.mesh, self.axis = config, mesh, axis
        self.num_ranks = int(mesh.shape[axis])
        sizes = check_placement_size(num_layers, num_logical, num_physical)
        self.num_layers, self.num_logical, self.num_physical = sizes
        self.window = LoadWindow(config, mesh, self.num_layers, self.num_physical, axis)
        self.mover = Mover(mesh, axis, self.num_logical, self.num_physical)

    def check_placement(self, placement: Placement) -> None:
        """``ValueError`` unless ``placement`` is a valid placement of this loop's ``(L, E, P)`` on its ranks."""
        want = (self.num_layers, self.num_logical, self.num_physical)
        got = (placement.num_layers, placement.num_logical, placement.num_physical)
        if got != want:
            raise ValueError(f"placement is for (L, E, P) = {got} but the model has (L, E, P) = {want}")
        placement.validate(num_ranks=self.num_ranks)

    def fresh(self, placement: Placement) -> Run:
        """A run on ``placement`` with an empty window and the tables of no load (``"lp"``: equal shares)."""
        return Run(self.window.fresh(), placement, self.tables_for(placement), Schedule(self.config))

    # ------------------------------------------------------------------ decide
    def tables_for(self, placement: Placement, logical=None) -> dict[str, np.ndarray]:
        """The routing tables of ``placement`` for the logical load ``[L, E]`` (``None``: no load yet)."""
        if logical is None:
            logical = np.zeros((self.num_layers, self.num_logical))
        return stacked_routing_tables(self.config.routing, logical, placement, num_ranks=self.num_ranks)

    def decide(self, state: EplbState, current: Placement, tables, *, placement=None) -> Rearrangement:
        """The rearrangement from ``current`` (routing by ``tables``) to ``placement`` or, by default, the
        policy's placement for the window's logical load; it carries both sides' routing tables."""
        logical = self.window.logical_load(state, current.phy2log, self.num_logical)
        if placement is None:
            placement = compute_placement(logical, self.config, old_phy2log=current.phy2log)
        self.check_placement(placement)
        return Rearrangement.between(
            current,
            placement,
            num_ranks=self.num_ranks,
            old_tables=tables,
            new_tables=self.tables_for(placement, logical),
            load=logical,
        )

    # -------------------------------------------------------------------- move
    def move(self, store: ExpertStore, move: Rearrangement, *, at_once: bool = False) -> Rearrangement:
        """Moves the next share of ``move``: every pending layer (``at_once`` or no ``config.overlap``; the tables
        switch once every byte has arrived), else one layer or a byte budget, each layer switching with its bytes.

        Atomic: any failure rolls every layer of ``move`` back and raises ``RearrangementError``.
        """
        overlap = self.config.overlap
        if at_once or overlap is None:
            return self.mover.run(store, move, move.pending, defer_switch=True)
        layers = move.pending[:1] if overlap == "layer" else move.pending
        return self.mover.run(store, move, layers, budget=overlap if isinstance(overlap, int) else None)

    def install(self, store: ExpertStore, placement: Placement, tables, *, previous=None) -> None:
        """Hands every layer its row of ``placement`` and ``tables``; on a failure the layers switched so far get
        ``previous`` (``(placement, tables)``) back, then the failure is raised."""
        switched = []
        try:
            for layer in range(self.num_layers):
                store.switch(layer, placement, tables)
                switched.append(layer)
        except BaseException:
            if previous is not None:
                for layer in switched:
                    store.switch(layer, *previous)
            raise

    # ------------------------------------------------------------------ commit
    def commit(self, state: EplbState, move: Rearrangement, schedule: Schedule | None = None):
        """A completed ``move``: the window restarted, the counters reset; returns ``(state, report)`` (logged)."""
        report: dict[str, Any] = {"rearranged": True}
        if schedule is not None:
            schedule.rearranged()
            report["num_rearrangements"] = schedule.num_rearrangements
        report.update(move.summary(self.num_ranks))
        _log.info(
            "EPLB rearrangement %s: balancedness %.4f -> %.4f, %d slots in %d layers moved, "
            "%.1f MB in %.3f s (%.2f GB/s)",
            report.get("num_rearrangements", ""),
            report.get("balancedness_before", float("nan")),
            report.get("balancedness_after", float("nan")),
            report["slots_moved"],
            report["layers_moved"],
            report["bytes_moved"] / 1e6,
            report["move_seconds"],
            report["gb_per_s"],
        )
        return self.window.mark_rearranged(state), report

    # ----------------------------------------------------------- stateful steps
    def close(self, run: Run, loads) -> dict[str, Any] | None:
        """Records one step's ``loads`` (one ``[G, P]`` or ``[P]`` per layer) and closes it; the balance report on
        steps that log. No host sync and no transfer otherwise: loads of steps while layers move are not
        recorded (they fall under a placement that is changing)."""
        run.state = self.window.close(run.state, loads, self.window.dummy(run.moving is not None))
        run.schedule.tick()
        if not run.schedule.logs:
            return None
        return self._balance_report(run, self.window.step_slot_load(loads))

    def closed_on_device(self, run: Run, state: EplbState, num_steps: int) -> dict[str, Any] | None:
        """Takes ``state``, the window after ``num_steps`` steps a caller closed on the device itself
        (:func:`close_step` in its own jitted loop, ``dummy`` from :meth:`LoadWindow.dummy` of ``run.moving``),
        and counts them on the host; the balance report of the last of them that logs (while its row is still in
        the window)."""
        # A caller's program writes the window's own shardings (``window.as_written``); one that wrote an
        # equivalent sharding another way gets the window's, so its jitted updates do not compile again.
        wanted = jax.tree.leaves(self.window.sharding)
        if all(leaf.sharding == want for leaf, want in zip(jax.tree.leaves(state), wanted, strict=True)):
            run.state = state
        else:
            run.state = jax.device_put(state, self.window.sharding)
        logged = None
        for _ in range(num_steps):
            run.schedule.tick()
            if run.schedule.logs:
                logged = run.schedule.total_steps
        if logged is None or run.moving is not None:
            return None
        back = run.schedule.total_steps - logged  # steps closed after the one that logs
        if back >= self.config.window_size:
            return None
        return self._balance_report(run, self.window.recent_slot_load(run.state, np.int32(back)), logged)

    def _balance_report(self, run: Run, step_slot_load, step: int | None = None) -> dict[str, Any]:
        """The balance of one step's ``[L, P]`` slot loads (of ``step``, default the last closed), logged."""
        ranks = metrics.rank_load(np.asarray(host_value(step_slot_load), np.float64), self.num_ranks)
        report = {
            "step": run.schedule.total_steps if step is None else step,
            "balancedness": float(metrics.balancedness(ranks)),
            "rank_imbalance": metrics.rank_imbalance(ranks).tolist(),
        }
        _log.info(
            "EPLB step %d: balancedness %.4f, max rank imbalance %.3f",
            report["step"],
            report["balancedness"],
            max(report["rank_imbalance"]),
        )
        return report

    def advance(self, run: Run, store: ExpertStore, report=None, *, rebalance: bool = True):
        """After :meth:`close`: moves the next share of the rearrangement in progress, or decides one when due.

        Returns ``report`` joined with the rearrangement's report when one completes.
        """
        if run.moving is None and not (rebalance and run.schedule.due):
            return report
        move = run.moving if run.moving is not None else self.decide(run.state, run.placement, run.tables)
        done = self._proceed(run, store, move, at_once=False)
        return dict(report or {}, **done) if done is not None else report

    def rearrange(self, run: Run, store: ExpertStore) -> dict[str, Any]:
        """Decides and moves every layer now, or finishes the overlapped rearrangement in progress."""
        move = run.moving if run.moving is not None else self.decide(run.state, run.placement, run.tables)
        report = self._proceed(run, store, move, at_once=True)
        assert report is not None
        return report

    def _proceed(self, run: Run, store: ExpertStore, move: Rearrangement, *, at_once: bool):
        run.moving = None  # a failure rolls back: the old placement, the window as it was before the decision
        move = self.move(store, move, at_once=at_once)
        if not move.done:
            run.moving = move
            return None
        run.state, report = self.commit(run.state, move, run.schedule)
        run.placement, run.tables = move.new, dict(move.new_tables)
        return report

    def apply(self, run: Run, store: ExpertStore, placement: Placement) -> dict[str, Any]:
        """Moves every layer to ``placement`` (tables solved from the window); the window and counters stay."""
        if run.moving is not None:
            raise ValueError("a rearrangement is in progress: call rearrange() to finish it first")
        move = self.decide(run.state, run.placement, run.tables, placement=placement)
        move = self.move(store, move, at_once=True)
        run.placement, run.tables = move.new, dict(move.new_tables)
        return move.summary(self.num_ranks)

    # ------------------------------------------------------------------ resize
    def resized(
        self, store: elastic.ResizeStore, state: EplbState, current: Placement, new_mesh: jax.sharding.Mesh,
        **options,
    ) -> tuple[ControlLoop, EplbState, Placement, dict[str, np.ndarray], dict[str, Any]]:  # fmt: skip
        """Moves the model in ``store`` from this loop's mesh to ``new_mesh`` (``control.elastic``).

        ``options``: ``placement`` (default: ``policy.resize_placement`` of the
        window's load from ``current``, keeping what each staying device
        holds), ``num_physical`` (``P'``), ``policy`` (default
        ``config.policy``; ``"fill"`` keeps every carried slot), ``lost_ranks``
        (ranks whose devices are gone: nothing is read from them) and
        ``reload`` (an ``elastic.ExpertSource`` for experts no survivor holds).
        ``ValueError`` before anything changes; a later failure leaves the
        store as it was and raises ``RearrangementError``. Returns the loop on
        ``new_mesh``, the window carried over (each step's logical load kept),
        the new placement, its routing tables and the report.
        """
        start = time.perf_counter()
        decision = elastic.decide(self.config, self.mesh, new_mesh, self.axis, state, current, **options)
        sizes = dict(num_layers=self.num_layers, num_logical=self.num_logical, num_physical=decision.new.num_physical)
        loop = ControlLoop(decision.config, new_mesh, self.axis, **sizes)
        tables = loop.tables_for(decision.new, decision.load)
        replicated = store.replicated()
        try:
            trees, spent = elastic.move_experts(store, decision, self.mesh, new_mesh, self.axis)
            replicated = replicate_to(replicated, self.mesh, new_mesh, axis=self.axis, lost_ranks=decision.lost_ranks)
            new_state = loop.window.put(elastic.carry_window(decision.window, current.phy2log, decision.new))
        except ValueError:
            raise
        except Exception as error:
            raise RearrangementError(
                f"EPLB resize failed before any variable changed; the model is on its old mesh "
                f"({type(error).__name__}: {error})"
            ) from error
        saved = store.save()
        try:
            store.install(new_mesh, trees, replicated, decision.new, tables)
        except BaseException as error:
            try:
                store.restore(saved)
            except BaseException as second:
                raise rollback_failed(second, error) from second
            raise RearrangementError(
                f"EPLB resize failed while installing and was rolled back; the model is on its old mesh "
                f"({type(error).__name__}: {error})"
            ) from error
        report = elastic.summary(decision, self.num_ranks, loop.num_ranks, spent, time.perf_counter() - start)
        _log.info(
            "EPLB resize %d -> %d ranks: balancedness %.4f -> %.4f, %d slots kept, %d rows moved, %d reloaded",
            self.num_ranks, loop.num_ranks, report["balancedness_before"], report["balancedness_after"],
            report["slots_kept"], report["rows_moved"], report["rows_reloaded"],
        )  # fmt: skip
        return loop, new_state, decision.new, tables, report

    def resize(self, run: Run, store: elastic.ResizeStore, new_mesh: jax.sharding.Mesh, **options):
        """:meth:`resized` for a stateful adapter: ``run`` follows; returns ``(loop on new_mesh, report)``."""
        if run.moving is not None:
            raise ValueError("a rearrangement is in progress: call rearrange() to finish it before a resize")
        loop, run.state, run.placement, run.tables, report = self.resized(
            store, run.state, run.placement, new_mesh, **options
        )
        run.schedule.config = loop.config
        return loop, report

    # ------------------------------------------------------------------ warmup
    def warmup(
        self, store: ExpertStore, state: EplbState, current: Placement, load=None,
        switch: Callable[[Placement, Mapping[str, np.ndarray]], Any] | None = None, loads=None,
    ) -> dict[str, Any]:  # fmt: skip
        """Compiles what a rearrangement runs -- the mover, the window readers, the tables' solve and ``switch``
        (the adapter's table update, called with the first target and its tables) -- moving nothing; with
        ``loads`` (a step's, as :meth:`close` takes them) the step's window update too, on a fresh window.

        Plans the moves to the policy's placements for ``load`` (``[L, E]``;
        default: four :func:`rehearsal_load` s), pads every later plan to
        their largest send capacity and runs these moves without keeping their
        results (one layer's memory at a time). Returns ``seconds``, the
        mover's ``send_capacity`` and the number of ``moves`` rehearsed.
        """
        start = time.perf_counter()
        targets = rehearsal_targets(self.config, current, load)
        info = self.mover.rehearse(store, current, targets)
        self.window.logical_load(state, current.phy2log, self.num_logical)
        self.window_slot_load(state)
        jax.block_until_ready(self.window.mark_rearranged(state))
        rehearsed = rehearsal_load(self.num_layers, self.num_logical) if load is None else np.asarray(load)
        solved = self.tables_for(targets[0], rehearsed)  # a skewed load, so "lp" solves
        if switch is not None:
            switch(targets[0], solved)
        if loads is not None:  # a fresh window is donated, never the run's
            jax.block_until_ready(self.window.close(self.window.fresh(), loads, self.window.dummy(False)))
        return {"seconds": time.perf_counter() - start, **info}

    # ------------------------------------------------------ reads, files, items
    def window_slot_load(self, state: EplbState) -> np.ndarray:
        """``[L, P]`` host float64 tokens per slot over the window and the EP ranks (summed in float32)."""
        return np.asarray(host_value(self.window.slot_load(state)), np.float64)

    def dump_loads(self, state: EplbState, recorded_under: Placement, path: str | os.PathLike, **meta) -> None:
        """Writes the window's per-step logical loads ``[steps, L, E]`` (through the placement they were recorded
        under) as a load file ``moe-eplb fit`` reads; ``meta``: more of its metadata (``layer_ids``, ...)."""
        check_output_path(path, what="load", suffixes=(".json", ".npz"))  # before reading the window
        rows = self.window.logical_rows(state, recorded_under.phy2log, self.num_logical)
        if not len(rows):
            raise ValueError("the load window is empty: record at least one step before dump_loads")
        save_load(path, rows, num_ranks=self.num_ranks, **meta)

    def item(self, state: EplbState, placement: Placement, shares=None, *, drop_layers=()) -> dict[str, np.ndarray]:
        """The Orbax item of the window ``state`` on ``placement`` with ``shares`` (``None``: equal shares); the
        window rows of ``drop_layers`` are zeroed (recorded under a placement those layers have left)."""
        host = self.window.host_summed(state)
        host["window"][:, list(drop_layers)] = 0
        if shares is None:
            shares = equal_shares(placement.logcnt, self.num_physical - self.num_logical + 1)
        return checkpoint.to_item(checkpoint.Snapshot(self.config, placement, shares, host))

    def snapshot(self, item) -> tuple[checkpoint.Snapshot, EplbState]:
        """A restored item validated (``ValueError`` naming the field) and its window placed on the mesh."""
        snapshot = checkpoint.from_item(
            item,
            config=self.config,
            num_layers=self.num_layers,
            num_logical=self.num_logical,
            num_physical=self.num_physical,
        )
        return snapshot, self.window.put(snapshot.state)

    def checkpoint_item(self, run: Run) -> dict[str, np.ndarray]:
        """The item of ``run``: mid-move, the placement the layers route with now and no window rows of the moved
        layers."""
        moved = run.moving.moved if run.moving is not None else ()
        shares = run.current_tables.get("replica_shares")
        return self.item(run.state, run.current, shares, drop_layers=moved)

    def restore(self, run: Run, store: ExpertStore, item) -> None:
        """Restores :meth:`checkpoint_item` output into ``run`` and the layers' tables (no byte moves); an
        overlapped rearrangement in progress is dropped. Nothing changes unless every field passes."""
        snapshot, state = self.snapshot(item)
        tables = {"replica_shares": snapshot.replica_shares} if routing_mode(self.config.routing).shares else {}
        self.install(store, snapshot.placement, tables, previous=(run.current, run.current_tables))
        counters = {name: int(snapshot.state[name]) for name in ("step", "total_steps", "num_rearrangements")}
        run.state, run.placement, run.tables, run.moving = state, snapshot.placement, tables, None
        run.schedule = Schedule(self.config, counters["step"], counters["total_steps"], counters["num_rearrangements"])

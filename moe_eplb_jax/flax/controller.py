"""The EPLB controller: wraps a Flax NNX MoE model, records loads, rebalances, moves experts atomically.

    controller = EplbController(model, mesh, config, optimizer=optimizer)
    controller.warmup()                          # compile the mover and readers before the run
    for batch in data:
        train_step(model, optimizer, batch)      # the MoE layers add their loads
        report = controller.step()               # record; rearrange when due

A thin layer over ``moe_eplb_jax.control`` (the functional API's pieces): the
model's expert variables and optimizer moments are its ``ExpertStore``.
``step`` closes the step in the ``LoadWindow`` (one small jitted update, no
host sync, no communication: each EP rank writes its own rows) and, every
``config.rearrange_interval`` steps, decides a placement (window -> rows
summed over the ranks, the one all-reduce -> logical load ``[L, E]`` ->
policy; every process computes the same one) and moves each layer's expert
variables and the matching optimizer moments with the ``Mover``: atomically
(on any failure every layer is moved back and gets its old tables, then
``RearrangementError`` is raised), each layer switching tables only once its
bytes have arrived, with one layer's extra memory at a time. With
``overlap`` the layers move over the following steps (one layer, or a byte
budget, per step) instead of all at one step boundary; outputs are the same
at every step either way (placement-invariant layers). Nothing recompiles
when tables change (they are variables), and ``warmup()`` compiles the mover
ahead so no rearrangement compiles mid-run. Every rearrangement logs and
reports its duration, bytes moved and GB/s. ``config.routing`` reaches every
layer (``eplb_set_routing`` at construction); for ``"lp"`` each layer's
replica shares, solved from the window's loads, switch with its placement
row (see ``EplbController``).

Checkpoints: ``checkpoint_item()`` / ``restore_item(item)`` are the EPLB state
as an Orbax item beside the model and optimizer (see
``moe_eplb_jax.control.checkpoint`` for the ``CheckpointManager`` example).
``dump_loads(path)`` writes the window as a load file for ``moe-eplb fit``.

Everything is validated when the controller is built and before any byte
moves: a model with no MoE layer, expert variables without a ``[P]`` slot axis
sharded over the EP axis, an EP size that does not divide ``P``, a placement
for another model shape -- each raises ``ValueError`` and leaves the model
untouched.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from moe_eplb_jax import metrics
from moe_eplb_jax.config import EplbConfig
from moe_eplb_jax.control import (
    LoadWindow,
    Mover,
    Rearrangement,
    RearrangementError,
    check_slot_leaf,
    checkpoint,
    host_value,
    rehearsal_load,
    rehearsal_targets,
)
from moe_eplb_jax.flax.discovery import MoELayerRef, find_moe_layers, variable_paths
from moe_eplb_jax.placement import Placement
from moe_eplb_jax.policy import compute_placement
from moe_eplb_jax.routing import equal_shares, stacked_routing_tables
from moe_eplb_jax.state import EplbState
from moe_eplb_jax.transport.mesh import put_host

__all__ = ["EplbController"]

_log = logging.getLogger("moe_eplb_jax")


class _ModuleStore:
    """The ``ExpertStore`` of NNX MoE layers: their expert variables and the optimizer moments mirroring them."""

    def __init__(self, layers: list[MoELayerRef], opt_vars: list[list[nnx.Variable]]):
        self.layers, self.opt_vars = layers, opt_vars

    def read(self, layer: int):
        variables = self.layers[layer].module.eplb_expert_variables()
        return {
            "experts": {name: var.get_value() for name, var in variables.items()},
            "opt": [var.get_value() for var in self.opt_vars[layer]],
        }

    def write(self, layer: int, tree) -> None:
        for name, var in self.layers[layer].module.eplb_expert_variables().items():
            var.set_value(tree["experts"][name])
        for var, value in zip(self.opt_vars[layer], tree["opt"]):
            var.set_value(value)

    def switch(self, layer: int, placement: Placement, tables: Mapping[str, np.ndarray]) -> None:
        rows = {name: table[layer] for name, table in tables.items()}
        module = self.layers[layer].module
        module.eplb_set_placement(placement.phy2log[layer], placement.log2phy[layer], placement.logcnt[layer], **rows)


def _takes_keyword(method, name: str) -> bool:
    """Whether ``method`` accepts the keyword argument ``name`` (by name or through ``**kwargs``)."""
    try:
        parameters = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): let the call decide
        return True
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return any(p.kind == inspect.Parameter.VAR_KEYWORD or (p.name == name and p.kind in kinds) for p in parameters)


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
        self.layers: list[MoELayerRef] = find_moe_layers(model)
        self.num_ranks = int(mesh.shape[axis])
        self.num_logical, self.num_physical = self._check_layers()
        if config.num_redundant_experts != self.num_physical - self.num_logical:
            raise ValueError(
                f"config.num_redundant_experts={config.num_redundant_experts} but the model has "
                f"P - E = {self.num_physical} - {self.num_logical} = {self.num_physical - self.num_logical}"
            )
        if config.num_gpus != self.num_ranks:
            raise ValueError(f"config.num_gpus={config.num_gpus} but mesh axis {axis!r} has {self.num_ranks} ranks")
        config.num_physical(self.num_logical)  # P divides into the ranks, E into the groups where hierarchical
        if config.policy in ("online", "quota"):
            from moe_eplb_jax.policy.online import home_layout

            home_layout(self.num_logical, self.num_physical, self.num_ranks)
        to_switch = self._layers_to_switch()
        opt_vars = self._optimizer_variables() if optimizer is not None else [[] for _ in self.layers]
        start = None
        if placement is not None:
            start = placement if isinstance(placement, Placement) else Placement.load(placement)
            self._check_placement(start)
        self._store = _ModuleStore(self.layers, opt_vars)
        self._window = LoadWindow(config, mesh, len(self.layers), self.num_physical, axis)
        self._mover = Mover(mesh, axis, self.num_logical, self.num_physical)
        self.state: EplbState = self._window.fresh()
        self._steps_since = self._total_steps = self._num_rearrangements = 0
        self._moving: Rearrangement | None = None
        self._moving_since = 0
        self.last_report: dict[str, Any] | None = None
        self._zero_loads = [self._zeros_like(ref.module.eplb_load_variable().get_value()) for ref in self.layers]
        self._placement = self._read_placement()
        self._tables = self._solve_tables(self._placement, fresh=True)
        previous = [(ref.module, getattr(ref.module, "routing", "hash")) for ref in to_switch]
        try:  # every check passed: now the layers change, and go back to their modes if this fails
            for ref in to_switch:
                ref.module.eplb_set_routing(config.routing)
            if self._tables:
                for layer in range(len(self.layers)):
                    self._store.switch(layer, self._placement, self._tables)
            if start is not None:
                self.apply_placement(start)
        except BaseException:
            for module, routing in previous:
                module.eplb_set_routing(routing)
            raise

    # ------------------------------------------------------------ checks
    def _check_layers(self) -> tuple[int, int]:
        sizes = set()
        for ref in self.layers:
            num_logical = int(ref.module.eplb_num_logical_experts())
            variables = dict(ref.module.eplb_expert_variables())
            if not variables:
                raise ValueError(f"MoE layer {ref.name} lists no expert variables")
            leading = set()
            for name, var in variables.items():
                leaves = jax.tree.leaves(var.get_value()) if isinstance(var, nnx.Variable) else []
                if not leaves:
                    raise ValueError(f"expert variable {ref.name}/{name} must be an nnx.Variable holding arrays")
                for value in leaves:  # a variable may hold a pytree (quantized weights and scales)
                    name_ = f"{ref.name}/{name}"
                    leading.add(check_slot_leaf(name_, value, num_physical=None, mesh=self.mesh, axis=self.axis))
            if len(leading) != 1:
                raise ValueError(f"expert variables of {ref.name} disagree on the slot axis size: {sorted(leading)}")
            num_physical = leading.pop()
            if num_physical < num_logical:
                raise ValueError(f"{ref.name}: {num_physical} slots for {num_logical} logical experts")
            if num_physical % self.num_ranks:
                raise ValueError(f"{ref.name}: P={num_physical} slots are not divisible by EP size {self.num_ranks}")
            load = ref.module.eplb_load_variable().get_value()
            if tuple(load.shape) not in ((num_physical,), (self.num_ranks, num_physical)):
                raise ValueError(
                    f"{ref.name}: load variable must have shape [P]=({num_physical},) or "
                    f"[G, P]=({self.num_ranks}, {num_physical}), got {load.shape}"
                )
            sizes.add((num_logical, num_physical))
        if len(sizes) != 1:
            raise ValueError(f"MoE layers disagree on (E, P): {sorted(sizes)}")
        return sizes.pop()

    def _layers_to_switch(self) -> list[MoELayerRef]:
        """The layers whose routing mode differs from ``config.routing``; ``ValueError`` where a layer cannot follow.

        A layer's mode is its ``routing`` attribute (``"hash"`` without one);
        switching it needs ``eplb_set_routing``. ``"lp"`` also needs an
        ``eplb_set_placement`` that takes ``replica_shares``.
        """
        routing, to_switch = self.config.routing, []
        for ref in self.layers:
            current = getattr(ref.module, "routing", "hash")
            if current != routing:
                if not callable(getattr(ref.module, "eplb_set_routing", None)):
                    raise ValueError(
                        f"MoE layer {ref.name} routes by {current!r} and has no eplb_set_routing(mode) to follow "
                        f"config.routing={routing!r}"
                    )
                to_switch.append(ref)
            if routing == "lp" and not _takes_keyword(ref.module.eplb_set_placement, "replica_shares"):
                raise ValueError(
                    f"config.routing='lp' hands every layer its replica shares, but {ref.name}.eplb_set_placement "
                    f"takes no replica_shares keyword"
                )
        return to_switch

    def _check_placement(self, placement: Placement) -> None:
        want = (len(self.layers), self.num_logical, self.num_physical)
        got = (placement.num_layers, placement.num_logical, placement.num_physical)
        if got != want:
            raise ValueError(f"placement is for (L, E, P) = {got} but the model has (L, E, P) = {want}")
        placement.validate(num_ranks=self.num_ranks)

    def _optimizer_variables(self) -> list[list[nnx.Variable]]:
        """Per layer, the optimizer-state variables that mirror its expert variables (same path suffix, [P] axis)."""
        model_paths = variable_paths(self.model)
        expert_paths = []
        for ref in self.layers:
            expert_paths.append({model_paths[id(v)] for v in ref.module.eplb_expert_variables().values()})
        found: list[list[nnx.Variable]] = [[] for _ in self.layers]
        for path, node in nnx.iter_graph(self.optimizer):
            if not isinstance(node, nnx.Variable) or isinstance(node, nnx.Param):
                continue
            value = node.get_value()
            if not isinstance(value, jax.Array) or value.ndim < 1 or value.shape[0] != self.num_physical:
                continue
            for layer, paths in enumerate(expert_paths):
                if any(len(path) > len(p) and tuple(path[-len(p) :]) == p for p in paths):
                    found[layer].append(node)
                    break
        return found

    def _zeros_like(self, value) -> jax.Array:
        # The layer's own sharding, so the model's jitted step sees one input sharding and never recompiles.
        spec = value.sharding.spec if isinstance(value.sharding, NamedSharding) else PS()
        return put_host(np.zeros(value.shape, np.int32), self.mesh, spec)

    # ---------------------------------------------------------- placement
    def _read_placement(self) -> Placement:
        tables = [[np.asarray(t) for t in ref.module.eplb_get_placement()] for ref in self.layers]
        return Placement.from_tables(*(np.stack(t) for t in zip(*tables)), num_ranks=self.num_ranks)

    @property
    def placement(self) -> Placement:
        """The placement every layer routes with now (during an overlapped move: moved layers on the new one)."""
        return self._moving.current if self._moving is not None else self._placement

    @property
    def routing_tables(self) -> dict[str, np.ndarray]:
        """The routing tables every layer routes with now, name -> ``[L, ...]`` (``"lp"``: ``replica_shares
        [L, E, S]``; ``{}`` for the modes without tables)."""
        return self._moving.current_tables if self._moving is not None else dict(self._tables)

    def _solve_tables(self, placement: Placement, *, fresh: bool = False) -> dict[str, np.ndarray]:
        """The routing tables of ``placement`` for the window's loads (``fresh``: for no load yet)."""
        if self.config.routing != "lp":
            return {}
        if fresh:
            logical = np.zeros((len(self.layers), self.num_logical))
        else:
            logical = self._window.logical_load(self.state, self._placement.phy2log, self.num_logical)
        return stacked_routing_tables(self.config.routing, logical, placement, num_ranks=self.num_ranks)

    @property
    def rearranging(self) -> bool:
        """True while an overlapped rearrangement has layers left to move."""
        return self._moving is not None

    def apply_placement(self, placement: Placement) -> dict[str, Any]:
        """Moves every layer's experts (and optimizer state) to ``placement`` and hands the layers its tables.

        Validated before any byte moves; atomic (``RearrangementError`` after a
        rollback on failure). With ``"lp"`` routing the layers get the shares
        solved for ``placement`` from the window's loads. The load window and
        counters are left as they are. Returns the move's summary
        (``slots_moved``, ``bytes_moved``, ``move_seconds``, ...).
        """
        if self._moving is not None:
            raise ValueError("a rearrangement is in progress: call rearrange() to finish it first")
        self._check_placement(placement)
        move = Rearrangement.between(
            self._placement,
            placement,
            num_ranks=self.num_ranks,
            old_tables=self._tables,
            new_tables=self._solve_tables(placement),
        )
        move = self._mover.run(self._store, move, move.pending, defer_switch=True)
        self._placement, self._tables = move.new, dict(move.new_tables)
        return move.summary(self.num_ranks)

    # --------------------------------------------------------------- steps
    def step(self) -> dict[str, Any] | None:
        """Closes one step: records every layer's load, rearranges (or moves the next layers) when due.

        Call it once per training / serving step on every process. Returns a
        report dict on steps that log (``config.log_interval``) or finish a
        rearrangement, else ``None``. While an overlapped rearrangement is in
        progress the step's loads are not recorded (they fall under a
        placement that is changing; the window restarts when it completes).
        ``self.state`` is replaced: the old state's arrays are donated to the
        update (read ``controller.state`` anew after a step).
        """
        variables = [ref.module.eplb_load_variable() for ref in self.layers]
        loads = [v.get_value() for v in variables]
        self.state = self._window.close(self.state, loads, np.bool_(self._moving is not None))
        for v, zeros in zip(variables, self._zero_loads):
            v.set_value(zeros)
        self._steps_since += 1
        self._total_steps += 1
        report = None
        interval = self.config.log_interval
        if interval is not None and self._total_steps % interval == 0:
            report = self._report(np.asarray(host_value(self._window.step_slot_load(loads))), "step")
        if self._moving is not None:
            done = self._advance()
            report = dict(report or {}, **done) if done is not None else report
        elif self.rebalance and self._due():
            done = self._begin()
            report = dict(report or {}, **done) if done is not None else report
        if report is not None:
            self.last_report = report
        return report

    @property
    def total_steps(self) -> int:
        """Steps closed so far (a host mirror of ``state.total_steps``)."""
        return self._total_steps

    @property
    def num_rearrangements(self) -> int:
        return self._num_rearrangements

    def _due(self) -> bool:
        # Host mirror of state.should_rearrange (no device sync): all processes step in lock-step.
        due = self.config.first_rearrangement_step if self._num_rearrangements == 0 else self.config.rearrange_interval
        return self._steps_since >= due

    def window_slot_load(self) -> np.ndarray:
        """``[L, P]`` tokens per slot summed over the load window and the EP ranks (under the current placement).

        float64 on the host, summed in float32 on the device (no int32 wrap; see ``state.window_slot_load``).
        """
        return np.asarray(host_value(self._window.slot_load(self.state)), np.float64)

    def _decide(self) -> Rearrangement:
        current = self._placement
        logical = self._window.logical_load(self.state, current.phy2log, self.num_logical)
        new = compute_placement(logical, self.config, old_phy2log=current.phy2log)
        return Rearrangement.between(
            current,
            new,
            num_ranks=self.num_ranks,
            old_tables=self._tables,
            new_tables=stacked_routing_tables(self.config.routing, logical, new, num_ranks=self.num_ranks),
            load=logical,
        )

    def _begin(self) -> dict[str, Any] | None:
        move = self._decide()
        if self.config.overlap is None:
            return self._commit(self._mover.run(self._store, move, move.pending, defer_switch=True))
        self._moving, self._moving_since = move, self._total_steps
        return self._advance()

    def _advance(self) -> dict[str, Any] | None:
        """Moves the next layer (or byte budget) of the rearrangement in progress; its report when it completes."""
        move, overlap = self._moving, self.config.overlap
        assert move is not None
        layers = move.pending[:1] if overlap == "layer" else move.pending
        budget = overlap if isinstance(overlap, int) else None
        try:
            move = self._mover.run(self._store, move, layers, budget=budget)
        except RearrangementError:
            self._moving = None  # rolled back: the old placement, the window as it was before the decision
            raise
        if not move.done:
            self._moving = move
            return None
        self._moving = None
        return self._commit(move)

    def rearrange(self) -> dict[str, Any]:
        """Rearranges now, all layers at once (or finishes the overlapped rearrangement in progress).

        Computes a placement from the load window, moves the experts to it,
        resets the window; returns the report (also logged).
        """
        if self._moving is not None:
            move, self._moving = self._moving, None
            return self._commit(self._mover.run(self._store, move, move.pending))
        move = self._decide()
        return self._commit(self._mover.run(self._store, move, move.pending, defer_switch=True))

    def _commit(self, move: Rearrangement) -> dict[str, Any]:
        self._placement, self._tables = move.new, dict(move.new_tables)
        self._steps_since = 0
        self._num_rearrangements += 1
        self.state = self._window.mark_rearranged(self.state)
        report = {
            "rearranged": True,
            "num_rearrangements": self._num_rearrangements,
            **move.summary(self.num_ranks),
        }
        _log.info(
            "EPLB rearrangement %d: balancedness %.4f -> %.4f, %d slots in %d layers moved, "
            "%.1f MB in %.3f s (%.2f GB/s)",
            self._num_rearrangements,
            report.get("balancedness_before", float("nan")),
            report.get("balancedness_after", float("nan")),
            report["slots_moved"],
            report["layers_moved"],
            report["bytes_moved"] / 1e6,
            report["move_seconds"],
            report["gb_per_s"],
        )
        return report

    def _report(self, slot_load: np.ndarray, what: str) -> dict[str, Any]:
        ranks = metrics.rank_load(np.asarray(slot_load, np.float64), self.num_ranks)
        report = {
            "step": self._total_steps,
            "balancedness": float(metrics.balancedness(ranks)),
            "rank_imbalance": metrics.rank_imbalance(ranks).tolist(),
        }
        if what == "step":
            _log.info(
                "EPLB step %d: balancedness %.4f, max rank imbalance %.3f",
                report["step"],
                report["balancedness"],
                max(report["rank_imbalance"]),
            )
        return report

    def warmup(self, load=None) -> dict[str, Any]:
        """Compiles what a rearrangement runs -- the mover, the window readers, the tables' switch -- moving nothing.

        Plans the moves to the policy's placements for ``load`` (``[L, E]``;
        default: four skewed synthetic loads, ``control.rehearsal_load``),
        pads every later plan to their largest send capacity, runs these moves
        without keeping their results (one layer's memory at a time), reads
        the window, and hands every layer its current tables again. A later
        plan that needs more capacity, or an executor variant none of these
        needed (a longer chain of moves), still compiles once. Call it on
        every process before the run. Returns ``seconds``, the mover's
        ``send_capacity`` and the number of ``moves`` rehearsed.
        """
        import time

        start = time.perf_counter()
        current, tables = self.placement, self.routing_tables
        targets = rehearsal_targets(self.config, current, load)
        info = self._mover.rehearse(self._store, current, targets)
        self._window.logical_load(self.state, current.phy2log, self.num_logical)
        self.window_slot_load()
        jax.block_until_ready(self._window.mark_rearranged(self.state))
        rehearsed = rehearsal_load(len(self.layers), self.num_logical) if load is None else np.asarray(load)
        stacked_routing_tables(self.config.routing, rehearsed, targets[0], num_ranks=self.num_ranks)  # "lp": solve
        for layer in range(len(self.layers)):
            self._store.switch(layer, current, tables)
        return {"seconds": time.perf_counter() - start, **info}

    # ----------------------------------------------------- files and state
    def save_placement(self, path) -> None:
        """Writes the current placement (``.json`` / ``.npz``), e.g. to serve with it later."""
        self.placement.save(path)

    def dump_loads(self, path) -> None:
        """Writes the window's per-step logical loads ``[steps, L, E]`` as a load file (``moe-eplb fit`` reads it).

        The loads are summed over the EP ranks and mapped to logical experts
        through the placement they were recorded under.
        """
        from moe_eplb_jax.sim.loadfile import save_load

        recorded_under = self._moving.old if self._moving is not None else self._placement
        rows = self._window.logical_rows(self.state, recorded_under.phy2log, self.num_logical)
        if not len(rows):
            raise ValueError("the load window is empty: record at least one step before dump_loads")
        save_load(path, rows, num_ranks=self.num_ranks)

    def checkpoint_item(self) -> dict[str, np.ndarray]:
        """The EPLB state as an Orbax item (host numpy arrays; see ``moe_eplb_jax.control.checkpoint``).

        During an overlapped rearrangement the item holds the placement the
        layers route with now and drops the moved layers' window rows (they
        were recorded under those layers' old placement).
        """
        host = self._window.host_summed(self.state)
        if self._moving is not None:
            host["window"][:, list(self._moving.moved)] = 0
        placement = self.placement
        shares = self.routing_tables.get("replica_shares")
        if shares is None:
            shares = equal_shares(placement.logcnt, self.num_physical - self.num_logical + 1)
        return checkpoint.to_item(checkpoint.Snapshot(self.config, placement, shares, host))

    def restore_item(self, item) -> None:
        """Restores :meth:`checkpoint_item` output: the state, and the tables the layers route with.

        Every field is validated first (``ValueError`` naming it; nothing
        changes then). The model's expert variables must come from the
        checkpoint saved with it (they already follow that placement): nothing
        moves here. With ``"lp"`` routing the layers get the item's replica
        shares (the ones the saved run routed with). An overlapped
        rearrangement in progress is dropped.
        """
        snapshot = checkpoint.from_item(
            item,
            config=self.config,
            num_layers=len(self.layers),
            num_logical=self.num_logical,
            num_physical=self.num_physical,
        )
        state = self._window.put(snapshot.state)
        tables = {"replica_shares": snapshot.replica_shares} if self.config.routing == "lp" else {}
        previous, previous_tables, switched = self.placement, self.routing_tables, []
        try:
            for layer in range(len(self.layers)):
                self._store.switch(layer, snapshot.placement, tables)
                switched.append(layer)
        except BaseException:
            for layer in switched:
                self._store.switch(layer, previous, previous_tables)
            raise
        counters = snapshot.state
        self.state, self._placement, self._tables, self._moving = state, snapshot.placement, tables, None
        self._total_steps, self._steps_since = int(counters["total_steps"]), int(counters["step"])
        self._num_rearrangements = int(counters["num_rearrangements"])

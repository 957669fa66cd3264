"""The EPLB controller: wraps a Flax NNX MoE model, records loads, rebalances.

    controller = EplbController(model, mesh, config, optimizer=optimizer)
    for batch in data:
        train_step(model, optimizer, batch)     # the MoE layers add their loads
        info = controller.step()                 # record; rearrange when due

``step`` reads every layer's load into the ``EplbState`` window (one small
jitted update, no host sync, no communication: the window keeps one row per EP
rank, sharded over the EP axis, and each rank writes its own counts) and,
every ``config.step_interval`` steps, rearranges: window -> rows summed over
the ranks (the one all-reduce of the loads) -> logical load ``[L, E]`` ->
policy -> new ``Placement`` (a pure function of the summed, replicated loads:
every process computes the same one) ->
the transport moves each layer's expert variables and the matching optimizer
moments -> the layers get the new tables. Outputs are unchanged by a
rearrangement (same expert bytes, same math per token), and nothing
recompiles (the tables are variables).

Everything is validated when the controller is built and before any byte
moves: a model with no MoE layer, expert variables without a ``[P]`` slot axis
sharded over the EP axis, an EP size that does not divide ``P``, a placement
file for another model shape -- each raises ``ValueError`` and leaves the model
untouched.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from moe_eplb_jax import metrics
from moe_eplb_jax import state as eplb_state
from moe_eplb_jax.flax.discovery import MoELayerRef, find_moe_layers, variable_paths
from moe_eplb_jax.placement import Placement
from moe_eplb_jax.sharding.mesh import put_host
from moe_eplb_jax.state import EplbConfig, EplbState

__all__ = ["EplbController"]

_log = logging.getLogger("moe_eplb_jax")
_CHECKPOINT_FORMAT = "moe_eplb_jax.controller"


def _close_step(state: EplbState, loads, num_ranks: int):
    """Records one step's loads (``[G, P]`` per rank or ``[P]`` already summed) into the per-rank state."""
    rows = []
    for load in loads:
        load = load.astype(jnp.int32)
        if load.ndim == 1:  # a layer that psums its own load: charge the total to rank 0's row, sums unchanged
            load = jnp.where(jnp.arange(num_ranks)[:, None] == 0, load[None, :], 0)
        rows.append(load)
    load = jnp.stack(rows)
    return eplb_state.end_step(eplb_state.record(state, load)), load


def _sum_rank_rows(state: EplbState) -> EplbState:
    """The per-rank state with its rank rows summed: the single-layout state a checkpoint holds."""
    return dataclasses.replace(
        state, pass_load=state.pass_load.sum(1, dtype=jnp.int32), window=state.window.sum(2, dtype=jnp.int32)
    )


def _split_rank_rows(state: EplbState, num_ranks: int) -> EplbState:
    """Inverse of ``_sum_rank_rows`` up to the split: the totals go to rank 0's row."""

    def rows(x, axis):
        first = jax.lax.broadcasted_iota(jnp.int32, (*x.shape[:axis], num_ranks, *x.shape[axis:]), axis) == 0
        return jnp.where(first, jnp.expand_dims(x, axis), 0)

    return dataclasses.replace(state, pass_load=rows(state.pass_load, 1), window=rows(state.window, 2))


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
    ):
        if not isinstance(config, EplbConfig):
            raise ValueError(f"config must be an EplbConfig, got {type(config).__name__}")
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
        self._opt_vars = self._optimizer_variables() if optimizer is not None else [[] for _ in self.layers]
        start = None
        if placement is not None:
            start = placement if isinstance(placement, Placement) else Placement.load(placement)
            self._check_placement(start)
        self._init_state_functions()
        self.state = self._fresh_state()
        self._steps_since = 0
        self._total_steps = 0
        self._num_rearrangements = 0
        self.last_report: dict[str, Any] | None = None
        self._zero_loads = [self._zeros_like_load(ref.module.eplb_load_variable().get_value()) for ref in self.layers]
        self._placement = self._read_placement()
        if start is not None:
            self.apply_placement(start)

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
                    self._check_slot_leaf(f"{ref.name}/{name}", value)
                    leading.add(int(value.shape[0]))
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

    def _check_slot_leaf(self, name: str, value) -> None:
        if not isinstance(value, jax.Array) or value.ndim < 1:
            raise ValueError(f"expert variable {name} must hold jax.Arrays with a leading slot axis [P, ...]")
        spec = value.sharding.spec if isinstance(value.sharding, NamedSharding) else None
        first = spec[0] if spec is not None and len(spec) else None
        names = first if isinstance(first, tuple) else (first,)
        if self.num_ranks > 1 and self.axis not in names:
            raise ValueError(
                f"expert variable {name} (shape {value.shape}) has no slot axis sharded over mesh axis "
                f"{self.axis!r} (sharding {value.sharding}); expected a leading [P, ...] axis with "
                f"PartitionSpec({self.axis!r}, ...)"
            )

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

    # ------------------------------------------------------ state on the mesh
    def _init_state_functions(self) -> None:
        """Jitted state updates with fixed output shardings: rank rows on their EP rank, counters replicated.

        Fixed shardings keep every update a local op on each rank's shard (no
        collective) and give the model's and the controller's jitted functions
        the same input shardings every step, so nothing recompiles.
        """
        mesh, axis = self.mesh, self.axis
        replicated = NamedSharding(mesh, PS())
        make = functools.partial(eplb_state.init_state, self.config, len(self.layers), self.num_physical, per_rank=True)
        shape = jax.eval_shape(make)
        self._state_sharding = jax.tree.map(lambda _: replicated, shape)
        self._state_sharding = dataclasses.replace(
            self._state_sharding,
            pass_load=NamedSharding(mesh, PS(None, axis, None)),
            window=NamedSharding(mesh, PS(None, None, axis, None)),
        )
        self._fresh_state = jax.jit(make, out_shardings=self._state_sharding)
        # The state is donated: the window ([W, L, G, P]) is updated in place, not copied every step.
        self._close = jax.jit(
            _close_step,
            static_argnums=2,
            donate_argnums=0,
            out_shardings=(self._state_sharding, NamedSharding(mesh, PS(None, axis, None))),
        )
        self._mark_rearranged = jax.jit(eplb_state.mark_rearranged, out_shardings=self._state_sharding)
        # The readers: the sums over ranks happen here, on logging / rearrangement / checkpoint steps only.
        self._step_slot_load = jax.jit(lambda load: load.sum(1, dtype=jnp.int32), out_shardings=replicated)
        self._window_slot_load = jax.jit(eplb_state.window_slot_load, out_shardings=replicated)
        self._window_logical_load = jax.jit(eplb_state.window_logical_load, static_argnums=2, out_shardings=replicated)
        self._summed_state = jax.jit(_sum_rank_rows, out_shardings=replicated)
        self._split_state = jax.jit(_split_rank_rows, static_argnums=1, out_shardings=self._state_sharding)

    def _zeros_like_load(self, value) -> jax.Array:
        # The layer's own sharding, so the model's jitted step sees one input sharding and never recompiles.
        spec = value.sharding.spec if isinstance(value.sharding, NamedSharding) else PS()
        return put_host(np.zeros(value.shape, np.int32), self.mesh, spec)

    # ---------------------------------------------------------- placement
    def _read_placement(self) -> Placement:
        tables = [[np.asarray(t) for t in ref.module.eplb_get_placement()] for ref in self.layers]
        return Placement.from_tables(*(np.stack(t) for t in zip(*tables)), num_ranks=self.num_ranks)

    @property
    def placement(self) -> Placement:
        """The current placement of every layer (host numpy tables)."""
        return self._placement

    def apply_placement(self, placement: Placement) -> dict[str, int]:
        """Moves every layer's experts (and optimizer state) to ``placement`` and hands the layers its tables.

        Validated before any byte moves. Returns ``{"slots_moved": n}``.
        """
        from moe_eplb_jax.sharding import rearrange_experts

        placement = placement.to_numpy()
        self._check_placement(placement)
        old = self._placement
        moved = int(np.sum(old.phy2log != placement.phy2log))
        for layer, ref in enumerate(self.layers):
            if np.array_equal(old.phy2log[layer], placement.phy2log[layer]):
                continue
            variables = dict(ref.module.eplb_expert_variables())
            opt_vars = self._opt_vars[layer]
            tree = {
                "experts": {k: v.get_value() for k, v in variables.items()},
                "opt": [v.get_value() for v in opt_vars],
            }
            tree = rearrange_experts(
                tree,
                old.phy2log[layer],
                placement.phy2log[layer],
                mesh=self.mesh,
                axis=self.axis,
                num_logical=self.num_logical,
            )
            for k, v in variables.items():
                v.set_value(tree["experts"][k])
            for v, value in zip(opt_vars, tree["opt"]):
                v.set_value(value)
            ref.module.eplb_set_placement(placement.phy2log[layer], placement.log2phy[layer], placement.logcnt[layer])
        self._placement = placement
        return {"slots_moved": moved}

    # --------------------------------------------------------------- steps
    def step(self) -> dict[str, Any] | None:
        """Closes one step: records every layer's load, rearranges when due.

        Call it once per training / serving step on every process. Returns a
        report dict on steps that log (``config.log_interval``) or rearrange,
        else ``None``. ``self.state`` is replaced: the old state's arrays are
        donated to the update (read ``controller.state`` anew after a step).
        """
        variables = [ref.module.eplb_load_variable() for ref in self.layers]
        self.state, load = self._close(self.state, [v.get_value() for v in variables], self.num_ranks)
        for v, zeros in zip(variables, self._zero_loads):
            v.set_value(zeros)
        self._steps_since += 1
        self._total_steps += 1
        report = None
        interval = self.config.log_interval
        if interval is not None and self._total_steps % interval == 0:
            report = self._report(np.asarray(self._step_slot_load(load)), "step")
        if self.rebalance and self._due():
            report = dict(report or {}, **self.rearrange())
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
        due = self.config.first_rearrangement_step if self._num_rearrangements == 0 else self.config.step_interval
        return self._steps_since >= due

    def window_slot_load(self) -> np.ndarray:
        """``[L, P]`` tokens per slot summed over the load window and the EP ranks (under the current placement)."""
        return np.asarray(self._window_slot_load(self.state))

    def rearrange(self) -> dict[str, Any]:
        """Computes a placement from the load window, moves the experts to it, resets the window."""
        logical = np.asarray(self._window_logical_load(self.state, self._placement.phy2log, self.num_logical))
        before = self._report(self.window_slot_load(), "window")
        new = eplb_state.compute_placement(logical, self.config, old_phy2log=self._placement.phy2log)
        moved = self.apply_placement(new)
        predicted = metrics.rank_load_from_logical(logical, new.phy2log, self.num_ranks)
        self._steps_since = 0
        self._num_rearrangements += 1
        self.state = self._mark_rearranged(self.state)
        report = {
            "rearranged": True,
            "num_rearrangements": self._num_rearrangements,
            "balancedness_before": before["balancedness"],
            "balancedness_after": float(metrics.balancedness(predicted)),
            "max_rank_imbalance_after": float(np.max(metrics.rank_imbalance(predicted))),
            **moved,
        }
        _log.info(
            "EPLB rearrangement %d: balancedness %.4f -> %.4f, %d slots moved",
            self._num_rearrangements,
            report["balancedness_before"],
            report["balancedness_after"],
            moved["slots_moved"],
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

    # ----------------------------------------------------- files and state
    def save_placement(self, path) -> None:
        """Writes the current placement (``.json`` / ``.npz``), e.g. to serve with it later."""
        self._placement.save(path)

    def save(self, path) -> None:
        """Checkpoints the EPLB state and placement as ``.npz`` (restore next to the model's own checkpoint).

        The loads are saved summed over the EP ranks (``window [W, L, P]``), the
        totals every reader uses.
        """
        summed = self._summed_state(self.state)
        fields = {f.name: np.asarray(getattr(summed, f.name)) for f in dataclasses.fields(EplbState)}
        p = self._placement
        host = np.asarray([self._total_steps, self._steps_since, self._num_rearrangements], np.int64)
        path = os.fspath(path)
        if not path.endswith(".npz"):
            raise ValueError(f"controller checkpoint must end in .npz, got {path!r}")
        np.savez(
            path,
            format=np.asarray(_CHECKPOINT_FORMAT),
            phy2log=p.phy2log,
            log2phy=p.log2phy,
            logcnt=p.logcnt,
            host_counters=host,
            **{f"state_{k}": v for k, v in fields.items()},
        )

    def restore(self, path) -> None:
        """Restores :meth:`save` output: the state, and the tables the layers route with.

        The model's expert variables must come from the checkpoint saved with it
        (they already follow that placement): nothing moves here.
        """
        try:
            with np.load(os.fspath(path), allow_pickle=False) as z:
                doc = {k: z[k] for k in z.files}
        except (OSError, ValueError, EOFError) as e:
            raise ValueError(f"{path}: not a readable controller checkpoint ({e})") from e
        if str(doc.get("format", "")) != _CHECKPOINT_FORMAT:
            raise ValueError(f"{path}: field 'format' is not {_CHECKPOINT_FORMAT!r}")
        try:
            placement = Placement.from_tables(doc["phy2log"], doc["log2phy"], doc["logcnt"], num_ranks=self.num_ranks)
        except KeyError as e:
            raise ValueError(f"{path}: missing field {e}") from None
        self._check_placement(placement)
        fields = {}
        summed = jax.eval_shape(_sum_rank_rows, self.state)
        for f in dataclasses.fields(EplbState):
            try:
                value = doc[f"state_{f.name}"]
            except KeyError as e:
                raise ValueError(f"{path}: missing field {e}") from None
            want = tuple(getattr(summed, f.name).shape)
            if value.shape != want:
                raise ValueError(f"{path}: state field {f.name} has shape {value.shape}, expected {want}")
            fields[f.name] = put_host(value.astype(np.int32), self.mesh)
        total, since, count = (int(v) for v in doc["host_counters"])
        self.state = self._split_state(EplbState(**fields), self.num_ranks)
        for layer, ref in enumerate(self.layers):
            ref.module.eplb_set_placement(placement.phy2log[layer], placement.log2phy[layer], placement.logcnt[layer])
        self._placement = placement
        self._total_steps, self._steps_since, self._num_rearrangements = total, since, count

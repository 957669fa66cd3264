"""The ``ExpertStore`` of an NNX model: its MoE layers' expert variables and the optimizer moments mirroring them.

:meth:`ModuleStore.of` finds the layers (``find_moe_layers``) and checks them before anything changes: expert
variables holding ``[P, ...]`` arrays sharded over the EP axis, one ``(E, P)`` for every layer, ``P`` divisible
by the EP size, a load variable of ``[P]`` or ``[G, P]``; with an optimizer, its per-expert state (the variables
whose path ends with an expert variable's path) moves with the parameters. For a resize the store also places
the model's (and optimizer's) replicated arrays on the new mesh, hands each layer its new mesh and tables
(``eplb_resize``) and can put the whole graph back (``flax.graph_state``).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from moe_eplb_jax.control import check_slot_leaf
from moe_eplb_jax.flax import graph_state
from moe_eplb_jax.flax.discovery import MoELayerRef, find_moe_layers, variable_paths
from moe_eplb_jax.placement import Placement
from moe_eplb_jax.routing import routing_mode
from moe_eplb_jax.transport.mesh import put_host

__all__ = ["ModuleStore"]


class ModuleStore:
    """The layers' expert variables (``read`` / ``write`` a layer's pytree) and their tables (``switch``)."""

    def __init__(
        self, layers: list[MoELayerRef], opt_vars: list[list[nnx.Variable]], num_logical, num_physical, *,
        roots=(), mesh: jax.sharding.Mesh | None = None,
    ):  # fmt: skip
        self.layers, self.opt_vars = layers, opt_vars
        self.num_logical, self.num_physical = int(num_logical), int(num_physical)
        self.roots, self.mesh = tuple(roots), mesh  # the model (and optimizer) a resize moves whole
        self._targets: list[graph_state.ReplicatedTarget] = []

    @classmethod
    def of(cls, model, mesh: jax.sharding.Mesh | None, axis: str, optimizer=None) -> ModuleStore:
        """The store of every MoE layer of ``model`` (and ``optimizer``'s state); ``ValueError`` naming the layer.

        ``mesh=None``: the expert variables' shardings are not checked (a
        checkpoint's experts to reload from, on any devices or the host).
        """
        layers = find_moe_layers(model)
        num_logical, num_physical = _check_layers(layers, mesh, axis)
        opt_vars = [[] for _ in layers]
        if optimizer is not None:
            opt_vars = _optimizer_variables(model, optimizer, layers, num_physical)
        roots = (model,) if optimizer is None else (model, optimizer)
        return cls(layers, opt_vars, num_logical, num_physical, roots=roots, mesh=mesh)

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

    # ------------------------------------------------------------ resize
    def replicated(self) -> list[jax.Array]:
        """Every array of the model and optimizer on the mesh but the expert state and loads (all replicated);
        ``ValueError`` first for a layer without ``eplb_resize`` or a non-expert variable sharded over the mesh."""
        for ref in self.layers:
            if not callable(getattr(ref.module, "eplb_resize", None)):
                raise ValueError(
                    f"MoE layer {ref.name} has no eplb_resize(mesh, phy2log, log2phy, logcnt): it cannot resize"
                )
        assert self.mesh is not None
        skip = {id(var) for layer in self.opt_vars for var in layer} | {id(v) for v in self.load_variables()}
        skip |= {id(var) for ref in self.layers for var in ref.module.eplb_expert_variables().values()}
        self._targets, arrays = graph_state.replicated_arrays(self.roots, self.mesh, skip)
        return arrays

    def save(self) -> graph_state.Snapshot:
        return graph_state.snapshot(self.roots)

    def install(self, mesh: jax.sharding.Mesh, trees, replicated, placement: Placement, tables) -> None:
        """Writes the moved experts and replicated arrays, hands each layer ``mesh`` and its tables
        (``eplb_resize``) and points every module's ``mesh`` at ``mesh``."""
        for layer, tree in enumerate(trees):
            self.write(layer, tree)
        graph_state.place_arrays(self._targets, replicated)
        for layer, ref in enumerate(self.layers):
            rows = {name: table[layer] for name, table in tables.items()}
            p = placement
            ref.module.eplb_resize(mesh, p.phy2log[layer], p.log2phy[layer], p.logcnt[layer], **rows)
        assert self.mesh is not None
        graph_state.repoint_meshes(self.roots, self.mesh, mesh)
        self.mesh, self.num_physical = mesh, placement.num_physical

    def restore(self, saved: graph_state.Snapshot) -> None:
        graph_state.restore(saved)

    # ------------------------------------------------------------- loads
    def load_variables(self) -> list[nnx.Variable]:
        """Every layer's load variable, in layer order."""
        return [ref.module.eplb_load_variable() for ref in self.layers]

    def take_loads(self, zeros: list[jax.Array]) -> list[jax.Array]:
        """Every layer's load since the last call; each load variable is reset to its ``zeros`` (placed once).

        A plain variable (no value hooks, not an array ref) is read and reset
        through its raw value: the same effect without the per-call copy and
        hook checks, which cost more than the window update they feed.
        """
        loads = []
        for var, zero in zip(self.load_variables(), zeros):
            if var.ref or var.has_metadata("on_get_value") or var.has_metadata("on_set_value"):
                loads.append(var.get_value())
                var.set_value(zero)
            else:
                loads.append(var.get_raw_value())
                var.set_raw_value(zero)
        return loads

    def zero_loads(self, mesh: jax.sharding.Mesh) -> list[jax.Array]:
        """Zeros for every layer's load variable, each with the layer's own sharding (so the model's jitted step
        sees one input sharding and never recompiles), placed once."""
        out = []
        for var in self.load_variables():
            value = var.get_value()
            spec = value.sharding.spec if isinstance(value.sharding, NamedSharding) else PS()
            out.append(put_host(np.zeros(value.shape, np.int32), mesh, spec))
        return out

    def placement(self, num_ranks: int) -> Placement:
        """The placement the layers' tables hold now."""
        tables = [[np.asarray(t) for t in ref.module.eplb_get_placement()] for ref in self.layers]
        return Placement.from_tables(*(np.stack(t) for t in zip(*tables)), num_ranks=num_ranks)

    def layers_to_switch(self, routing: str) -> list[MoELayerRef]:
        """The layers whose routing mode differs from ``routing``; ``ValueError`` where a layer cannot follow.

        A layer's mode is its ``routing`` attribute (``"hash"`` without one);
        switching it needs ``eplb_set_routing``. ``"lp"`` also needs an
        ``eplb_set_placement`` that takes ``replica_shares``.
        """
        to_switch = []
        for ref in self.layers:
            current = getattr(ref.module, "routing", "hash")
            if current != routing:
                if not callable(getattr(ref.module, "eplb_set_routing", None)):
                    raise ValueError(
                        f"MoE layer {ref.name} routes by {current!r} and has no eplb_set_routing(mode) to follow "
                        f"config.routing={routing!r}"
                    )
                to_switch.append(ref)
            if routing_mode(routing).shares and not _takes_keyword(ref.module.eplb_set_placement, "replica_shares"):
                raise ValueError(
                    f"config.routing={routing!r} hands every layer its replica shares, but {ref.name}.eplb_set_placement "
                    f"takes no replica_shares keyword"
                )
        return to_switch


def _check_layers(layers: list[MoELayerRef], mesh, axis: str) -> tuple[int, int]:
    """``(E, P)`` of the layers, every expert variable and load variable checked (shardings: where ``mesh``)."""
    num_ranks, sizes = (int(mesh.shape[axis]) if mesh is not None else None), set()
    for ref in layers:
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
                leading.add(check_slot_leaf(f"{ref.name}/{name}", value, num_physical=None, mesh=mesh, axis=axis))
        if len(leading) != 1:
            raise ValueError(f"expert variables of {ref.name} disagree on the slot axis size: {sorted(leading)}")
        num_physical = leading.pop()
        if num_physical < num_logical:
            raise ValueError(f"{ref.name}: {num_physical} slots for {num_logical} logical experts")
        sizes.add((num_logical, num_physical))
        if num_ranks is None:
            continue
        if num_physical % num_ranks:
            raise ValueError(f"{ref.name}: P={num_physical} slots are not divisible by EP size {num_ranks}")
        load = ref.module.eplb_load_variable().get_value()
        if tuple(load.shape) not in ((num_physical,), (num_ranks, num_physical)):
            raise ValueError(
                f"{ref.name}: load variable must have shape [P]=({num_physical},) or "
                f"[G, P]=({num_ranks}, {num_physical}), got {load.shape}"
            )
    if len(sizes) != 1:
        raise ValueError(f"MoE layers disagree on (E, P): {sorted(sizes)}")
    return sizes.pop()


def _optimizer_variables(model, optimizer, layers: list[MoELayerRef], num_physical: int) -> list[list[nnx.Variable]]:
    """Per layer, the optimizer-state variables that mirror its expert variables (same path suffix, [P] axis)."""
    model_paths = variable_paths(model)
    expert_paths = [{model_paths[id(v)] for v in ref.module.eplb_expert_variables().values()} for ref in layers]
    found: list[list[nnx.Variable]] = [[] for _ in layers]
    for path, node in nnx.iter_graph(optimizer):
        if not isinstance(node, nnx.Variable) or isinstance(node, nnx.Param):
            continue
        value = node.get_value()
        if not isinstance(value, jax.Array) or value.ndim < 1 or value.shape[0] != num_physical:
            continue
        for layer, paths in enumerate(expert_paths):
            if any(len(path) > len(p) and tuple(path[-len(p) :]) == p for p in paths):
                found[layer].append(node)
                break
    return found


def _takes_keyword(method, name: str) -> bool:
    """Whether ``method`` accepts the keyword argument ``name`` (by name or through ``**kwargs``)."""
    try:
        parameters = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): let the call decide
        return True
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return any(p.kind == inspect.Parameter.VAR_KEYWORD or (p.name == name and p.kind in kinds) for p in parameters)

"""An NNX graph's state as a resize sees it: its replicated arrays on a mesh, and a snapshot to roll back to.

A resize moves a whole model (and its optimizer) to another mesh: the MoE layers' expert variables move by the
transport's plan, every other array on the old mesh must be replicated there and is placed anew
(:func:`replicated_arrays`, :func:`place_arrays`), and every module attribute naming the old mesh names the
new one (:func:`repoint_meshes`). :func:`snapshot` / :func:`restore` keep every variable's raw value and every
object's plain attributes, so a failed resize puts the graph back exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

__all__ = ["ReplicatedTarget", "Snapshot", "place_arrays", "replicated_arrays", "repoint_meshes", "restore", "snapshot"]


def _nodes(roots) -> tuple[list[tuple[str, nnx.Variable]], list[nnx.Pytree]]:
    """Every variable (with its path) and every module / optimizer reachable from ``roots``, each once."""
    variables, objects, seen = [], [], set()
    for root in roots:
        for path, node in nnx.iter_graph(root):
            if id(node) in seen:
                continue
            seen.add(id(node))
            if isinstance(node, nnx.Variable):
                variables.append(("/".join(str(p) for p in path) or "<root>", node))
            elif isinstance(node, nnx.Pytree):
                objects.append(node)
    return variables, objects


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Every variable's raw value and every object's plain (non-underscore) attributes, by reference."""

    values: tuple[tuple[nnx.Variable, object], ...]
    attributes: tuple[tuple[nnx.Pytree, dict], ...]


def snapshot(roots) -> Snapshot:
    variables, objects = _nodes(roots)
    attributes = [(obj, {k: v for k, v in vars(obj).items() if not k.startswith("_")}) for obj in objects]
    return Snapshot(tuple((var, var.get_raw_value()) for _, var in variables), tuple(attributes))


def restore(saved: Snapshot) -> None:
    """Puts every saved attribute and variable value back (only assignments: the old arrays were kept)."""
    for obj, attributes in saved.attributes:
        for name, value in attributes.items():
            if getattr(obj, name, None) is not value:
                setattr(obj, name, value)
    for var, value in saved.values:
        var.set_raw_value(value)


@dataclasses.dataclass(frozen=True)
class ReplicatedTarget:
    """A variable whose value holds arrays replicated over the old mesh: its value's structure and which of its
    leaves are those arrays."""

    variable: nnx.Variable
    treedef: object
    positions: tuple[int, ...]


def _on_mesh(leaf, mesh: Mesh) -> bool:
    sharding = getattr(leaf, "sharding", None)
    return isinstance(sharding, NamedSharding) and sharding.mesh == mesh


def replicated_arrays(roots, mesh: Mesh, skip: set[int]) -> tuple[list[ReplicatedTarget], list[jax.Array]]:
    """The arrays on ``mesh`` of every variable of ``roots`` but those in ``skip`` (ids), all replicated.

    ``ValueError`` naming a variable with an array sharded over ``mesh``: it
    is no expert variable, so it cannot follow a resize. Arrays placed
    elsewhere (one device, another mesh) are left where they are.
    """
    targets, arrays = [], []
    for path, var in _nodes(roots)[0]:
        if id(var) in skip:
            continue
        leaves, treedef = jax.tree.flatten(var.get_raw_value())
        positions = []
        for i, leaf in enumerate(leaves):
            if not _on_mesh(leaf, mesh):
                continue
            if not leaf.sharding.is_fully_replicated:
                raise ValueError(
                    f"variable {path} is sharded over the mesh ({leaf.sharding.spec}) and is no expert variable: "
                    "it cannot follow a resize (only expert variables are sharded over EP; the rest is replicated)"
                )
            positions.append(i)
            arrays.append(leaf)
        if positions:
            targets.append(ReplicatedTarget(var, treedef, tuple(positions)))
    return targets, arrays


def place_arrays(targets: Sequence[ReplicatedTarget], arrays: Sequence[jax.Array]) -> None:
    """Writes ``arrays`` (in :func:`replicated_arrays`' order) into their variables."""
    values = iter(arrays)
    for target in targets:
        leaves = jax.tree.leaves(target.variable.get_raw_value())
        for i in target.positions:
            leaves[i] = next(values)
        target.variable.set_raw_value(jax.tree.unflatten(target.treedef, leaves))


def repoint_meshes(roots, mesh: Mesh, new_mesh: Mesh) -> None:
    """Every module whose ``mesh`` attribute is ``mesh`` gets ``new_mesh``."""
    modules: list[Any] = _nodes(roots)[1]  # any module may name the mesh
    for obj in modules:
        if getattr(obj, "mesh", None) == mesh:
            obj.mesh = new_mesh

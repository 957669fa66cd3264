"""Finds every EPLB MoE layer of a Flax NNX model, however deeply nested.

A wrapper (say a vision-language model whose language model holds the MoE
layers) implements nothing: the search walks the whole module graph.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx

from moe_eplb_jax.flax.protocol import EplbMoE

__all__ = ["MoELayerRef", "find_moe_layers", "variable_paths"]


@dataclasses.dataclass(frozen=True)
class MoELayerRef:
    """One MoE layer: its path in the model graph and the module itself."""

    path: tuple
    module: Any

    @property
    def name(self) -> str:
        return "/".join(str(p) for p in self.path) or "<root>"


def find_moe_layers(model) -> list[MoELayerRef]:
    """Every module of ``model`` implementing :class:`EplbMoE`, in graph order (layer ``l`` of the tables).

    Raises ``ValueError`` when ``model`` is not an ``nnx.Module`` or holds no MoE layer.
    """
    if not isinstance(model, nnx.Module):
        raise ValueError(f"model must be a flax.nnx.Module, got {type(model).__name__}")
    found = [
        MoELayerRef(tuple(path), module) for path, module in nnx.iter_modules(model) if isinstance(module, EplbMoE)
    ]
    if not found:
        raise ValueError(
            f"{type(model).__name__} holds no MoE layer: no module implements the EplbMoE protocol "
            "(eplb_num_logical_experts, eplb_expert_variables, eplb_load_variable, eplb_get_placement, "
            "eplb_set_placement)"
        )
    # A module reachable by two paths is one layer: keep its first path.
    seen, unique = set(), []
    for ref in sorted(found, key=lambda r: _path_key(r.path)):
        if id(ref.module) not in seen:
            seen.add(id(ref.module))
            unique.append(ref)
    return unique


def variable_paths(root) -> dict[int, tuple]:
    """``id(variable) -> path`` of every ``nnx.Variable`` reachable from ``root`` (first path wins)."""
    paths: dict[int, tuple] = {}
    for path, node in nnx.iter_graph(root):
        if isinstance(node, nnx.Variable) and id(node) not in paths:
            paths[id(node)] = tuple(path)
    return paths


def _path_key(path) -> tuple:
    # Graph order with numeric list indices compared as numbers ("layers/10" after "layers/9").
    return tuple((0, p, "") if isinstance(p, int) else (1, 0, str(p)) for p in path)

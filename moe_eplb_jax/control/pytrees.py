"""The functional API's pytrees: which params leaves are experts, the route tables a jitted step reads, the state.

* ``ExpertLayout`` -- the ``"/"``-joined paths of each MoE layer's per-expert leaves;
* ``RouteTables`` -- every layer's routing tables on the mesh (``moe_apply``'s arguments), rebuilt per placement;
* ``BalanceState`` -- the load window (``EplbState``, per-rank rows) and the route tables, one pytree;
* ``PytreeStore`` -- the ``ExpertStore`` a ``Balancer`` moves flattened params and optimizer state through.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
from jax.sharding import NamedSharding

from moe_eplb_jax.control.loop import check_slot_leaf
from moe_eplb_jax.control.window import host_value
from moe_eplb_jax.placement import Placement
from moe_eplb_jax.routing import equal_shares, mode_lookup, routing_mode
from moe_eplb_jax.state import EplbState
from moe_eplb_jax.transport.mesh import put_host

__all__ = ["BalanceState", "ExpertLayout", "PytreeStore", "RouteTables", "path_names"]


def _key_name(key) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_names(path) -> tuple[str, ...]:
    """A jax key path as a tuple of names (dict keys, sequence indices, attribute names)."""
    return tuple(_key_name(k) for k in path)


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """Which leaves of a params pytree are per-expert, per MoE layer.

    ``layers[l]``: the ``"/"``-joined paths of layer ``l``'s per-expert leaves
    (each ``[P, ...]``, the slot axis sharded over EP), e.g.
    ``("layers/0/experts/w_in", "layers/0/experts/w_out")``.
    """

    layers: tuple[tuple[str, ...], ...]

    def __post_init__(self):
        if not self.layers or any(not layer for layer in self.layers):
            raise ValueError("ExpertLayout.layers must name at least one leaf for each of at least one layer")
        paths = [p for layer in self.layers for p in layer]
        if any(not isinstance(p, str) for p in paths) or len(set(paths)) != len(paths):
            raise ValueError("ExpertLayout.layers must hold distinct path strings")

    @classmethod
    def match(cls, params, pattern: str) -> ExpertLayout:
        """The leaves whose path matches ``pattern`` (``re.search``); its first group numbers the layer.

        Layers are ordered by that number (``layers/3/...`` after
        ``layers/1/...``), so MoE layers among dense ones need no renumbering.
        """
        regex = re.compile(pattern)
        if regex.groups < 1:
            raise ValueError(f"pattern {pattern!r} needs a group that captures the layer number")
        found: dict[int, list[str]] = {}
        for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
            name = "/".join(path_names(path))
            m = regex.search(name)
            if m is None:
                continue
            try:
                number = int(m.group(1))
            except (TypeError, ValueError):
                raise ValueError(f"pattern {pattern!r}: group 1 of {name!r} is not a layer number") from None
            found.setdefault(number, []).append(name)
        if not found:
            raise ValueError(f"no leaf of params matches {pattern!r}")
        return cls(tuple(tuple(found[number]) for number in sorted(found)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RouteTables:
    """Every layer's routing tables, replicated: what layer ``l`` passes to ``moe_apply`` is row ``l``.

    ``phy2log [L, P]``, ``log2phy [L, E, S]``, ``logcnt [L, E]`` int32,
    ``replica_shares [L, E, S]`` float32 (``moe_apply(..., routing="lp",
    replica_shares=...)``: the LP shares solved at each rearrangement; equal
    shares until the first one and in the other modes) and ``lookup [L, K]``,
    the ``map_and_count`` lookup table of each layer
    (``moe_eplb_jax.routing.mode_lookup``, built once per placement; for
    ``"lp"`` it carries the shares' alias table).
    """

    phy2log: jax.Array
    log2phy: jax.Array
    logcnt: jax.Array
    replica_shares: jax.Array
    lookup: jax.Array

    @classmethod
    def build(
        cls, placement: Placement, mesh: jax.sharding.Mesh, *, routing: str = "hash", replica_shares=None
    ) -> RouteTables:
        """The tables of ``placement`` for ``routing``; ``replica_shares [L, E, S]`` (``None``: equal shares)."""
        p = placement.to_numpy()
        shares = _shares_or_equal(replica_shares, p)
        lookup = np.stack(
            [
                mode_lookup(routing, p.log2phy[i], p.logcnt[i], replica_shares=shares[i], num_physical=p.num_physical)
                for i in range(p.num_layers)
            ]
        )
        return cls(*(put_host(t, mesh) for t in (p.phy2log, p.log2phy, p.logcnt, shares, lookup)))

    def updated(
        self, placement: Placement, mesh: jax.sharding.Mesh, *, routing: str, replica_shares=None
    ) -> RouteTables:
        """The tables of ``placement`` and ``replica_shares`` (``None``: equal shares) for ``routing``, the lookup
        rebuilt only for the layers whose tables changed."""
        p, old = placement.to_numpy(), self.placement()
        shares = _shares_or_equal(replica_shares, p)
        lookup = np.array(host_value(self.lookup))
        changed = (p.log2phy != old.log2phy).any((1, 2)) | (p.logcnt != old.logcnt).any(1)
        if routing_mode(routing).shares:  # its lookup carries the shares
            changed |= (shares != np.asarray(host_value(self.replica_shares))).any((1, 2))
        for layer in np.flatnonzero(changed):
            lookup[layer] = mode_lookup(
                routing, p.log2phy[layer], p.logcnt[layer], replica_shares=shares[layer], num_physical=p.num_physical
            )
        return RouteTables(*(put_host(t, mesh) for t in (p.phy2log, p.log2phy, p.logcnt, shares, lookup)))

    def host_tables(self, routing: str) -> dict[str, np.ndarray]:
        """The routing tables ``routing`` reads, on the host (name -> ``[L, ...]``, as a ``Rearrangement`` holds them)."""
        return (
            {"replica_shares": np.asarray(host_value(self.replica_shares), np.float32)}
            if routing_mode(routing).shares
            else {}
        )

    def placement(self) -> Placement:
        """The host ``Placement`` these tables route with."""
        return Placement(*(np.asarray(host_value(t), np.int32) for t in (self.phy2log, self.log2phy, self.logcnt)))


def _shares_or_equal(replica_shares, placement: Placement) -> np.ndarray:
    if replica_shares is None:
        return equal_shares(placement.logcnt, placement.log2phy.shape[2])
    shares = np.asarray(replica_shares, np.float32)
    if shares.shape != placement.log2phy.shape:
        raise ValueError(f"replica_shares must have shape [L, E, S] = {placement.log2phy.shape}, got {shares.shape}")
    return shares


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BalanceState:
    """The functional EPLB state: the load window (per-rank rows) and the route tables."""

    loads: EplbState
    tables: RouteTables


class PytreeStore:
    """An ``ExpertStore`` over flattened params / optimizer state and host route tables (switched row by row)."""

    def __init__(self, params, opt_state, placement: Placement, routing_tables, positions, mesh=None):
        self.params, self.params_def = jax.tree.flatten(params)
        self.opt, self.opt_def = jax.tree.flatten(opt_state)
        self.positions = positions  # per layer: (params positions, opt positions)
        p = placement.to_numpy()
        self.tables = [p.phy2log.copy(), p.log2phy.copy(), p.logcnt.copy()]
        self.routing_tables = {name: np.array(table) for name, table in routing_tables.items()}
        self.mesh = mesh  # where the pytrees live (a resize moves them whole)
        self._replicated: list[tuple[str, int]] = []

    @staticmethod
    def positions_of(params, opt_state, layout: ExpertLayout, *, mesh, axis: str) -> tuple[list, int]:
        """Per layer, the flat positions of its expert leaves in ``params`` and of their mirrors in ``opt_state``
        (the leaves whose path ends with an expert leaf's path), every leaf checked; and ``P``."""
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        where = {"/".join(path_names(path)): i for i, (path, _) in enumerate(flat)}
        layers, owner, num_physical = [], {}, None
        for layer, names in enumerate(layout.layers):
            found = []
            for name in names:
                if name not in where:
                    raise ValueError(f"params has no leaf {name!r} (from the expert layout)")
                leaf = flat[where[name]][1]
                num_physical = check_slot_leaf(f"params/{name}", leaf, num_physical=num_physical, mesh=mesh, axis=axis)
                found.append(where[name])
                owner[tuple(name.split("/"))] = layer
            layers.append((found, []))
        assert num_physical is not None
        for i, (path, leaf) in enumerate(jax.tree_util.tree_flatten_with_path(opt_state)[0]):
            names = path_names(path)
            for suffix, layer in owner.items():
                if len(names) > len(suffix) and names[-len(suffix) :] == suffix:
                    label = "opt_state/" + "/".join(names)
                    check_slot_leaf(label, leaf, num_physical=num_physical, mesh=mesh, axis=axis)
                    layers[layer][1].append(i)
                    break
        return layers, num_physical

    def read(self, layer):
        params, opt = self.positions[layer]
        return {"experts": [self.params[i] for i in params], "opt": [self.opt[i] for i in opt]}

    def write(self, layer, tree):
        params, opt = self.positions[layer]
        for i, value in zip(params, tree["experts"]):
            self.params[i] = value
        for i, value in zip(opt, tree["opt"]):
            self.opt[i] = value

    def switch(self, layer, placement, tables):
        for mine, theirs in zip(self.tables, (placement.phy2log, placement.log2phy, placement.logcnt)):
            mine[layer] = theirs[layer]
        for name, table in tables.items():
            self.routing_tables[name][layer] = table[layer]

    def placement(self) -> Placement:
        return Placement(*self.tables)

    # ------------------------------------------------------------ resize
    def replicated(self) -> list[jax.Array]:
        """Every params / optimizer leaf on the mesh but the expert leaves and their mirrors (all replicated);
        ``ValueError`` naming a non-expert leaf sharded over the mesh (it cannot follow a resize)."""
        experts = {("params", i) for ps, _ in self.positions for i in ps}
        experts |= {("opt", i) for _, os in self.positions for i in os}
        assert self.mesh is not None, "a store for a resize knows its mesh"
        self._replicated, arrays = [], []
        for kind, leaves in (("params", self.params), ("opt", self.opt)):
            for i, leaf in enumerate(leaves):
                sharding = getattr(leaf, "sharding", None)
                if (kind, i) in experts or not isinstance(sharding, NamedSharding):
                    continue
                if sharding.mesh != self.mesh:
                    continue
                if not sharding.is_fully_replicated:
                    raise ValueError(
                        f"{kind} leaf {i} (shape {leaf.shape}) is sharded over the mesh ({sharding.spec}) and is no "
                        "expert leaf: it cannot follow a resize"
                    )
                self._replicated.append((kind, i))
                arrays.append(leaf)
        return arrays

    def save(self):
        return list(self.params), list(self.opt), [t.copy() for t in self.tables], dict(self.routing_tables), self.mesh

    def install(self, mesh, trees, replicated, placement: Placement, tables) -> None:
        for layer, tree in enumerate(trees):
            self.write(layer, tree)
        for (kind, i), value in zip(self._replicated, replicated):
            (self.params if kind == "params" else self.opt)[i] = value
        p = placement.to_numpy()
        self.tables = [p.phy2log.copy(), p.log2phy.copy(), p.logcnt.copy()]
        self.routing_tables = {name: np.array(table) for name, table in tables.items()}
        self.mesh = mesh

    def restore(self, saved) -> None:
        self.params, self.opt, self.tables, self.routing_tables, self.mesh = saved

    def pytrees(self):
        return jax.tree.unflatten(self.params_def, self.params), jax.tree.unflatten(self.opt_def, self.opt)

"""EPLB over plain pytrees: params, optax state and a ``BalanceState``, for a functional (Linen/MaxText-style) step.

Record inside the jitted step, decide and move outside it::

    layout = ExpertLayout.match(params, r"layers/(\\d+)/experts/")   # which leaves are per-expert, per layer
    balancer = Balancer(config, mesh, layout)
    balance = balancer.init(params)          # load window (per-rank rows) + route tables [L, ...]

    @jax.jit
    def train_step(params, opt_state, balance, batch):
        t = balance.tables                  # layer l: moe_apply(..., t.log2phy[l], t.logcnt[l], lookup=t.lookup[l],
        ...                                 #   routing=config.routing, replica_shares=t.replica_shares[l])
        balance = balancer.record_step(balance, loads)   # loads: per layer [G, P] from moe_apply
        return params, opt_state, balance, loss

    for batch in data:
        params, opt_state, balance, loss = train_step(params, opt_state, balance, batch)
        if balancer.is_due(balance):
            params, opt_state, balance, report = balancer.rearrange(params, opt_state, balance)

``rearrange`` moves every layer's experts and their optimizer moments (the
optimizer-state leaves whose path ends with an expert leaf's path) at one
step boundary; with ``config.overlap`` set, ``decide`` then ``advance`` once
per step moves a layer (or a byte budget) at a time instead, each layer
switching tables with its bytes. ``config.routing`` is honoured: ``"lp"``
shares are solved from the window at every rearrangement and switch with each
layer's placement row; ``"quota"`` rearrangements are the ``"online"``
policy's spare-slot refreshes. Moves are atomic (``control.moves``): on
failure the inputs are untouched, and ``RearrangementError.restored`` holds
``(params, opt_state, balance)`` on the old placement. Extra memory: the new
copies of the layers moved in one call, as long as the caller still holds its
inputs (``advance`` keeps that to one layer or the byte budget).
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from moe_eplb_jax.config import EplbConfig
from moe_eplb_jax.control import checkpoint as _checkpoint
from moe_eplb_jax.control.moves import Mover, Rearrangement, RearrangementError
from moe_eplb_jax.control.window import LoadWindow, close_step, host_value
from moe_eplb_jax.placement import Placement
from moe_eplb_jax.policy import compute_placement
from moe_eplb_jax.routing import equal_shares, stacked_routing_tables
from moe_eplb_jax.state import EplbState
from moe_eplb_jax.transport.mesh import put_host

__all__ = [
    "BalanceState",
    "Balancer",
    "ExpertLayout",
    "RouteTables",
    "check_slot_leaf",
    "rehearsal_load",
    "rehearsal_targets",
]


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
    (``moe_eplb_jax.routing._map_and_count.lookup_table``, built once per placement; for
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
        lookup = np.stack([_lookup(routing, p, shares, layer) for layer in range(p.num_layers)])
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
        if routing == "lp":  # its lookup carries the shares
            changed |= (shares != np.asarray(host_value(self.replica_shares))).any((1, 2))
        for layer in np.flatnonzero(changed):
            lookup[layer] = _lookup(routing, p, shares, int(layer))
        return RouteTables(*(put_host(t, mesh) for t in (p.phy2log, p.log2phy, p.logcnt, shares, lookup)))

    def host_tables(self, routing: str) -> dict[str, np.ndarray]:
        """The routing tables ``routing`` reads, on the host (name -> ``[L, ...]``, as a ``Rearrangement`` holds them)."""
        return {"replica_shares": np.asarray(host_value(self.replica_shares), np.float32)} if routing == "lp" else {}

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


def _lookup(routing: str, placement: Placement, shares: np.ndarray, layer: int) -> np.ndarray:
    """One layer's ``map_and_count`` lookup table (with the alias table of its shares for ``"lp"``)."""
    from moe_eplb_jax.routing import lookup_table

    log2phy, logcnt = placement.log2phy[layer], placement.logcnt[layer]
    if routing == "lp":
        return np.asarray(
            lookup_table(log2phy, logcnt, replica_shares=shares[layer], num_physical=placement.num_physical)
        )
    return np.asarray(lookup_table(log2phy, logcnt))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BalanceState:
    """The functional EPLB state: the load window (per-rank rows) and the route tables."""

    loads: EplbState
    tables: RouteTables


def check_slot_leaf(name: str, value, *, num_physical: int | None, mesh, axis: str) -> int:
    """``ValueError`` unless ``value`` is a ``jax.Array`` ``[P, ...]`` whose slot axis is sharded over ``axis``.

    Returns its ``P`` (which must equal ``num_physical`` when given).
    """
    if not isinstance(value, jax.Array) or value.ndim < 1:
        raise ValueError(f"expert leaf {name} must be a jax.Array with a leading slot axis [P, ...]")
    if num_physical is not None and value.shape[0] != num_physical:
        raise ValueError(f"expert leaf {name} has {value.shape[0]} slots, its layers have P={num_physical}")
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


class _PytreeStore:
    """An ``ExpertStore`` over flattened params / optimizer state and host route tables (switched row by row)."""

    def __init__(self, params, opt_state, placement: Placement, routing_tables, positions):
        self.params, self.params_def = jax.tree.flatten(params)
        self.opt, self.opt_def = jax.tree.flatten(opt_state)
        self.positions = positions  # per layer: (params positions, opt positions)
        p = placement.to_numpy()
        self.tables = [p.phy2log.copy(), p.log2phy.copy(), p.logcnt.copy()]
        self.routing_tables = {name: np.array(table) for name, table in routing_tables.items()}

    def read(self, layer):
        params, opt = self.positions[layer]
        return {"params": [self.params[i] for i in params], "opt": [self.opt[i] for i in opt]}

    def write(self, layer, tree):
        params, opt = self.positions[layer]
        for i, value in zip(params, tree["params"]):
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

    def pytrees(self):
        return jax.tree.unflatten(self.params_def, self.params), jax.tree.unflatten(self.opt_def, self.opt)


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
        self.window: LoadWindow | None = None
        self.mover: Mover | None = None

    # ------------------------------------------------------------- set-up
    def _sizes(self, num_physical: int) -> None:
        """Fixes ``P`` (and ``E = P - R``) at first use; later pytrees must agree."""
        if self.window is not None:
            if num_physical != self.num_physical:
                raise ValueError(f"expert leaves have P={num_physical} slots, this balancer P={self.num_physical}")
            return
        num_logical = num_physical - self.config.num_redundant_experts
        if num_logical < 1:
            raise ValueError(
                f"P={num_physical} slots leave no logical expert with num_redundant_experts="
                f"{self.config.num_redundant_experts}"
            )
        self.config.num_physical(num_logical)  # divisibility by the EP size and the expert groups
        self.num_physical, self.num_logical = num_physical, num_logical
        self.window = LoadWindow(self.config, self.mesh, self.num_layers, num_physical, self.axis)
        self.mover = Mover(self.mesh, self.axis, num_logical, num_physical)

    def _positions(self, params, opt_state) -> list[tuple[list[int], list[int]]]:
        """Per layer, the flat positions of its expert leaves in ``params`` and of their mirrors in ``opt_state``."""
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        where = {"/".join(path_names(path)): i for i, (path, _) in enumerate(flat)}
        layers, owner, num_physical = [], {}, None
        for layer, names in enumerate(self.layout.layers):
            found = []
            for name in names:
                if name not in where:
                    raise ValueError(f"params has no leaf {name!r} (from the expert layout)")
                num_physical = check_slot_leaf(
                    f"params/{name}", flat[where[name]][1], num_physical=num_physical, mesh=self.mesh, axis=self.axis
                )
                found.append(where[name])
                owner[tuple(name.split("/"))] = layer
            layers.append((found, []))
        assert num_physical is not None
        self._sizes(num_physical)
        for i, (path, leaf) in enumerate(jax.tree_util.tree_flatten_with_path(opt_state)[0]):
            names = path_names(path)
            for suffix, layer in owner.items():
                if len(names) > len(suffix) and names[-len(suffix) :] == suffix:
                    label = "opt_state/" + "/".join(names)
                    check_slot_leaf(label, leaf, num_physical=self.num_physical, mesh=self.mesh, axis=self.axis)
                    layers[layer][1].append(i)
                    break
        return layers

    def init(self, params, *, placement: Placement | None = None) -> BalanceState:
        """A fresh state for ``params``, whose experts are on ``placement`` (default: linear, slot ``p`` holds ``p mod E``).

        No load is known yet: ``"lp"`` starts from equal replica shares.
        """
        self._positions(params, ())
        if placement is None:
            placement = Placement.linear(self.num_layers, self.num_logical, self.num_physical)
        self._check_placement(placement)
        assert self.window is not None
        return BalanceState(self.window.fresh(), self._tables(placement))

    def _tables(self, placement: Placement, replica_shares=None) -> RouteTables:
        return RouteTables.build(placement, self.mesh, routing=self.config.routing, replica_shares=replica_shares)

    def _check_placement(self, placement: Placement) -> None:
        want = (self.num_layers, self.num_logical, self.num_physical)
        got = (placement.num_layers, placement.num_logical, placement.num_physical)
        if got != want:
            raise ValueError(f"placement is for (L, E, P) = {got} but the model has (L, E, P) = {want}")
        placement.validate(num_ranks=self.num_ranks)

    # -------------------------------------------------------------- steps
    @staticmethod
    def record_step(balance: BalanceState, loads, *, dummy=False) -> BalanceState:
        """Records one step's loads (one ``[G, P]`` or ``[P]`` per layer) and closes the step; call it in the jitted step.

        ``dummy`` (may be traced) advances the counters without recording, e.g.
        on a step whose loads must not count. No collective: each rank writes
        its own rows.
        """
        return dataclasses.replace(balance, loads=close_step(balance.loads, loads, dummy=dummy))

    def is_due(self, balance: BalanceState) -> bool:
        """Whether a rearrangement is due (reads two counters from the device: a sync)."""
        step, count = (int(host_value(x)) for x in (balance.loads.step, balance.loads.num_rearrangements))
        return step >= (self.config.first_rearrangement_step if count == 0 else self.config.rearrange_interval)

    def window_slot_load(self, balance: BalanceState) -> np.ndarray:
        """``[L, P]`` tokens per slot summed over the load window and the EP ranks (under the current placement).

        float64 on the host, summed in float32 on the device (no int32 wrap; see ``state.window_slot_load``).
        """
        self._need_sizes()
        assert self.window is not None
        return np.asarray(host_value(self.window.slot_load(balance.loads)), np.float64)

    # ------------------------------------------------------------- moves
    def decide(self, balance: BalanceState, *, placement: Placement | None = None) -> Rearrangement:
        """The rearrangement from the current placement to ``placement`` or, by default, the policy's for the window.

        It carries the routing tables of both sides (``"lp"``: the current
        shares, and the shares solved for the new placement from the window's
        logical loads), each layer switching to its new row with its bytes.
        """
        self._need_sizes()
        assert self.window is not None
        current = balance.tables.placement()
        logical = self.window.logical_load(balance.loads, current.phy2log, self.num_logical)
        if placement is None:
            placement = compute_placement(logical, self.config, old_phy2log=current.phy2log)
        self._check_placement(placement)
        return Rearrangement.between(
            current,
            placement,
            num_ranks=self.num_ranks,
            old_tables=balance.tables.host_tables(self.config.routing),
            new_tables=stacked_routing_tables(self.config.routing, logical, placement, num_ranks=self.num_ranks),
            load=logical,
        )

    def rearrange(self, params, opt_state, balance: BalanceState, *, placement: Placement | None = None):
        """Decides and moves every layer now: ``(params, opt_state, balance, report)``.

        ``report``: ``rearranged``, the balancedness of the window's load before
        and (predicted) after, and :meth:`Rearrangement.summary` (slots and
        bytes moved, seconds, GB/s).
        """
        rearrangement = self.decide(balance, placement=placement)
        params, opt_state, balance, rearrangement = self._run(
            params, opt_state, balance, rearrangement, rearrangement.pending, defer_switch=True
        )
        return params, opt_state, *self._finish(balance, rearrangement)

    def advance(self, params, opt_state, balance: BalanceState, rearrangement: Rearrangement):
        """Moves the next layer (``config.overlap="layer"``), the next byte budget (an int) or every pending layer.

        Returns ``(params, opt_state, balance, rearrangement, report)``:
        ``report`` is ``None`` until the last layer has moved, then as for
        :meth:`rearrange` (the window is reset then). Each moved layer's tables
        switch with its bytes, so the model is consistent after every call.
        """
        overlap, pending = self.config.overlap, rearrangement.pending
        layers = pending[:1] if overlap == "layer" else pending
        budget = overlap if isinstance(overlap, int) else None
        params, opt_state, balance, rearrangement = self._run(
            params, opt_state, balance, rearrangement, layers, budget=budget
        )
        if not rearrangement.done:
            return params, opt_state, balance, rearrangement, None
        balance, report = self._finish(balance, rearrangement)
        return params, opt_state, balance, rearrangement, report

    def _run(self, params, opt_state, balance, rearrangement, layers, *, defer_switch=False, budget=None):
        positions = self._positions(params, opt_state)
        store = _PytreeStore(params, opt_state, rearrangement.current, rearrangement.current_tables, positions)
        assert self.mover is not None
        try:
            rearrangement = self.mover.run(store, rearrangement, layers, defer_switch=defer_switch, budget=budget)
        except RearrangementError as error:
            restored = (*store.pytrees(), dataclasses.replace(balance, tables=self._updated(balance, store)))
            raise RearrangementError(str(error), restored) from error.__cause__
        params, opt_state = store.pytrees()
        balance = dataclasses.replace(balance, tables=self._updated(balance, store))
        return params, opt_state, balance, rearrangement

    def _updated(self, balance: BalanceState, store: _PytreeStore) -> RouteTables:
        shares = store.routing_tables.get("replica_shares")
        return balance.tables.updated(store.placement(), self.mesh, routing=self.config.routing, replica_shares=shares)

    def _finish(self, balance: BalanceState, rearrangement: Rearrangement) -> tuple[BalanceState, dict]:
        assert self.window is not None
        loads = self.window.mark_rearranged(balance.loads)
        report = {"rearranged": True, **rearrangement.summary(self.num_ranks)}
        return dataclasses.replace(balance, loads=loads), report

    def warmup(self, params, opt_state, balance: BalanceState, *, load=None) -> dict[str, Any]:
        """Compiles the mover and the readers a rearrangement uses, moving nothing.

        Plans the moves to the policy's placements for ``load`` (``[L, E]``;
        default: four :func:`rehearsal_load` s), pads every later plan to
        their largest send capacity, runs these moves without keeping their
        results, and runs the window readers and the route-table build once.
        Returns ``seconds`` and the mover's ``send_capacity``.
        """
        start = time.perf_counter()
        positions = self._positions(params, opt_state)
        assert self.window is not None and self.mover is not None
        current = balance.tables.placement()
        targets = rehearsal_targets(self.config, current, load)
        tables = balance.tables.host_tables(self.config.routing)
        info = self.mover.rehearse(_PytreeStore(params, opt_state, current, tables, positions), current, targets)
        self.window.logical_load(balance.loads, current.phy2log, self.num_logical)
        jax.block_until_ready(self.window.mark_rearranged(balance.loads))
        # What a rearrangement runs on the host: the routing tables' solve (a skewed load, so "lp" solves) and the
        # lookup build.
        rehearsed = rehearsal_load(self.num_layers, self.num_logical) if load is None else np.asarray(load)
        solved = stacked_routing_tables(self.config.routing, rehearsed, targets[0], num_ranks=self.num_ranks)
        shares = solved.get("replica_shares")
        balance.tables.updated(targets[0], self.mesh, routing=self.config.routing, replica_shares=shares)
        return {"seconds": time.perf_counter() - start, **info}

    # ------------------------------------------------------ files, checkpoints
    def dump_loads(self, balance: BalanceState, path: str | os.PathLike) -> None:
        """Writes the window's per-step logical loads ``[steps, L, E]`` as a load file ``moe-eplb fit`` reads."""
        from moe_eplb_jax.sim.loadfile import save_load

        self._need_sizes()
        assert self.window is not None
        rows = self.window.logical_rows(balance.loads, balance.tables.placement().phy2log, self.num_logical)
        if not len(rows):
            raise ValueError("the load window is empty: record at least one step before dump_loads")
        save_load(path, rows, num_ranks=self.num_ranks)

    def checkpoint_item(self, balance: BalanceState) -> dict[str, np.ndarray]:
        """The Orbax item of ``balance`` (``moe_eplb_jax.control.checkpoint``)."""
        self._need_sizes()
        assert self.window is not None
        host = self.window.host_summed(balance.loads)
        shares = np.asarray(host_value(balance.tables.replica_shares), np.float32)
        return _checkpoint.to_item(_checkpoint.Snapshot(self.config, balance.tables.placement(), shares, host))

    def restore_item(self, item) -> BalanceState:
        """A ``BalanceState`` from a restored item, every field validated first (``ValueError`` naming it).

        The replica shares are the item's (the shares the saved run routed with).
        """
        self._need_sizes()
        snapshot = _checkpoint.from_item(
            item,
            config=self.config,
            num_layers=self.num_layers,
            num_logical=self.num_logical,
            num_physical=self.num_physical,
        )
        assert self.window is not None
        return BalanceState(self.window.put(snapshot.state), self._tables(snapshot.placement, snapshot.replica_shares))

    def _need_sizes(self) -> None:
        if self.window is None:
            raise ValueError("the balancer has not seen its params yet: call init(params) first")

"""Atomic expert moves: a rearrangement moves layer by layer and either completes or is rolled back.

A :class:`Rearrangement` goes from one ``Placement`` to another. :meth:`Mover.run` moves some of its layers
through an :class:`ExpertStore` -- where the per-expert pytrees live (NNX variables, or plain pytrees) and how
a layer is handed its tables -- in phases, layer by layer:

1. plan: the layer's host plan (``plan_rearrangement``), padded to the capacities seen so far, so that later
   moves reuse the compiled executor;
2. move: pack, transfer and unpack (one ``execute_plan`` without donation), waited on, so a device failure
   surfaces here and not in a later step;
3. write: the moved pytree replaces the layer's (the store drops the old arrays);
4. switch: the layer gets its new tables (``ExpertStore.switch``) -- right after its bytes, or after every
   layer of the call (``defer_switch``), never before its bytes have arrived.

A failure in any phase at any layer rolls the whole rearrangement back: a layer whose write stopped partway
(some variables new, some old) gets its old pytree written back whole, every layer moved so far (in this call
or an earlier one) moves back by the inverse plan, and all of them get their old tables again, then
:class:`RearrangementError` is raised with the failure as its cause. The rollback is exact because the
replicas of an expert hold identical bytes -- the invariant the forward move relies on too.

Memory: a layer moves without donating its buffers, so its old and new pytrees coexist only while that layer
moves. The extra device memory is one layer's per-expert pytree (weights, quantization scales, optimizer
moments) plus the transport's buffers for that layer's moving rows -- provided the store holds the only
reference to the old arrays (the NNX controller's variables do; a functional caller's input pytrees keep their
arrays alive until the caller drops them).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from moe_eplb_jax import metrics
from moe_eplb_jax.placement import Placement, check_placement_size
from moe_eplb_jax.transport import TransportPlan, execute_plan, plan_rearrangement, row_bytes

__all__ = ["ExpertStore", "Mover", "Rearrangement", "RearrangementError", "rollback_failed"]


class RearrangementError(RuntimeError):
    """A rearrangement failed and was rolled back: every layer is on the old placement again.

    The failure is ``__cause__``. ``restored``: where the caller's own pytrees
    were rebuilt (the functional API), the pytrees on the old placement, e.g.
    ``(params, opt_state, balance)``; ``None`` where the store was restored in
    place (the NNX controller's model).
    """

    def __init__(self, message: str, restored: Any = None):
        super().__init__(message)
        self.restored = restored


class ExpertStore(Protocol):
    """Where each MoE layer's per-expert pytree lives, and how a layer is handed new tables."""

    def read(self, layer: int) -> Any:
        """The layer's per-expert pytree: ``jax.Array`` leaves ``[P, ...]``, the slot axis sharded over EP."""
        ...

    def write(self, layer: int, tree: Any) -> None:
        """Replaces the layer's per-expert pytree (same structure, shapes, dtypes, shardings)."""
        ...

    def switch(self, layer: int, placement: Placement, tables: Mapping[str, np.ndarray]) -> None:
        """Hands layer ``layer`` its row of ``placement`` and of each routing table (``tables``: ``[L, ...]``)."""
        ...


@dataclasses.dataclass(frozen=True)
class Rearrangement:
    """A move from ``old`` to ``new`` (host ``Placement`` s), and how far it got.

    ``old_tables`` / ``new_tables``: routing tables that go with each placement
    (name -> ``[L, ...]`` host array, e.g. LP replica shares; empty for hash
    routing), handed to each layer as it switches. ``moved``: layers moved and
    switched so far; ``seconds`` / ``bytes_moved``: time spent in the moves and
    bytes sent or received by the busiest rank, summed over layers. ``load``:
    the ``[L, E]`` logical load the new placement was computed from, if any.
    """

    old: Placement
    new: Placement
    old_tables: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)
    new_tables: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)
    moved: tuple[int, ...] = ()
    seconds: float = 0.0
    bytes_moved: int = 0
    load: np.ndarray | None = None

    @classmethod
    def between(
        cls, old: Placement, new: Placement, *, num_ranks: int, old_tables=None, new_tables=None, load=None
    ) -> Rearrangement:
        """A validated rearrangement (``ValueError`` before anything moves: shapes, tables, ranks)."""
        old, new = old.to_numpy(), new.to_numpy()
        shape = lambda p: (p.num_layers, p.num_logical, p.num_physical)
        if shape(old) != shape(new):
            raise ValueError(f"new placement is for (L, E, P) = {shape(new)}, the old one for {shape(old)}")
        new.validate(num_ranks=num_ranks)
        old_tables, new_tables = dict(old_tables or {}), dict(new_tables or {})
        if set(old_tables) != set(new_tables):
            raise ValueError(f"routing tables {sorted(new_tables)} do not match the old ones {sorted(old_tables)}")
        for name, table in (*old_tables.items(), *new_tables.items()):
            if np.shape(table)[:1] != (old.num_layers,):
                raise ValueError(f"routing table {name!r} must have a leading [L={old.num_layers}] axis")
        if load is not None:
            load = np.asarray(load, np.float64)
            if load.shape != (old.num_layers, old.num_logical):
                raise ValueError(f"load must have shape [L, E] = {(old.num_layers, old.num_logical)}, got {load.shape}")
        return cls(old, new, old_tables, new_tables, load=load)

    @functools.cached_property
    def layers(self) -> tuple[int, ...]:
        """Layers whose tables change (bytes move where ``phy2log`` changes), in order."""
        differs = np.zeros(self.old.num_layers, bool)
        old = (self.old.phy2log, self.old.log2phy, self.old.logcnt, *self.old_tables.values())
        new = (self.new.phy2log, self.new.log2phy, self.new.logcnt, *self.new_tables.values())
        for a, b in zip(old, new):
            a, b = np.asarray(a), np.asarray(b)
            differs |= (a != b).reshape(a.shape[0], -1).any(1)
        return tuple(int(layer) for layer in np.flatnonzero(differs))

    @property
    def pending(self) -> tuple[int, ...]:
        return tuple(layer for layer in self.layers if layer not in self.moved)

    @property
    def done(self) -> bool:
        return not self.pending

    @property
    def current(self) -> Placement:
        """The placement the model is on now: ``new`` for the moved layers, ``old`` for the rest."""
        moved = np.isin(np.arange(self.old.num_layers), self.moved)
        pick = lambda a, b: np.where(moved.reshape((-1,) + (1,) * (a.ndim - 1)), b, a)
        old, new = self.old, self.new
        return Placement(
            *(pick(a, b) for a, b in ((old.phy2log, new.phy2log), (old.log2phy, new.log2phy), (old.logcnt, new.logcnt)))
        )

    @property
    def current_tables(self) -> dict[str, np.ndarray]:
        """The routing tables the model routes with now: ``new_tables`` rows for the moved layers, ``old_tables``'s
        for the rest."""
        moved = np.isin(np.arange(self.old.num_layers), self.moved)
        out = {}
        for name, old in self.old_tables.items():
            old, new = np.asarray(old), np.asarray(self.new_tables[name])
            out[name] = np.where(moved.reshape((-1,) + (1,) * (old.ndim - 1)), new, old)
        return out

    @property
    def slots_moved(self) -> int:
        """Slots whose expert changes (over every layer)."""
        return int(np.sum(self.old.phy2log != self.new.phy2log))

    def summary(self, num_ranks: int) -> dict[str, Any]:
        """What a report says of this rearrangement.

        ``slots_moved``, ``layers_moved``, ``bytes_moved``, ``move_seconds``,
        ``gb_per_s`` (1e9 bytes per second of moving) and, where ``load`` is
        known, ``balancedness_before`` / ``balancedness_after`` (predicted) of
        that load and ``max_rank_imbalance_after``.
        """
        rate = self.bytes_moved / self.seconds / 1e9 if self.seconds > 0 else 0.0
        out: dict[str, Any] = {}
        if self.load is not None:
            before = metrics.rank_load_from_logical(self.load, self.old.phy2log, num_ranks)
            after = metrics.rank_load_from_logical(self.load, self.new.phy2log, num_ranks)
            out["balancedness_before"] = float(metrics.balancedness(before))
            out["balancedness_after"] = float(metrics.balancedness(after))
            out["max_rank_imbalance_after"] = float(np.max(metrics.rank_imbalance(after)))
        return {
            **out,
            "slots_moved": self.slots_moved,
            "layers_moved": len(self.moved),
            "bytes_moved": self.bytes_moved,
            "move_seconds": self.seconds,
            "gb_per_s": rate,
        }


class Mover:
    """Runs a rearrangement's layer moves atomically on ``mesh`` (see the module docstring).

    Holds the send capacity of the largest plan so far: every layer's plan is
    padded to it (and duplicates and local copies to ``P / G``, their bound),
    so plans of one rearrangement and of later ones share one compiled
    executor. :meth:`rehearse` raises it ahead and compiles (``warmup``).
    """

    def __init__(self, mesh: jax.sharding.Mesh, axis: str, num_logical: int, num_physical: int):
        self.mesh, self.axis = mesh, axis
        self.num_ranks = int(mesh.shape[axis])
        _, self.num_logical, self.num_physical = check_placement_size(1, num_logical, num_physical)
        self.send_capacity = 0

    def plan(self, old_row, new_row) -> TransportPlan:
        """Phase 1: one layer's plan (``[P]`` tables), padded to the shared capacities."""
        plan = plan_rearrangement(old_row, new_row, self.num_ranks, num_logical=self.num_logical)
        if plan.is_empty:
            return plan
        self.send_capacity = max(self.send_capacity, plan.capacities[0])
        bound = self.num_physical // self.num_ranks
        return plan.padded(send=self.send_capacity, dup=bound, copy=bound)

    def transfer(self, tree: Any, plan: TransportPlan) -> Any:
        """Phase 2: the moved pytree, waited on (``tree`` stays valid: nothing is donated)."""
        return jax.block_until_ready(execute_plan(tree, plan, mesh=self.mesh, axis=self.axis, donate=False))

    def run(
        self,
        store: ExpertStore,
        rearrangement: Rearrangement,
        layers: Sequence[int],
        *,
        defer_switch: bool = False,
        budget: int | None = None,
    ) -> Rearrangement:
        """Moves and switches ``layers`` (pending layers of ``rearrangement``, in order); returns it updated.

        ``defer_switch``: switch the layers only after all their bytes have
        arrived (a whole rearrangement at one step boundary); else each layer
        right after its bytes (layers spread over steps: every step sees
        layers whose tables match their experts). ``budget``: stop before the
        first layer whose bytes would take the bytes moved in this call past
        ``budget`` (at least one layer moves). Any failure rolls back every
        layer of ``rearrangement`` moved so far and raises
        :class:`RearrangementError`.
        """
        layers = [int(layer) for layer in layers]
        stray = sorted(set(layers) - set(rearrangement.pending))
        if stray:
            raise ValueError(f"layers {stray} are not pending in this rearrangement (pending: {rearrangement.pending})")
        start, spent, written, layer, writing = time.perf_counter(), 0, [], None, None
        try:
            for layer in layers:
                plan = self.plan(rearrangement.old.phy2log[layer], rearrangement.new.phy2log[layer])
                if not plan.is_empty:
                    tree = store.read(layer)
                    cost = plan.bytes_moved(row_bytes(tree))
                    if budget is not None and written and spent + cost > budget:
                        break
                    spent += cost
                    moved = self.transfer(tree, plan)
                    writing = (layer, tree)  # a write that stops partway leaves the layer half new: write it back
                    store.write(layer, moved)
                written.append(layer)
                writing = None
                if not defer_switch:
                    store.switch(layer, rearrangement.new, rearrangement.new_tables)
            if defer_switch:
                for layer in written:
                    store.switch(layer, rearrangement.new, rearrangement.new_tables)
        except BaseException as error:
            if writing is not None and writing[0] not in written:
                self.restore(store, *writing, error)
            self.roll_back(store, rearrangement, [*rearrangement.moved, *written], error)
            raise RearrangementError(
                f"EPLB rearrangement failed at layer {layer} and was rolled back; every layer is on its old "
                f"placement ({type(error).__name__}: {error})"
            ) from error
        return dataclasses.replace(
            rearrangement,
            moved=rearrangement.moved + tuple(written),
            seconds=rearrangement.seconds + time.perf_counter() - start,
            bytes_moved=rearrangement.bytes_moved + spent,
        )

    def restore(self, store: ExpertStore, layer: int, tree: Any, cause=None) -> None:
        """Writes ``tree``, the layer's pytree before a write that stopped partway, back whole."""
        try:
            store.write(layer, tree)
        except BaseException as error:
            raise rollback_failed(error, cause) from error

    def roll_back(self, store: ExpertStore, rearrangement: Rearrangement, layers: Sequence[int], cause=None) -> None:
        """Moves ``layers`` back from ``new`` to ``old`` and hands every one its old tables again."""
        try:
            for layer in reversed(layers):
                plan = self.plan(rearrangement.new.phy2log[layer], rearrangement.old.phy2log[layer])
                if not plan.is_empty:
                    store.write(layer, self.transfer(store.read(layer), plan))
            for layer in layers:
                store.switch(layer, rearrangement.old, rearrangement.old_tables)
        except BaseException as error:
            raise rollback_failed(error, cause) from error

    def rehearse(self, store: ExpertStore, current: Placement, targets: Sequence[Placement]) -> dict[str, Any]:
        """Compiles the executors moves from ``current`` to ``targets`` need, moving nothing (``warmup``).

        Raises the send capacity to the largest of the targets' layer plans,
        then runs every changed layer's padded move without keeping its
        result (one layer's memory at a time): each executor variant these
        plans need (chunking differs with the chains of moves) compiles now.
        Returns the capacity and the number of moves rehearsed.
        """
        moves = [
            (layer, target)
            for target in targets
            for layer in range(current.num_layers)
            if not np.array_equal(current.phy2log[layer], target.phy2log[layer])
        ]
        for layer, target in moves:  # the capacity first: every rehearsed plan is padded to the final one
            raw = plan_rearrangement(current.phy2log[layer], target.phy2log[layer], self.num_ranks)
            self.send_capacity = max(self.send_capacity, raw.capacities[0])
        for layer, target in moves:
            self.transfer(store.read(layer), self.plan(current.phy2log[layer], target.phy2log[layer]))
        return {"send_capacity": self.send_capacity, "moves": len(moves)}


def rollback_failed(error: BaseException, cause) -> RuntimeError:
    """The error raised when undoing a failed move fails too (the model needs its checkpoint)."""
    return RuntimeError(
        f"EPLB: rolling back a failed rearrangement failed too ({type(error).__name__}: {error}); the "
        f"model's experts are inconsistent with its tables -- restore it from a checkpoint. The first "
        f"failure was {type(cause).__name__}: {cause}"
    )

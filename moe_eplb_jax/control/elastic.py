"""Elastic EP for the control loop: a running model moved to a mesh of another EP size, atomically.

``ControlLoop.resized`` runs these phases once for both adapters (the NNX controller and ``Balancer``):

1. decide (host only, nothing changes): the window's load summed over the surviving ranks (lost devices are never
   read; with several processes every process gets the same copy), the new config (``num_gpus = G'``,
   ``num_redundant_experts = P' - E``), the new placement -- the caller's, or ``policy.resize_placement`` of that
   load from the current placement, so what each staying device holds stays -- and each layer's ``ResizePlan``.
   An expert that only lost ranks held comes from ``reload`` (an :class:`ExpertSource`: a checkpoint), else a
   ``ValueError`` names every such (layer, expert) and the way out;
2. move (new arrays beside the old ones, nothing written): each layer's per-expert pytree (weights, scales,
   optimizer moments) to the new mesh (``transport.execute_resize``), the model's replicated arrays
   (``transport.replicate_to``), the load window (each step's logical load kept, split over the new replicas);
3. install: the store writes every array and hands each layer its mesh and tables (:class:`ResizeStore`); a
   failure puts back everything the store saved before it began, then ``RearrangementError``.

Memory: the old and the new expert state coexist until the install (the old state is the rollback).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from moe_eplb_jax import metrics
from moe_eplb_jax.config import EplbConfig
from moe_eplb_jax.control.moves import ExpertStore
from moe_eplb_jax.control.window import sum_rank_rows
from moe_eplb_jax.placement import Placement
from moe_eplb_jax.policy import resize_placement
from moe_eplb_jax.policy.online import home_layout
from moe_eplb_jax.state import EplbState
from moe_eplb_jax.transport import (
    ResizePlan,
    execute_resize,
    missing_experts,
    new_rank_of_old,
    plan_for_meshes,
    row_bytes,
)

__all__ = ["ExpertSource", "ResizeDecision", "ResizeStore", "carry_window", "decide", "move_experts", "summary"]

_FIELDS = tuple(f.name for f in dataclasses.fields(EplbState))
_WAY_OUT = (
    "Nothing was changed. Reload them from a checkpoint: resize(..., reload=source) with "
    "source = EplbController.expert_source(model, placement, optimizer=...) or "
    "Balancer.expert_source(params, opt_state, placement) over the checkpoint's experts"
)


class ResizeStore(ExpertStore, Protocol):
    """An ``ExpertStore`` that can move its whole model to another mesh (what an adapter supplies for a resize)."""

    def replicated(self) -> list[jax.Array]:
        """Every other array of the model (and optimizer) on the old mesh, replicated, in a fixed order;
        ``ValueError`` for one sharded over the EP axis that is no expert leaf (it cannot follow)."""
        ...

    def save(self) -> Any:
        """What :meth:`restore` needs to put every variable (and attribute) back as it is now."""
        ...

    def install(self, mesh: Mesh, trees: Sequence[Any], replicated: Sequence[jax.Array], placement, tables) -> None:
        """Writes every layer's moved pytree and the replicated arrays (in :meth:`replicated`'s order) and hands
        each layer ``mesh`` and its rows of ``placement`` and ``tables``."""
        ...

    def restore(self, saved: Any) -> None: ...


@dataclasses.dataclass(frozen=True)
class ExpertSource:
    """Experts to reload from a checkpoint when no surviving rank holds them.

    ``read(layer)``: the layer's per-expert pytree in the structure the
    adapter's store reads (leaves ``[P0, ...]``, host arrays or arrays of this
    process's devices), slot ``p`` holding expert ``placement.phy2log[layer, p]``.
    """

    read: Callable[[int], Any]
    placement: Placement

    def check(self, missing: np.ndarray) -> None:
        """``ValueError`` naming the ``(layer, expert)`` pairs of ``missing [K, 2]`` this source does not hold."""
        phy2log = np.asarray(self.placement.phy2log)
        absent = [(int(lyr), int(e)) for lyr, e in missing.tolist() if lyr >= len(phy2log) or e not in phy2log[lyr]]
        if absent:
            raise ValueError(f"the reload source holds no replica of (layer, expert) {absent[:16]}")

    def rows(self, layer: int) -> Callable[[np.ndarray], Any]:
        """``transport``'s ``reload`` for one layer's plan: requests ``[K, 2]`` of ``(0, expert)`` -> host rows."""
        phy2log = np.asarray(self.placement.phy2log[layer])

        def read(requests: np.ndarray):
            slots = np.array([int(np.flatnonzero(phy2log == e)[0]) for e in requests[:, 1]], dtype=np.int64)

            def rows(leaf):
                if np.ndim(leaf) == 0:
                    return leaf
                if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
                    raise ValueError("reload source leaves must be host arrays or arrays of this process's devices")
                return np.asarray(leaf)[slots]

            return jax.tree.map(rows, self.read(layer))

        return read


@dataclasses.dataclass(frozen=True)
class ResizeDecision:
    """A resize decided and checked, before any byte moves: the new config and placement, and one plan per layer."""

    config: EplbConfig
    old: Placement
    new: Placement
    plans: tuple[ResizePlan, ...]
    lost_ranks: tuple[int, ...]
    load: np.ndarray
    window: dict[str, np.ndarray]
    reload: ExpertSource | None


def decide(
    config: EplbConfig, mesh: Mesh, new_mesh: Mesh, axis: str, state: EplbState, current: Placement, *,
    placement: Placement | None = None, num_physical: int | None = None, policy: str | None = None,
    lost_ranks=(), reload: ExpertSource | None = None,
) -> ResizeDecision:  # fmt: skip
    """Phase 1 (see the module docstring): ``ValueError`` for anything that would fail, before any change."""
    if not isinstance(new_mesh, Mesh) or axis not in new_mesh.shape:
        raise ValueError(f"new_mesh must be a jax.sharding.Mesh with the EP axis {axis!r}, got {new_mesh!r}")
    if reload is not None and not isinstance(reload, ExpertSource):
        raise ValueError(f"reload must be an ExpertSource (see expert_source), got {type(reload).__name__}")
    num_ranks, new_num_ranks = int(mesh.shape[axis]), int(new_mesh.shape[axis])
    lost = tuple(sorted({int(r) for r in lost_ranks}))
    if any(r < 0 or r >= num_ranks for r in lost):
        raise ValueError(f"lost_ranks {list(lost)} are not ranks of the current mesh (0..{num_ranks - 1})")
    num_layers, num_logical = current.num_layers, current.num_logical
    window = surviving_window(state, mesh, axis, lost)
    load = logical_load(window, current.phy2log, num_logical)
    mapping = new_rank_of_old(mesh, new_mesh, axis=axis)
    if placement is None:
        placement = resize_placement(
            load, current.phy2log, num_ranks=num_ranks, new_num_ranks=new_num_ranks, new_num_physical=num_physical,
            policy=config.policy if policy is None else policy, num_groups=config.num_groups,
            num_nodes=config.num_nodes, new_rank_of_old=mapping, lost_ranks=lost,
        )  # fmt: skip
    if not isinstance(placement, Placement):
        raise ValueError(f"placement must be a Placement, got {type(placement).__name__}")
    placement = placement.to_numpy()
    if (placement.num_layers, placement.num_logical) != (num_layers, num_logical):
        raise ValueError(
            f"placement is for (L, E) = {(placement.num_layers, placement.num_logical)}, the model has "
            f"{(num_layers, num_logical)}"
        )
    if num_physical is not None and placement.num_physical != num_physical:
        raise ValueError(f"num_physical={num_physical} but the placement has P'={placement.num_physical} slots")
    placement.validate(num_ranks=new_num_ranks)
    fields = dict(num_gpus=new_num_ranks, num_redundant_experts=placement.num_physical - num_logical)
    new_config = dataclasses.replace(config, **fields)
    new_config.num_physical(num_logical)
    if {config.policy, policy} & {"online", "quota"}:  # home experts per rank: E must divide into G' ranks
        home_layout(num_logical, placement.num_physical, new_num_ranks)
    missing = missing_experts(current.phy2log, num_ranks, placement.phy2log, lost_ranks=lost)
    if missing.size and reload is None:
        shown = ", ".join(f"(layer {lyr}, expert {e})" for lyr, e in missing[:16].tolist())
        more = f" and {len(missing) - 16} more" if len(missing) > 16 else ""
        raise ValueError(
            f"{len(missing)} experts of the new placement have no replica outside the lost ranks {list(lost)}: "
            f"{shown}{more}. {_WAY_OUT}"
        )
    if reload is not None:
        reload.check(missing)
    plans = tuple(
        plan_for_meshes(
            current.phy2log[layer],
            placement.phy2log[layer],
            mesh=mesh,
            new_mesh=new_mesh,
            axis=axis,
            lost_ranks=lost,
            reload=reload is not None,
            num_logical=num_logical,
        )
        for layer in range(num_layers)
    )
    widest = np.max([plan.capacities for plan in plans], axis=0)
    plans = tuple(plan.padded(*(int(c) for c in widest)) for plan in plans)  # one compiled executor for all
    return ResizeDecision(new_config, current, placement, plans, lost, load, window, reload)


def surviving_window(state: EplbState, mesh: Mesh, axis: str, lost: Sequence[int]) -> dict[str, np.ndarray]:
    """The window's fields on the host, the rank rows of the surviving ranks summed (lost devices are not read).

    Every process gets the same copy: the process of the first survivor
    reads it and, with several processes, broadcasts it.
    """
    devices = list(mesh.devices.flat)
    survivors = [d for rank, d in enumerate(devices) if rank not in set(lost)]
    if not survivors:
        raise ValueError("every rank of the current mesh is lost: nothing to resize from (restore a checkpoint)")
    sub = Mesh(np.array(survivors), (axis,), axis_types=(jax.sharding.AxisType.Auto,))
    on_survivors = jax.tree.map(lambda x: _restricted(x, survivors, sub, axis), state)
    summed = jax.jit(sum_rank_rows, out_shardings=NamedSharding(sub, PartitionSpec()))(on_survivors)
    source = jax.process_index() == survivors[0].process_index
    host = {}
    for name in _FIELDS:
        value = getattr(summed, name)
        host[name] = np.array(value.addressable_data(0)) if source else np.zeros(value.shape, value.dtype)
    if jax.process_count() > 1:
        host = {k: np.asarray(v) for k, v in multihost_utils.broadcast_one_to_all(host, is_source=source).items()}
    return host


def _restricted(x: jax.Array, survivors: list, sub: Mesh, axis: str) -> jax.Array:
    """``x`` (rank rows sharded over ``axis``, or replicated) as the same shards on the survivors' mesh."""
    old = x.sharding
    spec = old.spec if isinstance(old, NamedSharding) else PartitionSpec()
    shape = list(x.shape)
    for dim, name in enumerate(spec):
        if name == axis and isinstance(old, NamedSharding):
            shape[dim] = shape[dim] // int(old.mesh.shape[axis]) * len(survivors)
    sharding = NamedSharding(sub, spec)
    shards = {shard.device: shard.data for shard in x.addressable_shards}
    arrays = [shards[d] for d in sharding.addressable_devices_indices_map(tuple(shape))]
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays, dtype=x.dtype)


def logical_load(window: dict[str, np.ndarray], phy2log, num_logical: int) -> np.ndarray:
    """``[L, E]`` float64 tokens per logical expert over the window's valid rows (host, exact)."""
    rows = window["window"][: int(window["window_filled"])].astype(np.int64).sum(0)  # [L, P]
    onehot = np.asarray(phy2log)[:, :, None] == np.arange(num_logical)
    return np.einsum("lp,lpe->le", rows, onehot.astype(np.int64)).astype(np.float64)


def carry_window(window: dict[str, np.ndarray], old_phy2log, new: Placement) -> dict[str, np.ndarray]:
    """The window on the new placement (summed layout): each step's logical load per layer kept exactly, each
    expert's count split over its new replicas (the first ones take the remainder); counters as they were."""
    old, num_logical = np.asarray(old_phy2log), new.num_logical
    onehot = (old[:, :, None] == np.arange(num_logical)).astype(np.int64)
    replica = np.zeros(new.phy2log.shape, np.int64)  # each new slot's index among its expert's replicas
    layers, experts, index = np.nonzero(new.log2phy >= 0)
    replica[layers, new.log2phy[layers, experts, index]] = index
    count = np.take_along_axis(new.logcnt, new.phy2log, axis=1)  # [L, P'] replicas of each slot's expert

    def carried(rows):  # [..., L, P] -> [..., L, P']
        logical = np.einsum("...lp,lpe->...le", rows.astype(np.int64), onehot)
        per_slot = np.take_along_axis(
            logical, np.broadcast_to(new.phy2log, logical.shape[:-1] + new.phy2log.shape[-1:]), -1
        )
        return (per_slot // count + (replica < per_slot % count)).astype(np.int32)

    out = dict(window)
    filled = int(window["window_filled"])
    rows = window["window"].copy()
    rows[filled:] = 0
    out["window"], out["pass_load"] = carried(rows), carried(window["pass_load"])
    return out


def move_experts(store: ExpertStore, decision: ResizeDecision, mesh: Mesh, new_mesh: Mesh, axis: str):
    """Phase 2: every layer's pytree on the new mesh (the old ones untouched); ``(trees, bytes_moved)``."""
    trees, spent = [], 0
    for layer, plan in enumerate(decision.plans):
        tree = store.read(layer)
        reload = decision.reload.rows(layer) if decision.reload is not None and plan.reload_count.any() else None
        moved = execute_resize(tree, plan, mesh=mesh, new_mesh=new_mesh, axis=axis, reload=reload)
        trees.append(jax.block_until_ready(moved))
        spent += plan.bytes_moved(row_bytes(tree))
    return trees, spent


def summary(decision: ResizeDecision, num_ranks: int, new_num_ranks: int, bytes_moved: int, seconds: float) -> dict:
    """What a resize report says: sizes before and after, slots kept and rows moved or reloaded, bytes, time,
    the balancedness of the window's load before and (predicted) after."""
    before = metrics.rank_load_from_logical(decision.load, decision.old.phy2log, num_ranks)
    after = metrics.rank_load_from_logical(decision.load, decision.new.phy2log, new_num_ranks)
    plans = decision.plans
    return {
        "resized": True,
        "num_ranks": (num_ranks, new_num_ranks),
        "num_physical": (decision.old.num_physical, decision.new.num_physical),
        "lost_ranks": decision.lost_ranks,
        "slots_kept": int(sum(int(p.copy_count.sum()) for p in plans)),
        "rows_moved": int(sum(p.rows_moved for p in plans)),
        "rows_reloaded": int(sum(int(p.reload_count.sum()) for p in plans)),
        "bytes_moved": int(bytes_moved),
        "move_seconds": float(seconds),
        "balancedness_before": float(metrics.balancedness(before)),
        "balancedness_after": float(metrics.balancedness(after)),
    }

"""The load window on the mesh: per-rank rows sharded over the EP axis, jitted updates with fixed shardings.

``LoadWindow`` owns the jitted functions over an ``EplbState`` in the
per-rank layout (``pass_load [L, G, P]``, ``window [W, L, G, P]``, the ``G``
axis sharded over the EP mesh axis, counters replicated): closing a step is
elementwise on each rank's rows (no collective); the readers sum the rank rows
(the one all-reduce), only on steps that log, rearrange or checkpoint.

:func:`close_step` is the pure function a jitted train step calls itself (the
functional API); ``LoadWindow.close`` is the same, jitted with the state
donated, for callers outside a jitted step (the NNX controller).

Counts are int32 per step (one step's tokens for a slot, summed over the
ranks, must fit, as ``state.record``'s counts do); sums over the window's
steps run in float32 (``state.window_slot_load``), since a long window passes
``2**31`` tokens per slot where no single step does.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from moe_eplb_jax import state as eplb_state
from moe_eplb_jax._checks import INT32_MAX, check_int, show
from moe_eplb_jax.config import EplbConfig
from moe_eplb_jax.state import EplbState
from moe_eplb_jax.transport.mesh import put_host

__all__ = [
    "LoadWindow",
    "as_written",
    "close_step",
    "close_steps",
    "host_value",
    "split_rank_rows",
    "step_loads",
    "sum_rank_rows",
]


def close_step(state: EplbState, loads, *, dummy: bool | jax.Array = False) -> EplbState:
    """Records one step's per-layer loads and closes the step; pure, for use inside a jitted step.

    ``loads``: one array per MoE layer (or one ``[L, ...]`` array), each
    ``[G, P]`` (row ``g`` counted on EP rank ``g``) or ``[P]`` already summed
    over the ranks (then charged to rank 0's row: the sums every reader uses
    are unchanged). ``dummy`` (a traced bool allowed) advances the step
    counters without writing the window.
    """
    return eplb_state.end_step(eplb_state.record(state, step_loads(state, loads)), dummy=dummy)


def step_loads(state: EplbState, loads) -> jax.Array:
    """One step's per-layer ``loads`` (as :func:`close_step` takes them) as the ``[L, G, P]`` int32 row the
    per-rank ``state`` records."""
    _check_per_rank(state)
    num_layers, num_ranks, num_physical = state.pass_load.shape
    sequence = isinstance(loads, (list, tuple)) or getattr(loads, "ndim", 0) >= 1  # no asarray: may hold tracers
    if not sequence or len(loads) != num_layers:
        got = f"{len(loads)} of them" if sequence else show(loads)
        raise ValueError(f"loads must be one array per MoE layer ({num_layers}), got {got}")
    rows = []
    for layer, load in enumerate(loads):
        shape = tuple(np.shape(load))
        if shape not in ((num_ranks, num_physical), (num_physical,)):
            raise ValueError(
                f"loads[{layer}] must have shape [G, P] = {(num_ranks, num_physical)} or [P] = "
                f"{(num_physical,)}, got {shape}"
            )
        load = eplb_state.checked_counts(f"loads[{layer}]", load)  # before the cast: nothing wraps
        if load.ndim == 1:
            load = jnp.where(jnp.arange(num_ranks)[:, None] == 0, load[None, :], 0)
        rows.append(load)
    return jnp.stack(rows)


def close_steps(state: EplbState, steps, *, dummy: bool | jax.Array = False) -> EplbState:
    """Closes ``n`` steps at once: the state of ``n`` calls of :func:`close_step`, for a caller's loop that keeps
    each step's row (:func:`step_loads`) and closes them after it, with one write into the window.

    ``steps``: ``[n, L, G, P]`` integer counts, ``n`` static; the first joins what the open step recorded
    before. ``dummy`` (a traced bool allowed) as in :func:`close_step`, for every one of the steps.
    """
    _check_per_rank(state)
    n = int(np.shape(steps)[0]) if np.ndim(steps) == 4 else 0
    if n < 1 or tuple(np.shape(steps)[1:]) != tuple(state.pass_load.shape):
        raise ValueError(
            f"steps must have shape [n >= 1, L, G, P] = [n, {', '.join(map(str, state.pass_load.shape))}], got "
            f"{tuple(np.shape(steps))}"
        )
    steps = eplb_state.checked_counts("steps", steps)
    closed = eplb_state.end_step(eplb_state.record(state, steps[0]), dummy=dummy)  # checks state and dummy
    if n == 1:
        return closed
    dummy = jnp.asarray(dummy, jnp.bool_)
    size = state.window.shape[0]
    kept = min(n - 1, size)  # of steps 2..n; any before them are overwritten within the call
    slots = (closed.window_pos + (n - 1 - kept) + jnp.arange(kept, dtype=jnp.int32)) % size
    # A dummy call rewrites the rows with themselves: one scatter of ``kept`` rows either way, never a select over
    # the window.
    rows = jnp.where(dummy, closed.window[slots], steps[n - kept :])
    advance = jnp.where(dummy, 0, n - 1).astype(jnp.int32)
    return dataclasses.replace(
        closed,
        window=closed.window.at[slots].set(rows, unique_indices=True),
        window_pos=(closed.window_pos + advance) % size,
        window_filled=jnp.minimum(closed.window_filled + advance, size),
        step=closed.step + (n - 1),
        total_steps=closed.total_steps + (n - 1),
    )


def _check_per_rank(state) -> None:
    if not isinstance(state, EplbState) or not state.per_rank:
        got = "the summed layout" if isinstance(state, EplbState) else type(state).__name__
        raise ValueError(f"state must be an EplbState in the per-rank layout (pass_load [L, G, P]), got {got}")


def sum_rank_rows(state: EplbState) -> EplbState:
    """The per-rank state with its rank rows summed: the single-layout state a checkpoint holds."""
    return dataclasses.replace(
        state, pass_load=state.pass_load.sum(1, dtype=jnp.int32), window=state.window.sum(2, dtype=jnp.int32)
    )


def split_rank_rows(state: EplbState, num_ranks: int) -> EplbState:
    """Inverse of :func:`sum_rank_rows` up to the split: the totals go to rank 0's row."""

    def rows(x, axis):
        first = jax.lax.broadcasted_iota(jnp.int32, (*x.shape[:axis], num_ranks, *x.shape[axis:]), axis) == 0
        return jnp.where(first, jnp.expand_dims(x, axis), 0)

    return dataclasses.replace(state, pass_load=rows(state.pass_load, 1), window=rows(state.window, 2))


def _window_rows(state: EplbState):
    """``[W, L, P]`` the window's valid rows summed over ranks, oldest first (rows past ``window_filled`` zero)."""
    size = state.window.shape[0]
    order = (state.window_pos - state.window_filled + jnp.arange(size)) % size
    rows = state.window.sum(2, dtype=jnp.int32)[order]
    valid = jnp.arange(size) < state.window_filled
    return jnp.where(valid[:, None, None], rows, 0)


def _recent_row(state: EplbState, back):
    """``[L, P]`` the window row of the step closed ``back`` steps before the last one, summed over the ranks."""
    row = (state.window_pos - 1 - back) % state.window.shape[0]
    return jax.lax.dynamic_index_in_dim(state.window, row, axis=0, keepdims=False).sum(1, dtype=jnp.int32)


class LoadWindow:
    """Jitted ``EplbState`` updates of ``num_layers`` layers of ``num_physical`` slots on ``mesh``.

    Every function has fixed output shardings, so the model's and these
    functions' inputs keep one sharding and nothing recompiles step to step.
    """

    def __init__(self, config: EplbConfig, mesh: jax.sharding.Mesh, num_layers: int, num_physical: int, axis: str):
        self.config, self.mesh, self.axis = config, mesh, axis
        self.num_layers = check_int("num_layers", num_layers, minimum=1, maximum=INT32_MAX)
        self.num_physical = check_int("num_physical", num_physical, minimum=1, maximum=INT32_MAX)
        self.num_ranks = int(mesh.shape[axis])
        replicated = NamedSharding(mesh, PS())
        make = functools.partial(eplb_state.init_state, config, self.num_layers, self.num_physical, per_rank=True)
        sharding = jax.tree.map(lambda _: replicated, jax.eval_shape(make))
        self.sharding = dataclasses.replace(
            sharding, pass_load=as_written(mesh, None, axis, None), window=as_written(mesh, None, None, axis, None)
        )
        self.fresh = jax.jit(make, out_shardings=self.sharding)
        # Donated: the window ([W, L, G, P]) is updated in place, not copied every step.
        self.close = jax.jit(
            lambda state, loads, dummy: close_step(state, loads, dummy=dummy),
            donate_argnums=0,
            out_shardings=self.sharding,
        )
        self.mark_rearranged = jax.jit(eplb_state.mark_rearranged, out_shardings=self.sharding)
        self.step_slot_load = jax.jit(_per_step, out_shardings=replicated)
        self.slot_load = jax.jit(eplb_state.window_slot_load, out_shardings=replicated)
        self._logical_load = jax.jit(eplb_state.window_logical_load, static_argnums=2, out_shardings=replicated)
        self.summed = jax.jit(sum_rank_rows, out_shardings=replicated)
        self.split = jax.jit(split_rank_rows, static_argnums=1, out_shardings=self.sharding)
        self.rows = jax.jit(_window_rows, out_shardings=replicated)
        self.recent_slot_load = jax.jit(_recent_row, out_shardings=replicated)
        self._flags = {flag: put_host(np.bool_(flag), mesh) for flag in (False, True)}

    def logical_load(self, state: EplbState, phy2log, num_logical: int) -> np.ndarray:
        """``[L, E]`` host float64 logical loads of the window (every rank's rows summed)."""
        return np.asarray(
            host_value(self._logical_load(state, np.asarray(phy2log, np.int32), int(num_logical))), np.float64
        )

    def logical_rows(self, state: EplbState, phy2log, num_logical: int) -> np.ndarray:
        """``[steps, L, E]`` host logical loads of each step in the window, oldest first (a load file's rows)."""
        filled = int(host_value(state.window_filled))
        rows = np.asarray(host_value(self.rows(state)))[:filled].astype(np.float64)
        onehot = np.asarray(phy2log)[:, :, None] == np.arange(int(num_logical))  # [L, P, E]
        return np.einsum("slp,lpe->sle", rows, onehot.astype(np.float64))

    def dummy(self, flag: bool) -> jax.Array:
        """``close``'s ``dummy`` argument as a replicated device scalar, placed once: no upload per step."""
        return self._flags[bool(flag)]

    def put(self, summed: dict[str, np.ndarray]) -> EplbState:
        """Host ``EplbState`` fields in the summed layout (a checkpoint's) placed on the mesh, per-rank layout."""
        fields = {f.name: put_host(np.asarray(summed[f.name], np.int32), self.mesh) for f in _FIELDS}
        return self.split(EplbState(**fields), self.num_ranks)

    def host_summed(self, state: EplbState) -> dict[str, np.ndarray]:
        """The state's fields on the host, rank rows summed (a checkpoint's layout)."""
        summed = self.summed(state)
        return {f.name: np.array(host_value(getattr(summed, f.name))) for f in _FIELDS}


_FIELDS = dataclasses.fields(EplbState)


def as_written(mesh: jax.sharding.Mesh, *axes) -> NamedSharding:
    """``NamedSharding(mesh, PS(*axes))`` in the form a jitted program writes on its outputs (mesh axes of size
    one and trailing ``None`` dropped): a caller's loop that returns the window returns this very sharding, so
    taking the window back needs no ``device_put``, and nothing compiles again."""
    kept = [a if a is not None and mesh.shape[a] > 1 else None for a in axes]
    while kept and kept[-1] is None:
        kept.pop()
    return NamedSharding(mesh, PS(*kept))


def _per_step(loads):
    """``[L, P]`` one step's per-layer loads summed over the ranks (each ``[G, P]`` or ``[P]``)."""
    return jnp.stack([load.sum(0, dtype=jnp.int32) if load.ndim == 2 else load.astype(jnp.int32) for load in loads])


def host_value(value) -> np.ndarray:
    """A replicated array's value on this host (every process holds all of it)."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        value = value.addressable_data(0)
    return np.asarray(value)

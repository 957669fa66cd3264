"""``EplbState``: the load window and step counters, and its pure updates -- load recording and the trigger.

``EplbState`` is a pytree of arrays that lives next to the model and is
updated every step (the static configuration is ``moe_eplb_jax.EplbConfig``,
the policy call ``moe_eplb_jax.policy.compute_placement``)::

    state = init_state(config, num_layers=L, num_physical=P)
    for each step:
        for each forward pass (micro-batch) of the step:
            state = record(state, load)          # load [L, P]: tokens per slot, padding excluded
        state = end_step(state)                  # or end_step(state, dummy=True) on a rank with no data
        if should_rearrange(state, config):
            logical = window_logical_load(state, phy2log, E)      # the only sum over EP ranks
            placement = compute_placement(np.asarray(logical), config, old_phy2log=phy2log)
            ... move the experts (moe_eplb_jax.transport) ...
            state = mark_rearranged(state)

Every rank calls ``end_step`` every step (a rank without data passes
``dummy=True``), so the step counters of all ranks stay in lock-step and every
rank decides to rearrange at the same step.

Loads are summed over the EP ranks only when the window is read, never per
step. Two layouts do that: inside ``jax.shard_map`` each rank keeps a state of
its own counts and passes ``axis_name`` to the readers (they psum); outside it,
``init_state(..., per_rank=True)`` keeps one row per rank (``[L, G, P]``, the
``G`` axis sharded over the EP mesh axis), so ``record`` / ``end_step`` are
elementwise on each rank's shard and the readers sum the rows (the one
all-reduce, at read time).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from moe_eplb_jax._checks import INT32_MAX, check_fits, check_int, device_memory_bytes, is_concrete, show
from moe_eplb_jax.config import EplbConfig

__all__ = [
    "EplbState",
    "check_window_size",
    "checked_counts",
    "end_step",
    "init_state",
    "mark_rearranged",
    "record",
    "should_rearrange",
    "window_logical_load",
    "window_slot_load",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EplbState:
    """Load bookkeeping of every MoE layer (all fields are arrays).

    Attributes:
      pass_load: ``[L, P]`` int32, tokens per slot recorded during the current
        step; ``[L, G, P]`` in the per-rank layout (row ``g``: the tokens EP
        rank ``g`` counted; the total is the sum of the rows).
      window: ``[W, L, P]`` (per-rank: ``[W, L, G, P]``) int32 ring buffer of per-step loads.
      window_pos: index of the window row the next step writes.
      window_filled: number of valid window rows (``<= W``).
      step: steps since the last rearrangement (or since the start).
      total_steps: steps since the start.
      num_rearrangements: rearrangements done so far.
    """

    pass_load: jax.Array
    window: jax.Array
    window_pos: jax.Array
    window_filled: jax.Array
    step: jax.Array
    total_steps: jax.Array
    num_rearrangements: jax.Array

    @property
    def num_layers(self) -> int:
        return int(self.pass_load.shape[0])

    @property
    def num_physical(self) -> int:
        return int(self.pass_load.shape[-1])

    @property
    def per_rank(self) -> bool:
        """True for the per-rank layout (``pass_load [L, G, P]``): readers sum the rank rows."""
        return self.pass_load.ndim == 3

    @property
    def window_size(self) -> int:
        return int(self.window.shape[0])


def init_state(config: EplbConfig, num_layers: int, num_physical: int, *, per_rank: bool = False) -> EplbState:
    """A fresh state with an empty window of ``config.window_size`` steps.

    ``per_rank=True``: one load row per EP rank (``G = config.num_gpus``),
    ``pass_load [L, G, P]`` and ``window [W, L, G, P]``; ``record`` then takes
    ``[L, G, P]`` per-rank counts, and shard the ``G`` axis over the EP mesh
    axis so that recording needs no communication (see the module docstring).

    Raises ``ValueError`` for sizes that are not integers in ``[1, 2**31 -
    1]`` and for a window that one device cannot hold (its summed ``[W, L,
    P]`` rows are what every reader builds), naming ``EplbConfig.window_size``.
    """
    if not isinstance(config, EplbConfig):
        raise ValueError(f"config must be an EplbConfig, got {type(config).__name__}")
    num_layers = check_int("num_layers", num_layers, minimum=1, maximum=INT32_MAX)
    num_physical = check_int("num_physical", num_physical, minimum=1, maximum=INT32_MAX)
    if not isinstance(per_rank, (bool, np.bool_)):
        raise ValueError(f"per_rank must be True or False, got {show(per_rank)}")
    check_window_size(config, num_layers, num_physical)
    if num_physical % config.num_gpus:
        raise ValueError(f"{num_physical} slots are not divisible by num_gpus={config.num_gpus}")
    zero = jnp.zeros((), jnp.int32)
    rows = (num_layers, config.num_gpus, num_physical) if per_rank else (num_layers, num_physical)
    return EplbState(
        pass_load=jnp.zeros(rows, jnp.int32),
        window=jnp.zeros((config.window_size, *rows), jnp.int32),
        window_pos=zero,
        window_filled=zero,
        step=zero,
        total_steps=zero,
        num_rearrangements=zero,
    )


def check_window_size(config: EplbConfig, num_layers: int, num_physical: int) -> None:
    """``ValueError`` naming ``EplbConfig.window_size`` when one device cannot hold the window's ``[W, L, P]`` rows.

    Every reader of the window (and a checkpoint) builds the rows summed over
    the ranks on one device, so that is the bound in either layout.
    """
    check_fits(
        f"a load window of EplbConfig.window_size={config.window_size} steps x {num_layers} layers x "
        f"{num_physical} slots (int32)",
        4 * config.window_size * num_layers * num_physical,
        device_memory_bytes(),
        where="one device",
        hint="lower EplbConfig.window_size",
    )


def _check_state(state) -> None:
    if not isinstance(state, EplbState):
        raise ValueError(f"state must be an EplbState (see init_state), got {type(state).__name__}")


def record(state: EplbState, load) -> EplbState:
    """Adds one forward pass's per-slot load ``[L, P]`` (per-rank layout: ``[L, G, P]``; padding excluded).

    ``load`` holds integer token counts (not bools, not floats), checked by
    :func:`checked_counts` before the int32 cast; the running sums are int32.
    """
    _check_state(state)
    shape = tuple(np.shape(load))
    load = checked_counts("load", load)
    if shape != tuple(state.pass_load.shape):
        axes = "[L, G, P]" if state.per_rank else "[L, P]"
        raise ValueError(f"load must have shape {axes} = {tuple(state.pass_load.shape)}, got {shape}")
    return dataclasses.replace(state, pass_load=state.pass_load + load)


def checked_counts(name: str, load) -> jax.Array:
    """Token counts ``load`` as int32, checked before the cast (``ValueError`` naming ``name`` otherwise).

    The dtype must be an integer one (traced loads included). Host loads
    (numpy, lists) and loads of a dtype wider than int32 are checked by value:
    a negative count or one past ``2**31 - 1`` raises instead of wrapping.
    Device int32 loads are assumed non-negative (checking them would wait for
    the device), as are traced loads under ``jit``.
    """
    if not hasattr(load, "dtype"):
        try:
            load = np.asarray(load)
        except (ValueError, TypeError, OverflowError) as e:
            raise ValueError(f"{name} must be a rectangular array of token counts ({e})") from None
    dtype = np.dtype(load.dtype)
    if dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integer token counts, got dtype {dtype}")
    on_host = not isinstance(load, jax.Array)
    if is_concrete(load) and (on_host or dtype.itemsize > 4 or dtype == np.uint32) and np.size(load):
        host = np.asarray(load)
        if host.min() < 0 or host.max() > INT32_MAX:
            bad = (host < 0) | (host > INT32_MAX)
            index = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"{name}{list(index)} = {host[index]} is not a token count in [0, 2**31 - 1]")
        load = host.astype(np.int32)
    return jnp.asarray(load).astype(jnp.int32)


def end_step(state: EplbState, *, dummy: bool | jax.Array = False) -> EplbState:
    """Closes a step: pushes the step's load into the window (unless ``dummy``) and advances the counters.

    ``dummy`` is a bool or a (possibly traced) boolean scalar array; anything
    else (``"no"``, ``0``) raises ``ValueError``. A dummy step records nothing
    but still advances ``step`` so that every rank stays in lock-step.
    """
    _check_state(state)
    if not isinstance(dummy, (bool, np.bool_)) and not (
        hasattr(dummy, "dtype") and np.dtype(dummy.dtype) == np.bool_ and np.ndim(dummy) == 0
    ):
        raise ValueError(f"dummy must be True, False or a boolean scalar array, got {dummy!r}")
    dummy = jnp.asarray(dummy, jnp.bool_)
    # The row at window_pos is rewritten either way (with itself on a dummy step): an update of one row, in
    # place where the window is donated, never a select over the whole window.
    row = jnp.where(dummy, state.window[state.window_pos], state.pass_load)
    window = state.window.at[state.window_pos].set(row)
    advance = jnp.where(dummy, 0, 1).astype(jnp.int32)
    return dataclasses.replace(
        state,
        pass_load=jnp.zeros_like(state.pass_load),
        window=window,
        window_pos=(state.window_pos + advance) % state.window.shape[0],
        window_filled=jnp.minimum(state.window_filled + advance, state.window.shape[0]),
        step=state.step + 1,
        total_steps=state.total_steps + 1,
    )


def should_rearrange(state: EplbState, config: EplbConfig):
    """True when a rearrangement is due: first after a quarter of the interval, then every ``rearrange_interval``."""
    due = jnp.where(state.num_rearrangements == 0, config.first_rearrangement_step, config.rearrange_interval)
    return state.step >= due


def window_slot_load(state: EplbState, *, axis_name=None):
    """Tokens per physical slot summed over the window, ``[L, P]`` float32 -- over every EP rank.

    The per-rank layout's rows are summed here (under ``jit`` on a state whose
    rank axis is sharded, this is the all-reduce). Inside ``jax.shard_map``
    pass ``axis_name`` (the EP axis): each rank's locally counted loads are
    then psummed, so every rank gets the same global load.

    The sums run in float32, as :func:`window_logical_load`'s: a window of
    many steps passes ``2**31`` tokens per slot long before any one step does,
    and an int32 sum would wrap there (JAX has no wider integer without x64).
    They are exact while every partial sum stays below ``2**24``, and rounded
    to float32 (relative error about ``1e-7`` per addition) beyond.
    """
    _check_state(state)
    return _summed_window(state, axis_name)


def _summed_window(state: EplbState, axis_name):
    """``[L, P]`` float32: the valid window rows summed over the rows and the EP ranks."""
    valid_rows = jnp.arange(state.window.shape[0]) < state.window_filled
    valid_rows = valid_rows.reshape((-1,) + (1,) * (state.window.ndim - 1))
    slot_load = jnp.where(valid_rows, state.window, 0).astype(jnp.float32).sum(0)
    if state.per_rank:
        slot_load = slot_load.sum(1)
    if axis_name is not None:
        slot_load = jax.lax.psum(slot_load, axis_name)
    return slot_load


def window_logical_load(state: EplbState, phy2log, num_logical: int, *, axis_name=None):
    """Total load of each logical expert over the window, ``[L, E]`` float32.

    Slot loads are summed over the window rows and the EP ranks (``axis_name``
    inside ``jax.shard_map`` psums them, as :func:`window_slot_load`), then
    into the logical expert each slot holds (``phy2log [L, P]``), so every rank
    gets the same global load and computes the same placement. The sums run in
    float32 (never an int32 wrap; see :func:`window_slot_load`). Ids of a
    concrete ``phy2log`` outside ``[0, E)`` raise ``ValueError`` (checked before
    the int32 cast); under ``jit`` they are assumed in range.
    """
    _check_state(state)
    num_logical = check_int("num_logical", num_logical, minimum=1)
    want = (state.num_layers, state.num_physical)
    if tuple(np.shape(phy2log)) != want:
        raise ValueError(f"phy2log must have shape [L, P] = {want}, got {tuple(np.shape(phy2log))}")
    dtype = np.dtype(phy2log.dtype) if hasattr(phy2log, "dtype") else np.asarray(phy2log).dtype
    if dtype.kind not in "iu":
        raise ValueError(f"phy2log must hold integer expert ids, got dtype {dtype}")
    if is_concrete(phy2log):
        host = np.asarray(phy2log)
        bad = (host < 0) | (host >= num_logical)
        if np.any(bad):
            layer, slot = (int(i) for i in np.argwhere(bad)[0])
            raise ValueError(
                f"phy2log[{layer}, {slot}] = {host[layer, slot]} is outside the logical expert range [0, {num_logical})"
            )
        phy2log = host.astype(np.int32)
    phy2log = jnp.asarray(phy2log).astype(jnp.int32)
    slot_load = _summed_window(state, axis_name)
    onehot = phy2log[..., None] == jnp.arange(num_logical, dtype=jnp.int32)[None, None, :]
    return jnp.einsum("lp,lpe->le", slot_load, onehot.astype(jnp.float32))


def mark_rearranged(state: EplbState) -> EplbState:
    """Resets the step counter and empties the window after a rearrangement.

    Window rows count tokens per physical slot under the placement they were
    recorded with; once slots hold other experts those rows would be charged to
    the wrong experts, so they are dropped rather than misread.
    """
    return dataclasses.replace(
        state,
        pass_load=jnp.zeros_like(state.pass_load),
        window_pos=jnp.zeros_like(state.window_pos),
        window_filled=jnp.zeros_like(state.window_filled),
        step=jnp.zeros_like(state.step),
        num_rearrangements=state.num_rearrangements + 1,
    )

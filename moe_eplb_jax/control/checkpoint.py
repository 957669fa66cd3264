"""The EPLB state as an Orbax checkpoint item, every field validated when it is restored.

The item is a flat dict of host numpy arrays -- the placement tables, the
replica shares the layers route with (``replica_shares [L, E, S]`` float32:
the LP shares of ``routing="lp"``, equal shares in the other modes), the load
window summed over the EP ranks (``window [W, L, P]``), the step counters and
the config (its JSON as ``uint8`` bytes) -- so Orbax's standard handler saves
it beside the model and the optimizer in one ``CheckpointManager`` step
(atomic as Orbax makes it: a step is written to a temporary directory and
renamed when every item is complete; every process calls ``save``, the
primary one writes the host arrays)::

    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(max_to_keep=3))
    manager.save(step, args=ocp.args.Composite(
        model=ocp.args.StandardSave(nnx.state(model)),
        optimizer=ocp.args.StandardSave(nnx.state(optimizer)),
        eplb=ocp.args.StandardSave(controller.checkpoint_item()),
    ))
    manager.wait_until_finished()

    step, restored = restore_step(directory, {"model": nnx.state(model), "optimizer": nnx.state(optimizer)})
    controller.restore_item(restored["eplb"])   # ValueError naming the field; nothing changes unless all pass
    nnx.update(model, restored["model"])
    nnx.update(optimizer, restored["optimizer"])

:func:`restore_step` is Orbax's restore with this library's errors: a
missing directory, a step that is not there and a damaged step each raise one
``ValueError`` naming the directory and the step (Orbax raises its own
``FileNotFoundError``, JSON or TensorStore errors), and the EPLB item comes
back as saved, for ``restore_item`` to check.

The model checkpoint holds the expert weights on the placement the item names
(the layers' tables are model variables too), so restoring moves no byte. The
shares are stored, not solved again: the loads they were solved from left the
window at that rearrangement, and a resumed run must route as the run it
resumes. Items of version 1 (before the shares were stored) restore with equal
shares. The functional API has the same pair (``Balancer.checkpoint_item`` /
``restore_item``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from moe_eplb_jax._checks import check_int
from moe_eplb_jax.config import EplbConfig
from moe_eplb_jax.placement import Placement
from moe_eplb_jax.routing import equal_shares
from moe_eplb_jax.state import EplbState

__all__ = ["ITEM_VERSION", "STATE_FIELDS", "Snapshot", "from_item", "restore_step", "to_item"]

ITEM_VERSION = 2
STATE_FIELDS = tuple(f.name for f in dataclasses.fields(EplbState))
_COUNTERS = ("window_pos", "window_filled", "step", "total_steps", "num_rearrangements")
_INTEGER_FIELDS = ("version", "config", "phy2log", "log2phy", "logcnt", "pass_load", "window", *_COUNTERS)
_FIELDS = {1: _INTEGER_FIELDS, 2: (*_INTEGER_FIELDS, "replica_shares")}


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The host side of a checkpoint item: config, placement, replica shares and the ``EplbState`` fields.

    ``replica_shares``: ``[L, E, S]`` float32, each layer's shares of its
    replicas (``moe_eplb_jax.routing.equal_shares`` where the routing mode
    solves none). ``state``: field name -> numpy array (``pass_load [L, P]``,
    ``window [W, L, P]``, the counters 0-d), the rank rows summed.
    """

    config: EplbConfig
    placement: Placement
    replica_shares: np.ndarray
    state: dict[str, np.ndarray]


def to_item(snapshot: Snapshot) -> dict[str, np.ndarray]:
    """The Orbax item of ``snapshot``: a flat dict of numpy arrays (see the module docstring)."""
    p = snapshot.placement.to_numpy()
    item = {
        "version": np.asarray(ITEM_VERSION, np.int32),
        "config": np.frombuffer(snapshot.config.to_json().encode(), np.uint8).copy(),
        "phy2log": p.phy2log,
        "log2phy": p.log2phy,
        "logcnt": p.logcnt,
        "replica_shares": np.asarray(snapshot.replica_shares, np.float32),
    }
    for name in STATE_FIELDS:
        item[name] = np.asarray(snapshot.state[name], np.int32)
    return item


def from_item(item, *, config: EplbConfig, num_layers: int, num_logical: int, num_physical: int) -> Snapshot:
    """Validates a restored item for a model of ``(L, E, P)`` run with ``config``; ``ValueError`` naming the field.

    Checked: the version, the set of fields, integer dtypes (float
    ``replica_shares``), the saved config (it must parse, and agree with
    ``config`` on the window size, redundant experts and EP ranks), every
    shape, the placement (a valid one for ``config.num_gpus`` ranks), the
    shares (finite, non-negative, zero past each expert's replica count),
    non-negative loads, and counters in range
    (``0 <= window_pos < W``, ``0 <= window_filled <= W`` -- equal to
    ``window_pos`` while the window is not full --, ``0 <= step <=
    total_steps``, ``num_rearrangements >= 0``).
    """
    if not isinstance(item, Mapping):
        raise ValueError(f"EPLB checkpoint item must be a mapping of arrays, got {type(item).__name__}")
    version = _version(item)
    expected = _FIELDS[version]
    missing, unknown = sorted(set(expected) - set(item)), sorted(str(k) for k in set(item) - set(expected))
    if missing or unknown:
        raise ValueError(f"EPLB checkpoint item: missing field(s) {missing}, unknown field(s) {unknown}")
    fields = {}
    for name in _INTEGER_FIELDS:
        value = np.asarray(item[name])
        if value.dtype.kind not in "iu":
            raise ValueError(f"EPLB checkpoint field {name!r} must hold integers, got dtype {value.dtype}")
        fields[name] = value
    saved = _saved_config(fields["config"])
    for name in ("window_size", "num_redundant_experts", "num_gpus"):
        if getattr(saved, name) != getattr(config, name):
            raise ValueError(
                f"EPLB checkpoint field 'config': saved with {name}={getattr(saved, name)}, "
                f"the controller has {name}={getattr(config, name)}"
            )
    size = config.window_size
    shapes = {
        "phy2log": (num_layers, num_physical),
        "log2phy": (num_layers, num_logical, num_physical - num_logical + 1),
        "logcnt": (num_layers, num_logical),
        "pass_load": (num_layers, num_physical),
        "window": (size, num_layers, num_physical),
        **{name: () for name in _COUNTERS},
    }
    for name, shape in shapes.items():
        if fields[name].shape != shape:
            raise ValueError(f"EPLB checkpoint field {name!r} has shape {fields[name].shape}, the model needs {shape}")
    try:
        placement = Placement.from_tables(
            fields["phy2log"], fields["log2phy"], fields["logcnt"], num_ranks=config.num_gpus
        )
    except ValueError as e:
        raise ValueError(f"EPLB checkpoint placement (fields 'phy2log', 'log2phy', 'logcnt'): {e}") from None
    width = num_physical - num_logical + 1
    if version == 1:
        shares = equal_shares(placement.logcnt, width)
    else:
        shares = _shares(item["replica_shares"], placement, (num_layers, num_logical, width))
        # The placement lists replicas in slot order; shares follow the order the item listed them in.
        listed = np.where(fields["log2phy"] < 0, np.iinfo(np.int64).max, fields["log2phy"].astype(np.int64))
        shares = np.take_along_axis(shares, np.argsort(listed, axis=-1, kind="stable"), axis=-1)
    for name in ("pass_load", "window"):
        if np.any(fields[name] < 0):
            raise ValueError(f"EPLB checkpoint field {name!r} holds negative loads")
    pos, filled, step, total, count = (int(fields[name]) for name in _COUNTERS)
    if not 0 <= pos < size:
        raise ValueError(f"EPLB checkpoint field 'window_pos' is {pos}, outside [0, {size})")
    if not 0 <= filled <= size:
        raise ValueError(f"EPLB checkpoint field 'window_filled' is {filled}, outside [0, {size}]")
    if filled < size and pos != filled:
        raise ValueError(f"EPLB checkpoint fields 'window_pos' ({pos}) and 'window_filled' ({filled}) disagree")
    if not 0 <= step <= total:
        raise ValueError(f"EPLB checkpoint fields 'step' ({step}) and 'total_steps' ({total}) need 0 <= step <= total")
    if count < 0:
        raise ValueError(f"EPLB checkpoint field 'num_rearrangements' is negative ({count})")
    return Snapshot(saved, placement, shares, {name: fields[name].astype(np.int32) for name in STATE_FIELDS})


def _version(item: Mapping) -> int:
    if "version" not in item:
        raise ValueError("EPLB checkpoint item: missing field(s) ['version']")
    raw = np.asarray(item["version"])
    if raw.shape != () or raw.dtype.kind not in "iu" or int(raw) not in _FIELDS:
        raise ValueError(f"EPLB checkpoint field 'version' is {raw!r}, this library reads {sorted(_FIELDS)}")
    return int(raw)


def _shares(raw, placement: Placement, shape: tuple[int, int, int]) -> np.ndarray:
    shares = np.asarray(raw)
    if shares.dtype.kind != "f":
        raise ValueError(f"EPLB checkpoint field 'replica_shares' must hold floats, got dtype {shares.dtype}")
    if shares.shape != shape:
        raise ValueError(f"EPLB checkpoint field 'replica_shares' has shape {shares.shape}, the model needs {shape}")
    if not np.all(np.isfinite(shares)) or np.any(shares < 0):
        raise ValueError("EPLB checkpoint field 'replica_shares' must be finite and non-negative")
    if np.any(shares[np.arange(shape[2]) >= np.asarray(placement.logcnt)[..., None]]):
        raise ValueError("EPLB checkpoint field 'replica_shares' gives shares to replicas the placement does not have")
    return shares.astype(np.float32)


def _saved_config(raw: np.ndarray) -> EplbConfig:
    if raw.ndim != 1 or raw.dtype != np.uint8:
        raise ValueError(f"EPLB checkpoint field 'config' must be uint8 JSON bytes, got {raw.dtype}{list(raw.shape)}")
    try:
        return EplbConfig.from_json(raw.tobytes().decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"EPLB checkpoint field 'config': {e}") from None


def restore_step(
    directory, targets: Mapping[str, Any], *, step: int | None = None, item: str = "eplb"
) -> tuple[int, dict[str, Any]]:
    """Restores ``step`` (default: the latest) of the Orbax checkpoint in ``directory``: ``(step, items)``.

    Args:
      directory: the ``CheckpointManager`` directory (or the manager itself).
      targets: item name -> a pytree like the one saved (e.g.
        ``nnx.state(model)``); each comes back with its shapes, dtypes and
        shardings.
      step: the step to restore; ``None``: the latest.
      item: the name of the EPLB item, restored as saved (no target).

    Raises ``ValueError`` naming the directory (and the step) when it is
    missing, holds no checkpoint or that step, or the step cannot be read.
    """
    if isinstance(directory, ocp.CheckpointManager):
        manager, where = directory, os.fspath(directory.directory)
    else:
        where = os.fspath(directory)
        if not os.path.isdir(where):
            raise ValueError(f"{where}: no such checkpoint directory")
        manager = ocp.CheckpointManager(where, options=ocp.CheckpointManagerOptions(create=False))
    steps = sorted(manager.all_steps())
    if step is not None:
        try:
            step = check_int("step", step, minimum=0)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    if step is None:
        if not steps:
            raise ValueError(f"{where}: holds no checkpoint")
        step = steps[-1]
    elif step not in steps:
        raise ValueError(f"{where}: holds no checkpoint of step {step} (steps: {steps})")
    abstract = {
        name: ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
        for name, state in targets.items()
    }
    try:
        restored = manager.restore(step, args=ocp.args.Composite(**abstract, **{item: ocp.args.StandardRestore()}))
    except Exception as e:  # Orbax and TensorStore raise many types for one damaged step
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        raise ValueError(f"{where}: step {step} cannot be restored ({type(e).__name__}: {reason})") from e
    return step, dict(restored)

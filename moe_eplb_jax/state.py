"""EPLB state: load recording, the load window, the rearrangement trigger.

``EplbConfig`` is static configuration (hashable, safe as a ``jit`` static
argument). ``EplbState`` is a pytree of arrays that lives next to the model and
is updated every step::

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
import json
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moe_eplb_jax import policy as _policy
from moe_eplb_jax._checks import check_int, is_concrete
from moe_eplb_jax.placement import Placement
from moe_eplb_jax.routing import MODES, routing_mode

__all__ = [
    "EplbConfig",
    "EplbState",
    "init_state",
    "record",
    "end_step",
    "should_rearrange",
    "window_slot_load",
    "window_logical_load",
    "compute_placement",
    "mark_rearranged",
]


@dataclasses.dataclass(frozen=True)
class EplbConfig:
    """Static EPLB configuration, every field checked when it is built.

    Build it in Python, or from what users already write for vLLM
    (``--eplb-config``) with :meth:`from_json` / :meth:`from_dict`;
    :meth:`to_json` writes it back.

    Attributes:
      num_redundant_experts: ``R`` extra physical slots; ``P = E + R``.
      window_size: number of past steps whose loads decide the next placement.
      step_interval: steps between rearrangements. The first rearrangement comes
        after a quarter of the interval, so a fresh model is balanced early.
      policy: name of the placement (L1) policy registered in
        ``moe_eplb_jax.policy`` (``policy.available()``); default
        ``moe_eplb_jax.policy.DEFAULT_POLICY`` (``"balanced"``: DeepSeek's
        replication with a refined GPU packing, never less balanced), or
        ``"deepseek"``, ``"online"``, or any name registered with
        ``moe_eplb_jax.policy.register`` before the config is built.
      num_groups, num_nodes, num_gpus: topology handed to the policy (expert
        groups, hosts, EP ranks). As in DeepSeek's and vLLM's EPLB, groups are
        kept on one node only when ``num_groups % num_nodes == 0``
        (hierarchical; then ``num_gpus % num_nodes == 0`` and ``E %
        num_groups == 0`` are required); otherwise the policy balances
        globally and neither is required.
      log_interval: steps between balance logs (``None``: never).
      routing: replica (L2) routing, one of ``moe_eplb_jax.routing.ROUTING_MODES``:
        ``"hash"`` (stateless), ``"round_robin"``, ``"lp"`` (LP replica shares)
        or ``"quota"`` (per-batch quotas, which needs the ``"online"`` policy:
        fixed home experts, spare slots refreshed).
      refresh_interval: with ``routing="quota"``, steps between spare-slot
        refreshes (``None``: ``step_interval``); only valid with ``"quota"``.
      overlap: how a rearrangement's expert moves are spread over steps:
        ``None`` (all layers at one step boundary), ``"layer"`` (one layer per
        step) or a byte budget per step (an int: as many whole layers as fit,
        at least one). Either way each layer switches to its new tables only
        once its bytes have arrived.
    """

    num_redundant_experts: int = 0
    window_size: int = 1000
    step_interval: int = 3000
    policy: str = _policy.DEFAULT_POLICY
    num_groups: int = 1
    num_nodes: int = 1
    num_gpus: int = 1
    log_interval: int | None = None
    routing: str = "hash"
    refresh_interval: int | None = None
    overlap: str | int | None = None

    def __post_init__(self):
        for name in ("window_size", "step_interval", "num_groups", "num_nodes", "num_gpus"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("num_redundant_experts", self.num_redundant_experts, minimum=0)
        for name in ("log_interval", "refresh_interval"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1, none="None or ")
        if self.hierarchical and self.num_gpus % self.num_nodes:
            raise ValueError(
                f"EplbConfig: num_gpus ({self.num_gpus}) is not divisible by num_nodes ({self.num_nodes}), which "
                f"the hierarchical policy needs when num_groups ({self.num_groups}) is a multiple of num_nodes"
            )
        if not isinstance(self.policy, str) or not self.policy:
            raise ValueError(f"EplbConfig.policy must be a policy name, got {self.policy!r}")
        try:
            chosen = _policy.get(self.policy)
        except ValueError as e:
            raise ValueError(f"EplbConfig.policy: {e}") from None
        mode = routing_mode(self.routing, field="EplbConfig.routing")
        if mode.policy is not None and chosen is not _policy.get(mode.policy):
            raise ValueError(
                f"EplbConfig: routing={mode.name!r} ({mode.summary}) needs policy={mode.policy!r}, got "
                f"policy={self.policy!r}"
            )
        if self.refresh_interval is not None and mode.policy is None:
            raise ValueError(
                f"EplbConfig.refresh_interval is the spare-slot refresh period of a routing mode with its own "
                f"policy ({', '.join(repr(m.name) for m in MODES.values() if m.policy)}); routing is "
                f"{self.routing!r} (use step_interval)"
            )
        if self.overlap is not None and self.overlap != "layer":
            _check_int("overlap", self.overlap, minimum=1, none="None, 'layer' or ")

    @property
    def hierarchical(self) -> bool:
        """Whether the policies keep expert groups on one node: ``num_groups % num_nodes == 0`` (else global)."""
        return self.num_groups % self.num_nodes == 0

    @property
    def rearrange_interval(self) -> int:
        """Steps between rearrangements: ``refresh_interval`` under quota routing when set, else ``step_interval``."""
        return self.refresh_interval if self.refresh_interval is not None else self.step_interval

    @property
    def first_rearrangement_step(self) -> int:
        return max(1, self.rearrange_interval // 4)

    def num_physical(self, num_logical: int) -> int:
        """``P = E + R`` for ``E`` logical experts, checked against the topology.

        ``P`` must divide into ``num_gpus``; ``E`` into ``num_groups`` only
        where the policy is hierarchical (:attr:`hierarchical`).
        """
        num_logical = check_int("num_logical", num_logical, minimum=1)
        num_physical = num_logical + self.num_redundant_experts
        if num_physical % self.num_gpus:
            raise ValueError(
                f"{num_logical} experts + {self.num_redundant_experts} redundant = {num_physical} slots, "
                f"not divisible by num_gpus={self.num_gpus}"
            )
        if self.hierarchical and num_logical % self.num_groups:
            raise ValueError(
                f"{num_logical} experts are not divisible by num_groups={self.num_groups}, which the hierarchical "
                f"policy needs when num_groups is a multiple of num_nodes={self.num_nodes}"
            )
        return num_physical

    # ------------------------------------------------------------------ JSON
    @classmethod
    def from_dict(cls, fields: Mapping[str, Any]) -> EplbConfig:
        """A config from a mapping of field names: this class's, or vLLM's ``EPLBConfig`` names.

        vLLM's ``window_size``, ``step_interval``, ``num_redundant_experts`` and
        ``policy`` are ours too (``"default"`` is this library's default
        policy, ``"balanced"``); ``log_balancedness`` (bool) with
        ``log_balancedness_interval`` becomes ``log_interval``, ``use_async``
        (bool) becomes ``overlap="layer"``. Unknown keys, a field given under
        two names and values of the wrong type (``true`` for an int, ``16.7``
        for an int, ``"no"`` for a bool) raise ``ValueError`` naming the key.
        """
        if not isinstance(fields, Mapping):
            raise ValueError(f"EplbConfig fields must be a mapping, got {type(fields).__name__}")
        unknown = sorted(str(k) for k in fields if k not in _FIELD_NAMES and k not in _VLLM_FIELDS)
        if unknown:
            known = sorted(_FIELD_NAMES | set(_VLLM_FIELDS))
            raise ValueError(f"EplbConfig: unknown field(s) {unknown}; known: {known}")
        for key, kind in _VLLM_FIELDS.items():
            if key in fields and kind is bool and not isinstance(fields[key], bool):
                raise ValueError(f"EplbConfig: field {key!r} must be true or false, got {fields[key]!r}")
        out = {k: v for k, v in fields.items() if k in _FIELD_NAMES}
        if "log_balancedness" in fields or "log_balancedness_interval" in fields:
            if "log_interval" in fields:
                raise ValueError("EplbConfig: give log_interval or vLLM's log_balancedness(_interval), not both")
            interval = fields.get("log_balancedness_interval", 1)
            _check_int("log_balancedness_interval", interval, minimum=1)
            out["log_interval"] = interval if fields.get("log_balancedness", False) else None
        if "use_async" in fields:
            if "overlap" in fields:
                raise ValueError("EplbConfig: give overlap or vLLM's use_async, not both")
            out["overlap"] = "layer" if fields["use_async"] else None
        if out.get("policy") == "default":
            out["policy"] = cls.policy
        return cls(**out)

    @classmethod
    def from_json(cls, text: str) -> EplbConfig:
        """A config from a JSON object (as vLLM's ``--eplb-config`` takes); see :meth:`from_dict`."""
        if not isinstance(text, str):
            raise ValueError(f"EplbConfig.from_json takes a JSON string, got {type(text).__name__}")
        try:
            fields = json.loads(text, object_pairs_hook=_no_duplicate_keys)
        except json.JSONDecodeError as e:
            raise ValueError(f"EplbConfig: not valid JSON ({e})") from None
        if not isinstance(fields, dict):
            raise ValueError(f"EplbConfig JSON must be an object, got {type(fields).__name__}")
        return cls.from_dict(fields)

    def to_dict(self) -> dict[str, Any]:
        """Every field under this class's names (``from_dict`` reads it back)."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(EplbConfig))
# vLLM's EPLBConfig fields without a twin here, and their types (mapped onto our fields by from_dict).
_VLLM_FIELDS = {"log_balancedness": bool, "log_balancedness_interval": int, "use_async": bool}


def _check_int(name: str, value, *, minimum: int, none: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else "a non-negative integer"
        raise ValueError(f"EplbConfig.{name} must be {none}{what}, got {value!r}")


def _no_duplicate_keys(pairs):
    keys = [k for k, _ in pairs]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise ValueError(f"EplbConfig JSON repeats key(s) {repeated}")
    return dict(pairs)


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
    """
    if num_layers < 1 or num_physical < 1:
        raise ValueError(f"need num_layers >= 1 and num_physical >= 1, got {num_layers}, {num_physical}")
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


_INT32_MAX = int(np.iinfo(np.int32).max)


def _check_state(state) -> None:
    if not isinstance(state, EplbState):
        raise ValueError(f"state must be an EplbState (see init_state), got {type(state).__name__}")


def record(state: EplbState, load) -> EplbState:
    """Adds one forward pass's per-slot load ``[L, P]`` (per-rank layout: ``[L, G, P]``; padding excluded).

    ``load`` holds integer token counts (not bools, not floats). Host loads
    (numpy, lists) and loads of a dtype wider than int32 are checked before the
    int32 cast: a negative count or one past ``2**31 - 1`` raises instead of
    wrapping. Device int32 loads are assumed non-negative (checking them would
    wait for the device), as are traced loads under ``jit``; the running sums
    are int32.
    """
    _check_state(state)
    dtype = np.dtype(load.dtype) if hasattr(load, "dtype") else np.asarray(load).dtype
    if dtype.kind not in "iu":
        raise ValueError(f"load must hold integer token counts, got dtype {dtype}")
    shape = tuple(np.shape(load))
    if shape != tuple(state.pass_load.shape):
        axes = "[L, G, P]" if state.per_rank else "[L, P]"
        raise ValueError(f"load must have shape {axes} = {tuple(state.pass_load.shape)}, got {shape}")
    on_host = not isinstance(load, jax.Array)
    if is_concrete(load) and (on_host or dtype.itemsize > 4 or dtype == np.uint32) and len(shape) and 0 not in shape:
        host = np.asarray(load)
        if host.min() < 0 or host.max() > _INT32_MAX:
            bad = (host < 0) | (host > _INT32_MAX)
            index = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"load{list(index)} = {host[index]} is not a token count in [0, 2**31 - 1]")
        load = host.astype(np.int32)
    load = jnp.asarray(load)
    return dataclasses.replace(state, pass_load=state.pass_load + load.astype(jnp.int32))


def end_step(state: EplbState, *, dummy=False) -> EplbState:
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
    written = state.window.at[state.window_pos].set(state.pass_load)
    window = jnp.where(dummy, state.window, written)
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


def compute_placement(logical_load, config: EplbConfig, *, old_phy2log=None) -> Placement:
    """Runs the configured policy on host loads ``[L, E]`` and returns a validated ``Placement``.

    With ``old_phy2log`` the policy keeps experts that stay on a rank in their
    old slot, so the rearrangement moves as few bytes as possible.
    """
    load = np.asarray(logical_load, dtype=np.float64)
    if load.ndim != 2:
        raise ValueError(f"logical_load must have shape [L, E], got {load.shape}")
    if not np.all(np.isfinite(load)) or np.any(load < 0):
        raise ValueError("logical_load must be finite and non-negative")
    num_logical = load.shape[1]
    num_physical = config.num_physical(num_logical)
    if old_phy2log is not None:
        old_phy2log = np.asarray(old_phy2log)
        if old_phy2log.shape != (load.shape[0], num_physical):
            raise ValueError(f"old_phy2log must have shape {(load.shape[0], num_physical)}, got {old_phy2log.shape}")
    fn = _policy.get(config.policy)
    phy2log, log2phy, logcnt = fn(
        load, num_physical, config.num_groups, config.num_nodes, config.num_gpus, old_phy2log=old_phy2log
    )
    return Placement.from_tables(phy2log, log2phy, logcnt, num_ranks=config.num_gpus)


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

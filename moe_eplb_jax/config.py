"""``EplbConfig``: the static EPLB configuration, every field checked when it is built, with vLLM's JSON names.

Hashable, so it is safe as a ``jit`` static argument. Build it in Python, or
from what users already write for vLLM (``--eplb-config``) with
``EplbConfig.from_json`` / ``from_dict``; ``to_json`` writes it back.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from moe_eplb_jax import policy as _policy
from moe_eplb_jax._checks import INT32_MAX, check_int, show
from moe_eplb_jax.routing import MODES, routing_mode

__all__ = ["EPLB_COMMUNICATORS", "EplbConfig"]


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
            raise ValueError(f"EplbConfig.policy must be a policy name, got {show(self.policy)}")
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
            _check_int("overlap", self.overlap, minimum=1, maximum=2**63 - 1, none="None, 'layer' or ")

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
        num_logical = check_int("num_logical", num_logical, minimum=1, maximum=INT32_MAX)
        num_physical = num_logical + self.num_redundant_experts
        if num_physical > INT32_MAX:  # slot ids are int32
            raise ValueError(
                f"{num_logical} experts + EplbConfig.num_redundant_experts={self.num_redundant_experts} = "
                f"{num_physical} slots, more than 2**31 - 1"
            )
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

        Every field of vLLM's ``EPLBConfig`` is read, with vLLM's defaults:
        ``window_size``, ``step_interval``, ``num_redundant_experts`` and
        ``policy`` are ours too (``"default"`` is this library's default
        policy, ``"balanced"``); ``log_balancedness`` (bool) with
        ``log_balancedness_interval`` becomes ``log_interval``; ``use_async``
        (bool; vLLM's default ``true`` where neither it nor ``overlap`` is
        given) becomes ``overlap="layer"`` (one layer moved per step, the
        layers switching as their bytes arrive) or ``None``; ``communicator``
        (vLLM's weight-transfer backend: one of ``EPLB_COMMUNICATORS`` or
        ``null``) is checked and not kept: the transport picks its own (a GPU
        kernel or ``ppermute``, ``moe_eplb_jax.transport``). Unknown keys, a
        field given under two names and values of the wrong type (``true`` for
        an int, ``16.7`` for an int, ``"no"`` for a bool) raise ``ValueError``
        naming the key.
        """
        if not isinstance(fields, Mapping):
            raise ValueError(f"EplbConfig fields must be a mapping, got {type(fields).__name__}")
        unknown = sorted(str(k) for k in fields if k not in _FIELD_NAMES and k not in _VLLM_FIELDS)
        if unknown:
            known = sorted(_FIELD_NAMES | set(_VLLM_FIELDS))
            raise ValueError(f"EplbConfig: unknown field(s) {unknown}; known: {known}")
        for key, kind in _VLLM_FIELDS.items():
            if key in fields and kind is bool and not isinstance(fields[key], bool):
                raise ValueError(f"EplbConfig: field {key!r} must be true or false, got {show(fields[key])}")
        if fields.get("communicator") is not None and fields["communicator"] not in EPLB_COMMUNICATORS:
            raise ValueError(
                f"EplbConfig: field 'communicator' must be null or one of vLLM's {list(EPLB_COMMUNICATORS)}, got "
                f"{show(fields['communicator'])}"
            )
        out = {k: v for k, v in fields.items() if k in _FIELD_NAMES}
        if "log_balancedness" in fields or "log_balancedness_interval" in fields:
            if "log_interval" in fields:
                raise ValueError("EplbConfig: give log_interval or vLLM's log_balancedness(_interval), not both")
            interval = fields.get("log_balancedness_interval", 1)
            _check_int("log_balancedness_interval", interval, minimum=1)
            out["log_interval"] = interval if fields.get("log_balancedness", False) else None
        if "use_async" in fields and "overlap" in fields:
            raise ValueError("EplbConfig: give overlap or vLLM's use_async, not both")
        if "overlap" not in fields:
            out["overlap"] = "layer" if fields.get("use_async", _VLLM_USE_ASYNC) else None
        if out.get("policy") == "default":
            out["policy"] = cls.policy
        return cls(**out)

    @classmethod
    def from_json(cls, text: str) -> EplbConfig:
        """A config from a JSON object (as vLLM's ``--eplb-config`` takes); see :meth:`from_dict`."""
        return cls.from_dict(cls.parse_json(text))

    @staticmethod
    def parse_json(text: str) -> dict[str, Any]:
        """The fields of a JSON object, unchecked but for the JSON itself (a string holding one object, no key twice,
        not nested without end); :meth:`from_dict` checks them."""
        if not isinstance(text, str):
            raise ValueError(f"EplbConfig.from_json takes a JSON string, got {type(text).__name__}")
        try:
            fields = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_int=_parse_int)
        except json.JSONDecodeError as e:
            raise ValueError(f"EplbConfig: not valid JSON ({e})") from None
        except RecursionError:
            raise ValueError("EplbConfig: not valid JSON (nested too deeply)") from None
        if not isinstance(fields, dict):
            raise ValueError(f"EplbConfig JSON must be an object, got {type(fields).__name__}")
        return fields

    def to_dict(self) -> dict[str, Any]:
        """Every field under this class's names (``from_dict`` reads it back)."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(EplbConfig))
# vLLM's EPLBConfig fields without a twin here, and their types (mapped onto our fields by from_dict).
_VLLM_FIELDS = {"log_balancedness": bool, "log_balancedness_interval": int, "use_async": bool, "communicator": str}
_VLLM_USE_ASYNC = True  # vLLM's default
EPLB_COMMUNICATORS = ("torch_nccl", "torch_gloo", "nixl", "pynccl")  # vLLM's weight-transfer backends


def _check_int(name: str, value, *, minimum: int, maximum: int = INT32_MAX, none: str = "") -> None:
    """Counts and steps live in int32 on the device (a window row, the step counters): past that they would wrap."""
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        what = "a positive integer" if minimum == 1 else "a non-negative integer"
        bound = "2**31 - 1" if maximum == INT32_MAX else "2**63 - 1"
        raise ValueError(f"EplbConfig.{name} must be {none}{what} up to {bound}, got {show(value)}")


def _parse_int(digits: str) -> int:
    """A JSON integer; one longer than Python converts becomes a number of as many digits (no field takes it)."""
    sign = -1 if digits.startswith("-") else 1
    count = len(digits.lstrip("-"))
    return int(digits) if count <= 4000 else sign * 10 ** (count - 1)


def _no_duplicate_keys(pairs):
    keys = [k for k, _ in pairs]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise ValueError(f"EplbConfig JSON repeats key(s) {repeated}")
    return dict(pairs)

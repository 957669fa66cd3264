"""The replica (L2) routing modes: one registry that every layer, config, flag and kernel consults.

A mode decides which replica of an expert serves each (token, k) entry; it never changes a token's output,
only the load. Each entry of :data:`MODES` says what the mode reads and where that comes from, so a new mode is
one entry here (plus, where it needs one, its table's solver or planner and its ``map_and_count`` rule).
"""

from __future__ import annotations

import dataclasses
import types

from moe_eplb_jax._checks import show

__all__ = ["KERNEL_RULES", "MODES", "ROUTING_MODES", "RoutingMode", "check_routing", "routing_mode"]

# How map_and_count picks an entry's replica -- by the token hash, by token index, from the shares' alias table,
# by running quotas in token order -- and the [E, S] table each rule reads.
_RULE_TABLES = {"hash": None, "round_robin": None, "lp": "replica_shares", "quota": "quotas"}
KERNEL_RULES = tuple(_RULE_TABLES)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoutingMode:
    """One replica routing mode: what it reads and who supplies it.

    Attributes:
      name: the name ``EplbConfig.routing``, ``MoELayer(routing=)``, ``moe_apply(routing=)`` and
        ``map_and_count(mode=)`` accept.
      kernel: the ``map_and_count`` rule that picks each entry's replica (one of :data:`KERNEL_RULES`).
      shares: reads ``replica_shares [E, S]`` float32, solved from the load window at every rearrangement
        (``routing_tables``) and kept with the placement (its ``lookup_table`` carries their alias table).
      quotas: reads integer ``quotas [E, S]``, planned per batch inside the forward pass from the EP group's
        counts (``batch_quotas``: one all-gather over EP).
      policy: the placement policy the mode needs (``None``: any); it refreshes the mode's spare slots every
        ``EplbConfig.refresh_interval`` steps.
      summary: one line for help texts and errors.
    """

    name: str
    kernel: str
    shares: bool = False
    quotas: bool = False
    policy: str | None = None
    summary: str = ""

    def __post_init__(self):
        if self.kernel not in KERNEL_RULES:
            raise ValueError(f"RoutingMode.kernel must be one of {KERNEL_RULES}, got {self.kernel!r}")
        if self.table != _RULE_TABLES[self.kernel]:
            raise ValueError(
                f"RoutingMode {self.name!r}: kernel rule {self.kernel!r} reads {_RULE_TABLES[self.kernel]}, but the "
                f"mode supplies {self.table}"
            )

    @property
    def stateless(self) -> bool:
        """Whether the mode reads nothing but the placement (a deterministic function of the batch's ids)."""
        return not (self.shares or self.quotas)

    @property
    def table(self) -> str | None:
        """The ``map_and_count`` keyword of the ``[E, S]`` table the mode reads (``None``: none)."""
        return "replica_shares" if self.shares else "quotas" if self.quotas else None


MODES: types.MappingProxyType[str, RoutingMode] = types.MappingProxyType(
    {
        mode.name: mode
        for mode in (
            RoutingMode(name="hash", kernel="hash", summary="replica from the high bits of the token hash; stateless"),
            RoutingMode(name="round_robin", kernel="round_robin", summary="replica u mod c of the token position"),
            RoutingMode(
                name="lp",
                kernel="lp",
                shares=True,
                summary="replicas drawn with LP shares solved from the window at each rearrangement",
            ),
            RoutingMode(
                name="quota",
                kernel="quota",
                quotas=True,
                policy="online",
                summary="per-batch integer quotas over the placement's replicas, spare slots refreshed by 'online'",
            ),
        )
    }
)
ROUTING_MODES = tuple(MODES)


def routing_mode(mode: str | RoutingMode, *, field: str = "routing") -> RoutingMode:
    """The registered :class:`RoutingMode` named ``mode`` (or ``mode`` itself); ``ValueError`` naming ``field`` and
    listing the modes otherwise."""
    name = mode.name if isinstance(mode, RoutingMode) else mode
    found = MODES.get(name) if isinstance(name, str) else None
    if found is None or (isinstance(mode, RoutingMode) and mode != found):
        raise ValueError(f"{field} must be one of {ROUTING_MODES}, got {show(mode)}")
    return found


def check_routing(routing) -> str:
    """``routing`` if it names a mode, else ``ValueError`` listing them (the name of :func:`routing_mode`)."""
    return routing_mode(routing).name

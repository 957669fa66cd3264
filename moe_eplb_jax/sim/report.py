"""Policy simulator: replay a load trace under several balancing policies and report.

A trace is ``load [steps, L, E]`` (tokens per logical expert; see
:mod:`moe_eplb_jax.sim.loadfile` and :mod:`moe_eplb_jax.sim.generators`). The EP
mesh has ``G`` ranks with ``H = E / G`` home experts and ``S`` spare slots each
(``P = G * (H + S)`` slots). Policy names:

* ``"none"`` -- home experts only, spare slots idle (the unbalanced baseline);
* ``"<L1 name>"`` -- a registered placement policy (e.g. ``"deepseek"``), fitted
  on the first step and refitted every ``step_interval`` steps on the mean of
  the last ``window`` steps (loads it has seen, never the step it serves);
  tokens split evenly over replicas (``hash`` routing);
* ``"<L1 name>+lp"`` -- the same placement, replica shares from
  :func:`moe_eplb_jax.routing.lp_shares` on each step's load (LP routing);
* ``"online"`` -- :func:`moe_eplb_jax.routing.plan_quotas` on every step's load
  (home experts fixed, spare slots re-planned per batch, exact quotas).

Report per policy: balancedness (``sum mean / sum max`` over every layer and
step), per-layer rank imbalance (mean over steps), replicas used, bytes moved
per rebalance, and a modelled step time: compute ``sum_l max_rank_load *
token_time_us`` plus moved expert bytes over ``link_gbps`` (no overlap assumed).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moe_eplb_jax import policy as _policy
from moe_eplb_jax._checks import check_int, check_real
from moe_eplb_jax._files import FIGURE_SUFFIXES, check_output_path, pyplot, save_figure
from moe_eplb_jax.metrics import rank_load_from_logical
from moe_eplb_jax.placement import build_log2phy
from moe_eplb_jax.routing.lp import lp_shares
from moe_eplb_jax.routing.quota import plan_quotas
from moe_eplb_jax.sim.loadfile import _check_load

__all__ = [
    "PolicyReport",
    "check_policy_names",
    "format_table",
    "plot_reports",
    "policy_names",
    "resolve_policy",
    "simulate",
]

# The quota planner counts tokens in int32: a layer whose total exceeds this (or whose loads are not whole
# tokens) is planned on its loads scaled to this total, and the plan's rank loads are scaled back.
_PLANNER_TOKENS = 1 << 30


@dataclasses.dataclass
class PolicyReport:
    """One policy's results on one trace (arrays are numpy)."""

    name: str
    rank_load: np.ndarray  # [steps, L, G] tokens per rank
    replicas_used: float  # mean spare slots holding an expert, per layer
    num_rebalances: int
    bytes_moved: float  # total expert bytes moved over the trace
    step_time_ms: float  # modelled, mean per step
    ideal_step_time_ms: float  # perfectly even load, nothing moved

    @property
    def balancedness(self) -> float:
        loads = self.rank_load.reshape(-1, self.rank_load.shape[-1])
        peak = loads.max(-1).sum()
        return float(loads.mean(-1).sum() / peak) if peak > 0 else 1.0

    @property
    def layer_imbalance(self) -> np.ndarray:
        """``[L]`` per-layer rank imbalance, mean over steps."""
        mean = self.rank_load.mean(-1)
        ratio = np.where(mean > 0, self.rank_load.max(-1) / np.where(mean > 0, mean, 1), 1.0)
        return ratio.mean(0)

    @property
    def step_imbalance(self) -> np.ndarray:
        """``[steps]`` rank imbalance averaged over layers."""
        mean = self.rank_load.mean(-1)
        return np.where(mean > 0, self.rank_load.max(-1) / np.where(mean > 0, mean, 1), 1.0).mean(1)

    @property
    def bytes_per_rebalance(self) -> float:
        return self.bytes_moved / self.num_rebalances if self.num_rebalances else 0.0


def resolve_policy(name: str):
    """The L1 policy function for ``name`` (``ValueError`` listing known names)."""
    return _policy.get(name)


def policy_names() -> list[str]:
    """Every name :func:`simulate` accepts: ``none``, ``online`` and each registered policy, alone and with ``+lp``."""
    fitted = [name for name in _policy.available() if name not in ("online", "quota")]
    return ["none", "online", *fitted, *(f"{name}+lp" for name in fitted)]


def check_policy_names(policies) -> tuple[str, ...]:
    """``policies`` (a name or a sequence of names) as a tuple, each known and none twice; ``ValueError`` otherwise."""
    if isinstance(policies, str):
        policies = (policies,)
    try:
        policies = tuple(policies)
    except TypeError:
        raise ValueError(f"policies must be a policy name or a sequence of names, got {policies!r}") from None
    if not policies:
        raise ValueError("policies is empty; choose from " + ", ".join(policy_names()))
    known = policy_names()
    for name in policies:
        if not isinstance(name, str):
            raise ValueError(f"policy names must be strings, got {name!r}")
        if name not in known:  # the names the CLI's help lists, in the same words
            raise ValueError(f"unknown policy {name!r}; choose from {', '.join(known)}")
    if len(set(policies)) != len(policies):
        raise ValueError(f"policies lists a name twice: {list(policies)}")
    return policies


@functools.lru_cache(maxsize=16)
def _online_planner(num_home: int, num_spare: int):
    def plan(counts):
        p = plan_quotas(counts, num_home=num_home, num_spare=num_spare, with_quota=False)
        return p.phy2log, p.rank_load, p.logcnt

    return jax.jit(jax.vmap(plan))


@functools.lru_cache(maxsize=16)
def _lp_router(num_physical: int, num_ranks: int):
    fn = functools.partial(lp_shares, num_physical=num_physical, num_ranks=num_ranks)
    return jax.jit(jax.vmap(lambda load, l2p, cnt: fn(load, l2p, cnt)[1]))


def _home_counts(load: np.ndarray, num_home: int) -> tuple[np.ndarray, np.ndarray]:
    """``[L, G, E]`` int32 counts with each expert's load sent from its home rank, and the ``[L]`` scale applied.

    Whole-token loads whose layer total fits the planner are exact (scale 1);
    any other layer is scaled to ``_PLANNER_TOKENS`` tokens, so no count wraps.
    """
    num_layers, num_logical = load.shape
    totals = load.sum(1)
    exact = (totals <= _PLANNER_TOKENS) & np.all(load == np.round(load), axis=1)
    scale = np.where(exact | (totals == 0), 1.0, _PLANNER_TOKENS / np.where(totals > 0, totals, 1.0))
    tokens = np.minimum(np.rint(load * scale[:, None]), _PLANNER_TOKENS)
    counts = np.zeros((num_layers, num_logical // num_home, num_logical), np.int32)
    counts[:, np.arange(num_logical) // num_home, np.arange(num_logical)] = tokens.astype(np.int32)
    return counts, scale


def simulate(
    load,
    *,
    num_ranks: int,
    num_spare: int,
    policies=("none", "deepseek", "online"),
    step_interval: int = 10,
    window: int = 10,
    expert_bytes: float = 44e6,
    token_time_us: float = 0.05,
    link_gbps: float = 400.0,
    progress=None,
) -> list[PolicyReport]:
    """Replays ``load [steps, L, E]`` under each policy; returns one :class:`PolicyReport` per name.

    ``expert_bytes`` is one expert's weight size (default: a DeepSeek-V3
    expert in fp8, ~44 MB); ``token_time_us`` the modelled compute time per
    (token, expert) entry on one rank; ``link_gbps`` the per-rank link speed
    for moved bytes. ``progress`` (optional) wraps the step iterator (e.g. tqdm).
    """
    load = _check_load(load, "simulate")
    num_steps, num_layers, num_logical = load.shape
    num_ranks = check_int("num_ranks", num_ranks, minimum=1)
    if num_logical % num_ranks:
        raise ValueError(f"E ({num_logical}) must be divisible by num_ranks ({num_ranks})")
    num_spare = check_int("num_spare", num_spare, minimum=0, maximum=num_logical)
    step_interval = check_int("step_interval", step_interval, minimum=1)
    window = check_int("window", window, minimum=1)
    expert_bytes = check_real("expert_bytes", expert_bytes, minimum=0.0)
    token_time_us = check_real("token_time_us", token_time_us, minimum=0.0)
    link_gbps = check_real("link_gbps", link_gbps, positive=True)
    if progress is not None and not callable(progress):
        raise ValueError(f"progress must be callable (e.g. tqdm.tqdm), got {progress!r}")
    policies = check_policy_names(policies)
    num_home = num_logical // num_ranks
    num_physical = num_ranks * (num_home + num_spare)
    ideal = float(load.sum(-1).mean(0).sum() / num_ranks * token_time_us / 1e3)
    steps: Any = range(num_steps) if progress is None else progress(range(num_steps))
    runners = {
        name: _runner(name, load, num_ranks, num_home, num_spare, num_physical, step_interval, window)
        for name in policies
    }
    results = {name: [] for name in policies}
    for step in steps:
        for name, run in runners.items():
            results[name].append(run(step))
    reports = []
    for name in policies:
        rank_load = np.stack([r[0] for r in results[name]])
        moved_slots = sum(r[1] for r in results[name])
        rebalances = sum(r[2] for r in results[name])
        replicas = float(np.mean([r[3] for r in results[name]]))
        compute_ms = rank_load.max(-1).sum(-1).mean() * token_time_us / 1e3
        move_ms = moved_slots * expert_bytes / (link_gbps * 1e9) * 1e3 / num_steps / num_ranks
        reports.append(
            PolicyReport(
                name=name,
                rank_load=rank_load,
                replicas_used=replicas,
                num_rebalances=int(rebalances),
                bytes_moved=float(moved_slots * expert_bytes),
                step_time_ms=float(compute_ms + move_ms),
                ideal_step_time_ms=ideal,
            )
        )
    return reports


def _runner(name, load, num_ranks, num_home, num_spare, num_physical, step_interval, window):
    """A closure ``step -> (rank_load [L, G], slots moved, rebalanced?, replicas used)`` for one policy."""
    num_steps, num_layers, num_logical = load.shape
    home_phy2log = np.arange(num_logical)

    if name == "none":

        def run_home(step):
            return (
                rank_load_from_logical(load[step], np.broadcast_to(home_phy2log, (num_layers, num_logical)), num_ranks),
                0,
                0,
                0.0,
            )

        return run_home

    if name == "online":
        planner = _online_planner(num_home, num_spare)
        state: dict[str, Any] = {"phy2log": None}

        def run_online(step):
            counts, scale = _home_counts(load[step], num_home)
            phy2log, rank_load, logcnt = (np.asarray(a) for a in planner(jnp.asarray(counts)))
            rank_load = rank_load / scale[:, None]
            old = state["phy2log"]
            moved = 0 if old is None else int(np.sum((phy2log >= 0) & (phy2log != old)))
            state["phy2log"] = np.where(phy2log >= 0, phy2log, old if old is not None else -1)
            return rank_load, moved, 1, float((logcnt.sum(-1) - num_logical).mean())

        return run_online

    use_lp = name.endswith("+lp")
    fn = resolve_policy(name.removesuffix("+lp"))
    state: dict[str, Any] = {"phy2log": None, "tables": None}

    def fit(weight):
        phy2log, _, _ = fn(weight, num_physical, 1, 1, num_ranks, old_phy2log=state["phy2log"])
        phy2log = np.asarray(phy2log, dtype=np.int64)
        moved = 0 if state["phy2log"] is None else int(np.sum(phy2log != state["phy2log"]))
        state["phy2log"] = phy2log
        state["tables"] = build_log2phy(phy2log, num_logical)
        return moved

    def run(step):
        moved, rebalanced = 0, 0
        if step == 0:
            fit(load[0])
        elif step % step_interval == 0:
            moved, rebalanced = fit(load[max(0, step - window) : step].mean(0)), 1
        if use_lp:
            log2phy, logcnt = state["tables"]
            rank_load = np.asarray(
                _lp_router(num_physical, num_ranks)(
                    jnp.asarray(load[step], jnp.float32), jnp.asarray(log2phy), jnp.asarray(logcnt)
                )
            ).astype(np.float64)
        else:
            rank_load = rank_load_from_logical(load[step], state["phy2log"], num_ranks)
        return rank_load, moved, rebalanced, float(num_physical - num_logical)

    return run


def format_table(reports: list[PolicyReport]) -> str:
    """A fixed-width text table, one row per policy."""
    head = (
        f"{'policy':<16} {'balanced':>8} {'imb mean':>8} {'imb max':>8} {'replicas':>8} {'rebal':>5} "
        f"{'MB/rebal':>9} {'step ms':>8} {'x ideal':>7}"
    )
    rows = [head, "-" * len(head)]
    for r in reports:
        imb = r.layer_imbalance
        rows.append(
            f"{r.name:<16} {r.balancedness:8.4f} {imb.mean():8.4f} {imb.max():8.4f} {r.replicas_used:8.1f} "
            f"{r.num_rebalances:5d} {r.bytes_per_rebalance / 1e6:9.1f} {r.step_time_ms:8.3f} "
            f"{r.step_time_ms / r.ideal_step_time_ms if r.ideal_step_time_ms else 1.0:7.3f}"
        )
    return "\n".join(rows)


def plot_reports(reports: list[PolicyReport], path) -> None:
    """Writes a PNG: rank imbalance per step (left) and per layer (right), one line per policy (atomically)."""
    path = check_output_path(path, what="plot", suffixes=FIGURE_SUFFIXES)
    plt = pyplot()

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for r in reports:
        left.plot(r.step_imbalance, label=r.name)
        right.plot(r.layer_imbalance, marker="o", label=r.name)
    left.set(xlabel="step", ylabel="rank imbalance (max / mean)", title="per step (mean over layers)")
    right.set(xlabel="layer", ylabel="rank imbalance", title="per layer (mean over steps)")
    left.legend()
    fig.tight_layout()
    try:
        save_figure(fig, path, what="plot")
    finally:
        plt.close(fig)

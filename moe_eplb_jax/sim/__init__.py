"""Policy simulator: synthetic and recorded load traces, per-policy reports, plots.

* generators: :func:`zipf_counts`, :func:`zipf_topk`, :func:`zipf_popularity`,
  :func:`lognormal_load`, :func:`drifting_load`;
* recorded loads: :func:`read_load` / :func:`save_load` (format ``moe_eplb_jax.load``);
* :func:`simulate` -> :class:`PolicyReport` list, :func:`format_table`, :func:`plot_reports`;
* a scale event (``G`` to ``G'`` ranks): :func:`simulate_resize` -> :class:`ResizeReport` list,
  :func:`format_resize_table`.
"""

from moe_eplb_jax.sim.generators import (
    drifting_load,
    home_rank_imbalance,
    lognormal_load,
    zipf_counts,
    zipf_popularity,
    zipf_topk,
)
from moe_eplb_jax.sim.loadfile import LOAD_FORMAT, LOAD_VERSION, LoadTrace, read_load, save_load
from moe_eplb_jax.sim.report import (
    PolicyReport,
    check_policy_names,
    format_table,
    plot_reports,
    policy_names,
    resolve_policy,
    simulate,
)
from moe_eplb_jax.sim.resize import ResizeReport, format_resize_table, simulate_resize

__all__ = [
    "LOAD_FORMAT",
    "LOAD_VERSION",
    "LoadTrace",
    "PolicyReport",
    "ResizeReport",
    "check_policy_names",
    "drifting_load",
    "format_resize_table",
    "format_table",
    "home_rank_imbalance",
    "lognormal_load",
    "plot_reports",
    "policy_names",
    "read_load",
    "resolve_policy",
    "save_load",
    "simulate",
    "simulate_resize",
    "zipf_counts",
    "zipf_popularity",
    "zipf_topk",
]

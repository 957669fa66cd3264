"""Fused replica routing and load counting: one kernel package (public function, reference, backends, tiling).

``map_and_count(topk_ids, log2phy, logcnt, *, num_physical, mode=...)`` maps logical expert ids ``[T, k]`` to
physical slots and counts the load per slot, for any routing mode of :data:`moe_eplb_jax.routing.MODES`
(:mod:`.api`: the semantics, the checks, the default implementation). ``lookup_table(log2phy, logcnt)`` builds
the kernel's lookup table once per placement (``map_and_count(lookup=...)``).

* :mod:`.reference` -- the pure-jnp implementation ``"xla"`` (and the oracle of the kernels);
* :mod:`._triton` -- the Pallas (Triton) implementation ``"pallas"`` and its parts (``_alias*``, ``_rank``,
  ``_positions``, ``_search``, ``_tables``, ``_triton_ops``);
* :mod:`.config` -- ``Config``, the frozen tiling of the Pallas kernels, and ``Config.default`` by size.
"""

from moe_eplb_jax.routing._map_and_count.api import IMPLEMENTATIONS, lookup_table, map_and_count
from moe_eplb_jax.routing._map_and_count.config import QUOTA_PATHS, Config

__all__ = ["IMPLEMENTATIONS", "QUOTA_PATHS", "Config", "lookup_table", "map_and_count"]

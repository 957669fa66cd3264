"""Fused replica routing and load counting (Pallas GPU kernels with a pure-jnp reference).

``map_and_count(topk_ids, log2phy, logcnt, *, num_physical, mode=...)`` maps
logical expert ids ``[T, k]`` to physical slots and counts the load per slot;
``mode`` is one of the routing modes ``"hash"``, ``"round_robin"``, ``"lp"``
(replica shares) and ``"quota"`` (per-replica quotas), see
:mod:`moe_eplb_jax.routing._map_and_count.api`. ``lookup_table(log2phy, logcnt)``
builds the kernel's lookup table once per placement (``map_and_count(lookup=...)``).
"""

from moe_eplb_jax.routing._map_and_count.api import IMPLEMENTATIONS, MODES, lookup_table, map_and_count

__all__ = ["map_and_count", "lookup_table", "MODES", "IMPLEMENTATIONS"]

"""Fused replica routing and load counting (GPU kernels with a pure-jnp reference).

``map_and_count(topk_ids, log2phy, logcnt, *, num_physical, ...)`` maps logical
expert ids ``[T, k]`` to physical slots and counts the load per slot, with the
``"xla"`` (reference, CPU default) or ``"pallas"`` (Triton kernel, GPU default)
implementation. See :mod:`moe_eplb_jax.pallas.map_and_count` for the exact
semantics of each routing mode. ``lookup_table(log2phy, logcnt)`` builds the
kernel's lookup table once per placement (``map_and_count(lookup=...)``).
"""

from moe_eplb_jax.pallas.map_and_count import IMPLEMENTATIONS, MODES, lookup_table, map_and_count

__all__ = ["map_and_count", "lookup_table", "MODES", "IMPLEMENTATIONS"]

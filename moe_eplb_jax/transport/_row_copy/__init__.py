"""Row gather / scatter with a bounded grid: one kernel package (public functions, reference, backend, tiling).

``gather_rows(row_views, rows)`` packs rows ``[C]`` of uint32 row views ``[N, m_i]`` into one
``[C, sum(m_i)]`` buffer; ``scatter_rows(row_views, packed, dst)`` writes packed rows back into the views in
place (:mod:`.api`: the semantics and the checks). The transport's stream schedule runs them beside an NCCL
transfer: XLA's gather and scatter fusions fill every SM at full HBM speed and slow the transfer they overlap,
while these kernels launch ``Config.num_programs`` programs that loop over their work items, taking a bounded
share of the GPU.

* :mod:`.reference` -- the pure-jnp implementation ``"xla"`` (the kernels' oracle);
* :mod:`._triton` -- the Pallas (Triton) implementation ``"pallas"`` (Pallas interpret mode off the GPU);
* :mod:`.config` -- ``Config``, the frozen tiling of the kernels.
"""

from moe_eplb_jax.transport._row_copy.api import IMPLEMENTATIONS, gather_rows, offsets_fit, scatter_rows
from moe_eplb_jax.transport._row_copy.config import Config

__all__ = ["IMPLEMENTATIONS", "Config", "gather_rows", "offsets_fit", "scatter_rows"]

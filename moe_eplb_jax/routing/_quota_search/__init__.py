"""The quota planner's target search: one kernel package (entry point, reference, backend, tiling).

``search(load, implementation=...)`` finds the smallest feasible target of ``routing.plan_quotas`` and its
layout (:mod:`.api`). The sequential part is laying demands against supplies:

For a target ``T``, demands (in demand order) end at the cumulative boundaries
``d_hi`` on one token axis; supply ranks (most slack first) follow each other
on the same axis. A rank starting at position ``x`` inside demand ``j``
(``j = #{boundaries <= x}``) ends at ``min(x + supply, d_pad[j + S - 1])``
(``d_pad`` is ``d_hi`` followed by ``S`` copies of the total): it takes at most
``S`` experts and stops at a demand boundary rather than start another. The walk
over the ranks also checks the plan it lays out, so no ``[C, E, G]`` table is
needed: every piece (one rank's share of one demand) must hold at least
``min_replica_tokens`` tokens and no demand may be split over more than
``max_replicas - 1`` ranks (the ``S``-expert limit per rank holds by
construction).

Two implementations give the same integers:

* ``"xla"`` (:mod:`.reference`): the orders as XLA ops and :func:`.reference.fill_layout`, a ``lax.scan`` over
  the ranks for ``C`` candidate targets at once, called once per search round (on GPU every step of the scan
  is a few kernel launches);
* ``"pallas"`` (:mod:`._triton`): ONE Triton kernel that takes the expert loads and does everything up to the
  layout: the orders (hot order on each rank, supply order, demand order, by pairwise compares) and every
  search round (candidate grid, demands, their running sums, the walk), with the candidates as vectors; the
  pick of the smallest feasible candidate of the last round is one small XLA step after it. A one-round
  search (the default) splits its candidates over programs of :attr:`Config.lanes` that walk in parallel;
  several rounds run in one program (each round's pick feeds the next). Under ``vmap`` the batch becomes the
  kernel's first grid axis. Off GPU it runs in Pallas interpret mode (slowly; for tests).

:mod:`.config` holds ``Config``, the kernel's frozen tiling.
"""

from moe_eplb_jax.routing._quota_search._triton import search_pallas
from moe_eplb_jax.routing._quota_search.api import search
from moe_eplb_jax.routing._quota_search.config import IMPLEMENTATIONS, Config
from moe_eplb_jax.routing._quota_search.reference import search_reference

__all__ = ["IMPLEMENTATIONS", "Config", "search", "search_pallas", "search_reference"]

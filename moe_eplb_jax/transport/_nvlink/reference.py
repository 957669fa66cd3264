"""The jnp put: each round's packed rows ``ppermute``-d to their receiver, then scattered into its rows."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

__all__ = ["put_rows_reference"]


def put_rows_reference(
    staged,
    dst,
    row_views,
    next_rows=None,
    *,
    axis: str,
    num_ranks: int,
    rows_per_round: int,
    offsets: Sequence[int],
    local: bool = False,
):
    """``api.put_rows``'s result, inside ``shard_map`` over ``axis`` (``local``: this rank's own rows, no mesh).

    The next chunk is packed from the rows as they were (the caller guarantees no peer writes them).
    """
    views = [jnp.asarray(v) for v in row_views]
    following = None
    if next_rows is not None:
        rows = jnp.asarray(next_rows)
        following = jnp.concatenate([v[rows] for v in views], axis=1)
    staged, dst = jnp.asarray(staged), jnp.asarray(dst)
    if local:
        received = [(staged, dst)]
    else:
        received = []
        for d in range(1, num_ranks):
            part = slice((d - 1) * rows_per_round, d * rows_per_round)
            perm = [(r, (r + d) % num_ranks) for r in range(num_ranks)]
            received.append((jax.lax.ppermute(staged[part], axis, perm), jax.lax.ppermute(dst[part], axis, perm)))
    for rows, where in received:
        views = [
            # Padding names rows past the views (.at[] drops them); a negative row is moved past the end too.
            v.at[jnp.where(where >= 0, where, v.shape[0])].set(rows[:, offset : offset + v.shape[1]], mode="drop")
            for v, offset in zip(views, offsets)
        ]
    return views, following

"""The pure-jnp row gather / scatter: the ``"xla"`` implementation and the oracle of the kernels."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

__all__ = ["gather_rows_reference", "scatter_rows_reference"]


def gather_rows_reference(row_views: Sequence[jax.Array], rows: jax.Array) -> jax.Array:
    """``[C, sum(m_i)]``: row ``rows[c]`` of every view, leaf after leaf (out-of-range rows clamped into range)."""
    views = [jnp.asarray(v) for v in row_views]
    rows = jnp.clip(jnp.asarray(rows), 0, views[0].shape[0] - 1)
    return jnp.concatenate([v[rows] for v in views], axis=1)


def scatter_rows_reference(row_views: Sequence[jax.Array], packed: jax.Array, dst: jax.Array) -> list[jax.Array]:
    """The views with packed row ``c`` written to row ``dst[c]`` of each; ``dst`` outside ``[0, N)`` skipped."""
    packed, dst = jnp.asarray(packed), jnp.asarray(dst)
    out, offset = [], 0
    for view in row_views:
        view = jnp.asarray(view)
        width = view.shape[1]
        # .at[] wraps a negative index around: move every out-of-range destination past the end, where it drops.
        skip = jnp.where((dst >= 0) & (dst < view.shape[0]), dst, view.shape[0])
        out.append(view.at[skip].set(packed[:, offset : offset + width], mode="drop"))
        offset += width
    return out

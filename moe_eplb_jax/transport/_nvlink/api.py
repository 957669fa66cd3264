"""``put_rows``: the put schedule's write of packed rows into the peers' rows, and where it can run."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from moe_eplb_jax.transport._nvlink import _mosaic
from moe_eplb_jax.transport._nvlink.config import WORD_MULTIPLE, Config, copy_words
from moe_eplb_jax.transport._nvlink.reference import put_rows_reference

__all__ = ["IMPLEMENTATIONS", "can_put", "put_rows"]

IMPLEMENTATIONS = ("mosaic", "xla")  # the NVLink kernel; the jnp reference


def can_put(widths: Sequence[int], devices) -> bool:
    """Whether the put kernel can move rows of these word widths between ``devices`` (all GPUs of this process)."""
    devices = list(devices)
    return (
        len(devices) > 1
        and all(d.platform == "gpu" for d in devices)
        and jax.device_count() == jax.local_device_count()
        and all(copy_words(int(w)) for w in widths)
    )


def put_rows(
    staged,
    dst,
    row_views,
    next_rows=None,
    *,
    axis: str,
    num_ranks: int,
    rows_per_round: int,
    offsets: Sequence[int],
    config: Config = Config(),
    local: bool = False,
    interpret=None,
    implementation: str = "mosaic",
):
    """Writes ``staged`` rows into the row views of the peers; call inside ``shard_map`` over ``axis``.

    ``staged`` is ``[N, B]`` uint32 with ``N = (G - 1) * rows_per_round``:
    rows ``(d - 1) * rows_per_round ...`` go to rank ``(r + d) % G``.
    ``dst [N]`` int32 names each row's destination row in the *receiver's*
    row views (rows at or beyond their length: padding, not written).
    ``row_views`` are this rank's ``[num_rows, m_i]`` uint32 leaves; packed
    row ``k`` holds leaf ``i``'s row in words ``offsets[i] : offsets[i] +
    m_i``. ``next_rows [N']`` (optional): local rows to pack, as
    ``pack_rows`` would, into a new ``[N', B]`` buffer by
    ``config.pack_programs`` of the programs (the caller guarantees no peer
    writes them in this call). ``local`` writes this rank's own rows instead
    of the peers' (no remote refs, no semaphores: the Mosaic GPU interpreter
    has neither), to check the copy pipeline off the GPU.

    ``implementation``: ``"mosaic"`` (the kernel) or ``"xla"`` (the
    reference: a ``ppermute`` per round, then a scatter; ``config`` and
    ``interpret`` unused).

    Returns ``(row views with every row the peers sent written, the next
    staged buffer or None)``; the row views are updated in place where the
    caller donates them.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    row_views = list(row_views)
    widths = tuple(int(v.shape[1]) for v in row_views)
    if not isinstance(config, Config):
        raise ValueError(f"config must be a _nvlink.Config, got {type(config).__name__}")
    chunks = tuple(copy_words(w, config.max_copy_bytes) for w in widths)
    if not all(chunks):
        raise ValueError(f"put_rows: every row must be a multiple of {WORD_MULTIPLE * 4} bytes, got widths {widths}")
    if implementation == "xla":
        return put_rows_reference(
            staged,
            dst,
            row_views,
            next_rows,
            axis=axis,
            num_ranks=num_ranks,
            rows_per_round=rows_per_round,
            offsets=offsets,
            local=local,
        )
    return _mosaic.put_rows_mosaic(
        staged,
        dst,
        row_views,
        next_rows,
        axis=axis,
        num_ranks=num_ranks,
        rows_per_round=rows_per_round,
        offsets=offsets,
        widths=widths,
        chunks=chunks,
        config=config,
        local=local,
        interpret=interpret,
    )

"""Write packed rows straight into the peer GPUs' expert rows over NVLink: one kernel package.

The ``"put"`` schedule of the executor (``transport``) moves a rearrangement
chunk by chunk. A chunk's send rows of every round are packed into one
``[N, B]`` uint32 buffer (``staged``); :func:`put_rows` then copies each
packed row of round ``d`` into its *final* rows of rank ``(r + d) % G``'s row
views -- TMA bulk copies HBM -> shared memory -> the peer's HBM
(``plgpu.remote_ref``). No receive buffer, no unpack, one kernel per chunk
instead of a collective per round and chunk. The same kernel packs the *next*
chunk on a few of its programs (``next_rows``: local rows -> a new staged
buffer), so after the first chunk the packing hides behind the transfer.

Ordering, per chunk ``c``: the kernel starts with XLA's cross-device barrier,
so every rank has finished its work before kernel ``c`` -- in particular
packing chunk ``c`` -- before any peer writes chunk ``c``'s rows into it. The
plan's streaming order (``streaming.order_for_streaming``: a row is written in a
chunk no earlier than every chunk that reads it) means no row packed for
chunk ``c + 1`` is written in chunk ``c``, so packing it beside chunk ``c``'s
writes is safe. Each program, once its stores have landed, signals a
semaphore on every peer (a ``release`` at system scope); program 0 of each
rank waits for all of them, so when the kernel returns every row written into
this rank is complete.

Peer addresses come from XLA's collective metadata, so the kernel needs every
device of the mesh in this process (``jax.device_count() ==
jax.local_device_count()``) and no NVSHMEM. Nothing multicast is used.
"

* :mod:`.api` -- ``put_rows`` (the semantics, the checks, ``implementation="mosaic" | "xla"``), ``can_put``;
* :mod:`.reference` -- the jnp implementation ``"xla"``: a ``ppermute`` per round and a scatter (the oracle);
* :mod:`._mosaic` -- the Pallas Mosaic GPU kernel ``"mosaic"``;
* :mod:`.config` -- ``Config``, the frozen tiling, ``config_for(device)`` and ``copy_words``.
"""

from moe_eplb_jax.transport._nvlink.api import IMPLEMENTATIONS, can_put, put_rows
from moe_eplb_jax.transport._nvlink.config import Config, config_for, copy_words

__all__ = ["IMPLEMENTATIONS", "Config", "can_put", "config_for", "copy_words", "put_rows"]

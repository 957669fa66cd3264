"""One process of the multi-process transport test (launched by test_transport_multiprocess.py).

Usage: python _mp_transport_worker.py PROCESS_ID NUM_PROCESSES PORT
Each process owns 4 CPU devices; the EP mesh spans all processes' devices.
Prints WORKER_OK <id> when every local shard holds the expected bytes.
"""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax
import ml_dtypes
import numpy as np


def main():
    process_id, num_processes, port = (int(a) for a in sys.argv[1:4])
    jax.config.update("jax_numpy_rank_promotion", "raise")
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=30,
    )
    from moe_eplb_jax import transport as eps
    from moe_eplb_jax.transport.packing import byte_rows_numpy

    num_ranks = jax.device_count()
    assert num_ranks == 4 * num_processes and jax.local_device_count() == 4, jax.devices()
    rng = np.random.default_rng(1234)  # the same placements and checkpoint in every process
    layers, experts, slots = 2, 3 * num_ranks, 4 * num_ranks
    ckpt = {}
    for name, dtype, width in (
        ("bf16", ml_dtypes.bfloat16, 2),
        ("e5m2", ml_dtypes.float8_e5m2, 1),
        ("e8m0", ml_dtypes.float8_e8m0fnu, 1),
        ("fp4", ml_dtypes.float4_e2m1fn, 1),
    ):
        raw = rng.integers(0, 256, (layers, experts, 4, width), dtype=np.uint8)
        if name == "fp4":
            raw &= np.uint8(0x0F)
        ckpt[name] = raw.view(dtype).reshape(layers, experts, 4)

    def placement():
        extra = rng.integers(0, experts, slots - experts)
        return np.stack([rng.permutation(np.concatenate([np.arange(experts), extra])) for _ in range(layers)])

    def load(phy2log):
        return {k: v[np.arange(layers)[:, None], phy2log] for k, v in ckpt.items()}

    def check(arrays, phy2log, what):
        expected = load(phy2log)
        for k, arr in arrays.items():
            for shard in arr.addressable_shards:
                got = byte_rows_numpy(np.asarray(shard.data), 2)
                want = byte_rows_numpy(expected[k][shard.index], 2)
                if not np.array_equal(got, want):
                    raise SystemExit(f"process {process_id}: {what}: leaf {k} shard {shard.index} differs")

    mesh = eps.ep_mesh()
    p0, p1, p2 = placement(), placement(), placement()
    arrays = eps.shard_slots(load(p0), mesh, layered=True)
    arrays = eps.rearrange_experts(arrays, p0, p1, mesh=mesh)
    check(arrays, p1, "all layers")
    for layer in range(layers):  # layer by layer
        arrays = eps.rearrange_experts(arrays, p1, p2, mesh=mesh, layer=layer)
    check(arrays, p2, "layer by layer")
    print(f"WORKER_OK {process_id}", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()

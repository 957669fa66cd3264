"""One process of the multi-process resize test (launched by test_transport_multiprocess.py).

Usage: python _mp_resize_worker.py PROCESS_ID NUM_PROCESSES PORT
Each process owns 4 CPU devices. Moves experts between EP groups spanning both processes, one of them, or
two devices of each, with a lost rank; prints WORKER_OK <id> when every local shard holds the expected bytes.
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
    from moe_eplb_jax import policy
    from moe_eplb_jax import transport as eps
    from moe_eplb_jax.transport.packing import byte_rows_numpy

    assert jax.device_count() == 4 * num_processes and jax.local_device_count() == 4, jax.devices()
    rng = np.random.default_rng(1234)  # the same placements and checkpoint in every process
    layers, experts = 2, 12
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
    weight = rng.lognormal(0, 1, (layers, experts))

    def load(phy2log):
        return {k: v[np.arange(layers)[:, None], phy2log] for k, v in ckpt.items()}

    def check(arrays, phy2log, new_mesh, what):
        expected = load(phy2log)
        local = [d for d in new_mesh.devices.flat if d.process_index == process_id]
        for k, arr in arrays.items():
            if k == "count":
                if local and int(arr.addressable_shards[0].data) != 7:
                    raise SystemExit(f"process {process_id}: {what}: the step count differs")
                continue
            assert {s.device for s in arr.addressable_shards} == set(local), (what, k)
            for shard in arr.addressable_shards:
                got = byte_rows_numpy(np.asarray(shard.data), 2)
                if not np.array_equal(got, byte_rows_numpy(expected[k][shard.index], 2)):
                    raise SystemExit(f"process {process_id}: {what}: leaf {k} shard {shard.index} differs")

    devices = jax.devices()  # process 0's four, then process 1's
    both, first = eps.ep_mesh(8), eps.ep_mesh(4, devices=devices[:4])
    two_and_two = eps.ep_mesh(4, devices=[devices[0], devices[1], devices[4], devices[5]])
    phy2log, mesh = policy.get("balanced")(weight, 16, 1, 1, 8)[0], both
    arrays = eps.shard_slots(load(phy2log), mesh, layered=True)
    arrays["count"] = eps.put_host(np.int32(7), mesh)
    for what, new_mesh, lost in (
        ("2 x 4 -> 1 x 4", first, ()),
        ("1 x 4 -> 2 x 4", both, ()),
        ("2 x 4 -> 2 x 2", two_and_two, ()),
        ("2 x 2 -> 1 x 4, rank 2 lost", first, (2,)),
    ):
        num_ranks, new_num_ranks = mesh.devices.size, new_mesh.devices.size
        new = policy.resize_placement(
            weight,
            phy2log,
            num_ranks=num_ranks,
            new_num_ranks=new_num_ranks,
            new_num_physical=16,
            new_rank_of_old=eps.new_rank_of_old(mesh, new_mesh),
            lost_ranks=lost,
        ).phy2log
        reload = (
            eps.reload_from(dict(ckpt, count=0))
            if eps.missing_experts(phy2log, num_ranks, new, lost_ranks=lost).size
            else None
        )
        arrays = eps.resize_experts(arrays, phy2log, new, mesh=mesh, new_mesh=new_mesh, lost_ranks=lost, reload=reload)
        check(arrays, new, new_mesh, what)
        phy2log, mesh = new, new_mesh
    print(f"WORKER_OK {process_id}", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()

"""One process of the multi-process controller resize test (launched by test_transport_multiprocess.py).

Usage: python _mp_controller_resize_worker.py PROCESS_ID NUM_PROCESSES PORT
Each process owns 4 CPU devices. ``EplbController.resize`` moves an NNX model (every dtype in its expert state,
Adam moments) between EP groups spanning both processes, one of them, or two devices of each, the last with a lost
rank. After every move each local shard of every expert leaf holds the checkpoint's bytes for the new placement,
every process holds the same placement, and the outputs on the local devices equal those before any move; prints
WORKER_OK <id>.
"""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax


def main():
    process_id, num_processes, port = (int(a) for a in sys.argv[1:4])
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=30,
    )
    import numpy as np
    from _elastic import L, build, checkpoint, forward, layer_state, scenario_loads, slots, tokens
    from jax.experimental import multihost_utils
    from jax.sharding import PartitionSpec as PS

    from moe_eplb_jax import EplbConfig
    from moe_eplb_jax.flax import EplbController
    from moe_eplb_jax.placement import Placement
    from moe_eplb_jax.transport import ep_mesh, missing_experts, put_host
    from moe_eplb_jax.transport.packing import byte_rows_numpy

    E, P = 8, 16
    devices = jax.devices()  # process 0's four, then process 1's
    both, first = ep_mesh(8, devices=devices), ep_mesh(4, devices=devices[:4])
    two_and_two = ep_mesh(4, devices=[devices[0], devices[1], devices[4], devices[5]])
    ckpt = checkpoint()
    linear = Placement.linear(L, E, P)
    model, optimizer = build(both, P, ckpt, linear.phy2log)
    config = EplbConfig(num_redundant_experts=P - E, window_size=4, step_interval=1000, num_gpus=8)
    ctl = EplbController(model, both, config, optimizer=optimizer)
    x = tokens()
    reference = np.asarray(multihost_utils.process_allgather(forward(model, put_host(x, both, PS("ep"))), tiled=True))

    def check(mesh, what):
        placement = ctl.placement
        agreed = multihost_utils.process_allgather(placement.phy2log)
        if not all(np.array_equal(row, placement.phy2log) for row in agreed):
            raise SystemExit(f"process {process_id}: {what}: the processes hold different placements")
        state = slots(ckpt, placement.phy2log)
        expected = {"w_in": state["w_in"], "w_out": state["w_out"], **state["extras"]}
        expected.update({f"{m}/{k}": v for m in ("mu", "nu") for k, v in state[m].items()})
        for layer, got in enumerate(layer_state(model, optimizer)):
            leaves = {**got["experts"], **got["experts"]["extras"]}
            leaves.update({f"{m}/{k}": v for m in ("mu", "nu") for k, v in got[m].items()})
            leaves.pop("extras")
            for name, leaf in leaves.items():
                if list(leaf.sharding.mesh.devices.flat) != list(mesh.devices.flat):
                    raise SystemExit(f"process {process_id}: {what}: {name} is not on the new mesh")
                for shard in leaf.addressable_shards:
                    want = expected[name][layer][shard.index]
                    if not np.array_equal(byte_rows_numpy(np.asarray(shard.data), 1), byte_rows_numpy(want, 1)):
                        raise SystemExit(f"process {process_id}: {what}: layer {layer} {name} {shard.index} differs")
        out = forward(model, put_host(x, mesh, PS("ep")))
        for shard in out.addressable_shards:
            if not np.array_equal(np.asarray(shard.data), reference[shard.index]):
                raise SystemExit(f"process {process_id}: {what}: the outputs differ")

    mesh = both
    for step, (what, new_mesh, lost) in enumerate(
        (
            ("2 x 4 -> 1 x 4", first, ()),
            ("1 x 4 -> 2 x 4", both, ()),
            ("2 x 4 -> 2 x 2", two_and_two, ()),
            ("2 x 2 -> 1 x 4, rank 2 lost", first, (2,)),
        )
    ):
        loads = scenario_loads(step, ctl.num_ranks, ctl.num_physical)
        for layer, load in zip(model.layers, loads):
            layer.expert_load.set_value(put_host(load, mesh, PS("ep")))
        ctl.step()
        reload = None
        if lost and missing_experts(ctl.placement.phy2log, ctl.num_ranks, lost_ranks=lost).size:
            saved, saved_optimizer = build(
                first if process_id == 0 else ep_mesh(4, devices=devices[4:]), P, ckpt, linear.phy2log
            )
            reload = EplbController.expert_source(saved, linear, optimizer=saved_optimizer)
        report = ctl.resize(new_mesh, num_physical=P, lost_ranks=lost, reload=reload)
        print(f"{what}: {report['rows_moved']} rows moved, {report['rows_reloaded']} reloaded", flush=True)
        check(new_mesh, what)
        mesh = new_mesh
    print(f"WORKER_OK {process_id}", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()

"""One process of tests/test_multiprocess.py: 2 CPU devices, jax.distributed over localhost (gloo)."""

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax

port, process_id, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as PS  # noqa: E402

from moe_eplb_jax.config import EplbConfig  # noqa: E402
from moe_eplb_jax.flax import EplbController, MoELayer  # noqa: E402

E, P, D, H = 8, 12, 16, 8
mesh = jax.make_mesh((4,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))


class Model(nnx.Module):
    def __init__(self, rngs):
        self.moe = MoELayer(D, H, E, 2, mesh=mesh, num_physical=P, rngs=rngs)
        skew = -1.5 * np.log1p(np.arange(E, dtype=np.float32))
        value = self.moe.router_bias.get_value()
        self.moe.router_bias.set_value(jax.make_array_from_callback(value.shape, value.sharding, lambda i: skew[i]))

    def __call__(self, x):
        return self.moe(x)


model = Model(nnx.Rngs(0))
layer = model.moe
# The global expert weights, slot e holding expert e (linear start), rebuilt on every process.
full = {}
for name in ("w_in", "w_out"):
    value = layer.eplb_expert_variables()[name].get_value()
    gathered = jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, PS()))(value)
    full[name] = np.asarray(gathered)[:E]
config = EplbConfig(num_redundant_experts=P - E, window_size=4, step_interval=4, num_gpus=4)
controller = EplbController(model, mesh, config)
data = np.random.default_rng(7).standard_normal((4, 16, D)).astype(np.float32)
x = jax.make_array_from_callback(data.shape, NamedSharding(mesh, PS("ep")), lambda i: data[i])
forward = nnx.jit(lambda m, x: m(x))
before = forward(model, x)
report = None
while report is None or not report.get("rearranged"):
    forward(model, x)
    report = controller.step()
after = forward(model, x)
phy2log = controller.placement.phy2log
exact = True
for name in ("w_in", "w_out"):
    expected = full[name][phy2log[0]]
    for shard in layer.eplb_expert_variables()[name].get_value().addressable_shards:
        exact &= bool(np.array_equal(np.asarray(shard.data).view(np.uint8), expected[shard.index].view(np.uint8)))
same_out = all(
    np.array_equal(np.asarray(a.data), np.asarray(b.data))
    for a, b in zip(before.addressable_shards, after.addressable_shards)
)
with open(out_path, "w") as f:
    json.dump(
        {
            "phy2log": phy2log.tolist(),
            "exact": exact,
            "same_out": bool(same_out),
            "balancedness_after": report["balancedness_after"],
            "moved": report["slots_moved"],
            "devices": jax.device_count(),
            "local": jax.local_device_count(),
        },
        f,
    )
jax.distributed.shutdown()

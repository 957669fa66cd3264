"""Worker of tests/test_control_checkpoint.py: a crash while committing a save, or two processes saving at once.

python _checkpoint_worker.py crash DIR            # saves step 1, is killed while committing step 2
python _checkpoint_worker.py two DIR PORT ID      # one of two jax.distributed processes (2 CPU devices each)
"""

import json
import os
import pathlib
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package
os.environ["JAX_PLATFORMS"] = "cpu"
mode, directory = sys.argv[1], pathlib.Path(sys.argv[2])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={4 if mode == 'crash' else 2}"

import jax  # noqa: E402

if mode == "two":
    port, process_id = int(sys.argv[3]), int(sys.argv[4])
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)

import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as PS  # noqa: E402

from moe_eplb_jax.config import EplbConfig  # noqa: E402
from moe_eplb_jax.flax import EplbController, MoELayer  # noqa: E402

E, P, D = 8, 12, 16
mesh = jax.make_mesh((4,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
config = EplbConfig(num_redundant_experts=P - E, window_size=4, step_interval=8, num_gpus=4)


class Model(nnx.Module):
    def __init__(self, seed):
        self.moe = MoELayer(D, 8, E, 2, mesh=mesh, num_physical=P, rngs=nnx.Rngs(seed))
        skew = -1.5 * np.log1p(np.arange(E, dtype=np.float32))
        value = self.moe.router_bias.get_value()
        self.moe.router_bias.set_value(jax.make_array_from_callback(value.shape, value.sharding, lambda i: skew[i]))

    def __call__(self, x):
        return self.moe(x)


forward = nnx.jit(lambda m, x: m(x))
data = np.random.default_rng(7).standard_normal((4 * 8, D)).astype(np.float32)
x = jax.make_array_from_callback(data.shape, NamedSharding(mesh, PS("ep")), lambda i: data[i])


def run(seed, steps):
    model = Model(seed)
    ctl = EplbController(model, mesh, config)
    for _ in range(steps):
        forward(model, x)
        ctl.step()
    return model, ctl


def save(manager, step, model, ctl):
    manager.save(
        step,
        args=ocp.args.Composite(
            model=ocp.args.StandardSave(nnx.state(model)), eplb=ocp.args.StandardSave(ctl.checkpoint_item())
        ),
    )
    manager.wait_until_finished()


if mode == "crash":
    manager = ocp.CheckpointManager(directory / "ckpt")
    model, ctl = run(0, 3)
    save(manager, 1, model, ctl)
    np.savez(directory / "saved_1.npz", **ctl.checkpoint_item())
    print("saved 1", flush=True)
    for _ in range(3):
        forward(model, x)
        ctl.step()

    def die(*args, **kwargs):  # every file of step 2 written; the commit (a rename) never happens
        print("committing 2", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    os.rename = die
    pathlib.Path.rename = die
    save(manager, 2, model, ctl)
    print("not killed", flush=True)
    sys.exit(0)

manager = ocp.CheckpointManager(directory / "ckpt")
model, ctl = run(0, 3)
assert ctl.num_rearrangements == 1
save(manager, 3, model, ctl)
fresh = Model(1)
twin = EplbController(fresh, mesh, config)
restored = manager.restore(
    3, args=ocp.args.Composite(model=ocp.args.StandardRestore(nnx.state(fresh)), eplb=ocp.args.StandardRestore())
)
twin.restore_item(restored["eplb"])
nnx.update(fresh, restored["model"])
a, b = forward(model, x), forward(fresh, x)
same_out = all(
    np.array_equal(np.asarray(s.data), np.asarray(t.data)) for s, t in zip(a.addressable_shards, b.addressable_shards)
)
result = {
    "steps": list(manager.all_steps()),
    "restored_equal": bool(
        same_out
        and twin.placement == ctl.placement
        and np.array_equal(twin.window_slot_load(), ctl.window_slot_load())
        and twin.total_steps == ctl.total_steps
    ),
    "placement_moved": bool(np.any(ctl.placement.phy2log != np.arange(P) % E)),
}
(directory / f"result_{process_id}.json").write_text(json.dumps(result))
jax.distributed.shutdown()

"""What ``EplbController.step()`` costs the host when nothing is due, next to one trivial jitted call.

A stack of ``MoELayer`` s shaped like the ``small`` preset's MoE layers (7 layers of 64 experts, one EP rank, a
window of 1000 steps) under an ``EplbController`` that never rearranges. Printed, in microseconds per call (the
median of ``--repeats`` runs of ``--calls`` calls each, so a busy host shows as spread, not as the figure):

* ``trivial_jit``: ``x + 1`` jitted on one device (the floor of any dispatch);
* ``trivial_jit_mesh``: the same on the EP mesh's devices (the floor of a program over ``--ranks`` devices);
* ``window_update``: the jitted window update alone (``LoadWindow.close`` on a window of the controller's shape);
* ``step``: ``controller.step()`` with nothing due: the loads read and reset, the window update, the counters;
* ``schedule_tick``: the functional API's per-step host work (``Schedule.tick()`` and ``due``);
* ``loop_and_steps_closed``: 16 steps closed in a caller's own on-device loop, as ``generate(controller=)``
  runs them once per call: the loop's dispatch (a jitted call, as ``trivial_jit``) and
  ``controller.steps_closed(state, 16)`` (the window taken back, the steps counted, the loads reset).

No step reads the device or uploads to it (``tests/test_control_loop.py`` holds that under a transfer guard).

  PYTHONPATH=. python benchmarks/controller_step.py                                         # one GPU
  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/controller_step.py                       # CPU
  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
      PYTHONPATH=. python benchmarks/controller_step.py --ranks 4 --redundant 4              # a CPU mesh
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=7, help="MoE layers")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--redundant", type=int, default=0)
    p.add_argument("--ranks", type=int, default=1, help="EP ranks")
    p.add_argument("--window", type=int, default=1000, help="EplbConfig.window_size")
    p.add_argument("--calls", type=int, default=2000, help="calls per timed run")
    p.add_argument("--repeats", type=int, default=7, help="timed runs (the median is printed)")
    return p.parse_args(argv)


def per_call_us(fn, calls: int, repeats: int) -> float:
    """Median over ``repeats`` runs of the mean microseconds per call of ``fn`` (host time: nothing waits)."""
    for _ in range(calls // 10 + 1):
        fn()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(runs)


def main(argv=None):
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from moe_eplb_jax.config import EplbConfig
    from moe_eplb_jax.control import LoadWindow, Schedule, close_step
    from moe_eplb_jax.flax import EplbController, MoELayer
    from moe_eplb_jax.transport import ep_mesh, put_host

    mesh = ep_mesh(args.ranks)
    num_physical = args.experts + args.redundant

    class Stack(nnx.Module):
        def __init__(self):
            rngs = nnx.Rngs(0)
            layer = lambda: MoELayer(16, 16, args.experts, 2, mesh=mesh, num_physical=num_physical, rngs=rngs)
            self.layers = nnx.List([layer() for _ in range(args.layers)])

    config = EplbConfig(
        num_redundant_experts=args.redundant,
        window_size=args.window,
        step_interval=10**9,  # nothing is ever due
        num_gpus=args.ranks,
    )
    model = Stack()
    controller = EplbController(model, mesh, config)
    trivial = jax.jit(lambda x: x + 1)
    one = jnp.zeros(())
    spread = put_host(np.zeros(args.ranks, np.float32), mesh, jax.sharding.PartitionSpec("ep"))
    # The window update alone, as the step runs it: a window of the controller's shape, the layers' loads.
    window = LoadWindow(config, mesh, args.layers, num_physical, "ep")
    loads = [layer.eplb_load_variable().get_value() for layer in model.layers]
    dummy, held = window.dummy(False), [window.fresh()]

    def window_update():
        held[0] = window.close(held[0], loads, dummy)

    schedule = Schedule(config)
    # A caller's on-device loop of 16 steps; its window comes back to the controller between two of them.
    looped = jax.jit(
        lambda state, dummy: jax.lax.fori_loop(0, 16, lambda _, s: close_step(s, loads, dummy=dummy), state),
        donate_argnums=0,
    )

    def loop_and_steps_closed():
        controller.steps_closed(looped(*controller.device_window()), 16)

    def schedule_tick():
        schedule.tick()
        return schedule.due

    timed = {
        "trivial_jit": lambda: trivial(one),
        "trivial_jit_mesh": lambda: trivial(spread),
        "window_update": window_update,
        "step": controller.step,
        "schedule_tick": schedule_tick,
        "loop_and_steps_closed": loop_and_steps_closed,
    }
    result = {
        "device": jax.devices()[0].device_kind,
        "ranks": args.ranks,
        "layers": args.layers,
        "slots": num_physical,
        "window": args.window,
        **{f"{name}_us": round(per_call_us(fn, args.calls, args.repeats), 2) for name, fn in timed.items()},
    }
    jax.block_until_ready(controller.state)
    assert controller.num_rearrangements == 0
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""Start-up shared by the examples: simulated devices, several processes, the EP mesh.

JAX reads the device count when it starts, so ``start`` sets the flags BEFORE
importing jax; the example scripts therefore import jax only after calling it.
"""

from __future__ import annotations

import os


def add_runtime_args(parser):
    """Adds --devices, --ranks and the multi-process flags to an argparse parser."""
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (0: use the real backend)")
    parser.add_argument("--ranks", type=int, default=None, help="EP ranks (default: every device)")
    parser.add_argument("--coordinator", help="HOST:PORT of process 0 (several hosts/processes)")
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)


class Runtime:
    """The EP mesh, and helpers to place host data on it (the same on every process)."""

    def __init__(self, args):
        if args.devices:
            os.environ.setdefault("JAX_PLATFORMS", "cpu")
            os.environ["XLA_FLAGS"] = (
                os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
            )
        import jax

        if args.coordinator:
            jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
        self.ranks = args.ranks or jax.device_count()
        self.mesh = jax.make_mesh(
            (self.ranks,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[: self.ranks]
        )
        self.replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())

    def global_batch(self, host):
        """Every process holds the same host batch; each device takes its rows."""
        from jax.sharding import PartitionSpec

        from moe_eplb_jax.sharding import put_host

        return put_host(host, self.mesh, PartitionSpec("ep"))

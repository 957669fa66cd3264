"""Start-up shared by the examples: flag types and checks, ``--eplb-config``, simulated devices, the EP mesh.

JAX reads its platform and device count when it is imported and started, so
a script calls ``prepare_devices(argv)`` first, before anything imports jax
(``moe_eplb_jax`` does), then parses and checks its flags the argparse way
(one line naming the flag, exit status 2), then builds the ``Runtime``.

The EPLB configuration of a run is layered: the example's defaults, then the
fields ``--eplb-config`` names (a JSON file or the JSON itself, vLLM's field
names or this library's), then the flags given on the command line
(``eplb_fields``); ``build_eplb_config`` builds the ``EplbConfig`` for the run's EP
size. Both raise ``ValueError`` naming the flag or field, for ``parser.error``.
"""

from __future__ import annotations

import argparse
import json
import math
import os


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every flag's default in its help."""


def _number(kind, text: str, test, what: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    if not test(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be {what}")
    return value


def positive_int(text: str) -> int:
    return _number(int, text, lambda v: v >= 1, "a positive integer")


def nonnegative_int(text: str) -> int:
    return _number(int, text, lambda v: v >= 0, "an integer >= 0")


def positive_float(text: str) -> float:
    return _number(float, text, lambda v: v > 0, "a positive number")


def nonnegative_float(text: str) -> float:
    return _number(float, text, lambda v: v >= 0, "a number >= 0")


def unit_interval(text: str) -> float:
    return _number(float, text, lambda v: 0 < v <= 1, "in (0, 1]")


def existing_file(text: str) -> str:
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return text


def writable_path(text: str) -> str:
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a directory")
    if not os.path.isdir(os.path.dirname(os.path.abspath(text))):
        raise argparse.ArgumentTypeError(f"{text}: its directory does not exist")
    return text


DEFAULT_DEVICES = 8


def prepare_devices(argv=None) -> None:
    """Sets JAX's platform, device count and CPU compile flags from ``--devices`` (default 8) before jax starts.

    A malformed value is left to the full parser to report.
    """
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--devices", default=str(DEFAULT_DEVICES))
    known, _ = pre.parse_known_args(argv)
    try:
        devices = int(known.devices)
    except ValueError:
        return
    if devices > 0:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
        # Simulated devices run many small programs a few times each: LLVM's optimisation passes cost more
        # compile time than they save (a third of the CPU time of serve.py's default run).
        if "xla_backend_optimization_level" not in flags:
            flags += " --xla_backend_optimization_level=0"
        os.environ["XLA_FLAGS"] = flags.strip()


def add_runtime_args(parser):
    """Adds --devices, --ranks and the multi-process flags to an argparse parser."""
    parser.add_argument(
        "--devices", type=nonnegative_int, default=DEFAULT_DEVICES, help="simulated CPU devices (0: the real backend)"
    )
    parser.add_argument("--ranks", type=positive_int, default=None, help="EP ranks (default: every device)")
    parser.add_argument("--coordinator", help="HOST:PORT of process 0 (several hosts/processes)")
    parser.add_argument("--num-processes", type=positive_int, default=1, help="processes taking part")
    parser.add_argument("--process-id", type=nonnegative_int, default=0, help="this process's index")


def check_runtime_args(parser, args) -> int | None:
    """Checks the runtime flags against each other; returns the EP size where it is known before jax starts."""
    if args.process_id >= args.num_processes:
        parser.error(f"--process-id {args.process_id} must be below --num-processes {args.num_processes}")
    if args.num_processes > 1 and not args.coordinator:
        parser.error("--num-processes > 1 needs --coordinator HOST:PORT")
    if args.devices and args.ranks is not None and args.ranks > args.devices * args.num_processes:
        parser.error(f"--ranks {args.ranks} exceeds the {args.devices * args.num_processes} simulated devices")
    if args.ranks is not None:
        return args.ranks
    return args.devices * args.num_processes if args.devices else None


def check_divides(parser, ranks: int | None, sizes: dict[str, int]) -> None:
    """``parser.error`` unless ``ranks`` divides each size, named as the user knows it (``"--batch"``...)."""
    if ranks is None:
        return
    for name, size in sizes.items():
        if size % ranks:
            parser.error(f"{name} = {size} is not divisible by the {ranks} EP ranks (--ranks)")


class Runtime:
    """The EP mesh, and helpers to place host data on it (the same on every process)."""

    def __init__(self, args, parser=None):
        import jax  # after prepare_devices

        if args.coordinator:
            jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
        self.ranks = args.ranks or jax.device_count()
        if self.ranks > jax.device_count():
            message = f"--ranks {self.ranks} exceeds the {jax.device_count()} devices of the {jax.default_backend()}"
            if parser is None:
                raise ValueError(message)
            parser.error(message)
        self.mesh = jax.make_mesh(
            (self.ranks,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[: self.ranks]
        )
        self.replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())

    def resize(self, ranks: int):
        """The mesh over the first ``ranks`` devices, which becomes this runtime's (elastic EP)."""
        import jax

        self.ranks = ranks
        self.mesh = jax.make_mesh(
            (ranks,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:ranks]
        )
        self.replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        return self.mesh

    def global_batch(self, host):
        """Every process holds the same host batch; each device takes its rows."""
        from jax.sharding import PartitionSpec

        from moe_eplb_jax.transport import put_host

        return put_host(host, self.mesh, PartitionSpec("ep"))


# vLLM's names for EplbConfig fields that this library names otherwise (EplbConfig.from_dict maps them).
_VLLM_NAMES = {"log_balancedness": "log_interval", "log_balancedness_interval": "log_interval", "use_async": "overlap"}


def add_eplb_config_arg(parser, flags: str):
    """Adds ``--eplb-config``; ``flags`` names the example's flags that override its fields."""
    parser.add_argument(
        "--eplb-config",
        metavar="FILE",
        help="EplbConfig as JSON: a file, or the JSON object itself; vLLM's field names (window_size, "
        "step_interval, num_redundant_experts, log_balancedness, use_async, policy) or this library's "
        f"(routing, overlap, ...). Fields it leaves out keep this example's defaults; {flags} override it",
    )


def eplb_fields(text: str | None, *, defaults: dict, flags: dict) -> dict:
    """The run's ``EplbConfig`` fields: ``defaults``, then those ``text`` names, then ``flags`` (``None``: not given).

    ``text``: the ``--eplb-config`` value, a JSON file or a JSON object. Raises
    ``ValueError`` naming ``--eplb-config`` and the field for a missing file,
    bad JSON, an unknown field or a bad value.
    """
    from moe_eplb_jax import EplbConfig

    named = {}
    if text:
        if not text.lstrip().startswith("{"):
            if not os.path.isfile(text):
                raise ValueError(f"--eplb-config {text}: no such file (give a JSON file or a JSON object)")
            with open(text) as f:
                text = f.read()
        try:
            config = EplbConfig.from_json(text)
        except ValueError as e:
            raise ValueError(f"--eplb-config: {e}") from None
        keys = {_VLLM_NAMES.get(key, key) for key in json.loads(text)}
        named = {name: value for name, value in config.to_dict().items() if name in keys}
    return {**defaults, **named, **{name: value for name, value in flags.items() if value is not None}}


def parse_eplb_fields(parser, make_fields, ranks: int | None) -> dict:
    """``make_fields()``'s EPLB fields, checked as a config for ``ranks`` EP ranks when known; else one-line exit 2."""
    try:
        fields = make_fields()
        if ranks is not None:
            build_eplb_config(fields, num_gpus=ranks)
    except ValueError as e:
        parser.error(str(e))
    return fields


def build_eplb_config(fields: dict, *, num_gpus: int | None = None):
    """``EplbConfig(**fields)`` for ``num_gpus`` EP ranks (``None``: ``fields``' own); ``ValueError`` naming the field.

    A ``num_gpus`` named in ``--eplb-config`` must be the run's EP size.
    """
    from moe_eplb_jax import EplbConfig

    if num_gpus is not None:
        if fields.get("num_gpus", num_gpus) != num_gpus:
            raise ValueError(f"--eplb-config: num_gpus={fields['num_gpus']} but the run has {num_gpus} EP ranks")
        fields = {**fields, "num_gpus": num_gpus}
    try:
        return EplbConfig(**fields)
    except ValueError as e:
        raise ValueError(f"EPLB config (--eplb-config and flags): {e}") from None


def dense_bf16_peak() -> float | None:
    """The device's dense bf16 peak in FLOP/s for MFU (H100 / H200 SXM: 989 TFLOP/s), or ``None`` where unknown."""
    import jax

    kind = jax.devices()[0].device_kind
    return 989e12 * jax.device_count() if ("H100" in kind or "H200" in kind) else None

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
import contextlib
import math
import os
import stat
import tempfile


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every flag's default in its help (where it has one and its help does not
    already say it)."""

    def _get_help_string(self, action):
        if action.default is None or action.required or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


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


def output_file_problem(path: str, suffixes: tuple[str, ...] = (".json", ".npz")) -> str | None:
    """Why no file can be written at ``path`` (``None``: it can), checked before the run whose result goes there.

    The name must end in one of ``suffixes``; the path must not name a
    directory or a special file; its directory must exist and take a new file
    (tried with a temporary file, so ``/proc``, ``/sys`` and read-only mounts
    are caught even for root).
    """
    if not path.endswith(suffixes):
        return f"the file name must end in {' or '.join(suffixes)}"
    if os.path.isdir(path):
        return "it is a directory"
    if os.path.exists(path) and not os.path.isfile(path):
        return "it names a device, FIFO or socket"
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        return "its directory does not exist"
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".probe.")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        return f"cannot write in {directory} ({e.strerror or e})"
    return None


def output_dir_problem(path: str) -> str | None:
    """Why ``path`` cannot hold the run's files (``None``: it can): an existing directory, or a new one in an
    existing directory; tried with a temporary entry, before the run."""
    if os.path.exists(path) and not os.path.isdir(path):
        return "it is not a directory"
    target = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(target):
        return "its parent directory does not exist"
    try:
        os.rmdir(tempfile.mkdtemp(dir=target, prefix=".probe."))
    except OSError as e:
        return f"cannot write in {target} ({e.strerror or e})"
    return None


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


def add_routing_arg(parser):
    """Adds ``--routing``: the replica routing mode, the ``EplbConfig.routing`` field (a flag wins over the file)."""
    from moe_eplb_jax.routing import MODES

    needs = "; ".join(f"{m.name} uses policy {m.policy}" for m in MODES.values() if m.policy)
    parser.add_argument(
        "--routing",
        choices=tuple(MODES),
        default=None,
        help=f"replica routing mode (default: hash, or --eplb-config's routing); {needs}",
    )


def eplb_fields(text: str | None, *, defaults: dict, flags: dict) -> dict:
    """The run's ``EplbConfig`` fields: ``defaults``, then those ``text`` names, then ``flags`` (``None``: not given).

    ``text``: the ``--eplb-config`` value, a JSON file or a JSON object. A
    routing mode that needs its own policy (``quota``: ``online``) gets it
    when no policy is named. Raises ``ValueError`` naming ``--eplb-config``
    and the field for a missing file, bad JSON, an unknown field or a bad
    value, and for a policy named that the routing mode cannot use (saying
    what to write instead).
    """
    from moe_eplb_jax import EplbConfig

    named = {}
    if text:
        if not text.lstrip().startswith("{"):
            text = _read_text("--eplb-config", text)
        try:
            doc = EplbConfig.parse_json(text)
            config = EplbConfig.from_dict(_with_routing_policy(doc))
        except ValueError as e:
            raise ValueError(f"--eplb-config: {e}") from None
        keys = {_VLLM_NAMES.get(key, key) for key in doc}
        named = {name: value for name, value in config.to_dict().items() if name in keys}
    fields = {**defaults, **named, **{name: value for name, value in flags.items() if value is not None}}
    return _with_routing_policy(fields)


def _with_routing_policy(fields: dict) -> dict:
    """``fields`` with the policy the routing mode needs where none is named; ``ValueError`` saying what to change
    where another one is."""
    from moe_eplb_jax import policy
    from moe_eplb_jax.routing import routing_mode

    mode = routing_mode(fields.get("routing", "hash"))
    if mode.policy is None:
        return fields
    if "policy" not in fields:
        return {**fields, "policy": mode.policy}
    named = policy.DEFAULT_POLICY if fields["policy"] == "default" else fields["policy"]  # vLLM's name
    if policy.get(named) is not policy.get(mode.policy):
        raise ValueError(
            f"routing {mode.name!r} needs policy {mode.policy!r} (its spare slots are refreshed by it), got policy "
            f'{fields["policy"]!r}: write "policy": "{mode.policy}" in --eplb-config, or leave policy out'
        )
    return fields


def _read_text(flag: str, path: str) -> str:
    """The UTF-8 text of the regular file ``path``; ``ValueError`` naming ``flag`` otherwise (a FIFO never blocks)."""
    if not os.path.lexists(path):
        raise ValueError(f"{flag} {path}: no such file (give a JSON file or a JSON object)")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot read it ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{flag} {path}: not a regular file (a directory, device or FIFO)")
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def parse_eplb_fields(parser, make_fields, ranks: int | None) -> dict:
    """``make_fields()``'s EPLB fields, checked as a config for ``ranks`` EP ranks when known; else one-line exit 2."""
    try:
        fields = make_fields()
        if ranks is not None:
            build_eplb_config(fields, num_gpus=ranks)
    except ValueError as e:
        parser.error(str(e))
    return fields


def build_eplb_config(fields: dict, *, num_gpus: int | None = None, window: tuple[int, int] | None = None):
    """``EplbConfig(**fields)`` for ``num_gpus`` EP ranks (``None``: ``fields``' own); ``ValueError`` naming the field.

    A ``num_gpus`` named in ``--eplb-config`` must be the run's EP size. With
    ``window=(L, P)`` (MoE layers, slots) the load window must fit one device
    (call it once the devices are up: it asks one its memory).
    """
    from moe_eplb_jax import EplbConfig
    from moe_eplb_jax.state import check_window_size

    if num_gpus is not None:
        if fields.get("num_gpus", num_gpus) != num_gpus:
            raise ValueError(f"--eplb-config: num_gpus={fields['num_gpus']} but the run has {num_gpus} EP ranks")
        fields = {**fields, "num_gpus": num_gpus}
    try:
        config = EplbConfig(**fields)
        if window is not None:
            check_window_size(config, *window)
    except ValueError as e:
        raise ValueError(f"EPLB config (--eplb-config and flags): {e}") from None
    return config


@contextlib.contextmanager
def counting_compiles():
    """Counts the XLA programs compiled inside the block (JAX's backend-compile events): ``with ... as count``,
    then ``count[0]``."""
    import jax

    count = [0]

    def listener(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            count[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield count
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def memory_bandwidth() -> float | None:
    """The first device's memory bandwidth in bytes/s (H100 SXM 3.35 TB/s, H200 4.8 TB/s), or ``None`` where
    unknown: a decode step's floor is the bytes it reads over it."""
    import jax

    kind = jax.devices()[0].device_kind
    return 4.8e12 if "H200" in kind else 3.35e12 if "H100" in kind else None


def dense_bf16_peak() -> float | None:
    """The device's dense bf16 peak in FLOP/s for MFU (H100 / H200 SXM: 989 TFLOP/s), or ``None`` where unknown."""
    import jax

    kind = jax.devices()[0].device_kind
    return 989e12 * jax.device_count() if ("H100" in kind or "H200" in kind) else None

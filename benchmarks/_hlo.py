"""What a profiled kernel computes: the HLO instruction behind a kernel's name, read from XLA's dump.

    os.environ["XLA_FLAGS"] = with_dump(os.environ.get("XLA_FLAGS", ""), directory)  # before JAX starts a backend
    ...                                                                              # compile and profile
    describe(directory, ["loop_select_fusion_1", "gemm_fusion_dot_345"])

A kernel XLA emits is named after its HLO instruction (``loop_add_fusion.14`` runs as ``loop_add_fusion_14``), so
the optimized modules XLA writes (``*after_optimizations.txt``) say what each profiled kernel is: its result
shape, its fusion kind, and the JAX operation and source line it came from. A name in several modules (the
prefill and the decode loop are compiled apart) gets one line per module.
"""

from __future__ import annotations

import glob
import os
import re

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_SHAPE_AND_OP = re.compile(r"^(\([^=]*?\)|\S+)\s+([\w\-]+)\(")
_KIND = re.compile(r"\bkind=(\w+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_SOURCE = re.compile(r'source_file="([^"]*)"\s+source_line=(\d+)')
_NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}
_MODULE = re.compile(r"^module_\d+\.(.+?)\.(?:sm_[\d.]+_gpu_|cpu_)?after_optimizations\.txt$")


def with_dump(flags: str, directory: str) -> str:
    """``flags`` (an ``XLA_FLAGS`` value) with XLA writing every compiled module's text into ``directory``."""
    return f"{flags} --xla_dump_to={directory} --xla_dump_hlo_as_text".strip()


def kernel_name(instruction: str) -> str:
    """The name a profiler shows for the kernel of HLO instruction ``instruction``."""
    return re.sub(r"[.\-]", "_", instruction)


def describe_line(text: str) -> str:
    """One HLO instruction's right-hand side, short: ``shape op [kind]  <- jax op  (file:line)``."""
    head = _SHAPE_AND_OP.match(text)
    shape, op = (head.group(1), head.group(2)) if head else ("?", text.split("(")[0])
    shape = re.sub(r"\{[^{}]*\}", "", shape)  # layouts
    kind = _KIND.search(text)
    parts = [f"{shape} {op}" + (f" {kind.group(1)}" if kind else "")]
    name = _OP_NAME.search(text)
    if name:
        parts.append("<- " + "/".join(name.group(1).split("/")[-4:]))
    source = _SOURCE.search(text)
    if source:
        parts.append(f"({os.path.basename(source.group(1))}:{source.group(2)})")
    return "  ".join(parts)


def instructions(directory: str) -> dict[str, list[str]]:
    """``{kernel name: ["module: description", ...]}`` for every instruction of every optimized module dumped in
    ``directory``."""
    found: dict[str, list[str]] = {}
    for path in sorted(glob.glob(os.path.join(directory, "*after_optimizations.txt"))):
        match = _MODULE.match(os.path.basename(path))
        module = match.group(1) if match else os.path.basename(path)
        with open(path) as f:
            for line in f:
                instruction = _INSTRUCTION.match(line)
                if instruction is None or "(" not in instruction.group(2):
                    continue
                head = _SHAPE_AND_OP.match(instruction.group(2))
                if head and head.group(2) in _NOT_KERNELS:
                    continue
                entry = f"{module}: {describe_line(instruction.group(2))}"
                found.setdefault(kernel_name(instruction.group(1)), []).append(entry)
    return found


def describe(directory: str, names) -> dict[str, list[str]]:
    """For each kernel name of ``names``: what its instruction is, one line per module holding it (``[]``: not an
    XLA instruction, e.g. a Pallas or cuDNN kernel, or a library kernel XLA called)."""
    known = instructions(directory)
    return {name: known.get(name, []) for name in names}

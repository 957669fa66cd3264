"""Runs worker scripts as separate processes on localhost (the multi-process tests' launcher)."""

import os
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(argvs, *, timeout: float) -> list[tuple[int, str]]:
    """Starts ``python argv...`` for each argv at once and waits for all; returns (returncode, output) each.

    The workers get this environment without the test session's device flags, so each can choose its own
    device count before JAX starts. A worker still running at the end (timeout, failure) is killed.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    procs = [
        subprocess.Popen(
            [sys.executable, *map(str, argv)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for argv in argvs
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return [(proc.returncode, out) for proc, out in zip(procs, outputs)]

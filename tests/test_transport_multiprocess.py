"""Transport across processes: 2 processes x 4 CPU devices on localhost (jax.distributed, gloo)."""

import os
import socket
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "_mp_transport_worker.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_rearrange_across_two_processes():
    port, num_processes = free_port(), 2
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    procs = [
        subprocess.Popen([sys.executable, WORKER, str(i), str(num_processes), str(port)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(num_processes)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=90)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for i, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0 and f"WORKER_OK {i}" in out, f"process {i} (rc {proc.returncode}):\n{out[-3000:]}"

"""Transport across processes: 2 processes x 4 CPU devices on localhost (jax.distributed, gloo)."""

import os

import pytest
from _processes import free_port, run_workers

WORKER = os.path.join(os.path.dirname(__file__), "_mp_transport_worker.py")


@pytest.mark.slow
def test_rearrange_across_two_processes():
    port, num_processes = free_port(), 2
    runs = run_workers([[WORKER, i, num_processes, port] for i in range(num_processes)], timeout=90)
    for i, (returncode, out) in enumerate(runs):
        assert returncode == 0 and f"WORKER_OK {i}" in out, f"process {i} (rc {returncode}):\n{out[-3000:]}"


RESIZE_WORKER = os.path.join(os.path.dirname(__file__), "_mp_resize_worker.py")


@pytest.mark.slow
def test_resize_across_two_processes():
    """2 x 4 -> 1 x 4 -> 2 x 4 -> 2 x 2 -> 1 x 4 with a lost rank, on jax.distributed: byte-exact everywhere."""
    port, num_processes = free_port(), 2
    runs = run_workers([[RESIZE_WORKER, i, num_processes, port] for i in range(num_processes)], timeout=120)
    for i, (returncode, out) in enumerate(runs):
        assert returncode == 0 and f"WORKER_OK {i}" in out, f"process {i} (rc {returncode}):\n{out[-3000:]}"


CONTROLLER_WORKER = os.path.join(os.path.dirname(__file__), "_mp_controller_resize_worker.py")


@pytest.mark.slow
def test_controller_resize_across_two_processes():
    """EplbController.resize on jax.distributed: 2 x 4 -> 1 x 4 -> 2 x 4 -> 2 x 2 -> 1 x 4 with a lost rank; every
    process agrees on the placement, every local shard holds the checkpoint's bytes, the outputs are unchanged."""
    port, num_processes = free_port(), 2
    runs = run_workers([[CONTROLLER_WORKER, i, num_processes, port] for i in range(num_processes)], timeout=400)
    for i, (returncode, out) in enumerate(runs):
        assert returncode == 0 and f"WORKER_OK {i}" in out, f"process {i} (rc {returncode}):\n{out[-3000:]}"

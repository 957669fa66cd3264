"""Two processes x two CPU devices under jax.distributed: same placement everywhere, exact bytes moved."""

import json
import os
import socket
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "_multiprocess_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_rebalance_identically(tmp_path):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    outs = [tmp_path / f"p{i}.json" for i in range(2)]
    procs = [
        subprocess.Popen([sys.executable, WORKER, str(port), str(i), str(outs[i])], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    results = [json.loads(o.read_text()) for o in outs]
    assert results[0]["devices"] == 4 and results[0]["local"] == 2
    assert results[0]["phy2log"] == results[1]["phy2log"]  # invariant 5: one placement everywhere
    assert results[0]["moved"] > 0
    for r in results:
        assert r["exact"], "moved expert bytes differ from the permuted checkpoint"
        assert r["same_out"], "outputs changed with the placement"

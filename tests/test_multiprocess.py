"""Two processes x two CPU devices under jax.distributed: same placement everywhere, exact bytes moved."""

import json
import os

import pytest
from _processes import free_port, run_workers

WORKER = os.path.join(os.path.dirname(__file__), "_multiprocess_worker.py")


@pytest.mark.slow
def test_two_processes_rebalance_identically(tmp_path):
    port = free_port()
    outs = [tmp_path / f"p{i}.json" for i in range(2)]
    runs = run_workers([[WORKER, port, i, outs[i]] for i in range(2)], timeout=120)
    for returncode, log in runs:
        assert returncode == 0, log[-3000:]
    results = [json.loads(o.read_text()) for o in outs]
    assert results[0]["devices"] == 4 and results[0]["local"] == 2
    assert results[0]["phy2log"] == results[1]["phy2log"]  # invariant 5: one placement everywhere
    assert results[0]["moved"] > 0
    for r in results:
        assert r["exact"], "moved expert bytes differ from the permuted checkpoint"
        assert r["same_out"], "outputs changed with the placement"

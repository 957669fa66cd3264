"""The multi-GPU validation script's own logic (``benchmarks/multi_gpu.py``): how it judges a serving run.

Its GPU run happens on lent machines only; what it compares must not fail for reasons other than the result
(on 4 x H200 a shut-down warning in one process's log once made two equal summaries differ).
"""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script():
    spec = importlib.util.spec_from_file_location("multi_gpu", os.path.join(ROOT, "benchmarks", "multi_gpu.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SUMMARY = """serve (EPLB placement): 100%|##########| 5/5
=== summary (process {index} of 2) ===
EP ranks 4, layers 2, experts 16 + 8 redundant, top-2
balancedness (measured) before 0.534 -> after {after}  (1.0 = perfect)
rearrangement: 23 slots moved, policy-predicted balancedness 0.990
throughput: {tps} tok/s before, 2498.9 tok/s after
{noise}"""


def test_serve_summaries_compare_results_not_runtime_noise():
    multi_gpu = _script()
    warning = (
        "W1130 22:13:19.241826 7768 pjrt_client.cc:1605] WatchTasksAsync failed for task 0: UNAVAILABLE\n"
        "=== Source Location Trace: ===\n[Gloo] Rank 0 is connected to 1 peer ranks"
    )
    first = SUMMARY.format(index=0, after="0.886", tps="2276.2", noise=warning)
    second = SUMMARY.format(index=1, after="0.886", tps="2269.3", noise="")
    a, b = multi_gpu._summary_lines(first), multi_gpu._summary_lines(second)
    assert a == b and len(a) == 3  # header, throughput and runtime lines left out
    assert a[1].startswith("balancedness (measured) before 0.534 -> after 0.886")
    # A different result is still a difference.
    third = SUMMARY.format(index=1, after="0.885", tps="2269.3", noise="")
    assert multi_gpu._summary_lines(third) != a
    # No summary at all (a crashed process) never equals one.
    assert multi_gpu._summary_lines("Traceback (most recent call last):\n  ...") == []

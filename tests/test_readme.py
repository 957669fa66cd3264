"""The README's python code blocks run as written, in order, in one fresh process (8 simulated CPU devices)."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


@pytest.mark.slow
def test_readme_python_blocks_run(tmp_path):
    with open(os.path.join(ROOT, "README.md")) as f:
        blocks = python_blocks(f.read())
    assert len(blocks) >= 2 and any("EplbController" in block for block in blocks)
    script = tmp_path / "readme.py"
    script.write_text("\n\n".join(blocks))
    # The first block sets the device count itself; the package is this checkout's, the files land in tmp_path.
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    run = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert "balancedness" in run.stdout and (tmp_path / "placement.json").exists() and (tmp_path / "loads.npz").exists()

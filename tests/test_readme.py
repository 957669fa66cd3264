"""The README's python code blocks run as a user pastes them: each alone, in a fresh process, in an empty folder.

A block that leans on another one's imports, device flags or files fails here; a block that writes into the
folder it runs in (the repository, for a user) fails too: snippets write into a temporary directory.
"""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


def readme_blocks() -> list[str]:
    with open(os.path.join(ROOT, "README.md")) as f:
        return python_blocks(f.read())


def test_readme_has_the_usage_blocks():
    blocks = readme_blocks()
    assert len(blocks) >= 3
    assert "rearrange_experts" in blocks[0] and any("EplbController" in block for block in blocks[1:])


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(readme_blocks())))
def test_readme_block_runs_alone(index, tmp_path):
    block = readme_blocks()[index]
    folder = tmp_path / f"block{index}"
    folder.mkdir()
    script = tmp_path / f"block{index}.py"  # outside the folder it runs in, so the folder stays empty
    script.write_text(block)
    # A fresh environment: no device flags of the suite's own (the block sets its own), this checkout's package.
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    run = subprocess.run(
        [sys.executable, str(script)], cwd=folder, env=env, capture_output=True, text=True, timeout=1200
    )
    assert run.returncode == 0, f"README block {index + 1}:\n{block}\n" + run.stdout[-3000:] + run.stderr[-6000:]
    assert os.listdir(folder) == [], f"README block {index + 1} wrote into the folder it ran in: {os.listdir(folder)}"
    if index == 0:
        assert "balancedness" in run.stdout

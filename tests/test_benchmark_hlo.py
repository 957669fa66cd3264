"""``benchmarks/_hlo.py``: a profiled kernel's name leads back to its HLO instruction and JAX operation."""

import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROGRAM = """
import jax, jax.numpy as jnp
def scaled_tanh_sum(x, w):
    return jnp.tanh(x @ w).sum(0) * 2.0
print(jax.jit(scaled_tanh_sum)(jnp.ones((8, 16)), jnp.ones((16, 4))))
"""


def _module():
    spec = importlib.util.spec_from_file_location("_hlo", os.path.join(ROOT, "benchmarks", "_hlo.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kernel_names_lead_to_their_instructions(tmp_path):
    hlo = _module()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=hlo.with_dump("", str(tmp_path)))
    subprocess.run([sys.executable, "-c", PROGRAM], env=env, check=True, capture_output=True, timeout=120)
    known = hlo.instructions(str(tmp_path))
    dots = [line for lines in known.values() for line in lines if " dot " in line and "dot_general" in line]
    assert dots and all(line.startswith("jit_scaled_tanh_sum: f32[8,4] dot ") for line in dots)
    assert any("(<string>:" not in line and "tanh" in line for lines in known.values() for line in lines)
    name = next(name for name, lines in known.items() if any(" dot " in line for line in lines))
    assert hlo.describe(str(tmp_path), [name, "no_such_kernel"]) == {name: known[name], "no_such_kernel": []}
    assert hlo.kernel_name("loop_add_fusion.14") == "loop_add_fusion_14"
    assert not any(" parameter" in line for lines in known.values() for line in lines)


def test_one_instruction_line_is_described_short():
    hlo = _module()
    line = (
        "f32[32,1024]{1,0} fusion(bf16[32,1024]{1,0} %p0, f32[1024]{0} %p1), kind=kLoop, calls=%fused_computation.7, "
        'metadata={op_name="jit(_decode_loop)/while/body/layers/mul" source_file="/x/moe_eplb_jax/models/layers.py" '
        "source_line=41}"
    )
    assert hlo.describe_line(line) == "f32[32,1024] fusion kLoop  <- while/body/layers/mul  (layers.py:41)"
    tuple_line = '(f32[2]{0}, s32[]{:T(128)}) custom-call(f32[2]{0} %a), custom_call_target="x"'
    assert hlo.describe_line(tuple_line).startswith("(f32[2], s32[]) custom-call")

"""Every Triton grouped matmul lowers to Triton IR for a Hopper GPU, on a machine without one.

The interpreter tests run each kernel's jaxpr on the CPU; this lowers the same kernels as a GPU compile would
(``jax.export`` for ``cuda``, the card's compute capability given), so a primitive without a Triton lowering
fails here and not only on a GPU. It also holds the call's shape: the kernel alone, no XLA ops building a work
item table before it.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import pytest
from jax import export

from moe_eplb_jax import quant
from moe_eplb_jax.moe._gmm import triton as gmm_triton
from moe_eplb_jax.moe._qgmm import triton as qgmm_triton

try:
    from jax._src.pallas.triton import pallas_call_registration as _registration
except ImportError:  # another jax layout: nothing to hook
    _registration = None

TRITON_CALL = "__gpu$xla.gpu.triton"


@pytest.fixture
def hopper(monkeypatch):
    """Lowering as for an sm90 card (Pallas asks the local GPU for its compute capability)."""
    info = getattr(_registration, "gpu_info_lib", None)
    if info is None or not hasattr(info, "get_gpu_info"):
        pytest.skip("this jax's Pallas Triton lowering has no GPU-info hook to stand in for a card")
    monkeypatch.setattr(info, "get_gpu_info", lambda: types.SimpleNamespace(compute_capability=90))


def lowered_for_cuda(fn, *shapes) -> str:
    checks = [export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
    return export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*shapes).mlir_module()


def ops_around_kernels(module: str) -> int:
    """StableHLO ops in the module other than the Triton calls themselves."""
    return module.count("stablehlo.") - module.count(f"stablehlo.custom_call @{TRITON_CALL}")


@pytest.mark.parametrize(
    ("rows", "groups", "transpose"), [(8, 64, False), (256, 64, True), (4096, 12, False), (4096, 300, False)]
)
def test_grouped_matmul_lowers_for_hopper_with_nothing_before_it(hopper, rows, groups, transpose):
    x = jax.ShapeDtypeStruct((rows, 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((groups, 128, 256) if transpose else (groups, 256, 128), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((groups,), jnp.int32)
    module = lowered_for_cuda(lambda x, w, s: gmm_triton.grouped_matmul(x, w, s, transpose_rhs=transpose), x, w, sizes)
    assert module.count(TRITON_CALL) == 1
    assert ops_around_kernels(module) <= 6, module  # reshapes and the sizes' padding only


def test_weight_gradient_lowers_for_hopper(hopper):
    x, dy = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16), jax.ShapeDtypeStruct((512, 128), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((16,), jnp.int32)
    module = lowered_for_cuda(gmm_triton.transposed_grouped_matmul, x, dy, sizes)
    assert module.count(TRITON_CALL) == 1


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_quantized_grouped_matmul_lowers_for_hopper(hopper, fmt):
    w = jnp.ones((4, 128, 256), jnp.float32)
    q = quant.quantize_experts(w, fmt, block_size=(32, 64)) if fmt == "fp8_block" else quant.quantize_experts(w, fmt)
    x, sizes = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16), jax.ShapeDtypeStruct((4,), jnp.int32)
    module = lowered_for_cuda(lambda x, s: qgmm_triton.grouped_matmul(x, q, s, jnp.ones((4,))), x, sizes)
    assert module.count(TRITON_CALL) == 1


def test_fp8_rows_lower_for_hopper_as_an_e4m3_product(hopper):
    """W8A8: e4m3 rows multiply the e4m3 weights as they are (an fp8 ``tt.dot``), nothing decoded to 16 bits."""
    q = quant.quantize_experts(jnp.ones((4, 128, 256), jnp.float32), "fp8")
    x, sizes = jax.ShapeDtypeStruct((64, 256), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((4,), jnp.int32)
    module = lowered_for_cuda(lambda x, s: qgmm_triton.grouped_matmul(x, q, s, jnp.ones((4,))), x, sizes)
    assert module.count(TRITON_CALL) == 1


@pytest.mark.parametrize("entries", [200, 2048])
def test_slot_sort_lowers_for_hopper(hopper, entries):
    """The decode sort: one Triton kernel (its scatters by place included) reading the slots and writing the three
    outputs as they are, no XLA op around it."""
    from moe_eplb_jax.moe._slot_sort import triton as slot_sort

    physical = jax.ShapeDtypeStruct((entries,), jnp.int32)
    module = lowered_for_cuda(lambda p: slot_sort.slot_sort(p, 64, 8), physical)
    assert module.count(TRITON_CALL) == 1
    assert ops_around_kernels(module) == 0, module


def test_top_k_take_lowers_for_hopper(hopper):
    """The router's top-k, gather, renormalization, scaling and mask as the router asks for them: one Triton kernel,
    nothing around it but the bitcasts of its operands and the mask's conversion."""
    from moe_eplb_jax.moe._top_k import triton as fused

    scores, valid = jax.ShapeDtypeStruct((32, 64), jnp.float32), jax.ShapeDtypeStruct((32,), jnp.bool_)
    call = lambda c, s, v: fused.top_k_take(c, s, 8, valid=v, renormalize=True, scale=2.5)
    module = lowered_for_cuda(call, scores, scores, valid)
    assert module.count(TRITON_CALL) == 1
    assert ops_around_kernels(module) <= 4, module


def test_decode_attention_lowers_for_hopper(hopper):
    """A decode step's attention and cache write: one Triton kernel updating the caches in place (aliased), nothing
    around it but the mask's conversion and the index's reshape."""
    from moe_eplb_jax.models._decode_attention import triton as decode

    spec = jax.ShapeDtypeStruct
    args = [spec((32, 16, 64), jnp.bfloat16)] + [spec((32, 4, 64), jnp.bfloat16)] * 2
    args += [spec((32, 4, 48, 64), jnp.bfloat16)] * 2 + [spec((), jnp.int32), spec((32, 48), jnp.bool_)]
    module = lowered_for_cuda(lambda *a: decode.decode_attention(*a, scale=0.125), *args)
    aliases = module.count("stablehlo.output_operand_alias<")
    assert module.count(TRITON_CALL) == 1 and aliases == 2
    # the mask's conversion, the index's reshape, the unused operands' placeholder (a constant)
    assert ops_around_kernels(module) - aliases <= 4, module
    args += [spec((64,), jnp.bfloat16), spec((32, 2, 32), jnp.float32)]
    call = lambda *a: decode.decode_attention(*a[:7], scale=0.125, q_norm=a[7], k_norm=a[7], eps=1e-6, rope=a[8])
    assert lowered_for_cuda(call, *args).count(TRITON_CALL) == 1  # the norms and RoPE inside

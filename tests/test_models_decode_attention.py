"""The decode step's attention kernel (``models/decode_attention.py``) against the XLA reference: in Pallas'
interpreter on the CPU, compiled on a GPU; masked rows, a row that sees no key, caches off the kernel's blocks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_eplb_jax.models.attention import attend
from moe_eplb_jax.models.decode_attention import Config, decode_attention, supports

CASES = [  # (batch, heads, kv heads, cache positions, key width, value width, dtype, block_keys)
    (3, 16, 4, 48, 64, 64, jnp.float32, 16),
    (2, 8, 8, 37, 32, 16, jnp.bfloat16, 16),
    (2, 32, 2, 70, 16, 32, jnp.float32, 32),  # 16 query heads per key/value head: the matrix-product path
]


def _inputs(rng, batch, heads, kv_heads, positions, key_width, value_width, dtype):
    q = jnp.asarray(rng.standard_normal((batch, heads, key_width)), dtype)
    keys = jnp.asarray(rng.standard_normal((batch, kv_heads, positions, key_width)) * 3, dtype)
    values = jnp.asarray(rng.standard_normal((batch, kv_heads, positions, value_width)), dtype)
    valid = rng.random((batch, positions)) < 0.6
    valid[0] = False  # sees nothing: the reference's uniform average over the floor scores
    valid[-1, -1] = True
    return q, keys, values, jnp.asarray(valid)


def _reference(q, keys, values, valid, scale):
    swap = lambda a: jnp.swapaxes(a, 1, 2)
    return attend(q[:, None], swap(keys), swap(values), valid[:, None, :], scale=scale, implementation="xla")[:, 0]


def _check(got, want, dtype):
    tolerance = 2e-2 if dtype == jnp.bfloat16 else 2e-5
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.isfinite(np.asarray(got, np.float32)).all()
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tolerance, atol=tolerance
    )


@pytest.mark.parametrize("case", CASES, ids=["gqa4", "mha-bf16", "gqa16"])
def test_interpreted_kernel_matches_the_xla_reference(rng, case):
    *shape, dtype, block_keys = case
    q, keys, values, valid = _inputs(rng, *shape, dtype)
    scale = shape[4] ** -0.5
    got = decode_attention(q, keys, values, valid, scale=scale, config=Config(block_keys=block_keys), interpret=True)
    _check(got, _reference(q, keys, values, valid, scale), dtype)


def test_bad_inputs_are_refused():
    q, kv, valid = jnp.zeros((2, 8, 32)), jnp.zeros((2, 4, 40, 32)), jnp.ones((2, 40), bool)
    with pytest.raises(ValueError, match="valid must have shape"):
        decode_attention(q, kv, kv, valid[:, :39], scale=1.0)
    with pytest.raises(ValueError, match="keys / values"):
        decode_attention(q, kv, kv[:, :, :39], valid, scale=1.0)
    with pytest.raises(ValueError, match="power-of-two"):
        decode_attention(jnp.zeros((2, 12, 32)), kv, kv, valid, scale=1.0)
    with pytest.raises(ValueError, match="block_keys"):
        Config(block_keys=48)
    with pytest.raises(ValueError, match="num_warps"):
        Config(num_warps=0)
    with pytest.raises(ValueError, match="one query per sequence"):
        attend(jnp.zeros((2, 3, 8, 32)), kv, kv, jnp.ones((2, 3, 40), bool), scale=1.0, implementation="pallas")
    assert supports(16, 4, 64, 64) and not supports(12, 4, 64, 64) and not supports(16, 4, 8, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=["gqa4", "mha-bf16", "gqa16"])
def test_compiled_kernel_matches_the_xla_reference_on_a_gpu(rng, case):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    *shape, dtype, block_keys = case
    q, keys, values, valid = _inputs(rng, *shape, dtype)
    scale = shape[4] ** -0.5
    want = _reference(q, keys, values, valid, scale)
    _check(decode_attention(q, keys, values, valid, scale=scale, config=Config(block_keys=block_keys)), want, dtype)
    swap = lambda a: jnp.swapaxes(a, 1, 2)
    through_attend = attend(
        q[:, None], swap(keys), swap(values), valid[:, None, :], scale=scale, implementation="pallas"
    )
    _check(through_attend[:, 0], want, dtype)

"""A decode step's attention and cache write in one kernel (``models/_decode_attention``) against XLA's attention
after a ``dynamic_update_slice`` of the caches: the output within the 16-bit rounding of the probabilities, the
caches bit for bit; masked keys, a row with no key left, the written position at either end of the cache, caches
off a power of two, group sizes 1 to 16, float16."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from moe_eplb_jax.models._decode_attention import triton as decode
from moe_eplb_jax.models.attention import attend

gpu = pytest.mark.gpu


def _case(rng, batch, heads, kv_heads, positions, width, dtype):
    draw = lambda *shape: np.asarray(jnp.asarray(rng.standard_normal(shape), dtype))
    q, k, v = draw(batch, heads, width), draw(batch, kv_heads, width), draw(batch, kv_heads, width)
    keys, values = draw(batch, kv_heads, positions, width), draw(batch, kv_heads, positions, width)
    mask = rng.random((batch, positions)) < 0.6
    return q, k, v, keys, values, mask


def _reference(q, k, v, keys, values, index, mask, scale):
    keys, values = keys.copy(), values.copy()
    keys[:, :, index], values[:, :, index] = k, v
    out = attend(
        jnp.asarray(q)[:, None],
        jnp.swapaxes(jnp.asarray(keys), 1, 2),
        jnp.swapaxes(jnp.asarray(values), 1, 2),
        jnp.asarray(mask)[:, None],
        scale=scale,
        implementation="xla",
    )
    return np.asarray(out[:, 0], np.float32), keys, values


@pytest.mark.parametrize("implementation", ["interpret", pytest.param("triton", marks=gpu)])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "positions", "width", "dtype"),
    [
        (16, 4, 48, 64, jnp.bfloat16),
        (4, 4, 37, 32, jnp.bfloat16),
        (16, 1, 512, 128, jnp.float16),
        (8, 2, 1, 64, jnp.bfloat16),
    ],
)
def test_decode_attention_equals_xla_after_the_cache_write(
    implementation, heads, kv_heads, positions, width, dtype, rng
):
    batch, scale = 3, width**-0.5
    q, k, v, keys, values, mask = _case(rng, batch, heads, kv_heads, positions, width, dtype)
    for index in sorted({0, positions - 1, positions // 2}):
        mask_now = mask.copy()
        mask_now[:, index] = True
        mask_now[2] = False  # a blind row: the XLA form averages every position
        call = functools.partial(decode.decode_attention, scale=scale, interpret=implementation == "interpret")
        out, new_keys, new_values = call(q, k, v, keys, values, np.int32(index), mask_now)
        want, want_keys, want_values = _reference(q, k, v, keys, values, index, mask_now, scale)
        assert out.shape == q.shape and out.dtype == dtype
        np.testing.assert_array_equal(np.asarray(new_keys), want_keys)
        np.testing.assert_array_equal(np.asarray(new_values), want_values)
        # The products' summation order (interpreted), the card's exponent and 16-bit probabilities (on a card).
        tolerance = (1e-4, 1e-2) if implementation == "interpret" else (2e-2, 2e-2)
        np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=tolerance[0], rtol=tolerance[1])


def test_decode_attention_refuses_what_it_does_not_take():
    spec = lambda *shape: jnp.zeros(shape, jnp.bfloat16)
    assert decode.applies((2, 16, 64), (2, 4, 512, 64), jnp.bfloat16)
    assert not decode.applies((2, 16, 64), (2, 4, decode.MAX_KEYS + 1, 64), jnp.bfloat16)  # long caches: XLA's
    assert not decode.applies((2, 16, 64), (2, 4, 48, 64), jnp.float32)
    assert not decode.applies((2, 16, 48), (2, 4, 48, 48), jnp.bfloat16)  # a width off a power of two
    assert not decode.applies((2, 16, 16), (2, 4, 48, 16), jnp.bfloat16)  # halves narrower than a product
    assert not decode.applies((2, 34, 64), (2, 2, 48, 64), jnp.bfloat16)  # 17 query heads a group
    assert not decode.applies((2, 16, 64), (3, 4, 48, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="decode_attention takes"):
        decode.decode_attention(
            spec(2, 16, 64), spec(2, 4, 64), spec(2, 4, 64), spec(2, 4, 48, 32), spec(2, 4, 48, 32), 0,
            jnp.ones((2, 48), bool), scale=1.0, interpret=True,
        )  # fmt: skip
    with pytest.raises(ValueError, match="mask"):
        decode.decode_attention(
            spec(2, 16, 64), spec(2, 4, 64), spec(2, 4, 64), spec(2, 4, 48, 64), spec(2, 4, 48, 64), 0,
            jnp.ones((2, 47), bool), scale=1.0, interpret=True,
        )  # fmt: skip


@pytest.mark.parametrize(
    "changes",
    [{}, {"qk_norm": False}, {"partial_rotary_factor": 0.5}],
    ids=["norms-and-rope-inside", "rope-inside", "partial-rope-outside"],
)
def test_attention_module_decodes_through_the_kernel_as_through_xla(monkeypatch, changes, rng):
    """The module's wiring: a decode step through the kernel (interpreted, as if its probe had passed on a card) --
    the q/k norms and a whole-head RoPE inside it, a partial RoPE before it -- gives the XLA step's output within
    rounding and the same caches; a CPU keeps XLA's."""
    from flax import nnx

    from moe_eplb_jax import models, transport
    from moe_eplb_jax.models import attention

    config = models.preset("tiny", dtype="bfloat16", num_heads=4, num_kv_heads=2, head_dim=32, **changes)
    module = attention.Attention(config, mesh=transport.ep_mesh(1), rngs=nnx.Rngs(0))
    batch, positions = 3, 20
    x = jnp.asarray(rng.standard_normal((batch, 1, config.dim)), jnp.bfloat16)
    cache = tuple(
        jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for shape in module.cache_shapes(batch, positions)
    )
    mask = jnp.asarray(rng.random((batch, 1, positions)) < 0.7).at[:, :, 9].set(True)
    pos = jnp.asarray([[9], [3], [9]], jnp.int32)  # rows at different positions: each row's own rotation
    assert not module._fused_decode(jnp.zeros((batch, 1, 4, 32), jnp.bfloat16), cache[0])  # no GPU here
    want, want_cache = module(x, pos, mask, cache, jnp.int32(9))
    monkeypatch.setattr(attention, "pallas_default", lambda *args, **kwargs: True)
    monkeypatch.setattr(decode, "decode_attention", functools.partial(decode.decode_attention, interpret=True))
    got, got_cache = module(x, pos, mask, cache, jnp.int32(9))
    for have, expected in zip(got_cache, want_cache):
        np.testing.assert_array_equal(np.asarray(have), np.asarray(expected))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=1e-2, rtol=1e-2)


def test_probe_agrees_in_the_interpreter(monkeypatch):
    """The probe a card runs first -- both forms, ready queries and the norms and RoPE inside -- holds interpreted."""
    monkeypatch.setattr(decode, "decode_attention", functools.partial(decode.decode_attention, interpret=True))
    assert decode.probe()

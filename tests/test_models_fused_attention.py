"""cuDNN's fused attention (the GPU default for 16-bit prefill and training) against the XLA reference, on one GPU."""

import jax.numpy as jnp
import numpy as np
import pytest

from moe_eplb_jax.models.attention import CausalPrefix, attend
from moe_eplb_jax.models.layers import attention_mask


@pytest.mark.gpu
@pytest.mark.parametrize("widths", [(64, 64), (96, 64)], ids=["gqa", "mla-widths"])
@pytest.mark.parametrize("padded", ["causal", "left-padded", "prefix"])
def test_fused_attention_matches_the_xla_reference(padded, widths, rng):
    """cuDNN's fused attention (the GPU default for 16-bit prefill and training) against the XLA path, GQA, within
    bf16 tolerance; with left padding or a right-padded prefix (rows of length 0 and ``t`` included), real queries
    agree and no query gives a NaN."""
    (b, t, h, kh), (dh, dv) = (4, 256, 8, 2), widths
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, w)), jnp.bfloat16) for n, w in ((h, dh), (kh, dh), (kh, dv)))
    mask = None
    real = np.ones((b, t), bool)
    if padded == "left-padded":
        real = np.arange(t)[None, :] >= rng.integers(0, t // 2, b)[:, None]
        mask = attention_mask(jnp.asarray(real), 0, t)
    elif padded == "prefix":
        lengths = np.array([t, 0, 1, rng.integers(2, t)], np.int32)
        real = np.arange(t)[None, :] < lengths[:, None]
        mask = CausalPrefix(jnp.asarray(lengths))
    got = np.asarray(attend(q, k, v, mask, scale=dh**-0.5, implementation="cudnn"), np.float32)
    if padded == "prefix":  # the reference reads the mask as an array, written out here
        keys, queries = np.arange(t)[None, None, :], np.arange(t)[None, :, None]
        mask = jnp.asarray((keys <= queries) & (keys < np.maximum(lengths, 1)[:, None, None]))
    want = np.asarray(attend(q, k, v, mask, scale=dh**-0.5, implementation="xla"), np.float32)
    assert np.isfinite(got).all()
    err = np.linalg.norm((got - want)[real]) / np.linalg.norm(want[real])
    assert err < 1e-2, err

"""Quantized experts on an 8-rank EP mesh: rearrangement contract and EP-consistent scales."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from moe_eplb_jax import quant

try:
    from moe_eplb_jax.transport import rearrange_experts, shard_slots
except ImportError as err:  # the transport issue not landed in this checkout
    rearrange_experts = None
    _MISSING = f"moe_eplb_jax.transport.rearrange_experts not importable: {err}"

G, E, P, T, H, I = 8, 8, 16, 4, 128, 128  # 8 ranks, 8 logical experts on 16 slots (8 redundant)


def _mesh():
    return Mesh(np.array(jax.devices()[:G]), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))


def _u8(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.uint8) if x.dtype.itemsize == 1 else x.view(np.uint8).reshape(*x.shape, -1)


def _placement(rng):
    """A random phy2log [P] with every logical expert present and some replicated."""
    return rng.permutation(np.concatenate([np.arange(E), rng.integers(0, E, P - E)])).astype(np.int32)


@pytest.mark.skipif(rearrange_experts is None, reason=_MISSING if rearrange_experts is None else "")
@pytest.mark.parametrize(
    "fmt", [f if f in ("fp8", "mxfp4") else pytest.param(f, marks=pytest.mark.slow) for f in quant.FORMATS]
)  # the fast lane: one per-tensor and one block-scaled format
def test_rearranged_quantized_experts_equal_quantized_permuted_checkpoint(fmt, rng):
    mags = np.exp2(rng.uniform(-3, 3, (E, 1, 1))).astype(np.float32)
    checkpoint = [(rng.standard_normal(s) * mags * 0.05).astype(np.float32) for s in ((E, I, H), (E, I, H), (E, H, I))]
    old, new = _placement(rng), _placement(rng)
    assert not np.array_equal(old, new)

    def load(phy2log):  # "loading a permuted checkpoint": quantize w[phy2log]
        layer = quant.quantize_mlp(*(w[phy2log] for w in checkpoint), fmt, input_scale=0.01, down_input_scale=0.004)
        return jax.tree.map(np.asarray, layer)

    mesh = _mesh()
    moved = rearrange_experts(shard_slots(load(old), mesh), old, new, mesh=mesh, axis="ep")
    fresh = load(new)
    moved_leaves, fresh_leaves = jax.tree.leaves(moved), jax.tree.leaves(fresh)
    assert jax.tree.structure(moved) == jax.tree.structure(fresh) and len(moved_leaves) >= 6
    for a, b in zip(moved_leaves, fresh_leaves, strict=True):  # every leaf, derived factors included
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(_u8(a), _u8(b))

    # Same tokens per slot -> identical outputs: nothing the compute path uses was left behind.
    x = rng.standard_normal((P, T, H)).astype(np.float32)
    y_moved = np.asarray(quant.expert_mlp(x, *jax.tree.map(np.asarray, moved)))
    np.testing.assert_array_equal(y_moved, np.asarray(quant.expert_mlp(x, *fresh)))
    # And slot p computes logical expert new[p] (its first replica here): placement does not change the math.
    logical = quant.quantize_mlp(*checkpoint, fmt, input_scale=0.01, down_input_scale=0.004)
    first = np.array([np.flatnonzero(new == e)[0] for e in range(E)])
    y_logical = np.asarray(quant.expert_mlp(x[first], *logical))
    np.testing.assert_allclose(y_moved[first], y_logical, rtol=1e-6, atol=1e-7)


def test_ep_amax_gives_every_rank_the_same_scale_and_error(rng):
    """Ranks see different activation statistics; after ep_amax they quantize a token identically."""
    mesh = _mesh()
    spread = np.exp2(np.arange(G, dtype=np.float32))[:, None, None, None]  # rank r's activations ~ 2**r
    x = (rng.standard_normal((G, 2, T, H)).astype(np.float32) * spread).reshape(G * 2, T, H)
    probe = rng.standard_normal(H).astype(np.float32)
    x[0::2, 0] = probe  # the same token on every rank (its expert "moved" there)

    def per_rank(x_local, consistent):
        scale = quant.activation_scale(x_local, "ep" if consistent else None)
        token = x_local[0, 0]
        token_q = quant.quantize_activation_fp8(token[None, None], scale[None]).astype(jnp.float32) * scale
        return scale[None], (token_q[0, 0] - token)[None]

    outs = {}
    for consistent in (True, False):
        fn = jax.jit(
            jax.shard_map(
                lambda v, c=consistent: per_rank(v, c),
                mesh=mesh,
                in_specs=PartitionSpec("ep"),
                out_specs=PartitionSpec("ep"),
            )
        )
        scales, errors = (np.asarray(o) for o in fn(x))
        outs[consistent] = (scales, errors)
    scales, errors = outs[True]
    assert np.all(scales == np.abs(x).max() * np.float32(1 / 448))
    assert np.all(errors == errors[0]) and np.any(errors[0] != 0)
    local_scales, local_errors = outs[False]
    assert len(np.unique(local_scales)) == G and not np.all(local_errors == local_errors[0])


def test_dynamic_fp8_mlp_inside_shard_map_is_rank_independent(rng):
    mesh = _mesh()
    checkpoint = [(rng.standard_normal(s) * 0.05).astype(np.float32) for s in ((1, I, H), (1, I, H), (1, H, I))]
    layer = quant.quantize_mlp(*(np.repeat(w, G, axis=0) for w in checkpoint), "fp8")  # one expert on every rank
    x = rng.standard_normal((G, T, H)).astype(np.float32) * np.exp2(np.arange(G, dtype=np.float32))[:, None, None]
    x[:, 0] = x[0, 0]  # the same first token everywhere
    spec = PartitionSpec("ep")

    def run(axis):
        fn = jax.shard_map(
            lambda v, *q: quant.expert_mlp(v, *q, activation_scaling="dynamic", axis_name=axis),
            mesh=mesh,
            in_specs=spec,
            out_specs=spec,
        )
        return np.asarray(jax.jit(fn)(x, *layer))[:, 0]

    y = run("ep")
    assert np.all(y == y[0])
    assert not np.all(run(None) == y[0])  # without the EP max the ranks disagree


def test_ep_amax_validates_and_casts():
    with pytest.raises(ValueError, match="float"):
        quant.ep_amax(jnp.arange(3), "ep")
    assert quant.ep_amax(jnp.asarray(2.0, jnp.bfloat16), None).dtype == jnp.float32

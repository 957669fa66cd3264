"""Tests of the Triton ops that Pallas does not expose (``moe_eplb_jax.routing._map_and_count._triton_ops``).

Each op runs inside a small Pallas kernel -- interpret mode on CPU, compiled on
the GPU (``gpu`` marker) -- and is checked against numpy on fresh random inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from moe_eplb_jax.routing._map_and_count._triton_ops import atomic_add_int, histogram, take

INTERPRET = [pytest.param(True, id="interpret"), pytest.param(False, id="compiled", marks=pytest.mark.gpu)]


def _call(kernel, out_shape, *args, interpret, grid=(1,), aliases=None):
    whole = pl.no_block_spec
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole] * len(args),
        out_specs=whole,
        out_shape=out_shape,
        input_output_aliases=aliases or {},
        interpret=interpret,
    )(*args)


@pytest.mark.parametrize("interpret", INTERPRET)
def test_atomic_add_int_applies_every_masked_lane(interpret, rng):
    """Lanes that share an address all land; masked-off lanes (even out of range) change nothing."""
    num_lanes, size, programs = 256, 40, 3
    index = rng.integers(0, size, num_lanes).astype(np.int32)  # many lanes per address
    values = rng.integers(-5, 100, num_lanes).astype(np.int32)
    mask = rng.random(num_lanes) < 0.7
    index[~mask & (rng.random(num_lanes) < 0.5)] = size + 7  # out of range, masked off
    start = rng.integers(-1000, 1000, size).astype(np.int32)

    def kernel(index_ref, values_ref, mask_ref, start_ref, out_ref):
        del start_ref  # aliased to out_ref
        atomic_add_int(out_ref, index_ref[...], values_ref[...], mask_ref[...] != 0)

    got = _call(
        kernel,
        jax.ShapeDtypeStruct((size,), jnp.int32),
        jnp.asarray(index),
        jnp.asarray(values),
        jnp.asarray(mask.astype(np.int32)),
        jnp.asarray(start),
        interpret=interpret,
        grid=(programs,),
        aliases={3: 0},
    )
    want = start + programs * np.bincount(index[mask], weights=values[mask], minlength=size).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_atomic_add_int_checks_its_operands():
    ref_like = jnp.zeros((8,), jnp.int32)
    with pytest.raises(ValueError, match="int32 index and values"):
        atomic_add_int(ref_like, jnp.zeros((4,), jnp.int32), jnp.zeros((4,), jnp.float32), jnp.ones((4,), bool))
    with pytest.raises(ValueError, match="int32 index and values"):
        atomic_add_int(ref_like, jnp.zeros((4,), jnp.int32), jnp.zeros((5,), jnp.int32), jnp.ones((4,), bool))


@pytest.mark.parametrize("interpret", INTERPRET)
def test_histogram_counts_masked_in_range_values(interpret, rng):
    num_values, num_bins = 512, 64
    values = rng.integers(-8, num_bins + 8, num_values).astype(np.int32)  # some outside [0, num_bins)
    mask = rng.random(num_values) < 0.8

    def kernel(values_ref, mask_ref, out_ref):
        out_ref[...] = histogram(values_ref[...], num_bins, mask_ref[...] != 0)

    got = _call(
        kernel,
        jax.ShapeDtypeStruct((num_bins,), jnp.int32),
        jnp.asarray(values),
        jnp.asarray(mask.astype(np.int32)),
        interpret=interpret,
    )
    counted = values[mask & (values >= 0) & (values < num_bins)]
    np.testing.assert_array_equal(np.asarray(got), np.bincount(counted, minlength=num_bins))


def test_histogram_checks_its_operands():
    with pytest.raises(ValueError, match="power of two >= 32"):
        histogram(jnp.zeros((8,), jnp.int32), 48)
    with pytest.raises(ValueError, match="1-D int32"):
        histogram(jnp.zeros((8,), jnp.float32), 32)


@pytest.mark.parametrize("interpret", INTERPRET)
def test_take_gathers_from_a_register_table(interpret, rng):
    table = rng.integers(-(2**31), 2**31 - 1, 128, dtype=np.int64).astype(np.int32)
    index = rng.integers(0, 128, 256).astype(np.int32)

    def kernel(table_ref, index_ref, out_ref):
        out_ref[...] = take(table_ref[...], index_ref[...])

    got = _call(
        kernel, jax.ShapeDtypeStruct((256,), jnp.int32), jnp.asarray(table), jnp.asarray(index), interpret=interpret
    )
    np.testing.assert_array_equal(np.asarray(got), table[index])
    with pytest.raises(ValueError, match="power of two"):
        take(jnp.zeros((96,), jnp.int32), jnp.zeros((4,), jnp.int32))

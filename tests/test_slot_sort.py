"""The one-kernel sort of a rank's assignments by slot (``moe/_slot_sort``) against ``jnp.argsort(stable=True)``:
every place, the inverse and each row's token, for sizes off a power of two, unsent entries, one slot holding
everything, slot ids at the packing's int32 limit; and ``local.sort_local`` returning the same on either path."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_eplb_jax.moe import local
from moe_eplb_jax.moe._slot_sort import triton as slot_sort

gpu = pytest.mark.gpu


def _want(physical, num_slots, top_k):
    order = np.argsort(np.where(physical < 0, num_slots, physical), kind="stable").astype(np.int32)
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size, dtype=np.int32)
    return order, inverse, order // top_k


def _cases(rng):
    yield rng.integers(-1, 64, 256).astype(np.int32), 64, 8  # a decode step of 32 tokens, top-8
    yield rng.integers(-1, 3, 24).astype(np.int32), 3, 8  # off a power of two, many ties
    yield np.full(40, -1, np.int32), 5, 4  # nothing sent
    yield np.full(33, 2, np.int32), 4, 1  # one slot takes every entry
    yield np.array([7], np.int32), 8, 1
    yield rng.integers(-1, 288, slot_sort.MAX_ENTRIES).astype(np.int32), 288, 8
    big = (np.iinfo(np.int32).max // 64) - 2  # (slots + 2) * 64 entries padded: the largest slot count that packs
    yield np.array([big - 1, -1, 0, big - 1, 5] * 9, np.int32), big, 3


@pytest.mark.parametrize("implementation", ["interpret", pytest.param("triton", marks=gpu)])
def test_slot_sort_equals_a_stable_argsort(implementation, rng):
    for physical, num_slots, top_k in _cases(rng):
        got = slot_sort.slot_sort(jnp.asarray(physical), num_slots, top_k, interpret=implementation == "interpret")
        for name, have, want in zip(("order", "inverse", "tokens"), got, _want(physical, num_slots, top_k)):
            assert have.dtype == jnp.int32 and have.shape == physical.shape, name
            np.testing.assert_array_equal(np.asarray(have), want, err_msg=f"{name}, {physical.size} entries")


def test_slot_sort_tilings_agree(rng):
    physical = rng.integers(-1, 50, 700).astype(np.int32)
    want = _want(physical, 50, 8)
    for config in (slot_sort.Config(block=64, chunk=16), slot_sort.Config(block=1024, chunk=128, num_warps=8)):
        got = slot_sort.slot_sort(jnp.asarray(physical), 50, 8, config=config, interpret=True)
        for have, expected in zip(got, want):
            np.testing.assert_array_equal(np.asarray(have), expected)


def test_slot_sort_refuses_what_it_does_not_take():
    assert slot_sort.applies(256, 64) and slot_sort.applies(slot_sort.MAX_ENTRIES, 1 << 16)
    assert not slot_sort.applies(0, 64)
    assert not slot_sort.applies(slot_sort.MAX_ENTRIES + 1, 64)
    assert not slot_sort.applies(64, np.iinfo(np.int32).max // 64 - 1)  # its packed keys would pass int32
    with pytest.raises(ValueError, match="entries"):
        slot_sort.slot_sort(jnp.zeros(slot_sort.MAX_ENTRIES + 1, jnp.int32), 4, 1, interpret=True)
    for bad in ({"block": 3}, {"chunk": 0}, {"num_warps": True}):
        with pytest.raises(ValueError, match="power of two"):
            slot_sort.Config(**bad)


def test_sort_local_returns_each_rows_token(rng):
    """The XLA path here (no GPU): order, inverse, the slots' sizes and ``order // k``, as the kernel returns them."""
    physical = rng.integers(-1, 16, (32, 4)).astype(np.int32)
    order, inverse, sizes, tokens = jax.jit(lambda p: local.sort_local(p, 16))(jnp.asarray(physical))
    want_order, want_inverse, want_tokens = _want(physical.reshape(-1), 16, 4)
    np.testing.assert_array_equal(np.asarray(order), want_order)
    np.testing.assert_array_equal(np.asarray(inverse), want_inverse)
    np.testing.assert_array_equal(np.asarray(tokens), want_tokens)
    np.testing.assert_array_equal(np.asarray(sizes), np.bincount(physical[physical >= 0], minlength=16))


def test_probe_agrees_in_the_interpreter(monkeypatch):
    monkeypatch.setattr(slot_sort, "slot_sort", functools.partial(slot_sort.slot_sort, interpret=True))
    assert slot_sort.probe()

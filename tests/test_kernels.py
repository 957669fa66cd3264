"""Tests of the shared kernel helpers (``moe_eplb_jax._kernels``): the probe behind every Pallas default, and the
Triton grouped matmul's fallback to ``dense`` where its kernel cannot run.

(``map_and_count``'s and ``plan_quotas``' fallbacks: ``test_map_and_count.py``, ``test_routing_quota.py``.)
"""

from __future__ import annotations

import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_eplb_jax import _kernels


@pytest.fixture
def fresh(monkeypatch):
    """A fresh record of probes and warnings."""
    monkeypatch.setattr(_kernels, "_PROBED", {})
    monkeypatch.setattr(_kernels, "_WARNED", set())
    return _kernels


def test_probe_runs_once_per_case_and_warns_once_per_kernel(fresh):
    calls = []

    def probe(result):
        def run():
            calls.append(result)
            if result is None:
                raise RuntimeError("no Triton here")
            return result

        return run

    assert fresh.probed("kernel_a", probe(True), case="x")
    assert fresh.probed("kernel_a", probe(True), case="x")
    assert calls == [True]  # once per (kernel, case)
    with pytest.warns(RuntimeWarning, match="kernel_a: the Pallas kernel failed on this device \\(RuntimeError: no"):
        assert not fresh.probed("kernel_a", probe(None), case="y")
    with pytest.warns(RuntimeWarning, match="kernel_b: the Pallas kernel disagrees with its XLA implementation"):
        assert not fresh.probed("kernel_b", probe(False))
    with warnings.catch_warnings():  # kernel_a warned already: its other failing case is silent
        warnings.simplefilter("error", RuntimeWarning)
        assert not fresh.probed("kernel_a", probe(False), case="z")
    assert fresh._PROBED == {
        ("kernel_a", "x"): True,
        ("kernel_a", "y"): False,
        ("kernel_b", ""): False,
        ("kernel_a", "z"): False,
    }


def test_a_probe_first_reached_while_tracing_runs_on_concrete_values(fresh):
    """A kernel's default is often first asked for inside ``jit``: its probe (jnp set-up, an ahead-of-time
    compiled call, a comparison on the host) still runs eagerly and returns its verdict."""

    def probe():
        x = jnp.arange(8, dtype=jnp.float32) * 2  # a tracer without the compile-time scope
        compiled = jax.jit(lambda v: v + 1).lower(x).compile()
        return bool(np.allclose(np.asarray(compiled(x)), np.arange(8) * 2 + 1))

    verdicts = []

    def traced(v):
        verdicts.append(fresh.probed("traced_kernel", probe))
        return v + 1

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        jax.jit(traced)(jnp.float32(3))
    assert verdicts == [True]
    assert fresh._PROBED == {("traced_kernel", ""): True}


def test_pallas_default_needs_a_gpu(fresh, monkeypatch):
    """Off a GPU the XLA implementation is the default without probing; on one, the probe decides."""
    ran = []
    probe = lambda: ran.append(1) or True
    monkeypatch.setattr(fresh, "on_gpu", lambda: False)
    assert not fresh.pallas_default("k", probe) and not ran
    monkeypatch.setattr(fresh, "on_gpu", lambda: True)
    assert fresh.pallas_default("k", probe) and ran == [1]


def _grouped_inputs(rng):
    x = jnp.asarray(rng.standard_normal((40, 32)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((3, 32, 16)).astype(np.float32))
    return x, w, jnp.asarray([7, 0, 21], jnp.int32)  # 12 padding rows


@pytest.mark.parametrize("missing", [False, True], ids=["no-gpu", "no-triton"])
def test_grouped_matmul_falls_back_to_dense(fresh, monkeypatch, missing, rng):
    """``matmul="pallas"`` where its kernel cannot run -- no GPU here (the probe's compiled kernel fails), or Pallas'
    Triton backend missing (its import fails) -- computes with ``dense``: equal results, eager and inside jit, one
    warning per process."""
    from moe_eplb_jax.moe import grouped_matmul

    if missing:
        from jax.experimental import pallas

        monkeypatch.setitem(sys.modules, "jax.experimental.pallas.triton", None)
        monkeypatch.delattr(pallas, "triton", raising=False)
        monkeypatch.delitem(sys.modules, "moe_eplb_jax.moe._gmm.triton", raising=False)
        monkeypatch.delattr(sys.modules["moe_eplb_jax.moe._gmm"], "triton", raising=False)
    x, w, sizes = _grouped_inputs(rng)
    want = np.asarray(grouped_matmul.dense(x, w, sizes))
    kernel = grouped_matmul.get("pallas")
    with pytest.warns(RuntimeWarning, match="grouped_matmul: the Pallas kernel failed on this device") as caught:
        for got in (kernel(x, w, sizes), jax.jit(kernel)(x, w, sizes), kernel(x, w, sizes)):
            np.testing.assert_array_equal(np.asarray(got), want)
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    if missing:
        assert "ModuleNotFoundError" in str(caught[0].message)


@pytest.mark.gpu
def test_grouped_matmul_probe_passes_on_gpu(fresh, rng, recwarn):
    """On a GPU the Triton grouped matmul runs (no fallback, no warning) at full float32 precision."""
    from moe_eplb_jax.moe import grouped_matmul

    x, w, sizes = _grouped_inputs(rng)
    got = np.asarray(grouped_matmul.get("pallas")(x, w, sizes))
    assert fresh._PROBED == {("grouped_matmul", ""): True}
    slot = np.repeat(np.arange(3), np.asarray(sizes))
    want = np.einsum("nk,nkm->nm", np.asarray(x, np.float64)[:28], np.asarray(w, np.float64)[slot])
    np.testing.assert_allclose(got[:28], want, rtol=1e-4, atol=1e-4)
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]

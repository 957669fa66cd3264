"""Test configuration: 8 simulated CPU devices and a strict JAX.

The device count must be set before JAX initialises its backends, so this runs
at import time, before any test module imports jax. On a GPU machine run
``JAX_PLATFORMS=cuda pytest -m gpu`` to run the GPU-only tests; modules that need several devices
(``pytestmark = pytest.mark.devices(n)``, their module-level mesh guarded) skip on a machine with fewer.
"""

import os
import zlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
# The suite compiles hundreds of small CPU programs (Pallas interpret mode above all) and runs each on tiny
# inputs: LLVM's optimisation passes cost more than they save (about 13% of an interpret-mode test's time).
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags.strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Strict JAX: no implicit rank promotion, no silent dtype promotion.
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")

settings.register_profile("ci", deadline=None, max_examples=25, derandomize=True, print_blob=True)
settings.register_profile("dev", deadline=None, max_examples=100)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    """Tests skip with a reason where this machine lacks what they need: ``gpu`` ones without a GPU backend,
    ``devices(n)`` ones with fewer than n JAX devices (the closest marker wins, so a test can need fewer devices
    than its module)."""
    on_gpu = jax.default_backend() == "gpu"
    device_count = jax.device_count()
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        needs = item.get_closest_marker("devices")
        if needs is not None and device_count < needs.args[0]:
            item.add_marker(
                pytest.mark.skip(reason=f"needs {needs.args[0]} JAX devices, this machine has {device_count}")
            )


@pytest.fixture
def rng():
    """A numpy Generator per test, seeded from the test's id (reproducible, never all zeros)."""
    return np.random.default_rng(zlib.crc32(os.environ.get("PYTEST_CURRENT_TEST", "").encode()))


@pytest.fixture
def mesh(request):
    """A 1-D EP mesh (axis ``"ep"``) over the devices the test needs: its closest ``devices(n)`` marker's ``n``,
    else every device (``_models.ep_mesh``; modules that need a mesh at import build theirs with it too)."""
    from _models import ep_mesh

    needs = request.node.get_closest_marker("devices")
    return ep_mesh(needs.args[0] if needs is not None else jax.device_count())


@pytest.fixture
def h100_lowering(monkeypatch):
    """Lets Pallas lower Triton kernels for an H100/H200 on a machine without a GPU (lowering checks only).

    Every Triton module is also verified as it is lowered (MLIR's verifier: e.g. a loop whose bounds differ in
    type, which otherwise only fails when XLA parses the module on a GPU). Returns the ``disabled_checks`` that
    ``jax.export`` needs for the Triton custom call.
    """
    try:
        from jax._src.pallas.triton import gpu_info, pallas_call_registration
    except ImportError:  # private modules moved: nothing to check here
        pytest.skip("jax private Triton modules not found")
    monkeypatch.setattr(
        pallas_call_registration.gpu_info_lib,
        "get_gpu_info",
        lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100),
    )
    lower = pallas_call_registration.lowering.lower_jaxpr_to_triton_module

    def lower_and_verify(*args, **kwargs):
        result = lower(*args, **kwargs)
        result.module.operation.verify()  # raises MLIRError naming the op
        return result

    monkeypatch.setattr(pallas_call_registration.lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
    return [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]

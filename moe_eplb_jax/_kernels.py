"""Helpers shared by the package's Pallas kernels (``routing/_map_and_count/``, ``routing/``, ``transport/``, ``flax/``).

* :func:`join_varying` -- inputs and output types of a ``pallas_call`` inside ``shard_map``;
* :func:`fused_unless_differentiated` -- a fused inference kernel beside the composite whose gradients are written;
* :func:`pallas_default` / :func:`probed` -- whether a kernel's Pallas implementation may serve here: once a
  probe of it ran and agreed with its XLA implementation (``pallas_default``: and only on a GPU). Pallas'
  Triton backend is deprecated and leans on JAX internals, so a kernel that cannot lower or compile falls
  back to XLA with one warning instead of failing the caller.
"""

from __future__ import annotations

import concurrent.futures
import functools
import warnings
from collections.abc import Callable

import jax

__all__ = ["fused_unless_differentiated", "join_varying", "on_gpu", "pallas_default", "probed", "traced_zero"]


def join_varying(*arrays):
    """Inside ``shard_map``: makes every input vary over the union of the inputs' manual axes.

    Returns the cast arrays and a ``ShapeDtypeStruct`` factory whose outputs
    vary over that union (``pallas_call`` needs it under ``check_vma=True``).
    """
    mats = [getattr(jax.typeof(a), "mat", None) for a in arrays]
    varying = [m.varying for m in mats if m is not None]
    if len(varying) < len(arrays):  # a jax without manual axis types
        return arrays, jax.ShapeDtypeStruct
    axes = frozenset().union(*varying)
    cast = []
    for array, have in zip(arrays, varying):
        missing = tuple(sorted(axes - have, key=str))
        cast.append(jax.lax.pcast(array, missing, to="varying") if missing else array)
    mat = jax.sharding.ManualAxisType(varying=axes)
    return cast, functools.partial(jax.ShapeDtypeStruct, manual_axis_type=mat)


def fused_unless_differentiated(fused: Callable, plain: Callable) -> Callable:
    """A function of ``fused``'s and ``plain``'s arguments that runs ``fused(*args)`` where nothing differentiates
    the call, and ``plain``'s forward pass and VJP under ``jax.vjp`` / ``jax.grad`` -- for a fused kernel with no
    gradient of its own beside the composite of differentiable parts it replaces (the two compute the same
    function; no forward-mode derivative)."""

    @jax.custom_vjp
    def call(*args):
        return fused(*args)

    def forward(*args):
        return jax.vjp(plain, *args)

    def backward(vjp, cotangent):
        return vjp(cotangent)

    call.defvjp(forward, backward)
    return call


def traced_zero():
    """Inside a Pallas kernel: 0 as a traced value, the start of a masked window that reaches past an array's end
    (jax refuses a static slice past the end; the mask keeps the loads and stores inside)."""
    from jax.experimental import pallas as pl

    return pl.program_id(0) * 0


def on_gpu() -> bool:
    """Whether JAX's default backend is a GPU (where the Pallas kernels are the defaults)."""
    return jax.default_backend() == "gpu"


# Probe outcomes per (kernel, case) and the kernels already warned about: process state, not settings.
_PROBED: dict[tuple[str, str], bool] = {}
_WARNED: set[str] = set()


def pallas_default(kernel: str, probe: Callable[[], bool], *, case: str = "") -> bool:
    """Whether ``kernel``'s Pallas implementation serves as its default in this process: on a GPU
    (:func:`on_gpu`) where :func:`probed` says it works."""
    return on_gpu() and probed(kernel, probe, case=case)


def probed(kernel: str, probe: Callable[[], bool], *, case: str = "") -> bool:
    """Whether ``probe()`` -- run once per ``(kernel, case)`` and process -- returned ``True``.

    The probe should compile and run the Pallas kernel on a small input, ahead
    of time and outside any trace the caller is in
    (``jax.jit(f).lower(...).compile()(...)``), and compare it with the XLA
    implementation. A probe that raises (the Triton backend or a JAX internal
    missing, a lowering or compilation error, no GPU) or returns ``False``
    means the XLA implementation serves, with one ``RuntimeWarning`` per
    kernel and process.
    """
    key = (kernel, case)
    if key not in _PROBED:
        try:
            # On a thread of its own: JAX's trace state is per thread, so a probe first reached while the caller
            # traces still runs its set-up and its compiled call on concrete values.
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                agrees = pool.submit(probe).result()
            problem = None if agrees else "disagrees with its XLA implementation on this device"
        except Exception as err:  # any failure of the Pallas path: the XLA one still serves
            problem = f"failed on this device ({type(err).__name__}: {err})"
        _PROBED[key] = problem is None
        if problem is not None and kernel not in _WARNED:
            _WARNED.add(kernel)
            warnings.warn(
                f"{kernel}: the Pallas kernel {problem}; using the XLA implementation",
                RuntimeWarning,
                stacklevel=3,
            )
    return _PROBED[key]

"""Shared pieces of the resize tests: an NNX model whose expert state holds every dtype, its functional twin, and
the checks that every per-expert leaf equals the permuted checkpoint.

``MixedLayer`` is a ``MoELayer`` with one more expert variable, ``extras``: per slot an fp4 / e8m0 / fp8 / bf16 /
f32 / int8 pytree that moves with the weights (the forward pass does not read it). Its state comes from a logical
checkpoint (``[L, E, ...]`` per leaf, Adam moments included), so after any move each slot must hold the bytes of
its expert's row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from _bytes import random_bytes
from flax import nnx
from jax.sharding import PartitionSpec as PS

from moe_eplb_jax.flax import MoELayer
from moe_eplb_jax.transport import ep_mesh, put_host
from moe_eplb_jax.transport.packing import byte_rows_numpy

E, D, H, L = 8, 16, 8, 2
EXTRA_DTYPES = [
    ml_dtypes.float4_e2m1fn,
    ml_dtypes.float8_e8m0fnu,
    ml_dtypes.float8_e5m2,
    ml_dtypes.bfloat16,
    np.float32,
    np.int8,
]


def meshes(*sizes):
    """An EP mesh over the first ``g`` devices for each size."""
    return [ep_mesh(g) for g in sizes]


class MixedLayer(MoELayer):
    """A ``MoELayer`` whose expert state also holds ``extras``: one ``[P, 2, 4]`` leaf per dtype."""

    def __init__(self, mesh, num_physical, rngs):
        super().__init__(D, H, E, 2, mesh=mesh, num_physical=num_physical, rngs=rngs)
        zeros = {np.dtype(d).name: np.zeros((num_physical, 2, 4), d) for d in EXTRA_DTYPES}
        self.extras = nnx.Variable({k: put_host(v, mesh, PS("ep")) for k, v in zeros.items()})

    def eplb_expert_variables(self):
        return {**super().eplb_expert_variables(), "extras": self.extras}


class Stack(nnx.Module):
    """``L`` residual ``MixedLayer`` s with skewed routers."""

    def __init__(self, mesh, num_physical, seed=0):
        rngs = nnx.Rngs(seed)
        self.layers = nnx.List([MixedLayer(mesh, num_physical, rngs) for _ in range(L)])
        skew = -1.5 * np.log1p(np.arange(E, dtype=np.float32))
        for layer in self.layers:
            layer.router_bias.set_value(put_host(skew, mesh))

    def __call__(self, x, record=True):
        for layer in self.layers:
            x = x + layer(x, record=record)
        return x


@nnx.jit
def forward(model, x):
    return model(x, record=False)


def checkpoint(seed=0) -> dict:
    """Logical state per (layer, expert): ``w_in``, ``w_out``, their Adam moments, and ``extras``."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: (rng.standard_normal((L, E) + shape) * 0.3).astype(np.float32)
    ckpt = {"w_in": normal(D, 2 * H), "w_out": normal(H, D)}
    for moment in ("mu", "nu"):
        ckpt[moment] = {"w_in": np.abs(normal(D, 2 * H)), "w_out": np.abs(normal(H, D))}
    ckpt["extras"] = {np.dtype(d).name: random_bytes(rng, d, (L, E, 2, 4)) for d in EXTRA_DTYPES}
    return ckpt


def slots(ckpt, phy2log) -> dict:
    """The checkpoint laid out by ``phy2log [L, P]``: every leaf ``[L, P, ...]``."""
    return jax.tree.map(lambda x: x[np.arange(L)[:, None], np.asarray(phy2log)], ckpt)


def build(mesh, num_physical, ckpt, phy2log):
    """The NNX model and its Adam optimizer on ``mesh``, the expert state loaded from ``ckpt`` for ``phy2log``."""
    model = Stack(mesh, num_physical)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    fresh = nnx.state(optimizer, nnx.OptState)  # Adam starts at zeros: placed on the mesh, replicated
    nnx.update(optimizer, jax.tree.map(lambda x: put_host(np.zeros(x.shape, x.dtype), mesh), fresh))
    state = slots(ckpt, phy2log)
    put = lambda x: put_host(x, mesh, PS("ep"))
    for layer, module in enumerate(model.layers):
        module.w_in.set_value(put(state["w_in"][layer]))
        module.w_out.set_value(put(state["w_out"][layer]))
        module.extras.set_value({k: put(v[layer]) for k, v in state["extras"].items()})
    for path, var in nnx.iter_graph(optimizer):
        if (
            isinstance(var, nnx.Variable)
            and len(path) >= 4
            and path[-1] in ("w_in", "w_out")
            and path[-4] in ("mu", "nu")
        ):
            var.set_value(put(state[path[-4]][path[-1]][int(path[-2])]))
    return model, optimizer


def functional_twin(model, optimizer):
    """``(params, opt_state)`` holding the same arrays as the NNX model: the ``Balancer``'s view of it."""
    layers = [
        {
            "experts": {name: var.get_value() for name, var in module.eplb_expert_variables().items()},
            "router": module.router.get_value(),
        }
        for module in model.layers
    ]
    moments = {}
    for path, var in nnx.iter_graph(optimizer):
        if (
            isinstance(var, nnx.Variable)
            and len(path) >= 4
            and path[-1] in ("w_in", "w_out")
            and path[-4] in ("mu", "nu")
        ):
            rows = moments.setdefault(path[-4], {"layers": [{"experts": {}} for _ in range(L)]})["layers"]
            rows[int(path[-2])]["experts"][path[-1]] = var.get_value()
    count = jax.tree.leaves(nnx.state(optimizer, nnx.OptState))[0]
    return {"layers": layers}, {"count": count, **moments}


def assert_bytes(tree, want, mesh, what=""):
    """Every leaf of ``tree`` (``[P, ...]``) holds ``want``'s bytes and lives on ``mesh``, slot axis over EP."""
    for (path, leaf), expected in zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(want)):
        name = what + jax.tree_util.keystr(path)
        assert leaf.shape == expected.shape and leaf.dtype == expected.dtype, name
        assert list(leaf.sharding.mesh.devices.flat) == list(mesh.devices.flat), name
        np.testing.assert_array_equal(byte_rows_numpy(np.asarray(leaf), 1), byte_rows_numpy(expected, 1), name)


def layer_state(model, optimizer):
    """Per layer ``{"experts": ..., "mu": ..., "nu": ...}`` of the NNX model, as the checkpoint names them."""
    _, opt = functional_twin(model, optimizer)
    return [
        {
            "experts": {name: var.get_value() for name, var in m.eplb_expert_variables().items()},
            "mu": opt["mu"]["layers"][i]["experts"],
            "nu": opt["nu"]["layers"][i]["experts"],
        }
        for i, m in enumerate(model.layers)
    ]


def expected_layer(ckpt, phy2log, layer):
    state = slots(ckpt, phy2log)
    experts = {"w_in": state["w_in"][layer], "w_out": state["w_out"][layer]}
    experts["extras"] = {k: v[layer] for k, v in state["extras"].items()}
    return {
        "experts": experts,
        "mu": {k: v[layer] for k, v in state["mu"].items()},
        "nu": {k: v[layer] for k, v in state["nu"].items()},
    }


def assert_model_holds(model, optimizer, ckpt, phy2log, mesh):
    for layer, got in enumerate(layer_state(model, optimizer)):
        assert_bytes(got, expected_layer(ckpt, phy2log, layer), mesh, f"layer {layer}")


def scenario_loads(step: int, num_ranks: int, num_physical: int) -> np.ndarray:
    """``[L, G, P]`` int32 skewed per-rank tokens per slot."""
    rng = np.random.default_rng(step)
    weight = np.stack([np.roll(1.0 / np.arange(1, num_physical + 1) ** 1.5, 3 * layer) for layer in range(L)])
    return rng.poisson(100 * weight[:, None, :], size=(L, num_ranks, num_physical)).astype(np.int32)


def tokens(count=48, seed=3):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((count, D)).astype(np.float32))


def everything(model, optimizer, ctl, x) -> dict:
    """What a failed resize must leave as it was: every variable's bytes and placement, the layers' meshes and
    sizes, the controller's placement, tables, config and window, and the outputs."""
    out = {"forward": np.asarray(forward(model, x))}
    for root, name in ((model, "model"), (optimizer, "opt")):
        for path, var in nnx.iter_graph(root):
            if isinstance(var, nnx.Variable):
                for leaf_path, leaf in jax.tree_util.tree_leaves_with_path(var.get_value()):
                    key = f"{name}/{path}{jax.tree_util.keystr(leaf_path)}"
                    devices = [d.id for d in leaf.sharding.device_set] if hasattr(leaf, "sharding") else None
                    out[key] = (byte_rows_numpy(np.asarray(leaf)[None], 1), sorted(devices or []))
    out["layers"] = [(m.mesh, m.num_physical) for m in model.layers]
    p = ctl.placement
    out["placement"] = (p.phy2log, p.log2phy, p.logcnt)
    out["tables"] = ctl.routing_tables
    out["controller"] = (ctl.config, ctl.mesh, ctl.num_ranks, ctl.num_physical, ctl.total_steps)
    out["window"] = ctl._loop.window.host_summed(ctl.state)
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        flat_a, flat_b = jax.tree.leaves(a[key]), jax.tree.leaves(b[key])
        assert len(flat_a) == len(flat_b), key
        for x, y in zip(flat_a, flat_b):
            if isinstance(x, np.ndarray):
                assert np.array_equal(x, y), key
            else:
                assert x == y, key

"""A small MoE language model as plain pytrees and pure functions -- no NNX (the functional example's model).

``params``: ``embed [V, D]`` (tied output projection) and per layer ``router [D, E]``, ``router_bias [E]`` and
``experts = {"w_in": [P, D, 2H], "w_out": [P, H, D]}``, the slot axis sharded over the EP mesh axis. A block is
``x + moe(rms_norm(x))`` with ``moe_eplb_jax.moe.moe_apply``; each layer routes with its row of the
``RouteTables`` the balancer keeps, and returns its per-rank load ``[G, P]`` for ``Balancer.record_step``.
Routers start skewed (expert ``e`` biased by ``-skew * log(e + 1)``), the way real routers favour a few experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as PS

from moe_eplb_jax.moe import RouterConfig, moe_apply, tie_replicas
from moe_eplb_jax.placement import Placement
from moe_eplb_jax.transport import put_host

EXPERT_PATTERN = r"layers/(\d+)/experts/"  # the per-expert leaves, numbered by layer (ExpertLayout.match)


def init_params(
    seed: int, *, mesh, vocab=64, dim=32, hidden=32, num_layers=2, num_experts=8, num_physical=12, skew=1.5
):
    """Parameters with slot ``p`` holding expert ``p mod E`` (the linear placement), replicas identical."""
    rng = np.random.default_rng(seed)
    phy2log = Placement.linear(1, num_experts, num_physical).phy2log[0]
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    layers = []
    for _ in range(num_layers):
        w_in = normal(num_experts, dim, 2 * hidden) * dim**-0.5
        w_out = normal(num_experts, hidden, dim) * hidden**-0.5
        layers.append(
            {
                "router": put_host(normal(dim, num_experts) * dim**-0.5, mesh),
                "router_bias": put_host(-skew * np.log1p(np.arange(num_experts, dtype=np.float32)), mesh),
                "experts": {
                    "w_in": put_host(w_in[phy2log], mesh, PS("ep")),
                    "w_out": put_host(w_out[phy2log], mesh, PS("ep")),
                },
            }
        )
    return {"embed": put_host(normal(vocab, dim) * dim**-0.5, mesh), "layers": layers}


def rms_norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def forward(params, tables, tokens, *, mesh, top_k=2):
    """``tokens [B, T] -> (logits [B, T, V], loads)``: one ``[G, P]`` load per MoE layer."""
    x = params["embed"][tokens]
    loads = []
    for layer, p in enumerate(params["layers"]):
        h = rms_norm(x)
        # tie_replicas: every replica of an expert gets the expert's summed gradient, so replicas stay identical.
        experts = {name: tie_replicas(w, tables.phy2log[layer]) for name, w in p["experts"].items()}
        out, load = moe_apply(
            h.reshape(-1, h.shape[-1]),
            p["router"],
            p["router_bias"],
            experts,
            tables.log2phy[layer],
            tables.logcnt[layer],
            router=RouterConfig(top_k=top_k),
            mesh=mesh,
            lookup=tables.lookup[layer],
        )
        x = x + out.reshape(x.shape)
        loads.append(load)
    return rms_norm(x) @ params["embed"].T, loads


def loss_and_loads(params, tables, tokens, *, mesh, top_k=2):
    """Next-token cross entropy on ``tokens [B, T + 1]``, and the layers' loads."""
    logits, loads = forward(params, tables, tokens[:, :-1], mesh=mesh, top_k=top_k)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return loss, loads


def synthetic_batch(rng: np.random.Generator, batch: int, seq: int, vocab: int) -> np.ndarray:
    """Token sequences from a skewed (Zipf) unigram distribution whose second half repeats the first."""
    probs = 1.0 / np.arange(1, vocab + 1) ** 1.1
    tokens = rng.choice(vocab, size=(batch, seq), p=probs / probs.sum())
    tokens[:, seq // 2 :] = tokens[:, : seq - seq // 2]
    return tokens.astype(np.int32)

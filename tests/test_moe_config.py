"""The token path's configuration: ``RouterConfig`` and ``DispatchConfig`` checked once where built, each error
naming its field; the registry of routing modes every layer, config and kernel consults."""

import dataclasses

import jax
import pytest

from moe_eplb_jax.config import EplbConfig
from moe_eplb_jax.models import ModelConfig, preset
from moe_eplb_jax.moe import DispatchConfig, RouterConfig
from moe_eplb_jax.routing import MODES, ROUTING_MODES, RoutingMode, check_routing, routing_mode


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"top_k": 0}, "RouterConfig.top_k must be an integer >= 1, got 0"),
        ({"top_k": True}, "RouterConfig.top_k must be an integer"),
        ({"top_k": 2.0}, "RouterConfig.top_k must be an integer"),
        ({"num_groups": 0}, "RouterConfig.num_groups must be an integer >= 1"),
        ({"num_groups": 4, "topk_groups": 0}, "RouterConfig.topk_groups must be an integer >= 1"),
        ({"num_groups": 4, "topk_groups": 5}, r"RouterConfig.topk_groups=5 must be in \[1, num_groups=4\]"),
        ({"scoring": "relu"}, "RouterConfig.scoring must be one of \\('softmax', 'sigmoid'\\)"),
        ({"renormalize": 1}, "RouterConfig.renormalize must be a bool"),
        ({"routed_scaling_factor": float("nan")}, "RouterConfig.routed_scaling_factor must be positive and finite"),
        ({"routed_scaling_factor": 0.0}, "RouterConfig.routed_scaling_factor"),
        ({"routed_scaling_factor": True}, "RouterConfig.routed_scaling_factor"),
    ],
)
def test_router_config_rejects_bad_fields_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        RouterConfig(**{"top_k": 2} | fields)


def test_route_marks_padding_rows_routed_nowhere():
    """``route(valid=)``: the rows it marks false get ids -1 and keep their weights; a mask of another length is
    refused by name."""
    import jax.numpy as jnp
    import numpy as np

    from moe_eplb_jax.moe import route

    config = RouterConfig(top_k=2)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 8)), jnp.float32)
    router_w = jnp.asarray(np.random.default_rng(1).standard_normal((8, 6)), jnp.float32)
    valid = jnp.asarray([True, False, True, True, False])
    ids, weights = route(x, router_w, config)
    masked_ids, masked_weights = route(x, router_w, config, valid=valid)
    np.testing.assert_array_equal(np.asarray(masked_ids), np.where(np.asarray(valid)[:, None], ids, -1))
    np.testing.assert_array_equal(np.asarray(masked_weights), np.asarray(weights))
    with pytest.raises(ValueError, match=r"valid must have shape \[T=5\]"):
        route(x, router_w, config, valid=valid[:4])


def test_router_config_checks_the_experts_it_routes():
    RouterConfig(top_k=8, num_groups=8, topk_groups=4).check_experts(256)  # DeepSeek-V3
    for config, message in [
        (RouterConfig(top_k=9), "RouterConfig.top_k=9 is larger than num_experts=8"),
        (RouterConfig(top_k=2, num_groups=3), "num_experts=8 is not divisible by RouterConfig.num_groups=3"),
        (RouterConfig(top_k=3, num_groups=4, topk_groups=1), "groups of 2 experts hold fewer than top_k=3"),
    ]:
        with pytest.raises(ValueError, match=message):
            config.check_experts(8)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"matmul": "magic"}, "DispatchConfig.matmul: unknown grouped matmul 'magic'"),
        ({"map_implementation": "cuda"}, "DispatchConfig.map_implementation must be one of \\('xla', 'pallas'\\)"),
        ({"quant_impl": "fast"}, "DispatchConfig.quant_impl must be one of"),
        ({"activation_scaling": "per_token"}, "DispatchConfig.activation_scaling must be one of"),
        ({"capacity_factor": 0.0}, "DispatchConfig.capacity_factor must be positive and finite or None"),
        ({"capacity_factor": float("inf")}, "DispatchConfig.capacity_factor"),
        ({"capacity_factor": "1.25"}, "DispatchConfig.capacity_factor"),
        ({"one_round_rows": -1}, "DispatchConfig.one_round_rows must be an integer >= 0"),
        ({"one_round_rows": 1.5}, "DispatchConfig.one_round_rows must be an integer"),
        ({"load_reduce": "mean"}, "DispatchConfig.load_reduce must be one of \\('none', 'psum'\\)"),
        ({"shared_expert": "remote"}, "DispatchConfig.shared_expert must be one of \\('local', 'waterfill'\\)"),
        ({"batch_axes": ("data", "data")}, "DispatchConfig.batch_axes must name distinct mesh axes"),
        ({"batch_axes": (0,)}, "DispatchConfig.batch_axes must name distinct mesh axes"),
    ],
)
def test_dispatch_config_rejects_bad_fields_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        DispatchConfig(**fields)


def test_dispatch_config_resolves_axes_and_capacity():
    assert DispatchConfig(batch_axes="data").batch_axes == ("data",)
    assert DispatchConfig(batch_axes=["data", "fsdp"]).batch_axes == ("data", "fsdp")
    mesh = jax.make_mesh((1, 1, 1), ("data", "fsdp", "ep"), devices=jax.devices()[:1])
    assert DispatchConfig().token_axes(mesh, "ep") == ("data", "fsdp")
    assert DispatchConfig(batch_axes="fsdp").token_axes(mesh, "ep") == ("fsdp",)
    for config, axis in ((DispatchConfig(batch_axes="ep"), "ep"), (DispatchConfig(batch_axes="tp"), "ep")):
        with pytest.raises(ValueError, match="DispatchConfig.batch_axes must name mesh axes other than 'ep'"):
            config.token_axes(mesh, axis)
    with pytest.raises(ValueError, match="mesh has no axis 'tp'"):
        DispatchConfig().token_axes(mesh, "tp")
    # ceil(f * A / G) rows per rank pair, at least 1, at most A; None: one worst-case exchange.
    assert DispatchConfig().capacity(64, 4) is None
    rounds = [DispatchConfig(capacity_factor=f, one_round_rows=0).capacity(64, 4) for f in (1.0, 1.25, 0.01, 100.0)]
    assert rounds == [16, 20, 1, 64]
    # A worst case of at most one_round_rows rows (G * A) goes in one round: no loop of rounds at decode sizes.
    assert DispatchConfig(capacity_factor=1.0).capacity(64, 4) is None  # 256 <= 4096
    assert DispatchConfig(capacity_factor=1.0).capacity(2048, 4) == 512  # 8192 > 4096
    assert DispatchConfig(capacity_factor=1.0, one_round_rows=256).capacity(64, 4) is None
    assert DispatchConfig(capacity_factor=1.0, one_round_rows=255).capacity(64, 4) == 16
    # Frozen and hashable: a static argument of a jitted function.
    assert hash(DispatchConfig()) == hash(DispatchConfig()) and hash(RouterConfig(top_k=2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        DispatchConfig().matmul = "pallas"  # type: ignore[misc]


def test_model_config_builds_its_router():
    v3 = preset("deepseek_v3_small")
    assert v3.router == RouterConfig(
        top_k=8, num_groups=8, topk_groups=4, scoring="sigmoid", renormalize=True, routed_scaling_factor=2.5
    )
    with pytest.raises(ValueError, match="ModelConfig.topk_groups=5 must be in"):  # named as the user wrote it
        ModelConfig(num_groups=4, topk_groups=5)


def test_routing_modes_are_one_registry():
    """Every mode's table is its kernel rule's; a name or a registered mode resolves, anything else is refused
    naming the field; EplbConfig takes its policy rule from the registry."""
    assert ROUTING_MODES == tuple(MODES) == ("hash", "round_robin", "lp", "quota")
    assert [MODES[m].stateless for m in ROUTING_MODES] == [True, True, False, False]
    assert MODES["lp"].shares and MODES["lp"].table == "replica_shares" and MODES["lp"].policy is None
    assert MODES["quota"].quotas and MODES["quota"].table == "quotas" and MODES["quota"].policy == "online"
    assert routing_mode("lp") is routing_mode(MODES["lp"]) is MODES["lp"] and check_routing("quota") == "quota"
    for bad in ("shares", None, ["hash"], dataclasses.replace(MODES["hash"], summary="another")):
        with pytest.raises(ValueError, match="EplbConfig.routing must be one of"):
            routing_mode(bad, field="EplbConfig.routing")
    with pytest.raises(TypeError):
        MODES["new"] = MODES["hash"]  # type: ignore[index]
    with pytest.raises(ValueError, match="kernel rule 'lp' reads replica_shares, but the mode supplies None"):
        RoutingMode(name="lp_batch", kernel="lp")
    with pytest.raises(ValueError, match="RoutingMode.kernel must be one of"):
        RoutingMode(name="random", kernel="random")
    with pytest.raises(ValueError, match="routing='quota' .* needs policy='online'"):
        EplbConfig(routing="quota")
    with pytest.raises(ValueError, match="refresh period of a routing mode with its own policy \\('quota'\\)"):
        EplbConfig(routing="lp", refresh_interval=4)

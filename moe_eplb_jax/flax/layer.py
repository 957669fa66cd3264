"""A reference expert-parallel MoE layer (Flax NNX) with physical expert slots.

Expert weights are stored per physical slot, ``w_in [P, D, 2H]`` and
``w_out [P, H, D]``, sharded over the EP axis (or, after
``MoELayer.quantize(fmt)``, quantized pytrees of ``moe_eplb_jax.quant``);
replicas of an expert hold identical bytes, and in training ``tie_replicas``
gives every replica the expert's summed gradient so they stay identical. The
placement tables (``phy2log [P]``, ``log2phy [E, S]``, ``logcnt [E]``,
``replica_shares [E, S]`` (``"lp"``), and ``route_lookup``, the Pallas
kernel's lookup table of them, rebuilt whenever they change so no forward pass
rebuilds it) are ``EplbTable`` variables -- inputs of the compiled function,
never constants in it, so a rearrangement never recompiles -- and the tokens
per slot of every forward pass are added to the ``ExpertLoad`` variable, which
the controller reads. The forward pass is :func:`moe_eplb_jax.moe.moe_apply`
(routing modes, meshes with batch axes, load layouts: see its module), configured
by the layer's ``RouterConfig`` and ``DispatchConfig``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from moe_eplb_jax import quant
from moe_eplb_jax.moe import DispatchConfig, RouterConfig, axes_size, moe_apply, tie_replicas
from moe_eplb_jax.placement import Placement
from moe_eplb_jax.routing import equal_shares, mode_lookup, routing_mode
from moe_eplb_jax.transport.mesh import put_host

__all__ = ["EplbTable", "ExpertLoad", "MoELayer", "QuantizedExperts"]


class EplbTable(nnx.Variable):
    """A placement table of one MoE layer (int32; float32 ``replica_shares``). Not a parameter: optimizers skip it."""


class QuantizedExperts(nnx.Variable):
    """A quantized expert projection (a ``moe_eplb_jax.quant`` pytree, every leaf ``[P, ...]``). Frozen."""


class ExpertLoad(nnx.Variable):
    """Tokens routed to each physical slot since the controller last read it (int32).

    ``[G, P]`` (row ``g``: counted on EP rank ``g``, summed over the mesh's
    batch axes; sharded over the EP axis, replicated over the batch axes) with
    ``load_reduce="none"``, ``[P]`` (replicated) with ``"psum"``.
    """


class MoELayer(nnx.Module):
    """Expert-parallel MoE layer with ``P`` physical slots (see the module docstring).

    Args:
      dim: model width ``D``.
      hidden: expert hidden width ``H`` (gated MLP: ``w_in [P, D, 2H]``, ``w_out [P, H, D]``).
      num_experts: logical experts ``E``.
      router: the router's style, a ``RouterConfig`` (``top_k``, groups,
        scoring, scaling; see ``route``), or ``k`` for the plain top-k softmax
        router. With ``"softmax"`` ``router_bias`` is added to the logits;
        with ``"sigmoid"`` (DeepSeek-V3) it is the score-correction bias, used
        to choose experts only. (The router's weights are the parameter
        ``self.router``, its config ``self.router_config``.)
      mesh: the device mesh; ``axis`` names its EP axis (``G`` ranks, ``P % G == 0``).
      num_physical: ``P`` (default ``E``: no redundant slots).
      shared_hidden: width of a shared expert applied to every token (0: none).
      dtype: activation and expert-weight dtype (e.g. ``jnp.bfloat16``).
      routing: replica routing mode, a name of ``moe_eplb_jax.routing.ROUTING_MODES``
        (``"hash"``, ``"round_robin"``, ``"lp"``, ``"quota"``; see ``moe_apply``);
        ``eplb_set_routing`` switches it later.
      dispatch: how the forward pass runs (``DispatchConfig``: grouped matmul,
        ``map_and_count`` implementation, exchange capacity, load layout,
        shared-expert placement, batch axes). With ``load_reduce="none"`` (the
        default) ``expert_load`` is ``[G, P]``, each rank adding its own counts
        to its row, no collective in the step (the controller sums the rows
        when it reads them); with ``"psum"`` it is ``[P]``, summed over the EP
        axis every forward pass. On a mesh with batch axes the rows are also
        summed over them.
      rngs: ``nnx.Rngs`` for the initial weights.

    Replicas start with identical weights: slot ``p`` holds expert ``p mod E``.
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        num_experts: int,
        router: RouterConfig | int,
        *,
        mesh: jax.sharding.Mesh,
        axis: str = "ep",
        num_physical: int | None = None,
        shared_hidden: int = 0,
        dtype: Any = jnp.float32,
        routing: str = "hash",
        dispatch: DispatchConfig = DispatchConfig(),
        rngs: nnx.Rngs,
    ):
        router = RouterConfig(top_k=router) if isinstance(router, int) and not isinstance(router, bool) else router
        if not isinstance(router, RouterConfig):
            raise ValueError(f"router must be a RouterConfig or a top_k, got {router!r}")
        if not isinstance(dispatch, DispatchConfig):
            raise ValueError(f"dispatch must be a DispatchConfig, got {type(dispatch).__name__}")
        num_physical = num_experts if num_physical is None else num_physical
        if min(dim, hidden, num_experts) < 1:
            raise ValueError(f"dim, hidden, num_experts must be positive, got {dim}, {hidden}, {num_experts}")
        router.check_experts(num_experts)
        if axis not in mesh.shape:
            raise ValueError(f"mesh has no axis {axis!r}; its axes are {tuple(mesh.shape)}")
        if num_physical < num_experts or num_physical % mesh.shape[axis]:
            raise ValueError(
                f"num_physical={num_physical} must be >= num_experts={num_experts} and divisible by the "
                f"EP size {mesh.shape[axis]} of mesh axis {axis!r}"
            )
        dispatch.token_axes(mesh, axis)  # checks the batch axes against the mesh
        self.routing = routing_mode(routing).name
        self.router_config, self.dispatch = router, dispatch
        self.mesh, self.axis = mesh, axis
        self.num_experts, self.num_physical = num_experts, num_physical
        self.quant_format = None

        keys = [rngs.params() for _ in range(5)]
        placement = Placement.linear(1, num_experts, num_physical)
        phy2log = placement.phy2log[0]
        slots = NamedSharding(mesh, PS(axis))
        self.router = nnx.Param(
            put_host(np.asarray(jax.random.normal(keys[2], (dim, num_experts)) * dim**-0.5), mesh, PS())
        )
        self.router_bias = nnx.Param(put_host(np.zeros(num_experts, np.float32), mesh, PS()))
        # One float32 draw on the device at a time: at DeepSeek-V3 widths each is gigabytes.
        w_in = jax.random.normal(keys[0], (num_experts, dim, 2 * hidden), jnp.float32) * dim**-0.5
        self.w_in = nnx.Param(put_host(np.asarray(w_in.astype(dtype))[phy2log], mesh, slots.spec))
        del w_in
        w_out = jax.random.normal(keys[1], (num_experts, hidden, dim), jnp.float32) * hidden**-0.5
        self.w_out = nnx.Param(put_host(np.asarray(w_out.astype(dtype))[phy2log], mesh, slots.spec))
        del w_out
        if shared_hidden:
            s_in = jax.random.normal(keys[3], (dim, 2 * shared_hidden), jnp.float32) * dim**-0.5
            s_out = jax.random.normal(keys[4], (shared_hidden, dim), jnp.float32) * shared_hidden**-0.5
            self.shared_in = nnx.Param(put_host(np.asarray(s_in.astype(dtype)), mesh, PS()))
            self.shared_out = nnx.Param(put_host(np.asarray(s_out.astype(dtype)), mesh, PS()))
        else:
            self.shared_in = self.shared_out = None
        self.phy2log = EplbTable(put_host(placement.phy2log[0], mesh, PS()))
        self.log2phy = EplbTable(put_host(placement.log2phy[0], mesh, PS()))
        self.logcnt = EplbTable(put_host(placement.logcnt[0], mesh, PS()))
        shares = equal_shares(placement.logcnt[0], placement.log2phy.shape[2])
        self.replica_shares = EplbTable(put_host(shares, mesh, PS()))
        self.route_lookup = EplbTable(self._lookup(routing, placement.log2phy[0], placement.logcnt[0], shares))
        if dispatch.load_reduce == "psum":
            self.expert_load = ExpertLoad(put_host(np.zeros(num_physical, np.int32), mesh, PS()))
        else:  # one row per EP rank, each on its rank: the forward pass adds to it without communication
            load = np.zeros((mesh.shape[axis], num_physical), np.int32)
            self.expert_load = ExpertLoad(put_host(load, mesh, PS(axis)))

    def __call__(self, x, *, valid=None, record=True):
        """``x [..., D]`` (leading sizes multiply to a multiple of ``G`` times the batch axes' size) -> ``[..., D]``.

        ``valid``: optional bool mask of ``x``'s leading shape; ``False`` marks
        padding, which no routed expert computes (the local shared expert
        still does; Waterfill does not) and no load counts. ``record``: count
        this pass's load (a Python or traced bool).
        """
        lead, dim = x.shape[:-1], x.shape[-1]
        tokens = x.reshape(-1, dim)
        if valid is not None:
            if tuple(valid.shape) != tuple(lead):
                raise ValueError(f"valid must have x's leading shape {tuple(lead)}, got {tuple(valid.shape)}")
            valid = valid.reshape(-1)
        num_devices = self.mesh.shape[self.axis] * axes_size(self.mesh, self.dispatch.token_axes(self.mesh, self.axis))
        if tokens.shape[0] % num_devices:
            raise ValueError(
                f"{tokens.shape[0]} tokens are not divisible by the EP size {self.mesh.shape[self.axis]} "
                f"times the batch axes' size {num_devices // self.mesh.shape[self.axis]}"
            )
        phy2log = self.phy2log.get_value()
        if self.quant_format is None:
            experts = {
                name: tie_replicas(var.get_value(), phy2log, num_logical=self.num_experts)
                for name, var in self.eplb_expert_variables().items()
            }
        else:  # quantized experts are frozen (serving): nothing to tie
            experts = {name: var.get_value() for name, var in self.eplb_expert_variables().items()}
        shared = None
        if self.shared_in is not None and self.shared_out is not None:
            shared = {
                "w_in": _shared_weight(self.shared_in.get_value(), x.dtype),
                "w_out": _shared_weight(self.shared_out.get_value(), x.dtype),
            }
        out, load = moe_apply(
            tokens,
            self.router.get_value(),
            self.router_bias.get_value(),
            experts,
            self.log2phy.get_value(),
            self.logcnt.get_value(),
            valid,
            record,
            router=self.router_config,
            mesh=self.mesh,
            axis=self.axis,
            routing=self.routing,
            dispatch=self.dispatch,
            lookup=self.route_lookup.get_value(),
            replica_shares=self.replica_shares.get_value(),
            shared=shared,
        )
        self.expert_load.set_value(self.expert_load.get_value() + load)
        return out.reshape(*lead, dim)

    # ------------------------------------------------- the EPLB protocol
    def eplb_num_logical_experts(self) -> int:
        return self.num_experts

    def eplb_expert_variables(self) -> dict[str, nnx.Variable]:
        if self.quant_format is None:
            variables = {"w_in": self.w_in, "w_out": self.w_out}
        else:
            variables = {"gate": self.q_gate, "up": self.q_up, "down": self.q_down}
        return {name: var for name, var in variables.items() if var is not None}

    # ------------------------------------------------------ quantization
    def quantize(self, fmt: str, *, impl: str = "auto", activation_scaling: str = "dynamic") -> None:
        """Replaces the float expert weights by quantized ones (serving; e.g. ``"fp8"``, ``"mxfp4"``).

        Every slot is quantized on its own, so replicas stay bit-identical.
        ``impl`` and ``activation_scaling`` become the layer's ``DispatchConfig.quant_impl`` /
        ``activation_scaling`` (``"auto"``: the ragged quantized grouped matmul);
        dynamic activation scales are max-reduced over the EP axis. The
        quantized pytrees (weights and scales, all ``[P, ...]``) are what the
        controller moves.
        """
        w_in_var, w_out_var = self.w_in, self.w_out
        if self.quant_format is not None or w_in_var is None or w_out_var is None:
            raise ValueError(f"layer is already quantized ({self.quant_format!r})")
        if fmt not in quant.FORMATS:
            raise ValueError(f"unknown quantized format {fmt!r}; known: {sorted(quant.FORMATS)}")
        if impl not in quant.IMPLS:
            raise ValueError(f"unknown quant impl {impl!r}; known: {list(quant.IMPLS)}")
        hidden = w_out_var.get_value().shape[1]
        w_in = np.asarray(w_in_var.get_value(), np.float32)
        w_out = np.asarray(w_out_var.get_value(), np.float32)
        # quant wants the contraction axis last: gate/up [P, H, D], down [P, D, H].
        gate = np.ascontiguousarray(np.swapaxes(w_in[:, :, :hidden], 1, 2))
        up = np.ascontiguousarray(np.swapaxes(w_in[:, :, hidden:], 1, 2))
        down = np.ascontiguousarray(np.swapaxes(w_out, 1, 2))
        q = quant.quantize_mlp(jnp.asarray(gate), jnp.asarray(up), jnp.asarray(down), fmt)
        self.set_quantized_experts(*q, impl=impl, activation_scaling=activation_scaling)

    def set_quantized_experts(self, gate, up, down, *, impl: str = "auto", activation_scaling: str = "dynamic"):
        """Installs quantized experts in place of the float ones (e.g. block-FP8 experts read from a checkpoint).

        ``gate``/``up`` ``[P, H, D]`` and ``down`` ``[P, D, H]``: pytrees of one
        ``moe_eplb_jax.quant`` format, slot ``p`` holding expert ``phy2log[p]``
        (host or device arrays). Checked before anything changes.
        """
        w_in_var, w_out_var = self.w_in, self.w_out
        if self.quant_format is not None or w_in_var is None or w_out_var is None:
            raise ValueError(f"layer is already quantized ({self.quant_format!r})")
        if impl not in quant.IMPLS:
            raise ValueError(f"unknown quant impl {impl!r}; known: {list(quant.IMPLS)}")
        kinds = {type(t) for t in (gate, up, down)}
        if len(kinds) != 1 or not isinstance(gate, quant.QuantizedExperts):
            raise ValueError(f"gate, up, down must be quantized experts of one format, got {sorted(map(str, kinds))}")
        p, d, hidden = w_in_var.get_value().shape[0], w_in_var.get_value().shape[1], w_out_var.get_value().shape[1]
        for name, q, want in (
            ("gate", gate, (p, hidden, d)),
            ("up", up, (p, hidden, d)),
            ("down", down, (p, d, hidden)),
        ):
            if tuple(q.shape) != want:
                raise ValueError(f"quantized {name} has shape {tuple(q.shape)}, expected {want}")
        slots = PS(self.axis)
        placed = [jax.tree.map(lambda leaf: put_host(np.asarray(leaf), self.mesh, slots), t) for t in (gate, up, down)]
        self.q_gate, self.q_up, self.q_down = (QuantizedExperts(t) for t in placed)
        self.w_in = self.w_out = None
        self.quant_format = gate.fmt
        self.dispatch = dataclasses.replace(self.dispatch, quant_impl=impl, activation_scaling=activation_scaling)

    def eplb_load_variable(self) -> nnx.Variable:
        return self.expert_load

    def eplb_get_placement(self):
        return self.phy2log.get_value(), self.log2phy.get_value(), self.logcnt.get_value()

    def eplb_set_placement(self, phy2log, log2phy, logcnt, *, replica_shares=None) -> None:
        """Installs a new placement (and, for ``"lp"``, its replica shares), checked before anything changes.

        ``replica_shares``: ``[E, S]`` finite non-negative weights of each
        expert's replicas (``moe_eplb_jax.routing.routing_tables``); ``None``:
        equal shares. Kept whatever the mode, read by ``"lp"``.
        """
        tables = self._checked_tables(self.num_physical, phy2log, log2phy, logcnt, replica_shares)
        self._set_tables(self.mesh, *tables)

    def eplb_resize(self, mesh: jax.sharding.Mesh, phy2log, log2phy, logcnt, *, replica_shares=None) -> None:
        """Moves the layer to ``mesh`` with ``P' = len(phy2log)`` slots: its EP size, tables and (zero) load.

        The controller calls it during a resize, once the expert variables hold
        their ``[P', ...]`` arrays on ``mesh`` (and the router and shared expert
        their replicated ones); checked before anything changes.
        """
        if self.axis not in mesh.shape:
            raise ValueError(f"mesh has no axis {self.axis!r}; its axes are {tuple(mesh.shape)}")
        num_physical, num_ranks = int(np.shape(phy2log)[0]), int(mesh.shape[self.axis])
        if num_physical < self.num_experts or num_physical % num_ranks:
            raise ValueError(
                f"{num_physical} slots must be >= num_experts={self.num_experts} and divisible by the EP size {num_ranks}"
            )
        self.dispatch.token_axes(mesh, self.axis)
        tables = self._checked_tables(num_physical, phy2log, log2phy, logcnt, replica_shares)
        load = self.expert_load.get_value()
        rows, spec = ((num_physical,), PS()) if load.ndim == 1 else ((num_ranks, num_physical), PS(self.axis))
        zeros = put_host(np.zeros(rows, np.int32), mesh, spec)
        self.mesh, self.num_physical = mesh, num_physical
        self._set_tables(mesh, *tables)
        self.expert_load.set_value(zeros)

    def _checked_tables(self, num_physical: int, phy2log, log2phy, logcnt, replica_shares):
        """The tables as host arrays with this layer's lookup, for ``num_physical`` slots (``ValueError`` first)."""
        width = num_physical - self.num_experts + 1
        for name, value, shape in (
            ("phy2log", phy2log, (num_physical,)),
            ("log2phy", log2phy, (self.num_experts, width)),
            ("logcnt", logcnt, (self.num_experts,)),
        ):
            if tuple(np.shape(value)) != shape:
                raise ValueError(f"placement table must have shape {shape} ({name}), got {np.shape(value)}")
        log2phy, logcnt = np.asarray(log2phy, np.int32), np.asarray(logcnt, np.int32)
        if replica_shares is None:
            shares = equal_shares(logcnt, log2phy.shape[1])
        else:
            shares = np.asarray(replica_shares)
            if shares.shape != log2phy.shape or not np.issubdtype(shares.dtype, np.floating):
                raise ValueError(
                    f"replica_shares must be floats of shape [E, S] = {log2phy.shape}, got {shares.dtype} {shares.shape}"
                )
            if not np.all(np.isfinite(shares)) or np.any(shares < 0):
                raise ValueError("replica_shares must be finite and non-negative")
            shares = shares.astype(np.float32)
        lookup = mode_lookup(self.routing, log2phy, logcnt, replica_shares=shares, num_physical=num_physical)
        return np.asarray(phy2log, np.int32), log2phy, logcnt, shares, lookup

    def _set_tables(self, mesh, phy2log, log2phy, logcnt, shares, lookup) -> None:
        for var, value in (
            (self.phy2log, phy2log),
            (self.log2phy, log2phy),
            (self.logcnt, logcnt),
            (self.replica_shares, shares),
            (self.route_lookup, lookup),
        ):
            var.set_value(put_host(value, mesh, PS()))

    def eplb_set_routing(self, routing: str) -> None:
        """Switches the replica routing mode (a name of ``moe_eplb_jax.routing.ROUTING_MODES``).

        The mode is static configuration: the next jitted call compiles once
        for it; the weights, tables and loads stay as they are.
        """
        routing = routing_mode(routing).name
        if routing == self.routing:
            return
        tables = (self.log2phy, self.logcnt, self.replica_shares)
        route_lookup = self._lookup(routing, *(np.asarray(t.get_value()) for t in tables))
        self.routing = routing
        self.route_lookup.set_value(route_lookup)  # a shares mode's carries the alias table: another shape

    def _lookup(self, routing, log2phy, logcnt, shares):
        """``routing.mode_lookup`` of this layer's placement, replicated (built once per placement)."""
        table = mode_lookup(routing, log2phy, logcnt, replica_shares=shares, num_physical=self.num_physical)
        return put_host(table, self.mesh, PS())


def _shared_weight(value, dtype):
    """A shared-expert weight as a float ``[in, out]`` array.

    Float weights are used as stored; a block-FP8 one (``quant.Fp8BlockExperts``
    in the checkpoint layout: ``w_in`` as two experts ``[2, H, D]``, gate then
    up; ``w_out`` as one ``[1, D, H]``) is decoded to ``dtype``.
    """
    if not isinstance(value, quant.Fp8BlockExperts):
        return value
    w = value.dequantize()  # [n, out, in] float32
    return jnp.concatenate(list(w), axis=0).T.astype(dtype)

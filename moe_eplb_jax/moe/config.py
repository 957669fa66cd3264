"""Frozen configuration of the token path, checked once where it is built.

* :class:`RouterConfig` -- how a token picks its experts: part of the model (what a checkpoint's config fixes).
* :class:`DispatchConfig` -- how a layer runs its token path: kernels, the exchange, the load's layout, where the
  shared expert runs, which mesh axes shard the tokens. Every choice gives the same routed outputs (``"ragged_dot"``
  up to rounding that may follow the placement; quantized experts by ``quant_impl`` / ``activation_scaling``).

``moe_apply``, ``MoELayer``, ``models.ModelConfig`` and the examples share these objects.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from moe_eplb_jax._checks import INT32_MAX, show
from moe_eplb_jax.moe import grouped_matmul
from moe_eplb_jax.quant import ACTIVATION_SCALINGS
from moe_eplb_jax.quant import IMPLS as QUANT_IMPLS
from moe_eplb_jax.routing import MAP_AND_COUNT_IMPLEMENTATIONS

__all__ = ["LOAD_REDUCTIONS", "ROUTER_SCORINGS", "SHARED_EXPERTS", "DispatchConfig", "RouterConfig", "axes_size"]

ROUTER_SCORINGS = ("softmax", "sigmoid")
LOAD_REDUCTIONS = ("none", "psum")
SHARED_EXPERTS = ("local", "waterfill")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """Top-k routing in the styles of released MoE models (see ``route``).

    Attributes:
      top_k: experts per token.
      num_groups: expert groups (``E`` divisible by it); with ``topk_groups`` set, a token picks its experts only
        from its ``topk_groups`` groups with the highest group score.
      topk_groups: ``None``: plain top-k.
      scoring: ``"softmax"`` (Qwen3-MoE; the router bias is added to the logits) or ``"sigmoid"`` (DeepSeek-V3;
        the bias is the score-correction bias, used to choose experts only).
      renormalize: divide the ``k`` weights by their sum (Qwen3's ``norm_topk_prob``; DeepSeek-V3 sets it).
      routed_scaling_factor: multiplies the weights after renormalisation (DeepSeek-V3: 2.5).
    """

    top_k: int
    num_groups: int = 1
    topk_groups: int | None = None
    scoring: str = "softmax"
    renormalize: bool = True
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        _check_int("RouterConfig.top_k", self.top_k, minimum=1)
        _check_int("RouterConfig.num_groups", self.num_groups, minimum=1)
        if self.topk_groups is not None:
            _check_int("RouterConfig.topk_groups", self.topk_groups, minimum=1)
            if self.topk_groups > self.num_groups:
                raise ValueError(
                    f"RouterConfig.topk_groups={self.topk_groups} must be in [1, num_groups={self.num_groups}]"
                )
        if self.scoring not in ROUTER_SCORINGS:
            raise ValueError(f"RouterConfig.scoring must be one of {ROUTER_SCORINGS}, got {self.scoring!r}")
        if not isinstance(self.renormalize, bool):
            raise ValueError(f"RouterConfig.renormalize must be a bool, got {self.renormalize!r}")
        factor = self.routed_scaling_factor
        if (
            isinstance(factor, bool)
            or not isinstance(factor, (int, float))
            or not (math.isfinite(factor) and factor > 0)
        ):
            raise ValueError(f"RouterConfig.routed_scaling_factor must be positive and finite, got {factor!r}")

    def check_experts(self, num_experts: int) -> None:
        """``ValueError`` unless ``num_experts`` logical experts can be routed this way (``top_k`` of them, in
        ``num_groups`` equal groups, ``topk_groups`` of which hold at least ``top_k``)."""
        if self.top_k > num_experts:
            raise ValueError(f"RouterConfig.top_k={self.top_k} is larger than num_experts={num_experts}")
        if num_experts % self.num_groups:
            raise ValueError(f"num_experts={num_experts} is not divisible by RouterConfig.num_groups={self.num_groups}")
        if self.topk_groups is not None and self.topk_groups * (num_experts // self.num_groups) < self.top_k:
            raise ValueError(
                f"RouterConfig.topk_groups={self.topk_groups} groups of {num_experts // self.num_groups} experts "
                f"hold fewer than top_k={self.top_k}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class DispatchConfig:
    """How a layer runs its token path (see ``moe_apply``).

    Attributes:
      matmul: the grouped matmul of the float expert MLP, a name in ``moe.grouped_matmul.IMPLEMENTATIONS``
        (``"auto"``, the default: the GPU kernels with gradients on a GPU, the exact, placement-invariant
        ``"dense"`` elsewhere; ``"pallas"``, ``"triton"``, ``"mosaic"``, ``"ragged_dot"``).
      map_implementation: ``map_and_count``'s implementation (``"xla"``, ``"pallas"``; ``None``: its default).
      quant_impl, activation_scaling: quantized experts: ``"auto"`` runs them ragged through
        ``moe.quantized_matmul`` (the kernel reading packed weights on a GPU), another ``quant.IMPLS`` name runs
        ``quant.expert_mlp`` with it densely; dynamic activation scales cover the real rows, max-reduced over the
        EP axis, so they do not depend on the placement.
      capacity_factor: ``None`` exchanges the worst-case buffer in one ``all_to_all`` (``[G, A, D]`` per rank,
        ``A``: a rank's assignments); a factor ``f`` exchanges and computes the rows in rounds of
        ``C = ceil(f * A / G)`` rows per rank pair, as many as the fullest pair needs (one when balanced and
        ``f >= 1``): buffers of ``[A, D]`` and ``[G, C, D]``, still dropless, same results.
      one_round_rows: with a ``capacity_factor``, a rank whose worst case is at most this many rows (``G * A``;
        4096 by default, decode batches) exchanges it in one round all the same: no loop of rounds, whose trip
        count XLA's GPU runtime reads on the host, a wait for the device in every layer of every step. ``0``:
        rounds at every size.
      load_reduce: ``"none"``: each rank returns its own counts, ``load [G, P]`` sharded over EP (no collective
        over EP in the step; summed when read); ``"psum"``: ``load [P]`` summed every pass, replicated.
      shared_expert: where the shared expert runs: ``"local"`` (each rank its own tokens, padding included) or
        ``"waterfill"`` (valid tokens moved to the ranks with slack above the routed load; same outputs for valid
        tokens, zero for padding).
      batch_axes: the mesh axes that shard tokens besides the EP axis (``None``: every other axis of the mesh;
        a string names one).
    """

    matmul: str = "auto"
    map_implementation: str | None = None
    quant_impl: str = "auto"
    activation_scaling: str = "dynamic"
    capacity_factor: float | None = None
    one_round_rows: int = 4096
    load_reduce: str = "none"
    shared_expert: str = "local"
    batch_axes: tuple[str, ...] | None = None

    def __post_init__(self):
        try:
            grouped_matmul.get(self.matmul)
        except ValueError as e:
            raise ValueError(f"DispatchConfig.matmul: {e}") from None
        if self.map_implementation is not None and self.map_implementation not in MAP_AND_COUNT_IMPLEMENTATIONS:
            raise ValueError(
                f"DispatchConfig.map_implementation must be one of {MAP_AND_COUNT_IMPLEMENTATIONS} or None, got "
                f"{self.map_implementation!r}"
            )
        _check_choice("DispatchConfig.quant_impl", self.quant_impl, QUANT_IMPLS)
        _check_choice("DispatchConfig.activation_scaling", self.activation_scaling, ACTIVATION_SCALINGS)
        factor = self.capacity_factor
        if factor is not None and (
            isinstance(factor, bool)
            or not isinstance(factor, (int, float))
            or not (math.isfinite(factor) and factor > 0)
        ):
            raise ValueError(f"DispatchConfig.capacity_factor must be positive and finite or None, got {factor!r}")
        _check_int("DispatchConfig.one_round_rows", self.one_round_rows, minimum=0)
        _check_choice("DispatchConfig.load_reduce", self.load_reduce, LOAD_REDUCTIONS)
        _check_choice("DispatchConfig.shared_expert", self.shared_expert, SHARED_EXPERTS)
        if self.batch_axes is not None:
            axes = (self.batch_axes,) if isinstance(self.batch_axes, str) else tuple(self.batch_axes)
            if not all(isinstance(name, str) for name in axes) or len(set(axes)) != len(axes):
                raise ValueError(f"DispatchConfig.batch_axes must name distinct mesh axes, got {self.batch_axes!r}")
            object.__setattr__(self, "batch_axes", axes)

    def token_axes(self, mesh, axis: str) -> tuple[str, ...]:
        """The mesh axes sharding tokens besides the EP axis ``axis`` (``batch_axes``, or every other axis)."""
        if axis not in mesh.shape:
            raise ValueError(f"mesh has no axis {axis!r}; its axes are {tuple(mesh.shape)}")
        if self.batch_axes is None:
            return tuple(name for name in mesh.axis_names if name != axis)
        for name in self.batch_axes:
            if name not in mesh.shape or name == axis:
                raise ValueError(
                    f"DispatchConfig.batch_axes must name mesh axes other than {axis!r}; mesh axes {tuple(mesh.shape)}"
                )
        return self.batch_axes

    def capacity(self, num_assign: int, num_ranks: int) -> int | None:
        """Rows per rank pair and exchange round for ``num_assign`` assignments per rank (``None``: one round)."""
        if self.capacity_factor is None or num_ranks * num_assign <= self.one_round_rows:
            return None
        per_pair = -(-int(np.ceil(self.capacity_factor * num_assign)) // num_ranks)
        return int(min(num_assign, max(1, per_pair)))


def axes_size(mesh, axes) -> int:
    """The number of devices along ``axes`` of ``mesh`` together (1 for none)."""
    return int(np.prod([mesh.shape[name] for name in axes], dtype=np.int64))


def _check_int(name: str, value, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not minimum <= value <= INT32_MAX:
        bound = f">= {minimum}" if isinstance(value, int | np.integer) and value < minimum else "up to 2**31 - 1"
        raise ValueError(f"{name} must be an integer {bound}, got {show(value)}")


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {show(value)}")

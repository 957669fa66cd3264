"""``MoECausalLM``: a decoder-only MoE language model whose MoE layers EPLB balances as they are.

Token embedding -> ``num_layers`` blocks of (RMSNorm, attention with RoPE --
grouped-query or DeepSeek's multi-head latent attention, ``config.attention``
-- RMSNorm, MLP) -> RMSNorm -> output projection. The blocks
``config.dense_blocks`` have a dense SwiGLU MLP, the rest a
``moe_eplb_jax.flax.MoELayer`` (routed experts in ``P`` physical slots over the
EP mesh axis, plus the shared expert), so ``EplbController(model, ...)`` finds
and balances every MoE layer without glue. Attribute names follow the Hugging
Face checkpoints (``embed_tokens``, ``layers[i].self_attn.q_proj``, ...).

Shapes: ``tokens [B, T]`` int32 sharded over the EP axis by batch (``B * T``
divisible by the EP size ``G``); ``valid [B, T]`` bool marks real tokens
(``False``: padding, never routed to an expert, never counted as load, never
attended to). A token's position is the number of real tokens before it in
its row, so left padding and a KV cache give the same positions as the
unpadded sequence.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from moe_eplb_jax.flax import MoELayer
from moe_eplb_jax.models.attention import CausalPrefix, attention_module
from moe_eplb_jax.models.config import ModelConfig
from moe_eplb_jax.models.layers import DenseMLP, RMSNorm, attention_mask, dot_f32, embed, replicated_param
from moe_eplb_jax.moe import DispatchConfig

__all__ = ["DecoderBlock", "KVCache", "MoECausalLM"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """A preallocated attention cache of every block for ``B`` sequences of up to ``S`` positions.

    Attributes:
      layers: per block, its attention's cache arrays in the model dtype, batch
        first (sharded over the EP axis): grouped-query attention ``(keys,
        values)``, each ``[B, K, S, Dh]``; MLA ``(latent,)``,
        ``[B, S, kv_lora_rank + qk_rope_head_dim]``.
      valid: ``[B, S]`` bool, positions that hold a real token (padding and unwritten positions: ``False``).
      index: ``[]`` int32, the next position written (the same for every row: prompts are left-padded).
    """

    layers: tuple[tuple[jax.Array, ...], ...]
    valid: jax.Array
    index: jax.Array

    @property
    def max_len(self) -> int:
        return int(self.valid.shape[1])


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _empty_cache(shapes, dtype, valid_shape, rows, replicated) -> KVCache:
    """The zero cache as one program, compiled once per shape: called eagerly, one dispatch rather than one per
    array; inside a jitted step (the prefill), no dispatch of its own."""

    def zeros(shape, element_type, sharding):
        return jax.lax.with_sharding_constraint(jnp.zeros(shape, element_type), sharding)

    layers = tuple(tuple(zeros(shape, dtype, rows) for shape in block) for block in shapes)
    return KVCache(layers, zeros(valid_shape, jnp.bool_, rows), zeros((), jnp.int32, replicated))


class DecoderBlock(nnx.Module):
    """``x + attn(norm(x))`` then ``+ mlp(norm(x))``; ``mlp`` is a ``DenseMLP`` or an EP ``MoELayer``."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        moe: bool,
        mesh,
        axis: str,
        num_physical: int,
        routing: str,
        dispatch: DispatchConfig,
        rngs,
    ):
        dtype = config.jnp_dtype
        self.input_layernorm = RMSNorm(config.dim, eps=config.rms_eps, dtype=dtype, mesh=mesh)
        self.self_attn = attention_module(config, mesh=mesh, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.dim, eps=config.rms_eps, dtype=dtype, mesh=mesh)
        if moe:
            self.mlp = MoELayer(
                config.dim,
                config.moe_hidden,
                config.num_experts,
                config.router,
                mesh=mesh,
                axis=axis,
                num_physical=num_physical,
                shared_hidden=config.shared_hidden,
                dtype=dtype,
                routing=routing,
                dispatch=dispatch,
                rngs=rngs,
            )
        else:
            self.mlp = DenseMLP(config.dim, config.dense_hidden, dtype=dtype, mesh=mesh, rngs=rngs)

    def __call__(self, x, positions, mask, *, valid, record, cache=None, cache_index: jax.Array | int = 0):
        """-> ``(x, cache)``; see ``models.attention`` for the cache."""
        h, cache = self.self_attn(self.input_layernorm(x), positions, mask, cache, cache_index)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x), valid=valid, record=record), cache


def _run_block(block: DecoderBlock, x, positions, mask, valid, record):
    return block(x, positions, mask, valid=valid, record=record)[0]


# Training memory: keeps each block's input, recomputes the block (attention and MoE) in the backward pass.
_run_block_remat = nnx.remat(_run_block)


class MoECausalLM(nnx.Module):
    """The decoder (see the module docstring).

    Args:
      config: the architecture (``ModelConfig`` or a preset from ``models.preset``).
      mesh: the device mesh; ``axis`` is its EP axis (``G`` ranks): expert
        slots and the batch are sharded over it, everything else replicated.
      num_redundant_experts: ``R``, redundant slots per MoE layer
        (``P = E + R``, divisible by ``G``); ``EplbConfig.num_redundant_experts``
        must match.
      routing: every MoE layer's replica routing mode (``MoELayer(routing=)``).
      dispatch: how every MoE layer runs (``moe.DispatchConfig``: grouped
        matmul, ``map_and_count`` implementation, exchange capacity, load
        layout, shared-expert placement), so one config builds the model
        with any kernel. The router is ``config.router``.
      remat: recompute each decoder block (attention and MoE) in the backward
        pass instead of keeping its activations (training memory: one block's
        activations plus each block's input).
      rngs: ``nnx.Rngs`` for the initial weights (``models.load_checkpoint``
        replaces them).

    Replicas start as copies of their expert (slot ``p`` holds expert ``p mod E``).
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        mesh: jax.sharding.Mesh,
        axis: str = "ep",
        num_redundant_experts: int = 0,
        routing: str = "hash",
        dispatch: DispatchConfig = DispatchConfig(),
        remat: bool = False,
        rngs: nnx.Rngs,
    ):
        if not isinstance(config, ModelConfig):
            raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}")
        if axis not in mesh.shape:
            raise ValueError(f"mesh has no axis {axis!r}; its axes are {tuple(mesh.shape)}")
        r = num_redundant_experts
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 0:
            raise ValueError(f"num_redundant_experts must be a non-negative integer, got {r!r}")
        num_physical = config.num_experts + int(r)
        if num_physical % mesh.shape[axis]:
            raise ValueError(
                f"num_redundant_experts={r}: P = E + R = {config.num_experts} + {r} = {num_physical} slots are not "
                f"divisible by the EP size {mesh.shape[axis]} of mesh axis {axis!r}"
            )
        if not isinstance(remat, bool):
            raise ValueError(f"remat must be a bool, got {remat!r}")
        self.config, self.mesh, self.axis, self.remat = config, mesh, axis, remat
        dtype = config.jnp_dtype
        self.embed_tokens = replicated_param(
            rngs, (config.vocab_size, config.dim), fan_in=config.dim, dtype=dtype, mesh=mesh
        )
        self.layers = nnx.List(
            [
                DecoderBlock(
                    config,
                    moe=i not in config.dense_blocks,
                    mesh=mesh,
                    axis=axis,
                    num_physical=num_physical,
                    routing=routing,
                    dispatch=dispatch,
                    rngs=rngs,
                )
                for i in range(config.num_layers)
            ]
        )
        self.norm = RMSNorm(config.dim, eps=config.rms_eps, dtype=dtype, mesh=mesh)
        if config.tie_embeddings:
            self.lm_head = None
        else:
            self.lm_head = replicated_param(
                rngs, (config.dim, config.vocab_size), fan_in=config.dim, dtype=dtype, mesh=mesh
            )

    # ------------------------------------------------------------ structure
    @property
    def moe_layers(self) -> list[MoELayer]:
        """The MoE layers in order (the ``L`` layers of a ``Placement``)."""
        return [block.mlp for block in self.layers if isinstance(block.mlp, MoELayer)]

    @property
    def num_physical(self) -> int:
        return self.moe_layers[0].num_physical

    @property
    def eplb_layer_ids(self) -> tuple[tuple[int, ...], int]:
        """``(block of each MoE layer, decoder blocks)``: where files of every block (SGLang's) hold each MoE row."""
        return tuple(self.config.moe_blocks), self.config.num_layers

    # -------------------------------------------------------------- forward
    def __call__(self, tokens, *, valid=None, record=True):
        """``tokens [B, T]`` -> logits ``[B, T, vocab]`` float32 (causal; no cache: training, full recompute).

        ``valid [B, T]`` bool (default all ``True``) marks real tokens;
        ``record`` (a Python or traced bool) counts this pass's expert load.
        """
        # No padding: plain causal attention (the fused GPU kernel's fast case), no mask array.
        mask = None if valid is None else attention_mask(self._check_tokens(tokens, valid), 0, tokens.shape[1])
        valid = self._check_tokens(tokens, valid)
        positions = jnp.maximum(jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1, 0)
        x = self._embed(tokens)
        run = _run_block_remat if self.remat else _run_block
        for block in self.layers:
            x = run(block, x, positions, mask, valid, jnp.asarray(record))
        return self._logits(x)

    def call_cached(self, tokens, cache: KVCache, *, valid=None, record=True):
        """Appends ``tokens [B, T]`` to ``cache``; returns ``(logits of the last position [B, vocab], new cache)``.

        Prefill (``T`` = the left-padded prompt width, empty cache) and decode
        (``T = 1``) are the same call. The new tokens go to positions
        ``[cache.index, cache.index + T)`` of every row; ``valid`` marks the
        real ones (a finished request's decode token is padding). Fixed shapes:
        one compilation per ``(B, T, S)``. ``cache.index + T`` must not exceed
        ``S``: the index is traced, so this is the caller's to keep
        (``generate`` sizes the cache for it).
        """
        if not isinstance(cache, KVCache):
            raise ValueError(f"cache must be a KVCache, got {type(cache).__name__}")
        valid = self._check_tokens(tokens, valid)
        if cache.valid.shape[0] != tokens.shape[0] or len(cache.layers) != len(self.layers):
            raise ValueError(
                f"cache holds {cache.valid.shape[0]} sequences of {len(cache.layers)} blocks; tokens have "
                f"{tokens.shape[0]} sequences and the model {len(self.layers)} blocks"
            )
        if tokens.shape[1] > cache.max_len:
            raise ValueError(f"{tokens.shape[1]} tokens do not fit a cache of {cache.max_len} positions")
        seen = cache.valid.sum(axis=1, dtype=jnp.int32)[:, None]
        positions = jnp.maximum(seen + jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1, 0)
        kv_valid = jax.lax.dynamic_update_slice(cache.valid, valid, (0, cache.index))
        mask = attention_mask(kv_valid, cache.index, tokens.shape[1])
        x = self._embed(tokens)
        layers = []
        for block, state in zip(self.layers, cache.layers):
            x, state = block(x, positions, mask, valid=valid, record=record, cache=state, cache_index=cache.index)
            layers.append(tuple(state))
        new = KVCache(tuple(layers), kv_valid, cache.index + tokens.shape[1])
        return self._logits(x[:, -1:])[:, 0], new

    def prefill(self, tokens, lengths, *, max_len: int, record=True):
        """The prompts' pass into a new cache -> ``(logits of each row's last prompt token [B, vocab], cache)``.

        ``tokens [B, T]`` are right-padded: row ``b`` holds its prompt in its
        first ``lengths[b]`` positions (``[B]`` int32, 0 for an empty row); the
        cache has ``max_len >= T`` positions, the prompts at ``[0, T)`` and the
        next token at ``T`` for every row. The same values as ``call_cached`` on
        an empty cache with those tokens marked valid, but each query attends to
        the new keys through a ``CausalPrefix``: cuDNN's fused kernel skips the
        blocks above the diagonal and past each prompt instead of reading a
        ``[B, T, S]`` mask over the whole cache.
        """
        batch, width = tokens.shape
        if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
            raise ValueError(f"lengths must be an integer [{batch}] array, got shape {lengths.shape} {lengths.dtype}")
        if width > max_len:
            raise ValueError(f"{width} tokens do not fit a cache of {max_len} positions")
        lengths = lengths.astype(jnp.int32)
        valid = self._check_tokens(tokens, jnp.arange(width, dtype=jnp.int32)[None, :] < lengths[:, None])
        cache = self.init_cache(batch, max_len)
        positions = jnp.minimum(jnp.arange(width, dtype=jnp.int32)[None, :], jnp.maximum(lengths - 1, 0)[:, None])
        mask = CausalPrefix(lengths)
        x = self._embed(tokens)
        layers = []
        for block, state in zip(self.layers, cache.layers):
            x, state = block(x, positions, mask, valid=valid, record=record, cache=state, cache_index=0)
            layers.append(tuple(state))
        kv_valid = jax.lax.dynamic_update_slice(cache.valid, valid, (0, 0))
        last = jnp.take_along_axis(x, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)
        return self._logits(last)[:, 0], KVCache(tuple(layers), kv_valid, cache.index + width)

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty cache for ``batch`` sequences (divisible by ``G``) of up to ``max_len`` positions, on the mesh."""
        g = self.mesh.shape[self.axis]
        if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1 or batch % g:
            raise ValueError(f"batch must be a positive multiple of the EP size {g}, got {batch!r}")
        if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len < 1:
            raise ValueError(f"max_len must be a positive integer, got {max_len!r}")
        if max_len > self.config.max_seq_len:
            raise ValueError(f"max_len={max_len} exceeds the model's max_seq_len={self.config.max_seq_len}")
        shapes = tuple(block.self_attn.cache_shapes(int(batch), int(max_len)) for block in self.layers)
        rows = NamedSharding(self.mesh, PS(self.axis))
        return _empty_cache(
            shapes, self.config.jnp_dtype, (int(batch), int(max_len)), rows, NamedSharding(self.mesh, PS())
        )

    # -------------------------------------------------------------- helpers
    def _check_tokens(self, tokens, valid):
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must be an integer [B, T] array, got shape {tokens.shape} dtype {tokens.dtype}")
        g = self.mesh.shape[self.axis]
        if tokens.shape[0] % g:
            raise ValueError(f"batch {tokens.shape[0]} is not divisible by the EP size {g}")
        if valid is None:
            return jnp.ones(tokens.shape, jnp.bool_)
        if tuple(valid.shape) != tuple(tokens.shape) or valid.dtype != jnp.bool_:
            raise ValueError(f"valid must be a bool array of shape {tokens.shape}, got {valid.shape} {valid.dtype}")
        return valid

    def _embed(self, tokens):
        return embed(self.embed_tokens.get_value(), tokens)

    def _logits(self, x):
        x = self.norm(x)
        if self.lm_head is None:
            head = self.embed_tokens.get_value().T
        else:
            head = self.lm_head.get_value()
        return dot_f32(x, head)

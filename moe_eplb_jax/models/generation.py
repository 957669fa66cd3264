"""Batched generation with a preallocated KV cache: a right-padded prefill, then on-device loops of decode passes.

    result = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=32, sampling=Sampling(temperature=0.7, top_p=0.9),
                      tokens_per_call=8, controller=controller)

Prompts of different lengths are padded to one width ``W``. The prefill runs
them right-padded, each from position 0, so its attention is causal over each
prompt (``MoECausalLM.prefill``: cuDNN skips what the mask hides); decode pass
``n`` then writes cache position ``W + n`` for every row (one
``dynamic_update_slice``, no per-row scatter). Padding is marked invalid: it is never attended to, never routed to an
expert and never counted as expert load; a request that produced ``eos_id``
turns into padding too. The batch is padded with empty rows to a multiple of
the EP size, and to two rows per rank at least. Prefill and decode are jitted once per shape; the cache is
donated, so each step updates it in place. A decode call runs
``tokens_per_call`` passes in a ``fori_loop`` on the device, so the host
dispatches once per call. With a ``controller`` every pass is still one step
of its load window (closed on the device, after the call's loop) and the
controller decides and moves between calls -- nothing recompiles (but a
shorter last call), the tables are model variables.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import weakref
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from moe_eplb_jax.control import close_steps, step_loads
from moe_eplb_jax.flax import EplbController, ExpertLoad, find_moe_layers
from moe_eplb_jax.models.model import MoECausalLM
from moe_eplb_jax.transport.mesh import put_host

__all__ = ["Generation", "Sampling", "generate", "left_pad", "sample"]


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is picked from the logits.

    Attributes:
      temperature: 0 (default): greedy (argmax); else logits are divided by it and sampled.
      top_k: keep only the ``top_k`` most likely tokens (0: all).
      top_p: keep the smallest set of most likely tokens whose probability reaches ``top_p`` (1.0: all).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t >= 0):
            raise ValueError(f"Sampling.temperature must be a finite number >= 0, got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"Sampling.top_k must be an integer >= 0, got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"Sampling.top_p must be in (0, 1], got {p!r}")


@dataclasses.dataclass(frozen=True)
class Generation:
    """What ``generate`` returns (host arrays, one row per prompt).

    Attributes:
      tokens: ``[N, max_new_tokens]`` int32; after a request's ``eos_id`` (kept) the row holds ``pad_id``.
      num_generated: ``[N]`` tokens generated per request, its ``eos_id`` included.
      prefill_seconds: wall time of the prefill pass (until its tokens were ready).
      decode_seconds: wall time of the decode steps after it, ``on_step`` included.
    """

    tokens: np.ndarray
    num_generated: np.ndarray
    prefill_seconds: float
    decode_seconds: float


def sample(logits, key, sampling: Sampling):
    """Next tokens ``[B]`` int32 from ``logits [B, V]`` (``key`` unused when greedy)."""
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / jnp.float32(sampling.temperature)
    floor = jnp.float32(-jnp.inf)
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, floor, logits)
    if sampling.top_p < 1:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked above each one
        keep = jnp.maximum((before < jnp.float32(sampling.top_p)).sum(-1, keepdims=True), 1)
        cutoff = jnp.take_along_axis(ordered, keep - 1, axis=-1)
        logits = jnp.where(logits < cutoff, floor, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def left_pad(prompts: Sequence[Sequence[int]], *, width: int | None = None, batch_multiple: int = 1, pad_id: int = 0):
    """Host ``(tokens [B, width] int32, lengths [B] int32)``: prompts right-aligned, ``B`` rounded up to ``batch_multiple``.

    Rows added for the multiple are empty (length 0). ``width`` defaults to
    the longest prompt.
    """
    rows = [np.asarray(p) for p in prompts]
    if not rows:
        raise ValueError("prompts is empty")
    for i, row in enumerate(rows):
        if row.ndim != 1 or row.size == 0 or not np.issubdtype(row.dtype, np.integer):
            raise ValueError(f"prompt {i} must be a non-empty sequence of integer token ids, got {row!r}")
    longest = max(row.size for row in rows)
    width = longest if width is None else width
    if isinstance(width, bool) or not isinstance(width, (int, np.integer)) or width < longest:
        raise ValueError(f"width must be an integer >= the longest prompt ({longest}), got {width!r}")
    batch = -(-len(rows) // batch_multiple) * batch_multiple
    tokens = np.full((batch, int(width)), pad_id, np.int32)
    lengths = np.zeros(batch, np.int32)
    for i, row in enumerate(rows):
        tokens[i, width - row.size :] = row
        lengths[i] = row.size
    return tokens, lengths


def generate(
    model: MoECausalLM,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    seed: int = 0,
    eos_id: int | None = None,
    pad_id: int = 0,
    prompt_width: int | None = None,
    use_cache: bool = True,
    record: bool = True,
    tokens_per_call: int | None = None,
    controller: EplbController | None = None,
    on_step: Callable[[int], object] | None = None,
) -> Generation:
    """Generates ``max_new_tokens`` tokens for each prompt (see the module docstring).

    Args:
      model: the model; its MoE layers add each pass's load (``record``).
      prompts: ``N`` token sequences, each non-empty, ids in ``[0, vocab)``.
      max_new_tokens: tokens per request (a finished request pads the rest).
      sampling: greedy (default) or sampled decoding; ``seed`` seeds it.
      eos_id: a request ends after producing it (``None``: never ends early).
      pad_id: the id written into padding.
      prompt_width: the padded prompt width (default: the longest prompt);
        fix it to reuse one compilation across batches of different prompts.
      use_cache: ``False`` runs the whole sequence again for every token
        (no KV cache): the reference the cache must match, and the baseline
        of its speed-up.
      record: count the expert load of every pass.
      tokens_per_call: decode passes per host round trip, run in one
        on-device loop: the host dispatches once per ``tokens_per_call``
        tokens and the GPU does not wait for it in between. The tokens are
        the same whatever the value. ``None``: 16, or 1 with ``on_step``
        (the host every token). The loop's length is compiled in, so a
        shorter last call (``max_new_tokens - 1`` not a multiple) compiles once more.
      controller: the model's ``EplbController``: every pass's load goes
        into its window (on the device, inside the loop), and its step runs
        between calls -- a rearrangement due partway through a call happens
        at its end. Pass it here rather than calling ``controller.step()``
        from ``on_step``. With ``record=False`` it counts nothing, and the
        call compiles the same programs (a warm-up).
      on_step: called on the host after the prefill and after each decode
        call with the number of tokens generated so far.
    """
    if not isinstance(model, MoECausalLM):
        raise ValueError(f"model must be a MoECausalLM, got {type(model).__name__}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not isinstance(sampling, Sampling):
        raise ValueError(f"sampling must be a Sampling, got {type(sampling).__name__}")
    if tokens_per_call is None:
        # Enough passes to hide the host's dispatch behind the device's work; a rearrangement due partway through a
        # call waits at most this many steps, for the call's end.
        tokens_per_call = 1 if on_step is not None else 16
    if isinstance(tokens_per_call, bool) or not isinstance(tokens_per_call, (int, np.integer)) or tokens_per_call < 1:
        raise ValueError(f"tokens_per_call must be a positive integer or None, got {tokens_per_call!r}")
    _check_controller(controller, model)
    vocab = model.config.vocab_size
    for name, value in (("eos_id", eos_id), ("pad_id", pad_id)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
            raise ValueError(f"{name} must be an integer token id, got {value!r}")
        if value is not None and not 0 <= value < vocab:
            raise ValueError(f"{name}={value} is outside the vocabulary [0, {vocab})")
    ranks = model.mesh.shape[model.axis]
    # At least two rows per rank: XLA rewrites a one-row matmul as a multiply and a reduction that write and
    # reread a weight-sized product, several times the bytes of the weights' read that bounds decode.
    multiple = 2 * ranks if len(prompts) <= ranks else ranks
    tokens, lengths = left_pad(prompts, width=prompt_width, batch_multiple=multiple, pad_id=pad_id)
    if tokens.min() < 0 or tokens.max() >= vocab:
        raise ValueError(f"prompt token ids must be in [0, {vocab}), got ids in [{tokens.min()}, {tokens.max()}]")
    width = tokens.shape[1]
    total = width + int(max_new_tokens)
    if total - 1 > model.config.max_seq_len:
        raise ValueError(
            f"prompt width {width} + max_new_tokens {max_new_tokens} - 1 exceeds max_seq_len={model.config.max_seq_len}"
        )
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    rows = PS(model.axis)
    step = functools.partial(_step_callback, on_step)
    start = time.perf_counter()
    # Every scalar the programs read, traced (a new eos or pad id does not recompile) and sent once: a host
    # scalar passed to each call would be a transfer per call, which waits for the device.
    scalars = put_host(_scalars(seed, eos_id, pad_id, record, width), model.mesh)
    if use_cache:
        prefill = _compiled(_prefill, model, ("window",))
        window, dummy = controller.device_window() if controller is not None else (None, None)
        # The prefill runs right-padded (each prompt from position 0): its attention is causal over each prompt.
        out, active, cache, key, counter, window = prefill(
            put_host(tokens, model.mesh, rows),
            put_host(lengths, model.mesh, rows),
            scalars,
            window,
            dummy,
            max_len=total - 1,
            sampling=sampling,
        )
        decode = _compiled(_decode_loop, model, ("cache", "window"))  # looked up while the prefill runs
        generated = [jax.block_until_ready(out)]
        prefill_seconds = time.perf_counter() - start
        if controller is not None:
            controller.steps_closed(window, 1 if record else 0)
        step(1)
        done = 1
        while done < max_new_tokens:
            count = min(int(tokens_per_call), max_new_tokens - done)
            window, dummy = controller.device_window() if controller is not None else (None, None)
            block, out, active, cache, counter, window = decode(
                out, active, cache, key, counter, scalars, window, dummy, sampling=sampling, count=count
            )
            generated.append(block)
            done += count
            if controller is not None:
                controller.steps_closed(window, count if record else 0)
            step(done)
    else:
        valid = np.arange(width)[None, :] >= (width - lengths)[:, None]
        recompute = _compiled(_recompute, model, ("buffer", "valid"))
        key, counter = None, put_host(np.int32(0), model.mesh)
        buffer = np.concatenate([tokens, np.full((tokens.shape[0], max_new_tokens), pad_id, np.int32)], axis=1)
        buffer_valid = np.concatenate([valid, np.zeros((tokens.shape[0], max_new_tokens), bool)], axis=1)
        buffer, buffer_valid = put_host(buffer, model.mesh, rows), put_host(buffer_valid, model.mesh, rows)
        active = put_host(lengths > 0, model.mesh, PS())
        generated, prefill_seconds = [], 0.0
        for n in range(max_new_tokens):
            out, active, buffer, buffer_valid, counter = recompute(
                buffer, buffer_valid, active, counter, scalars, sampling=sampling
            )
            generated.append(out)
            if n == 0:
                jax.block_until_ready(out)
                prefill_seconds = time.perf_counter() - start
            if controller is not None and record:
                controller.step()
            step(n + 1)
    # Joined on the host: a device concatenate would be one more dispatch (and program) per shape.
    result = np.concatenate([np.reshape(part, (-1, part.shape[-1])) for part in jax.device_get(generated)]).T
    decode_seconds = time.perf_counter() - start - prefill_seconds
    count = len(prompts)
    num_generated = np.full(result.shape[0], max_new_tokens, np.int32)
    if eos_id is not None:
        hits = result == eos_id
        num_generated = np.where(hits.any(axis=1), hits.argmax(axis=1) + 1, max_new_tokens).astype(np.int32)
    return Generation(result[:count], num_generated[:count], prefill_seconds, decode_seconds)


def _compiled(step, model: MoECausalLM, donate: tuple[str, ...]):
    """``step`` jitted with ``model`` bound: its variables are inputs, read afresh at every call (a rearrangement's
    weights and tables between steps), and only those the step changes (the expert loads) are outputs -- the
    weights are never copied to outputs -- with ``donate`` given to the step (the KV cache is updated in place).

    One wrapper (one compilation) per model, step and set of variable objects: a model whose variables were
    replaced (``quantize``) gets a new one.
    """
    leaves, structure = jax.tree.flatten(model, is_leaf=lambda x: isinstance(x, nnx.Variable))
    key = (step, structure, tuple(map(id, leaves)))
    compiled = _COMPILED.setdefault(model, {})
    if key not in compiled:
        static = {_decode_loop: ("sampling", "count"), _prefill: ("sampling", "max_len")}.get(step, ("sampling",))
        compiled[key] = nnx.jit_partial(step, model, static_argnames=static, donate_argnames=donate, graph=False)
    return compiled[key]


# The jitted steps of each live model (a cache, not a setting): built once, so generate never recompiles.
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _step_callback(on_step, n):
    if on_step is not None:
        on_step(n)


def _scalars(seed: int, eos_id: int | None, pad_id: int, record: bool, width: int) -> np.ndarray:
    """``[5]`` int32: the seed's low 32 bits (what ``jax.random.key`` keeps of it), the eos id (-1: none, matching
    no token), the pad id, whether to record, the prompt width."""
    fields = [int(seed) & 0xFFFFFFFF, -1 if eos_id is None else eos_id, pad_id, int(bool(record)), width]
    return np.array(fields, np.int64).astype(np.int32)


def _unpack(scalars):
    """``(key, eos_id, pad_id, record, width)`` from ``_scalars``' array, inside a program."""
    return jax.random.key(scalars[0]), scalars[1], scalars[2], scalars[3] > 0, scalars[4]


def _next(logits, active, key, counter, *, mesh, sampling, eos_id, pad_id):
    """Picks the next tokens; rows no longer active get ``pad_id``; returns replicated ``(tokens, active)``."""
    picked = jnp.where(active, sample(logits, jax.random.fold_in(key, counter), sampling), pad_id)
    active = active & (picked != eos_id)
    replicated = NamedSharding(mesh, PS())  # readable on every process
    return jax.lax.with_sharding_constraint(picked, replicated), jax.lax.with_sharding_constraint(active, replicated)


def _prefill(model, tokens, lengths, scalars, window, dummy, *, max_len, sampling):
    """The prompts' pass -> ``(tokens, active, cache, key, counter, window)``. ``tokens`` come left-padded (as
    ``left_pad`` makes them) and run right-padded, each row turned here, inside the program; the KV cache of
    ``max_len`` positions and the sampling key are made here too, rather than by dispatches of their own."""
    key, eos_id, pad_id, record, _ = _unpack(scalars)
    counter = jnp.int32(0)  # the step index, carried on the device: it folds into the sampling key
    width = tokens.shape[1]
    turned = (jnp.arange(width, dtype=jnp.int32)[None, :] - lengths[:, None]) % jnp.int32(width)
    tokens = jnp.take_along_axis(tokens, turned, axis=1)  # right-padded: each prompt from position 0
    logits, cache = model.prefill(tokens, lengths, max_len=max_len, record=record)
    active = jax.lax.with_sharding_constraint(lengths > 0, NamedSharding(model.mesh, PS()))
    picked, active = _next(
        logits, active, key, counter, mesh=model.mesh, sampling=sampling, eos_id=eos_id, pad_id=pad_id
    )
    return picked, active, cache, key, counter + 1, _close_window_step(model, window, dummy, record)


def _decode(model, token, active, cache, key, counter, record, *, sampling, eos_id, pad_id):
    rows = NamedSharding(model.mesh, PS(model.axis))
    token = jax.lax.with_sharding_constraint(token, rows)[:, None]
    valid = jax.lax.with_sharding_constraint(active, rows)[:, None]
    logits, cache = model.call_cached(token, cache, valid=valid, record=record)
    picked, active = _next(
        logits, active, key, counter, mesh=model.mesh, sampling=sampling, eos_id=eos_id, pad_id=pad_id
    )
    return picked, active, cache, counter + 1


def _decode_loop(model, token, active, cache, key, counter, scalars, window, dummy, *, count, sampling):
    """``count`` decode passes in one on-device loop -> ``([count, B] tokens, token, active, cache, counter,
    window)``.

    ``count`` is static: XLA's GPU runtime waits for the device before every pass of a loop whose trip count it
    does not know (it reads the condition on the host), so the host could not queue the next pass's kernels
    while the GPU runs this one. A shorter last call compiles once more.

    Without a ``window`` the expert loads are carried between passes and add up in the model, as in single passes
    (the weights are read in place). With one (an ``EplbState``) each pass starts from zero loads -- constants, not
    carried: no pass reads or clears a load variable -- and its loads become one row of a ``[count, L, G, P]``
    block, the loads held before the loop joining the first; after the loop the rows close ``count`` steps of the
    window at once (one write, not a window update per pass) and the load variables are zero.
    """
    _, eos_id, pad_id, record, _ = _unpack(scalars)
    graphdef, loads, rest = nnx.split(model, ExpertLoad, ...)

    def one_pass(i, carry):
        token, active, cache, counter, carried, rows, block = carry
        # Made inside the pass: variables the pass changes must belong to its trace.
        start = jax.tree.map(jnp.zeros_like, loads) if window is not None else carried
        stepped = nnx.merge(graphdef, start, rest)
        token, active, cache, counter = _decode(
            stepped, token, active, cache, key, counter, record, sampling=sampling, eos_id=eos_id, pad_id=pad_id
        )
        if window is not None:
            rows = jax.lax.dynamic_update_index_in_dim(rows, _take_loads(stepped, window), i, axis=0)
        else:
            carried = nnx.state(stepped, ExpertLoad)
        block = jax.lax.dynamic_update_index_in_dim(block, token, i, axis=0)
        return token, active, cache, counter, carried, rows, block

    block = jnp.zeros((count, *token.shape), token.dtype)
    rows = None if window is None else jnp.zeros((count, *window.pass_load.shape), jnp.int32)
    carry = (token, active, cache, counter, None if window is not None else loads, rows, block)
    token, active, cache, counter, carried, rows, block = jax.lax.fori_loop(0, count, one_pass, carry)
    if window is None:
        nnx.update(model, carried)
    else:
        nnx.update(model, loads)
        rows = rows.at[0].add(_take_loads(model, window))  # what the variables held before the loop; now zero
        window = _close_window_steps(window, rows, dummy, record)
    # Laid out as the prefill hands them over: the next call then reuses this compilation.
    block, token, active = jax.lax.with_sharding_constraint((block, token, active), NamedSharding(model.mesh, PS()))
    return block, token, active, cache, counter, window


def _take_loads(model, window):
    """The pass's loads as one ``[L, G, P]`` window row; every load variable restarts from zero."""
    variables = [ref.module.eplb_load_variable() for ref in find_moe_layers(model)]
    loads = [variable.get_value() for variable in variables]
    for variable, load in zip(variables, loads):
        variable.set_value(jnp.zeros_like(load))
    return step_loads(window, loads)


def _close_window_step(model, window, dummy, record):
    """With a ``window`` (an ``EplbState``): the pass's loads close one of its steps and every load variable
    restarts from zero (see :func:`_close_window_steps`)."""
    if window is None:
        return None
    return _close_window_steps(window, _take_loads(model, window)[None], dummy, record)


def _close_window_steps(window, rows, dummy, record):
    """``rows [n, L, G, P]`` close ``n`` steps of ``window``. Unrecorded passes leave the window as it was -- the
    same program, so an unrecorded warm-up call compiles what recording calls run.

    Selects rather than ``lax.cond``: XLA's GPU runtime reads a conditional's predicate on the host, a wait for
    the device. An unrecorded call rewrites the window's rows with themselves (dummy steps) and keeps the old
    counters."""
    closed = close_steps(window, rows, dummy=jnp.logical_or(dummy, jnp.logical_not(record)))
    counters = jax.tree.map(lambda new, old: jnp.where(record, new, old), closed, window)
    return dataclasses.replace(counters, window=closed.window)  # no select over the whole window


def _check_controller(controller, model) -> None:
    """``ValueError`` unless ``controller`` is ``None`` or the ``EplbController`` of ``model``'s MoE layers."""
    if controller is None:
        return
    if not isinstance(controller, EplbController):
        raise ValueError(f"controller must be an EplbController, got {type(controller).__name__}")
    if {id(ref.module) for ref in controller.layers} != {id(ref.module) for ref in find_moe_layers(model)}:
        raise ValueError("controller must be the EplbController of this model (its MoE layers are another model's)")


def _recompute(model, buffer, valid, active, counter, scalars, *, sampling):
    """One token by running the whole buffer (no cache); writes it at position ``width + counter``."""
    key, eos_id, pad_id, record, width = _unpack(scalars)
    position = width + counter
    logits = model(buffer, valid=valid, record=record)
    last = jax.lax.dynamic_index_in_dim(logits, position - 1, axis=1, keepdims=False)
    picked, new_active = _next(
        last, active, key, counter, mesh=model.mesh, sampling=sampling, eos_id=eos_id, pad_id=pad_id
    )
    rows = NamedSharding(model.mesh, PS(model.axis))
    column = jax.lax.with_sharding_constraint(picked, rows)[:, None]
    buffer = jax.lax.dynamic_update_slice(buffer, column, (0, position))
    written = jax.lax.with_sharding_constraint(active & new_active, rows)[:, None]
    valid = jax.lax.dynamic_update_slice(valid, written, (0, position))
    return picked, new_active, buffer, valid, counter + 1

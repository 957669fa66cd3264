"""Serving the MoE decoder: KV-cache decoding equals full recompute, EPLB records and rearranges mid-decode,
a rearranged model equals the model loaded from the permuted checkpoint; sampling; bad input."""

import _models_reference as reference
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import ep_mesh, tiny_model
from flax import nnx

from moe_eplb_jax.config import EplbConfig
from moe_eplb_jax.flax import EplbController
from moe_eplb_jax.models import Sampling, generate, left_pad, load_checkpoint, preset, sample
from moe_eplb_jax.moe import DispatchConfig

G, R = 4, 4
pytestmark = pytest.mark.devices(G)  # skipped on fewer devices, where MESH is None
MESH = ep_mesh(G)
# DeepSeek-V3 routing, with a score-correction bias from the checkpoint skewing the traffic.
CONFIG = preset("tiny", scoring="sigmoid", num_groups=4, topk_groups=2, routed_scaling_factor=2.5)
NEW = 6


def _model(seed=0):
    return tiny_model(CONFIG, MESH, redundant=R, seed=seed)


def _prompts(rng, lengths=(5, 11, 1, 8)):
    return [rng.integers(0, CONFIG.vocab_size, n) for n in lengths]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    path = tmp_path_factory.mktemp("ckpt") / "model.safetensors"
    safetensors_numpy.save_file(reference.random_tensors(CONFIG, np.random.default_rng(7)), str(path))
    return path


@pytest.mark.slow
def test_cached_decoding_equals_full_recompute(rng):
    model = _model()
    prompts = _prompts(rng)
    cached = generate(model, prompts, max_new_tokens=NEW, prompt_width=12)
    again = generate(model, prompts, max_new_tokens=NEW, prompt_width=12, use_cache=False)
    assert cached.tokens.shape == (len(prompts), NEW)
    assert np.array_equal(cached.tokens, again.tokens)


def test_serve_record_rearrange_equals_permuted_checkpoint(checkpoint, rng):
    """Checkpoint -> serve with EPLB recording -> rearrange between decode steps -> outputs of the permuted load."""
    model = _model(1)
    load_checkpoint(model, checkpoint)
    config = EplbConfig(num_redundant_experts=R, num_gpus=G, window_size=64, step_interval=10**6)
    controller = EplbController(model, MESH, config)
    prompts = _prompts(rng)
    lengths = [len(p) for p in prompts]
    first = generate(model, prompts, max_new_tokens=NEW, prompt_width=12, on_step=lambda n: controller.step())
    # Padding never counts: per layer, k assignments for each prompt token and each decoded token fed back.
    window = controller.window_slot_load()
    assert np.all(window.sum(1) == CONFIG.top_k * (sum(lengths) + (NEW - 1) * len(prompts)))
    balancedness_before = controller.rearrange()["balancedness_before"]
    assert controller.num_rearrangements == 1

    def rearrange_midway(n):  # the caller rearranges between two decode steps
        controller.step()
        if n == 3:
            controller.rearrange()

    second = generate(model, prompts, max_new_tokens=NEW, prompt_width=12, on_step=rearrange_midway)
    assert controller.num_rearrangements == 2
    assert np.array_equal(second.tokens, first.tokens)  # moving experts never changes what the model says
    assert balancedness_before < 1.0
    permuted = _model(2)
    load_checkpoint(permuted, checkpoint, placement=controller.placement)
    assert np.any(controller.placement.phy2log != np.arange(CONFIG.num_experts + R) % CONFIG.num_experts)
    for ours, theirs in zip(model.moe_layers, permuted.moe_layers):
        for name in ("w_in", "w_out"):
            a, b = ours.eplb_expert_variables()[name].get_value(), theirs.eplb_expert_variables()[name].get_value()
            assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    third = generate(permuted, prompts, max_new_tokens=NEW, prompt_width=12)
    assert np.array_equal(third.tokens, first.tokens)
    tokens, lengths = left_pad(prompts, batch_multiple=G)
    valid = np.arange(tokens.shape[1])[None, :] >= (tokens.shape[1] - lengths)[:, None]
    forward = nnx.jit(lambda m, t, v: m(t, valid=v, record=False))
    assert np.array_equal(np.asarray(forward(model, tokens, valid)), np.asarray(forward(permuted, tokens, valid)))


@pytest.mark.slow
def test_sampling_and_eos(rng):
    model = _model(3)
    prompts = _prompts(rng, (4, 9, 2, 6))
    hot = Sampling(temperature=1.5)
    a = generate(model, prompts, max_new_tokens=NEW, sampling=hot, seed=5, prompt_width=12)
    b = generate(model, prompts, max_new_tokens=NEW, sampling=hot, seed=5, prompt_width=12)
    c = generate(model, prompts, max_new_tokens=NEW, sampling=hot, seed=6, prompt_width=12)
    assert np.array_equal(a.tokens, b.tokens) and not np.array_equal(a.tokens, c.tokens)
    eos = int(a.tokens[1, 2])  # some request produces it at step 3 (or earlier)
    ended = generate(model, prompts, max_new_tokens=NEW, sampling=hot, seed=5, eos_id=eos, pad_id=0, prompt_width=12)
    for row, full in zip(ended.tokens, a.tokens):
        hits = np.nonzero(full == eos)[0]
        stop = hits[0] + 1 if hits.size else NEW
        assert np.array_equal(row[:stop], full[:stop]) and np.all(row[stop:] == 0)
    assert ended.num_generated[1] <= 3 and np.all(ended.num_generated >= 1)


def test_sample_filters(rng):
    logits = jax.numpy.asarray(rng.standard_normal((64, 50)).astype(np.float32))
    key = jax.random.key(0)
    top = np.argsort(-np.asarray(logits), axis=1)
    picked = np.asarray(sample(logits, key, Sampling(temperature=1.0, top_k=3)))
    assert all(p in top[i, :3] for i, p in enumerate(picked))
    one = np.asarray(sample(logits, key, Sampling(temperature=1.0, top_p=1e-6)))
    assert np.array_equal(one, top[:, 0])
    assert np.array_equal(np.asarray(sample(logits, key, Sampling())), top[:, 0])
    probs = np.exp(np.asarray(logits))
    probs /= probs.sum(1, keepdims=True)
    ordered = np.take_along_axis(probs, top, 1)
    keep = ((np.cumsum(ordered, 1) - ordered) < 0.5).sum(1)
    picked = np.asarray(sample(logits, key, Sampling(temperature=1.0, top_p=0.5)))
    assert all(p in top[i, : keep[i]] for i, p in enumerate(picked))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 600}, "max_seq_len"),
        ({"prompt_width": 2}, "width must be"),
        ({"eos_id": 256}, "eos_id=256 is outside"),
        ({"prompts": []}, "prompts is empty"),
        ({"prompts": [[1, 2], []]}, "prompt 1"),
        ({"prompts": [[1, 999]]}, r"token ids must be in \[0, 256\)"),
        ({"tokens_per_call": 0}, "tokens_per_call must be a positive integer"),
        ({"tokens_per_call": 2.0}, "tokens_per_call must be a positive integer or None"),
        ({"controller": "step"}, "controller must be an EplbController"),
    ],
)
def test_generate_rejects_bad_input(kwargs, match):
    args = {"prompts": [[1, 2, 3]], "max_new_tokens": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        generate(_model(), args.pop("prompts"), **args)
    with pytest.raises(ValueError, match="Sampling.top_p"):
        Sampling(temperature=1.0, top_p=0.0)


def _window_fields(controller):
    state = controller.state
    return {name: np.asarray(getattr(state, name)) for name in ("pass_load", "window", "window_pos", "total_steps")}


@pytest.mark.slow  # about 50 s of compiles on 2 cores
def test_decode_loops_on_the_device_with_the_same_tokens_and_loads(rng):
    """Several passes per host call: the tokens of one pass per call, every pass a step of the controller's window
    (the same window, bit for bit, as ``controller.step()`` after each pass), and no recompilation per call."""
    prompts = _prompts(rng)
    config = EplbConfig(num_redundant_experts=R, num_gpus=G, window_size=16, step_interval=10**6, log_interval=4)
    model = _model(4)
    one_by_one = EplbController(model, MESH, config)
    want = generate(model, prompts, max_new_tokens=NEW + 3, prompt_width=12, on_step=lambda n: one_by_one.step())
    expected, expected_report = _window_fields(one_by_one), one_by_one.last_report
    assert expected_report["step"] == 8
    for tokens_per_call in (1, 4, 16):
        model = _model(4)
        controller = EplbController(model, MESH, config)
        got = generate(
            model,
            prompts,
            max_new_tokens=NEW + 3,
            prompt_width=12,
            tokens_per_call=tokens_per_call,
            controller=controller,
        )
        np.testing.assert_array_equal(got.tokens, want.tokens)
        assert controller.total_steps == NEW + 3  # the prefill and every decode pass
        for name, value in _window_fields(controller).items():
            np.testing.assert_array_equal(value, expected[name], err_msg=name)
        assert controller.state.window.sharding == one_by_one.state.window.sharding
        assert all(not np.asarray(layer.expert_load.get_value()).any() for layer in model.moe_layers)
        report = controller.last_report
        assert report is not None and report["step"] == 8
        assert report["balancedness"] == pytest.approx(expected_report["balancedness"])
    # Without a controller the loads add up in the model, as one pass per call does.
    plain, looped = _model(4), _model(4)
    generate(plain, prompts, max_new_tokens=NEW, prompt_width=12, tokens_per_call=1)
    generate(looped, prompts, max_new_tokens=NEW, prompt_width=12, tokens_per_call=3)
    for a, b in zip(plain.moe_layers, looped.moe_layers):
        np.testing.assert_array_equal(np.asarray(a.expert_load.get_value()), np.asarray(b.expert_load.get_value()))


def test_generate_loops_16_passes_per_call_unless_on_step_wants_the_host_every_token(rng, monkeypatch):
    """The default ``tokens_per_call``: 16 decode passes per host call (a shorter last one), and one per call with
    ``on_step``, which is then called after every token."""
    from moe_eplb_jax.models import generation

    counts, compiled = [], generation._compiled

    def counting(step, model, donate):
        run = compiled(step, model, donate)
        if step is not generation._decode_loop:
            return run
        return lambda *args, **kwargs: counts.append(kwargs["count"]) or run(*args, **kwargs)

    monkeypatch.setattr(generation, "_compiled", counting)
    model, prompts = _model(), _prompts(rng)
    default = generate(model, prompts, max_new_tokens=20, prompt_width=12)
    assert counts == [16, 3]
    counts.clear()
    steps = []
    stepped = generate(model, prompts, max_new_tokens=20, prompt_width=12, on_step=steps.append)
    assert counts == [1] * 19 and steps == list(range(1, 21))
    np.testing.assert_array_equal(default.tokens, stepped.tokens)


def _primitives(jaxpr, found=None):
    """Every primitive of ``jaxpr`` and the jaxprs inside it, a Pallas kernel's body excluded."""
    found = set() if found is None else found
    for eqn in jaxpr.eqns:
        found.add(eqn.primitive.name)
        if eqn.primitive.name == "pallas_call":
            continue
        for param in eqn.params.values():
            for inner in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    _primitives(inner, found)
    return found


def _programs_run(fn) -> dict[str, int]:
    """``{XLA module name: executions}`` of every program ``fn()`` ran, from a profiler trace."""
    import collections
    import glob
    import tempfile

    from jax.profiler import ProfileData

    for array in jax.live_arrays():  # nothing an earlier test left running ends inside the trace
        array.block_until_ready()
    directory = tempfile.mkdtemp(prefix="programs_")
    with jax.profiler.trace(directory):
        fn()
    runs = set()
    for path in glob.glob(f"{directory}/**/*.xplane.pb", recursive=True):
        for plane in ProfileData.from_file(path).planes:
            for line in plane.lines:
                for event in line.events:
                    stats = {name: value for name, value in event.stats}
                    if "hlo_module" in stats and "run_id" in stats:
                        runs.add((stats["hlo_module"], stats["run_id"]))
    return dict(collections.Counter(module for module, _ in runs))


@pytest.mark.filterwarnings("ignore:builtin type event_stats has no __module__")  # the profiler's C types
def test_generate_runs_one_program_per_host_call(rng):
    """Before the prefill's program, no programs of their own: the KV cache is made inside it and the ids and
    counters go in as host scalars (each a dispatch before the first kernel otherwise); the tokens are joined on
    the host. Besides the key's seeding, the prefill and the decode loops."""
    model = _model()
    run = lambda: generate(model, _prompts(rng), max_new_tokens=9, tokens_per_call=4)
    run()
    programs = _programs_run(run)
    assert programs.pop("jit__prefill") == 1 and programs.pop("jit__decode_loop") >= 2, programs
    assert sum(programs.values()) <= 2, programs  # the key from the seed (and a scalar staged for it)


def test_generate_compiles_its_prefill_and_its_decode_loop_once(rng):
    """Over several ranks the decode loop hands its token and flags back laid out as the prefill does: its
    second call reuses the first call's compilation (XLA compiles per input layout)."""
    import collections

    compiled = collections.Counter()

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled[kwargs.get("fun_name")] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        generate(_model(), _prompts(rng), max_new_tokens=13, tokens_per_call=4)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiled["jit(_prefill)"] == 1 and compiled["jit(_decode_loop)"] == 1, dict(compiled)


@pytest.mark.parametrize(
    "use_cache, controlled, placed",
    [(True, False, 3), (True, True, 3), (False, False, 5)],
    ids=["cached", "controller", "recompute"],
)
def test_generate_sends_host_values_once_before_its_first_program(rng, monkeypatch, use_cache, controlled, placed):
    """No call takes a host scalar (an implicit transfer per call, which waits for the device on a GPU): the
    prompts and one array of scalars are placed before the first program, however many calls follow, the
    controller's steps included."""
    from moe_eplb_jax.models import generation

    model, prompts = _model(), _prompts(rng)
    config = EplbConfig(num_redundant_experts=R, num_gpus=G, window_size=8, step_interval=10**6)
    controller = EplbController(model, MESH, config) if controlled else None
    kwargs = dict(max_new_tokens=7, tokens_per_call=2, eos_id=3, seed=7, use_cache=use_cache, controller=controller)
    want = generate(model, prompts, **kwargs)
    placements, place = [], generation.put_host

    def put_host(value, *args):  # the one way in, counted
        placements.append(value)
        with jax.transfer_guard_host_to_device("allow"):
            return place(value, *args)

    monkeypatch.setattr(generation, "put_host", put_host)
    with jax.transfer_guard_host_to_device("disallow"):
        got = generate(model, prompts, **kwargs)
    assert np.array_equal(got.tokens, want.tokens)
    assert len(placements) == placed, [np.shape(p) for p in placements]


@pytest.mark.parametrize("ranks, capacity_factor", [(1, None), (G, 1.25)])
def test_the_decode_loop_never_waits_for_the_device_on_the_host(ranks, capacity_factor):
    """XLA's GPU runtime reads a ``while`` condition of unknown trip count and a ``cond`` predicate on the host,
    a wait for the device in every pass: the decode loop (the controller stepping every pass) has a static trip
    count and no conditional, also over several ranks with a capacity factor (a decode batch's exchange fits
    ``DispatchConfig.one_round_rows``: no loop of rounds)."""
    from moe_eplb_jax.models import generation

    mesh = ep_mesh(ranks)
    model = tiny_model(CONFIG, mesh, redundant=R, dispatch=DispatchConfig(capacity_factor=capacity_factor))
    config = EplbConfig(num_redundant_experts=R, num_gpus=ranks, window_size=8)
    controller = EplbController(model, mesh, config)
    window, dummy = controller.device_window()
    graphdef, variables = nnx.split(model)

    def loop(variables, token, active, cache, window):
        return generation._decode_loop(
            nnx.merge(graphdef, variables),
            token,
            active,
            cache,
            jax.random.key(0),
            jnp.int32(0),
            jnp.asarray(generation._scalars(0, None, 0, True, 8)),
            window,
            dummy,
            count=3,
            sampling=Sampling(),
        )

    token, active = jnp.zeros(2 * ranks, jnp.int32), jnp.ones(2 * ranks, bool)
    jaxpr = jax.make_jaxpr(loop)(variables, token, active, model.init_cache(2 * ranks, 8), window).jaxpr
    found = _primitives(jaxpr)
    assert "cond" not in found and "while" not in found, sorted(found)
    assert [eqn.params["length"] for eqn in jaxpr.eqns if eqn.primitive.name == "scan"] == [3]


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_the_decode_loop_joins_each_layers_projection_weights_once_per_call(attention):
    """A decode step projects q, k and v (MLA: the query's first projection and the latent's) with one product of
    the weights side by side; XLA joins the weights before the loop (they do not change in it), not in every pass:
    no join of their shape in the loop's body."""
    import re

    from moe_eplb_jax.models import generation

    c = CONFIG if attention == "gqa" else preset("deepseek_v3_tiny")
    model = tiny_model(c, ep_mesh(1))
    graphdef, variables = nnx.split(model)

    def loop(variables, token, active, cache):
        return generation._decode_loop(
            nnx.merge(graphdef, variables), token, active, cache, jax.random.key(0), jnp.int32(0),
            jnp.asarray(generation._scalars(0, None, 0, True, 8)), None, None, count=3, sampling=Sampling(),
        )  # fmt: skip

    token, active = jnp.zeros(2, jnp.int32), jnp.ones(2, bool)
    text = jax.jit(loop).lower(variables, token, active, model.init_cache(2, 8)).compile().as_text()
    if attention == "gqa":
        width = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    else:
        width = c.q_lora_rank + c.kv_lora_rank + c.qk_rope_head_dim
    joined = f"[{c.dim},{width}]"
    computations = re.split(r"\n(?=\S)", text)
    entry = [body for body in computations if body.startswith("ENTRY")]
    assert len(entry) == 1 and "while(" in entry[0]
    joining = [body for body in computations for line in body.splitlines() if joined in line and "concatenate(" in line]
    assert len(joining) == len(model.layers), joining
    for body in joining:  # the entry computation itself, or a fusion only it calls
        name = body.split(" ", 1)[0]
        callers = [other for other in computations if f"calls={name}," in other or f"calls={name}\n" in other]
        assert body is entry[0] or callers == entry, name


@pytest.mark.slow
def test_a_rearrangement_due_inside_a_loop_happens_at_its_end(rng):
    prompts = _prompts(rng)
    model = _model(5)
    want = generate(model, prompts, max_new_tokens=NEW + 4, prompt_width=12).tokens
    config = EplbConfig(num_redundant_experts=R, num_gpus=G, window_size=16, step_interval=5)
    controller = EplbController(model, MESH, config)
    calls = []
    got = generate(
        model,
        prompts,
        max_new_tokens=NEW + 4,
        prompt_width=12,
        tokens_per_call=3,
        controller=controller,
        on_step=lambda n: calls.append((n, controller.num_rearrangements)),
    )
    np.testing.assert_array_equal(got.tokens, want)  # moving experts never changes what the model says
    assert [n for n, _ in calls] == [1, 4, 7, 10]
    assert controller.num_rearrangements >= 1 and controller.total_steps == NEW + 4
    assert [r for _, r in calls] == sorted(r for _, r in calls)
    with pytest.raises(ValueError, match="another model's"):
        generate(_model(), prompts, max_new_tokens=2, controller=controller)
    with pytest.raises(ValueError, match="num_steps must be an integer >= 0"):
        controller.steps_closed(controller.state, -1)
    # Unrecorded, the controller counts nothing and its window stays as it was.
    before = _window_fields(controller)
    generate(model, prompts, max_new_tokens=5, prompt_width=12, tokens_per_call=3, controller=controller, record=False)
    for name, value in _window_fields(controller).items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)

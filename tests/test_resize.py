"""Moves between EP sizes on 8 CPU devices: each move equals loading the permuted checkpoint on the new mesh."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from _bytes import random_bytes
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from test_transport import float_ops

from moe_eplb_jax import policy
from moe_eplb_jax import transport as eps
from moe_eplb_jax.transport import _resize_executor, resize
from moe_eplb_jax.transport.packing import byte_rows_numpy, leaf_layout

pytestmark = pytest.mark.devices(8)

# fp4 pairs, e8m0 scales, fp8 (e5m2 NaN payloads), bf16 (subnormals), f32, and integers
MIXED = [
    ml_dtypes.float4_e2m1fn,
    ml_dtypes.float8_e8m0fnu,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
    ml_dtypes.bfloat16,
    np.float32,
    np.int8,
]


def checkpoint(rng, layers, experts, dtypes=MIXED, row=(2, 4)):
    """``{name: [L, E, *row]}``: random bytes (special values often) per (layer, logical expert)."""
    return {np.dtype(d).name: random_bytes(rng, d, (layers, experts) + row) for d in dtypes}


def load(ckpt, phy2log):
    """The arrays a placement loads from the checkpoint: ``[L, P, ...]`` (``[P, ...]`` for a ``[P]`` table)."""
    table = np.atleast_2d(phy2log)
    out = {k: v[np.arange(table.shape[0])[:, None], table] for k, v in ckpt.items()}
    return out if np.ndim(phy2log) == 2 else {k: v[0] for k, v in out.items()}


def random_placement(rng, layers, experts, slots):
    extra = rng.integers(0, experts, slots - experts)
    return np.stack([rng.permutation(np.concatenate([np.arange(experts), extra])) for _ in range(layers)])


def assert_equals_checkpoint(moved, ckpt, phy2log, new_mesh):
    num_lead = np.ndim(phy2log)
    for k, want in load(ckpt, phy2log).items():
        leaf = moved[k]
        assert leaf.dtype == want.dtype and leaf.shape == want.shape, k
        assert list(leaf.sharding.mesh.devices.flat) == list(new_mesh.devices.flat), k
        assert leaf.sharding.spec[num_lead - 1] == "ep", k
        np.testing.assert_array_equal(byte_rows_numpy(np.asarray(leaf), num_lead), byte_rows_numpy(want, num_lead), k)


def mesh_on(devices):
    return eps.ep_mesh(len(devices), devices=devices)


# ------------------------------------------------------------------ contract
@st.composite
def resizes(draw):
    """Old and new EP groups on the 8 devices (overlapping or not), sizes, tables, lost ranks."""
    num_ranks = draw(st.integers(1, 8))
    old_devices = draw(st.permutations(range(8)))[:num_ranks]
    lost = draw(st.sets(st.sampled_from(old_devices), max_size=min(2, num_ranks - 1)))
    pool = [d for d in range(8) if d not in lost]
    new_num_ranks = draw(st.integers(1, len(pool)))
    new_devices = draw(st.permutations(pool))[:new_num_ranks]
    layered = draw(st.booleans())
    experts = draw(st.integers(1, 12))
    per_rank, new_per_rank = -(-experts // num_ranks), -(-experts // new_num_ranks)
    slots = num_ranks * draw(st.integers(per_rank, 2 * per_rank + 1))
    new_slots = new_num_ranks * draw(st.integers(new_per_rank, 2 * new_per_rank + 1))
    seed = draw(st.integers(0, 2**31 - 1))
    row = draw(st.sampled_from([(2, 4), (2, 3)]))  # word rows / odd bytes
    lost_ranks = sorted(old_devices.index(d) for d in lost)
    return old_devices, new_devices, lost_ranks, layered, experts, slots, new_slots, seed, row


def check_resize(case, dtypes=MIXED, with_scalar=True, padding=0):
    old_devices, new_devices, lost, layered, experts, slots, new_slots, seed, row = case
    rng = np.random.default_rng(seed)
    layers = 2 if layered else 1
    ckpt = checkpoint(rng, layers, experts, dtypes=dtypes, row=row)
    old, new = random_placement(rng, layers, experts, slots), random_placement(rng, layers, experts, new_slots)
    if not layered:
        old, new = old[0], new[0]
    devices = jax.devices()
    mesh, new_mesh = mesh_on([devices[d] for d in old_devices]), mesh_on([devices[d] for d in new_devices])
    tree = eps.shard_slots(load(ckpt, old), mesh, layered=layered)
    if with_scalar:
        tree["count"] = eps.put_host(np.int32(seed % 1000), mesh)
    missing = eps.missing_experts(old, len(old_devices), new, lost_ranks=lost)
    rows = ckpt if layered else {k: v[0] for k, v in ckpt.items()}  # [L, E, ...] / one layer's [E, ...]
    reload = eps.reload_from(dict(rows, count=0) if with_scalar else rows, layered=layered) if missing.size else None
    options = dict(mesh=mesh, new_mesh=new_mesh, lost_ranks=lost)
    plan = eps.plan_for_meshes(old, new, reload=reload is not None, **options)
    if padding:  # wider tables (a resize pads every layer's plan to the widest): the same move
        plan = plan.padded(*(c + padding for c in plan.capacities))
    del options["lost_ranks"]
    moved = eps.execute_resize(tree, plan, reload=reload, **options)
    assert_equals_checkpoint({k: v for k, v in moved.items() if k != "count"}, ckpt, new, new_mesh)
    if with_scalar:
        assert int(moved["count"]) == seed % 1000
        assert moved["count"].sharding.is_equivalent_to(NamedSharding(new_mesh, PartitionSpec()), 0)
    for k, leaf in tree.items():  # the input is untouched
        assert not leaf.is_deleted(), k


@settings(max_examples=6)
@given(resizes())
def test_resize_equals_the_permuted_checkpoint_on_the_new_mesh(case):
    """Any old and new group (overlapping, disjoint, a subset), lost ranks, every dtype's special values."""
    check_resize(case)


@settings(max_examples=3)
@given(resizes(), st.integers(1, 5))
def test_a_padded_plan_moves_the_same(case, padding):
    check_resize(case, padding=padding)


@pytest.mark.slow
@settings(max_examples=12)
@given(resizes())
def test_resize_equals_the_permuted_checkpoint_many_draws(case):
    check_resize(case, dtypes=MIXED + [np.float16, np.bool_, np.int32, np.uint8])


def test_no_float_op_touches_expert_bytes(rng):
    """The compiled executor sees the leaves' float dtypes in its parameters and bitcasts only (a bf16 0-d leaf
    too: it is broadcast as uint16)."""
    ckpt = checkpoint(rng, 2, 8, dtypes=MIXED[:-1], row=(2, 3))
    old, new = random_placement(rng, 2, 8, 8), random_placement(rng, 2, 8, 12)
    devices = jax.devices()
    mesh, new_mesh = mesh_on(devices[:4]), mesh_on(devices[2:5])
    tree = eps.shard_slots(load(ckpt, old), mesh, layered=True)
    plan = eps.plan_for_meshes(old, new, mesh=mesh, new_mesh=new_mesh)
    union = eps.union_mesh(plan, mesh, new_mesh)
    assert [d.id for d in union.devices.flat] == [0, 1, 2, 3, 4]  # survivors, then the device new to the group
    local = list(enumerate(union.devices.flat))
    leaves = [tree[k] for k in sorted(tree)]
    layouts = [leaf_layout(leaf.dtype, leaf.shape[2:]) for leaf in leaves]
    scalar = resize._scalar_on_union(jnp.bfloat16(1), np.asarray(ml_dtypes.bfloat16(1e-40)), union, local)
    run, tables = _resize_executor.build(
        plan, layouts, [PartitionSpec(None, "ep")] * len(leaves), [scalar.dtype], union, "ep", False
    )
    old_arrays = [resize._on_union(leaf, plan, union, "ep", local) for leaf in leaves]
    ops = float_ops(run.lower(tables, old_arrays, [], [scalar]).compile().as_text())
    assert ops <= {"parameter", "bitcast-convert", "bitcast", "tuple", "get-tuple-element"} and "bitcast-convert" in ops
    moved, (value,) = run(tables, old_arrays, [], [scalar])
    assert np.asarray(value).view(np.uint16) == np.asarray(ml_dtypes.bfloat16(1e-40)).view(np.uint16) != 0
    moved = {k: resize._on_new_mesh(leaf, new_mesh, plan, "ep") for k, leaf in zip(sorted(tree), moved)}
    assert_equals_checkpoint(moved, ckpt, new, new_mesh)


# ----------------------------------------------------------- scale events
def test_8_to_4_to_6_to_8_with_params_scales_and_adam_state(rng):
    """Quantized weights, their scales, bf16 and f32 parameters and the Adam state through 8 -> 4 -> 6 -> 8 ranks,
    each placement solved for the new size from the loads. Every move equals loading the permuted state on the
    new mesh, byte for byte, and the next optimizer step equals that model's."""
    layers, experts = 2, 12
    ckpt = checkpoint(rng, layers, experts, dtypes=[ml_dtypes.float4_e2m1fn, ml_dtypes.float8_e8m0fnu], row=(2, 8))
    ckpt["b"] = random_bytes(rng, ml_dtypes.bfloat16, (layers, experts, 4))
    w = rng.standard_normal((layers, experts, 4, 2)).astype(np.float32)
    weight = rng.lognormal(0, 1, (layers, experts))
    opt = optax.adam(1e-2)

    @jax.jit
    def step(params, state):  # per-slot terms only, so replicas of an expert stay equal
        grads = jax.grad(lambda p: jnp.sum(jnp.sin(p["w"]) * p["w"]))(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    devices = jax.devices()
    mesh, phy2log = mesh_on(devices), policy.get("balanced")(weight, 16, 1, 1, 8)[0]
    with jax.numpy_dtype_promotion("standard"):  # optax relies on implicit promotion
        params = {"w": eps.shard_slots(load({"w": w}, phy2log), mesh, layered=True)["w"]}
        params, state = step(params, opt.init(params))
        model = {"params": params, "opt": state, "quant": eps.shard_slots(load(ckpt, phy2log), mesh, layered=True)}
        for num_ranks, new_num_ranks, new_slots in ((8, 4, 16), (4, 6, 18), (6, 8, 16)):
            new = policy.resize_placement(
                weight, phy2log, num_ranks=num_ranks, new_num_ranks=new_num_ranks, new_num_physical=new_slots
            ).phy2log
            new_mesh = mesh_on(devices[:new_num_ranks])
            moved = eps.resize_experts(model, phy2log, new, mesh=mesh, new_mesh=new_mesh)
            expected = jax.tree.map(lambda x: _reloaded(x, phy2log, new, experts, new_mesh), model)
            for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(moved), jax.tree.leaves(expected)):
                assert a.shape == b.shape and a.dtype == b.dtype and a.sharding.is_equivalent_to(b.sharding, a.ndim)
                np.testing.assert_array_equal(
                    byte_rows_numpy(np.asarray(a), min(a.ndim, 2)),
                    byte_rows_numpy(np.asarray(b), min(b.ndim, 2)),
                    jax.tree_util.keystr(path),
                )
            ours, ref = step(moved["params"], moved["opt"]), step(expected["params"], expected["opt"])
            for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            model, mesh, phy2log = moved, new_mesh, new


def _reloaded(leaf, phy2log, new, experts, new_mesh):
    """``leaf [L, P, ...]`` saved as a logical checkpoint (each expert's replicas checked equal) and loaded for
    ``new`` on ``new_mesh``; a 0-d leaf replicated there."""
    host = np.asarray(leaf)
    if host.ndim == 0:
        return eps.put_host(host, new_mesh)
    rows = byte_rows_numpy(host, 2)
    logical = np.zeros((host.shape[0], experts) + host.shape[2:], host.dtype)
    for layer in range(host.shape[0]):
        for e in range(experts):
            (slots,) = np.nonzero(phy2log[layer] == e)
            assert all(np.array_equal(rows[layer, s], rows[layer, slots[0]]) for s in slots)
            logical[layer, e] = host[layer, slots[0]]
    return eps.shard_slots(load({"x": logical}, new)["x"], new_mesh, layered=True)


def test_8_to_7_moves_only_what_must_change(rng):
    """From 8 ranks to 7 (rank 7 leaves): the bytes moved are the rows of the new slots whose device did not hold
    their expert, each (device, layer, expert) once -- never more than the slots that change; with the "fill"
    placement only the leaving rank's experts move."""
    layers, experts, slots = 3, 48, 56  # 7 slots per rank on 8 ranks, 8 on 7
    ckpt = checkpoint(rng, layers, experts, dtypes=[ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn], row=(4,))
    weight = rng.lognormal(0, 1, (layers, experts))
    old = policy.get("balanced")(weight, slots, 1, 1, 8)[0]
    devices = jax.devices()
    mesh, new_mesh = mesh_on(devices[:8]), mesh_on(devices[:7])
    row_bytes = 4 * 2 + 4
    for name in ("fill", "balanced", "deepseek"):
        new = policy.resize_placement(weight, old, num_ranks=8, new_num_ranks=7, policy=name).phy2log
        plan = eps.plan_for_meshes(old, new, mesh=mesh, new_mesh=new_mesh)
        # what must change: new slots whose device did not hold that expert in that layer
        must = 0
        for layer in range(layers):
            for r in range(7):
                before = set(old[layer, r * 7 : (r + 1) * 7].tolist())
                must += len(set(new[layer, r * 8 : (r + 1) * 8].tolist()) - before)
        changed = sum(
            int(
                (
                    new[layer].reshape(7, 8)
                    != np.pad(old[layer, :49].reshape(7, 7), ((0, 0), (0, 1)), constant_values=-1)
                ).sum()
            )
            for layer in range(layers)
        )
        assert plan.rows_moved == must <= changed, name
        assert plan.rows_received.sum() == must
        if name == "fill":
            assert must <= layers * 7  # the leaving rank's 7 slots per layer at most
        tree = eps.shard_slots(load(ckpt, old), mesh, layered=True)
        moved = eps.execute_resize(tree, plan, mesh=mesh, new_mesh=new_mesh)
        assert_equals_checkpoint(moved, ckpt, new, new_mesh)
        assert plan.bytes_moved(row_bytes) == max(plan.rows_sent.max(), plan.rows_received.max()) * row_bytes


# ---------------------------------------------------------------- lost ranks
def test_a_lost_rank_recovers_from_surviving_replicas(rng):
    """Rank 2 of 4 is lost: every expert it held has a replica elsewhere, so 4 -> 3 needs no checkpoint."""
    layers, experts = 2, 6
    ckpt = checkpoint(rng, layers, experts)
    old = np.array([[0, 1, 2, 3, 4, 5, 4, 5], [5, 4, 3, 2, 1, 0, 1, 0]])  # rank 3 holds copies of rank 2's experts
    devices = jax.devices()
    mesh = mesh_on(devices[:4])
    new_mesh = mesh_on([devices[0], devices[1], devices[3]])
    weight = rng.lognormal(0, 1, (layers, experts))
    new = policy.resize_placement(
        weight, old, num_ranks=4, new_num_ranks=3, new_num_physical=9, lost_ranks=[2], new_rank_of_old=[0, 1, -1, 2]
    ).phy2log
    assert eps.missing_experts(old, 4, new, lost_ranks=[2]).size == 0
    tree = eps.shard_slots(load(ckpt, old), mesh, layered=True)
    plan = eps.plan_for_meshes(old, new, mesh=mesh, new_mesh=new_mesh, lost_ranks=[2])
    assert 2 not in plan.moves[:, 2] // 2  # nothing is read from the lost rank's slots
    assert_equals_checkpoint(
        eps.resize_experts(tree, old, new, mesh=mesh, new_mesh=new_mesh, lost_ranks=[2]), ckpt, new, new_mesh
    )


def test_an_expert_without_a_surviving_replica_is_a_clear_error_or_a_reload(rng):
    layers, experts = 2, 6
    ckpt = checkpoint(rng, layers, experts)
    old = np.array([[0, 1, 2, 3, 4, 5, 0, 1], [5, 4, 3, 2, 1, 0, 5, 4]])  # rank 2 alone holds 4, 5 / 1, 0
    new = np.array([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]])
    devices = jax.devices()
    mesh, new_mesh = mesh_on(devices[:4]), mesh_on([devices[0], devices[1], devices[3]])
    tree = eps.shard_slots(load(ckpt, old), mesh, layered=True)
    before = {k: byte_rows_numpy(np.asarray(v), 2) for k, v in tree.items()}
    with pytest.raises(
        ValueError,
        match=r"4 experts .* lost ranks \[2\]: \(layer 0, expert 4\), \(layer 0, expert 5\), "
        r"\(layer 1, expert 0\), \(layer 1, expert 1\)\. Pass reload=",
    ):
        eps.resize_experts(tree, old, new, mesh=mesh, new_mesh=new_mesh, lost_ranks=[2])
    for k, v in tree.items():  # nothing changed
        np.testing.assert_array_equal(byte_rows_numpy(np.asarray(v), 2), before[k])
    np.testing.assert_array_equal(eps.missing_experts(old, 4, new, lost_ranks=[2]), [[0, 4], [0, 5], [1, 0], [1, 1]])
    requests = []

    def reload(req):  # the way out: those experts' rows from the checkpoint
        requests.append(req.tolist())
        return eps.reload_from(ckpt)(req)

    moved = eps.resize_experts(tree, old, new, mesh=mesh, new_mesh=new_mesh, lost_ranks=[2], reload=reload)
    assert_equals_checkpoint(moved, ckpt, new, new_mesh)
    assert sorted(sum(requests, [])) == [[0, 4], [0, 5], [1, 0], [1, 1]]  # only what no survivor holds


def test_a_reload_that_gives_wrong_rows_changes_nothing(rng):
    ckpt = checkpoint(rng, 1, 4, dtypes=[ml_dtypes.bfloat16], row=(2,))
    old, new = np.array([[0, 1, 2, 3]]), np.array([[3, 2, 1, 0]])
    devices = jax.devices()
    mesh, new_mesh = mesh_on(devices[:2]), mesh_on(devices[:1])
    tree = eps.shard_slots(load(ckpt, old), mesh, layered=True)
    for bad, match in (
        (lambda req: {"bfloat16": np.zeros((len(req), 3), ml_dtypes.bfloat16)}, r"needs bfloat16\[2, 2\]"),
        (lambda req: {"bfloat16": np.zeros((len(req), 2), np.float32)}, "reload gave leaf 0 as float32"),
        (lambda req: {"other": 1}, "structure"),
        (lambda req: ckpt["bfloat16"][9], "reload failed"),
    ):
        with pytest.raises(ValueError, match=match):
            eps.resize_experts(tree, old, new, mesh=mesh, new_mesh=new_mesh, lost_ranks=[1], reload=bad)
    assert_equals_checkpoint(tree, ckpt, old, mesh)


# ------------------------------------------------------------------ bad input
def test_bad_input_raises_before_any_device_work(rng):
    ckpt = checkpoint(rng, 2, 4, dtypes=[ml_dtypes.bfloat16], row=(2,))
    old, new = random_placement(rng, 2, 4, 4), random_placement(rng, 2, 4, 6)
    devices = jax.devices()
    mesh, new_mesh = mesh_on(devices[:2]), mesh_on(devices[2:5])
    tree = eps.shard_slots(load(ckpt, old), mesh, layered=True)
    two_axes = Mesh(np.array(devices[:4]).reshape(2, 2), ("dp", "ep"))
    cases = [
        (dict(new_phy2log=new[:, :5]), "not divisible by 3 ranks"),
        (dict(new_phy2log=new[0]), r"must both be \[P\] or \[L, \*\]"),
        (dict(new_phy2log=new - 1), "is not an expert id"),
        (dict(new_mesh=two_axes), "only axis of size > 1"),
        (dict(axis="tp"), "no axis 'tp'"),
        (dict(lost_ranks=[5]), "lost_ranks entry must be <= 1"),
        (dict(new_mesh=mesh_on(devices[1:4]), lost_ranks=[1]), "old rank 1 is lost but"),
        (dict(experts={"x": eps.shard_slots(load(ckpt, old[:1]), mesh, layered=True)["bfloat16"]}), "slot axes"),
        (dict(experts={"x": jax.device_put(load(ckpt, old)["bfloat16"], devices[0])}), "NamedSharding on the old mesh"),
        (dict(reload=3), "reload must be callable"),
        (dict(num_logical=3), "outside the expert range"),
    ]
    for overrides, match in cases:
        kwargs = dict(experts=tree, old_phy2log=old, new_phy2log=new, mesh=mesh, new_mesh=new_mesh) | overrides
        with pytest.raises(ValueError, match=match):
            eps.resize_experts(**kwargs)
        assert_equals_checkpoint(tree, ckpt, old, mesh)
    bad_spec = jax.device_put(load(ckpt, old)["bfloat16"], NamedSharding(mesh, PartitionSpec(None, None, "ep")))
    with pytest.raises(ValueError, match="only the slot axis may be sharded"):
        eps.resize_experts({"x": bad_spec}, old, new, mesh=mesh, new_mesh=new_mesh)
    plan = eps.plan_for_meshes(old, new, mesh=mesh, new_mesh=new_mesh)
    with pytest.raises(ValueError, match="the plan is for 2 -> 3 ranks"):
        eps.execute_resize(tree, plan, mesh=mesh, new_mesh=mesh_on(devices[2:4]))
    with pytest.raises(ValueError, match="do not match the meshes' devices"):
        eps.execute_resize(tree, plan, mesh=mesh, new_mesh=mesh_on(devices[1:4]))


@st.composite
def sequences(draw):
    """A few scale events in a row: each a group of the 8 devices, a policy, maybe a lost rank."""
    steps = []
    for _ in range(draw(st.integers(2, 4))):
        size = draw(st.integers(1, 8))
        devices = sorted(draw(st.permutations(range(8)))[:size])
        lose = draw(st.booleans())
        steps.append((devices, draw(st.sampled_from(["fill", "balanced", "deepseek"])), lose))
    return steps, draw(st.integers(0, 2**31 - 1))


@pytest.mark.slow
@settings(max_examples=5)
@given(sequences())
def test_random_sequences_of_scale_events(case):
    """Random sizes, device groups, policies and lost ranks in a row, with a mixed-dtype pytree: after every
    move the experts equal the permuted checkpoint on the new mesh; experts only a lost rank held are reloaded."""
    steps, seed = case
    rng = np.random.default_rng(seed)
    layers, experts = 2, 8
    ckpt = checkpoint(rng, layers, experts, dtypes=MIXED + [np.float16], row=(2, 4))
    weight = rng.lognormal(0, 1, (layers, experts))
    all_devices = jax.devices()
    mesh = mesh_on(all_devices[:4])
    phy2log = policy.get("balanced")(weight, 12, 1, 1, 4)[0]
    tree = eps.shard_slots(load(ckpt, phy2log), mesh, layered=True)
    for devices, name, lose in steps:
        old_devices = [d.id for d in mesh.devices.flat]
        lost = [old_devices.index(d) for d in old_devices if d not in devices][:1] if lose else []
        new_mesh = mesh_on([all_devices[d] for d in devices])
        new_slots = len(devices) * -(-max(12, experts) // len(devices))
        new = policy.resize_placement(
            weight,
            phy2log,
            num_ranks=len(old_devices),
            new_num_ranks=len(devices),
            new_num_physical=new_slots,
            policy=name,
            new_rank_of_old=eps.new_rank_of_old(mesh, new_mesh),
            lost_ranks=lost,
        ).phy2log
        tree = eps.resize_experts(
            tree, phy2log, new, mesh=mesh, new_mesh=new_mesh, lost_ranks=lost, reload=eps.reload_from(ckpt)
        )
        assert_equals_checkpoint(tree, ckpt, new, new_mesh)
        mesh, phy2log = new_mesh, new

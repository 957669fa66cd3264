"""One test body for every grouped matmul (``moe_eplb_jax.moe.grouped_matmul``): values, gradients, padding, edges.

Each implementation is checked against a float64 numpy oracle on fresh random
inputs: empty groups, groups straddling kernel tiles, padding rows (which must
come out zero and pass nothing -- not even a NaN -- into real rows or
gradients), float32 and bfloat16. On CPU: ``dense``, ``ragged_dot`` and the
Triton kernels in Pallas' interpreter; on a GPU also the compiled Triton and
Mosaic GPU kernels and ``auto``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_eplb_jax.moe import grouped_matmul as gmm
from moe_eplb_jax.moe._gmm import mosaic

gpu = pytest.mark.gpu
CPU_IMPLEMENTATIONS = ["dense", "ragged_dot", "pallas_interpret"]
GPU_IMPLEMENTATIONS = [pytest.param(name, marks=gpu) for name in ("triton", "mosaic", "pallas", "auto")]
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def _sizes(rng, num_groups: int, num_rows: int, live: int):
    """``num_groups`` sizes summing to ``live <= num_rows``, one group empty, the rest random."""
    cuts = np.sort(rng.integers(0, live + 1, num_groups - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [live]])).astype(np.int32)
    empty = rng.integers(num_groups)
    sizes[(empty + 1) % num_groups] += sizes[empty]
    sizes[empty] = 0
    return sizes


def _case(rng, implementation: str, dtype):
    """Shapes the implementation takes: Mosaic tiles are 128 wide, Triton's interpreter is slow."""
    if implementation in ("mosaic", "pallas", "auto", "triton"):
        num_rows, depth, width, groups = 2560, 128, 256, 5  # >= 2048 rows: "pallas" picks Mosaic for bf16
    else:
        num_rows, depth, width, groups = 150, 32, 64, 4
    sizes = _sizes(rng, groups, num_rows, num_rows - 23)
    x = rng.standard_normal((num_rows, depth)).astype(np.float32)
    w = (rng.standard_normal((groups, depth, width)) / np.sqrt(depth)).astype(np.float32)
    x, w = np.asarray(jnp.asarray(x, dtype)), np.asarray(jnp.asarray(w, dtype))  # the values the kernels see
    return x, w, sizes


def _oracle(x, w, sizes):
    slot = np.repeat(np.arange(len(sizes)), sizes)
    live = len(slot)
    y = np.zeros((x.shape[0], w.shape[2]))
    y[:live] = np.einsum("nk,nkm->nm", x[:live].astype(np.float64), w[slot].astype(np.float64))
    return y


def _relative(got, want):
    return np.linalg.norm(np.asarray(got, np.float64) - want) / max(np.linalg.norm(want), 1e-30)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("implementation", CPU_IMPLEMENTATIONS + GPU_IMPLEMENTATIONS)
def test_values_and_gradients_match_float64(implementation, dtype, rng):
    if implementation == "mosaic" and dtype == jnp.float32:
        pytest.skip("the Mosaic GPU kernels take 16-bit floats only (pallas routes float32 to Triton)")
    x, w, sizes = _case(rng, implementation, dtype)
    live = int(sizes.sum())
    cot = rng.standard_normal((x.shape[0], w.shape[2])).astype(np.float32)
    f = jax.jit(lambda x, w, s: gmm.grouped_matmul(x, w, s, implementation=implementation))
    y = np.asarray(f(x, w, sizes))
    assert y.shape == (x.shape[0], w.shape[2])
    assert y.dtype == (np.float32 if implementation in ("dense", "ragged_dot") else x.dtype)
    y = y.astype(np.float32)
    assert _relative(y, _oracle(x, w, sizes)) < TOLERANCE[dtype]
    np.testing.assert_array_equal(y[live:], 0.0)  # padding rows come out zero

    loss = lambda x, w: jnp.sum(
        gmm.grouped_matmul(x, w, sizes, implementation=implementation).astype(jnp.float32) * cot
    )
    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype and dw.shape == w.shape
    slot = np.repeat(np.arange(len(sizes)), sizes)
    cot64 = cot.astype(np.float64)
    if dtype == jnp.bfloat16:  # the kernels cast the cotangent to the inputs' dtype
        cot64 = np.asarray(jnp.asarray(cot, dtype), np.float64)
    want_dx = np.zeros(x.shape)
    want_dx[:live] = np.einsum("nm,nkm->nk", cot64[:live], w[slot].astype(np.float64))
    xs, cs = x[:live].astype(np.float64), cot64[:live]
    want_dw = np.stack([xs[slot == s].T @ cs[slot == s] for s in range(len(sizes))])
    assert _relative(dx, want_dx) < TOLERANCE[dtype]
    assert _relative(dw, want_dw) < TOLERANCE[dtype]
    np.testing.assert_array_equal(np.asarray(dx, np.float32)[live:], 0.0)
    np.testing.assert_array_equal(np.asarray(dw, np.float32)[sizes == 0], 0.0)


@pytest.mark.parametrize("implementation", ["pallas_interpret", *GPU_IMPLEMENTATIONS[:3]])
def test_nan_in_padding_rows_reaches_nothing(implementation, rng):
    """Into the kernels, padding rows may hold anything (a previous kernel's unwritten rows): no real row and no
    gradient sees it. (``dense`` multiplies every row by every slot: its padding rows must be finite, as the MoE
    layer's are -- zeros.)"""
    dtype = jnp.bfloat16 if implementation == "mosaic" else jnp.float32
    x, w, sizes = _case(rng, implementation, dtype)
    live = int(sizes.sum())
    dirty = x.copy()
    dirty[live:] = np.nan
    cot = rng.standard_normal((x.shape[0], w.shape[2])).astype(np.float32)
    cot[live:] = np.inf

    def run(x):
        loss = lambda x, w: jnp.sum(
            gmm.grouped_matmul(x, w, sizes, implementation=implementation).astype(jnp.float32) * cot
        )
        y = gmm.grouped_matmul(x, w, sizes, implementation=implementation)
        return y, jax.grad(loss, argnums=(0, 1))(x, w)

    clean_y, (clean_dx, clean_dw) = jax.jit(run)(np.where(np.isnan(dirty), 0, dirty).astype(x.dtype))
    y, (dx, dw) = jax.jit(run)(dirty)
    y, clean_y = np.asarray(y, np.float32), np.asarray(clean_y, np.float32)
    np.testing.assert_array_equal(y[:live], clean_y[:live])
    np.testing.assert_array_equal(y[live:], 0.0)
    np.testing.assert_array_equal(np.asarray(dx, np.float32)[:live], np.asarray(clean_dx, np.float32)[:live])
    np.testing.assert_array_equal(np.asarray(dw, np.float32), np.asarray(clean_dw, np.float32))


def test_triton_tilings_in_interpret_mode(rng):
    """The Triton kernels under several tilings: tiles straddling groups, one row per group, a tail tile."""
    from moe_eplb_jax.moe._gmm import triton

    x = rng.standard_normal((150, 32)).astype(np.float32)
    w = rng.standard_normal((4, 32, 64)).astype(np.float32)
    dy = rng.standard_normal((150, 64)).astype(np.float32)
    for sizes in (np.array([10, 0, 70, 45], np.int32), np.array([1, 1, 1, 147], np.int32)):
        live = int(sizes.sum())
        for config in (triton.Config(block_k=16, block_cols=32), triton.Config(block_rows=16, block_k=32)):
            got = np.asarray(triton.grouped_matmul(x, w, sizes, config=config, interpret=True))
            assert _relative(got[:live], _oracle(x, w, sizes)[:live]) < 1e-5
            wt = np.swapaxes(w, 1, 2)  # [S, M, K]: the transposed product gives x @ wt[s]^T = x @ w[s]
            got_t = np.asarray(triton.grouped_matmul(x, wt, sizes, transpose_rhs=True, config=config, interpret=True))
            np.testing.assert_allclose(got_t[:live], got[:live], rtol=1e-5, atol=1e-5)
            dw = np.asarray(triton.transposed_grouped_matmul(x, dy, sizes, config=config, interpret=True))
            np.testing.assert_allclose(dw, np.asarray(gmm.transposed_dense(x, dy, sizes)), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="multiples"):
        triton.grouped_matmul(x[:, :24], w[:, :24], sizes, interpret=True)
    # What the kernels tile, both ways (the input gradient swaps K and M); "pallas" takes "dense" elsewhere.
    assert triton.supports(32, 64) and triton.supports(1024, 512) and triton.supports(16, 16)
    assert not triton.supports(24, 64) and not triton.supports(64, 8) and not triton.supports(96, 64)


def test_work_items_tile_each_group_from_its_first_row(rng):
    """Each group is ``cdiv(n, block_rows)`` items whose tiles start at its first row (its weights read that many
    times), items past the count are dead, and the grid has room for every item."""
    from moe_eplb_jax.moe._gmm import triton

    for _ in range(20):
        sizes = rng.integers(0, 40, size=int(rng.integers(1, 24))).astype(np.int32)
        sizes[rng.random(sizes.shape) < 0.3] = 0
        block_rows = int(rng.choice([16, 32, 64]))
        padded = triton.padded_sizes(jnp.asarray(sizes))
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        want = [(g, starts[g] + j * block_rows) for g in range(len(sizes)) for j in range(-(-sizes[g] // block_rows))]
        grid = triton.max_items(int(sizes.sum()), len(sizes), block_rows)
        assert grid >= len(want)
        got = []
        for item in range(grid):
            live, group, first_row, start, end = (int(v) for v in triton.work_item(padded, item, block_rows))
            if live:
                assert (start, end) == (starts[group], starts[group] + sizes[group])
                got.append((group, first_row))
        assert got == want


def test_triton_default_tiling_follows_rows_per_group(rng):
    """Fewer rows than groups (small-batch decode) take 16-row tiles with deep loads, 16 rows per group and more a
    third stage; the product stays exact."""
    from moe_eplb_jax.moe._gmm import triton

    decode = triton.Config(block_rows=16, block_k=256, block_cols=64, num_warps=4, num_stages=3)
    assert triton.default_config(8, 1024, 64) == triton.default_config(64, 1024, 64) == decode
    assert triton.default_config(256, 1024, 64) == triton.Config()
    assert triton.default_config(2048, 1024, 64) == triton.Config(num_stages=3)
    assert triton.default_config(65536, 1024, 64).block_rows == 128
    x = rng.standard_normal((6, 64)).astype(np.float32)
    w = rng.standard_normal((8, 64, 128)).astype(np.float32)
    sizes = np.array([0, 1, 0, 2, 0, 0, 1, 0], np.int32)  # 4 live rows, 2 padding rows
    got = np.asarray(triton.grouped_matmul(x, w, sizes, interpret=True))
    assert _relative(got[:4], _oracle(x, w, sizes)[:4]) < 1e-5


def test_bad_inputs_are_refused(rng):
    x, w, sizes = _case(rng, "dense", jnp.float32)
    with pytest.raises(ValueError, match="unknown grouped matmul"):
        gmm.get("nope")
    with pytest.raises(ValueError, match="same K"):
        gmm.grouped_matmul(x[:, :8], w, sizes)
    with pytest.raises(ValueError, match="group_sizes"):
        gmm.grouped_matmul(x, w, sizes[:-1])


def test_mosaic_supports_only_its_tiles():
    assert mosaic.supports((4096, 1024), (64, 1024, 512), jnp.bfloat16)
    assert not mosaic.supports((4096, 1024), (64, 1024, 512), jnp.float32)
    assert not mosaic.supports((4096, 96), (64, 96, 512), jnp.bfloat16)
    assert mosaic.supports((4096, 512), (64, 1024, 512), jnp.bfloat16, transpose_rhs=True)


@gpu
def test_kernel_paths_are_placement_invariant(rng):
    """A row's result is bit-identical wherever its group sits (another slot index, another start row)."""
    for implementation, dtype in (("triton", jnp.float32), ("mosaic", jnp.bfloat16)):
        x, w, sizes = _case(rng, implementation, dtype)
        y = np.asarray(gmm.grouped_matmul(x, w, sizes, implementation=implementation), np.float32)
        order = np.roll(np.arange(len(sizes)), 2)
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        rows = np.concatenate([np.arange(starts[s], starts[s] + sizes[s]) for s in order])
        live = len(rows)
        x2 = np.concatenate([x[rows], x[live:]])
        y2 = np.asarray(gmm.grouped_matmul(x2, w[order], sizes[order], implementation=implementation), np.float32)
        np.testing.assert_array_equal(y2[:live], y[rows])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_swiglu_kernel_in_interpret_mode(dtype, rng):
    """``swiglu_matmul`` (gate and up products and SwiGLU in one kernel, rows read from their tokens or given)
    against a float64 oracle under several tilings: tiles straddling groups, an empty group, a tail tile, padding
    rows whose tokens are never read (out of range here), and large, tiny and signed-zero inputs."""
    from moe_eplb_jax.moe._gmm import triton, triton_swiglu

    tokens, depth, hidden, top_k = 50, 32, 32, 3
    x = rng.standard_normal((tokens, depth)).astype(np.float32)
    x[0, :4] = [0.0, -0.0, 1e-39, -1e-39]  # zeros and float32 subnormals
    x[1] *= 40.0  # products far out in the sigmoid's tails
    sizes = _sizes(rng, 4, tokens * top_k, tokens * top_k - 17)
    live = int(sizes.sum())
    row_tokens = rng.integers(0, tokens, tokens * top_k).astype(np.int32)
    row_tokens[live:] = np.iinfo(np.int32).max  # padding rows: the kernel must not read their tokens
    row_tokens[:3] = [0, 1, 0]
    w_in = (rng.standard_normal((4, depth, 2 * hidden)) / np.sqrt(depth)).astype(np.float32)
    x, w_in = np.asarray(jnp.asarray(x, dtype)), np.asarray(jnp.asarray(w_in, dtype))
    h = _oracle(x[np.minimum(row_tokens, tokens - 1)], w_in, sizes)[:live]
    if dtype == jnp.bfloat16:  # the kernel rounds the products to bf16 before the SwiGLU, as the two-kernel path
        h = np.asarray(jnp.asarray(h, jnp.bfloat16), np.float64)
    want = h[:, :hidden] / (1 + np.exp(-h[:, :hidden])) * h[:, hidden:]
    tolerance = 1e-5 if dtype == jnp.float32 else 1e-2
    decode = triton_swiglu.default_config(256, 512, 64)  # four rows a group: 16-row tiles, 128 columns a product
    assert decode == triton.Config(block_rows=16, block_k=64, block_cols=256, num_warps=4, num_stages=4)
    assert triton_swiglu.default_config(2048, 512, 64) == triton.Config(num_stages=3)
    configs = (triton.Config(block_k=16, block_cols=32), triton.Config(block_rows=16, block_k=32), decode, None)
    for config in configs:
        got = triton_swiglu.swiglu_matmul(x, w_in, sizes, row_tokens, config=config, interpret=True)
        assert got.shape == (tokens * top_k, hidden) and got.dtype == dtype
        assert _relative(np.asarray(got, np.float32)[:live], want) < tolerance
        rows = x[np.minimum(row_tokens, tokens - 1)]
        given = triton_swiglu.swiglu_matmul(rows, w_in, sizes, config=config, interpret=True)
        np.testing.assert_array_equal(np.asarray(given)[:live], np.asarray(got)[:live])
    with pytest.raises(ValueError, match="w_in"):
        triton_swiglu.swiglu_matmul(x, w_in[:, :, :-1], sizes, row_tokens, interpret=True)
    with pytest.raises(ValueError, match="multiples"):
        triton_swiglu.swiglu_matmul(x[:, :24], w_in[:, :24], sizes, row_tokens, interpret=True)
    assert triton_swiglu.supports(4096, 1024, 512, 64) and not triton_swiglu.supports(64, 24, 32, 4)
    with pytest.raises(ValueError, match="backend"):
        gmm.swiglu_matmul(x, w_in, sizes, row_tokens, backend="mosaic")


@gpu
def test_pallas_runs_triton_without_gradients_and_mosaic_with(rng):
    """At Mosaic's sizes ``"pallas"`` runs the Triton kernel where nothing differentiates the product (the same
    rows as ``"triton"``'s, bit for bit) and Mosaic's kernels under ``jax.grad``."""
    x, w, sizes = _case(rng, "pallas", jnp.bfloat16)
    live = int(sizes.sum())
    product = lambda x: gmm.grouped_matmul(x, w, sizes, implementation="pallas")
    want = np.asarray(gmm.grouped_matmul(x, w, sizes, implementation="triton"), np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(product)(x), np.float32)[:live], want[:live])
    inference = jax.jit(product).lower(x).as_text()
    training = jax.jit(jax.grad(lambda x: jnp.sum(product(x).astype(jnp.float32)))).lower(x).as_text()
    assert "triton" in inference and "mosaic" not in inference.lower()
    assert "mosaic" in training.lower() and "xla.gpu.triton" not in training


@gpu
@pytest.mark.parametrize("batch", [1, 8, 32, 256])
def test_decode_shapes_on_their_default_tilings(batch, rng):
    """On the card, a decode step's two expert kernels at the ``small`` preset's shapes (top-8 of 64 experts,
    1024 -> 2 x 512 -> 1024) on the tilings ``default_config`` picks for the batch: the fused first half reading
    rows from their tokens, then the down product, against float64 (one row a group up to a few rows a group)."""
    from moe_eplb_jax.moe._gmm import triton, triton_swiglu

    groups, dim, hidden, rows = 64, 1024, 512, batch * 8
    sizes = rng.multinomial(rows, [1 / groups] * groups).astype(np.int32)
    tokens = rng.integers(0, batch, rows).astype(np.int32)
    x = np.asarray(jnp.asarray(rng.standard_normal((batch, dim)), jnp.bfloat16))
    w_in = np.asarray(jnp.asarray(rng.standard_normal((groups, dim, 2 * hidden)) / 32, jnp.bfloat16))
    w_out = np.asarray(jnp.asarray(rng.standard_normal((groups, hidden, dim)) / 22, jnp.bfloat16))
    act = np.asarray(jax.jit(triton_swiglu.swiglu_matmul)(x, w_in, sizes, tokens), np.float32)
    h = np.asarray(jnp.asarray(_oracle(x[tokens], w_in, sizes), jnp.bfloat16), np.float64)
    want = h[:, :hidden] / (1 + np.exp(-h[:, :hidden])) * h[:, hidden:]
    assert _relative(act, want) < TOLERANCE[jnp.bfloat16]
    y = np.asarray(jax.jit(triton.grouped_matmul)(act.astype(jnp.bfloat16), w_out, sizes), np.float32)
    act16 = np.asarray(jnp.asarray(act, jnp.bfloat16))
    assert _relative(y, _oracle(act16, w_out, sizes)) < TOLERANCE[jnp.bfloat16]


def _warp_specialized(x_shape, w_shape, transpose_rhs, config=None):
    from moe_eplb_jax.moe._gmm import mosaic_ws

    config = config or mosaic_ws.Config()
    return lambda x, w, s: mosaic_ws.grouped_matmul(x, w, s, transpose_rhs=transpose_rhs, config=config)


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["forward", "transposed"])
def test_warp_specialized_mosaic_kernel_lowers_for_hopper(transpose_rhs):
    """No GPU needed: the warp-specialized kernel's Mosaic GPU module builds (layouts inferred, pipelines laid out)
    for a row count off the tile and for a wider tiling, and bad shapes are refused first."""
    from moe_eplb_jax.moe._gmm import mosaic_ws

    checks = [jax.export.DisabledSafetyCheck.custom_call(name) for name in ("mosaic_gpu", "mosaic_gpu_v2")]
    for rows, config in ((1000, mosaic_ws.Config()), (4096, mosaic_ws.Config(block_n=128, max_concurrent_steps=3))):
        w_shape = (8, 512, 256) if transpose_rhs else (8, 256, 512)
        args = [
            jax.ShapeDtypeStruct(s, d)
            for s, d in (((rows, 256), jnp.bfloat16), (w_shape, jnp.bfloat16), ((8,), jnp.int32))
        ]
        call = jax.jit(_warp_specialized(args[0].shape, w_shape, transpose_rhs, config))
        module = jax.export.export(call, platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()
        assert "mosaic_gpu" in module
    with pytest.raises(ValueError, match="tile"):
        mosaic_ws.grouped_matmul(
            jnp.zeros((64, 96), jnp.bfloat16), jnp.zeros((2, 96, 128), jnp.bfloat16), jnp.zeros(2, jnp.int32)
        )
    assert not mosaic_ws.supports((64, 256), (2, 256, 128), jnp.float32)


@pytest.mark.parametrize("product", ["forward", "transposed", "weight_gradient"])
def test_mosaic_products_take_the_warp_specialized_kernel_where_its_bands_tile(product):
    """No GPU needed: ``_gmm.mosaic``'s three products lower to the warp-specialized kernels where the output width
    is a multiple of their 256-column bands, to JAX's ``ragged_dot_mgpu`` where it is not (the weight gradient's
    fallback, JAX's ``transposed_ragged_dot_mgpu``, reads the device's SM count: it lowers on a card only)."""
    from moe_eplb_jax.moe._gmm import mosaic_ws

    checks = [jax.export.DisabledSafetyCheck.custom_call(name) for name in ("mosaic_gpu", "mosaic_gpu_v2")]
    for width, warp_specialized in ((512, True), (384, False)):
        if product == "weight_gradient":
            if not warp_specialized:
                fits = mosaic_ws.supports_transposed(
                    (4096, 256), (4096, width), jnp.bfloat16, config=mosaic.WARP_SPECIALIZED
                )
                assert not fits
                continue
            second, kernel_name = (4096, width), "transposed_grouped_matmul_ws"
            call = jax.jit(mosaic.transposed_grouped_matmul)
        else:
            transpose_rhs = product == "transposed"
            second, kernel_name = ((8, width, 256) if transpose_rhs else (8, 256, width)), "grouped_matmul_ws"
            call = jax.jit(lambda x, w, s, t=transpose_rhs: mosaic.grouped_matmul(x, w, s, transpose_rhs=t))
        args = [
            jax.ShapeDtypeStruct(s, d)
            for s, d in (((4096, 256), jnp.bfloat16), (second, jnp.bfloat16), ((8,), jnp.int32))
        ]
        module = jax.export.export(call, platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()
        assert (kernel_name in module) == warp_specialized


@gpu
@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["forward", "transposed"])
def test_warp_specialized_mosaic_kernel_matches_float64(transpose_rhs, rng):
    """On the card: the live rows against a float64 oracle -- empty groups, tiles straddling groups, a row count off
    the tile, padding rows after the groups."""
    for num_rows, groups in ((2500, 7), (300, 3)):
        sizes = _sizes(rng, groups, num_rows, num_rows - 41)
        live = int(sizes.sum())
        x = np.asarray(jnp.asarray(rng.standard_normal((num_rows, 256)), jnp.bfloat16))
        w = np.asarray(jnp.asarray(rng.standard_normal((groups, 256, 384)) / 16, jnp.bfloat16))
        weights = np.swapaxes(w, 1, 2).copy() if transpose_rhs else w
        got = jax.jit(_warp_specialized(x.shape, weights.shape, transpose_rhs))(x, weights, sizes)
        assert got.shape == (num_rows, 384) and got.dtype == jnp.bfloat16
        assert _relative(np.asarray(got, np.float32)[:live], _oracle(x, w, sizes)[:live]) < 1e-2


def test_warp_specialized_weight_gradient_lowers_for_hopper():
    """No GPU needed: the warp-specialized weight gradient's Mosaic GPU module builds (a chunk count read from the
    group sizes, the masked first and last chunks) for a row count off the chunk and a wider tiling; bad shapes
    are refused first."""
    from moe_eplb_jax.moe._gmm import mosaic_ws

    checks = [jax.export.DisabledSafetyCheck.custom_call(name) for name in ("mosaic_gpu", "mosaic_gpu_v2")]
    for rows, config in ((1000, mosaic_ws.Config()), (4096, mosaic_ws.Config(block_n=128, max_concurrent_steps=3))):
        args = [
            jax.ShapeDtypeStruct(s, d)
            for s, d in (((rows, 256), jnp.bfloat16), ((rows, 512), jnp.bfloat16), ((8,), jnp.int32))
        ]
        call = jax.jit(lambda x, dy, s, config=config: mosaic_ws.transposed_grouped_matmul(x, dy, s, config=config))
        module = jax.export.export(call, platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()
        assert "transposed_grouped_matmul_ws" in module
    with pytest.raises(ValueError, match="tile"):
        mosaic_ws.transposed_grouped_matmul(
            jnp.zeros((64, 96), jnp.bfloat16), jnp.zeros((64, 256), jnp.bfloat16), jnp.zeros(2, jnp.int32)
        )
    with pytest.raises(ValueError, match="group_sizes"):
        mosaic_ws.transposed_grouped_matmul(
            jnp.zeros((64, 128), jnp.bfloat16), jnp.zeros((64, 256), jnp.bfloat16), jnp.zeros((2, 1), jnp.int32)
        )
    assert not mosaic_ws.supports_transposed((64, 256), (64, 256), jnp.float32)
    assert not mosaic_ws.supports_transposed((64, 256), (32, 256), jnp.bfloat16)


@gpu
def test_warp_specialized_weight_gradient_matches_float64(rng):
    """On the card: each group's ``x^T dy`` against a float64 oracle -- an empty group (zeros), groups sharing
    their first and last chunks, a row count off the chunk, non-finite-free padding rows after the groups."""
    from moe_eplb_jax.moe._gmm import mosaic_ws

    for num_rows, groups in ((2500, 7), (300, 3)):
        sizes = _sizes(rng, groups, num_rows, num_rows - 41)
        live = int(sizes.sum())
        x = np.asarray(jnp.asarray(rng.standard_normal((num_rows, 256)), jnp.bfloat16))
        dy = np.asarray(jnp.asarray(rng.standard_normal((num_rows, 512)), jnp.bfloat16))
        got = jax.jit(mosaic_ws.transposed_grouped_matmul)(x, dy, sizes)
        assert got.shape == (groups, 256, 512) and got.dtype == jnp.bfloat16
        ends = np.cumsum(sizes)
        for group, (start, end) in enumerate(zip(ends - sizes, ends)):
            want = x[start:end].astype(np.float64).T @ dy[start:end].astype(np.float64)
            part = np.asarray(got[group], np.float32)
            if end == start:
                assert not part.any()
            else:
                assert _relative(part, want) < 1e-2, (group, start, end)
        assert live < num_rows

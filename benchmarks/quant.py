"""Quantized experts: quantization throughput and expert-MLP step time per format, vs bf16 and the floors.

Run:  PYTHONPATH=. python3 benchmarks/quant.py            (GPU if present, plus the host CPU)
      PYTHONPATH=. python3 benchmarks/quant.py --small    (tiny shapes, a quick CPU smoke run)
      PYTHONPATH=. python3 benchmarks/quant.py --ragged [--small] [--shapes 32x64,8x2048]   (only section 5)

Prints, side by side in one run:
1. checks: GPU bytes == CPU bytes of every leaf for every format; each fast MLP path vs the float32
   reference on the GPU (relative error);
2. measured ceilings: an elementwise bf16 pass (read + write) and the bf16 / fp8 GEMM rates;
3. quantization throughput per format (bf16 weights in) on the GPU and the CPU, against the floor
   (bytes read + written at the measured elementwise rate);
4. expert-MLP step time per format and implementation against bf16 on the same shapes, with the
   floor max(weight bytes / bandwidth, FLOPs / GEMM rate) for a decode-sized and a prefill-sized T;
5. the MoE layer's expert MLP on slot-sorted rows (``moe.expert_mlp``) per format: the ragged quantized
   grouped matmul (the kernel reading packed weights), the dense path it replaced (every row through every
   slot's ``quant.expert_mlp``), the bf16 grouped matmul, and the weight-read floor (the slots' packed
   weights and scales over the card's HBM bandwidth: H100 3.35 TB/s, H200 4.8 TB/s), at DeepSeek-V3's expert
   shape (D=7168, H=2048) for decode (64 rows per slot, 8 and 32 slots) and prefill (8 slots of 2048 rows).
   Device time of the kernels (CUPTI); on a CPU the rows are only checked ("needs a GPU").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from moe_eplb_jax import quant
from moe_eplb_jax.moe import expert_mlp
from moe_eplb_jax.moe import grouped_matmul as gmm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import device_seconds, hbm_bandwidth, median_seconds


def leaf_bytes(tree) -> int:
    return sum(x.size * jax.dtypes.itemsize_bits(x.dtype) // 8 for x in jax.tree.leaves(tree))


def u8(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.uint8).reshape(x.shape[0], -1)


def check_cross_backend(gpu, cpu, log):
    """Quantizes the same random weights on both backends; every leaf must match byte for byte."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((4, 256, 512)) * np.exp2(rng.uniform(-6, 6, (4, 256, 1)))).astype(np.float32)
    w[0, 0, :64] *= 1e-39  # subnormal float32 values in some blocks
    w[3, 5, 7], w[3, 9, 40] = np.nan, -np.inf  # non-finite values follow each format's documented rule
    ok = True
    for fmt in quant.FORMATS:
        out = {}
        for name, dev in (("gpu", gpu), ("cpu", cpu)):
            with jax.default_device(dev):
                q = quant.quantize_experts(jax.device_put(w, dev), fmt, nonfinite="propagate")
                out[name] = [u8(x) for x in jax.tree.leaves(q)]
        same = all(np.array_equal(a, b) for a, b in zip(out["gpu"], out["cpu"], strict=True))
        ok &= same
        log(f"  bytes gpu == cpu  {fmt:10s} {'OK' if same else 'MISMATCH'}")
    return ok


# Device-to-device copy on an H200, bytes read + written (KINDS.md, 2026-11-04): the HBM ceiling. XLA's own
# elementwise kernels measured lower here (about 1.96 TB/s), so floors are given at both rates.
HBM_COPY_BPS = 4.3e12


def mlp_variants():
    yield "bf16", None, "auto"
    yield "fp8", "fp8", "auto"
    yield "fp8 fast-accum", "fp8", "fast"
    yield "fp8 via bf16", "fp8", "dequant"
    yield "fp8_block", "fp8_block", "auto"
    yield "mxfp8", "mxfp8", "auto"
    yield "mxfp8 scaled_mm", "mxfp8", "scaled_matmul"
    yield "mxfp4", "mxfp4", "auto"
    yield "mxfp4 scaled_mm", "mxfp4", "scaled_matmul"
    yield "nvfp4", "nvfp4", "auto"


def make_layer(key, e, h, i, dtype):
    kg, ku, kd = jax.random.split(key, 3)
    return [
        (jax.random.normal(k, s, jnp.float32) * 0.02).astype(dtype)
        for k, s in ((kg, (e, i, h)), (ku, (e, i, h)), (kd, (e, h, i)))
    ]


def quantized_layer(weights, fmt, x):
    if fmt is None:
        return weights
    s_x = float(quant.activation_scale(x))
    return quant.quantize_mlp(*weights, fmt, input_scale=s_x, down_input_scale=s_x * 0.05, nonfinite="propagate")


def _diagnose_bytes(dev, cpu, log):
    """Cross-backend byte differences of every format's leaves, in detail (finite and NaN/Inf weights)."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((4, 256, 512)) * np.exp2(rng.uniform(-6, 6, (4, 256, 1)))).astype(np.float32)
    w[0, 0, :64] *= 1e-39
    w_bad = w.copy()
    w_bad[3, 5, 7], w_bad[3, 9, 40] = np.nan, -np.inf
    for case, weights in (("finite", w), ("nan/inf", w_bad)):
        for fmt in quant.FORMATS:
            qs = {}
            for name, device in (("gpu", dev), ("cpu", cpu)):
                with jax.default_device(device):
                    qs[name] = quant.quantize_experts(jax.device_put(weights, device), fmt, nonfinite="propagate")
            for field in dataclasses.fields(qs["gpu"]):
                a = np.asarray(getattr(qs["gpu"], field.name))
                b = np.asarray(getattr(qs["cpu"], field.name))
                a8, b8 = a.view(np.uint8).reshape(-1), b.view(np.uint8).reshape(-1)
                bad = np.flatnonzero(a8 != b8)
                if bad.size == 0:
                    continue
                idx = np.unravel_index(bad[:3] // max(1, a8.size // a.size), a.shape)
                log(
                    f"  {case:7s} {fmt:9s} {field.name:13s} {bad.size} of {a8.size} bytes differ; first "
                    f"gpu {a8[bad[:3]].tolist()} cpu {b8[bad[:3]].tolist()} "
                    f"at {[tuple(int(v) for v in i) for i in zip(*idx)]}"
                    f" values gpu {a[idx].astype(np.float32).tolist()} cpu {b[idx].astype(np.float32).tolist()}"
                )
            log(f"  {case:7s} {fmt:9s} checked")


def _diagnose_fp8_gemm(key, shape, ts, log):
    """FP8 GEMM accumulation: DEFAULT vs HIGHEST precision vs bf16 operands, time, error, the custom calls."""
    ne, ni, nh = shape
    dims = (((2,), (2,)), ((0,), (0,)))
    w8 = (jax.random.normal(key, (ne, ni, nh), jnp.float32) * 64).astype(jnp.float8_e4m3fn)
    for t in ts:
        x8 = jax.random.normal(jax.random.fold_in(key, t), (ne, t, nh), jnp.float32) * 64
        x8 = x8.astype(jnp.float8_e4m3fn)
        exact = np.asarray(x8[0, :32]).astype(np.float64) @ np.asarray(w8[0, :256]).astype(np.float64).T
        for label, prec, cast in (
            ("fp8 DEFAULT", "default", None),
            ("fp8 HIGHEST", "highest", None),
            ("bf16 of fp8", "default", jnp.bfloat16),
        ):
            fn = jax.jit(
                lambda a, b, p=prec, c=cast: jax.lax.dot_general(
                    a if c is None else a.astype(c),
                    b if c is None else b.astype(c),
                    dims,
                    precision=p,
                    preferred_element_type=jnp.float32,
                )
            )
            out = fn(x8, w8)
            err = np.linalg.norm(np.asarray(out[0, :32, :256]) - exact) / np.linalg.norm(exact)
            hlo = fn.lower(x8, w8).compile().as_text()
            calls = sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo)))
            sec = median_seconds(fn, x8, w8)
            log(
                f"  T={t:5d} {label:12s} {sec * 1e3:7.3f} ms  {2 * ne * t * ni * nh / sec / 1e12:6.0f} TFLOP/s"
                f"  rel err {err:.1e}  calls {calls}"
            )


def _diagnose_fp4_decode(dev, key, shape, log):
    """Packed fp4 -> bf16: XLA's float4 conversion (the MLP's decode) vs a lookup of ``quant.E2M1_VALUES``."""
    ne, ni, nh = shape
    packed = jax.random.randint(key, (ne, ni, nh // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    big = jax.random.normal(key, (256 * 1024 * 1024 // (64 if dev.platform == "cpu" else 1),), jnp.float32)
    bw = 2 * big.nbytes / median_seconds(jax.jit(lambda v: v * jnp.float32(1.5)), big)
    log(f"  elementwise f32 r+w {bw / 1e12:.2f} TB/s")
    del big
    table = jnp.asarray(quant.E2M1_VALUES, jnp.bfloat16)
    variants = {
        "table": lambda p: table[quant.unpack_fp4(p)],
        "float4": lambda p: (
            jax.lax.bitcast_convert_type(p, jnp.float4_e2m1fn)
            .reshape(*p.shape[:-1], p.shape[-1] * 2)
            .astype(jnp.bfloat16)
        ),
    }
    ref = None
    for name, fn in variants.items():
        try:
            fn = jax.jit(fn)
            out = fn(packed)
            same = ref is None or bool(jnp.all(out == ref))
            ref = out if ref is None else ref
            sec = median_seconds(fn, packed)
            floor = (packed.nbytes + out.nbytes) / bw
            log(
                f"  fp4 decode {name:6s} {sec * 1e3:7.3f} ms floor {floor * 1e3:.3f} ms ({floor / sec:.2f}) same {same}"
            )
        except Exception as err:
            log(f"  fp4 decode {name} FAILED {type(err).__name__}: {str(err).splitlines()[0][:160]}")


def _diagnose_mlps(key, shape, ts, log):
    """FP8 MLP with and without fast accumulation (time, error), and the fp4 MLPs' step time."""
    ne, ni, nh = shape
    weights = make_layer(key, ne, nh, ni, jnp.bfloat16)
    for t in ts:
        x = jax.random.normal(jax.random.fold_in(key, t), (ne, t, nh), jnp.float32).astype(jnp.bfloat16)
        layer = quantized_layer(weights, "fp8", x)
        ref = quant.expert_mlp_reference(x[:, :8].astype(jnp.float32), *layer)
        for fast in (False, True):
            fn = jax.jit(lambda v, *q, f=fast: quant.expert_mlp(v, *q, fast_accumulation=f))
            out = fn(x, *layer)[:, :8]
            rel = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
            sec = median_seconds(fn, x, *layer)
            log(f"  fp8 MLP T={t:5d} fast_accumulation={fast!s:5s} {sec * 1e3:7.3f} ms rel err {rel:.1e}")
        for fmt in ("mxfp4", "nvfp4"):
            layer = quantized_layer(weights, fmt, x)
            try:
                fn = jax.jit(lambda v, *q: quant.expert_mlp(v, *q))
                log(f"  {fmt} MLP T={t:5d} {median_seconds(fn, x, *layer) * 1e3:7.3f} ms")
            except Exception as err:
                log(f"  {fmt} MLP FAILED {type(err).__name__}: {str(err).splitlines()[0][:120]}")


def diagnose(dev, cpu, log):
    """--diag: cross-backend byte differences in detail, FP8 GEMM accumulation, fp4 decoding, ceilings."""
    _diagnose_bytes(dev, cpu, log)
    shape = (2, 256, 512) if dev.platform == "cpu" else (8, 2048, 7168)
    ts = (16, 64) if dev.platform == "cpu" else (64, 2048)
    with jax.default_device(dev):
        key = jax.random.PRNGKey(3)
        _diagnose_fp8_gemm(key, shape, ts, log)
        _diagnose_fp4_decode(dev, key, shape, log)
        _diagnose_mlps(key, shape, ts, log)


def _check_mlps(xc, layers, log):
    """Each MLP variant against the float32 reference: ``(ok, names that failed to run)``."""
    ok, failed = True, set()
    for name, fmt, impl in mlp_variants():
        try:
            ref = quant.expert_mlp_reference(xc, *layers[fmt])
            out = quant.expert_mlp(
                xc, *layers[fmt], impl="auto" if impl == "fast" else impl, fast_accumulation=impl == "fast"
            )
        except Exception as err:
            failed.add(name)
            ok = False
            log(f"  mlp {name:16s} FAILED {type(err).__name__}: {str(err).splitlines()[0][:160]}")
            continue
        rel = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
        good = np.isfinite(rel) and rel < (1e-3 if name == "fp8" else 2e-2)
        if "scaled_mm" in name:  # activations MX-quantized too: compare to bf16 end to end
            ref_bf16 = quant.expert_mlp_reference(xc, *layers[None])
            rel = float(jnp.linalg.norm(out - ref_bf16) / jnp.linalg.norm(ref_bf16))
            good = np.isfinite(rel) and rel < 0.3
        ok &= bool(good)
        log(f"  mlp {name:16s} vs reference rel err {rel:.2e} {'OK' if good else 'BAD'}")
    return ok, failed


def _ceilings(key, small: bool, log):
    """The measured elementwise bf16 bandwidth (read + write) and bf16 / fp8 GEMM rates."""
    big = jax.random.normal(key, (256 * 1024 * 1024 // (64 if small else 1),), jnp.bfloat16)
    elementwise = jax.jit(lambda v: v * jnp.bfloat16(1.5))
    bw = 2 * big.nbytes / median_seconds(elementwise, big)
    n = 1024 if small else 8192
    a = jax.random.normal(key, (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.fold_in(key, 1), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.float32))
    bf16_rate = 2 * n**3 / median_seconds(mm, a, b)
    a8, b8 = a.astype(jnp.float8_e4m3fn), b.astype(jnp.float8_e4m3fn)
    try:
        fp8_rate = 2 * n**3 / median_seconds(mm, a8, b8)
    except Exception as err:
        fp8_rate = 2 * bf16_rate
        log(f"  fp8 GEMM ceiling FAILED ({type(err).__name__}); using 2x bf16")
    del big, a, b, a8, b8
    log(
        f"ceilings: elementwise bf16 r+w {bw / 1e12:.2f} TB/s; GEMM {n}^3 bf16 {bf16_rate / 1e12:.0f} TFLOP/s, "
        f"fp8 {fp8_rate / 1e12:.0f} TFLOP/s"
    )
    return bw, bf16_rate, fp8_rate


def _quantize_throughput(weights, dev, cpu, on_gpu: bool, bw, log):
    """quantize_experts per format on the GPU and the CPU against the floor: ``(ok, result rows)``."""
    e, i, h = weights[0].shape
    log("")
    log(f"quantize_experts, bf16 w [{e}, {i}, {h}] ({weights[0].nbytes / 2**20:.0f} MiB):")
    log(
        f"{'format':10s} {'where':5s} {'time ms':>9s} {'in GB/s':>9s} {'floor ms':>9s} {'floor/time':>10s} "
        f"{'@4.3TB/s':>9s}"
    )
    ok, rows = True, []
    cpu_w = jax.device_put(weights[0][: max(1, e // 8)], cpu)  # a slice: a CPU pass over all takes seconds
    for fmt in quant.FORMATS:
        for where, device in (("gpu", dev), ("cpu", cpu)) if on_gpu else (("cpu", cpu),):
            with jax.default_device(device):
                w = cpu_w if where == "cpu" else weights[0]
                fn = lambda v, f=fmt: quant.quantize_experts(v, f, nonfinite="propagate")
                try:
                    sec = median_seconds(fn, w, reps=3 if where == "cpu" else 10, warmup=1)
                except Exception as err:
                    ok = False
                    log(f"{fmt:10s} {where:5s} FAILED {type(err).__name__}: {str(err).splitlines()[0][:160]}")
                    continue
                moved = w.nbytes + leaf_bytes(fn(w))
                floor = moved / bw if where == "gpu" else float("nan")
                log(
                    f"{fmt:10s} {where:5s} {sec * 1e3:9.3f} {w.nbytes / sec / 1e9:9.1f} {floor * 1e3:9.3f} "
                    f"{floor / sec:10.2f} {moved / HBM_COPY_BPS / sec:9.2f}"
                )
                rows.append({"fmt": fmt, "where": where, "shape": list(w.shape), "s": sec, "floor_s": floor})
    return ok, rows


def _mlp_step_times(xs, layers, failed, shape, ceilings, log):
    """Expert-MLP step time per variant against bf16 and the floor, for each token count in ``xs``."""
    e, h, i = shape
    bw, bf16_rate, fp8_rate = ceilings
    rows = []
    for t, x in xs.items():
        flops = 6 * e * t * h * i
        log("")
        log(f"expert MLP step, E={e} slots x T={t} tokens, H={h}, I={i} ({flops / 1e9:.0f} GFLOP):")
        log(
            f"{'variant':16s} {'ms':>8s} {'vs bf16':>8s} {'weight MiB':>10s} {'floor ms':>9s} {'floor/time':>10s} "
            f"{'@4.3TB/s':>9s}"
        )
        base = None
        for name, fmt, impl in mlp_variants():
            if name in failed:
                continue
            layer = layers[fmt]
            fn = jax.jit(
                lambda v, *q, m=impl: quant.expert_mlp(
                    v, *q, impl="auto" if m == "fast" else m, fast_accumulation=m == "fast"
                )
            )
            sec = median_seconds(fn, x, *layer)
            base = sec if base is None else base
            rate = fp8_rate if name.startswith("fp8") and "via" not in name and "block" not in name else bf16_rate
            wbytes = leaf_bytes(layer)
            io = x.nbytes + e * t * h * 4  # tokens in (bf16), float32 out
            floor = max((wbytes + io) / bw, flops / rate)  # bw counts bytes read + written
            hbm_floor = max((wbytes + io) / HBM_COPY_BPS, flops / rate)
            log(
                f"{name:16s} {sec * 1e3:8.3f} {base / sec:8.2f} {wbytes / 2**20:10.0f} {floor * 1e3:9.3f} "
                f"{floor / sec:10.2f} {hbm_floor / sec:9.2f}"
            )
            rows.append({"variant": name, "T": t, "s": sec, "floor_s": floor, "weight_bytes": wbytes})
    return rows


RAGGED_TARGETS = {"fp8": 1.6, "mxfp4": 2.5}  # speed-up over bf16 the ragged kernel should reach at decode


def dense_quantized_mlp(x, experts, sizes):
    """The dense path the ragged one replaced: every row through every local slot's ``quant.expert_mlp``."""
    mine = gmm.slot_of_row(sizes, x.shape[0])[None, :] == jnp.arange(sizes.shape[0])[:, None]
    every = jnp.where(mine[..., None], x[None], jnp.zeros((), x.dtype))
    y = quant.expert_mlp(
        every, *(experts[k] for k in ("gate", "up", "down")), activation_scaling="dynamic", compute_dtype=x.dtype
    )
    return gmm.select_own_slot(y, sizes).astype(x.dtype)


def _ragged_case(key, slots, rows_per_slot, dim, hidden):
    """bf16 rows ``[S * T, D]`` (every slot ``T`` rows), float experts for ``moe.expert_mlp`` and their
    ``(gate [S, H, D], up, down [S, D, H])`` in quant's layout."""
    kx, kg, ku, kd = jax.random.split(key, 4)
    x = (jax.random.normal(kx, (slots * rows_per_slot, dim), jnp.float32)).astype(jnp.bfloat16)
    gate, up = (jax.random.normal(k, (slots, hidden, dim), jnp.float32) * 0.02 for k in (kg, ku))
    down = jax.random.normal(kd, (slots, dim, hidden), jnp.float32) * 0.02
    float_experts = {
        "w_in": jnp.concatenate([jnp.swapaxes(gate, 1, 2), jnp.swapaxes(up, 1, 2)], axis=2).astype(jnp.bfloat16),
        "w_out": jnp.swapaxes(down, 1, 2).astype(jnp.bfloat16),
    }
    return x, float_experts, (gate, up, down)


def _ragged_time(fn, args, on_gpu):
    if not on_gpu:
        return None
    sec, _ = device_seconds(fn, *args)
    return sec if sec is not None else median_seconds(fn, *args)


RAGGED_SHAPES = ((8, 64), (32, 64), (8, 2048))  # (slots, rows per slot): decode at 8 and 32 slots, a prefill


def ragged_mlp(dev, small: bool, log, sizes_per_slot=RAGGED_SHAPES):
    """Section 5: ``(ok, rows)`` -- per format the ragged kernel, the dense path, bf16 and the weight-read floor.

    Args:
      sizes_per_slot: ``(slots, rows per slot)`` pairs; under 512 rows a slot counts as decode.
    """
    on_gpu = dev.platform == "gpu"
    bandwidth = hbm_bandwidth(dev.device_kind)
    dim, hidden = (256, 128) if small else (7168, 2048)
    if small:
        sizes_per_slot = ((4, 8),)
    shapes = [("decode" if t < 512 else "prefill", s, t) for s, t in sizes_per_slot]
    kernel = "auto" if on_gpu else "pallas_interpret"
    ok, rows = True, []
    for phase, slots, per_slot in shapes:
        key = jax.random.PRNGKey(slots * 7919 + per_slot)
        with jax.default_device(dev):
            x, float_experts, weights = _ragged_case(key, slots, per_slot, dim, hidden)
            sizes = jnp.full((slots,), per_slot, jnp.int32)
            bf16 = jax.jit(lambda v, e, s: expert_mlp(v, e, s))
            base = _ragged_time(bf16, (x, float_experts, sizes), on_gpu)
        log("")
        log(f"moe expert MLP, {phase}: S={slots} slots x {per_slot} rows, D={dim}, H={hidden} ({dev.device_kind})")
        log(f"{'variant':18s} {'ms':>9s} {'vs bf16':>8s} {'weight MiB':>10s} {'floor ms':>9s} {'floor/time':>10s}")
        bf16_bytes = leaf_bytes(float_experts)
        _ragged_row(log, "bf16 grouped_mm", base, base, bf16_bytes, bandwidth)
        rows.append(
            {"phase": phase, "S": slots, "T": per_slot, "variant": "bf16", "s": base, "weight_bytes": bf16_bytes}
        )
        for fmt in quant.FORMATS:
            with jax.default_device(dev):
                q = quant.quantize_mlp(*weights, fmt, input_scale=0.02, down_input_scale=0.001, nonfinite="propagate")
                experts = dict(zip(("gate", "up", "down"), q))
                ragged = jax.jit(lambda v, e, s: expert_mlp(v, e, s, implementation=kernel))
                dense = jax.jit(dense_quantized_mlp)
                try:
                    got, want = ragged(x, experts, sizes), dense(x, experts, sizes)
                except Exception as err:
                    ok = False
                    log(f"{fmt:18s} FAILED {type(err).__name__}: {str(err).splitlines()[0][:160]}")
                    continue
                got, want = got.astype(jnp.float32), want.astype(jnp.float32)
                rel = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
                good = bool(np.isfinite(rel) and rel < 2e-2)
                ok &= good
                times = {
                    "ragged": _ragged_time(ragged, (x, experts, sizes), on_gpu),
                    "dense": _ragged_time(dense, (x, experts, sizes), on_gpu)
                    if slots * per_slot * slots * dim * 2 < 8 * 2**30
                    else None,
                }
            wbytes = leaf_bytes(q)
            for variant, sec in times.items():
                _ragged_row(log, f"{fmt} {variant}", sec, base, wbytes, bandwidth)
                rows.append(
                    {
                        "phase": phase,
                        "S": slots,
                        "T": per_slot,
                        "variant": f"{fmt} {variant}",
                        "s": sec,
                        "weight_bytes": wbytes,
                        "rel_vs_dense": rel,
                    }
                )
            target = RAGGED_TARGETS.get(fmt) if phase == "decode" else None
            met = (
                ""
                if target is None or times["ragged"] is None
                else f"; target {target}x over bf16 " + ("met" if base / times["ragged"] >= target else "NOT met")
            )
            log(f"{'':18s} ragged vs dense rel err {rel:.1e} {'OK' if good else 'BAD'}{met}")
    return ok, rows


def _ragged_row(log, name, sec, base, wbytes, bandwidth):
    floor = wbytes / bandwidth if bandwidth else None
    if sec is None:
        log(f"{name:18s} {'needs a GPU':>9s} {'':8s} {wbytes / 2**20:10.1f}")
        return
    vs = f"{base / sec:8.2f}" if base else f"{'':8s}"
    floor_txt = f"{floor * 1e3:9.3f} {floor / sec:10.2f}" if floor else f"{'?':>9s} {'':10s}"
    log(f"{name:18s} {sec * 1e3:9.3f} {vs} {wbytes / 2**20:10.1f} {floor_txt}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--diag", action="store_true", help="only the diagnostics (see diagnose)")
    parser.add_argument("--ragged", action="store_true", help="only section 5 (the MoE layer's expert MLP)")
    parser.add_argument(
        "--shapes",
        default=",".join(f"{s}x{t}" for s, t in RAGGED_SHAPES),
        help="section 5's SLOTSxROWS pairs (rows per slot), comma-separated",
    )
    args = parser.parse_args()
    try:
        shapes = tuple(tuple(int(n) for n in pair.split("x")) for pair in args.shapes.split(","))
        if any(len(pair) != 2 or min(pair) < 1 for pair in shapes):
            raise ValueError
    except ValueError:
        parser.error(f"--shapes: expected SLOTSxROWS pairs such as 32x64,8x2048, got {args.shapes!r}")
    lines: list[str] = []

    def log(msg=""):
        print(msg, flush=True)
        lines.append(msg)

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    cpu = jax.devices("cpu")[0]
    dev = gpus[0] if gpus else cpu
    log(
        f"jax {jax.__version__}, device {dev.device_kind}, cpu cores {os.cpu_count()}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    results = {"device": dev.device_kind}
    if args.diag:
        diagnose(dev, cpu, log)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "quant_diag.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
        return 0
    if args.ragged:
        ok, results["ragged"] = ragged_mlp(dev, args.small, log, shapes)
        log(f"checks {'PASSED' if ok else 'FAILED'}")
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "quant_ragged.json"), "w") as f:
            json.dump(results, f, indent=1)
        return 0 if ok else 1

    # 1. checks
    ok = True
    if gpus:
        log("checks:")
        ok &= check_cross_backend(dev, cpu, log)
    e, h, i = (4, 256, 128) if args.small else (8, 7168, 2048)
    t_small, t_large = (8, 32) if args.small else (64, 2048)
    key = jax.random.PRNGKey(0)
    with jax.default_device(dev):
        weights = make_layer(key, e, h, i, jnp.bfloat16)
        xs = {
            t: jax.random.normal(jax.random.fold_in(key, t), (e, t, h), jnp.float32).astype(jnp.bfloat16)
            for t in (t_small, t_large)
        }
        layers = {}
        for _, fmt, _ in mlp_variants():
            if fmt not in layers:
                layers[fmt] = quantized_layer(weights, fmt, xs[t_small])
        mlps_ok, failed = _check_mlps(xs[t_small][:, :8].astype(jnp.float32), layers, log)
        ok &= mlps_ok
        # 2. ceilings
        ceilings = _ceilings(key, args.small, log)
        results["ceilings"] = dict(zip(("bw_Bps", "bf16_flops", "fp8_flops"), ceilings))
    # 3. quantization throughput
    quantize_ok, results["quantize"] = _quantize_throughput(weights, dev, cpu, bool(gpus), ceilings[0], log)
    ok &= quantize_ok
    # 4. MLP step time
    with jax.default_device(dev):
        results["mlp"] = _mlp_step_times(xs, layers, failed, (e, h, i), ceilings, log)
    # 5. the MoE layer's expert MLP: ragged kernel vs the dense path vs bf16
    ragged_ok, results["ragged"] = ragged_mlp(dev, args.small, log, shapes)
    ok &= ragged_ok

    log("")
    log(f"checks {'PASSED' if ok else 'FAILED'}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "quant_bench.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "quant_bench.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

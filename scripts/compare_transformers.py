"""Compares moe_eplb_jax.models with Hugging Face transformers on tiny random checkpoints (optional; not in CI).

Two halves, each in its own environment (transformers is not a dependency of this project):

    python3 -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install torch transformers safetensors numpy ml_dtypes
    /tmp/hfvenv/bin/python scripts/compare_transformers.py hf /tmp/hfcmp      # checkpoints + reference outputs
    .venv/bin/python scripts/compare_transformers.py ours /tmp/hfcmp          # load, compare, export, report

``hf`` writes, per case, a checkpoint with ``save_pretrained`` (float32, and bfloat16), a DeepSeek-style
block-FP8 checkpoint of the same weights (e4m3 + float32 ``weight_scale_inv`` per 128 x 128 block), and
transformers' float32 logits and greedy tokens for each. ``ours`` reads each ``config.json`` with
``config_from_hf``, loads the files into a float32 ``MoECausalLM`` at EP=1 and at EP=8 with 8 redundant
experts on a random placement (8 simulated CPU devices) in every routing mode, and prints the largest
relative logit difference (``max |ours - hf| / max |hf|``), whether greedy tokens match, and whether
``export_checkpoint`` gives back every tensor of the file bit for bit.
"""

from __future__ import annotations

import json
import os
import sys

CASES = {
    # DeepSeek-V3: MLA with a low-rank query, interleaved RoPE, YaRN with DeepSeek's mscale terms.
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        q_lora_rank=32,
        rope={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    ),  # fmt: skip
    # DeepSeek-V2-Lite-style: full-rank query, rotate-half RoPE, attention biases, plain RoPE.
    "deepseek_v3_nolora_bias": dict(model_type="deepseek_v3", q_lora_rank=None, rope_interleave=False, bias=True),
    # GLM-4.5: GQA with q/k/v biases, partial RoPE (half the head), per-head q/k norm.
    "glm4_moe": dict(model_type="glm4_moe", bias=True, qk_norm=True),
    # Qwen3-MoE: dense blocks anywhere (mlp_only_layers, decoder_sparse_step), YaRN.
    "qwen3_moe": dict(
        model_type="qwen3_moe", rope={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    ),
}
WIDTH = 128  # 128-wide so that every expert is a whole number of 128 x 128 FP8 blocks
BATCH, PROMPT, NEW = 8, 12, 8


# ----------------------------------------------------------------- the hf half
def _hf_config(case: dict):
    import transformers

    rope = {"rope_type": "default", "rope_theta": 10000.0} | case.get("rope", {})
    rope.setdefault("rope_theta", 10000.0)
    common = dict(
        vocab_size=256, hidden_size=WIDTH, intermediate_size=256, moe_intermediate_size=WIDTH, num_attention_heads=4,
        num_experts_per_tok=2, max_position_embeddings=128, rope_parameters=rope, attention_bias=case.get("bias", False),
    )  # fmt: skip
    kind = case["model_type"]
    if kind == "deepseek_v3":
        return transformers.DeepseekV3Config(
            **common, num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=16, n_shared_experts=1,
            kv_lora_rank=32, q_lora_rank=case["q_lora_rank"], qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
            n_group=4, topk_group=2, first_k_dense_replace=1, rope_interleave=case.get("rope_interleave", True),
        )  # fmt: skip
    if kind == "glm4_moe":
        return transformers.Glm4MoeConfig(
            **common, num_hidden_layers=3, num_key_value_heads=2, head_dim=32, n_routed_experts=16, n_shared_experts=1,
            n_group=4, topk_group=2, first_k_dense_replace=1, use_qk_norm=case.get("qk_norm", False),
            routed_scaling_factor=2.5,
        )  # fmt: skip
    return transformers.Qwen3MoeConfig(
        **common, num_hidden_layers=4, num_key_value_heads=2, head_dim=32, num_experts=16, norm_topk_prob=True,
        mlp_only_layers=[2], decoder_sparse_step=1,
    )  # fmt: skip


def _randomize(model, seed: int):
    """Weights ~ N(0, 1/fan_in), norms near 1, biases and the score-correction bias ~ N(0, 0.1^2)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point() or "inv_freq" in name:
                continue
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * noise)
            elif p.ndim == 1:
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise * p.shape[-1] ** -0.5)


def _fp8_blocks(w):
    """DeepSeek's block FP8 of a float32 ``[out, in]`` numpy array: (e4m3 bytes, float32 scale_inv per 128 x 128)."""
    import ml_dtypes
    import numpy as np

    out, inp = w.shape
    rows, cols = -(-out // 128), -(-inp // 128)
    scale = np.ones((rows, cols), np.float32)
    q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            amax = float(np.abs(tile).max())
            scale[i, j] = amax / 448.0 if amax else 1.0
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (tile / scale[i, j]).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def _write_fp8(src: str, dst: str):
    """A DeepSeek-style FP8 checkpoint of ``src``: linear weights in block FP8, the rest bfloat16, biases float32.

    Returns the dequantized float32 tensors (what the FP8 checkpoint means), for transformers to run.
    """
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import load_file, save_file

    tensors = load_file(os.path.join(src, "model.safetensors"))
    out, meaning = {}, {}
    for name, value in tensors.items():
        linear = name.endswith("_proj.weight") or name.endswith("_mqa.weight")
        if linear and value.ndim == 2:
            q, s = _fp8_blocks(value)
            out[name], out[name + "_scale_inv"] = q, s
            rows = np.repeat(np.repeat(s, 128, 0), 128, 1)[: value.shape[0], : value.shape[1]]
            meaning[name] = q.astype(np.float32) * rows
        elif name.endswith("e_score_correction_bias"):
            out[name] = meaning[name] = value.astype(np.float32)
        else:
            out[name] = value.astype(ml_dtypes.bfloat16)
            meaning[name] = out[name].astype(np.float32)
    os.makedirs(dst, exist_ok=True)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                     "activation_scheme": "dynamic"}  # fmt: skip
    config["dtype"] = "bfloat16"
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return meaning


def hf_half(root: str):
    import numpy as np
    import torch
    import transformers

    torch.manual_seed(0)
    tokens = np.random.default_rng(0).integers(0, 256, (BATCH, PROMPT))
    ids = torch.tensor(tokens)
    np.save(os.path.join(root, "tokens.npy"), tokens)
    for i, (name, case) in enumerate(CASES.items()):
        config = _hf_config(case)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
        _randomize(model, seed=i)
        results = {}
        for flavour, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
            path = os.path.join(root, name, flavour)
            model.to(dtype).save_pretrained(path)
            # transformers runs every flavour in float32, from the file's values.
            ref = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation="eager"
            )
            results[flavour] = ref
        model.float()
        meaning = _write_fp8(os.path.join(root, name, "f32"), os.path.join(root, name, "fp8"))
        results["fp8"] = _with_tensors(model, meaning)
        for flavour, ref in results.items():
            ref.eval()
            ref.generation_config.eos_token_id = None  # greedy for NEW tokens, as ours (no early stop at eos)
            with torch.no_grad():
                logits = ref(ids).logits.float().numpy()
                mask = torch.ones_like(ids)  # every token is real (id 0 included)
                greedy = ref.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)[
                    :, PROMPT:
                ].numpy()
            np.savez(os.path.join(root, name, flavour, "reference.npz"), logits=logits, greedy=greedy)
        print(f"{name}: written", flush=True)


def _with_tensors(model, tensors):
    """A float32 copy of ``model`` holding checkpoint-named ``tensors`` (loaded through transformers' converter)."""
    import tempfile

    import torch
    from safetensors.numpy import save_file

    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        return type(model).from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")


# --------------------------------------------------------------- the ours half
def ours_half(root: str):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from safetensors import safe_open

    from moe_eplb_jax.models import MoECausalLM, config_from_hf, export_checkpoint, generate, load_checkpoint
    from moe_eplb_jax.models import safetensors_io as io
    from moe_eplb_jax.placement import Placement
    from moe_eplb_jax.routing import ROUTING_MODES

    tokens = np.load(os.path.join(root, "tokens.npy")).astype(np.int32)
    rng = np.random.default_rng(0)
    rows = []
    for name in CASES:
        for flavour in ("f32", "bf16", "fp8"):
            path = os.path.join(root, name, flavour)
            ref = np.load(os.path.join(path, "reference.npz"))
            config = config_from_hf(path, dtype="float32")
            worst, greedy_ok = 0.0, True
            for ep, redundant in ((1, 0), (8, 8)):
                mesh = jax.make_mesh(
                    (ep,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:ep]
                )
                e = config.num_experts
                phy2log = np.stack(
                    [rng.permutation(np.r_[np.arange(e), rng.integers(0, e, redundant)]) for _ in config.moe_blocks]
                )
                for mode in ROUTING_MODES:
                    model = MoECausalLM(
                        config, mesh=mesh, num_redundant_experts=redundant, rngs=nnx.Rngs(0), routing=mode
                    )
                    load_checkpoint(
                        model, os.path.join(path, "model.safetensors"), placement=Placement.from_phy2log(phy2log, e)
                    )
                    logits = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens)))
                    worst = max(worst, float(np.abs(logits - ref["logits"]).max() / np.abs(ref["logits"]).max()))
                    if mode in ("hash", "quota"):
                        greedy = generate(model, tokens.tolist(), max_new_tokens=NEW).tokens
                        greedy_ok &= bool(np.array_equal(greedy, ref["greedy"]))
            out = os.path.join(root, name, f"export-{flavour}.safetensors")
            export_checkpoint(model, out)
            same = _same_tensors(os.path.join(path, "model.safetensors"), out, io, safe_open)
            rows.append((name, flavour, worst, greedy_ok, same))
            print(f"{name:26s} {flavour:5s} max rel logit diff {worst:.2e}  greedy identical {greedy_ok}  "
                  f"export bit for bit {same}", flush=True)  # fmt: skip
    return rows


def _same_tensors(original: str, exported: str, io, safe_open) -> bool:
    a, b = io.index([original]), io.index([exported])
    if set(a) != set(b):
        print("  names differ:", sorted(set(a) ^ set(b))[:4])
        return False
    ta, tb = io.read(a, sorted(a)), io.read(b, sorted(b))
    for name in a:
        if a[name][1:] != b[name][1:] or ta[name].tobytes() != tb[name].tobytes():
            print("  differs:", name, a[name][1:], b[name][1:])
            return False
    return True


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("hf", "ours"):
        sys.exit(f"usage: {sys.argv[0]} hf|ours DIR")
    os.makedirs(sys.argv[2], exist_ok=True)
    (hf_half if sys.argv[1] == "hf" else ours_half)(sys.argv[2])

"""``config_from_hf``: Hugging Face config.json files of the three families, and every field it cannot honour."""

import json

import pytest

from moe_eplb_jax.models import YarnScaling, config_from_hf

# DeepSeek-V3's released config.json (transformers 4.x field names: rope_scaling, torch_dtype; an FP8 checkpoint).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}, "aux_loss_alpha": 0.001,
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip
# What transformers 5 writes for a Qwen3-MoE (rope_parameters, num_local_experts), with dense blocks anywhere.
QWEN3 = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "decoder_sparse_step": 2, "dtype": "float32", "head_dim": 16, "hidden_act": "silu", "hidden_size": 32,
    "intermediate_size": 48, "max_position_embeddings": 32768, "mlp_only_layers": [2], "model_type": "qwen3_moe",
    "moe_intermediate_size": 16, "norm_topk_prob": False, "num_attention_heads": 4, "num_experts_per_tok": 2,
    "num_hidden_layers": 6, "num_key_value_heads": 2, "num_local_experts": 8, "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "yarn", "factor": 4.0,
                        "original_max_position_embeddings": 8192},
    "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False, "use_cache": True,
    "use_sliding_window": False, "vocab_size": 64,
}  # fmt: skip
GLM = {
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "dtype": "bfloat16", "first_k_dense_replace": 1,
    "head_dim": 16, "hidden_act": "silu", "hidden_size": 32, "intermediate_size": 48, "model_type": "glm4_moe",
    "moe_intermediate_size": 16, "n_group": 1, "n_routed_experts": 8, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 3, "num_key_value_heads": 2,
    "num_nextn_predict_layers": 1, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "routed_scaling_factor": 2.5, "tie_word_embeddings": False, "topk_group": 1, "use_qk_norm": True,
    "vocab_size": 64,
}  # fmt: skip


def test_deepseek_v3_release_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    c = config_from_hf(tmp_path)
    assert c.attention == "mla" and (c.q_lora_rank, c.kv_lora_rank) == (1536, 512)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.rope_interleave) == (128, 64, 128, True)
    assert c.rope_scaling == YarnScaling(factor=40.0, original_max_len=4096, mscale=1.0, mscale_all_dim=1.0)
    assert (c.num_experts, c.top_k, c.num_groups, c.topk_groups, c.scoring) == (256, 8, 8, 4, "sigmoid")
    assert (c.first_dense_layers, c.num_moe_layers, c.shared_hidden, c.dense_hidden) == (3, 58, 2048, 18432)
    assert c.routed_scaling_factor == 2.5 and c.renormalize and not c.qk_norm and not c.qkv_bias
    assert (c.dtype, c.max_seq_len, c.mtp_layers, c.vocab_size) == ("bfloat16", 163840, 1, 129280)
    assert config_from_hf(DEEPSEEK_V3 | {"q_lora_rank": None}, dtype="float32").q_lora_rank is None  # V2-Lite's


def test_qwen3_dense_blocks_anywhere_and_yarn():
    c = config_from_hf(QWEN3)
    # mlp_only_layers [2], and with decoder_sparse_step 2 only every second block is sparse.
    assert c.dense_layers == (0, 2, 4) and c.moe_blocks == (1, 3, 5)
    assert (c.num_experts, c.num_kv_heads, c.head_dim, c.qk_norm, c.renormalize) == (8, 2, 16, True, False)
    assert c.rope_theta == 1e6 and c.rope_scaling == YarnScaling(factor=4.0, original_max_len=8192)
    assert c.attention == "gqa" and c.shared_hidden == 0 and c.scoring == "softmax"
    plain = config_from_hf(QWEN3 | {"decoder_sparse_step": 1, "mlp_only_layers": []})
    assert plain.dense_layers is None and plain.first_dense_layers == 0 and plain.num_moe_layers == 6


def test_glm4_moe_partial_rope_biases_and_legacy_rope_fields():
    c = config_from_hf(GLM)
    assert (c.partial_rotary_factor, c.rotary_dim, c.qkv_bias, c.o_bias, c.qk_norm) == (0.5, 8, True, False, True)
    assert (c.rms_eps, c.first_dense_layers, c.shared_hidden, c.mtp_layers, c.dtype) == (1e-5, 1, 16, 1, "bfloat16")
    assert config_from_hf({k: v for k, v in GLM.items() if k != "partial_rotary_factor"}).partial_rotary_factor == 0.5


@pytest.mark.parametrize(
    ("base", "changes", "field"),
    [
        (DEEPSEEK_V3, {"hidden_act": "gelu"}, "hidden_act"),
        (DEEPSEEK_V3, {"topk_method": "group_limited_greedy"}, "topk_method"),
        (DEEPSEEK_V3, {"scoring_func": "softmax"}, "scoring_func"),
        (DEEPSEEK_V3, {"moe_layer_freq": 2}, "moe_layer_freq"),
        (DEEPSEEK_V3, {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
        (DEEPSEEK_V3, {"rope_scaling": {"type": "yarn", "factor": 2.0, "low_freq_factor": 1}}, "rope_scaling"),
        (DEEPSEEK_V3, {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        (DEEPSEEK_V3, {"head_dim": 128}, "head_dim"),
        (DEEPSEEK_V3, {"torch_dtype": "float16"}, "dtype"),
        (DEEPSEEK_V3, {"attention_dropout": 0.1}, "attention_dropout"),
        (DEEPSEEK_V3, {"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}}, "weight_block"),
        (DEEPSEEK_V3, {"quantization_config": {"quant_method": "fp8", "group_size": 4}}, "quantization_config"),
        (DEEPSEEK_V3, {"use_mla_kernel": True}, "use_mla_kernel"),
        (DEEPSEEK_V3, {"model_type": "deepseek_v2"}, "model_type"),
        (DEEPSEEK_V3, {"hidden_size": None}, "hidden_size"),
        (DEEPSEEK_V3, {"qk_rope_head_dim": 63}, "qk_rope_head_dim"),
        (QWEN3, {"use_sliding_window": True}, "use_sliding_window"),
        (QWEN3, {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        (QWEN3, {"num_local_experts": 0}, "num_experts"),
        (QWEN3, {"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "per-layer-type"),
        (QWEN3, {"rope_parameters": {"rope_type": "default", "factor": 2.0}}, "rope_parameters"),
        (GLM, {"pretraining_tp": 2}, "pretraining_tp"),
    ],
)
def test_fields_it_cannot_honour_are_named(base, changes, field):
    with pytest.raises(ValueError, match=field):
        config_from_hf(base | changes)


def test_files(tmp_path):
    with pytest.raises(ValueError, match="no such config file"):
        config_from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        config_from_hf(tmp_path / "config.json")
    (tmp_path / "config.json").write_text(json.dumps(QWEN3))
    assert config_from_hf(tmp_path, dtype="bfloat16", max_seq_len=256).max_seq_len == 256

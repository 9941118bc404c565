"""The config.json of each family's published checkpoint, key for key as users download it (old key names
such as rope_scaling and rope_theta included), and the size fields the tiny checkpoints
shrink. Every value's source is in FAMILIES.md; `tiny_config` is the only place values change.
"""
from __future__ import annotations

import copy

_ESM2 = {"architectures": ["EsmForMaskedLM"], "attention_probs_dropout_prob": 0.0, "classifier_dropout": None,
         "emb_layer_norm_before": False, "esmfold_config": None, "hidden_act": "gelu", "hidden_dropout_prob": 0.0,
         "initializer_range": 0.02, "is_folding_model": False, "layer_norm_eps": 1e-05, "mask_token_id": 32,
         "max_position_embeddings": 1026, "model_type": "esm", "pad_token_id": 1,
         "position_embedding_type": "rotary", "token_dropout": True, "torch_dtype": "float32",
         "transformers_version": "4.25.0.dev0", "use_cache": True, "vocab_list": None, "vocab_size": 33}
_ESM1 = _ESM2 | {"emb_layer_norm_before": True, "position_embedding_type": "absolute", "hidden_size": 1280,
                 "intermediate_size": 5120, "num_attention_heads": 20, "num_hidden_layers": 33}
_T5_XL = {"d_ff": 16384, "d_kv": 128, "d_model": 1024, "decoder_start_token_id": 0, "dropout_rate": 0.1,
          "eos_token_id": 1, "initializer_factor": 1.0, "is_encoder_decoder": True, "layer_norm_epsilon": 1e-06,
          "model_type": "t5", "n_positions": 512, "num_heads": 32, "num_layers": 24, "output_past": True,
          "pad_token_id": 0, "relative_attention_num_buckets": 32, "vocab_size": 128}
_ANKH = {"architectures": ["T5ForConditionalGeneration"], "d_kv": 64, "decoder_start_token_id": 0,
         "dense_act_fn": "gelu_new", "dropout_rate": 0.0, "eos_token_id": 1, "feed_forward_proj": "gated-gelu",
         "initializer_factor": 1.0, "is_encoder_decoder": True, "is_gated_act": True, "layer_norm_epsilon": 1e-06,
         "model_type": "t5", "num_decoder_layers": 24, "num_layers": 48, "pad_token_id": 0,
         "relative_attention_max_distance": 128, "relative_attention_num_buckets": 64,
         "tie_word_embeddings": False, "torch_dtype": "float32", "use_cache": True, "vocab_size": 144}
_PROTBERT = {"architectures": ["BertForMaskedLM"], "attention_probs_dropout_prob": 0.0, "hidden_act": "gelu",
             "hidden_dropout_prob": 0.0, "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 4096,
             "max_position_embeddings": 40000, "num_attention_heads": 16, "num_hidden_layers": 30,
             "type_vocab_size": 2, "vocab_size": 30}
_LLAMA2 = {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
           "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 11008,
           "max_position_embeddings": 4096, "model_type": "llama", "num_attention_heads": 32,
           "num_hidden_layers": 32, "num_key_value_heads": 32, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
           "rope_scaling": None, "tie_word_embeddings": False, "torch_dtype": "float16",
           "transformers_version": "4.31.0.dev0", "use_cache": True, "vocab_size": 32000}
_QWEN_BASE = {"attention_dropout": 0.0, "bos_token_id": 151643, "hidden_act": "silu", "initializer_range": 0.02,
              "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": True,
              "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}

PUBLISHED: dict[str, dict] = {
    "esm2_t6_8m": _ESM2 | {"hidden_size": 320, "intermediate_size": 1280, "num_attention_heads": 20,
                           "num_hidden_layers": 6},
    "esm2_t33_650m": _ESM2 | {"hidden_size": 1280, "intermediate_size": 5120, "num_attention_heads": 20,
                              "num_hidden_layers": 33},
    "esm1b": _ESM1,
    "esm1v": _ESM1,
    "saprot": _ESM2 | {"hidden_size": 1280, "intermediate_size": 5120, "num_attention_heads": 20,
                       "num_hidden_layers": 33, "vocab_size": 446, "mask_token_id": 4},
    "nucleotide_transformer_v1": {
        "architectures": ["EsmForMaskedLM"], "attention_probs_dropout_prob": 0.0, "emb_layer_norm_before": False,
        "esmfold_config": None, "hidden_dropout_prob": 0.0, "hidden_size": 1280, "initializer_range": 0.02,
        "intermediate_size": 5120, "is_folding_model": False, "layer_norm_eps": 1e-12, "mask_token_id": 2,
        "max_position_embeddings": 1002, "model_type": "esm", "num_attention_heads": 20, "num_hidden_layers": 24,
        "pad_token_id": 1, "position_embedding_type": "absolute", "tie_word_embeddings": False,
        "token_dropout": True, "torch_dtype": "float32", "transformers_version": "4.29.0.dev0", "use_cache": False,
        "vocab_list": None, "vocab_size": 4105},
    "prot_t5_xl_u50": _T5_XL | {"architectures": ["T5ForConditionalGeneration"]},
    "prot_t5_xl_half_enc": _T5_XL | {
        "architectures": ["T5EncoderModel"], "dense_act_fn": "relu", "feed_forward_proj": "relu",
        "is_gated_act": False, "num_decoder_layers": 24, "relative_attention_max_distance": 128,
        "torch_dtype": "float16", "transformers_version": "4.25.1", "use_cache": True},
    "prostt5": _T5_XL | {"architectures": ["T5ForConditionalGeneration"], "dense_act_fn": "relu",
                         "feed_forward_proj": "relu", "is_gated_act": False, "num_decoder_layers": 24,
                         "relative_attention_max_distance": 128, "torch_dtype": "float32", "vocab_size": 150},
    "ankh_base": _ANKH | {"d_ff": 3072, "d_model": 768, "num_heads": 12},
    "ankh_large": _ANKH | {"d_ff": 3840, "d_model": 1536, "num_heads": 16},
    "prot_bert": _PROTBERT,
    "prot_bert_bfd": _PROTBERT,
    "llama2": _LLAMA2,
    "llama3": {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
               "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
               "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
               "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
               "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
               "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0,
                                                       "low_freq_factor": 1.0,
                                                       "original_max_position_embeddings": 8192,
                                                       "rope_type": "llama3"},
               "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
               "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256},
    "llama_rope_linear": _LLAMA2 | {"max_position_embeddings": 16384, "rope_scaling": {"factor": 4.0,
                                                                                      "type": "linear"}},
    "llama_rope_dynamic": _LLAMA2 | {"rope_scaling": {"factor": 2.0, "type": "dynamic"}},
    "llama_rope_yarn": _LLAMA2 | {"max_position_embeddings": 65536,
                                  "rope_scaling": {"factor": 16.0, "original_max_position_embeddings": 4096,
                                                   "type": "yarn", "finetuned": True}},
    "llama_rope_longrope": _LLAMA2 | {"max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                                      "rope_scaling": {"type": "longrope", "short_factor": None,
                                                       "long_factor": None}},
    "mistral": {"architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
                "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
                "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
                "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
                "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000},
    "qwen2": _QWEN_BASE | {"architectures": ["Qwen2ForCausalLM"], "eos_token_id": 151643, "hidden_size": 896,
                           "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
                           "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
                           "num_key_value_heads": 2, "sliding_window": 32768, "transformers_version": "4.40.1"},
    "qwen3": _QWEN_BASE | {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "eos_token_id": 151645,
                           "head_dim": 128, "hidden_size": 1024, "intermediate_size": 3072,
                           "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
                           "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
                           "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
                           "transformers_version": "4.51.0"},
    "protgpt2": {"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
                 "bos_token_id": 0, "embd_pdrop": 0.1, "eos_token_id": 0, "initializer_range": 0.02,
                 "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 1280, "n_head": 20,
                 "n_inner": None, "n_layer": 36, "n_positions": 1024, "reorder_and_upcast_attn": False,
                 "resid_pdrop": 0.1, "scale_attn_by_inverse_layer_idx": False, "scale_attn_weights": True,
                 "summary_activation": None, "summary_first_dropout": 0.1, "summary_proj_to_labels": True,
                 "summary_type": "cls_index", "summary_use_proj": True, "torch_dtype": "float32",
                 "use_cache": True, "vocab_size": 50257},
}

_ESM_TINY = {"hidden_size": 32, "intermediate_size": 128, "num_attention_heads": 2, "num_hidden_layers": 2}
_T5_TINY = {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_heads": 4, "num_layers": 2, "num_decoder_layers": 2}
_LM_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
            "num_hidden_layers": 2}
TINY: dict[str, dict] = {
    "esm2_t6_8m": _ESM_TINY,                                                            # head_dim 16, as 8M
    "esm2_t33_650m": _ESM_TINY | {"hidden_size": 128, "intermediate_size": 256},         # head_dim 64, as 650M
    "esm1b": _ESM_TINY | {"hidden_size": 64}, "esm1v": _ESM_TINY | {"hidden_size": 64},
    "saprot": _ESM_TINY | {"hidden_size": 64},
    "nucleotide_transformer_v1": _ESM_TINY | {"num_attention_heads": 4},
    "prot_t5_xl_u50": _T5_TINY, "prot_t5_xl_half_enc": _T5_TINY, "prostt5": _T5_TINY,
    "ankh_base": _T5_TINY, "ankh_large": _T5_TINY | {"d_model": 48, "d_ff": 96, "num_layers": 3},
    "prot_bert": {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2},
    "prot_bert_bfd": {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2},
    "llama2": _LM_TINY,
    "llama3": _LM_TINY | {"head_dim": 16, "num_key_value_heads": 1},
    "llama_rope_linear": _LM_TINY, "llama_rope_dynamic": _LM_TINY, "llama_rope_yarn": _LM_TINY,
    "llama_rope_longrope": _LM_TINY,
    "mistral": _LM_TINY | {"num_key_value_heads": 1},
    "qwen2": _LM_TINY | {"num_key_value_heads": 1, "max_window_layers": 2},
    "qwen3": _LM_TINY | {"head_dim": 32, "num_key_value_heads": 2, "max_window_layers": 2},
    "protgpt2": {"n_embd": 64, "n_head": 4, "n_layer": 2},
}


def tiny_config(name: str) -> dict:
    """The published config of `name` with only its size fields replaced (a deep copy)."""
    config = copy.deepcopy(PUBLISHED[name])
    config.update(copy.deepcopy(TINY[name]))
    if name == "llama_rope_longrope":     # per-frequency factors: one per rotary pair of the shrunk head_dim
        half = config["hidden_size"] // config["num_attention_heads"] // 2
        config["rope_scaling"]["short_factor"] = [1.0 + 0.05 * i for i in range(half)]
        config["rope_scaling"]["long_factor"] = [1.0 + 0.5 * i for i in range(half)]
    return config

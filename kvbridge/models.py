"""Bundled Hugging Face ``config.json`` excerpts of real models.

Only the fields that decide the KV cache are kept; the values are those of the
published configs.  ``KVLayout.for_model(name)`` builds a layout from them, and
``KVLayout.from_hf_config`` accepts any full config.json dict.
"""

from __future__ import annotations

from typing import Any

MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3-8b": {
        "_name_or_path": "meta-llama/Meta-Llama-3-8B",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 32,
        "torch_dtype": "bfloat16",
    },
    "llama-3-70b": {
        "_name_or_path": "meta-llama/Meta-Llama-3-70B",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 8192,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "num_hidden_layers": 80,
        "torch_dtype": "bfloat16",
    },
    "qwen2.5-7b": {
        "_name_or_path": "Qwen/Qwen2.5-7B",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 3584,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "num_hidden_layers": 28,
        "torch_dtype": "bfloat16",
    },
    "deepseek-v3": {
        "_name_or_path": "deepseek-ai/DeepSeek-V3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "hidden_size": 7168,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "num_hidden_layers": 61,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "torch_dtype": "bfloat16",
    },
}

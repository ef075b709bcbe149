"""Config-only model folders with the shapes of real models, for dummy-weight benchmarks.

A benchmark's cost per token depends on the model's shape, not on its weights, so a folder
holding only config.json and a byte-level tokenizer (run with `load_format="dummy"`) measures
what the real model would cost without a download. The vocabulary keeps the real size (it
sets the LM head's cost); token ids above 255 are reserved tokens of the byte tokenizer.
"""

from __future__ import annotations

from typing import Any, Dict

from fulcrum.default_model import cache_root, ensure_config_folder

# Special-token ids of the byte-level tokenizer (<|endoftext|>, <|im_end|>).
_BYTE_TOKENIZER_IDS = {"bos_token_id": 256, "eos_token_id": 258}

SMOLLM2_135M: Dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0, "hidden_act": "silu", "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", **_BYTE_TOKENIZER_IDS,
}

QWEN2_5_0_5B: Dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2,
    "vocab_size": 151936, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "hidden_act": "silu", "tie_word_embeddings": True,
    "use_sliding_window": False, "torch_dtype": "bfloat16", **_BYTE_TOKENIZER_IDS,
}

SHAPES: Dict[str, Dict[str, Any]] = {"smollm2-135m": SMOLLM2_135M, "qwen2.5-0.5b": QWEN2_5_0_5B}
DEFAULT_SHAPE = "smollm2-135m"


def shape_dir(name: str) -> str:
    """Write the folder of shape `name` under $FULCRUM_CACHE/shapes if needed; return its path."""
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; choose from {', '.join(SHAPES)}")
    return ensure_config_folder(cache_root() / "shapes" / name, SHAPES[name])

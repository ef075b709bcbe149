"""Architecture registry: HF `architectures` name -> model class, imported on first use."""

from __future__ import annotations

import importlib
from typing import Any, Dict, Type

from fulcrum.models.layers import DecoderForCausalLM

_REGISTRY = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

SUPPORTED_ARCHITECTURES = tuple(sorted(_REGISTRY))


def model_class(hf_config: Dict[str, Any]) -> Type[DecoderForCausalLM]:
    names = hf_config.get("architectures") or []
    for name in names:
        if name in _REGISTRY:
            module = importlib.import_module(f"fulcrum.models.{_REGISTRY[name]}")
            return getattr(module, name)
    raise ValueError(f"unsupported model architecture {', '.join(names) or '(none given)'}; "
                     f"fulcrum supports: {', '.join(SUPPORTED_ARCHITECTURES)}")

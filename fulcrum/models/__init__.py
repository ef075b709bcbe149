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
    """The class of the config's architecture. A pre-quantized checkpoint (its
    quantization_config) is refused here, before any of its weights are read: they would
    load as floats where no scales are stored, or fail on their scales' names."""
    quantized = hf_config.get("quantization_config")
    if quantized:
        method = quantized.get("quant_method", "unnamed") if isinstance(quantized, dict) \
            else quantized
        raise ValueError(f"pre-quantized checkpoints are not supported (config.json's "
                         f"quantization_config: quant_method {method!r}); load a bf16, fp16 or "
                         f"fp32 checkpoint (quantization='int8' quantizes at load)")
    names = hf_config.get("architectures") or []
    for name in names:
        if name in _REGISTRY:
            module = importlib.import_module(f"fulcrum.models.{_REGISTRY[name]}")
            return getattr(module, name)
    raise ValueError(f"unsupported model architecture {', '.join(names) or '(none given)'}; "
                     f"fulcrum supports: {', '.join(SUPPORTED_ARCHITECTURES)}")

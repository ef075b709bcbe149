"""Qwen3 (dense): Llama's layout with RMSNorm on each head's queries and keys."""

from __future__ import annotations

from typing import Any, Dict

from fulcrum.models.layers import DecoderForCausalLM
from fulcrum.models.spec import DecoderSpec
from fulcrum.models.llama import decoder_spec
from fulcrum.models.qwen2 import reject_sliding_window


class Qwen3ForCausalLM(DecoderForCausalLM):
    @staticmethod
    def spec_from_config(cfg: Dict[str, Any]) -> DecoderSpec:
        reject_sliding_window(cfg)
        return decoder_spec(cfg, qk_norm=True)

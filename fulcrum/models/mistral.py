"""Mistral: Llama's layout with sliding-window attention."""

from __future__ import annotations

from typing import Any, Dict

from fulcrum.models.layers import DecoderForCausalLM
from fulcrum.models.spec import DecoderSpec
from fulcrum.models.llama import decoder_spec


class MistralForCausalLM(DecoderForCausalLM):
    @staticmethod
    def spec_from_config(cfg: Dict[str, Any]) -> DecoderSpec:
        return decoder_spec(cfg, qkv_bias=False, o_proj_bias=False, sliding_window=cfg.get("sliding_window"))

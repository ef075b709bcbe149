"""Qwen2 / Qwen2.5: Llama's layout with biases on the q, k and v projections."""

from __future__ import annotations

from typing import Any, Dict

from fulcrum.models.layers import DecoderForCausalLM
from fulcrum.models.spec import DecoderSpec
from fulcrum.models.llama import decoder_spec


def reject_sliding_window(cfg: Dict[str, Any]) -> None:
    if cfg.get("use_sliding_window"):
        raise ValueError("Qwen models with use_sliding_window=True (per-layer windows) are not "
                         "supported")


class Qwen2ForCausalLM(DecoderForCausalLM):
    @staticmethod
    def spec_from_config(cfg: Dict[str, Any]) -> DecoderSpec:
        reject_sliding_window(cfg)
        return decoder_spec(cfg, qkv_bias=True, o_proj_bias=False)

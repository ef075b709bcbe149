"""Llama (1, 2, 3.x, incl. Llama 3 RoPE scaling): the reference layout the others vary."""

from __future__ import annotations

from typing import Any, Dict

from fulcrum.models.layers import DecoderForCausalLM
from fulcrum.models.spec import DecoderSpec


def rope_settings(cfg: Dict[str, Any]):
    """(theta, scaling) from either transformers 5's `rope_parameters` or the older keys."""
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type", "default") != "default"
                                          else None)
    return float(theta), scaling


def decoder_spec(cfg: Dict[str, Any], **overrides: Any) -> DecoderSpec:
    num_heads = cfg["num_attention_heads"]
    theta, scaling = rope_settings(cfg)
    fields = dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        qkv_bias=cfg.get("attention_bias", False),
        o_proj_bias=cfg.get("attention_bias", False),
        hidden_act=cfg.get("hidden_act", "silu"),
    )
    fields.update(overrides)
    return DecoderSpec(**fields)


class LlamaForCausalLM(DecoderForCausalLM):
    @staticmethod
    def spec_from_config(cfg: Dict[str, Any]) -> DecoderSpec:
        if cfg.get("mlp_bias"):
            raise ValueError("Llama models with mlp_bias=True are not supported")
        return decoder_spec(cfg)

"""Qwen2 / Qwen2.5: Llama's layout with biases on the q, k and v projections."""

from __future__ import annotations

from typing import Any, Dict

from fulcrum.models.layers import DecoderForCausalLM
from fulcrum.models.spec import DecoderSpec
from fulcrum.models.llama import decoder_spec


def reject_sliding_window(cfg: Dict[str, Any]) -> None:
    """Refuse a model whose layers slide: transformers gives layer i a window only where
    use_sliding_window is set and its layer_types (by default: every layer from
    max_window_layers on) say "sliding_attention"."""
    # transformers' default window (4096) where the config names none; null: no window
    if not cfg.get("use_sliding_window") or cfg.get("sliding_window", 4096) is None:
        return
    layers = cfg["num_hidden_layers"]
    kinds = cfg.get("layer_types") or ["sliding_attention" if i >= cfg.get("max_window_layers", 28)
                                       else "full_attention" for i in range(layers)]
    sliding = [i for i, kind in enumerate(kinds) if kind == "sliding_attention"]
    if sliding:
        raise ValueError(f"Qwen models whose layers slide are not supported (per-layer "
                         f"windows): layer {sliding[0]} of {layers} slides (use_sliding_window "
                         f"with max_window_layers={cfg.get('max_window_layers', 28)})")


class Qwen2ForCausalLM(DecoderForCausalLM):
    @staticmethod
    def spec_from_config(cfg: Dict[str, Any]) -> DecoderSpec:
        reject_sliding_window(cfg)
        return decoder_spec(cfg, qkv_bias=True, o_proj_bias=False)

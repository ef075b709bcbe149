"""The shape and options of a Llama-family decoder, read from its HF config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional


@dataclass(frozen=True)
class DecoderSpec:
    """The shape and options of a Llama-family decoder, read from its HF config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[Dict[str, Any]]
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_proj_bias: bool = False
    qk_norm: bool = False
    sliding_window: Optional[int] = None
    hidden_act: str = "silu"

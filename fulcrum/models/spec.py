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

    @property
    def rope_type(self) -> str:
        scaling = self.rope_scaling or {}
        return scaling.get("rope_type", scaling.get("type", "default"))

    @property
    def original_max_positions(self) -> int:
        """The context the model was pretrained on, where a RoPE scaling names one."""
        return int((self.rope_scaling or {}).get("original_max_position_embeddings")
                   or self.max_position_embeddings)

    @property
    def max_context_len(self) -> int:
        """The longest sequence the model serves: max_position_embeddings, stretched by the
        factor of a linear or YaRN RoPE scaling (vLLM's rule: YaRN's from the pretrained
        length; Llama 3's scaling is already counted in max_position_embeddings)."""
        if self.rope_type == "linear":
            return int(self.max_position_embeddings * linear_factor(self))
        if self.rope_type == "yarn":
            return int(self.original_max_positions * yarn_factor(self))
        return self.max_position_embeddings


def linear_factor(spec: DecoderSpec) -> float:
    factor = (spec.rope_scaling or {}).get("factor")
    if not isinstance(factor, (int, float)) or factor <= 0:
        raise ValueError(f"rope_scaling of type 'linear' needs a factor (a positive number), "
                         f"got {factor!r}")
    return float(factor)


def yarn_factor(spec: DecoderSpec) -> float:
    """YaRN's stretch: its `factor`, or where it gives none, max_position_embeddings over the
    pretrained length (transformers' rule)."""
    factor = (spec.rope_scaling or {}).get("factor")
    return float(factor) if factor else spec.max_position_embeddings / spec.original_max_positions

"""Paged attention over a packed, unpadded batch.

A step's tokens are laid out flat: first the single-token queries (decodes, and one-token
prefill tails), then each prefill chunk. Every token's key and value are written into the
paged cache at its slot; then decodes attend in one batched call over their gathered
contexts, and each prefill chunk attends causally to its own tokens and to everything its
request already has cached (earlier chunks, prefix-cache hits).

The metadata is built once per step by the model runner and handed explicitly to every
layer: there is no global attention context. A backend for another device (flash-attn,
flashinfer style kernels on CUDA) implements `AttentionBackend.forward` over the same
metadata.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """One prefill chunk: query rows [q_start, q_end) of the flat batch."""

    q_start: int
    q_end: int
    # Cache slots of the request's whole context after this step, or None when the chunk is
    # the whole context (a fresh prompt): then keys and values are used as computed.
    context_slots: Optional[torch.Tensor]
    # Boolean [chunk, context] mask (True = attend), or None for plain causal attention.
    mask: Optional[torch.Tensor]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] cache slot each new key/value is written to
    num_decodes: int
    decode_slots: Optional[torch.Tensor]  # [num_decodes, max_context] slots, padded
    decode_mask: Optional[torch.Tensor]  # [num_decodes, 1, 1, max_context] True = attend
    prefills: List[PrefillSpan]


class AttentionBackend(ABC):
    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; caches: [blocks, block_size, Hkv, D]. -> [T, Hq, D]"""


class TorchAttentionBackend(AttentionBackend):
    """Portable backend on torch's scaled_dot_product_attention; the CPU default."""

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        k_flat.index_copy_(0, meta.slot_mapping, k)
        v_flat.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        if meta.num_decodes:
            nd = meta.num_decodes
            keys = k_flat[meta.decode_slots].transpose(1, 2)  # [B, Hkv, L, D]
            values = v_flat[meta.decode_slots].transpose(1, 2)
            out[:nd] = F.scaled_dot_product_attention(
                q[:nd].unsqueeze(2), keys, values, attn_mask=meta.decode_mask, scale=scale,
                enable_gqa=True).squeeze(2)
        for span in meta.prefills:
            rows = slice(span.q_start, span.q_end)
            if span.context_slots is None:
                keys, values = k[rows], v[rows]
            else:
                keys, values = k_flat[span.context_slots], v_flat[span.context_slots]
            out[rows] = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                attn_mask=span.mask, is_causal=span.mask is None, scale=scale,
                enable_gqa=True).transpose(0, 1)
        return out

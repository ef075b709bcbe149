"""Paged attention over a packed, unpadded batch.

A step's tokens are laid out flat: first the single-token queries (decodes, and one-token
prefill tails), then each prefill chunk. Every token's key and value are written into the
paged cache at its slot; then decodes attend in one batched call over their gathered
contexts, and each prefill chunk attends causally to its own tokens and to everything its
request already has cached (earlier chunks, prefix-cache hits).

The metadata is built once per step by the model runner and handed explicitly to every
layer: there is no global attention context. On CPU, decodes go through a native kernel
(fulcrum/kernels) that reads the paged cache in place; the torch backend is the portable
fallback. A backend for another device (flash-attn, flashinfer style kernels on CUDA)
implements `AttentionBackend.forward` over the same metadata.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from fulcrum import kernels

logger = logging.getLogger(__name__)


@dataclass
class PrefillSpan:
    """One prefill chunk: query rows [q_start, q_end) of the flat batch."""

    q_start: int
    q_end: int
    # Cache slots of the request's whole context after this step, or None when the chunk is
    # the whole context (a fresh prompt): then keys and values are used as computed (rounded
    # to the cache's dtype, as a chunk reading them back would find them).
    context_slots: Optional[torch.Tensor]
    # Boolean [chunk, context] mask (True = attend), or None for plain causal attention.
    mask: Optional[torch.Tensor]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] cache slot each new key/value is written to
    # Every sequence of the step, in row order: [num_seqs, max_blocks] null-padded tables,
    # [num_seqs + 1] first query row of each, [num_seqs] context length after this step.
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_decodes: int
    # What backends that split decodes from prefills need (see `AttentionBackend.splits`).
    decode_block_tables: Optional[torch.Tensor] = None  # [num_decodes, max_blocks]
    decode_context_lens: Optional[torch.Tensor] = None  # [num_decodes] tokens to attend to
    decode_mask: Optional[torch.Tensor] = None  # [num_decodes, 1, 1, max_blocks * block_size]
    prefills: List[PrefillSpan] = field(default_factory=list)
    sliding_window: int = 0  # 0: none


def key_slots(k_cache: torch.Tensor) -> torch.Tensor:
    """The key cache [blocks, kv_heads, head_dim, block_size] seen as [blocks, block_size,
    kv_heads, head_dim], the value cache's layout, so both index alike by (block, offset).

    Keys are stored head_dim-major within a block so that a decode kernel computes a block's
    scores as contiguous vector operations over its tokens."""
    return k_cache.permute(0, 3, 1, 2)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the step's new keys and values at their cache slots."""
    block_size = v_cache.shape[1]
    key_slots(k_cache)[slot_mapping // block_size, slot_mapping % block_size] = \
        k.to(k_cache.dtype)
    v_cache.view(-1, v_cache.shape[2], v_cache.shape[3]).index_copy_(0, slot_mapping,
                                                                     v.to(v_cache.dtype))


class AttentionBackend(ABC):
    # Whether decodes read padding slots and mask them out: then the runner builds
    # decode_mask and the cache is zeroed, since masked garbage could still be NaN.
    reads_padding = True
    # Whether decodes and prefill chunks are attended separately: then the runner builds
    # the decode_* fields and one PrefillSpan (context slots, mask) per chunk.
    splits = True

    def cache_shapes(self, num_blocks: int, block_size: int, num_kv_heads: int,
                     head_dim: int) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        """(key, value) cache tensor shapes: keys [blocks, kv_heads, head_dim, block_size]
        (see `key_slots`), values [blocks, block_size, kv_heads, head_dim]."""
        return ((num_blocks, num_kv_heads, head_dim, block_size),
                (num_blocks, block_size, num_kv_heads, head_dim))

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; caches as in `key_slots`. -> [T, Hq, D]"""


class TorchAttentionBackend(AttentionBackend):
    """Portable backend on torch's scaled_dot_product_attention (any device, any dtype)."""

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        block_size = v_cache.shape[1]
        v_flat = v_cache.view(-1, v_cache.shape[2], v_cache.shape[3])
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        if meta.num_decodes:
            out[:meta.num_decodes] = self.decode(q[:meta.num_decodes], k_cache, v_cache, meta,
                                                 scale)
        for span in meta.prefills:
            rows = slice(span.q_start, span.q_end)
            if span.context_slots is None:
                keys, values = _as_stored(k[rows], k_cache), _as_stored(v[rows], v_cache)
            else:
                slots = span.context_slots
                keys = key_slots(k_cache)[slots // block_size, slots % block_size].to(q.dtype)
                values = v_flat[slots].to(q.dtype)
            # 4-D inputs: torch's CPU flash-attention kernel takes only those (3-D falls back
            # to the unfused math path, 2-3x slower).
            out[rows] = F.scaled_dot_product_attention(
                _heads_first(q[rows]), _heads_first(keys), _heads_first(values),
                attn_mask=span.mask, is_causal=span.mask is None, scale=scale,
                enable_gqa=True)[0].transpose(0, 1)
        return out

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Single-token queries: gather whole context blocks, one batched SDPA call."""
        tables = meta.decode_block_tables
        num_seqs, num_blocks = tables.shape
        _, block_size, num_kv_heads, head_dim = v_cache.shape
        keys = key_slots(k_cache.index_select(0, tables.flatten())).reshape(
            num_seqs, num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)
        values = v_cache.index_select(0, tables.flatten()).view(
            num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        return F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask, scale=scale,
            enable_gqa=True).squeeze(2)


def _as_stored(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Keys or values as a later chunk reading them back from `cache` finds them (rounded, if
    its dtype holds them inexactly), so that a prompt's numbers do not depend on its
    chunking. A wider cache holds them exactly; bf16 and fp16 hold each other's inexactly."""
    if cache.dtype == x.dtype or cache.element_size() > x.element_size():
        return x
    return x.to(cache.dtype).to(x.dtype)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, dim] -> [1, heads, tokens, dim]."""
    return x.transpose(0, 1).unsqueeze(0)


class CpuPagedAttentionBackend(TorchAttentionBackend):
    """Decodes through fulcrum's native paged-attention kernel, which reads keys and values
    in place from the block tables; prefill chunks as in the torch backend."""

    reads_padding = False

    def decode(self, q, k_cache, v_cache, meta, scale):
        return kernels.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables,
                                              meta.decode_context_lens, scale,
                                              meta.sliding_window)


class CpuVarlenAttentionBackend(AttentionBackend):
    """bf16 on AVX512-BF16 or AVX2 CPUs: all of a step's query tokens, decodes and prefill chunks
    alike, in one native call that reads keys and values in place from the block tables.
    No context is gathered and no mask is built, so a chunk costs the same whether its
    context came from this prompt's earlier chunks or from the prefix cache. Its cache is
    stored in the dot-product instruction's pair layout (`kernels.varlen_cache_shapes`), so
    the rearranging happens once per token written, not once per token read each step."""

    reads_padding = False
    splits = False

    def cache_shapes(self, num_blocks, block_size, num_kv_heads, head_dim):
        return kernels.varlen_cache_shapes(num_blocks, block_size, num_kv_heads, head_dim)

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        kernels.write_kv_bf16(k, v, k_cache, v_cache, meta.slot_mapping)
        return kernels.paged_varlen_attention(q, k_cache, v_cache, meta.block_tables,
                                              meta.query_start_loc, meta.seq_lens, scale,
                                              meta.sliding_window)


def make_backend(device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype,
                 group_size: int, head_dim: int, block_size: int) -> AttentionBackend:
    """The fastest backend that handles this device, dtypes and shape."""
    if device.type != "cpu":
        return TorchAttentionBackend()
    if kernels.supports_varlen(dtype, cache_dtype, group_size, head_dim, block_size):
        return CpuVarlenAttentionBackend()
    if kernels.supports_varlen(dtype, cache_dtype, group_size, head_dim,
                               kernels.VARLEN_BLOCK_SIZE):
        _warn_block_size_off_the_kernel(block_size)
    if kernels.supports(dtype, cache_dtype, group_size, head_dim, block_size):
        return CpuPagedAttentionBackend()
    return TorchAttentionBackend()


def _warn_block_size_off_the_kernel(block_size: int) -> None:
    """A bf16 model the varlen kernel would take but for `block_size` (vLLM's CPU backend
    defaults to 128 with IPEX) runs attention in torch and each layer's kernels from Python:
    a 4-layer bf16 Llama's decode steps at batch 4 took 3.6x and 5.7x as long at
    block_size=128 as at 16, in two runs. Say so at start, with the size that runs it."""
    logger.warning("block_size=%d: the bf16 attention kernel and the one-call decoder stack "
                   "take blocks of %d tokens, so this model runs a slower path (decode steps "
                   "several times as long); block_size=%d runs them", block_size,
                   kernels.VARLEN_BLOCK_SIZE, kernels.VARLEN_BLOCK_SIZE)

"""How many KV blocks fit, and the per-layer tensors that hold them.

On CUDA, `gpu_memory_utilization` is vLLM's: the fraction of the device's memory fulcrum
may use in all; the KV cache gets what is left of it after the weights and activations.
On CPU there is no device memory to share, so it means the fraction of the RAM available
when the engine starts (after the weights are loaded; within a container's memory limit,
see memory.py) that the KV cache may take, capped at `CPU_KV_CACHE_CAP_BYTES` (4 GiB, as
vLLM's CPU backend defaults to) and at what `max_num_seqs` requests of `max_model_len`
tokens could ever use. `kv_cache_memory_bytes`
sets the size exactly and overrides both.

Layouts (see attention.py): keys [blocks, kv_heads, head_dim, block_size], values
[blocks, block_size, kv_heads, head_dim].

Block 0 is the null block: it is zeroed, never handed to a request, and padded block-table
entries point at it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, List, Optional

import torch

from fulcrum import kernels
from fulcrum.models.attention import AttentionBackend
from fulcrum.config import EngineConfig
from fulcrum.models.layers import KVCache
from fulcrum.models.spec import DecoderSpec
from fulcrum.worker.memory import available_cpu_memory

if TYPE_CHECKING:
    from fulcrum.distributed.group import ParallelGroup

logger = logging.getLogger(__name__)

CPU_KV_CACHE_CAP_BYTES = 4 << 30
NULL_BLOCK = 0


def bytes_per_block(spec: DecoderSpec, block_size: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * itemsize


def ranks_sharing_ram(group: Optional["ParallelGroup"]) -> int:
    """How many ranks, this one included, size and allocate their caches from this
    machine's RAM at the same time (each before any has allocated)."""
    return group.world_size if group is not None and group.same_host else 1


def kv_cache_bytes(config: EngineConfig, device: torch.device, sharing: int = 1) -> int:
    """This rank's cache size; on CPU, its share of the fraction of the RAM available, which
    `sharing` ranks on this machine divide (each took it all: together, a multiple of it)."""
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        # Leave room for activations of a full-budget step (a rough, conservative 10%).
        return int(total * config.gpu_memory_utilization - used - 0.1 * total)
    budget = int(available_cpu_memory() * config.gpu_memory_utilization) // sharing
    return min(budget, CPU_KV_CACHE_CAP_BYTES)


def num_kv_blocks(config: EngineConfig, spec: DecoderSpec, dtype: torch.dtype,
                  device: torch.device, group: Optional["ParallelGroup"] = None) -> int:
    """Blocks for the cache, the null block included; with a tensor-parallel `group`, the
    fewest that fit on any of its ranks (one block table serves them all)."""
    sharing = ranks_sharing_ram(group)
    if config.num_gpu_blocks_override is not None:
        num_blocks = config.num_gpu_blocks_override
    else:
        num_blocks = kv_cache_bytes(config, device, sharing) // bytes_per_block(
            spec, config.block_size, dtype)
        if config.kv_cache_memory_bytes is None:
            most_ever_used = config.max_num_seqs * -(-config.max_model_len // config.block_size)
            num_blocks = min(num_blocks, most_ever_used + 1)
    if device.type == "cpu":
        _check_fits_in_ram(num_blocks, num_blocks * bytes_per_block(spec, config.block_size, dtype),
                           sharing)
    if group is not None:
        num_blocks = group.min_int(num_blocks)
    usable = num_blocks - 1
    if usable * config.block_size < config.max_model_len:
        knob = (f"num_gpu_blocks_override={num_blocks}, the null block included"
                if config.num_gpu_blocks_override is not None
                else "kv_cache_memory_bytes / gpu_memory_utilization")
        raise ValueError(
            f"the KV cache holds {max(usable, 0) * config.block_size} tokens "
            f"({max(usable, 0)} blocks of {config.block_size}), fewer than max_model_len="
            f"{config.max_model_len}: one full-length request could never fit. Give the cache "
            f"more blocks ({knob}) or lower max_model_len.")
    logger.info("KV cache: %d blocks of %d tokens (%.1f MiB); max concurrency at %d tokens per "
                "request: %.1fx", usable, config.block_size,
                num_blocks * bytes_per_block(spec, config.block_size, dtype) / 2**20,
                config.max_model_len, usable * config.block_size / config.max_model_len)
    return num_blocks


def _check_fits_in_ram(num_blocks: int, nbytes: int, sharing: int = 1) -> None:
    """The cache is zeroed (committed) at once: one larger than the RAM available would get
    the process killed, or fail deep in an allocation. `nbytes` is this rank's share, which
    each of the `sharing` ranks on this machine allocates."""
    available = available_cpu_memory()
    if nbytes * sharing > available:
        ranks = f" on each of {sharing} ranks" if sharing > 1 else ""
        raise ValueError(f"a KV cache of {num_blocks} blocks would take {nbytes / 2**30:.1f} GiB"
                         f"{ranks}, more than the {available / 2**30:.1f} GiB of RAM available: "
                         "lower kv_cache_memory_bytes or num_gpu_blocks_override")


def allocate_kv_caches(spec: DecoderSpec, num_blocks: int, block_size: int,
                       dtype: torch.dtype, device: torch.device,
                       backend: AttentionBackend) -> List[KVCache]:
    """Per-layer (key, value) tensors in the backend's layout, zeroed. Zeroing commits the
    whole cache's memory now, as vLLM reserves its cache on a GPU: with unzeroed memory the
    OS would commit pages only as blocks are first used, so a server's memory would creep up
    under load for hours (and could then be killed for it) instead of being what it will
    ever use from the start."""
    k_shape, v_shape = backend.cache_shapes(num_blocks, block_size, spec.num_kv_heads,
                                            spec.head_dim)
    if device.type == "cpu":  # huge pages: attention reads blocks all over the cache
        tensors = [t.zero_() for t in kernels.huge_page_tensors(
            [(k_shape, dtype), (v_shape, dtype)] * spec.num_layers)]
        return list(zip(tensors[::2], tensors[1::2]))
    return [(torch.zeros(k_shape, dtype=dtype, device=device),
             torch.zeros(v_shape, dtype=dtype, device=device)) for _ in range(spec.num_layers)]

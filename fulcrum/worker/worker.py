"""One rank's share of the model: its weights, its KV cache and the model runner over them.

The driver's worker (rank 0) lives in the engine's process and samples. Under tensor
parallelism the other ranks' workers live in their own processes (spawned, Ray actors, or
torchrun's) and follow the driver step by step: each step they receive a `StepInput` (the
chunks' tokens and the blocks allocated since the last step, never the scheduler's objects),
run the same forward pass on their share, and take part in its collectives.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch

from fulcrum.models.attention import make_backend
from fulcrum.config import EngineConfig
from fulcrum.worker.kv_cache import allocate_kv_caches, num_kv_blocks
from fulcrum.worker.model_loader import load_model
from fulcrum.worker.model_runner import ChunkInput, ModelRunner, step_order
from fulcrum.models import model_class
from fulcrum.models.sharding import Shard
from fulcrum.core.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from fulcrum.distributed.group import ParallelGroup

logger = logging.getLogger(__name__)


@dataclass
class WorkerConfig:
    """Everything a rank needs to build its share (picklable: it travels to other ranks)."""

    config: EngineConfig  # resolved
    model_dir: str
    load_format: str
    hf_config: Dict[str, Any]
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    device: str  # "cpu" or "cuda"


class Worker:
    def __init__(self, wc: WorkerConfig, group: Optional["ParallelGroup"] = None) -> None:
        config = wc.config
        self.group = group
        rank = group.rank if group else 0
        # A rank's device is its group's (mp: cuda:<rank>; torchrun: the local rank's; a
        # Ray actor sees its one GPU as cuda:0).
        self.device = group.device if group else torch.device(wc.device)
        spec = model_class(wc.hf_config).spec_from_config(wc.hf_config)
        local = Shard(rank, group.world_size if group else 1, spec).local_spec
        backend = make_backend(self.device, wc.dtype, wc.kv_cache_dtype,
                               local.num_heads // local.num_kv_heads, local.head_dim,
                               config.block_size)
        model = load_model(wc.model_dir, wc.hf_config, wc.dtype, self.device, backend,
                           wc.load_format, config.seed, config.quantization, group)
        self.num_blocks = num_kv_blocks(config, model.spec, wc.kv_cache_dtype, self.device,
                                        group)
        caches = allocate_kv_caches(model.spec, self.num_blocks, config.block_size,
                                    wc.kv_cache_dtype, self.device, backend)
        self.runner = ModelRunner(model, caches, config.block_size, self.device,
                                  config.sampling_seed, backend)

    def follow_driver(self) -> None:
        """A non-driver rank's life: run each step the driver broadcasts until it sends
        None (shut down)."""
        tables: Dict[str, List[int]] = {}
        while True:
            step: Optional[StepInput] = self.group.broadcast_object()
            if step is None:
                return
            step.apply_to(tables)
            self.runner.follow(step.chunks)


@dataclass
class StepInput:
    """What crosses from the driver to the other ranks each step (pickled, broadcast)."""

    chunks: List[ChunkInput]  # in the runner's row order
    dropped: List[str] = field(default_factory=list)  # requests that finished or were preempted

    def apply_to(self, tables: Dict[str, List[int]]) -> None:
        """Bring a rank's block tables up to date and give each chunk its request's."""
        for request_id in self.dropped:
            tables.pop(request_id, None)
        for chunk in self.chunks:
            table = tables.setdefault(chunk.request_id, [])
            table.extend(chunk.new_blocks)
            chunk.block_table = table


class StepInputBuilder:
    """The driver's side of the block tables the other ranks keep: what each already has,
    so a step sends only the blocks allocated since (tables only ever grow; a preempted
    request starts over)."""

    def __init__(self) -> None:
        self._sent: Dict[str, int] = {}
        self._dropped: List[str] = []

    def build(self, output: SchedulerOutput) -> Optional[StepInput]:
        """The step's message, or None for a step with nothing to compute (dropped requests
        then wait for the next message)."""
        for request_id in (*output.finished_request_ids, *output.preempted_request_ids):
            if self._sent.pop(request_id, None) is not None:
                self._dropped.append(request_id)
        if output.is_empty:
            return None
        chunks = []
        for chunk in step_order(output.chunks):
            sent = self._sent.get(chunk.request_id, 0)
            table = chunk.block_table
            self._sent[chunk.request_id] = len(table)
            chunks.append(ChunkInput(chunk.request_id, chunk.token_ids, chunk.start_pos,
                                     table[sent:], chunk.sample,
                                     chunk.num_prompt_logprob_targets,
                                     chunk.prompt_logprob_row))
        step = StepInput(chunks, self._dropped)
        self._dropped = []
        return step

"""The engine: add requests, step, collect outputs. Everything above it builds on these calls.

Data flows one way through a step: scheduler -> model runner (forward + sampler) ->
scheduler bookkeeping -> output processor -> caller.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time
from typing import Any, Deque, Dict, Iterable, List, Optional, Sequence, Union

import torch

from fulcrum.attention import make_backend
from fulcrum.block_manager import BlockManager
from fulcrum.config import EngineConfig
from fulcrum.default_model import default_model_dir
from fulcrum.kv_cache import allocate_kv_caches, num_kv_blocks
from fulcrum.model_loader import load_hf_config, load_model, resolve_dtype
from fulcrum.models import model_class
from fulcrum.model_runner import ModelRunner
from fulcrum.output_processor import OutputProcessor
from fulcrum.outputs import RequestOutput
from fulcrum.request import Request, RequestStatus
from fulcrum.sampling_params import SamplingParams
from fulcrum.scheduler import Scheduler
from fulcrum.stats import StepStats
from fulcrum.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

PromptType = Union[str, List[int], Dict[str, Any]]
STATS_HISTORY = 100_000


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        model_dir = config.model
        load_format = config.load_format
        if model_dir is None:
            model_dir, load_format = default_model_dir(), "dummy"
        hf_config = load_hf_config(model_dir)
        self.model_dir = model_dir
        self.config = config.resolve(hf_config.get("max_position_embeddings", 2048))
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, hf_config)
        torch.manual_seed(config.seed)
        self.tokenizer = Tokenizer(config.tokenizer or model_dir)
        self.kv_cache_dtype = (self.dtype if config.kv_cache_dtype == "auto"
                               else resolve_dtype(config.kv_cache_dtype, hf_config))
        spec = model_class(hf_config).spec_from_config(hf_config)
        backend = make_backend(self.device, self.dtype, self.kv_cache_dtype,
                               spec.num_heads // spec.num_kv_heads, spec.head_dim,
                               self.config.block_size)
        model = load_model(model_dir, hf_config, self.dtype, self.device, backend, load_format,
                           config.seed)
        self.vocab_size = model.spec.vocab_size
        num_blocks = num_kv_blocks(self.config, model.spec, self.kv_cache_dtype, self.device)
        caches = allocate_kv_caches(model.spec, num_blocks, self.config.block_size,
                                    self.kv_cache_dtype, self.device, backend)
        self.block_manager = BlockManager(num_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.config, self.block_manager)
        self.runner = ModelRunner(model, caches, self.config.block_size, self.device,
                                  config.seed, backend)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stats: Deque[StepStats] = collections.deque(maxlen=STATS_HISTORY)
        self._aborted_children: List[str] = []
        self._step_counter = itertools.count()
        self._request_counter = itertools.count()

    @classmethod
    def from_engine_args(cls, **kwargs: Any) -> "LLMEngine":
        return cls(EngineConfig(**kwargs))

    # ---------------------------------------------------------------- requests
    def tokenize_prompt(self, prompt: PromptType) -> tuple:
        """(text or None, token ids) for a string, a token-id list or vLLM's prompt dicts."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise TypeError(f"a prompt must be a string, a list of token ids or a dict, "
                        f"got {type(prompt).__name__}")

    def validate_prompt(self, token_ids: Sequence[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty: it must contain at least one token")
        limit = self.config.max_model_len
        if len(token_ids) > limit:
            raise ValueError(f"the prompt is {len(token_ids)} tokens long, more than the maximum "
                             f"model length of {limit} tokens")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of vocabulary (valid ids are 0.."
                             f"{self.vocab_size - 1})")

    def add_request(self, request_id: Optional[str], prompt: PromptType,
                    params: Optional[SamplingParams] = None, arrival_time: Optional[float] = None,
                    priority: int = 0) -> str:
        """Queue a request; raises ValueError/TypeError (and queues nothing) on bad input."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        if not isinstance(priority, int):
            raise TypeError("priority must be an integer")
        if request_id is None:
            request_id = str(next(self._request_counter))
        child_ids = [request_id] if params.n == 1 else [f"{i}_{request_id}"
                                                        for i in range(params.n)]
        taken = [i for i in [request_id, *child_ids] if self.output_processor.has_request(i)
                 or i in self.scheduler.requests]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        self.validate_prompt(token_ids)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        room = self.config.max_model_len - len(token_ids)
        max_tokens = max(1, min(params.max_tokens or room, room))
        children = []
        for index, child_id in enumerate(child_ids):
            child_params = params if params.n == 1 else _child_params(params, index)
            children.append(Request(child_id, token_ids, child_params,
                                    self.tokenizer.eos_token_ids, text, priority, arrival,
                                    max_tokens))
        self.output_processor.add_request(request_id, text, children)
        for child in children:
            self.scheduler.add_request(child)
        return request_id

    def abort_request(self, request_ids: Union[str, Iterable[str]]) -> None:
        """Stop requests now and free their KV blocks; the next step reports them as 'abort'."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            child_ids = self.output_processor.child_ids(request_id)
            done = self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
            self._aborted_children.extend(r.request_id for r in done)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._aborted_children)

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    # -------------------------------------------------------------------- step
    def step(self) -> List[RequestOutput]:
        start_wall = time.monotonic()
        start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        sampled = self.runner.execute(scheduled)
        self.scheduler.update_from_output(scheduled, sampled)
        stopped = self.output_processor.process_tokens(sampled)
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        touched = list(sampled) + self._aborted_children
        self._aborted_children = []
        outputs = self.output_processor.make_outputs(touched)
        self._record_stats(scheduled, start_wall, time.perf_counter() - start)
        return outputs

    def _record_stats(self, scheduled, start_wall: float, wall: float) -> None:
        sched = self.scheduler.stats()
        self.stats.append(StepStats(
            step=next(self._step_counter), start_time=start_wall, wall_seconds=wall,
            forward_seconds=self.runner.last_forward_seconds if not scheduled.is_empty else 0.0,
            num_prefill_tokens=scheduled.num_prefill_tokens,
            num_decode_tokens=scheduled.num_decode_tokens,
            num_running=sched.num_running, num_waiting=sched.num_waiting,
            num_preempted=len(scheduled.preempted_request_ids),
            num_preemptions_total=sched.num_preemptions_total,
            kv_blocks_used=sched.kv_blocks_used, kv_blocks_total=sched.kv_blocks_total,
            kv_cache_usage=sched.kv_cache_usage,
            prefix_cache_queries=sched.prefix_cache_queries,
            prefix_cache_hits=sched.prefix_cache_hits))

    @property
    def last_step_stats(self) -> Optional[StepStats]:
        return self.stats[-1] if self.stats else None


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The sampling parameters of completion `index` of an n > 1 request."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)

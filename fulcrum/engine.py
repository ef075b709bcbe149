"""The engine: add requests, step, collect outputs. Everything above it builds on these calls.

Data flows one way through a step: scheduler -> model runner (forward + sampler) ->
scheduler bookkeeping -> output processor -> caller.
"""

from __future__ import annotations

import collections
import collections.abc
import concurrent.futures
import dataclasses
import itertools
import logging
import math
import numbers
import threading
import time
from typing import (TYPE_CHECKING, Any, Deque, Dict, Iterable, List, Optional,
                    Sequence, Union)

import numpy as np
import torch

from fulcrum.core.block_manager import BlockManager
from fulcrum.config import EngineConfig
from fulcrum.default_model import default_model_dir
from fulcrum.generation_config import generation_config_folder, load_generation_defaults
from fulcrum.executor import ExecutorError, make_executor
from fulcrum.worker.memory import in_this_ram
from fulcrum.worker.model_loader import check_weights_fit_in_ram, load_hf_config, resolve_dtype
from fulcrum.models import model_class
from fulcrum.models.sharding import Shard
from fulcrum.worker.model_runner import ModelRunner, StepResult
from fulcrum.output_processor import OutputProcessor
from fulcrum.outputs import RequestFault, RequestOutput
from fulcrum.core.request import Request, RequestStatus, SloTargets
from fulcrum.sampling_params import SEED_MAX, SEED_MIN, ParamError, SamplingParams, is_int
from fulcrum.core.scheduler import Scheduler
from fulcrum.core.scheduling_policy import derived_targets
from fulcrum.stats import FinishedRequest, StepStats
from fulcrum.core.step_time_model import StepTimeModel
from fulcrum.tokenizer import Tokenizer
from fulcrum.worker.worker import WorkerConfig

if TYPE_CHECKING:
    from fulcrum.structured_output import GrammarCompiler

logger = logging.getLogger(__name__)

PromptType = Union[str, List[int], Dict[str, Any]]
STATS_HISTORY = 100_000
FINISHED_HISTORY = 10_000
# Normalizers may change a text's length a little before it is split into tokens.
TEXT_SLACK = 2
# The keys of vLLM's TextPrompt / TokensPrompt dicts that fulcrum reads (others, such as
# multi_modal_data, are refused rather than dropped).
PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")
# A step with nothing to run while grammars compile waits this long for one to finish.
GRAMMAR_WAIT_S = 0.05


def resolve_device(device: str) -> torch.device:
    """'auto': CUDA where this machine and this build of torch have it, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: fulcrum runs on 'cpu', 'cuda' (or 'cuda:N') "
                         f"or 'auto'")
    if resolved.type == "cuda" and not (
            torch.cuda.is_available() and (resolved.index or 0) < torch.cuda.device_count()):
        raise ValueError(f"device {device!r}: no such CUDA device here (this build of torch "
                         f"sees {torch.cuda.device_count()})")
    return resolved


class LLMEngine:
    def __init__(self, config: EngineConfig, served: bool = False) -> None:
        """`served`: an AsyncLLM (the server) drives it, and bounds its queue by
        max_queued_requests; any other caller queues all it is given, so there that
        setting would change nothing and is refused."""
        if config.max_queued_requests is not None and not served:
            raise ValueError("max_queued_requests is a server setting (fulcrum serve bounds "
                             "its waiting requests with it): offline, LLM and the engine queue "
                             "every request they are given")
        model_dir = config.model
        load_format = config.load_format
        if model_dir is None:
            model_dir, load_format = default_model_dir(), "dummy"
        hf_config = load_hf_config(model_dir)
        self._shut_down = False
        self.model_dir = model_dir
        spec = model_class(hf_config).spec_from_config(hf_config)
        self.config = config.resolve(spec.max_context_len)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, hf_config)
        torch.manual_seed(config.seed)
        self.tokenizer = Tokenizer(config.tokenizer or model_dir,
                                   generation_config_folder(config.generation_config, model_dir))
        # Sampling defaults of the model's own (for fields a request leaves unset).
        self.generation_defaults = load_generation_defaults(config.generation_config, model_dir)
        self.kv_cache_dtype = (self.dtype if config.kv_cache_dtype == "auto"
                               else resolve_dtype(config.kv_cache_dtype, hf_config))
        Shard(0, self.config.tensor_parallel_size, spec)  # refuses a split before any rank starts
        self.vocab_size = spec.vocab_size
        if in_this_ram(self.device.type, self.config.distributed_executor_backend):
            check_weights_fit_in_ram(hf_config, self.dtype)
        self.executor = make_executor(WorkerConfig(
            self.config, model_dir, load_format, hf_config, self.dtype, self.kv_cache_dtype,
            self.device.type))
        self.block_manager = BlockManager(self.executor.num_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching)
        self.step_time = StepTimeModel()
        self.scheduler = Scheduler(self.config, self.block_manager, self.step_time)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stats: Deque[StepStats] = collections.deque(maxlen=STATS_HISTORY)
        # Requests that ran their course, newest last (the dashboard's latency window).
        self.recent_finished: Deque[FinishedRequest] = collections.deque(maxlen=FINISHED_HISTORY)
        self._aborted_children: List[str] = []
        self._grammar_compiler: Optional[GrammarCompiler] = None
        self._grammar_lock = threading.Lock()
        self._compiling: List[Request] = []  # requests whose grammar is not ready yet
        self._step_counter = itertools.count()
        self._request_counter = itertools.count()
        self.slo_defaults = SloTargets()
        self._profiled_prompt_s = 0.0  # the longest prompt step the profile measured
        if self.config.scheduling_policy == "slo":
            self._profile_step_time()
        self.slo_defaults = self._resolve_slo_defaults()
        self.scheduler.policy.expect_arrivals(self.slo_defaults)
        # When it could first take requests (time.monotonic()): rates over a recent window
        # (the dashboard's throughput) cover no time before it.
        self.ready_time = time.monotonic()

    @classmethod
    def from_engine_args(cls, **kwargs: Any) -> "LLMEngine":
        return cls(EngineConfig(**kwargs))

    @property
    def runner(self) -> ModelRunner:
        """The driver's model runner (rank 0's, in this process)."""
        return self.executor.runner

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, if any (requests in flight are dropped).
        The engine takes no request and runs no step after it, whatever its executor."""
        self._shut_down = True
        self.executor.shutdown()

    def _check_running(self) -> None:
        if self._shut_down:
            raise RuntimeError("this engine was shut down")

    # ---------------------------------------------------------- step-time model
    def _profile_step_time(self) -> None:
        """Seed the step-time model with a few real steps: a full-budget prompt, a batch of
        short ones, their decodes. Run twice, learning from the second run only (the first
        pays for one-time costs: allocations, kernel builds); then the engine is as new."""
        for _ in range(2):
            self.step_time.reset()
            self.stats.clear()
            self.block_manager.reset_prefix_cache()  # the second run must compute its prompts too
            for request_id, prompt, max_tokens in self._profile_requests():
                self.add_request(request_id, {"prompt_token_ids": prompt},
                                 SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                ignore_eos=True))
            while self.has_unfinished_requests():
                self.step()
        self._profiled_prompt_s = max((s.wall_seconds for s in self.stats
                                       if s.num_prefill_tokens), default=0.0)
        self.step_time.anchor_here()
        self.block_manager.reset_prefix_cache()
        self.stats.clear()
        self.recent_finished.clear()
        self._step_counter = itertools.count()
        self.scheduler.reset_counters()

    def _profile_requests(self) -> List[tuple]:
        """Steps of every kind the model must tell apart: a full-budget prompt; a quarter-
        budget prompt beside short ones and a decode; decode batches of several sizes (the
        short ones end one after another); a request decoding alone."""
        config = self.config
        room = config.max_model_len
        long_len = max(1, min(config.max_num_batched_tokens, room - 8))
        short_len = max(1, min(16, room - 5))
        count = max(1, min(8, config.max_num_seqs - 2, config.max_num_batched_tokens // short_len))
        ids = itertools.count(1)
        tokens = lambda n: [next(ids) % self.vocab_size for _ in range(n)]  # noqa: E731
        outputs = lambda n, wanted: max(1, min(wanted, room - n))  # noqa: E731
        medium_len = max(1, long_len // 4)
        return ([("fulcrum-profile-long", tokens(long_len), outputs(long_len, 8)),
                 ("fulcrum-profile-medium", tokens(medium_len), outputs(medium_len, 2))]
                + [(f"fulcrum-profile-{i}", tokens(short_len), outputs(short_len, 2 + i % 4))
                   for i in range(count)])

    def _resolve_slo_defaults(self) -> SloTargets:
        """The targets of requests that set none: the configured ones, else those the step
        time predicts (`derived_targets`)."""
        config = self.config
        derived = derived_targets(self.step_time, config.max_num_batched_tokens,
                                  self._profiled_prompt_s)
        return SloTargets(
            config.slo_ttft_ms / 1e3 if config.slo_ttft_ms is not None else derived.ttft_s,
            config.slo_tpot_ms / 1e3 if config.slo_tpot_ms is not None else derived.tpot_s)

    def slo_targets(self, params: SamplingParams) -> SloTargets:
        defaults = self.slo_defaults
        return SloTargets(
            params.slo_ttft_ms / 1e3 if params.slo_ttft_ms is not None else defaults.ttft_s,
            params.slo_tpot_ms / 1e3 if params.slo_tpot_ms is not None else defaults.tpot_s)

    # ------------------------------------------------------- structured outputs
    @property
    def grammar_compiler(self) -> "GrammarCompiler":
        """Built with the first constrained request (xgrammar and the vocabulary's byte
        table cost about a second, which unconstrained users never pay)."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                from fulcrum.structured_output import GrammarCompiler
                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size)
            return self._grammar_compiler

    def _grammar_failures(self) -> Dict[str, str]:
        """Requests whose grammar failed to compile (they fail; the rest wait or run)."""
        failures = {r.request_id: r.grammar.error for r in self._compiling if r.grammar.error}
        self._compiling = [r for r in self._compiling
                           if not r.is_finished and not r.ready and r.request_id not in failures]
        return failures

    def _wait_for_grammars(self) -> None:
        futures = [r.grammar.future for r in self._compiling]
        if futures:
            concurrent.futures.wait(futures, GRAMMAR_WAIT_S, concurrent.futures.FIRST_COMPLETED)

    @staticmethod
    def _advance_grammars(scheduled, sampled: Dict[str, Any]) -> Dict[str, str]:
        """Move each constrained request's matcher past its new token; a token the grammar
        refuses (only possible when every token was masked) fails its request, and so does
        a grammar that takes too long a token (the request's own fault)."""
        refused: Dict[str, str] = {}
        for chunk in scheduled.chunks:
            row = chunk.sampling
            if row is None or row.grammar is None or chunk.request_id not in sampled:
                continue
            token = sampled[chunk.request_id].token_id
            if not row.grammar.accept(token):
                refused[chunk.request_id] = (f"token {token} is not allowed by the request's "
                                             "structured-output grammar")
                del sampled[chunk.request_id]
            elif (costly := row.grammar.too_costly) is not None:
                refused[chunk.request_id] = RequestFault(costly)
                del sampled[chunk.request_id]
        return refused

    # ---------------------------------------------------------------- requests
    def tokenize_prompt(self, prompt: PromptType, keep: Optional[int] = None) -> tuple:
        """(text or None, token ids) for a string, a token-id list or vLLM's prompt dicts;
        `keep` as in `encode`."""
        if isinstance(prompt, dict):
            unread = [key for key, value in prompt.items()
                      if key not in PROMPT_DICT_KEYS and value is not None]
            if unread:
                raise ValueError(f"a prompt dict has keys fulcrum does not read: {unread} (it "
                                 f"reads {', '.join(PROMPT_DICT_KEYS)}; multimodal inputs are "
                                 "not supported)")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), token_id_list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, self.encode(prompt, keep=keep)
        if isinstance(prompt, np.ndarray) and prompt.ndim == 1:  # numpy's token ids
            prompt = prompt.tolist()
        if isinstance(prompt, (list, tuple)) and (not prompt or any(map(is_token_id, prompt))):
            return None, token_id_list(prompt)  # which names a non-integer it holds
        raise TypeError(f"a prompt must be a string, a list of token ids or a dict, "
                        f"got {type(prompt).__name__}")

    def encode(self, text: str, add_special_tokens: bool = True,
               keep: Optional[int] = None) -> List[int]:
        """Token ids of a prompt text. A text too long to fit in max_model_len tokens even at
        the most characters a token can stand for is refused before it is tokenized, so a
        huge body cannot hold the server up tokenizing it; unless only its last `keep`
        tokens are wanted (truncate_prompt_tokens, -1: max_model_len): then only its end is
        tokenized, twice as many tokens' worth of characters as are kept, which hold them."""
        chars = TEXT_SLACK * self.tokenizer.max_chars_per_token
        if len(text) > chars * self.config.max_model_len:
            if keep is None:
                raise ValueError(f"the prompt is {len(text)} characters long: more than "
                                 f"{self.config.max_model_len} tokens (the maximum model "
                                 "length) can hold; truncate_prompt_tokens keeps its end")
            # More than max_model_len kept tokens could not run anyway: no more is read.
            text = text[-chars * min(self._kept_tokens(keep), self.config.max_model_len):]
        return self.tokenizer.encode(text, add_special_tokens)

    def _kept_tokens(self, keep: int) -> int:
        return self.config.max_model_len if keep == -1 else keep

    def prepare_prompt(self, prompt: PromptType, params: SamplingParams) -> tuple:
        """(text, token ids) of a prompt as the request will run it: tokenized, truncated as
        params ask, checked against the model's limits."""
        keep = params.truncate_prompt_tokens
        text, token_ids = self.truncate_prompt(*self.tokenize_prompt(prompt, keep), keep)
        self.validate_prompt(token_ids)
        return text, token_ids

    def truncate_prompt(self, text: Optional[str], token_ids: List[int],
                        keep: Optional[int]) -> tuple:
        """(text, token ids) of the prompt's last `keep` tokens (-1: max_model_len), vLLM's
        truncate_prompt_tokens; a prompt cut short gets the text of what is left."""
        count = None if keep is None else self._kept_tokens(keep)
        if count is None or len(token_ids) <= count:
            return text, token_ids
        kept = token_ids[-count:]
        return self.tokenizer.decode(kept, skip_special_tokens=False), kept

    def bad_words_token_ids(self, words: Optional[Sequence[str]]) -> List[List[int]]:
        """Each bad word as token ids, alone and after a space (vLLM's two spellings; the
        second only where it is a different word of as many tokens). A spelling with a token
        the model cannot produce (a tokenizer's added token past the model's vocabulary)
        can never be completed, so it is left out: the sampler bans ids by their place in
        the batch's flat logits, where such an id would land on the next request's row."""
        found: List[List[int]] = []
        for word in words or []:
            alone = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            found.append(alone)
            if spaced[0] != alone[0] and len(spaced) == len(alone):
                found.append(spaced)
        return [ids for ids in found if all(t < self.vocab_size for t in ids)]

    def validate_prompt(self, token_ids: Sequence[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty: it must contain at least one token")
        limit = self.config.max_model_len
        if len(token_ids) > limit:
            raise ValueError(f"the prompt is {len(token_ids)} tokens long, more than the maximum "
                             f"model length of {limit} tokens")
        self.check_token_ids("prompt", "prompt token id", token_ids)

    def check_token_ids(self, param: str, what: str, token_ids: Iterable[int]) -> None:
        """ParamError naming the first of `token_ids` outside the vocabulary."""
        token_ids = list(token_ids)
        if _all_ints(token_ids) and (not token_ids or (
                min(token_ids) >= 0 and max(token_ids) < self.vocab_size)):
            return  # in C: a 32,000-token prompt is checked twice on the server's event loop
        bad = [t for t in token_ids if not is_int(t) or not 0 <= t < self.vocab_size]
        if bad:
            raise ParamError(param, f"{what} {bad[0]} is out of vocabulary (valid ids are 0.."
                                    f"{self.vocab_size - 1})")

    def validate_params(self, params: SamplingParams, num_prompt_tokens: int) -> int:
        """Check a request's parameters against this model and the engine's limits; return
        its max_tokens (the room the prompt leaves when the request gave none). Never clamps:
        a prompt + max_tokens over max_model_len is refused, as vLLM's and OpenAI's servers do."""
        config = self.config
        if params.n > config.max_n:
            raise ParamError("n", f"n must be at most {config.max_n} (max_n), got {params.n}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > config.max_logprobs:
                raise ParamError(name, f"{name} must be at most {config.max_logprobs} "
                                       f"(max_logprobs), got {value}")
            # A --max-logprobs past the vocabulary: more top tokens than there are failed
            # the whole step's logprobs, and so its other requests.
            if value is not None and value > self.vocab_size:
                raise ParamError(name, f"{name} must be at most the vocabulary size "
                                       f"({self.vocab_size}), got {value}")
        for name in ("stop_token_ids", "logit_bias", "allowed_token_ids"):
            self.check_token_ids(name, f"{name}: token id", getattr(params, name) or ())
        keep = params.truncate_prompt_tokens
        if keep is not None and keep > config.max_model_len:  # vLLM's check and words
            raise ParamError("truncate_prompt_tokens", f"truncate_prompt_tokens value ({keep}) "
                             f"is greater than max_model_len ({config.max_model_len}); select "
                             "a smaller truncation size")
        if params.structured_outputs is not None:
            self.grammar_compiler.parse(params.structured_outputs)
        limit = config.max_model_len
        room = limit - num_prompt_tokens
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room or room < 1:
            raise ValueError(
                f"this model's maximum context length is {limit} tokens, but {num_prompt_tokens}"
                f" prompt tokens + max_tokens {max(max_tokens, 1)} = "
                f"{num_prompt_tokens + max(max_tokens, 1)} were requested; shorten the prompt "
                "or lower max_tokens")
        if params.min_tokens > max_tokens:
            raise ParamError("min_tokens", f"min_tokens ({params.min_tokens}) is more than the "
                                           f"{max_tokens} tokens this request may generate")
        if params.min_tokens and params.allowed_token_ids:
            stops = set(params.stop_token_ids)
            if not params.ignore_eos:
                stops |= self.tokenizer.eos_token_ids
            if stops.issuperset(params.allowed_token_ids):
                raise ParamError("allowed_token_ids", "allowed_token_ids holds only stop "
                                 "tokens, which min_tokens holds back: no token could be "
                                 "generated")
        # The cache holds at least max_model_len tokens (checked when it is sized), so a
        # request that passes here always fits once it has the cache to itself.
        return max_tokens

    @staticmethod
    def cache_salt(prompt: PromptType) -> Optional[str]:
        """The prompt's cache_salt (vLLM's field of prompt dicts), checked."""
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ParamError("cache_salt", "cache_salt must be a non-empty string")
        return salt

    def validate_priority(self, priority: int) -> None:
        """A priority only the priority policy reads is refused elsewhere (as vLLM does),
        rather than accepted and silently ignored."""
        if not is_int(priority):
            raise TypeError("priority must be an integer")
        policy = self.config.scheduling_policy
        if priority != 0 and policy != "priority":
            raise ParamError("priority", f"priority={priority} needs scheduling_policy="
                             f"'priority'; this engine runs {policy!r}, which does not read "
                             "priorities")

    @staticmethod
    def arrival_time(given: Optional[float]) -> float:
        """A request's arrival on time.monotonic(), the clock the scheduler orders, ages and
        times requests by: now unless given. One later than now (vLLM's arrival times are
        time.time() readings, decades ahead of it) is refused: it sorted after every request
        arriving for real, starved under fcfs or priority while others kept coming, and its
        time to first token came out hugely negative."""
        now = time.monotonic()
        if given is None:
            return now
        if not isinstance(given, numbers.Real) or isinstance(given, bool) \
                or not -math.inf < given <= now:
            raise ValueError(f"arrival_time must be a time.monotonic() reading no later than "
                             f"now ({now:.3f}), got {given!r} (fulcrum's arrival times are "
                             "on time.monotonic(), not vLLM's time.time())")
        return float(given)

    def add_request(self, request_id: Optional[str], prompt: PromptType,
                    params: Optional[SamplingParams] = None, arrival_time: Optional[float] = None,
                    priority: int = 0) -> str:
        """Queue a request; raises ValueError/TypeError (and queues nothing) on bad input."""
        self._check_running()
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        self.validate_priority(priority)
        arrival = self.arrival_time(arrival_time)
        text, token_ids = self.prepare_prompt(prompt, params)
        max_tokens = self.validate_params(params, len(token_ids))
        salt = self.cache_salt(prompt)
        if request_id is None:
            request_id = str(next(self._request_counter))
        check_request_ids([request_id])
        child_ids = [request_id] if params.n == 1 else [f"{i}_{request_id}"
                                                        for i in range(params.n)]
        taken = [i for i in [request_id, *child_ids] if self.output_processor.has_request(i)
                 or i in self.scheduler.requests]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in use")
        children = []
        targets = self.slo_targets(params)
        bad_words = self.bad_words_token_ids(params.bad_words)
        for index, child_id in enumerate(child_ids):
            child_params = params if params.n == 1 else _child_params(params, index)
            child = Request(child_id, token_ids, child_params, self.tokenizer.eos_token_ids,
                            text, priority, arrival, max_tokens, salt,
                            self.tokenizer.eos_token_id)
            child.metrics.slo = targets
            child.bad_words_token_ids = bad_words
            if index == 0 and params.prompt_logprobs is not None:
                child.prompt_logprobs = [None]  # the first token has none; one child computes
            if params.structured_outputs is not None:
                child.grammar = self.grammar_compiler.grammar_for(params.structured_outputs)
                if not child.ready:
                    self._compiling.append(child)
            children.append(child)
        self.output_processor.add_request(request_id, text, children)
        for child in children:
            self.scheduler.add_request(child)
        return request_id

    def abort_request(self, request_ids: Union[str, Iterable[str]]) -> None:
        """Stop requests now and free their KV blocks; the next step reports them as 'abort'."""
        one = isinstance(request_ids, str) or not isinstance(request_ids, collections.abc.Iterable)
        request_ids = [request_ids] if one else list(request_ids)
        check_request_ids(request_ids)
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
        """Run one step. A failure confined to some requests fails those alone (finish reason
        "error"); a failed forward pass fails the step's requests and gives their blocks back.
        Anything else raised here means the engine's state can no longer be trusted."""
        self._check_running()
        start_wall = time.monotonic()
        start = time.perf_counter()
        grammar_failed = self._grammar_failures() if self._compiling else {}
        self._fail(grammar_failed)
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty and self._compiling:
            self._wait_for_grammars()
        predicted = self.step_time.predict(scheduled.shape)
        try:
            result = self.executor.execute(scheduled)
        except ExecutorError:
            raise  # ranks out of step: nothing more can run
        except Exception as error:  # noqa: BLE001 - the step never happened; see _fail
            logger.exception("the forward pass failed; failing the step's requests")
            result = StepResult(failed={c.request_id: f"the forward pass failed: {error!r}"
                                        for c in scheduled.chunks})
        sampled, failed = result.sampled, result.failed
        self.output_processor.add_prompt_logprobs(result.prompt_logprobs)
        if self._grammar_compiler is not None:  # none before the first constrained request
            failed.update(self._advance_grammars(scheduled, sampled))
        failed.update(grammar_failed)
        self._fail(failed)
        ended = self.scheduler.update_from_output(scheduled, sampled)
        stopped, failed_later = self.output_processor.process_tokens(sampled)
        ended += self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self._record_finished(ended)
        self._fail(failed_later)
        touched = [*sampled, *failed, *failed_later, *self._aborted_children]
        self._aborted_children = []
        outputs, failed_outputs = self.output_processor.make_outputs(touched)
        self.scheduler.finish_requests(failed_outputs, RequestStatus.FINISHED_ERROR)
        wall = time.perf_counter() - start
        self.step_time.update(scheduled.shape, wall)
        self._record_stats(scheduled, start_wall, wall, predicted)
        return outputs

    def _fail(self, failed: Dict[str, str]) -> None:
        """End the requests (all children of each) that failed, with the reason; the blocks
        they were to compute this step lose their names as they are freed."""
        for child_id, message in failed.items():
            siblings = self.output_processor.siblings(child_id)
            for request in siblings:
                request.error = request.error or message
            self.scheduler.finish_requests([r.request_id for r in siblings],
                                           RequestStatus.FINISHED_ERROR)

    def _record_finished(self, requests: List[Request]) -> None:
        for request in requests:
            metrics, count = request.metrics, request.num_output_tokens
            first, last = metrics.first_token_time, metrics.last_token_time
            self.recent_finished.append(FinishedRequest(
                metrics.finished_time or time.monotonic(), metrics.time_to_first_token,
                (last - first) / (count - 1) if count > 1 and first and last else None,
                request.num_prompt_tokens, count, metrics.slo.ttft_s, metrics.slo.tpot_s,
                metrics.num_cached_tokens))

    def _record_stats(self, scheduled, start_wall: float, wall: float, predicted: float) -> None:
        sched = self.scheduler.stats()
        self.stats.append(StepStats(
            step=next(self._step_counter), start_time=start_wall, wall_seconds=wall,
            predicted_seconds=predicted,
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


def check_request_ids(request_ids: Iterable[object]) -> None:
    """Request ids are non-empty strings (vLLM's): another type could not be told apart from
    a list of ids where one is aborted, nor reach its caller's stream."""
    for request_id in request_ids:
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"a request id must be a non-empty string, got {request_id!r}")


def is_token_id(value: object) -> bool:
    """An integer: Python's or numpy's (numbers.Integral), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _all_ints(values: List[Any]) -> bool:
    """Every value a Python int (not a bool), found at C speed."""
    return set(map(type, values)) <= {int}


def token_id_list(values: Any) -> List[int]:
    """Token ids as Python ints, from a list, a tuple or a numpy array of integers."""
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__"):
        raise TypeError(f"prompt_token_ids must be a list of token ids, got "
                        f"{type(values).__name__}")
    ids = list(values)
    if _all_ints(ids):
        return ids
    for token in ids:
        if not is_token_id(token):
            raise TypeError(f"token ids must be integers, got {type(token).__name__} {token!r}")
    return [int(t) for t in ids]


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The sampling parameters of completion `index` of an n > 1 request. The seed is set
    after the copy, whose checks would read a derived seed of -1 as a request for none."""
    child = dataclasses.replace(params, n=1)
    if params.seed is not None:  # seed + index, wrapped into the 64-bit range
        child.seed = (params.seed + index - SEED_MIN) % (SEED_MAX - SEED_MIN + 1) + SEED_MIN
    return child

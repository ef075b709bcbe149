"""A request's life in the engine: its tokens, how many are computed, and why it ended.

The scheduler reasons about requests only through `num_tokens` and `num_computed_tokens`: a
decode is a request one token behind, a prefill is one many tokens behind, and a preempted
request is one whose computed count went back to zero. There is no separate phase field.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, List, Optional, Set

from fulcrum.sampling_params import SamplingParams

if TYPE_CHECKING:
    from fulcrum.structured_output import RequestGrammar


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one request in the batch."""

    request_id: str
    params: SamplingParams
    all_token_ids: List[int]
    num_prompt_tokens: int
    stop_token_ids: List[int] = field(default_factory=list)
    grammar: Optional["RequestGrammar"] = None  # tokens it forbids are never sampled
    bad_words_token_ids: List[List[int]] = field(default_factory=list)  # params.bad_words


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # vLLM v1's finish reason for a request whose processing failed (the others go on).
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)

    @property
    def finish_reason(self) -> Optional[str]:
        return self.value if self.finished else None


@dataclass(frozen=True)
class SloTargets:
    """A request's latency targets in seconds: time to first token, time per output token."""

    ttft_s: float = math.inf
    tpot_s: float = math.inf


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic seconds) and counters of one request's life, and the
    latency targets it was scheduled for."""

    arrival_time: float
    slo: SloTargets = field(default_factory=SloTargets)
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0

    @property
    def time_to_first_token(self) -> Optional[float]:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> Optional[float]:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: List[int]
    sampling_params: SamplingParams
    eos_token_ids: Set[int] = field(default_factory=set)
    prompt: Optional[str] = None
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    max_tokens: int = 16
    # Requests share prefix-cache blocks only when their salts are equal (vLLM's cache_salt).
    cache_salt: Optional[str] = None
    # The tokenizer's EOS among eos_token_ids: a stop on it has no stop_reason; the other
    # eos ids (the model's generation config lists) report theirs, as vLLM's stop tokens.
    eos_token_id: Optional[int] = None

    def __post_init__(self) -> None:
        self.all_token_ids: List[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        # Seconds spent waiting to run before the current wait, and when that began (None
        # while it runs): the priority policy ages requests by their time waiting only.
        self.waited_s = 0.0
        self.queued_since: Optional[float] = self.arrival_time
        self.stop_reason: Optional[object] = None
        self.error: Optional[str] = None  # why it failed, with FINISHED_ERROR
        # Hashes of this request's full blocks, filled lazily by the KV cache manager.
        self.block_hashes: List[bytes] = []
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        stop_ids = set(self.sampling_params.stop_token_ids)
        if not self.sampling_params.ignore_eos:
            stop_ids |= self.eos_token_ids
        self.stop_token_ids = stop_ids
        self.sorted_stop_token_ids = sorted(stop_ids)  # what the sampler masks, in order
        # Its structured-output constraint, if any (set by the engine).
        self.grammar: Optional[RequestGrammar] = None
        self.bad_words_token_ids: List[List[int]] = []  # params.bad_words, tokenized
        # With params.prompt_logprobs: one entry per prompt token computed so far (the first
        # is None). Such a request reads nothing from the prefix cache: every prompt position
        # must pass through the model to have its logprobs.
        self.prompt_logprobs: Optional[list] = None
        self.sampling_row: Optional[SamplingRow] = None  # the scheduler's, made once

    @property
    def ready(self) -> bool:
        """Whether it may be scheduled: a constrained request waits for its grammar."""
        return self.grammar is None or self.grammar.ready

    @property
    def slo(self) -> SloTargets:
        return self.metrics.slo

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> List[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def in_prefill(self) -> bool:
        """More than one token behind: the next chunk is (re)computing known tokens."""
        return self.num_tokens - self.num_computed_tokens > 1

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> Optional[RequestStatus]:
        """The finished status the newest token puts this request in, if any."""
        tokens = self.all_token_ids
        num_out = len(tokens) - self.num_prompt_tokens
        last = tokens[-1]
        if self.grammar is not None and self.grammar.is_terminated():
            # Its grammar took a stop token: even with ignore_eos nothing more may follow.
            self.stop_reason = None if last == self.eos_token_id else last
            return RequestStatus.FINISHED_STOPPED
        if num_out >= self.sampling_params.min_tokens and last in self.stop_token_ids:
            # vLLM's order: the EOS first (no stop_reason), then stop_token_ids.
            self.stop_reason = None if last == self.eos_token_id and \
                not self.sampling_params.ignore_eos else last
            return RequestStatus.FINISHED_STOPPED
        if num_out >= self.max_tokens or len(tokens) >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

"""What callers get back, with vLLM's field names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Union

from fulcrum.core.request import RequestMetrics


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: Optional[str] = None


@dataclass
class SampledToken:
    token_id: int
    # token id -> Logprob for the sampled token and the top `logprobs` alternatives.
    logprobs: Optional[Dict[int, Logprob]] = None


SampleLogprobs = List[Dict[int, Logprob]]


class RequestFault(str):
    """Why a request failed when the cause lies in the request itself, not in the engine (its
    constraints and penalties leave no token to sample): servers answer it as a client error
    (400), not a 500. A str, so it travels wherever failure messages do."""


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: List[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[SampleLogprobs]
    finish_reason: Optional[str] = None  # "stop", "length", "abort" or "error"
    stop_reason: Union[int, str, None] = None  # the stop string or stop token id that ended it
    # With logprobs: where each token's text starts in the text (OpenAI's `text_offset`).
    text_offsets: Optional[List[int]] = field(default=None, repr=False)
    # This completion's own timestamps (RequestOutput.metrics are the first completion's):
    # the metrics count each completion, as vLLM does.
    metrics: Optional[RequestMetrics] = field(default=None, repr=False, compare=False)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput]
    finished: bool
    metrics: Optional[RequestMetrics] = None
    num_cached_tokens: int = 0
    prompt_logprobs: Optional[list] = field(default=None, repr=False)
    error: Optional[str] = None  # why the request failed (finish reason "error"); RequestFault
    # when the request caused it

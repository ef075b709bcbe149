"""From sampled tokens to `RequestOutput`s: detokenise, apply stop strings, gather n > 1.

A request with `n` > 1 runs as n child requests (ids "i_parent") that share the prompt, and
so its KV blocks through the prefix cache; the caller sees one `RequestOutput` whose
`outputs` holds the n completions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

from fulcrum.detokenizer import IncrementalDetokenizer
from fulcrum.outputs import CompletionOutput, RequestOutput
from fulcrum.core.request import Request, RequestStatus
from fulcrum.outputs import Logprob, SampledToken
from fulcrum.sampling_params import RequestOutputKind
from fulcrum.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class _Child:
    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: Optional[list]
    cumulative_logprob: Optional[float]
    sent_text: int = 0
    sent_tokens: int = 0
    # A stop string its last allowed token completed: the text ends there, so the string
    # is why it ended (as in vLLM, whose stop strings outrank the length).
    stopped_at_length: Optional[str] = None


@dataclass
class _Parent:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    output_kind: RequestOutputKind
    children: List[_Child] = field(default_factory=list)
    sent_prompt_logprobs: bool = False

    def prompt_logprobs(self, delta: bool) -> Optional[list]:
        """The prompt's logprobs once all are computed (a delta stream sends them once)."""
        found = self.children[0].request.prompt_logprobs
        if found is None or len(found) < len(self.prompt_token_ids) \
                or (delta and self.sent_prompt_logprobs):
            return None
        self.sent_prompt_logprobs = True
        return found

    @property
    def finished(self) -> bool:
        return all(c.request.is_finished for c in self.children)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._parents: Dict[str, _Parent] = {}
        self._children: Dict[str, tuple] = {}

    def add_request(self, request_id: str, prompt: Optional[str], children: List[Request]) -> None:
        first = children[0]
        params = first.sampling_params
        parent = _Parent(request_id, prompt, first.prompt_token_ids, params.output_kind)
        for index, request in enumerate(children):
            wants_logprobs = request.sampling_params.logprobs is not None
            # Logprobs come with where each token's text starts (the completions API's).
            parent.children.append(_Child(
                index, request,
                IncrementalDetokenizer(self.tokenizer, request.sampling_params,
                                       request.prompt_token_ids, record_offsets=wants_logprobs),
                [] if wants_logprobs else None, 0.0 if wants_logprobs else None))
            self._children[request.request_id] = (parent, index)
        self._parents[request_id] = parent

    def child_ids(self, request_id: str) -> List[str]:
        parent = self._parents.get(request_id)
        return [c.request.request_id for c in parent.children] if parent else []

    def has_request(self, request_id: str) -> bool:
        return request_id in self._parents

    def siblings(self, child_id: str) -> List[Request]:
        """Every child of the request that `child_id` belongs to (itself included)."""
        entry = self._children.get(child_id)
        return [c.request for c in entry[0].children] if entry else []

    def process_tokens(self, sampled: Dict[str, SampledToken]) -> Tuple[List[str], Dict[str, str]]:
        """Detokenise new tokens. Returns the child ids that a stop string has just ended,
        and why processing failed for the children it failed for."""
        ended, failed = [], {}
        for child_id, token in sampled.items():
            entry = self._children.get(child_id)
            if entry is None:
                continue
            try:
                if self._process_token(entry[0].children[entry[1]], token):
                    ended.append(child_id)
            except Exception as error:  # noqa: BLE001 - this request fails, the others go on
                logger.exception("processing the output of %s failed", child_id)
                failed[child_id] = f"processing the output failed: {error!r}"
        return ended, failed

    def _process_token(self, child: _Child, token: SampledToken) -> bool:
        """Detokenise one new token; True if a stop string has just ended the child."""
        self._record_logprobs(child, token)
        request = child.request
        if (request.status is RequestStatus.FINISHED_STOPPED
                and not request.sampling_params.include_stop_str_in_output):
            stop = child.detokenizer.finish(
                request.num_output_tokens > request.sampling_params.min_tokens)
            child.detokenizer.skip()  # the stop token itself is not part of the text
            if stop is not None:
                request.stop_reason = stop  # the string outranks the stop token (vLLM)
            return False
        # As in vLLM, a stop string counts only in text after the first min_tokens tokens.
        stop = child.detokenizer.update(
            [token.token_id], request.num_output_tokens > request.sampling_params.min_tokens,
            final=request.is_finished)
        if stop is None:
            return False
        if request.status is RequestStatus.FINISHED_LENGTH:
            child.stopped_at_length = stop
            return False
        if request.status is RequestStatus.FINISHED_STOPPED:
            request.stop_reason = stop  # the string outranks the stop token it ends with (vLLM)
            return False
        if request.is_finished:
            return False  # a failure ended it first
        request.stop_reason = stop
        return True

    def add_prompt_logprobs(self, found: Dict[str, List[Dict[int, Logprob]]]) -> None:
        """Record the prompt logprobs a step computed (with each token's text)."""
        for child_id, entries in found.items():
            entry = self._children.get(child_id)
            if entry is None:
                continue
            for logprobs in entries:
                self._decode(logprobs)
            entry[0].children[entry[1]].request.prompt_logprobs.extend(entries)

    def _decode(self, logprobs: Dict[int, Logprob]) -> None:
        for token_id, logprob in logprobs.items():
            logprob.decoded_token = self.tokenizer.decode([token_id], False)

    def _record_logprobs(self, child: _Child, token: SampledToken) -> None:
        if child.logprobs is None or token.logprobs is None:
            return
        self._decode(token.logprobs)
        child.logprobs.append(token.logprobs)
        child.cumulative_logprob += token.logprobs[token.token_id].logprob

    def make_outputs(self, child_ids: Iterable[str]) -> Tuple[List[RequestOutput], Dict[str, str]]:
        """Outputs for the parents of the given children; finished parents are forgotten.

        A parent whose output cannot be built gets a final output with finish reason "error"
        instead; the second value says which children failed so, for the engine to end them.
        """
        touched: Dict[str, List[int]] = {}
        for child_id in child_ids:
            entry = self._children.get(child_id)
            if entry is not None:
                touched.setdefault(entry[0].request_id, []).append(entry[1])
        outputs, failed = [], {}
        for request_id, indices in touched.items():
            parent = self._parents[request_id]
            finished = parent.finished
            try:
                output = self._parent_output(parent, sorted(set(indices)), finished)
            except Exception as error:  # noqa: BLE001 - this request fails, the others go on
                logger.exception("building the output of %s failed", request_id)
                message = f"building the output failed: {error!r}"
                failed.update((c.request.request_id, message) for c in parent.children)
                output, finished = self._error_output(parent, message), True
            if output is not None:
                outputs.append(output)
            if finished:
                del self._parents[request_id]
                for child in parent.children:
                    self._children.pop(child.request.request_id, None)
        return outputs, failed

    @staticmethod
    def _error_output(parent: _Parent, message: str) -> RequestOutput:
        """The final output of a request whose output could not be built: no text, the error."""
        completions = [CompletionOutput(c.index, "", [], None, None, finish_reason="error",
                                        metrics=c.request.metrics) for c in parent.children]
        return RequestOutput(request_id=parent.request_id, prompt=parent.prompt,
                             prompt_token_ids=parent.prompt_token_ids, outputs=completions,
                             finished=True, error=message)

    def _parent_output(self, parent: _Parent, touched: List[int],
                       finished: bool) -> Optional[RequestOutput]:
        kind = parent.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind is RequestOutputKind.DELTA
        children = [parent.children[i] for i in touched] if delta else parent.children
        completions = [self._completion(c, delta) for c in children]
        first = parent.children[0].request
        error = next((c.request.error for c in parent.children if c.request.error), None)
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids, outputs=completions, finished=finished,
            metrics=first.metrics, num_cached_tokens=first.metrics.num_cached_tokens,
            prompt_logprobs=parent.prompt_logprobs(delta), error=error)

    @staticmethod
    def _completion(child: _Child, delta: bool) -> CompletionOutput:
        request = child.request
        text = child.detokenizer.visible_text(request.is_finished)
        token_ids = request.output_token_ids
        logprobs, offsets = child.logprobs, child.detokenizer.text_offsets
        if delta:
            text, child.sent_text = text[child.sent_text:], len(text)
            start, child.sent_tokens = child.sent_tokens, len(token_ids)
            token_ids = token_ids[start:]
            logprobs = logprobs[start:] if logprobs is not None else None
            offsets = offsets[start:] if offsets is not None else None
        finish_reason = request.status.finish_reason
        stop_reason = request.stop_reason if request.is_finished else None
        if child.stopped_at_length is not None:
            finish_reason, stop_reason = "stop", child.stopped_at_length
        return CompletionOutput(
            index=child.index, text=text, token_ids=list(token_ids),
            cumulative_logprob=child.cumulative_logprob, logprobs=logprobs,
            text_offsets=list(offsets) if offsets is not None else None,
            finish_reason=finish_reason, stop_reason=stop_reason, metrics=request.metrics)

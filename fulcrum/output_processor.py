"""From sampled tokens to `RequestOutput`s: detokenise, apply stop strings, gather n > 1.

A request with `n` > 1 runs as n child requests (ids "i_parent") that share the prompt, and
so its KV blocks through the prefix cache; the caller sees one `RequestOutput` whose
`outputs` holds the n completions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional

from fulcrum.detokenizer import IncrementalDetokenizer
from fulcrum.outputs import CompletionOutput, RequestOutput
from fulcrum.request import Request, RequestStatus
from fulcrum.sampler import SampledToken
from fulcrum.sampling_params import RequestOutputKind
from fulcrum.tokenizer import Tokenizer


@dataclass
class _Child:
    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: Optional[list]
    cumulative_logprob: Optional[float]
    sent_text: int = 0
    sent_tokens: int = 0


@dataclass
class _Parent:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    output_kind: RequestOutputKind
    children: List[_Child] = field(default_factory=list)

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
            parent.children.append(_Child(
                index, request,
                IncrementalDetokenizer(self.tokenizer, request.sampling_params),
                [] if wants_logprobs else None, 0.0 if wants_logprobs else None))
            self._children[request.request_id] = (parent, index)
        self._parents[request_id] = parent

    def child_ids(self, request_id: str) -> List[str]:
        parent = self._parents.get(request_id)
        return [c.request.request_id for c in parent.children] if parent else []

    def has_request(self, request_id: str) -> bool:
        return request_id in self._parents

    def process_tokens(self, sampled: Dict[str, SampledToken]) -> List[str]:
        """Detokenise new tokens; return the child ids that a stop string has just ended."""
        ended = []
        for child_id, token in sampled.items():
            entry = self._children.get(child_id)
            if entry is None:
                continue
            parent, index = entry
            child = parent.children[index]
            self._record_logprobs(child, token)
            request = child.request
            new_ids = [token.token_id]
            if (request.status is RequestStatus.FINISHED_STOPPED
                    and not request.sampling_params.include_stop_str_in_output):
                new_ids = []  # the stop token itself is not part of the text
            stop = child.detokenizer.update(new_ids)
            if stop is not None and not request.is_finished:
                request.stop_reason = stop
                ended.append(child_id)
        return ended

    def _record_logprobs(self, child: _Child, token: SampledToken) -> None:
        if child.logprobs is None or token.logprobs is None:
            return
        for token_id, logprob in token.logprobs.items():
            logprob.decoded_token = self.tokenizer.decode([token_id], False)
        child.logprobs.append(token.logprobs)
        child.cumulative_logprob += token.logprobs[token.token_id].logprob

    def make_outputs(self, child_ids: Iterable[str]) -> List[RequestOutput]:
        """Outputs for the parents of the given children; finished parents are forgotten."""
        touched: Dict[str, List[int]] = {}
        for child_id in child_ids:
            entry = self._children.get(child_id)
            if entry is not None:
                touched.setdefault(entry[0].request_id, []).append(entry[1])
        outputs = []
        for request_id, indices in touched.items():
            parent = self._parents[request_id]
            finished = parent.finished
            output = self._parent_output(parent, sorted(set(indices)), finished)
            if output is not None:
                outputs.append(output)
            if finished:
                del self._parents[request_id]
                for child in parent.children:
                    self._children.pop(child.request.request_id, None)
        return outputs

    def _parent_output(self, parent: _Parent, touched: List[int],
                       finished: bool) -> Optional[RequestOutput]:
        kind = parent.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind is RequestOutputKind.DELTA
        children = [parent.children[i] for i in touched] if delta else parent.children
        completions = [self._completion(c, delta) for c in children]
        first = parent.children[0].request
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids, outputs=completions, finished=finished,
            metrics=first.metrics, num_cached_tokens=first.metrics.num_cached_tokens)

    @staticmethod
    def _completion(child: _Child, delta: bool) -> CompletionOutput:
        request = child.request
        text = child.detokenizer.visible_text(request.is_finished)
        token_ids = request.output_token_ids
        logprobs = child.logprobs
        if delta:
            text, child.sent_text = text[child.sent_text:], len(text)
            start, child.sent_tokens = child.sent_tokens, len(token_ids)
            token_ids = token_ids[start:]
            logprobs = logprobs[start:] if logprobs is not None else None
        return CompletionOutput(
            index=child.index, text=text, token_ids=list(token_ids),
            cumulative_logprob=child.cumulative_logprob, logprobs=logprobs,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason if request.is_finished else None)

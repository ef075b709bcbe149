"""The choices of one API request as the engine's outputs grow them: each choice's text,
tokens, logprobs and finish so far, what each new output added (a `Delta`, ready to send),
and the request's usage. Choices are numbered prompt-major, as in vLLM: choice `i * n + j`
is completion j of prompt i."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import AsyncIterator, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from fulcrum.detokenizer import prompt_text_offsets
from fulcrum.outputs import CompletionOutput, Logprob, RequestOutput
from fulcrum.server.protocol import PromptTokensDetails, UsageInfo
from fulcrum.tokenizer import Tokenizer

EnginePrompt = Tuple[Optional[str], List[int]]  # (text, token ids); no text: given as ids


@dataclass
class Delta:
    """What one engine output added to a choice, ready to send."""

    text: str
    token_ids: List[int]
    logprobs: List[Dict[int, Logprob]]
    # Where each token (the echoed prompt's, then the delta's own) starts in the choice's text:
    # tracked for the completions API's logprobs only.
    text_offsets: List[int] = field(default_factory=list)
    # With echo and logprobs, the delta that carries the prompt carries its logprobs too.
    prompt_token_ids: List[int] = field(default_factory=list)
    prompt_logprobs: List[Optional[Dict[int, Logprob]]] = field(default_factory=list)
    # vLLM's prompt_logprobs field: in the first delta after they are computed.
    new_prompt_logprobs: Optional[list] = None


@dataclass
class Choice:
    """One choice's output so far."""

    index: int
    prefix: str = ""  # the prompt, with echo: sent before the first delta
    prompt_token_ids: List[int] = field(default_factory=list)  # with echo
    prompt_logprobs: Optional[list] = None  # once computed (vLLM's prompt_logprobs)
    sent_prompt_logprobs: bool = False
    text: str = ""
    token_ids: List[int] = field(default_factory=list)
    logprobs: List[Dict[int, Logprob]] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    prompt_offsets: List[int] = field(default_factory=list)  # the echoed prompt's tokens'
    text_offsets: List[int] = field(default_factory=list)

    def add(self, completion: CompletionOutput) -> Delta:
        echoing = not self.text
        text = (self.prefix if echoing else "") + completion.text
        offsets = [len(self.prefix) + offset for offset in completion.text_offsets or ()]
        delta = Delta(text, list(completion.token_ids), list(completion.logprobs or []),
                       offsets)
        self.text_offsets.extend(offsets)
        if echoing and self.prefix:
            self._echo_into(delta)
        if self.prompt_logprobs is not None and not self.sent_prompt_logprobs:
            delta.new_prompt_logprobs, self.sent_prompt_logprobs = self.prompt_logprobs, True
        self.text += text
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        self.finish_reason = completion.finish_reason
        self.stop_reason = completion.stop_reason
        return delta

    def whole(self) -> Delta:
        """Everything so far, as one delta (for a response that is not streamed)."""
        delta = Delta(self.text, self.token_ids, self.logprobs, self.text_offsets,
                       new_prompt_logprobs=self.prompt_logprobs)
        if self.prefix:
            self._echo_into(delta)
        return delta

    def _echo_into(self, delta: Delta) -> None:
        """The delta that carries the echoed prompt carries its tokens, logprobs, offsets."""
        delta.prompt_token_ids = self.prompt_token_ids
        delta.prompt_logprobs = self.prompt_logprobs or []
        delta.text_offsets = self.prompt_offsets + delta.text_offsets


class Generation:
    """The choices of one API request, fed with the engine outputs of its prompts. Given a
    `tokenizer` (for the completions API's logprobs), an echoed prompt's tokens get their
    text offsets too; `decoded`: which prompts' texts are their token ids decoded (given as
    ids, or truncated), special tokens kept, as their offsets then are."""

    def __init__(self, prompts: Sequence[EnginePrompt], n: int, echo: bool = False,
                 tokenizer: Optional[Tokenizer] = None,
                 decoded: Sequence[bool] = (), prompt_only: bool = False) -> None:
        self.n = n
        self.prompt_only = prompt_only  # echo with max_tokens 0: no generated token shown
        self.prompt_tokens = sum(len(ids) for _, ids in prompts)
        decoded = list(decoded) or [False] * len(prompts)
        self.choices = [choice for index, prompt in enumerate(prompts)
                        for choice in self._choices(index, prompt, echo, tokenizer,
                                                    decoded[index])]
        self.prompt_ids = [ids for _, ids in prompts]
        # Prompt tokens found in the prefix cache; None until the prompt's first output.
        self.cached_tokens: List[Optional[int]] = [None] * len(prompts)

    def _choices(self, index: int, prompt: EnginePrompt, echo: bool,
                 tokenizer: Optional[Tokenizer], decoded: bool) -> List[Choice]:
        text, ids = prompt
        prefix = text if echo and text else ""
        echoed = ids if echo else []
        # An echoed prompt is the prompt's text, without the special tokens added to it; a
        # decoded one keeps them (as vLLM's text of token ids).
        offsets = (prompt_text_offsets(tokenizer, ids, skip_special_tokens=not decoded)
                   if prefix and tokenizer else [])
        return [Choice(index * self.n + j, prefix, echoed, prompt_offsets=offsets)
                for j in range(self.n)]

    def add(self, prompt_index: int, output: RequestOutput) -> Iterator[Tuple[Choice, Delta]]:
        self.cached_tokens[prompt_index] = output.num_cached_tokens
        if output.prompt_logprobs is not None:
            for choice in self.choices[prompt_index * self.n:(prompt_index + 1) * self.n]:
                choice.prompt_logprobs = output.prompt_logprobs
        for completion in output.outputs:
            choice = self.choices[prompt_index * self.n + completion.index]
            if self.prompt_only:
                completion = _nothing_generated(completion)
            yield choice, choice.add(completion)

    async def consume(self, outputs: AsyncIterator[Tuple[int, RequestOutput]]) -> None:
        async for prompt_index, output in outputs:
            for _ in self.add(prompt_index, output):
                pass

    def logprob_entries(self) -> int:
        """The logprobs (alternatives included) the choices hold, the prompts' too."""
        prompts = {id(c.prompt_logprobs): c.prompt_logprobs for c in self.choices}
        return sum(len(entry or ()) for c in self.choices for entry in c.logprobs) + sum(
            len(entry or ()) for found in prompts.values() for entry in found or ())

    def usage(self) -> UsageInfo:
        return _usage_info(self.prompt_tokens, sum(len(c.token_ids) for c in self.choices),
                           sum(c or 0 for c in self.cached_tokens))

    def choice_usage(self, choice: Choice) -> UsageInfo:
        """continuous_usage_stats on a chunk of one choice: its prompt and its tokens so far
        (vLLM's; the totals over all choices come in the usage chunk at the end). Before
        the prompt's first output (a chat stream's first chunks) its cached tokens are not
        known yet and go unsaid."""
        prompt_index = choice.index // self.n
        return _usage_info(len(self.prompt_ids[prompt_index]), len(choice.token_ids),
                           self.cached_tokens[prompt_index])

    def usage_of(self, choice: Choice, continuous: bool) -> Optional[UsageInfo]:
        """A chunk's usage: its choice's with continuous_usage_stats, else none."""
        return self.choice_usage(choice) if continuous else None


def _nothing_generated(completion: CompletionOutput) -> CompletionOutput:
    """A completion asked for no token (echo with max_tokens 0): the one the engine ran
    left out, and finished as max_tokens ends it, unless it failed or was aborted."""
    finish = completion.finish_reason
    return dataclasses.replace(
        completion, text="", token_ids=[], logprobs=None if completion.logprobs is None else [],
        text_offsets=None if completion.text_offsets is None else [],
        finish_reason="length" if finish in ("stop", "length") else finish, stop_reason=None)


def _usage_info(prompt: int, completion: int, cached: Optional[int]) -> UsageInfo:
    """OpenAI's usage; the cached prompt tokens where known."""
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion,
                     prompt_tokens_details=None if cached is None else
                     PromptTokensDetails(cached_tokens=cached))

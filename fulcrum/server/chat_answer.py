"""A chat completion's answer as its choices grow: the stream's chunks (the role, the echoed
message, then one per engine output) or the whole response. With a reasoning parser a
choice's text splits into `reasoning` and `content`; with tools, the content into calls."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from pydantic import BaseModel

from fulcrum.server import reasoning, tool_calls
from fulcrum.server.choices import Choice, Delta, Generation
from fulcrum.server.logprob_format import chat_logprobs, prompt_logprobs
from fulcrum.server.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                     ChatCompletionResponse, ChatLogprobs, ChatResponseMessage,
                                     ChatStreamChoice, DeltaMessage, UsageInfo)


@dataclass
class ChatAnswer:
    """`thinking` and `calls`: each choice's reasoning split and tool call reader (None:
    the server has no such parser, or the request asks for none). `num_logprobs` and
    `with_ids`: what the choices carry (include_reasoning false drops both, which would
    spell the thinking out)."""

    request: ChatCompletionRequest
    generation: Generation
    response_id: str
    model_name: str
    thinking: Dict[int, Optional[reasoning.ReasoningStream]]
    calls: Dict[int, Optional[tool_calls.ToolCallStream]]
    num_logprobs: Optional[int]
    with_ids: bool
    created: int = field(default_factory=lambda: int(time.time()))

    def chunk(self, choices: List[ChatStreamChoice],
              usage: Optional[UsageInfo] = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.response_id, created=self.created,
                                   model=self.model_name, choices=choices, usage=usage)

    def usage_chunk(self) -> ChatCompletionChunk:
        return self.chunk([], self.generation.usage())

    def _usage(self, choice: Choice) -> Optional[UsageInfo]:
        return self.generation.usage_of(choice, self.request.continuous_usage)

    def _prompt_ids(self) -> Optional[List[int]]:
        """vLLM's prompt_token_ids (kept with include_reasoning false: they show no thinking)."""
        return self.generation.prompt_ids[0] if self.request.return_token_ids else None

    def preamble(self) -> List[ChatCompletionChunk]:
        """Each choice's role, then (echo) the message it continues."""
        choices = self.generation.choices
        chunks = [self.chunk([ChatStreamChoice(index=c.index, delta=DeltaMessage(
            role="assistant", content=""))], self._usage(c)) for c in choices]
        chunks[0].prompt_token_ids = self._prompt_ids()
        echo = self.request.echo_text
        if echo:
            chunks += [self.chunk([ChatStreamChoice(index=c.index,
                                                    delta=DeltaMessage(content=echo))],
                                  self._usage(c)) for c in choices]
        return chunks

    def _logprobs(self, delta: Delta) -> Optional[ChatLogprobs]:
        if self.num_logprobs is None:
            return None
        return chat_logprobs(delta.logprobs, delta.token_ids, self.num_logprobs,
                             self.request.return_tokens_as_token_ids)

    def delta_chunks(self, c: Choice, delta: Delta) -> List[BaseModel]:
        """What one engine output adds to choice `c`: no chunk where the parsers hold its
        text back (and it carries no logprobs or ids), two where it ends in tool calls."""
        thought, text = _split_reasoning(self.thinking[c.index], delta.text,
                                         c.finish_reason is not None)
        message = DeltaMessage(content=text, reasoning=thought, reasoning_content=thought)
        finish_reason, calls = c.finish_reason, self.calls[c.index]
        if calls is not None:
            piece = calls.feed(text or "")
            were_calls = False
            if c.finish_reason is not None:
                rest, were_calls = calls.finish()
                piece = tool_calls.ToolDelta((piece.content or "") + (rest.content or "") or None,
                                             piece.tool_calls + rest.tool_calls)
            message = DeltaMessage(content=piece.content, reasoning=thought,
                                   reasoning_content=thought, tool_calls=piece.tool_calls or None)
            finish_reason = _tool_finish_reason(c.finish_reason, were_calls)
        held_back = (message.content, message.reasoning, message.tool_calls,
                     finish_reason) == (None, None, None, None)
        if (calls is not None or self.thinking[c.index] is not None) and held_back \
                and self.num_logprobs is None and not self.with_ids:
            # Text a parser holds back: no empty chunk (as vLLM), unless it must carry its
            # tokens' logprobs or ids (vLLM sends return_token_ids' too).
            return []
        streamed = ChatStreamChoice(
            index=c.index, delta=message, logprobs=self._logprobs(delta),
            finish_reason=finish_reason, stop_reason=c.stop_reason,
            token_ids=list(delta.token_ids) if self.with_ids else None)
        usage = self._usage(c)
        return [self.chunk([choice], usage) for choice in _finish_apart_from_calls(streamed)]

    def _message(self, c: Choice) -> Tuple[ChatResponseMessage, Optional[str]]:
        """A whole choice's message (the echoed one first) and finish reason."""
        split, calls, echo = self.thinking[c.index], self.calls[c.index], self.request.echo_text
        thought, text = (None, c.text) if split is None else split.whole(c.text)
        if calls is None:
            content = echo + text if text is not None else echo or None
            return (ChatResponseMessage(content=content, reasoning=thought,
                                        reasoning_content=thought), c.finish_reason)
        content, found, were_calls = calls.whole(text or "")
        if echo:
            content = echo + (content or "")
        return (ChatResponseMessage(content=content, tool_calls=found, reasoning=thought,
                                    reasoning_content=thought),
                _tool_finish_reason(c.finish_reason, were_calls))

    def final(self) -> ChatCompletionResponse:
        choices = []
        for c in self.generation.choices:
            reply, finish_reason = self._message(c)
            choices.append(ChatChoice(index=c.index, message=reply,
                                      logprobs=self._logprobs(c.whole()),
                                      finish_reason=finish_reason, stop_reason=c.stop_reason,
                                      token_ids=list(c.token_ids) if self.with_ids else None))
        asked = self.request.prompt_logprobs is not None
        return ChatCompletionResponse(
            id=self.response_id, created=self.created, model=self.model_name,
            usage=self.generation.usage(), choices=choices,
            prompt_logprobs=(prompt_logprobs(self.generation.choices[0].prompt_logprobs)
                             if asked else None),
            prompt_token_ids=self._prompt_ids())


def _split_reasoning(split: Optional[reasoning.ReasoningStream], text: str, last: bool
                     ) -> Tuple[Optional[str], Optional[str]]:
    """(reasoning, content) of a streamed piece; without a reasoning parser, all content."""
    if split is None:
        return None, text
    piece = split.feed(text)
    if last:
        rest = split.finish()
        piece = reasoning.ReasoningDelta((piece.reasoning or "") + (rest.reasoning or ""),
                                         (piece.content or "") + (rest.content or ""))
    return piece.reasoning or None, piece.content or None


def _finish_apart_from_calls(piece: ChatStreamChoice) -> List[ChatStreamChoice]:
    """A choice's last piece, its finish_reason in a piece of its own where it carries tool
    calls (as OpenAI sends it): OpenAI's SDK stream helper closes a call (its
    tool_calls.function.arguments.done event, with parsed_arguments) when a later piece
    comes, so a call sent whole with the finish_reason (as "required" and "auto" send them)
    would never be closed."""
    if piece.finish_reason is None or not piece.delta.tool_calls:
        return [piece]
    finish = ChatStreamChoice(index=piece.index, delta=DeltaMessage(),
                              finish_reason=piece.finish_reason, stop_reason=piece.stop_reason)
    return [piece.model_copy(update={"finish_reason": None, "stop_reason": None}), finish]


def _tool_finish_reason(finish_reason: Optional[str], were_calls: bool) -> Optional[str]:
    """OpenAI's "tool_calls" for an answer that ended in calls of the model's choosing."""
    return "tool_calls" if were_calls and finish_reason == "stop" else finish_reason

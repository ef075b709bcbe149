"""Reasoning parsers (vLLM's `--reasoning-parser`): a reasoning model thinks between <think>
and </think> before it answers; the chat API gives the thinking as the message's `reasoning`
(vLLM's field, and `reasoning_content`, its older name, which clients still read) and the
rest as `content`, which the tool call parser then reads.

- `deepseek_r1` (DeepSeek-R1 and its distills, QwQ; and Qwen3's thinking-only models, whose
  templates open <think> in the prompt): an answer starts in its thinking (a <think> it opens
  with is dropped), and all of it is reasoning until </think>, so an answer cut short before
  it is reasoning alone;
- `qwen3`: an answer thinks only where it opens with <think> (with `enable_thinking: false`
  in `chat_template_kwargs` it does not), else all of it is content.

A request's `include_reasoning: false` (vLLM's) drops the thinking from the answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from fulcrum.server.tool_calls import held_back

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    thinks_from_start: bool  # whether an answer that does not open with <think> thinks


PARSERS: Dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser("deepseek_r1", thinks_from_start=True),
    "qwen3": ReasoningParser("qwen3", thinks_from_start=False),
}


def make_parser(name: str) -> ReasoningParser:
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose from {sorted(PARSERS)}")
    return PARSERS[name]


@dataclass
class ReasoningDelta:
    reasoning: Optional[str] = None
    content: Optional[str] = None


class ReasoningStream:
    """One choice's answer split as it streams. Text that may still become a marker (the
    start of <think> at the answer's start, of </think> while it thinks) is held back until
    it cannot, or the answer ends. `hidden` (vLLM's include_reasoning false): the thinking
    is split off and dropped, the content alone given."""

    def __init__(self, parser: ReasoningParser, hidden: bool = False) -> None:
        self.parser = parser
        self.hidden = hidden
        self.text = ""
        self.read = 0  # characters of `text` already split
        self.state = "opening"  # then "thinking", then "answering"

    def feed(self, delta: str) -> ReasoningDelta:
        self.text += delta
        return self._split(final=False)

    def finish(self) -> ReasoningDelta:
        return self._split(final=True)

    def whole(self, text: str) -> Tuple[Optional[str], Optional[str]]:
        """A whole answer (not streamed): (reasoning, content), None where empty."""
        first, last = self.feed(text), self.finish()
        reasoning = (first.reasoning or "") + (last.reasoning or "")
        content = (first.content or "") + (last.content or "")
        return reasoning or None, content or None

    def _split(self, final: bool) -> ReasoningDelta:
        delta = self._split_all(final)
        if self.hidden:
            delta.reasoning = None
        return delta

    def _split_all(self, final: bool) -> ReasoningDelta:
        if self.state == "opening":
            opened = self.text.lstrip()
            if START.startswith(opened) and len(opened) < len(START) and not final:
                return ReasoningDelta()  # may still open with <think>
            if opened.startswith(START):
                self.read = len(self.text) - len(opened) + len(START)
                self.state = "thinking"
            else:
                self.state = "thinking" if self.parser.thinks_from_start else "answering"
        delta = ReasoningDelta()
        if self.state == "thinking":
            end = self.text.find(END, self.read)
            if end < 0:
                safe = len(self.text) - (0 if final else held_back(self.text, END))
                delta.reasoning = self.text[self.read:max(safe, self.read)] or None
                self.read = max(self.read, safe)
                return delta
            delta.reasoning = self.text[self.read:end] or None
            self.read, self.state = end + len(END), "answering"
        delta.content = self.text[self.read:] or None
        self.read = len(self.text)
        return delta


"""Incremental detokenisation with stop strings.

Decoding one token at a time is wrong for byte-fallback and byte-level BPE (a character may
span tokens) and for tokenizers whose decoder strips a leading space. So each step decodes a
short window of recent tokens twice, with and without the new ones, and emits the
difference once it no longer ends in an incomplete character (U+FFFD). Stop strings are
searched only in the region the new text can complete, and text that could still become the
start of a stop string is held back from streaming until it cannot.

The text is that of the output tokens on their own, as `tokenizer.decode(output_ids)` gives
(and as HF transformers users see it): a SentencePiece tokenizer's leading space on the
first output token is dropped, as its decoder does for any decoded sequence.
"""

from __future__ import annotations

from typing import List, Optional

from fulcrum.sampling_params import SamplingParams
from fulcrum.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.tokens: List[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.output_text = ""
        self.stop_strings = params.stop
        self.hold_back = max((len(s) for s in self.stop_strings), default=1) - 1

    def update(self, new_token_ids: List[int], check_stop: bool = True) -> Optional[str]:
        """Append tokens; return the stop string that ends the request, if one appeared.

        `check_stop` is False while min_tokens holds stop strings back; as in vLLM, text
        appended then is not searched later either, except where a stop string could start
        in it and end in the new text.
        """
        searched_from = len(self.output_text)
        for token_id in new_token_ids:
            self.tokens.append(token_id)
            self.output_text += self._decode_newest()
        if not self.stop_strings or not check_stop:
            return None
        return self._find_stop(max(0, searched_from - self.hold_back))

    def _decode_newest(self) -> str:
        skip = self.params.skip_special_tokens
        before = self.tokenizer.decode(self.tokens[self.prefix_offset:self.read_offset], skip)
        after = self.tokenizer.decode(self.tokens[self.prefix_offset:], skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return after[len(before):]

    def _find_stop(self, start: int) -> Optional[str]:
        best = None
        for stop in self.stop_strings:
            index = self.output_text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        end = index + len(stop) if self.params.include_stop_str_in_output else index
        self.output_text = self.output_text[:end]
        return stop

    def visible_text(self, finished: bool) -> str:
        """The text a stream may show now: all of it once finished, else minus the hold-back."""
        if finished or not self.hold_back:
            return self.output_text
        return self.output_text[:max(0, len(self.output_text) - self.hold_back)]

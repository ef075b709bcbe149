"""Incremental detokenisation with stop strings.

Decoding one token at a time is wrong for byte-fallback and byte-level BPE (a character may
span tokens) and for tokenizers whose decoder strips a leading space. So each step decodes a
short window of recent tokens twice, with and without the new ones, and emits the
difference once it no longer ends in an incomplete character (U+FFFD). Stop strings are
searched only in the region the new text can complete, and text that could still become the
start of a stop string is held back from streaming until it cannot.

The first output tokens are decoded after the prompt's last few (as vLLM's detokenizers do),
so the text is what they add to the prompt: a SentencePiece tokenizer's decoder drops the
leading space of a sequence's first token, which `tokenizer.decode(output_ids)` would lose
("Once upon" + "a time"); here the completion keeps it (" a time"), as vLLM and OpenAI's
completions give it.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from fulcrum.sampling_params import SamplingParams
from fulcrum.tokenizer import Tokenizer

# Prompt tokens decoded before the first output ones: the fewest from 4 whose text is whole
# characters (no U+FFFD at a cut through one), at most 24 (vLLM's rule).
CONTEXT_TOKENS = (4, 24)
# The most tokens a prompt may end with that are the start of a character still incomplete
# (a 4-byte UTF-8 character's first 3 bytes): its output completes it. The same bounds the
# tokens at the end of any text that may still become a character.
MAX_PARTIAL_TOKENS = 3
# Unread tokens past which those before the last MAX_PARTIAL_TOKENS are read as they are:
# while no character completes (bytes that are no UTF-8, special tokens skipped), the window
# decoded each step would grow without end, each token costing as much as all before it.
MAX_UNREAD_TOKENS = 2 * MAX_PARTIAL_TOKENS


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams,
                 prompt_token_ids: Sequence[int] = (), record_offsets: bool = False) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.tokens, self.read_offset = self._context(list(prompt_token_ids))
        self.prefix_offset = 0
        # Where the context ends in prompt tokens not yet read (an incomplete character's
        # start, or bytes that are no character's): the texts of the context up to each of
        # them, longest first. The longest the output's first text still begins with is the
        # prompt's (bytes the output completed nothing of keep their U+FFFD there); the rest
        # is the output's, a character it completed included.
        self._unread_prompt = [self._decode(self.tokens[:end])
                               for end in range(len(self.tokens), self.read_offset, -1)]
        self.output_text = ""
        # Where asked (OpenAI's logprobs `text_offset`): where each token's text starts in
        # output_text, counted as the text grows. A token's own decode is no measure (a
        # SentencePiece token decoded alone loses its leading space, a byte of a multi-byte
        # character decodes to U+FFFD), and the bytes of one character all start where it does.
        self.text_offsets: Optional[List[int]] = [] if record_offsets else None
        self.stop_strings = params.stop
        self.hold_back = max((len(s) for s in self.stop_strings), default=1) - 1

    def update(self, new_token_ids: List[int], check_stop: bool = True,
               final: bool = False) -> Optional[str]:
        """Append tokens; return the stop string that ends the request, if one appeared.

        `check_stop` is False while min_tokens holds stop strings back; as in vLLM, text
        appended then is not searched later either, except where a stop string could start
        in it and end in the new text. `final`: the request ends with these tokens, so the
        text of those still unread is added too (see `flush`).
        """
        searched_from = len(self.output_text)
        for token_id in new_token_ids:
            self.tokens.append(token_id)
            start = len(self.output_text)
            text, own_start = self._decode_newest()
            self.output_text += text
            if self.text_offsets is not None:
                self.text_offsets.append(start + own_start)
        if final:
            self.flush()
        if not self.stop_strings or not check_stop:
            return None
        return self._find_stop(max(0, searched_from - self.hold_back))

    def _context(self, prompt: List[int]) -> Tuple[List[int], int]:
        """(prompt tokens to decode the output after, how many of them count as text already
        read): whole characters, then the start of one the prompt leaves incomplete, which
        the output's text then includes once complete. Where every window holds a U+FFFD
        (bytes that are no character, or the character itself), the last `most` tokens (vLLM
        primes its decoder with the prompt so: decoded on its own, the output would lose a
        SentencePiece word's leading space), all read but the start of a character the
        prompt leaves incomplete."""
        fewest, most = CONTEXT_TOKENS
        partials = range(min(MAX_PARTIAL_TOKENS, len(prompt) - 1) + 1)
        for partial in partials:
            whole = prompt[:len(prompt) - partial]
            for count in range(min(fewest, len(whole)), min(most, len(whole)) + 1):
                if "\ufffd" not in self._decode(whole[-count:]):
                    return whole[-count:] + prompt[len(whole):], count
        partial = next((p for p in partials if not self._decode(
            prompt[-most:len(prompt) - p]).endswith("\ufffd")), 0)
        context = prompt[-most:]
        return context, len(context) - partial

    def _decode(self, token_ids: List[int]) -> str:
        return self.tokenizer.decode(token_ids, self.params.skip_special_tokens)

    def flush(self) -> None:
        """The text of the tokens still unread, at the request's end: their complete
        characters, and a character they leave incomplete as U+FFFD, as tokenizer.decode
        gives it (a token holding one character and the first byte of the next would
        otherwise take both with it)."""
        if self.read_offset == len(self.tokens):
            return
        before = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        after = self._decode(self.tokens[self.prefix_offset:])
        before = self._prompts_part(before, after)
        if after.startswith(before):
            self.output_text += after[len(before):]
        self.prefix_offset = self.read_offset = len(self.tokens)

    def finish(self, check_stop: bool = True) -> Optional[str]:
        """The request ends on a token whose text it leaves out (a stop token): the text of
        those still unread (`flush`), searched for stop strings as `update`'s is."""
        searched_from = len(self.output_text)
        self.flush()
        if not self.stop_strings or not check_stop or len(self.output_text) == searched_from:
            return None
        return self._find_stop(max(0, searched_from - self.hold_back))

    def skip(self) -> None:
        """A token whose text the output leaves out (a stop token): it starts where the
        text ends."""
        if self.text_offsets is not None:
            self.text_offsets.append(len(self.output_text))

    def _decode_newest(self) -> Tuple[str, int]:
        """The text the newest token completes, and where the newest token's own text
        starts in it: after the tokens still unread before it where their text stays as it
        was (bytes that are no character keep their U+FFFD), else with them (the bytes of
        the character it completes)."""
        before = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        after = self._decode(self.tokens[self.prefix_offset:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            settled = self._settle(before, after)
            return settled, len(settled)  # the newest token is still unread, after it
        before = self._prompts_part(before, after)
        own_start = 0
        if self.text_offsets is not None and len(self.tokens) - self.read_offset > 1:
            unread = self._decode(self.tokens[self.prefix_offset:-1])
            if after.startswith(unread):
                own_start = max(0, len(unread) - len(before))
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return after[len(before):], own_start

    def _settle(self, before: str, after: str) -> str:
        """Past MAX_UNREAD_TOKENS unread, the text of all but the last MAX_PARTIAL_TOKENS
        that have text (they may still begin a character; skipped special tokens between
        a character's bytes do not part them), read as it is: its U+FFFD stay. The cut is
        the latest that splits no character (the text up to it begins `after`)."""
        if len(self.tokens) - self.read_offset <= MAX_UNREAD_TOKENS:
            return ""
        latest = len(self.tokens)
        if after.endswith("\ufffd"):
            with_text = 0
            while latest > self.read_offset and with_text < MAX_PARTIAL_TOKENS \
                    and len(self.tokens) - latest < 4 * MAX_UNREAD_TOKENS:
                latest -= 1
                with_text += bool(self._decode(self.tokens[latest:latest + 1]))
        for cut in range(latest, self.read_offset, -1):
            text = self._decode(self.tokens[self.prefix_offset:cut])
            if len(text) >= len(before) and after.startswith(text):
                before = self._prompts_part(before, text)
                self.prefix_offset, self.read_offset = self.read_offset, cut
                return text[len(before):]
        return ""

    def _prompts_part(self, before: str, text: str) -> str:
        """`before`, or where the context ends in prompt tokens not yet read, the longest of
        their texts that `text` begins with (the rest is the output's)."""
        if self._unread_prompt:
            before = next((t for t in self._unread_prompt
                           if len(t) > len(before) and text.startswith(t)), before)
            self._unread_prompt = []
        return before

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


def prompt_text_offsets(tokenizer: Tokenizer, token_ids: Sequence[int],
                        skip_special_tokens: bool = True) -> List[int]:
    """Where each token starts in the text of `token_ids` (an echoed prompt, its special
    tokens skipped unless asked), counted as the detokenizer grows it."""
    detokenizer = IncrementalDetokenizer(
        tokenizer, SamplingParams(skip_special_tokens=skip_special_tokens), record_offsets=True)
    detokenizer.update(list(token_ids), check_stop=False)
    return detokenizer.text_offsets

"""Structured outputs: a grammar (JSON schema, regex, choice, EBNF or Lark, any JSON)
constrains which tokens a request may sample next, through xgrammar (what vLLM and SGLang use).

A request's constraint is parsed when it arrives, so a bad schema is refused at once; the
expensive part, the per-token mask cache, is compiled on a background thread and kept by the
constraint's source, so a schema that many requests share is compiled once. The request
waits (the scheduler skips it) until its grammar is ready. Each step the sampler masks the
logits of every constrained row with one batched bitmask fill, and the engine advances each
request's matcher by the token it sampled. Preemption keeps a request's generated tokens, so
its matcher stays where it is and needs no rollback.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import re
import threading
import time
from typing import Optional, Sequence

import torch
import xgrammar as xgr

from fulcrum.sampling_params import StructuredOutputsParams
from fulcrum.tokenizer import Tokenizer

# Parsed and compiled grammars kept for reuse, the least recently used dropped first.
MAX_CACHED_GRAMMARS = 256
# What a request's grammar may take from the steps it shares with every request in the
# batch (masking its row, accepting its token: its thread's CPU time, not waits for the GIL
# or the OS), on average a token after a grace for its first ones. An ambiguous grammar
# grows slower token by token (208 ms a token by its 322nd here, for every request in the
# batch); a typical one takes well under a millisecond.
GRAMMAR_SECONDS_PER_TOKEN = 0.01
GRAMMAR_GRACE_SECONDS = 0.5
# xgrammar's errors start with a timestamp and its source file: "[12:00:00] /x/y.cc:42: ".
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _message(error: BaseException) -> str:
    return _LOCATION.sub("", str(error)).strip() or type(error).__name__


def _failure(future: concurrent.futures.Future) -> Optional[BaseException]:
    """What a finished compile raised (cancelled counts), or None."""
    if not future.done():
        return None
    if future.cancelled():
        return concurrent.futures.CancelledError("the compile was cancelled")
    return future.exception()


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> xgr.TokenizerInfo:
    """How xgrammar reads the vocabulary: each token's bytes, from `tokenizer.json` (byte-level
    BPE, byte fallback or raw), padded to the model's vocabulary size. Special tokens spell
    nothing (xgrammar then never allows them, the stop tokens aside where the grammar may
    end): read as their names, they let "<|im_start|>" count as 12 characters of a string
    that the answer, decoded without special tokens, did not hold (15 of 20 answers to
    `[a-z<|>_]{40}` broke it), and EOS end a choice of "<|im_end|>" as an empty answer."""
    vocab = tokenizer.vocab()
    encoded = [""] * max(vocab_size, max(vocab.values()) + 1)
    special = tokenizer.special_token_ids()
    for token, index in vocab.items():
        encoded[index] = "" if index in special else token
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.backend_json())
    return xgr.TokenizerInfo(encoded[:vocab_size], metadata["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=sorted(tokenizer.eos_token_ids) or None,
                             add_prefix_space=metadata["add_prefix_space"])


class RequestGrammar:
    """One request's place in its grammar: waits for the compiled grammar, then matches."""

    def __init__(self, compiled: "concurrent.futures.Future[xgr.CompiledGrammar]") -> None:
        self._compiled = compiled
        self._matcher: Optional[xgr.GrammarMatcher] = None
        self._seconds = 0.0  # spent masking and matching for this request
        self._tokens = 0

    @property
    def ready(self) -> bool:
        return self._compiled.done() and _failure(self._compiled) is None

    @property
    def error(self) -> Optional[str]:
        """Why compiling failed, once it has."""
        failure = _failure(self._compiled)
        return None if failure is None else f"compiling the grammar failed: {_message(failure)}"

    @property
    def future(self) -> concurrent.futures.Future:
        return self._compiled

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        if self._matcher is None:
            self._matcher = xgr.GrammarMatcher(self._compiled.result())
        return self._matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write into `bitmask`'s `row` the tokens the grammar allows next."""
        start = time.thread_time()
        self.matcher.fill_next_token_bitmask(bitmask, row)
        self._seconds += time.thread_time() - start

    def accept(self, token_id: int) -> bool:
        start = time.thread_time()
        accepted = self.matcher.accept_token(token_id)
        self._seconds += time.thread_time() - start
        self._tokens += 1
        return accepted

    @property
    def too_costly(self) -> Optional[str]:
        """Why the grammar may not go on (it takes too long a token), or None."""
        if self._seconds <= GRAMMAR_GRACE_SECONDS + GRAMMAR_SECONDS_PER_TOKEN * self._tokens:
            return None
        return (f"the structured-output grammar took {1e3 * self._seconds / self._tokens:.0f}"
                f" ms a token, more than the {1e3 * GRAMMAR_SECONDS_PER_TOKEN:.0f} ms a request "
                "may take from every step (the whole batch waits for it); simplify the "
                "constraint")

    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing more may come."""
        return self._matcher is not None and self._matcher.is_terminated()


class GrammarCompiler:
    """Parses constraints and compiles them off the engine thread, one compile per source."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(tokenizer_info(tokenizer, vocab_size),
                                             max_threads=1)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="fulcrum-grammar")
        self._cache: "collections.OrderedDict[tuple, concurrent.futures.Future]" = \
            collections.OrderedDict()
        # Parsed once per constraint: the server's check, the engine's and the compile each
        # ask, from the event loop and the engine thread (a 5,000-property schema parses in
        # ~50 ms).
        self._parsed: "collections.OrderedDict[tuple, xgr.Grammar]" = collections.OrderedDict()
        self._parsed_lock = threading.Lock()

    def parse(self, params: StructuredOutputsParams) -> xgr.Grammar:
        """The constraint as a grammar; ValueError (naming what is wrong) if it is invalid."""
        key = _key(params)
        with self._parsed_lock:
            grammar = self._parsed.get(key)
            if grammar is not None:
                self._parsed.move_to_end(key)
                return grammar
        grammar = _parse(params)
        with self._parsed_lock:
            _keep(self._parsed, key, grammar)
        return grammar

    def grammar_for(self, params: StructuredOutputsParams) -> RequestGrammar:
        """A new request's grammar; its compiled form is shared with every request that has
        the same constraint."""
        key = _key(params)
        compiled = self._cache.get(key)
        if compiled is None or _failure(compiled) is not None:
            compiled = self._executor.submit(self._compiler.compile_grammar, self.parse(params))
        _keep(self._cache, key, compiled)
        return RequestGrammar(compiled)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _key(params: StructuredOutputsParams) -> tuple:
    """A constraint's cache key: a digest of its source (up to 1 MiB) rather than the text."""
    digest = hashlib.blake2b(params.source.encode("utf-8", "surrogatepass"), digest_size=16)
    return params.kind, digest.digest(), params.disable_any_whitespace


def _keep(cache: collections.OrderedDict, key: tuple, value) -> None:
    """Store as the most recently used; the least recently used beyond the limit go."""
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > MAX_CACHED_GRAMMARS:
        cache.popitem(last=False)


def _parse(params: StructuredOutputsParams) -> xgr.Grammar:
    kind = params.kind
    any_whitespace = not params.disable_any_whitespace
    try:
        if kind == "json":
            return _json_schema_grammar(params.source, any_whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(
                _ebnf_literal(c) for c in params.choice))
        if kind == "grammar":
            return _grammar(params.grammar)
        # json_object: any JSON object (OpenAI's JSON mode), not any JSON value.
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
    except RuntimeError as error:
        raise ValueError(f"invalid {kind} constraint: {_message(error)}") from None


# A comment in a grammar, EBNF's or Lark's.
_COMMENT = re.compile(r"(#|//).*$")


def _grammar(source: str) -> xgr.Grammar:
    """An EBNF grammar (xgrammar's, GBNF-like: `root ::= ...`), or a Lark one (`start: ...`),
    which vLLM takes too (it converts them to EBNF): as vLLM tells them apart, a grammar none
    of whose lines holds "::=" is Lark."""
    if any("::=" in _COMMENT.sub("", line) for line in source.splitlines()):
        return xgr.Grammar.from_ebnf(source)
    return xgr.Grammar.from_lark(source)


# xgrammar 0.2.9 writes a string with minLength/maxLength as so many characters of
# [^"\\\r\n]: control characters, which no JSON string holds raw (the output was no JSON).
# They become JSON's plain string characters, control characters, quotes and backslashes
# left out: escapes too would make each token cost hundreds of milliseconds to match (a
# repetition of alternatives; 528 ms at maxLength 200 on a 49k vocabulary), so such strings
# are written without them.
_LENGTH_BOUNDED_CHARACTER = '(([^\\"\\\\\\r\\n]))'
_JSON_STRING_CHARACTER = '(([^\\0-\\x1f\\"\\\\]))'


def _json_schema_grammar(schema: str, any_whitespace: bool) -> xgr.Grammar:
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace)
    text = str(grammar)
    if _LENGTH_BOUNDED_CHARACTER not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LENGTH_BOUNDED_CHARACTER, _JSON_STRING_CHARACTER))


def _ebnf_literal(text: str) -> str:
    """`text` as an EBNF string literal: quotes, backslashes and control characters escaped."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + "".join(c if c >= " " else f"\\x{ord(c):02x}" for c in escaped) + '"'


def apply_grammar_masks(logits: torch.Tensor,
                        grammars: Sequence[Optional[RequestGrammar]]) -> None:
    """Set to -inf, in place, the logits of tokens each row's grammar forbids now (rows
    without a grammar are left alone). One bitmask fill for the whole batch."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return
    vocab = logits.shape[-1]
    bitmask = xgr.allocate_token_bitmask(len(grammars), vocab)
    for i in rows:
        grammars[i].fill(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=vocab,
                                    indices=rows)

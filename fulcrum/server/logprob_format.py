"""Logprobs as OpenAI's APIs show them: the completions API's legacy lists (echoed prompt
first), chat's content entries, and vLLM's prompt_logprobs field."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

from fulcrum.outputs import Logprob
from fulcrum.server.choices import Delta
from fulcrum.server.protocol import (ChatLogprobs, CompletionLogprobs, PromptLogprob,
                                     TokenLogprob, TopLogprob)


def _json_logprob(value: float) -> float:
    """A logprob JSON can carry: a token a constraint masks has -inf, which JSON lacks
    (pydantic wrote null where OpenAI's schema wants a number); vLLM's servers send -9999."""
    return max(value, -9999.0)


def _token_name(token_id: int, logprob: Optional[Logprob], as_id: bool,
                decode: Callable[[int], str]) -> str:
    """A token as logprobs show it: its text, or vLLM's "token_id:N" where asked."""
    if as_id:
        return f"token_id:{token_id}"
    return (logprob.decoded_token or "") if logprob is not None else decode(token_id)


def legacy_logprobs(delta: Delta, decode: Callable[[int], str],
                     as_ids: bool = False) -> CompletionLogprobs:
    """OpenAI's completions logprobs, the echoed prompt's first (its first token has none)."""
    result = CompletionLogprobs(text_offset=list(delta.text_offsets))
    entries = list(zip(delta.prompt_token_ids, delta.prompt_logprobs or
                       [None] * len(delta.prompt_token_ids)))
    for token_id, entry in entries + list(zip(delta.token_ids, delta.logprobs)):
        chosen = entry[token_id] if entry else None
        result.tokens.append(_token_name(token_id, chosen, as_ids, decode))
        result.token_logprobs.append(_json_logprob(chosen.logprob) if chosen else None)
        top: Optional[Dict[str, float]] = None
        if entry:
            top = {}
            # Tokens may decode alike: the likelier one keeps the text's key.
            for tid, lp in sorted(entry.items(), key=lambda item: item[1].rank):
                top.setdefault(_token_name(tid, lp, as_ids, decode), _json_logprob(lp.logprob))
        result.top_logprobs.append(top)
    return result


def prompt_logprobs(entries: Optional[list]) -> Optional[list]:
    """vLLM's prompt_logprobs field: per prompt token, token id -> logprob, rank, text."""
    if entries is None:
        return None
    return [None if e is None else {t: PromptLogprob(logprob=_json_logprob(lp.logprob),
                                                     rank=lp.rank,
                                                     decoded_token=lp.decoded_token)
                                    for t, lp in e.items()} for e in entries]


def top_logprob(token_id: int, logprob: Logprob, as_id: bool) -> TopLogprob:
    token = _token_name(token_id, logprob, as_id, str)
    return TopLogprob(token=token, logprob=_json_logprob(logprob.logprob),
                      bytes=list(token.encode()))


def chat_logprobs(entries: List[Dict[int, Logprob]], token_ids: List[int],
                   num_top: int, as_ids: bool = False) -> ChatLogprobs:
    content = []
    for token_id, entry in zip(token_ids, entries):
        tops = sorted(entry.items(), key=lambda item: item[1].rank)[:num_top]
        chosen = top_logprob(token_id, entry[token_id], as_ids)
        content.append(TokenLogprob(**chosen.model_dump(), top_logprobs=[
            top_logprob(tid, lp, as_ids) for tid, lp in tops]))
    return ChatLogprobs(content=content)

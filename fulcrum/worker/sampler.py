"""Turn a batch of logits into next tokens, one vectorised pass for the whole batch.

Order (as in vLLM): structured-output grammars mask the tokens they forbid; raw logprobs are
taken from the model's logits; then allowed_token_ids, bad_words and logit_bias; repetition,
frequency and presence penalties; min_tokens masks the stop tokens; greedy rows take the
argmax; the others are divided by their temperature, filtered by min_p, top_k and top_p, and
sampled by inverting each row's cumulative distribution at one uniform draw (kernels.sample
on a CPU, whose filters look only at the tokens that can pass them, where torch sorts whole
rows; `_sample_with_torch` elsewhere). One random number a row, where the exponential race
draws one per vocabulary entry: on a CPU that is ~60 ms for 64 rows of a 49k vocabulary
against ~2. A seeded request draws its number from its own generator, so its tokens do not
depend on what else is in the batch.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from fulcrum import kernels
from fulcrum.core.request import SamplingRow
from fulcrum.outputs import Logprob, RequestFault, SampledToken
from fulcrum.sampling_params import SamplingParams


class RowsFailed(ValueError):
    """Rows that had nothing to sample. `failures` maps a row's index to why (a RequestFault
    where the request's own constraints ruled out every token); `sampled` holds the other
    rows' tokens (None for the failed), so that they are not drawn again: a seeded request's
    generator has moved on, and a second draw would change its output."""

    def __init__(self, failures: Dict[int, str], sampled: List[Optional[SampledToken]]):
        super().__init__("; ".join(failures.values()))
        self.failures, self.sampled = failures, sampled


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._request_generators: Dict[str, torch.Generator] = {}
        # Each request's allowed_token_ids as an array, made once: a list of 1,000 ids made
        # into one at every step cost ~3 ms of a 64-row step.
        self._allowed_ids: Dict[str, np.ndarray] = {}

    def forget(self, request_ids: List[str]) -> None:
        for request_id in request_ids:
            self._request_generators.pop(request_id, None)
            self._allowed_ids.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, rows: List[SamplingRow],
                 argmax: Optional[torch.Tensor] = None) -> List[SampledToken]:
        """`argmax`: each row's argmax of `logits` as given (the native LM head takes it in
        the same call, where the kernels' wrapper would cost ~0.15 ms of cold Python at batch
        1); greedy rows take it if nothing changes the logits first."""
        given = logits
        masked = any(r.grammar is not None for r in rows)
        if masked:
            # xgrammar is imported with the first constrained request, not at start-up.
            from fulcrum.structured_output import apply_grammar_masks
            apply_grammar_masks(logits, [r.grammar for r in rows])
            argmax = None  # masked in place
        raw = logits  # what logprobs report (the controls and penalties below copy it)
        logits = self._apply_token_controls(logits, rows)
        logits = self._apply_penalties(logits, rows)
        logits = self._mask_stops_before_min_tokens(logits, rows)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows and len(random_rows) == len(rows):  # no greedy row: no argmax, no copy
            tokens = self._sample(logits, rows)
        else:
            tokens = argmax if argmax is not None and logits is given else kernels.argmax(logits)
            if random_rows:
                index = torch.tensor(random_rows, device=logits.device)
                tokens[index] = self._sample(logits[index], [rows[i] for i in random_rows])
        token_list = tokens.tolist()
        failures = self._check_chosen(given, logits if masked or logits is not given else None,
                                      tokens, token_list)
        logprobs = _chosen_logprobs(raw, failures, token_list, rows)
        sampled = [None if i in failures else SampledToken(t, logprobs.get(i))
                   for i, t in enumerate(token_list)]
        if failures:
            raise RowsFailed(failures, sampled)
        return sampled

    @staticmethod
    def _check_chosen(given: torch.Tensor, changed: Optional[torch.Tensor],
                      tokens: torch.Tensor, token_list: List[int]) -> Dict[int, str]:
        """The rows that chose a token their logits rule out, and why: a row whose constraints
        exclude every token (a grammar that no text matches, allowed_token_ids all in
        bad_words), or whose penalty overflowed its logits to inf or NaN, has nothing to
        sample; argmax then picks a masked token, and the inverse CDF of NaN weights one past
        the vocabulary, which the next forward pass, shared by the whole batch, would fail on.

        `changed`: the logits after masks and penalties, None where nothing changed them;
        then no token is ruled out and only the range is checked (each torch op on the
        cache-cold path after a batch-1 forward costs ~25-100 µs): a greedy row then takes
        its argmax as torch.argmax would, a NaN included, as vLLM does.

        The failure is the request's (a RequestFault) unless the model's own logits for the
        row hold a NaN or +inf (masks only add -inf)."""
        vocab = given.shape[-1]
        bad = {i for i, t in enumerate(token_list) if not 0 <= t < vocab}
        if changed is not None:
            chosen = changed.gather(1, tokens.clamp(0, vocab - 1).view(-1, 1)).view(-1).tolist()
            bad |= {i for i, value in enumerate(chosen) if not math.isfinite(value)}
        return {i: _why_nothing(given[i]) for i in sorted(bad)}

    # ------------------------------------------------------- token controls
    def _allowed(self, row: SamplingRow) -> np.ndarray:
        ids = self._allowed_ids.get(row.request_id)
        if ids is None:
            ids = np.asarray(row.params.allowed_token_ids, dtype=np.int64)
            self._allowed_ids[row.request_id] = ids
        return ids

    def _apply_token_controls(self, logits: torch.Tensor,
                              rows: List[SamplingRow]) -> torch.Tensor:
        """allowed_token_ids, then bad_words, then logit_bias, for all rows at once (one
        gather or scatter each over the ids the rows name; rows without them cost one check
        each)."""
        controlled = [i for i, r in enumerate(rows) if r.params.logit_bias
                      or r.params.allowed_token_ids or r.bad_words_token_ids]
        if not controlled:
            return logits
        logits = _writable_copy(logits)
        flat, vocab = logits.view(-1), logits.shape[-1]
        allowed = [i for i in controlled if rows[i].params.allowed_token_ids]
        if allowed:
            index = _flat_index(vocab, [(i, self._allowed(rows[i])) for i in allowed],
                                logits.device)
            kept = flat[index]
            logits[allowed] = float("-inf")
            flat[index] = kept
        banned = _flat_index(vocab, [(i, _banned_by_bad_words(rows[i])) for i in controlled],
                             logits.device)
        flat[banned] = float("-inf")
        biased = [(i, rows[i].params.logit_bias) for i in controlled if rows[i].params.logit_bias]
        if biased:
            index = _flat_index(vocab, [(i, list(bias)) for i, bias in biased], logits.device)
            flat[index] += torch.tensor([v for _, bias in biased for v in bias.values()],
                                        dtype=logits.dtype, device=logits.device)
        return logits

    # -------------------------------------------------------------- penalties
    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: List[SamplingRow]) -> torch.Tensor:
        """vLLM's penalties, for all rows at once and only on the tokens they touch: the
        repetition penalty on each token of a row's prompt or output once, then the
        frequency penalty times its count in the output and the presence penalty once."""
        penalised = [i for i, r in enumerate(rows) if r.params.uses_penalties]
        if not penalised:
            return logits
        logits = _writable_copy(logits)
        flat, vocab, device = logits.view(-1), logits.shape[-1], logits.device
        repeated = [i for i in penalised if rows[i].params.repetition_penalty != 1.0]
        if repeated:
            keys = np.unique(_flat_keys(vocab, [(i, rows[i].all_token_ids) for i in repeated]))
            factor = _per_key(keys, vocab, rows, "repetition_penalty", logits.dtype, device)
            index = torch.from_numpy(keys).to(device)
            value = flat[index]
            penalised_value = torch.where(value > 0, value / factor, value * factor)
            # A tiny penalty may push a logit past float32's range: the largest finite one
            # instead (+inf left no token to sample); masked tokens stay at -inf, and a NaN
            # stays one (the model's fault, which _check_chosen reports as such).
            flat[index] = torch.nan_to_num(penalised_value, nan=float("nan"),
                                           posinf=torch.finfo(value.dtype).max,
                                           neginf=float("-inf"))
        counted = [i for i in penalised if rows[i].params.frequency_penalty != 0.0
                   or rows[i].params.presence_penalty != 0.0]
        outputs = [(i, rows[i].all_token_ids[rows[i].num_prompt_tokens:]) for i in counted]
        keys, counts = np.unique(_flat_keys(vocab, outputs), return_counts=True)
        if len(keys):
            index = torch.from_numpy(keys).to(device)
            value = flat[index]
            value -= _per_key(keys, vocab, rows, "frequency_penalty", logits.dtype, device) * \
                torch.from_numpy(counts).to(device=device, dtype=logits.dtype)
            value -= _per_key(keys, vocab, rows, "presence_penalty", logits.dtype, device)
            flat[index] = value
        return logits

    @staticmethod
    def _mask_stops_before_min_tokens(logits: torch.Tensor,
                                      rows: List[SamplingRow]) -> torch.Tensor:
        """Hold stop tokens back until min_tokens are out; except where a grammar allows
        nothing else (its output is complete): the constraint then ends the request, which
        would otherwise have no token left to take."""
        masked = False
        for i, row in enumerate(rows):
            num_out = len(row.all_token_ids) - row.num_prompt_tokens
            if num_out < row.params.min_tokens and row.stop_token_ids:
                if row.grammar is not None and not _allows_more_than(logits[i],
                                                                    row.stop_token_ids):
                    continue
                if not masked:
                    logits, masked = logits.clone(), True
                logits[i, row.stop_token_ids] = float("-inf")
        return logits

    # --------------------------------------------------------------- sampling
    def _sample(self, logits: torch.Tensor, rows: List[SamplingRow]) -> torch.Tensor:
        device = logits.device
        u = torch.rand(len(rows), 1, generator=self.generator, device=device,
                       dtype=torch.float64)
        for i, row in enumerate(rows):
            if row.params.seed is not None:
                u[i] = torch.rand(1, generator=self._generator_for(row), device=device,
                                  dtype=torch.float64)
        params = [r.params for r in rows]
        if kernels.can_sample(logits):
            return kernels.sample(logits, [p.temperature for p in params],
                                  [p.min_p for p in params], [p.top_k for p in params],
                                  [p.top_p for p in params], u)
        return _sample_with_torch(logits, params, u)

    def _generator_for(self, row: SamplingRow) -> torch.Generator:
        generator = self._request_generators.get(row.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(row.params.seed)
            self._request_generators[row.request_id] = generator
        return generator

def _why_nothing(logits: torch.Tensor) -> str:
    """The engine's fault where the model's own logits hold a NaN or +inf (masks only add
    -inf), else the request's. (Callers name the request: an engine child's id, as in
    "0_cmpl-...", would not be the one its client knows.)"""
    if bool((torch.isnan(logits) | torch.isposinf(logits)).any()):
        return "the model's logits are not finite"
    return RequestFault("no token can be sampled: its constraints and penalties leave none "
                        "with a finite logit")


def logprob_entries(logits: torch.Tensor, token_ids: List[int],
                    num_top: Union[int, Sequence[int]]) -> List[Dict[int, Logprob]]:
    """For each row of `logits` ([rows, vocab], fp32): its token's logprob (log-softmax) and
    rank (1 = most likely), then its `num_top` (one for all rows, or one a row) most likely
    tokens, as vLLM reports them."""
    tops = [num_top] * len(token_ids) if isinstance(num_top, int) else list(num_top)
    chosen, ranks, top_values, top_ids = _logprob_parts(logits, token_ids, max(tops, default=0))
    entries = [{t: Logprob(v, r)} for t, v, r in zip(token_ids, chosen, ranks)]
    for entry, values, top, count in zip(entries, top_values, top_ids, tops):
        for rank, (value, token) in enumerate(zip(values[:count], top[:count]), start=1):
            entry.setdefault(token, Logprob(value, rank))
    return entries


def _logprob_parts(logits: torch.Tensor, token_ids: List[int], num_top: int
                   ) -> Tuple[List[float], List[int], List[List[float]], List[List[int]]]:
    """(each row's logprob at its token, its rank, its num_top best logprobs and their ids):
    on a CPU the native kernel, which writes no log-softmax out (torch's path reads and
    writes each row four times); torch's path for the rows it leaves (NaN or +inf logits)."""
    if not kernels.can_sample(logits):
        return _logprob_parts_with_torch(logits, token_ids, num_top)
    chosen, ranks, values, ids, answered = kernels.logprobs(logits, token_ids, num_top)
    parts = chosen.tolist(), ranks.tolist(), values.tolist(), ids.tolist()
    left = (~answered).nonzero().view(-1).tolist()
    if left:
        redone = _logprob_parts_with_torch(logits[left], [token_ids[i] for i in left], num_top)
        for whole, part in zip(parts, redone):
            for i, value in zip(left, part):
                whole[i] = value
    return parts


def _logprob_parts_with_torch(logits: torch.Tensor, token_ids: List[int], num_top: int
                              ) -> Tuple[List[float], List[int], List[List[float]],
                                         List[List[int]]]:
    logprobs = torch.log_softmax(logits, dim=-1)
    ids = torch.tensor(token_ids, device=logprobs.device).unsqueeze(1)
    chosen = logprobs.gather(1, ids)
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    values, top = logprobs.topk(num_top, dim=-1) if num_top else (logprobs[:, :0],) * 2
    return chosen.squeeze(1).tolist(), ranks, values.tolist(), top.long().tolist()


def _chosen_logprobs(raw: torch.Tensor, failures: Dict[int, str], tokens: List[int],
                     rows: List[SamplingRow]) -> Dict[int, Dict[int, Logprob]]:
    """Each row's logprob entries by its index in the batch, for the rows that asked and
    have a token; `raw`: the logits they are taken from."""
    kept = [i for i, r in enumerate(rows) if r.params.logprobs is not None and i not in failures]
    if not kept:
        return {}
    entries = logprob_entries(raw if len(kept) == len(rows) else raw[kept],
                              [tokens[i] for i in kept], [rows[i].params.logprobs for i in kept])
    return dict(zip(kept, entries))


def _writable_copy(logits: torch.Tensor) -> torch.Tensor:
    """A contiguous copy, which `.view(-1)` turns into one flat row of every (row, token)."""
    return logits.clone(memory_format=torch.contiguous_format)


def _flat_keys(vocab: int, ids_by_row: List[Tuple[int, Sequence[int]]]) -> np.ndarray:
    """Each (row, token) as row * vocab + token: its place in the flat view of the logits.
    Token ids were checked against the vocabulary when their request was added (bad words
    with ids past it left out): an id past it would land on the next row."""
    parts = [row * vocab + np.asarray(ids, dtype=np.int64) for row, ids in ids_by_row if len(ids)]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def _flat_index(vocab: int, ids_by_row: List[Tuple[int, Sequence[int]]],
                device: torch.device) -> torch.Tensor:
    return torch.from_numpy(_flat_keys(vocab, ids_by_row)).to(device)


def _per_key(keys: np.ndarray, vocab: int, rows: List[SamplingRow], name: str,
             dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The sampling parameter `name` of the row of each flat key."""
    by_row = np.array([getattr(r.params, name) for r in rows], dtype=np.float64)
    return torch.from_numpy(by_row[keys // vocab]).to(device=device, dtype=dtype)


def _allows_more_than(logits: torch.Tensor, token_ids: List[int]) -> bool:
    """Whether a row's logits leave some token outside `token_ids` possible."""
    possible = logits > float("-inf")
    possible[token_ids] = False
    return bool(possible.any())


def _banned_by_bad_words(row: SamplingRow) -> List[int]:
    """The next tokens that would complete a bad word (vLLM's rule): a one-token word always,
    a longer one when the output ends with all of it but its last token."""
    output = row.all_token_ids[row.num_prompt_tokens:]
    banned = []
    for word in row.bad_words_token_ids:
        prefix = word[:-1]
        if len(prefix) <= len(output) and output[len(output) - len(prefix):] == prefix:
            banned.append(word[-1])
    return banned


def _sample_with_torch(logits: torch.Tensor, params: List[SamplingParams],
                       u: torch.Tensor) -> torch.Tensor:
    """Each row's token at its uniform u from softmax(logits / T) after min_p, top_k and top_p:
    the portable path of kernels.sample (which follows the same rules)."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    logits = logits / temperature.unsqueeze(1)
    min_p = [p.min_p for p in params]
    if any(min_p):
        probs = logits.softmax(dim=-1)
        threshold = torch.tensor(min_p, device=device).unsqueeze(1) * \
            probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if any(top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    return _inverse_cdf(logits.softmax(dim=-1), u)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor, block: int = 256) -> torch.Tensor:
    """Each row's token at cumulative probability u (in [0, 1)) of its total, in two levels:
    the block of `block` tokens it falls in, then the token within that block. Sums are in
    float64, so a token of tiny probability keeps its share; the chosen token always has
    probability above zero (masked tokens are never drawn). Two short prefix sums instead of
    one over the whole vocabulary: ~3x faster on a CPU."""
    rows, vocab = probs.shape
    num_blocks = -(-vocab // block)
    blocks = torch.nn.functional.pad(probs, (0, num_blocks * block - vocab)).view(
        rows, num_blocks, block)
    block_cdf = blocks.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)
    target = u * block_cdf[:, -1:]
    chosen = torch.searchsorted(block_cdf, target, right=True).clamp_(max=num_blocks - 1)
    before = torch.where(chosen > 0, block_cdf.gather(1, (chosen - 1).clamp(min=0)), 0.0)
    inner = blocks[torch.arange(rows, device=probs.device), chosen.squeeze(1)].cumsum(
        dim=-1, dtype=torch.float64)
    # Strictly below the block's own total, which its sum above may miss by a rounding.
    rest = torch.minimum(target - before, torch.nextafter(inner[:, -1:], inner.new_zeros(())))
    return (chosen * block + torch.searchsorted(inner, rest, right=True)).squeeze(1)


def _top_k_top_p(logits: torch.Tensor, top_k: List[int], top_p: List[float]) -> torch.Tensor:
    """Mask all but each row's top_k tokens and its smallest nucleus of mass top_p."""
    vocab = logits.shape[-1]
    device = logits.device
    # stable: of equal logits the lower token id ranks first, as in kernels.sample
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    k = torch.tensor([t if 0 < t < vocab else vocab for t in top_k], device=device)
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    remove = ranks >= k.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    p = torch.tensor(top_p, device=device).unsqueeze(1)
    remove |= mass_before >= p
    remove[:, 0] = False  # always keep the most likely token
    return logits.masked_fill(torch.zeros_like(remove).scatter(1, order, remove), float("-inf"))

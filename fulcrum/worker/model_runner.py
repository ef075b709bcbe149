"""Run one scheduled step: pack the chunks into flat tensors, one forward pass, sample.

Inputs are built with numpy in a handful of vectorised operations (no per-token Python
loops): flat token ids and positions, the cache slot of every new token, and the
attention metadata (single-token queries first, then prefill chunks). A step of single tokens
(decodes) is written instead, in plain Python, into one persistent buffer (`SingleTokenInputs`).

Under tensor parallelism every rank runs the same forward pass and the same LM-head calls
(their collectives must pair up); the driver's runner alone samples (`execute`), the
others `follow` from the chunks the driver sends them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from fulcrum.models.attention import AttentionBackend, AttentionMetadata, PrefillSpan
from fulcrum.worker.kv_cache import NULL_BLOCK
from fulcrum.models.layers import DecoderForCausalLM, KVCache
from fulcrum.core.request import SamplingRow
from fulcrum.outputs import Logprob, SampledToken
from fulcrum.worker.sampler import RowsFailed, Sampler, logprob_entries
from fulcrum.core.scheduler import ScheduledChunk, SchedulerOutput

logger = logging.getLogger(__name__)
# Prompt logprobs take the whole vocabulary's logits of every position: this many at a time.
PROMPT_LOGPROB_ROWS = 256


@dataclass
class StepResult:
    """What a step computed: each sampling request's new token, why sampling failed for the
    requests it failed for (they alone fail), and prompt logprobs of chunks that asked."""

    sampled: Dict[str, SampledToken] = field(default_factory=dict)
    failed: Dict[str, str] = field(default_factory=dict)
    prompt_logprobs: Dict[str, List[Dict[int, Logprob]]] = field(default_factory=dict)


@dataclass(slots=True)
class ChunkInput:
    """A chunk as the driver sends it to the other ranks: the blocks its request got since
    the last step that sent it (`block_table` is rebuilt by the receiving rank)."""

    request_id: str
    token_ids: List[int]
    start_pos: int
    new_blocks: List[int]
    sample: bool
    num_prompt_logprob_targets: int
    prompt_logprob_row: int
    block_table: List[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def step_order(chunks: Sequence[ScheduledChunk]) -> List[ScheduledChunk]:
    """The runner's row order: single-token queries first, then prefill chunks."""
    return sorted(chunks, key=lambda c: c.num_tokens > 1)


class SingleTokenInputs:
    """The inputs of a step where every chunk is one token, in one persistent int64 buffer
    whose views (and metadata) are kept for the next step of the same shape: decode steps
    come by the hundred alike, and there a step's inputs cost one numpy write instead of
    several torch calls. What it returns is overwritten by the next step's inputs."""

    def __init__(self, device: torch.device, sliding_window: int) -> None:
        self.device, self.sliding_window = device, sliding_window
        self._host = torch.zeros(0, dtype=torch.int64)
        self._staged, self._numpy = self._host, self._host.numpy()
        self._key: Optional[Tuple[int, int, Optional[int]]] = None
        self._views: Optional[tuple] = None

    def __call__(self, flat: List[int], n: int, width: int, rows: Optional[List[int]]):
        """Token ids, positions, attention metadata and logits rows (None: every row) of a
        step of `n` tokens, from `flat`: ids, positions, slots, query starts (n + 1),
        sequence lengths and block tables (n x `width`)."""
        num_rows = None if rows is None else len(rows)
        flat += rows or []
        if len(flat) > len(self._numpy):
            self._host = torch.zeros(2 * len(flat), dtype=torch.int64)
            self._numpy = self._host.numpy()
            self._staged = self._host.to(self.device)
            self._key = None
        self._numpy[:len(flat)] = flat
        if self._staged is not self._host:
            self._staged[:len(flat)].copy_(self._host[:len(flat)])
        if self._key != (n, width, num_rows):
            self._key, self._views = (n, width, num_rows), self._make_views(n, width, num_rows)
        return self._views

    def _make_views(self, n: int, width: int, num_rows: Optional[int]):
        sizes = [n, n, n, n + 1, n, n * width, num_rows or 0]
        token_ids, positions, slots, query_start, seq_lens, tables, rows = \
            self._staged[:sum(sizes)].split(sizes)
        meta = AttentionMetadata(slot_mapping=slots, block_tables=tables.view(n, width),
                                 query_start_loc=query_start, seq_lens=seq_lens,
                                 num_decodes=n, sliding_window=self.sliding_window)
        return token_ids, positions, meta, None if num_rows is None else rows


class ModelRunner:
    def __init__(self, model: DecoderForCausalLM, kv_caches: List[KVCache], block_size: int,
                 device: torch.device, seed: int, backend: AttentionBackend) -> None:
        self.model = model
        self.reads_padding = backend.reads_padding
        self.splits = backend.splits
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sliding_window: Optional[int] = model.spec.sliding_window
        self.device = device
        self.sampler = Sampler(seed, device)
        self._single_token_inputs = SingleTokenInputs(device, self.sliding_window or 0)
        self.last_forward_seconds = 0.0

    def execute(self, output: SchedulerOutput) -> StepResult:
        """Compute the step: the new token of every chunk that reaches its end."""
        # A preempted request keeps its seeded generator: it resumes where it stopped.
        self.sampler.forget(output.finished_request_ids)
        if output.is_empty:
            return StepResult()
        chunks = step_order(output.chunks)
        hidden, logits, argmax = self._forward(chunks)
        result = StepResult(prompt_logprobs=self._prompt_logprobs(hidden, chunks))
        if logits is not None:
            result.sampled, result.failed = self._sample(
                logits, argmax, [c.sampling for c in chunks if c.sample])
        return result

    def follow(self, chunks: Sequence[ChunkInput]) -> None:
        """A non-driver rank's step: the driver's forward pass and LM-head calls, on this
        rank's share of the model; the driver samples."""
        hidden, _, _ = self._forward(chunks)
        with torch.inference_mode():
            for _, _, rows in self._prompt_logprob_rows(chunks):
                self.model.compute_logits(hidden[rows])

    def _forward(self, chunks) -> Tuple[torch.Tensor, Optional[torch.Tensor],
                                        Optional[torch.Tensor]]:
        """(hidden states of every row, logits of the rows that sample, None if none does,
        and their argmax where the forward pass gave it)."""
        input_ids, positions, meta, logits_rows = self._prepare(chunks)
        start = time.perf_counter()
        outputs = self.model.forward_with_logits(input_ids, positions, self.kv_caches, meta,
                                                 logits_rows)
        self.last_forward_seconds = time.perf_counter() - start
        return outputs

    @staticmethod
    def _prompt_logprob_rows(chunks) -> Iterator[Tuple[object, slice, slice]]:
        """(chunk, its targets' part, the hidden rows that predict them), in the order every
        rank computes them, PROMPT_LOGPROB_ROWS at a time."""
        offset = 0
        for chunk in chunks:
            row = offset + chunk.prompt_logprob_row
            for first in range(0, chunk.num_prompt_logprob_targets, PROMPT_LOGPROB_ROWS):
                last = min(first + PROMPT_LOGPROB_ROWS, chunk.num_prompt_logprob_targets)
                yield chunk, slice(first, last), slice(row + first, row + last)
            offset += chunk.num_tokens

    def _prompt_logprobs(self, hidden: torch.Tensor,
                         chunks: List[ScheduledChunk]) -> Dict[str, List[Dict[int, Logprob]]]:
        """Logprobs of the prompt tokens that chunks' positions predict (raw, as vLLM's).
        Inference mode is entered only for chunks that ask: entering it after a forward pass
        costs ~40 us, the caches being cold, and almost no step asks."""
        found: Dict[str, List[Dict[int, Logprob]]] = {}
        for chunk, part, rows in self._prompt_logprob_rows(chunks):
            with torch.inference_mode():
                logits = self.model.compute_logits(hidden[rows])
            found.setdefault(chunk.request_id, []).extend(logprob_entries(
                logits.float(), chunk.prompt_logprob_targets[part], chunk.num_prompt_logprobs))
        return found

    def _sample(self, logits: torch.Tensor, argmax: Optional[torch.Tensor],
                rows: List[SamplingRow]) -> Tuple[Dict[str, SampledToken], Dict[str, str]]:
        """Sample the batch at once; rows with nothing to sample fail alone, the others keep
        their tokens. Any other failure: row by row, so one bad row fails alone."""
        try:
            return {row.request_id: t
                    for row, t in zip(rows, self.sampler(logits, rows, argmax))}, {}
        except RowsFailed as error:
            return ({row.request_id: t for row, t in zip(rows, error.sampled) if t is not None},
                    {rows[i].request_id: why for i, why in error.failures.items()})
        except Exception:  # noqa: BLE001 - isolated below, row by row
            logger.exception("sampling the batch failed; sampling its rows one by one")
        sampled, failed = {}, {}
        for i, row in enumerate(rows):
            try:
                sampled[row.request_id] = self.sampler(logits[i:i + 1], [row])[0]
            except RowsFailed as error:
                failed[row.request_id] = error.failures[0]
            except Exception as error:  # noqa: BLE001 - this request fails, the others go on
                failed[row.request_id] = f"sampling failed: {error!r}"
        return sampled, failed

    # ------------------------------------------------------------------ inputs
    def _prepare(self, chunks: List[ScheduledChunk]):
        if not self.splits and all(len(c.token_ids) == 1 for c in chunks):
            return self._prepare_single_tokens(chunks)
        bs = self.block_size
        lens = np.fromiter((c.num_tokens for c in chunks), np.int64, len(chunks))
        starts = np.fromiter((c.start_pos for c in chunks), np.int64, len(chunks))
        total = int(lens.sum())
        q_end = np.cumsum(lens)
        q_start = q_end - lens
        token_ids = np.fromiter((t for c in chunks for t in c.token_ids), np.int64, total)
        positions = np.arange(total) + np.repeat(starts - q_start, lens)
        tables = np.full((len(chunks), max(len(c.block_table) for c in chunks)), NULL_BLOCK,
                         dtype=np.int64)
        for i, chunk in enumerate(chunks):
            tables[i, :len(chunk.block_table)] = chunk.block_table
        seq = np.repeat(np.arange(len(chunks)), lens)
        slot_mapping = tables[seq, positions // bs] * bs + positions % bs

        num_decodes = int((lens == 1).sum())
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slot_mapping), block_tables=self._tensor(tables),
            query_start_loc=self._tensor(np.concatenate([[0], q_end])),
            seq_lens=self._tensor(starts + lens), num_decodes=num_decodes,
            sliding_window=self.sliding_window or 0)
        if self.splits:
            meta.decode_block_tables, meta.decode_context_lens, meta.decode_mask = \
                self._decode_context(tables[:num_decodes], starts[:num_decodes] + 1)
            meta.prefills = [self._prefill_span(tables[i], int(starts[i]), int(lens[i]),
                                                int(q_start[i]))
                             for i in range(num_decodes, len(chunks))]
        # None: every row samples (a step of decodes), which spares a gather, ~60 us cold.
        logits_rows = None
        if total != len(chunks) or not all(c.sample for c in chunks):
            sample_rows = np.fromiter((c.sample for c in chunks), bool, len(chunks))
            logits_rows = self._tensor(q_end[sample_rows] - 1)
        return self._tensor(token_ids), self._tensor(positions), meta, logits_rows

    def _prepare_single_tokens(self, chunks: List[ScheduledChunk]):
        """`_prepare` for a step where every chunk is one token (decodes, mostly), in plain
        Python into `SingleTokenInputs`: it runs right after a forward pass has swept the
        caches, where each numpy or torch call of the general path costs 10-90 us (~0.25 ms
        in all, 2-3% of a batch-1 decode step)."""
        bs, n = self.block_size, len(chunks)
        width = max(len(c.block_table) for c in chunks)
        positions = [c.start_pos for c in chunks]
        flat = [c.token_ids[0] for c in chunks]
        flat += positions
        flat += [c.block_table[p // bs] * bs + p % bs for c, p in zip(chunks, positions)]
        flat += range(n + 1)
        flat += [p + 1 for p in positions]
        for chunk in chunks:
            flat += chunk.block_table
            flat += [NULL_BLOCK] * (width - len(chunk.block_table))
        # A chunk inside a prompt (sample False) leaves its row out of the logits' rows.
        rows = [i for i, c in enumerate(chunks) if c.sample]
        return self._single_token_inputs(flat, n, width, rows if len(rows) < n else None)

    def _decode_context(self, tables: np.ndarray, context_lens: np.ndarray):
        """Block tables, context lengths and (for the torch backend) the key mask."""
        if not len(context_lens):
            return None, None, None
        used_blocks = -(-int(context_lens.max()) // self.block_size)
        tables = tables[:, :used_blocks]
        mask = None
        if self.reads_padding:
            j = np.arange(used_blocks * self.block_size)
            valid = j[None, :] < context_lens[:, None]
            if self.sliding_window:
                valid &= j[None, :] > context_lens[:, None] - 1 - self.sliding_window
            mask = torch.from_numpy(valid[:, None, None, :]).to(self.device)
        return self._tensor(tables), self._tensor(context_lens), mask

    def _prefill_span(self, table: np.ndarray, start: int, length: int,
                      q_start: int) -> PrefillSpan:
        context = start + length
        j = np.arange(context)
        query_pos = np.arange(start, context)
        windowed = self.sliding_window is not None and context > self.sliding_window
        mask = None
        if start > 0 or windowed:
            allowed = j[None, :] <= query_pos[:, None]
            if windowed:
                allowed &= j[None, :] > query_pos[:, None] - self.sliding_window
            mask = torch.from_numpy(allowed).to(self.device)
        slots = None if start == 0 else self._tensor(table[j // self.block_size]
                                                     * self.block_size + j % self.block_size)
        return PrefillSpan(q_start, q_start + length, slots, mask)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(self.device)

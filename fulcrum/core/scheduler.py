"""Which tokens of which requests run in the next forward pass.

One step has one token budget (`max_num_batched_tokens`) and a cap on running requests
(`max_num_seqs`). Running decodes are served first, one token each; what is left goes to
prefill chunks of partially prefilled and waiting requests, in policy order. A request that
cannot get KV blocks makes the policy's worst running request give all of its blocks back
(preemption by recompute). The scheduler is plain Python over request state: it never
touches tensors, and the KV cache is an opaque `BlockManager` handle to it.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set

from fulcrum.core.block_manager import BlockManager
from fulcrum.config import EngineConfig
from fulcrum.core.request import Request, RequestStatus
from fulcrum.core.request import SamplingRow
from fulcrum.outputs import SampledToken
from fulcrum.core.scheduling_policy import PrefillLimit, make_policy
from fulcrum.core.step_time_model import StepShape, StepTimeModel


@dataclass(slots=True)
class ScheduledChunk:
    """A contiguous run of one request's tokens to compute this step."""

    request_id: str
    token_ids: List[int]
    start_pos: int
    block_table: List[int]
    # Set when the chunk reaches the request's newest token, so a new one is sampled.
    sampling: Optional[SamplingRow]
    # With prompt logprobs: the prompt tokens still without theirs that the chunk's positions
    # predict, in order, from its position `prompt_logprob_row` on (past 0 where a chunk
    # recomputes positions done before a preemption), and how many alternatives to report.
    prompt_logprob_targets: Optional[List[int]] = None
    prompt_logprob_row: int = 0
    num_prompt_logprobs: int = 0

    @property
    def sample(self) -> bool:
        return self.sampling is not None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_logprob_targets(self) -> int:
        return len(self.prompt_logprob_targets) if self.prompt_logprob_targets else 0


@dataclass
class SchedulerOutput:
    chunks: List[ScheduledChunk]
    num_prefill_tokens: int
    num_decode_tokens: int
    preempted_request_ids: List[str]
    # Requests that ended since the last step, so the runner can drop their per-request state.
    finished_request_ids: List[str]
    shape: StepShape = field(default_factory=StepShape)  # what the step-time model reads

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preempted_waiting: int
    num_preemptions_total: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int


@dataclass
class _StepPlan:
    budget: int
    tokens: Dict[Request, int] = field(default_factory=dict)
    preempted: List[Request] = field(default_factory=list)
    partial: Set[Request] = field(default_factory=set)
    limit: PrefillLimit = field(default_factory=PrefillLimit)

    def add(self, request: Request, num_tokens: int) -> None:
        self.tokens[request] = num_tokens
        self.budget -= num_tokens

    def drop(self, request: Request) -> None:
        self.budget += self.tokens.pop(request, 0)
        self.partial.discard(request)


class Scheduler:
    """`step_time` is the engine's step-time model (the slo policy reads it); `clock` gives
    the time decisions are taken at (tests pass a simulated one)."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager,
                 step_time: Optional[StepTimeModel] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.kv = block_manager
        self.clock = clock
        self.policy = make_policy(config, clock, step_time)
        self.static = config.batching_mode == "static"
        self.chunked_prefill = config.chunked_prefill
        self.requests: Dict[str, Request] = {}
        self.waiting: List[Request] = []
        self.running: List[Request] = []
        self._finished_ids: List[str] = []
        self.num_preemptions_total = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # --------------------------------------------------------------- requests
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self._enqueue(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> List[Request]:
        """End requests (abort, stop string); unknown or already finished ids are ignored."""
        done = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished:
                self._finish(request, status)
                done.append(request)
        return done

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def reset_counters(self) -> None:
        self.num_preemptions_total = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        self.policy.begin_step()
        plan = _StepPlan(budget=self.config.max_num_batched_tokens)
        may_admit = not self.static or not self.running
        self._schedule_decodes(plan)
        self._schedule_prefills(plan, may_admit and not plan.preempted)
        return self._build_output(plan)

    def _schedule_decodes(self, plan: _StepPlan) -> None:
        # Runs for every running request, every step: locals, and `plan.add` inlined on the
        # common path (the budget is synced with the plan around preemptions, which drop).
        running = RequestStatus.RUNNING
        append_slot, tokens, budget = self.kv.append_slot, plan.tokens, plan.budget
        for request in self._in_order(self.running):
            # Not `request.in_prefill`
            if len(request.all_token_ids) - request.num_computed_tokens > 1 \
                    or request.status is not running:
                continue
            if budget < 1:
                break
            if append_slot(request):
                tokens[request] = 1
                budget -= 1
                continue
            plan.budget = budget
            if self._allocate(request, 1, plan):
                plan.add(request, 1)
            budget = plan.budget
        plan.budget = budget

    def _schedule_prefills(self, plan: _StepPlan, may_admit: bool) -> None:
        plan.limit = self.policy.prefill_limit(list(plan.tokens), self.chunked_prefill)
        plan.partial = {r for r in self.running if r.in_prefill}
        candidates = list(plan.partial)
        # With every seat taken, a waiting request gets one only by preempting: no need to
        # order the whole queue otherwise.
        if may_admit and (len(self.running) < self.config.max_num_seqs
                          or self.policy.preempts_for_seats):
            candidates += self.waiting
        admitting = may_admit
        for request in self.policy.prefill_order(candidates):
            if plan.budget < 1:
                break
            if request in plan.preempted:
                continue
            if request.status is RequestStatus.RUNNING:
                self._continue_prefill(request, plan)
            elif admitting and request.ready:
                admitting = self._admit(request, plan)

    def _continue_prefill(self, request: Request, plan: _StepPlan) -> None:
        start = request.num_computed_tokens
        remaining = request.num_tokens - start
        num_new = self._chunk_size(request, start, remaining, plan)
        if num_new > 0 and self._allocate(request, num_new, plan):
            plan.add(request, num_new)
            plan.limit.add(request, start, num_new)
            if num_new == remaining:
                plan.partial.discard(request)

    def _admit(self, request: Request, plan: _StepPlan) -> bool:
        """Try to start a waiting request; False means stop admitting for this step.

        The running requests it would displace (for a seat or for KV blocks) are chosen
        first and preempted only once the request is sure to fit, so no preemption is wasted
        on a request that then stays waiting.
        """
        victims: List[Request] = []
        while True:
            computed = self.kv.admission_hits(request, victims)
            remaining = request.num_tokens - computed.num_tokens
            num_new = self._chunk_size(request, computed.num_tokens, remaining, plan)
            if num_new < 1:
                return False  # the step has no room left for prompts
            if num_new < remaining:
                if not self.chunked_prefill:
                    return False  # the whole prompt must wait for a step with room for it
                if len(plan.partial) >= self.config.max_num_partial_prefills:
                    return True  # skip it; a shorter prompt behind it may still complete
            has_seat = len(self.running) - len(victims) < self.config.max_num_seqs
            if has_seat and self.kv.can_allocate(request, num_new, computed, victims):
                break
            victim = self._victim(excluding=victims, admitting=request)
            if victim is None:
                return False
            victims.append(victim)
        if victims:
            for victim in victims:
                if victim.status is RequestStatus.RUNNING:  # not already dropped with another
                    self._preempt(victim, plan)
            # Re-read the hits: preempting drops the names of blocks the victims had not
            # computed yet (and of blocks held by requests dropped along with them). The
            # chunk stays at most the one weighed: the budget the victims' tokens gave back
            # would grow it past the blocks they were chosen to free, and the request would
            # then not fit after all, its victims preempted for nothing.
            computed = self.kv.get_computed_blocks(request)
            remaining = request.num_tokens - computed.num_tokens
            num_new = min(num_new, self._chunk_size(request, computed.num_tokens, remaining,
                                                    plan))
            if num_new < 1 or (num_new < remaining and not self.chunked_prefill):
                return False
        if not self.kv.allocate_slots(request, num_new, computed):
            return False  # more hits were dropped than weighed; try again next step
        self.waiting.remove(request)
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.waited_s += self.policy.now - request.queued_since
        request.queued_since = None
        request.num_computed_tokens = computed.num_tokens
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = self.clock()
            request.metrics.num_cached_tokens = computed.num_tokens
            # As vLLM's counters: a request's own lookup; one resumed after a preemption
            # finds its own blocks again, which says nothing of prompts sharing a prefix,
            # and one asking for prompt logprobs does not look (its prompt is computed whole).
            if self.kv.enable_prefix_caching and request.prompt_logprobs is None:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += computed.num_tokens
        plan.add(request, num_new)
        plan.limit.add(request, computed.num_tokens, num_new)
        if num_new < remaining:
            plan.partial.add(request)
        return True

    @staticmethod
    def _chunk_size(request: Request, start: int, remaining: int, plan: _StepPlan) -> int:
        return min(plan.limit.cap(request, start, remaining), plan.budget)

    # -------------------------------------------------------------- preemption
    def _allocate(self, request: Request, num_new: int, plan: _StepPlan) -> bool:
        """Allocate blocks for a running request, preempting the worst running ones."""
        while not self.kv.allocate_slots(request, num_new):
            victim = self._victim()
            if victim is None:
                return False
            self._preempt(victim, plan)
            if victim is request:
                return False
        return True

    def _victim(self, excluding: Sequence[Request] = (),
                admitting: Optional[Request] = None) -> Optional[Request]:
        """The running request to preempt next, the last in the policy's order; with
        `admitting`, the last that the policy lets that request preempt (the last of all may
        be one it may not, of its own priority, say, where another is fair game)."""
        policy = self.policy
        if admitting is not None and not policy.preempts_for_seats:
            return None
        return max((r for r in self.running if r not in excluding and (
            admitting is None or policy.may_preempt_for(admitting, r))),
            key=policy.key, default=None)

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        shared = self.kv.uncomputed_shared_blocks(request)
        self.running.remove(request)
        self.kv.free(request)
        plan.drop(request)
        plan.preempted.append(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.queued_since = self.policy.now
        request.metrics.num_preemptions += 1
        self.num_preemptions_total += 1
        self._enqueue(request)
        if shared:
            # Requests admitted this step with prefix hits on blocks this one was to compute.
            bs = self.kv.block_size
            for other in list(plan.tokens):
                hits = self.kv.block_table(other.request_id)[:other.num_computed_tokens // bs]
                if shared.intersection(hits):
                    self._preempt(other, plan)

    # ------------------------------------------------------------------ output
    def _build_output(self, plan: _StepPlan) -> SchedulerOutput:
        # Runs once per request per step: locals instead of properties (see
        # benchmarks/scheduling_cost.py).
        chunks = []
        shape = StepShape()  # what the step costs: a one-token chunk costs what a decode does
        num_decode = 0  # what the step is: a decode is a request one token behind
        tables = self.kv.block_tables
        for request, num_new in plan.tokens.items():
            start = request.num_computed_tokens
            tokens = request.all_token_ids
            end = start + num_new
            num_decode += len(tokens) - start == 1
            shape.add_chunk(start, num_new)
            chunk = ScheduledChunk(
                request.request_id, tokens[start:end], start, tables[request.request_id],
                self._sampling_row(request) if end == len(tokens) else None)
            if request.prompt_logprobs is not None:
                self._add_prompt_logprob_targets(request, chunk)
            chunks.append(chunk)
        finished, self._finished_ids = self._finished_ids, []
        num_tokens = sum(plan.tokens.values())
        return SchedulerOutput(chunks, num_tokens - num_decode, num_decode,
                               [r.request_id for r in plan.preempted], finished, shape)

    @staticmethod
    def _add_prompt_logprob_targets(request: Request, chunk: ScheduledChunk) -> None:
        """The chunk's share of the prompt logprobs still missing: token i's comes from
        position i - 1, and a chunk that recomputes positions after a preemption may reach
        past the ones done before it."""
        start, end = chunk.start_pos, chunk.start_pos + chunk.num_tokens
        first = len(request.prompt_logprobs)  # the first token still without its logprobs
        last = min(end + 1, request.num_prompt_tokens)
        if not start < first < last:
            return
        chunk.prompt_logprob_targets = request.all_token_ids[first:last]
        chunk.prompt_logprob_row = first - 1 - start
        chunk.num_prompt_logprobs = request.sampling_params.prompt_logprobs

    @staticmethod
    def _sampling_row(request: Request) -> SamplingRow:
        """Made once per request (everything in it is fixed, or a list that grows in place)."""
        row = request.sampling_row
        if row is None:
            row = request.sampling_row = SamplingRow(
                request.request_id, request.sampling_params, request.all_token_ids,
                request.num_prompt_tokens, request.sorted_stop_token_ids, request.grammar,
                request.bad_words_token_ids)
        return row

    def update_from_output(self, output: SchedulerOutput,
                           sampled: Dict[str, SampledToken]) -> List[Request]:
        """Advance computed counts, append sampled tokens; return requests that just ended."""
        now = self.clock()
        finished = []
        requests, running = self.requests, RequestStatus.RUNNING
        for chunk in output.chunks:
            request = requests.get(chunk.request_id)
            if request is None or request.status is not running:  # ended since scheduled
                continue
            request.num_computed_tokens += len(chunk.token_ids)
            if chunk.sampling is None:
                continue
            request.all_token_ids.append(sampled[chunk.request_id].token_id)
            metrics = request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            status = request.check_stop(self.config.max_model_len)
            if status is not None:
                self._finish(request, status)
                finished.append(request)
        return finished

    # ----------------------------------------------------------------- helpers
    def _in_order(self, requests: List[Request]) -> List[Request]:
        return sorted(requests, key=self.policy.key)

    def _enqueue(self, request: Request) -> None:
        keys = [self.policy.key(r) for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, self.policy.key(request)), request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = status
        request.metrics.finished_time = self.clock()
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preempted_waiting=sum(r.status is RequestStatus.PREEMPTED for r in self.waiting),
            num_preemptions_total=self.num_preemptions_total,
            kv_blocks_used=self.kv.num_usable_blocks - self.kv.num_free_blocks,
            kv_blocks_total=self.kv.num_usable_blocks,
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
        )

"""Which request goes first, and how much prompt a step may carry: small policy objects the
scheduler consults.

A policy orders requests (the smallest key is served first and preempted last), says whether
a waiting request may displace a running one, orders the prompts that want prefill tokens,
and at the start of each step's prefills hands the scheduler a `PrefillLimit`, which caps
each prompt's chunk. `fcfs` and `priority` cap chunks at a fixed size
(`long_prefill_token_threshold`); `slo` caps the whole step's predicted time instead.
"""

from __future__ import annotations

import math
import operator
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from fulcrum.config import EngineConfig
from fulcrum.core.request import Request
from fulcrum.core.step_time_model import StepShape, StepTimeModel

SortKey = Tuple
# priority: a waiting request gains one priority level for every this many seconds it waits.
PRIORITY_AGING_S = 10.0
# slo: a request that would miss its TTFT target anyway yields to those that can still make
# theirs, until it has waited this many times its target plus its own prefill time (so a
# long prompt does not jump the queue merely for being long); then it goes first.
SLO_AGING_FACTOR = 2.0
# slo: an aged prompt gets at least this many tokens a step, even past the step-time cap.
SLO_AGED_MIN_CHUNK = 16
# slo: a decoding request that is ahead of its TPOT target (its tokens came faster than the
# target, on average) lets a step take up to this many times the target, spending the time
# it banked; never more, so no single gap between tokens grows without bound.
SLO_MAX_BANKED_STEPS = 4.0


class PrefillLimit:
    """Caps the prompt chunks of one step: `cap` is the most tokens a chunk of `request`
    starting at `start` may have (up to `wanted`); `add` records the chunk taken."""

    def cap(self, request: Request, start: int, wanted: int) -> int:
        return wanted

    def add(self, request: Request, start: int, num_tokens: int) -> None:
        pass


class FixedChunkLimit(PrefillLimit):
    """At most `threshold` tokens of one prompt a step (0: no cap)."""

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold

    def cap(self, request: Request, start: int, wanted: int) -> int:
        return min(wanted, self.threshold) if self.threshold > 0 else wanted


class StepTimeLimit(FixedChunkLimit):
    """Prompt chunks while the step's predicted time stays within `seconds` (and within an
    explicit `long_prefill_token_threshold`); prompts that have waited past their aging
    bound get a minimum chunk regardless, so none starves.

    `budget()` gives (the decodes' step shape, the seconds they allow); it runs over every
    decode, so only once a prompt asks for a chunk (most steps of a busy server have none)."""

    def __init__(self, model: StepTimeModel, budget: Callable[[], Tuple[StepShape, float]],
                 is_aged: Callable[[Request], bool], threshold: int = 0) -> None:
        super().__init__(threshold)
        self.model = model
        self._budget: Optional[Callable[[], Tuple[StepShape, float]]] = budget
        self._shape = StepShape()
        self._seconds = math.inf
        self.is_aged = is_aged

    def _settle(self) -> None:
        if self._budget is not None:
            self._shape, self._seconds = self._budget()
            self._budget = None

    @property
    def shape(self) -> StepShape:
        self._settle()
        return self._shape

    @property
    def seconds(self) -> float:
        """The most time the step may take (finding it costs a pass over the decodes)."""
        self._settle()
        return self._seconds

    def cap(self, request: Request, start: int, wanted: int) -> int:
        wanted = super().cap(request, start, wanted)
        fits = lambda n: self.model.predict(self.shape.with_chunk(start, n)) <= self.seconds  # noqa: E731
        if math.isinf(self.seconds) or fits(wanted):
            return wanted
        low, high = 0, wanted  # fits(low) holds (or low is 0), fits(high) does not
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
        floor = min(wanted, SLO_AGED_MIN_CHUNK) if self.is_aged(request) else 0
        return max(low, floor)

    def add(self, request: Request, start: int, num_tokens: int) -> None:
        self.shape.add_chunk(start, num_tokens)
        if start + num_tokens >= request.num_tokens:
            # The prompt is done: its first token comes at the end of this step, so the
            # chunks still to come may delay it by one TPOT target at most, as a decode.
            self._seconds = min(self.seconds, self.model.predict(self.shape)
                                + request.metrics.slo.tpot_s)


class SchedulingPolicy:
    """First come, first served by default; subclasses change the order or the limits."""

    name = "base"
    preempts_for_seats = False  # whether may_preempt_for can ever be True

    def __init__(self, config: EngineConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self.now = clock()

    def begin_step(self) -> None:
        """Fix the time the step's decisions are taken at."""
        self.now = self.clock()

    def key(self, request: Request) -> SortKey:
        raise NotImplementedError

    def may_preempt_for(self, candidate: Request, victim: Request) -> bool:
        """Whether admitting `candidate` justifies evicting the running `victim`."""
        return False

    def prefill_order(self, candidates: Sequence[Request]) -> List[Request]:
        return sorted(candidates, key=self.key)

    def prefill_limit(self, decodes: Sequence[Request], chunked: bool) -> PrefillLimit:
        """The limit for this step's prompt chunks, given the decodes already in it."""
        return FixedChunkLimit(self.config.long_prefill_token_threshold if chunked else 0)


class FcfsPolicy(SchedulingPolicy):
    """First come, first served: arrival order (request id breaks ties)."""

    name = "fcfs"
    # (arrival_time, request_id), read in C: running requests are sorted by it every step.
    key = staticmethod(operator.attrgetter("arrival_time", "request_id"))  # type: ignore


class PriorityPolicy(SchedulingPolicy):
    """Lower `priority` value first, then arrival. A waiting request may preempt a running one
    of strictly worse priority when the batch or the KV cache is full. Aging: every
    PRIORITY_AGING_S seconds since its arrival lowers a request's value by one, so a request
    of any priority is served within a bounded time however many better ones keep coming."""

    name = "priority"
    preempts_for_seats = True

    def key(self, request: Request) -> SortKey:
        """(effective priority: its value less one per PRIORITY_AGING_S waited, arrival, id);
        one call, no helper: the queue is sorted by this every step."""
        arrival = request.arrival_time
        return (request.priority - int((self.now - arrival) // PRIORITY_AGING_S), arrival,
                request.request_id)

    def may_preempt_for(self, candidate: Request, victim: Request) -> bool:
        return self.key(candidate)[0] < self.key(victim)[0]


class SloPolicy(FcfsPolicy):
    """Meet each request's latency targets (TTFT and TPOT) step by step.

    Decodes come first, as in every policy. Prompt tokens then fill the step only while its
    predicted time stays within what the decodes it carries can afford (`step_allowance`) and
    delays a prompt finishing in it by one TPOT target at most (`StepTimeLimit.add`), so a
    long prompt shares steps with decodes without stretching their time per token; with no
    decode in the step there is no cap but the token budget, so a lone long prompt gets
    whole steps. Prompts go least slack first: slack is the time left to the TTFT deadline
    (arrival + target) minus the predicted time of the prompt's remaining prefill. A prompt
    that cannot make its deadline anyway yields to those that still can, rather than making
    them miss too, until it has waited SLO_AGING_FACTOR times its target and its own prefill
    time (bounded aging).
    """

    name = "slo"

    def __init__(self, config: EngineConfig, clock: Callable[[], float],
                 model: StepTimeModel) -> None:
        super().__init__(config, clock)
        self.model = model

    def is_aged(self, request: Request) -> bool:
        own = self.model.prefill_seconds(0, request.num_prompt_tokens)
        return self.now - request.arrival_time > SLO_AGING_FACTOR * (request.slo.ttft_s + own)

    def slack(self, request: Request) -> float:
        start = request.num_computed_tokens
        prefill = self.model.prefill_seconds(start, request.num_tokens - start)
        return request.arrival_time + request.slo.ttft_s - self.now - prefill

    def urgency(self, request: Request) -> SortKey:
        # A request resuming after a preemption is stalled mid-answer: it goes first.
        if request.metrics.first_token_time is not None or self.is_aged(request):
            return (0, -math.inf, request.arrival_time)
        slack = self.slack(request)
        return (1 if slack < 0 else 0, slack, request.arrival_time)

    def prefill_order(self, candidates: Sequence[Request]) -> List[Request]:
        return sorted(candidates, key=self.urgency)

    def step_allowance(self, request: Request) -> float:
        """How long this step may take without `request` missing its TPOT target, read as
        vLLM's benchmarks and goodput read it: the mean time per output token after the first.
        Its n-th token after the first is due n targets after the first token; a request
        ahead of that pace may wait longer than one target for its next token (at most
        SLO_MAX_BANKED_STEPS targets), one behind it gets one target.

        A request whose first token came after its TTFT target cannot meet its targets
        whatever its pace from now on: like a prompt that will miss its deadline anyway, it
        no longer holds the others back, and gets the loosest allowance (its stream still
        moves, never more than SLO_MAX_BANKED_STEPS targets between tokens). Under overload
        that lets prompts that can still make their deadlines into the steps."""
        metrics = request.metrics
        target, first = metrics.slo.tpot_s, metrics.first_token_time
        if first is None or target == math.inf:
            return target
        if first - request.arrival_time > metrics.slo.ttft_s:
            return SLO_MAX_BANKED_STEPS * target
        due = first + (len(request.all_token_ids) - request.num_prompt_tokens) * target
        return min(max(due - self.now, target), SLO_MAX_BANKED_STEPS * target)

    def prefill_limit(self, decodes: Sequence[Request], chunked: bool) -> PrefillLimit:
        if not chunked:
            return PrefillLimit()  # whole prompts only: a cap would only make them wait
        def budget() -> Tuple[StepShape, float]:
            # Over every decode (256 and more): one pass of plain arithmetic each.
            shape = StepShape.of_decodes([r.num_computed_tokens + 1 for r in decodes])
            return shape, min(map(self.step_allowance, decodes), default=math.inf)

        return StepTimeLimit(self.model, budget, self.is_aged,
                             self.config.long_prefill_token_threshold)


POLICIES: Dict[str, Callable[..., SchedulingPolicy]] = {
    "fcfs": FcfsPolicy,
    "priority": PriorityPolicy,
    "slo": SloPolicy,
}


def make_policy(config: EngineConfig, clock: Callable[[], float],
                model: Optional[StepTimeModel] = None) -> SchedulingPolicy:
    name = config.scheduling_policy
    if name not in POLICIES:
        raise ValueError(f"unknown scheduling_policy {name!r}; choose from {sorted(POLICIES)}")
    if name == "slo":
        return SloPolicy(config, clock, model if model is not None else StepTimeModel())
    return POLICIES[name](config, clock)

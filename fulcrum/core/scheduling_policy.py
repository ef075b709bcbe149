"""Which request goes first, and how much prompt a step may carry: small policy objects the
scheduler consults.

A policy orders requests (the smallest key is served first and preempted last), says whether
a waiting request may displace a running one, orders the prompts that want prefill tokens,
and at the start of each step's prefills hands the scheduler a `PrefillLimit`, which caps
each prompt's chunk. `fcfs` and `priority` cap chunks at a fixed size
(`long_prefill_token_threshold`); `slo` caps the whole step's predicted time instead.
"""

from __future__ import annotations

import heapq
import math
import operator
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from fulcrum.config import EngineConfig
from fulcrum.core.request import Request, SloTargets
from fulcrum.core.step_time_model import StepShape, StepTimeModel

SortKey = Tuple
# priority: a waiting request gains one priority level for every this many seconds it waits.
PRIORITY_AGING_S = 10.0
# slo: a prompt set aside so that more prompts make their TTFT targets yields to the others
# until it has waited this many times its target plus its own prefill time (so a long
# prompt does not jump the queue merely for being long); then it goes first.
SLO_AGING_FACTOR = 2.0
# slo: an aged prompt gets at least this many tokens a step, even past the step-time cap; so
# does the first chunk of a step that carries nothing else (see `StepTimeLimit.cap`).
SLO_AGED_MIN_CHUNK = 16
# slo: a decoding request that is ahead of its TPOT target (its tokens came faster than the
# target, on average) lets a step take up to this many times the target, spending the time
# it banked; never more, so no single gap between tokens grows without bound.
SLO_MAX_BANKED_STEPS = 4.0
# slo: a decoding request may also spend now the time its next tokens will save: counted over
# at most this many of them (never past its max_tokens), each at the predicted time of a step
# of the running decodes alone. Long steps then carry whole bursts of prompts while the
# streams' mean time per token still meets the target; a request that ends sooner than its
# max_tokens (a stop token) within these few tokens can miss it.
SLO_LOOKAHEAD_TOKENS = 8
# slo: steps are planned against this share of each TPOT target, so that a stream kept at its
# planned pace is not pushed past its target by the step-time model's errors.
SLO_TPOT_PLANNED_SHARE = 0.9
# slo: a step's prompt chunks may add at most this share of the default TTFT target to the
# time of its decodes (or its fixed cost). A request arriving while the step runs waits for
# its end (steps are not interrupted), so the share left is what it has for its own prefill.
SLO_ARRIVAL_SHARE = 0.5


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
    bound get a minimum chunk regardless, so none starves, and so does the first chunk of a
    step that carries nothing else, so the engine never idles with prompts waiting.

    `budget()` gives (the decodes' step shape, the seconds they allow); it runs over every
    decode, so only once a prompt asks for a chunk (most steps of a busy server have none)."""

    def __init__(self, model: StepTimeModel, budget: Callable[[], Tuple[StepShape, float]],
                 is_aged: Callable[[Request], bool], now: float, threshold: int = 0) -> None:
        super().__init__(threshold)
        self.model = model
        self.now = now
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
        return max(low, self._floor(request, wanted))

    def _floor(self, request: Request, wanted: int) -> int:
        """The least chunk `request` gets whatever the cap. An aged prompt's, and that of a
        step holding nothing yet: where the targets are tighter than a one-token step (a
        TTFT target under the model's fixed cost), a cap of 0 there would leave the engine
        idle, every prompt waiting to age, and one with a looser target of its own (aged
        only after twice that target) waiting that long with nothing else to run."""
        if self.is_aged(request) or self.shape.is_empty:
            return min(wanted, SLO_AGED_MIN_CHUNK)
        return 0

    def add(self, request: Request, start: int, num_tokens: int) -> None:
        self.shape.add_chunk(start, num_tokens)
        if start + num_tokens >= request.num_tokens:
            # The prompt is done: its first token comes at the end of this step, so the
            # chunks still to come may delay it by one TPOT target at most, as a decode, and
            # never past its TTFT deadline while it can still make it.
            predicted, slo = self.model.predict(self.shape), request.metrics.slo
            room = request.arrival_time + slo.ttft_s - self.now - predicted
            delay = min(slo.tpot_s, room) if room >= 0 else slo.tpot_s
            self._seconds = min(self.seconds, predicted + delay)


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

    def expect_arrivals(self, targets: SloTargets) -> None:
        """The targets of requests that set none (those yet to arrive, as far as is known)."""

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
    PRIORITY_AGING_S seconds it spends waiting (before its admission, and after each
    preemption) lowers a request's value by one, so a request of any priority is served
    within a bounded time however many better ones keep coming. Time running does not count:
    a request running for minutes keeps the priority it was admitted with, so a better one
    arriving still preempts it, and is not preempted in its stead, as in vLLM. When blocks
    run out mid-decode the victim is the last by `key`, aging included: a request admitted
    after a long wait may then keep its blocks while a better, fresher one gives way."""

    name = "priority"
    preempts_for_seats = True

    def key(self, request: Request) -> SortKey:
        """(effective priority: its value less one per PRIORITY_AGING_S waited, arrival, id);
        one call, no helper: the queue is sorted by this every step."""
        since, waited = request.queued_since, request.waited_s
        if since is not None:
            waited += self.now - since
        return (request.priority - int(waited // PRIORITY_AGING_S), request.arrival_time,
                request.request_id)

    def may_preempt_for(self, candidate: Request, victim: Request) -> bool:
        """Only for a better priority, as in vLLM, and one its aging has not made up for.
        Aging orders the queue and shields a request admitted after a long wait; it never
        lets a request preempt one of a better priority: two that cannot run together
        would take turns, each waiting long enough to outrank the other, each turn a
        recompute."""
        return candidate.priority < victim.priority and \
            self.key(candidate)[0] < self.key(victim)[0]


class SloPolicy(FcfsPolicy):
    """Meet each request's latency targets (TTFT and TPOT) step by step.

    Decodes come first, as in every policy. Prompt tokens then fill the step only while its
    predicted time stays within what the decodes it carries can afford (`step_allowance`),
    delays a prompt finishing in it by one TPOT target at most and never past a TTFT deadline
    it can still make (`StepTimeLimit.add`), and adds at most SLO_ARRIVAL_SHARE of the
    default TTFT target (`expect_arrivals`) to the decodes' time. So a long prompt shares
    steps with decodes without stretching their time per token, and a request arriving
    while it runs, which must wait for the step's end, still makes its TTFT target.

    Prompts are ordered to meet as many TTFT deadlines (arrival + target) as possible: by
    deadline, except that wherever the predicted prefill times of the prompts so far would
    make one miss its deadline, the longest of them is set aside (Moore and Hodgson's rule,
    which maximises the deadlines met on one machine). So a burst of short requests behind a
    long prompt goes first, and a prompt that cannot make its deadline yields to those that
    can, rather than making them miss too. Set-aside prompts still fill what the step has
    left, oldest first, and a prompt that has waited SLO_AGING_FACTOR times its target and its
    own prefill time goes first (bounded aging: nothing starves).
    """

    name = "slo"

    def __init__(self, config: EngineConfig, clock: Callable[[], float],
                 model: StepTimeModel) -> None:
        super().__init__(config, clock)
        self.model = model
        self.arrivals = SloTargets()

    def expect_arrivals(self, targets: SloTargets) -> None:
        self.arrivals = targets

    def is_aged(self, request: Request) -> bool:
        own = self.model.prefill_seconds(0, request.num_prompt_tokens)
        return self.now - request.arrival_time > SLO_AGING_FACTOR * (request.slo.ttft_s + own)

    def prefill_seconds(self, request: Request) -> float:
        """Predicted time of the request's remaining prefill."""
        start = request.num_computed_tokens
        return self.model.prefill_seconds(start, request.num_tokens - start)

    def prefill_order(self, candidates: Sequence[Request]) -> List[Request]:
        # A request resuming after a preemption is stalled mid-answer: it goes first, with
        # the aged ones.
        first: List[Request] = []
        rest: List[Request] = []
        for request in candidates:
            stalled = request.metrics.first_token_time is not None or self.is_aged(request)
            (first if stalled else rest).append(request)
        rest.sort(key=lambda r: (r.arrival_time + r.slo.ttft_s, r.arrival_time))
        finish = self.now + sum(map(self.prefill_seconds, first))
        kept: List[Tuple[float, int, Request]] = []  # a max-heap on prefill time
        set_aside: List[Request] = []
        for order, request in enumerate(rest):
            cost = self.prefill_seconds(request)
            heapq.heappush(kept, (-cost, order, request))
            finish += cost
            if finish > request.arrival_time + request.slo.ttft_s:
                longest, _, dropped = heapq.heappop(kept)
                finish += longest
                set_aside.append(dropped)
        aside = set(map(id, set_aside))
        return (first + [r for r in rest if id(r) not in aside]
                + sorted(set_aside, key=lambda r: (r.arrival_time, r.request_id)))

    def step_allowance(self, request: Request, decode_step: float = 0.0) -> float:
        """How long this step may take without `request` missing its TPOT target (planned at
        SLO_TPOT_PLANNED_SHARE of it), read as vLLM's benchmarks and goodput read it: the
        mean time per output token after the first.
        Its n-th token after the first is due n targets after the first token; a request
        ahead of that pace may wait longer than one target for its next token, and so may
        one whose next tokens (up to SLO_LOOKAHEAD_TOKENS, never past its max_tokens) will
        come faster than the target in steps of the decodes alone (`decode_step` seconds);
        never more than SLO_MAX_BANKED_STEPS targets. A request behind even that pace may
        still be ahead of the pace of its whole target: it gets what that leaves it (at most
        one target), so that a server whose decodes alone nearly fill the planned pace still
        lets prompts in; behind that too, it gets a step of the decodes alone, which catches
        it up (the time it borrowed from its next tokens is repaid as they run out).

        A request whose first token came after its TTFT target cannot meet its targets
        whatever its pace from now on: like a prompt that will miss its deadline anyway, it
        no longer holds the others back, and gets the loosest allowance (its stream still
        moves, never more than SLO_MAX_BANKED_STEPS targets between tokens). Under overload
        that lets prompts that can still make their deadlines into the steps."""
        # Runs for every decode of a step that takes prompt tokens: plain comparisons, no
        # builtins, ~1 us a request.
        metrics = request.metrics
        slo, first = metrics.slo, metrics.first_token_time
        target = SLO_TPOT_PLANNED_SHARE * slo.tpot_s
        if first is None or target == math.inf:
            return target
        most = SLO_MAX_BANKED_STEPS * target
        if first - request.arrival_time > slo.ttft_s:
            return most
        produced = len(request.all_token_ids) - request.num_prompt_tokens
        allowance = first + produced * target - self.now
        later = request.max_tokens - produced - 1
        if later > 0 and target > decode_step:
            allowance += (later if later < SLO_LOOKAHEAD_TOKENS else SLO_LOOKAHEAD_TOKENS) \
                * (target - decode_step)
        if allowance >= decode_step:
            return most if allowance > most else allowance
        # Behind its planned pace: up to where its whole target puts its next token, if that
        # is still ahead, else a step of the decodes alone, to catch up.
        ahead = first + produced * slo.tpot_s - self.now
        ahead = slo.tpot_s if ahead > slo.tpot_s else ahead
        return ahead if ahead > decode_step else decode_step

    def prefill_limit(self, decodes: Sequence[Request], chunked: bool) -> PrefillLimit:
        if not chunked:
            return PrefillLimit()  # whole prompts only: a cap would only make them wait
        def budget() -> Tuple[StepShape, float]:
            # Over every decode (256 and more): one pass of plain arithmetic each.
            shape = StepShape.of_decodes([r.num_computed_tokens + 1 for r in decodes])
            step, allowance = self.model.predict(shape), self.step_allowance
            allowed = min((allowance(r, step) for r in decodes), default=math.inf)
            # Prompts add to the decodes' time, or to the step's fixed cost if none: on a
            # small model that cost may exceed the share itself.
            base = step if decodes else self.model.prefill_seconds(0, 0)
            return shape, min(allowed, base + SLO_ARRIVAL_SHARE * self.arrivals.ttft_s)

        return StepTimeLimit(self.model, budget, self.is_aged, self.now,
                             self.config.long_prefill_token_threshold)


def derived_targets(model: StepTimeModel, budget: int, measured_s: float = 0.0) -> SloTargets:
    """Targets for requests that set none, from the predicted time of a full-budget prompt
    step, `full`: TTFT and TPOT full / 2. A step's prompts then add at most a quarter
    budget's time to its decodes (SLO_ARRIVAL_SHARE of the TTFT target), so a short request
    arriving behind a long prompt has its first token within about full / 2. A looser TTFT
    target lets long prompts take longer steps, faster for them and slower for the short
    requests arriving meanwhile (`fulcrum bench report --engines fulcrum,fulcrum-fcfs` shows
    the trade-off; `--slo-ttft-ms` moves along it). Where the fit predicts under a quarter of
    `measured_s`, the longest prompt step measured (a few noisy profile steps on a busy
    machine can leave it predicting nothing), the measurement stands in. No steps seen yet:
    no targets."""
    full = model.prefill_seconds(0, budget)
    full = full if full >= measured_s / 4 else measured_s
    return SloTargets(full / 2, full / 2) if full > 0 else SloTargets()


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

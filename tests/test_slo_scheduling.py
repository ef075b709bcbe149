"""The slo policy on a simulated clock (each step takes what a known cost model says), the
priority policy's aging, and the engine-level contract: targets per request or per engine,
and the same greedy tokens under every policy."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fulcrum import LLM, SamplingParams
from fulcrum.core.request import RequestStatus, SloTargets
from fulcrum.core.scheduling_policy import (PRIORITY_AGING_S, SLO_AGED_MIN_CHUNK, SLO_AGING_FACTOR,
                                       SLO_ARRIVAL_SHARE, SLO_LOOKAHEAD_TOKENS,
                                       SLO_MAX_BANKED_STEPS, SLO_TPOT_PLANNED_SHARE,
                                       derived_targets)
from fulcrum.core.step_time_model import StepShape, StepTimeModel
from test_scheduler import Sim, chunk_of
from test_step_time_model import train, truth

BUDGET = 512


def fitted_model() -> StepTimeModel:
    """A model that has learned the cost that the simulated clock charges."""
    return train(StepTimeModel(), random.Random(0), 300)


def slo_sim(**config) -> Sim:
    config.setdefault("num_blocks", 2000)
    config.setdefault("block_size", 16)
    return Sim(scheduling_policy="slo", step_time=fitted_model(), model_max_len=4096,
               max_num_batched_tokens=BUDGET, **config)


def add(sim: Sim, request_id: str, prompt_len: int, ttft: float = math.inf,
        tpot: float = math.inf, max_tokens: int = 4):
    request = sim.add(request_id, prompt_len, max_tokens=max_tokens)
    request.metrics.slo = SloTargets(ttft, tpot)
    return request


def clocked_step(sim: Sim):
    """One step that takes as long as the cost model says; its tokens come out at its end."""
    out = sim.schedule()
    sim.now += truth(out.shape)
    sim.update(out)
    return out


def test_a_lone_long_prompt_gets_whole_steps():
    sim = slo_sim()
    add(sim, "long", 2000, ttft=1.0, tpot=0.05)
    sizes = [clocked_step(sim).chunks[0].num_tokens for _ in range(4)]
    assert sizes == [BUDGET, BUDGET, BUDGET, 2000 - 3 * BUDGET]


def largest_within(model: StepTimeModel, shape: StepShape, start: int, seconds: float) -> int:
    """The most tokens of a chunk after `start` that keep the step's predicted time within
    `seconds`."""
    n = 0
    while model.predict(shape.with_chunk(start, n + 1)) <= seconds:
        n += 1
    return n


def test_steps_a_request_may_arrive_during_add_half_its_ttft_target_at_most():
    """The default TTFT target is what a request yet to arrive will have: a step carrying a
    prompt adds at most SLO_ARRIVAL_SHARE of it to its decodes' time (or its fixed cost), so
    one arriving at its start still makes its target."""
    sim = slo_sim()
    policy, model = sim.sched.policy, sim.sched.policy.model
    policy.expect_arrivals(SloTargets(0.4, math.inf))
    add(sim, "decoding", 40, max_tokens=50)
    clocked_step(sim)
    long = add(sim, "long", 2000)
    out = clocked_step(sim)
    decodes = StepShape.of_decodes([41])
    chunk = chunk_of(out, "long").num_tokens
    assert chunk == largest_within(model, decodes, 0, model.predict(decodes)
                                   + SLO_ARRIVAL_SHARE * 0.4)
    assert 0 < chunk < BUDGET - 1
    sim.sched.finish_requests(["decoding"], RequestStatus.FINISHED_ABORTED)
    started = sim.now
    out = clocked_step(sim)  # the long prompt alone: the share added to the fixed cost
    fixed = model.prefill_seconds(0, 0)
    assert fixed > 0
    assert chunk_of(out, "long").num_tokens == largest_within(model, StepShape(), chunk,
                                                              fixed + SLO_ARRIVAL_SHARE * 0.4)
    # A request that arrived as that step started has waited for all of it.
    ended, sim.now = sim.now, started
    short = add(sim, "short", 40, ttft=0.4)
    sim.now = ended
    for _ in range(3):
        if short.metrics.first_token_time is None:
            clocked_step(sim)
    assert short.metrics.time_to_first_token <= 0.4
    assert long.num_computed_tokens < long.num_prompt_tokens


def test_a_short_request_behind_a_long_prompt_meets_its_targets():
    sim = slo_sim()
    add(sim, "long", 3000, ttft=1.0, tpot=0.1, max_tokens=2)
    clocked_step(sim)
    short = add(sim, "short", 40, ttft=0.8, tpot=0.1, max_tokens=8)
    long_chunks = []
    while sim.sched.has_unfinished_requests():
        out = clocked_step(sim)
        decodes = [c for c in out.chunks if c.num_tokens == 1]
        if decodes:  # the short one decoding: no gap beyond what its banked time allows
            assert truth(out.shape) <= SLO_MAX_BANKED_STEPS * 0.1 + 1e-9
        if chunk_of(out, "long") is not None:
            long_chunks.append((chunk_of(out, "long").num_tokens, bool(decodes)))
    assert short.metrics.time_to_first_token <= 0.8
    tpot = (short.metrics.last_token_time - short.metrics.first_token_time) / 7
    assert tpot <= 0.1 + 1e-9
    # The long prompt kept going beside the decodes, with smaller chunks, then full ones.
    shared = [n for n, with_decodes in long_chunks if with_decodes]
    assert shared and all(0 < n < BUDGET for n in shared)
    assert any(n == BUDGET for n, with_decodes in long_chunks if not with_decodes)
    sim.check_all_done()


def test_tpot_is_a_mean_a_request_ahead_of_pace_lends_the_step_its_banked_time():
    """Targets are planned at SLO_TPOT_PLANNED_SHARE; steps of the decodes alone take 80 ms,
    so each of the next SLO_LOOKAHEAD_TOKENS tokens also lends what it will save."""
    planned = SLO_TPOT_PLANNED_SHARE * 0.1
    spare = SLO_LOOKAHEAD_TOKENS * (planned - 0.08)
    sim = slo_sim()
    request = add(sim, "r", 40, tpot=0.1, max_tokens=50)
    clocked_step(sim)  # the prompt: first token
    policy = sim.sched.policy
    first = policy.now = request.metrics.first_token_time
    assert policy.step_allowance(request, 0.08) == pytest.approx(planned + spare)  # none banked
    request.append_token(7)
    policy.now = first + planned / 2  # its 2nd token came in half a planned target
    assert policy.step_allowance(request, 0.08) == pytest.approx(1.5 * planned + spare)
    for _ in range(20):
        request.append_token(7)
    assert policy.step_allowance(request, 0.08) == pytest.approx(SLO_MAX_BANKED_STEPS * planned)
    policy.now = first + 5.0  # far behind its pace
    assert policy.step_allowance(request, 0.08) == pytest.approx(0.08)  # catch up: decodes only
    assert policy.step_allowance(request, 0.2) == pytest.approx(0.2)  # decodes alone: no more


def test_a_request_may_borrow_from_its_next_tokens_up_to_its_max_tokens():
    """The next SLO_LOOKAHEAD_TOKENS tokens, at 40 ms steps of the decodes alone, will each
    save (planned target - 40 ms): the step may spend that now, less as max_tokens nears."""
    planned = SLO_TPOT_PLANNED_SHARE * 0.1
    saves = planned - 0.04
    sim = slo_sim()
    request = add(sim, "r", 40, tpot=0.1, max_tokens=6)
    clocked_step(sim)
    policy = sim.sched.policy
    first = policy.now = request.metrics.first_token_time  # the 2nd token due in `planned`
    assert SLO_LOOKAHEAD_TOKENS > 4
    # 4 tokens may follow the next one (max_tokens 6)
    assert policy.step_allowance(request, 0.04) == pytest.approx(planned + 4 * saves)
    request.append_token(7)
    request.append_token(7)  # 3 produced: 2 may follow the next one
    policy.now = first + 3 * planned + 0.03  # 30 ms behind its planned pace
    assert policy.step_allowance(request, 0.04) == pytest.approx(-0.03 + 2 * saves)
    request.append_token(7)
    request.append_token(7)  # 5 produced: the next one is the last
    policy.now = first + 5 * planned + 0.03  # 30 ms owed, no token left to borrow from
    assert policy.step_allowance(request, 0.04) == pytest.approx(0.04)  # decodes only
    request = add(sim, "long", 40, tpot=0.1, max_tokens=100)
    clocked_step(sim)
    policy.now = request.metrics.first_token_time
    assert policy.step_allowance(request, 0.04) == pytest.approx(
        min(planned + SLO_LOOKAHEAD_TOKENS * saves, SLO_MAX_BANKED_STEPS * planned))


def test_a_request_late_for_its_first_token_no_longer_holds_steps_back():
    sim = slo_sim()
    on_time = add(sim, "on-time", 40, ttft=10.0, tpot=0.1, max_tokens=50)
    late = add(sim, "late", 40, ttft=0.001, tpot=0.1, max_tokens=50)
    clocked_step(sim)  # both prompts: their first tokens, one within its target, one not
    policy = sim.sched.policy
    policy.now = sim.now + 5.0  # both far behind their pace
    planned = SLO_TPOT_PLANNED_SHARE * 0.1
    assert policy.step_allowance(on_time, 0.2) == pytest.approx(0.2)  # the decodes alone
    assert policy.step_allowance(late, 0.2) == pytest.approx(SLO_MAX_BANKED_STEPS * planned)


@pytest.mark.parametrize("tpot", [0.05, math.inf])
def test_a_prompt_finishing_in_a_step_is_delayed_by_one_tpot_target_at_most(tpot):
    sim = slo_sim()
    add(sim, "long", 3000)
    clocked_step(sim)
    add(sim, "short", 40, ttft=10.0, tpot=tpot)
    out = clocked_step(sim)
    assert chunk_of(out, "short").num_tokens == 40  # least slack first: it goes first
    long_chunk = chunk_of(out, "long").num_tokens
    if math.isinf(tpot):
        assert long_chunk == BUDGET - 40  # no target: the long prompt takes the rest
        return
    model = sim.sched.policy.model
    alone = StepShape()
    alone.add_chunk(0, 40)
    assert 0 < long_chunk < BUDGET - 40
    assert model.predict(out.shape) <= model.predict(alone) + tpot + 1e-9
    # One token more would have crossed the line.
    longer = alone.with_chunk(BUDGET, long_chunk + 1)
    assert model.predict(longer) > model.predict(alone) + tpot


def test_a_prompt_finishing_in_a_step_keeps_its_ttft_deadline():
    """Its TPOT target would let the chunks after it delay its first token by 0.3 s; its TTFT
    deadline, which it can still make, stops them sooner. One past its deadline already (it
    waited a second; aged, it goes first) is delayed by its TPOT target."""
    for ttft, waited in ((0.2, 0.0), (0.001, 1.0)):
        sim = slo_sim()
        add(sim, "long", 3000)
        clocked_step(sim)
        short = add(sim, "short", 40, ttft=ttft, tpot=0.3)
        sim.now += waited
        out = clocked_step(sim)
        policy = sim.sched.policy
        model = policy.model
        alone = StepShape()
        alone.add_chunk(0, 40)
        # The deadline, from the time the step was planned at (the short one arrived before).
        limit = short.arrival_time + ttft - policy.now if not waited \
            else model.predict(alone) + 0.3
        assert chunk_of(out, "short").num_tokens == 40
        assert chunk_of(out, "long").num_tokens == largest_within(model, alone, BUDGET, limit)
        assert 0 < chunk_of(out, "long").num_tokens < BUDGET - 40
        assert (short.metrics.time_to_first_token <= ttft) == (not waited)


def test_the_default_targets_are_half_a_full_budget_step():
    model = fitted_model()
    full = model.prefill_seconds(0, BUDGET)
    assert derived_targets(model, BUDGET) == SloTargets(full / 2, full / 2)
    assert derived_targets(StepTimeModel(), BUDGET) == SloTargets()  # nothing seen: none
    # A fit noise left predicting no time (a test saw targets of +inf on a busy machine):
    # the longest prompt step measured stands in.
    degenerate = StepTimeModel()
    degenerate.coefficients = (-1.0,) + (0.0,) * (len(degenerate.coefficients) - 1)
    assert derived_targets(degenerate, BUDGET, 0.5) == SloTargets(0.25, 0.25)
    degenerate.coefficients = (1e-7,) + degenerate.coefficients[1:]  # next to nothing
    assert derived_targets(degenerate, BUDGET, 0.5) == SloTargets(0.25, 0.25)
    assert derived_targets(model, BUDGET, full) == SloTargets(full / 2, full / 2)


def test_least_slack_first_across_targets():
    sim = slo_sim()
    add(sim, "relaxed", 400, ttft=10.0)
    add(sim, "urgent", 400, ttft=1.0)  # arrives later, but its deadline is nearer
    out = clocked_step(sim)
    assert chunk_of(out, "urgent").num_tokens == 400
    assert chunk_of(out, "relaxed").num_tokens == BUDGET - 400


def test_a_long_prompt_that_would_make_a_burst_miss_is_set_aside():
    """All four alone could each make 1.2 s, but not together: serving the long prompt (about
    1.0 s of prefill) first would make the third short one miss, so the long one goes last
    (three deadlines met rather than two); with one short request both fit, by deadline."""
    sim = slo_sim()
    add(sim, "long", 1000, ttft=1.2)
    shorts = [add(sim, f"short-{i}", 100, ttft=1.2) for i in range(3)]
    out = clocked_step(sim)
    assert [chunk_of(out, f"short-{i}").num_tokens for i in range(3)] == [100] * 3
    assert chunk_of(out, "long").num_tokens == BUDGET - 300
    assert all(r.metrics.time_to_first_token <= 1.2 for r in shorts)
    sim = slo_sim()
    add(sim, "long", 1000, ttft=1.2)
    add(sim, "short", 100, ttft=1.2)
    out = clocked_step(sim)
    assert chunk_of(out, "long").num_tokens == BUDGET and chunk_of(out, "short") is None


def test_a_hopeless_prompt_yields_until_it_has_aged():
    sim = slo_sim()
    add(sim, "hopeless", 2000, ttft=0.5)  # ~2 s of prefill: it cannot make 0.5 s
    add(sim, "feasible", 300, ttft=5.0)
    out = clocked_step(sim)
    assert chunk_of(out, "feasible").num_tokens == 300
    assert chunk_of(out, "hopeless").num_tokens == BUDGET - 300
    own = sim.sched.policy.model.prefill_seconds(0, 2000)
    sim.now = SLO_AGING_FACTOR * (0.5 + own) - 0.01  # not aged yet: still yields
    add(sim, "early", 300, ttft=5.0)
    out = clocked_step(sim)
    assert chunk_of(out, "early").num_tokens == 300
    assert chunk_of(out, "hopeless").num_tokens == BUDGET - 301
    sim.now = SLO_AGING_FACTOR * (0.5 + own) + 0.01  # past its aging bound
    add(sim, "newcomer", 300, ttft=5.0)
    out = clocked_step(sim)
    assert chunk_of(out, "hopeless").num_tokens == BUDGET - 2  # two decodes, then it first
    assert chunk_of(out, "newcomer") is None


def test_an_idle_engine_serves_prompts_under_a_ttft_target_tighter_than_any_step():
    """Engine targets tighter than a one-token step's fixed cost left every step of an idle
    engine empty: each prompt waited to age, and one with a loose target of its own (1000 s,
    aged after 2000 s) was never served while the engine sat idle."""
    sim = slo_sim()
    policy = sim.sched.policy
    policy.expect_arrivals(SloTargets(ttft_s=1e-6))
    assert policy.model.predict(StepShape.of_decodes([1])) > \
        policy.model.prefill_seconds(0, 0) + SLO_ARRIVAL_SHARE * 1e-6
    add(sim, "loose", 40, ttft=1000.0, max_tokens=2)
    add(sim, "default", 40, ttft=1e-6, max_tokens=2)
    out = clocked_step(sim)
    assert [c.num_tokens for c in out.chunks] == [SLO_AGED_MIN_CHUNK]
    for _ in range(20):
        if not sim.sched.has_unfinished_requests():
            break
        assert not clocked_step(sim).is_empty
    sim.check_all_done()


@st.composite
def workloads(draw):
    return [dict(at=draw(st.integers(0, 30)), prompt=draw(st.integers(1, 1500)),
                 ttft=draw(st.sampled_from([0.05, 0.5, 2.0, 10.0])),
                 tpot=draw(st.sampled_from([0.001, 0.02, 0.1, 1.0])),
                 max_tokens=draw(st.integers(1, 12)))
            for _ in range(draw(st.integers(1, 12)))]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads())
def test_steps_keep_to_what_the_decodes_allow_and_nothing_starves(workload):
    sim = slo_sim(max_num_seqs=16)
    policy = sim.sched.policy
    pending = sorted(enumerate(workload), key=lambda item: item[1]["at"])
    for step in range(5000):
        while pending and pending[0][1]["at"] <= step:
            index, spec = pending.pop(0)
            add(sim, f"r{index}", spec["prompt"], spec["ttft"], spec["tpot"], spec["max_tokens"])
        if not pending and not sim.sched.has_unfinished_requests():
            break
        decided_at = policy.now = sim.now
        # what the policy reads: the predicted time of a step of the running decodes alone
        decoding = [r for r in sim.sched.running
                    if len(r.all_token_ids) - r.num_computed_tokens == 1]
        alone = policy.model.predict(
            StepShape.of_decodes([r.num_computed_tokens + 1 for r in decoding]))
        allowance = {i: policy.step_allowance(r, alone) for i, r in sim.all.items()}
        out = clocked_step(sim)
        decodes = [sim.all[c.request_id] for c in out.chunks if c.num_tokens == 1
                   and sim.all[c.request_id].num_output_tokens > 1]
        prompts = [c for c in out.chunks if c.num_tokens > 1]
        if decodes and prompts:
            cap = min(allowance[r.request_id] for r in decodes)
            # Only an aged prompt's minimum chunk may push a step past the cap.
            policy.now = decided_at
            aged = [c for c in prompts if c.num_tokens <= SLO_AGED_MIN_CHUNK
                    and policy.is_aged(sim.all[c.request_id])]
            assert sim.sched.policy.model.predict(out.shape) <= cap or aged
    assert not pending and not sim.sched.has_unfinished_requests(), "a request starved"
    sim.check_all_done()


# ------------------------------------------------------------------------ priority
@pytest.mark.parametrize("aging", [True, False])
def test_priority_aging_serves_a_low_priority_request_among_a_stream_of_urgent_ones(
        aging, monkeypatch):
    if not aging:
        monkeypatch.setattr("fulcrum.core.scheduling_policy.PRIORITY_AGING_S", math.inf)
    sim = Sim(scheduling_policy="priority", max_num_seqs=1, tick=1.0)
    sim.add("low", 8, max_tokens=1, priority=5)
    served_at = None
    for step in range(100):
        sim.add(f"urgent-{step}", 8, max_tokens=1, priority=0)  # as many as are served
        out = sim.step()
        if chunk_of(out, "low") is not None:
            served_at = step
            break
    if not aging:
        assert served_at is None  # starved for as long as urgent requests keep coming
        return
    # Two simulated seconds an iteration; "low" outranks a fresh urgent request once it has
    # aged five levels (the waiting urgent ones age too, but each waits one step only).
    assert served_at is not None
    assert 5 * PRIORITY_AGING_S / 2 - 2 <= served_at <= 5 * PRIORITY_AGING_S / 2 + 2


def test_priority_aging_counts_time_waiting_not_time_running():
    """A priority-1 request admitted at once and running for 11 s is still worse than a
    fresh priority-0 one, as in vLLM: the newcomer takes its seat, and when blocks run out
    it is the one preempted. Aging by time since arrival made it outrank the newcomer after
    10 s (no seat for the newcomer, which was preempted in its stead)."""
    sim = Sim(max_num_batched_tokens=64, max_num_seqs=1, scheduling_policy="priority")
    sim.add("batch", 6, max_tokens=200, priority=1)
    sim.step()
    sim.now += PRIORITY_AGING_S + 1
    sim.add("interactive", 6, max_tokens=3, priority=0)
    out = sim.step()
    assert out.preempted_request_ids == ["batch"]
    assert chunk_of(out, "interactive") is not None
    sim.run()

    sim = Sim(num_blocks=7, block_size=4, max_num_batched_tokens=32, prefix_caching=False,
              scheduling_policy="priority", max_num_seqs=2)
    sim.add("batch", 8, max_tokens=12, priority=1)
    sim.step()
    sim.now += PRIORITY_AGING_S + 1
    sim.add("interactive", 8, max_tokens=12, priority=0)
    victims = []
    while sim.sched.has_unfinished_requests():
        victims += sim.step().preempted_request_ids
    assert victims and set(victims) == {"batch"}
    sim.check_all_done()


def test_aging_never_lets_a_worse_priority_preempt_a_better_one():
    """Two requests that cannot run together, each running far longer than the aging
    step: the priority-0 one preempts the priority-1 one once, and however long the latter
    then waits, it does not preempt back (that would make them take turns, a recompute of
    the whole cache each time)."""
    sim = Sim(num_blocks=17, block_size=4, prefix_caching=False, model_max_len=64,
              max_num_batched_tokens=64, max_num_seqs=2, scheduling_policy="priority",
              tick=PRIORITY_AGING_S / 2)
    sim.add("low", 8, max_tokens=56, priority=1)
    sim.step()
    sim.add("high", 8, max_tokens=56, priority=0)
    sim.run()
    assert sim.all["low"].metrics.num_preemptions == 1
    assert sim.all["high"].metrics.num_preemptions == 0


def test_admission_preempts_the_worst_request_it_may_preempt():
    """The victim weighed for a newcomer is the worst running request it may preempt. The
    worst by aged key was v (priority 1, as good as the newcomer's, so not to be preempted),
    and the newcomer gave up though w (priority 3) was there to preempt. `aged` (priority
    5) is shielded by its long wait: `fresh` goes instead."""
    sim = Sim(max_num_batched_tokens=64, max_num_seqs=2, scheduling_policy="priority")
    sim.add("w", 6, max_tokens=200, priority=3)
    sim.now += 2 * PRIORITY_AGING_S  # waited 20 s: key 1
    sim.step()
    sim.add("v", 6, max_tokens=200, priority=1)
    sim.step()
    sim.add("newcomer", 6, max_tokens=2, priority=1)
    sim.now += PRIORITY_AGING_S + 1  # key 0
    out = sim.step()
    assert out.preempted_request_ids == ["w"] and chunk_of(out, "newcomer") is not None
    sim.run()

    sim = Sim(max_num_batched_tokens=64, max_num_seqs=2, scheduling_policy="priority")
    sim.add("aged", 6, max_tokens=50, priority=5)
    sim.now += 5 * PRIORITY_AGING_S  # waited 50 s: key 0, shielded from priority 1
    sim.step()
    sim.add("fresh", 6, max_tokens=50, priority=3)
    sim.step()
    sim.add("newcomer", 6, max_tokens=2, priority=1)
    out = sim.step()
    assert out.preempted_request_ids == ["fresh"] and chunk_of(out, "newcomer") is not None
    sim.run()


def test_a_preempted_request_ages_while_it_waits_again():
    sim = Sim(max_num_batched_tokens=64, max_num_seqs=1, scheduling_policy="priority")
    low = sim.add("low", 6, max_tokens=50, priority=2)
    sim.step()
    sim.now += 1.5 * PRIORITY_AGING_S  # running
    sim.add("top", 6, max_tokens=2, priority=0)
    assert sim.step().preempted_request_ids == ["low"]
    policy = sim.sched.policy
    assert policy.key(low)[0] == 2  # time running did not count
    sim.now += 2 * PRIORITY_AGING_S + 0.5
    policy.begin_step()
    assert policy.key(low)[0] == 0  # time waiting after its preemption does
    sim.run()


def test_a_preempted_request_keeps_its_place_by_priority():
    """vLLM #41951: a preempted request went back to the head of the queue, ahead of better
    requests; here it goes back to where its priority puts it."""
    sim = Sim(num_blocks=40, block_size=4, scheduling_policy="priority", max_num_seqs=2)
    sim.add("busy", 8, max_tokens=20, priority=0)
    sim.add("mid", 8, max_tokens=20, priority=1)
    sim.step()
    sim.add("low", 8, max_tokens=4, priority=2)  # no seat, and may not take one
    sim.add("top", 8, max_tokens=4, priority=0)  # takes mid's seat
    out = sim.step()
    assert out.preempted_request_ids == ["mid"]
    assert [r.request_id for r in sim.sched.waiting] == ["mid", "low"]
    assert sim.all["mid"].status is RequestStatus.PREEMPTED
    sim.run()


# -------------------------------------------------------------------------- engine
PROMPTS = [list(range(1, 90)), [5, 6, 7], list(range(100, 140)), [9] * 17]


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, **kwargs)


def test_greedy_tokens_are_the_same_under_every_policy(llama_dir):
    results = {}
    for policy in ("slo", "fcfs", "priority"):
        llm = LLM(str(llama_dir), scheduling_policy=policy, max_num_batched_tokens=32,
                  max_num_seqs=4)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(),
                               use_tqdm=False,
                               priority=[1, 0, 2, 0] if policy == "priority" else None)
        results[policy] = [o.outputs[0].token_ids for o in outputs]
    assert results["slo"] == results["fcfs"] == results["priority"]


def test_slo_targets_per_engine_and_per_request(llama_dir):
    llm = LLM(str(llama_dir), scheduling_policy="slo")
    defaults = llm.llm_engine.slo_defaults
    # Derived from the profiled full-budget step: half a step to the first token, and a token.
    assert 0 < defaults.tpot_s < math.inf and defaults.ttft_s == defaults.tpot_s
    assert llm.llm_engine.scheduler.policy.arrivals == defaults
    assert not llm.llm_engine.stats  # the start-up profile leaves no trace
    (output,) = llm.generate({"prompt_token_ids": [1, 2, 3]}, greedy(slo_tpot_ms=250),
                             use_tqdm=False, slo_ttft_ms=1500)
    assert output.metrics.slo == SloTargets(1.5, 0.25)
    configured = LLM(str(llama_dir), scheduling_policy="slo", slo_ttft_ms=300, slo_tpot_ms=40)
    assert configured.llm_engine.slo_defaults == SloTargets(0.3, 0.04)
    assert LLM(str(llama_dir)).llm_engine.config.scheduling_policy == "slo"  # the default
    fixed = LLM(str(llama_dir), scheduling_policy="fcfs")  # nothing profiled, no targets
    assert fixed.llm_engine.slo_defaults == SloTargets()
    for bad in (0, -5, float("nan"), "fast"):
        with pytest.raises(ValueError, match="slo_ttft_ms must be a positive number"):
            SamplingParams(slo_ttft_ms=bad)
    with pytest.raises(ValueError, match="slo_tpot_ms must be a positive number"):
        LLM(str(llama_dir), slo_tpot_ms=-1)


def test_latency_targets_are_refused_where_nothing_reads_them(llama_dir):
    unread = (r"latency targets steer only the slo scheduling policy, and "
              r"LLM\(disable_log_stats=True\) keeps no metrics, so under 'fcfs' they would "
              r"change nothing \(use 'slo', or leave them out\)$")
    with pytest.raises(ValueError, match="^slo_ttft_ms and slo_tpot_ms: " + unread):
        LLM(str(llama_dir), scheduling_policy="fcfs", slo_ttft_ms=100, slo_tpot_ms=10)
    llm = LLM(str(llama_dir), scheduling_policy="fcfs")
    with pytest.raises(ValueError, match="^slo_tpot_ms: " + unread):
        llm.generate("x", greedy(), use_tqdm=False, slo_tpot_ms=10)
    with pytest.raises(ValueError, match="^slo_ttft_ms: " + unread):
        llm.chat([{"role": "user", "content": "x"}], greedy(slo_ttft_ms=10), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    # With metrics they are read: each request's SLO is met or missed by them.
    observed = LLM(str(llama_dir), scheduling_policy="fcfs", disable_log_stats=False,
                   slo_tpot_ms=1e6)
    observed.generate("x", greedy(slo_ttft_ms=1e-6), use_tqdm=False)
    judged = {(m.labels["target"], m.labels["result"]): m.value
              for m in observed.get_metrics() if m.name == "fulcrum:request_slo"}
    assert judged[("ttft", "missed")] == judged[("tpot", "met")] == 1

"""The Scheduler driven directly, with no model: each step is schedule() + fake sampled tokens."""

from __future__ import annotations

import random
from typing import Dict, List, Optional

import pytest

from fulcrum.core.block_manager import BlockManager
from fulcrum.config import EngineConfig
from fulcrum.core.request import Request, RequestStatus
from fulcrum.outputs import SampledToken
from fulcrum.sampling_params import SamplingParams
from fulcrum.core.scheduler import Scheduler, SchedulerOutput

MODEL_MAX_LEN = 256
SAMPLED_TOKEN = 1  # never a stop token here: requests end by max_tokens


class Sim:
    """A scheduler plus the checks that must hold at every step, on a simulated clock that
    moves `tick` seconds with every arrival and step (the fixed-budget policies by default)."""

    def __init__(self, num_blocks: int = 200, block_size: int = 4, prefix_caching: bool = True,
                 model_max_len: int = MODEL_MAX_LEN, step_time=None, tick: float = 1e-3,
                 **config) -> None:
        config.setdefault("long_prefill_token_threshold", 0)  # vLLM's meaning: no cap
        config.setdefault("scheduling_policy", "fcfs")
        self.config = EngineConfig(block_size=block_size, **config).resolve(model_max_len)
        self.kv = BlockManager(num_blocks, block_size, prefix_caching)
        self.now = 0.0
        self.tick = tick
        self.sched = Scheduler(self.config, self.kv, step_time, clock=lambda: self.now)
        self.all: Dict[str, Request] = {}
        self.finished: List[str] = []
        self.history: List[SchedulerOutput] = []

    def add(self, request_id: str, prompt_len: int, max_tokens: int = 4, priority: int = 0,
            tokens: Optional[List[int]] = None) -> Request:
        seed = len(self.all) * 37
        prompt = tokens if tokens is not None else [(seed + i) % 250 for i in range(prompt_len)]
        request = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens,
                                                             ignore_eos=True),
                          priority=priority, arrival_time=self.now,
                          max_tokens=max_tokens)
        self.all[request_id] = request
        self.sched.add_request(request)
        self.now += self.tick
        return request

    def schedule(self) -> SchedulerOutput:
        behind = {rid: r.num_tokens - r.num_computed_tokens
                  for rid, r in self.sched.requests.items() if r.status is RequestStatus.RUNNING}
        out = self.sched.schedule()
        self.history.append(out)
        cfg = self.config
        assert out.num_tokens == sum(c.num_tokens for c in out.chunks)
        assert out.num_tokens <= cfg.max_num_batched_tokens
        assert len(self.sched.running) <= cfg.max_num_seqs
        ids = [c.request_id for c in out.chunks]
        assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
        assert set(ids) <= {r.request_id for r in self.sched.running}
        for chunk in out.chunks:
            request = self.all[chunk.request_id]
            assert chunk.num_tokens >= 1
            end = chunk.start_pos + chunk.num_tokens
            assert end <= request.num_tokens
            assert chunk.token_ids == request.all_token_ids[chunk.start_pos:end]
            assert len(chunk.block_table) * self.kv.block_size >= end
            assert chunk.sample == (end == request.num_tokens)
            if behind.get(chunk.request_id) == 1 and chunk.request_id not in \
                    out.preempted_request_ids:
                assert chunk.num_tokens == 1, "a decode got more than one token"
        self.kv.check_invariants(list(self.sched.requests))
        return out

    def update(self, out: SchedulerOutput) -> List[str]:
        sampled = {c.request_id: SampledToken(SAMPLED_TOKEN) for c in out.chunks if c.sample}
        done = [r.request_id for r in self.sched.update_from_output(out, sampled)]
        self.finished += done
        self.kv.check_invariants(list(self.sched.requests))
        return done

    def step(self) -> SchedulerOutput:
        out = self.schedule()
        self.update(out)
        self.now += self.tick
        return out

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                break
            out = self.step()
            assert not out.is_empty, "no progress with requests pending"
        assert not self.sched.has_unfinished_requests()
        self.check_all_done()

    def check_all_done(self) -> None:
        assert sorted(self.finished) == sorted(self.all)
        for request in self.all.values():
            assert request.status is RequestStatus.FINISHED_LENGTH
            assert request.num_output_tokens == request.max_tokens
        assert self.kv.num_free_blocks == self.kv.num_usable_blocks
        self.kv.check_invariants()


def chunk_of(out: SchedulerOutput, request_id: str):
    return next((c for c in out.chunks if c.request_id == request_id), None)


def prefill_to_decode(sim: Sim, *request_ids: str) -> None:
    """Step until every given request has its prompt computed and is decoding."""
    for _ in range(100):
        if all(sim.all[r].num_output_tokens >= 1 for r in request_ids):
            return
        sim.step()
    raise AssertionError("prompts never finished prefilling")


# ------------------------------------------------------------------- budget
def test_budget_and_seq_cap_hold_on_a_mixed_workload():
    sim = Sim(max_num_batched_tokens=24, max_num_seqs=5)
    for i in range(12):
        sim.add(f"r{i}", prompt_len=3 + 11 * i % 60, max_tokens=1 + i % 7)
    sim.run()
    assert max(o.num_tokens for o in sim.history) == 24  # the budget was actually used up
    assert max(len(o.chunks) for o in sim.history) == 5


def test_decodes_come_first_and_get_one_token_each():
    sim = Sim(max_num_batched_tokens=8, max_num_seqs=4)
    for i in range(3):
        sim.add(f"d{i}", prompt_len=2, max_tokens=20)
    prefill_to_decode(sim, "d0", "d1", "d2")
    sim.add("long", prompt_len=40)
    out = sim.step()
    assert [c.request_id for c in out.chunks[:3]] == ["d0", "d1", "d2"]
    assert all(c.num_tokens == 1 and c.sample for c in out.chunks[:3])
    assert out.num_decode_tokens == 3
    long_chunk = chunk_of(out, "long")
    assert long_chunk is not None and long_chunk.num_tokens == 5  # what the decodes left
    assert not long_chunk.sample
    assert out.num_prefill_tokens == 5


def test_chunked_prefill_splits_a_long_prompt_while_decodes_continue():
    sim = Sim(max_num_batched_tokens=16, max_num_seqs=4)
    sim.add("s0", prompt_len=3, max_tokens=30)
    sim.add("s1", prompt_len=3, max_tokens=30)
    prefill_to_decode(sim, "s0", "s1")
    sim.add("long", prompt_len=100)
    chunks = []
    while sim.all["long"].num_output_tokens == 0:
        out = sim.step()
        # Both short requests decode in every step of the long prefill: a mixed batch.
        assert chunk_of(out, "s0").num_tokens == 1
        assert chunk_of(out, "s1").num_tokens == 1
        assert out.num_decode_tokens == 2
        chunks.append(chunk_of(out, "long"))
    # 100 tokens at the 14 a step that the two decodes leave.
    assert [c.num_tokens for c in chunks] == [14] * 7 + [2]
    assert [c.start_pos for c in chunks] == [14 * i for i in range(8)]
    assert [c.sample for c in chunks] == [False] * 7 + [True]
    sim.run()


def test_without_chunked_prefill_prompts_are_scheduled_only_whole():
    sim = Sim(max_num_batched_tokens=64, max_num_seqs=8, enable_chunked_prefill=False,
              max_model_len=64)
    sim.add("a", prompt_len=40)
    sim.add("b", prompt_len=40)
    sim.add("c", prompt_len=10)
    out = sim.step()
    # b does not fit in what a left and may not be split; it blocks admission (FCFS).
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 40)]
    sim.run()
    for out in sim.history:
        for chunk in out.chunks:
            if chunk.num_tokens > 1 or chunk.start_pos == 0:
                request = sim.all[chunk.request_id]
                assert chunk.start_pos == 0 and chunk.num_tokens == request.num_prompt_tokens


def test_long_prefill_token_threshold_caps_one_prompts_chunk():
    sim = Sim(max_num_batched_tokens=64, long_prefill_token_threshold=8,
              max_num_partial_prefills=2)
    sim.add("long", prompt_len=30)
    sim.add("short", prompt_len=5)
    out = sim.step()
    assert chunk_of(out, "long").num_tokens == 8
    assert chunk_of(out, "short").num_tokens == 5
    sim.run()
    sizes = [chunk_of(o, "long").num_tokens for o in sim.history if chunk_of(o, "long")]
    assert sizes[:4] == [8, 8, 8, 6]


def test_auto_threshold_with_several_partial_prefills():
    config = EngineConfig(max_num_partial_prefills=2, long_prefill_token_threshold=0).resolve(1000)
    assert config.long_prefill_token_threshold == 40  # vLLM's rule: 4% of max_model_len
    assert EngineConfig(long_prefill_token_threshold=0).resolve(1000) \
        .long_prefill_token_threshold == 0


def test_default_chunk_is_an_eighth_of_the_budget_and_partial_chunks_fill_a_step():
    slo = EngineConfig().resolve(1000)
    assert slo.scheduling_policy == "slo"  # the default
    assert slo.long_prefill_token_threshold == 0  # slo: no fixed cap
    config = EngineConfig(scheduling_policy="fcfs").resolve(1000)
    assert config.long_prefill_token_threshold == 64
    assert config.max_num_partial_prefills == 8
    small = EngineConfig(max_num_batched_tokens=100, scheduling_policy="fcfs").resolve(1000)
    assert (small.long_prefill_token_threshold, small.max_num_partial_prefills) == (12, 8)
    whole = EngineConfig(enable_chunked_prefill=False).resolve(1000)
    assert (whole.long_prefill_token_threshold, whole.max_num_partial_prefills) == (0, 1)
    explicit = EngineConfig(long_prefill_token_threshold=100, max_num_partial_prefills=2)
    assert explicit.resolve(1000).max_num_partial_prefills == 2
    assert EngineConfig(long_prefill_token_threshold=128, scheduling_policy="fcfs") \
        .resolve(1000).max_num_partial_prefills == 4
    slo = EngineConfig(max_num_seqs=32, scheduling_policy="slo").resolve(1000)
    assert (slo.long_prefill_token_threshold, slo.max_num_partial_prefills) == (0, 32)


def test_default_schedule_fills_steps_with_chunks_of_many_prompts():
    """Sixteen 100-token prompts at once: every step carries 8 chunks of 64 tokens (the
    budget), never one prompt hogging it, and all prompts finish prefill."""
    sim = Sim(max_num_batched_tokens=512, long_prefill_token_threshold=None, num_blocks=600)
    for i in range(16):
        sim.add(f"r{i}", 100, max_tokens=2)
    out = sim.step()
    assert sorted(c.num_tokens for c in out.chunks) == [64] * 8
    assert out.num_tokens == 512


def partway(sim: Sim, out: SchedulerOutput) -> List[str]:
    """Requests whose prompt is part-way computed after this step's chunks."""
    return sorted(c.request_id for c in out.chunks
                  if c.start_pos + c.num_tokens < sim.all[c.request_id].num_prompt_tokens)


def test_one_partial_prefill_at_a_time_but_short_prompts_still_admitted():
    sim = Sim(max_num_batched_tokens=64, long_prefill_token_threshold=16,
              max_num_partial_prefills=1)
    sim.add("a", prompt_len=50)
    sim.add("b", prompt_len=50)
    sim.add("c", prompt_len=10)
    out = sim.step()
    assert chunk_of(out, "a").num_tokens == 16
    assert chunk_of(out, "b") is None  # would be a second partial prefill
    assert chunk_of(out, "c").num_tokens == 10  # completes in this step: admitted
    assert partway(sim, out) == ["a"]
    sim.run()
    assert all(len(partway(sim, o)) <= 1 for o in sim.history)


def test_two_partial_prefills_allowed_when_configured():
    sim = Sim(max_num_batched_tokens=64, long_prefill_token_threshold=16,
              max_num_partial_prefills=2)
    sim.add("a", prompt_len=50)
    sim.add("b", prompt_len=50)
    sim.add("c", prompt_len=50)
    out = sim.step()
    assert partway(sim, out) == ["a", "b"]
    sim.run()
    assert all(len(partway(sim, o)) <= 2 for o in sim.history)


def test_max_num_seqs_caps_running_requests():
    sim = Sim(max_num_batched_tokens=64, max_num_seqs=3)
    for i in range(8):
        sim.add(f"r{i}", prompt_len=4, max_tokens=3)
    out = sim.step()
    assert [c.request_id for c in out.chunks] == ["r0", "r1", "r2"]
    sim.run()
    assert max(len(o.chunks) for o in sim.history) == 3


# ----------------------------------------------------------------- priority
def test_priority_policy_admits_in_priority_order():
    sim = Sim(max_num_batched_tokens=64, max_num_seqs=1, scheduling_policy="priority")
    for rid, priority in (("p3", 3), ("p1", 1), ("p2", 2), ("p0", 0)):
        sim.add(rid, prompt_len=4, max_tokens=2, priority=priority)
    order = []
    while sim.sched.has_unfinished_requests():
        out = sim.step()
        order += [c.request_id for c in out.chunks if c.request_id not in order]
    assert order == ["p0", "p1", "p2", "p3"]


def test_fcfs_ignores_priority():
    sim = Sim(max_num_batched_tokens=64, max_num_seqs=1)
    for rid, priority in (("p3", 3), ("p1", 1)):
        sim.add(rid, prompt_len=4, max_tokens=2, priority=priority)
    order = []
    while sim.sched.has_unfinished_requests():
        out = sim.step()
        order += [c.request_id for c in out.chunks if c.request_id not in order]
    assert order == ["p3", "p1"]


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_high_priority_arrival_preempts_only_under_priority_policy(policy):
    sim = Sim(max_num_batched_tokens=64, max_num_seqs=2, scheduling_policy=policy)
    low = sim.add("low", prompt_len=6, max_tokens=20, priority=5)
    sim.add("mid", prompt_len=6, max_tokens=20, priority=1)
    prefill_to_decode(sim, "low", "mid")
    sim.add("high", prompt_len=6, max_tokens=3, priority=0)
    out = sim.step()
    if policy == "priority":
        assert out.preempted_request_ids == ["low"]
        assert chunk_of(out, "low") is None  # its decode was taken back
        assert chunk_of(out, "high") is not None
        assert low.status is RequestStatus.PREEMPTED and low.num_computed_tokens == 0
        assert low.metrics.num_preemptions == 1
        assert sim.kv.block_table("low") == []
        assert sorted(r.request_id for r in sim.sched.running) == ["high", "mid"]
    else:
        assert out.preempted_request_ids == []
        assert chunk_of(out, "high") is None
        assert low.status is RequestStatus.RUNNING
    sim.run()


def test_equal_priority_does_not_preempt():
    sim = Sim(max_num_batched_tokens=64, max_num_seqs=1, scheduling_policy="priority")
    sim.add("first", prompt_len=6, max_tokens=10, priority=1)
    prefill_to_decode(sim, "first")
    sim.add("second", prompt_len=6, max_tokens=2, priority=1)
    out = sim.step()
    assert out.preempted_request_ids == []
    assert [c.request_id for c in out.chunks] == ["first"]
    sim.run()


# --------------------------------------------------------------- preemption
def test_out_of_blocks_preempts_by_recompute_and_victim_later_completes():
    # 6 usable blocks of 4 tokens; each request grows to 8 + 12 = 20 tokens = 5 blocks.
    sim = Sim(num_blocks=7, max_num_batched_tokens=32, prefix_caching=False)
    first = sim.add("first", prompt_len=8, max_tokens=12)
    second = sim.add("second", prompt_len=8, max_tokens=12)
    preempted_at = None
    for step in range(100):
        out = sim.step()
        if out.preempted_request_ids:
            preempted_at = step
            break
    assert preempted_at is not None
    assert out.preempted_request_ids == ["second"]  # FCFS: the latest arrival goes
    assert chunk_of(out, "second") is None
    assert second.status is RequestStatus.PREEMPTED
    assert second.num_computed_tokens == 0
    assert sim.kv.block_table("second") == []
    assert second in sim.sched.waiting
    assert second.metrics.num_preemptions == 1
    assert sim.sched.num_preemptions_total == 1
    assert sim.sched.stats().num_preempted_waiting == 1
    assert first.status is RequestStatus.RUNNING
    tokens_before = list(second.all_token_ids)
    sim.run()
    # Recompute keeps the tokens generated so far: the output continues where it stopped.
    assert second.all_token_ids[:len(tokens_before)] == tokens_before
    # The recompute of prompt + generated tokens was scheduled as one prefill from 0.
    assert any(c.request_id == "second" and c.start_pos == 0 and
               c.num_tokens == len(tokens_before)
               for o in sim.history[preempted_at + 1:] for c in o.chunks)


def test_prefix_cache_counters_count_each_request_once_as_vllm():
    """A request resumed after a preemption finds its own blocks again: not a query of the
    prefix cache in vLLM's counters (it keeps those apart), nor in fulcrum's."""
    sim = Sim(num_blocks=7, max_num_batched_tokens=32, prefix_caching=True)
    sim.add("first", prompt_len=8, max_tokens=12)
    sim.add("second", prompt_len=8, max_tokens=12)
    sim.run()
    assert sim.sched.num_preemptions_total >= 1
    assert sim.sched.prefix_cache_queries == 16
    assert sim.sched.prefix_cache_hits == 0
    sim.add("again", prompt_len=0, max_tokens=2, tokens=list(sim.all["first"].prompt_token_ids))
    sim.run()
    assert sim.sched.prefix_cache_queries == 24
    assert sim.sched.prefix_cache_hits == 4  # one full block; the last token is recomputed
    # A request asking for prompt logprobs computes its prompt whole, reading no cache: it
    # is no query (it lowered the hit rate as a miss).
    scoring = sim.add("scoring", prompt_len=0, max_tokens=2,
                      tokens=list(sim.all["first"].prompt_token_ids))
    scoring.prompt_logprobs = []
    sim.run()
    assert (sim.sched.prefix_cache_queries, sim.sched.prefix_cache_hits) == (24, 4)


def test_request_preempts_itself_when_it_is_the_worst():
    # Only the newest request can be the victim; when it is the one that needs a block,
    # it gives its own blocks back instead of taking the older one's.
    sim = Sim(num_blocks=6, max_num_batched_tokens=32, prefix_caching=False)
    sim.add("old", prompt_len=4, max_tokens=14)
    sim.add("new", prompt_len=4, max_tokens=14)
    sim.run()
    assert sim.all["new"].metrics.num_preemptions >= 1
    assert sim.all["old"].metrics.num_preemptions == 0


# ------------------------------------------------------------------- static
def test_static_batching_runs_each_batch_to_completion():
    sim = Sim(max_num_batched_tokens=256, max_num_seqs=3, batching_mode="static")
    for i in range(7):
        sim.add(f"r{i}", prompt_len=5 + i, max_tokens=2 + 3 * (i % 3))
    out = sim.step()
    assert sorted(c.request_id for c in out.chunks) == ["r0", "r1", "r2"]
    batches: List[set] = []
    current: set = set()
    while sim.sched.has_unfinished_requests():
        running_before = {r.request_id for r in sim.sched.running}
        out = sim.step()
        started = {c.request_id for c in out.chunks} - running_before
        if started:
            # New requests join only when the previous batch has entirely finished.
            assert not running_before
            assert all(sim.all[r].is_finished for r in current)
            batches.append(started)
            current = set(started)
    assert batches == [{"r3", "r4", "r5"}, {"r6"}]
    sim.check_all_done()


def test_static_batching_never_chunks_prompts():
    sim = Sim(max_num_batched_tokens=256, max_num_seqs=4, batching_mode="static")
    sim.add("a", prompt_len=100)
    out = sim.step()
    assert chunk_of(out, "a").num_tokens == 100
    sim.run()


@pytest.mark.parametrize("off", [dict(enable_chunked_prefill=False),
                                 dict(batching_mode="static")])
def test_chunk_knobs_without_chunked_prefill_are_refused(off):
    """They would change nothing; vLLM refuses the first in these words."""
    with pytest.raises(ValueError, match=r"^Chunked prefill must be enabled to set "
                                         r"max_num_partial_prefills > 1\. It is off here"):
        EngineConfig(max_num_partial_prefills=2, **off)
    with pytest.raises(ValueError, match="^Chunked prefill must be enabled to set "
                                         "long_prefill_token_threshold"):
        EngineConfig(long_prefill_token_threshold=4, **off)
    # What changes nothing stays accepted: one prompt at a time, and vLLM's 0 (no cap).
    config = EngineConfig(max_num_partial_prefills=1, long_prefill_token_threshold=0, **off)
    assert config.resolve(256).max_num_partial_prefills == 1


# ------------------------------------------------------------ no lost requests
@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_finish_every_request(seed):
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8])
    max_prompt, max_out = 40, 12
    need = -(-(max_prompt + max_out) // block_size)
    policy = rng.choice(["fcfs", "priority"])
    chunked = rng.random() < 0.7
    budget = rng.choice([8, 16, 64]) if chunked else 64
    sim = Sim(num_blocks=1 + need + rng.randrange(0, 3 * need), block_size=block_size,
              prefix_caching=rng.random() < 0.5, model_max_len=64,
              max_num_batched_tokens=budget, max_num_seqs=rng.randint(1, 6),
              enable_chunked_prefill=chunked, scheduling_policy=policy,
              long_prefill_token_threshold=rng.choice([0, 5]) if chunked else 0,
              max_num_partial_prefills=rng.randint(1, 3) if chunked else 1)
    shared_prefix = [7] * 16
    count = 0
    for _ in range(400):
        for _ in range(rng.choice([0, 0, 1, 2])):
            if count < 20:
                length = rng.randint(1, max_prompt)
                tokens = None
                if rng.random() < 0.3:
                    tokens = (shared_prefix + [rng.randrange(250) for _ in range(max_prompt)])[
                        :length]
                sim.add(f"q{count}", length, max_tokens=rng.randint(1, max_out),
                        priority=rng.randint(0, 3), tokens=tokens)
                count += 1
        if sim.sched.has_unfinished_requests():
            assert not sim.step().is_empty
    sim.run()
    assert count == 20


# --------------------------------------------------------------- validation
@pytest.mark.parametrize("kwargs, model_len", [
    (dict(max_num_batched_tokens=100, enable_chunked_prefill=False), 256),
    (dict(max_num_batched_tokens=100, batching_mode="static"), 256),
    (dict(max_num_batched_tokens=8, max_num_seqs=9), 256),
    (dict(max_num_seqs=3000), 256),
    (dict(max_model_len=300), 256),
])
def test_resolve_rejects_inconsistent_configs(kwargs, model_len):
    with pytest.raises(ValueError):
        EngineConfig(**kwargs).resolve(model_len)


@pytest.mark.parametrize("kwargs", [
    dict(scheduling_policy="lifo"),
    dict(batching_mode="dynamic"),
    dict(max_num_seqs=0),
    dict(max_num_batched_tokens=-1),
    dict(long_prefill_token_threshold=-1),
    dict(max_num_partial_prefills=0),
    dict(block_size=0),
])
def test_bad_config_values_raise(kwargs):
    with pytest.raises(ValueError):
        EngineConfig(**kwargs)


def test_resolve_defaults_and_accepts_consistent_configs():
    config = EngineConfig(enable_chunked_prefill=False).resolve(4096)
    assert config.max_num_batched_tokens == 4096  # raised to fit the longest prompt
    assert config.max_num_seqs == 256
    small = EngineConfig(max_num_batched_tokens=16).resolve(4096)
    assert small.max_num_seqs == 16
    EngineConfig(max_num_batched_tokens=16, max_num_seqs=16).resolve(4096)


def test_duplicate_request_id_rejected():
    sim = Sim()
    sim.add("x", prompt_len=3)
    with pytest.raises(ValueError):
        sim.add("x", prompt_len=3)


def test_finish_requests_frees_blocks_and_reports_once():
    sim = Sim(max_num_batched_tokens=64)
    a = sim.add("a", prompt_len=10, max_tokens=10)
    sim.add("b", prompt_len=10, max_tokens=10)
    sim.step()
    done = sim.sched.finish_requests(["a", "a", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert done == [a]
    assert a.status.finish_reason == "abort"
    assert sim.kv.block_table("a") == []
    out = sim.schedule()
    assert out.finished_request_ids == ["a"]
    assert chunk_of(out, "a") is None
    sim.update(out)
    assert sim.sched.schedule().finished_request_ids == []


# ------------------------------------------------------- admission with preemption
def test_prefix_hits_dropped_by_a_preemption_are_not_handed_to_the_newcomer():
    """A newcomer's prefix hit on a block another request names (but has not computed) this
    step must not survive that request's preemption for the newcomer's sake."""
    sim = Sim(num_blocks=6, block_size=4, scheduling_policy="priority")
    sim.add("r0", 8, max_tokens=4, priority=1)
    r1 = sim.add("r1", 7, max_tokens=4, priority=1)
    sim.step()  # both prefilled: r0 holds 9 tokens, r1 8 (its last one not computed yet)
    # r2 repeats all of r1's tokens: r1's decode this step fills (and names) r1's block 1.
    sim.add("r2", 9, priority=0, tokens=r1.all_token_ids + [99])
    out = sim.schedule()
    assert sorted(out.preempted_request_ids) == ["r0", "r1"]  # five blocks for r2's three
    chunk = chunk_of(out, "r2")
    # Only r1's block 0 was computed; block 1 lost its name when r1 gave it back.
    assert chunk.start_pos == 4 and chunk.token_ids == sim.all["r2"].all_token_ids[4:]
    sim.update(out)
    sim.run()


def test_no_preemption_for_a_seat_when_the_newcomer_would_still_not_fit():
    sim = Sim(num_blocks=9, block_size=4, scheduling_policy="priority", max_num_seqs=2)
    sim.add("big", 16, max_tokens=8, priority=0)
    sim.add("small", 4, max_tokens=8, priority=2)
    sim.step()
    # Decodes leave one free block; "mid" needs four. Evicting "small" would free two, and
    # "big" outranks "mid": so nothing may be preempted, and "small" keeps decoding.
    sim.add("mid", 16, max_tokens=4, priority=1)
    out = sim.step()
    assert out.preempted_request_ids == []
    assert chunk_of(out, "small").num_tokens == 1 and chunk_of(out, "mid") is None
    assert sim.all["small"].metrics.num_preemptions == 0
    sim.run()


def test_a_preemption_for_admission_admits_the_newcomer():
    """The budget a victim's decode gives back must not grow the newcomer's chunk past the
    blocks weighed: here top's 4 tokens fit in the one block d frees, 5 would need two, and
    top was not admitted while d was preempted for nothing (and c next step, likewise)."""
    sim = Sim(num_blocks=8, block_size=4, prefix_caching=False, model_max_len=28,
              max_num_batched_tokens=8, max_num_seqs=8, scheduling_policy="priority")
    for request_id, prompt_len in (("a", 4), ("b", 4), ("c", 4), ("d", 3)):
        sim.add(request_id, prompt_len, max_tokens=20, priority=2)
    prefill_to_decode(sim, "a", "b", "c", "d")
    assert sim.kv.num_free_blocks == 0 and sim.kv.block_table("d") == [6]
    sim.add("top", 8, max_tokens=4, priority=0)
    out = sim.step()
    assert out.preempted_request_ids == ["d"]
    assert chunk_of(out, "top").num_tokens == 4
    sim.run()

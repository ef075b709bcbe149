"""Randomised engine runs on the tiny llama: arrivals between steps, aborts, small KV caches,
priorities that preempt, and cache salts that partition the prefix cache.

Whatever the configuration, every request ends exactly once with the right reason and length,
greedy and seeded outputs equal those of a plain reference engine, the block
bookkeeping is consistent after every step, and every block is free at the end.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fulcrum import LLM
from fulcrum.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_MODEL_LEN = 48
MAX_PROMPT = 32
MAX_TOKENS = 16  # MAX_PROMPT + MAX_TOKENS <= MAX_MODEL_LEN: max_tokens is never clamped
SHARED_PREFIX = [(7 * i + 3) % 250 for i in range(MAX_PROMPT)]
SEEDS = (None, 1, 2)  # None: greedy


class Reference:
    """Outputs of each (prompt, seed) run alone on a plain engine, MAX_TOKENS long."""

    def __init__(self, model_dir: str) -> None:
        self.llm = LLM(model_dir, max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False,
                       num_gpu_blocks_override=256)
        self.cache: Dict[Tuple[Tuple[int, ...], object], List[int]] = {}

    def get(self, specs: List[Tuple[List[int], object]]) -> List[List[int]]:
        missing = list({(tuple(p), s) for p, s in specs} - set(self.cache))
        if missing:
            outs = self.llm.generate([list(p) for p, _ in missing],
                                     [params(s, MAX_TOKENS) for _, s in missing], use_tqdm=False)
            for key, out in zip(missing, outs):
                self.cache[key] = out.outputs[0].token_ids
        return [self.cache[(tuple(p), s)] for p, s in specs]


def params(seed, max_tokens: int, stop_token_ids=None) -> SamplingParams:
    return SamplingParams(temperature=0.0 if seed is None else 1.0, seed=seed,
                          max_tokens=max_tokens, ignore_eos=True,
                          stop_token_ids=stop_token_ids)


@pytest.fixture(scope="module")
def reference(llama_dir) -> Reference:
    return Reference(str(llama_dir))


@st.composite
def engine_configs(draw, block_size_choices=(4, 8, 16)) -> dict:
    block_size = draw(st.sampled_from(block_size_choices))
    static = draw(st.integers(0, 5)) == 0
    chunked = not static and draw(st.booleans())
    if chunked:
        budget = draw(st.sampled_from([4, 8, 16, 32, 64]))
    else:
        budget = draw(st.sampled_from([MAX_MODEL_LEN, 2 * MAX_MODEL_LEN]))
    min_blocks = -(-MAX_MODEL_LEN // block_size) + 1  # one full-length request + the null block
    return dict(
        block_size=block_size,
        num_gpu_blocks_override=draw(st.integers(min_blocks, 2 * min_blocks)),
        enable_prefix_caching=draw(st.booleans()),
        enable_chunked_prefill=chunked,
        batching_mode="static" if static else "continuous",
        max_num_batched_tokens=budget,
        max_num_seqs=draw(st.integers(1, min(6, budget))),
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
        # Chunk knobs only with chunks (without them they are refused).
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 5])) if chunked else 0,
        max_num_partial_prefills=draw(st.integers(1, 3)) if chunked else 1,
        max_model_len=MAX_MODEL_LEN,
    )


request_specs = st.fixed_dictionaries(dict(
    shared=st.sampled_from([0, 16, 24, 32]),
    tail=st.lists(st.integers(0, 255), min_size=1, max_size=MAX_PROMPT),
    max_tokens=st.integers(1, MAX_TOKENS),
    seed=st.sampled_from(SEEDS),
    priority=st.integers(0, 2),
    stop_at=st.one_of(st.none(), st.integers(0, MAX_TOKENS - 1)),
    salt=st.sampled_from([None, None, "tenant-a", "tenant-b"]),
))

# Per step: the requests that arrive before it and which live requests to abort (as indices).
schedules = st.lists(st.tuples(st.lists(request_specs, max_size=4),
                               st.lists(st.integers(0, 50), max_size=2)),
                     min_size=2, max_size=8)


def prompt_of(spec: dict) -> List[int]:
    return (SHARED_PREFIX[:spec["shared"]] + spec["tail"])[:MAX_PROMPT]


def run_scenario(model_dir: str, reference: Reference, config: dict, schedule: list,
                 abort_rate: int):
    """Run the schedule on a fresh engine, checking as it goes; returns the engine and the
    ids of the requests it aborted."""
    specs = [spec for arrivals, _ in schedule for spec in arrivals]
    refs = reference.get([(prompt_of(s), s["seed"]) for s in specs])
    engine = LLM(model_dir, **config).llm_engine
    kv = engine.block_manager
    budget = engine.config.max_num_batched_tokens
    by_priority = engine.config.scheduling_policy == "priority"

    expected: Dict[str, dict] = {}
    live: List[str] = []
    aborted = set()
    results: Dict[str, object] = {}
    ref_iter = iter(refs)
    for step in range(3000):
        if step < len(schedule):
            arrivals, aborts = schedule[step]
            for spec in arrivals:
                ref = next(ref_iter)
                stop_ids = None
                if spec["stop_at"] is not None and spec["stop_at"] < spec["max_tokens"]:
                    stop_ids = [ref[spec["stop_at"]]]
                rid = f"req{len(expected)}"
                engine.add_request(rid, {"prompt_token_ids": prompt_of(spec),
                                         "cache_salt": spec["salt"]},
                                   params(spec["seed"], spec["max_tokens"], stop_ids),
                                   # Only the priority policy takes priorities (as vLLM).
                                   priority=spec["priority"] if by_priority else 0)
                expected[rid] = dict(spec, ref=ref, stop_ids=stop_ids or [])
                live.append(rid)
            for pick in aborts[:abort_rate]:
                if live:
                    rid = live.pop(pick % len(live))
                    engine.abort_request(rid)
                    aborted.add(rid)
                    kv.check_invariants(live)
        elif not engine.has_unfinished_requests():
            break
        outputs = engine.step()
        assert engine.last_step_stats.num_prefill_tokens + \
            engine.last_step_stats.num_decode_tokens <= budget
        for out in outputs:
            if out.finished:
                assert out.request_id not in results, "a request finished twice"
                results[out.request_id] = out
                if out.request_id in live:
                    live.remove(out.request_id)
        kv.check_invariants(live)
    assert not engine.has_unfinished_requests()
    assert set(results) == set(expected)

    for rid, spec in expected.items():
        out = results[rid].outputs[0]
        if rid in aborted:
            assert out.finish_reason == "abort"
            continue
        ref = spec["ref"][:spec["max_tokens"]]
        stop_ids = spec["stop_ids"]
        if stop_ids and stop_ids[0] in ref:
            ref = ref[:ref.index(stop_ids[0]) + 1]
        if out.finish_reason == "length":
            assert len(out.token_ids) == spec["max_tokens"]
            assert not set(out.token_ids) & set(stop_ids)
        else:
            assert out.finish_reason == "stop"
            assert len(out.token_ids) <= spec["max_tokens"]
            assert out.token_ids[-1] in stop_ids
            assert out.stop_reason == out.token_ids[-1]
        assert out.token_ids == ref, f"{rid} differs from its solo run"

    assert kv.num_free_blocks == kv.num_usable_blocks
    kv.check_invariants([])
    assert not engine.scheduler.requests
    assert not engine.output_processor._parents
    return engine, aborted, results


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(config=engine_configs(), schedule=schedules, abort_rate=st.sampled_from([0, 1, 2]))
def test_random_workloads_complete_consistently(llama_dir, reference, config, schedule,
                                                abort_rate):
    engine, aborted, results = run_scenario(str(llama_dir), reference, config, schedule,
                                            abort_rate)
    event(f"preempted: {engine.scheduler.num_preemptions_total > 0}")
    event(f"aborted: {bool(aborted)}")
    event(f"stopped: {any(r.outputs[0].finish_reason == 'stop' for r in results.values())}")
    event(f"prefix hits: {engine.scheduler.prefix_cache_hits > 0}")


def crowded_schedule(salt_of=lambda i: None) -> list:
    def spec(i: int) -> dict:
        return dict(shared=[16, 24, 32][i % 3], tail=[(11 * i + j) % 256 for j in range(8)],
                    max_tokens=MAX_TOKENS - i % 3, seed=SEEDS[i % 3], priority=i % 3,
                    stop_at=5 if i % 2 else None, salt=salt_of(i))

    return [([spec(4 * s + k) for k in range(4)], [3 * s]) for s in range(6)]


def crowded_config(chunked: bool, policy: str) -> dict:
    return dict(block_size=4, num_gpu_blocks_override=14, enable_prefix_caching=True,
                enable_chunked_prefill=chunked, max_num_seqs=4, max_model_len=MAX_MODEL_LEN,
                max_num_batched_tokens=16 if chunked else MAX_MODEL_LEN,
                scheduling_policy=policy)


@pytest.mark.parametrize("chunked,policy", [(True, "fcfs"), (False, "fcfs"),
                                            (True, "priority"), (False, "priority")])
def test_heavy_workload_exercises_preemption_prefix_hits_aborts_and_stops(llama_dir, reference,
                                                                          chunked, policy):
    """A fixed crowded workload, so the paths the random one may miss are always run."""
    salts = lambda i: ["a", None][i % 2]  # noqa: E731 - two tenants share the cache
    engine, aborted, results = run_scenario(str(llama_dir), reference,
                                            crowded_config(chunked, policy),
                                            crowded_schedule(salts), 1)
    assert engine.scheduler.num_preemptions_total > 0
    assert engine.scheduler.prefix_cache_hits > 0
    assert len(aborted) == 6
    assert any(r.outputs[0].finish_reason == "stop" for r in results.values())
    assert any(r.outputs[0].finish_reason == "length" for r in results.values())


def test_requests_with_different_salts_never_share_a_prefix(llama_dir, reference):
    """Every request its own salt: no first admission hits the cache (a preempted request
    may still hit its own blocks when it resumes), though the prompts share prefixes."""
    config = crowded_config(True, "priority")
    _, _, shared = run_scenario(str(llama_dir), reference, config, crowded_schedule(), 1)
    assert any(r.num_cached_tokens > 0 for r in shared.values())
    _, _, salted = run_scenario(str(llama_dir), reference, config,
                                crowded_schedule(lambda i: f"tenant-{i}"), 1)
    assert all(r.num_cached_tokens == 0 for r in salted.values())

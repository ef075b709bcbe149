"""/metrics for latency targets and the per-step budget: fulcrum:request_slo_total, the
default-target gauges, the iteration token histograms and the step-time model's accuracy.
Pure functions and synthetic step reports first, then a live server on the tiny llama."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from conftest import running_server
from fulcrum.stats import StepReport
from fulcrum.outputs import CompletionOutput, RequestOutput
from fulcrum.core.request import RequestMetrics, SloTargets
from fulcrum.metrics import slo_results, token_buckets
from fulcrum.server.metrics import ServerMetrics
from fulcrum.stats import StepStats

MODEL = "tiny-llama"
INF = math.inf


def _metrics(ttft_s=INF, tpot_s=INF, first=None, last=None, arrival=100.0):
    return RequestMetrics(arrival_time=arrival, slo=SloTargets(ttft_s, tpot_s),
                          first_token_time=first, last_token_time=last,
                          finished_time=last)


# ------------------------------------------------------------------ pure functions
def test_ttft_is_met_up_to_and_including_the_target():
    # arrival 100, first token 100.25: TTFT 0.25 s (exact in binary)
    assert slo_results(_metrics(0.25, first=100.25, last=100.25), 1)["ttft"]
    assert not slo_results(_metrics(0.2499, first=100.25, last=100.25), 1)["ttft"]
    assert slo_results(_metrics(INF, first=1e9, last=1e9), 1)["ttft"]  # no target: met


def test_tpot_divides_by_tokens_minus_one():
    # 5 tokens, first at 100.5, last at 101.5: TPOT 1.0 / 4 = 0.25 s (1.0 / 5 would be 0.2)
    metrics = _metrics(tpot_s=0.25, first=100.5, last=101.5)
    assert slo_results(metrics, 5) == {"ttft": True, "tpot": True, "all": True}
    metrics = _metrics(tpot_s=0.24, first=100.5, last=101.5)
    assert slo_results(metrics, 5) == {"ttft": True, "tpot": False, "all": False}
    # with 6 tokens the same span is 0.2 s a token: 0.24 is then enough
    assert slo_results(metrics, 6)["tpot"]


def test_single_token_and_infinite_targets_meet_tpot():
    # a one-token request has no TPOT: met whatever the target, as in vLLM
    assert slo_results(_metrics(tpot_s=1e-9, first=100.5, last=100.5), 1)["tpot"]
    assert slo_results(_metrics(tpot_s=INF, first=100.5, last=200.0), 3)["tpot"]
    both_missed = slo_results(_metrics(1e-6, 1e-6, first=100.5, last=101.0), 3)
    assert both_missed == {"ttft": False, "tpot": False, "all": False}
    ttft_only = slo_results(_metrics(1e-6, 1.0, first=100.5, last=101.0), 3)
    assert ttft_only == {"ttft": False, "tpot": True, "all": False}


def test_token_buckets_end_at_the_budget():
    assert token_buckets(512) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    assert token_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert token_buckets(1) == (1,)


# --------------------------------------------------------- synthetic step reports
class _FakeAsyncLLM:
    """What ServerMetrics reads from an AsyncLLM, without an engine."""

    def __init__(self) -> None:
        self.loop_stats = SimpleNamespace(busy_seconds=0.0, forward_seconds=0.0,
                                          overhead_fraction=0.0)
        self.config = SimpleNamespace(max_num_batched_tokens=64, max_model_len=128,
                                      block_size=16, kv_cache_dtype="auto",
                                      enable_prefix_caching=True, gpu_memory_utilization=0.9)
        self.engine = SimpleNamespace(slo_defaults=SloTargets(2.0, 0.125), scheduler=None,
                                      config=self.config,
                                      block_manager=SimpleNamespace(num_blocks=9))
        self.listeners = []

    def add_listener(self, listener) -> None:
        self.listeners.append(listener)


def _stats(step, prefill, decode, wall, predicted) -> StepStats:
    return StepStats(step=step, start_time=0.0, wall_seconds=wall, predicted_seconds=predicted,
                     forward_seconds=wall / 2, num_prefill_tokens=prefill,
                     num_decode_tokens=decode, num_running=1, num_waiting=0, num_preempted=0,
                     num_preemptions_total=0, kv_blocks_used=1, kv_blocks_total=8,
                     kv_cache_usage=0.125, prefix_cache_queries=0, prefix_cache_hits=0)


def _finished(request_id, reason, tokens, metrics, index=0) -> RequestOutput:
    completion = CompletionOutput(index, "x" * tokens, list(range(tokens)), None, None,
                                  finish_reason=reason, metrics=metrics)
    return RequestOutput(request_id, "p", [1, 2], [completion], True, metrics=metrics)


def _samples(metrics: ServerMetrics) -> dict:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))):
            s.value for family in text_string_to_metric_families(text) for s in family.samples}


def _slo(samples: dict, target: str, result: str) -> float:
    return samples[("fulcrum:request_slo_total", (("result", result), ("target", target)))]


def test_slo_counters_count_finished_requests_only():
    fake = _FakeAsyncLLM()
    metrics = ServerMetrics(fake, MODEL)
    good = _metrics(1.0, 0.1, first=100.5, last=100.8)  # TTFT 0.5, TPOT 0.3 / 3 = 0.1
    slow_decode = _metrics(1.0, 0.09, first=100.5, last=100.8)  # TPOT 0.1 > 0.09
    late = _metrics(0.4, INF, first=100.5, last=100.8)  # TTFT 0.5 > 0.4
    hopeless = _metrics(1e-6, 1e-6, first=100.5, last=100.8)
    outputs = [_finished("a", "length", 4, good), _finished("b", "stop", 4, slow_decode),
               _finished("c", "length", 4, late),
               _finished("d", "abort", 4, hopeless),  # aborted: not judged
               _finished("e", "error", 4, hopeless)]  # failed: not judged
    metrics.record(StepReport(outputs, None, 0, 101.0))
    samples = _samples(metrics)
    assert _slo(samples, "ttft", "met") == 2 and _slo(samples, "ttft", "missed") == 1
    assert _slo(samples, "tpot", "met") == 2 and _slo(samples, "tpot", "missed") == 1
    assert _slo(samples, "all", "met") == 1 and _slo(samples, "all", "missed") == 2
    assert samples[("fulcrum:slo_ttft_target_seconds", ())] == 2.0
    assert samples[("fulcrum:slo_tpot_target_seconds", ())] == 0.125


def test_tokens_of_a_request_add_up_over_its_outputs():
    """TPOT's token count is the request's total over its DELTA outputs, not the last one's."""
    metrics = ServerMetrics(_FakeAsyncLLM(), MODEL)
    slo = _metrics(INF, 0.25, first=100.5, last=101.5)  # 1.0 s over 5 tokens: 0.25 a token
    first = RequestOutput("r", "p", [1], [CompletionOutput(0, "a", [7], None, None,
                                                           metrics=slo)], False, metrics=slo)
    metrics.record(StepReport([first], None, 0, 100.5))
    metrics.record(StepReport([_finished("r", "length", 4, slo)], None, 0, 101.5))
    samples = _samples(metrics)
    assert _slo(samples, "tpot", "met") == 1 and _slo(samples, "tpot", "missed") == 0


def test_latencies_count_each_completion_and_only_real_token_gaps():
    """As vLLM counts: each of n completions is a request (its TTFT even when another
    completion's token came first); an abort's token-less output is no inter-token gap and
    TPOT runs to the last token; a one-token completion's TPOT is 0."""
    metrics = ServerMetrics(_FakeAsyncLLM(), MODEL)
    zero = _metrics(first=None, last=None)
    zero.first_scheduled_time = 100.125
    one = _metrics(first=100.25, last=100.25)

    def output(completions, finished=False):
        return RequestOutput("n2", "p", [1, 2], completions, finished, metrics=zero)

    # Completion 1 gets its first token before completion 0 does.
    metrics.record(StepReport([output([CompletionOutput(1, "a", [5], None, None,
                                                        metrics=one)])], None, 0, 100.25))
    zero.first_token_time = zero.last_token_time = 100.5
    metrics.record(StepReport([output([CompletionOutput(0, "b", [6], None, None,
                                                        metrics=zero)])], None, 0, 100.5))
    zero.last_token_time = 100.75
    metrics.record(StepReport([output([CompletionOutput(0, "c", [7], None, None,
                                                        metrics=zero)])], None, 0, 100.75))
    # Both aborted at 103: no new tokens.
    zero.finished_time = one.finished_time = 103.0
    metrics.record(StepReport([output([
        CompletionOutput(0, "", [], None, None, finish_reason="abort", metrics=zero),
        CompletionOutput(1, "", [], None, None, finish_reason="abort", metrics=one)],
        finished=True)], None, 0, 103.0))
    samples = _samples(metrics)

    def get(name):
        return samples[(name, ())]

    assert get("fulcrum:time_to_first_token_seconds_count") == 2
    assert get("fulcrum:time_to_first_token_seconds_sum") == pytest.approx(0.25 + 0.5)
    assert get("fulcrum:inter_token_latency_seconds_count") == 1
    assert get("fulcrum:inter_token_latency_seconds_sum") == pytest.approx(0.25)
    assert get("fulcrum:request_time_per_output_token_seconds_count") == 2
    assert get("fulcrum:request_time_per_output_token_seconds_sum") == pytest.approx(0.25)
    # First scheduled to the last token, not to the abort (vLLM's).
    assert get("fulcrum:request_inference_time_seconds_count") == 1
    assert get("fulcrum:request_inference_time_seconds_sum") == pytest.approx(0.625)
    assert samples[("fulcrum:request_success_total", (("finished_reason", "abort"),))] == 2
    assert get("fulcrum:prompt_tokens_total") == 4
    assert get("fulcrum:generation_tokens_total") == 3


def test_a_prompt_counts_once_its_completion_has_a_token():
    """vLLM counts a prompt where its first token comes: one aborted while it waited (or
    failed before any token) computed nothing that counts; an n=2 request counts its
    prompt for each completion that got a token."""
    metrics = ServerMetrics(_FakeAsyncLLM(), MODEL)
    waited = _metrics(first=None, last=None)
    aborted = RequestOutput("w", "p", list(range(100)), [CompletionOutput(
        0, "", [], None, None, finish_reason="abort", metrics=waited)], True, metrics=waited)
    ran = _metrics(first=100.25, last=100.25)
    running = RequestOutput("r", "p", list(range(40)), [
        CompletionOutput(0, "a", [5], None, None, metrics=ran),
        CompletionOutput(1, "", [], None, None, metrics=ran)], False, metrics=ran)
    metrics.record(StepReport([aborted, running], None, 0, 100.25))
    samples = _samples(metrics)
    assert samples[("fulcrum:prompt_tokens_total", ())] == 40
    assert samples[("fulcrum:request_prompt_tokens_count", ())] == 1
    assert metrics.totals["prompt_tokens"] == 40
    running.outputs[1] = CompletionOutput(1, "b", [6], None, None, metrics=ran)
    metrics.record(StepReport([running], None, 0, 100.5))
    assert _samples(metrics)[("fulcrum:prompt_tokens_total", ())] == 80


def test_latency_histograms_reach_vllms_top_buckets():
    """A request may run for many minutes on a CPU: past the last bound every quantile
    reads as that bound (160 s), so the phases end at vLLM's 7,680 s, TTFT at 2,560 s and
    the token gaps at 80 s."""
    metrics = ServerMetrics(_FakeAsyncLLM(), MODEL)
    text = generate_latest(metrics.registry).decode()
    tops = {}
    for family in text_string_to_metric_families(text):
        bounds = [float(s.labels["le"]) for s in family.samples
                  if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]
        if bounds:
            tops[family.name] = max(bounds)
    assert tops["fulcrum:time_to_first_token_seconds"] == 2560.0
    for phase in ("e2e_request_latency", "request_queue_time", "request_prefill_time",
                  "request_decode_time", "request_inference_time"):
        assert tops[f"fulcrum:{phase}_seconds"] == 7680.0, phase
    for gap in ("inter_token_latency", "time_per_output_token",
                "request_time_per_output_token"):
        assert tops[f"fulcrum:{gap}_seconds"] == 80.0, gap


def test_step_histograms_and_prediction_error():
    metrics = ServerMetrics(_FakeAsyncLLM(), MODEL)
    steps = [_stats(0, 48, 0, 0.5, 0.4), _stats(1, 10, 6, 0.25, 0.3),
             _stats(2, 0, 0, 0.001, 0.0)]  # an empty step: no prediction error
    for stats in steps:
        metrics.record(StepReport([], stats, 0, 0.0))
    samples = _samples(metrics)

    def get(name, **labels):
        return samples[(name, tuple(sorted(labels.items())))]

    assert get("fulcrum:iteration_prefill_tokens_count") == 3
    assert get("fulcrum:iteration_prefill_tokens_sum") == 58
    assert get("fulcrum:iteration_decode_tokens_sum") == 6
    assert get("fulcrum:iteration_tokens_total_sum") == 64
    assert get("fulcrum:iteration_tokens_total_bucket", le="16.0") == 2  # 16 and 0 tokens
    assert get("fulcrum:iteration_prefill_tokens_bucket", le="32.0") == 2  # 10 and 0
    assert get("fulcrum:step_time_seconds_count") == 3
    assert get("fulcrum:step_time_seconds_sum") == pytest.approx(0.751)
    assert get("fulcrum:step_time_predicted_seconds_sum") == pytest.approx(0.7)
    # |0.5 - 0.4| / 0.5 = 0.2 and |0.25 - 0.3| / 0.25 = 0.2
    assert get("fulcrum:step_time_prediction_error_ratio_count") == 2
    assert get("fulcrum:step_time_prediction_error_ratio_sum") == pytest.approx(0.4)
    assert get("fulcrum:last_step_prefill_tokens") == 0
    assert get("fulcrum:last_step_time_seconds") == 0.001
    assert get("fulcrum:last_step_time_predicted_seconds") == 0.0


# ------------------------------------------------------------------- live server
GENEROUS_MS = 600_000.0  # ten minutes: met on any machine
IMPOSSIBLE_MS = 0.001  # one microsecond: missed by any real step


@pytest.fixture(scope="module")
def served(llama_dir):
    # Engine defaults (used by requests that set no target of their own) are generous.
    with running_server(llama_dir, MODEL, num_gpu_blocks_override=1024,
                        slo_ttft_ms=GENEROUS_MS, slo_tpot_ms=GENEROUS_MS / 2) as pair:
        yield pair


def _scrape(server) -> dict:
    text = httpx.get(server.url + "/metrics").text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))):
            s.value for family in text_string_to_metric_families(text) for s in family.samples}


def _wait_idle(async_llm, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not async_llm.is_idle:
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.01)


def _last_step(async_llm) -> int:
    stats = async_llm.engine.stats
    return stats[-1].step if stats else -1


def _complete(server, max_tokens: int, **extra) -> dict:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, **extra}
    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _slo_delta(before: dict, after: dict) -> dict:
    return {(target, result): _slo(after, target, result) - _slo(before, target, result)
            for target in ("ttft", "tpot", "all") for result in ("met", "missed")}


def test_default_target_gauges(served):
    server, async_llm = served
    samples = _scrape(server)
    assert async_llm.engine.slo_defaults == SloTargets(GENEROUS_MS / 1e3, GENEROUS_MS / 2e3)
    assert samples[("fulcrum:slo_ttft_target_seconds", ())] == GENEROUS_MS / 1e3
    assert samples[("fulcrum:slo_tpot_target_seconds", ())] == GENEROUS_MS / 2e3


def test_requests_count_as_met_or_missed(served):
    server, async_llm = served
    _wait_idle(async_llm)
    before = _scrape(server)
    # 2 generous (engine defaults, then explicit), 2 impossible, 1 missing TPOT only, and a
    # one-token request whose impossible TPOT target is met trivially.
    _complete(server, 6)
    _complete(server, 6, slo_ttft_ms=GENEROUS_MS, slo_tpot_ms=GENEROUS_MS)
    _complete(server, 6, slo_ttft_ms=IMPOSSIBLE_MS, slo_tpot_ms=IMPOSSIBLE_MS)
    _complete(server, 4, n=1, slo_ttft_ms=IMPOSSIBLE_MS, slo_tpot_ms=IMPOSSIBLE_MS)
    _complete(server, 6, slo_ttft_ms=GENEROUS_MS, slo_tpot_ms=IMPOSSIBLE_MS)
    _complete(server, 1, slo_ttft_ms=GENEROUS_MS, slo_tpot_ms=IMPOSSIBLE_MS)
    _wait_idle(async_llm)
    after = _scrape(server)
    assert _slo_delta(before, after) == {
        ("ttft", "met"): 4, ("ttft", "missed"): 2,
        ("tpot", "met"): 3, ("tpot", "missed"): 3,
        ("all", "met"): 3, ("all", "missed"): 3}
    assert after[("fulcrum:request_success_total", (("finished_reason", "length"),))] - \
        before[("fulcrum:request_success_total", (("finished_reason", "length"),))] == 6


def test_chat_requests_are_judged_too(served):
    server, async_llm = served
    _wait_idle(async_llm)
    before = _scrape(server)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
            "temperature": 0.0, "ignore_eos": True, "slo_ttft_ms": IMPOSSIBLE_MS}
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    _wait_idle(async_llm)
    delta = _slo_delta(before, _scrape(server))
    # TPOT falls back to the engine's generous default
    assert delta == {("ttft", "met"): 0, ("ttft", "missed"): 1, ("tpot", "met"): 1,
                     ("tpot", "missed"): 0, ("all", "met"): 0, ("all", "missed"): 1}


def test_aborted_requests_are_not_judged(served):
    server, async_llm = served
    _wait_idle(async_llm)
    before = _scrape(server)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 450,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "slo_ttft_ms": IMPOSSIBLE_MS, "slo_tpot_ms": IMPOSSIBLE_MS}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                break  # hang up after the first token
    deadline = time.monotonic() + 30
    key = ("fulcrum:request_success_total", (("finished_reason", "abort"),))
    while _scrape(server)[key] == before[key]:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.05)
    _wait_idle(async_llm)
    after = _scrape(server)
    assert after[key] - before[key] == 1
    assert all(value == 0 for value in _slo_delta(before, after).values())


def test_step_histograms_match_the_engine_steps(served):
    server, async_llm = served
    _wait_idle(async_llm)
    first_step = _last_step(async_llm) + 1
    before = _scrape(server)
    _complete(server, 5, prompt=["a long prompt " * 12, "short"], n=2)
    _complete(server, 3)
    _wait_idle(async_llm)
    steps = [s for s in list(async_llm.engine.stats) if s.step >= first_step]
    assert steps and steps[0].step == first_step  # no step fell out of the history

    def delta(samples_after, name):
        return samples_after[(name, ())] - before[(name, ())]

    # The last step's report reaches the event loop just after the engine records it.
    deadline = time.monotonic() + 10
    while True:
        after = _scrape(server)
        if delta(after, "fulcrum:step_time_seconds_count") >= len(steps) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    prefill = sum(s.num_prefill_tokens for s in steps)
    decode = sum(s.num_decode_tokens for s in steps)
    assert prefill > 0 and decode > 0
    for name in ("iteration_prefill_tokens", "iteration_decode_tokens",
                 "iteration_tokens_total", "step_time_seconds", "step_time_predicted_seconds"):
        assert delta(after, f"fulcrum:{name}_count") == len(steps), name
    assert delta(after, "fulcrum:iteration_prefill_tokens_sum") == prefill
    assert delta(after, "fulcrum:iteration_decode_tokens_sum") == decode
    assert delta(after, "fulcrum:iteration_tokens_total_sum") == prefill + decode
    assert delta(after, "fulcrum:step_time_seconds_sum") == pytest.approx(
        sum(s.wall_seconds for s in steps))
    assert delta(after, "fulcrum:step_time_predicted_seconds_sum") == pytest.approx(
        sum(s.predicted_seconds for s in steps))
    working = [s for s in steps if s.num_prefill_tokens + s.num_decode_tokens]
    assert delta(after, "fulcrum:step_time_prediction_error_ratio_count") == len(working)
    assert delta(after, "fulcrum:step_time_prediction_error_ratio_sum") == pytest.approx(
        sum(abs(s.wall_seconds - s.predicted_seconds) / s.wall_seconds for s in working))
    last = steps[-1]
    assert after[("fulcrum:last_step_prefill_tokens", ())] == last.num_prefill_tokens
    assert after[("fulcrum:last_step_decode_tokens", ())] == last.num_decode_tokens
    assert after[("fulcrum:last_step_time_seconds", ())] == pytest.approx(last.wall_seconds)
    assert after[("fulcrum:last_step_time_predicted_seconds", ())] == pytest.approx(
        last.predicted_seconds)


def test_disable_log_stats_leaves_no_engine_series(llama_dir):
    """vLLM's disable_log_stats: no stat loggers, Prometheus's included. The process's series
    stay, and so does the dashboard (it reads the engine's own records, not the metrics)."""
    with running_server(llama_dir, MODEL, disable_log_stats=True) as (server, _):
        done = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert done.status_code == 200
        page = httpx.get(server.url + "/metrics")
        assert page.status_code == 200
        names = {family.name for family in text_string_to_metric_families(page.text)}
        assert "process_resident_memory_bytes" in names
        assert all(name.startswith("process_") for name in names), names
        state = httpx.get(server.url + "/dashboard/state", params={"since": -1}).json()
        assert state["steps"] and state["latency"]["finished"] == 1

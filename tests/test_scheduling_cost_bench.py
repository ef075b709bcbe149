"""benchmarks/scheduling_cost.py on a tiny configuration: its output has the promised
structure, and the steps it timed really had the stated numbers of running and waiting
requests, with the slo policy's ordering and chunk sizing at work. No timing assertions."""

from __future__ import annotations

import json
import math

import pytest

from conftest import load_benchmark
from fulcrum.core.scheduling_policy import StepTimeLimit

bench = load_benchmark("scheduling_cost.py")

TINY = dict(num_running=8, max_num_batched_tokens=32, block_size=4, running_prompt=(8, 24),
            waiting_prompt=(10, 40), finish_every=8, warmup_steps=8, timed_steps=32,
            max_model_len=512)
WAITING = (0, 3, 20)


@pytest.fixture(scope="module")
def results():
    return bench.run_benchmark(("slo", "fcfs", "priority"), WAITING, loose_ttft_s=3600.0,
                               **TINY)


def test_every_policy_and_waiting_count_is_measured(results):
    labels = [(r.scenario.policy, r.scenario.ttft_s, r.scenario.num_waiting) for r in results]
    assert labels == ([("slo", None, w) for w in WAITING] + [("slo", 3600.0, w) for w in WAITING]
                      + [("fcfs", None, w) for w in WAITING]
                      + [("priority", None, w) for w in WAITING])
    for result in results:
        summary = result.summary()
        assert summary["steps"] == TINY["timed_steps"] == len(result.steps)
        for key in ("median_us", "p99_us", "schedule_median_us", "update_median_us",
                    "model_update_median_us"):
            assert summary[key] > 0 and math.isfinite(summary[key])
        assert summary["p99_us"] >= summary["median_us"]
        assert summary["median_under_1ms"] == (summary["median_us"] < 1000)
        assert all(s.total_us == s.schedule_us + s.update_us for s in result.steps)


def test_steps_had_the_stated_running_and_waiting_counts(results):
    for result in results:
        sc = result.scenario
        assert result.problems == [] and bench.check_counts(result) == []
        summary = result.summary()
        assert summary["running_min"] == summary["running_max"] == sc.num_running
        assert summary["waiting_min"] == summary["waiting_max"] == sc.num_waiting
        assert summary["preemptions"] == 0
        # Steady churn: requests ended, were replaced, and the queue's head took the seats.
        assert summary["finishes"] >= TINY["timed_steps"] // TINY["finish_every"] - 1
        assert summary["admissions"] >= summary["finishes"] - 1
        assert summary["mean_prefill_tokens"] > 0
        # Running requests decode: all but the few being prefilled get a token every step.
        assert summary["mean_decode_tokens"] >= sc.num_running - 2
        for before, after in zip(result.steps, result.steps[1:]):
            # A finish frees a seat until the next step admits the replacement's turn.
            assert after.running_before == sc.num_running - before.finished
            assert after.waiting_before == sc.num_waiting + before.finished


def test_recorded_counts_match_the_scheduler_seen_from_outside():
    """The counts in the records are those of the scheduler right after each schedule()."""
    seen = []

    def instrument(driver):
        schedule = driver.sched.schedule

        def spy():
            out = schedule()
            seen.append((len(driver.sched.running), len(driver.sched.waiting),
                         out.num_decode_tokens))
            return out
        driver.sched.schedule = spy

    result = bench.measure(bench.Scenario("fcfs", 5, **TINY), instrument=instrument)
    assert seen == [(s.running, s.waiting, s.decode_tokens) for s in result.steps]
    assert {(r, w) for r, w, _ in seen} == {(TINY["num_running"], 5)}


def test_slo_ordering_and_chunk_sizing_really_run():
    """The slo policy orders the whole queue whenever a seat is free (with every seat taken
    the queue cannot move, so it is left alone) and sizes chunks against a finite step-time
    cap from a fitted model; the loose target keeps waiting requests unaged."""
    orders, caps = [], []

    def instrument(driver):
        policy = driver.sched.policy
        prefill_order, prefill_limit = policy.prefill_order, policy.prefill_limit

        def order(candidates):
            orders.append(len(candidates))
            return prefill_order(candidates)

        def limit(*args, **kwargs):
            result = prefill_limit(*args, **kwargs)
            caps.append(result)
            return result
        policy.prefill_order, policy.prefill_limit = order, limit

    for ttft_s in (None, 3600.0):
        orders.clear()
        caps.clear()
        result = bench.measure(bench.Scenario("slo", 20, ttft_s=ttft_s, **TINY),
                               instrument=instrument)
        assert len(orders) == TINY["timed_steps"] and max(orders) >= 20
        assert all(isinstance(c, StepTimeLimit) and math.isfinite(c.seconds) for c in caps)
        full_step = caps[0].model.prefill_seconds(0, TINY["max_num_batched_tokens"])
        assert 0 < caps[0].seconds < full_step
        targets = result.summary()["slo_targets"]
        assert math.isfinite(targets["ttft_ms"]) and math.isfinite(targets["tpot_ms"])
        if ttft_s is not None:
            assert result.aged_waiting_share == 0.0
    model = bench.fitted_step_time_model()
    shape = bench.StepShape()
    shape.add_chunk(100, 200)
    for _ in range(64):
        shape.add_decode(300)
    assert model.predict(shape) == pytest.approx(bench.true_step_seconds(shape), rel=0.05)


def test_results_files(results, tmp_path):
    json_path, md_path = bench.write_results(results, tmp_path)
    assert (json_path.name, md_path.name) == ("scheduling_cost.json", "scheduling_cost.md")
    data = json.loads(json_path.read_text())
    assert data["target_us"] == 1000.0
    assert {"platform", "cpu", "cpu_count", "python", "load_average"} <= set(data["machine"])
    assert data["setup"]["num_running"] == TINY["num_running"]
    assert len(data["results"]) == len(results)
    for row in data["results"]:
        assert {"policy", "ttft_s", "num_waiting", "median_us", "p99_us", "median_under_1ms",
                "problems"} <= set(row)
    md = md_path.read_text()
    assert f"{data['machine']['cpu_count']} CPUs" in md
    table = [line for line in md.splitlines() if line.startswith(("| slo", "| fcfs",
                                                                  "| priority"))]
    assert len(table) == len(results)
    assert "no exceptions" in md

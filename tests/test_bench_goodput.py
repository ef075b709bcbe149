"""`fulcrum bench goodput`: real fulcrum servers on the tiny model, chat-like traffic at two
rates, and the table, JSON and plot it writes (loopback only)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fulcrum.bench.datasets import LONG, SHORT, chat_requests
from fulcrum.bench.goodput import best_budget, traffic
from fulcrum.cli import main


def test_chat_lengths_are_log_normal_within_bounds():
    requests = chat_requests(2000, 128, 48, 4096, np.random.default_rng(0))
    prompts = np.array([r.prompt_len for r in requests])
    outputs = np.array([r.output_len for r in requests])
    assert 110 <= np.median(prompts) <= 150 and 40 <= np.median(outputs) <= 56
    assert prompts.min() >= 4 and prompts.max() <= 2048  # the tail is clipped at max_len / 2
    assert 0.05 <= np.mean(prompts > 4 * 128) <= 0.15  # log-normal, sigma 1: P(> 4x) ~ 8%
    assert outputs.min() >= 2 and outputs.max() <= 512
    assert all(len(r.prompt) == r.prompt_len for r in requests)
    assert {r.group for r in requests} == {SHORT, LONG}
    assert all((r.group == LONG) == (r.prompt_len > 4 * 128) for r in requests)


def test_every_rate_offers_the_same_lengths_scaled_in_time_with_fresh_prompts():
    a, b = traffic(1.0, 8, 64, 16, 0.5, 0), traffic(2.0, 8, 64, 16, 0.5, 0)
    assert [(r.prompt_len, r.output_len) for _, r in a] == \
        [(r.prompt_len, r.output_len) for _, r in b]
    assert [2 * offset for offset, _ in b] == pytest.approx([offset for offset, _ in a])
    assert all(x.prompt != y.prompt for (_, x), (_, y) in zip(a, b))
    assert all(len(r.prompt) == r.prompt_len for _, r in a)
    assert traffic(1.0, 8, 64, 16, 0.5, 0) == a
    gaps = np.diff([offset for offset, _ in traffic(4.0, 400, 64, 16, 0.5, 1)])
    assert 0.2 <= gaps.mean() <= 0.3  # mean gap 1 / rate
    assert gaps.std() / gaps.mean() > 1.2  # burstier than Poisson (coefficient of variation 1)


def test_best_budget_is_the_most_goodput_over_rates():
    results = {"fulcrum-slo": {"points": [{"goodput": 9.0}]},
               "fulcrum-fcfs-256": {"points": [{"goodput": 1.0}, {"goodput": 2.0}]},
               "fulcrum-fcfs-512": {"points": [{"goodput": 2.0}, {"goodput": 1.5}]},
               "fulcrum-fcfs-2048": {"error": "failed"}}
    assert best_budget(results) == "fulcrum-fcfs-512"


def test_goodput_bench_writes_table_json_and_plot(llama_dir, tmp_path):
    code = main(["bench", "goodput", "--engines", "fulcrum-slo,fulcrum-fcfs-256",
                 "--rates", "4,8", "--num-prompts", "6", "--input-len", "16",
                 "--output-len", "4", "--max-model-len", "512", "--model", str(llama_dir), "--output-dir", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "goodput.json").read_text())
    assert set(data["results"]) == {"fulcrum-slo", "fulcrum-fcfs-256"}
    assert data["best_fixed_budget"] == "fulcrum-fcfs-256"
    for outcome in data["results"].values():
        assert [p["rate"] for p in outcome["points"]] == [4.0, 8.0]
        for p in outcome["points"]:
            assert p["completed"] == 6 and not p["errors"]
            assert 0.0 <= p["goodput_share"] <= 1.0
            assert p["goodput"] <= p["completed"] / 0.1
    assert "--slo-ttft-ms" in data["results"]["fulcrum-slo"]["flags"]
    page = (tmp_path / "goodput.md").read_text()
    assert "| fulcrum-slo | " in page and "| fulcrum-fcfs-256 | " in page
    assert "fulcrum bench goodput --engines fulcrum-slo,fulcrum-fcfs-256" in page
    assert (tmp_path / "goodput.png").stat().st_size > 10_000

"""`fulcrum bench stress` against an in-process server on stories260K (loopback only): kept
streams get every token, disconnected and stalled ones leave nothing behind."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from conftest import running_server
from fulcrum.bench.stress import (DISCONNECT, KEPT, STALL, RoundReport, StressConfig,
                                  format_table, parse_metrics, plan_round, problems, run_stress)
from fulcrum.cli import main

MODEL = "stories"


@pytest.fixture(scope="module")
def server(stories_dir):
    with running_server(stories_dir, MODEL, num_gpu_blocks_override=1024) as (background, _):
        yield background


def test_plan_round_shares_and_reproducibility():
    config = StressConfig(num_clients=100, max_tokens=8, disconnect_fraction=0.3,
                          stall_fraction=0.05, seed=3)
    plans = plan_round(config, 0)
    kinds = [p.kind for p in plans]
    assert (kinds.count(KEPT), kinds.count(DISCONNECT), kinds.count(STALL)) == (65, 30, 5)
    assert all(0 <= p.disconnect_after < 8 for p in plans)
    assert any(p.kind == DISCONNECT and p.disconnect_after == 0 for p in plans)
    assert plans == plan_round(config, 0) and plans != plan_round(config, 1)
    with pytest.raises(ValueError):
        StressConfig(disconnect_fraction=0.9, stall_fraction=0.2)


def test_parse_metrics_matches_suffixes():
    text = ('# TYPE vllm:num_requests_running gauge\n'
            'vllm:num_requests_running{model_name="m"} 2.0\n'
            '# TYPE process_resident_memory_bytes gauge\n'
            'process_resident_memory_bytes 1048576.0\n'
            '# TYPE vllm:request_success counter\n'
            'vllm:request_success_total{finished_reason="abort",model_name="m"} 7.0\n')
    state = parse_metrics(text)
    assert state["running"] == 2 and state["waiting"] is None
    assert state["rss_bytes"] == 2**20 and state["finished"] == {"abort": 7}


def test_problems_name_leaks_and_short_streams():
    clean = RoundReport(1, sent=3, completed=3, running_after=0, waiting_after=0,
                        kv_blocks_used_after=0)
    assert problems([clean]) == []
    leaky = RoundReport(2, sent=3, completed=3, running_after=1, waiting_after=0,
                        kv_blocks_used_after=4, kept_token_mismatches=1)
    found = problems([clean, leaky])
    assert len(found) == 3 and all(f.startswith("round 2") for f in found)


def test_server_exports_blocks_and_rss(server):
    text = httpx.get(server.url + "/metrics").text
    state = parse_metrics(text)
    assert state["kv_blocks_used"] == 0 and state["rss_bytes"] > 0
    assert 'finished_reason="error"' in text


def test_stress_rounds_leave_nothing_behind(server):
    config = StressConfig(base_url=server.url, num_clients=60, rounds=2, max_tokens=8,
                          disconnect_fraction=0.3, stall_fraction=0.05, stall_seconds=1.0,
                          read_timeout=30.0, round_timeout=60.0, drain_timeout=15.0)
    report = asyncio.run(run_stress(config, log=None))
    assert report["passed"], report["problems"]
    assert report["model"] == MODEL and not report["unchecked"]
    for r in report["rounds"]:
        assert r["sent"] == 60 == r["completed"] + r["disconnected"] + r["stalled"]
        assert (r["disconnected"], r["stalled"]) == (18, 3)
        assert r["errors"] == r["failed"] == r["kept_token_mismatches"] == 0
        assert r["kept_tokens_delivered"] == r["kept_tokens_asked"] == r["completed"] * 8
        assert (r["running_after"], r["waiting_after"], r["kv_blocks_used_after"]) == (0, 0, 0)
        assert r["drained"] and r["rss_after_bytes"] > 0
        assert r["server_finished"].get("length", 0) >= r["completed"]
        assert sum(r["server_finished"].values()) == 60
    assert report["overall"]["sent"] == 120
    assert "PASSED" in format_table(report)


def test_cli_smoke(server, tmp_path, capsys):
    out = tmp_path / "stress.json"
    code = main(["bench", "stress", "--base-url", server.url, "--num-clients", "12",
                 "--rounds", "1", "--max-tokens", "4", "--stall-seconds", "0.2",
                 "--stall-fraction", "0.1", "--save-result", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "requests sent" in printed and "PASSED" in printed
    saved = json.loads(out.read_text())
    assert saved["passed"] and saved["overall"]["sent"] == 12 and "date" in saved


@pytest.mark.parametrize("command", [["stress", "--num-clients", "1"],
                                     ["serve", "--num-prompts", "1", "--model", "m"],
                                     ["serve", "--num-prompts", "1"]])
@pytest.mark.parametrize("url", ["http://127.0.0.1:9", "notaurl"])
def test_cli_without_server_fails_cleanly(capsys, command, url):
    code = main(["bench", *command, "--base-url", url])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"fulcrum bench: error: cannot use {url}: ")

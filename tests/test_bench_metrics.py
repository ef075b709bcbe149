"""The arithmetic of fulcrum bench: metrics from synthetic timelines, arrivals, datasets,
grid parsing and Pareto fronts. No model, no server."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from fulcrum.bench.arrivals import arrival_offsets, schedule
from fulcrum.bench.datasets import jsonl_requests, mixed_requests, random_requests
from fulcrum.bench.metrics import RequestTimeline, compute_report, format_report, \
    meets_slo, parse_goodput, report_by_group
from fulcrum.bench.sweep import pareto_front, parse_grid


def _timelines():
    return [
        RequestTimeline(0.0, 10, 4, [0.1, 0.15, 0.25, 0.30], group="short"),
        RequestTimeline(1.0, 20, 2, [1.2, 1.3], group="short"),
        RequestTimeline(0.5, 30, 1, [0.9], group="long"),
        RequestTimeline(0.2, 40, 5, [], group="long", success=False, error="boom"),
    ]


def test_per_request_definitions():
    first = _timelines()[0]
    assert first.ttft == pytest.approx(0.1)
    assert first.e2el == pytest.approx(0.3)
    assert first.itl == pytest.approx([0.05, 0.1, 0.05])
    assert first.tpot == pytest.approx(0.2 / 3)  # (E2EL - TTFT) / (out - 1)
    assert _timelines()[2].tpot is None  # one token: no TPOT


def test_report_throughputs_and_percentiles():
    report = compute_report(_timelines(), duration=2.0)
    assert report["completed"] == 3 and report["failed"] == 1
    assert report["total_input_tokens"] == 60 and report["total_output_tokens"] == 7
    assert report["request_throughput"] == pytest.approx(1.5)
    assert report["output_throughput"] == pytest.approx(3.5)
    assert report["total_token_throughput"] == pytest.approx(33.5)
    ttft = report["ttft_ms"]  # [100, 200, 400]
    assert ttft["mean"] == pytest.approx(700 / 3)
    assert ttft["median"] == pytest.approx(200)
    assert ttft["p90"] == pytest.approx(360)  # linear interpolation, as numpy and vLLM
    assert ttft["p99"] == pytest.approx(396)
    assert report["itl_ms"]["mean"] == pytest.approx(75)  # gaps 50, 100, 50, 100
    assert report["tpot_ms"]["mean"] == pytest.approx((200 / 3 + 100) / 2)
    assert report["e2el_ms"]["median"] == pytest.approx(300)
    assert "goodput" not in report


def test_goodput_counts_requests_meeting_every_slo():
    both = compute_report(_timelines(), 2.0, {"ttft_ms": 250, "tpot_ms": 80})
    assert both["goodput"] == pytest.approx(0.5)  # only the first meets both
    tpot_only = compute_report(_timelines(), 2.0, {"tpot_ms": 80})
    assert tpot_only["goodput"] == pytest.approx(1.0)  # a 1-token request has TPOT 0
    with pytest.raises(ValueError, match="unknown SLO"):
        compute_report(_timelines(), 2.0, {"itl": 1})


# Hand-made requests whose latencies are exact in binary, so targets can sit on the boundary.
# (send, prompt, output tokens, chunk times): TTFT / TPOT / E2EL in ms
def _goodput_timelines():
    return [
        RequestTimeline(0.0, 8, 3, [0.25, 0.5, 0.75], group="a"),  # 250 / 250 / 750
        RequestTimeline(0.0, 8, 1, [0.5], group="a"),  # 500 / none (counts 0) / 500
        RequestTimeline(0.0, 8, 4, [], group="b", success=False, error="HTTP 503"),
        RequestTimeline(1.0, 8, 5, [1.125, 1.25, 1.375, 1.5, 2.125], group="b"),  # 125/250/1125
    ]


def _goodput(targets):
    return compute_report(_goodput_timelines(), 4.0, targets)


def test_goodput_targets_are_inclusive_and_every_one_must_hold():
    report = _goodput({"ttft": 250, "tpot": 250})
    assert report["slo"] == {"ttft": 250.0, "tpot": 250.0}
    assert report["good_requests"] == 2  # the first (on both boundaries) and the last
    assert report["goodput"] == 0.5  # good requests / duration
    assert report["goodput_share"] == 0.5  # of all 4 requests sent, the failed one included
    assert report["slo_attainment"] == {"ttft": 0.5, "tpot": 0.75}
    just_below = _goodput({"ttft": 249.999, "tpot": 250})
    assert just_below["good_requests"] == 1 and just_below["slo_attainment"]["ttft"] == 0.25
    assert _goodput({"ttft": 250, "tpot": 249.999})["good_requests"] == 0
    assert [meets_slo(t, {"ttft": 250, "tpot": 250}) for t in _goodput_timelines()
            if t.completed] == [True, False, True]


def test_goodput_tpot_divides_by_tokens_minus_one():
    # TPOTs are 250 ms: (E2EL - TTFT) / (tokens - 1); over all tokens they would be 166.7 and
    # 200, and both would meet 200
    report = _goodput({"tpot": 200})
    assert report["good_requests"] == 1  # the single-token request alone
    assert _goodput({"tpot": 0})["good_requests"] == 1  # a single token counts as TPOT 0
    assert _goodput({"tpot": 250})["good_requests"] == 3


def test_goodput_e2el_and_legacy_keys():
    assert _goodput({"e2el": 750})["good_requests"] == 2
    assert _goodput({"e2el": 1125})["good_requests"] == 3  # the failed request never counts
    assert _goodput({"ttft_ms": 250, "tpot_ms": 250}) == _goodput({"ttft": 250, "tpot": 250})
    with pytest.raises(ValueError, match="twice"):
        _goodput({"ttft": 250, "ttft_ms": 250})


def test_goodput_per_group_and_in_the_table():
    reports = report_by_group(_goodput_timelines(), 4.0, {"ttft": 250, "tpot": 250})
    assert reports["a"]["good_requests"] == 1 and reports["a"]["goodput_share"] == 0.5
    assert reports["b"]["good_requests"] == 1 and reports["b"]["goodput_share"] == 0.5
    assert reports["b"]["goodput"] == 0.25
    table = format_report({"all": reports["all"]}).splitlines()
    assert "Goodput targets (ms)" in table[9] and table[9].endswith("ttft:250 tpot:250")
    assert table[10].startswith("Request goodput (req/s)") and table[10].endswith(" 0.50")
    assert table[11].startswith("Good requests") and table[11].endswith(" 2")
    assert table[12].startswith("Within all targets (%)") and table[12].endswith(" 50.00")
    assert table[13].startswith("Within TTFT target (%)") and table[13].endswith(" 50.00")
    assert table[14].startswith("Within TPOT target (%)") and table[14].endswith(" 75.00")


def test_parse_goodput_vllm_syntax():
    assert parse_goodput(["ttft:1000", "tpot:100", "e2el:2500.5"]) == {
        "ttft": 1000.0, "tpot": 100.0, "e2el": 2500.5}
    assert parse_goodput(["tpot:0"]) == {"tpot": 0.0}
    assert parse_goodput(["ttft_ms=1000", "tpot_ms=100"], alias=True) == {
        "ttft": 1000.0, "tpot": 100.0}


@pytest.mark.parametrize("items, words", [
    (["ttft=500"], "no ':'"),  # the --slo spelling given to --goodput
    (["ttft 500"], "no ':'"),
    (["TTFT:500"], "unknown target 'TTFT'"),
    (["ttft_ms:500"], "unknown target 'ttft_ms'"),
    (["itl:5"], "unknown target 'itl'"),
    (["ttft:"], "is not a number"),
    (["ttft:500ms"], "is not a number"),
    (["ttft:-1"], "non-negative"),
    (["ttft:nan"], "finite"),
    (["ttft:inf"], "finite"),
    (["ttft:500", "ttft:600"], "already given"),
])
def test_parse_goodput_refuses_bad_items(items, words):
    with pytest.raises(ValueError, match=re.escape(words)) as caught:
        parse_goodput(items)
    assert repr(items[-1]) in str(caught.value)  # names the offending item
    if "unknown" in words:
        assert "ttft, tpot, e2el" in str(caught.value)


def test_parse_slo_alias_refuses_bad_items():
    with pytest.raises(ValueError, match="no '='"):
        parse_goodput(["ttft_ms:500"], alias=True)
    with pytest.raises(ValueError, match="unknown target 'ttft'"):
        parse_goodput(["ttft=500"], alias=True)


def _serve_args(*flags):
    from fulcrum.cli import build_parser

    return build_parser().parse_args(["bench", "serve", *flags])


def test_cli_goodput_flag_and_slo_alias():
    assert _serve_args().goodput == {}
    assert _serve_args("--goodput", "ttft:1000", "tpot:100").goodput == {
        "ttft": 1000.0, "tpot": 100.0}
    assert _serve_args("--slo", "ttft_ms=1000", "tpot_ms=100").goodput == {
        "ttft": 1000.0, "tpot": 100.0}
    assert _serve_args("--goodput", "ttft:1000", "--slo", "e2el_ms=9").goodput == {
        "ttft": 1000.0, "e2el": 9.0}


@pytest.mark.parametrize("flags, words", [
    (["--goodput", "ttft=1000"], "bad --goodput item 'ttft=1000'"),
    (["--goodput", "ttft:fast"], "bad --goodput item 'ttft:fast'"),
    (["--slo", "ttft:1000"], "bad --slo item 'ttft:1000'"),
    (["--goodput", "ttft:1", "--slo", "ttft_ms=2"], "a ttft target is already given"),
    (["--goodput"], "expected at least one argument"),
])
def test_cli_goodput_errors_are_usage_errors(flags, words, capsys):
    with pytest.raises(SystemExit) as caught:
        _serve_args(*flags)
    assert caught.value.code == 2
    assert words in capsys.readouterr().err


def test_groups_are_reported_apart_over_the_same_duration():
    reports = report_by_group(_timelines(), 2.0)
    assert set(reports) == {"all", "short", "long"}
    assert reports["short"]["completed"] == 2
    assert reports["long"]["failed"] == 1
    assert reports["short"]["request_throughput"] == pytest.approx(1.0)
    assert set(report_by_group(_timelines()[:2], 2.0)) == {"all"}


def test_empty_metrics_are_none():
    report = compute_report([RequestTimeline(0.0, 5, 1, [0.5])], 1.0)
    assert report["tpot_ms"]["p99"] is None and report["itl_ms"]["mean"] is None


def test_arrivals_all_at_once_poisson_and_gamma():
    rng = np.random.default_rng(0)
    assert arrival_offsets(3, math.inf, 1.0, rng) == [0.0, 0.0, 0.0]
    for burstiness in (1.0, 0.25):
        offsets = arrival_offsets(20000, 10.0, burstiness, rng)
        gaps = np.diff(offsets)
        assert offsets[0] == 0.0 and np.all(gaps >= 0)
        assert gaps.mean() == pytest.approx(0.1, rel=0.05)
        # gamma gaps: squared coefficient of variation = 1 / burstiness
        assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1 / burstiness, rel=0.1)


def test_random_and_mixed_datasets_have_exact_lengths():
    rng = np.random.default_rng(0)
    fixed = random_requests(5, 32, 8, 0.0, rng)
    assert all(r.prompt_len == len(r.prompt) == 32 and r.output_len == 8 for r in fixed)
    assert all(0 <= t < 256 for r in fixed for t in r.prompt)
    ranged = random_requests(200, 100, 10, 0.5, rng)
    assert all(50 <= r.prompt_len <= 150 and 5 <= r.output_len <= 15 for r in ranged)
    mixed = mixed_requests(6, 16, 2, 300, 4, 0.0, rng)
    assert [r.group for r in mixed].count("long") == 2
    assert {r.prompt_len for r in mixed if r.group == "long"} == {300}


def test_mixed_schedule_gives_each_group_its_rate():
    mixed = mixed_requests(50, 16, 2, 300, 4, 0.0, np.random.default_rng(0))
    timed = schedule(mixed, {"all": 5.0, "long": math.inf}, 1.0, seed=0)
    offsets = [o for o, _ in timed]
    assert offsets == sorted(offsets)
    assert all(o == 0.0 for o, r in timed if r.group == "long")
    assert max(offsets) > 1.0  # the short ones trickle in after the long ones


def test_chat_long_requests_arrive_with_the_others_unless_given_a_rate():
    """--dataset chat at 2 req/s sent its longest prompts (over 4x the median: 6 of 64) all
    at t=0, a burst the asked rate never offered; they now arrive in the one process at
    --request-rate (their group still splits the report). Mixed keeps its long prompts at
    the start, and a --long-request-rate still gives the long requests their own process."""
    from fulcrum.bench.arrivals import build_schedule
    from fulcrum.bench.datasets import build_requests

    args = _bench_args("serve", "--dataset", "chat", "--request-rate", "2")
    timed = build_schedule(build_requests(args), args)
    assert [offset for offset, _ in timed].count(0.0) == 1
    assert sum(r.group == "long" for _, r in timed) == 6
    offsets = [offset for offset, _ in timed]
    assert np.mean(np.diff(offsets)) == pytest.approx(0.5, rel=0.3)
    args = _bench_args("serve", "--dataset", "chat", "--request-rate", "2",
                       "--long-request-rate", "inf")
    timed = build_schedule(build_requests(args), args)
    assert all(offset == 0.0 for offset, r in timed if r.group == "long")
    args = _bench_args("serve", "--dataset", "mixed", "--request-rate", "2")
    timed = build_schedule(build_requests(args), args)
    assert [r.group for offset, r in timed if offset == 0.0] == ["long", "long", "short"]


def test_jsonl_dataset(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(item) for item in [
        {"prompt": "hello", "output_len": 3}, {"prompt": [1, 2, 3], "group": "long"}]))
    requests = jsonl_requests(str(path), 7, count_tokens=len)
    assert [(r.prompt_len, r.output_len, r.group) for r in requests] == [
        (5, 3, "all"), (3, 7, "long")]
    path.write_text('{"prompt": 5}\n')
    with pytest.raises(ValueError, match="prompt"):
        jsonl_requests(str(path), 7)


def _bench_args(*argv):
    from fulcrum.cli import build_parser

    return build_parser().parse_args(["bench", *argv])


def test_each_dataset_takes_only_the_settings_it_reads(tmp_path):
    from fulcrum.bench.arrivals import build_schedule
    from fulcrum.bench.datasets import build_requests

    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": [i, i + 1]}) for i in range(5)))
    jsonl = ("--dataset", "jsonl", "--dataset-path", str(path))
    refused = [("throughput", "--dataset-path", str(path)),
               ("throughput", "--long-input-len", "100"),
               ("throughput", "--dataset", "chat", "--range-ratio", "0.5"),
               ("throughput", *jsonl, "--input-len", "9"),
               ("sweep", *jsonl, "--long-num-prompts", "1")]
    for argv in refused:
        with pytest.raises(ValueError, match=f"^{argv[-2]} is not read by --dataset"):
            build_requests(_bench_args(*argv))
    # Not given: each command's defaults (sweep's scenario is smaller).
    args = _bench_args("throughput", "--dataset", "mixed")
    requests = build_requests(args)
    assert (args.num_prompts, args.input_len, args.output_len, args.long_input_len) == (
        64, 256, 128, 2048)
    assert [r.prompt_len for r in requests].count(2048) == 2 and len(requests) == 66
    args = _bench_args("sweep")
    assert len(build_requests(args)) == 34 and args.input_len == 64 and args.output_len == 32
    # jsonl: the whole file unless --num-prompts takes its first lines.
    assert [r.prompt[0] for r in build_requests(_bench_args("throughput", *jsonl))] == [
        0, 1, 2, 3, 4]
    assert [r.prompt[0] for r in build_requests(
        _bench_args("throughput", *jsonl, "--num-prompts", "2"))] == [0, 1]
    # A long-request rate needs long requests to apply to.
    args = _bench_args("serve", "--long-request-rate", "2")
    with pytest.raises(ValueError, match="the dataset has no long requests"):
        build_schedule(build_requests(args), args)
    args = _bench_args("serve", "--dataset", "mixed", "--long-request-rate", "2",
                       "--request-rate", "inf")
    timed = build_schedule(build_requests(args), args)
    assert sum(offset > 0 for offset, r in timed if r.group == "long") == 1


def test_grid_is_a_union_of_products():
    grid = parse_grid(["max-num-batched-tokens=64,128 enable_chunked_prefill=true,false",
                       "batching_mode=static", "max_num_batched_tokens=64"])
    assert len(grid) == 6
    assert {"max_num_batched_tokens": 128, "enable_chunked_prefill": False} in grid
    assert {"batching_mode": "static"} in grid
    with pytest.raises(ValueError, match="grid item"):
        parse_grid(["not_a_knob=1"])


def test_grid_values_may_be_floats_and_none():
    grid = parse_grid(["slo_ttft_ms=200.5,1e3 gpu_memory_utilization=0.5",
                       "quantization=None,int8"])
    assert grid == [{"slo_ttft_ms": 200.5, "gpu_memory_utilization": 0.5},
                    {"slo_ttft_ms": 1000.0, "gpu_memory_utilization": 0.5},
                    {"quantization": None}, {"quantization": "int8"}]
    assert parse_grid(["max_num_seqs=8"]) == [{"max_num_seqs": 8}]  # ints stay ints


def test_pareto_front_maximises_throughput_and_minimises_latency():
    points = [(100, 50), (200, 80), (150, 90), (200, 70), (50, None)]
    assert pareto_front(points) == [True, False, False, True, False]

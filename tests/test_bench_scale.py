"""fulcrum bench scale's reading of /metrics and its page section."""

from __future__ import annotations

from pathlib import Path

from fulcrum.bench.scale import prefix_hits, summary

METRICS = """# TYPE fulcrum:prefix_cache_hits_total counter
fulcrum:prefix_cache_hits_total{engine="0",model_name="m"} 96.0
fulcrum:prefix_cache_hits_total{engine="1",model_name="m"} 32.0
fulcrum:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9
fulcrum:prefix_cache_queries_total{engine="0",model_name="m"} 200.0
fulcrum:prefix_cache_queries_total{engine="1",model_name="m"} 56.0
"""


def test_prefix_hits_sum_every_replica():
    assert prefix_hits(METRICS) == (128.0, 256.0)
    assert prefix_hits("fulcrum:prefix_cache_hits_total{model_name=\"m\"} 5.0\n") == (5.0, 0.0)


def _part(variants, loads):
    return {"shape": "s", "median": {v: {load: dict(values) for load, values in loads[v].items()}
                                     for v in variants}}


def test_summary_states_each_ratio():
    data = {"setup": {"repeats": 2, "command": "fulcrum bench scale", "machine": {"date": "D", "cores": 2},
                      "routing": {"prefixes": 8, "per_prefix": 8, "prefix_len": 768,
                                  "ending_len": 32, "concurrency": 8}},
            "parts": {
                "tp": _part(["tp=1", "tp=2"], {
                    "tp=1": {"batch 1": {"tpot_ms": 10}, "batch 8": {"tpot_ms": 20},
                             "prefill 1024": {"ttft_ms": 100}},
                    "tp=2": {"batch 1": {"tpot_ms": 15}, "batch 8": {"tpot_ms": 30},
                             "prefill 1024": {"ttft_ms": 90}}}),
                "dp": _part(["one engine", "dp=2"], {
                    "one engine": {"throughput": {"total_tokens_per_s": 100, "tpot_ms": 1,
                                                  "makespan_s": 2}},
                    "dp=2": {"throughput": {"total_tokens_per_s": 95, "tpot_ms": 1,
                                            "makespan_s": 2}}}),
                "routing": _part(["round_robin", "cache_aware"], {
                    "round_robin": {"shared prefixes": {"prefix_hit_rate": 0.5, "ttft_ms": 3,
                                                        "total_tokens_per_s": 4,
                                                        "makespan_s": 5}},
                    "cache_aware": {"shared prefixes": {"prefix_hit_rate": 0.8, "ttft_ms": 3,
                                                        "total_tokens_per_s": 4,
                                                        "makespan_s": 5}}})}}
    text = "\n".join(summary(data, Path("/r/scale.json"), Path("/docs")))
    assert "two ranks, 1 core each, against one rank on all 2 cores." in text
    assert "so on 2 cores it is slower: TPOT at batch 1 x1.50, at batch 8 x1.50" in text
    assert "two replicas behind the router, 1 core each, against one engine on all 2 cores" \
        in text
    data["setup"]["machine"]["cores"] = 16  # the page once said one core each on any machine
    text = "\n".join(summary(data, Path("/r/scale.json"), Path("/docs")))
    assert "two ranks, 8 cores each, against one rank on all 16 cores." in text
    assert "so on 16 cores it is slower" in text
    data["setup"]["cores"] = 2  # 2 of the machine's 16 given to the run (taskset, a cpuset)
    text = "\n".join(summary(data, Path("/r/scale.json"), Path("/docs")))
    assert "two ranks, 1 core each, against one rank on all 2 cores." in text
    assert "TTFT x0.90" in text
    assert "total tokens/s x0.95" in text
    assert "prefix-cache hit rate 0.50 vs 0.80" in text
    assert "| tp=2 | 15.0 | 30.0 | 90.0 |" in text
    assert "[raw](../r/scale.json)" in text

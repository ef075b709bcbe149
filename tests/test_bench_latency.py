"""`fulcrum bench latency` on the tiny model: the steps it times are full-batch decode steps,
a step's work counts every weight once per step and 2 FLOPs per weight per request, each batch
size is judged against the bandwidth probed between its own steps, and the docs section reads
its numbers. No timing assertions."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

from fulcrum.bench.latency import (BandwidthProbe, kernel_roofline_s, measure, step_work,
                                   summary, workload_flops)
from fulcrum.config import EngineConfig
from fulcrum.engine import LLMEngine
from fulcrum.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(llama_dir):
    return LLMEngine(EngineConfig(model=str(llama_dir), max_model_len=64,
                                  scheduling_policy="fcfs"))


def test_step_work_counts_weights_and_cache(engine):
    spec = engine.runner.model.spec
    h, f = spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    params = spec.num_layers * (h * (q + 2 * kv) + q * h + h * 2 * f + f * h) + h * spec.vocab_size
    work = step_work(engine, batch=3, context=10)
    assert work["weight_bytes"] == params * 4  # float32
    kv_bytes = 3 * 10 * spec.num_layers * 2 * kv * 4
    assert work["bytes"] == params * 4 + kv_bytes
    assert work["flops"] == 2 * params * 3 + 4 * 3 * 10 * spec.num_layers * q


def test_the_bandwidth_probe_reads_the_memory_of_the_weights_device():
    """On a GPU the probe's array is in the GPU's memory, not the host's (the meta device
    stands in for one here: it allocates nothing and computes nothing)."""
    probe = BandwidthProbe(torch.device("meta"))
    assert probe.data.device.type == "meta"
    assert probe.data.numel() * 4 == 512 << 20
    probe()
    assert len(probe.readings) == 1 and probe.readings[0] > 0
    host = BandwidthProbe()
    assert host.data.device.type == "cpu" and host.data.numel() * 4 == 512 << 20
    host()
    assert len(host.readings) == 1


def test_measure_times_full_batch_decode_steps(engine, llama_dir):
    int8 = LLMEngine(EngineConfig(model=str(llama_dir), max_model_len=64,
                                  scheduling_policy="fcfs", quantization="int8"))
    data = measure({"float32": engine, "int8": int8}, [1, 3], input_len=5, output_len=6,
                   runs=2)
    assert list(data["engines"]) == ["float32", "int8"]
    full, quantized = data["engines"]["float32"], data["engines"]["int8"]
    assert quantized["weights_mb"] == pytest.approx(full["weights_mb"] / 4)  # fp32 -> int8
    rows = full["rows"] + quantized["rows"]
    assert [r["batch"] for r in rows] == [1, 3, 1, 3]
    for row in rows:
        assert row["steps"] == 2 * 5  # 6 tokens: one from the prefill step, 5 decode steps
        assert row["tokens_per_s"] == pytest.approx(row["batch"] / row["ms_per_token"] * 1e3)
        assert 0 < row["share_of_roofline"] and row["bound"] in ("memory", "compute")
        # the forward pass is part of the step: shorter, so nearer the roofline
        assert 0 < row["forward_ms"] < row["ms_per_token"]
        assert row["forward_share_of_roofline"] == pytest.approx(
            row["roofline_ms"] / row["forward_ms"])
    # A probe after every step (each run: one prefill step, then 5 decode steps), and each
    # batch size judged against the median of its own probes, the same for both engines.
    probes = data["machine_limits"]["bandwidth_gb_per_s_probes"]
    assert {batch: len(readings) for batch, readings in probes.items()} == {"1": 24, "3": 24}
    for i, batch in enumerate(("1", "3")):
        assert full["rows"][i]["bandwidth_gb_per_s"] == pytest.approx(
            statistics.median(probes[batch]))
        assert quantized["rows"][i]["bandwidth_gb_per_s"] == full["rows"][i]["bandwidth_gb_per_s"]
    assert full["matrix_peak_gflops"] > 0 and quantized["matrix_peak_gflops"] > 0
    data["setup"] = {"shape": "tiny", "dtype": "float32", "input_len": 5, "output_len": 6,
                     "machine": {"cpu": "Some CPU", "cores": 2, "kernels": "avx2",
                                 "date": "today"}, "command": "fulcrum bench latency"}
    lines = summary(data, Path("/r/latency.json"), Path("/docs"))
    assert "Some CPU, 2 cores, avx2 kernels, today; [raw](../r/latency.json)" in lines[3]
    assert lines[1] == "## Latency against the roofline"
    assert lines[-1] == "![latency](../r/latency.png)"
    assert sum(line.startswith("| float32 | ") or line.startswith("| int8 | ")
               for line in lines) == 4


def test_a_run_without_a_whole_batch_step_says_why(llama_dir):
    """One 16-token prompt chunk a step: the first request decodes its 6 tokens while the
    other prompts are still being prefilled, so no step decodes all 8; the bench says so
    (it once failed with "no median for empty data")."""
    engine = LLMEngine(EngineConfig(model=str(llama_dir), max_model_len=64,
                                    max_num_batched_tokens=64, scheduling_policy="fcfs",
                                    long_prefill_token_threshold=16,
                                    max_num_partial_prefills=1))
    with pytest.raises(ValueError, match=r"no step decoded all 8 requests together: "
                                         r"prefilling their 8 x 40 prompt tokens \(64 a step"):
        measure({"float32": engine}, [8], input_len=40, output_len=6, runs=1)


def test_workload_flops_counts_each_computed_token_once(engine, llama_dir):
    """Prompts of 5 and 3 tokens making 4 and 1 outputs: 8 and 3 tokens pass through the
    stack (the last output is never fed back), 5 rows of the LM head, and the token at
    position t attends to t + 1 keys."""
    config = json.loads((Path(llama_dir) / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = hidden // heads
    per_layer = (hidden * (heads + 2 * config["num_key_value_heads"]) * head_dim
                 + heads * head_dim * hidden + 3 * hidden * config["intermediate_size"])
    body = config["num_hidden_layers"] * per_layer
    per_key = 4 * config["num_hidden_layers"] * heads * head_dim
    expected = (2 * body * (8 + 3) + 2 * hidden * config["vocab_size"] * (4 + 1)
                + per_key * (sum(range(1, 9)) + sum(range(1, 4))))
    assert workload_flops(engine.runner.model, [5, 3], [4, 1]) == expected


def test_kernel_roofline_judges_each_step_by_compute_or_memory(engine):
    """Two 5-token prompts making 4 tokens each, fcfs: one step prefills both (10 rows, no
    decode, so no LM head), then 3 steps decode both. With the bandwidth unbounded the bound
    is the FLOPs at the peak, the LM head's rows for the prompts' first tokens left out; with
    the peak unbounded it is reading the weights once a step (the LM head in the 3 decode
    steps only) and each decode's KV cache: positions 5, 6, 7 attend to 6 + 7 + 8 keys."""
    first = len(engine.stats)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i in range(2):
        engine.add_request(f"roofline-{i}", {"prompt_token_ids": [1, 2, 3, 4, 5]}, params)
    while engine.has_unfinished_requests():
        engine.step()
    steps = list(engine.stats)[first:]
    assert [(s.num_prefill_tokens, s.num_decode_tokens) for s in steps] == \
        [(10, 0)] + [(0, 2)] * 3
    model, spec = engine.runner.model, engine.runner.model.spec
    head_params = spec.hidden_size * spec.vocab_size
    flops = workload_flops(model, [5, 5], [4, 4]) - 2 * 2 * head_params
    peak = 1e9
    assert kernel_roofline_s(engine, [5, 5], [4, 4], steps, peak, float("inf")) == \
        pytest.approx(flops / peak, rel=1e-12)
    weights = step_work(engine, 1, 0)["weight_bytes"]  # float32, the LM head included
    kv_per_key = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 4
    read = 4 * (weights - 4 * head_params) + 3 * 4 * head_params + 2 * 21 * kv_per_key
    assert kernel_roofline_s(engine, [5, 5], [4, 4], steps, float("inf"), 1e9) == \
        pytest.approx(read / 1e9, rel=1e-12)


def test_the_page_names_only_the_weights_that_ran():
    """--quantizations none ran the bf16 engine alone, yet the page said the model ran "with
    its weights as loaded and with int8 ..., runs alternating between the two"."""
    row = {"batch": 1, "ms_per_token": 2.0, "tokens_per_s": 500.0, "bandwidth_gb_per_s": 10.0,
           "roofline_ms": 1.0, "share_of_roofline": 0.5, "forward_ms": 1.5,
           "forward_share_of_roofline": 0.7, "bound": "memory", "achieved_gb_per_s": 5.0,
           "achieved_gflops": 1.0}
    setup = {"shape": "tiny", "dtype": "bfloat16", "input_len": 5, "output_len": 6,
             "machine": {"cpu": "Some CPU", "cores": 2, "date": "today"}, "command": "c"}

    def page(*labels):
        data = {"setup": setup, "machine_limits": {"bandwidth_gb_per_s_probes": {"1": [10.0]}},
                "engines": {label: {"weights_mb": 1.0, "matrix_peak_gflops": 1.0, "rows": [row]}
                            for label in labels}}
        return summary(data, Path("/r/latency.json"), Path("/docs"))[3]

    assert "bfloat16, with its weights as loaded; 5-token prompts" in page("bfloat16")
    assert "bfloat16, with int8 (`--quantization int8`, the LM head included); 5-token" in \
        page("int8")
    assert ("with its weights as loaded and with int8 (`--quantization int8`, the LM head "
            "included), runs alternating between the two; 5-token") in page("bfloat16", "int8")

"""`fulcrum bench throughput` and `fulcrum bench sweep` on a tiny model, and the HF
baseline's accounting; small enough to run in seconds."""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import pytest
import torch

from fulcrum.bench import throughput
from fulcrum.bench.cli import register
from fulcrum.bench.datasets import random_requests
from fulcrum.bench.hf_baseline import measure_hf
from fulcrum.bench.latency import workload_flops
from fulcrum.bench.shapes import SMOLLM2_135M, shape_dir
from fulcrum.bench.throughput import measure_fulcrum, write_comparison
from fulcrum.llm import LLM
from fulcrum.tokenizer import Tokenizer

SMALL_KV = ["--kv-cache-memory-bytes", "20000000"]


def _run_cli(argv):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_sweep_writes_png_and_table(llama_dir, tmp_path, capsys):
    out = tmp_path / "sweep"
    code = _run_cli(["bench", "sweep", str(llama_dir), "--num-prompts", "4", "--input-len", "8",
                     "--output-len", "4", "--long-num-prompts", "1", "--long-input-len", "120",
                     "--request-rate", "40", "--grid", "max_num_batched_tokens=32,128",
                     "--grid", "batching_mode=static", "--output-dir", str(out), *SMALL_KV])
    assert code == 0
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    table = (out / "sweep.md").read_text()
    assert "budget=32" in table and "mode=static" in table and "*" in table
    points = json.loads((out / "sweep.json").read_text())["points"]
    assert len(points) == 3
    assert all(p["latency_group"] == "short" for p in points)
    assert points[2]["config"]["batching_mode"] == "static"
    assert "TTFT p99" in capsys.readouterr().out


def test_a_bad_grid_point_fails_before_any_point_runs(llama_dir, tmp_path, monkeypatch):
    import fulcrum.bench.sweep as sweep

    def must_not_run(*args, **kwargs):
        raise AssertionError("a point ran")

    monkeypatch.setattr(sweep, "run_point", must_not_run)
    argv = ["bench", "sweep", str(llama_dir), "--num-prompts", "2", "--input-len", "8",
            "--output-len", "4", "--output-dir", str(tmp_path / "sweep"), *SMALL_KV]
    with pytest.raises(ValueError, match="block_size must be a positive integer, got 0"):
        _run_cli([*argv, "--grid", "block_size=16,0"])
    with pytest.raises(ValueError, match="bad grid item 'model=/x'"):
        _run_cli([*argv, "--grid", "model=/x"])


def test_throughput_command(llama_dir, tmp_path, capsys):
    saved = tmp_path / "throughput.json"
    assert _run_cli(["bench", "throughput", str(llama_dir), "--num-prompts", "3",
                     "--input-len", "8", "--output-len", "4", "--save-result", str(saved),
                     *SMALL_KV]) == 0
    result = json.loads(saved.read_text())["result"]
    assert result["num_requests"] == 3 and result["output_tokens"] == 12
    assert result["input_tokens"] == 24 and result["peak_rss_mib"] > 0
    assert json.loads(saved.read_text())["machine"]["cores"] == os.cpu_count()
    # three 8-token prompts making 4 tokens each: the roofline of exactly that work
    model = LLM(str(llama_dir), kv_cache_memory_bytes=20_000_000).llm_engine.runner.model
    assert result["flops"] == workload_flops(model, [8] * 3, [4] * 3)
    assert result["matrix_peak_flops"] > 0
    assert result["roofline_s"] == result["flops"] / result["matrix_peak_flops"]
    assert result["share_of_roofline"] == result["roofline_s"] / result["elapsed_s"]
    # kernel by kernel: at least the FLOPs but the LM head's rows for the prompts' first tokens
    head = model.spec.hidden_size * model.spec.vocab_size
    least = (result["flops"] - 2 * head * 3) / result["matrix_peak_flops"]
    assert result["bandwidth"] > 0 and result["kernel_roofline_s"] >= least * (1 - 1e-12)
    assert result["share_of_kernel_roofline"] == result["kernel_roofline_s"] / result["elapsed_s"]
    out = capsys.readouterr().out
    assert "% of the roofline" in out and "kernel by kernel, memory-bound work at" in out


def test_throughput_hf_flags_go_with_compare_hf_which_saves_its_result(llama_dir, tmp_path,
                                                                      monkeypatch):
    argv = ["bench", "throughput", str(llama_dir), "--num-prompts", "2", "--input-len", "8",
            "--output-len", "4", *SMALL_KV]
    for flag, value in (("--hf-batch-size", "3"), ("--results-dir", str(tmp_path / "r"))):
        with pytest.raises(ValueError, match=f"^{flag} go with --compare-hf"):
            _run_cli([*argv, flag, value])
    assert not (tmp_path / "r").exists()
    with pytest.raises(ValueError, match="^--slo-ttft-ms: latency targets steer only the slo "
                                         "scheduling policy, and bench throughput reports no "
                                         "SLO attainment, so under 'fcfs'"):
        _run_cli([*argv, "--scheduling-policy", "fcfs", "--slo-ttft-ms", "5"])
    monkeypatch.setattr(throughput, "run_isolated", lambda function, *args: function(*args))
    saved = tmp_path / "saved.json"
    assert _run_cli([*argv, "--compare-hf", "--hf-batch-size", "2", "--results-dir",
                     str(tmp_path / "cmp"), "--save-result", str(saved)]) == 0
    data = json.loads(saved.read_text())
    assert data["result"]["output_tokens"] == data["hf_transformers"]["output_tokens"] == 8
    assert sorted(p.name for p in (tmp_path / "cmp").iterdir()) == [
        "throughput_vs_hf_llama.json", "throughput_vs_hf_llama.md"]
    compared = json.loads((tmp_path / "cmp" / "throughput_vs_hf_llama.json").read_text())
    assert compared["setup"]["hf_batch_size"] == 2


def test_fulcrum_and_hf_produce_the_same_token_counts(llama_dir, tmp_path):
    requests = random_requests(3, 8, 5, 0.0, np.random.default_rng(0))
    ours = measure_fulcrum(str(llama_dir), {"kv_cache_memory_bytes": 20_000_000}, requests)
    theirs = measure_hf(str(llama_dir), torch.float32, "cpu", requests, batch_size=2,
                        random_weights=True)
    assert ours.output_tokens == theirs.output_tokens == 15  # EOS ignored on both sides
    setup = {"model": "tiny", "hf_batch_size": 2}
    json_path, md_path = write_comparison(ours, theirs, setup, tmp_path / "cmp")
    assert json.loads(json_path.read_text())["output_tokens_per_s_ratio"] > 0
    assert "| fulcrum" in md_path.read_text()


def test_hf_counts_the_tokens_asked_for_not_a_batch_padded_to_its_longest(llama_dir):
    """Outputs of 2 and 8 tokens in one batch: HF generates 8 for both rows, and the 6 extra
    tokens of the first were counted as output (16, not 10), inflating HF's tokens/s
    whenever the lengths vary (--range-ratio)."""
    from fulcrum.bench.datasets import SampleRequest

    requests = [SampleRequest([5, 6, 7], 3, 2), SampleRequest([8, 9, 10, 11], 4, 8)]
    theirs = measure_hf(str(llama_dir), torch.float32, "cpu", requests, batch_size=2,
                        random_weights=True)
    assert theirs.output_tokens == 10 and theirs.input_tokens == 7


def test_shape_folder_matches_its_config(tmp_path, monkeypatch):
    monkeypatch.setenv("FULCRUM_CACHE", str(tmp_path))
    folder = shape_dir("smollm2-135m")
    config = json.loads((tmp_path / "shapes" / "smollm2-135m" / "config.json").read_text())
    assert config == SMOLLM2_135M and config["vocab_size"] == 49152
    assert Tokenizer(folder).vocab_size == 49152

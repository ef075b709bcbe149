"""benchmarks/attention_layout.py: its block tables are the layouts it names, and one small
measurement runs every layout and the read. No timing assertions."""

from __future__ import annotations

import pytest
import torch

from conftest import load_benchmark
from fulcrum import kernels

bench = load_benchmark("attention_layout.py")


def test_layouts_place_blocks_as_named():
    # 3 sequences of 5 blocks (context 80), the first 3 blocks of each its prompt's.
    tables = bench.layouts(3, 80, 48, torch.Generator().manual_seed(0))
    assert tables["runs"].tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]
    # Prompts' blocks 0-8 in runs; then each decode step's new blocks, one per sequence.
    assert tables["prompt runs, decode interleaved"].tolist() == [
        [0, 1, 2, 9, 12], [3, 4, 5, 10, 13], [6, 7, 8, 11, 14]]
    assert sorted(tables["random"].flatten().tolist()) == list(range(15))
    assert tables["in L2"].tolist() == [[0, 1, 2, 3, 4]] * 3
    # A partial last block counts as a block; a prompt longer than the context is all runs.
    partial = bench.layouts(2, 33, 100, torch.Generator().manual_seed(0))
    assert partial["prompt runs, decode interleaved"].tolist() == [[0, 1, 2], [3, 4, 5]]


def test_measure_runs_every_layout_and_the_read():
    if not kernels.supports_varlen(torch.bfloat16, torch.bfloat16, bench.HEADS // bench.KV_HEADS,
                                   bench.HEAD_DIM, bench.BLOCK):
        pytest.skip("no bf16 varlen attention kernel on this machine")
    kernel = bench.typed(kernels.paged_attention())
    results = bench.measure(kernel, batch=2, context=40, prompt_len=16, turns=1)
    assert list(results) == ["runs", "prompt runs, decode interleaved", "random", "in L2",
                             "read"]
    assert results["read"]["over_read"] == 1.0
    assert all(r["ms"] > 0 and r["over_read"] > 0 for r in results.values())

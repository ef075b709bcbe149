"""benchmarks/attention_layout.py: its block tables are the layouts it names, and one small
measurement runs every layout and the read. No timing assertions."""

from __future__ import annotations

import pytest
import torch

from conftest import load_benchmark
from fulcrum import kernels

bench = load_benchmark("attention_layout.py")


def test_layouts_place_blocks_as_named():
    # 3 sequences of 5 blocks (context 80), the first 3 blocks of each its prompt's, in a
    # cache of 400 blocks (block 0 the engine's null block, in no table).
    tables = bench.layouts(3, 80, 48, 400, torch.Generator().manual_seed(0))
    assert tables["runs"].tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15]]
    # Prompts' blocks 1-9 in runs; then each decode step's new blocks, one per sequence.
    assert tables["prompt runs, decode interleaved"].tolist() == [
        [1, 2, 3, 10, 13], [4, 5, 6, 11, 14], [7, 8, 9, 12, 15]]
    random_blocks = tables["random"].flatten().tolist()
    assert len(set(random_blocks)) == 15 and 0 not in random_blocks
    assert max(random_blocks) < 400
    assert tables["in L2"].tolist() == [[1, 2, 3, 4, 5]] * 3
    assert tables["server"].shape == (3, 5)
    # A partial last block counts as a block; a prompt longer than the context is all runs.
    partial = bench.layouts(2, 33, 100, 400, torch.Generator().manual_seed(0))
    assert partial["prompt runs, decode interleaved"].tolist() == [[1, 2, 3], [4, 5, 6]]
    assert bench.adjacent_share(partial["runs"]) == 1.0
    assert bench.adjacent_share(torch.tensor([[1, 2, 4], [9, 8, 7]])) == 0.25
    with pytest.raises(ValueError):
        bench.layouts(3, 80, 48, 15, torch.Generator().manual_seed(0))  # 15 blocks + null


def test_measure_runs_every_layout_and_the_read():
    if not kernels.supports_varlen(torch.bfloat16, torch.bfloat16, bench.HEADS // bench.KV_HEADS,
                                   bench.HEAD_DIM, bench.BLOCK):
        pytest.skip("no bf16 varlen attention kernel on this machine")
    kernel = bench.typed(kernels.paged_attention())
    results = bench.measure(kernel, batch=2, context=40, prompt_len=16, num_blocks=300,
                            turns=1)
    assert list(results) == ["runs", "prompt runs, decode interleaved", "server", "random",
                             "in L2", "read"]
    assert results["read"]["over_read"] == 1.0
    assert all(r["ms"] > 0 and r["over_read"] > 0 for r in results.values())
    assert results["runs"]["adjacent"] == 1.0 and "adjacent" not in results["read"]

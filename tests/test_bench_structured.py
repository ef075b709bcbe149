"""`fulcrum bench structured` on the tiny model: both variants decode the whole batch for the
whole run (the schema's long string keeps constrained requests going), the steps it times are
full-batch decode steps, and the summary for docs/performance.md reads its numbers. No timing
assertions."""

from __future__ import annotations

from pathlib import Path

from fulcrum.bench.structured import grammar_work_ms, measure, summary
from fulcrum.config import EngineConfig
from fulcrum.engine import LLMEngine


def test_measure_times_full_batch_decode_steps_of_both_variants(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), max_model_len=64,
                                    scheduling_policy="fcfs"))
    prompts = [[1 + i, 2 + i, 3 + i, 4 + i] for i in range(6)]
    data = measure(engine, prompts, output_len=10, repeats=2)
    for variant, result in data["results"].items():
        assert result["errors"] == 0
        assert result["min_output_tokens"] == 10  # nobody finished early
        assert result["steps"] == 2 * 9  # 10 tokens: one from the prefill step, 9 decode steps
        assert len(result["run_step_ms_medians"]) == 2
    assert data["ratio"] > 0
    data["grammar_work_ms"] = grammar_work_ms(engine, 6, repeats=3)
    assert data["grammar_work_ms"] > 0
    assert not engine.has_unfinished_requests()
    data["setup"] = {"num_requests": 6, "shape": "tiny", "dtype": "float32", "input_len": 4,
                     "output_len": 10, "repeats": 2, "machine": {"date": "today"},
                     "command": "fulcrum bench structured"}
    lines = summary(data, Path("/r/structured_outputs.json"), Path("/docs"))
    assert lines[1] == "## Structured outputs"
    assert f"**{data['grammar_work_ms']:.2f} ms**" in lines[3]
    assert "[raw](../r/structured_outputs.json)" in lines[3]
    assert lines[-2].startswith("| none |") and lines[-1].startswith("| json_schema |")

"""`fulcrum bench structured`: what structured outputs cost a decode step.

A batch of requests decodes together, in-process, once unconstrained and once under a JSON
schema (xgrammar masks every row's logits each step and advances every row's matcher). The
schema holds each answer in one long string, so every request keeps decoding for the whole
run. Unconstrained and constrained runs alternate, `--repeats` times each, so slow drifts of a
shared machine hit both alike; the figure is the median wall time of the steps where the
whole batch decodes (no prompt chunk in them), and the difference is what the grammars cost.
That difference can drown in a noisy machine's swings, so the grammar work of one step is
also timed alone: the batch's bitmask filled and applied to its logits, and every matcher
advanced by one token (and rolled back, to time the same state again).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence

import numpy as np
import torch

from fulcrum.arg_types import output_dir, positive_int
from fulcrum.bench.shapes import DEFAULT_SHAPE, SHAPES, shape_dir
from fulcrum.config import EngineConfig
from fulcrum.engine import LLMEngine
from fulcrum.sampling_params import SamplingParams, StructuredOutputsParams

# One long string: a random model fills it for the whole run instead of finishing early.
SCHEMA = {"type": "object",
          "properties": {"title": {"type": "string", "minLength": 4000},
                         "done": {"type": "boolean"}},
          "required": ["title", "done"]}
VARIANTS = ("none", "json_schema")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default=DEFAULT_SHAPE, choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-requests", type=positive_int, default=64)
    parser.add_argument("--input-len", type=positive_int, default=64)
    parser.add_argument("--output-len", type=positive_int, default=64)
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="runs of each variant, alternating (default 3)")
    parser.add_argument("--output-dir", type=output_dir,
                        default="benchmarks/results/structured_outputs")


def _params(variant: str, output_len: int, seed: int) -> SamplingParams:
    constraint = (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
                  if variant == "json_schema" else None)
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=output_len, ignore_eos=True,
                          structured_outputs=constraint)


def run_variant(engine: LLMEngine, variant: str, prompts: Sequence[List[int]],
                output_len: int) -> Dict[str, Any]:
    """Decode the batch once; wall and forward times of its full-batch decode steps."""
    first_step = len(engine.stats)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{variant}-{time.monotonic_ns()}-{i}", {"prompt_token_ids": prompt},
                           _params(variant, output_len, i))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    steps = [s for s in list(engine.stats)[first_step:]
             if s.num_decode_tokens == len(prompts) and s.num_prefill_tokens == 0]
    lengths = [len(o.outputs[0].token_ids) for o in finished]
    return {"steps": len(steps), "step_ms": [1e3 * s.wall_seconds for s in steps],
            "forward_ms": [1e3 * s.forward_seconds for s in steps],
            "min_output_tokens": min(lengths), "errors": sum(o.error is not None for o in finished)}


def measure(engine: LLMEngine, prompts: Sequence[List[int]], output_len: int,
            repeats: int) -> Dict[str, Any]:
    runs: Dict[str, List[Dict[str, Any]]] = {v: [] for v in VARIANTS}
    run_variant(engine, "json_schema", prompts[:2], 4)  # compile the schema, warm both paths
    for _ in range(repeats):
        for variant in VARIANTS:
            runs[variant].append(run_variant(engine, variant, prompts, output_len))
    results = {}
    for variant, outcomes in runs.items():
        steps = [t for o in outcomes for t in o["step_ms"]]
        forward = [t for o in outcomes for t in o["forward_ms"]]
        results[variant] = {
            "steps": len(steps), "step_ms_median": statistics.median(steps),
            "forward_ms_median": statistics.median(forward),
            "outside_forward_ms_median": statistics.median(
                s - f for s, f in zip(steps, forward)),
            "run_step_ms_medians": [statistics.median(o["step_ms"]) for o in outcomes],
            "min_output_tokens": min(o["min_output_tokens"] for o in outcomes),
            "errors": sum(o["errors"] for o in outcomes)}
    none, schema = results["none"], results["json_schema"]
    return {"results": results,
            "extra_ms_per_step": schema["step_ms_median"] - none["step_ms_median"],
            "extra_outside_forward_ms": (schema["outside_forward_ms_median"]
                                         - none["outside_forward_ms_median"]),
            "ratio": schema["step_ms_median"] / none["step_ms_median"]}


def grammar_work_ms(engine: LLMEngine, num_rows: int, repeats: int = 50) -> float:
    """Median time of one step's grammar work for `num_rows` rows inside the schema's string."""
    from fulcrum.structured_output import apply_grammar_masks

    params = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    grammars = [engine.grammar_compiler.grammar_for(params) for _ in range(num_rows)]
    for grammar in grammars:
        grammar.future.result()
        grammar.matcher.accept_string('{"title": "abc')
    token = engine.tokenizer.encode("x", add_special_tokens=False)[0]
    logits = torch.randn(num_rows, engine.vocab_size)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        apply_grammar_masks(logits, grammars)
        for grammar in grammars:
            if not grammar.accept(token):
                raise RuntimeError("the benchmark's token left the schema's string")
        times.append(1e3 * (time.perf_counter() - start))
        for grammar in grammars:
            grammar.matcher.rollback(1)
    return statistics.median(times)


def run_structured(args: argparse.Namespace) -> None:
    from fulcrum.bench.report import machine_facts

    engine = LLMEngine(EngineConfig(
        model=shape_dir(args.shape), load_format="dummy", dtype=args.dtype,
        max_model_len=args.input_len + args.output_len + 8,
        max_num_seqs=max(256, args.num_requests), scheduling_policy="fcfs"))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, engine.vocab_size, args.input_len).tolist()
               for _ in range(args.num_requests)]
    data = measure(engine, prompts, args.output_len, args.repeats)
    data["grammar_work_ms"] = grammar_work_ms(engine, args.num_requests)
    data["setup"] = {"shape": args.shape, "dtype": args.dtype,
                     "num_requests": args.num_requests, "input_len": args.input_len,
                     "output_len": args.output_len, "repeats": args.repeats,
                     "schema": SCHEMA, "machine": machine_facts(),
                     "command": (f"fulcrum bench structured --shape {args.shape} --num-requests "
                                 f"{args.num_requests} --output-len {args.output_len} "
                                 f"--repeats {args.repeats}")}
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "structured_outputs.json"
    json_path.write_text(json.dumps(data, indent=2) + "\n")
    (out / "structured_outputs.md").write_text("\n".join(
        ["# Structured outputs: cost per decode step", *summary(data, json_path, out)[3:]]) + "\n")
    print("\n".join(table(data)))


def table(data: Dict[str, Any]) -> List[str]:
    rows = ["| variant | decode step, median (ms) | forward (ms) | outside the forward (ms) | "
            "steps timed |", "|---|---:|---:|---:|---:|"]
    for variant, r in data["results"].items():
        rows.append(f"| {variant} | {r['step_ms_median']:.1f} | {r['forward_ms_median']:.1f} | "
                    f"{r['outside_forward_ms_median']:.2f} | {r['steps']} |")
    return rows


def summary(data: Dict[str, Any], json_path: Path, page_dir: Path) -> List[str]:
    """The section docs/performance.md shows of these results (links relative to page_dir)."""
    setup = data["setup"]
    relative = os.path.relpath(json_path, page_dir)
    return ["", "## Structured outputs", "",
            f"{setup['num_requests']} requests decoding together ({setup['shape']} shape, "
            f"{setup['dtype']}, {setup['input_len']}-token prompts, {setup['output_len']} output "
            "tokens each), unconstrained and under a JSON schema (xgrammar: one bitmask fill "
            "for the batch, matchers advanced on every token), runs alternating, "
            f"{setup['repeats']} of each; medians over the steps where the whole batch decodes. "
            f"Step to step the schema changed the median step by "
            f"{data['extra_ms_per_step']:+.2f} ms ({100 * (data['ratio'] - 1):+.1f}%; outside "
            f"the forward pass {data['extra_outside_forward_ms']:+.2f} ms); the grammar work "
            "of one step timed alone (bitmask filled and "
            f"applied for {setup['num_requests']} rows, every matcher advanced) is "
            f"**{data['grammar_work_ms']:.2f} ms**. {setup['machine']['date']}; "
            f"[raw]({relative}); `{setup['command']}` regenerates it.", "", *table(data)]


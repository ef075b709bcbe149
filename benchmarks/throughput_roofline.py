"""The throughput workload against this machine's compute roofline (issue 12's target).

64 requests of 256 prompt tokens -> 128 output tokens (EOS ignored), all at once, in-process
(`LLM.generate`, model load excluded), bf16 and int8 weights alternating for 3 rounds, each
run in a fresh process. The roofline of a run is the FLOPs the workload must do
(`fulcrum.bench.latency.workload_flops`: every computed token through the stack, one LM-head
row per output token, causal attention) at the matrix peak of the engine's own kernel,
measured before and after that run (the better kept). Medians over rounds: a run's share
moves by up to 20 points with the matrix peak measured around it.

    python benchmarks/throughput_roofline.py        # results/throughput_roofline.{json,md}
    python benchmarks/throughput_roofline.py --name throughput_roofline-avx2   # another machine
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np

from fulcrum.bench.datasets import random_requests
from fulcrum.bench.report import machine_facts, results_name
from fulcrum.bench.shapes import shape_dir
from fulcrum.bench.throughput import measure_fulcrum, run_isolated

RESULTS = Path(__file__).resolve().parent / "results"
NUM_PROMPTS, PROMPT, OUTPUT, ROUNDS = 64, 256, 128, 3
WEIGHTS = {"bfloat16": {}, "int8": {"quantization": "int8"}}


def main() -> None:
    stem, command, _ = results_name("throughput_roofline.py", __doc__,
                                    "throughput_roofline")
    model = shape_dir("smollm2-135m")
    requests = random_requests(NUM_PROMPTS, PROMPT, OUTPUT, 0.0, np.random.default_rng(0))
    runs = {name: [] for name in WEIGHTS}
    for number in range(1, ROUNDS + 1):
        for name, extra in WEIGHTS.items():
            result = run_isolated(measure_fulcrum, model, {"load_format": "dummy", **extra},
                                  requests)
            runs[name].append(result.as_dict())
            print(f"round {number}, {name}: {result.total_tokens_per_s:.1f} total tokens/s, "
                  f"{100 * result.share_of_roofline:.0f}% of the roofline", flush=True)
    summary = {name: {key: statistics.median(r[key] for r in values)
                      for key in ("total_tokens_per_s", "matrix_peak_flops", "roofline_s",
                                  "elapsed_s", "share_of_roofline")}
               for name, values in runs.items()}
    data = {"num_prompts": NUM_PROMPTS, "prompt_tokens": PROMPT, "output_tokens": OUTPUT,
            "rounds": ROUNDS, "runs": runs, "medians": summary, "machine": machine_facts()}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(data, indent=2) + "\n")
    machine = data["machine"]
    flops = runs["bfloat16"][0]["flops"]
    lines = ["# The throughput workload against the compute roofline", "",
             f"smollm2-135m shape, random weights, {NUM_PROMPTS} requests of {PROMPT} prompt "
             f"tokens -> {OUTPUT} output tokens at once, in-process; {flops / 1e12:.2f} TFLOP "
             f"of work; the roofline is that work at the matrix peak of the engine's own kernel "
             f"(its MLP projection on 512 rows), measured around each run; weights alternating "
             f"for {ROUNDS} rounds, medians over rounds; {machine['cpu']}, {machine['cores']} "
             f"cores, fulcrum's kernels: {machine['kernels']}; {machine['date']}. "
             f"Regenerate: `{command}`.", "",
             "| weights | total tokens/s | time (s) | matrix peak (GFLOP/s) | roofline (s) "
             "| share of roofline | rounds (share) |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for name, m in summary.items():
        each = ", ".join(f"{100 * r['share_of_roofline']:.0f}%" for r in runs[name])
        lines.append(f"| {name} | {m['total_tokens_per_s']:.1f} | {m['elapsed_s']:.1f} | "
                     f"{m['matrix_peak_flops'] / 1e9:.0f} | {m['roofline_s']:.1f} | "
                     f"{100 * m['share_of_roofline']:.0f}% | {each} |")
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""The throughput workload against this machine's compute roofline (issue 12's target).

64 requests of 256 prompt tokens -> 128 output tokens (EOS ignored), all at once, in-process
(`LLM.generate`, model load excluded), bf16 and int8 weights alternating for 3 rounds, each
run in a fresh process. The roofline of a run is the FLOPs the workload must do
(`fulcrum.bench.latency.workload_flops`: every computed token through the stack, one LM-head
row per output token, causal attention) at the matrix peak of the engine's own kernel,
measured before and after that run (the better kept). Medians over rounds: a run's share
moves by up to 20 points with the matrix peak measured around it.

The compute roofline treats every part of the work as bound by arithmetic. Some is not: the
decodes' attention reads the KV cache at 3 FLOPs a byte, and the last steps, when few
requests are left, read every weight for a few rows. So each run is also judged against the
roofline kernel by kernel (`fulcrum.bench.latency.kernel_roofline_s`: each step's linear
layers at max(FLOPs / peak, weights / bandwidth), prompt attention at the peak, decode
attention at max(FLOPs / peak, KV bytes / bandwidth)), at the best bandwidth probed after the
run: the least time this machine allows, memory included.

    python benchmarks/throughput_roofline.py        # results/throughput_roofline.{json,md}
    python benchmarks/throughput_roofline.py --name throughput_roofline-avx2   # another machine
"""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np

from fulcrum.bench.datasets import random_requests
from fulcrum.bench.report import machine_facts, results_name, write_results
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
                  f"{100 * result.share_of_roofline:.0f}% of the roofline, "
                  f"{100 * result.share_of_kernel_roofline:.0f}% kernel by kernel", flush=True)
    summary = {name: {key: statistics.median(r[key] for r in values)
                      for key in ("total_tokens_per_s", "matrix_peak_flops", "roofline_s",
                                  "elapsed_s", "share_of_roofline", "bandwidth",
                                  "kernel_roofline_s", "share_of_kernel_roofline")}
               for name, values in runs.items()}
    data = {"num_prompts": NUM_PROMPTS, "prompt_tokens": PROMPT, "output_tokens": OUTPUT,
            "rounds": ROUNDS, "runs": runs, "medians": summary, "machine": machine_facts()}
    machine = data["machine"]
    flops = runs["bfloat16"][0]["flops"]
    lines = ["# The throughput workload against the compute roofline", "",
             f"smollm2-135m shape, random weights, {NUM_PROMPTS} requests of {PROMPT} prompt "
             f"tokens -> {OUTPUT} output tokens at once, in-process; {flops / 1e12:.2f} TFLOP "
             f"of work; the roofline is that work at the matrix peak of the engine's own kernel "
             f"(its MLP projection on 512 rows), measured around each run; the roofline kernel "
             f"by kernel also counts the work bound by memory (decode attention reading the KV "
             f"cache, steps of few rows reading the weights) at the best bandwidth probed after "
             f"each run; weights alternating for {ROUNDS} rounds, medians over rounds; "
             f"{machine['cpu']}, {machine['cores']} cores, fulcrum's kernels: "
             f"{machine['kernels']}; {machine['date']}. Regenerate: `{command}`.", "",
             "| weights | total tokens/s | time (s) | matrix peak (GFLOP/s) | roofline (s) "
             "| share of roofline | rounds (share) | bandwidth (GB/s) | kernel by kernel (s) "
             "| its share | rounds (its share) |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|"]
    for name, m in summary.items():
        each = ", ".join(f"{100 * r['share_of_roofline']:.0f}%" for r in runs[name])
        each_kernel = ", ".join(f"{100 * r['share_of_kernel_roofline']:.0f}%" for r in runs[name])
        lines.append(f"| {name} | {m['total_tokens_per_s']:.1f} | {m['elapsed_s']:.1f} | "
                     f"{m['matrix_peak_flops'] / 1e9:.0f} | {m['roofline_s']:.1f} | "
                     f"{100 * m['share_of_roofline']:.0f}% | {each} | "
                     f"{m['bandwidth'] / 1e9:.1f} | {m['kernel_roofline_s']:.1f} | "
                     f"{100 * m['share_of_kernel_roofline']:.0f}% | {each_kernel} |")
    write_results(RESULTS, stem, data, lines)


if __name__ == "__main__":
    main()

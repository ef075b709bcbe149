"""Where the throughput workload's time goes, kernel by kernel (issue 12's profile).

The workload of benchmarks/throughput_roofline.py (64 requests of 256 prompt tokens -> 128
output tokens, EOS ignored, all at once, in-process), bf16 and int8 weights alternating for 3
rounds, each run in a fresh process, with the native decoder stack timing each kind of kernel
it calls (`NativeStack.time_kernels`: two clock reads a call, ~330 calls a step). For each
kind: its seconds, its share of the run, and for the matrix work (the projections, the LM
head, attention) its rate against the matrix peak of the engine's own kernel, measured
before the run. Attention is also judged against its own bound
(`fulcrum.bench.latency.attention_bound_s`: the prompt tokens' FLOPs at the matrix peak, the
decodes' reads of the KV cache at the best of 10 bandwidth probes after the run), since the
decodes' part is bound by memory, not by the matrix rate. "outside the kernels" is the rest
of the run: the Python of each step (scheduling, inputs, sampling, detokenisation) and the
embedding lookup. Medians over rounds.

    python benchmarks/stack_profile.py        # results/stack_profile.{json,md}
    python benchmarks/stack_profile.py --name stack_profile-avx2   # another machine
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Dict, List

import numpy as np

from fulcrum.bench.datasets import SampleRequest, random_requests
from fulcrum.bench.report import machine_facts, results_name, write_results
from fulcrum.bench.shapes import shape_dir
from fulcrum.bench.throughput import run_isolated

RESULTS = Path(__file__).resolve().parent / "results"
NUM_PROMPTS, PROMPT, OUTPUT, ROUNDS = 64, 256, 128, 3
WEIGHTS = {"bfloat16": {}, "int8": {"quantization": "int8"}}


def profile_run(model_dir: str, engine_kwargs: Dict[str, Any],
                requests: List[SampleRequest]) -> Dict[str, Any]:
    from fulcrum import SamplingParams
    from fulcrum.bench.latency import (BandwidthProbe, attention_bound_s, measure_peak_flops,
                                       workload_flops_by_kind)
    from fulcrum.bench.throughput import PROBES
    from fulcrum.llm import LLM
    from fulcrum.models.native_stack import KERNEL_KINDS

    llm = LLM(model_dir, **engine_kwargs)
    engine = llm.llm_engine
    model = engine.runner.model
    native = model.model.native
    if native is None:
        raise SystemExit("this machine runs the Python layers: there is no native stack to time")
    peak = measure_peak_flops(model, engine.dtype)
    params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
              for r in requests]
    seconds = native.time_kernels()
    start = time.perf_counter()
    llm.generate([r.engine_prompt() for r in requests], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    spent = dict(zip(KERNEL_KINDS, seconds.tolist()))
    probe = BandwidthProbe()
    for _ in range(2 * PROBES):
        probe()
    bandwidth = max(probe.readings)
    prompt_lens, output_lens = [r.prompt_len for r in requests], [r.output_len for r in requests]
    return {"elapsed_s": elapsed, "matrix_peak_flops": peak, "bandwidth": bandwidth,
            "attention_bound_s": attention_bound_s(engine, prompt_lens, output_lens, peak,
                                                   bandwidth),
            "seconds": spent, "flops": workload_flops_by_kind(model, prompt_lens, output_lens)}


def main() -> None:
    stem, command, _ = results_name("stack_profile.py", __doc__, "stack_profile")
    model = shape_dir("smollm2-135m")
    requests = random_requests(NUM_PROMPTS, PROMPT, OUTPUT, 0.0, np.random.default_rng(0))
    runs: Dict[str, List[Dict[str, Any]]] = {name: [] for name in WEIGHTS}
    for number in range(1, ROUNDS + 1):
        for name, extra in WEIGHTS.items():
            run = run_isolated(profile_run, model, {"load_format": "dummy", **extra}, requests)
            runs[name].append(run)
            print(f"round {number}, {name}: {run['elapsed_s']:.1f} s, attention "
                  f"{run['seconds']['attention']:.2f} s", flush=True)
    machine = machine_facts()
    write_results(RESULTS, stem, {"num_prompts": NUM_PROMPTS, "prompt_tokens": PROMPT,
                                  "output_tokens": OUTPUT, "rounds": ROUNDS, "runs": runs,
                                  "machine": machine}, _page(runs, machine, command))


def _page(runs: Dict[str, List[Dict[str, Any]]], machine: Dict[str, Any],
          command: str) -> List[str]:
    lines = ["# Where the throughput workload's time goes", "",
             f"smollm2-135m shape, random weights, {NUM_PROMPTS} requests of {PROMPT} prompt "
             f"tokens -> {OUTPUT} output tokens at once, in-process, each kind of kernel of the "
             f"native decoder stack timed (two clock reads a call); the rate of the matrix work "
             f"is judged against the matrix peak of the engine's own kernel (its MLP projection "
             f"on 512 rows) measured before each run; weights alternating for {ROUNDS} rounds, "
             f"medians over rounds; {machine['cpu']}, {machine['cores']} cores, fulcrum's "
             f"kernels: {machine['kernels']}; {machine['date']}. Regenerate: `{command}`."]
    for name, values in runs.items():
        lines += _table(name, values)
    return lines


def _table(name: str, runs: List[Dict[str, Any]]) -> List[str]:
    median = lambda pick: statistics.median(pick(r) for r in runs)  # noqa: E731
    elapsed = median(lambda r: r["elapsed_s"])
    peak = median(lambda r: r["matrix_peak_flops"])
    lines = ["", f"## {name}", "",
             f"Run: {elapsed:.1f} s; matrix peak {peak / 1e9:.0f} GFLOP/s.", "",
             "| kernel | seconds | share of the run | GFLOP/s | share of the matrix peak |",
             "|---|---:|---:|---:|---:|"]
    kinds = sorted(runs[0]["seconds"], key=lambda k: -median(lambda r: r["seconds"][k]))
    for kind in kinds:
        seconds = median(lambda r: r["seconds"][kind])
        if kind == "all_reduce" and seconds == 0.0:
            continue  # one rank
        rate = "- | -"
        if kind in runs[0]["flops"]:
            speed = lambda r: r["flops"][kind] / r["seconds"][kind]  # noqa: E731
            share = median(lambda r: speed(r) / r["matrix_peak_flops"])
            rate = f"{median(speed) / 1e9:.0f} | {100 * share:.0f}%"
        lines.append(f"| {kind} | {seconds:.2f} | {100 * seconds / elapsed:.1f}% | {rate} |")
    outside = median(lambda r: r["elapsed_s"] - sum(r["seconds"].values()))
    lines.append(f"| outside the kernels | {outside:.2f} | {100 * outside / elapsed:.1f}% | - "
                 f"| - |")
    bound = median(lambda r: r["attention_bound_s"])
    share = median(lambda r: r["attention_bound_s"] / r["seconds"]["attention"])
    lines += ["", f"Attention's bound: {bound:.2f} s (bandwidth "
              f"{median(lambda r: r['bandwidth']) / 1e9:.1f} GB/s); attention runs at "
              f"{100 * share:.0f}% of it."]
    return lines


if __name__ == "__main__":
    main()

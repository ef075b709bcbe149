"""Random sampling's cost: the native kernel (kernels.sample) against the torch path.

Users sample: temperature, top_p, top_k and min_p are in most requests a server gets, and
the torch path sorts every row's whole vocabulary for top_p or top_k. Two parts, each
alternating the two paths in one process (each first in half the turns), medians:
- the sampling call alone, [batch, vocab] fp32 logits of a trained-looking spread (a few
  likely tokens, a long tail), one uniform a row, at decode batch sizes 1, 16, 64 and 256 over
  the vocabularies of smollm2-135m (49,152) and qwen2.5-0.5b (151,936);
- whole decode steps of the engine: 64 requests decoding together with temperature 0.8 and
  top_p 0.95 (smollm2-135m shape, bfloat16, dummy weights, in-process), the sampler on the
  kernel or on the torch path (the forward pass is the same); the median step and the
  median time outside the forward pass.

    python benchmarks/sampler_ab.py                       # results/sampler_ab.{json,md}
    python benchmarks/sampler_ab.py --name sampler_ab-avx2   # another kind of machine
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Dict, List
from unittest import mock

import numpy as np
import torch

from fulcrum import kernels
from fulcrum.bench.kernel_ab import alternate
from fulcrum.bench.report import machine_facts, results_name, write_results
from fulcrum.bench.shapes import shape_dir
from fulcrum.config import EngineConfig
from fulcrum.engine import LLMEngine
from fulcrum.sampling_params import SamplingParams
from fulcrum.worker.sampler import _sample_with_torch

RESULTS = Path(__file__).resolve().parent / "results"
TURNS = 9
VOCABS = {"smollm2-135m": 49152, "qwen2.5-0.5b": 151936}
BATCHES = (1, 16, 64, 256)
SETTINGS = {"temperature 0.8": dict(temperature=0.8),
            "top_p 0.95": dict(temperature=0.8, top_p=0.95),
            "top_k 50": dict(temperature=0.8, top_k=50),
            "min_p 0.05": dict(temperature=0.8, min_p=0.05),
            "top_k 50, top_p 0.9, min_p 0.02": dict(temperature=0.7, top_k=50, top_p=0.9,
                                                    min_p=0.02)}
STEP_PARAMS = dict(temperature=0.8, top_p=0.95)
STEP_REQUESTS, STEP_PROMPT, STEP_OUTPUT, STEP_ROUNDS = 64, 64, 48, 3


def logits_like_a_model(batch: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """A trained model's spread: Gaussian logits (sd 2) plus a few hundred lifted tokens."""
    logits = torch.randn(batch, vocab, generator=generator) * 2.0
    lifted = torch.randint(0, vocab, (batch, 200), generator=generator)
    logits.scatter_add_(1, lifted, torch.rand(batch, 200, generator=generator) * 8.0)
    return logits


def time_call(vocab: int, batch: int, settings: Dict[str, Any]) -> Dict[str, Any]:
    generator = torch.Generator().manual_seed(batch)
    logits = logits_like_a_model(batch, vocab, generator)
    u = torch.rand(batch, 1, generator=generator, dtype=torch.float64)
    params = [SamplingParams(max_tokens=1, **settings)] * batch
    columns = [[p.temperature for p in params], [p.min_p for p in params],
               [p.top_k for p in params], [p.top_p for p in params]]
    tokens: Dict[str, torch.Tensor] = {}
    calls = {"kernel": lambda: tokens.__setitem__("kernel", kernels.sample(logits, *columns, u)),
             "torch": lambda: tokens.__setitem__("torch", _sample_with_torch(logits, params, u))}
    times = alternate(calls, TURNS)
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    return {"ms": ms, "speedup": statistics.median(t / k for t, k in zip(times["torch"],
                                                                            times["kernel"])),
            "same_tokens": int((tokens["kernel"] == tokens["torch"]).sum()), "rows": batch}


def decode_steps(engine: LLMEngine, prompts: List[List[int]], on_kernel: bool) -> List[Any]:
    """The full-batch decode steps of one run of the batch."""
    first = len(engine.stats)
    # the sampler asks kernels.can_sample for every batch: the torch path where it says no
    with mock.patch.object(kernels, "can_sample", lambda logits, real=kernels.can_sample:
                           on_kernel and real(logits)):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{on_kernel}-{time.monotonic_ns()}-{i}",
                               {"prompt_token_ids": prompt},
                               SamplingParams(max_tokens=STEP_OUTPUT, ignore_eos=True, seed=i,
                                              **STEP_PARAMS))
        while engine.has_unfinished_requests():
            engine.step()
    return [s for s in list(engine.stats)[first:]
            if s.num_decode_tokens == len(prompts) and s.num_prefill_tokens == 0]


def time_steps() -> Dict[str, Any]:
    engine = LLMEngine(EngineConfig(model=shape_dir("smollm2-135m"), load_format="dummy",
                                    dtype="bfloat16", max_num_seqs=STEP_REQUESTS,
                                    max_model_len=STEP_PROMPT + STEP_OUTPUT + 8,
                                    scheduling_policy="fcfs"))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, engine.vocab_size, STEP_PROMPT).tolist()
               for _ in range(STEP_REQUESTS)]
    decode_steps(engine, prompts[:4], True)  # warm up both paths
    decode_steps(engine, prompts[:4], False)
    steps: Dict[str, List[Any]] = {"kernel": [], "torch": []}
    for round_ in range(STEP_ROUNDS):
        for name in (("kernel", "torch") if round_ % 2 == 0 else ("torch", "kernel")):
            steps[name] += decode_steps(engine, prompts, name == "kernel")
    return {name: {"steps": len(s), "step_ms": 1e3 * statistics.median(x.wall_seconds for x in s),
                   "outside_forward_ms": 1e3 * statistics.median(
                       x.wall_seconds - x.forward_seconds for x in s)}
            for name, s in steps.items()}


def main() -> None:
    stem, command, _ = results_name("sampler_ab.py", __doc__, "sampler_ab")
    calls = {shape: {setting: {batch: time_call(vocab, batch, params) for batch in BATCHES}
                     for setting, params in SETTINGS.items()}
             for shape, vocab in VOCABS.items()}
    steps = time_steps()
    machine = machine_facts()
    data = {"turns": TURNS, "calls": calls, "steps": steps, "step_params": STEP_PARAMS,
            "machine": machine}
    lines = ["# Random sampling: the native kernel against the torch path", "",
             f"{machine['cpu']}, {machine['cores']} cores, fulcrum's kernels: "
             f"{machine['kernels']}; {machine['date']}. Regenerate: `{command}`.", "",
             "## The sampling call", "",
             f"fp32 logits of a trained model's spread, one uniform a row; the two paths in "
             f"turns ({TURNS} after a warm-up, each first in half), medians; `same` counts the "
             "rows where both drew the same token at the same uniform.", "",
             "| vocabulary | setting | batch | torch (ms) | kernel (ms) | torch / kernel | same |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for shape, by_setting in calls.items():
        for setting, by_batch in by_setting.items():
            for batch, r in by_batch.items():
                lines.append(f"| {VOCABS[shape]:,} ({shape}) | {setting} | {batch} | "
                             f"{r['ms']['torch']:.2f} | {r['ms']['kernel']:.3f} | "
                             f"{r['speedup']:.1f}x | {r['same_tokens']}/{r['rows']} |")
    lines += ["", "## Decode steps", "",
              f"{STEP_REQUESTS} requests decoding together (smollm2-135m shape, bfloat16, "
              f"{STEP_PROMPT}-token prompts, {STEP_OUTPUT} tokens each, temperature 0.8, top_p "
              f"0.95), runs alternating between the paths, {STEP_ROUNDS} rounds; medians over "
              "the steps where the whole batch decodes.", "",
              "| sampler | steps | decode step (ms) | outside the forward pass (ms) |",
              "|---|---:|---:|---:|"]
    for name, r in steps.items():
        lines.append(f"| {name} | {r['steps']} | {r['step_ms']:.1f} | "
                     f"{r['outside_forward_ms']:.1f} |")
    write_results(RESULTS, stem, data, lines)


if __name__ == "__main__":
    main()

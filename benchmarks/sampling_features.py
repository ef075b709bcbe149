"""What each per-request sampling feature costs a decode step, on this tree and another revision.

Benchmarks decode greedily; users ask for logprobs, penalties, logit_bias, allowed_token_ids,
stop strings, seeds and nucleus sampling. Each feature's cost is what a full-batch decode step
spends outside the forward pass (the forward is the same for all): 64 requests decoding
together (smollm2-135m shape, bfloat16, dummy weights, in-process, 64-token prompts, 32
tokens each, EOS ignored), every request asking for the feature; medians over the steps where
the whole batch decodes. Prompt logprobs are timed whole: 8 prompts of 512 tokens, one output
token each, with and without `prompt_logprobs=5`. The revision given by `--base` runs from a
temporary git worktree; the two trees alternate, each run in a fresh process.

    python benchmarks/sampling_features.py [--base 753527d] [--repeats 2]
    python benchmarks/sampling_features.py --name sampling_features-avx2   # another machine
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
BASE = "753527d"  # before the batched token controls, penalties and logprobs
REQUESTS, PROMPT, OUTPUT = 64, 64, 32
PROMPT_LOGPROB_REQUESTS, PROMPT_LOGPROB_LEN = 8, 512
FEATURES: Dict[str, Dict[str, Any]] = {
    "greedy": {},
    "logprobs 5": dict(logprobs=5),
    "logprobs 20": dict(logprobs=20),
    "repetition_penalty 1.1": dict(repetition_penalty=1.1),
    "frequency + presence 0.5": dict(frequency_penalty=0.5, presence_penalty=0.5),
    "logit_bias (10 ids)": dict(logit_bias={i: 1.0 for i in range(100, 110)}),
    "allowed_token_ids (1,000)": dict(allowed_token_ids=list(range(1000, 2000))),
    "3 stop strings": dict(stop=["hello world", "\n\n", "The end"]),
    "temperature 0.8, top_p 0.95, seed": dict(temperature=0.8, top_p=0.95, seed=1),
}


def measure() -> Dict[str, Any]:
    """One run of every feature on the fulcrum this process imports (its tree's)."""
    import numpy as np

    import fulcrum
    from fulcrum.bench.shapes import shape_dir
    from fulcrum.config import EngineConfig
    from fulcrum.engine import LLMEngine
    from fulcrum.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(
        model=shape_dir("smollm2-135m"), load_format="dummy", dtype="bfloat16",
        max_num_seqs=REQUESTS, max_model_len=PROMPT_LOGPROB_LEN + 8,
        scheduling_policy="fcfs", enable_prefix_caching=False))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, engine.vocab_size, PROMPT).tolist() for _ in range(REQUESTS)]
    long_prompts = [rng.integers(0, engine.vocab_size, PROMPT_LOGPROB_LEN).tolist()
                    for _ in range(PROMPT_LOGPROB_REQUESTS)]

    def run(prompts: List[List[int]], **params: Any) -> float:
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{time.monotonic_ns()}-{i}", {"prompt_token_ids": prompt},
                               SamplingParams(ignore_eos=True, **params))
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - start

    def decode_steps(params: Dict[str, Any]) -> Dict[str, float]:
        first = len(engine.stats)
        run(prompts, max_tokens=OUTPUT, **{"temperature": 0.0, **params})
        steps = [s for s in list(engine.stats)[first:]
                 if s.num_decode_tokens == REQUESTS and s.num_prefill_tokens == 0]
        return {"step_ms": 1e3 * statistics.median(s.wall_seconds for s in steps),
                "outside_forward_ms": 1e3 * statistics.median(
                    s.wall_seconds - s.forward_seconds for s in steps)}

    decode_steps({})  # warm up
    result: Dict[str, Any] = {"module": fulcrum.__file__,
                              "decode": {name: decode_steps(p) for name, p in FEATURES.items()}}
    run(long_prompts[:1], max_tokens=1, prompt_logprobs=5)  # warm up
    result["prompt_logprobs_s"] = {
        "none": run(long_prompts, max_tokens=1),
        "prompt_logprobs 5": run(long_prompts, max_tokens=1, prompt_logprobs=5)}
    return result


def measure_in(tree: Path) -> Dict[str, Any]:
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--measure"],
                          cwd=tree, capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(tree)})
    result = json.loads(done.stdout.splitlines()[-1])
    if not result.pop("module").startswith(str(tree)):
        raise RuntimeError(f"{tree} did not import its own fulcrum")
    return result


def summarise(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    return {"decode": {name: {key: statistics.median(r["decode"][name][key] for r in runs)
                              for key in ("step_ms", "outside_forward_ms")}
                       for name in FEATURES},
            "prompt_logprobs_s": {key: statistics.median(r["prompt_logprobs_s"][key]
                                                         for r in runs)
                                  for key in runs[0]["prompt_logprobs_s"]}}


def page(base: str, repeats: int, medians: Dict[str, Any], command: str,
         machine: Dict[str, Any]) -> List[str]:
    before, after = medians[base], medians["this tree"]
    lines = ["# What each sampling feature costs a decode step", "",
             f"{machine['cpu']}, {machine['cores']} cores, fulcrum's kernels: "
             f"{machine['kernels']}; {machine['date']}. Regenerate: `{command}`.", "",
             f"{REQUESTS} requests decoding together (smollm2-135m shape, bfloat16, dummy "
             f"weights, in-process, {PROMPT}-token prompts, {OUTPUT} tokens each), every "
             "request asking for the feature (greedy unless it says otherwise); medians over "
             f"the full-batch decode steps, then over {repeats} runs a tree, the two trees "
             "alternating in fresh processes.", "",
             f"| feature | outside the forward, {base} (ms) | this tree (ms) | "
             f"{base} / this tree | step, {base} (ms) | this tree (ms) |",
             "|---|---:|---:|---:|---:|---:|"]
    for name in FEATURES:
        b, a = before["decode"][name], after["decode"][name]
        lines.append(f"| {name} | {b['outside_forward_ms']:.1f} | "
                     f"{a['outside_forward_ms']:.1f} | "
                     f"{b['outside_forward_ms'] / a['outside_forward_ms']:.1f}x | "
                     f"{b['step_ms']:.1f} | {a['step_ms']:.1f} |")
    lines += ["", f"Prompt logprobs: {PROMPT_LOGPROB_REQUESTS} prompts of {PROMPT_LOGPROB_LEN} "
              "tokens, one output token each, the whole run (s):", "",
              f"| prompt_logprobs | {base} (s) | this tree (s) |", "|---|---:|---:|"]
    for key in after["prompt_logprobs_s"]:
        lines.append(f"| {key} | {before['prompt_logprobs_s'][key]:.2f} | "
                     f"{after['prompt_logprobs_s'][key]:.2f} |")
    return lines


def main() -> None:
    if sys.argv[1:] == ["--measure"]:
        print(json.dumps(measure()))
        return
    sys.path.insert(0, str(REPO))
    from fulcrum.bench.report import machine_facts, results_name, write_results

    def options(parser):
        parser.add_argument("--base", default=BASE, help="the revision to compare with")
        parser.add_argument("--repeats", type=int, default=2)

    stem, command, args = results_name("sampling_features.py", __doc__, "sampling_features",
                                       options)
    runs: Dict[str, List[Dict[str, Any]]] = {args.base: [], "this tree": []}
    with tempfile.TemporaryDirectory() as scratch:
        base_tree = Path(scratch) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base_tree), args.base],
                       cwd=REPO, check=True, capture_output=True)
        try:
            for repeat in range(args.repeats):
                order = [args.base, "this tree"][::1 if repeat % 2 == 0 else -1]
                for name in order:
                    runs[name].append(measure_in(base_tree if name == args.base else REPO))
                    print(name, json.dumps(runs[name][-1]), flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=REPO,
                           check=True)
    medians = {name: summarise(r) for name, r in runs.items()}
    machine = machine_facts()
    write_results(RESULTS, stem, {"base": args.base, "repeats": args.repeats, "runs": runs,
                                  "median": medians, "machine": machine},
                  page(args.base, args.repeats, medians, command, machine))


if __name__ == "__main__":
    main()

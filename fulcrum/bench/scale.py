"""`fulcrum bench scale`: what tensor parallelism, data-parallel replicas and cache-aware
routing buy on this machine, each against its baseline, servers alternating in one run.

- tp: `fulcrum serve -tp 2` vs one rank, on a model whose heads split in two (qwen2.5-0.5b
  shape): time per output token at batch 1 and 8, and the first token of a 1,024-token prompt.
- dp: `fulcrum serve -dp 2` vs one engine on docs/performance.md's throughput workload
  (64 requests, 256 prompt tokens, 128 output tokens, smollm2-135m shape).
- routing: -dp 2 with the cache-aware router vs round robin, on prompts that share long
  prefixes (8 prefixes of 768 tokens, 8 requests each with its own 32-token ending, 8 at a
  time): the replicas' prefix-cache hit rate (from the merged /metrics), TTFT, makespan.
Each server is fresh (an empty prefix cache) and runs alone on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from fulcrum.arg_types import positive_int
from fulcrum.bench.arrivals import Schedule, schedule
from fulcrum.bench.datasets import SampleRequest, random_requests
from fulcrum.bench.metrics import ALL, report_by_group
from fulcrum.bench.report import (_fmt, free_port, fulcrum_command, machine_facts,
                                  running_server)
from fulcrum.bench.shapes import shape_dir
from fulcrum.distributed.launch import DriverPin

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "scale"
PARTS = ("tp", "dp", "routing")
TP_SHAPE, DP_SHAPE = "qwen2.5-0.5b", "smollm2-135m"
MAX_MODEL_LEN = 2048
PREFIXES, PER_PREFIX, PREFIX_LEN, ENDING_LEN, CONCURRENCY = 8, 8, 768, 32, 8


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--repeats", type=positive_int, default=2,
                        help="runs of each server, alternating (default 2)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny workloads (for tests: checks the plumbing, not the machine)")
    parser.add_argument("--out-dir", default=str(RESULTS))


def _everything_now(requests: List[SampleRequest]) -> Schedule:
    return schedule(requests, {ALL: float("inf")}, 1.0, 0)


def tp_workloads(quick: bool, rng: np.random.Generator) -> Dict[str, Schedule]:
    out = 16 if quick else 128
    return {"batch 1": _everything_now(random_requests(1, 64, out, 0.0, rng)),
            "batch 8": _everything_now(random_requests(8, 64, out, 0.0, rng)),
            "prefill 1024": _everything_now(random_requests(1, 128 if quick else 1024, 1,
                                                            0.0, rng))}


def dp_workloads(quick: bool, rng: np.random.Generator) -> Dict[str, Schedule]:
    count, prompt, out = (8, 32, 16) if quick else (64, 256, 128)
    return {"throughput": _everything_now(random_requests(count, prompt, out, 0.0, rng))}


def routing_shape(quick: bool) -> Tuple[int, int, int]:
    """(prefixes, requests per prefix, prefix tokens)."""
    return (2, 4, 64) if quick else (PREFIXES, PER_PREFIX, PREFIX_LEN)


def routing_workloads(quick: bool, rng: np.random.Generator) -> Dict[str, Schedule]:
    prefixes, per, length = routing_shape(quick)
    heads = [rng.integers(0, 49152, length).tolist() for _ in range(prefixes)]
    requests = [SampleRequest(head + rng.integers(0, 49152, ENDING_LEN).tolist(),
                              length + ENDING_LEN, 16)
                for head in heads for _ in range(per)]
    order = rng.permutation(len(requests))
    return {"shared prefixes": _everything_now([requests[i] for i in order])}


def prefix_hits(metrics_text: str) -> Tuple[float, float]:
    """(hits, queries) of the prefix cache, summed over every replica's series."""
    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", metrics_text,
                                                re.M))
    return total("fulcrum:prefix_cache_hits_total"), total("fulcrum:prefix_cache_queries_total")


def measure(base_url: str, loads: Dict[str, Schedule], concurrency: int | None,
            hit_rate: bool) -> Dict[str, Any]:
    """Warm up, run each load once: per load the whole report (+ prefix hits)."""
    from fulcrum.bench.serve import make_client, run_load, served_model, warm_up

    async def main() -> Dict[str, Any]:
        url = base_url + "/v1/completions"
        found: Dict[str, Any] = {}
        async with make_client() as client:
            model = await served_model(client, base_url)
            await warm_up(client, url, model)
            for name, load in loads.items():
                before = prefix_hits((await client.get(base_url + "/metrics")).text)
                timelines, duration = await run_load(client, url, model, load, concurrency,
                                                     show_progress=False)
                after = prefix_hits((await client.get(base_url + "/metrics")).text)
                report = report_by_group(timelines, duration)[ALL]
                if hit_rate:
                    queries = after[1] - before[1]
                    report["prefix_hit_rate"] = (after[0] - before[0]) / queries if queries else 0
                found[name] = report
                print(f"  {name}: tpot {_fmt(report['tpot_ms']['median'])} ms, ttft "
                      f"{_fmt(report['ttft_ms']['median'])} ms, "
                      f"{_fmt(report['total_token_throughput'])} tok/s"
                      + (f", hit rate {report['prefix_hit_rate']:.2f}" if hit_rate else ""),
                      flush=True)
        return found

    return asyncio.run(main())


PART_SETUP = {  # part -> (shape, {variant: serve flags}, workloads, concurrency, hit rate)
    "tp": (TP_SHAPE, {"tp=1": (), "tp=2": ("--tensor-parallel-size", "2")}, tp_workloads,
           None, False),
    "dp": (DP_SHAPE, {"one engine": (), "dp=2": ("--data-parallel-size", "2")}, dp_workloads,
           None, False),
    "routing": (DP_SHAPE, {"round_robin": ("-dp", "2", "--router-policy", "round_robin"),
                           "cache_aware": ("-dp", "2", "--router-policy", "cache_aware")},
                routing_workloads, CONCURRENCY, True),
}


def run_part(part: str, repeats: int, quick: bool) -> Dict[str, Any]:
    shape, variants, workloads, concurrency, hit_rate = PART_SETUP[part]
    model_dir = shape_dir(shape)
    runs: Dict[str, List[Dict[str, Any]]] = {v: [] for v in variants}
    for repeat in range(repeats):
        loads = workloads(quick, np.random.default_rng(repeat))
        for variant, flags in variants.items():
            print(f"{part}: {variant}, run {repeat + 1}/{repeats}", flush=True)
            port = free_port()
            command = fulcrum_command(flags, model_dir, True, port, MAX_MODEL_LEN)
            with running_server(command, port) as base_url:
                runs[variant].append(measure(base_url, loads, concurrency, hit_rate))
    return {"shape": shape, "flags": {v: list(f) for v, f in variants.items()},
            "runs": runs, "median": {v: _medians(r) for v, r in runs.items()}}


def _medians(runs: List[Dict[str, Any]]) -> Dict[str, Dict[str, float]]:
    picks = {"tpot_ms": lambda r: r["tpot_ms"]["median"],
             "ttft_ms": lambda r: r["ttft_ms"]["median"],
             "total_tokens_per_s": lambda r: r["total_token_throughput"],
             "makespan_s": lambda r: r["duration_s"],
             "prefix_hit_rate": lambda r: r.get("prefix_hit_rate")}
    out: Dict[str, Dict[str, float]] = {}
    for load in runs[0]:
        values = {k: [pick(run[load]) for run in runs] for k, pick in picks.items()}
        out[load] = {k: statistics.median(v) for k, v in values.items()
                     if all(x is not None for x in v)}
    return out


def run_scale(args: argparse.Namespace) -> int:
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # The cores this run may use, which each server's ranks or replicas split (a machine's
    # count says nothing of a taskset or a container's cpuset).
    data = {"setup": {"machine": machine_facts(), "cores": len(DriverPin.process_cores()),
                      "repeats": args.repeats, "quick": args.quick,
                      "routing": dict(zip(("prefixes", "per_prefix", "prefix_len"),
                                          routing_shape(args.quick)),
                                      ending_len=ENDING_LEN, concurrency=CONCURRENCY),
                      "command": "fulcrum bench scale" + (" --quick" if args.quick else "")
                      + f" --repeats {args.repeats} --parts {' '.join(args.parts)}"},
            "parts": {part: run_part(part, args.repeats, args.quick) for part in args.parts}}
    data = _merged(out_dir / "scale.json", data)
    (out_dir / "scale.json").write_text(json.dumps(data, indent=1) + "\n")
    md = "\n".join(summary(data, out_dir / "scale.json", out_dir)) + "\n"
    (out_dir / "scale.md").write_text(md)
    print(md)
    return 0


def _merged(path: Path, data: Dict[str, Any]) -> Dict[str, Any]:
    """`data` over the parts an earlier run left in `path` (a run of some parts keeps the
    others' results, each part with its own date)."""
    for part in data["parts"].values():
        part["date"] = data["setup"]["machine"]["date"]
    if not path.exists():
        return data
    earlier = json.loads(path.read_text())
    if earlier["setup"].get("quick") != data["setup"]["quick"]:
        return data
    for name, part in earlier["parts"].items():
        part.setdefault("date", earlier["setup"]["machine"]["date"])
        data["parts"].setdefault(name, part)
    data["parts"] = {name: data["parts"][name] for name in PARTS if name in data["parts"]}
    return data


def _table(part: Dict[str, Any], columns: Sequence[Tuple[str, str, str]]) -> List[str]:
    head = "| | " + " | ".join(h for h, _, _ in columns) + " |"
    lines = [head, "|" + "---|" * (len(columns) + 1)]
    for variant, loads in part["median"].items():
        cells = [loads[load].get(key) for _, load, key in columns]
        lines.append(f"| {variant} | " + " | ".join(
            "-" if v is None else (f"{v:.2f}" if key == "prefix_hit_rate" else f"{v:.1f}")
            for v, (_, _, key) in zip(cells, columns)) + " |")
    return lines


def _date(part: Dict[str, Any], setup: Dict[str, Any]) -> str:
    return part.get("date", setup["machine"]["date"])


def _ratio(part: Dict[str, Any], load: str, key: str) -> float:
    first, second = list(part["median"].values())
    return second[load][key] / first[load][key]


def _split(two: str, one: str, cores: int) -> str:
    """How the two ranks or replicas share the run's cores, against one process on all of
    them (launch.split_cores gives each a contiguous half; an odd core goes to the first)."""
    half = cores // 2 if cores % 2 == 0 else f"{cores // 2} or {cores // 2 + 1}"
    return (f"two {two}, {half} core{'s' if cores > 2 else ''} each, against one {one} on "
            f"all {cores} cores")


def summary(data: Dict[str, Any], json_path: Path, page_dir: Path) -> List[str]:
    """The "Scale" section of docs/performance.md (links relative to page_dir)."""
    setup, parts = data["setup"], data["parts"]
    lines = ["", "## Scale", "",
             f"Servers alternating, {setup['repeats']} runs each, medians; each server fresh "
             f"and alone on the machine; [raw]({os.path.relpath(json_path, page_dir)}); "
             "`fulcrum bench scale --repeats 2` regenerates it (`--parts tp` one part)."]
    cores = setup.get("cores", setup["machine"]["cores"])  # (older runs: the machine's)
    if "tp" in parts:
        tp = parts["tp"]
        slower = _ratio(tp, "batch 8", "tpot_ms") > 1
        lines += ["", f"**Tensor parallel** ({tp['shape']} shape, bfloat16; {_date(tp, setup)}): "
                  f"{_split('ranks', 'rank', cores)}. The split halves each rank's "
                  "weights and matrix work but adds two all-reduces a layer (through shared "
                  "memory) and a message from the driver to the other rank each step"
                  + (f", so on {cores} cores it is slower: " if slower else ": ") +
                  f"TPOT at batch 1 x{_ratio(tp, 'batch 1', 'tpot_ms'):.2f}, at batch 8 "
                  f"x{_ratio(tp, 'batch 8', 'tpot_ms'):.2f}, a 1,024-token prompt's TTFT "
                  f"x{_ratio(tp, 'prefill 1024', 'ttft_ms'):.2f}. Its point is models larger "
                  "than one device or machine.", ""]
        lines += _table(tp, [("TPOT batch 1 (ms)", "batch 1", "tpot_ms"),
                             ("TPOT batch 8 (ms)", "batch 8", "tpot_ms"),
                             ("TTFT 1,024-token prompt (ms)", "prefill 1024", "ttft_ms")])
    if "dp" in parts:
        dp = parts["dp"]
        lines += ["", f"**Data parallel** ({dp['shape']} shape; {_date(dp, setup)}): "
                  f"{_split('replicas behind the router', 'engine', cores)}, on the "
                  "throughput workload: total tokens/s "
                  f"x{_ratio(dp, 'throughput', 'total_tokens_per_s'):.2f}.", ""]
        lines += _table(dp, [("total tokens/s", "throughput", "total_tokens_per_s"),
                             ("TPOT (ms)", "throughput", "tpot_ms"),
                             ("makespan (s)", "throughput", "makespan_s")])
    if "routing" in parts:
        routing, shape = parts["routing"], setup["routing"]
        lines += ["", f"**Routing** (-dp 2; {_date(routing, setup)}): requests sharing long "
                  "prefixes "
                  f"({shape['prefixes']} prefixes of {shape['prefix_len']} tokens x "
                  f"{shape['per_prefix']} requests, each with its own {shape['ending_len']}-token "
                  f"ending, {shape['concurrency']} at a time), round robin against cache-aware: "
                  "prefix-cache hit rate "
                  f"{routing['median']['round_robin']['shared prefixes']['prefix_hit_rate']:.2f}"
                  " vs "
                  f"{routing['median']['cache_aware']['shared prefixes']['prefix_hit_rate']:.2f}"
                  ".", ""]
        lines += _table(routing, [("prefix hit rate", "shared prefixes", "prefix_hit_rate"),
                                  ("TTFT median (ms)", "shared prefixes", "ttft_ms"),
                                  ("total tokens/s", "shared prefixes", "total_tokens_per_s"),
                                  ("makespan (s)", "shared prefixes", "makespan_s")])
    return lines

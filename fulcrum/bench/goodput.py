"""`fulcrum bench goodput`: goodput against offered load, fulcrum's policies beside vLLM's.

Goodput (DistServe; vLLM's `--goodput`) counts the requests that meet both latency targets,
TTFT and TPOT: the number a service is judged by. Each engine serves the same chat-like
traffic (log-normal prompt and answer lengths, bursty gamma arrivals) at a rising request
rate; the curve shows how much load each keeps within its targets. fulcrum runs with the
`slo` policy given the same targets, and with fixed token budgets (fcfs) so that the best
hand-picked budget is in the comparison too; vLLM runs with its defaults and tuned.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from fulcrum.arg_types import output_dir, positive_int, rate_list
from fulcrum.bench.arrivals import schedule
from fulcrum.bench.datasets import RANDOM_ID_LIMIT, SampleRequest, chat_requests
from fulcrum.bench.metrics import ALL, report_by_group
from fulcrum.bench.report import (VLLM_VARIANTS, free_port, fulcrum_command, machine_facts,
                                  running_server, vllm_command, vllm_version)
from fulcrum.bench.shapes import DEFAULT_SHAPE, shape_dir

BUDGETS = (256, 512, 2048)  # the fixed token budgets swept (fcfs, default chunking rule)
PEERS = ("vllm", "vllm-tuned")


def engines(slo: Dict[str, float]) -> Dict[str, Tuple[str, Tuple[str, ...]]]:
    """name -> (kind, server flags)."""
    table = {"fulcrum-slo": ("fulcrum", ("--scheduling-policy", "slo", "--slo-ttft-ms",
                                         f"{slo['ttft']:g}", "--slo-tpot-ms",
                                         f"{slo['tpot']:g}"))}
    for budget in BUDGETS:
        table[f"fulcrum-fcfs-{budget}"] = ("fulcrum", ("--scheduling-policy", "fcfs",
                                                       "--max-num-batched-tokens", str(budget)))
    for peer in PEERS:
        table[peer] = ("vllm", VLLM_VARIANTS[peer])
    return table


def traffic(rate: float, count: int, input_len: int, output_len: int, burstiness: float,
            seed: int, max_model_len: int = 4096) -> List[Tuple[float, SampleRequest]]:
    """The load of one point. Every rate offers the same requests' lengths on the same
    arrival pattern, scaled in time, so the points differ by load alone; the token ids are
    fresh per rate (a repeat would only measure the prefix cache)."""
    lengths = chat_requests(count, input_len, output_len, max_model_len,
                            np.random.default_rng(seed))
    ids = np.random.default_rng([seed, int(rate * 1000)])
    requests = [SampleRequest(ids.integers(0, RANDOM_ID_LIMIT, size=r.prompt_len).tolist(),
                              r.prompt_len, r.output_len) for r in lengths]
    return schedule(requests, {ALL: rate}, burstiness, seed)


def measure(base_url: str, loads: Sequence[Tuple[float, list]],
            slo: Dict[str, float]) -> List[Dict[str, Any]]:
    from fulcrum.bench.serve import make_client, run_load, served_model, warm_up

    async def main() -> List[Dict[str, Any]]:
        url = base_url + "/v1/completions"
        points = []
        async with make_client() as client:
            model = await served_model(client, base_url)
            await warm_up(client, url, model)
            for rate, load in loads:
                timelines, duration = await run_load(client, url, model, load,
                                                     show_progress=False)
                report = report_by_group(timelines, duration, slo)[ALL]
                points.append(point(rate, report, [t.error for t in timelines
                                                   if not t.completed]))
                print(f"  {rate:g} req/s: goodput {points[-1]['goodput']:.2f} req/s "
                      f"({100 * points[-1]['goodput_share']:.0f}%), TTFT p99 "
                      f"{points[-1]['ttft_p99_ms']:.0f} ms, TPOT p99 "
                      f"{points[-1]['tpot_p99_ms']:.0f} ms", flush=True)
        return points

    return asyncio.run(main())


def point(rate: float, report: Dict[str, Any], errors: List[str]) -> Dict[str, Any]:
    return {"rate": rate, "goodput": report["goodput"], "goodput_share": report["goodput_share"],
            "slo_attainment": report["slo_attainment"],
            "ttft_p50_ms": report["ttft_ms"]["median"], "ttft_p99_ms": report["ttft_ms"]["p99"],
            "tpot_p50_ms": report["tpot_ms"]["median"], "tpot_p99_ms": report["tpot_ms"]["p99"],
            "total_token_throughput": report["total_token_throughput"],
            "completed": report["completed"], "errors": errors}


def best_budget(results: Dict[str, Any]) -> Optional[str]:
    """The fixed-budget engine with the most goodput summed over the rates."""
    fixed = [name for name in results if name.startswith("fulcrum-fcfs-")
             and "points" in results[name]]
    return max(fixed, key=lambda n: sum(p["goodput"] for p in results[n]["points"]),
               default=None)


def table(results: Dict[str, Any], rates: Sequence[float]) -> str:
    head = "| engine | " + " | ".join(f"{r:g} req/s" for r in rates) + " | mean share |"
    lines = [head, "|---|" + "---:|" * (len(rates) + 1)]
    for name, outcome in results.items():
        if "points" not in outcome:
            lines.append(f"| {name} | failed: {outcome['error'][:80]} |")
            continue
        cells = [f"{p['goodput']:.2f} ({100 * p['goodput_share']:.0f}%)"
                 for p in outcome["points"]]
        mean = np.mean([p["goodput_share"] for p in outcome["points"]])
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {100 * mean:.0f}% |")
    return "\n".join(lines)


def rate_table(results: Dict[str, Any], rates: Sequence[float],
               cell: Callable[[Dict[str, Any]], str]) -> List[str]:
    """A markdown table: one row per engine that ran, one `cell(point)` per rate."""
    lines = ["| engine | " + " | ".join(f"{r:g} req/s" for r in rates) + " |",
             "|---|" + "---:|" * len(rates)]
    return lines + [f"| {name} | " + " | ".join(cell(p) for p in outcome["points"]) + " |"
                    for name, outcome in results.items() if "points" in outcome]


def latency_table(results: Dict[str, Any], rates: Sequence[float]) -> str:
    return "\n".join(rate_table(results, rates, lambda p: f"{p['ttft_p99_ms']:.0f} / "
                                                      f"{p['tpot_p99_ms']:.0f}"))


def summary(data: Dict[str, Any], json_path: Path, page_dir: Path) -> List[str]:
    """The section docs/performance.md shows of these results (links relative to page_dir)."""
    setup = data["setup"]
    relative = lambda p: os.path.relpath(p, page_dir)  # noqa: E731
    return ["", "## Goodput against offered load", "",
            f"{setup['traffic']}; a request counts when TTFT <= {setup['slo']['ttft']:g} ms and "
            f"TPOT <= {setup['slo']['tpot']:g} ms (vLLM's `--goodput`). `fulcrum-slo` is given "
            "the same targets; `fulcrum-fcfs-N` is the fixed rule with a budget of N tokens "
            f"(best of the sweep: {data.get('best_fixed_budget') or 'none'}). "
            f"{setup['machine']['date']}; full tables in "
            f"[goodput.md]({relative(json_path.with_suffix('.md'))}), "
            "`bash benchmarks/goodput.sh` regenerates them.", "",
            *rate_table(data["results"], setup["rates"],
                        lambda p: f"{100 * p['goodput_share']:.0f}%"),
            "", f"![goodput]({relative(json_path.with_suffix('.png'))})"]


def plot(results: Dict[str, Any], shown: Sequence[str], path: Path, title: str) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 4.8), layout="constrained")
    axes = figure.subplots(1, 2)
    for name in shown:
        points = results[name]["points"]
        rates = [p["rate"] for p in points]
        axes[0].plot(rates, [p["goodput"] for p in points], "o-", label=name)
        axes[1].plot(rates, [100 * p["goodput_share"] for p in points], "o-", label=name)
    axes[0].plot(rates, rates, ":", color="tab:gray", label="offered load")
    axes[0].set_ylabel("goodput (requests/s within both targets)")
    axes[1].set_ylabel("requests within both targets (%)")
    for axis in axes:
        axis.set_xlabel("offered load (requests/s)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(title)
    figure.savefig(path, dpi=110)


def render(data: Dict[str, Any], plot_name: str) -> str:
    setup, results = data["setup"], data["results"]
    slo = setup["slo"]
    best = data.get("best_fixed_budget")
    lines = [
        "# Goodput against offered load", "",
        f"{setup['traffic']}; targets TTFT <= {slo['ttft']:g} ms and TPOT <= {slo['tpot']:g} "
        f"ms (a request counts only if it meets both). Model: {setup['model']}, max_model_len "
        f"{setup['max_model_len']}; {setup['machine']['cpu']}, {setup['machine']['cores']} cores; "
        f"{setup['machine']['date']}.", "",
        "Engines: `fulcrum-slo` is `fulcrum serve --scheduling-policy slo` given the same "
        "targets; `fulcrum-fcfs-N` is the fixed rule with a token budget of N; `vllm` is "
        "vLLM's CPU build with its defaults, `vllm-tuned` with "
        f"`{' '.join(VLLM_VARIANTS['vllm-tuned'])}`."
        + (f" The best fixed budget over the rates is **{best}**." if best else ""), "",
        "Goodput in requests/s (share of the requests within both targets):", "",
        table(results, setup["rates"]), "",
        "TTFT p99 / TPOT p99 (ms):", "", latency_table(results, setup["rates"]), "",
        f"![goodput]({plot_name})", "",
        "Regenerate: `" + setup["command"] + "`", ""]
    return "\n".join(lines)


def command_line(args: argparse.Namespace) -> str:
    words = ["fulcrum", "bench", "goodput", "--engines", args.engines, "--rates", args.rates,
             "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
             "--output-len", str(args.output_len), "--burstiness", f"{args.burstiness:g}",
             "--slo-ttft-ms", f"{args.slo_ttft_ms:g}", "--slo-tpot-ms", f"{args.slo_tpot_ms:g}",
             "--seed", str(args.seed), "--max-model-len", str(args.max_model_len),
             "--output-dir", args.output_dir]
    return shlex.join(words + (["--model", args.model] if args.model else []))


def run_goodput(args: argparse.Namespace) -> int:
    slo = {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms}
    table_of = engines(slo)
    chosen = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(chosen) - set(table_of)
    if unknown:
        raise ValueError(f"--engines takes {', '.join(table_of)} (got {sorted(unknown)})")
    if vllm_version() is None:
        chosen = [e for e in chosen if table_of[e][0] != "vllm"]
    rates = [float(r) for r in args.rates.split(",")]
    loads = [(rate, traffic(rate, args.num_prompts, args.input_len, args.output_len,
                            args.burstiness, args.seed, args.max_model_len)) for rate in rates]
    model_dir = args.model or shape_dir(DEFAULT_SHAPE)
    dummy = args.model is None
    results: Dict[str, Any] = {}
    for name in chosen:
        print(f"[{name}]", flush=True)
        kind, flags = table_of[name]
        build = vllm_command if kind == "vllm" else fulcrum_command
        port = free_port()
        try:
            with running_server(build(flags, model_dir, dummy, port, args.max_model_len),
                                port) as base_url:
                results[name] = {"flags": list(flags), "points": measure(base_url, loads, slo)}
        except RuntimeError as error:
            results[name] = {"error": str(error)}
            print(f"  failed: {error}", flush=True)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    best = best_budget(results)
    data = {"setup": {
        "machine": machine_facts(), "vllm_version": vllm_version(), "slo": slo, "rates": rates,
        "max_model_len": args.max_model_len,
        "model": f"{DEFAULT_SHAPE} shape (dummy weights)" if dummy else Path(model_dir).name,
        "traffic": (f"{args.num_prompts} chat-like requests per rate (prompt tokens log-normal "
                    f"around a median of {args.input_len}, output tokens around "
                    f"{args.output_len}), gamma arrivals with burstiness {args.burstiness:g}"),
        "command": command_line(args)},
        "best_fixed_budget": best, "results": results}
    shown = [n for n in ("fulcrum-slo", best, *PEERS) if n and "points" in results.get(n, {})]
    if shown:
        plot(results, shown, out_dir / "goodput.png",
             f"Goodput, TTFT <= {slo['ttft']:g} ms and TPOT <= {slo['tpot']:g} ms")
    (out_dir / "goodput.json").write_text(json.dumps(data, indent=2) + "\n")
    (out_dir / "goodput.md").write_text(render(data, "goodput.png"))
    print(f"wrote {out_dir}/goodput.{{md,json,png}}")
    failed = any("error" in r or any(p["errors"] for p in r["points"]) for r in results.values())
    return 1 if failed else 0


def add_goodput_args(parser: argparse.ArgumentParser) -> None:
    names = ",".join(engines({"ttft": 0, "tpot": 0}))
    parser.add_argument("--engines", default=names, help=f"comma-separated, from {names}")
    parser.add_argument("--rates", type=rate_list, default="0.5,1,1.5,2",
                        help="request rates to offer (req/s)")
    parser.add_argument("--num-prompts", type=positive_int, default=30, help="requests per rate")
    parser.add_argument("--input-len", type=positive_int, default=128, help="median prompt tokens")
    parser.add_argument("--output-len", type=positive_int, default=48, help="median output tokens")
    parser.add_argument("--burstiness", type=float, default=0.5,
                        help="gamma shape of the gaps (1 Poisson, < 1 burstier)")
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="TTFT target")
    parser.add_argument("--slo-tpot-ms", type=float, default=100.0, help="TPOT target")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=positive_int, default=4096,
                        help="every server's context; prompts reach half of it")
    parser.add_argument("--model", default=None,
                        help=f"a model folder with real weights (default: the {DEFAULT_SHAPE} "
                             "shape with dummy weights)")
    parser.add_argument("--output-dir", type=output_dir, default="benchmarks/results/goodput")

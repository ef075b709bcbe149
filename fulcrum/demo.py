"""`fulcrum demo`: the case fulcrum exists for, in one minute.

A long prompt arrives first; short requests keep arriving while it is being prefilled. The
demo runs the same arrival schedule three ways and prints every request's TTFT, the total
throughput, and how the short and the long requests fared:
- slo (fulcrum's default): chunks sized step by step so that decodes keep to their time per
  token and a request arriving during a step still makes its first-token target, short
  prompts first when their first-token deadline is nearer;
- fcfs with fixed chunks (an eighth of the budget): short requests never wait long, but the
  long prompt pays for its small chunks even when it is alone;
- no chunking: the long prompt in one piece, every short request queued behind it.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
import webbrowser
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional

from fulcrum.arg_types import port, positive_int, seconds
from fulcrum.engine_args import add_engine_args, engine_kwargs


DASHBOARD_PAUSE_S = 2.0


@dataclass
class Arrival:
    at: float  # seconds after the start
    name: str
    prompt_token_ids: List[int]
    max_tokens: int


def make_arrivals(long_len: int, num_short: int, short_len: int, output_len: int,
                  interval: float, seed: int) -> List[Arrival]:
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(256) for _ in range(n)]  # noqa: E731
    arrivals = [Arrival(0.0, "long", tokens(long_len), output_len)]
    for i in range(num_short):
        arrivals.append(Arrival(0.05 + i * interval, f"short-{i:02d}", tokens(short_len),
                                output_len))
    return arrivals


def run_schedule(engine, arrivals: List[Arrival]) -> Dict[str, dict]:
    """Feed the arrivals to the engine in real time; return each request's timings."""
    from fulcrum import SamplingParams

    pending = sorted(arrivals, key=lambda a: a.at)
    results: Dict[str, dict] = {}
    start = time.monotonic()
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while pending and pending[0].at <= now:
            a = pending.pop(0)
            engine.add_request(a.name, {"prompt_token_ids": a.prompt_token_ids},
                               SamplingParams(temperature=0, max_tokens=a.max_tokens,
                                              ignore_eos=True), arrival_time=start + a.at)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0].at - now))
            continue
        for output in engine.step():
            if output.finished:
                m = output.metrics
                results[output.request_id] = dict(
                    ttft=m.time_to_first_token, finished=m.finished_time - start,
                    tokens=len(output.prompt_token_ids) + len(output.outputs[0].token_ids))
    return results


def summarise(label: str, results: Dict[str, dict]) -> dict:
    short = sorted(r["ttft"] for name, r in results.items() if name.startswith("short"))
    makespan = max(r["finished"] for r in results.values())
    total_tokens = sum(r["tokens"] for r in results.values())
    return dict(label=label, long_ttft=results["long"]["ttft"],
                short_median=statistics.median(short), short_max=short[-1],
                makespan=makespan, throughput=total_tokens / makespan)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo", help="long prompt + stream of short ones: slo vs fixed chunks vs no chunking",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None,
                        help="local model folder (default: the built-in model)")
    parser.add_argument("--long-len", type=positive_int, default=3072)
    parser.add_argument("--num-short", type=positive_int, default=12)
    parser.add_argument("--short-len", type=positive_int, default=32)
    parser.add_argument("--output-len", type=positive_int, default=16)
    parser.add_argument("--interval", type=seconds, default=0.2,
                        help="seconds between short arrivals")
    parser.add_argument("--chunk-budget", type=positive_int, default=256,
                        help="max_num_batched_tokens in the chunked runs")
    parser.add_argument("--dashboard", nargs="?", type=port, const=8001, default=None,
                        metavar="PORT", help="serve the live scheduler dashboard on this port "
                                             "(default 8001) while the demo runs, and print "
                                             "its URL")
    parser.add_argument("--open", action="store_true",
                        help="open the dashboard in a browser (implies --dashboard)")
    # the modes set the chunking (and a threshold would contradict the fixed chunks' size)
    add_engine_args(parser, skip=("model", "enable_chunked_prefill", "max_num_batched_tokens",
                                  "scheduling_policy", "long_prefill_token_threshold",
                                  "max_num_partial_prefills"))
    parser.set_defaults(func=run)


def modes(budget: int) -> Dict[str, dict]:
    """The three ways to run the schedule: label -> engine arguments."""
    chunked = dict(enable_chunked_prefill=True, max_num_batched_tokens=budget)
    return {"slo (default): chunks sized to latency targets": dict(chunked,
                                                                   scheduling_policy="slo"),
            f"fcfs: fixed chunks of {budget // 8} tokens": dict(
                chunked, scheduling_policy="fcfs"),
            "no chunked prefill": dict(enable_chunked_prefill=False, max_num_batched_tokens=None,
                                       scheduling_policy="fcfs")}


def _engine(args, overrides: dict):
    from fulcrum.engine import LLMEngine
    from fulcrum.config import EngineConfig

    return LLMEngine(EngineConfig(**engine_kwargs(args), **overrides))


@contextlib.contextmanager
def _dashboard(args: argparse.Namespace) -> Iterator[Optional[Any]]:
    """A dashboard over whichever engine the demo runs (None without --dashboard)."""
    port = args.dashboard if args.dashboard is not None else (8001 if args.open else None)
    if port is None:
        yield None
        return
    from fulcrum.server import BackgroundServer
    from fulcrum.server.dashboard import DashboardFeed, dashboard_app

    feed = DashboardFeed(None, "starting")
    with BackgroundServer(dashboard_app(feed), port=port) as server:
        print(f"Dashboard: {server.url}/ (open the Dashboard tab)")
        if args.open:
            webbrowser.open(server.url + "/")
        yield feed


def run(args: argparse.Namespace) -> int:
    arrivals = make_arrivals(args.long_len, args.num_short, args.short_len, args.output_len,
                             args.interval, args.seed)
    print(f"Workload: one {args.long_len}-token prompt at t=0, then {args.num_short} prompts of "
          f"{args.short_len} tokens every {args.interval:.2f} s; {args.output_len} output tokens "
          "each.")
    summaries = []
    with _dashboard(args) as feed:
        for label, overrides in modes(args.chunk_budget).items():
            engine = _engine(args, overrides)
            print(f"\n== {label}: model {engine.model_dir} ({str(engine.dtype)[6:]}) ==")
            run_schedule(engine, arrivals[1:2])  # warm-up
            if feed is not None:
                feed.engine, feed.model_name = engine, label
                time.sleep(DASHBOARD_PAUSE_S)  # the page catches up with the new engine
            results = run_schedule(engine, arrivals)
            summaries.append(summarise(label, results))
            for name in sorted(results):
                print(f"  {name:9s} TTFT {results[name]['ttft'] * 1000:8.0f} ms")
    print("\n{:52s} {:>10s} {:>12s} {:>10s} {:>9s} {:>10s}".format(
        "mode", "long TTFT", "short TTFT", "short max", "makespan", "tokens/s"))
    for s in summaries:
        print("{:52s} {:9.2f}s {:11.2f}s {:9.2f}s {:8.1f}s {:10.0f}".format(
            s["label"], s["long_ttft"], s["short_median"], s["short_max"], s["makespan"],
            s["throughput"]))
    slo, fixed, whole = summaries
    print(f"\nslo vs no chunking: short requests' median TTFT {short_ttft_change(slo, whole)}, "
          f"long prompt's TTFT "
          f"{slo['long_ttft'] / whole['long_ttft']:.2f}x; vs fixed chunks: long prompt's TTFT "
          f"{slo['long_ttft'] / fixed['long_ttft']:.2f}x.")
    return 0


def short_ttft_change(slo: dict, other: dict) -> str:
    """How slo's median short-request TTFT compares with `other`'s, in words that hold
    either way (on a busy machine chunking can lose)."""
    ratio = other["short_median"] / slo["short_median"]
    return f"{ratio:.1f}x lower" if ratio >= 1 else f"{1 / ratio:.1f}x higher"

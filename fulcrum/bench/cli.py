"""`fulcrum bench serve | throughput | sweep | report | goodput | stress | structured |
latency`: argument wiring only; the work is in the sibling modules. Without a model folder,
throughput and sweep use a real model's shape with dummy weights (see shapes.py)."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib
import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any, Awaitable, Callable, Dict, Tuple

from fulcrum.arg_types import output_dir, output_file, positive_int, positive_seconds, url_path
from fulcrum.bench.arrivals import add_arrival_args, build_schedule
from fulcrum.bench.datasets import add_dataset_args, build_requests, resolve_dataset_args
from fulcrum.bench.metrics import GOODPUT_KEYS, format_report, parse_goodput, report_by_group
from fulcrum.bench.shapes import DEFAULT_SHAPE, SHAPES, shape_dir
from fulcrum.config import check_slo_targets_read
from fulcrum.engine_args import add_engine_args, engine_kwargs

RESULTS_DIR = "benchmarks/results"
HF_BATCH_SIZE = 16


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmark a server, the engine or its settings",
                                  description="Measure serving latency, offline throughput, "
                                              "or the trade-offs of scheduler settings.")
    commands = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    _register_serve(commands)
    _register_throughput(commands)
    _register_sweep(commands)
    _register_report(commands)
    _register_module_command(commands, "goodput")
    _register_stress(commands)
    _register_module_command(commands, "structured")
    _register_module_command(commands, "latency")
    _register_module_command(commands, "scale")


def _register_serve(commands) -> None:
    parser = commands.add_parser(
        "serve", help="load-test an OpenAI-compatible /v1/completions server",
        description="Stream requests to a running server (fulcrum, vLLM, llama.cpp), each sent "
                    "at its arrival time, and report TTFT, TPOT, ITL, E2E latency, throughput "
                    "and goodput with vLLM's definitions.")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--endpoint", type=url_path, default="/v1/completions")
    parser.add_argument("--model", help="model name for the requests (default: the first "
                                        "that /v1/models lists)")
    parser.add_argument("--max-concurrency", type=positive_int, default=None,
                        help="most requests in flight; later arrivals wait for a slot")
    parser.add_argument("--goodput", nargs="+", action=GoodputAction, default={},
                        metavar="KEY:MS",
                        help="report goodput: requests meeting every given target, per second, "
                             "and their share (vLLM's flag and syntax); KEY is "
                             f"{', '.join(GOODPUT_KEYS)}, MS the target in milliseconds, "
                             "e.g. --goodput ttft:1000 tpot:100")
    parser.add_argument("--slo", nargs="+", action=GoodputAction, dest="goodput",
                        metavar="KEY_ms=MS", help="the same targets in the older spelling "
                                                  "(ttft_ms=1000 tpot_ms=100)")
    parser.add_argument("--save-result", type=output_file, metavar="FILE",
                        help="write the report as JSON")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    add_dataset_args(parser)
    add_arrival_args(parser)
    parser.set_defaults(func=run_serve)


def _add_model_args(parser: argparse.ArgumentParser, **dataset_defaults: int) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="local Hugging Face model folder (default: --shape, dummy weights)")
    parser.add_argument("--shape", choices=list(SHAPES), default=DEFAULT_SHAPE,
                        help="model shape to use with dummy weights when no folder is given")
    add_dataset_args(parser, **dataset_defaults)
    add_engine_args(parser, skip=("model", "seed"))  # --seed seeds the weights and prompts


def _register_throughput(commands) -> None:
    parser = commands.add_parser(
        "throughput", help="offline throughput of LLM.generate over a dataset",
        description="Generate for the whole dataset at once in-process and report tokens/s "
                    "and requests/s (model loading excluded).")
    _add_model_args(parser)
    parser.add_argument("--compare-hf", action="store_true",
                        help="also run HF transformers generate in static batches on the same "
                             "prompts and write JSON + markdown to --results-dir")
    parser.add_argument("--hf-batch-size", type=positive_int, default=None,
                        help=f"with --compare-hf: HF's batch size (default {HF_BATCH_SIZE})")
    parser.add_argument("--results-dir", default=None,
                        help=f"with --compare-hf: where the comparison goes (default "
                             f"{RESULTS_DIR})")
    parser.add_argument("--save-result", type=output_file, metavar="FILE",
                        help="write the result as JSON (with --compare-hf, HF's beside it)")
    parser.set_defaults(func=run_throughput)


def _register_sweep(commands) -> None:
    from fulcrum.bench.sweep import DEFAULT_GRID

    parser = commands.add_parser(
        "sweep", help="one scenario over a grid of scheduler settings: trade-off plot + table",
        description="Replay one serving scenario in-process under each setting and draw total "
                    "throughput against short-request TTFT p99 and TPOT p99, Pareto front "
                    "marked. Writes sweep.png, sweep.md and sweep.json.")
    _add_model_args(parser, num_prompts=32, input_len=64, output_len=32)
    add_arrival_args(parser)
    parser.add_argument("--grid", action="append", metavar="'FIELD=V1,V2 ...'",
                        help="settings: each --grid is a Cartesian product, several are joined "
                             "(values: true/false, none, integers, numbers, else text; "
                             f"default: {' | '.join(DEFAULT_GRID)})")
    parser.add_argument("--output-dir", type=output_dir, default=f"{RESULTS_DIR}/sweep")
    parser.set_defaults(func=run_sweep, dataset="mixed", request_rate=4.0)


def _register_report(commands) -> None:
    from fulcrum.bench.report import add_report_args, run_report

    parser = commands.add_parser(
        "report", help="regenerate docs/performance.md: every engine on three workloads",
        description="Serve each engine in turn (fulcrum's variants, vLLM's CPU build if "
                    "installed; HF transformers offline) and run a throughput, a decode and a "
                    "mixed workload through the streaming client; write the markdown page "
                    "of medians and the raw runs as JSON beside it. A full run on 2 cores "
                    "takes ~30 min, ~90 min with llama.cpp's server (its throughput "
                    "workload alone ~5 min a round).")
    add_report_args(parser)
    parser.set_defaults(func=run_report)


# Subcommands whose module brings its own arguments and runner:
# name -> (module, its add-arguments function, its run function, help, description).
_MODULE_COMMANDS = {
    "goodput": ("fulcrum.bench.goodput", "add_goodput_args", "run_goodput",
                "goodput against offered load: fulcrum's policies beside vLLM's",
                "Serve each engine in turn and offer it chat-like bursty traffic at rising "
                "request rates; report the requests/s that meet both latency targets (TTFT and "
                "TPOT), with a plot. Writes goodput.md, goodput.json and goodput.png."),
    "latency": ("fulcrum.bench.latency", "add_args", "run_latency",
                "time per output token at batch 1, 4, 16, 64 against the roofline",
                "Decode batches of several sizes in-process, bf16 and int8 weights side by "
                "side, and compare each step's time with this machine's measured memory "
                "bandwidth and matrix peak. Writes latency.json, latency.md and latency.png."),
    "structured": ("fulcrum.bench.structured", "add_args", "run_structured",
                   "what structured outputs cost a decode step",
                   "Decode a batch in-process unconstrained and under a JSON schema, runs "
                   "alternating; report the median step time of each and the difference. "
                   "Writes structured_outputs.json and structured_outputs.md."),
    "scale": ("fulcrum.bench.scale", "add_args", "run_scale",
              "tensor parallel, data-parallel replicas and cache-aware routing, each against "
              "its baseline",
              "Serve each variant in turn (fresh servers, alternating): -tp 2 vs one rank, -dp 2 "
              "vs one engine, cache-aware vs round-robin routing on shared prefixes. Writes "
              "scale.json and scale.md."),
}


def _register_module_command(commands, name: str) -> None:
    module, add_args, run, help_text, description = _MODULE_COMMANDS[name]
    loaded = importlib.import_module(module)
    parser = commands.add_parser(name, help=help_text, description=description)
    getattr(loaded, add_args)(parser)
    parser.set_defaults(func=getattr(loaded, run))


def _register_stress(commands) -> None:
    parser = commands.add_parser(
        "stress", help="robustness: concurrent streams that disconnect or stall, then leaks",
        description="Open many concurrent streaming /v1/completions requests against a "
                    "running server, some hanging up mid-stream and some stalling unread; "
                    "check that kept streams got every token asked for and that, once idle, "
                    "nothing is left running, waiting or holding KV blocks; report the "
                    "server's RSS per round. Exits non-zero on any error or leak.")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="model name for the requests (default: the first "
                                        "that /v1/models lists)")
    parser.add_argument("--num-clients", type=positive_int, default=1000,
                        help="concurrent requests per round (default 1000)")
    parser.add_argument("--rounds", type=positive_int, default=2, help="rounds (default 2)")
    parser.add_argument("--max-tokens", type=positive_int, default=32,
                        help="tokens each request asks for, with ignore_eos (default 32)")
    parser.add_argument("--disconnect-fraction", type=float, default=0.3,
                        help="share of clients that hang up at a random point (default 0.3)")
    parser.add_argument("--stall-fraction", type=float, default=0.05,
                        help="share of clients that open the stream, never read it and hang "
                             "up after --stall-seconds (default 0.05)")
    parser.add_argument("--stall-seconds", type=positive_seconds, default=5.0)
    parser.add_argument("--seed", type=int, default=0, help="seeds prompts and client roles")
    parser.add_argument("--read-timeout", type=positive_seconds, default=120.0,
                        help="longest wait for the headers or one chunk, seconds")
    parser.add_argument("--round-timeout", type=positive_seconds, default=600.0,
                        help="bound on one round's requests, seconds")
    parser.add_argument("--drain-timeout", type=positive_seconds, default=60.0,
                        help="bound on the wait for an idle server after a round, seconds")
    parser.add_argument("--save-result", type=output_file, metavar="FILE",
                        help="write the report as JSON")
    parser.set_defaults(func=run_stress)


class GoodputAction(argparse.Action):
    """`--goodput ttft:MS ...` and its alias `--slo ttft_ms=MS ...`: both fill one dict of
    targets in milliseconds ({"ttft": 1000.0, ...}); a bad item is a usage error."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        try:
            targets = parse_goodput(values, alias=option_string == "--slo")
        except ValueError as error:
            parser.error(str(error))
        merged = dict(getattr(namespace, self.dest) or {})
        twice = sorted(set(merged) & set(targets))
        if twice:
            parser.error(f"{option_string}: a {twice[0]} target is already given")
        setattr(namespace, self.dest, {**merged, **targets})


def _write_json(path: str, content: Dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(content, indent=2) + "\n")


def run_serve(args: argparse.Namespace) -> int:
    from fulcrum.bench.serve import make_client, run_load, served_context, served_model

    resolve_dataset_args(args)  # a setting the dataset does not read fails before any request

    async def main() -> Tuple[str, list, float]:
        async with make_client() as client:
            model = await served_model(client, args.base_url, args.model)
            if args.dataset == "chat":  # its prompts and answers fit the server's context
                args.max_model_len = await served_context(client, args.base_url, model)
            timed = build_schedule(build_requests(args), args)
            url = args.base_url.rstrip("/") + args.endpoint
            timelines, duration = await run_load(client, url, model, timed,
                                                 args.max_concurrency, not args.disable_tqdm)
            return model, timelines, duration

    model, timelines, duration = _against_server(args, main)
    reports = report_by_group(timelines, duration, args.goodput)
    print(format_report(reports))
    errors = [t.error for t in timelines if not t.completed]
    if errors:
        print(f"{len(errors)} requests failed; first error: {errors[0]}")
    if args.save_result:
        _write_json(args.save_result, {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "base_url": args.base_url, "model": model, "args": _run_args(args),
            "reports": reports, "errors": errors})
    return 1 if errors else 0


def run_stress(args: argparse.Namespace) -> int:
    from fulcrum.bench.stress import StressConfig, format_table
    from fulcrum.bench.stress import run_stress as stress

    config = StressConfig(
        base_url=args.base_url, model=args.model, num_clients=args.num_clients,
        rounds=args.rounds, max_tokens=args.max_tokens,
        disconnect_fraction=args.disconnect_fraction, stall_fraction=args.stall_fraction,
        stall_seconds=args.stall_seconds, seed=args.seed, read_timeout=args.read_timeout,
        round_timeout=args.round_timeout, drain_timeout=args.drain_timeout)
    report = _against_server(args, lambda: stress(config))
    print(format_table(report))
    if args.save_result:
        _write_json(args.save_result, {
            "date": datetime.datetime.now().isoformat(timespec="seconds"), **report})
    return 0 if report["passed"] else 1


def _against_server(args: argparse.Namespace, run: Callable[[], Awaitable[Any]]) -> Any:
    """`run()`'s result; a server that cannot be reached or used (no server there, a bad
    URL, /v1/models failing) is a ValueError: the one-line error of the command line."""
    import httpx

    try:
        return asyncio.run(run())
    except (httpx.HTTPError, httpx.InvalidURL) as error:
        raise ValueError(f"cannot use {args.base_url}: {type(error).__name__}: {error}") from None


def _run_args(args: argparse.Namespace) -> Dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k not in ("func", "dataset_defaults")}


def _model(args: argparse.Namespace) -> Tuple[str, str, Dict[str, Any]]:
    """(folder, display name, engine kwargs): a real folder, or a shape with dummy weights."""
    kwargs = {k: v for k, v in engine_kwargs(args).items() if k != "model"}
    if args.model:
        return args.model, Path(args.model).name, kwargs
    return shape_dir(args.shape), args.shape, {**kwargs, "load_format": "dummy"}


def _token_counter(model_dir: str):
    from fulcrum.tokenizer import Tokenizer

    tokenizer = Tokenizer(model_dir)
    return lambda text: len(tokenizer.encode(text))


def run_throughput(args: argparse.Namespace) -> int:
    from fulcrum.bench.throughput import measure_fulcrum

    given = [flag for flag, value in (("--hf-batch-size", args.hf_batch_size),
                                      ("--results-dir", args.results_dir)) if value is not None]
    if given and not args.compare_hf:
        raise ValueError(f"{' and '.join(given)} go with --compare-hf (HF's run), which was "
                         "not asked for")
    check_slo_targets_read(args.scheduling_policy, False, {
        "--slo-ttft-ms": args.slo_ttft_ms, "--slo-tpot-ms": args.slo_tpot_ms},
        "bench throughput reports no SLO attainment")
    model_dir, name, kwargs = _model(args)
    requests = build_requests(args, _token_counter(model_dir))
    hf = None
    if args.compare_hf:
        result, hf = _compare_hf(args, model_dir, name, kwargs, requests)
    else:
        result = measure_fulcrum(model_dir, kwargs, requests, show_progress=True)
        print(result.summary("fulcrum"))
    if args.save_result:
        from fulcrum.bench.report import machine_facts

        _write_json(args.save_result, {"model": name, "args": _run_args(args),
                                       "machine": machine_facts(), "result": result.as_dict(),
                                       **({"hf_transformers": hf.as_dict()} if hf else {})})
    return 0


def _compare_hf(args: argparse.Namespace, model_dir: str, name: str, kwargs: Dict[str, Any],
                requests: list) -> Tuple[Any, Any]:
    """(fulcrum's result, HF's), each measured in a process of its own; the comparison is
    written to --results-dir."""
    import torch

    from fulcrum.bench.hf_baseline import measure_hf
    from fulcrum.bench.throughput import measure_fulcrum, run_isolated, write_comparison
    from fulcrum.engine import resolve_device
    from fulcrum.worker.model_loader import load_hf_config, resolve_dtype

    dtype = resolve_dtype(args.dtype, load_hf_config(model_dir))
    device = str(resolve_device(args.device))
    batch_size = args.hf_batch_size or HF_BATCH_SIZE
    fulcrum = run_isolated(measure_fulcrum, model_dir, kwargs, requests)
    print(fulcrum.summary("fulcrum"))
    hf = run_isolated(measure_hf, model_dir, dtype, device, requests, batch_size,
                      kwargs["load_format"] == "dummy")
    print(hf.summary("HF transformers"))
    setup = {"model": name, "weights": "dummy" if kwargs["load_format"] == "dummy" else "real",
             "dtype": str(dtype).removeprefix("torch."), "device": device,
             "requests": len(requests), "input_len": args.input_len,
             "output_len": args.output_len, "hf_batch_size": batch_size,
             "torch": torch.__version__, "transformers": importlib.metadata.version("transformers"),
             "cpus": os.cpu_count(), "date": datetime.date.today().isoformat()}
    stem = Path(args.results_dir or RESULTS_DIR) / f"throughput_vs_hf_{name}"
    json_path, md_path = write_comparison(fulcrum, hf, setup, stem)
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")
    return fulcrum, hf


def run_sweep(args: argparse.Namespace) -> int:
    from fulcrum.bench.sweep import DEFAULT_GRID, config_for, longest_request, mark_fronts, \
        parse_grid, run_point, table, write_outputs

    model_dir, name, kwargs = _model(args)
    timed = build_schedule(build_requests(args, _token_counter(model_dir)), args)
    settings = parse_grid(args.grid or DEFAULT_GRID)
    for setting in settings:  # a bad value fails now, not after the points before it ran
        config_for(model_dir, kwargs, setting, longest_request(timed))
    results = []
    for number, setting in enumerate(settings, 1):
        result = run_point(model_dir, kwargs, setting, timed)
        print(f"[{number}/{len(settings)}] {result['label']}: "
              f"{result['total_token_throughput']:.1f} tok/s, "
              f"TTFT p99 {result['ttft_p99_ms']:.1f} ms", flush=True)
        results.append(result)
    mark_fronts(results)
    title = (f"{name}, {args.dataset} dataset, {len(timed)} requests at "
             f"{args.request_rate} req/s")
    paths = write_outputs(results, Path(args.output_dir), title)
    print(table(results))
    for path in paths:
        print(f"wrote {path}")
    return 0

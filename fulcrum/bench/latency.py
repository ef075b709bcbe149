"""`fulcrum bench latency`: time per output token at batch sizes 1, 4, 16, 64, against what
this machine can do at best.

For each batch size, that many requests (random prompts of `--input-len` tokens) decode
`--output-len` tokens together, in-process; the figure is the median wall time of the steps
where the whole batch decodes: each request's time per output token at that batch size.
The model runs with its weights as loaded and with int8 (`--quantizations`),
side by side: runs alternate between the two engines, so the machine's drifts hit both.

The machine's limits are measured here too, on the same cores: the memory bandwidth by a probe
(summing a 512 MiB float32 array where the weights live: on huge pages on a CPU, in the GPU's
own memory on a GPU) after every decode step,
each batch size judged against the median of the probes between its own steps, since this
machine's bandwidth drifts by up to 2x within a minute (a bound measured once, minutes away,
would judge a step against another machine); and the matrix-multiply peak of each engine's
number format (its own gate/up projection on 512 rows), before and after all the runs, the
better kept. A decode step must read every weight once (plus the KV cache of
every request) and do 2 FLOPs per weight per request (plus attention), so its least possible
time is max(bytes / bandwidth, FLOPs / peak): the roofline. The report gives each batch
size's share of that bound: 100% would be a step that only streams weights and multiplies,
with nothing else in the way. The forward pass's own share (decoder stack and LM head, timed
in the same steps) tells the kernels' distance from the bound apart from the engine's Python
around them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from fulcrum import kernels
from fulcrum.arg_types import output_dir, positive_int
from fulcrum.bench.shapes import DEFAULT_SHAPE, SHAPES, shape_dir
from fulcrum.config import EngineConfig
from fulcrum.engine import LLMEngine
from fulcrum.sampling_params import SamplingParams
from fulcrum.stats import StepStats

BATCH_SIZES = (1, 4, 16, 64)
BANDWIDTH_BYTES = 512 << 20
DEFAULT_OUTPUT_DIR = "benchmarks/results/latency"


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default=DEFAULT_SHAPE, choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantizations", nargs="+", choices=["none", "int8"],
                        default=["none", "int8"],
                        help="the weight formats to run side by side (default both)")
    parser.add_argument("--batch-sizes", type=positive_int, nargs="+", default=list(BATCH_SIZES))
    parser.add_argument("--input-len", type=positive_int, default=128)
    parser.add_argument("--output-len", type=positive_int, default=64)
    parser.add_argument("--num-iters", type=positive_int, default=3,
                        help="runs per batch size (vLLM's flag); steps of all runs pooled")
    parser.add_argument("--output-dir", type=output_dir, default=DEFAULT_OUTPUT_DIR)


# ----------------------------------------------------------------- machine limits
def synchronizer(device: torch.device) -> Callable[[], None]:
    """What waits for `device`'s queued work, so that a wall clock times it."""
    return torch.cuda.synchronize if device.type == "cuda" else lambda: None


class BandwidthProbe:
    """Reads of a 512 MiB array in the memory the weights are in: on a CPU, on huge pages as
    the weights are (kernels.huge_page_tensor: on 4 KiB pages the same sum reads slower, which
    would flatter every figure judged against it); on a GPU, in its own memory, not the
    host's. Each call appends one reading, in bytes per second."""

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        if device.type == "cpu":
            self.data = kernels.huge_page_tensor(BANDWIDTH_BYTES).view(torch.float32)
        else:
            self.data = torch.empty(BANDWIDTH_BYTES // 4, dtype=torch.float32, device=device)
        self.data.fill_(1.0)
        self.done = synchronizer(device)
        self.readings: List[float] = []

    def __call__(self) -> None:
        self.done()
        start = time.perf_counter()
        self.data.sum()
        self.done()
        self.readings.append(BANDWIDTH_BYTES / (time.perf_counter() - start))


def measure_peak_flops(model: Any, dtype: torch.dtype, repeats: int = 5) -> float:
    """Multiply-add throughput (FLOP/s) of the model's own MLP projection (gate and up,
    its largest matrix but the LM head, whose huge output is memory work) on 512 rows: the best
    a step's matrix work can do, in the model's number format (int8 products have a rate of
    their own, not always bf16's). Best of `repeats`."""
    layer = next(m for name, m in model.named_modules() if name.endswith("gate_up_proj"))
    device = next(model.parameters()).device
    rows = torch.randn(512, layer.in_features, dtype=dtype, device=device)
    done = synchronizer(device)
    best = float("inf")
    with torch.inference_mode():
        layer(rows)
        for _ in range(repeats):
            done()
            start = time.perf_counter()
            layer(rows)
            done()
            best = min(best, time.perf_counter() - start)
    return 2.0 * 512 * layer.in_features * layer.out_features / best


# ----------------------------------------------------------------- a step's work
def _linears(model: Any) -> Dict[str, Any]:
    """The model's linear layers, the LM head included, by name."""
    return {name: m for name, m in model.named_modules() if hasattr(m, "out_features")}


def _stack_and_head(model: Any) -> Tuple[List[Any], Any]:
    """The decoder stack's linear layers, which every computed token passes through, and the
    LM head, which only the rows sampled from do."""
    linears = _linears(model)
    head = linears.pop("lm_head")
    return list(linears.values()), head


def _params(linear: Any) -> int:
    return linear.in_features * linear.out_features


def _flops_per_key(spec: Any) -> float:
    """One query token against one key in every layer: scores and values, 2 FLOPs per
    multiply-add."""
    return 4.0 * spec.num_layers * spec.num_heads * spec.head_dim


def _weight_bytes(engine: LLMEngine, linear: Any) -> int:
    """int8 layers hold a byte a weight (their scales are negligible), the rest the dtype's."""
    width = 1 if getattr(linear, "scale", None) is not None else \
        torch.finfo(engine.dtype).bits // 8
    return _params(linear) * width


def _kv_bytes_per_key(engine: LLMEngine) -> int:
    """The KV cache one token holds over all layers, which every query attending to it reads."""
    spec = engine.runner.model.spec
    return (spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim
            * torch.finfo(engine.kv_cache_dtype).bits // 8)


def step_work(engine: LLMEngine, batch: int, context: int) -> Dict[str, float]:
    """Bytes a decode step must read and FLOPs it must do, `batch` requests at `context`."""
    model, spec = engine.runner.model, engine.runner.model.spec
    linears = list(_linears(model).values())
    weight_params = sum(_params(m) for m in linears)
    weight_bytes = sum(_weight_bytes(engine, m) for m in linears)
    kv_bytes = batch * context * _kv_bytes_per_key(engine)
    flops = 2.0 * weight_params * batch + batch * context * _flops_per_key(spec)
    return {"bytes": float(weight_bytes + kv_bytes), "flops": flops,
            "weight_bytes": float(weight_bytes)}


def workload_flops(model: Any, prompt_lens: Sequence[int],
                   output_lens: Sequence[int]) -> float:
    """FLOPs a whole generation must do, no prompt token found cached (the sum of
    `workload_flops_by_kind`)."""
    return sum(workload_flops_by_kind(model, prompt_lens, output_lens).values())


def workload_flops_by_kind(model: Any, prompt_lens: Sequence[int],
                           output_lens: Sequence[int]) -> Dict[str, float]:
    """A whole generation's FLOPs by kind of matrix work, no prompt token found cached: each
    projection of the decoder stack by its name in a layer ("qkv_proj", ...; every token but
    a request's last output passes through it, 2 FLOPs per weight), "lm_head" (one row per
    output token) and "attention" (the token at position t attends to t + 1 keys, 4 FLOPs
    per key and query dim, scores and values)."""
    computed = sum(p + o - 1 for p, o in zip(prompt_lens, output_lens))
    flops: Dict[str, float] = {}
    for name, linear in _linears(model).items():
        kind = name.rsplit(".", 1)[-1]
        rows = sum(output_lens) if kind == "lm_head" else computed
        flops[kind] = flops.get(kind, 0.0) + 2.0 * _params(linear) * rows
    keys = sum((p + o - 1) * (p + o) / 2 for p, o in zip(prompt_lens, output_lens))
    flops["attention"] = _flops_per_key(model.spec) * keys
    return flops


def kernel_roofline_s(engine: LLMEngine, prompt_lens: Sequence[int],
                      output_lens: Sequence[int], steps: Sequence[StepStats], peak: float,
                      bandwidth: float) -> float:
    """The least time a whole generation can take on this machine, the roofline applied kernel
    by kernel rather than to the workload's FLOPs alone: each step's linear layers take at
    least max(their FLOPs at the matrix peak, one read of their weights at the bandwidth), the
    prompt tokens' attention its FLOPs at the peak, and the decodes' attention at least the
    time to read the KV cache each decode attends to (3 FLOPs a byte for a GQA group of 3,
    far below the peak's FLOPs per byte of bandwidth). A batch of 64 is bound by compute, but
    its decodes' attention and the batch's last steps, with few rows, are bound by memory:
    a CPU whose matrix rate doubles (AVX512-BF16 against AVX2) makes those the larger part.
    `steps` are the generation's steps; the LM head is counted in a step for its decodes
    only, which keeps this a lower bound (a prompt's first token comes from it too)."""
    stack, head = _stack_and_head(engine.runner.model)
    body_params = sum(_params(m) for m in stack)
    body_bytes = sum(_weight_bytes(engine, m) for m in stack)
    head_params, head_bytes = _params(head), _weight_bytes(engine, head)
    linear_s = 0.0
    for step in steps:
        rows, sampled = step.num_prefill_tokens + step.num_decode_tokens, step.num_decode_tokens
        if rows:
            flops = 2.0 * (body_params * rows + head_params * sampled)
            read = body_bytes + (head_bytes if sampled else 0)
            linear_s += max(flops / peak, read / bandwidth)
    return linear_s + attention_bound_s(engine, prompt_lens, output_lens, peak, bandwidth)


def attention_bound_s(engine: LLMEngine, prompt_lens: Sequence[int],
                      output_lens: Sequence[int], peak: float, bandwidth: float) -> float:
    """The least time a whole generation's attention can take: the prompt tokens' FLOPs at
    the matrix peak, and the decodes' at least one read of the KV cache each attends to."""
    prompt_keys = sum(p * (p + 1) / 2 for p in prompt_lens)
    decode_keys = sum((p + o - 1) * (p + o) / 2 - p * (p + 1) / 2
                      for p, o in zip(prompt_lens, output_lens))
    per_key = _flops_per_key(engine.runner.model.spec)
    decode_s = max(per_key * decode_keys / peak,
                   _kv_bytes_per_key(engine) * decode_keys / bandwidth)
    return per_key * prompt_keys / peak + decode_s


def decode_steps(engine: LLMEngine, batch: int, input_len: int, output_len: int,
                 runs: int, rng: np.random.Generator,
                 probe: Optional[BandwidthProbe] = None) -> List[StepStats]:
    """The stats of the full-batch decode steps of `runs` runs; `probe`, if given, reads the
    bandwidth after every step."""
    steps: List[StepStats] = []
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for run in range(runs):
        first = len(engine.stats)
        for i in range(batch):
            engine.add_request(f"latency-{batch}-{run}-{i}", {"prompt_token_ids": rng.integers(
                0, engine.vocab_size, input_len).tolist()}, params)
        while engine.has_unfinished_requests():
            engine.step()
            if probe is not None:
                probe()
        steps += [s for s in list(engine.stats)[first:]
                  if s.num_decode_tokens == batch and s.num_prefill_tokens == 0]
    if runs and not steps:  # the prompts' prefill outlasted the first requests' output
        raise ValueError(
            f"no step decoded all {batch} requests together: prefilling their {batch} x "
            f"{input_len} prompt tokens ({engine.config.max_num_batched_tokens} a step at "
            f"most) took longer than the first of them took to make their {output_len} "
            f"output tokens; raise --output-len or lower --input-len")
    return steps


def measure(engines: Dict[str, LLMEngine], batch_sizes: Sequence[int], input_len: int,
            output_len: int, runs: int) -> Dict[str, Any]:
    """Each engine (label -> engine) at each batch size, runs alternating between engines."""
    rng = np.random.default_rng(0)
    for engine in engines.values():
        decode_steps(engine, 1, input_len, 4, 1, rng)  # warm-up
    peaks = {label: measure_peak_flops(e.runner.model, e.dtype) for label, e in engines.items()}
    timed: Dict[str, Dict[int, List[StepStats]]] = {label: {b: [] for b in batch_sizes}
                                                    for label in engines}
    probed: Dict[int, List[float]] = {}
    # One device for all the engines compared (they are built alike but for their weights).
    probe = BandwidthProbe(next(iter(engines.values())).device)
    for batch in batch_sizes:
        probe.readings = probed[batch] = []  # the probes between this batch size's steps
        for _ in range(runs):
            for label, engine in engines.items():
                timed[label][batch] += decode_steps(engine, batch, input_len, output_len, 1,
                                                    rng, probe)
    bandwidth = {batch: statistics.median(readings) for batch, readings in probed.items()}
    # The peak before and after the runs, the better kept: a noisy neighbour in one
    # measurement must not lower the bound the runs are judged against.
    peaks = {label: max(peak, measure_peak_flops(engines[label].runner.model,
                                                 engines[label].dtype))
             for label, peak in peaks.items()}
    context = input_len + output_len // 2  # the mean context of the timed steps
    return {"machine_limits": {"bandwidth_gb_per_s_probes": {
                str(batch): [r / 1e9 for r in readings] for batch, readings in probed.items()}},
            "engines": {label: {"weights_mb": step_work(engine, 1, 0)["weight_bytes"] / 1e6,
                                "matrix_peak_gflops": peaks[label] / 1e9,
                                "rows": [_row(engine, batch, steps, context, bandwidth[batch],
                                              peaks[label])
                                         for batch, steps in timed[label].items()]}
                        for label, engine in engines.items()}}


def _row(engine: LLMEngine, batch: int, steps: List[StepStats], context: int,
         bandwidth: float, peak: float) -> Dict[str, Any]:
    step = statistics.median(s.wall_seconds for s in steps)
    # The forward pass alone (decoder stack and LM head): what the kernels reach, apart from
    # the engine's Python around them (scheduling, inputs, sampling, outputs).
    forward = statistics.median(s.forward_seconds for s in steps)
    work = step_work(engine, batch, context)
    bound = max(work["bytes"] / bandwidth, work["flops"] / peak)
    return {"batch": batch, "steps": len(steps), "ms_per_token": 1e3 * step,
            "tokens_per_s": batch / step, "bandwidth_gb_per_s": bandwidth / 1e9,
            "roofline_ms": 1e3 * bound,
            "roofline_tokens_per_s": batch / bound, "share_of_roofline": bound / step,
            "forward_ms": 1e3 * forward, "forward_share_of_roofline": bound / forward,
            "bound": "memory" if work["bytes"] / bandwidth >= work["flops"] / peak
            else "compute",
            "achieved_gb_per_s": work["bytes"] / step / 1e9,
            "achieved_gflops": work["flops"] / step / 1e9}


# ----------------------------------------------------------------- report
def table(data: Dict[str, Any]) -> List[str]:
    lines = ["| weights | batch | ms per output token | tokens/s | machine's bandwidth (GB/s) "
             "| roofline (ms) | share of roofline | forward pass (ms) | its share "
             "| bound by | GB/s achieved | GFLOP/s achieved |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for label, result in data["engines"].items():
        for r in result["rows"]:
            lines.append(f"| {label} | {r['batch']} | {r['ms_per_token']:.1f} | "
                         f"{r['tokens_per_s']:.0f} | {r['bandwidth_gb_per_s']:.1f} | "
                         f"{r['roofline_ms']:.1f} | "
                         f"{100 * r['share_of_roofline']:.0f}% | {r['forward_ms']:.1f} | "
                         f"{100 * r['forward_share_of_roofline']:.0f}% | {r['bound']} | "
                         f"{r['achieved_gb_per_s']:.1f} | {r['achieved_gflops']:.0f} |")
    return lines


def summary(data: Dict[str, Any], json_path: Path, page_dir: Path) -> List[str]:
    """The section docs/performance.md shows of these results (links relative to page_dir)."""
    setup, limits = data["setup"], data["machine_limits"]
    relative = lambda p: os.path.relpath(p, page_dir)  # noqa: E731
    weights = ", ".join(f"{label} {result['weights_mb']:.0f} MB"
                        for label, result in data["engines"].items())
    peaks = ", ".join(f"{label} {result['matrix_peak_gflops']:.0f}"
                      for label, result in data["engines"].items())
    probes = [r for readings in limits["bandwidth_gb_per_s_probes"].values() for r in readings]
    return ["", "## Latency against the roofline", "",
            f"Time per output token at each batch size ({setup['shape']} shape, {setup['dtype']}, "
            f"{_weights_compared(list(data['engines']))}; "
            f"{setup['input_len']}-token prompts, {setup['output_len']} output tokens, median of "
            "the steps where the whole batch decodes, in-process). The roofline is this "
            "machine's own limit, measured in the same run: memory bandwidth by a probe "
            "after every decode step (a reduction over 512 MiB on huge pages, as the weights "
            "are), each row judged against the median of the probes between its own steps "
            f"(the {len(probes)} probes read {min(probes):.1f}-{max(probes):.1f} GB/s: this "
            f"machine's bandwidth drifts), and matrix peak in GFLOP/s {peaks} (each engine's "
            "own MLP projection on 512 rows); a decode step "
            f"must read its weights ({weights}) plus the KV cache. The forward pass is the "
            "same steps' decoder stack and LM head alone, without the engine's Python around "
            "them (scheduling, inputs, sampling, outputs). "
            f"{_where(setup['machine'])}; [raw]({relative(json_path)}); `{setup['command']}` "
            "regenerates it.", "", *table(data), "",
            f"![latency]({relative(json_path.with_suffix('.png'))})"]


def _weights_compared(labels: Sequence[str]) -> str:
    """Which weights the run measured (`--quantizations` may leave either out), as the page
    says it: a page must not claim an int8 engine, or alternating runs, that never ran."""
    int8 = "int8 (`--quantization int8`, the LM head included)"
    if len(labels) > 1:
        return f"with its weights as loaded and with {int8}, runs alternating between the two"
    return f"with {int8}" if labels[0] == "int8" else "with its weights as loaded"


def _where(machine: Dict[str, Any]) -> str:
    """The machine and date of a run (and which kernels ran, where recorded: their build
    for the CPU's instruction set sets every figure)."""
    kernels_used = f", {machine['kernels']} kernels" if "kernels" in machine else ""
    return f"{machine['cpu']}, {machine['cores']} cores{kernels_used}, {machine['date']}"


def plot(data: Dict[str, Any], path: Path) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.2), layout="constrained")
    axis = figure.subplots()
    for (label, result), color in zip(data["engines"].items(), ("tab:blue", "tab:orange")):
        rows = result["rows"]
        batches = [r["batch"] for r in rows]
        axis.plot(batches, [r["tokens_per_s"] for r in rows], "o-", color=color,
                  label=f"fulcrum, {label}")
        axis.plot(batches, [r["roofline_tokens_per_s"] for r in rows], "--", color=color,
                  label=f"roofline, {label}")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("batch size (requests decoding together)")
    axis.set_ylabel("output tokens/s")
    axis.set_title("Decode throughput against this machine's roofline")
    axis.legend()
    figure.savefig(path, dpi=110)


def run_latency(args: argparse.Namespace) -> None:
    from fulcrum.bench.report import machine_facts

    engines = {(args.dtype if q == "none" else q): LLMEngine(EngineConfig(
        model=shape_dir(args.shape), load_format="dummy", dtype=args.dtype,
        max_model_len=args.input_len + args.output_len + 8,
        max_num_seqs=max(256, max(args.batch_sizes)), scheduling_policy="fcfs",
        quantization=None if q == "none" else q)) for q in args.quantizations}
    data = measure(engines, args.batch_sizes, args.input_len, args.output_len, args.num_iters)
    sizes = " ".join(map(str, args.batch_sizes))
    data["setup"] = {"shape": args.shape, "dtype": args.dtype, "input_len": args.input_len,
                     "output_len": args.output_len, "num_iters": args.num_iters,
                     "machine": machine_facts(),
                     "command": f"fulcrum bench latency --shape {args.shape} --batch-sizes "
                                f"{sizes} --input-len {args.input_len} --output-len "
                                f"{args.output_len} --num-iters {args.num_iters} "
                                f"--quantizations {' '.join(args.quantizations)}"
                                + ("" if args.output_dir == DEFAULT_OUTPUT_DIR
                                   else f" --output-dir {args.output_dir}")}
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "latency.json"
    json_path.write_text(json.dumps(data, indent=2) + "\n")
    plot(data, json_path.with_suffix(".png"))
    json_path.with_suffix(".md").write_text("\n".join(
        [summary(data, json_path, out)[1].replace("##", "#"), *summary(data, json_path, out)[3:]])
        + "\n")
    print("\n".join(table(data)))

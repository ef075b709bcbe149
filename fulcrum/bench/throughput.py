"""Offline throughput: `LLM.generate` over a whole dataset at once, as vLLM's
`benchmark_throughput` measures it (load time excluded), optionally next to HF transformers.

The comparison runs each side in its own spawned process, so each peak RSS
(`resource.getrusage`) belongs to that side alone and neither warms the other's caches.
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import resource
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

from fulcrum.bench.datasets import SampleRequest
from fulcrum.sampling_params import SamplingParams

PROBES = 5  # bandwidth readings in a set: it flips between levels within seconds


@dataclass
class ThroughputResult:
    num_requests: int
    input_tokens: int
    output_tokens: int
    elapsed_s: float
    peak_rss_mib: float
    # The compute roofline (fulcrum only; 0: not measured): the FLOPs the workload must do,
    # and the best matrix rate of the engine's own kernel, measured in the same run.
    flops: float = 0.0
    matrix_peak_flops: float = 0.0
    # The roofline kernel by kernel (latency.kernel_roofline_s), which counts the work bound
    # by memory too, at the best bandwidth probed after the run (bytes/s).
    bandwidth: float = 0.0
    kernel_roofline_s: float = 0.0

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.elapsed_s

    @property
    def roofline_s(self) -> float:
        """The time the workload's FLOPs take at the matrix peak, as if no part of it were
        bound by memory (the kernel-by-kernel roofline counts those parts)."""
        return self.flops / self.matrix_peak_flops if self.matrix_peak_flops else 0.0

    @property
    def share_of_roofline(self) -> float:
        return self.roofline_s / self.elapsed_s

    @property
    def share_of_kernel_roofline(self) -> float:
        return self.kernel_roofline_s / self.elapsed_s

    def as_dict(self) -> Dict[str, float]:
        return {**asdict(self), "requests_per_s": self.requests_per_s,
                "output_tokens_per_s": self.output_tokens_per_s,
                "total_tokens_per_s": self.total_tokens_per_s,
                "roofline_s": self.roofline_s, "share_of_roofline": self.share_of_roofline,
                "share_of_kernel_roofline": self.share_of_kernel_roofline}

    def summary(self, name: str) -> str:
        line = (f"{name}: {self.elapsed_s:.2f} s, {self.requests_per_s:.2f} requests/s, "
                f"{self.output_tokens_per_s:.1f} output tokens/s, "
                f"{self.total_tokens_per_s:.1f} total tokens/s, peak RSS "
                f"{self.peak_rss_mib:.0f} MiB")
        if not self.roofline_s:
            return line
        return (f"{line}\n  roofline: {self.flops / 1e12:.2f} TFLOP at this machine's matrix "
                f"peak ({self.matrix_peak_flops / 1e9:.0f} GFLOP/s, the engine's own kernel, "
                f"measured around the run) take {self.roofline_s:.2f} s: "
                f"{100 * self.share_of_roofline:.0f}% of the roofline\n  kernel by kernel, "
                f"memory-bound work at {self.bandwidth / 1e9:.1f} GB/s: "
                f"{self.kernel_roofline_s:.2f} s, {100 * self.share_of_kernel_roofline:.0f}%")


def peak_rss_mib() -> float:
    """This process's peak resident set size (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def measure_fulcrum(model_dir: str, engine_kwargs: Dict[str, Any],
                    requests: List[SampleRequest], show_progress: bool = False) -> ThroughputResult:
    """Greedy, EOS ignored: every request yields exactly its output length. On one rank,
    the rooflines too: the matrix peak is measured before and after the run and the bandwidth
    after it, with the matrix peak between two sets of readings, the best of each kept (a
    noisy neighbour in one measurement must not lower the bound the run is judged against);
    under tensor parallelism this process holds one shard, so none is given."""
    from fulcrum.bench.latency import (BandwidthProbe, kernel_roofline_s, measure_peak_flops,
                                       workload_flops)
    from fulcrum.llm import LLM

    llm = LLM(model_dir, **engine_kwargs)
    engine = llm.llm_engine
    model = engine.runner.model if engine.config.tensor_parallel_size == 1 else None
    peak = measure_peak_flops(model, engine.dtype) if model is not None else 0.0
    params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
              for r in requests]
    first_step = len(engine.stats)
    start = time.perf_counter()
    outputs = llm.generate([r.engine_prompt() for r in requests], params,
                           use_tqdm=show_progress)
    elapsed = time.perf_counter() - start
    prompt_lens = [len(o.prompt_token_ids) for o in outputs]
    output_lens = [len(o.outputs[0].token_ids) for o in outputs]
    result = ThroughputResult(len(requests), sum(prompt_lens), sum(output_lens), elapsed,
                              peak_rss_mib())
    if model is not None:
        steps = list(engine.stats)[first_step:]
        result.flops = workload_flops(model, prompt_lens, output_lens)
        # The probe's 512 MiB comes after the peak RSS is read, so as not to count in it.
        probe = BandwidthProbe(engine.device)
        for _ in range(PROBES):
            probe()
        result.matrix_peak_flops = max(peak, measure_peak_flops(model, engine.dtype))
        for _ in range(PROBES):
            probe()
        result.bandwidth = max(probe.readings)
        result.kernel_roofline_s = kernel_roofline_s(engine, prompt_lens, output_lens, steps,
                                                     result.matrix_peak_flops, result.bandwidth)
    return result


def measure_step_overhead(model_dir: str, engine_kwargs: Dict[str, Any],
                          requests: List[SampleRequest]) -> Dict[str, float]:
    """The share of a step's wall time spent outside the model's forward pass (scheduling,
    input preparation, sampling, detokenisation), over the steps in which every request of
    the batch decodes: medians of step and forward time, and the overhead fraction."""
    from fulcrum.llm import LLM

    llm = LLM(model_dir, **engine_kwargs)
    params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
              for r in requests]
    llm.generate([r.engine_prompt() for r in requests], params, use_tqdm=False)
    steps = [s for s in llm.llm_engine.stats
             if s.num_prefill_tokens == 0 and s.num_decode_tokens == len(requests)]
    wall = statistics.median(s.wall_seconds for s in steps)
    forward = statistics.median(s.forward_seconds for s in steps)
    return {"running_requests": len(requests), "steps": len(steps),
            "step_ms": wall * 1e3, "forward_ms": forward * 1e3,
            "overhead_fraction": statistics.median(
                1 - s.forward_seconds / s.wall_seconds for s in steps)}


def run_isolated(function: Callable[..., Any], *args: Any) -> Any:
    """Run `function(*args)` in a fresh spawned process and return its result."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(function, *args).result()


def write_comparison(fulcrum: ThroughputResult, hf: ThroughputResult, setup: Dict[str, Any],
                     stem: Path) -> Tuple[Path, Path]:
    """`stem`.json (everything) and `stem`.md (a short table) side by side."""
    ratio = fulcrum.output_tokens_per_s / hf.output_tokens_per_s
    stem.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = stem.with_suffix(".json"), stem.with_suffix(".md")
    json_path.write_text(json.dumps({"setup": setup, "fulcrum": fulcrum.as_dict(),
                                     "hf_transformers": hf.as_dict(),
                                     "output_tokens_per_s_ratio": ratio}, indent=2) + "\n")
    rows = [("fulcrum (continuous batching)", fulcrum),
            (f"HF transformers generate (static batches of {setup['hf_batch_size']})", hf)]
    lines = ["# Offline throughput: fulcrum vs HF transformers\n",
             ", ".join(f"{k}: {v}" for k, v in setup.items()) + "\n",
             "| engine | output tokens/s | total tokens/s | requests/s | time (s) "
             "| peak RSS (MiB) |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {name} | {r.output_tokens_per_s:.1f} | {r.total_tokens_per_s:.1f} | "
              f"{r.requests_per_s:.2f} | {r.elapsed_s:.1f} | {r.peak_rss_mib:.0f} |"
              for name, r in rows]
    lines.append(f"\nfulcrum / HF output tokens/s: **{ratio:.2f}x**")
    md_path.write_text("\n".join(lines) + "\n")
    return json_path, md_path

"""Serving metrics from request timelines, with vLLM's serving-benchmark definitions.

Pure functions: the HTTP client and the in-process replay both produce `RequestTimeline`s, so
both report the same numbers the same way.

- TTFT: send to the first chunk carrying a token.  ITL: gaps between successive chunks.
- TPOT: (E2EL - TTFT) / (output tokens - 1), only for requests with more than one token.
- E2EL: send to the last chunk.
- Throughputs divide by the run's duration (first dispatch to last completion).
- Goodput: completed requests meeting every given SLO, per second (DistServe).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

PERCENTILES = (90, 99)
SLO_KEYS = ("ttft_ms", "tpot_ms", "e2el_ms")
ALL = "all"


@dataclass
class RequestTimeline:
    """One request as its client saw it; times in seconds on one clock (perf_counter)."""

    send_time: float
    prompt_len: int
    output_len: int
    chunk_times: List[float] = field(default_factory=list)
    group: str = ALL
    success: bool = True
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.send_time

    @property
    def e2el(self) -> float:
        return self.chunk_times[-1] - self.send_time

    @property
    def itl(self) -> List[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> Optional[float]:
        if self.output_len < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_len - 1)

    @property
    def completed(self) -> bool:
        return self.success and bool(self.chunk_times)


def summarize_ms(seconds: List[float]) -> Dict[str, Optional[float]]:
    """Mean, median, p90 and p99 in milliseconds (numpy's linear interpolation, as vLLM)."""
    if not seconds:
        return {"mean": None, "median": None, **{f"p{p}": None for p in PERCENTILES}}
    ms = np.asarray(seconds) * 1000.0
    summary = {"mean": float(ms.mean()), "median": float(np.median(ms))}
    summary.update({f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES})
    return summary


def meets_slo(timeline: RequestTimeline, slo: Dict[str, float]) -> bool:
    """A single-token request has no TPOT; it counts as 0, as in vLLM."""
    observed = {"ttft_ms": timeline.ttft * 1000, "e2el_ms": timeline.e2el * 1000,
                "tpot_ms": (timeline.tpot or 0.0) * 1000}
    return all(observed[key] <= limit for key, limit in slo.items())


def compute_report(timelines: List[RequestTimeline], duration: float,
                   slo: Optional[Dict[str, float]] = None) -> Dict[str, object]:
    """The report of one group of requests over a run of `duration` seconds."""
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    slo = slo or {}
    unknown = set(slo) - set(SLO_KEYS)
    if unknown:
        raise ValueError(f"unknown SLO {sorted(unknown)}; use {', '.join(SLO_KEYS)}")
    done = [t for t in timelines if t.completed]
    input_tokens = sum(t.prompt_len for t in done)
    output_tokens = sum(t.output_len for t in done)
    report: Dict[str, object] = {
        "duration_s": duration,
        "completed": len(done),
        "failed": len(timelines) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "ttft_ms": summarize_ms([t.ttft for t in done]),
        "tpot_ms": summarize_ms([t.tpot for t in done if t.tpot is not None]),
        "itl_ms": summarize_ms([gap for t in done for gap in t.itl]),
        "e2el_ms": summarize_ms([t.e2el for t in done]),
    }
    if slo:
        report["slo"] = dict(slo)
        report["goodput"] = sum(meets_slo(t, slo) for t in done) / duration
    return report


def report_by_group(timelines: List[RequestTimeline], duration: float,
                    slo: Optional[Dict[str, float]] = None) -> Dict[str, Dict[str, object]]:
    """{"all": report} plus one report per group when the requests come in several groups."""
    reports = {ALL: compute_report(timelines, duration, slo)}
    groups = sorted({t.group for t in timelines})
    if len(groups) > 1:
        for group in groups:
            reports[group] = compute_report([t for t in timelines if t.group == group],
                                            duration, slo)
    return reports


def format_report(reports: Dict[str, Dict[str, object]]) -> str:
    """A plain-text table in the spirit of vLLM's, one section per request group."""
    lines = []
    for group, report in reports.items():
        lines.append(f"{' ' + group + ' requests ':=^56}")
        rows = [("Successful requests", report["completed"]),
                ("Failed requests", report["failed"]),
                ("Benchmark duration (s)", report["duration_s"]),
                ("Total input tokens", report["total_input_tokens"]),
                ("Total generated tokens", report["total_output_tokens"]),
                ("Request throughput (req/s)", report["request_throughput"]),
                ("Output token throughput (tok/s)", report["output_throughput"]),
                ("Total token throughput (tok/s)", report["total_token_throughput"])]
        if "goodput" in report:
            rows.append(("Goodput (req/s)", report["goodput"]))
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            name = metric[:-3].upper()
            rows += [(f"{stat.capitalize()} {name} (ms)", value)
                     for stat, value in report[metric].items()]
        for name, value in rows:
            shown = "-" if value is None else (f"{value:.2f}" if isinstance(value, float)
                                               else str(value))
            lines.append(f"{name:<40}{shown:>16}")
    return "\n".join(lines)

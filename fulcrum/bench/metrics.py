"""Serving metrics from request timelines, with vLLM's serving-benchmark definitions.

Pure functions: the HTTP client and the in-process replay both produce `RequestTimeline`s, so
both report the same numbers the same way.

- TTFT: send to the first chunk carrying a token.  ITL: gaps between successive chunks.
- TPOT: (E2EL - TTFT) / (output tokens - 1), only for requests with more than one token.
- E2EL: send to the last chunk.
- Throughputs divide by the run's duration (first dispatch to last completion).
- Goodput (DistServe; vLLM's `--goodput`): completed requests that meet every given target,
  per second of the run. Targets are in milliseconds for `ttft`, `tpot` and `e2el`; a request
  meets one when its value is <= the target (vLLM's `target >= value`). A request with a
  single output token has no TPOT and counts as TPOT 0 (it meets any TPOT target), as in
  vLLM. `goodput_share` is the share of the group's requests, failed ones included (a failed
  request met nothing), that meet every target; `slo_attainment` the same share per target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional

import numpy as np

PERCENTILES = (90, 99)
GOODPUT_KEYS = ("ttft", "tpot", "e2el")  # vLLM's names, values in milliseconds
# The older spelling (`--slo ttft_ms=500`), still accepted everywhere a target dict is.
SLO_KEYS = tuple(f"{key}_ms" for key in GOODPUT_KEYS)
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


def parse_goodput(items: Iterable[str], alias: bool = False) -> Dict[str, float]:
    """Targets in milliseconds from vLLM's `--goodput` items (`ttft:500 tpot:50 e2el:2000`),
    or, with `alias`, from the older `--slo` items (`ttft_ms=500`). Raises ValueError naming
    the bad item for an unknown key, a missing or non-numeric value, a negative or non-finite
    one, or a key given twice."""
    flag, separator, keys = ("--slo", "=", SLO_KEYS) if alias else ("--goodput", ":",
                                                                    GOODPUT_KEYS)
    usage = (f"use KEY{separator}MILLISECONDS with KEY one of {', '.join(keys)}, e.g. "
             f"{flag} {keys[0]}{separator}1000 {keys[1]}{separator}100")
    targets: Dict[str, float] = {}
    for item in items:
        key, found, value = item.partition(separator)
        key = key.strip()
        if not found:
            raise ValueError(f"bad {flag} item {item!r}: no {separator!r}; {usage}")
        if key not in keys:
            raise ValueError(f"bad {flag} item {item!r}: unknown target {key!r}; {usage}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"bad {flag} item {item!r}: {value!r} is not a number of "
                             f"milliseconds; {usage}") from None
        if not math.isfinite(ms) or ms < 0:
            raise ValueError(f"bad {flag} item {item!r}: the target must be a finite, "
                             f"non-negative number of milliseconds")
        name = key.removesuffix("_ms")
        if name in targets:
            raise ValueError(f"bad {flag} item {item!r}: a {name} target is already given")
        targets[name] = ms
    return targets


def normalize_targets(targets: Optional[Dict[str, float]]) -> Dict[str, float]:
    """{"ttft"|"tpot"|"e2el": ms}, from keys in either spelling ("ttft" or "ttft_ms")."""
    normalized: Dict[str, float] = {}
    for key, ms in (targets or {}).items():
        name = key[:-3] if key in SLO_KEYS else key
        if name not in GOODPUT_KEYS:
            raise ValueError(f"unknown SLO {key!r}; use {', '.join(GOODPUT_KEYS)} (or "
                             f"{', '.join(SLO_KEYS)})")
        if name in normalized:
            raise ValueError(f"SLO {name!r} given twice")
        normalized[name] = float(ms)
    return normalized


def observed_ms(timeline: RequestTimeline) -> Dict[str, float]:
    """What the targets are compared with: TTFT, TPOT (0 for one token) and E2EL in ms."""
    return {"ttft": timeline.ttft * 1000, "e2el": timeline.e2el * 1000,
            "tpot": (timeline.tpot or 0.0) * 1000}


def meets_slo(timeline: RequestTimeline, slo: Dict[str, float]) -> bool:
    """Whether a completed request meets every target (value <= target, as vLLM). A
    single-token request has no TPOT; it counts as 0, as in vLLM."""
    observed = observed_ms(timeline)
    return all(observed[key] <= limit for key, limit in normalize_targets(slo).items())


def goodput_report(timelines: List[RequestTimeline], duration: float,
                   slo: Dict[str, float]) -> Dict[str, object]:
    """Goodput (req/s), the good requests, their share and the share per target."""
    targets = normalize_targets(slo)
    done = [observed_ms(t) for t in timelines if t.completed]
    good = sum(all(o[k] <= ms for k, ms in targets.items()) for o in done)
    total = len(timelines)
    share = (lambda count: count / total if total else None)  # noqa: E731
    return {
        "slo": targets,
        "good_requests": good,
        "goodput": good / duration,
        "goodput_share": share(good),
        "slo_attainment": {key: share(sum(o[key] <= ms for o in done))
                           for key, ms in targets.items()},
    }


def compute_report(timelines: List[RequestTimeline], duration: float,
                   slo: Optional[Dict[str, float]] = None) -> Dict[str, object]:
    """The report of one group of requests over a run of `duration` seconds."""
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    slo = normalize_targets(slo)
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
        report.update(goodput_report(timelines, duration, slo))
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
            rows += _goodput_rows(report)
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            name = metric[:-3].upper()
            rows += [(f"{stat.capitalize()} {name} (ms)", value)
                     for stat, value in report[metric].items()]
        for name, value in rows:
            shown = "-" if value is None else (f"{value:.2f}" if isinstance(value, float)
                                               else str(value))
            lines.append(f"{name:<40}{shown:>16}")
    return "\n".join(lines)


def _goodput_rows(report: Dict[str, object]) -> List[tuple]:
    targets = " ".join(f"{k}:{v:g}" for k, v in report["slo"].items())
    percent = lambda share: None if share is None else 100.0 * share  # noqa: E731
    rows = [("Goodput targets (ms)", targets),
            ("Request goodput (req/s)", report["goodput"]),
            ("Good requests", report["good_requests"]),
            ("Within all targets (%)", percent(report["goodput_share"]))]
    rows += [(f"Within {key.upper()} target (%)", percent(share))
             for key, share in report["slo_attainment"].items()]
    return rows

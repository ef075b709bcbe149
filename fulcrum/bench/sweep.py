"""`fulcrum bench sweep`: one serving scenario under a grid of scheduler settings, and the
trade-off it shows: total throughput against short-request TTFT p99 and against TPOT p99.

Each setting runs the same schedule (same prompts, same arrival times) through an in-process
engine (see replay.py). The Pareto front (no other setting has both more throughput and
lower latency) is what a user should choose from; everything else is dominated.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from fulcrum.bench.arrivals import Schedule
from fulcrum.bench.datasets import SHORT
from fulcrum.bench.metrics import ALL, report_by_group
from fulcrum.bench.replay import bench_params, replay
from fulcrum.config import EngineConfig
from fulcrum.engine import LLMEngine

# The knobs shown in the table, with short names for plot labels.
KNOBS = {"max_num_batched_tokens": "budget", "long_prefill_token_threshold": "lpt",
         "max_num_seqs": "seqs", "enable_chunked_prefill": "chunked",
         "batching_mode": "mode"}
DEFAULT_GRID = ("max_num_batched_tokens=256,1024,4096", "long_prefill_token_threshold=64",
                "enable_chunked_prefill=false", "batching_mode=static")
AXES = (("ttft_p99_ms", "TTFT p99 (ms)"), ("tpot_p99_ms", "TPOT p99 (ms)"))


def _parse_value(text: str) -> Any:
    """A grid value as EngineConfig takes it: a bool, None, an int, a float, else the text."""
    words = {"true": True, "false": False, "none": None}
    if text.lower() in words:
        return words[text.lower()]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_grid(specs: Sequence[str]) -> List[Dict[str, Any]]:
    """Each spec ("key=v1,v2 key2=v3") is a Cartesian product; the grid is their union.

    Keys are EngineConfig fields (dashes or underscores); settings not named keep defaults.
    """
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    settings: List[Dict[str, Any]] = []
    for spec in specs:
        axes = {}
        for item in spec.split():
            key, _, values = item.partition("=")
            key = key.replace("-", "_")
            if key not in fields or key == "model" or not values:
                raise ValueError(f"bad grid item {item!r}: expected FIELD=V1,V2 with an "
                                 "EngineConfig field other than model")
            axes[key] = [_parse_value(v) for v in values.split(",")]
        for combo in itertools.product(*axes.values()):
            setting = dict(zip(axes, combo))
            if setting not in settings:
                settings.append(setting)
    return settings


def label(setting: Dict[str, Any]) -> str:
    return " ".join(f"{KNOBS.get(k, k)}={v}" for k, v in setting.items()) or "defaults"


def config_for(model_dir: str, engine_kwargs: Dict[str, Any], setting: Dict[str, Any],
               max_model_len: int) -> EngineConfig:
    """max_model_len defaults to the scenario's longest request. Without chunking a whole
    prompt must fit one step, so the budget is raised to max_model_len there; the table shows
    the budget actually used. Every point's config is built before the first runs, so a bad
    value fails the sweep at once."""
    kwargs = {**engine_kwargs, **setting}
    kwargs["max_model_len"] = kwargs.get("max_model_len") or max_model_len
    config = EngineConfig(model=model_dir, **kwargs)
    budget = config.max_num_batched_tokens
    if not config.chunked_prefill and budget is not None and budget < config.max_model_len:
        config = dataclasses.replace(config, max_num_batched_tokens=config.max_model_len)
    return config


def longest_request(timed: Schedule) -> int:
    return max(r.prompt_len + r.output_len for _, r in timed)


def warm_up(engine: LLMEngine) -> None:
    """One small request first, so one-off start-up costs do not land on the first point."""
    engine.add_request("warm-up", {"prompt_token_ids": [1, 2, 3]}, bench_params(2))
    while engine.has_unfinished_requests():
        engine.step()


def run_point(model_dir: str, engine_kwargs: Dict[str, Any], setting: Dict[str, Any],
              timed: Schedule) -> Dict[str, Any]:
    engine = LLMEngine(config_for(model_dir, engine_kwargs, setting, longest_request(timed)))
    warm_up(engine)
    timelines, duration = replay(engine, timed)
    reports = report_by_group(timelines, duration)
    latency_group = SHORT if SHORT in reports else ALL
    return {"label": label(setting), "setting": setting,
            "config": {k: getattr(engine.config, k) for k in KNOBS},
            "total_token_throughput": reports[ALL]["total_token_throughput"],
            "request_throughput": reports[ALL]["request_throughput"],
            "latency_group": latency_group,
            "ttft_p99_ms": reports[latency_group]["ttft_ms"]["p99"],
            "tpot_p99_ms": reports[latency_group]["tpot_ms"]["p99"],
            "reports": reports}


def pareto_front(points: Sequence[tuple]) -> List[bool]:
    """For (throughput, latency) pairs: True where no other point is at least as good in both
    and better in one. Points with no latency are never on the front."""
    def dominated(p: tuple) -> bool:
        return any(q[1] is not None and q[0] >= p[0] and q[1] <= p[1] and q != p
                   for q in points)
    return [p[1] is not None and not dominated(p) for p in points]


def mark_fronts(results: List[Dict[str, Any]]) -> None:
    for key, _ in AXES:
        front = pareto_front([(r["total_token_throughput"], r[key]) for r in results])
        for result, on_front in zip(results, front):
            result[f"pareto_{key}"] = on_front


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(results: List[Dict[str, Any]]) -> str:
    """Markdown; * marks a Pareto-optimal point on that latency."""
    header = (["setting"] + list(KNOBS.values())
              + ["total tok/s", "req/s", "TTFT p99 ms", "TPOT p99 ms"])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        marks = [_fmt(r[key]) + (" *" if r[f"pareto_{key}"] else "") for key, _ in AXES]
        cells = ([r["label"]] + [str(r["config"][k]) for k in KNOBS]
                 + [_fmt(r["total_token_throughput"]), f"{r['request_throughput']:.2f}"] + marks)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: List[Dict[str, Any]], path: Path, title: str) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(13, 5.5), layout="constrained")
    group = results[0]["latency_group"]
    for axis, (key, name) in zip(figure.subplots(1, 2), AXES):
        drawn = [r for r in results if r[key] is not None]
        front = sorted((r for r in drawn if r[f"pareto_{key}"]),
                       key=lambda r: r["total_token_throughput"])
        axis.scatter([r["total_token_throughput"] for r in drawn], [r[key] for r in drawn],
                     color="tab:gray", label="setting")
        axis.plot([r["total_token_throughput"] for r in front], [r[key] for r in front],
                  "o-", color="tab:red", label="Pareto front")
        for r in drawn:
            axis.annotate(r["label"], (r["total_token_throughput"], r[key]), fontsize=7,
                          xytext=(4, 4), textcoords="offset points")
        axis.set_xlabel("total token throughput (tokens/s)")
        axis.set_ylabel(f"{group} requests' {name}")
        axis.grid(alpha=0.3)
        axis.legend(loc="best", fontsize=8)
    figure.suptitle(title)
    figure.savefig(path, dpi=120)


def write_outputs(results: List[Dict[str, Any]], out_dir: Path, title: str) -> List[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "sweep.png", out_dir / "sweep.md", out_dir / "sweep.json"]
    plot(results, paths[0], title)
    paths[1].write_text(f"# {title}\n\n{table(results)}\n\n* Pareto-optimal on that latency.\n")
    paths[2].write_text(json.dumps({"title": title, "points": results}, indent=2) + "\n")
    return paths

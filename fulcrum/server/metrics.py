"""The server's Prometheus metrics: the engine's (fulcrum.metrics), recorded from the engine
loop's step reports on the event loop, plus the loop's own busy and forward time and the
process's (resident memory, CPU time, open files: prometheus_client's ProcessCollector)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Dict, Iterator, Optional

from prometheus_client import ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from fulcrum.async_engine import AsyncLLM
from fulcrum.metrics import EngineMetrics
from fulcrum.core.scheduler import SchedulerStats

logger = logging.getLogger(__name__)


class _LoopCollector(Collector):
    """Reads the engine loop's cumulative busy and forward time at scrape time."""

    def __init__(self, async_llm: AsyncLLM, labels: Dict[str, str]) -> None:
        self._async_llm = async_llm
        self._labels = labels

    def collect(self) -> Iterator:
        stats = self._async_llm.loop_stats
        names, values = list(self._labels), list(self._labels.values())
        busy = CounterMetricFamily("fulcrum:engine_loop_busy_seconds",
                                   "Wall time of engine loop iterations that had work",
                                   labels=names)
        busy.add_metric(values, stats.busy_seconds)
        forward = CounterMetricFamily("fulcrum:engine_loop_forward_seconds",
                                      "Time the engine loop spent in the model's forward pass",
                                      labels=names)
        forward.add_metric(values, stats.forward_seconds)
        overhead = GaugeMetricFamily("fulcrum:engine_loop_overhead_fraction",
                                     "Share of the loop's busy time outside the forward pass",
                                     labels=names)
        overhead.add_metric(values, stats.overhead_fraction)
        return iter((busy, forward, overhead))


class ServerMetrics(EngineMetrics):
    def __init__(self, async_llm: AsyncLLM, model_name: str) -> None:
        super().__init__(async_llm.engine, model_name)
        self.registry.register(_LoopCollector(async_llm, self._labels))
        ProcessCollector(registry=self.registry)
        async_llm.add_listener(self.record)


class StatsLogger:
    """vLLM's periodic stats line: every `interval` seconds (None: never; it must be None
    without `metrics`), the prompt and generation throughput since the last line, the
    queues, the KV cache's use and the prefix cache's hit rate. Quiet while the server is
    idle."""

    def __init__(self, async_llm: AsyncLLM, metrics: Optional[EngineMetrics],
                 interval: Optional[float]) -> None:
        self.async_llm, self.metrics, self.interval = async_llm, metrics, interval

    async def run(self) -> None:
        if self.interval is None:
            return
        since, seen = time.monotonic(), dict(self.metrics.totals)
        while True:
            await asyncio.sleep(self.interval)
            now, totals = time.monotonic(), dict(self.metrics.totals)
            try:
                stats = self.async_llm.engine.scheduler.stats()
            except RuntimeError:  # a queue changed under the read: next time
                continue
            line = stats_line(now - since, totals["prompt_tokens"] - seen["prompt_tokens"],
                              totals["generation_tokens"] - seen["generation_tokens"], stats)
            if line:
                logger.info(line)
            since, seen = now, totals


def stats_line(seconds: float, prompt_tokens: int, generation_tokens: int,
               stats: SchedulerStats) -> Optional[str]:
    """The line for an interval, or None if nothing ran and nothing waits."""
    if not (prompt_tokens or generation_tokens or stats.num_running or stats.num_waiting):
        return None
    queries = stats.prefix_cache_queries
    hit_rate = stats.prefix_cache_hits / queries if queries else 0.0
    return (f"Avg prompt throughput: {prompt_tokens / seconds:.1f} tokens/s, "
            f"Avg generation throughput: {generation_tokens / seconds:.1f} tokens/s, "
            f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {100 * stats.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {100 * hit_rate:.1f}%")

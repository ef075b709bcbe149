"""Prometheus metrics of one engine, fed by its step reports (the server's /metrics, and
`LLM.get_metrics()`).

Names follow vLLM's (`vllm:` becomes `fulcrum:`), so existing dashboards need only the
prefix changed. Every collector lives in a private CollectorRegistry per engine, so two
engines in one process (as in the tests) never share counts. In the server, updates run on
the event loop, from `AsyncLLM`'s listener hook, never on the engine thread.

The queue and KV-cache gauges are set from every step report and refreshed from a live
snapshot of the scheduler at each scrape: when the last request is aborted, or finishes, no
later step may report the idle state, and a scrape must not show it still running. The
snapshot is read from the event loop while the engine thread runs on; its fields are plain
counts, each consistent on its own. `process_*` metrics (resident memory, CPU time, open
files) come from prometheus_client's ProcessCollector.

vLLM's series (under `fulcrum:`): request counts by finish reason, prompt and generation
token counters, TTFT, e2e, queue, prefill (first scheduled -> first token), decode (first
-> last token) and inference (first scheduled -> last token) time histograms,
`request_time_per_output_token_seconds` (each request's mean),
`time_per_output_token_seconds` and `inter_token_latency_seconds` (every gap between a
request's outputs, vLLM's meaning), per-request prompt / generation token and `n` /
`max_tokens` histograms, `iteration_tokens_total`, queue and KV-cache gauges, prefix-cache
queries and hits, preemptions, and `cache_config_info`.

As in vLLM, where each of a request's n completions runs as a request of its own, the
request series count completions: a request with n = 3 adds 3 to `request_success`, its
prompt 3 times to `prompt_tokens`, 3 TTFTs. `request_time_per_output_token_seconds` is a
completion's decode time (first to last token) over its tokens after the first, 0 for a
single token (vLLM's). Latencies come from the engine's request timestamps where they are
set once (arrival, first scheduled, first token, last token, finished) and otherwise from
the report's step time, which is when the step's tokens left the engine; an output with no
new token (an abort) is no inter-token gap.

Latency targets (SLOs) and the per-step budget, fulcrum's own (vLLM has no equivalent except
`vllm:iteration_tokens_total`, kept here under its name):

- `fulcrum:request_slo_total{target, result}`: counter of finished requests, `target` one of
  `ttft`, `tpot`, `all` (both), `result` `met` or `missed`. Each request that finished with
  reason `stop` or `length` (not `abort` or `error`) adds 1 to each target's `met` or
  `missed`, judged against the targets it was scheduled for (`RequestMetrics.slo`: its own
  `slo_ttft_ms`/`slo_tpot_ms`, else the engine's defaults). TTFT is met when
  first token - arrival <= the TTFT target; TPOT (vLLM's definition) when
  (last token - first token) / (output tokens - 1) <= the TPOT target, and always for a
  request of one output token; an infinite target is always met. Each of a request's n
  completions is judged on its own. Attainment = met / (met + missed) per target.
- `fulcrum:slo_ttft_target_seconds`, `fulcrum:slo_tpot_target_seconds`: gauges, the
  engine's default targets now (`LLMEngine.slo_defaults`; +Inf when there is none).
- Per engine step (every step the engine takes, empty ones included, one observation each):
  histograms `fulcrum:iteration_prefill_tokens` and `fulcrum:iteration_decode_tokens` (the
  step's budget split: prompt tokens computed, decode tokens computed),
  `fulcrum:iteration_tokens_total` (their sum, vLLM's), `fulcrum:step_time_seconds` (the
  step's measured wall time) and `fulcrum:step_time_predicted_seconds` (what the step-time
  model expected before running it), and gauges `fulcrum:last_step_prefill_tokens`,
  `fulcrum:last_step_decode_tokens`, `fulcrum:last_step_time_seconds`,
  `fulcrum:last_step_time_predicted_seconds` of the latest step. Mean split and mean step
  time over a window come from the histograms' `_sum / _count` rates.
- `fulcrum:step_time_prediction_error_ratio`: histogram of |actual - predicted| / actual per
  step that computed something (an empty step has no prediction to judge).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from fulcrum.outputs import CompletionOutput, RequestOutput
from fulcrum.core.request import RequestMetrics
from fulcrum.sampling_params import SamplingParams
from fulcrum.stats import StepReport, StepStats

# vLLM's bounds at the top (a request may wait or run for many minutes on a CPU: past the
# last bound every quantile reads as that bound); finer ones below a second, where a CPU
# engine's TTFT, queue and token times fall.
_UNDER_160_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
LATENCY_BUCKETS = _UNDER_160_S + (640.0, 2560.0)  # vLLM's time_to_first_token buckets' top
REQUEST_LATENCY_BUCKETS = _UNDER_160_S + (240.0, 480.0, 960.0, 1920.0, 7680.0)  # vLLM's e2e
TOKEN_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                         0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                         80.0)  # vLLM's inter_token_latency buckets' top
FINISH_REASONS = ("stop", "length", "abort", "error")
STEP_TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15,
                     0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
PREDICTION_ERROR_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)
SLO_TARGETS = ("ttft", "tpot", "all")
SLO_RESULTS = ("met", "missed")
SLO_FINISH_REASONS = ("stop", "length")  # requests that ran their course


def token_buckets(max_num_batched_tokens: int) -> Tuple[int, ...]:
    """1, 2, 4, ... below the step budget, then the budget itself (as vLLM's
    iteration_tokens_total, whose buckets end at max_num_batched_tokens)."""
    buckets, size = [], 1
    while size < max_num_batched_tokens:
        buckets.append(size)
        size *= 2
    return tuple(buckets) + (max_num_batched_tokens,)


def length_buckets(max_model_len: int) -> Tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's build_1_2_5_buckets)."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > max_model_len:
                return tuple(buckets)
            buckets.append(step * scale)
        scale *= 10


def slo_results(metrics: RequestMetrics, num_output_tokens: int) -> Dict[str, bool]:
    """{"ttft", "tpot", "all": met?} of a finished request against `metrics.slo`."""
    targets = metrics.slo
    ttft = metrics.time_to_first_token
    ttft_met = math.isinf(targets.ttft_s) or (ttft is not None and ttft <= targets.ttft_s)
    if math.isinf(targets.tpot_s) or num_output_tokens <= 1:
        tpot_met = True
    elif metrics.first_token_time is None or metrics.last_token_time is None:
        tpot_met = False
    else:
        tpot = (metrics.last_token_time - metrics.first_token_time) / (num_output_tokens - 1)
        tpot_met = tpot <= targets.tpot_s
    return {"ttft": ttft_met, "tpot": tpot_met, "all": ttft_met and tpot_met}


@dataclass
class _Progress:
    """What the metrics remember about a completion between its outputs."""

    tokens: int = 0
    prompt_counted: bool = False
    last_time: Optional[float] = None  # when its latest tokens left the engine
    # Counted as finished: it comes again in its request's later CUMULATIVE outputs (while
    # its siblings run on) and in an error output, and must not count twice.
    finished: bool = False


class EngineMetrics:
    """`engine` is an LLMEngine (or what of one the metrics read: config, slo_defaults,
    scheduler, block_manager)."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self._engine = engine
        self._labels = {"model_name": model_name}
        # request id -> completion index -> progress, until the request's last output
        self._progress: Dict[str, Dict[int, _Progress]] = {}
        self._last_stats: StepStats | None = None
        # Plain running totals, for the server's stats line.
        self.totals = {"prompt_tokens": 0, "generation_tokens": 0}
        self._define_gauges()
        self._define_counters()
        self._define_histograms()

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, list(self._labels), registry=self.registry).labels(**self._labels)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, list(self._labels),
                       registry=self.registry).labels(**self._labels)

    def _histogram(self, name: str, doc: str, buckets: Iterable[float]) -> Histogram:
        return Histogram(name, doc, list(self._labels), buckets=tuple(buckets),
                         registry=self.registry).labels(**self._labels)

    def _define_gauges(self) -> None:
        self.running = self._gauge("fulcrum:num_requests_running", "Requests in the running batch")
        self.waiting = self._gauge("fulcrum:num_requests_waiting", "Requests waiting to run")
        self.preempted = self._gauge("fulcrum:num_requests_preempted",
                                     "Waiting requests that were preempted and must resume")
        self.kv_usage = self._gauge("fulcrum:kv_cache_usage_perc",
                                    "Fraction of KV-cache blocks in use (1 = full)")
        self.kv_blocks_used = self._gauge("fulcrum:kv_cache_blocks_used",
                                          "KV-cache blocks referenced by requests (blocks "
                                          "kept only for the prefix cache count as free)")
        self.hit_rate = self._gauge("fulcrum:prefix_cache_hit_rate",
                                    "Share of looked-up prompt tokens found in the prefix cache")
        self.slo_ttft_target = self._gauge("fulcrum:slo_ttft_target_seconds",
                                           "The engine's default time-to-first-token target "
                                           "(requests may set their own)")
        self.slo_tpot_target = self._gauge("fulcrum:slo_tpot_target_seconds",
                                           "The engine's default time-per-output-token target "
                                           "(requests may set their own)")
        self.last_prefill_tokens = self._gauge("fulcrum:last_step_prefill_tokens",
                                               "Prompt tokens computed by the latest step")
        self.last_decode_tokens = self._gauge("fulcrum:last_step_decode_tokens",
                                              "Decode tokens computed by the latest step")
        self.last_step_time = self._gauge("fulcrum:last_step_time_seconds",
                                          "Measured wall time of the latest step")
        self.last_step_predicted = self._gauge("fulcrum:last_step_time_predicted_seconds",
                                               "Step-time model's prediction for the latest step")
        self._refresh_slo_targets()
        config = self._engine.config
        info = Gauge("fulcrum:cache_config_info", "The KV cache's configuration (value 1)",
                     list(self._labels) + ["block_size", "num_gpu_blocks", "cache_dtype",
                                           "enable_prefix_caching", "gpu_memory_utilization"],
                     registry=self.registry)
        info.labels(block_size=str(config.block_size),
                    num_gpu_blocks=str(self._engine.block_manager.num_blocks),
                    cache_dtype=str(config.kv_cache_dtype),
                    enable_prefix_caching=str(config.enable_prefix_caching),
                    gpu_memory_utilization=str(config.gpu_memory_utilization),
                    **self._labels).set(1)

    def _define_counters(self) -> None:
        self.finished = Counter("fulcrum:request_success", "Finished requests by finish reason",
                                list(self._labels) + ["finished_reason"], registry=self.registry)
        for reason in FINISH_REASONS:
            self.finished.labels(finished_reason=reason, **self._labels)
        self.prompt_tokens = self._counter("fulcrum:prompt_tokens", "Prompt tokens of requests")
        self.generation_tokens = self._counter("fulcrum:generation_tokens", "Generated tokens")
        self.preemptions = self._counter("fulcrum:num_preemptions", "Preemptions")
        self.cache_queries = self._counter("fulcrum:prefix_cache_queries",
                                           "Prompt tokens looked up in the prefix cache")
        self.cache_hits = self._counter("fulcrum:prefix_cache_hits",
                                        "Prompt tokens found in the prefix cache")
        self.slo = Counter("fulcrum:request_slo",
                           "Requests finished with reason stop or length, by whether they met "
                           "their latency target (target: ttft, tpot, or all = both)",
                           list(self._labels) + ["target", "result"], registry=self.registry)
        self._slo_children = {(target, result): self.slo.labels(target=target, result=result,
                                                                **self._labels)
                              for target in SLO_TARGETS for result in SLO_RESULTS}

    def _define_histograms(self) -> None:
        self.ttft = self._histogram("fulcrum:time_to_first_token_seconds",
                                    "Arrival to first token", LATENCY_BUCKETS)
        self.tpot = self._histogram("fulcrum:request_time_per_output_token_seconds",
                                    "Mean time per output token after the first, per request",
                                    TOKEN_LATENCY_BUCKETS)
        self.token_gap = self._histogram("fulcrum:time_per_output_token_seconds",
                                         "Time between a request's consecutive outputs (vLLM's "
                                         "older name for inter_token_latency)",
                                         TOKEN_LATENCY_BUCKETS)
        self.itl = self._histogram("fulcrum:inter_token_latency_seconds",
                                   "Time between a request's consecutive outputs",
                                   TOKEN_LATENCY_BUCKETS)
        self.e2e = self._histogram("fulcrum:e2e_request_latency_seconds",
                                   "Arrival to finish", REQUEST_LATENCY_BUCKETS)
        self.queue_time = self._histogram("fulcrum:request_queue_time_seconds",
                                          "Arrival to first scheduled", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = self._histogram("fulcrum:request_prefill_time_seconds",
                                            "First scheduled to first token",
                                            REQUEST_LATENCY_BUCKETS)
        self.decode_time = self._histogram("fulcrum:request_decode_time_seconds",
                                           "First token to last token", REQUEST_LATENCY_BUCKETS)
        self.inference_time = self._histogram("fulcrum:request_inference_time_seconds",
                                              "First scheduled to last token",
                                              REQUEST_LATENCY_BUCKETS)
        lengths = length_buckets(self._engine.config.max_model_len)
        self.request_prompt_tokens = self._histogram("fulcrum:request_prompt_tokens",
                                                     "Prompt tokens per request", lengths)
        self.request_generation_tokens = self._histogram(
            "fulcrum:request_generation_tokens", "Generated tokens per finished request",
            lengths)
        self.params_n = self._histogram("fulcrum:request_params_n", "The n of each request",
                                        (1, 2, 5, 10, 20))
        self.params_max_tokens = self._histogram("fulcrum:request_params_max_tokens",
                                                 "The max_tokens of each request", lengths)
        tokens = token_buckets(self._engine.config.max_num_batched_tokens)
        self.step_prefill_tokens = self._histogram("fulcrum:iteration_prefill_tokens",
                                                   "Prompt tokens computed per engine step",
                                                   tokens)
        self.step_decode_tokens = self._histogram("fulcrum:iteration_decode_tokens",
                                                  "Decode tokens computed per engine step",
                                                  tokens)
        self.step_tokens = self._histogram("fulcrum:iteration_tokens_total",
                                           "Tokens (prompt + decode) computed per engine step",
                                           tokens)
        self.step_time = self._histogram("fulcrum:step_time_seconds",
                                         "Measured wall time of each engine step",
                                         STEP_TIME_BUCKETS)
        self.step_predicted = self._histogram("fulcrum:step_time_predicted_seconds",
                                              "Step time the step-time model predicted for "
                                              "each engine step", STEP_TIME_BUCKETS)
        self.step_error = self._histogram("fulcrum:step_time_prediction_error_ratio",
                                          "|actual - predicted| / actual step time, per step "
                                          "that computed tokens", PREDICTION_ERROR_BUCKETS)

    # ------------------------------------------------------------- updates
    def record_params(self, params: SamplingParams, max_tokens: int) -> None:
        """A request arrived with these parameters (`max_tokens`: its effective limit)."""
        self.params_n.observe(params.n)
        self.params_max_tokens.observe(max_tokens)

    def record(self, report: StepReport, cumulative: bool = False) -> None:
        """One step's stats and outputs; `cumulative`: outputs carry all tokens so far
        (RequestOutputKind CUMULATIVE or FINAL_ONLY), not only the new ones."""
        if report.stats is not None:
            self._record_step(report.stats, report.num_preempted)
        for output in report.outputs:
            self._record_output(output, report.time, cumulative)

    def _record_step(self, stats: StepStats, num_preempted: int) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.preempted.set(num_preempted)
        self.kv_usage.set(stats.kv_cache_usage)
        self.kv_blocks_used.set(stats.kv_blocks_used)
        last = self._last_stats
        self.preemptions.inc(stats.num_preemptions_total
                             - (last.num_preemptions_total if last else 0))
        self.cache_queries.inc(stats.prefix_cache_queries
                               - (last.prefix_cache_queries if last else 0))
        self.cache_hits.inc(stats.prefix_cache_hits - (last.prefix_cache_hits if last else 0))
        if stats.prefix_cache_queries:
            self.hit_rate.set(stats.prefix_cache_hits / stats.prefix_cache_queries)
        self._last_stats = stats
        self._record_budget(stats)

    def _record_budget(self, stats: StepStats) -> None:
        prefill, decode = stats.num_prefill_tokens, stats.num_decode_tokens
        self.step_prefill_tokens.observe(prefill)
        self.step_decode_tokens.observe(decode)
        self.step_tokens.observe(prefill + decode)
        self.step_time.observe(stats.wall_seconds)
        self.step_predicted.observe(stats.predicted_seconds)
        self.last_prefill_tokens.set(prefill)
        self.last_decode_tokens.set(decode)
        self.last_step_time.set(stats.wall_seconds)
        self.last_step_predicted.set(stats.predicted_seconds)
        if prefill + decode > 0 and stats.wall_seconds > 0:
            self.step_error.observe(abs(stats.wall_seconds - stats.predicted_seconds)
                                    / stats.wall_seconds)

    def _record_output(self, output: RequestOutput, now: float, cumulative: bool) -> None:
        """As vLLM, which runs each of a request's n completions as a request of its own,
        counts: per completion, its prompt included, once its first token is out (a request
        aborted or failed before then computed no prompt that counts)."""
        completions = self._progress.setdefault(output.request_id, {})
        for completion in output.outputs:
            progress = completions.setdefault(completion.index, _Progress())
            if not progress.finished:
                self._record_tokens(completion, progress, now, cumulative)
            if progress.tokens and not progress.prompt_counted:
                progress.prompt_counted = True
                self._count_prompt(len(output.prompt_token_ids))
        if output.finished:
            del self._progress[output.request_id]

    def _count_prompt(self, tokens: int) -> None:
        self.prompt_tokens.inc(tokens)
        self.totals["prompt_tokens"] += tokens
        self.request_prompt_tokens.observe(tokens)

    def _record_tokens(self, completion: CompletionOutput, progress: _Progress, now: float,
                       cumulative: bool) -> None:
        total = len(completion.token_ids) + (0 if cumulative else progress.tokens)
        if total > progress.tokens:
            metrics = completion.metrics
            if progress.last_time is not None:
                self.itl.observe(now - progress.last_time)
                self.token_gap.observe(now - progress.last_time)
            elif metrics is not None and metrics.first_token_time is not None:
                self.ttft.observe(metrics.time_to_first_token)
            progress.last_time = now
        self.generation_tokens.inc(total - progress.tokens)
        self.totals["generation_tokens"] += total - progress.tokens
        progress.tokens = total
        if completion.finish_reason is not None:
            progress.finished = True
            self._observe_finish(completion, total)

    def _observe_finish(self, completion: CompletionOutput, tokens: int) -> None:
        reason = completion.finish_reason
        self.finished.labels(finished_reason=reason, **self._labels).inc()
        metrics = completion.metrics
        if metrics is None or metrics.finished_time is None:
            return
        self.e2e.observe(metrics.finished_time - metrics.arrival_time)
        self.request_generation_tokens.observe(tokens)
        self._observe_phases(metrics)
        first, last = metrics.first_token_time, metrics.last_token_time
        if first is not None and last is not None:
            # vLLM's: the decode time over the tokens after the first; 0 for a single token.
            self.tpot.observe((last - first) / (tokens - 1) if tokens > 1 else 0.0)
        if reason in SLO_FINISH_REASONS:
            for target, met in slo_results(metrics, tokens).items():
                self._slo_children[(target, "met" if met else "missed")].inc()

    def _observe_phases(self, metrics: RequestMetrics) -> None:
        """At the finish, as vLLM observes them (a completion may be seen before it is
        scheduled): queue, prefill, decode, and inference time to the last token (vLLM's),
        or to the finish where no token came."""
        scheduled, first, last = (metrics.first_scheduled_time, metrics.first_token_time,
                                  metrics.last_token_time)
        if scheduled is not None:
            self.queue_time.observe(metrics.queue_time)
            self.inference_time.observe((last if last is not None else metrics.finished_time)
                                        - scheduled)
            if first is not None:
                self.prefill_time.observe(first - scheduled)
        if first is not None and last is not None:
            self.decode_time.observe(last - first)

    def refresh_state(self) -> None:
        """Set the queue and KV-cache gauges from the scheduler as it stands now.

        On failure (the engine thread changed a queue mid-read) the gauges keep the last step
        report's values.
        """
        try:
            stats = self._engine.scheduler.stats()
        except (RuntimeError, AttributeError):
            return
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.preempted.set(stats.num_preempted_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.kv_blocks_used.set(stats.kv_blocks_used)
        self._refresh_slo_targets()

    def _refresh_slo_targets(self) -> None:
        defaults = getattr(self._engine, "slo_defaults", None)
        if defaults is not None:
            self.slo_ttft_target.set(defaults.ttft_s)
            self.slo_tpot_target.set(defaults.tpot_s)

    def render(self) -> bytes:
        self.refresh_state()
        return generate_latest(self.registry)


# ----------------------------------------------------------------- snapshots
@dataclass
class Metric:
    """One series of a snapshot (vLLM's `vllm.v1.metrics.reader` shapes): a counter or gauge
    has `value`; a histogram has `count`, `sum` and cumulative `buckets` (upper bound ->
    count)."""

    name: str
    labels: Dict[str, str]
    kind: str  # "counter", "gauge" or "histogram"
    value: float = 0.0
    count: int = 0
    sum: float = 0.0
    buckets: Dict[str, int] = field(default_factory=dict)


def snapshot(registry: CollectorRegistry) -> List[Metric]:
    """Every series of `registry` now (counters under their name without `_total`)."""
    found: List[Metric] = []
    for family in registry.collect():
        if family.type in ("counter", "gauge"):
            found += [Metric(family.name, dict(s.labels), family.type, value=s.value)
                      for s in family.samples if s.name in (family.name, family.name + "_total")]
        elif family.type == "histogram":
            found += _histograms(family)
    return found


def _histograms(family: Any) -> List[Metric]:
    series: Dict[tuple, Metric] = {}
    for sample in family.samples:
        labels = {k: v for k, v in sample.labels.items() if k != "le"}
        metric = series.setdefault(tuple(sorted(labels.items())),
                                   Metric(family.name, labels, "histogram"))
        if sample.name.endswith("_bucket"):
            metric.buckets[sample.labels["le"]] = int(sample.value)
        elif sample.name.endswith("_count"):
            metric.count = int(sample.value)
        elif sample.name.endswith("_sum"):
            metric.sum = sample.value
    return list(series.values())

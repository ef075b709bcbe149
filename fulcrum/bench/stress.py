"""`fulcrum bench stress`: many concurrent streams that misbehave, then a check that the server
gave everything back.

Each round opens `num_clients` streaming `/v1/completions` requests at once. Most read their
stream to the end ("kept"); a share hangs up at a random point of the stream, after a random
number of chunks or before the first ("disconnect"); a share opens the stream and does not
read it for `stall_seconds`, then hangs up ("stall"). Kept requests ask for `ignore_eos`, so
each must deliver exactly `max_tokens` tokens, counted from the final usage chunk and
cross-checked against the token-bearing chunks.

After the round the client waits, bounded, until /metrics shows nothing running, waiting or
holding KV blocks, then records those gauges and the server's resident memory. A server that
leaks requests, blocks or memory under disconnects shows it here: gauges stuck above zero, or
RSS growing from round to round once the first round has warmed everything up.

Metric names are matched on their suffix (`fulcrum:num_requests_running`,
`vllm:num_requests_running`), so vLLM servers can be stressed too; a gauge the server does
not export is reported as missing rather than checked.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import httpx
from prometheus_client.parser import text_string_to_metric_families

from fulcrum.bench.serve import parse_sse_line, served_model

KEPT, DISCONNECT, STALL = "kept", "disconnect", "stall"
WORDS = ("the", "a", "little", "big", "dog", "cat", "girl", "boy", "sun", "tree", "ran", "saw",
         "happy", "sad", "park", "ball", "mom", "friend", "played", "jumped", "red", "blue",
         "house", "day", "once", "upon", "time", "there", "was", "and", "then", "found")

# Gauge suffixes read from /metrics after each round; the counter of finished requests.
RUNNING, WAITING, KV_BLOCKS, RSS = ("num_requests_running", "num_requests_waiting",
                                    "kv_cache_blocks_used", "process_resident_memory_bytes")
FINISHED = "request_success_total"


@dataclass
class StressConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: Optional[str] = None  # None: the first model /v1/models lists
    num_clients: int = 1000
    rounds: int = 2
    max_tokens: int = 32
    disconnect_fraction: float = 0.3
    stall_fraction: float = 0.05
    stall_seconds: float = 5.0
    seed: int = 0
    read_timeout: float = 120.0  # longest wait for one chunk (or the headers)
    round_timeout: float = 600.0  # bound on one round's requests, all together
    drain_timeout: float = 60.0  # bound on the wait for an idle server after a round

    def __post_init__(self) -> None:
        if self.num_clients < 1 or self.rounds < 1 or self.max_tokens < 1:
            raise ValueError("num_clients, rounds and max_tokens must be at least 1")
        for name in ("disconnect_fraction", "stall_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1]")
        if self.disconnect_fraction + self.stall_fraction > 1.0:
            raise ValueError("disconnect_fraction + stall_fraction must be at most 1")
        for name in ("stall_seconds", "read_timeout", "round_timeout", "drain_timeout"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")


@dataclass
class ClientPlan:
    index: int
    kind: str
    prompt: str
    disconnect_after: int = 0  # chunks read before hanging up (disconnect only)


@dataclass
class ClientResult:
    kind: str
    status: Optional[int] = None
    chunks: int = 0  # chunks that carried a choice
    tokens: Optional[int] = None  # usage.completion_tokens of the final usage chunk
    finish_reason: Optional[str] = None
    done: bool = False  # the stream ended with [DONE]
    error: Optional[str] = None


def plan_round(config: StressConfig, round_index: int) -> List[ClientPlan]:
    """Who does what in one round, reproducible from the seed and the round number."""
    rng = random.Random(config.seed * 1_000_003 + round_index)
    n = config.num_clients
    num_stall = round(n * config.stall_fraction)
    num_disconnect = min(round(n * config.disconnect_fraction), n - num_stall)
    kinds = [STALL] * num_stall + [DISCONNECT] * num_disconnect
    kinds += [KEPT] * (n - len(kinds))
    rng.shuffle(kinds)
    plans = []
    for index, kind in enumerate(kinds):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
        after = rng.randrange(config.max_tokens) if kind == DISCONNECT else 0
        plans.append(ClientPlan(index, kind, prompt, after))
    return plans


def _payload(model: str, prompt: str, max_tokens: int) -> Dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def run_client(client: httpx.AsyncClient, url: str, model: str, plan: ClientPlan,
                     config: StressConfig) -> ClientResult:
    """One client's request; never raises (errors are recorded in the result)."""
    result = ClientResult(plan.kind)
    try:
        async with client.stream("POST", url,
                                 json=_payload(model, plan.prompt, config.max_tokens)) as reply:
            result.status = reply.status_code
            if reply.status_code != 200:
                body = (await reply.aread()).decode(errors="replace")
                result.error = f"HTTP {reply.status_code}: {body[:200]}"
                return result
            if plan.kind == STALL:
                await asyncio.sleep(config.stall_seconds)
                return result  # leaving the block closes the unread stream
            if plan.kind == DISCONNECT and plan.disconnect_after == 0:
                return result
            await _read_stream(reply, plan, result)
    except (httpx.HTTPError, ValueError) as error:  # ValueError: a malformed JSON event
        where = "before the response" if result.status is None else \
            f"after {result.chunks} chunks"
        result.error = f"{type(error).__name__} {where}: {error}".rstrip(": ")
    if plan.kind == KEPT and result.error is None:
        result.error = _check_kept(result, config.max_tokens)
    return result


async def _read_stream(reply: httpx.Response, plan: ClientPlan, result: ClientResult) -> None:
    async for line in reply.aiter_lines():
        if line.strip() == "data: [DONE]":
            result.done = True
            continue
        event = parse_sse_line(line)
        if event is None:
            continue
        if "error" in event:
            result.error = f"error event: {str(event['error'])[:200]}"
            return
        choices = event.get("choices") or []
        if choices:
            result.chunks += 1
            result.finish_reason = choices[-1].get("finish_reason") or result.finish_reason
        usage = event.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            result.tokens = usage["completion_tokens"]
        if plan.kind == DISCONNECT and result.chunks >= plan.disconnect_after:
            return  # leaving the `stream` block hangs up mid-stream


def _check_kept(result: ClientResult, asked: int) -> Optional[str]:
    """Why a kept stream that raised nothing is still broken, or None."""
    if not result.done:
        return "the stream ended without [DONE]"
    if result.chunks == 0:
        return "the stream carried no tokens"
    if result.tokens is None:
        return "no usage chunk (stream_options.include_usage)"
    if result.chunks > result.tokens:
        return f"{result.chunks} token chunks but usage says {result.tokens} tokens"
    if result.finish_reason != "length":
        return f"finish_reason {result.finish_reason!r}, expected 'length' (ignore_eos)"
    return None


# ------------------------------------------------------------------ metrics
def parse_metrics(text: str) -> Dict[str, Any]:
    """The gauges the stress test checks, by suffix, and finished requests by reason."""
    gauges: Dict[str, float] = {}
    finished: Dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            for suffix in (RUNNING, WAITING, KV_BLOCKS, RSS):
                if name == suffix or name.endswith(":" + suffix):
                    gauges[suffix] = gauges.get(suffix, 0.0) + sample.value
            if name.endswith(":" + FINISHED) and "finished_reason" in sample.labels:
                reason = sample.labels["finished_reason"]
                finished[reason] = finished.get(reason, 0.0) + sample.value
    return {"running": _int(gauges.get(RUNNING)), "waiting": _int(gauges.get(WAITING)),
            "kv_blocks_used": _int(gauges.get(KV_BLOCKS)), "rss_bytes": _int(gauges.get(RSS)),
            "finished": {k: int(v) for k, v in finished.items()}}


def _int(value: Optional[float]) -> Optional[int]:
    return None if value is None else int(value)


async def scrape(client: httpx.AsyncClient, base_url: str) -> Dict[str, Any]:
    reply = await client.get(base_url.rstrip("/") + "/metrics")
    reply.raise_for_status()
    return parse_metrics(reply.text)


def _is_idle(state: Dict[str, Any]) -> bool:
    return all(not state[key] for key in ("running", "waiting", "kv_blocks_used"))


async def wait_until_idle(client: httpx.AsyncClient, base_url: str,
                          timeout: float) -> Tuple[Dict[str, Any], float, bool]:
    """Poll /metrics until nothing runs, waits or holds blocks: (last state, seconds, idle)."""
    start = time.monotonic()
    while True:
        state = await scrape(client, base_url)
        waited = time.monotonic() - start
        if _is_idle(state) or waited >= timeout:
            return state, waited, _is_idle(state)
        await asyncio.sleep(0.1)


# ------------------------------------------------------------------ report
@dataclass
class RoundReport:
    round: int
    sent: int = 0
    completed: int = 0  # kept streams that ended well
    failed: int = 0  # kept streams with an error
    disconnected: int = 0
    stalled: int = 0
    errors: int = 0  # every client's errors: HTTP, broken streams, error events
    kept_tokens_asked: int = 0
    kept_tokens_delivered: int = 0
    kept_token_mismatches: int = 0  # kept streams that did not get exactly max_tokens
    duration_s: float = 0.0
    drain_s: float = 0.0
    drained: bool = False
    timed_out: bool = False  # the round's requests ran past round_timeout
    running_after: Optional[int] = None
    waiting_after: Optional[int] = None
    kv_blocks_used_after: Optional[int] = None
    rss_before_bytes: Optional[int] = None
    rss_after_bytes: Optional[int] = None
    rss_growth_pct: Optional[float] = None  # after this round vs after the previous one
    server_finished: Dict[str, int] = field(default_factory=dict)  # by reason, this round
    error_samples: List[str] = field(default_factory=list)

    def add(self, result: ClientResult, max_tokens: int) -> None:
        self.sent += 1
        if result.error is not None:
            self.errors += 1
            if len(self.error_samples) < 5:
                self.error_samples.append(f"{result.kind}: {result.error}")
        if result.kind == DISCONNECT:
            self.disconnected += 1
        elif result.kind == STALL:
            self.stalled += 1
        else:
            self.kept_tokens_asked += max_tokens
            self.kept_tokens_delivered += result.tokens or 0
            if result.tokens != max_tokens:
                self.kept_token_mismatches += 1
            if result.error is None:
                self.completed += 1
            else:
                self.failed += 1


def _pct(after: Optional[int], before: Optional[int]) -> Optional[float]:
    if after is None or not before:
        return None
    return 100.0 * (after - before) / before


async def run_round(config: StressConfig, client: httpx.AsyncClient,
                    metrics_client: httpx.AsyncClient, model: str, round_index: int,
                    previous_rss: Optional[int]) -> RoundReport:
    report = RoundReport(round_index + 1)
    before = await scrape(metrics_client, config.base_url)
    report.rss_before_bytes = before["rss_bytes"]
    url = config.base_url.rstrip("/") + "/v1/completions"
    plans = plan_round(config, round_index)
    start = time.monotonic()
    tasks = [asyncio.ensure_future(run_client(client, url, model, plan, config))
             for plan in plans]
    done, pending = await asyncio.wait(tasks, timeout=config.round_timeout or None)
    report.duration_s = time.monotonic() - start
    if pending:
        report.timed_out = True
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for plan, task in zip(plans, tasks):
        if task in pending:
            result = ClientResult(plan.kind, error=f"no end within {config.round_timeout} s")
        else:
            result = task.result()
        report.add(result, config.max_tokens)
    after, report.drain_s, report.drained = await wait_until_idle(
        metrics_client, config.base_url, config.drain_timeout)
    report.running_after, report.waiting_after = after["running"], after["waiting"]
    report.kv_blocks_used_after = after["kv_blocks_used"]
    report.rss_after_bytes = after["rss_bytes"]
    report.rss_growth_pct = _pct(report.rss_after_bytes, previous_rss)
    report.server_finished = {reason: count - before["finished"].get(reason, 0)
                              for reason, count in after["finished"].items()
                              if count - before["finished"].get(reason, 0)}
    return report


def overall(rounds: Sequence[RoundReport]) -> Dict[str, Any]:
    sums = {name: sum(getattr(r, name) for r in rounds)
            for name in ("sent", "completed", "failed", "disconnected", "stalled", "errors",
                         "kept_tokens_asked", "kept_tokens_delivered", "kept_token_mismatches",
                         "duration_s")}
    last = rounds[-1]
    sums.update(running_after=last.running_after, waiting_after=last.waiting_after,
                kv_blocks_used_after=last.kv_blocks_used_after,
                rss_before_bytes=rounds[0].rss_before_bytes, rss_after_bytes=last.rss_after_bytes,
                rss_growth_pct=_pct(last.rss_after_bytes, rounds[0].rss_after_bytes)
                if len(rounds) > 1 else None)
    return sums


def problems(rounds: Sequence[RoundReport]) -> List[str]:
    """Everything that makes the run fail; empty when it passed."""
    found = []
    for r in rounds:
        where = f"round {r.round}"
        if r.timed_out:
            found.append(f"{where}: requests still open after the round timeout")
        if r.errors:
            found.append(f"{where}: {r.errors} errors (first: {r.error_samples[0]})")
        if r.kept_token_mismatches:
            found.append(f"{where}: {r.kept_token_mismatches} kept streams did not get exactly "
                         f"their tokens ({r.kept_tokens_delivered}/{r.kept_tokens_asked})")
        for name in ("running_after", "waiting_after", "kv_blocks_used_after"):
            value = getattr(r, name)
            if value:
                found.append(f"{where}: {name.removesuffix('_after')} = {value} after draining "
                             f"{r.drain_s:.1f} s")
    return found


async def run_stress(config: StressConfig, log=print) -> Dict[str, Any]:
    """Every round against a running server; the report `fulcrum bench stress` prints."""
    # No keep-alive: each request gets its own connection. A pooled connection that sits
    # idle for the server's keep-alive timeout (uvicorn: 5 s) may be closed by the server
    # just as the next round sends on it, and that POST then fails with a bare ReadError
    # before reaching the server: a race of HTTP/1.1 itself, not a fault of the server.
    limits = httpx.Limits(max_connections=config.num_clients, max_keepalive_connections=0)
    timeout = httpx.Timeout(config.read_timeout, connect=30.0, pool=config.read_timeout)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client, \
            httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0),
                              timeout=30.0) as metrics_client:
        model = config.model or await served_model(metrics_client, config.base_url)
        rounds: List[RoundReport] = []
        previous_rss = None
        for index in range(config.rounds):
            report = await run_round(config, client, metrics_client, model, index, previous_rss)
            previous_rss = report.rss_after_bytes
            rounds.append(report)
            if log is not None:
                log(f"round {report.round}/{config.rounds}: {report.sent} sent, "
                    f"{report.completed} completed, {report.disconnected} disconnected, "
                    f"{report.stalled} stalled, {report.errors} errors in "
                    f"{report.duration_s:.1f} s; idle after {report.drain_s:.1f} s")
    found = problems(rounds)
    missing = [name for name in ("running_after", "waiting_after", "kv_blocks_used_after")
               if getattr(rounds[-1], name) is None]
    return {"base_url": config.base_url, "model": model, "config": dataclasses.asdict(config),
            "rounds": [dataclasses.asdict(r) for r in rounds], "overall": overall(rounds),
            "passed": not found, "problems": found,
            "unchecked": [f"{name.removesuffix('_after')}: not in /metrics" for name in missing]}


# ------------------------------------------------------------------ table
def _mib(value: Optional[int]) -> str:
    return "-" if value is None else f"{value / 2**20:.1f} MiB"


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:+.1f} %"
    return str(value)


def format_table(report: Dict[str, Any]) -> str:
    rounds, total = report["rounds"], report["overall"]
    columns = [f"round {r['round']}" for r in rounds] + ["overall"]
    rows = [("requests sent", "sent"), ("completed", "completed"), ("failed (kept)", "failed"),
            ("disconnected", "disconnected"), ("stalled", "stalled"), ("errors", "errors")]
    table: List[Tuple[str, List[str]]] = [
        (label, [_fmt(r[key]) for r in rounds] + [_fmt(total[key])]) for label, key in rows]
    table.append(("kept tokens delivered/asked",
                  [f"{r['kept_tokens_delivered']}/{r['kept_tokens_asked']}" for r in rounds]
                  + [f"{total['kept_tokens_delivered']}/{total['kept_tokens_asked']}"]))
    table.append(("kept streams short/over", [_fmt(r["kept_token_mismatches"]) for r in rounds]
                  + [_fmt(total["kept_token_mismatches"])]))
    table.append(("duration", [f"{r['duration_s']:.1f} s" for r in rounds]
                  + [f"{total['duration_s']:.1f} s"]))
    for label, key in (("running after", "running_after"), ("waiting after", "waiting_after"),
                       ("KV blocks in use after", "kv_blocks_used_after")):
        table.append((label, [_fmt(r[key]) for r in rounds] + [_fmt(total[key])]))
    table.append(("idle after", [f"{r['drain_s']:.1f} s" for r in rounds] + [""]))
    table.append(("server RSS before", [_mib(r["rss_before_bytes"]) for r in rounds]
                  + [_mib(total["rss_before_bytes"])]))
    table.append(("server RSS after", [_mib(r["rss_after_bytes"]) for r in rounds]
                  + [_mib(total["rss_after_bytes"])]))
    table.append(("RSS growth vs prev round", [_fmt(r["rss_growth_pct"]) for r in rounds]
                  + [_fmt(total["rss_growth_pct"])]))
    table.append(("server finished (reason)",
                  [" ".join(f"{k}={v}" for k, v in sorted(r["server_finished"].items())) or "-"
                   for r in rounds] + [""]))
    width = max(len(label) for label, _ in table)
    widths = [max(len(c), *(len(cells[i]) for _, cells in table)) for i, c in enumerate(columns)]
    lines = [" " * width + "  " + "  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines.append("-" * len(lines[0]))
    for label, cells in table:
        lines.append(label.ljust(width) + "  "
                     + "  ".join(c.rjust(w) for c, w in zip(cells, widths)))
    config = report["config"]
    lines.insert(0, f"Stress: {config['num_clients']} clients x {config['rounds']} rounds, "
                    f"max_tokens {config['max_tokens']}, {config['disconnect_fraction']:.0%} "
                    f"disconnect, {config['stall_fraction']:.0%} stall "
                    f"{config['stall_seconds']:g} s; {report['model']} at {report['base_url']}")
    lines.append("RSS growth of overall: after the last round vs after the first.")
    for note in report["unchecked"]:
        lines.append(f"unchecked: {note}")
    lines.append("PASSED" if report["passed"] else "FAILED:\n  " + "\n  ".join(report["problems"]))
    return "\n".join(lines)

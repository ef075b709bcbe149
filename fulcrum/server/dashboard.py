"""The built-in web page: a chat playground and a live view of what the scheduler does.

`/` serves the page: static files shipped in the package (no CDN, no build step, charts
drawn on canvas by the page's own code). `GET /dashboard/state?since=STEP` is its data: the
engine's steps after STEP (prefill and decode tokens against the budget, predicted and
actual time, queues, KV use), the queues and the KV cache now, TTFT and TPOT percentiles,
SLO attainment and the prefix cache's hit rate over a sliding window, throughput, and the
requests in flight. It is read only when polled, from what the engine keeps anyway
(`engine.stats`, one record a step, and `engine.recent_finished`), so a server that nobody
watches pays nothing for it.
`POST /dashboard/load` fires a small built-in load: one long prompt among short ones, the
case where chunked prefill protects the short requests.

The state and load routes take the server's API key (as /v1 does); the page asks for it.
"""

from __future__ import annotations

import asyncio
import random
import time
from importlib import resources
from typing import Any, Callable, Dict, List, Optional

from fastapi import APIRouter, Depends
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from fulcrum.bench.metrics import summarize_ms
from fulcrum.sampling_params import SamplingParams
from fulcrum.server.serving import APIError

STATIC = resources.files("fulcrum.server") / "static"
MAX_STEPS = 600  # steps one poll returns (the page shows fewer)
MAX_REQUESTS = 50  # rows of the in-flight table
WINDOW_S = 60.0  # latency percentiles and SLO attainment over this many seconds
THROUGHPUT_WINDOW_S = 10.0
MAX_WINDOW_STEPS = 10 * MAX_STEPS  # steps a throughput reads at most


def _tail(records: Any, keep: Callable[[Any], bool], limit: int) -> List[Any]:
    """The newest records of a deque that another thread appends to, while `keep` holds,
    oldest first: read from the end by index (O(1) each; an append meanwhile may shift one
    record, which the caller's own key removes twice-read duplicates of)."""
    found = []
    for back in range(1, limit + 1):
        try:
            record = records[-back]
        except IndexError:
            break
        if not keep(record):
            break
        found.append(record)
    return found[::-1]


class DashboardFeed:
    """The page's data, read from an LLMEngine running in another thread."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def state(self, since: int) -> Dict[str, Any]:
        """Everything the page shows; `since`: the last step it has (of this engine, which
        `run` names: a new engine restarts the step count)."""
        now = time.monotonic()
        engine = self.engine
        if engine is None:
            raise APIError(503, "no engine is running yet")
        steps = {s.step: s for s in _tail(engine.stats, lambda s: s.step > since, MAX_STEPS)}
        sched = engine.scheduler.stats()
        done = _tail(engine.recent_finished, lambda r: r.finished_time >= now - WINDOW_S,
                     len(engine.recent_finished))
        return {
            "time": now,
            "run": id(engine),
            "config": self._config(),
            "steps": [self._step(s) for _, s in sorted(steps.items())],
            "queues": {"running": sched.num_running, "waiting": sched.num_waiting,
                       "preempted": sched.num_preempted_waiting,
                       "preemptions_total": sched.num_preemptions_total},
            "kv": {"usage": sched.kv_cache_usage, "blocks_used": sched.kv_blocks_used,
                   "blocks_total": sched.kv_blocks_total,
                   "prefix_cache_hit_rate": self._hit_rate(done)},
            "latency": self._latency(done),
            "throughput": self._throughput(now),
            "requests": self._requests(now),
        }

    def _config(self) -> Dict[str, Any]:
        config, slo = self.engine.config, self.engine.slo_defaults
        return {"model": self.model_name, "policy": config.scheduling_policy,
                "max_num_batched_tokens": config.max_num_batched_tokens,
                "max_num_seqs": config.max_num_seqs, "max_model_len": config.max_model_len,
                "slo_ttft_ms": _ms(slo.ttft_s), "slo_tpot_ms": _ms(slo.tpot_s)}

    @staticmethod
    def _step(s: Any) -> Dict[str, Any]:
        return {"step": s.step, "t": s.start_time, "prefill": s.num_prefill_tokens,
                "decode": s.num_decode_tokens, "wall_ms": 1e3 * s.wall_seconds,
                "predicted_ms": 1e3 * s.predicted_seconds, "running": s.num_running,
                "waiting": s.num_waiting, "kv_usage": s.kv_cache_usage}

    def _hit_rate(self, done: List[Any]) -> Optional[float]:
        """Share of the prompt tokens of the requests finished in the window that were found
        in the prefix cache (None without a prefix cache, or with no such request): a live
        view, as vLLM's log line reads recent requests (the server's lifetime share hardly
        moves once it has run a while, whatever its prompts do now)."""
        prompt_tokens = sum(r.num_prompt_tokens for r in done)
        if not (self.engine.config.enable_prefix_caching and prompt_tokens):
            return None
        return sum(r.num_cached_tokens for r in done) / prompt_tokens

    @staticmethod
    def _latency(done: List[Any]) -> Dict[str, Any]:
        ttft = [r.ttft_s for r in done if r.ttft_s is not None]
        tpot = [r.tpot_s for r in done if r.tpot_s is not None]
        met = [(r.ttft_s is not None and r.ttft_s <= r.slo_ttft_s)
               and (r.tpot_s is None or r.tpot_s <= r.slo_tpot_s) for r in done]
        return {"window_s": WINDOW_S, "finished": len(done),
                "ttft_ms": summarize_ms(ttft) if ttft else None,
                "tpot_ms": summarize_ms(tpot) if tpot else None,
                "slo_met_share": sum(met) / len(met) if met else None}

    def _throughput(self, now: float) -> Dict[str, Any]:
        """Tokens computed per second over the last THROUGHPUT_WINDOW_S seconds, or over the
        engine's life while it is younger: a burst after an idle spell is spread over the
        window, not over the time since its own first step (which showed one 200-token
        prompt as 1100 tokens/s). A step counts once it ended in the window (one longer
        than the window never counted); past MAX_WINDOW_STEPS steps, over the time since the
        first one read began."""
        start = max(now - THROUGHPUT_WINDOW_S, self.engine.ready_time)
        steps = _tail(self.engine.stats, lambda s: s.start_time + s.wall_seconds >= start,
                      MAX_WINDOW_STEPS)
        if not steps:
            return {"tokens_per_s": 0.0, "prefill_per_s": 0.0, "decode_per_s": 0.0}
        if len(steps) == MAX_WINDOW_STEPS:
            start = steps[0].start_time
        span = max(now - start, 1e-3)
        prefill = sum(s.num_prefill_tokens for s in steps)
        decode = sum(s.num_decode_tokens for s in steps)
        return {"tokens_per_s": (prefill + decode) / span, "prefill_per_s": prefill / span,
                "decode_per_s": decode / span}

    def _requests(self, now: float) -> List[Dict[str, Any]]:
        scheduler = self.engine.scheduler
        rows = [(r, "running") for r in list(scheduler.running)]
        rows += [(r, "preempted" if r.status.value == "preempted" else "waiting")
                 for r in list(scheduler.waiting)]
        return [{"id": r.request_id, "state": state, "age_s": now - r.arrival_time,
                 "prompt_tokens": r.num_prompt_tokens, "computed_tokens": r.num_computed_tokens,
                 "output_tokens": r.num_output_tokens} for r, state in rows[:MAX_REQUESTS]]


def _ms(seconds: float) -> Optional[float]:
    return None if seconds == float("inf") else 1e3 * seconds


class DemoLoad:
    """One long prompt, then short ones arriving while it is prefilled (at most one load at a
    time), through the engine's own request path."""

    def __init__(self, async_llm: Any) -> None:
        self.async_llm = async_llm
        self.task: Optional[asyncio.Task] = None
        self.count = 0

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def start(self, num_short: int = 10, short_len: int = 32, interval_s: float = 0.3,
              output_len: int = 16) -> Dict[str, Any]:
        config = self.async_llm.config
        long_len = max(1, min(2048, config.max_model_len - output_len))
        short_len = max(1, min(short_len, config.max_model_len - output_len))
        self.count += 1
        self.task = asyncio.ensure_future(self._run(
            self.count, long_len, num_short, short_len, interval_s, output_len))
        return {"long_tokens": long_len, "short_requests": num_short,
                "short_tokens": short_len, "interval_s": interval_s, "output_tokens": output_len}

    async def _run(self, run: int, long_len: int, num_short: int, short_len: int,
                   interval_s: float, output_len: int) -> None:
        rng = random.Random(run)
        vocab = self.async_llm.engine.vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)

        async def one(name: str, length: int, delay: float) -> None:
            await asyncio.sleep(delay)
            prompt = {"prompt_token_ids": [rng.randrange(vocab) for _ in range(length)]}
            async for _ in self.async_llm.generate(prompt, params, f"dashboard-{run}-{name}"):
                pass

        await asyncio.gather(one("long", long_len, 0.0),
                             *(one(f"short-{i}", short_len, 0.05 + i * interval_s)
                               for i in range(num_short)), return_exceptions=True)


def dashboard_routes(feed: DashboardFeed, load: Optional[DemoLoad],
                     check_key: Callable[..., None]) -> APIRouter:
    """The page (open, like /health) and its data (behind the API key)."""
    router = APIRouter()
    guarded = APIRouter(prefix="/dashboard", dependencies=[Depends(check_key)])

    @router.get("/", include_in_schema=False)
    async def page() -> Response:
        return FileResponse(str(STATIC / "index.html"), media_type="text/html")

    @guarded.get("/state")
    async def state(since: int = -1) -> Dict[str, Any]:
        return feed.state(since)

    @guarded.post("/load")
    async def fire_load() -> Response:
        if load is None:
            raise APIError(404, "this page has no server engine to load")
        if load.running:
            raise APIError(409, "a load is already running")
        return JSONResponse(load.start())

    router.include_router(guarded)
    return router


def static_files() -> StaticFiles:
    return StaticFiles(directory=str(STATIC))


def dashboard_app(feed: DashboardFeed) -> Any:
    """The page and its data alone, over an engine stepped by someone else (`fulcrum demo
    --dashboard`); no API, so the playground has nothing to talk to."""
    from fastapi import FastAPI

    from fulcrum.server.api_server import add_error_handlers  # (it imports this module)

    app = FastAPI(title="fulcrum dashboard")
    add_error_handlers(app)  # its refusals in the API's error shape
    app.include_router(dashboard_routes(feed, None, lambda: None))
    app.mount("/static", static_files(), name="static")
    return app

"""The load generator of `fulcrum bench serve`: streams requests to an OpenAI-compatible
`/v1/completions` endpoint, each sent at its arrival time, and records what the client sees.

Prompts go as token-id lists (the completions API allows them) with `ignore_eos`, so input and
output lengths are exact on fulcrum, vLLM and llama.cpp alike. The token count of a response
is the server's `usage.completion_tokens` when it sends one, else the number of chunks that
carried tokens; a stream that reports an error fails its request.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Dict, List, Optional, Tuple

import httpx
from tqdm.auto import tqdm

from fulcrum.bench.arrivals import Schedule
from fulcrum.bench.datasets import SampleRequest
from fulcrum.bench.metrics import RequestTimeline


def completion_payload(model: str, request: SampleRequest) -> Dict[str, Any]:
    return {"model": model, "prompt": request.prompt, "max_tokens": request.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


def parse_sse_line(line: str) -> Optional[Dict[str, Any]]:
    """The JSON of a `data:` line; None for other lines and for `data: [DONE]`."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:"):].strip()
    if not data or data == "[DONE]":
        return None
    return json.loads(data)


async def send_request(client: httpx.AsyncClient, url: str, model: str,
                       request: SampleRequest) -> RequestTimeline:
    """Stream one completion; a chunk with choices counts as carrying a token (as vLLM). An
    error event fails the request (a server reports a request that fails mid-way so, then
    ends the stream as usual). The output's length is the usage the server reports, else the
    chunks that carried tokens (at least one token each), never the length asked for."""
    timeline = RequestTimeline(send_time=time.perf_counter(), prompt_len=request.prompt_len,
                               output_len=0, group=request.group)
    try:
        async with client.stream("POST", url, json=completion_payload(model, request)) as reply:
            if reply.status_code != 200:
                body = (await reply.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {reply.status_code}: {body[:300]}")
            usage = None
            async for line in reply.aiter_lines():
                chunk = parse_sse_line(line)
                if chunk is None:
                    continue
                if chunk.get("error"):
                    raise RuntimeError(f"the stream reported an error after "
                                       f"{len(timeline.chunk_times)} chunks: "
                                       f"{json.dumps(chunk['error'])[:300]}")
                if chunk.get("choices"):
                    timeline.chunk_times.append(time.perf_counter())
                usage = chunk.get("usage") or usage
        if not timeline.chunk_times:
            raise RuntimeError("the stream carried no tokens")
        timeline.output_len = (usage or {}).get("completion_tokens", len(timeline.chunk_times))
        timeline.prompt_len = (usage or {}).get("prompt_tokens", timeline.prompt_len)
    except (httpx.HTTPError, RuntimeError, ValueError) as error:
        timeline.success, timeline.error = False, f"{type(error).__name__}: {error}"
    return timeline


async def warm_up(client: httpx.AsyncClient, url: str, model: str) -> None:
    """Two small requests first, so a server's one-off start-up costs land on no measurement."""
    await run_load(client, url, model, [(0.0, SampleRequest(list(range(16)), 16, 4))] * 2,
                   show_progress=False)


async def run_load(client: httpx.AsyncClient, url: str, model: str, timed: Schedule,
                   max_concurrency: Optional[int] = None,
                   show_progress: bool = True) -> Tuple[List[RequestTimeline], float]:
    """Send every request at its offset (waiting for a slot under `max_concurrency`).

    Returns the timelines in schedule order and the duration from the start of dispatch to
    the last completion.
    """
    slots = asyncio.Semaphore(max_concurrency or max(1, len(timed)))
    bar = tqdm(total=len(timed), desc="Requests", disable=not show_progress, dynamic_ncols=True)
    start = time.perf_counter()

    async def fire(offset: float, request: SampleRequest) -> RequestTimeline:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        async with slots:
            timeline = await send_request(client, url, model, request)
        bar.update(1)
        return timeline

    try:
        timelines = await asyncio.gather(*(fire(offset, request) for offset, request in timed))
    finally:
        bar.close()
    return list(timelines), time.perf_counter() - start


async def served_model(client: httpx.AsyncClient, base_url: str,
                       wanted: Optional[str] = None) -> str:
    """`wanted`, or else the first model `/v1/models` lists: the name to put in requests.
    Asked either way, so that a server that is not there fails the run before it starts."""
    reply = await client.get(base_url.rstrip("/") + "/v1/models")
    reply.raise_for_status()
    models = reply.json().get("data") or []
    if wanted is None and not models:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return wanted or models[0]["id"]


async def served_context(client: httpx.AsyncClient, base_url: str,
                         model: str) -> Optional[int]:
    """The context the server gives `model`: the `max_model_len` of its /v1/models entry (as
    fulcrum and vLLM list it); None where the server does not say (llama.cpp's server)."""
    reply = await client.get(base_url.rstrip("/") + "/v1/models")
    reply.raise_for_status()
    listed = {entry.get("id"): entry for entry in reply.json().get("data") or []}
    return (listed.get(model) or {}).get("max_model_len")


# No connection cap: the schedule and --max-concurrency set the load. No connection is kept
# for reuse either: a server may close an idle one just as the client sends on it (uvicorn,
# fulcrum's server and vLLM's, after 5 s idle; llama.cpp's server now and then right after a
# stream), and that request then fails (ReadError, RemoteProtocolError) through no fault of
# the server. A new local connection costs well under a millisecond of a request's TTFT.
CLIENT_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=0)


def make_client() -> httpx.AsyncClient:
    """No timeout and `CLIENT_LIMITS`."""
    return httpx.AsyncClient(timeout=None, limits=CLIENT_LIMITS)

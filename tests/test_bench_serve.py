"""`fulcrum bench serve`: the streaming client against a mock endpoint, and end to end
against a live `fulcrum serve` on a tiny model (loopback only)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import pytest

from fulcrum.bench.datasets import SampleRequest
from fulcrum.bench.report import free_port, running_server
from fulcrum.bench.serve import CLIENT_LIMITS, parse_sse_line, run_load


def _sse(*chunks) -> bytes:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"


def test_parse_sse_line():
    assert parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert parse_sse_line("data: [DONE]") is None
    assert parse_sse_line(": keep-alive") is None and parse_sse_line("") is None


def test_the_client_keeps_no_idle_connection():
    """A request sent on an idle connection the server is closing fails (ReadError,
    RemoteProtocolError); uvicorn closes them after 5 s, llama.cpp's server sometimes at once."""
    assert CLIENT_LIMITS.max_keepalive_connections == 0
    assert CLIENT_LIMITS.max_connections is None  # the schedule sets the load, not the pool


def test_run_load_streams_token_ids_and_reads_usage():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if body["prompt"] == [9]:
            return httpx.Response(500, text="server fell over")
        return httpx.Response(200, content=_sse(
            {"choices": [{"index": 0, "text": "a"}]}, {"choices": [{"index": 0, "text": "b"}]},
            {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
            {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}}))

    timed = [(0.0, SampleRequest([1, 2, 3], 3, 3, "short")), (0.05, SampleRequest([9], 1, 2))]

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await run_load(client, "http://127.0.0.1/v1/completions", "m", timed,
                                  max_concurrency=1, show_progress=False)

    timelines, duration = asyncio.run(main())
    assert seen[0]["prompt"] == [1, 2, 3] and seen[0]["ignore_eos"] and seen[0]["stream"]
    assert seen[0]["max_tokens"] == 3 and seen[0]["model"] == "m"
    good, bad = timelines
    assert good.completed and len(good.chunk_times) == 3 and good.output_len == 3
    assert good.group == "short"
    assert not bad.completed and "HTTP 500" in bad.error
    assert duration >= 0.05  # the second request waited for its arrival time


def test_a_stream_that_fails_mid_way_is_a_failure_and_lengths_are_what_came():
    """A request that fails after its first tokens gets an error event, then the stream
    ends as usual without usage: it was counted a success of the full length asked for,
    which inflated throughput, TPOT and goodput. Without usage, a stream is credited with
    the chunks that carried tokens, not with max_tokens."""
    def handler(request: httpx.Request) -> httpx.Response:
        token = {"choices": [{"index": 0, "text": "a"}]}
        if json.loads(request.content)["prompt"] == [9]:
            return httpx.Response(200, content=_sse(token, token, {"error": {
                "message": "processing the output failed", "type": "InternalServerError",
                "code": 500}}))
        return httpx.Response(200, content=_sse(token, token, token))

    timed = [(0.0, SampleRequest([9], 1, 100)), (0.0, SampleRequest([1], 1, 100))]

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await run_load(client, "http://127.0.0.1/v1/completions", "m", timed,
                                  show_progress=False)

    (failed, unreported), _ = asyncio.run(main())
    assert not failed.completed
    assert failed.error.startswith("RuntimeError: the stream reported an error after 2 chunks")
    assert "processing the output failed" in failed.error
    assert unreported.completed and unreported.output_len == 3


@pytest.fixture(scope="module")
def live_server(llama_dir):
    port = free_port()
    command = [sys.executable, "-m", "fulcrum", "serve", str(llama_dir), "--port", str(port),
               "--kv-cache-memory-bytes", "20000000"]
    with running_server(command, port) as base_url:
        yield base_url


def test_bench_serve_end_to_end(live_server, tmp_path):
    result = tmp_path / "serve.json"
    run = subprocess.run(
        [sys.executable, "-m", "fulcrum", "bench", "serve", "--base-url", live_server,
         "--num-prompts", "4", "--input-len", "16", "--output-len", "5", "--request-rate", "20",
         "--goodput", "ttft:60000", "tpot:60000", "--save-result", str(result),
         "--disable-tqdm"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Mean TTFT (ms)" in run.stdout
    report = json.loads(result.read_text())["reports"]["all"]
    assert report["completed"] == 4 and report["failed"] == 0
    assert report["total_input_tokens"] == 4 * 16 and report["total_output_tokens"] == 4 * 5
    assert report["goodput"] == pytest.approx(report["request_throughput"])
    assert report["slo"] == {"ttft": 60000.0, "tpot": 60000.0}
    assert report["good_requests"] == 4 and report["goodput_share"] == 1.0
    assert report["slo_attainment"] == {"ttft": 1.0, "tpot": 1.0}
    assert "Request goodput (req/s)" in run.stdout and "Within all targets (%)" in run.stdout
    assert report["tpot_ms"]["mean"] > 0 and report["itl_ms"]["p99"] > 0


def test_bench_serve_chat_prompts_fit_the_servers_context(live_server, tmp_path):
    """--dataset chat drew its lengths for a 4,096-token context whatever the server's (bench
    serve has no --max-model-len): on this 512-token server the longest of these 4 requests
    (569 prompt tokens) failed with a 400. The server's max_model_len now bounds them."""
    result = tmp_path / "chat.json"
    run = subprocess.run(
        [sys.executable, "-m", "fulcrum", "bench", "serve", "--base-url", live_server,
         "--dataset", "chat", "--num-prompts", "4", "--input-len", "300", "--output-len", "8",
         "--save-result", str(result), "--disable-tqdm"],
        capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    saved = json.loads(result.read_text())
    assert saved["reports"]["all"]["completed"] == 4 and saved["errors"] == []
    assert saved["args"]["max_model_len"] == 512

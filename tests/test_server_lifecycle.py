"""The server's life beyond single requests: the queue limit (503 + Retry-After), API keys,
graceful shutdown on SIGTERM (in-flight requests finish or are aborted, exit status 0), and
the engine's death (clients get errors, `serve` returns 1 so a supervisor restarts it)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Iterator, List, Tuple

import httpx

from conftest import free_port, running_server
from fulcrum.async_engine import AsyncLLM
from fulcrum.server import build_app
from fulcrum.server.api_server import listening_socket, serve
from fulcrum.server.cli import api_keys
from fulcrum.cli import build_parser

LONG = {"prompt": "a long answer", "max_tokens": 400, "ignore_eos": True}


def wait_until(condition, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def stream_events(url: str, body: dict, first_chunk: threading.Event = None) -> List[dict]:
    """POST a streamed completion and return its events (the final [DONE] as None)."""
    events = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(None if line == "data: [DONE]" else json.loads(line[6:]))
                if first_chunk is not None:
                    first_chunk.set()
    return events


def finish(events: List[dict]) -> tuple:
    """(finish reason, number of text chunks) of a streamed single-choice completion."""
    assert events[-1] is None, "the stream did not end with [DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    return chunks[-1]["choices"][0]["finish_reason"], len(chunks)


# ------------------------------------------------------------------ queue limit
def test_queue_limit_answers_503_with_retry_after(llama_dir):
    with running_server(llama_dir, max_num_seqs=1, max_queued_requests=2) as (server, llm), \
            concurrent.futures.ThreadPoolExecutor(3) as pool:
        running = threading.Event()
        futures = [pool.submit(stream_events, server.url, LONG, running)]
        running.wait(30)
        futures += [pool.submit(stream_events, server.url, LONG) for _ in range(2)]
        wait_until(lambda: llm.num_queued == 2, what="two queued requests")
        response = httpx.post(server.url + "/v1/completions", json={"prompt": "x"})
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        error = response.json()["error"]
        assert error["code"] == 503 and "max_queued_requests=2" in error["message"]
        # A request that could never be queued is a client error, not a retry.
        too_many = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "n": 3})
        assert too_many.status_code == 400 and "max_queued_requests" in too_many.text
        assert httpx.get(server.url + "/health").status_code == 200
        for future in futures:
            assert finish(future.result(60)) == ("length", 400)
        wait_until(lambda: llm.is_idle, what="idle")
        accepted = httpx.post(server.url + "/v1/completions", json={"prompt": "x",
                                                                    "max_tokens": 2})
        assert accepted.status_code == 200


# --------------------------------------------------------------------- API keys
def test_several_api_keys_from_flags_or_environment(llama_dir, monkeypatch):
    parse = build_parser().parse_args
    monkeypatch.setenv("FULCRUM_API_KEY", "env-one, env-two")
    assert api_keys(parse(["serve"])) == ["env-one", "env-two"]
    assert api_keys(parse(["serve", "--api-key", "a", "--api-key", "b"])) == ["a", "b"]
    monkeypatch.delenv("FULCRUM_API_KEY")
    assert api_keys(parse(["serve"])) == []
    with running_server(llama_dir, app_kwargs={"api_key": ["a", "b"]}) as (server, _):
        def status(key):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            return httpx.get(server.url + "/v1/models", headers=headers).status_code
        assert [status(k) for k in ("a", "b", "c", "", "ab")] == [200, 200, 401, 401, 401]
        assert httpx.get(server.url + "/health").status_code == 200  # open without a key


# ------------------------------------------------------------------- shutdown
@contextlib.contextmanager
def serving_process(model_dir, *flags: str,
                    start_timeout: float = 90) -> Iterator[Tuple[subprocess.Popen, str]]:
    """(process, URL): `fulcrum serve` in a process of its own, once healthy; killed on
    leaving if it still runs."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "fulcrum", "serve", str(model_dir), "--port", str(port), *flags,
         "--uvicorn-log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        def healthy() -> bool:
            try:
                return httpx.get(url + "/health").status_code == 200
            except httpx.TransportError:
                assert process.poll() is None, process.stdout.read().decode()
                return False

        wait_until(healthy, start_timeout, "the server to start")
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_sigterm_drains_then_aborts_and_exits_zero(llama_dir):
    with serving_process(llama_dir, "--shutdown-timeout", "1",
                         "--max-num-seqs", "1") as (process, url):
        # One request runs at a time: the short one first, then eight long ones in turn,
        # far more work than the one second the server gives them once signalled.
        with concurrent.futures.ThreadPoolExecutor(9) as pool:
            started = threading.Event()
            short = pool.submit(stream_events, url, {**LONG, "max_tokens": 8}, started)
            assert started.wait(30)
            longs = [pool.submit(stream_events, url, {**LONG, "max_tokens": 480})
                     for _ in range(8)]
            wait_until(lambda: _gauge(url, "fulcrum:num_requests_waiting") >= 7, 30, "queued")
            process.send_signal(signal.SIGTERM)
            wait_until(lambda: httpx.get(url + "/health").status_code == 503, 5, "draining")
            refused = httpx.post(url + "/v1/completions", json={"prompt": "x"})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == 503
            assert refused.headers["retry-after"] == "1"
            assert finish(short.result(30)) == ("length", 8)
            ends = [finish(future.result(30)) for future in longs]
        assert process.wait(30) == 0
    assert all(reason in ("length", "abort") for reason, _ in ends)
    aborted = [chunks for reason, chunks in ends if reason == "abort"]
    assert len(aborted) >= 6 and all(chunks < 480 for chunks in aborted)


def _gauge(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)


def test_engine_death_fails_clients_and_serve_returns_one(llama_dir):
    async_llm = AsyncLLM.from_engine_args(model=str(llama_dir))
    app = build_app(async_llm, "m")
    port = free_port()
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault(
        "code", serve(app, listening_socket("127.0.0.1", port), log_level="warning")),
        daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(url + "/health").status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(up, 30, "the server to start")

        def broken_schedule():
            raise RuntimeError("injected: scheduler state corrupted")

        async_llm.engine.scheduler.schedule = broken_schedule
        response = httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=30)
        assert response.status_code == 503
        assert "injected: scheduler state corrupted" in response.json()["error"]["message"]
        thread.join(30)
        assert result == {"code": 1}
        assert not async_llm.is_healthy
    finally:
        async_llm.shutdown()


STOPPED_BY_SIGTERM = """
import os, signal, threading
from fastapi import FastAPI
from fulcrum.server.api_server import GracefulServer, listening_socket, run_on
async def drain(timeout):
    return 0
server = GracefulServer(FastAPI(), 30.0, "warning", drain)
def stop_when_started():
    while not server.started:
        threading.Event().wait(0.05)
    os.kill(os.getpid(), signal.SIGTERM)
threading.Thread(target=stop_when_started, daemon=True).start()
run_on(server, listening_socket("127.0.0.1", 0))
print("RETURNED", server.exit_code)
"""


def test_a_server_stopped_by_sigterm_exits_zero():
    # uvicorn re-raises the signal after its shutdown (status 143, as if killed): the data-
    # parallel router, which runs such a server, must exit 0 as the single server does.
    done = subprocess.run([sys.executable, "-c", STOPPED_BY_SIGTERM], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "RETURNED 0" in done.stdout


def test_the_data_parallel_router_drains_as_a_server_does(llama_dir):
    """--shutdown-timeout behind the router: new calls get 503 at once, requests in flight
    get the timeout, then the rest are closed (their replicas abort them) and it exits 0."""
    with serving_process(llama_dir, "--data-parallel-size", "2", "--shutdown-timeout", "1",
                         "--max-num-seqs", "1", start_timeout=240) as (process, url):
        # One request runs at a time on each replica: far more work than the one second the
        # server gives it once signalled (the stream waits behind the others).
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            plain = [pool.submit(httpx.post, url + "/v1/completions", timeout=60,
                                 json={**LONG, "max_tokens": 480}) for _ in range(6)]
            time.sleep(0.5)
            streamed = pool.submit(stream_events, url, {**LONG, "max_tokens": 480})
            time.sleep(0.5)
            signalled = time.monotonic()
            process.send_signal(signal.SIGTERM)
            wait_until(lambda: httpx.get(url + "/health").status_code == 503, 5, "draining")
            refused = httpx.post(url + "/v1/completions", json={"prompt": "x"})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            answers = [future.result(60) for future in plain]
            events = streamed.result(60)
        assert process.wait(60) == 0
        assert time.monotonic() - signalled < 30
    closed = {"error": {"message": "the server shut down before the answer came "
                                   "(--shutdown-timeout)", "type": "ServiceUnavailableError",
                        "param": None, "code": 503}}
    assert all(a.status_code in (200, 503) for a in answers)
    assert sum(a.status_code == 503 for a in answers) >= 4
    assert all(a.json() == closed for a in answers if a.status_code == 503)
    assert events[-2:] == [closed, None]  # a stream ends with the error, then [DONE]

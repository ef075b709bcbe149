"""Data-parallel replicas behind the router: both replicas serve, a repeated prompt goes to
the replica that cached it, /metrics labels each replica's series, a replica killed
mid-run fails its requests with an error while the server serves on, a client that leaves
stops its request at the replica, and stuck or unreachable replicas (stand-ins here) are
taken out of service."""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import re
import socket
import threading
import time

import httpx
import pytest
from fastapi import FastAPI

from conftest import free_port
from fulcrum import LLM, SamplingParams
from fulcrum.cli import build_parser
from fulcrum.server import BackgroundServer
from fulcrum.server.prefix_tree import PrefixTree
from fulcrum.server.replicas import Replica, replica_args, start_replicas
from fulcrum.server.router import build_router_app, routing_text

pytestmark = pytest.mark.timeout(300)

LONG = "Once upon a time there was a little dog who liked to run in the park. " * 3


@pytest.fixture(scope="module")
def dp_server(stories_dir):
    args = build_parser().parse_args(["serve", str(stories_dir), "--served-model-name", "m",
                                      "--kv-cache-memory-bytes", str(4 << 20),
                                      "--uvicorn-log-level", "warning",
                                      "--enable-request-id-headers"])
    replicas = start_replicas(args, 2, "mp")
    try:
        with BackgroundServer(build_router_app(replicas.replicas,
                                               request_id_headers=True)) as server:
            yield server, replicas.replicas
    finally:
        replicas.stop()


def _complete(url: str, prompt: str, max_tokens: int = 4, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra})


def _metric(text: str, name: str, engine: int) -> float:
    found = re.search(rf'^{re.escape(name)}{{[^}}]*engine="{engine}"[^}}]*}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_both_replicas_serve_and_a_repeated_prefix_meets_its_cache(dp_server):
    server, replicas = dp_server
    prompts = [f"Story {i}: " + "the cat sat " * (i + 1) for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda p: _complete(server.url, p), prompts))
    assert all(a.status_code == 200 for a in answers)
    served = [r.served for r in replicas]
    assert all(count >= 2 for count in served), served
    # The long prompt, then the same long prompt with a new ending: same replica, cache hit.
    before = [r.served for r in replicas]
    assert _complete(server.url, LONG).status_code == 200
    first = [i for i, r in enumerate(replicas) if r.served > before[i]][0]
    hits_before = _metric(httpx.get(f"{server.url}/metrics").text,
                          "fulcrum:prefix_cache_hits_total", first)
    for ending in ("The end.", "And then it rained."):
        assert _complete(server.url, LONG + ending).status_code == 200
    assert replicas[first].served == before[first] + 3
    metrics = httpx.get(f"{server.url}/metrics").text
    assert _metric(metrics, "fulcrum:prefix_cache_hits_total", first) >= hits_before + 2 * 48
    assert _metric(metrics, "fulcrum:router_requests_total", first) >= 3
    assert metrics.count("# TYPE fulcrum:num_requests_running gauge") == 1  # merged families


def test_errors_pass_through_the_router(dp_server):
    server, _ = dp_server
    bad = _complete(server.url, "hi", max_tokens=-1)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"
    broken = httpx.post(f"{server.url}/v1/completions", content=b"{not json",
                        headers={"content-type": "application/json"})
    assert broken.status_code == 400
    assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"] == "m"
    traced = _complete(server.url, "hi", max_tokens=1, request_id="dp-1")
    assert traced.json()["id"] == "cmpl-dp-1"  # the replica's header, passed on once
    assert traced.headers.get_list("x-request-id") == ["dp-1"]


def test_a_client_that_leaves_a_plain_request_stops_it_at_the_replica(dp_server):
    server, replicas = dp_server
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 1 s and hangs up
        httpx.post(f"{server.url}/v1/completions", timeout=1.0, json={
            "model": "m", "prompt": [1, 403, 407], "max_tokens": 480, "n": 16,
            "ignore_eos": True, "temperature": 0.7})
    deadline = time.monotonic() + 10
    while True:
        metrics = httpx.get(f"{server.url}/metrics").text
        running = sum(_metric(metrics, "fulcrum:num_requests_running", r.index)
                      for r in replicas)
        if (running == 0 and not any(r.in_flight for r in replicas)) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert running == 0 and [r.in_flight for r in replicas] == [0, 0]
    generated = sum(_metric(metrics, "fulcrum:generation_tokens_total", r.index)
                    for r in replicas)
    assert generated < 16 * 480  # stopped, not run to the end


def test_a_killed_replica_fails_its_requests_and_the_server_serves_on(dp_server):
    server, replicas = dp_server
    text = "Lily had a red ball. " * 4
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60, json={
            "model": "m", "prompt": text, "max_tokens": 400, "stream": True,
            "ignore_eos": True}) as stream:
        lines = stream.iter_lines()
        events = [next(lines) for _ in range(3)]
        assert events[0].startswith("data: ")
        target = next(r for r in replicas if r.in_flight > 0)
        target.handle.kill()
        rest = list(lines)
    errors = [json.loads(line[6:]) for line in rest if line.startswith("data: {\"error\"")]
    assert errors and "failed mid-stream" in errors[0]["error"]["message"]
    assert rest[-1] == "data: [DONE]" or rest[-2] == "data: [DONE]"
    deadline = time.monotonic() + 10  # the router looks at its replicas every 0.5 s
    while True:
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 200
        state = {s["engine"]: s for s in health.json()["replicas"]}[target.index]
        if not state["healthy"] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert state["healthy"] is False and "exit code" in state["error"]
    for prompt in ("After the rain", text):
        assert _complete(server.url, prompt).status_code == 200
    assert 'fulcrum:router_replica_up{engine="%d"} 0.0' % target.index in \
        httpx.get(f"{server.url}/metrics").text


def test_replicas_draw_unseeded_samples_from_streams_of_their_own(llama_dir):
    """Every replica had the engine's seed, so the n-th unseeded request of one got the same
    tokens as the n-th of another (two replicas in turn: each answer twice). Each replica now
    draws from seed + its rank; seeded requests and dummy weights are alike in all."""
    args = build_parser().parse_args(["serve", str(llama_dir), "--data-parallel-rank", "2"])
    assert [replica_args(args, i, "127.0.0.1", 0, None).data_parallel_rank
            for i in range(2)] == [2, 3]
    params = [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)]
    answers = []
    for rank in (0, 1):
        llm = LLM(str(llama_dir), load_format="dummy", data_parallel_rank=rank)
        answers.append([llm.generate({"prompt_token_ids": [5, 6, 7]}, p, use_tqdm=False)[0]
                        .outputs[0].token_ids for p in params])
    unseeded, seeded_and_greedy = zip(*[(a[0], a[1:]) for a in answers])
    assert unseeded[0] != unseeded[1]
    assert seeded_and_greedy[0] == seeded_and_greedy[1]


def test_replicas_that_fail_to_start_end_the_server_with_one_line_each(llama_dir, tmp_path):
    """Each replica's bad setting and the router's own failure were tracebacks (90 lines for
    a missing model folder); they are one line each, as a single server's is."""
    import subprocess
    import sys

    def serve(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "fulcrum", "serve", *flags, "-dp", "2",
                               "--port", str(free_port())],
                              capture_output=True, text=True, timeout=240)

    done = serve(str(llama_dir), "--kv-cache-memory-bytes", "1000")
    assert done.returncode == 1
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert re.fullmatch(r"fulcrum serve: error: data-parallel replica \d failed to start "
                        r"\(exit code 2\); see its log above", errors[-1])
    assert errors[:-1] and all(line.startswith("fulcrum serve: error: the KV cache holds 0 "
                                               "tokens") for line in errors[:-1])
    # A folder that is not there is the router's own finding, before any replica starts.
    done = serve(str(tmp_path / "missing"))
    assert done.returncode == 2
    assert re.fullmatch(r"fulcrum serve: error: model folder '.*missing' does not exist .*\n",
                        done.stderr)


def test_replicas_on_one_machine_share_the_kv_fraction_of_its_ram(monkeypatch):
    """Each replica sized its cache from the same available RAM at once: together they took
    --gpu-memory-utilization once per replica (2.2 GiB for 5% of 22 GiB with two)."""
    from types import SimpleNamespace

    from fulcrum.server import replicas as replicas_module

    started = []

    class Recorded:
        def __init__(self, target, name, args):
            started.append(args[0])

        def start(self):
            pass

    monkeypatch.setattr(replicas_module.multiprocessing, "get_context",
                        lambda method: SimpleNamespace(Process=Recorded))
    args = build_parser().parse_args(["serve", "--gpu-memory-utilization", "0.6"])
    replicas_module._start_processes(args, 3)
    assert [a.gpu_memory_utilization for a in started] == [pytest.approx(0.2)] * 3
    assert args.gpu_memory_utilization == 0.6


def test_replicas_whose_weights_do_not_fit_together_are_refused_before_any_starts(
        monkeypatch, tmp_path):
    """Each replica checked its own copy against RAM the others had not taken yet: three
    copies of a model a third of the RAM's size each passed, and the OOM killer ended some."""
    import torch

    from fulcrum.default_model import CONFIG, ensure_config_folder
    from fulcrum.server import replicas as replicas_module
    from fulcrum.worker import model_loader

    folder = ensure_config_folder(tmp_path / "model", CONFIG)
    one = model_loader.weight_bytes(model_loader.load_hf_config(folder), torch.float32)
    monkeypatch.setattr(model_loader, "available_cpu_memory", lambda: 3 * one - 1)
    monkeypatch.setattr(replicas_module.multiprocessing, "get_context",
                        lambda method: pytest.fail("a replica started"))
    args = build_parser().parse_args(["serve", folder, "--dtype", "float32"])
    with pytest.raises(ValueError, match=r"\(3 copies, one per data-parallel replica\), more "
                                         r"than the .* GiB of RAM available"):
        replicas_module._start_processes(args, 3)
    replicas_module.check_copies_fit(args, 2)  # two fit


def test_routing_text_and_prefix_tree():
    assert routing_text("/v1/completions", b'{"prompt": "abc"}') == "abc"
    assert routing_text("/v1/completions", b'{"prompt": ["x", "y"]}') == "x"
    chat1 = routing_text("/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "hi"}]}).encode())
    chat2 = routing_text("/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant",
                                                          "content": "yo"}]}).encode())
    assert chat2.startswith(chat1)
    assert routing_text("/v1/completions", b"[1, 2") is None
    deep = b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    assert routing_text("/v1/completions", deep) is None  # the replica refuses it: a 400
    tree = PrefixTree(max_chars=30)
    tree.insert("hello world", 0)
    tree.insert("hello there", 1)
    assert tree.match("hello world!") == {0: 11, 1: 6}
    assert tree.match("help") == {0: 3, 1: 3}
    tree.insert("z" * 20, 1)  # over 30 characters: the least recently used leaf goes
    assert tree.num_chars <= 30 and tree.match("hello world") == {0: 6, 1: 6}
    tree.forget(1)
    assert tree.match("zzz") == {}


def test_the_router_refuses_in_openai_error_bodies():
    with BackgroundServer(build_router_app([], "round_robin",
                                           request_id_headers=True)) as server:
        refused = httpx.post(server.url + "/v1/completions", json={"prompt": "x"},
                             headers={"X-Request-Id": "r-9"})
        assert refused.status_code == 503 and refused.headers["x-request-id"] == "r-9"
        wrong_method = httpx.put(server.url + "/v1/completions")
        assert wrong_method.status_code == 405
        assert wrong_method.json()["error"]["type"] == "MethodNotAllowedError"
        assert httpx.post(server.url + "/v1/completions",
                          json={"prompt": "x"}).json()["error"]["code"] == 503


@pytest.fixture
def alive():
    """A live process to stand for a replica's (the router also watches that it lives)."""
    process = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,))
    process.start()
    yield process
    process.kill()
    process.join()


def _answering_app() -> FastAPI:
    app = FastAPI()
    app.get("/health")(lambda: {})
    app.post("/v1/completions")(lambda: {"answered_by": "the replica in service"})
    return app


def test_the_router_answers_ping_as_its_health(alive):
    """vLLM's /ping, by GET or POST, is the router's own /health (a replica's would say 200
    while the router drains)."""
    from fastapi.testclient import TestClient

    app = build_router_app([Replica(0, f"http://127.0.0.1:{free_port()}", alive)])
    router = TestClient(app)
    assert [router.request(method, "/ping").status_code for method in ("GET", "POST")] \
        == [200, 200]
    app.state.draining = True
    assert router.get("/ping").status_code == 503


def test_a_stuck_replica_is_taken_out_and_its_requests_fail(alive):
    """A replica that lives but answers nothing (a socket nobody accepts on): its /health
    probe times out, the request waiting there gets a 502 naming why, streams an error
    event, the replica is ended, and with no replica left the router says so
    (on_all_down)."""
    stuck = socket.socket()
    stuck.bind(("127.0.0.1", 0))
    stuck.listen(64)  # connections complete in the kernel; no answer ever comes
    replica = Replica(0, f"http://127.0.0.1:{stuck.getsockname()[1]}", alive)
    all_down = threading.Event()
    app = build_router_app([replica], "round_robin", health_timeout=1.0,
                           on_all_down=all_down.set)
    try:
        with BackgroundServer(app) as server:
            start = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                plain = pool.submit(httpx.post, f"{server.url}/v1/completions",
                                    json={"prompt": "x"}, timeout=30)
                with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30,
                                  json={"prompt": "x", "stream": True}) as stream:
                    assert stream.status_code == 502  # it never answered the headers
                answer = plain.result()
            assert time.monotonic() - start < 10
            assert answer.status_code == 502
            error = answer.json()["error"]
            assert error["type"] == "BadGatewayError"
            assert "answered no /health for 1 s" in error["message"]
            assert all_down.wait(5)
            health = httpx.get(f"{server.url}/health")
            assert health.status_code == 503
            assert health.json()["replicas"][0]["error"] == "it answered no /health for 1 s"
            alive.join(5)  # and it was ended, its memory and cores given back
            assert alive.exitcode == -9
    finally:
        stuck.close()


def test_a_replica_that_takes_no_connection_hands_its_request_on(alive):
    """Nothing listens at `closed`'s port: its requests go to the other replica. Its process
    lives, so it stays in service (a refused connection may be the router's own doing, out
    of file descriptors); with no replica taking the connection, a 502."""
    closed = Replica(0, f"http://127.0.0.1:{free_port()}", alive)
    with BackgroundServer(_answering_app()) as up:
        serving = Replica(1, up.url, alive)
        with BackgroundServer(build_router_app([closed, serving], "round_robin")) as server:
            for _ in range(2):  # round robin: each replica is picked first once
                answer = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"})
                assert answer.status_code == 200, answer.text
                assert answer.json() == {"answered_by": "the replica in service"}
            assert closed.healthy and serving.healthy
            assert [closed.in_flight, serving.in_flight] == [0, 0]
            assert 'fulcrum:router_requests_total{engine="1"} 2.0' in \
                httpx.get(f"{server.url}/metrics").text  # counted where it was served
    nowhere = [Replica(i, f"http://127.0.0.1:{free_port()}", alive) for i in range(2)]
    with BackgroundServer(build_router_app(nowhere, "round_robin")) as server:
        answer = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"})
        assert answer.status_code == 502
        assert answer.json()["error"]["message"] == \
            "no data-parallel replica took the connection"


def test_a_full_prefix_tree_frees_a_tenth_at_once_least_recent_first():
    def text(i: int) -> str:  # 10 characters, no prefix shared with another i
        return chr(0x4E00 + i) * 10

    tree = PrefixTree(max_chars=1000)
    for i in range(100):  # exactly full
        tree.insert(text(i), i % 3)
    assert tree.num_chars == 1000
    tree.insert(text(100), 1)  # over: down to 900, the eleven oldest texts gone
    assert tree.num_chars == 900
    assert tree.match(text(0)) == {} and tree.match(text(10)) == {}
    assert tree.match(text(11)) == {2: 10} and tree.match(text(100)) == {1: 10}
    for i in range(101, 111):  # refills the freed tenth without evicting
        tree.insert(text(i), 0)
    assert tree.num_chars == 1000 and tree.match(text(11)) == {2: 10}


def test_replicas_as_ray_actors(stories_dir):
    ray = pytest.importorskip("ray")
    args = build_parser().parse_args(["serve", str(stories_dir), "--served-model-name", "m",
                                      "--kv-cache-memory-bytes", str(4 << 20),
                                      "--uvicorn-log-level", "warning"])
    replicas = start_replicas(args, 2, "ray")
    try:
        with BackgroundServer(build_router_app(replicas.replicas, "round_robin")) as server:
            texts = [_complete(server.url, "Once upon a time", max_tokens=6).json()
                     ["choices"][0]["text"] for _ in range(2)]
            assert texts[0] == texts[1] and texts[0]  # the same greedy answer from each
            assert [r.served for r in replicas.replicas] == [1, 1]
    finally:
        replicas.stop()
    assert not ray.is_initialized()  # the local Ray started for the replicas is stopped


def test_the_dashboard_names_the_one_replica_it_shows(dp_server):
    """Its numbers are the first replica's alone: the state says which, of how many, for the
    page to say so (it passed one replica's load for the server's)."""
    server, _ = dp_server
    state = httpx.get(f"{server.url}/dashboard/state", timeout=30)
    assert state.status_code == 200
    assert state.json()["data_parallel"] == {"engine": 0, "size": 2}
    assert "queues" in state.json() and "steps" in state.json()
    assert httpx.get(f"{server.url}/dashboard/state", params={"since": "x"}).status_code == 400

"""AsyncLLM on its own (no HTTP): streaming, abort, errors; and the `serve` command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import subprocess
import sys
import time

import httpx
import pytest

from conftest import free_port
from fulcrum import LLM, SamplingParams
from fulcrum.async_engine import AsyncLLM, EngineDeadError, StepReport
from fulcrum.server.cli import register, served_model_names

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def async_llm(llama_dir):
    llm = AsyncLLM.from_engine_args(model=str(llama_dir), num_gpu_blocks_override=256)
    yield llm
    llm.shutdown()


def wait_idle(llm: AsyncLLM, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not llm.is_idle:
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.01)


async def collect(llm: AsyncLLM, prompt, params, request_id):
    return [output async for output in llm.generate(prompt, params, request_id)]


def test_streams_deltas_equal_to_offline_generate(async_llm, llama_dir):
    prompts = ["Hello there", "A longer prompt about nothing at all"]

    async def run():
        return await asyncio.gather(*(collect(async_llm, p, GREEDY, f"r{i}")
                                      for i, p in enumerate(prompts)))

    streams = asyncio.run(run())
    expected = LLM(str(llama_dir)).generate(prompts, GREEDY, use_tqdm=False)
    for outputs, reference in zip(streams, expected):
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
        token_ids = [t for o in outputs for t in o.outputs[0].token_ids]
        assert token_ids == reference.outputs[0].token_ids
        assert "".join(o.outputs[0].text for o in outputs) == reference.outputs[0].text


def test_leaving_a_stream_aborts_and_frees_blocks(async_llm):
    reports = []
    async_llm.add_listener(reports.append)
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    def outputs() -> list:
        return [o for r in reports for o in r.outputs if o.request_id == "to-abort"]

    async def run() -> int:
        consumed = 0
        async with contextlib.aclosing(async_llm.generate("abort me", params, "to-abort")) as s:
            async for _ in s:
                consumed += 1
                if consumed == 3:
                    break
        while not outputs()[-1].finished:  # the abort is reported by the next step
            await asyncio.sleep(0.01)
        return consumed

    consumed = asyncio.run(asyncio.wait_for(run(), 10))
    wait_idle(async_llm)
    outputs = outputs()
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    # Steps already running or queued when the stream was left may finish (a loaded machine
    # delays the event loop by a step or two); a missed abort would run to 400 tokens.
    assert generated <= consumed + 3, "the engine kept decoding an aborted request"
    manager = async_llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_usable_blocks


def test_abort_ends_the_stream_of_its_request(async_llm):
    """abort() from outside the stream (another task, an admin): the task reading the stream
    gets a last output with finish reason "abort" (it waited forever), before and after the
    first token, many at once."""
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def read(request_id: str, abort_after: int) -> list:
        outputs = []
        async for output in async_llm.generate("abort me from outside", params, request_id):
            outputs.append(output)
            if len(outputs) == abort_after:
                async_llm.abort(request_id)
        return outputs

    async def run():
        early = asyncio.ensure_future(read("early", -1))
        await asyncio.sleep(0)
        async_llm.abort("early")  # before anything came out
        many = [asyncio.ensure_future(read(f"many-{i}", -1)) for i in range(20)]
        await asyncio.sleep(0)
        for i in range(20):
            async_llm.abort(f"many-{i}")
        return await asyncio.gather(early, read("late", 2), *many)

    streams = asyncio.run(asyncio.wait_for(run(), 20))
    for outputs in streams:
        assert outputs and outputs[-1].finished
        assert outputs[-1].outputs[0].finish_reason == "abort"
        assert sum(len(o.outputs[0].token_ids) for o in outputs) < 20
    assert len(streams[1]) >= 2
    wait_idle(async_llm)
    manager = async_llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_usable_blocks
    assert asyncio.run(collect(async_llm, "after", GREEDY, "early"))[-1].finished  # id free


def test_bad_requests_fail_alone(async_llm):
    async def run():
        with pytest.raises(ValueError, match="maximum model length"):
            await collect(async_llm, "x" * 600, GREEDY, "too-long")
        with pytest.raises(TypeError):
            await collect(async_llm, "fine", "not params", "bad-params")
        # An id that is not a string: refused, never handed to the engine thread (where an
        # abort of 7 iterated over an int and stopped the engine; None got an id of the
        # engine's choosing that no stream waited for).
        for request_id in (7, None, "", ("a",)):
            with pytest.raises(TypeError, match="request id must be a non-empty string"):
                await collect(async_llm, "fine", GREEDY, request_id)
            with pytest.raises(TypeError, match="request id must be a non-empty string"):
                async_llm.abort(request_id)
        return await collect(async_llm, "still fine", GREEDY, "good")

    outputs = asyncio.run(run())
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == GREEDY.max_tokens
    assert async_llm.is_healthy


def test_engine_thread_waits_at_most_a_fifth_of_a_millisecond_for_the_gil(async_llm):
    # Python's default (5 ms) would let the event loop hold the GIL that long after each
    # forward pass, on every token.
    assert sys.getswitchinterval() <= 0.0002


def test_listener_sees_every_step(async_llm):
    reports: list = []
    async_llm.add_listener(reports.append)
    asyncio.run(collect(async_llm, "count my steps", GREEDY, "steps"))
    assert all(isinstance(r, StepReport) and r.stats is not None for r in reports)
    assert sum(len(o.outputs[0].token_ids) for r in reports for o in r.outputs
               if o.request_id == "steps") == GREEDY.max_tokens
    assert async_llm.loop_stats.steps > 0
    assert 0.0 <= async_llm.loop_stats.overhead_fraction < 1.0


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fulcrum")
    register(parser.add_subparsers(dest="command"))
    return parser


def test_serve_command_line():
    args = _serve_parser().parse_args(
        ["serve", "/models/x", "--port", "9001", "--api-key", "k", "--max-num-seqs", "8",
         "--no-enable-prefix-caching", "--kv-cache-memory-bytes", "1000000",
         "--scheduling-policy", "priority", "--load-format", "dummy"])
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 9001, ["k"])
    assert (args.max_num_seqs, args.enable_prefix_caching) == (8, False)
    assert (args.kv_cache_memory_bytes, args.scheduling_policy) == (1000000, "priority")
    assert served_model_names(args) == ["/models/x"]
    assert callable(args.func)


def test_serve_defaults_to_loopback_and_builtin_model():
    args = _serve_parser().parse_args(["serve"])
    assert (args.host, args.port, args.model) == ("127.0.0.1", 8000, None)
    assert served_model_names(args) == ["fulcrum-default-135m"]


LAUNCH = """
import argparse, sys
from fulcrum.server.cli import register
parser = argparse.ArgumentParser(prog="fulcrum")
register(parser.add_subparsers())
args = parser.parse_args(sys.argv[1:])
sys.exit(args.func(args))
"""


def test_serve_command_runs_a_server(llama_dir):
    port = free_port()
    command = [sys.executable, "-c", LAUNCH, "serve", str(llama_dir), "--port", str(port),
               "--served-model-name", "cli-model", "--num-gpu-blocks-override", "64",
               "--uvicorn-log-level", "warning"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.stdout.read().decode()
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.2)
        body = {"model": "cli-model", "prompt": "hi", "max_tokens": 3, "ignore_eos": True}
        usage = httpx.post(url + "/v1/completions", json=body).json()["usage"]
        assert usage["completion_tokens"] == 3
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0


def test_a_cancelled_id_is_refused_until_its_abort_is_reported(async_llm, llama_dir):
    """No output of the old request may reach a new one of the same id: reusing it right
    after the cancel is refused by name, and works once the engine has stopped the old."""
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def run():
        stream = async_llm.generate("Hello", params, "dup")
        await stream.__anext__()
        await stream.aclose()
        with pytest.raises(ValueError, match="'dup' is still being aborted"):
            await collect(async_llm, "Hello", GREEDY, "dup")
        deadline = time.monotonic() + 10
        while "dup" in async_llm._aborting:
            assert time.monotonic() < deadline, "the abort was never reported"
            await asyncio.sleep(0.01)
        return await collect(async_llm, "Hello", GREEDY, "dup")

    outputs = asyncio.run(run())
    (alone,) = LLM(str(llama_dir)).generate("Hello", GREEDY, use_tqdm=False)
    assert [t for o in outputs for t in o.outputs[0].token_ids] == alone.outputs[0].token_ids
    wait_idle(async_llm)


def test_shutdown_ends_open_streams_and_refuses_new_requests(llama_dir):
    llm = AsyncLLM.from_engine_args(model=str(llama_dir), num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)

    async def run():
        stream = llm.generate("Hello", params, "long")
        await stream.__anext__()
        llm.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError, match="shut down"):
            await collect(llm, "Hello", GREEDY, "after")

    asyncio.run(asyncio.wait_for(run(), 20))
    assert not llm.is_healthy

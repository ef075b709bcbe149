"""What one client can hold at the connection level: header blocks, connections that never
finish their headers or body, pipelined requests whose client left, and streams nobody
reads (fulcrum/server/http_protocol.py, middleware.BodyGuard, serving.EventStream)."""

from __future__ import annotations

import json
import socket
import struct
import time
from typing import List

import httpx
import pytest

from conftest import running_server
from test_server import wait_idle


@pytest.fixture(scope="module")
def served(llama_dir, one_torch_thread):
    with running_server(llama_dir, max_model_len=512) as pair:
        yield pair


def connect(server, receive_buffer: int = 0) -> socket.socket:
    sock = socket.socket()
    if receive_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect((server.host, server.port))
    sock.settimeout(10)
    return sock


def read_until_closed(sock: socket.socket, limit: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (fails after `limit` s).
    A server closing with bytes of ours unread resets the connection."""
    data, deadline = b"", time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            piece = sock.recv(1 << 16)
        except ConnectionResetError:
            return data
        if not piece:
            return data
        data += piece
    raise AssertionError("the server kept the connection open")


def post(path: str, body: dict, extra: str = "") -> bytes:
    raw = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n{extra}\r\n").encode() + raw


def finish_reasons(async_llm) -> List[tuple]:
    """(request id, finish reason) of every completion that finishes from now on."""
    seen: List[tuple] = []
    async_llm.add_listener(lambda report: seen.extend(
        (output.request_id, choice.finish_reason) for output in report.outputs
        if output.finished for choice in output.outputs))
    return seen


def test_a_header_block_over_the_limit_is_refused_at_once(server):
    from fulcrum.server.http_protocol import DEFAULT_MAX_HEADER_BYTES

    with connect(server) as sock:
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: {'a' * 8000}\r\n\r\n".encode())
        assert sock.recv(100).startswith(b"HTTP/1.1 200")
    with connect(server) as sock:
        start = time.monotonic()
        try:
            # past the limit by more than the piece a request begins in (uncounted)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
            for _ in range((2 * DEFAULT_MAX_HEADER_BYTES + (512 << 10)) // 4096):
                sock.sendall(b"a" * 4096)
            sock.sendall(b"\r\n\r\n")
        except OSError:  # the server may close before it has read it all
            pass
        answer = read_until_closed(sock)
        assert time.monotonic() - start < 5
    assert answer == b"" or answer.startswith(b"HTTP/1.1 400")  # refused, or reset unread
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_connection_that_never_finishes_its_headers_is_closed(server, monkeypatch):
    """Whether it sends nothing or drips its headers; a slow request that is whole in time is
    answered."""
    from fulcrum.server import http_protocol

    monkeypatch.setattr(http_protocol, "HEADER_TIMEOUT_S", 0.5)
    with connect(server) as silent, connect(server) as dripping:
        dripping.sendall(b"GET /health HTTP/1.1\r\nHo")
        start = time.monotonic()
        assert read_until_closed(silent) == b"" and read_until_closed(dripping) == b""
        assert time.monotonic() - start < 5
    with connect(server) as slow:
        slow.sendall(b"GET /health HTTP/1.1\r\n")
        time.sleep(0.2)
        slow.sendall(b"Host: x\r\n\r\n")
        assert slow.recv(100).startswith(b"HTTP/1.1 200")


def test_a_large_body_is_no_header_block(server):
    """Bytes that arrive with the headers but after them are the body's: a small request
    with a large prompt is served."""
    body = {"model": "m", "prompt": "hello " * 30_000, "max_tokens": 1,
            "truncate_prompt_tokens": 8}
    with connect(server) as sock:
        sock.sendall(post("/v1/completions", body))
        assert sock.recv(100).startswith(b"HTTP/1.1 200")


def test_a_request_pipelined_behind_a_long_one_is_not_cut_off(server, monkeypatch):
    """The header deadline waits for the next request only when none is queued: the one that
    starts when the first is answered had its headers long ago."""
    from fulcrum.server import http_protocol

    monkeypatch.setattr(http_protocol, "HEADER_TIMEOUT_S", 0.3)
    quick = {"model": "m", "prompt": "hi", "max_tokens": 1}
    slow = {"model": "m", "prompt": "hi", "max_tokens": 400, "ignore_eos": True}
    with connect(server) as sock:
        sock.sendall(post("/v1/completions", quick) + post("/v1/completions", slow))
        answers = b""
        deadline = time.monotonic() + 30
        while answers.count(b"HTTP/1.1 200") < 2 and time.monotonic() < deadline:
            piece = sock.recv(1 << 16)
            assert piece, "the connection was closed before the second answer"
            answers += piece
    assert answers.count(b"HTTP/1.1 200") == 2 and answers.count(b'"finish_reason":"length"') == 2


def test_a_body_that_stops_arriving_gets_408(server, monkeypatch):
    from fulcrum.server import middleware

    monkeypatch.setattr(middleware, "BODY_TIMEOUT_S", 0.5)
    with connect(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 408")
    assert b"the request body stopped arriving" in answer


def test_a_pipelined_request_is_aborted_when_its_client_leaves(server, async_llm):
    """The running request is told of the disconnect, not only the one queued behind it (with
    httptools the running one went on to its last token)."""
    seen = finish_reasons(async_llm)
    body = {"model": "m", "prompt": "hello", "max_tokens": 480, "ignore_eos": True}
    with connect(server) as sock:
        sock.sendall(post("/v1/completions", body, "X-Request-Id: pipelined-1\r\n")
                     + post("/v1/completions", body, "X-Request-Id: pipelined-2\r\n"))
        time.sleep(0.05)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
    wait_idle(async_llm)
    assert [reason for request_id, reason in seen if "pipelined-1" in request_id] == ["abort"]


def test_a_stream_nobody_reads_is_closed_and_its_request_ends(server, async_llm, monkeypatch):
    from fulcrum.server import http_protocol

    monkeypatch.setattr(http_protocol, "WRITE_TIMEOUT_S", 0.5)
    body = {"model": "m", "prompt": "hello", "max_tokens": 480, "ignore_eos": True, "n": 8,
            "logprobs": 20, "stream": True}
    with connect(server, receive_buffer=4096) as sock:
        sock.sendall(post("/v1/completions", body))
        time.sleep(3)  # reading nothing while the buffers fill and the server waits
        received = read_until_closed(sock, limit=30)
    assert not received.rstrip().endswith(b"data: [DONE]")  # cut off, not finished
    wait_idle(async_llm)
    assert not async_llm._streams


def test_a_declared_oversized_body_that_never_comes_still_gets_its_413(server, monkeypatch):
    """The server reads (and drops) an oversized body before answering, so that a client
    still sending sees the answer; one that sends nothing gets it after BODY_TIMEOUT_S."""
    from fulcrum.server import middleware

    monkeypatch.setattr(middleware, "BODY_TIMEOUT_S", 0.5)
    with connect(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % (32 << 20))
        assert sock.recv(100).startswith(b"HTTP/1.1 413")

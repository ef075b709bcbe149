"""ASGI middleware that guards the app before a route sees a request: the body's size and
encoding, and the gate that refuses new API calls while the server drains for shutdown; and
the X-Request-Id header of --enable-request-id-headers.

Both are plain ASGI (not Starlette's BaseHTTPMiddleware) because the body limit must count
bytes as they arrive: a client may send a body without Content-Length, in chunks.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Awaitable, Callable, Dict, MutableMapping

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fulcrum.server.serving import RETRY_AFTER_S, APIError

Scope = MutableMapping
Message = Dict
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# A body over the limit is still read (and dropped) up to this many times the limit before
# the 413 goes out, so an ordinary client that is still sending sees the answer rather than
# a reset connection; beyond that the connection is simply closed after the answer.
DRAIN_FACTOR = 4
# The most JSON arrays and objects a body may open (its "[" and "{" bytes, counted as they
# arrive, strings' included): FastAPI parses a body on the event loop, and building
# containers is the costly part (3 million empty lists in 12 MB took 2 s there, every
# client waiting). The largest requests the server takes (10,000 messages, 1,024 tools,
# a 5,000-property schema) open a few tens of thousands.
MAX_JSON_CONTAINERS = 200_000
# Longest wait for the next piece of a request body: a client that declares more than it sends,
# or never ends a chunked body, would otherwise hold its connection (and a file descriptor)
# for ever.
BODY_TIMEOUT_S = 30.0


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body().model_dump(), status_code=error.status,
                        headers=error.headers)


async def api_error(_: object, error: APIError) -> JSONResponse:
    return error_response(error)


async def http_error(_: object, error: StarletteHTTPException) -> JSONResponse:
    """Starlette's own refusals (no route, wrong method, a body it could not parse) in
    OpenAI's error shape."""
    message = str(error.detail)
    if error.__cause__ is not None:  # FastAPI's "error parsing the body" hides why
        message = f"{message}: {str(error.__cause__)[:200]}"
    return error_response(APIError(error.status_code, message))


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than the server's limit of {limit} "
                         "bytes (--max-request-body-bytes)")


def _is_wide_unicode(head: bytes) -> bool:
    """Whether a body starts as UTF-16 or UTF-32 would: JSON in UTF-8 has no NUL byte, and
    Python's json would otherwise decode those encodings too (RFC 8259 asks for UTF-8)."""
    return b"\x00" in head[:4] or head.startswith((b"\xff\xfe", b"\xfe\xff"))


async def _in_time(receive: Receive) -> Message:
    """The body's next piece, or a 408 after BODY_TIMEOUT_S without one."""
    try:
        return await asyncio.wait_for(receive(), BODY_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise StarletteHTTPException(
            408, f"the request body stopped arriving for {BODY_TIMEOUT_S:.0f} s") from None


class BodyGuard:
    """Answer 413 to a request whose body is over `max_bytes`, declared or as it arrives, 400
    to one that is not UTF-8 or opens over MAX_JSON_CONTAINERS arrays and objects, and 408 to
    one whose body stops arriving for BODY_TIMEOUT_S."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            if int(declared) <= DRAIN_FACTOR * self.max_bytes:
                await self._drain(receive, 0)
            return await error_response(_too_large(self.max_bytes))(scope, receive, send)
        received = containers = 0
        body_done = False

        async def limited_receive() -> Message:
            nonlocal received, containers, body_done
            if body_done:  # what comes now is the disconnect, whenever the client leaves
                return await receive()
            message = await _in_time(receive)
            body_done = message["type"] != "http.request" or not message.get("more_body")
            if message["type"] == "http.request":
                chunk = message.get("body", b"")
                if received == 0 and _is_wide_unicode(chunk):
                    raise StarletteHTTPException(400, "the request body must be UTF-8 JSON")
                received += len(chunk)
                containers += chunk.count(b"[") + chunk.count(b"{")
                if containers > MAX_JSON_CONTAINERS:
                    if message.get("more_body"):
                        await self._drain(receive, received)
                    raise StarletteHTTPException(
                        400, f"the request body opens more than {MAX_JSON_CONTAINERS:,} JSON "
                             "arrays and objects")
                if received > self.max_bytes:
                    if message.get("more_body"):
                        await self._drain(receive, received)
                    # FastAPI passes an HTTPException raised while reading the body through.
                    raise StarletteHTTPException(413, _too_large(self.max_bytes).message)
            return message

        await self.app(scope, limited_receive, send)

    async def _drain(self, receive: Receive, received: int) -> None:
        while received <= DRAIN_FACTOR * self.max_bytes:
            try:
                message = await _in_time(receive)
            except StarletteHTTPException:  # it stopped sending: it gets its answer now
                return
            if message["type"] != "http.request":
                return
            received += len(message.get("body", b""))
            if not message.get("more_body"):
                return


class DrainGate:
    """While `is_draining()`, answer 503 (with Retry-After) to new calls of the /v1 API."""

    def __init__(self, app: ASGIApp, is_draining: Callable[[], bool]) -> None:
        self.app = app
        self.is_draining = is_draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and self.is_draining():
            error = APIError(503, "the server is shutting down", headers={
                "Retry-After": str(RETRY_AFTER_S), "Connection": "close"})
            return await error_response(error)(scope, receive, send)
        await self.app(scope, receive, send)


class RequestIdHeader:
    """vLLM's --enable-request-id-headers: each response carries an X-Request-Id header,
    the request's own, else (where vLLM's gives a fresh one) the id its completion got, its
    response id less the prefix, so a body's request_id comes back too; else a fresh one.
    One already there (a replica's, through the router) is kept."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(name.lower() == b"x-request-id" for name, _ in headers):
                    given = next((value for name, value in scope["headers"]
                                  if name == b"x-request-id"), None)  # the first, as routes read
                    chosen = scope.get("state", {}).get("request_id") or uuid.uuid4().hex
                    headers.append((b"x-request-id", given or chosen.encode("ascii")))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)

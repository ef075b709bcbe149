"""The HTTP/1.1 connections fulcrum's servers (and the data-parallel router) speak: uvicorn's
httptools protocol, with bounds on what one client can hold.

- A request's header block may be at most `max_header_bytes` (uvicorn's and vLLM's
  h11_max_incomplete_event_size, which uvicorn applies to its h11 protocol alone): httptools
  joins a header value piece by piece, with no limit, so one 64 MiB header took 8 s to parse
  on the event loop (every client waited, and the data-parallel router, stalled past its
  replicas' health checks, took them all out of service).
- A request's headers must arrive within HEADER_TIMEOUT_S of the connection opening, or of
  its last answer: uvicorn closes an idle connection only after an answer and stops counting
  at the first byte, so a connection that sent nothing, or dripped its headers, stayed open
  for ever, and some 20,000 of them used up the process's file descriptors. (Its body then
  arrives under middleware.BodyGuard's deadline.)
- A client that leaves ends every request it sent: uvicorn tells only the last one parsed,
  so a request with another pipelined behind it ran on to its last token.

h11 (uvicorn's other protocol) has the header limit, but its framing in Python made 64 token
streams a third slower on a 2-core machine.
"""

from __future__ import annotations

import asyncio
from typing import Any, List, Optional

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

HEADER_TIMEOUT_S = 30.0
# The largest header block a request may send (vLLM's default is 4 MiB; browsers and SDKs
# send a few KiB).
DEFAULT_MAX_HEADER_BYTES = 64 << 10


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds above (the header limit is the config's
    h11_max_incomplete_event_size)."""

    _headers_due: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_bytes = 0
        self._in_headers = True
        self._cycles: List[RequestResponseCycle] = []  # this connection's requests
        self._await_headers()

    def data_received(self, data: bytes) -> None:
        if self._in_headers:
            self._header_bytes += len(data)
            if self._header_bytes > self.config.h11_max_incomplete_event_size:
                self.logger.warning("a request's header block is over %d bytes: refused",
                                    self.config.h11_max_incomplete_event_size)
                self._stop_waiting()
                self.send_400_response("The request's header block is too large.")
                return
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers = True
        self._header_bytes = 0

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._stop_waiting()
        super().on_headers_complete()
        self._cycles = [c for c in self._cycles if not c.response_complete] + [self.cycle]

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.pipeline and not self.transport.is_closing():
            self._await_headers()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._stop_waiting()
        for cycle in self._cycles:
            if not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        self._stop_waiting()
        self._headers_due = self.loop.call_later(HEADER_TIMEOUT_S, self._headers_too_slow)

    def _stop_waiting(self) -> None:
        if self._headers_due is not None:
            self._headers_due.cancel()
            self._headers_due = None

    def _headers_too_slow(self) -> None:
        self._headers_due = None
        if not self.transport.is_closing():
            self.transport.close()


def uvicorn_config(app: Any, log_level: str, timeout_graceful_shutdown: float,
                   max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> uvicorn.Config:
    return uvicorn.Config(app, log_level=log_level, http=BoundedHttpToolsProtocol,
                          h11_max_incomplete_event_size=max_header_bytes,
                          timeout_graceful_shutdown=timeout_graceful_shutdown)

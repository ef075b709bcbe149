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
- A client that takes nothing of an answer for WRITE_TIMEOUT_S (the connection's buffers
  full) is disconnected, which ends its requests: a stream nobody read kept its connection,
  and every output made for it, for ever (6 such streams held 230 MB).

h11 (uvicorn's other protocol) has the header limit, but its framing in Python made 64 token
streams a third slower on a 2-core machine.
"""

from __future__ import annotations

import asyncio
from typing import Any, List, Optional

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

HEADER_TIMEOUT_S = 30.0
WRITE_TIMEOUT_S = 60.0
# The largest header block a request may send (vLLM's default is 4 MiB; browsers and SDKs
# send a few KiB).
DEFAULT_MAX_HEADER_BYTES = 64 << 10


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds above (the header limit is the config's
    h11_max_incomplete_event_size)."""

    _headers_due: Optional[asyncio.TimerHandle] = None
    _write_due: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_bytes = 0  # of the request whose headers are still arriving
        self._in_headers = True
        self._began = False  # whether a request began in the piece being parsed
        self._cycles: List[RequestResponseCycle] = []  # this connection's requests
        self._await_headers()

    def data_received(self, data: bytes) -> None:
        """Count what arrives while a request's headers are incomplete; a piece in which a
        request begins is not counted (where it begins is not known: the bound is then loose
        by one piece, at most 256 KiB), nor its body once they are whole."""
        self._began = False
        super().data_received(data)
        if not self._in_headers or self.transport.is_closing():
            return
        if not self._began:
            self._header_bytes += len(data)
        if self._header_bytes > self.config.h11_max_incomplete_event_size:
            self.logger.warning("a request's header block is over %d bytes: refused",
                                self.config.h11_max_incomplete_event_size)
            self._stop_waiting()
            self.send_400_response("The request's header block is too large.")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers = True
        self._began = True
        self._header_bytes = 0

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._stop_waiting()
        super().on_headers_complete()
        self._cycles = [c for c in self._cycles if not c.response_complete] + [self.cycle]

    def on_response_complete(self) -> None:
        queued = bool(self.pipeline)  # the next request, already here, starts now
        super().on_response_complete()
        if not queued and not self.transport.is_closing():
            self._await_headers()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_due is None:
            self._write_due = self.loop.call_later(WRITE_TIMEOUT_S, self.transport.abort)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_writing()

    def _stop_writing(self) -> None:
        if self._write_due is not None:
            self._write_due.cancel()
            self._write_due = None

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._stop_waiting()
        self._stop_writing()
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

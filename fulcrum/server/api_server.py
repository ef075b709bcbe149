"""The FastAPI app: OpenAI's routes under /v1, plus health (and ping), version, metrics and
tokenizer.

`build_app` takes a ready `AsyncLLM`, so one engine can sit behind several apps (tests) and
the caller decides its lifetime. With API keys, only /v1 routes are protected, as in vLLM:
health checks, metric scrapes and the tokenizer routes need no credentials. `serve` runs an
app until SIGTERM or SIGINT, then drains it (see `GracefulServer`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import threading
import time
from typing import Any, Awaitable, Callable, Dict, Optional, Sequence, Union

import contextlib
from functools import partial
from typing import AsyncIterator

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector,
                               generate_latest)
from starlette.exceptions import HTTPException as StarletteHTTPException

from fulcrum import __version__
from fulcrum.async_engine import AsyncLLM, EngineDeadError, QueueFullError, RequestFailedError
from fulcrum.chat_messages import validation_message
from fulcrum.server.dashboard import DashboardFeed, DemoLoad, dashboard_routes, static_files
from fulcrum.server.metrics import ServerMetrics, StatsLogger
from fulcrum.server.http_protocol import DEFAULT_MAX_HEADER_BYTES, uvicorn_config
from fulcrum.server.middleware import (BodyGuard, DrainGate, RequestIdHeader, api_error,
                                       error_response, http_error)
from fulcrum.server.protocol import (ChatCompletionRequest, CompletionRequest,
                                     DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList,
                                     TokenizeRequest, TokenizeResponse)
from fulcrum.server.serving import (HEAVY_PROMPT_ITEMS, APIError, OpenAIServing, bad_request,
                                    overloaded)

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 30.0
SHUTDOWN_TIMEOUT_S = 10.0
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 << 20
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


def add_error_handlers(app: FastAPI) -> None:
    """Every refusal in OpenAI's error shape (the API's, the page's and FastAPI's own)."""
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        message = validation_message(error.errors())
        whole_body = any(tuple(problem.get("loc", ())) == ("body",) for problem in error.errors())
        if whole_body and "json" not in request.headers.get("content-type", "").lower():
            # FastAPI read the body as bytes, and pydantic's message says only that they
            # are not an object.
            message = f"send the body as JSON, with Content-Type: application/json ({message})"
        return error_response(bad_request(message))

    async def engine_dead(_: Request, error: EngineDeadError) -> JSONResponse:
        return error_response(APIError(503, str(error)))

    async def queue_full(_: Request, error: QueueFullError) -> JSONResponse:
        return error_response(overloaded(error))

    async def request_failed(_: Request, error: RequestFailedError) -> JSONResponse:
        return error_response(APIError(error.status, str(error)))

    async def unexpected(_: Request, error: Exception) -> JSONResponse:
        logger.exception("unexpected error while serving a request")
        return error_response(APIError(500, f"internal error: {error!r}"))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(EngineDeadError, engine_dead)
    app.add_exception_handler(QueueFullError, queue_full)
    app.add_exception_handler(RequestFailedError, request_failed)
    app.add_exception_handler(Exception, unexpected)


def _api_key_checker(api_keys: Sequence[str]) -> Callable[[Request], None]:
    """Accept `Authorization: Bearer KEY` for any of the keys, comparing in constant time
    (every key is compared, so the time does not tell which one came close)."""
    expected = [f"Bearer {key}".encode() for key in api_keys]

    def check(request: Request) -> None:
        if not expected:
            return
        given = request.headers.get("authorization", "").encode("utf-8", "replace")
        matches = [secrets.compare_digest(given, key) for key in expected]
        if not any(matches):
            raise APIError(401, "Invalid or missing API key: send 'Authorization: Bearer KEY'")
    return check


def build_app(async_llm: AsyncLLM, served_model_name: Union[str, Sequence[str]],
              api_key: Union[None, str, Sequence[str]] = None,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              trust_request_chat_template: bool = False,
              log_requests: bool = False, chat_template: Optional[str] = None,
              tool_call_parser: Optional[str] = None, max_log_len: Optional[int] = None,
              cors: Optional[Dict[str, Any]] = None,
              stats_interval: Optional[float] = None, web_ui: bool = True,
              request_id_headers: bool = False,
              chat_template_content_format: str = "auto",
              reasoning_parser: Optional[str] = None) -> FastAPI:
    """The server's app. `served_model_name`: one name or several (aliases; the first is the
    one responses carry). `api_key`: one key or several; None or empty leaves /v1 open.
    `tool_call_parser`: reads tool calls for tool_choice "auto" (None: "auto" is refused).
    `cors`: CORSMiddleware's keywords (allow_origins, ...), None for no CORS headers.
    `stats_interval`: seconds between stats lines in the log (None: none). `web_ui`: serve
    the playground and dashboard page at / (see dashboard.py). `request_id_headers`: every
    response carries X-Request-Id (--enable-request-id-headers).
    `chat_template_content_format`: how templates read message content (see
    chat_template.content_format). `reasoning_parser`: splits chat answers into reasoning
    and content (server/reasoning.py; None: all content). An engine with disable_log_stats keeps no metrics: /metrics
    has the process's series alone (vLLM's, which then has no stat loggers)."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    # vLLM's disable_log_stats: no stat loggers, so no engine series on /metrics either.
    metrics = None if async_llm.config.disable_log_stats else ServerMetrics(async_llm, names[0])
    serving = OpenAIServing(async_llm, names, trust_request_chat_template, log_requests,
                            chat_template, tool_call_parser, max_log_len, metrics,
                            chat_template_content_format, reasoning_parser)
    app = FastAPI(title="fulcrum", version=__version__,
                  description="OpenAI-compatible API of the fulcrum inference engine",
                  lifespan=_lifespan(StatsLogger(async_llm, metrics,
                                                 stats_interval if metrics else None)))
    app.state.async_llm = async_llm
    app.state.metrics = metrics
    app.state.draining = False
    add_error_handlers(app)
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    app.include_router(_openai_routes(serving, keys))
    app.include_router(_utility_routes(serving, metrics, lambda: app.state.draining))
    if web_ui:
        feed = DashboardFeed(async_llm.engine, names[0])
        app.include_router(dashboard_routes(feed, DemoLoad(async_llm), _api_key_checker(keys)))
        app.mount("/static", static_files(), name="static")
    app.add_middleware(DrainGate, is_draining=lambda: app.state.draining)
    app.add_middleware(BodyGuard, max_bytes=max_request_body_bytes)
    if cors is not None:
        app.add_middleware(CORSMiddleware, **cors)
    if request_id_headers:
        app.add_middleware(RequestIdHeader)
    return app


def _lifespan(stats_logger: "StatsLogger") -> Callable[[FastAPI], Any]:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.ensure_future(stats_logger.run())
        try:
            yield
        finally:
            task.cancel()
    return lifespan


def _openai_routes(serving: OpenAIServing, api_keys: Sequence[str]) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(_api_key_checker(api_keys))])
    created = int(time.time())

    @router.post("/completions")
    async def completions(request: CompletionRequest, raw_request: Request) -> Any:
        return await serving.create_completion(request, raw_request)

    @router.post("/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Any:
        return await serving.create_chat_completion(request, raw_request)

    def card(name: str) -> ModelCard:
        llm = serving.llm
        return ModelCard(id=name, created=created, root=llm.engine.model_dir,
                         max_model_len=llm.config.max_model_len)

    @router.get("/models")
    async def models() -> ModelList:
        return ModelList(data=[card(name) for name in serving.model_names])

    # OpenAI's models.retrieve (and vLLM's): `:path`, as a served name may hold slashes (a
    # model folder's path, an org/name), which clients send escaped and arrive decoded.
    @router.get("/models/{model:path}")
    async def model(model: str) -> ModelCard:
        serving.check_model(model)
        return card(model)

    return router


def _utility_routes(serving: OpenAIServing, metrics: Optional[ServerMetrics],
                    is_draining: Callable[[], bool]) -> APIRouter:
    router = APIRouter()
    llm = serving.llm
    if metrics is not None:
        render = metrics.render
    else:  # the process's own series alone
        registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        render = partial(generate_latest, registry)

    @router.get("/health")
    async def health() -> Response:
        """200 while the server takes requests; 503 once the engine died or while draining."""
        return Response(status_code=200 if llm.is_healthy and not is_draining() else 503)

    # vLLM's /ping (SageMaker's health check, GET or POST): /health's answer.
    router.add_api_route("/ping", health, methods=["GET", "POST"])

    @router.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(render(), media_type=CONTENT_TYPE_LATEST)

    @router.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        serving.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise bad_request("give exactly one of prompt and messages")
        if request.messages is not None:
            serving.check_request_template(request.chat_template)
            tools = [t.model_dump(exclude_none=True) for t in request.tools or []]
            _, tokens = await serving.render_chat(
                request.messages, request.add_generation_prompt, request.chat_template,
                request.chat_template_kwargs, tools,
                continue_final_message=request.continue_final_message,
                add_special_tokens=request.add_special_tokens is True)
        elif request.chat_template is not None or request.chat_template_kwargs is not None:
            field = "chat_template" if request.chat_template is not None else \
                "chat_template_kwargs"
            raise APIError(400, f"{field} goes with messages, not prompt", field)
        else:
            try:
                tokens = await serving.off_loop_if(
                    len(request.prompt) > HEAVY_PROMPT_ITEMS,
                    partial(llm.engine.encode, request.prompt,
                            request.add_special_tokens is not False))
            except ValueError as error:
                raise bad_request(error) from None
        strings = ([llm.tokenizer.id_to_token(t) for t in tokens]
                   if request.return_token_strs else None)
        return TokenizeResponse(count=len(tokens), max_model_len=llm.config.max_model_len,
                                tokens=tokens, token_strs=strings)

    @router.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        serving.check_model(request.model)
        tokens = request.tokens
        try:
            llm.engine.check_token_ids("tokens", "token id", tokens)
        except ValueError as error:
            raise bad_request(error) from None
        text = await serving.off_loop_if(len(tokens) > HEAVY_PROMPT_ITEMS, partial(
            llm.tokenizer.decode, tokens, request.skip_special_tokens))
        return DetokenizeResponse(prompt=text)

    return router


class BackgroundServer:
    """Serve an app with uvicorn on a daemon thread; for tests, benchmarks and notebooks.

    The socket is bound before the thread starts (port 0: the OS picks a free one), so the
    URL is known and no other process can take the port in between.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self._socket = listening_socket(host, port)
        self.host, self.port = self._socket.getsockname()[:2]
        self._server = uvicorn.Server(uvicorn_config(app, "warning", 2))
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._socket]},
                                        name="fulcrum-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._server.should_exit = True
        self._thread.join(SHUTDOWN_TIMEOUT_S)
        self._socket.close()


class GracefulServer(uvicorn.Server):
    """uvicorn, with vLLM's shutdown: on SIGTERM or SIGINT the app stops taking API calls
    (503) and /health turns 503, requests in flight get up to `shutdown_timeout` seconds to
    finish, then `drain` ends the rest (a server aborts them: finish reason "abort"; the
    data-parallel router closes them, which aborts them at their replicas), and `serve`
    returns 0 instead of re-raising the signal. A second signal skips the wait. `stop(1)`
    (the engine died, or every replica) stops it at once, so a supervisor restarts it.
    `drain(timeout)` waits up to `timeout` seconds and returns how many requests it ended."""

    def __init__(self, app: FastAPI, shutdown_timeout: float, log_level: str,
                 drain: Callable[[float], Awaitable[int]],
                 max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> None:
        super().__init__(uvicorn_config(app, log_level, SHUTDOWN_TIMEOUT_S, max_header_bytes))
        self.app = app
        self.shutdown_timeout = shutdown_timeout
        self.drain = drain
        self.exit_code = 0
        self._drain: Optional[asyncio.Future] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    async def serve(self, sockets: Optional[list] = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:  # a signal handler: main thread
        if self._loop is None:
            self.should_exit = True
        elif self._drain is not None:
            self._loop.call_soon_threadsafe(self._drain.cancel)
        else:
            self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        self.app.state.draining = True
        logger.warning("shutting down: letting requests in flight finish for up to %.0f s",
                       self.shutdown_timeout)
        try:
            await asyncio.shield(asyncio.ensure_future(self._end_requests(self.shutdown_timeout)))
        except asyncio.CancelledError:  # a second signal: abort what is left now
            await self._end_requests(0.0)
        self.should_exit = True

    async def _end_requests(self, timeout: float) -> None:
        aborted = await self.drain(timeout)
        if aborted:
            logger.warning("aborted %d requests still running at shutdown", aborted)

    def stop(self, exit_code: int) -> None:
        self.exit_code = exit_code
        self.should_exit = True


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket listening on host:port (IPv4 or IPv6, as the host resolves), for uvicorn to
    serve on. `fulcrum serve` opens it before the model loads, so a bad --host or a port in
    use fails at once, as in vLLM. It listens at once, not only bound: two sockets with
    SO_REUSEADDR may both be bound while neither listens, so a second server started while
    the first loaded took the port too, loaded its model, then served nothing (uvloop
    drops the failed listen) while saying it ran. Meanwhile connections wait in the backlog
    and are answered once the server is up."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen()
    except OSError as error:
        raise ValueError(f"cannot listen on {host}:{port} (--host, --port): {error}") from None
    return sock


def serve(app: FastAPI, sock: socket.socket,
          shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S, log_level: str = "info",
          max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> int:
    """Serve on `sock` (see listening_socket) until a signal (exit status 0) or the engine's
    death (1)."""
    async_llm = app.state.async_llm
    server = GracefulServer(app, shutdown_timeout, log_level, async_llm.drain, max_header_bytes)

    def engine_died(error: BaseException) -> None:
        logger.error("the engine died (%r); stopping the server", error)
        server.stop(1)

    async_llm.add_dead_listener(engine_died)
    run_on(server, sock)
    return server.exit_code


def run_on(server: uvicorn.Server, sock: socket.socket) -> None:
    host, port = sock.getsockname()[:2]
    # uvicorn names its address only when it binds the socket itself.
    logging.getLogger("uvicorn.error").info(
        "Uvicorn running on http://%s:%d (Press CTRL+C to quit)",
        f"[{host}]" if ":" in host else host, port)
    server.run(sockets=[sock])

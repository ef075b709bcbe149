"""The FastAPI app: OpenAI's routes under /v1, plus health, version, metrics and tokenizer.

`build_app` takes a ready `AsyncLLM`, so one engine can sit behind several apps (tests) and
the caller decides its lifetime. With an API key, only /v1 routes are protected, as in vLLM:
health checks and metric scrapes need no credentials.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from typing import Any, Callable, Optional

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from fulcrum import __version__
from fulcrum.async_engine import AsyncLLM, EngineDeadError
from fulcrum.server.metrics import ServerMetrics
from fulcrum.server.protocol import (ChatCompletionRequest, CompletionRequest,
                                     DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList,
                                     TokenizeRequest, TokenizeResponse)
from fulcrum.server.serving import APIError, OpenAIServing, bad_request

STARTUP_TIMEOUT_S = 30.0
SHUTDOWN_TIMEOUT_S = 10.0


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body().model_dump(), status_code=error.status)


def _validation_message(error: RequestValidationError) -> str:
    """One line per problem, naming the field, as OpenAI's 400 messages do."""
    parts = []
    for problem in error.errors():
        location = ".".join(str(p) for p in problem.get("loc", ()) if p != "body")
        parts.append(f"{location}: {problem.get('msg')}" if location else problem.get("msg"))
    return "; ".join(parts) or "invalid request"


def _add_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return _error_response(error)

    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        return _error_response(bad_request(_validation_message(error)))

    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        return _error_response(APIError(error.status_code, str(error.detail)))

    async def engine_dead(_: Request, error: EngineDeadError) -> JSONResponse:
        return _error_response(APIError(503, str(error)))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(EngineDeadError, engine_dead)


def _api_key_checker(api_key: Optional[str]) -> Callable[[Request], None]:
    def check(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "Invalid or missing API key: send 'Authorization: Bearer KEY'")
    return check


def build_app(async_llm: AsyncLLM, served_model_name: str,
              api_key: Optional[str] = None) -> FastAPI:
    app = FastAPI(title="fulcrum", version=__version__,
                  description="OpenAI-compatible API of the fulcrum inference engine")
    serving = OpenAIServing(async_llm, served_model_name)
    metrics = ServerMetrics(async_llm, served_model_name)
    app.state.async_llm = async_llm
    app.state.metrics = metrics
    _add_error_handlers(app)
    app.include_router(_openai_routes(serving, api_key))
    app.include_router(_utility_routes(serving, metrics))
    return app


def _openai_routes(serving: OpenAIServing, api_key: Optional[str]) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(_api_key_checker(api_key))])
    created = int(time.time())

    @router.post("/completions")
    async def completions(request: CompletionRequest, raw_request: Request) -> Any:
        return await serving.create_completion(request, raw_request)

    @router.post("/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Any:
        return await serving.create_chat_completion(request, raw_request)

    @router.get("/models")
    async def models() -> ModelList:
        llm = serving.llm
        return ModelList(data=[ModelCard(id=serving.model_name, created=created,
                                         root=llm.engine.model_dir,
                                         max_model_len=llm.config.max_model_len)])

    return router


def _utility_routes(serving: OpenAIServing, metrics: ServerMetrics) -> APIRouter:
    router = APIRouter()
    llm = serving.llm

    @router.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if llm.is_healthy else 503)

    @router.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @router.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        serving.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise bad_request("give exactly one of prompt and messages")
        if request.messages is not None:
            _, tokens = serving.render_chat(request.messages, request.add_generation_prompt)
        else:
            tokens = llm.tokenizer.encode(request.prompt, request.add_special_tokens)
        return TokenizeResponse(count=len(tokens), max_model_len=llm.config.max_model_len,
                                tokens=tokens)

    @router.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        serving.check_model(request.model)
        vocab = llm.engine.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token id {bad[0]} is out of vocabulary (valid ids are "
                              f"0..{vocab - 1})")
        return DetokenizeResponse(prompt=llm.tokenizer.decode(request.tokens))

    return router


class BackgroundServer:
    """Serve an app with uvicorn on a daemon thread; for tests, benchmarks and notebooks.

    The socket is bound before the thread starts (port 0: the OS picks a free one), so the
    URL is known and no other process can take the port in between.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = self._socket.getsockname()[:2]
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
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

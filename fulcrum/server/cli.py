"""`fulcrum serve`: the OpenAI-compatible server on one model, every engine knob as a flag."""

from __future__ import annotations

import argparse
from typing import Optional

from fulcrum.engine_args import add_engine_args, engine_kwargs

DESCRIPTION = """\
Serve a model over OpenAI's HTTP API (/v1/completions, /v1/chat/completions,
/v1/models), with /health, /version, /metrics (Prometheus), /tokenize and
/detokenize. Any OpenAI client works: point its base URL at http://HOST:PORT/v1."""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server", description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None,
                        help="local Hugging Face model folder (default: built-in model)")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only; "
                             "0.0.0.0 accepts remote clients)")
    server.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    server.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1 routes")
    server.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: the model argument)")
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"],
                        help="uvicorn's log level (default info: one line per request)")
    add_engine_args(parser)
    parser.set_defaults(func=run)


def served_model_name(args: argparse.Namespace) -> str:
    from fulcrum.default_model import DEFAULT_MODEL_NAME

    name: Optional[str] = args.served_model_name
    return name or args.model or DEFAULT_MODEL_NAME


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from fulcrum.async_engine import AsyncLLM
    from fulcrum.server.api_server import build_app

    async_llm = AsyncLLM.from_engine_args(**engine_kwargs(args))
    app = build_app(async_llm, served_model_name(args), args.api_key)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    finally:
        async_llm.shutdown()
    return 0

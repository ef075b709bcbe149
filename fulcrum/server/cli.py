"""`fulcrum serve`: the OpenAI-compatible server on one model, every engine knob as a flag."""

from __future__ import annotations

import argparse
import logging
import os
import resource
from typing import Any, Dict, List, Optional

from fulcrum.arg_types import non_empty, non_negative_int, port, positive_int, seconds, string_list
from fulcrum.chat_template import CONTENT_FORMATS
from fulcrum.engine_args import add_engine_args, engine_kwargs

logger = logging.getLogger(__name__)

API_KEY_ENV = "FULCRUM_API_KEY"
# Copied from fulcrum.server.api_server and http_protocol, which import the server's heavy
# dependencies.
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 << 20
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
DEFAULT_MAX_HEADER_BYTES = 64 << 10
STATS_INTERVAL_S = 10.0  # vLLM's

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
    server.add_argument("--port", type=port, default=8000,
                        help="port (default 8000)")
    server.add_argument("--api-key", action="append", type=non_empty, default=None, metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on /v1 routes; repeat for "
                             "several keys (default: $FULCRUM_API_KEY, comma-separated)")
    server.add_argument("--max-request-body-bytes", type=positive_int,
                        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="larger request bodies get 413 (default 16 MiB)")
    server.add_argument("--h11-max-incomplete-event-size", type=positive_int,
                        default=DEFAULT_MAX_HEADER_BYTES, metavar="BYTES",
                        help="largest header block a request may send (vLLM's flag; default "
                             "64 KiB, vLLM's 4 MiB: h11 parses it on the event loop)")
    server.add_argument("--shutdown-timeout", type=seconds, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                        help="on SIGTERM/SIGINT, seconds requests in flight get to finish "
                             "before they are aborted (default 30)")
    server.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                        help="the chat template to use instead of the model's: a file or "
                             "the Jinja template itself (vLLM's flag)")
    server.add_argument("--chat-template-content-format", choices=CONTENT_FORMATS,
                        default="auto",
                        help="how the chat template reads message content: 'string' (text "
                             "parts joined), 'openai' (a list of parts), or 'auto' (as the "
                             "template's loops show; vLLM's flag)")
    server.add_argument("--trust-request-chat-template", action="store_true",
                        help="let requests bring their own chat_template (off: refused)")
    server.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction,
                        default=False, help="log each request's prompt lengths and sampling "
                                            "parameters (vLLM's flag; default off)")
    server.add_argument("--disable-log-requests", dest="enable_log_requests",
                        action="store_false", help="vLLM's older spelling of the default")
    server.add_argument("--enable-request-id-headers", action="store_true",
                        help="add an X-Request-Id header to responses: the request's own, "
                             "else the id its completion got (vLLM's flag; vLLM's then gives "
                             "a fresh one)")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='read tool calls from the model\'s answers for tool_choice "auto" '
                             "(needs --tool-call-parser)")
    server.add_argument("--tool-call-parser", default=None,
                        choices=["hermes", "llama3_json", "mistral"],
                        help="the model's tool call format: hermes (Qwen, Hermes: "
                             "<tool_call>...</tool_call>), llama3_json, mistral ([TOOL_CALLS])")
    server.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                        help="split chat answers into the model's thinking (the message's "
                             "`reasoning`, also `reasoning_content`) and its answer "
                             "(`content`): deepseek_r1 (DeepSeek-R1, QwQ, Qwen3's thinking-only "
                             "models: thinking until </think>), qwen3 (thinking only where the "
                             "answer opens with <think>)")
    server.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the model name(s) clients send; responses carry the first "
                             "(default: the model argument)")
    server.add_argument("--max-log-len", type=non_negative_int, default=None,
                        help="with --enable-log-requests: most prompt characters and token "
                             "ids logged per request (default: all)")
    server.add_argument("--allowed-origins", type=string_list, default=None, metavar="JSON",
                        help='CORS: allowed origins as a JSON list, e.g. \'["*"]\' (default: '
                             'none, so no CORS headers at all; unlike vLLM, whose default is '
                             '["*"]); the other CORS flags need it')
    server.add_argument("--allowed-methods", type=string_list, default=None, metavar="JSON",
                        help="CORS, with --allowed-origins: allowed methods as a JSON list "
                             "(default [\"*\"])")
    server.add_argument("--allowed-headers", type=string_list, default=None, metavar="JSON",
                        help="CORS, with --allowed-origins: allowed headers as a JSON list "
                             "(default [\"*\"])")
    server.add_argument("--allow-credentials", action="store_true",
                        help="CORS, with --allowed-origins: allow credentials")
    server.add_argument("--web-ui", action=argparse.BooleanOptionalAction, default=True,
                        help="serve the chat playground and live scheduler dashboard at / "
                             "(default on; --no-web-ui: API only)")
    server.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                        help="N whole engines (replicas), each with its share of the cores, "
                             "behind this one server's router (vLLM's flag; default 1)")
    server.add_argument("--data-parallel-backend", default="mp", choices=["mp", "ray"],
                        help="replicas as spawned processes (mp, default) or Ray actors, "
                             "possibly on other machines of $RAY_ADDRESS's cluster")
    server.add_argument("--router-policy", default="cache_aware",
                        choices=["cache_aware", "round_robin"],
                        help="with replicas: send a request where its prompt's prefix was "
                             "served (while loads stay balanced), or in turn")
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"],
                        help="uvicorn's log level (default info: one line per request)")
    add_engine_args(parser, served=True)
    parser.set_defaults(func=run)


def served_model_names(args: argparse.Namespace) -> List[str]:
    from fulcrum.default_model import DEFAULT_MODEL_NAME

    return list(args.served_model_name or [args.model or DEFAULT_MODEL_NAME])


def cors_options(args: argparse.Namespace) -> Optional[Dict[str, Any]]:
    """CORSMiddleware's keywords, or None when no --allowed-origins was given: fulcrum then
    sends no CORS headers (vLLM's default origins are "*"), so the other CORS flags would
    change nothing and are refused."""
    if args.allowed_origins is None:
        given = [flag for flag, value in (("--allowed-methods", args.allowed_methods),
                                          ("--allowed-headers", args.allowed_headers),
                                          ("--allow-credentials", args.allow_credentials or None))
                 if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} shape CORS answers, which only "
                             "--allowed-origins turns on (fulcrum sends none by default, "
                             "unlike vLLM, whose default origins are [\"*\"]): give "
                             "--allowed-origins too")
        return None
    return {"allow_origins": args.allowed_origins,
            "allow_methods": ["*"] if args.allowed_methods is None else args.allowed_methods,
            "allow_headers": ["*"] if args.allowed_headers is None else args.allowed_headers,
            "allow_credentials": args.allow_credentials}


def show_request_log(args: argparse.Namespace) -> None:
    """--enable-log-requests logs at INFO, as vLLM does, whatever --log-level hides."""
    if args.enable_log_requests:
        logging.getLogger("fulcrum.server.serving").setLevel(logging.INFO)


def api_keys(args: argparse.Namespace) -> List[str]:
    if args.api_key:
        return list(args.api_key)
    listed = os.environ.get(API_KEY_ENV, "")
    keys = [k.strip() for k in listed.split(",") if k.strip()]
    if listed.strip() and not keys:  # set to something, yet no key: not "no auth"
        raise ValueError(f"${API_KEY_ENV} is set but holds no key: {listed!r}")
    return keys


def raise_open_file_limit(target: int = 65535) -> None:
    """Each request in flight holds a socket (two through the data-parallel router): raise
    the soft limit on open files towards `target`, as vLLM does, where it is lower (1024 is
    a common default)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as error:
            logger.warning("could not raise the open-file limit from %d (%s): many clients "
                           "at once may meet 'Too many open files'; see `ulimit -n`",
                           soft, error)


def run(args: argparse.Namespace) -> int:
    from fulcrum.chat_template import load_chat_template

    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    # The server's own options are checked before any model loads (in any replica).
    keys = api_keys(args)
    cors = cors_options(args)
    template = load_chat_template(args.chat_template) if args.chat_template else None
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    show_request_log(args)
    raise_open_file_limit()
    if args.data_parallel_size > 1:
        return run_router(args, cors)
    from fulcrum.async_engine import AsyncLLM
    from fulcrum.server.api_server import build_app, listening_socket, serve

    sock = listening_socket(args.host, args.port)
    parser = args.tool_call_parser if args.enable_auto_tool_choice else None
    async_llm = AsyncLLM.from_engine_args(**engine_kwargs(args))
    app = build_app(async_llm, served_model_names(args), keys,
                    args.max_request_body_bytes, args.trust_request_chat_template,
                    args.enable_log_requests, template, parser, args.max_log_len, cors,
                    None if args.disable_log_stats else STATS_INTERVAL_S, args.web_ui,
                    args.enable_request_id_headers, args.chat_template_content_format,
                    args.reasoning_parser)
    try:
        return serve(app, sock, args.shutdown_timeout, args.uvicorn_log_level,
                     args.h11_max_incomplete_event_size)
    finally:
        async_llm.shutdown()


def run_router(args: argparse.Namespace, cors: Optional[Dict[str, Any]]) -> int:
    """The router in front of the replicas, drained on a signal as a single server is (see
    GracefulServer); the replicas are stopped only then."""
    from fulcrum.server.api_server import GracefulServer, listening_socket, run_on
    from fulcrum.server.replicas import start_replicas
    from fulcrum.server.router import build_router_app

    sock = listening_socket(args.host, args.port)
    replicas = start_replicas(args, args.data_parallel_size, args.data_parallel_backend)
    try:
        app = build_router_app(replicas.replicas, args.router_policy,
                               args.max_request_body_bytes, cors,
                               args.enable_request_id_headers,
                               on_all_down=lambda: server.stop(1))  # as an engine's death
        server = GracefulServer(app, args.shutdown_timeout, args.uvicorn_log_level,
                                app.state.drain, args.h11_max_incomplete_event_size)
        run_on(server, sock)
        return server.exit_code
    finally:
        replicas.stop()

"""`fulcrum` command line: demo, generate, serve, bench.

Each command lives in its own module, which adds its sub-parser in `register(subparsers)`
and sets `func` to what runs it.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import List, Optional

COMMAND_MODULES = ("fulcrum.demo", "fulcrum.generate", "fulcrum.server.cli", "fulcrum.bench.cli")


def build_parser() -> argparse.ArgumentParser:
    from fulcrum import __version__

    parser = argparse.ArgumentParser(
        prog="fulcrum",
        description="fulcrum: LLM inference with continuous batching, a paged KV cache and "
                    "chunked prefill. Models are local Hugging Face folders; with none given, "
                    "the built-in default model (SmolLM2-135M-shaped, random weights) is used.")
    parser.add_argument("--version", action="version", version=f"fulcrum {__version__}")
    parser.add_argument("--log-level", default=None,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="default: INFO for serve (its periodic stats and start-up lines, "
                             "as vLLM's), WARNING for the other commands")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def log_level(args: argparse.Namespace) -> str:
    return args.log_level or ("INFO" if args.command == "serve" else "WARNING")


def configure_logging(args: argparse.Namespace) -> None:
    """fulcrum's own loggers at `log_level`; other libraries' at WARNING unless --log-level
    is given (httpx logs every request at INFO: the router's health probes every 2 s).
    Where the process has configured logging already (a host application, pytest), as
    logging.basicConfig does, nothing changes."""
    if logging.getLogger().handlers:
        return
    logging.basicConfig(level=args.log_level or "WARNING",
                        format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("fulcrum").setLevel(log_level(args))


class CommandError(RuntimeError):
    """A command failed for a reason its message tells in full (a data-parallel replica that
    did not start, say): shown as one line, exit status 1, without a traceback."""


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed command: its exit status, a bad setting (ValueError, FileNotFoundError,
    TypeError) as one line and status 2 (argparse's for usage errors), a CommandError as
    one line and status 1."""
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError, TypeError, CommandError) as error:
        print(f"fulcrum {args.command}: error: {error}", file=sys.stderr)
        return 1 if isinstance(error, CommandError) else 2


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args)
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())

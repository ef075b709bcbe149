"""argparse types shared by the commands: a value is checked as it is parsed, so a bad one
is a usage error that names its flag (exit 2), before any model loads."""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import List


def port(text: str) -> int:
    """A TCP port number (argparse names the function in its error for a non-number)."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (0-65535)")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def seconds(text: str) -> float:
    """A finite duration of 0 or more seconds (float() takes 'nan' and 'inf')."""
    value = float(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


def positive_seconds(text: str) -> float:
    value = seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be more than 0 seconds")
    return value


def rate_list(text: str) -> str:
    """Comma-separated request rates, each a positive number (inf: all at once); kept as
    written, since reports quote the command."""
    for item in text.split(","):
        try:
            rate = float(item)
        except ValueError:
            rate = math.nan
        if not rate > 0:
            raise argparse.ArgumentTypeError(f"must be positive request rates separated by "
                                             f"commas, got {item!r} in {text!r}")
    return text


def string_list(text: str) -> List[str]:
    """A JSON list of strings, e.g. '["*"]' (a bare JSON string would be matched as a
    sequence of characters by whatever takes a list)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, e.g. '[\"*\"]', "
                                         f"got {text!r}")
    return value


def non_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def url_path(text: str) -> str:
    if not text.startswith("/"):
        raise argparse.ArgumentTypeError(f"must be a path that starts with '/', got {text!r}")
    return text


def output_file(text: str) -> str:
    """A file to write results to, checked before the run that fills it."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory, not a file")
    _check_can_create(path)
    return text


def output_dir(text: str) -> str:
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} exists and is not a directory")
    _check_can_create(path)
    return text


def _check_can_create(path: Path) -> None:
    """Its nearest existing folder must be a folder this process may write in."""
    existing = path.absolute().parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot create {path}: {existing} is not a "
                                         f"writable directory")

"""The JSON files of a model folder (config.json, tokenizer_config.json, ...), read so that a
broken one is named in the error: json's own message says where, never which file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict


def read_json_object(path: Path) -> Dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not text: {error}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds no JSON object")
    return data

"""A model's own sampling defaults, read from its generation_config.json as vLLM's
`--generation-config auto` reads them.

Model authors ship the temperature, top-p and so on their model was tuned for; a request that
leaves a parameter unset gets the model's value instead of the library's. Only the fields
vLLM applies are read (HF's `max_new_tokens` becomes `max_tokens`); `vllm` ignores the file,
and a folder path reads the file from that folder instead of the model's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

from fulcrum.json_files import read_json_object

# generation_config.json key -> SamplingParams field.
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_config_folder(source: str, model_dir: Optional[str]) -> Optional[str]:
    """The folder whose generation config `source` names: the model's for "auto" and
    "vllm" (which ignores its sampling defaults, not the eos ids it lists: vLLM stops on
    those either way), else the folder given."""
    return model_dir if source in ("auto", "vllm") else source


def load_generation_defaults(source: str, model_dir: Optional[str]) -> Dict[str, Any]:
    """SamplingParams fields from the generation config that `source` names ("auto": the
    model folder's, if it has one; "vllm": none; else a folder holding the file)."""
    if source == "vllm":
        return {}
    folder = generation_config_folder(source, model_dir)
    path = Path(folder) / "generation_config.json" if folder else None
    if path is None or not path.is_file():
        if source == "auto":
            return {}
        raise FileNotFoundError(f"generation_config {source!r}: no generation_config.json "
                                "in that folder (use 'auto' for the model's own or 'vllm' "
                                "for none)")
    data = read_json_object(path)
    return {ours: data[theirs] for theirs, ours in FIELDS.items()
            if data.get(theirs) is not None}

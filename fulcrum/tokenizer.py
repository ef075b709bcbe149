"""The model's tokenizer (HF `tokenizer.json` through the `tokenizers` library, or a slow
tokenizer's files converted by transformers), its special tokens, and its chat templates
(rendered by fulcrum.chat_template)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

from tokenizers import Tokenizer as _HFTokenizer

from fulcrum.chat_template import find_chat_templates, pick_template, render_chat
from fulcrum.json_files import read_json_object


# Texts (or token lists) longer than this go through the tokenizers library's batch calls,
# which let go of the GIL while they work: its single calls hold it throughout (a
# 1.1-million-character text held every other thread, the server's event loop, 0.9 s).
LONG_TEXT_CHARS = 10_000

# A slow tokenizer's files, which transformers converts where a folder has no tokenizer.json.
SLOW_TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "merges.txt")


def _read_json(path: Path) -> Dict[str, Any]:
    return read_json_object(path) if path.is_file() else {}


def lone_surrogate(text: str) -> Optional[int]:
    """Where `text` holds a lone UTF-16 surrogate (a \\ud800 without its pair), or None.
    Python strings may hold one; no Unicode text does, and tokenizers and UTF-8 encoders
    raise on it deep inside whatever handles the text."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return error.start
    return None


def lone_surrogate_at(value: Any) -> Optional[str]:
    """Where in parsed JSON (a request's body, a parameter's value) a string holds a lone
    UTF-16 surrogate (a \\ud800 escape without its pair), as "field.0.key" ("" for `value`
    itself); None if nowhere. No text holds one: tokenizers and UTF-8 encoders raise on it
    deep inside a request's handling."""
    try:  # in C, most of the time: a walk in Python took seconds for a large body
        json.dumps(value, ensure_ascii=False).encode("utf-8")
        return None
    except (UnicodeEncodeError, TypeError, ValueError, RecursionError):
        pass  # one is there (or the value is no JSON): the walk says where
    pending: List[Tuple[Any, Tuple[Any, ...]]] = [(value, ())]
    while pending:
        item, path = pending.pop()
        if isinstance(item, str):
            if lone_surrogate(item) is not None:
                return ".".join(map(str, path))
        elif isinstance(item, dict):
            pending.extend((key, path) for key in item)
            pending.extend((child, (*path, key)) for key, child in item.items())
        elif isinstance(item, list):
            pending.extend((child, (*path, i)) for i, child in enumerate(item)
                           if isinstance(child, (str, dict, list)))
    return None


def _token_content(value: Any) -> Optional[str]:
    """Special tokens in tokenizer_config.json are plain strings or AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _load_backend(folder: Path) -> _HFTokenizer:
    """The folder's tokenizer.json, read by the tokenizers library; a folder without one is
    converted by transformers (see `_converted`)."""
    file = folder / "tokenizer.json"
    if not file.is_file():
        return _converted(folder)
    try:
        return _HFTokenizer.from_file(str(file))
    except Exception as error:  # tokenizers raises a bare Exception
        raise ValueError(f"{file} is not a tokenizer the tokenizers library reads: "
                         f"{error}") from None


def _converted(folder: Path) -> _HFTokenizer:
    """The tokenizer of a folder that ships it only in a slow tokenizer's files (a
    SentencePiece tokenizer.model, GPT-2-style vocab.json and merges.txt), converted by
    transformers where it is installed: vLLM loads every tokenizer with transformers'
    AutoTokenizer, which converts such a folder, so a model that serves there serves here."""
    found = [name for name in SLOW_TOKENIZER_FILES if (folder / name).is_file()]
    if not found:
        raise FileNotFoundError(
            f"no tokenizer.json in {folder}: fulcrum needs a fast (tokenizers) tokenizer")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise FileNotFoundError(
            f"no tokenizer.json in {folder}, only {', '.join(found)}: install transformers "
            "(fulcrum converts the tokenizer with it, as vLLM does) or save a tokenizer.json "
            "once with AutoTokenizer.from_pretrained(folder).save_pretrained(folder)") from None
    try:
        return AutoTokenizer.from_pretrained(str(folder)).backend_tokenizer
    except Exception as error:  # transformers raises many kinds, its converters more
        raise ValueError(f"no tokenizer.json in {folder}, and transformers could not convert "
                         f"its {', '.join(found)} (a SentencePiece model needs the "
                         f"sentencepiece package): {error}"[:500]) from None


class Tokenizer:
    def __init__(self, path: str, model_dir: Optional[str] = None) -> None:
        """The tokenizer in folder `path`. The eos ids generation stops on are the tokenizer's
        EOS and those `model_dir`'s generation_config.json (else config.json) lists, as
        vLLM reads them from the model's folder, not the tokenizer's (default: `path`)."""
        folder = Path(path)
        self._tok = _load_backend(folder)
        config = _read_json(folder / "tokenizer_config.json")
        self.special_tokens = self._find_special_tokens(folder, config)
        self.eos_token = self.special_tokens.get("eos_token")
        # The tokenizer's own EOS id (vLLM's primary one: a stop on it has no stop_reason).
        self.eos_token_id = None if self.eos_token is None else \
            self._tok.token_to_id(self.eos_token)
        # One template, or several by name ("default", "tool_use", ...), as transformers has it.
        self.chat_template = find_chat_templates(folder, config)
        self.eos_token_ids = self._find_eos_ids(Path(model_dir) if model_dir else folder)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # No token stands for more characters than its own string has (byte-level and
        # byte-fallback pieces spell a byte with one or more characters).
        self.max_chars_per_token = max(map(len, self._tok.get_vocab(with_added_tokens=True)))

    @staticmethod
    def _find_special_tokens(folder: Path, config: Dict[str, Any]) -> Dict[str, str]:
        """The named special tokens a template sees (bos_token, pad_token, a model's own
        image_token, ...), as transformers finds them: tokenizer_config.json's `*_token`
        entries and extra_special_tokens over them. special_tokens_map.json is read only
        where the config has no added_tokens_decoder (a tokenizer saved before transformers
        4.34), and its tokens then win over the config's; transformers ignores the map of a
        newer config, so a token only the map names is none there. A token set to null
        (Qwen's bos_token) is none, whatever the file read before says."""
        found: Dict[str, str] = {}
        extra = config.get("extra_special_tokens")
        legacy = "added_tokens_decoder" not in config
        sources = (config, _read_json(folder / "special_tokens_map.json")) if legacy else (config,)
        for source in (*sources, extra if isinstance(extra, dict) else {}):
            for name, value in source.items():
                token = _token_content(value)
                if name.endswith("_token") and isinstance(token, str):
                    found[name] = token
                elif name.endswith("_token") and value is None:  # none, as a later file says
                    found.pop(name, None)
        return found

    def _find_eos_ids(self, folder: Path) -> Set[int]:
        ids: Set[int] = set()
        for source in ("generation_config.json", "config.json"):
            value = _read_json(folder / source).get("eos_token_id")
            if value is not None:
                found = value if isinstance(value, list) else [value]
                if not all(isinstance(i, int) and not isinstance(i, bool) for i in found):
                    raise ValueError(f"{folder / source}: eos_token_id must be a token id or "
                                     f"a list of them, got {value!r}"[:200])
                ids.update(found)
                break
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        return ids

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        try:
            if len(text) > LONG_TEXT_CHARS:
                return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # tokenizers': "TextInputSequence must be str"
            where = lone_surrogate(text) if isinstance(text, str) else None
            if where is not None:
                raise ValueError(f"the text holds a lone UTF-16 surrogate at character "
                                 f"{where}: it is not valid Unicode") from None
            raise

    def decode(self, token_ids: List[int], skip_special_tokens: bool = False) -> str:
        """The text of `token_ids`, special tokens kept unless `skip_special_tokens`, as
        transformers' decode has it (vLLM's get_tokenizer() is a transformers tokenizer)."""
        if len(token_ids) > LONG_TEXT_CHARS:
            return self._tok.decode_batch([token_ids], skip_special_tokens=skip_special_tokens)[0]
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> Optional[str]:
        return self._tok.id_to_token(token_id)

    def vocab(self) -> Dict[str, int]:
        """Every token's string (as tokenizer.json spells it) and id, added tokens included."""
        return self._tok.get_vocab(with_added_tokens=True)

    def special_token_ids(self) -> Set[int]:
        """The added tokens marked special: what decoding with skip_special_tokens drops."""
        return {index for index, token in self._tok.get_added_tokens_decoder().items()
                if token.special}

    def backend_json(self) -> str:
        """The whole tokenizer.json, which says how token strings spell bytes."""
        return self._tok.to_str()

    def template_for(self, chat_template: Optional[str] = None, tools: Any = None) -> str:
        """The template a chat renders with: `chat_template` (a template, or the name of one
        of the model's), else the model's (its tool_use one where tools are given)."""
        return pick_template(self.chat_template, chat_template, tools)

    def apply_chat_template(self, messages: List[Dict[str, Any]],
                            add_generation_prompt: bool = True,
                            chat_template: Optional[str] = None,
                            continue_final_message: bool = False, **kwargs: Any) -> str:
        """The conversation as the model's template (or `chat_template`, a template or the
        name of one of the model's) renders it, as transformers' apply_chat_template does;
        `kwargs` (tools, documents, chat_template_kwargs) reach the template."""
        template = self.template_for(chat_template, kwargs.get("tools"))
        return render_chat(template, messages, add_generation_prompt, continue_final_message,
                           {**self.special_tokens, **kwargs})

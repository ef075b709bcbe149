"""The model's tokenizer (HF `tokenizer.json` through the `tokenizers` library) and chat template."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Union

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
from tokenizers import Tokenizer as _HFTokenizer

from fulcrum.json_files import read_json_object


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


def _token_content(value: Any) -> Optional[str]:
    """Special tokens in tokenizer_config.json are plain strings or AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators: Optional[tuple] = None, sort_keys: bool = False) -> str:
    """transformers' tojson: json.dumps without jinja's HTML escaping, its options exposed."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    """transformers' strftime_now: templates date their system prompts (Llama 3.x)."""
    return datetime.now().strftime(format)


class _Namespace(jinja2.utils.Namespace):
    """transformers' namespace: no attribute of a template's own may start with "_"."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's trick: namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"but got {name!r}. Please rename the attribute.")


class _Generation(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (marks the assistant's tokens
    for training masks): rendering for inference, it renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Callable[[], str]) -> str:
        return caller()


# Where a message's reasoning may be (transformers'): templates read reasoning_content.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# The special tokens a template sees by name (transformers' SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")


def template_messages(messages: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The messages as transformers hands them to a template: keys whose value is None dropped
    (templates test for a missing key, and would print "None"), and a message's reasoning
    under each of its names."""
    found = []
    for message in messages:
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        found.append(message)
    return found


# The most items (characters, list entries) a template's `*` may make, and the most bits of a
# `**`: a request's own template (--trust-request-chat-template) or a caller's cannot hold
# the process up building {{ [0] * 10**9 }} (minutes and gigabytes, then a traceback that
# quotes it).
MAX_TEMPLATE_REPEAT = 1 << 20
MAX_TEMPLATE_POWER_BITS = 1 << 16


class _TemplateEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The sandbox, with `*` and `**` checked before they run (jinja then never folds them
    while compiling, either), and calls' counts. Not bounded: widths inside format strings
    and filters ({{ 'a' | center(10**9) }}); loops (the sandbox caps a range at 100,000)."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for count, items in ((left, right), (right, left)):
                if isinstance(count, int) and hasattr(items, "__len__") \
                        and count * len(items) > MAX_TEMPLATE_REPEAT:
                    raise jinja2.exceptions.TemplateError(
                        f"the chat template repeats {len(items)} items {count} times, more "
                        f"than the {MAX_TEMPLATE_REPEAT} allowed")
        elif isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                and right * abs(left).bit_length() > MAX_TEMPLATE_POWER_BITS:
            raise jinja2.exceptions.TemplateError(
                f"the chat template raises {left} to the power {right}: too large a number")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        """Calls with a count past the bound ("a".ljust(10**9), "a".center(...)) refused."""
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and abs(value) > MAX_TEMPLATE_REPEAT:
                raise jinja2.exceptions.TemplateError(
                    f"the chat template calls {getattr(__obj, '__name__', 'a function')} with "
                    f"{value}, more than the {MAX_TEMPLATE_REPEAT} allowed")
        return super().call(__context, __obj, *args, **kwargs)


def _environment() -> _TemplateEnvironment:
    """The sandbox with what transformers gives templates: its tojson, strftime_now,
    raise_exception, namespace and {% generation %}, and loop controls."""
    env = _TemplateEnvironment(trim_blocks=True, lstrip_blocks=True,
                               extensions=[_Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       namespace=_Namespace)
    return env


# transformers' marker for continue_final_message: appended to the final message, looked for
# in the rendered chat, cut there.
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# The roles a chat message may have (OpenAI's), on the server and offline alike.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _open_final_message(render: Callable[[List[Dict[str, Any]]], str],
                        messages: List[Dict[str, Any]], template: str) -> str:
    """The chat rendered up to the end of its final message's text, as transformers does it:
    the text tagged (the last text part's, for content given as parts), rendered, cut at the
    tag (and the spaces a template trimmed, trimmed)."""
    if not messages:
        raise ValueError("continue_final_message is set but the conversation is empty!")
    final = messages[-1].get("content")
    if final is None:
        raise ValueError('continue_final_message is set but the final message has no '
                         '"content" to continue!')
    if "content" not in template:
        raise ValueError('continue_final_message is set to "content" but this is not an '
                         'accepted field in the chat_template')
    if isinstance(final, (list, tuple)):
        parts = [dict(part) if isinstance(part, dict) else part for part in final]
        at = next((i for i in reversed(range(len(parts)))
                   if isinstance(parts[i], dict) and "text" in parts[i]), None)
        if at is None:
            raise ValueError("continue_final_message is set but we could not find any text to "
                             "continue in the final message!")
        final = parts[at]["text"]
        parts[at]["text"] = final + CONTINUE_TAG
        tagged: Any = parts
    else:
        tagged = final + CONTINUE_TAG
    text = render([*messages[:-1], {**messages[-1], "content": tagged}])
    if final.strip() not in text or CONTINUE_TAG.strip() not in text:
        raise ValueError("continue_final_message is set, but the final message's text does "
                         "not appear in the rendered chat template")
    at = text.rindex(CONTINUE_TAG.strip())
    return text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()


class Tokenizer:
    def __init__(self, path: str) -> None:
        folder = Path(path)
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {folder}: fulcrum needs a fast (tokenizers) tokenizer")
        try:
            self._tok = _HFTokenizer.from_file(str(file))
        except Exception as error:  # tokenizers raises a bare Exception
            raise ValueError(f"{file} is not a tokenizer the tokenizers library reads: "
                             f"{error}") from None
        config = _read_json(folder / "tokenizer_config.json")
        # Each named special token that is set, as templates see them (bos_token, ...).
        self.special_tokens = {name: _token_content(config[name]) for name in SPECIAL_TOKEN_NAMES
                               if isinstance(_token_content(config.get(name)), str)}
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        # One template, or several by name ("default", "tool_use", ...), as transformers has it.
        self.chat_template = self._find_chat_template(folder, config)
        self.eos_token_ids = self._find_eos_ids(folder)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # No token stands for more characters than its own string has (byte-level and
        # byte-fallback pieces spell a byte with one or more characters).
        self.max_chars_per_token = max(map(len, self._tok.get_vocab(with_added_tokens=True)))

    @staticmethod
    def _find_chat_template(folder: Path, config: Dict[str, Any]
                            ) -> Union[None, str, Dict[str, str]]:
        template_file = folder / "chat_template.jinja"
        if template_file.is_file():
            return template_file.read_text()
        template = config.get("chat_template")
        if isinstance(template, list):
            return {t["name"]: t["template"] for t in template}
        return template

    def _pick_template(self, chat_template: Optional[str], tools: Any) -> str:
        """transformers' choice: the given template (or the model's of that name), else the
        model's; among named ones, "tool_use" where tools are given, else "default"."""
        named = self.chat_template if isinstance(self.chat_template, dict) else {}
        if chat_template is not None:
            return named.get(chat_template, chat_template)
        if named:
            if tools is not None and "tool_use" in named:
                return named["tool_use"]
            if "default" in named:
                return named["default"]
            raise ValueError("This model has multiple chat templates with no default specified! "
                             "Please either pass a chat template or the name of the template "
                             "you wish to use to the `chat_template` argument. Available "
                             f"template names are {sorted(named)}.")
        if self.chat_template is None:
            raise ValueError("this model has no chat template; pass chat_template= or use "
                             "generate() with a plain prompt")
        return self.chat_template

    def _find_eos_ids(self, folder: Path) -> Set[int]:
        ids: Set[int] = set()
        for source in ("generation_config.json", "config.json"):
            value = _read_json(folder / source).get("eos_token_id")
            if value is not None:
                ids.update(value if isinstance(value, list) else [value])
                break
        if self.eos_token is not None and self._tok.token_to_id(self.eos_token) is not None:
            ids.add(self._tok.token_to_id(self.eos_token))
        return ids

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        try:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # tokenizers': "TextInputSequence must be str"
            where = lone_surrogate(text) if isinstance(text, str) else None
            if where is not None:
                raise ValueError(f"the text holds a lone UTF-16 surrogate at character "
                                 f"{where}: it is not valid Unicode") from None
            raise

    def decode(self, token_ids: List[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> Optional[str]:
        return self._tok.id_to_token(token_id)

    def vocab(self) -> Dict[str, int]:
        """Every token's string (as tokenizer.json spells it) and id, added tokens included."""
        return self._tok.get_vocab(with_added_tokens=True)

    def backend_json(self) -> str:
        """The whole tokenizer.json, which says how token strings spell bytes."""
        return self._tok.to_str()

    @staticmethod
    def load_chat_template(value: str) -> str:
        """A chat template given as vLLM's `--chat-template` takes it: a file's path or the
        template itself (which, as there, must hold a brace or a newline: anything else is a
        path that does not exist); a template that does not compile is refused at once."""
        path = Path(value)
        if not path.is_file() and not any(c in value for c in "{}\n"):
            raise ValueError(f"chat template {value!r} looks like a file's path, but there is no "
                             "such file (a template itself holds {{, {% or a newline)")
        try:
            template = path.read_text() if path.is_file() else value
        except OSError as error:
            raise ValueError(f"cannot read chat template {value!r}: {error}") from None
        try:
            _environment().parse(template)
        except jinja2.TemplateSyntaxError as error:
            raise ValueError(f"chat template {value[:80]!r} does not compile: {error}") from None
        return template

    def apply_chat_template(self, messages: List[Dict[str, Any]],
                            add_generation_prompt: bool = True,
                            chat_template: Optional[str] = None,
                            continue_final_message: bool = False, **kwargs: Any) -> str:
        """The conversation as the template renders it. `continue_final_message` (HF's and
        vLLM's): the text ends with the last message's own, not closed, so the model goes
        on with that message (a prefilled answer) rather than starting a new one."""
        template = self._pick_template(chat_template, kwargs.get("tools"))
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both "
                             "be true")
        messages = template_messages(messages)

        def render(conversation: List[Dict[str, Any]]) -> str:
            return self._render(template, conversation, add_generation_prompt, **kwargs)

        return _open_final_message(render, messages, template) if continue_final_message \
            else render(messages)

    def _render(self, template: str, messages: List[Dict[str, Any]],
                add_generation_prompt: bool, **kwargs: Any) -> str:
        """As transformers renders: its globals and filters, `tools` and `documents` None
        unless given, the named special tokens (the caller's keywords over them)."""
        variables = {"tools": None, "documents": None, **self.special_tokens, **kwargs}
        return _environment().from_string(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables)

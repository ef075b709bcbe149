"""Chat templates, rendered as transformers' `apply_chat_template` renders them (the
reference vLLM serves with): in jinja's immutable sandbox, with transformers' globals and
filters, its choice among named templates, the variables it always defines and messages as
it normalises them; and bounded, since a template may be a request's own
(--trust-request-chat-template) or a hub model's.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
import numpy as np

Templates = Union[None, str, Dict[str, str]]  # a model's: one, or several by name

# transformers' marker for continue_final_message: appended to the final message, looked for
# in the rendered chat, cut there.
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


# What a template's own code may raise while it renders ({{ 1/0 }}, raise_exception(...),
# an undefined name's attribute): the request's (or caller's) fault, not the server's.
TEMPLATE_ERRORS = (ArithmeticError, LookupError, RecursionError, MemoryError,
                   jinja2.TemplateError)
# Names a render sets itself, which chat_template_kwargs may not.
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "add_generation_prompt",
                                     "continue_final_message", "chat_template"})


def check_template_kwargs(kwargs: Any) -> None:
    """chat_template_kwargs: a dict of keyword names to values, none of them a render's own."""
    if kwargs is None:
        return
    if not isinstance(kwargs, dict) or not all(isinstance(key, str) for key in kwargs):
        raise TypeError("chat_template_kwargs must be a dict of keyword names to values")
    reserved = RESERVED_TEMPLATE_NAMES & set(kwargs)
    if reserved:
        raise ValueError(f"chat_template_kwargs cannot set {', '.join(sorted(reserved))}: "
                         "they are set by the request itself")


# Where a message's reasoning may be (transformers'): templates read reasoning_content.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# The most items (characters, list entries) a template's `*` may make, and the most bits of a
# `**`: a request's own template (--trust-request-chat-template) or a caller's cannot hold
# the process up building {{ [0] * 10**9 }} (minutes and gigabytes, then a traceback that
# quotes it).
MAX_TEMPLATE_REPEAT = 1 << 20
MAX_TEMPLATE_POWER_BITS = 1 << 16
MAX_TEMPLATE_RANGE_ITEMS = 1 << 20


class _TemplateEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The sandbox, with `*` and `**` checked before they run (jinja then never folds them
    while compiling, either), and calls' counts (strftime_now's widths are refused where it
    runs), and the items of all a render's ranges together (`_RangeBudget`). Not bounded:
    widths inside format strings, filters' arguments ({{ 'a' | center(10**9) }}, tojson's
    indent), `~` and `+` of growing strings; loops over other sequences."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            if isinstance(left, int) and isinstance(right, int) \
                    and abs(left).bit_length() + abs(right).bit_length() > MAX_TEMPLATE_POWER_BITS:
                raise jinja2.exceptions.TemplateError(
                    "the chat template multiplies two numbers into too large a number")
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




class _RangeBudget:
    """`range` for one render: the sandbox caps each range at 100,000 items, but loops nest
    (two such loops are 10**10 steps, a thread busy for hours); all of a render's ranges
    together may give MAX_TEMPLATE_RANGE_ITEMS."""

    def __init__(self) -> None:
        self.left = MAX_TEMPLATE_RANGE_ITEMS

    def __call__(self, *args: int) -> range:
        items = jinja2.sandbox.safe_range(*args)
        self.left -= len(items)
        if self.left < 0:
            raise jinja2.exceptions.TemplateError(
                f"the chat template's loops over ranges take more than "
                f"{MAX_TEMPLATE_RANGE_ITEMS} steps")
        return items


def _environment() -> _TemplateEnvironment:
    """The sandbox with what transformers gives templates: its tojson, strftime_now,
    raise_exception, namespace and {% generation %}, and loop controls."""
    env = _TemplateEnvironment(trim_blocks=True, lstrip_blocks=True,
                               extensions=[_Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       namespace=_Namespace)
    return env


@functools.lru_cache(maxsize=32)
def _compiled(template: str) -> jinja2.Template:
    """Compiled once (most of a render's time: ~18 ms for Llama 3.1's template). Blocks nested
    past what Python compiles (jinja's code for them) are the template's error."""
    try:
        return _environment().from_string(template)
    except (SyntaxError, RecursionError, MemoryError) as error:
        raise jinja2.exceptions.TemplateSyntaxError(
            f"the chat template nests too deeply to compile ({type(error).__name__})", 1) \
            from None


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators: Optional[tuple] = None, sort_keys: bool = False) -> str:
    """transformers' tojson: json.dumps without jinja's HTML escaping, its options exposed."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


# A field width inside a strftime format ("%9999Y") makes Python's strftime retry ever larger
# buffers: seconds and hundreds of megabytes for one call.
_STRFTIME_WIDTH = re.compile(r"%[-_0^#]*[0-9]")


def _strftime_now(format: str) -> str:
    """transformers' strftime_now (templates date their system prompts: Llama 3.x), without
    field widths."""
    if _STRFTIME_WIDTH.search(format):
        raise jinja2.exceptions.TemplateError("strftime_now takes no field widths")
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


# ------------------------------------------------------------------- loading
def load_chat_template(value: str) -> str:
    """A chat template given as vLLM's `--chat-template` takes it: a file's path or the
    template itself (which, as there, must hold a brace or a newline: anything else is a
    path that does not exist); a template that does not compile is refused at once."""
    is_template = any(c in value for c in "{}\n")
    try:
        template = Path(value).read_text() if Path(value).is_file() else value
    except (OSError, UnicodeDecodeError) as error:  # a template too long to be a file's name
        if not is_template:
            raise ValueError(f"cannot read chat template {value!r}: {error}") from None
        template = value
    if template is value and not is_template:
        raise ValueError(f"chat template {value!r} looks like a file's path, but there is no "
                         "such file (a template itself holds {{, {% or a newline)")
    try:
        _compiled(template)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"chat template {value[:80]!r} does not compile: {error}") from None
    return template


def find_chat_templates(folder: Path, config: Dict[str, Any]) -> Templates:
    """A model folder's templates, where transformers looks: chat_template.jinja ("default")
    and additional_chat_templates/*.jinja (by name) over tokenizer_config.json's."""
    named = {path.stem: _read_template(path)
             for path in sorted((folder / "additional_chat_templates").glob("*.jinja"))}
    main = folder / "chat_template.jinja"
    if main.is_file():
        named["default"] = _read_template(main)
    if named:
        return named["default"] if list(named) == ["default"] else named
    template = config.get("chat_template")
    if isinstance(template, list) and template and all(
            isinstance(t, dict) and isinstance(t.get("name"), str)
            and isinstance(t.get("template"), str) for t in template):
        return {t["name"]: t["template"] for t in template}
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{folder / 'tokenizer_config.json'}: chat_template must be a "
                         "template or a list of {\"name\": ..., \"template\": ...}, got "
                         f"{json.dumps(template)[:80]}")
    return template


def _read_template(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not a readable chat template: {error}") from None


def pick_template(templates: Templates, chat_template: Optional[str], tools: Any) -> str:
    """transformers' choice: the given template (or the model's of that name), else the
    model's; among named ones, "tool_use" where tools are given, else "default"."""
    named = templates if isinstance(templates, dict) else {}
    if chat_template is not None:
        return named.get(chat_template, chat_template)
    if named:
        if tools is not None and "tool_use" in named:
            return named["tool_use"]
        if "default" in named:
            return named["default"]
        raise ValueError("This model has multiple chat templates with no default specified! "
                         "Please either pass a chat template or the name of the template you "
                         "wish to use to the `chat_template` argument. Available template "
                         f"names are {sorted(named)}.")
    if templates is None:
        raise ValueError("this model has no chat template; pass chat_template= or use "
                         "generate() with a plain prompt")
    return templates


# ----------------------------------------------------------------- rendering
def render_chat(template: str, messages: List[Dict[str, Any]], add_generation_prompt: bool,
                continue_final_message: bool, variables: Dict[str, Any]) -> str:
    """The conversation as `template` renders it, `variables` (special tokens, tools,
    chat_template_kwargs) beside the messages. `continue_final_message` (transformers' and
    vLLM's): the text ends with the last message's own, not closed, so the model goes on
    with it (a prefilled answer) rather than starting a new one."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at "
                         "least one message.")
    try:
        messages = _template_messages(messages)
        variables = {"tools": None, "documents": None, **_plain(variables)}
    except RecursionError:
        raise ValueError("the conversation (or a keyword for the template) nests too deeply, "
                         "or holds itself") from None
    _check_documents(variables["documents"])

    def render(conversation: List[Dict[str, Any]]) -> str:
        return _compiled(template).render(**{
            **variables, "messages": conversation,
            "add_generation_prompt": add_generation_prompt, "range": _RangeBudget()})

    if continue_final_message:
        return _open_final_message(render, messages, template)
    return render(messages)


def _plain(value: Any) -> Any:
    """What a template sees, rebuilt from plain JSON types (transformers'): the sandbox lets a
    template call an object's public methods, so any other object is a placeholder naming
    its type, and subclasses (enums of str, numpy scalars) are their base values."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _template_messages(messages: List[Any]) -> List[Dict[str, Any]]:
    """The messages as transformers hands them to a template: plain data, keys whose value is
    None dropped (templates test for a missing key, and would print "None"), and a message's
    reasoning under each of its names."""
    found = []
    for message in _plain(list(messages)):
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        found.append(message)
    return found


def _check_documents(documents: Any) -> None:
    if documents is not None and (not isinstance(documents, (list, tuple))
                                  or not all(isinstance(d, dict) for d in documents)):
        raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")


def _open_final_message(render: Callable[[List[Dict[str, Any]]], str],
                        messages: List[Dict[str, Any]], template: str) -> str:
    """The chat rendered up to the end of its final message's text, as transformers does it:
    the text tagged, rendered, cut at the tag (and the spaces a template trimmed, trimmed)."""
    if "content" not in template:
        raise ValueError('continue_final_message is set to "content" but this is not an '
                         'accepted field in the chat_template')
    final, tagged = _tag_final(messages[-1].get("content"))
    text = render([*messages[:-1], {**messages[-1], "content": tagged}])
    if final.strip() not in text or CONTINUE_TAG.strip() not in text:
        raise ValueError("continue_final_message is set, but the final message's text does "
                         "not appear in the rendered chat template")
    at = text.rindex(CONTINUE_TAG.strip())
    return text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()


def _tag_final(content: Any) -> Tuple[str, Any]:
    """(the final message's text to continue, its content with that text tagged): the text,
    or the last text part's for content given as parts."""
    if content is None:
        raise ValueError('continue_final_message is set but the final message has no '
                         '"content" to continue!')
    if not isinstance(content, (list, tuple)):
        return content, content + CONTINUE_TAG
    parts = [dict(part) if isinstance(part, dict) else part for part in content]
    at = next((i for i in reversed(range(len(parts)))
               if isinstance(parts[i], dict) and "text" in parts[i]), None)
    if at is None:
        raise ValueError("continue_final_message is set but we could not find any text to "
                         "continue in the final message!")
    final = parts[at]["text"]
    parts[at]["text"] = final + CONTINUE_TAG
    return final, parts


# ------------------------------------------------------------- content format
# How a template reads a message's content (vLLM's --chat-template-content-format): "string"
# (text parts joined into one string first) or "openai" (OpenAI's list of parts, which the
# template iterates); "auto" looks at the template.
CONTENT_FORMATS = ("auto", "string", "openai")


def check_content_format(value: str) -> None:
    if value not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format must be one of "
                         f"{', '.join(CONTENT_FORMATS)}, got {value!r}")


def message_content(content: Union[None, str, List[Dict[str, Any]]], content_format: str
                    ) -> Union[str, List[Dict[str, Any]]]:
    """A message's content (text, text parts, or none) as a template of `content_format`
    ("string" or "openai") reads it, as vLLM gives it: the parts' texts (none, or empty, left
    out) joined one a line, or each text as a text part of its own."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content_format == "openai" else content
    texts = [part.get("text") for part in content or []]
    if content_format == "openai":
        return [{"type": "text", "text": text} for text in texts if text is not None]
    return "\n".join(text for text in texts if text)


def template_message(message: Dict[str, Any], content_format: str) -> Dict[str, Any]:
    """A chat message as vLLM hands it to templates (the server's and LLM.chat's alike): its
    content in the template's format, its tool calls' arguments as objects. A tool result's
    text is one string in either format, as vLLM gives it (templates print it whole: a list
    of parts came out as its Python repr, as in Mistral Small 3's [TOOL_CONTENT])."""
    kind = "string" if message.get("role") == "tool" else content_format
    message = {**message, "content": message_content(message.get("content"), kind)}
    if "tool_calls" in message:
        message["tool_calls"] = template_tool_calls(message["tool_calls"])
    return message


def template_tool_calls(tool_calls: Any) -> Any:
    """An assistant message's tool calls as vLLM hands them to templates: each call's
    arguments an object, not its JSON text (text that is no JSON stays text; none is {});
    an empty list is no calls."""
    if not isinstance(tool_calls, list):
        return tool_calls
    calls = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            call = {**call, "function": {**function,
                                         "arguments": _arguments(function.get("arguments"))}}
        calls.append(call)
    return calls or None


def _arguments(value: Any) -> Any:
    if not value:
        return {}
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except (ValueError, RecursionError):  # nested past Python's limit: text, as any non-JSON
        return value


@functools.lru_cache(maxsize=32)
def content_format(template: str, requested: str = "auto") -> str:
    """`requested`, or for "auto" the template's own, detected as vLLM detects it: "openai"
    where the template loops over the content of a message it loops over (`for message in
    messages` ... `for part in message['content']`, through {% set %} names, filters and
    slices), else "string". One pass over the template's sets and loops, whatever its size."""
    if requested != "auto":
        return requested
    try:
        root = _environment().parse(template)
        loops = list(root.find_all(jinja2.nodes.For))
        messages = _bound_names(root, "messages")
        items = {_loop_name(loop) for loop in loops if _read_name(loop.iter, None) in messages}
        contents = [loop for loop in loops if _read_name(loop.iter, "content") in items]
        return "openai" if any(_loop_name(loop) for loop in contents) else "string"
    except (jinja2.TemplateSyntaxError, TypeError, RecursionError):
        return "string"


def _loop_name(loop: jinja2.nodes.For) -> str:
    """A loop's variable; a loop that unpacks what it takes is one vLLM's detection does not
    follow (TypeError)."""
    if not isinstance(loop.target, jinja2.nodes.Name):
        raise TypeError("a loop unpacks its items")
    return loop.target.name


def _bound_names(root: jinja2.nodes.Node, name: str) -> set:
    """`name` and every name {% set %} binds to it (or to its filtered or sliced value), and
    to those, and so on (vLLM's walk, which a cycle of names does not hold up here)."""
    bound: Dict[str, List[jinja2.nodes.Node]] = {}
    for assign in root.find_all(jinja2.nodes.Assign):
        source = _read_name(assign.node, None)
        if source is not None:
            bound.setdefault(source, []).append(assign.target)
    found, pending = {name}, [name]
    while pending:
        for target in bound.get(pending.pop(), []):
            if not isinstance(target, jinja2.nodes.Name):
                raise TypeError("a {% set %} binds the messages to other than a name")
            if target.name not in found:
                found.add(target.name)
                pending.append(target.name)
    return found


def _read_name(node: jinja2.nodes.Node, key: Optional[str]) -> Optional[str]:
    """The name `node` reads (or whose `key` it reads, as an item or an attribute), under
    filters, tests and slices; None where it reads no name so."""
    while True:
        if isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
            node = node.node
        else:
            break
    if key is not None:
        if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const) \
                and node.arg.value == key:
            node = node.node
        elif isinstance(node, jinja2.nodes.Getattr) and node.attr == key:
            node = node.node
        else:
            return None
    if isinstance(node, jinja2.nodes.Name) and node.ctx == "load":
        return node.name
    return None

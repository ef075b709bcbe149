"""Tool calls: what a chat request's `tools` and `tool_choice` make of the model's answer.

`tool_choice` "required" and a named function are enforced with structured outputs, so the
call is always JSON that matches the function's parameters. "auto" reads the model's own
format with the parser chosen by `--tool-call-parser` (vLLM's names): `hermes` (Qwen,
Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), `llama3_json` (Llama
3.x: a JSON object `{"name": ..., "parameters": {...}}`, several separated by `;`) and
`mistral` (`[TOOL_CALLS][{"name": ..., "arguments": {...}}]`, or v11+'s
`[TOOL_CALLS]name[ARGS]{...}` a call). Text that is not a well-formed call stays content: a
parser never invents a call. Call ids are OpenAI-like, or Mistral's 9 letters and digits
(its chat templates refuse any other id when the calls come back in the history).

`ToolCallStream` turns one choice's text deltas into the chat deltas OpenAI streams: content
until a call starts (text that might be the start of a call's marker is held back until it
is clear), then the calls, each with its id and name first and its arguments after.
"""

from __future__ import annotations

import json
import random
import re
import string
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type

from fulcrum.sampling_params import StructuredOutputsParams


def openai_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object's text
    id: Optional[str] = None  # the model's own, where its format has one


def _call(name: Any, arguments: Any) -> ToolCall:
    """A call from parsed JSON; ValueError unless the name is a string and the arguments an
    object (or its JSON text)."""
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        raise ValueError("not a tool call")
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _objects(text: str) -> List[Any]:
    """Consecutive JSON values in `text`, separated by whitespace, ',' or ';'."""
    decoder, values, index = json.JSONDecoder(), [], 0
    while True:
        while index < len(text) and text[index] in " \t\r\n;,":
            index += 1
        if index == len(text):
            return values
        value, index = decoder.raw_decode(text, index)
        values.append(value)


# What parsing a model's malformed calls raises; RecursionError: JSON nested deeper than
# the interpreter's recursion limit, which a model can be led to write.
MALFORMED = (ValueError, TypeError, KeyError, AttributeError, RecursionError)


class ToolParser(ABC):
    """Finds tool calls in a model's answer (one format)."""

    name: str
    marker: str  # where the calls start
    at_start_only = False  # the marker counts only at the start of the answer
    # What must reach the parser: where the tokenizer marks one special, the answer is
    # decoded keeping special tokens (`skips_special_tokens`).
    markers: Tuple[str, ...] = ()
    new_call_id: Callable[[], str] = staticmethod(openai_call_id)

    def start(self, text: str) -> Optional[int]:
        """Where the calls start in `text`, if they do."""
        if self.at_start_only:
            stripped = len(text) - len(text.lstrip())
            return stripped if text.startswith(self.marker, stripped) else None
        index = text.find(self.marker)
        return index if index >= 0 else None

    def may_open(self, text: str) -> bool:
        """Whether an answer that starts with `text` (whitespace stripped) may still turn
        out to start with the calls (`at_start_only`: a stream holds it back until then)."""
        return not text

    def parse(self, text: str) -> Tuple[Optional[str], List[ToolCall]]:
        """(content before the calls, calls); when the calls are not well-formed, (text, [])."""
        start = self.start(text)
        if start is None:
            return text, []
        try:
            calls = self.calls(text[start:])
        except MALFORMED:
            return text, []
        if not calls:
            return text, []
        before = text[:start]
        return (before if before.strip() else None), calls

    @abstractmethod
    def calls(self, text: str) -> List[ToolCall]:
        """The calls in `text`, which starts at the marker; raises if malformed."""


class HermesParser(ToolParser):
    name = "hermes"
    marker = "<tool_call>"
    markers = ("<tool_call>", "</tool_call>")  # special in some tokenizers (vLLM's PR 25281)
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def calls(self, text: str) -> List[ToolCall]:
        found = []
        for body in self._block.findall(text):
            value = json.loads(body)
            found.append(_call(value["name"], value.get("arguments", {})))
        return found


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    marker = "{"
    at_start_only = True
    # Where the tokenizer shows it (not special, or skip_special_tokens false), the calls may
    # open with it: it is part of them, not content (vLLM's too).
    tag = "<|python_tag|>"

    def start(self, text: str) -> Optional[int]:
        offset = len(text) - len(text.lstrip())
        return offset if text.startswith(self.tag, offset) else super().start(text)

    def may_open(self, text: str) -> bool:
        return self.tag.startswith(text)

    def calls(self, text: str) -> List[ToolCall]:
        """A call names its function and gives "arguments" or "parameters" (vLLM reads the
        first where both are there): any other JSON object an answer starts with is text
        (a request for JSON data while tools are offered), as is code after the tag."""
        text = text[len(self.tag):] if text.startswith(self.tag) else text
        return [_call(value["name"], value["arguments"] if "arguments" in value
                      else value["parameters"]) for value in _objects(text)]


class MistralParser(ToolParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    markers = ("[TOOL_CALLS]", "[CALL_ID]", "[ARGS]")
    new_call_id = staticmethod(mistral_call_id)
    # v11+: [TOOL_CALLS]name[ARGS]{...}, [CALL_ID]id before [ARGS] in some versions.
    _named = re.compile(r"\s*([^\[\]\s]+)(?:\[CALL_ID\]([^\[]*))?\[ARGS\](.*)", re.DOTALL)

    def calls(self, text: str) -> List[ToolCall]:
        body = text[len(self.marker):]
        if not body.lstrip().startswith("["):
            return [self._named_call(part) for part in body.split(self.marker)]
        values = _objects(body.replace(self.marker, ""))
        if len(values) != 1 or not isinstance(values[0], list):
            raise ValueError("[TOOL_CALLS] must be followed by one JSON list")
        return [_call(value["name"], value.get("arguments", {})) for value in values[0]]

    def _named_call(self, part: str) -> ToolCall:
        found = self._named.fullmatch(part)
        if found is None:
            raise ValueError("not a [TOOL_CALLS]name[ARGS]{...} call")
        (arguments,) = _objects(found.group(3))
        call = _call(found.group(1), arguments)
        call.id = (found.group(2) or "").strip() or None
        return call


def skips_special_tokens(parser: ToolParser, tokenizer: Any) -> bool:
    """Whether answers for `parser` may be decoded without special tokens: only where the
    tokenizer marks none of its markers special (decoding keeps them then; keeping every
    special token instead sent a model's others, reserved ones included, as content)."""
    return all(tokenizer.decode(tokenizer.encode(marker, add_special_tokens=False),
                                skip_special_tokens=True) == marker for marker in parser.markers)


PARSERS: Dict[str, Type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def make_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose from {sorted(PARSERS)}")
    return PARSERS[name]()


# --------------------------------------------------------------- tool_choice
def required_schema(tools: Sequence[Dict[str, Any]], parallel: bool = True) -> Dict[str, Any]:
    """JSON for tool_choice "required": a non-empty list of calls of the given functions,
    each `{"name": ..., "parameters": {...}}` (vLLM's form); one call only unless
    `parallel` (OpenAI's parallel_tool_calls). Each function's definitions ($defs) move to
    the root, where its references ("#/$defs/...") still find them (vLLM's)."""
    limit = {} if parallel else {"maxItems": 1}
    definitions: Dict[str, Dict[str, Any]] = {}
    calls = []
    for tool in tools:
        name = tool["function"]["name"]
        parameters = dict(parameters_schema(tool))
        _check_no_root_references(name, parameters)  # its definitions' included
        for key in _DEFINITIONS:
            found = parameters.pop(key, None) or {}
            if not isinstance(found, dict):
                raise ValueError(f"the parameters of {name!r} have {key} that is not an object "
                                 "of named schemas")
            for entry, schema in found.items():
                if definitions.setdefault(key, {}).setdefault(entry, schema) != schema:
                    raise ValueError(f"tools define {key}/{entry} differently; tool_choice "
                                     '"required" needs one definition of each name')
        calls.append({"type": "object",
                      "properties": {"name": {"enum": [name]},
                                     "parameters": parameters},
                      "required": ["name", "parameters"]})
    return {"type": "array", "minItems": 1, **limit, "items": {"anyOf": calls}, **definitions}


# Where a JSON schema keeps definitions its references point at.
_DEFINITIONS = ("$defs", "definitions")


def _check_no_root_references(name: str, schema: Any) -> None:
    """Under "required" a function's parameters are no longer the root: a reference to the
    root ("#", "#/properties/...") would point at the list of calls."""
    pending = [schema]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if isinstance(ref, str) and ref.startswith("#") and not ref.startswith(
                    tuple(f"#/{key}/" for key in _DEFINITIONS)):
                raise ValueError(f"the parameters of {name!r} refer to their own root "
                                 f"({ref!r}), which tool_choice \"required\" cannot keep; "
                                 "refer to a $defs entry instead")
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)


def parameters_schema(tool: Dict[str, Any]) -> Dict[str, Any]:
    """A function's parameters; none means no arguments, "{}" (vLLM's), not any object."""
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


Check = Callable[[StructuredOutputsParams], Any]  # raises ValueError for a bad constraint


def constraint(tools: Sequence[Dict[str, Any]], choice: Optional[str],
               parallel: bool = True, check: Optional[Check] = None,
               ) -> Optional[StructuredOutputsParams]:
    """The structured output that enforces tool_choice "required", or a named function
    (`choice` is then its name). Compact JSON: arguments are read by programs, and no
    model gets to pad them with whitespace. `check` (the grammar compiler's parse) refuses
    what xgrammar cannot read, naming the function."""
    if choice is None:
        return None
    if choice != "required":
        tool = next(t for t in tools if t["function"]["name"] == choice)
        return _checked(choice, _object_parameters(tool), check)
    for tool in tools:  # each on its own first, so that a refusal names the tool
        _checked(tool["function"]["name"], _object_parameters(tool), check)
    return _checked("required", required_schema(tools, parallel), check)


def _object_parameters(tool: Dict[str, Any]) -> Dict[str, Any]:
    """A function's parameters, which must be an object, as OpenAI requires: a call's
    arguments are one (under {"type": "integer"} a named call's were "8", and "required"
    made no call, its JSON sent as content)."""
    schema = parameters_schema(tool)
    if schema.get("type", "object") != "object":
        raise ValueError(f"{tool['function']['name']!r}: the parameters must be a JSON schema "
                         f"of type 'object', got type {schema['type']!r}")
    return schema


def _checked(name: str, schema: Dict[str, Any],
             check: Optional[Check] = None) -> StructuredOutputsParams:
    try:
        params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        if check is not None:
            check(params)
        return params
    except ValueError as error:
        raise ValueError(f"{name!r}: {error}") from None


def required_calls(text: str) -> List[ToolCall]:
    """The calls of a "required" answer (a JSON list, as `required_schema` enforces)."""
    return [_call(value["name"], value["parameters"]) for value in json.loads(text)]


# ----------------------------------------------------------------- streaming
@dataclass
class ToolDelta:
    """What one chunk of a choice carries: content and/or tool-call deltas."""

    content: Optional[str] = None
    tool_calls: List[Dict[str, Any]] = field(default_factory=list)


def held_back(text: str, marker: str) -> int:
    """How many final characters of `text` could be the start of `marker`: a stream holds
    them back until the next piece tells."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ToolCallStream:
    """One choice's stream under `mode` "auto" (with `parser`), "required", or "named"
    (with `function`, whose arguments are the answer itself)."""

    def __init__(self, mode: str, parser: Optional[ToolParser] = None,
                 function: Optional[str] = None, parallel: bool = True) -> None:
        self.mode, self.parser, self.function = mode, parser, function
        self.parallel = parallel  # False: only the first call the model made counts
        self.text = ""
        self.sent = 0  # characters of `text` already sent as content (auto)
        self.named_id: Optional[str] = None
        self.new_call_id = parser.new_call_id if parser is not None else openai_call_id

    def feed(self, delta: str) -> ToolDelta:
        self.text += delta
        if self.mode == "named":
            return self._named(delta)
        if self.mode == "required" or self.parser.start(self.text) is not None:
            return ToolDelta()  # calls are sent whole, at the end
        safe = len(self.text) - self._held_back()
        content, self.sent = self.text[self.sent:safe], max(self.sent, safe)
        return ToolDelta(content=content or None)  # no empty chunk while text is held back

    def finish(self) -> Tuple[ToolDelta, bool]:
        """What is left to send, and whether the answer was tool calls (an answer cut short
        before its calls were complete is sent as content)."""
        if self.mode == "named":
            return ToolDelta(), False
        if self.mode == "required":
            try:
                return ToolDelta(tool_calls=self._deltas(required_calls(self.text))), True
            except MALFORMED:
                return ToolDelta(content=self.text or None), False
        content, calls = self.parser.parse(self.text)
        calls = calls if self.parallel else calls[:1]
        rest = (content or "")[self.sent:] if calls else self.text[self.sent:]
        return ToolDelta(content=rest or None, tool_calls=self._deltas(calls)), bool(calls)

    def whole(self, text: str) -> Tuple[Optional[str], List[Dict[str, Any]], bool]:
        """A whole answer (not streamed): its content, its calls, whether it was calls."""
        first = self.feed(text)
        last, were_calls = self.finish()
        content = (first.content or "") + (last.content or "")
        calls = [{k: v for k, v in c.items() if k != "index"}
                 for c in first.tool_calls + last.tool_calls]
        return content or None, calls, were_calls

    def _named(self, delta: str) -> ToolDelta:
        if self.named_id is None:
            self.named_id = self.new_call_id()
            return ToolDelta(tool_calls=[{"index": 0, "id": self.named_id, "type": "function",
                                          "function": {"name": self.function,
                                                       "arguments": delta}}])
        return ToolDelta(tool_calls=[{"index": 0, "function": {"arguments": delta}}])

    def _held_back(self) -> int:
        """How many final characters could be the start of the parser's marker."""
        if self.parser.at_start_only:
            return len(self.text) if self.parser.may_open(self.text.lstrip()) else 0
        return held_back(self.text, self.parser.marker)

    def _deltas(self, calls: Sequence[ToolCall]) -> List[Dict[str, Any]]:
        return [{"index": i, "id": call.id or self.new_call_id(), "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}
                for i, call in enumerate(calls)]

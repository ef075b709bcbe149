"""Sampling parameters, with vLLM's names, defaults and checks."""

from __future__ import annotations

import enum
import json
import math
import numbers
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from fulcrum.tokenizer import lone_surrogate_at

_GREEDY_EPS = 1e-5
# vLLM's seed range: a signed 64-bit integer (torch.iinfo(torch.long)).
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 63 - 1
# Stop strings are searched in every new piece of text and the longest is held back from
# streams, so their number and length bound per-token work and streaming delay.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
# logit_bias entries are added to every step's logits: their number bounds that work too.
MAX_LOGIT_BIAS_ENTRIES = 1024
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range; vLLM clamps to it
# allowed_token_ids mask every step's logits; no vocabulary has more ids than this (Gemma's
# 256K), and a longer list only repeats them.
MAX_ALLOWED_TOKEN_IDS = 1 << 18
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")
# The positive float32 range: a repetition penalty divides (or multiplies) float32 logits.
FLOAT32_TINY, FLOAT32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")
_INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
               "truncate_prompt_tokens")


class ParamError(ValueError):
    """A parameter that cannot be honoured; `param` names it, which the server's 400 puts in
    OpenAI's `param` field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def check_unicode(name: str, value: Any) -> None:
    """Refuse a parameter holding a string that is no Unicode text (a lone surrogate): it
    would fail later, where it is tokenized or encoded, naming nothing."""
    where = lone_surrogate_at(value)
    if where is not None:
        raise ParamError(name, f"{'.'.join(filter(None, (name, where)))} is not valid Unicode: "
                               "it holds a lone surrogate")


def _python_number(value: Any) -> Any:
    """A number of any kind (numpy's too) as a Python int or float; anything else (bools
    included) as it is."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    return value if isinstance(value, float) else float(value)


def is_int(value: object) -> bool:
    """A Python integer, not a bool (True is an int to isinstance)."""
    return isinstance(value, int) and not isinstance(value, bool)


class RequestOutputKind(enum.Enum):
    """What each RequestOutput carries: all text so far, only the new part, or only the end."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


# The constraints a StructuredOutputsParams may carry; exactly one is set.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_GRAMMAR_CHARS = 1 << 20
# A regex or EBNF grammar compiles in time that climbs with its length: "a" * 65,536 in
# ~1.3 s here, a 1 MiB one for over a minute, holding up every constrained request queued
# behind it on the one compile thread. So do the strings of a choice, an enum or a const:
# 2,000 choices of 100 characters compiled in 12 s (a trivial choice queued behind them
# waited 30 s), 1,000 enum strings of 100 in 2.7 s.
MAX_PATTERN_CHARS = 1 << 16
# Nesting of a JSON schema document: xgrammar's compile time grows with about its cube
# (~0.01 s at 64 here, 4.5 s at 600), and a compile holds up whoever waits on it. OpenAI's
# structured outputs allow 10 levels of objects, each 2 of the document.
MAX_SCHEMA_DEPTH = 64
# A JSON schema's object properties in all, and the values of its enums (or a choice's
# strings): past these the compile time climbs steeply (5,000 optional properties ~4 s here;
# 10,000 enum values 0.1 s, 20,000 5 s). OpenAI allows 5,000 properties, 1,000 enum values.
MAX_SCHEMA_PROPERTIES = 5_000
MAX_ALTERNATIVES = 10_000
# Without free whitespace (disable_any_whitespace, as every tool call's arguments are)
# optional properties compile far slower: 1,000 in ~2 s here, 1,500 in 5.6 s, 2,000 in 29 s,
# where 5,000 with free whitespace took 3.8 s.
MAX_COMPACT_SCHEMA_PROPERTIES = 1_000
# anyOf / oneOf / allOf branches in all: 5,000 string branches compiled in 4 s and cost ~19 ms
# a token in every step while a value was inside them (1,000: 0.4 s).
MAX_SCHEMA_BRANCHES = 1_000


@dataclass
class SchemaSize:
    """What a JSON schema's compile time climbs with, counted everywhere in the document."""

    depth: int = 0  # nesting (a scalar nests 0 deep)
    properties: int = 0  # object properties
    alternatives: int = 0  # enum values
    branches: int = 0  # anyOf / oneOf / allOf entries
    pattern_chars: int = 0  # the regexes of "pattern"s and "patternProperties"' keys
    literal_chars: int = 0  # the strings of enums and consts


def schema_size(value: Any) -> SchemaSize:
    """The size of a parsed JSON schema, found without recursion."""
    size = SchemaSize()
    pending = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        size.depth = max(size.depth, depth)
        if isinstance(item, dict):
            if isinstance(item.get("properties"), dict):
                size.properties += len(item["properties"])
            if isinstance(item.get("enum"), list):
                size.alternatives += len(item["enum"])
                size.literal_chars += sum(len(v) for v in item["enum"] if isinstance(v, str))
            if isinstance(item.get("const"), str):
                size.literal_chars += len(item["const"])
            size.branches += sum(len(item[key]) for key in ("anyOf", "oneOf", "allOf")
                                 if isinstance(item.get(key), list))
            if isinstance(item.get("pattern"), str):
                size.pattern_chars += len(item["pattern"])
            if isinstance(item.get("patternProperties"), dict):
                size.pattern_chars += sum(map(len, item["patternProperties"]))
            pending.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list):
            pending.extend((child, depth + 1) for child in item)
    return size


# Keywords whose value is a schema, a list of schemas, or a map of names to schemas: the
# places a schema's subschemas are (anything else is data: an enum's values, a default).
_SUBSCHEMA = ("items", "additionalProperties", "contains", "not", "if", "then", "else",
              "propertyNames", "additionalItems", "unevaluatedItems", "unevaluatedProperties")
_SUBSCHEMA_LISTS = ("prefixItems", "allOf", "anyOf", "oneOf", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas")
# What xgrammar (0.2.9) accepts in a JSON schema and then does not enforce: each was
# checked by compiling a schema and feeding it a value that breaks the keyword.
_UNENFORCED = ("contains", "minContains", "maxContains", "not", "if", "then", "else",
               "dependentRequired", "dependentSchemas", "$dynamicRef", "$recursiveRef")
# The formats xgrammar (0.2.9) writes its own grammar for: a "pattern" beside one is dropped
# (it let "a@b.co" through `"format": "email", "pattern": "^x"`).
_XGRAMMAR_FORMATS = frozenset({"date", "time", "date-time", "duration", "email", "ipv4",
                               "ipv6", "uri", "uuid", "json-pointer", "relative-json-pointer"})
# Not checked: "format", which JSON Schema (2019-09 on) makes an annotation unless a
# validator opts in: xgrammar holds strings to the formats it knows (date, email, uri, ...)
# and takes the rest, and the lengths beside them (pydantic's HttpUrl), as annotations too.
# Keywords that constrain a value of one type: without a "type" beside them, xgrammar lets
# any value through.
_TYPED = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
          "minLength", "maxLength", "pattern")
# What constrains a value beside an anyOf / oneOf / $ref, which xgrammar then ignores.
_VALIDATION = ("type", "enum", "const", "properties", "required", "items", "prefixItems",
               "additionalProperties", "patternProperties", "propertyNames", "minItems",
               "maxItems", "minProperties", "maxProperties", *_TYPED)


def unenforced_schema_keyword(schema: Any) -> Optional[str]:
    """Why some keyword of a JSON schema would be accepted and not enforced (the output could
    break it), naming the keyword and where it is; None if every keyword holds. vLLM refuses
    such schemas for xgrammar too."""
    pending: List[Tuple[Any, str]] = [(schema, "#")]
    while pending:
        item, where = pending.pop()
        if not isinstance(item, dict):
            continue
        problem = _unenforced_here(item)
        if problem is not None:
            return f"{problem} (at {where}) cannot be enforced; leave it out of the schema"
        for key in _SUBSCHEMA:
            sub = item.get(key)
            if key == "propertyNames" and isinstance(sub, dict):
                sub = {"type": "string", **sub}  # names are strings, said so or not
            pending.append((sub, f"{where}/{key}"))
        for key in _SUBSCHEMA_LISTS:
            if isinstance(item.get(key), list):
                pending.extend((sub, f"{where}/{key}/{i}") for i, sub in enumerate(item[key]))
        for key in _SUBSCHEMA_MAPS:
            if isinstance(item.get(key), dict):
                pending.extend((sub, f"{where}/{key}/{name}") for name, sub in item[key].items())
    return None


def _unenforced_here(schema: Dict[str, Any]) -> Optional[str]:
    found = next((key for key in _UNENFORCED if key in schema), None)
    if found is not None:
        return found
    problem = _unfollowed_reference(schema) or _unmatched_keyword(schema)
    if problem is not None:
        return problem
    if schema.get("uniqueItems") is True:
        return "uniqueItems"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return "allOf with more than one schema"
    bounded = [key for key in ("minLength", "maxLength") if key in schema]
    if bounded and "pattern" in schema:
        return f"{bounded[0]} beside pattern"
    if "multipleOf" in schema and schema.get("type") != "integer":
        return "multipleOf on a number that is not of type integer"
    untyped = next((key for key in _TYPED if key in schema), None)
    if untyped is not None and "type" not in schema:
        return f"{untyped} without a type"
    combined = next((key for key in ("anyOf", "oneOf", "$ref") if key in schema), None)
    beside = next((key for key in _VALIDATION if key in schema), None)
    if combined is not None and beside is not None:
        return f"{beside} beside {combined}"
    return None


def _unfollowed_reference(schema: Dict[str, Any]) -> Optional[str]:
    """A $ref xgrammar does not follow: only "#" and "#/..." pointers into the schema are;
    any other (a URL, a file, an $anchor's "#name", an $id) let any value through."""
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
        return f"$ref {ref[:80]!r} (only '#/...' pointers into the schema are followed)"
    return None


def _unmatched_keyword(schema: Dict[str, Any]) -> Optional[str]:
    """A keyword xgrammar takes and then drops: an empty list of types or of alternatives (any
    value, or an empty answer, where none is valid), a required name that `properties` does
    not define ({} passed `"required": ["b"]`), a lookahead in a pattern, a pattern beside a
    format it writes itself."""
    if schema.get("type") == []:
        return "type with no type in its list"
    empty = next((key for key in ("anyOf", "oneOf") if schema.get(key) == []), None)
    if empty is not None:
        return f"{empty} with no schema in its list"
    properties = schema.get("properties")
    defined = properties if isinstance(properties, dict) else {}
    required = schema.get("required")
    missing = next((name for name in required if name not in defined), None) \
        if isinstance(required, list) else None
    if missing is not None:
        return f"required {str(missing)[:80]!r} without a schema of its own in properties"
    patterns = [schema.get("pattern")]
    if isinstance(schema.get("patternProperties"), dict):
        patterns += list(schema["patternProperties"])
    looking = next((p for p in patterns if isinstance(p, str) and _has_lookahead(p)), None)
    if looking is not None:
        return f"lookahead in the pattern {looking[:80]!r}"
    if "pattern" in schema and schema.get("format") in _XGRAMMAR_FORMATS:
        return f"pattern beside format {schema['format']!r}"
    return None


def _has_lookahead(pattern: str) -> bool:
    """Whether a regex holds a lookahead, "(?=" or "(?!" (not escaped, nor in a class)."""
    escaped = in_class = False
    for index, char in enumerate(pattern):
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif pattern.startswith(("(?=", "(?!"), index):
            return True
    return False


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a JSON schema, a regular expression, one of several strings,
    an EBNF or Lark grammar, or any JSON (vLLM's names). `disable_any_whitespace` makes JSON
    compact (no free whitespace between tokens), which small models need to finish."""

    json: Optional[Union[str, Dict[str, Any]]] = None
    regex: Optional[str] = None
    choice: Optional[List[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        chosen = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError("structured outputs need exactly one of "
                             f"{', '.join(STRUCTURED_OUTPUT_KINDS)}; got "
                             f"{', '.join(chosen) or 'none'}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except (ValueError, RecursionError) as error:
                raise ValueError(f"the JSON schema is not valid JSON: {error}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError("the JSON schema must be a JSON object")
        if self.json is not None:
            self._check_schema_size()
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        if self.choice is not None and len(self.choice) > MAX_ALTERNATIVES:
            raise ValueError(f"choice has {len(self.choice)} strings, more than the "
                             f"{MAX_ALTERNATIVES} allowed")
        if self.choice is not None and sum(map(len, self.choice)) > MAX_PATTERN_CHARS:
            raise ValueError(f"choice has {sum(map(len, self.choice))} characters in all, more "
                             f"than the {MAX_PATTERN_CHARS} allowed")
        for name in ("json_object", "disable_any_whitespace"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        check_unicode(self.kind, getattr(self, self.kind))
        if self.kind in ("regex", "grammar") and len(self.source) > MAX_PATTERN_CHARS:
            raise ValueError(f"the {self.kind} constraint is longer than {MAX_PATTERN_CHARS} "
                             "characters")
        if len(self.source) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"the {self.kind} constraint is longer than {MAX_GRAMMAR_CHARS} "
                             "characters")

    def _check_schema_size(self) -> None:
        size = schema_size(self.json)
        properties = ((MAX_COMPACT_SCHEMA_PROPERTIES, "has {} object properties in all, "
                                                      "without free whitespace")
                      if self.disable_any_whitespace else
                      (MAX_SCHEMA_PROPERTIES, "has {} object properties in all"))
        limits = [(size.depth, MAX_SCHEMA_DEPTH, "nests {} levels deep"),
                  (size.properties, *properties),
                  (size.alternatives, MAX_ALTERNATIVES, "has {} enum values in all"),
                  (size.branches, MAX_SCHEMA_BRANCHES, "has {} anyOf / oneOf / allOf branches "
                                                       "in all"),
                  (size.pattern_chars, MAX_PATTERN_CHARS, "has {} characters of patterns in "
                                                          "all"),
                  (size.literal_chars, MAX_PATTERN_CHARS, "has {} characters of enum and const "
                                                          "strings in all")]
        for found, limit, what in limits:
            if found > limit:
                raise ValueError(f"the JSON schema {what.format(found)}, more than the "
                                 f"{limit} allowed")
        problem = unenforced_schema_keyword(self.json)
        if problem is not None:
            raise ValueError(f"the JSON schema's {problem}")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))

    @property
    def source(self) -> str:
        """The constraint as one string: with `kind` and the whitespace rule, its cache key."""
        value = getattr(self, self.kind)
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Latency targets of this request (milliseconds); None: the engine's.
    slo_ttft_ms: Optional[float] = None
    slo_tpot_ms: Optional[float] = None
    structured_outputs: Optional[StructuredOutputsParams] = None
    # Token-level controls, as in vLLM: a bias added to chosen tokens' logits (clamped to
    # [-100, 100]); the only tokens that may be sampled; words that may not be generated.
    logit_bias: Optional[Dict[int, float]] = None
    allowed_token_ids: Optional[List[int]] = None
    bad_words: Optional[List[str]] = None
    # Logprobs of each prompt token (given those before it), with this many alternatives.
    prompt_logprobs: Optional[int] = None
    # Keep only the prompt's last k tokens (-1: as many as max_model_len allows).
    truncate_prompt_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        self._as_python_numbers()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                raise ParamError(name, f"{name} must be a list, got {value!r}")
            setattr(self, name, list(value or []))
        if self.top_k == -1:
            self.top_k = 0
        if is_int(self.seed) and self.seed == -1:
            self.seed = None  # vLLM's "no seed": clients send -1 for a random draw
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is True:
                setattr(self, name, 1)  # vLLM's: True asks for the one most likely token
        self._verify()
        self._verify_token_controls()

    def _as_python_numbers(self) -> None:
        """numpy's integers, floats and bools (an evaluation script's seeds and settings) as
        Python's; a bool given for a number stays a bool, for the checks to refuse."""
        for name in (*_INT_FIELDS, *_FLOAT_FIELDS, "slo_ttft_ms", "slo_tpot_ms"):
            setattr(self, name, _python_number(getattr(self, name)))
        for name in _BOOL_FIELDS:  # numpy's bools as Python's (no other value)
            if isinstance(getattr(self, name), np.bool_):
                setattr(self, name, bool(getattr(self, name)))
        for name in ("stop_token_ids", "allowed_token_ids"):
            value = getattr(self, name)
            if isinstance(value, (list, tuple)):
                setattr(self, name, [_python_number(t) for t in value])
        if isinstance(self.logit_bias, dict):
            self.logit_bias = {_python_number(k): _python_number(v)
                               for k, v in self.logit_bias.items()}

    def _verify(self) -> None:
        def fail(name: str, rule: str) -> None:
            raise ParamError(name, f"{name} {rule}, got {getattr(self, name)!r}")

        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value):
                fail(name, "must be a finite number")
        if not is_int(self.n) or self.n < 1:
            fail("n", "must be an integer >= 1")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                fail(name, "must be True or False")
        if not isinstance(self.output_kind, RequestOutputKind):
            fail("output_kind", "must be a RequestOutputKind")
        if self.temperature < 0.0:
            fail("temperature", "must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < 0:
            fail("top_k", "must be a non-negative integer (0 or -1 disables it)")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", "must be in [-2, 2]")
        if not FLOAT32_TINY <= self.repetition_penalty <= FLOAT32_MAX:
            fail("repetition_penalty", "must be greater than zero, within float32's range")
        if self.max_tokens is not None and (not is_int(self.max_tokens)
                                            or self.max_tokens < 1):
            fail("max_tokens", "must be an integer >= 1")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            fail("min_tokens", "must be greater than or equal to 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be less than or equal to max_tokens={self.max_tokens}")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            fail("logprobs", "must be a non-negative integer")
        if self.seed is not None and (not is_int(self.seed)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            fail("seed", f"must be an integer in [{SEED_MIN}, {SEED_MAX}]")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(
                    value, (int, float)) or not 0 < value < 1e9):
                fail(name, "must be a positive number of milliseconds")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ParamError("stop", f"stop has {len(self.stop)} strings, more than the "
                             f"{MAX_STOP_STRINGS} allowed")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "must be non-empty strings")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise ParamError(
                "stop", f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters")
        check_unicode("stop", self.stop)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ParamError("stop_token_ids", f"stop_token_ids has {len(self.stop_token_ids)} "
                             f"ids, more than the {MAX_STOP_TOKEN_IDS} allowed")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ParamError("stop_token_ids", "stop_token_ids must be non-negative integers")
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            fail("structured_outputs", "must be a StructuredOutputsParams")

    def _verify_token_controls(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ParamError("logit_bias", "logit_bias must map token ids to biases")
            if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
                raise ParamError(
                    "logit_bias", f"logit_bias has {len(self.logit_bias)} entries, more than the "
                    f"{MAX_LOGIT_BIAS_ENTRIES} allowed")
            bias = {}
            for token, value in self.logit_bias.items():
                if not is_int(token) or token < 0:
                    raise ParamError(
                        "logit_bias", f"logit_bias keys must be token ids, got {token!r}")
                if isinstance(value, bool) or not isinstance(value, (int, float)) \
                        or not math.isfinite(value):
                    raise ParamError(
                        "logit_bias", f"logit_bias values must be finite numbers, got {value!r}")
                bias[token] = min(max(float(value), -LOGIT_BIAS_LIMIT), LOGIT_BIAS_LIMIT)
            self.logit_bias = bias
        if self.allowed_token_ids is not None:
            self._check_allowed_token_ids()
        if self.bad_words is not None:
            if not isinstance(self.bad_words, list) or len(self.bad_words) > MAX_STOP_STRINGS \
                    or not all(isinstance(w, str) and w.strip() for w in self.bad_words):
                raise ParamError(
                    "bad_words", f"bad_words must be a list of at most {MAX_STOP_STRINGS} "
                    "non-blank strings")
            if any(len(w) > MAX_STOP_STRING_CHARS for w in self.bad_words):
                raise ParamError("bad_words", f"bad_words must be at most {MAX_STOP_STRING_CHARS} "
                                 "characters each")
            check_unicode("bad_words", self.bad_words)
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs)
                                                 or self.prompt_logprobs < 0):
            raise ParamError(
                "prompt_logprobs", f"prompt_logprobs must be a non-negative integer, got "
                f"{self.prompt_logprobs!r}")
        if self.truncate_prompt_tokens is not None and (
                not is_int(self.truncate_prompt_tokens) or self.truncate_prompt_tokens == 0
                or self.truncate_prompt_tokens < -1):
            raise ParamError("truncate_prompt_tokens", "truncate_prompt_tokens must be a positive "
                             "integer or -1 (the maximum model length), got "
                             f"{self.truncate_prompt_tokens!r}")

    def _check_allowed_token_ids(self) -> None:
        ids = self.allowed_token_ids
        if not isinstance(ids, list) or not ids:
            raise ParamError(
                "allowed_token_ids", "allowed_token_ids must be a non-empty list of token ids")
        if len(ids) > MAX_ALLOWED_TOKEN_IDS:
            raise ParamError(
                "allowed_token_ids", f"allowed_token_ids has {len(ids)} entries; at most "
                f"{MAX_ALLOWED_TOKEN_IDS} allowed")
        if not all(is_int(t) and t >= 0 for t in ids):
            raise ParamError(
                "allowed_token_ids", "allowed_token_ids must be a non-empty list of token ids")
        self.allowed_token_ids = list(dict.fromkeys(ids))  # the mask is built every step

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

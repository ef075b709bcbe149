"""Structured outputs (xgrammar): every kind of constraint holds on what is generated, in the
LLM API and over HTTP; bad constraints are refused up front; constrained requests wait for
their grammar without holding others up, survive preemption, and fail alone."""

from __future__ import annotations

import functools
import json
import re
import threading
import time

import httpx
import pytest
import xgrammar.testing

from conftest import running_server
from fulcrum import LLM, SamplingParams
from fulcrum import structured_output
from fulcrum.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "object",
          "properties": {"color": {"enum": ["red", "green", "blue"]},
                         "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["color", "ok", "n"]}
PROMPTS = ["hello", "the weather is", "x y z", "1 2 3 4"]


def conforms(value) -> bool:
    return (isinstance(value, dict) and set(value) == {"color", "ok", "n"}
            and value["color"] in ("red", "green", "blue") and isinstance(value["ok"], bool)
            and isinstance(value["n"], int) and 0 <= value["n"] <= 99)


def constrained(seed: int = 0, max_tokens: int = 60, **constraint) -> SamplingParams:
    # temperature 1: a random model wanders everywhere the grammar lets it
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**constraint))


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), scheduling_policy="fcfs")


def texts(outputs):
    return [o.outputs[0].text for o in outputs]


def test_json_schema_holds_and_the_grammar_ends_the_answer(llm):
    params = [constrained(seed, json=SCHEMA, disable_any_whitespace=True) for seed in range(4)]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for output in outputs:
        assert conforms(json.loads(output.outputs[0].text)), output.outputs[0].text
        assert output.outputs[0].finish_reason == "stop"
    assert len({o.outputs[0].text for o in outputs}) > 1  # the seeds do differ


@pytest.mark.parametrize("constraint,check", [
    ({"regex": r"[a-c]{3}-\d\d"}, lambda t: re.fullmatch(r"[a-c]{3}-\d\d", t)),
    ({"choice": ["yes", "no", 'say "hi"\n']}, lambda t: t in ("yes", "no", 'say "hi"\n')),
    ({"grammar": 'root ::= "a" ("b" | "c")* "d"'}, lambda t: re.fullmatch(r"a[bc]*d", t)),
    # Lark, as vLLM takes it too (it was a 400: "EBNF lexer error ... Unexpected ':'")
    ({"grammar": '// a comment\nstart: "a" mid "d"\nmid: ("b" | "c")*\n'},
     lambda t: re.fullmatch(r"a[bc]*d", t)),
])
def test_each_kind_of_constraint_holds(llm, constraint, check):
    outputs = llm.generate(PROMPTS, [constrained(seed, max_tokens=200, **constraint)
                                     for seed in range(4)], use_tqdm=False)
    for text in texts(outputs):
        assert check(text), text


def test_special_tokens_are_not_text_to_the_grammar(llm):
    """A special token spelled its name to xgrammar ("<|im_start|>": 12 characters of the
    pattern) while the answer, decoded without special tokens, held none of it; and EOS could
    stand for the text of a choice "<|im_end|>", ending the answer empty."""
    pattern = "[a-z<|>_]{40}"
    outputs = llm.generate(PROMPTS * 2, [constrained(seed, regex=pattern)
                                         for seed in range(8)], use_tqdm=False)
    for text in texts(outputs):
        assert re.fullmatch(pattern, text), text
    choices = ["<|im_end|>", "ok"]
    outputs = llm.generate(PROMPTS * 2, [constrained(seed, choice=choices)
                                         for seed in range(8)], use_tqdm=False)
    assert all(text in choices for text in texts(outputs)), texts(outputs)


def test_json_object_is_an_object(llm):
    """A random model may write one endless string; whatever ends by itself is an object."""
    params = [constrained(seed, max_tokens=100, json_object=True, disable_any_whitespace=True)
              for seed in range(8)]
    outputs = [o.outputs[0] for o in llm.generate(PROMPTS * 2, params, use_tqdm=False)]
    ended = [o.text for o in outputs if o.finish_reason == "stop"]
    assert ended and all(isinstance(json.loads(t), dict) for t in ended)
    assert all(o.text.startswith("{") for o in outputs)


def test_json_schema_given_as_a_string_is_the_same_constraint(llm):
    as_dict = llm.generate(PROMPTS[:2], constrained(3, json=SCHEMA, disable_any_whitespace=True),
                           use_tqdm=False)
    as_text = llm.generate(PROMPTS[:2], constrained(3, json=json.dumps(SCHEMA),
                                                    disable_any_whitespace=True),
                           use_tqdm=False)
    assert texts(as_dict) == texts(as_text)


def test_a_constrained_request_leaves_its_batch_mates_alone(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPTS, plain, use_tqdm=False)
    mixed = llm.generate(PROMPTS, [plain, constrained(1, choice=["yes", "no"]), plain,
                                   constrained(2, json=SCHEMA, disable_any_whitespace=True)],
                         use_tqdm=False)
    assert texts(mixed)[0::2] == texts(alone)[0::2]
    assert texts(mixed)[1] in ("yes", "no") and conforms(json.loads(texts(mixed)[3]))


def test_ignore_eos_still_ends_when_the_grammar_is_complete(llm):
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=50, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    (output,) = llm.generate(["hi"], params, use_tqdm=False)
    assert output.outputs[0].text in ("yes", "no")
    assert output.outputs[0].finish_reason == "stop"


def test_a_complete_grammar_ends_the_answer_before_min_tokens(llm):
    """min_tokens holds back the end only while the grammar allows more: a complete answer
    (here after one or two tokens) would otherwise have no token left and fail."""
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=50, min_tokens=10,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    (output,) = llm.generate(["hi"], params, use_tqdm=False)
    assert output.outputs[0].text in ("yes", "no")
    assert output.outputs[0].finish_reason == "stop" and output.error is None


@pytest.mark.parametrize("constraint,message", [
    ({"json": {"type": "objec"}}, 'invalid json constraint: Unsupported type "objec"'),
    ({"regex": "a("}, "invalid regex constraint: Regex parsing error"),
    ({"grammar": 'root ::= "a" | '}, "invalid grammar constraint: EBNF parser error"),
])
def test_a_bad_constraint_is_refused_before_anything_is_queued(llm, constraint, message):
    engine = llm.llm_engine
    free = engine.block_manager.num_free_blocks
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate(["hi"], constrained(**constraint), use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == free


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems (at #)"),
    ({"type": "array", "contains": {"const": 5}}, "contains (at #)"),
    ({"not": {"type": "integer"}}, "not (at #)"),
    ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 3}}, "if (at #)"),
    ({"allOf": [{"type": "integer"}, {"type": "integer", "minimum": 5}]},
     "allOf with more than one schema"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "object", "properties": {"s": {"type": "string", "pattern": "^a+$",
                                             "maxLength": 2}}},
     "maxLength beside pattern (at #/properties/s)"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf on a number"),
    ({"type": "array", "items": {"minimum": 5}}, "minimum without a type (at #/items)"),
    ({"type": "string", "anyOf": [{"type": "integer"}]}, "type beside anyOf"),
    ({"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}},
     "$ref 'https://example.com/a.json' (only '#/...' pointers into the schema are "
     "followed) (at #/properties/a)"),
    ({"$defs": {"a": {"$anchor": "a", "type": "integer"}}, "$ref": "#a"}, "$ref '#a'"),
    ({"type": "object", "properties": {"a": {"$dynamicRef": "#n"}}}, "$dynamicRef"),
    ({"anyOf": []}, "anyOf with no schema in its list (at #)"),
    ({"type": "array", "items": {"oneOf": []}}, "oneOf with no schema in its list"),
    ({"type": []}, "type with no type in its list"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]},
     "required 'b' without a schema of its own in properties"),
    ({"type": "object", "required": ["b"], "additionalProperties": {"type": "integer"}},
     "required 'b'"),
    ({"type": "string", "pattern": "^(?!b)[a-z]+$"}, "lookahead in the pattern '^(?!b)[a-z]+$'"),
    ({"type": "object", "patternProperties": {"^a(?=b)": {"type": "integer"}}},
     "lookahead in the pattern"),
    ({"type": "string", "format": "email", "pattern": "^x"}, "pattern beside format 'email'"),
])
def test_schema_keywords_the_grammar_would_not_enforce_are_refused(schema, keyword):
    """Each was compiled and left unenforced (xgrammar 0.2.9): [2, 1, 1] under uniqueItems,
    "caaaa" under pattern + maxLength, any value for a $ref to a URL, an empty answer for an
    empty anyOf, {} for a required name without a property, "aaa" for ^(?=b)a+$, "a@b.co"
    for an email that must start with x. Accepting them gave outputs that break the schema."""
    with pytest.raises(ValueError, match=re.escape(f"the JSON schema's {keyword}")):
        StructuredOutputsParams(json=schema)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/A", "description": "d"}},
     "$defs": {"A": {"type": "integer", "minimum": 1}}},
    {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}], "default": None},
    {"type": "object", "propertyNames": {"pattern": "^a"}},
    {"type": "integer", "multipleOf": 3}, {"type": "string", "format": "date-time"},
    {"const": {"not": 1}}, {"type": "array", "uniqueItems": False},
    {"oneOf": [{"type": "integer"}, {"type": "string"}]},
    # "format" is an annotation (JSON Schema 2019-09 on): pydantic's HttpUrl, bytes,
    # SecretStr; OpenAPI's int64 and double.
    {"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083},
    {"type": "string", "format": "binary"}, {"type": "string", "format": "password"},
    {"type": "string", "format": "hostname", "pattern": "^[a-z]+$"},
    {"type": "string", "pattern": "^[(?=]\\(?!$"},  # no lookahead: a class, an escape
    {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#"}}},
     "required": ["c"]},
    {"type": "object", "properties": {"id": {"type": "integer", "format": "int64"},
                                      "x": {"type": "number", "format": "double"}}},
])
def test_schemas_the_grammar_enforces_are_taken(llm, schema):
    (output,) = llm.generate(["hi"], constrained(json=schema, max_tokens=1), use_tqdm=False)
    assert output.outputs[0].finish_reason in ("length", "stop")


def test_length_bounded_strings_are_json_strings(llm):
    """xgrammar 0.2.9 wrote a string with minLength/maxLength as characters that include raw
    control characters (no JSON); 6 of 8 random answers were no JSON. Escapes stay out (they
    made each token cost hundreds of milliseconds to match)."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 3,
                                                     "maxLength": 6}}, "required": ["s"]}
    outputs = llm.generate(["x"] * 8, [constrained(seed, json=schema, max_tokens=40)
                                       for seed in range(8)], use_tqdm=False)
    finished = [o.outputs[0].text for o in outputs if o.outputs[0].finish_reason == "stop"]
    assert len(finished) >= 4
    for text in finished:
        assert 3 <= len(json.loads(text)["s"]) <= 6, text
    grammar = structured_output._parse(StructuredOutputsParams(json=schema))
    accepts = functools.partial(xgrammar.testing._is_grammar_accept_string, grammar)
    assert accepts('{"s": "ab\u00e9"}') and accepts('{"s": "a b"}')
    assert not accepts('{"s": "a\tbc"}') and not accepts('{"s": "abcdefg"}')


@pytest.mark.parametrize("fields,message", [
    ({}, "exactly one of json, regex, choice, grammar, json_object; got none"),
    ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
    ({"json": "{not json"}, "the JSON schema is not valid JSON"),
    ({"json": [1]}, "must be a JSON object"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"regex": ""}, "regex must be a non-empty string"),
])
def test_structured_outputs_params_are_checked(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**fields)


def _properties(count: int, nested: bool = False) -> dict:
    """An object schema with `count` properties in all (half of them one level down)."""
    if not nested:
        return {"type": "object", "properties": {f"p{i}": {"type": "string"}
                                                 for i in range(count)}}
    inner = _properties(count // 2)
    return {"type": "object", "properties": {"inner": inner, **{
        f"q{i}": {"type": "integer"} for i in range(count - count // 2 - 1)}}}


def test_schema_size_limits_count_the_whole_schema():
    # What compiles in seconds is allowed; one more property or enum value is refused.
    from fulcrum.sampling_params import (MAX_ALTERNATIVES, MAX_PATTERN_CHARS,
                                         MAX_SCHEMA_BRANCHES, MAX_SCHEMA_PROPERTIES, SchemaSize,
                                         schema_size)

    assert schema_size(_properties(5000, nested=True)) == SchemaSize(5, 5000, 0, 0, 0)
    assert schema_size({"anyOf": [{"enum": [1, 2]}, {"enum": ["a"]}]}) == SchemaSize(
        4, 0, 3, 2, literal_chars=1)
    assert schema_size({"pattern": "ab", "patternProperties": {"^x": {}}}).pattern_chars == 4
    StructuredOutputsParams(json=_properties(MAX_SCHEMA_PROPERTIES, nested=True))
    with pytest.raises(ValueError, match="5001 object properties in all, more than the 5000"):
        StructuredOutputsParams(json=_properties(MAX_SCHEMA_PROPERTIES + 1, nested=True))
    # Compact JSON (tool calls' arguments too) compiled 2,000 optional properties in 29 s.
    StructuredOutputsParams(json=_properties(1000), disable_any_whitespace=True)
    with pytest.raises(ValueError, match="1001 object properties in all, without free "
                                         "whitespace, more than the 1000 allowed"):
        StructuredOutputsParams(json=_properties(1001), disable_any_whitespace=True)
    branches = {"anyOf": [{"type": "string", "minLength": i % 7}
                          for i in range(MAX_SCHEMA_BRANCHES)]}
    StructuredOutputsParams(json=branches)
    branches["anyOf"].append({"type": "integer"})
    with pytest.raises(ValueError, match="1001 anyOf / oneOf / allOf branches in all"):
        StructuredOutputsParams(json=branches)
    StructuredOutputsParams(regex="a" * MAX_PATTERN_CHARS)
    with pytest.raises(ValueError, match="regex constraint is longer than 65536 characters"):
        StructuredOutputsParams(regex="a" * (MAX_PATTERN_CHARS + 1))
    with pytest.raises(ValueError, match="grammar constraint is longer than 65536"):
        StructuredOutputsParams(grammar='root ::= "' + "a" * MAX_PATTERN_CHARS + '"')
    with pytest.raises(ValueError, match="65537 characters of patterns in all"):  # in a schema
        StructuredOutputsParams(json={"type": "string", "pattern": "a" * (MAX_PATTERN_CHARS + 1)})
    enums = {"anyOf": [{"enum": list(range(MAX_ALTERNATIVES // 2))},
                       {"enum": list(range(MAX_ALTERNATIVES // 2))}]}
    StructuredOutputsParams(json=enums)
    enums["anyOf"].append({"enum": [0]})
    with pytest.raises(ValueError, match="has 10001 enum values in all, more than the 10000"):
        StructuredOutputsParams(json=json.dumps(enums))
    StructuredOutputsParams(choice=["a"] * MAX_ALTERNATIVES)
    with pytest.raises(ValueError, match="choice has 10001 strings, more than the 10000"):
        StructuredOutputsParams(choice=["a"] * (MAX_ALTERNATIVES + 1))
    # Long strings: 2,000 choices of 100 characters compiled for 12 s, and every constrained
    # request behind them waited (1 MiB of them: minutes).
    StructuredOutputsParams(choice=["a" * 64] * (MAX_PATTERN_CHARS // 64))
    with pytest.raises(ValueError, match="choice has 65600 characters in all, more than the "
                                         "65536 allowed"):
        StructuredOutputsParams(choice=["a" * 100] * 656)
    assert schema_size({"enum": ["ab", 1, None], "const": "c"}).literal_chars == 3
    with pytest.raises(ValueError, match="65600 characters of enum and const strings in all"):
        StructuredOutputsParams(json={"anyOf": [{"enum": ["a" * 100] * 600},
                                                {"const": "b" * 5600}]})


def test_requests_with_one_schema_share_one_compile(llm):
    compiler = llm.llm_engine.grammar_compiler
    params = StructuredOutputsParams(regex=r"\d+x")
    first, second = compiler.grammar_for(params), compiler.grammar_for(params)
    assert first.future is second.future
    assert compiler.grammar_for(StructuredOutputsParams(regex=r"\d+y")).future \
        is not first.future


def test_a_constraint_is_parsed_once_however_often_it_is_checked(llm, monkeypatch):
    """The checks before a request is queued and its compile all ask for the parsed grammar;
    a large schema takes tens of milliseconds to parse, on the server's event loop."""
    from fulcrum import structured_output

    parsed = []
    original = structured_output._parse
    monkeypatch.setattr(structured_output, "_parse",
                        lambda params: parsed.append(params.source) or original(params))
    schema = {**SCHEMA, "title": "parsed once"}  # not parsed by the other tests
    for seed in (1, 2):
        llm.generate(["hello"], constrained(seed, max_tokens=4, json=schema), use_tqdm=False)
    assert parsed == [json.dumps(schema)]
    # The same schema with the other whitespace rule is another grammar.
    llm.generate(["hello"], constrained(3, max_tokens=4, json=schema,
                                        disable_any_whitespace=True), use_tqdm=False)
    assert len(parsed) == 2


def test_constrained_requests_survive_preemption(llama_dir):
    """Preemption keeps generated tokens, so the matcher is still right when they resume."""
    prompts = [list(range(1 + 40 * i, 35 + 40 * i)) for i in range(3)]
    params = [constrained(10 + i, max_tokens=45, regex="[a-z]{40}") for i in range(3)]
    roomy = LLM(str(llama_dir), block_size=8, max_model_len=128, scheduling_policy="fcfs")
    reference = roomy.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
    tight = LLM(str(llama_dir), block_size=8, max_model_len=128, num_gpu_blocks_override=17,
                scheduling_policy="fcfs")
    outputs = tight.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert texts(outputs) == texts(reference)
    assert all(re.fullmatch("[a-z]{40}", t) for t in texts(outputs))
    assert tight.llm_engine.block_manager.num_free_blocks == tight.llm_engine.block_manager.num_usable_blocks


def test_a_request_waits_for_its_grammar_while_others_run(llama_dir, monkeypatch):
    llm = LLM(str(llama_dir), scheduling_policy="fcfs")
    compiler = llm.llm_engine.grammar_compiler
    release = threading.Event()
    real = compiler._compiler.compile_grammar

    def slow_compile(grammar):
        release.wait(10)
        return real(grammar)

    monkeypatch.setattr(compiler._compiler, "compile_grammar", slow_compile)
    engine = llm.llm_engine
    engine.add_request("slow", {"prompt": "hi"}, constrained(choice=["yes", "no"]))
    engine.add_request("plain", {"prompt": "hi"}, SamplingParams(max_tokens=3, ignore_eos=True))
    finished = {}
    deadline = time.monotonic() + 20
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        if "plain" in finished:
            release.set()
    assert list(finished) == ["plain", "slow"]
    assert finished["slow"].outputs[0].text in ("yes", "no")


def test_a_grammar_that_fails_to_compile_fails_its_request_alone(llama_dir, monkeypatch):
    llm = LLM(str(llama_dir), scheduling_policy="fcfs")
    compiler = llm.llm_engine.grammar_compiler

    def broken(grammar):
        raise RuntimeError("[12:00:00] /x/compiler.cc:1: out of memory")

    monkeypatch.setattr(compiler._compiler, "compile_grammar", broken)
    broken_params = constrained(choice=["never compiled"])
    outputs = llm.generate(["a", "b"], [broken_params, SamplingParams(max_tokens=3,
                                                                      ignore_eos=True)],
                           use_tqdm=False)
    assert outputs[0].outputs[0].finish_reason == "error"
    assert outputs[0].error == "compiling the grammar failed: out of memory"
    assert len(outputs[1].outputs[0].token_ids) == 3
    engine = llm.llm_engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


def test_real_weights_follow_a_schema(stories_dir):
    """stories260K's byte-fallback vocabulary (sentencepiece pieces, not byte-level BPE)."""
    llm = LLM(str(stories_dir), scheduling_policy="fcfs")
    params = [constrained(seed, max_tokens=80, json=SCHEMA, disable_any_whitespace=True)
              for seed in range(3)]
    for output in llm.generate(["Once upon a time"] * 3, params, use_tqdm=False):
        assert conforms(json.loads(output.outputs[0].text)), output.outputs[0].text


# ---------------------------------------------------------------------------- server
@pytest.fixture(scope="module")
def served(llama_dir):
    with running_server(llama_dir, scheduling_policy="fcfs") as pair:
        yield pair


CHAT = {"messages": [{"role": "user", "content": "hi"}], "temperature": 1.0, "seed": 3,
        "max_tokens": 80}


def chat(server, **extra):
    return httpx.post(server.url + "/v1/chat/completions", json={**CHAT, **extra}, timeout=60)


# Free whitespace is on by default over HTTP (as in vLLM), where a random model may pad
# forever, so these schemas leave no room for whitespace: a string out of a list.
COLORS = {"enum": ["red", "green", "blue"]}
COLOR_TEXTS = ('"red"', '"green"', '"blue"')


def content(reply) -> str:
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def test_server_response_format_json_schema(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "color", "schema": COLORS}}
    assert content(chat(server, response_format=fmt)) in COLOR_TEXTS
    completion = httpx.post(server.url + "/v1/completions", json={
        "prompt": "x", "max_tokens": 80, "seed": 1, "temperature": 1.0,
        "response_format": fmt}, timeout=60)
    assert completion.json()["choices"][0]["text"] in COLOR_TEXTS


def test_server_json_object_structured_outputs_and_guided_fields(server):
    json_mode = chat(server, response_format={"type": "json_object"}, max_tokens=40)
    assert content(json_mode).startswith("{")
    if json_mode.json()["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(content(json_mode)), dict)
    assert content(chat(server, structured_outputs={"choice": ["left", "right"]})) \
        in ("left", "right")
    strict = chat(server, structured_outputs={"json": SCHEMA, "disable_any_whitespace": True})
    assert conforms(json.loads(content(strict)))
    assert re.fullmatch(r"\d{4}", content(chat(server, guided_regex=r"\d{4}")))
    assert content(chat(server, guided_choice=["up", "down"])) in ("up", "down")
    assert content(chat(server, guided_json=json.dumps(COLORS))) in COLOR_TEXTS
    assert content(chat(server, guided_grammar='root ::= "x" "y"+', max_tokens=5)) \
        .startswith("xy")
    assert content(chat(server, guided_grammar='start: "x" "y"+', max_tokens=5)) \
        .startswith("xy")  # Lark


def test_server_streams_a_constrained_answer(server):
    pieces = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                      json={**CHAT, "stream": True, "structured_outputs": {
                          "json": SCHEMA, "disable_any_whitespace": True}}) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0]["delta"].get("content"):
                    pieces.append(choices[0]["delta"]["content"])
    assert len(pieces) > 3
    assert conforms(json.loads("".join(pieces)))


@pytest.mark.parametrize("extra,param,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "needs json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "got 'yaml'"),
    ({"response_format": {}}, "response_format", "got None"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice",
     "at most one output constraint per request; got guided_regex, guided_choice"),
    ({"structured_outputs": {"regex": "a", "frob": 1}}, "structured_outputs",
     "structured_outputs takes only json, regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice must be a non-empty"),
    ({"guided_json": {"type": "objec"}}, None, 'Unsupported type "objec"'),
    ({"guided_regex": "("}, None, "Regex parsing error"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "not supported"),
])
def test_server_refuses_bad_constraints(server, async_llm, extra, param, message):
    reply = chat(server, **extra)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert message in error["message"] and error["param"] == param
    assert async_llm.is_healthy and async_llm.engine.get_num_unfinished_requests() == 0


# -------------------------------------------- real weights through the openai client
@pytest.fixture(scope="module")
def stories_client(stories_dir):
    """stories260K knows nothing of JSON: the constraint does all the work."""
    import openai

    with running_server(stories_dir, "stories", scheduling_policy="fcfs") as (server, _):
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none")


def test_openai_client_on_real_weights(stories_client):
    def texts(**extra):
        result = stories_client.completions.create(
            model="stories", prompt="Once upon a time", max_tokens=120, n=3, temperature=1.0,
            seed=7, extra_body=extra)
        return [c.text for c in result.choices]

    for text in texts(structured_outputs={"json": SCHEMA, "disable_any_whitespace": True}):
        assert conforms(json.loads(text)), text
    fmt = {"type": "json_schema", "json_schema": {"name": "color", "schema": COLORS}}
    assert set(texts(response_format=fmt)) <= set(COLOR_TEXTS)
    assert all(re.fullmatch(r"[a-z]+ [0-9]{2}", t) for t in texts(guided_regex=r"[a-z]+ [0-9]{2}"))
    assert set(texts(guided_choice=["Lily", "Tom"])) <= {"Lily", "Tom"}


def test_a_grammar_that_takes_too_long_a_token_fails_its_request_alone(llm, monkeypatch):
    """An ambiguous grammar grew slower token by token (208 ms a token by its 322nd), and
    every request in the batch waited for it: past its budget, it fails, its own fault."""
    monkeypatch.setattr(structured_output, "GRAMMAR_GRACE_SECONDS", 0.0)
    monkeypatch.setattr(structured_output, "GRAMMAR_SECONDS_PER_TOKEN", -1.0)  # any cost
    plain = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    costly, free = llm.generate(["hi", "hi"], [constrained(regex="[a-z]+"), plain],
                                use_tqdm=False)
    assert costly.outputs[0].finish_reason == "error"
    assert len(costly.outputs[0].token_ids) == 0
    assert re.search(r"the structured-output grammar took \d+ ms a token, more than the -1000 ms",
                     costly.error)
    assert len(free.outputs[0].token_ids) == 5
    assert not llm.llm_engine.has_unfinished_requests()

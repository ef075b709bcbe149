"""Tool calling: the parsers of each model format, the stream that turns text into OpenAI's
tool-call deltas, and the server end to end (tools and tool history in the chat template,
tool_choice none / auto / required / named, streamed and not, through the openai SDK too).

A random-weight model never decides to call a tool by itself, so the "auto" tests make it
write a call with a structured-output regex: the text then goes through the real parser,
exactly as a model's own call would."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from conftest import build_tiny_model, running_server
from fulcrum.server.tool_calls import (HermesParser, Llama3JsonParser, MistralParser,
                                       ToolCallStream, ToolDelta, required_schema)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"enum": ["Paris", "Rome"]},
                                  "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object",
                                       "properties": {"zone": {"enum": ["utc", "cet"]}},
                                       "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n' \
       '</tool_call>'


def calls(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed[1]]


# ------------------------------------------------------------------ parsers
def test_hermes_reads_content_then_calls():
    text = f"Let me check.\n{CALL}\n<tool_call>\n{{\"name\": \"get_time\", " \
           f"\"arguments\": {{\"zone\": \"utc\"}}}}\n</tool_call>"
    parsed = HermesParser().parse(text)
    assert parsed[0] == "Let me check.\n"
    assert calls(parsed) == [("get_weather", {"city": "Paris", "unit": "c"}),
                             ("get_time", {"zone": "utc"})]
    # a call cut off by EOS before its closing tag still counts once its JSON is whole
    assert calls(HermesParser().parse(CALL[:-len("</tool_call>")])) == calls(
        HermesParser().parse(CALL))


@pytest.mark.parametrize("text", [
    "no calls here",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',  # broken JSON
    '<tool_call>\n{"name": "get_weather", "arguments": [1, 2]}\n</tool_call>',  # not an object
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
])
def test_hermes_never_invents_a_call(text):
    assert HermesParser().parse(text) == (text, [])


def test_llama3_json_reads_one_or_several_objects():
    one = '{"name": "get_time", "parameters": {"zone": "cet"}}'
    assert calls(Llama3JsonParser().parse(one)) == [("get_time", {"zone": "cet"})]
    two = one + '; {"name": "get_weather", "arguments": {"city": "Rome", "unit": "f"}}'
    assert [n for n, _ in calls(Llama3JsonParser().parse(two))] == ["get_time", "get_weather"]
    assert calls(Llama3JsonParser().parse("<|python_tag|>" + one)) == [("get_time",
                                                                         {"zone": "cet"})]
    # The tag, where it shows, is no content (it came back as content beside the call, and
    # a stream sent it before the call came)
    assert Llama3JsonParser().parse("<|python_tag|>" + one)[0] is None
    stream = ToolCallStream("auto", Llama3JsonParser())
    assert stream.feed(" <|python") == ToolDelta()  # (a tokenizer that spells it out)
    assert stream.feed("_tag|>") == ToolDelta()
    assert stream.feed(one) == ToolDelta()
    assert stream.finish()[0].content is None
    code = '<|python_tag|>brave_search.call(query="x")'
    assert Llama3JsonParser().parse(code) == (code, [])
    stream = ToolCallStream("auto", Llama3JsonParser())
    assert stream.feed("<|py") == ToolDelta()
    assert stream.feed("thon!") == ToolDelta(content="<|python!")
    assert Llama3JsonParser().parse('Use {"name": "x"}') == ('Use {"name": "x"}', [])
    assert Llama3JsonParser().parse('{"a": 1}') == ('{"a": 1}', [])
    # JSON data asked for while tools are offered is no call (vLLM's parser needs one of the
    # two keys; of both, it reads "arguments")
    data = '{"name": "Alice", "age": 30}'
    assert Llama3JsonParser().parse(data) == (data, [])
    both = '{"name": "f", "arguments": {"a": 1}, "parameters": {"p": 2}}'
    assert calls(Llama3JsonParser().parse(both)) == [("f", {"a": 1})]


def test_special_tokens_are_kept_only_where_a_parsers_markers_are_special(llama_dir, tmp_path):
    """Answers for "auto" keep special tokens only where the tokenizer marks one of the
    parser's markers special (some mark <tool_call>, Mistral's [TOOL_CALLS]: skipped, the
    calls came back as text); keeping them always sent a model's other special tokens,
    reserved ones included, as content."""
    from fulcrum.default_model import byte_level_tokenizer
    from fulcrum.server.tool_calls import skips_special_tokens
    from fulcrum.tokenizer import Tokenizer

    plain = Tokenizer(str(llama_dir))
    assert all(skips_special_tokens(p, plain) for p in (HermesParser(), MistralParser()))
    marked = byte_level_tokenizer()
    marked.add_special_tokens(["<tool_call>", "</tool_call>", "[TOOL_CALLS]"])
    folder = tmp_path / "marked"
    folder.mkdir()
    marked.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    special = Tokenizer(str(folder))
    assert not skips_special_tokens(HermesParser(), special)
    assert not skips_special_tokens(MistralParser(), special)
    assert skips_special_tokens(Llama3JsonParser(), special)


def test_mistral_reads_its_list():
    text = 'Sure[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "utc"}}, ' \
           '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}]'
    parsed = MistralParser().parse(text)
    assert parsed[0] == "Sure"
    assert calls(parsed) == [("get_time", {"zone": "utc"}),
                             ("get_weather", {"city": "Rome", "unit": "c"})]
    assert MistralParser().parse("[TOOL_CALLS]oops") == ("[TOOL_CALLS]oops", [])


def test_mistral_reads_v11_calls_and_makes_ids_its_templates_take():
    """v11+ models (Mistral Small 3.2, Magistral, Devstral) write [TOOL_CALLS]name[ARGS]{...}
    a call; Mistral's templates refuse a call id that is not 9 letters and digits when the
    calls come back in the history."""
    text = 'Sure[TOOL_CALLS]get_time[ARGS]{"zone": "utc"}[TOOL_CALLS]get_weather' \
           '[CALL_ID]a1b2c3d4e[ARGS]{"city": "Rome", "unit": "c"}'
    parsed = MistralParser().parse(text)
    assert parsed[0] == "Sure"
    assert calls(parsed) == [("get_time", {"zone": "utc"}),
                             ("get_weather", {"city": "Rome", "unit": "c"})]
    for broken in ("[TOOL_CALLS]get_time[ARGS]{\"zone\": ", "[TOOL_CALLS]get_time{}"):
        assert MistralParser().parse(broken) == (broken, [])
    _, deltas, _ = feed_all(ToolCallStream("auto", MistralParser()), [text])
    named = ToolCallStream("named", MistralParser(), function="get_time").feed("{")
    for call_id in [d["id"] for d in deltas] + [named.tool_calls[0]["id"]]:
        assert re.fullmatch(r"[A-Za-z0-9]{9}", call_id)
    assert deltas[1]["id"] == "a1b2c3d4e"  # the model's own id, where it wrote one


def test_required_schema_offers_every_function():
    schema = required_schema(TOOLS)
    assert schema["minItems"] == 1 and "maxItems" not in schema
    assert required_schema(TOOLS, parallel=False)["maxItems"] == 1
    names = [o["properties"]["name"]["enum"] for o in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == WEATHER["function"][
        "parameters"]


def test_required_schema_keeps_each_functions_definitions_at_the_root():
    """Inside the list of calls, "#/$defs/..." would point at nothing (pydantic's tools have
    $defs for every nested model): the definitions move to the root, as vLLM moves them."""
    item = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    order = {"type": "function", "function": {"name": "order", "parameters": {
        "type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}},
        "required": ["item"], "$defs": {"Item": item}}}}
    schema = required_schema([order, WEATHER])
    assert schema["$defs"] == {"Item": item}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert "$defs" in order["function"]["parameters"]  # the request's own tool is unchanged
    other = json.loads(json.dumps(order))
    other["function"]["parameters"]["$defs"]["Item"] = {"type": "string"}
    with pytest.raises(ValueError, match=r"tools define \$defs/Item differently"):
        required_schema([order, other])
    itself = {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}}}
    with pytest.raises(ValueError, match="refer to their own root"):
        required_schema([itself])
    hidden = {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "properties": {"n": {"$ref": "#/$defs/Node"}},
        "$defs": {"Node": {"type": "object", "properties": {"up": {"$ref": "#"}}}}}}}
    with pytest.raises(ValueError, match="refer to their own root"):
        required_schema([hidden])
    for broken in ([1], "Item"):
        odd = {"type": "function", "function": {"name": "odd", "parameters": {
            "type": "object", "$defs": broken}}}
        with pytest.raises(ValueError, match=r"have \$defs that is not an object"):
            required_schema([odd])


def test_a_function_without_parameters_takes_no_arguments():
    """Not any object: a model filled one with invented keys until max_tokens."""
    bare = {"type": "function", "function": {"name": "now"}}
    (call,) = required_schema([bare])["items"]["anyOf"]
    assert call["properties"]["parameters"] == {"type": "object", "properties": {}}


# ------------------------------------------------------------------ stream
def feed_all(stream, pieces):
    content, deltas = "", []
    for piece in pieces:
        delta = stream.feed(piece)
        content += delta.content or ""
        deltas += delta.tool_calls
    rest, were_calls = stream.finish()
    return content + (rest.content or ""), deltas + rest.tool_calls, were_calls


def test_stream_holds_back_what_may_be_a_marker_then_sends_the_calls():
    stream = ToolCallStream("auto", HermesParser())
    assert stream.feed("Sure").content == "Sure"
    assert stream.feed(" <to").content == " "  # "<to" may start "<tool_call>"
    assert stream.feed("ol_call>\n{").content is None  # inside a call: nothing until the end
    stream.feed(CALL[len("<tool_call>\n{"):])
    rest, were_calls = stream.finish()
    assert were_calls and rest.content is None
    (call,) = rest.tool_calls
    assert call["index"] == 0 and call["type"] == "function" and call["id"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "c"}


def test_without_parallel_calls_only_the_first_counts():
    two = CALL + "\n" + CALL.replace("Paris", "Rome")
    content, deltas, were_calls = feed_all(ToolCallStream("auto", HermesParser(),
                                                          parallel=False), [two])
    assert were_calls and len(deltas) == 1 and "Paris" in deltas[0]["function"]["arguments"]


def test_stream_releases_a_false_alarm_and_a_broken_call_as_content():
    assert feed_all(ToolCallStream("auto", HermesParser()), ["a <to", "ast"]) == \
        ("a <toast", [], False)
    broken = ["ok ", "<tool_call>", '{"name": ']
    assert feed_all(ToolCallStream("auto", HermesParser()), broken) == \
        ("ok <tool_call>{\"name\": ", [], False)


@pytest.mark.parametrize("parser", [HermesParser(), Llama3JsonParser(), MistralParser()])
def test_calls_nested_past_the_recursion_limit_are_content(parser):
    """JSON nested deeper than the interpreter's recursion limit (which a model can be led to
    write) raises RecursionError in json: the answer is sent as content, not a 500."""
    text = parser.marker + "[" * 5000
    assert parser.parse(text) == (text, [])
    assert feed_all(ToolCallStream("auto", parser), [text]) == (text, [], False)
    assert feed_all(ToolCallStream("required"), ["[" * 5000]) == ("[" * 5000, [], False)


def test_named_stream_sends_the_arguments_as_they_come():
    stream = ToolCallStream("named", function="get_time")
    first, second = stream.feed('{"zone"'), stream.feed(': "utc"}')
    assert first.tool_calls[0]["function"] == {"name": "get_time", "arguments": '{"zone"'}
    assert first.tool_calls[0]["id"].startswith("chatcmpl-tool-")
    assert second.tool_calls == [{"index": 0, "function": {"arguments": ': "utc"}'}}]
    assert stream.finish() == (stream.finish()[0], False)  # named: finish reason stays


# ------------------------------------------------------------------ server
@pytest.fixture(scope="module")
def tools_dir(tmp_path_factory):
    """The tiny Llama with room for the tool preamble (byte-level: a token per character)."""
    return build_tiny_model("llama", tmp_path_factory.mktemp("tools") / "llama", max_pos=2048)


@pytest.fixture(scope="module")
def served(tools_dir):
    with running_server(tools_dir, scheduling_policy="fcfs",
                        app_kwargs={"tool_call_parser": "hermes"}) as pair:
        yield pair


@pytest.fixture(scope="module")
def plain_server(tools_dir):
    with running_server(tools_dir, scheduling_policy="fcfs") as (server, _):
        yield server


HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [{
               "id": "call_1", "type": "function",
               "function": {"name": "get_weather",
                            "arguments": '{"city": "Paris", "unit": "c"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"}]


def post(server, **body):
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
            "max_tokens": 120, "temperature": 1.0, "seed": 0, **body}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)


def test_the_template_sees_the_tools_and_the_tool_history(server):
    tokens = httpx.post(server.url + "/tokenize",
                        json={"messages": HISTORY, "tools": TOOLS}).json()["tokens"]
    text = httpx.post(server.url + "/detokenize", json={
        "tokens": tokens, "skip_special_tokens": True}).json()["prompt"]
    assert json.dumps(WEATHER) in text and json.dumps(TIME) in text
    assert f"assistant\n{CALL}\n" in text  # the assistant's call, its arguments as JSON
    assert "user\n<tool_response>\nsunny, 21\n</tool_response>\nassistant\n" in text
    assert text.endswith("</tool_response>\nassistant\n")  # (special tokens not shown)


def test_named_tool_choice_is_a_valid_call_of_that_function(server):
    reply = post(server, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                 messages=HISTORY)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["type"] == "function"
    arguments = json.loads(call["function"]["arguments"])
    assert arguments["city"] in ("Paris", "Rome") and arguments["unit"] in ("c", "f")
    assert choice["message"]["content"] is None and choice["finish_reason"] == "stop"


def test_a_named_choice_is_checked_against_its_own_function_alone(server):
    """Another tool's schema that cannot be enforced (pydantic's Set: uniqueItems) does not
    matter when it is not the one named; under "required" it does, named in the 400."""
    tags = {"type": "function", "function": {"name": "tag", "parameters": {
        "type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}}}}
    named = post(server, tools=[WEATHER, tags], messages=HISTORY,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.status_code == 200, named.text
    required = post(server, tools=[WEATHER, tags], tool_choice="required")
    assert required.status_code == 400 and "'tag': the JSON schema's uniqueItems" in required.text


def test_required_tool_choice_calls_functions_from_the_list(server):
    for seed in range(3):
        choice = post(server, tool_choice="required", seed=seed).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"]
        for call in choice["message"]["tool_calls"]:
            arguments = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == "get_weather":
                assert set(arguments) == {"city", "unit"}
            else:
                assert call["function"]["name"] == "get_time" and set(arguments) == {"zone"}


def forced(text: str):
    """A regex matching exactly `text` (metacharacters escaped, nothing else)."""
    return {"structured_outputs": {"regex": re.sub(r"([.^$*+?{}\[\]\\|()])", r"\\\1", text)}}


def test_auto_reads_the_models_own_call(server):
    reply = post(server, tool_choice="auto", **forced("Checking.\n" + CALL))
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking.\n"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather",
                                "arguments": '{"city": "Paris", "unit": "c"}'}
    plain = post(server, **forced("It is sunny.")).json()["choices"][0]  # tools: auto
    assert plain["message"] == {"role": "assistant", "content": "It is sunny.",
                                "tool_calls": []}
    assert plain["finish_reason"] == "stop"


def stream_events(server, **body):
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
            "max_tokens": 120, "stream": True, **body}
    events = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                      timeout=60) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return [e["choices"][0] for e in events if e["choices"]]


def test_auto_streams_content_then_the_call(server):
    choices = stream_events(server, **forced("Checking.\n" + CALL))
    content = "".join(c["delta"].get("content") or "" for c in choices)
    assert content == "Checking.\n"
    deltas = [d for c in choices for d in c["delta"].get("tool_calls") or []]
    assert len(deltas) == 1 and deltas[0]["function"]["name"] == "get_weather"
    assert choices[-1]["finish_reason"] == "tool_calls"
    assert all(c["finish_reason"] is None for c in choices[:-1])
    # What the parser holds back (the call as it comes) sends no empty chunks meanwhile.
    assert all(c["delta"].get("role") or c["delta"].get("content")
               or c["delta"].get("tool_calls") or c["finish_reason"] for c in choices)


def test_named_streams_argument_pieces(server):
    choices = stream_events(server, tool_choice={"type": "function",
                                                 "function": {"name": "get_time"}}, seed=1)
    deltas = [d for c in choices for d in c["delta"].get("tool_calls") or []]
    assert len(deltas) > 2 and deltas[0]["function"]["name"] == "get_time"
    # Later pieces carry the arguments alone: a null "type" there broke the openai SDK's
    # merging of the pieces (its stream helper asserted the type is "function").
    assert all(d == {"index": 0, "function": {"arguments": d["function"]["arguments"]}}
               for d in deltas[1:])
    arguments = "".join(d["function"]["arguments"] for d in deltas)
    assert json.loads(arguments)["zone"] in ("utc", "cet")


def test_the_openai_sdk_reads_the_calls(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    result = client.chat.completions.create(
        model="m", messages=HISTORY, tools=TOOLS, max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    call = result.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time" and "zone" in json.loads(call.function.arguments)
    stream = client.chat.completions.create(
        model="m", messages=HISTORY, tools=TOOLS, max_tokens=120, stream=True,
        extra_body=forced(CALL))
    pieces = [c.choices[0].delta.tool_calls for c in stream if c.choices]
    names = [d.function.name for p in pieces if p for d in p if d.function.name]
    assert names == ["get_weather"]
    # The SDK's stream helper merges the pieces of a named call as they come.
    with client.chat.completions.stream(
            model="m", messages=HISTORY, tools=TOOLS, max_tokens=80,
            tool_choice={"type": "function", "function": {"name": "get_time"}}) as events:
        final = events.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert call.type == "function" and call.function.name == "get_time"
    assert "zone" in json.loads(call.function.arguments)


TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'


@pytest.mark.parametrize("body", [{"extra_body": forced(CALL + "\n" + TIME_CALL)},
                                  {"tool_choice": "required", "seed": 0}])
def test_the_sdk_stream_helper_closes_every_call(server, body):
    """Calls sent whole at the end ("auto", "required") come before the finish_reason, in a
    chunk of their own: the SDK's helper closes a call (its arguments.done event) only when a
    later chunk comes, and closed none that came with the finish_reason."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    with client.chat.completions.stream(model="m", messages=HISTORY, tools=TOOLS,
                                        max_tokens=200, **body) as events:
        done = [(e.index, e.name, e.arguments) for e in events
                if e.type == "tool_calls.function.arguments.done"]
        final = events.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.tool_calls
    assert done == [(i, call.function.name, call.function.arguments)
                    for i, call in enumerate(final.message.tool_calls)]


def test_required_calls_a_function_whose_parameters_have_definitions(server):
    item = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"]}
    clock = {"type": "function", "function": {"name": "clock", "parameters": {
        "type": "object", "properties": {"at": {"$ref": "#/$defs/Where"}}, "required": ["at"],
        "$defs": {"Where": item}}}}
    reply = post(server, tools=[clock], tool_choice="required", parallel_tool_calls=False,
                 max_tokens=200).json()
    (call,) = reply["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"])["at"]["zone"] in ("utc", "cet")


@pytest.mark.parametrize("body,param,message", [
    ({"tool_choice": "required", "tools": None}, "tool_choice", "tool_choice needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "names the function 'nope', which is not in tools"),
    ({"tool_choice": "required", "guided_regex": "a"}, "tool_choice",
     "may not bring its own"),
    ({"tool_choice": "sometimes"}, None, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, None,
     "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}}}}],
      "tool_choice": "required"}, "tools",
     "tools: 'f': the JSON schema's uniqueItems (at #/properties/t) cannot be enforced"),
    # A call's arguments are an object: a named call's were "8", "required" made none.
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "integer"}}}], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools", "tools: 'f': the parameters must be a JSON schema of type 'object', got type "
              "'integer'"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {
        "type": "array"}}}], "tool_choice": "required"}, "tools",
     "'f': the parameters must be a JSON schema of type 'object', got type 'array'"),
    # What xgrammar refuses names the function (it said "invalid json constraint", param null)
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "objec"}}}}}],
      "tool_choice": "required"}, "tools",
     "tools: 'f': invalid json constraint: Unsupported type \"objec\""),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "$defs": [1]}}}], "tool_choice": "required"}, "tools",
     "have $defs that is not an object"),
    ({"messages": [{"role": "tool", "content": "x"}]}, None, "needs tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, None,
     "only assistant messages carry tool_calls"),
])
def test_bad_tool_requests_are_refused(server, body, param, message):
    body = {"messages": [{"role": "user", "content": "x"}], **body}
    if body.get("tools", TOOLS) is not None:
        body.setdefault("tools", TOOLS)
    body = {k: v for k, v in body.items() if v is not None}
    reply = httpx.post(server.url + "/v1/chat/completions", json={**body, "max_tokens": 4})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert message in error["message"] and error["param"] == param


def test_auto_needs_a_parser(plain_server):
    reply = post(plain_server)  # tools without tool_choice: "auto", as in vLLM
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == (
        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
    none = post(plain_server, tool_choice="none", max_tokens=3)
    assert none.status_code == 200 and none.json()["choices"][0]["message"]["tool_calls"] == []


def test_serve_flags_name_the_parsers():
    from fulcrum.cli import build_parser
    from fulcrum.server.tool_calls import PARSERS

    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice",
                                      "--tool-call-parser", "mistral"])
    assert args.enable_auto_tool_choice and args.tool_call_parser == "mistral"
    action = next(a for a in build_parser()._subparsers._group_actions[0].choices[
        "serve"]._actions if a.dest == "tool_call_parser")
    assert sorted(action.choices) == sorted(PARSERS)


def test_llm_chat_hands_tools_to_the_template(tools_dir):
    from fulcrum import LLM, SamplingParams

    llm = LLM(str(tools_dir), scheduling_policy="fcfs")
    (output,) = llm.chat(HISTORY, SamplingParams(max_tokens=1), use_tqdm=False, tools=TOOLS)
    assert json.dumps(WEATHER) in output.prompt and "<tool_response>" in output.prompt
    (plain,) = llm.chat(HISTORY[:1], SamplingParams(max_tokens=1), use_tqdm=False)
    assert "# Tools" not in plain.prompt
    assert "<|im_start|>assistant\n<tool_call>" in output.prompt  # content None: nothing

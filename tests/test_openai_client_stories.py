"""Issue 10's items through the official `openai` client against stories260K, a real trained
Llama (vocabulary 512): what a vLLM user's code sends is what fulcrum serves. A one-line chat
template joins the messages (the model ships none), so chat and tools work too."""

from __future__ import annotations

import json

import openai
import pytest

from conftest import running_server

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
PROMPT = "Once upon a time"
WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def client(stories_dir):
    with running_server(stories_dir, "stories", scheduling_policy="fcfs",
                        app_kwargs={"chat_template": TEMPLATE,
                                    "tool_call_parser": "hermes"}) as (server, _):
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none")


def complete(client, **kwargs):
    kwargs = {"model": "stories", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0,
              **kwargs}
    return client.completions.create(**kwargs)


def token_ids(client, text):
    import httpx

    return httpx.post(str(client.base_url).replace("/v1/", "/tokenize"),
                      json={"prompt": text, "add_special_tokens": False}).json()["tokens"]


def test_token_controls(client):
    plain = complete(client).choices[0].text
    (the,) = token_ids(client, "the")[-1:]
    biased = complete(client, logit_bias={str(the): 100}).choices[0].text
    assert biased.replace(" ", "") == "the" * 8 or set(biased.split()) == {"the"}
    allowed = token_ids(client, " Lily")
    text = complete(client, extra_body={"allowed_token_ids": allowed}).choices[0].text
    assert set(token_ids(client, text)) <= set(allowed) and text != plain
    assert "there" in plain  # ", there was a little girl ..."
    banned = complete(client, extra_body={"bad_words": ["there"]}).choices[0].text
    assert "there" not in banned and banned != plain


def test_prompt_logprobs_echo_and_truncation(client):
    echoed = complete(client, echo=True, logprobs=2, max_tokens=3).choices[0]
    prompt_tokens = len(token_ids(client, PROMPT)) + 1  # with <s>
    assert echoed.text.startswith(PROMPT)
    assert len(echoed.logprobs.tokens) == prompt_tokens + 3
    assert echoed.logprobs.token_logprobs[0] is None
    assert all(v <= 0 for v in echoed.logprobs.token_logprobs[1:])
    asked = complete(client, max_tokens=2, extra_body={"prompt_logprobs": 1})
    assert len(asked.choices[0].model_extra["prompt_logprobs"]) == prompt_tokens
    cut = complete(client, max_tokens=2, extra_body={"truncate_prompt_tokens": 2})
    assert cut.usage.prompt_tokens == 2


def test_text_offsets_are_where_each_token_starts_in_the_text(client):
    """OpenAI's text_offset: token i starts where the text of the first i tokens ends (a
    SentencePiece token's own decode drops its leading space: offsets are not sums of
    those), streamed as not; a multi-byte character's byte tokens all start where it does."""
    whole = complete(client, logprobs=0).choices[0]
    shorter = [len(complete(client, max_tokens=i).choices[0].text) for i in range(1, 8)]
    assert whole.logprobs.text_offset == [0] + shorter
    streamed = [offset for chunk in complete(client, logprobs=0, stream=True)
                for choice in chunk.choices for offset in choice.logprobs.text_offset]
    assert streamed == whole.logprobs.text_offset

    # "日本": <s>, "▁", then each character's three byte tokens. The echoed prompt is the
    # prompt's text, without <s>, whether or not the completion skips special tokens.
    for skip in (True, False):
        echoed = complete(client, prompt="日本", echo=True, logprobs=0, max_tokens=3,
                          extra_body={"skip_special_tokens": skip}).choices[0]
        assert echoed.text.startswith("日本")
        assert echoed.logprobs.text_offset[:9] == [0, 0, 0, 0, 0, 1, 1, 1, 2]


def test_structured_and_tools(client):
    schema = {"type": "object", "properties": {"name": {"enum": ["Lily", "Tom"]},
                                               "age": {"type": "integer", "minimum": 1,
                                                       "maximum": 9}},
              "required": ["name", "age"]}
    reply = client.chat.completions.create(
        model="stories", messages=[{"role": "user", "content": PROMPT}], max_tokens=60,
        extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}})
    value = json.loads(reply.choices[0].message.content)
    assert value["name"] in ("Lily", "Tom") and 1 <= value["age"] <= 9
    called = client.chat.completions.create(
        model="stories", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=40)
    call = called.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    required = client.chat.completions.create(
        model="stories", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER],
        tool_choice="required", parallel_tool_calls=False, max_tokens=200)
    assert required.choices[0].finish_reason == "tool_calls"
    (only,) = required.choices[0].message.tool_calls  # a real model would go on listing calls
    assert json.loads(only.function.arguments)["city"] in ("Paris", "Rome")


def test_vllm_400s(client):
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(model="stories", messages=[{"role": "user",
                                                                   "content": "x"}],
                                       top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="stream_options is only allowed"):
        complete(client, stream_options={"include_usage": True})
    with pytest.raises(openai.BadRequestError, match="needs scheduling_policy='priority'"):
        complete(client, extra_body={"priority": 1})
    with pytest.raises(openai.BadRequestError, match="invalid regex constraint"):
        complete(client, extra_body={"guided_regex": "("})


def post(client, path: str, body: dict):
    import httpx

    return httpx.post(str(client.base_url).replace("/v1/", path), json=body, timeout=60)


def chat_body(**extra) -> dict:
    return {"model": "stories", "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 2, "temperature": 0.0, "return_token_ids": True, **extra}


def test_chat_add_special_tokens_puts_the_tokenizers_own_around_the_template(client):
    """vLLM's field, off for chat (the template writes what it needs): on, <s> comes first."""
    rendered = token_ids(client, PROMPT + " ")  # TEMPLATE: each message's content and " "
    plain = post(client, "/v1/chat/completions", chat_body()).json()
    assert plain["prompt_token_ids"] == rendered
    special = post(client, "/v1/chat/completions", chat_body(add_special_tokens=True)).json()
    assert special["prompt_token_ids"] == [1] + rendered  # <s>
    assert special["usage"]["prompt_tokens"] == len(rendered) + 1


@pytest.mark.parametrize("path, field, value, why", [
    ("/v1/chat/completions", "structural_tag",
     json.dumps({"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}],
                 "triggers": ["<a>"]}), "structural tags"),
    ("/v1/completions", "prompt_embeds", "AAAA", "prompts given as embeddings"),
    ("/v1/completions", "guided_decoding_backend", "outlines",
     "a structured-output backend other than the server's, xgrammar"),
])
def test_vllm_fields_that_would_change_the_answer_are_400s_naming_them(client, path, field,
                                                                       value, why):
    body = chat_body() if "chat" in path else {"model": "stories", "prompt": PROMPT,
                                                "max_tokens": 2}
    answer = post(client, path, {**body, field: value})
    assert answer.status_code == 400
    assert answer.json() == {"error": {
        "message": f"{field} is not supported ({why}): refused rather than answered without it",
        "type": "BadRequestError", "param": field, "code": 400}}


def test_the_servers_own_structured_output_backend_may_be_named(client):
    answer = post(client, "/v1/completions", {
        "model": "stories", "prompt": PROMPT, "max_tokens": 3, "temperature": 0.0,
        "guided_decoding_backend": "xgrammar", "guided_regex": "[0-9]+"})
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"].isdigit()


def test_tokenize_takes_vllms_fields(client):
    """add_special_tokens (vLLM's defaults: on for a prompt, off for messages), a request's
    chat template under the rule chat completions follow (untrusted here: refused), its
    template kwargs, and return_token_strs."""
    messages = [{"role": "user", "content": PROMPT}]
    rendered = token_ids(client, PROMPT + " ")
    assert post(client, "/tokenize", {"messages": messages}).json()["tokens"] == rendered
    special = post(client, "/tokenize", {"messages": messages, "add_special_tokens": True})
    assert special.json()["tokens"] == [1] + rendered and special.json()["count"] == len(
        rendered) + 1
    assert post(client, "/tokenize", {"prompt": PROMPT}).json()["tokens"] == [1] + token_ids(
        client, PROMPT)
    named = post(client, "/tokenize", {"prompt": PROMPT, "return_token_strs": True}).json()
    assert named["token_strs"] == ["<s>", "▁Once", "▁upon", "▁a", "▁time"]
    assert post(client, "/tokenize", {"prompt": PROMPT}).json()["token_strs"] is None
    for body, message, param in (
            ({"messages": messages, "chat_template": "{{ 'X' }}"},
             "chat_template in a request is refused: start the server with "
             "--trust-request-chat-template to allow it", "chat_template"),
            ({"prompt": PROMPT, "chat_template_kwargs": {"x": 1}},
             "chat_template_kwargs goes with messages, not prompt", "chat_template_kwargs"),
            ({"prompt": PROMPT, "chat_template": "{{ 'X' }}"},
             "chat_template goes with messages, not prompt", "chat_template")):
        refused = post(client, "/tokenize", body)
        assert refused.status_code == 400
        assert refused.json() == {"error": {"message": message, "type": "BadRequestError",
                                            "param": param, "code": 400}}
    reserved = post(client, "/tokenize", {"messages": messages,
                                          "chat_template_kwargs": {"messages": []}})
    assert reserved.status_code == 400 and "chat_template_kwargs cannot set messages" in (
        reserved.json()["error"]["message"])


def test_detokenize_and_an_echoed_token_id_prompt_keep_special_tokens(client):
    """vLLM's text of token ids is tokenizer.decode(ids): <s> and </s> stay."""
    assert post(client, "/detokenize", {"tokens": [1, 403, 2]}).json() == {
        "prompt": "<s> Once</s>"}
    assert post(client, "/detokenize", {"tokens": [1, 403, 2],
                                        "skip_special_tokens": True}).json() == {"prompt": "Once"}
    answer = complete(client, prompt=[1, 403, 407], max_tokens=2).choices[0].text
    echoed = complete(client, prompt=[1, 403, 407], echo=True, logprobs=0,
                      max_tokens=2).choices[0]
    assert echoed.text == "<s> Once upon" + answer
    assert echoed.logprobs.text_offset[:3] == [0, 3, 8]  # where "<s>", " Once", " upon" start

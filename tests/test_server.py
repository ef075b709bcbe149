"""The HTTP server, driven by the official `openai` client and raw httpx on a loopback port."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import running_server
from fulcrum import LLM, SamplingParams
from fulcrum.async_engine import AsyncLLM

MODEL = "tiny-llama"
API_KEY = "sesame"
PROMPTS = ["The quick brown fox", "Once upon a time"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def served(llama_dir):
    with running_server(llama_dir, MODEL, num_gpu_blocks_override=1024) as pair:
        yield pair


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(llama_dir):
    return LLM(str(llama_dir))


def wait_idle(llm: AsyncLLM, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not llm.is_idle:
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.01)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


# ------------------------------------------------------------------ completions
def test_completions_match_offline_generate(client, offline):
    response = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=10,
                                         temperature=0.0, extra_body=NO_EOS)
    expected = offline.generate(PROMPTS, greedy(10), use_tqdm=False)
    assert response.id.startswith("cmpl-") and response.object == "text_completion"
    assert [c.index for c in response.choices] == [0, 1]
    assert [c.text for c in response.choices] == [e.outputs[0].text for e in expected]
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    assert response.usage.completion_tokens == 20
    assert response.usage.total_tokens == response.usage.prompt_tokens + 20


def test_streamed_completion_equals_plain_one(client):
    plain = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=8, n=2,
                                      temperature=0.0, extra_body=NO_EOS)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=8, n=2,
                                       temperature=0.0, stream=True, extra_body=NO_EOS,
                                       stream_options={"include_usage": True})
    texts, reasons, chunks = {}, {}, list(stream)
    for chunk in chunks[:-1]:
        assert chunk.usage is None and len(chunk.choices) == 1
        choice = chunk.choices[0]
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        reasons[choice.index] = choice.finish_reason
    assert texts == {c.index: c.text for c in plain.choices}
    assert reasons == {i: "length" for i in range(4)}
    # Token counts alike; cached_tokens differ when this test runs first (the plain call
    # fills the prefix cache the stream then reads).
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump(include=set(counts)) \
        == plain.usage.model_dump(include=set(counts))
    assert len(chunks) - 1 == 4 * 8, "one chunk per generated token"


def test_continuous_usage_stats_come_with_include_usage(client):
    def usages(**options):
        stream = client.completions.create(model=MODEL, prompt="abc", max_tokens=3,
                                           temperature=0.0, stream=True, extra_body=NO_EOS,
                                           stream_options=options)
        return [chunk.usage and chunk.usage.completion_tokens for chunk in stream]

    assert usages(include_usage=True, continuous_usage_stats=True) == [1, 2, 3, 3]
    assert usages(include_usage=True) == [None, None, None, 3]
    assert usages(include_usage=False, continuous_usage_stats=True) == [None, None, None]
    # vLLM's StreamOptions: include_usage is true unless the client says otherwise.
    assert usages(continuous_usage_stats=True) == [1, 2, 3, 3]
    assert usages() == [None, None, None, 3]
    # Null, which vLLM's Optional fields take, asks for none.
    assert usages(include_usage=None, continuous_usage_stats=None) == [None, None, None]


def test_continuous_usage_counts_each_choice_and_its_prompt(client, server):
    """As vLLM's: a chunk's usage is its own choice's tokens so far over its own prompt; the
    last chunk has the totals. A chat stream's first chunks (role, echo) count 0 tokens."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    stream = client.completions.create(model=MODEL, prompt=["abc", "a longer prompt"],
                                       max_tokens=3, n=2, temperature=0.0, stream=True,
                                       extra_body=NO_EOS, stream_options=options)
    chunks = list(stream)
    *deltas, last = chunks
    prompt_tokens = {}
    counts = {}
    for chunk in deltas:
        (choice,) = chunk.choices
        counts[choice.index] = counts.get(choice.index, 0) + 1
        usage = chunk.usage
        assert usage.completion_tokens == counts[choice.index]
        prompt_tokens.setdefault(choice.index // 2, usage.prompt_tokens)
        assert usage.prompt_tokens == prompt_tokens[choice.index // 2]
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert counts == {0: 3, 1: 3, 2: 3, 3: 3}
    assert prompt_tokens[0] < prompt_tokens[1]
    assert last.usage.completion_tokens == 12
    assert last.usage.prompt_tokens == prompt_tokens[0] + prompt_tokens[1]  # once a prompt

    body = {"messages": [{"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "Once up"}],
            "add_generation_prompt": False, "echo": True, "max_tokens": 2, "stream": True,
            "temperature": 0.0, "ignore_eos": True, "stream_options": options}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                      timeout=60) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    usages = [(e["choices"][0]["delta"].get("role") if e["choices"] else None,
               e["choices"][0]["delta"].get("content") if e["choices"] else None,
               e["usage"]["completion_tokens"]) for e in events]
    assert usages[:2] == [("assistant", "", 0), (None, "Once up", 0)]
    assert [count for *_, count in usages[2:]] == [1, 2, 2]
    assert "prompt_tokens_details" not in events[0]["usage"] or \
        events[0]["usage"]["prompt_tokens_details"] is None
    assert events[0]["usage"]["prompt_tokens"] == events[-1]["usage"]["prompt_tokens"] > 0


def test_chat_echo_starts_the_answer_with_the_message_it_continues(server):
    url = server.url + "/v1/chat/completions"
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once up"}]
    body = {"messages": history, "add_generation_prompt": False, "max_tokens": 4,
            "temperature": 0.0, "ignore_eos": True}

    def content(**fields):
        reply = httpx.post(url, json={**body, **fields}).json()
        return reply["choices"][0]["message"]["content"]

    plain = content()
    assert content(echo=True) == "Once up" + plain
    with httpx.stream("POST", url, json={**body, "echo": True, "stream": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == \
        "Once up" + plain
    # A new answer after the user's message continues nothing: nothing to echo.
    fresh = {"messages": history[:1], "add_generation_prompt": True}
    assert content(echo=True, **fresh) == content(**fresh)
    # continue_final_message leaves the message open: the prompt ends with its text.
    tokens = {flag: httpx.post(server.url + "/tokenize", json={
        "messages": history, "add_generation_prompt": False,
        "continue_final_message": flag}).json()["count"] for flag in (False, True)}
    assert tokens[False] - tokens[True] == 2  # "<|im_end|>" (a special token) and "\n"
    opened = httpx.post(url, json={**body, "continue_final_message": True, "echo": True})
    assert opened.json()["choices"][0]["message"]["content"].startswith("Once up")
    both = httpx.post(url, json={**body, "continue_final_message": True,
                                 "add_generation_prompt": True})
    assert both.status_code == 400 and "cannot both be true" in both.text


def test_logprobs_name_tokens_by_id_where_asked(server, llama_dir):
    from fulcrum.tokenizer import Tokenizer

    tokenizer = Tokenizer(str(llama_dir))
    body = {"prompt": "the cat", "max_tokens": 5, "temperature": 0.0, "ignore_eos": True,
            "logprobs": 2}
    plain = httpx.post(server.url + "/v1/completions", json=body).json()["choices"][0]
    by_id = httpx.post(server.url + "/v1/completions",
                       json={**body, "return_tokens_as_token_ids": True}).json()["choices"][0]
    ids = [int(t.removeprefix("token_id:")) for t in by_id["logprobs"]["tokens"]]
    assert all(t.startswith("token_id:") for t in by_id["logprobs"]["tokens"])
    assert tokenizer.decode(ids, skip_special_tokens=True) == by_id["text"] == plain["text"]
    assert by_id["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    assert by_id["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"]
    for top in by_id["logprobs"]["top_logprobs"]:
        assert len(top) >= 2 and all(k.startswith("token_id:") for k in top)
    chat = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True,
        "top_logprobs": 2, "return_tokens_as_token_ids": True}).json()["choices"][0]
    for entry in chat["logprobs"]["content"]:
        assert entry["token"].startswith("token_id:")
        assert entry["bytes"] == list(entry["token"].encode())
        assert [t["token"][:9] for t in entry["top_logprobs"]] == ["token_id:"] * 2


def test_return_token_ids_gives_the_prompts_and_the_answers_ids(server, llama_dir):
    from fulcrum.tokenizer import Tokenizer

    tokenizer = Tokenizer(str(llama_dir))
    body = {"prompt": ["the cat", "a dog"], "max_tokens": 4, "temperature": 0.0,
            "ignore_eos": True, "n": 2, "return_token_ids": True}
    whole = httpx.post(server.url + "/v1/completions", json={
        **body, "logprobs": 0, "return_tokens_as_token_ids": True}).json()["choices"]
    for c in whole:
        prompt = body["prompt"][c["index"] // 2]
        assert c["prompt_token_ids"] == tokenizer.encode(prompt)
        assert [f"token_id:{t}" for t in c["token_ids"]] == c["logprobs"]["tokens"]
        assert len(c["token_ids"]) == 4
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={**body, "stream": True}) as response:
        chunks = [json.loads(line[6:])["choices"][0] for line in response.iter_lines()
                  if line.startswith("data: {")]
    for c in whole:
        mine = [k for k in chunks if k["index"] == c["index"]]
        assert mine[0]["prompt_token_ids"] == c["prompt_token_ids"]
        assert all(k["prompt_token_ids"] is None for k in mine[1:])
        assert sum((k["token_ids"] for k in mine), []) == c["token_ids"]
    plain = httpx.post(server.url + "/v1/completions",
                       json={**body, "return_token_ids": False}).json()["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    reply = httpx.post(server.url + "/v1/chat/completions", json=chat).json()
    assert reply["prompt_token_ids"] == httpx.post(server.url + "/tokenize", json={
        "messages": chat["messages"]}).json()["tokens"]
    assert len(reply["choices"][0]["token_ids"]) == 3
    with httpx.stream("POST", server.url + "/v1/chat/completions",
                      json={**chat, "stream": True}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    assert events[0]["prompt_token_ids"] == reply["prompt_token_ids"]
    assert sum((e["choices"][0]["token_ids"] or [] for e in events[1:]), []) == \
        reply["choices"][0]["token_ids"]


def test_stream_ends_with_done(server):
    body = {"prompt": "abc", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "text_completion"


def test_n_with_seed_is_reproducible(client):
    def sample():
        return client.completions.create(model=MODEL, prompt="Roll the dice", n=3, seed=7,
                                         max_tokens=6, temperature=1.0, extra_body=NO_EOS)

    first, second = sample(), sample()
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage.completion_tokens == 18


def test_stop_string_ends_the_text(client):
    full = client.completions.create(model=MODEL, prompt="Stop here", max_tokens=32,
                                     temperature=0.0, extra_body=NO_EOS).choices[0].text
    position = next(i for i, ch in enumerate(full) if i >= 1 and ch.isprintable()
                    and ch != "\ufffd")
    stop = full[position]
    choice = client.completions.create(model=MODEL, prompt="Stop here", max_tokens=32,
                                       temperature=0.0, stop=[stop],
                                       extra_body=NO_EOS).choices[0]
    assert choice.text == full[:full.index(stop)]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop


def test_token_id_prompts_with_echo(client, offline):
    ids = [[72, 101, 108], [108, 111]]
    response = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, echo=True,
                                         temperature=0.0, extra_body=NO_EOS)
    expected = offline.generate(ids, greedy(4), use_tqdm=False)
    tokenizer = offline.get_tokenizer()
    assert [c.text for c in response.choices] == [
        tokenizer.decode(p) + e.outputs[0].text for p, e in zip(ids, expected)]
    assert response.usage.prompt_tokens == 5


def test_completion_logprobs(client):
    choice = client.completions.create(model=MODEL, prompt="Logprobs", max_tokens=5,
                                       logprobs=2, temperature=0.0,
                                       extra_body=NO_EOS).choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert len(logprobs.text_offset) == len(logprobs.top_logprobs) == 5
    assert all(p <= 0 for p in logprobs.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)
    assert [max(top.values()) for top in logprobs.top_logprobs] == logprobs.token_logprobs
    assert logprobs.text_offset[0] == 0


# ------------------------------------------------------------------------ chat
def test_chat_matches_offline_chat(client, offline):
    response = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8,
                                              temperature=0.0, extra_body=NO_EOS)
    expected = offline.chat(CHAT, greedy(8), use_tqdm=False)[0]
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"
    message = response.choices[0].message
    assert (message.role, message.content) == ("assistant", expected.outputs[0].text)
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == 8


def test_chat_streaming(client):
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, n=2,
                                           temperature=0.0, extra_body=NO_EOS)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, n=2, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body=NO_EOS))
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]
    texts: dict = {}
    for chunk in chunks[2:-1]:
        choice = chunk.choices[0]
        texts[choice.index] = texts.get(choice.index, "") + choice.delta.content
    assert texts == {c.index: c.message.content for c in plain.choices}
    assert chunks[-1].usage.completion_tokens == 12


def test_chat_logprobs(client):
    response = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                              logprobs=True, top_logprobs=3, temperature=0.0)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)


# ------------------------------------------------------------- other routes
def test_models_health_version(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == 512
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def test_models_retrieve_finds_each_served_name_and_404s_others(async_llm):
    """OpenAI's client.models.retrieve (GET /v1/models/{model}, as vLLM serves it): a name
    with slashes (an org/name, a folder's path) arrives escaped by the SDK."""
    from fulcrum.server import BackgroundServer, build_app

    with BackgroundServer(build_app(async_llm, ["org/tiny", MODEL], web_ui=False)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        for name in ("org/tiny", MODEL):
            card = client.models.retrieve(name)
            assert (card.id, card.object, card.model_extra["max_model_len"]) == (name, "model",
                                                                                512)
        with pytest.raises(openai.NotFoundError) as missing:
            client.models.retrieve("gpt-9")
        assert missing.value.body == {"message": "The model `gpt-9` does not exist.",
                                      "type": "NotFoundError", "param": "model", "code": 404}


def test_an_assistants_refusal_part_is_its_text(server, client):
    """OpenAI's chat history may hold an assistant's refusal as a content part; vLLM reads it
    as text (it was a 400: "content parts of type 'refusal' are not supported")."""
    def conversation(reply):
        return CHAT + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Ok."}]

    refusal = conversation([{"type": "refusal", "refusal": "I cannot."}])
    tokens = [httpx.post(server.url + "/tokenize", json={"messages": messages}).json()
              for messages in (refusal, conversation("I cannot."))]
    assert tokens[0] == tokens[1]
    reply = client.chat.completions.create(model=MODEL, messages=refusal, max_tokens=1)
    assert reply.usage.prompt_tokens == tokens[0]["count"]


def test_ping_answers_as_health_does(server, async_llm):
    """vLLM's /ping (SageMaker's health check), by GET or POST: 200 while the server takes
    requests, 503 while it drains."""
    from fastapi.testclient import TestClient

    from fulcrum.server import build_app

    assert [httpx.request(method, server.url + "/ping").status_code
            for method in ("GET", "POST")] == [200, 200]
    app = build_app(async_llm, MODEL, api_key="sesame", web_ui=False)
    app.state.draining = True
    assert TestClient(app).get("/ping").status_code == 503


def test_tokenize_round_trip(server, offline):
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": "hello world"}).json()
    assert tokens["tokens"] == offline.get_tokenizer().encode("hello world")
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
    text = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "hello world"}
    chat = httpx.post(server.url + "/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > tokens["count"]


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize("path, body, status, words", [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n must be"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 99}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "empty"),
    ("/v1/completions", {"prompt": [[1, 2], [99999]]}, 400, "99999"),
    ("/v1/completions", {"prompt": "x" * 600}, 400, "600 tokens long, more than the maximum "
                                                    "model length of 512"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1, "prompt_logprobs": 2}, 400,
     "prompt_logprobs must equal logprobs"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"x1": 5}}, 400, "logit_bias keys"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 5}}, 400, "99999 is out of"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "gpt-9"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 600}]}, 400,
     "maximum model length of 512"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": True, "prompt_logprobs": 0}, 400,
     "prompt_logprobs are not available when stream is true"),
    ("/v1/chat/completions", {"messages": CHAT, "model": "gpt-9"}, 404, "gpt-9"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template": "{{ raise_exception('no') }}"},
     400, "--trust-request-chat-template"),
    ("/tokenize", {}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "out of vocabulary"),
    ("/v1/nowhere", {}, 404, "Not Found"),
])
def test_errors_use_openai_format(server, path, body, status, words):
    response = httpx.post(server.url + path, json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == status and error["type"] and words in error["message"]


def test_malformed_json_is_a_bad_request(server):
    response = httpx.post(server.url + "/v1/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == 400


@pytest.mark.parametrize("field", ["n", "stream", "logprobs", "presence_penalty",
                                   "frequency_penalty", "echo"])
def test_openai_nullable_fields_take_null_for_their_default(client, field):
    """OpenAI documents these as "or null" (the SDK sends a None given for one as null), as
    vLLM takes them: each was a 400 ("n: Input should be a valid integer")."""
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                          temperature=0.0, **({} if field == "echo" else
                                                              {field: None}))
    assert len(chat.choices) == 1 and chat.choices[0].logprobs is None
    text = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0.0,
                                     **({} if field == "logprobs" else {field: None}))
    assert len(text.choices) == 1 and not text.choices[0].text.startswith("hi")


def test_openai_client_raises_on_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="missing", prompt="x")
    with pytest.raises(openai.BadRequestError, match="maximum model length"):
        client.completions.create(model=MODEL, prompt="x" * 600)


def test_api_key(llama_dir):
    with running_server(llama_dir, MODEL, {"api_key": API_KEY},
                        num_gpu_blocks_override=64) as (server, _):
        url = server.url + "/v1/models"
        assert httpx.get(url).status_code == 401
        wrong = httpx.get(url, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == 401
        assert httpx.get(url, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
        assert httpx.get(server.url + "/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="nope",
                          max_retries=0).completions.create(model=MODEL, prompt="x")
        good = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
        assert good.completions.create(model=MODEL, prompt="x", max_tokens=2).choices


# -------------------------------------------------------- load and disconnects
async def _stream_client(url: str, index: int, disconnect: bool) -> dict:
    """Stream one completion; a disconnecting client hangs up after three chunks."""
    body = {"prompt": f"client {index} asks a question", "stream": True, "temperature": 0.8,
            "max_tokens": 400 if disconnect else 24, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    chunks, usage = 0, None
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", url + "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                payload = json.loads(line[6:])
                if payload["choices"]:
                    chunks += 1
                usage = payload["usage"] or usage
                if disconnect and chunks == 3:
                    break
    return {"chunks": chunks, "usage": usage}


def scrape(server) -> dict:
    text = httpx.get(server.url + "/metrics").text
    return {(s.name, s.labels.get("finished_reason")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_concurrent_streams_with_disconnects(server, async_llm):
    wait_idle(async_llm)
    before = scrape(server)
    disconnecting = {i for i in range(32) if i % 5 == 0}

    async def run():
        return await asyncio.gather(*(_stream_client(server.url, i, i in disconnecting)
                                      for i in range(32)))

    results = asyncio.run(run())
    for index, result in enumerate(results):
        if index in disconnecting:
            assert result["chunks"] == 3
        else:
            assert result["chunks"] == 24 and result["usage"]["completion_tokens"] == 24
    wait_idle(async_llm)
    manager = async_llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_usable_blocks
    after = scrape(server)
    aborted = ("fulcrum:request_success_total", "abort")
    assert after[aborted] - before[aborted] == len(disconnecting)
    generated = (after[("fulcrum:generation_tokens_total", None)]
                 - before[("fulcrum:generation_tokens_total", None)])
    assert generated < 32 * 24 + len(disconnecting) * 100, "aborted requests kept decoding"


def test_plain_request_is_aborted_when_the_client_leaves(server, async_llm):
    wait_idle(async_llm)
    aborted = ("fulcrum:request_success_total", "abort")
    before = scrape(server)[aborted]
    body = {"prompt": "a long answer", "max_tokens": 480, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.2)
    deadline = time.monotonic() + 10
    while scrape(server)[aborted] == before:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.05)
    wait_idle(async_llm)
    manager = async_llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_usable_blocks


def test_metrics_count_the_requests(server, client, async_llm):
    wait_idle(async_llm)
    before = scrape(server)
    response = client.completions.create(model=MODEL, prompt=PROMPTS + ["third"], max_tokens=5,
                                         temperature=0.0, extra_body=NO_EOS)
    after = scrape(server)

    def delta(name: str, reason=None) -> float:
        return after[(name, reason)] - before.get((name, reason), 0.0)

    assert delta("fulcrum:request_success_total", "length") == 3
    assert delta("fulcrum:request_success_total", "stop") == 0
    assert delta("fulcrum:prompt_tokens_total") == response.usage.prompt_tokens
    assert delta("fulcrum:generation_tokens_total") == 15
    for histogram in ("time_to_first_token", "e2e_request_latency", "request_queue_time",
                      "request_time_per_output_token", "request_prefill_time",
                      "request_decode_time", "request_inference_time"):
        assert delta(f"fulcrum:{histogram}_seconds_count") == 3
    for histogram in ("request_prompt_tokens", "request_generation_tokens"):
        assert delta(f"fulcrum:{histogram}_count") == 3
    assert delta("fulcrum:request_generation_tokens_sum") == 15
    assert delta("fulcrum:request_params_max_tokens_sum") == 15
    assert delta("fulcrum:request_params_n_count") == 3
    assert delta("fulcrum:inter_token_latency_seconds_count") == 3 * 4
    assert delta("fulcrum:time_per_output_token_seconds_count") == 3 * 4  # vLLM's meaning
    for gauge in ("num_requests_running", "num_requests_waiting", "num_requests_preempted",
                  "kv_cache_usage_perc"):
        assert after[(f"fulcrum:{gauge}", None)] == 0
    assert 0 <= after[("fulcrum:prefix_cache_hit_rate", None)] <= 1
    assert after[("fulcrum:engine_loop_busy_seconds_total", None)] > 0


# ------------------------------------------------------------------- cache salts
def test_cache_salt_partitions_the_prefix_cache(client):
    prompt = "The same long prompt, shared by tenants. " * 4

    def cached(salt=None):
        extra = {"cache_salt": salt} if salt else {}
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                             extra_body=extra)
        return response.usage.prompt_tokens_details.cached_tokens

    first = cached("tenant-a")
    assert first == 0
    assert cached("tenant-b") == 0  # same prompt, other tenant: nothing shared
    hit = cached("tenant-a")
    assert hit > 0 and hit % 16 == 0  # whole blocks of the same tenant
    assert cached() == 0 and cached() == hit  # no salt is a tenant of its own
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1,
                                          extra_body={"cache_salt": "tenant-c"})
    again = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1,
                                           extra_body={"cache_salt": "tenant-c"})
    assert chat.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_a_trusted_request_chat_template_renders_and_its_errors_are_400(llama_dir):
    with running_server(llama_dir, MODEL, {"trust_request_chat_template": True}) as (server, _):
        url = server.url + "/v1/chat/completions"
        template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        ok = httpx.post(url, json={"messages": CHAT, "chat_template": template,
                                   "max_tokens": 1})
        assert ok.status_code == 200
        assert ok.json()["usage"]["prompt_tokens"] == len("Be brief.Hi there!")
        # A template that loops over content parts gets them (vLLM's auto content format).
        parts = httpx.post(url, json={"messages": CHAT, "max_tokens": 1, "chat_template":
                                      "{% for m in messages %}{% for p in m['content'] %}"
                                      "{{ p['text'] }}{% endfor %}{% endfor %}"})
        assert parts.json()["usage"]["prompt_tokens"] == len("Be brief.Hi there!")
        bad = httpx.post(url, json={"messages": CHAT, "max_tokens": 1,
                                    "chat_template": "{{ raise_exception('no way') }}"})
        assert bad.status_code == 400 and "no way" in bad.json()["error"]["message"]
        sandboxed = httpx.post(url, json={"messages": CHAT, "max_tokens": 1, "chat_template":
                                          "{{ ''.__class__.__mro__[1].__subclasses__() }}"})
        assert sandboxed.status_code == 400
        assert "unsafe" in sandboxed.json()["error"]["message"]
        recursive = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"
        # Python's errors, not jinja's; values too large to build (minutes and gigabytes
        # before, on the event loop)
        nested = "{% for a in [1] %}" * 30 + "{% endfor %}" * 30  # a 500 before
        for template in ("{{ 1 / 0 }}", "{{ messages[99] }}", recursive, "{{ [0] * 10**9 }}",
                         "{{ 'ab' * 600000 }}", "{{ 7 ** 1000000 }}", "{{ 'a'.ljust(10**9) }}",
                         nested):
            broken = httpx.post(url, json={"messages": CHAT, "max_tokens": 1,
                                           "chat_template": template})
            assert broken.status_code == 400, broken.text
        # /tokenize renders a request's template and its kwargs as chat completions do.
        tokenized = httpx.post(server.url + "/tokenize", json={
            "messages": CHAT, "chat_template":
                "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
            "chat_template_kwargs": {"greeting": "Hey! "}}).json()
        assert tokenized["count"] == len("Hey! Be brief.Hi there!")
        fine = httpx.post(url, json={"messages": CHAT, "max_tokens": 1, "chat_template":
                                     "{{ '-' * 3 }}{{ [1] * 2 }}{{ 2 ** 10 }}"})
        assert fine.status_code == 200 and fine.json()["usage"]["prompt_tokens"] == len(
            "---[1, 1]1024")
        # A slow template renders on a thread of its own: the server answers meanwhile.
        slow = ("{% set row = [0] * 200 %}{% for i in range(100000) %}{% for j in row %}"
                "{% endfor %}{% endfor %}ok")  # loops over lists are not bounded
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, url, timeout=120, json={
                "messages": CHAT, "max_tokens": 1, "chat_template": slow})
            waits = []
            while not pending.done():
                start = time.monotonic()
                assert httpx.get(server.url + "/health", timeout=60).status_code == 200
                waits.append(time.monotonic() - start)
                time.sleep(0.05)
            answer = pending.result()
        assert answer.status_code == 200 and answer.json()["usage"]["prompt_tokens"] == 2
        assert len(waits) >= 5 and max(waits) < 0.5, waits


def test_stream_events_stay_one_line_whatever_the_text():
    """U+2028, U+2029 and U+0085 are legal raw in JSON strings, but str.splitlines() (used by
    SSE clients such as httpx's and the openai SDK's) breaks lines at them."""
    from fulcrum.server.protocol import CompletionChoice
    from fulcrum.server.serving import _sse

    text = "a\u2028b\x85c\u2029d\ne"
    event = _sse(CompletionChoice(index=0, text=text))
    assert event.endswith("\n\n") and len(event.splitlines()) == 2  # the data line, the blank
    assert json.loads(event.splitlines()[0][len("data: "):])["text"] == text


def test_a_stream_that_fails_unexpectedly_ends_with_an_error_event_and_done():
    """Anything the request's handling raises after the first event (not only the engine's
    own failures) closes the stream as OpenAI's do, instead of cutting the connection."""
    from fulcrum.server.protocol import CompletionChoice
    from fulcrum.server.serving import _events

    async def outputs():
        raise TypeError("TextInputSequence must be str")
        yield  # an async generator

    async def run():
        preamble = [CompletionChoice(index=0, text="")]
        return [event async for event in _events(None, outputs(), None, preamble, None)]

    events = asyncio.run(run())
    assert len(events) == 3 and events[-1] == "data: [DONE]\n\n"
    error = json.loads(events[1][len("data: "):])["error"]
    assert error["code"] == 500 and "TextInputSequence must be str" in error["message"]


def test_masked_tokens_logprobs_are_numbers_in_json():
    """A token a constraint masks has logprob -inf, which JSON lacks (it came out null where
    OpenAI's schema wants a number): the server sends -9999, as vLLM's does."""
    from fulcrum.outputs import Logprob
    from fulcrum.server.logprob_format import prompt_logprobs, top_logprob

    masked = Logprob(float("-inf"), 7, "x")
    assert json.loads(top_logprob(5, masked, False).model_dump_json())["logprob"] == -9999.0
    (entry,) = prompt_logprobs([{5: masked}])
    assert entry[5].logprob == -9999.0
    assert top_logprob(6, Logprob(-1.5, 1, "y"), False).logprob == -1.5

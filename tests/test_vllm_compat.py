"""What a vLLM user carries over: the model's generation_config.json defaults, vLLM's launch
arguments with the one value fulcrum supports, and 400s (never a silently different answer)
for request fields fulcrum cannot honour yet."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
import time

import httpx
import pytest

from conftest import running_server
from fulcrum import LLM, SamplingParams
from fulcrum.sampling_params import RequestOutputKind
from fulcrum.cli import build_parser
from fulcrum.generation_config import load_generation_defaults

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def tuned_dir(llama_dir, tmp_path_factory):
    """The tiny Llama with sampling defaults in its generation_config.json: greedy, 7 tokens."""
    folder = tmp_path_factory.mktemp("tuned") / "llama"
    shutil.copytree(llama_dir, folder)
    config = json.loads((folder / "generation_config.json").read_text()) \
        if (folder / "generation_config.json").exists() else {}
    config.update(temperature=0.0, top_k=5, repetition_penalty=1.0, max_new_tokens=7,
                  do_sample=False)
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def test_generation_config_sources(tuned_dir, tmp_path):
    expected = {"temperature": 0.0, "top_k": 5, "repetition_penalty": 1.0, "max_tokens": 7}
    assert load_generation_defaults("auto", str(tuned_dir)) == expected
    assert load_generation_defaults("vllm", str(tuned_dir)) == {}
    assert load_generation_defaults(str(tuned_dir), None) == expected  # a folder given
    assert load_generation_defaults("auto", str(tmp_path)) == {}  # the model has none
    with pytest.raises(FileNotFoundError, match="no generation_config.json"):
        load_generation_defaults(str(tmp_path), str(tuned_dir))
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_generation_defaults(str(tmp_path), None)


def test_eos_ids_come_from_the_models_generation_config(llama_dir, tmp_path):
    """vLLM stops on the eos ids of the model's generation config (or of the folder
    --generation-config names), wherever the tokenizer lives; fulcrum read the tokenizer
    folder's, so a separate tokenizer folder lost the model's list."""
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [258, 257]}))
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model / name, tokenizer)
    assert LLM(str(model), tokenizer=str(tokenizer)).get_tokenizer().eos_token_ids == {257, 258}
    given = tmp_path / "given"
    given.mkdir()
    (given / "generation_config.json").write_text(json.dumps({"eos_token_id": [258, 300]}))
    llm = LLM(str(model), tokenizer=str(tokenizer), generation_config=str(given))
    assert llm.get_tokenizer().eos_token_ids == {258, 300}
    # "vllm" drops the model's sampling defaults, not the eos ids it lists.
    assert LLM(str(model), generation_config="vllm").get_tokenizer().eos_token_ids == {257, 258}


def test_offline_defaults_come_from_the_model(tuned_dir):
    llm = LLM(str(tuned_dir))
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 5, 7)
    out = llm.generate([{"prompt_token_ids": PROMPT}], use_tqdm=False)[0].outputs[0]
    greedy = llm.generate([{"prompt_token_ids": PROMPT}],
                          SamplingParams(temperature=0.0, max_tokens=7), use_tqdm=False)
    assert len(out.token_ids) == 7 and out.token_ids == greedy[0].outputs[0].token_ids
    # Explicit SamplingParams win whole, as in vLLM; "vllm" ignores the file.
    explicit = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=3),
                            use_tqdm=False)[0].outputs[0]
    assert len(explicit.token_ids) == 3
    plain = LLM(str(tuned_dir), generation_config="vllm").get_default_sampling_params()
    assert (plain.temperature, plain.max_tokens) == (1.0, 16)


def test_vllm_launch_arguments_with_the_supported_value(llama_dir):
    llm = LLM(str(llama_dir), tensor_parallel_size=1, pipeline_parallel_size=1,
              enforce_eager=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=2),
                       use_tqdm=False, lora_request=None)
    assert len(out[0].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="pipeline_parallel_size=4 is not supported"):
        LLM(str(llama_dir), pipeline_parallel_size=4)
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        LLM(str(llama_dir), tensor_parallel_size=2, distributed_executor_backend="threads")
    with pytest.raises(ValueError, match="'uni' runs one rank"):
        LLM(str(llama_dir), tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide"):
        LLM(str(llama_dir), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="lora_request is not supported"):
        llm.generate([{"prompt_token_ids": PROMPT}], lora_request=object())
    with pytest.raises(ValueError, match="priority=1 needs scheduling_policy='priority'"):
        llm.generate([{"prompt_token_ids": PROMPT}], priority=[1])
    assert not llm.llm_engine.has_unfinished_requests()
    assert build_parser().parse_args(["serve", "-tp", "2"]).tensor_parallel_size == 2
    args = build_parser().parse_args(["serve", "--disable-log-requests",
                                      "--tensor-parallel-size", "1", "--enforce-eager"])
    assert (args.enable_log_requests, args.tensor_parallel_size, args.enforce_eager) == \
        (False, 1, True)
    assert build_parser().parse_args(["serve", "--enable-log-requests"]).enable_log_requests


def test_vllm_short_flags():
    """vLLM's short forms of its engine flags: -tp, -pp and -q (`vllm serve MODEL -q ...`)."""
    args = build_parser().parse_args(["serve", "-tp", "2", "-pp", "1", "-q", "int8"])
    assert (args.tensor_parallel_size, args.pipeline_parallel_size, args.quantization) == \
        (2, 1, "int8")


def test_chat_template_kwargs_reach_the_template(llama_dir):
    llm = LLM(str(llama_dir))
    template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    out = llm.chat([{"role": "user", "content": "there"}], SamplingParams(max_tokens=1),
                   use_tqdm=False, chat_template=template,
                   chat_template_kwargs={"greeting": "Hello "})
    assert out[0].prompt == "Hello there"


@pytest.fixture(scope="module")
def tuned_server(tuned_dir):
    with running_server(tuned_dir, app_kwargs={"log_requests": True}) as (server, _):
        yield server


def test_server_applies_the_model_defaults_to_unset_fields(tuned_server):
    url = tuned_server.url + "/v1/completions"
    unset = httpx.post(url, json={"prompt": PROMPT}).json()
    greedy = httpx.post(url, json={"prompt": PROMPT, "temperature": 0, "max_tokens": 7}).json()
    assert unset["usage"]["completion_tokens"] == 7
    assert unset["choices"][0]["text"] == greedy["choices"][0]["text"]
    assert httpx.post(url, json={"prompt": PROMPT, "max_tokens": 2}).json()[
        "usage"]["completion_tokens"] == 2
    chat = httpx.post(tuned_server.url + "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["usage"]["completion_tokens"] == 7


@pytest.mark.parametrize("route,extra,param", [
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_fields_that_would_change_the_answer_are_refused_by_name(tuned_server, route, extra,
                                                                   param):
    body = ({"messages": [{"role": "user", "content": "hi"}]} if route == "chat"
            else {"prompt": PROMPT})
    reply = httpx.post(f"{tuned_server.url}/v1/{route}" + ("/completions" if route == "chat"
                                                          else ""), json={**body, **extra})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and param in error["message"]
    assert error["type"] == "BadRequestError"


def test_harmless_fields_pass_and_unknown_ones_are_logged(tuned_server, caplog):
    url = tuned_server.url + "/v1/completions"
    with caplog.at_level(logging.INFO, logger="fulcrum.server.serving"):
        reply = httpx.post(url, json={"prompt": PROMPT, "max_tokens": 1, "frobnicate": 1,
                                      "response_format": {"type": "text"},
                                      "tool_choice": "none"})
    assert reply.status_code == 200
    assert "ignored unknown request fields: frobnicate" in caplog.text
    assert "(5 tokens)" in caplog.text  # --enable-log-requests: one line per request
    priority = httpx.post(url, json={"prompt": PROMPT, "max_tokens": 1, "priority": 3})
    assert priority.status_code == 400
    assert "needs scheduling_policy='priority'" in priority.json()["error"]["message"]
    assert priority.json()["error"]["param"] == "priority"  # named, as the other refusals


def test_chat_template_flag_takes_a_file_or_the_template(tmp_path):
    from fulcrum.chat_template import load_chat_template

    template = "SYS{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    assert load_chat_template(str(tmp_path / "t.jinja")) == template
    assert load_chat_template(template) == template
    with pytest.raises(ValueError, match="does not compile"):
        load_chat_template("{% for m in messages %}")
    args = build_parser().parse_args(["serve", "--chat-template", str(tmp_path / "t.jinja")])
    assert args.chat_template == str(tmp_path / "t.jinja")


def test_server_template_renders_text_parts_one_a_line(llama_dir):
    template = "SYS{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    with running_server(llama_dir, app_kwargs={"chat_template": template}) as (server, _):
        parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
        tokens = httpx.post(server.url + "/tokenize", json={
            "messages": [{"role": "user", "content": parts}]}).json()["tokens"]
        text = httpx.post(server.url + "/detokenize", json={"tokens": tokens}).json()["prompt"]
        assert text == "SYS[a\nb]"
        image = [{"type": "image_url", "image_url": {"url": "data:,"}}]
        refused = httpx.post(server.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": image}], "max_tokens": 1})
        assert refused.status_code == 400 and "text-only" in refused.text


# ------------------------------------------------- vLLM's arguments and options
def test_no_op_arguments_and_refusals(llama_dir):
    with pytest.raises(ValueError, match="runs no code from model folders"):
        LLM(str(llama_dir), trust_remote_code=True)
    with pytest.raises(ValueError, match="only 'auto'"):
        LLM(str(llama_dir), tokenizer_mode="slow")
    args = build_parser().parse_args(["serve", "--no-trust-remote-code", "--tokenizer-mode",
                                      "auto", "--disable-log-stats", "--max-log-len", "20",
                                      "--served-model-name", "a", "b",
                                      "--allowed-origins", '["http://x.example"]',
                                      "--allow-credentials"])
    assert args.disable_log_stats and args.max_log_len == 20
    assert args.served_model_name == ["a", "b"]
    from fulcrum.server.cli import cors_options
    assert cors_options(args) == {"allow_origins": ["http://x.example"], "allow_methods": ["*"],
                                  "allow_headers": ["*"], "allow_credentials": True}
    assert cors_options(build_parser().parse_args(["serve"])) is None


def test_llm_get_metrics(llama_dir):
    quiet = LLM(str(llama_dir))
    with pytest.raises(ValueError, match="disable_log_stats=False"):
        quiet.get_metrics()
    llm = LLM(str(llama_dir), disable_log_stats=False)
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    llm.generate([PROMPT, PROMPT[:3]], params, use_tqdm=False)
    (two,) = llm.generate([PROMPT], SamplingParams(max_tokens=3, ignore_eos=True, n=2,
                                                   output_kind=RequestOutputKind.DELTA),
                          use_tqdm=False)
    # generate returns whole outputs whatever the kind (vLLM's LLM asks for FINAL_ONLY).
    assert [len(c.token_ids) for c in two.outputs] == [3, 3]
    metrics = {(m.name, m.labels.get("finished_reason")): m for m in llm.get_metrics()}
    # As vLLM counts: each of the n = 2 completions is a request, its prompt included.
    assert metrics[("fulcrum:prompt_tokens", None)].value == 5 + 3 + 2 * 5
    assert metrics[("fulcrum:generation_tokens", None)].value == 4 + 4 + 2 * 3
    assert metrics[("fulcrum:request_success", "length")].value == 4
    prompt_sizes = metrics[("fulcrum:request_prompt_tokens", None)]
    assert prompt_sizes.kind == "histogram" and prompt_sizes.count == 4
    assert prompt_sizes.sum == 18 and prompt_sizes.buckets["5.0"] == 4
    generated = metrics[("fulcrum:request_generation_tokens", None)]
    assert (generated.count, generated.sum) == (4, 4 + 4 + 2 * 3)
    assert metrics[("fulcrum:time_to_first_token_seconds", None)].count == 4
    # A gap between each completion's consecutive tokens: 3 + 3 + 2 * 2.
    assert metrics[("fulcrum:inter_token_latency_seconds", None)].count == 10
    assert metrics[("fulcrum:request_time_per_output_token_seconds", None)].count == 4
    assert metrics[("fulcrum:request_params_n", None)].sum == 1 + 1 + 2
    assert metrics[("fulcrum:num_requests_running", None)].value == 0
    # Whatever kind the params ask for, the metrics see every token's step.
    llm.generate([PROMPT], SamplingParams(max_tokens=5, ignore_eos=True,
                                          output_kind=RequestOutputKind.FINAL_ONLY),
                 use_tqdm=False)
    gaps = {m.name: m for m in llm.get_metrics()}["fulcrum:inter_token_latency_seconds"]
    assert gaps.count == 10 + 4


def test_llm_metrics_count_completions_finished_apart_once(llama_dir):
    """One at a time (max_num_seqs=1), an n = 2 request's completions finish steps apart;
    the first comes again in every later output of its request and counts once."""
    llm = LLM(str(llama_dir), disable_log_stats=False, max_num_seqs=1)
    llm.generate([PROMPT], SamplingParams(max_tokens=3, ignore_eos=True, n=2),
                 use_tqdm=False)
    metrics = {(m.name, m.labels.get("finished_reason")): m for m in llm.get_metrics()}
    assert metrics[("fulcrum:request_success", "length")].value == 2
    assert metrics[("fulcrum:prompt_tokens", None)].value == 2 * 5
    assert metrics[("fulcrum:generation_tokens", None)].value == 2 * 3
    for name in ("time_to_first_token_seconds", "request_queue_time_seconds",
                 "e2e_request_latency_seconds"):
        assert metrics[(f"fulcrum:{name}", None)].count == 2, name
    assert metrics[("fulcrum:inter_token_latency_seconds", None)].count == 2 * 2


def test_llm_generate_returns_whole_outputs_whatever_the_output_kind(llama_dir):
    llm = LLM(str(llama_dir))
    outputs = [llm.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True,
                                                     temperature=0.0, output_kind=kind),
                            use_tqdm=False)[0].outputs[0] for kind in RequestOutputKind]
    assert [len(o.token_ids) for o in outputs] == [6, 6, 6]
    assert len({(o.text, tuple(o.token_ids)) for o in outputs}) == 1


@pytest.fixture(scope="module")
def options_server(llama_dir):
    cors = {"allow_origins": ["http://ui.example"], "allow_methods": ["*"],
            "allow_headers": ["*"], "allow_credentials": False}
    with running_server(llama_dir, ["main", "alias"], app_kwargs={
            "cors": cors, "log_requests": True, "max_log_len": 3,
            "stats_interval": 0.05, "request_id_headers": True}) as (server, _):
        yield server


def test_aliases_cors_and_log_len(options_server, caplog):
    url = options_server.url
    assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["main", "alias"]
    with caplog.at_level(logging.INFO):
        reply = httpx.post(url + "/v1/completions", json={"model": "alias", "prompt": "hello",
                                                         "max_tokens": 30, "ignore_eos": True})
        # The stats line for the interval the request ran in comes at that interval's end
        # (0.05 s), which may be after the reply.
        deadline = time.monotonic() + 5.0
        while "Avg prompt throughput:" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
    assert reply.json()["model"] == "main"
    assert "prompt 'hel', prompt_token_ids [71, 68, 75] (5 tokens)" in caplog.text
    assert "Avg prompt throughput:" in caplog.text and "Running: " in caplog.text
    assert httpx.post(url + "/v1/completions", json={"model": "other", "prompt": "x"}
                      ).status_code == 404
    preflight = httpx.options(url + "/v1/completions", headers={
        "Origin": "http://ui.example", "Access-Control-Request-Method": "POST"})
    assert preflight.headers["access-control-allow-origin"] == "http://ui.example"
    elsewhere = httpx.get(url + "/v1/models", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in elsewhere.headers
    scrape = httpx.get(url + "/metrics").text
    assert 'fulcrum:cache_config_info{block_size="16"' in scrape


def test_request_ids_name_responses_and_may_repeat(tuned_server, caplog):
    url = tuned_server.url + "/v1"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    with caplog.at_level(logging.INFO, logger="fulcrum.server.serving"):
        mine = httpx.post(url + "/completions", json={"prompt": PROMPT, "request_id": "job-1"})
    assert mine.json()["id"] == "cmpl-job-1"
    assert re.search(r"request cmpl-job-1-[0-9a-f]{8}-0: prompt", caplog.text)
    fresh = httpx.post(url + "/completions", json={"prompt": PROMPT}).json()["id"]
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", fresh)
    header = httpx.post(url + "/chat/completions", headers={"X-Request-Id": "trace-7"},
                        json={**chat, "request_id": "body"})
    assert header.json()["id"] == "chatcmpl-trace-7"  # the header wins, as in vLLM
    with httpx.stream("POST", url + "/chat/completions", json={
            **chat, "stream": True, "request_id": "s"}) as stream:
        chunks = [json.loads(line[6:]) for line in stream.iter_lines()
                  if line.startswith("data: {")]
    assert len(chunks) >= 2 and {c["id"] for c in chunks} == {"chatcmpl-s"}
    assert "X-Request-Id" not in header.headers  # only with --enable-request-id-headers

    async def twice() -> list:  # one id in flight twice: a retry, say
        async with httpx.AsyncClient() as client:
            body = {"prompt": PROMPT, "max_tokens": 7, "request_id": "same"}
            return await asyncio.gather(*(client.post(url + "/completions", json=body)
                                          for _ in range(2)))
    replies = asyncio.run(twice())
    assert [r.status_code for r in replies] == [200, 200]
    assert [r.json()["id"] for r in replies] == ["cmpl-same"] * 2
    assert replies[0].json()["choices"] == replies[1].json()["choices"] == mine.json()["choices"]


@pytest.mark.parametrize("given", [{"json": {"request_id": "x" * 257}},
                                   {"json": {"request_id": "a\nb"}},
                                   {"json": {"request_id": "caf\u00e9"}},
                                   {"headers": {"X-Request-Id": "y" * 300}}])
def test_request_ids_must_be_short_printable_ascii(tuned_server, given):
    reply = httpx.post(tuned_server.url + "/v1/completions",
                       json={"prompt": PROMPT, **given.get("json", {})},
                       headers=given.get("headers"))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "request_id" and "at most 256 printable ASCII" in error["message"]
    assert httpx.post(tuned_server.url + "/v1/completions", json={
        "prompt": PROMPT, "request_id": "x" * 256}).json()["id"] == "cmpl-" + "x" * 256


def test_request_id_headers(options_server):
    url = options_server.url
    given = httpx.post(url + "/v1/completions", headers={"X-Request-Id": "abc"},
                       json={"prompt": "hi", "max_tokens": 1})
    assert given.headers["x-request-id"] == "abc" and given.json()["id"] == "cmpl-abc"
    body = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1,
                                                     "request_id": "from-body"})
    assert body.headers["x-request-id"] == "from-body"
    chosen = httpx.post(url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert chosen.json()["id"] == "chatcmpl-" + chosen.headers["x-request-id"]
    refused = httpx.post(url + "/v1/completions", json={"prompt": "hi", "n": 0},
                         headers={"X-Request-Id": "bad-1"})
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "bad-1"
    other = httpx.get(url + "/health")
    assert re.fullmatch(r"[0-9a-f]{32}", other.headers["x-request-id"])
    assert len(other.headers.get_list("x-request-id")) == 1


def test_no_cors_headers_unless_asked(tuned_server):
    reply = httpx.get(tuned_server.url + "/v1/models", headers={"Origin": "http://ui.example"})
    assert "access-control-allow-origin" not in reply.headers


def test_stats_line():
    from fulcrum.core.scheduler import SchedulerStats
    from fulcrum.server.metrics import stats_line

    idle = SchedulerStats(0, 0, 0, 0, 0, 100, 0.0, 0, 0)
    assert stats_line(10.0, 0, 0, idle) is None
    busy = SchedulerStats(3, 1, 0, 0, 25, 100, 0.25, 200, 50)
    assert stats_line(10.0, 1000, 250, busy) == (
        "Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 25.0 tokens/s, "
        "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%")

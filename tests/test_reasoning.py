"""Reasoning parsers (vLLM's --reasoning-parser): the model's thinking as the chat message's
`reasoning` (and `reasoning_content`), the rest as `content`, whole or streamed in any
pieces; through the server, with tool calls read from the content alone."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from conftest import running_server
from fulcrum.server.reasoning import ReasoningStream, make_parser

CASES = [  # (answer, deepseek_r1's (reasoning, content), qwen3's)
    ("<think>Let me see.</think>It is 4.", ("Let me see.", "It is 4."),
     ("Let me see.", "It is 4.")),
    ("\n<think>a < b</think>\n\nYes", ("a < b", "\n\nYes"), ("a < b", "\n\nYes")),
    ("Let me see.</think>It is 4.", ("Let me see.", "It is 4."),
     (None, "Let me see.</think>It is 4.")),  # R1 writes no <think>: its template opened it
    ("Still thinking <th", ("Still thinking <th", None), (None, "Still thinking <th")),
    ("It is 4.", ("It is 4.", None), (None, "It is 4.")),  # cut short: all reasoning for R1
    ("<think>", (None, None), (None, None)),
    ("<thin", ("<thin", None), (None, "<thin")),
    ("<think>x</think>", ("x", None), ("x", None)),
    ("<think>x</thinkable>y</think>z", ("x</thinkable>y", "z"), ("x</thinkable>y", "z")),
]


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("answer, r1, qwen3", CASES)
def test_an_answer_splits_alike_whole_and_in_any_pieces(name, answer, r1, qwen3):
    expected = r1 if name == "deepseek_r1" else qwen3
    assert ReasoningStream(make_parser(name)).whole(answer) == expected
    rng = random.Random(0)
    for _ in range(30):
        stream, reasoning, content = ReasoningStream(make_parser(name)), "", ""
        cuts = sorted(rng.sample(range(1, len(answer)), k=min(3, len(answer) - 1)))
        for piece in [answer[i:j] for i, j in zip([0] + cuts, cuts + [len(answer)])]:
            delta = stream.feed(piece)
            assert not (delta.reasoning or "").endswith(("<", "</", "</think")) or \
                answer.endswith(piece)  # a marker's start is held back
            reasoning += delta.reasoning or ""
            content += delta.content or ""
        last = stream.finish()
        reasoning += last.reasoning or ""
        content += last.content or ""
        assert (reasoning or None, content or None) == expected, cuts


def test_an_unknown_parser_is_named():
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2'; choose from"):
        make_parser("r2")


# ------------------------------------------------------------------ through the server
@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    from conftest import build_tiny_model

    folder = build_tiny_model("llama", tmp_path_factory.mktemp("reasoning") / "llama",
                              max_pos=2048)  # room for the tools' preamble
    with running_server(folder, scheduling_policy="fcfs",
                        app_kwargs={"reasoning_parser": "deepseek_r1",
                                    "tool_call_parser": "hermes"}) as (server, _):
        yield server


def chat(server, answer: str, stream: bool = False, **body):
    from test_tool_calls import forced

    body = {"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 200,
            "temperature": 0.0, "stream": stream, **forced(answer), **body}
    if not stream:
        return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    deltas = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                      timeout=60) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                deltas += [c for c in json.loads(line[6:])["choices"]]
    return deltas


def test_the_server_gives_the_thinking_as_reasoning_whole_and_streamed(thinking_server):
    answer = "<think>Paris is in France.</think>It is sunny."
    (choice,) = chat(thinking_server, answer)["choices"]
    assert choice["message"]["reasoning"] == choice["message"]["reasoning_content"] == \
        "Paris is in France."
    assert choice["message"]["content"] == "It is sunny."
    deltas = [d["delta"] for d in chat(thinking_server, answer, stream=True)]
    reasoning = [d.get("reasoning") for d in deltas if d.get("reasoning")]
    assert all(d.get("reasoning_content") == d.get("reasoning") for d in deltas)
    assert "".join(reasoning) == "Paris is in France."
    assert "".join(d.get("content") or "" for d in deltas) == "It is sunny."
    last_thought = max(i for i, d in enumerate(deltas) if d.get("reasoning"))
    assert all(not d.get("content") for d in deltas[:last_thought + 1])


def test_tool_calls_are_read_from_the_answer_not_the_thinking(thinking_server):
    from test_tool_calls import CALL, TOOLS

    reply = chat(thinking_server, "<think>I should call it.</think>" + CALL, tools=TOOLS,
                 tool_choice="auto")
    (choice,) = reply["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning"] == "I should call it."
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    mused = chat(thinking_server, "<think>Maybe " + CALL + "</think>It is sunny.", tools=TOOLS,
                 tool_choice="auto")["choices"][0]
    assert mused["finish_reason"] == "stop" and mused["message"]["tool_calls"] == []
    assert mused["message"]["content"] == "It is sunny."
    assert mused["message"]["reasoning"] == "Maybe " + CALL


def test_an_answer_a_grammar_writes_thinks_only_where_it_opens_with_think(thinking_server):
    """Under a grammar (tool_choice required, structured outputs) the answer is written
    from its first token: it thinks only where the grammar opens it with <think>, where
    deepseek_r1's rule took all of it for thinking (the calls came back in `reasoning`,
    none in tool_calls)."""
    from test_tool_calls import TOOLS

    body = {"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 200,
            "temperature": 0.0, "tools": TOOLS, "tool_choice": "required"}
    reply = httpx.post(thinking_server.url + "/v1/chat/completions", json=body, timeout=60)
    (choice,) = reply.json()["choices"]
    assert choice["finish_reason"] == "tool_calls" and "reasoning" not in choice["message"]
    assert choice["message"]["tool_calls"][0]["function"]["name"] in ("get_weather",
                                                                       "get_time")
    (choice,) = chat(thinking_server, "It is sunny.")["choices"]  # a regex: no <think>
    assert choice["message"]["content"] == "It is sunny."
    assert "reasoning" not in choice["message"]


def test_without_a_reasoning_parser_there_is_no_reasoning_field(llama_dir):
    with running_server(llama_dir, scheduling_policy="fcfs") as (server, _):
        (choice,) = chat(server, "<think>x</think>y", max_tokens=40)["choices"]
    assert choice["message"]["content"] == "<think>x</think>y"
    assert "reasoning" not in choice["message"] and "reasoning_content" not in choice["message"]


def test_a_stream_with_return_token_ids_carries_every_token(thinking_server):
    """Tokens whose text the parser holds back (a <think> or </think> still forming) go out
    all the same with return_token_ids, in chunks with an empty delta, as vLLM sends them:
    they were in no chunk, and the stream's ids fell short of the tokens generated."""
    answer = "<think>Hm.</think>Yes."
    (whole,) = chat(thinking_server, answer, return_token_ids=True)["choices"]
    streamed = chat(thinking_server, answer, stream=True, return_token_ids=True)
    assert [t for choice in streamed for t in choice["token_ids"] or []] == whole["token_ids"]
    assert len(whole["token_ids"]) >= len(answer)


def test_include_reasoning_false_drops_the_thinking(thinking_server):
    """vLLM's include_reasoning: false gives the answer without its thinking, whole or
    streamed, and without the logprobs and token ids that would spell it out (it was
    logged as an unknown field and the thinking sent all the same)."""
    answer = "<think>Paris is in France.</think>It is sunny."
    body = {"include_reasoning": False, "logprobs": True, "return_token_ids": True}
    (choice,) = chat(thinking_server, answer, **body)["choices"]
    assert choice["message"]["content"] == "It is sunny."
    assert "reasoning" not in choice["message"] and "reasoning_content" not in choice["message"]
    assert choice["logprobs"] is None and choice["token_ids"] is None
    deltas = chat(thinking_server, answer, stream=True, **body)
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "It is sunny."
    assert not any(d["delta"].get("reasoning") or d["logprobs"] or d["token_ids"]
                   for d in deltas)
    (shown,) = chat(thinking_server, answer, include_reasoning=True)["choices"]
    assert shown["message"]["reasoning"] == "Paris is in France."

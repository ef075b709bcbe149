"""vLLM's token-level controls and prompt handling: logit_bias, allowed_token_ids, bad_words,
prompt_logprobs (checked against HF's log-softmax), echo with logprobs, truncate_prompt_tokens;
in the sampler, the LLM API and over HTTP."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from conftest import running_server
from fulcrum import LLM, SamplingParams
from fulcrum.core.request import SamplingRow
from fulcrum.worker.sampler import Sampler

CPU = torch.device("cpu")
PROMPT = list(range(5, 45))  # 40 tokens


def row(**params) -> SamplingRow:
    return SamplingRow("r", SamplingParams(**params), [0], 1)


def sample(logits, row_: SamplingRow) -> int:
    return Sampler(0, CPU)(torch.tensor([logits]), [row_])[0].token_id


# ------------------------------------------------------------------ sampler
def test_logit_bias_shifts_and_is_clamped_to_100():
    logits = [5.0, 1.0, 0.0, -150.0]
    assert sample(logits, row(temperature=0.0)) == 0
    assert sample(logits, row(temperature=0.0, logit_bias={1: 4.5})) == 1
    assert sample(logits, row(temperature=0.0, logit_bias={1: 3.5})) == 0
    # +1000 becomes +100: -150 + 100 still loses to 5
    assert SamplingParams(logit_bias={3: 1000}).logit_bias == {3: 100.0}
    assert sample(logits, row(temperature=0.0, logit_bias={3: 1000})) == 0


def test_logit_bias_leaves_reported_logprobs_raw():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    token = Sampler(0, CPU)(logits, [row(temperature=0.0, logprobs=0, logit_bias={2: 10})])[0]
    assert token.token_id == 2
    assert token.logprobs[2].logprob == pytest.approx(torch.log_softmax(logits, -1)[0, 2].item())
    assert token.logprobs[2].rank == 3


def test_allowed_token_ids_are_the_only_ones_drawn():
    logits = torch.zeros(1, 10).expand(500, -1).clone()
    rows = [SamplingRow(f"r{i}", SamplingParams(temperature=1.0, allowed_token_ids=[2, 7]), [0],
                        1) for i in range(500)]
    drawn = {t.token_id for t in Sampler(0, CPU)(logits, rows)}
    assert drawn == {2, 7}
    assert sample([9.0, 0.0, 1.0, 3.0], row(temperature=0.0, allowed_token_ids=[1, 2])) == 2


def test_a_requests_allowed_ids_are_read_once_and_forgotten_with_it():
    """Each request's allowed_token_ids are made into an array once, not at every step, and
    dropped when the request ends."""
    sampler = Sampler(0, CPU)
    rows = [SamplingRow(f"r{i}", SamplingParams(temperature=0.0, allowed_token_ids=ids), [0], 1)
            for i, ids in enumerate(([3], [5, 6]))]
    logits = torch.arange(10.0).expand(2, -1).clone()
    for _ in range(2):
        assert [t.token_id for t in sampler(logits.clone(), rows)] == [3, 6]
        rows[0].params.allowed_token_ids.append(9)  # not read again while it runs
    sampler.forget(["r0", "r1"])
    assert [t.token_id for t in sampler(logits.clone(), rows)] == [9, 6]


def test_a_bad_word_the_model_cannot_produce_is_left_out(llama_dir):
    """A spelling with an id past the model's vocabulary (a tokenizer's added token) can never
    be completed; the sampler bans ids at their place in the batch's flat logits, where it
    would land on the next request's row."""
    engine = LLM(str(llama_dir), max_model_len=64).llm_engine
    tokenizer = engine.tokenizer
    (end,) = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    (e,) = tokenizer.encode("e", add_special_tokens=False)
    assert engine.bad_words_token_ids(["<|im_end|>", "e"])[0] == [end]
    engine.vocab_size = end  # as if the tokenizer had added <|im_end|> past the model's ids
    assert engine.bad_words_token_ids(["<|im_end|>", "e"]) == [[e]]


def test_bad_words_ban_the_token_that_would_complete_them():
    logits = [0.0, 0.0, 0.0, 0.0, 0.0, 9.0, 0.0, 0.0, 8.0]
    one = SamplingRow("r", SamplingParams(temperature=0.0), [0], 1, bad_words_token_ids=[[5]])
    assert sample(logits, one) == 8
    pair = [[7, 5]]  # "7 then 5": 5 is banned only right after a 7
    after_7 = SamplingRow("r", SamplingParams(temperature=0.0), [0, 7], 1,
                          bad_words_token_ids=pair)
    after_6 = SamplingRow("r", SamplingParams(temperature=0.0), [0, 6], 1,
                          bad_words_token_ids=pair)
    assert sample(logits, after_7) == 8 and sample(logits, after_6) == 5
    in_prompt = SamplingRow("r", SamplingParams(temperature=0.0), [0, 7], 2,
                            bad_words_token_ids=pair)  # the 7 is the prompt's: no ban
    assert sample(logits, in_prompt) == 5


@pytest.mark.parametrize("fields,message", [
    ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {1: float("nan")}}, "finite numbers"),
    ({"logit_bias": {i: 1.0 for i in range(1025)}}, "more than the 1024 allowed"),
    ({"allowed_token_ids": []}, "non-empty list of token ids"),
    ({"bad_words": [" "]}, "non-blank strings"),
    ({"prompt_logprobs": -1}, "non-negative integer"),
    ({"truncate_prompt_tokens": 0}, "positive integer or -1"),
    ({"truncate_prompt_tokens": -2}, "positive integer or -1"),
])
def test_bad_values_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


# ---------------------------------------------------------------- LLM API
@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), scheduling_policy="fcfs", max_num_batched_tokens=16,
               long_prefill_token_threshold=6)


def greedy(llm, prompt, **params):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, **params)
    return llm.generate([prompt], params, use_tqdm=False)[0]


def test_controls_through_the_engine(llm):
    (e,) = llm.get_tokenizer().encode("e", add_special_tokens=False)
    assert greedy(llm, "hello", logit_bias={e: 100}).outputs[0].token_ids == [e] * 8
    allowed = greedy(llm, "hello", allowed_token_ids=[70, 71, 72]).outputs[0].token_ids
    assert set(allowed) <= {70, 71, 72}
    # the bias would make every token "e"; the bad word forbids it outright
    banned = greedy(llm, "hello", logit_bias={e: 100}, bad_words=["e"]).outputs[0].token_ids
    assert e not in banned and len(banned) == 8


def test_the_engine_checks_ids_against_the_vocabulary(llm):
    for fields in ({"logit_bias": {320: 1.0}}, {"allowed_token_ids": [1, 320]}):
        with pytest.raises(ValueError, match="320 is out of vocabulary"):
            greedy(llm, "x", **fields)
    with pytest.raises(ValueError, match="prompt_logprobs must be at most 20"):
        greedy(llm, "x", prompt_logprobs=21)
    assert not llm.llm_engine.has_unfinished_requests()


def hf_prompt_logprobs(model_dir, prompt):
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0], -1)


def test_prompt_logprobs_match_hf_across_chunks(llm, llama_dir):
    reference = hf_prompt_logprobs(llama_dir, PROMPT)
    output = greedy(llm, {"prompt_token_ids": PROMPT}, prompt_logprobs=3)
    found = output.prompt_logprobs
    assert len(found) == len(PROMPT) and found[0] is None
    for i in range(1, len(PROMPT)):
        expected = reference[i - 1]
        entry = found[i]
        assert entry[PROMPT[i]].logprob == pytest.approx(expected[PROMPT[i]].item(), abs=1e-4)
        assert entry[PROMPT[i]].rank == int((expected > expected[PROMPT[i]]).sum()) + 1
        top = expected.topk(3).indices.tolist()
        assert set(top) <= set(entry) and len(entry) == len(set(top) | {PROMPT[i]})
        assert entry[PROMPT[i]].decoded_token == llm.get_tokenizer().decode([PROMPT[i]],
                                                                            False)


def test_prompt_logprobs_skip_the_prefix_cache_and_come_once(llm):
    first = greedy(llm, {"prompt_token_ids": PROMPT}).outputs[0].token_ids  # fills the cache
    again = greedy(llm, {"prompt_token_ids": PROMPT}, prompt_logprobs=0)
    assert again.num_cached_tokens == 0 and len(again.prompt_logprobs) == len(PROMPT)
    assert again.outputs[0].token_ids == first
    two = llm.generate([{"prompt_token_ids": PROMPT}],
                       SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=3,
                                      prompt_logprobs=1), use_tqdm=False)[0]
    assert len(two.prompt_logprobs) == len(PROMPT) and len(two.outputs) == 2


def test_prompt_logprobs_survive_preemption(llama_dir):
    prompts = [list(range(1 + 40 * i, 35 + 40 * i)) for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prompt_logprobs=1)
    tight = LLM(str(llama_dir), block_size=8, max_model_len=128, num_gpu_blocks_override=17,
                scheduling_policy="fcfs")
    outputs = tight.generate([{"prompt_token_ids": p} for p in prompts], params,
                             use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    roomy = LLM(str(llama_dir), block_size=8, max_model_len=128, scheduling_policy="fcfs")
    reference = roomy.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
    for got, want in zip(outputs, reference):
        assert len(got.prompt_logprobs) == 34
        assert [e and {t: round(lp.logprob, 4) for t, lp in e.items()}
                for e in got.prompt_logprobs] == \
            [e and {t: round(lp.logprob, 4) for t, lp in e.items()} for e in want.prompt_logprobs]


def test_prompt_logprobs_when_a_preempted_prompt_comes_back_in_larger_chunks(stories_dir):
    """B's prompt is first computed in chunks of what A leaves of the budget, then preempted
    and recomputed in larger ones: the positions past what was done before must still give
    their logprobs (they came back None)."""
    llm = LLM(str(stories_dir), max_model_len=512, num_gpu_blocks_override=33, block_size=16,
              scheduling_policy="fcfs", max_num_batched_tokens=64,
              long_prefill_token_threshold=64, enable_prefix_caching=False)
    a = {"prompt_token_ids": [1] + [(7 * i) % 500 + 3 for i in range(399)]}
    b = {"prompt_token_ids": [1] + [(11 * i) % 500 + 3 for i in range(119)]}
    params = SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=1)
    alone = llm.generate([b], params, use_tqdm=False)[0]
    _, beside = llm.generate([a, b], [SamplingParams(temperature=0, max_tokens=60,
                                                     ignore_eos=True), params], use_tqdm=False)
    assert beside.metrics.num_preemptions > 0
    rounded = lambda out: [e and {t: round(lp.logprob, 4) for t, lp in e.items()}  # noqa: E731
                           for e in out.prompt_logprobs]
    assert beside.prompt_logprobs is not None and len(beside.prompt_logprobs) == 120
    assert rounded(beside) == rounded(alone)
    assert beside.outputs[0].token_ids == alone.outputs[0].token_ids


def test_truncate_prompt_tokens_keeps_the_end(llm):
    output = greedy(llm, {"prompt_token_ids": PROMPT}, truncate_prompt_tokens=6)
    assert output.prompt_token_ids == PROMPT[-6:]
    assert output.prompt == llm.get_tokenizer().decode(PROMPT[-6:], skip_special_tokens=False)
    assert greedy(llm, {"prompt_token_ids": PROMPT}, truncate_prompt_tokens=-1
                  ).prompt_token_ids == PROMPT  # shorter than max_model_len already
    long = list(range(1, 300)) * 2  # 598 tokens > max_model_len 512
    with pytest.raises(ValueError, match="more than the maximum model length"):
        greedy(llm, {"prompt_token_ids": long})
    kept = llm.generate([{"prompt_token_ids": long}],
                        SamplingParams(max_tokens=2, truncate_prompt_tokens=500),
                        use_tqdm=False)[0]
    assert kept.prompt_token_ids == long[-500:]


def test_truncate_prompt_tokens_takes_a_text_past_the_length_guard(llm):
    """A text too long for max_model_len at the most characters a token can stand for is
    refused untokenized, unless only its end is wanted: then only its end is tokenized."""
    engine = llm.llm_engine
    guard = 2 * engine.config.max_model_len * engine.tokenizer.max_chars_per_token
    text = "".join(f"story {i} went on. " for i in range(guard // 10))
    assert len(text) > guard
    with pytest.raises(ValueError, match="truncate_prompt_tokens keeps its end"):
        greedy(llm, text)
    full = llm.get_tokenizer().encode(text)
    for keep in (40, 500):
        assert greedy(llm, text, truncate_prompt_tokens=keep).prompt_token_ids == full[-keep:]
    with pytest.raises(ValueError, match="but 512 prompt tokens"):  # -1 keeps 512: no room
        greedy(llm, text, truncate_prompt_tokens=-1)
    # Keeping more than max_model_len reads no more of the text than max_model_len does.
    huge = text * 200
    tokenized = []
    original = engine.tokenizer.encode
    engine.tokenizer.encode = lambda t, *a: tokenized.append(len(t)) or original(t, *a)
    try:
        with pytest.raises(ValueError, match="more than the maximum model length of 512"):
            greedy(llm, huge, truncate_prompt_tokens=10**9)
    finally:
        engine.tokenizer.encode = original
    assert tokenized == [guard]


# ------------------------------------------------------------------ server
@pytest.fixture(scope="module")
def served(llama_dir):
    with running_server(llama_dir, scheduling_policy="fcfs") as pair:
        yield pair


def complete(server, **body):
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0.0, **body}
    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_server_controls(server):
    (e,) = httpx.post(server.url + "/tokenize", json={"prompt": "e"}).json()["tokens"]
    assert complete(server, logit_bias={str(e): 100})["choices"][0]["text"] == "eeee"
    assert complete(server, logit_bias={str(e): 100}, bad_words=["e"])["choices"][0][
        "text"].count("e") == 0
    allowed = complete(server, allowed_token_ids=[e])["choices"][0]["text"]
    assert allowed == "eeee"
    truncated = complete(server, truncate_prompt_tokens=7)
    assert truncated["usage"]["prompt_tokens"] == 7
    chat = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi " * 100}], "max_tokens": 2,
        "truncate_prompt_tokens": 9}).json()
    assert chat["usage"]["prompt_tokens"] == 9
    huge = "once upon a time " * 100_000  # past the length guard
    for route, body in [("/v1/completions", {"prompt": huge}),
                        ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                "content": huge}]})]:
        reply = httpx.post(server.url + route, json={**body, "max_tokens": 1}, timeout=60)
        assert reply.status_code == 400 and "characters long" in reply.text
        reply = httpx.post(server.url + route, json={**body, "max_tokens": 1,
                                                     "truncate_prompt_tokens": 5}, timeout=60)
        assert reply.json()["usage"]["prompt_tokens"] == 5


def test_server_echo_with_logprobs_covers_the_prompt(server, llama_dir):
    reference = hf_prompt_logprobs(llama_dir, PROMPT)
    body = complete(server, echo=True, logprobs=2)
    logprobs = body["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(PROMPT) + 4
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for i in range(1, len(PROMPT)):
        assert logprobs["token_logprobs"][i] == pytest.approx(
            reference[i - 1][PROMPT[i]].item(), abs=1e-4)
        assert len(logprobs["top_logprobs"][i]) >= 2
    assert body["choices"][0]["text"].startswith(
        httpx.post(server.url + "/detokenize", json={"tokens": PROMPT}).json()["prompt"])
    offsets = logprobs["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0


def test_server_echo_with_max_tokens_0_scores_the_prompt_alone(server, llama_dir):
    """OpenAI's (and vLLM's) way to score a prompt: echo with max_tokens 0 returns the
    prompt, its logprobs and no generated token, whole or streamed (it was a 400)."""
    reference = hf_prompt_logprobs(llama_dir, PROMPT)
    prompt_text = httpx.post(server.url + "/detokenize", json={"tokens": PROMPT}).json()["prompt"]
    body = complete(server, echo=True, logprobs=1, max_tokens=0, n=2)
    assert body["usage"]["completion_tokens"] == 0
    for choice in body["choices"]:
        assert choice["text"] == prompt_text and choice["finish_reason"] == "length"
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(PROMPT)
        assert logprobs["token_logprobs"][-1] == pytest.approx(
            reference[-2][PROMPT[-1]].item(), abs=1e-4)
    streamed, finish = "", []
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "prompt": PROMPT, "max_tokens": 0, "echo": True, "stream": True}) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed += c["text"]
                    finish.append(c["finish_reason"])
    assert streamed == prompt_text and finish[-1] == "length"
    reply = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 0})
    assert reply.status_code == 400 and "max_tokens" in reply.text  # without echo: nothing


def test_server_prompt_logprobs_field(server, llama_dir):
    reference = hf_prompt_logprobs(llama_dir, PROMPT)
    body = complete(server, prompt_logprobs=1)
    found = body["choices"][0]["prompt_logprobs"]
    assert found[0] is None and len(found) == len(PROMPT)
    assert found[5][str(PROMPT[5])]["logprob"] == pytest.approx(
        reference[4][PROMPT[5]].item(), abs=1e-4)
    streamed = []
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "prompt": PROMPT, "max_tokens": 3, "stream": True, "prompt_logprobs": 0}) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                streamed += [c["prompt_logprobs"] for c in json.loads(line[6:])["choices"]]
    assert sum(p is not None for p in streamed) == 1  # sent once, in the first chunk
    assert streamed[0] is not None and len(streamed[0]) == len(PROMPT)

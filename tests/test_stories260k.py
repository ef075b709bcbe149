"""A real trained model (stories260K, Llama) reproduces HF transformers' greedy reference
(greedy_reference.json, shipped with the model) token for token and text for text: alone,
batched with unrelated requests under chunked prefill, and with the prefix cache reused."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer

from fulcrum import LLM, SamplingParams
from test_bad_input import assert_all_blocks_free


@pytest.fixture(scope="module")
def cases(stories_dir):
    """The reference's `greedy_text` is HF's decode of the output ids alone, which drops the
    first token's leading space; a completion is what the tokens add to the prompt's text
    (vLLM's and OpenAI's): `completion_text`, the same text where it starts with a space."""
    cases = json.loads((stories_dir / "greedy_reference.json").read_text())["cases"]
    assert len(cases) >= 3
    tokenizer = Tokenizer.from_file(str(stories_dir / "tokenizer.json"))
    for case in cases:
        prompt = tokenizer.decode(case["prompt_token_ids"])
        whole = tokenizer.decode(case["prompt_token_ids"] + case["greedy_token_ids"])
        assert whole.startswith(prompt)
        case["completion_text"] = whole[len(prompt):]
        assert case["completion_text"].removeprefix(" ") == case["greedy_text"]
    assert any(c["completion_text"].startswith(" ") for c in cases)
    return cases


def greedy(case):
    return SamplingParams(temperature=0.0, max_tokens=case["max_tokens"])


def assert_reproduces(output, case):
    assert output.prompt == case["prompt"]
    assert output.prompt_token_ids == case["prompt_token_ids"]
    completion = output.outputs[0]
    assert completion.token_ids == case["greedy_token_ids"]
    assert completion.text == case["completion_text"]
    assert completion.finish_reason == "length"


def test_each_case_alone(stories_dir, cases):
    llm = LLM(str(stories_dir))
    for case in cases:
        (output,) = llm.generate(case["prompt"], greedy(case), use_tqdm=False)
        assert_reproduces(output, case)
    assert_all_blocks_free(llm.llm_engine)


def test_batched_with_other_requests_chunked(stories_dir, cases):
    budget = 16
    llm = LLM(str(stories_dir), max_num_batched_tokens=budget, max_num_seqs=8, block_size=8,
              enable_prefix_caching=False)
    rng = random.Random(7)
    extra_prompts = [{"prompt_token_ids": [1] + [rng.randrange(3, 512) for _ in range(n)]}
                     for n in (40, 3, 75, 21)]
    extra_params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=5),
                    SamplingParams(temperature=0.8, seed=3, ignore_eos=True, max_tokens=52),
                    SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1),
                    SamplingParams(temperature=1.0, top_p=0.9, ignore_eos=True, max_tokens=30)]
    # Interleave: extra requests arrive before, between and after the reference prompts.
    prompts = [extra_prompts[0], cases[0]["prompt"], extra_prompts[1], cases[1]["prompt"],
               extra_prompts[2], cases[2]["prompt"], extra_prompts[3]]
    params = [extra_params[0], greedy(cases[0]), extra_params[1], greedy(cases[1]),
              extra_params[2], greedy(cases[2]), extra_params[3]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, case in zip((1, 3, 5), cases):
        assert_reproduces(outputs[i], case)
    for i, prompt, sp in zip((0, 2, 4, 6), extra_prompts, extra_params):
        assert outputs[i].prompt_token_ids == prompt["prompt_token_ids"]
        assert len(outputs[i].outputs[0].token_ids) == sp.max_tokens
    stats = list(llm.llm_engine.stats)
    assert all(s.num_prefill_tokens + s.num_decode_tokens <= budget for s in stats)
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in stats)
    assert_all_blocks_free(llm.llm_engine)


def test_prefix_caching_on_repeated_prompts(stories_dir, cases):
    block_size = 4  # the prompts are 5..13 tokens: small blocks give them full blocks to share
    llm = LLM(str(stories_dir), enable_prefix_caching=True, block_size=block_size)
    first = llm.generate([c["prompt"] for c in cases], [greedy(c) for c in cases],
                         use_tqdm=False)
    for output, case in zip(first, cases):
        assert_reproduces(output, case)
        assert output.num_cached_tokens == 0
    # Each prompt twice more, in one batch: every full block of every prompt is a hit.
    repeated = cases + cases
    again = llm.generate([c["prompt"] for c in repeated], [greedy(c) for c in repeated],
                         use_tqdm=False)
    for output, case in zip(again, repeated):
        assert_reproduces(output, case)
        expected = (len(case["prompt_token_ids"]) - 1) // block_size * block_size
        assert expected > 0
        assert output.num_cached_tokens == expected
    stats = llm.llm_engine.stats[-1]
    assert stats.prefix_cache_hits == sum(o.num_cached_tokens for o in again)
    assert_all_blocks_free(llm.llm_engine)


def test_continuing_from_a_generated_prefix_hits_decode_blocks(stories_dir, cases):
    """The prompt plus its first 20 greedy tokens continues with the remaining reference tokens,
    and the blocks filled while decoding the first request serve as its prefix cache."""
    block_size = 4
    llm = LLM(str(stories_dir), enable_prefix_caching=True, block_size=block_size)
    case = cases[0]
    (first,) = llm.generate(case["prompt"], greedy(case), use_tqdm=False)
    assert_reproduces(first, case)
    k = 20
    extended = case["prompt_token_ids"] + case["greedy_token_ids"][:k]
    params = SamplingParams(temperature=0.0, max_tokens=case["max_tokens"] - k)
    (second,) = llm.generate({"prompt_token_ids": extended}, params, use_tqdm=False)
    assert second.outputs[0].token_ids == case["greedy_token_ids"][k:]
    assert second.num_cached_tokens == (len(extended) - 1) // block_size * block_size
    assert_all_blocks_free(llm.llm_engine)


def test_min_tokens_holds_back_stop_strings(stories_dir, cases):
    """As in vLLM: a stop string counts only in text after the first min_tokens tokens."""
    llm = LLM(str(stories_dir))
    case = cases[0]
    tokenizer = llm.get_tokenizer()
    ids = case["greedy_token_ids"]
    word = next(w for w in case["greedy_text"].split()[1:] if len(w) > 2)
    # The token after which `word` first appears in the greedy text.
    first = next(k for k in range(1, len(ids) + 1) if word in tokenizer.decode(ids[:k]))
    (plain,) = llm.generate(case["prompt"], SamplingParams(
        temperature=0.0, max_tokens=case["max_tokens"], stop=[word]), use_tqdm=False)
    assert plain.outputs[0].finish_reason == "stop" and len(plain.outputs[0].token_ids) == first
    (held,) = llm.generate(case["prompt"], SamplingParams(
        temperature=0.0, max_tokens=case["max_tokens"], stop=[word], min_tokens=first),
        use_tqdm=False)
    completion = held.outputs[0]
    assert len(completion.token_ids) > first
    assert completion.token_ids == ids[:len(completion.token_ids)]
    assert case["greedy_text"].startswith(completion.text)
    assert len(completion.text) > len(plain.outputs[0].text) + len(word)

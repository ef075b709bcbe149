"""fulcrum's greedy tokens and logprobs equal HF transformers' for every supported architecture,
whatever the batching: one prompt, a mixed batch, chunked prefill, prefix caching, preemption
and static batching all have to produce the same tokens as HF's reference generate()."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import ARCHS, hf_greedy
from fulcrum import LLM, SamplingParams
from test_bad_input import assert_all_blocks_free

MAX_NEW = 20
_rng = random.Random(1234)


def _random_ids(n):
    return [_rng.randrange(300) for _ in range(n)]  # bytes and special tokens alike


# Prompts of mixed lengths (3..200 tokens). Three of them share long prefixes with the
# 200-token one (so the prefix cache has something to find): 120 and 70 tokens.
_LONG = _random_ids(200)
PROMPTS = [_random_ids(3), _LONG, _random_ids(17), _random_ids(64), _random_ids(5),
           _LONG[:120] + _random_ids(11), _random_ids(33), _LONG[:70] + _random_ids(26)]
# Admitted together these fill a 16-block cache of 8-token blocks exactly (5 + 8 + 3 blocks);
# their first decodes need more blocks, so some must be preempted.
PREEMPT_PROMPTS = [PROMPTS[6], PROMPTS[3], PROMPTS[2]]


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def model_dir(model_dirs, arch):
    return model_dirs[arch]


@pytest.fixture(scope="module")
def hf_ref(model_dir):
    """hf_ref(prompt): HF's greedy tokens, each prompt generated once per model."""
    cache = {}

    def ref(prompt):
        key = tuple(prompt)
        if key not in cache:
            cache[key] = hf_greedy(model_dir, list(prompt), MAX_NEW)
        return cache[key]

    return ref


def greedy(max_tokens=MAX_NEW, **kwargs):
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens, **kwargs)


def run(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def assert_matches_hf(outputs, prompts, hf_ref):
    assert len(outputs) == len(prompts)
    for i, (out, prompt) in enumerate(zip(outputs, prompts)):
        assert out.prompt_token_ids == prompt
        assert out.finished
        assert out.outputs[0].token_ids == hf_ref(prompt), f"prompt {i} ({len(prompt)} tokens)"
        assert out.outputs[0].finish_reason == "length"


def test_single_prompt(model_dir, hf_ref):
    llm = LLM(str(model_dir))
    prompt = PROMPTS[3]
    assert_matches_hf(run(llm, [prompt], greedy()), [prompt], hf_ref)
    assert_all_blocks_free(llm.llm_engine)


def test_mixed_length_batch(model_dir, hf_ref):
    llm = LLM(str(model_dir), enable_prefix_caching=False)
    assert_matches_hf(run(llm, PROMPTS, greedy()), PROMPTS, hf_ref)
    # The whole batch was really batched: some step decoded all eight at once.
    assert max(s.num_decode_tokens for s in llm.llm_engine.stats) == len(PROMPTS)
    assert_all_blocks_free(llm.llm_engine)


def test_chunked_prefill_tiny_budget(model_dir, hf_ref):
    budget = 12  # not a multiple of the block size: chunks end mid-block
    llm = LLM(str(model_dir), max_num_batched_tokens=budget, max_num_seqs=4,
              enable_prefix_caching=False, block_size=8)
    assert_matches_hf(run(llm, PROMPTS, greedy()), PROMPTS, hf_ref)
    stats = list(llm.llm_engine.stats)
    assert all(s.num_prefill_tokens + s.num_decode_tokens <= budget for s in stats)
    # Prefill chunks and decodes shared steps (the point of chunked prefill).
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in stats)
    assert_all_blocks_free(llm.llm_engine)


def test_prefix_caching_hits_and_tokens(model_dir, hf_ref):
    llm = LLM(str(model_dir), enable_prefix_caching=True, block_size=16,
              scheduling_policy="fcfs", long_prefill_token_threshold=256)  # prompts whole
    long, shares_120, shares_70 = PROMPTS[1], PROMPTS[5], PROMPTS[7]
    # In one batch: the second request reuses blocks the first writes in the same step.
    together = run(llm, [long, shares_120], greedy())
    assert together[0].num_cached_tokens == 0
    assert together[1].num_cached_tokens == 112  # 7 full blocks of the 120 shared tokens
    # Later: the blocks are still cached after their owners finished.
    later = run(llm, [shares_70], greedy())
    assert later[0].num_cached_tokens == 64
    assert later[0].metrics.num_cached_tokens == 64
    assert_matches_hf(together + later, [long, shares_120, shares_70], hf_ref)
    stats = llm.llm_engine.stats[-1]
    assert stats.prefix_cache_hits == 112 + 64
    assert stats.prefix_cache_queries == len(long) + len(shares_120) + len(shares_70)
    assert_all_blocks_free(llm.llm_engine)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_keeps_tokens(model_dir, hf_ref, prefix_caching):
    # 16 usable blocks of 8 tokens: the three requests grow to 25 blocks in all.
    llm = LLM(str(model_dir), block_size=8, num_gpu_blocks_override=17, max_model_len=128,
              enable_prefix_caching=prefix_caching)
    outputs = run(llm, PREEMPT_PROMPTS, greedy())
    assert_matches_hf(outputs, PREEMPT_PROMPTS, hf_ref)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert llm.llm_engine.stats[-1].num_preemptions_total > 0
    assert max(s.kv_blocks_used for s in llm.llm_engine.stats) <= 16
    assert_all_blocks_free(llm.llm_engine)


def test_static_batching(model_dir, hf_ref):
    llm = LLM(str(model_dir), batching_mode="static", max_num_seqs=3)
    assert_matches_hf(run(llm, PROMPTS, greedy()), PROMPTS, hf_ref)
    stats = list(llm.llm_engine.stats)
    # Static batching never mixes a new prompt into a running batch.
    assert not any(s.num_prefill_tokens and s.num_decode_tokens for s in stats)
    assert max(s.num_running for s in stats) == 3
    assert_all_blocks_free(llm.llm_engine)


def test_logprobs_match_hf_forward(model_dir):
    import transformers as tf

    k = 5
    llm = LLM(str(model_dir))
    outputs = run(llm, PROMPTS, greedy(1, logprobs=k))
    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for prompt, out in zip(PROMPTS, outputs):
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
        ref_values, ref_ids = ref.topk(k)
        step = out.outputs[0].logprobs[0]
        ranked = sorted(step.items(), key=lambda item: item[1].rank)[:k]
        assert [r.rank for _, r in ranked] == list(range(1, k + 1))
        assert [t for t, _ in ranked] == ref_ids.tolist()
        torch.testing.assert_close(torch.tensor([r.logprob for _, r in ranked]), ref_values,
                                   rtol=1e-4, atol=1e-5)
        assert out.outputs[0].token_ids == [ref_ids[0].item()]
        assert out.outputs[0].cumulative_logprob == pytest.approx(ref_values[0].item(),
                                                                  rel=1e-4, abs=1e-5)


def test_prefix_hit_after_same_step_preemption(llama_dir):
    llm = LLM(str(llama_dir), scheduling_policy="priority", max_num_seqs=1, block_size=4)
    engine = llm.llm_engine
    first = [10, 11, 12, 13, 14, 15]
    engine.add_request("low", {"prompt_token_ids": first}, greedy(), priority=1)
    engine.step()  # prefill: 6 tokens computed, 7 known
    (out,) = engine.step()  # decode: 7 computed, 8 known; the next decode fills block 2
    assert len(out.outputs[0].token_ids) == 2
    # A better-priority request continuing "low"'s text preempts it (max_num_seqs=1) in the
    # step where "low" was to fill its second block. That block was never computed, so it
    # must not be found in the prefix cache: only the first block is shared.
    prompt = first + out.outputs[0].token_ids + [50, 51]
    engine.add_request("high", {"prompt_token_ids": prompt}, greedy(), priority=0)
    final = {}
    while engine.has_unfinished_requests():
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    assert final["low"].metrics.num_preemptions == 1
    assert final["low"].outputs[0].token_ids == hf_greedy(llama_dir, first, MAX_NEW)
    assert final["high"].num_cached_tokens == 4
    assert final["high"].outputs[0].token_ids == hf_greedy(llama_dir, prompt, MAX_NEW)

"""The sampler on crafted logits, and sampling behaviour end to end through LLM."""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from typing import List, Optional

import numpy as np
import pytest
import torch

from fulcrum import LLM
from fulcrum.core.request import SamplingRow
from fulcrum.worker.sampler import Sampler, _inverse_cdf
from fulcrum.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU = torch.device("cpu")
DRAWS = 2000


def row(request_id: str = "r", prompt: Optional[List[int]] = None,
        output: Optional[List[int]] = None, stop: Optional[List[int]] = None,
        **params) -> SamplingRow:
    prompt = [0] if prompt is None else prompt
    return SamplingRow(request_id, SamplingParams(**params), prompt + list(output or []),
                       len(prompt), list(stop or []))


def log_probs(*probs: float) -> torch.Tensor:
    return torch.tensor(probs).log()


def draw(logits: torch.Tensor, count: int = DRAWS, seed: int = 0, **params) -> Counter:
    """Sample one distribution `count` times in one batch; counts of each token drawn."""
    rows = [row(f"r{i}", **params) for i in range(count)]
    tokens = Sampler(seed, CPU)(logits.expand(count, -1).clone(), rows)
    return Counter(t.token_id for t in tokens)


def greedy(logits: List[float], **params) -> int:
    return Sampler(0, CPU)(torch.tensor([logits]), [row(temperature=0.0, **params)])[0].token_id


# ------------------------------------------------------------ filtering masks
@pytest.mark.usefixtures("kernel_path")
def test_plain_sampling_reaches_every_token_in_proportion():
    counts = draw(log_probs(0.5, 0.3, 0.15, 0.05))
    assert set(counts) == {0, 1, 2, 3}
    assert counts[0] / DRAWS == pytest.approx(0.5, abs=0.05)
    assert counts[3] / DRAWS == pytest.approx(0.05, abs=0.025)


@pytest.mark.usefixtures("kernel_path")
def test_top_k_keeps_only_the_k_most_likely():
    logits = torch.tensor([0.1, 2.0, 0.3, 1.9, 1.8, -1.0, 0.0, 1.0])
    counts = draw(logits, top_k=3)
    assert set(counts) == {1, 3, 4}


@pytest.mark.usefixtures("kernel_path")
def test_top_p_keeps_smallest_nucleus_reaching_p():
    logits = log_probs(0.5, 0.3, 0.15, 0.05)
    assert set(draw(logits, top_p=0.7)) == {0, 1}
    assert set(draw(logits, top_p=0.9)) == {0, 1, 2}
    assert set(draw(logits, top_p=0.4)) == {0}  # the top token always stays


@pytest.mark.usefixtures("kernel_path")
def test_top_p_after_top_k_renormalises():
    # top_k=2 leaves {0: 0.625, 1: 0.375}; top_p=0.6 of that is token 0 alone.
    assert set(draw(log_probs(0.5, 0.3, 0.15, 0.05), top_k=2, top_p=0.6)) == {0}


@pytest.mark.usefixtures("kernel_path")
def test_min_p_drops_tokens_below_fraction_of_the_top():
    logits = log_probs(0.5, 0.3, 0.15, 0.05)
    assert set(draw(logits, min_p=0.2)) == {0, 1, 2}  # threshold 0.1
    assert set(draw(logits, min_p=0.5)) == {0, 1}  # threshold 0.25


@pytest.mark.usefixtures("kernel_path")
def test_filters_apply_per_row_in_a_mixed_batch():
    logits = log_probs(0.4, 0.3, 0.2, 0.1).expand(600, -1).clone()
    rows = [row(f"r{i}", top_k=1 + i % 3) for i in range(600)]
    tokens = Sampler(0, CPU)(logits, rows)
    for i, token in enumerate(tokens):
        assert token.token_id < 1 + i % 3
    assert {t.token_id for t in tokens} == {0, 1, 2}


@pytest.mark.usefixtures("kernel_path")
def test_low_temperature_concentrates_high_temperature_spreads():
    logits = log_probs(0.4, 0.3, 0.2, 0.1)
    cold = draw(logits, temperature=0.1)
    hot = draw(logits, temperature=5.0)
    assert cold[0] / DRAWS > 0.9
    assert hot[3] / DRAWS > 0.15


def test_greedy_is_argmax_per_row():
    torch.manual_seed(1)
    logits = torch.randn(16, 50)
    rows = [row(f"r{i}", temperature=0.0) for i in range(16)]
    tokens = [t.token_id for t in Sampler(0, CPU)(logits, rows)]
    assert tokens == logits.argmax(dim=-1).tolist()


def test_greedy_rows_take_a_given_argmax_only_where_nothing_changed_the_logits():
    """The native LM head hands its argmax along; a given (here deliberately wrong) argmax
    is taken as is by plain greedy rows, beside a random row too, and ignored once a logit
    bias, penalties or min_tokens change the logits."""
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0], [3.0, 0.0, 0.0, 0.0]])
    given = torch.tensor([2, 3])
    sampler = Sampler(0, CPU)

    def tokens(*rows):
        return [t.token_id for t in sampler(logits.clone(), list(rows), given.clone())]

    assert tokens(row("a", temperature=0.0), row("b", temperature=0.0)) == [2, 3]
    assert tokens(row("a", temperature=0.0, logit_bias={3: 2.0}),
                  row("b", temperature=0.0)) == [3, 0]
    assert tokens(row("a", temperature=0.0, output=[1], presence_penalty=2.0),
                  row("b", temperature=0.0)) == [3, 0]
    assert tokens(row("a", temperature=0.0, stop=[1], min_tokens=2),
                  row("b", temperature=0.0)) == [3, 0]
    mixed = tokens(row("a", temperature=0.0), row("b", temperature=1.0, seed=0))
    assert mixed[0] == 2 and mixed[1] in range(4)


def test_greedy_ignores_top_k_top_p_and_seed():
    logits = [0.0, 3.0, 1.0]
    assert greedy(logits, top_k=1, top_p=0.1, seed=3) == 1


# ------------------------------------------------------------------ penalties
def test_repetition_penalty_divides_positive_seen_logits():
    logits = [2.0, 1.5, 0.0]
    assert greedy(logits, prompt=[2]) == 0
    assert greedy(logits, prompt=[0], repetition_penalty=2.0) == 1  # 2.0 -> 1.0
    assert greedy(logits, prompt=[2], output=[0], repetition_penalty=2.0) == 1
    assert greedy(logits, prompt=[0], repetition_penalty=1.2) == 0  # 2.0 -> 1.67 > 1.5


def test_repetition_penalty_multiplies_negative_seen_logits():
    logits = [-1.0, -1.5, -9.0]
    # -1.0 * 2 = -2.0 < -1.5. Dividing it (the sign mistake) would give -0.5 and keep 0.
    assert greedy(logits, prompt=[0], repetition_penalty=2.0) == 1


def test_repetition_penalty_below_one_rewards_repeats():
    logits = [1.0, 1.5, 0.0]
    assert greedy(logits, prompt=[0], repetition_penalty=0.5) == 0  # 1.0 -> 2.0


def test_frequency_penalty_scales_with_output_count_and_ignores_prompt():
    logits = [3.0, 2.5, 0.0]
    assert greedy(logits, output=[0], frequency_penalty=0.3) == 0  # 2.7
    assert greedy(logits, output=[0, 0], frequency_penalty=0.3) == 1  # 2.4
    assert greedy(logits, prompt=[0, 0, 0], frequency_penalty=2.0) == 0
    assert greedy(logits, output=[1, 1], frequency_penalty=-1.0) == 1  # rewards repeats


def test_presence_penalty_is_independent_of_count_and_ignores_prompt():
    logits = [3.0, 2.5, 0.0]
    assert greedy(logits, output=[0, 0, 0], presence_penalty=0.4) == 0  # 2.6, not 1.8
    assert greedy(logits, output=[0], presence_penalty=0.6) == 1  # 2.4
    assert greedy(logits, prompt=[0], presence_penalty=2.0) == 0


def test_penalties_apply_per_row():
    logits = torch.tensor([[3.0, 2.5, 0.0]] * 2)
    rows = [row("a", output=[0], temperature=0.0, presence_penalty=1.0),
            row("b", output=[0], temperature=0.0)]
    assert [t.token_id for t in Sampler(0, CPU)(logits, rows)] == [1, 0]


# ------------------------------------------------------------------ min_tokens
def test_min_tokens_masks_stop_tokens_until_reached():
    logits = [0.0, 1.0, 9.0, 8.0]
    stop = [2, 3]
    assert greedy(logits, output=[1], stop=stop, min_tokens=3, max_tokens=5) == 1
    assert greedy(logits, output=[1, 1], stop=stop, min_tokens=3, max_tokens=5) == 1
    assert greedy(logits, output=[1, 1, 1], stop=stop, min_tokens=3, max_tokens=5) == 2
    assert greedy(logits, stop=stop) == 2


@pytest.mark.usefixtures("kernel_path")
def test_min_tokens_masks_in_random_sampling():
    counts = draw(log_probs(0.45, 0.45, 0.1), stop=[0, 1], min_tokens=1)
    assert set(counts) == {2}


# ------------------------------------------------------------------- seeding
def run_seeded(steps: int, batch_others: int, sampler_seed: int, seed: int = 1234) -> List[int]:
    """Tokens of request "target" (seed `seed`) when it shares each step with others."""
    generator = torch.Generator().manual_seed(99)
    target_logits = [torch.randn(40, generator=generator) for _ in range(steps)]
    sampler = Sampler(sampler_seed, CPU)
    other_rows = [row(f"o{i}", seed=(i if i % 2 else None), temperature=0.8)
                  for i in range(batch_others)]
    out: List[int] = []
    for step in range(steps):
        target = row("target", output=out, seed=seed, temperature=1.0)
        rows = other_rows[:batch_others // 2] + [target] + other_rows[batch_others // 2:]
        logits = torch.randn(len(rows), 40)
        position = batch_others // 2
        logits[position] = target_logits[step]
        tokens = sampler(logits, rows)
        out.append(tokens[position].token_id)
    return out


def test_seeded_row_is_reproducible_regardless_of_batch():
    alone = run_seeded(8, batch_others=0, sampler_seed=0)
    crowded = run_seeded(8, batch_others=4, sampler_seed=7)
    assert alone == crowded
    assert len(set(alone)) > 1  # really sampled, not a constant
    assert run_seeded(8, batch_others=0, sampler_seed=0, seed=4321) != alone


def test_unseeded_rows_follow_the_sampler_seed():
    logits = torch.zeros(1, 1000)
    first = Sampler(5, CPU)(logits, [row()])[0].token_id
    assert Sampler(5, CPU)(logits, [row()])[0].token_id == first
    assert len({Sampler(s, CPU)(logits, [row()])[0].token_id for s in range(10)}) > 1


def test_forget_restarts_a_requests_generator():
    sampler = Sampler(0, CPU)
    logits = torch.zeros(1, 1000)
    first = [sampler(logits, [row(seed=3)])[0].token_id for _ in range(3)]
    sampler.forget(["r"])
    again = [sampler(logits, [row(seed=3)])[0].token_id for _ in range(3)]
    assert first == again
    assert len(set(first)) > 1


def test_every_tensor_the_sampler_makes_is_on_the_logits_device():
    """A tensor made without a device lands on the default one, the CPU, which on a GPU is
    not where the logits are (random sampling once failed on every row on CUDA so). With the
    default device switched to `meta`, any such tensor meets the CPU logits and fails here,
    on a machine without a GPU; every feature of the sampler takes part."""
    logits = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    bad = row("bad words", output=[5, 6], temperature=0.8)
    bad.bad_words_token_ids = [[6, 7], [9]]
    rows = [row("plain"), row("seeded", seed=3, temperature=0.7),
            row("filtered", top_k=5, top_p=0.8, min_p=0.05),
            row("penalised", output=[3, 3, 7], repetition_penalty=1.3,
                frequency_penalty=0.5, presence_penalty=0.2),
            row("controlled", logit_bias={4: 5.0}, allowed_token_ids=[1, 2, 4, 9]),
            bad, row("min tokens", stop=[2], min_tokens=3, temperature=0.5),
            row("greedy", temperature=0.0, logprobs=3)]
    expected = Sampler(0, CPU)(logits.clone(), rows)
    torch.set_default_device("meta")
    try:
        sampled = Sampler(0, CPU)(logits.clone(), rows)
    finally:
        torch.set_default_device(None)
    assert [t.token_id for t in sampled] == [t.token_id for t in expected]
    assert sampled[-1].logprobs == expected[-1].logprobs


def mixed_rows(count: int, vocab: int, seed: int) -> List[SamplingRow]:
    """Rows of every feature at random, their ids at the vocabulary's two ends among them (a
    row's place in the flat view of the batch ends where the next row's begins)."""
    rng = np.random.default_rng(seed)
    edge = [0, 1, vocab - 2, vocab - 1]
    rows = []
    for i in range(count):
        pick = lambda: rng.random() < 0.4  # noqa: E731
        params = dict(temperature=0.0) if pick() else dict(temperature=0.9, seed=i)
        if pick():
            params.update(repetition_penalty=float(rng.choice([0.7, 1.3, 2.0])))
        if pick():
            params.update(frequency_penalty=float(rng.uniform(-1, 1)),
                          presence_penalty=float(rng.uniform(-1, 1)))
        if pick():
            params.update(logit_bias={int(t): float(rng.uniform(-5, 5))
                                      for t in rng.choice(edge + [7, 9], 3, replace=False)})
        if pick():
            params.update(allowed_token_ids=sorted({int(t) for t in rng.choice(vocab, 12)}
                                                   | {edge[i % 4]}))
        if pick():
            params.update(logprobs=int(rng.integers(0, 6)))
        if pick() and params["temperature"] > 0:
            params.update(top_k=5, top_p=0.8)
        output = [int(t) for t in rng.choice(edge + [3, 4, 5], int(rng.integers(0, 6)))]
        r = row(f"r{i}", prompt=[int(t) for t in rng.choice(vocab, 4)] + [edge[(i + 1) % 4]],
                output=output, stop=[edge[i % 4]], min_tokens=int(rng.integers(0, 8)),
                **params)
        r.bad_words_token_ids = [[edge[(i + 2) % 4]], [output[-1], 6]] if output else []
        rows.append(r)
    return rows


@pytest.mark.usefixtures("kernel_path")
def test_each_row_of_a_mixed_batch_samples_as_it_would_alone():
    """Controls, penalties and logprobs are applied to the whole batch at once, through one
    flat index of (row, token): every row must come out as it does alone."""
    vocab = 40
    for seed in range(4):
        rows = mixed_rows(24, vocab, seed)
        logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed))
        together = Sampler(0, CPU)(logits.clone(), rows)
        for i, r in enumerate(rows):
            alone = Sampler(0, CPU)(logits[i:i + 1].clone(), [r])[0]
            assert together[i].token_id == alone.token_id, (seed, i)
            if alone.logprobs is None:
                assert together[i].logprobs is None
                continue
            assert list(together[i].logprobs) == list(alone.logprobs), (seed, i)
            for token, entry in alone.logprobs.items():
                assert together[i].logprobs[token].rank == entry.rank
                assert together[i].logprobs[token].logprob == pytest.approx(entry.logprob,
                                                                            abs=1e-6)


def test_penalties_follow_vllms_formulas_on_every_row():
    """Repetition on each token of prompt or output once, then frequency times the output
    count, then presence once; nothing else in any row moves."""
    vocab = 30
    rows = mixed_rows(16, vocab, seed=9)
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(1))
    got = Sampler._apply_penalties(logits.clone(), rows)
    for i, r in enumerate(rows):
        expected = logits[i].double().clone()
        p = r.params
        for token in set(r.all_token_ids):
            value = expected[token]
            expected[token] = value / p.repetition_penalty if value > 0 else \
                value * p.repetition_penalty
        for token, count in Counter(r.all_token_ids[r.num_prompt_tokens:]).items():
            expected[token] -= p.frequency_penalty * count + p.presence_penalty
        assert torch.allclose(got[i].double(), expected, atol=1e-5), i


# ------------------------------------------------------------------- logprobs
@pytest.mark.parametrize("implementation", ["kernel", "portable kernel", "torch"])
def test_logprobs_follow_log_softmax_to_float64_precision(implementation, request,
                                                          monkeypatch):
    """Logprobs on the native kernel (this CPU's build and a portable one) and on torch's path
    against float64: each row's logprob at its token, its rank (1 + the tokens of a larger
    logit) and its 20 most likely tokens, of equal logits the lower id first on the kernel
    (torch's topk leaves ties in any order). Logits on a grid of 1/16 (two distinct ones
    never round to one logprob), ties, masked tokens, a row of one value, and rows of a NaN
    or +inf logit (which the kernel leaves to torch's path)."""
    from fulcrum import kernels
    from fulcrum.worker.sampler import _logprob_parts

    if implementation == "portable kernel":
        request.getfixturevalue("portable_sampling_kernel")
    if implementation == "torch":
        monkeypatch.setattr(kernels, "can_sample", lambda logits: False)
    generator = torch.Generator().manual_seed(5)
    rows, vocab, top = 12, 1003, 20  # no multiple of the kernel's vector or chunk widths
    logits = torch.randint(-160, 160, (rows, vocab), generator=generator).float() / 16
    logits[1, ::3] = float("-inf")
    logits[2] = 0.5
    logits[3, 10:] = float("-inf")  # fewer finite logits than the top asked for
    logits[4, vocab - 1] = 30.0  # the largest in the last, partial chunk
    logits[5, 7] = float("nan")
    logits[6, 9] = float("inf")
    tokens = torch.randint(0, vocab, (rows,), generator=generator).tolist()
    tokens[1], tokens[3], tokens[4] = 3, 9, vocab - 1  # masked (-inf); the last finite; the top
    chosen, ranks, values, ids = _logprob_parts(logits, tokens, top)
    reference = torch.log_softmax(logits.double(), dim=-1)
    for r, token in enumerate(tokens):
        if r in (5, 6):  # not finite: torch's answer
            assert math.isnan(chosen[r]), r
            continue
        assert chosen[r] == pytest.approx(reference[r, token].item(), rel=1e-6, abs=1e-5), r
        assert ranks[r] == 1 + int((logits[r] > logits[r, token]).sum()), r
        order = sorted(range(vocab), key=lambda i: (-logits[r, i].item(), i))[:top]
        if implementation == "torch":
            assert logits[r, ids[r]].tolist() == logits[r, order].tolist(), r
        else:
            assert ids[r] == order, r
        assert values[r] == pytest.approx(reference[r, ids[r]].tolist(), rel=1e-6, abs=1e-5)
    assert _logprob_parts(logits, tokens, 0)[2] == [[]] * rows
    if implementation != "torch":  # a token outside the vocabulary is left to torch's path
        answered = kernels.logprobs(logits[:3], [vocab, -1, 10 ** 7], 2)[4]
        assert answered.tolist() == [False, False, False]


def test_logprobs_report_rank_and_top_k_of_raw_distribution():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    raw = torch.log_softmax(logits[0], dim=-1)
    result = Sampler(0, CPU)(logits, [row(temperature=0.0, logprobs=3)])[0]
    assert result.token_id == 1
    assert set(result.logprobs) == {1, 2, 0}
    assert result.logprobs[1].rank == 1
    assert result.logprobs[2].rank == 2
    assert result.logprobs[0].rank == 3
    for token, entry in result.logprobs.items():
        assert entry.logprob == pytest.approx(raw[token].item(), abs=1e-6)


def test_logprobs_of_a_penalised_choice_are_raw_with_true_rank():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    raw = torch.log_softmax(logits[0], dim=-1)
    # Token 1 is seen and penalised (3.0 -> 0.75): greedy takes token 2, raw rank 2.
    result = Sampler(0, CPU)(logits, [row(prompt=[1], temperature=0.0, repetition_penalty=4.0,
                                          logprobs=1)])[0]
    assert result.token_id == 2
    assert set(result.logprobs) == {2, 1}
    assert result.logprobs[2].rank == 2
    assert result.logprobs[2].logprob == pytest.approx(raw[2].item(), abs=1e-6)
    assert result.logprobs[1].rank == 1


def test_logprobs_zero_returns_only_the_sampled_token_and_none_returns_nothing():
    logits = torch.tensor([[0.0, 1.0, 2.0]] * 2)
    rows = [row("a", temperature=0.0, logprobs=0), row("b", temperature=0.0)]
    a, b = Sampler(0, CPU)(logits, rows)
    assert list(a.logprobs) == [2]
    assert a.logprobs[2].rank == 1
    assert b.logprobs is None


# ------------------------------------------------------------- end to end: LLM
@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), num_gpu_blocks_override=128, max_model_len=256)


PROMPTS = ["The quick brown fox", "hello", "a b c d e f g", "0123456789", "zzz"]


def completion(llm: LLM, prompt, **params):
    return llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0].outputs[0]


def test_a_tiny_repetition_penalty_leaves_a_token_to_sample(llm):
    """12 / 2e-38 is past float32's range: +inf logits left no token to sample (finish
    "error"); they are the largest finite value instead."""
    for temperature in (0.0, 0.7):  # sampled too: the largest logits' weight must stay 1
        output = completion(llm, PROMPTS[0], temperature=temperature, max_tokens=4,
                            ignore_eos=True, repetition_penalty=2e-38, seed=0)
        assert output.finish_reason == "length" and len(output.token_ids) == 4


def test_seed_reproducible_across_batch_compositions(llm):
    params = SamplingParams(temperature=1.0, seed=2024, max_tokens=20, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.9, max_tokens=5 + 7 * i, ignore_eos=True,
                             seed=(i if i % 2 else None)) for i in range(4)]
    batch = llm.generate(PROMPTS[1:3] + [PROMPTS[0]] + PROMPTS[3:],
                         others[:2] + [params] + others[2:], use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    assert len(alone) == 20
    other_seed = SamplingParams(temperature=1.0, seed=2025, max_tokens=20, ignore_eos=True)
    assert llm.generate([PROMPTS[0]], other_seed, use_tqdm=False)[0].outputs[0].token_ids \
        != alone


def test_seed_minus_one_means_no_seed(llm):
    """vLLM reads seed=-1 as no seed (clients send it for "random"): calls differ, where a
    seed of -1 made every call give the same tokens."""
    assert SamplingParams(seed=-1).seed is None
    runs = {tuple(completion(llm, PROMPTS[0], temperature=1.0, seed=-1, max_tokens=12,
                             ignore_eos=True).token_ids) for _ in range(3)}
    assert len(runs) == 3


def test_a_child_whose_derived_seed_is_minus_one_keeps_it(llm):
    """n=3 with seed -3: the children's seeds are -3, -2 and -1 (vLLM's seed + index), and
    the last is a seed like the others, not the "no seed" a request's -1 means."""
    params = SamplingParams(n=3, temperature=1.0, seed=-3, max_tokens=10, ignore_eos=True)
    runs = [[c.token_ids for c in llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs]
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_stop_string_ends_request_and_is_excluded(llm):
    full = completion(llm, PROMPTS[0], temperature=0.0, max_tokens=30, ignore_eos=True)
    text = full.text
    k, stop = next((k, text[k:k + 2]) for k in range(3, len(text) - 2)
                   if "\ufffd" not in text[k:k + 2] and text.find(text[k:k + 2]) == k)
    cut = completion(llm, PROMPTS[0], temperature=0.0, max_tokens=30, ignore_eos=True,
                     stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.stop_reason == stop
    assert cut.text == text[:k]
    assert len(cut.token_ids) < len(full.token_ids)
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)]
    kept = completion(llm, PROMPTS[0], temperature=0.0, max_tokens=30, ignore_eos=True,
                      stop=[stop], include_stop_str_in_output=True)
    assert kept.text == text[:k + len(stop)]
    assert kept.finish_reason == "stop" and kept.stop_reason == stop
    # A stop token whose text completes a stop string: the string is the reason (vLLM's).
    cut_token = kept.token_ids[-1]
    assert cut_token not in kept.token_ids[:-1]  # so it stops there, not before
    both = completion(llm, PROMPTS[0], temperature=0.0, max_tokens=30, ignore_eos=True,
                      stop=[stop], include_stop_str_in_output=True, stop_token_ids=[cut_token])
    assert (both.text, both.token_ids[-1]) == (kept.text, cut_token)
    assert both.finish_reason == "stop" and both.stop_reason == stop
    # The last token max_tokens allows completes the string: the string ended it (vLLM).
    last = completion(llm, PROMPTS[0], temperature=0.0, max_tokens=len(cut.token_ids),
                      ignore_eos=True, stop=[stop])
    assert (last.text, last.token_ids) == (cut.text, cut.token_ids)
    assert last.finish_reason == "stop" and last.stop_reason == stop
    short = completion(llm, PROMPTS[0], temperature=0.0, max_tokens=len(cut.token_ids) - 1,
                       ignore_eos=True, stop=[stop])
    assert short.finish_reason == "length" and short.stop_reason is None


def test_stop_token_id_ends_request(llm):
    full = completion(llm, PROMPTS[1], temperature=0.0, max_tokens=30, ignore_eos=True)
    ids = full.token_ids
    i = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    cut = completion(llm, PROMPTS[1], temperature=0.0, max_tokens=30, ignore_eos=True,
                     stop_token_ids=[ids[i]])
    assert cut.finish_reason == "stop"
    assert cut.stop_reason == ids[i]
    assert cut.token_ids == ids[:i + 1]
    before = completion(llm, PROMPTS[1], temperature=0.0, max_tokens=i, ignore_eos=True)
    assert cut.text == before.text  # the stop token's own text is left out
    assert full.finish_reason == "length" and full.stop_reason is None


@pytest.fixture(scope="module")
def eos_llm(llama_dir, llm, tmp_path_factory):
    """The tiny llama with its greedy first token for PROMPTS[2] declared as an EOS id."""
    first = completion(llm, PROMPTS[2], temperature=0.0, max_tokens=1, ignore_eos=True)
    eos = first.token_ids[0]
    folder = tmp_path_factory.mktemp("eos_llama")
    for item in llama_dir.iterdir():
        shutil.copy(item, folder / item.name)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return LLM(str(folder), num_gpu_blocks_override=64, max_model_len=256), eos


def test_eos_stops_with_the_stop_reason_vllm_gives(eos_llm, llama_dir, tmp_path):
    """A stop on the tokenizer's EOS has no stop_reason; a stop on another eos id the
    model's generation config lists reports that id, as vLLM (which adds those to the
    request's stop_token_ids) reports it: fulcrum said None for both, so a Llama 3.1 answer
    ending in <|eom_id|> (a tool call to run) read like one ending in <|eot_id|>."""
    model, eos = eos_llm
    out = completion(model, PROMPTS[2], temperature=0.0, max_tokens=10)
    assert out.token_ids == [eos]
    assert out.finish_reason == "stop"
    assert out.stop_reason == eos
    assert out.text == ""
    folder = tmp_path / "model"
    shutil.copytree(llama_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["eos_token"] = model.get_tokenizer().id_to_token(eos)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    primary_llm = LLM(str(folder), num_gpu_blocks_override=64, max_model_len=256)
    primary = completion(primary_llm, PROMPTS[2], temperature=0.0, max_tokens=10)
    assert (primary.token_ids, primary.finish_reason, primary.stop_reason) == ([eos], "stop",
                                                                               None)
    # vLLM checks the EOS before stop_token_ids: listed there too, it still has no
    # stop_reason, unless ignore_eos leaves the list alone to stop on it.
    reasons = [completion(primary_llm, PROMPTS[2], temperature=0.0, max_tokens=10,
                          stop_token_ids=[eos], ignore_eos=ignore).stop_reason
               for ignore in (False, True)]
    assert reasons == [None, eos]


def test_min_tokens_holds_off_eos(eos_llm):
    model, eos = eos_llm
    out = completion(model, PROMPTS[2], temperature=0.0, max_tokens=12, min_tokens=5)
    assert len(out.token_ids) >= 5
    assert eos not in out.token_ids[:5]
    ignored = completion(model, PROMPTS[2], temperature=0.0, max_tokens=6, ignore_eos=True)
    assert ignored.token_ids[0] == eos and len(ignored.token_ids) == 6


def test_n_returns_n_distinct_completions(llm):
    out = llm.generate([PROMPTS[3]], SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8,
                                                    ignore_eos=True), use_tqdm=False)
    assert len(out) == 1
    completions = out[0].outputs
    assert [c.index for c in completions] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in completions)
    assert len({tuple(c.token_ids) for c in completions}) == 3
    again = llm.generate([PROMPTS[3]], SamplingParams(n=3, temperature=1.0, seed=11,
                                                      max_tokens=8, ignore_eos=True),
                         use_tqdm=False)
    assert [c.token_ids for c in again[0].outputs] == [c.token_ids for c in completions]


def test_logprobs_true_asks_for_one_as_in_vllm(llm):
    """vLLM's SamplingParams read logprobs=True (and prompt_logprobs=True) as 1; they were
    refused as not integers."""
    params = SamplingParams(logprobs=True, prompt_logprobs=True, max_tokens=2, temperature=0.0)
    assert (params.logprobs, params.prompt_logprobs) == (1, 1)
    output = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    assert all(1 <= len(entry) <= 2 for entry in output.outputs[0].logprobs)
    assert all(1 <= len(entry) <= 2 for entry in output.prompt_logprobs[1:])


def test_logprobs_through_llm_match_cumulative(llm):
    out = completion(llm, PROMPTS[4], temperature=0.0, max_tokens=6, ignore_eos=True,
                     logprobs=2)
    assert len(out.logprobs) == 6
    total = 0.0
    for token, entry in zip(out.token_ids, out.logprobs):
        assert entry[token].rank == 1  # greedy picks the top token
        assert 2 <= len(entry) <= 3
        assert math.isfinite(entry[token].logprob) and entry[token].logprob <= 0
        total += entry[token].logprob
    assert out.cumulative_logprob == pytest.approx(total)


def preemption_run(llama_dir, params: SamplingParams):
    """The request [5..9] with `params`, alone and behind an older greedy one in a KV cache
    too small for both (8 blocks of 4 tokens; each grows to 29 tokens), which preempts it."""
    alone = LLM(str(llama_dir), max_model_len=32, block_size=4, num_gpu_blocks_override=32)
    solo = alone.generate([[5, 6, 7, 8, 9]], params, use_tqdm=False)[0]
    tight = LLM(str(llama_dir), max_model_len=32, block_size=4, num_gpu_blocks_override=9)
    older = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    crowded = tight.generate([[1, 2, 3, 4, 10], [5, 6, 7, 8, 9]], [older, params],
                             use_tqdm=False)[1]
    return solo, crowded


def test_preempted_greedy_request_matches_its_solo_run(llama_dir):
    solo, crowded = preemption_run(
        llama_dir, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert crowded.metrics.num_preemptions >= 1
    assert crowded.outputs[0].token_ids == solo.outputs[0].token_ids


def test_preempted_seeded_request_matches_its_solo_run(llama_dir):
    solo, crowded = preemption_run(
        llama_dir, SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True))
    assert crowded.outputs[0].token_ids == solo.outputs[0].token_ids


# ------------------------------------------------------------ inverse CDF
def test_inverse_cdf_matches_a_float64_prefix_sum_everywhere():
    generator = torch.Generator().manual_seed(0)
    probs = torch.rand(3, 1000, generator=generator) ** 8  # many tiny probabilities
    probs[:, 500:700] = 0.0  # masked tokens
    probs /= probs.sum(dim=-1, keepdim=True)
    u = torch.rand(3, 400, generator=generator, dtype=torch.float64)
    cdf, draws = probs.double().cumsum(dim=-1).numpy(), u.numpy()
    for i in range(3):
        tokens = [int(_inverse_cdf(probs[i:i + 1], u[i, j].view(1, 1), block=64))
                  for j in range(400)]
        expected = np.searchsorted(cdf[i], draws[i] * cdf[i, -1], side="right").tolist()
        assert tokens == expected


def test_inverse_cdf_never_draws_a_token_of_probability_zero():
    probs = torch.zeros(2, 300)
    probs[0, [3, 250]] = torch.tensor([0.25, 0.75])  # 250 sits in a partial last block
    probs[1, 299] = 1.0
    edges = torch.tensor([[0.0], [1.0 - 2 ** -53]], dtype=torch.float64)
    for u in edges:
        tokens = _inverse_cdf(probs, u.expand(2, 1), block=128).tolist()
        assert tokens[0] in (3, 250) and tokens[1] == 299
    assert _inverse_cdf(probs, edges[:1].expand(2, 1), block=128).tolist() == [3, 299]
    assert _inverse_cdf(probs, edges[1:].expand(2, 1), block=128).tolist() == [250, 299]


# ------------------------------------------------------------ the sampling rules
def _reference_draws(logits: torch.Tensor, temperature: float, min_p: float, top_k: int,
                     top_p: float, u: np.ndarray):
    """The sampling rules in float64, for one row at many uniforms: the tokens, and for each
    whether float32 rounding could decide it otherwise (a weight, a nucleus mass or the draw
    within 1e-5 of its threshold)."""
    x = logits.double().numpy() / temperature
    finite = np.isfinite(x)
    w = np.where(finite, np.exp(x - x[finite].max()), 0.0)
    # (the largest logits' weight is exactly 1: min_p=1 keeps them whatever the rounding)
    near = bool(min_p) and bool(np.any((np.abs(w - min_p) <= 1e-5 * min_p) & (w < 1)))
    w[w < min_p] = 0.0
    order = sorted(np.flatnonzero(w > 0), key=lambda i: (-x[i], i))  # of equal x, lower id
    if 0 < top_k < len(order):
        near |= 0 < x[order[top_k - 1]] - x[order[top_k]] <= 1e-5 * abs(x[order[top_k]])
        order = order[:top_k]
    if top_p < 1.0:
        probs = w[order] / w[order].sum()
        before = np.cumsum(probs) - probs
        near |= bool(np.any(np.abs(before - top_p) <= 1e-5))
        order = order[:max(1, int(np.sum(before < top_p)))]
    kept = np.zeros_like(w)
    kept[order] = w[order]
    cdf = np.cumsum(kept)
    target = u * cdf[-1]
    tokens = np.searchsorted(cdf, target, side="right")
    gap = np.min(np.abs(cdf[None, :] - target[:, None]), axis=1)
    return tokens, near | (gap <= 1e-5 * cdf[-1])


@pytest.fixture
def portable_sampling_kernel(tmp_path, monkeypatch):
    """kernels.sample on a build of sampling.cpp for any x86-64 CPU (no AVX2: its portable
    loops), where this machine's build would take its vector ones."""
    import ctypes
    import platform
    import subprocess

    from fulcrum import kernels

    if kernels.compiler() is None or platform.machine() != "x86_64":
        pytest.skip("needs a C++ compiler for x86-64")
    flags = ["-march=x86-64" if flag == "-march=native" else flag for flag in kernels.FLAGS]
    built = tmp_path / "sampling.so"
    subprocess.run([kernels.compiler(), *flags, str(kernels.KERNEL_DIR / "sampling.cpp"), "-o",
                    str(built)], check=True, capture_output=True, timeout=300)
    library = ctypes.CDLL(str(built))
    kernels.declare_sampling(library)
    monkeypatch.setattr(kernels, "_sampling_library", lambda: library)


@pytest.mark.parametrize("implementation", ["kernel", "portable kernel", "torch"])
def test_sampling_follows_its_rules_to_float64_precision(implementation, request):
    """kernels.sample (this CPU's build and a portable one) and the torch path against the
    rules computed in float64: temperature, min_p, top_k (ties: the lower token id first,
    which bf16 logits make common), top_p renormalised over top_k, and the inverse CDF in
    vocabulary order, on rows with masked tokens; a draw may differ only where float32
    rounding could decide it otherwise."""
    from fulcrum import kernels
    from fulcrum.worker.sampler import _sample_with_torch

    if implementation == "portable kernel":
        request.getfixturevalue("portable_sampling_kernel")
    elif implementation == "kernel" and kernels._sampling_library() is None:
        pytest.skip("no C++ compiler")
    generator = torch.Generator().manual_seed(0)
    cases = [dict(), dict(top_p=0.9), dict(top_k=20), dict(top_k=50, top_p=0.6),
             dict(min_p=0.05), dict(min_p=0.01, top_k=30, top_p=0.8), dict(top_k=1),
             dict(top_p=0.3), dict(top_k=700, top_p=0.95), dict(min_p=1.0),
             dict(top_k=990, top_p=0.95)]
    draws = exact = 0
    for case_number, case in enumerate(cases):
        params = SamplingParams(temperature=[0.6, 1.0, 1.7][case_number % 3], **case)
        for trial in range(12):
            logits = torch.randn(1000, generator=generator) * (0.5 + trial / 2)
            if trial % 2:
                logits = logits.bfloat16().float()  # many equal logits
            if trial % 3 == 0:
                logits[trial::5] = float("-inf")  # masked tokens
            u = torch.rand(40, 1, generator=generator, dtype=torch.float64)
            rows = logits.expand(40, -1).contiguous()
            if implementation != "torch":
                got = kernels.sample(rows, [params.temperature] * 40, [params.min_p] * 40,
                                     [params.top_k] * 40, [params.top_p] * 40, u)
            else:
                got = _sample_with_torch(rows, [params] * 40, u)
            expected, near = _reference_draws(logits, params.temperature, params.min_p,
                                              params.top_k, params.top_p, u.numpy()[:, 0])
            for token, want, either in zip(got.tolist(), expected.tolist(), near.tolist()):
                draws += 1
                exact += not either
                assert token == want or either, (case, trial, token, want)
    assert exact >= 0.97 * draws  # the comparison is not left to the tolerance


# ------------------------------------------------------------ nothing to sample
@pytest.mark.usefixtures("kernel_path")
def test_a_row_with_nothing_to_sample_is_the_requests_fault_unless_the_model_is():
    from fulcrum.outputs import RequestFault
    from fulcrum.worker.sampler import RowsFailed

    def failure(logits, row_):
        with pytest.raises(RowsFailed) as caught:
            Sampler(0, CPU)(logits, [row_])
        return caught.value.failures[0]

    for params in (dict(temperature=0.0), dict(temperature=1.0, seed=1)):
        # Every token ruled out by the request's own controls: a RequestFault.
        constrained = row("x", allowed_token_ids=[2], **params)
        constrained.bad_words_token_ids = [[2]]
        why = failure(torch.tensor([[1.0, 2.0, 3.0]]), constrained)
        assert isinstance(why, RequestFault) and why.startswith("no token can be sampled")
        # NaN from the model itself, under a request's penalties: the engine's fault.
        why = failure(torch.tensor([[1.0, math.nan, 3.0]]),
                      row("y", prompt=[1], presence_penalty=1.0, **params))
        assert why == "the model's logits are not finite"
        assert not isinstance(why, RequestFault)
    # A sampled (not greedy) row of untouched NaN or +inf logits lands outside the vocabulary.
    for bad in (torch.full((1, 3), math.nan), torch.tensor([[0.0, math.inf, 1.0]])):
        why = failure(bad, row("z", temperature=1.0, seed=1))
        assert why == "the model's logits are not finite"
    # Unchanged logits rule nothing out: a greedy row takes its argmax, as torch.argmax and
    # vLLM would (a NaN's index included).
    sampler = Sampler(0, CPU)
    assert sampler(torch.tensor([[1.0, math.nan]]), [row(temperature=0.0)])[0].token_id == 1
    assert sampler(torch.tensor([[-math.inf, -math.inf]]), [row(temperature=0.0)])[
        0].token_id in (0, 1)


@pytest.mark.usefixtures("kernel_path")
def test_a_row_with_nothing_to_sample_leaves_the_seeded_rows_beside_it_alone():
    """The other rows keep the tokens of the batch's one draw: drawing them again would move
    a seeded request's generator on and change its output."""
    def batch(with_bad_row: bool):
        rows = [row(f"s{i}", temperature=1.0, seed=i) for i in range(3)]
        logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(7))
        if with_bad_row:
            rows[1] = row("bad", temperature=1.0, seed=1, allowed_token_ids=[4])
            rows[1].bad_words_token_ids = [[4]]
        try:
            return [t.token_id for t in Sampler(0, CPU)(logits, rows)]
        except RowsFailed as error:
            assert list(error.failures) == [1]
            return [t and t.token_id for t in error.sampled]

    from fulcrum.worker.sampler import RowsFailed

    alone, beside = batch(False), batch(True)
    assert beside[1] is None and [beside[0], beside[2]] == [alone[0], alone[2]]

"""Bad input is refused with a ValueError that names the problem, and refusing it leaves the
engine intact: queued good requests still finish and every KV block comes back. Aborts free
blocks too. Broken model folders fail at load time with a clear error."""

from __future__ import annotations

import json
import math
import re
import shutil
import time

import pytest
import torch

from conftest import VOCAB
from fulcrum import LLM, SamplingParams
from fulcrum.sampling_params import StructuredOutputsParams
from fulcrum.config import EngineConfig
from fulcrum.models import SUPPORTED_ARCHITECTURES

MAX_LEN = 64


@pytest.fixture
def llm(llama_dir):
    return LLM(str(llama_dir), max_model_len=MAX_LEN, block_size=4)


def ids(*token_ids):
    return {"prompt_token_ids": list(token_ids)}


def run_to_completion(engine):
    """Step until idle; return every output, and the final one of each request."""
    seen, final = [], {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen.append(output)
            if output.finished:
                assert output.request_id not in final, "a request finished twice"
                final[output.request_id] = output
    return seen, final


def assert_all_blocks_free(engine, live=()):
    """The block bookkeeping is consistent and, once nothing is live, every block is free."""
    manager = engine.block_manager
    manager.check_invariants(list(live))
    if not live:
        assert manager.num_free_blocks == manager.num_usable_blocks


# ----------------------------------------------------------------- prompts
BAD_PROMPTS = {
    "empty token ids": (ids(), "empty"),
    "empty string": ("", "empty"),
    "too long": (ids(*[5] * (MAX_LEN + 1)), f"{MAX_LEN + 1} tokens.*maximum model length of "
                                             f"{MAX_LEN}"),
    "out of vocabulary": (ids(1, 2, VOCAB), f"token id {VOCAB} is out of vocabulary"),
    "far out of vocabulary": (ids(10**9), "out of vocabulary"),
    "negative": (ids(4, -1, 5), "token id -1 is out of vocabulary"),
}


@pytest.mark.parametrize("name", list(BAD_PROMPTS))
def test_bad_prompt_raises_and_queues_nothing(llm, name):
    prompt, message = BAD_PROMPTS[name]
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    # Together with good prompts: the whole call is refused before anything is queued.
    with pytest.raises(ValueError, match=message):
        llm.generate([ids(1, 2, 3), prompt, "hello"], SamplingParams(max_tokens=2),
                     use_tqdm=False)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.get_num_unfinished_requests() == 0
    # The engine still works.
    (output,) = llm.generate(ids(1, 2, 3), SamplingParams(max_tokens=3, ignore_eos=True),
                             use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 3
    assert_all_blocks_free(engine)


def test_text_with_a_lone_surrogate_is_refused_by_name(llm):
    # Python strings may hold one ("\ud800" without its pair); no Unicode text does.
    with pytest.raises(ValueError, match="lone UTF-16 surrogate at character 1"):
        llm.generate("a\ud800b", SamplingParams(max_tokens=1), use_tqdm=False)
    blocks = llm.llm_engine.block_manager
    assert not llm.llm_engine.has_unfinished_requests()
    assert blocks.num_free_blocks == blocks.num_blocks - 1


def test_prompt_dict_keys_fulcrum_does_not_read_are_refused(llm):
    for prompt in ({"prompt": "hi", "multi_modal_data": {"image": "x.png"}},
                   {"prompt_token_ids": [5], "token_type_ids": [0]}):
        with pytest.raises(ValueError, match="a prompt dict has keys fulcrum does not read"):
            llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate({"prompt": "hi", "multi_modal_data": None, "cache_salt": "s"},
                       SamplingParams(max_tokens=1), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 1


def test_prompt_plus_max_tokens_must_fit_max_model_len(llm):
    (output,) = llm.generate(ids(*[7] * (MAX_LEN - 3)), SamplingParams(max_tokens=3,
                                                                       ignore_eos=True),
                             use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 3
    # One token more is refused up front, naming both numbers, not silently clamped.
    with pytest.raises(ValueError, match=f"{MAX_LEN} tokens.*{MAX_LEN - 3} prompt tokens "
                                         f"\\+ max_tokens 4 = {MAX_LEN + 1}"):
        llm.generate(ids(*[7] * (MAX_LEN - 3)), SamplingParams(max_tokens=4), use_tqdm=False)
    # Without max_tokens the request gets the room its prompt leaves; a full prompt has none.
    (output,) = llm.generate(ids(*[7] * (MAX_LEN - 2)), SamplingParams(max_tokens=None,
                                                                       ignore_eos=True),
                             use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate(ids(*[7] * MAX_LEN), SamplingParams(max_tokens=None), use_tqdm=False)
    assert_all_blocks_free(llm.llm_engine)


# -------------------------------------------------------- sampling params
BAD_PARAMS = [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=-0.1), "top_p"),
    (dict(n=0), "n must"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(logprobs=-1), "logprobs"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(top_p=float("nan")), "top_p must be a finite number"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite number"),
    # 1e-300 is 0 in float32: the request failed at its first step with no token to sample.
    (dict(repetition_penalty=1e-300), "repetition_penalty must be greater than zero, within"),
    (dict(repetition_penalty=1e300), "within float32's range"),
    (dict(presence_penalty=float("-inf")), "presence_penalty must be a finite number"),
    (dict(seed=2 ** 63), "seed must be an integer in"),
    (dict(seed=-(2 ** 63) - 1), "seed must be an integer in"),
    (dict(seed=1.5), "seed"),
    (dict(n=True), "n must"),
    (dict(stop=["x"] * 65), "stop has 65 strings, more than the 64"),
    (dict(stop=["x" * 1025]), "at most 1024 characters"),
    (dict(stop=[""]), "stop must be non-empty strings"),
    (dict(stop=5), "stop must be a list, got 5"),
    (dict(stop_token_ids=7), "stop_token_ids must be a list, got 7"),
    (dict(max_tokens=2.0), "max_tokens must be an integer >= 1, got 2.0"),
    (dict(output_kind=5), "output_kind must be a RequestOutputKind, got 5"),
    (dict(stop_token_ids=list(range(1025))), "stop_token_ids has 1025 ids"),
    # Strings that are no Unicode text failed later, where they were tokenized, naming nothing.
    (dict(stop=["ok", "x\ud800"]), "stop.1 is not valid Unicode"),
    (dict(bad_words=["x\udc00"]), "bad_words.0 is not valid Unicode"),
    # Switches read by truthiness took "no" for yes; None crashed inside the tokenizer.
    (dict(ignore_eos="no"), "ignore_eos must be True or False, got 'no'"),
    (dict(skip_special_tokens=None), "skip_special_tokens must be True or False, got None"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output must be True or False"),
]


@pytest.mark.parametrize("kwargs,field", BAD_PARAMS, ids=[str(k) for k, _ in BAD_PARAMS])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(top_p=1.0), dict(top_p=1e-6), dict(temperature=0.0),
                                    dict(max_tokens=1), dict(top_k=-1), dict(seed=2 ** 63 - 1),
                                    dict(seed=-(2 ** 63)), dict(stop=["x" * 1024] * 64)])
def test_boundary_sampling_params_are_accepted(kwargs):
    SamplingParams(**kwargs)


ENGINE_REFUSALS = [
    (dict(n=129), "n must be at most 128 \\(max_n\\), got 129"),
    (dict(logprobs=21), "logprobs must be at most 20 \\(max_logprobs\\), got 21"),
    (dict(stop_token_ids=[3, VOCAB]), f"stop_token_ids: token id {VOCAB} is out of vocabulary"),
    (dict(allowed_token_ids=[7, 9], stop_token_ids=[9, 7], min_tokens=1),
     "allowed_token_ids holds only stop tokens, which min_tokens holds back"),
]


@pytest.mark.parametrize("kwargs,message", ENGINE_REFUSALS,
                         ids=[str(k) for k, _ in ENGINE_REFUSALS])
def test_engine_limits_refuse_before_queueing(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([ids(1, 2), ids(3, 4)], SamplingParams(max_tokens=2, **kwargs),
                     use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


BAD_ENGINE_ARGS = [
    (dict(block_size=129), "block_size must be at most 128"),
    (dict(block_size=10**6), "block_size must be at most 128"),
    (dict(max_num_seqs=True), "max_num_seqs must be a positive integer, got True"),
    (dict(seed=2**70), "seed must be an integer in"),
    (dict(seed=None), "seed must be an integer, got None"),
    (dict(seed=1.5), "seed must be an integer, got 1.5"),
    (dict(enable_chunked_prefill="no"), "enable_chunked_prefill must be True or False"),
    (dict(gpu_memory_utilization="0.5"), "gpu_memory_utilization must be a number"),
    (dict(long_prefill_token_threshold=1.5),
     "long_prefill_token_threshold must be a non-negative integer, got 1.5"),
]


@pytest.mark.parametrize("kwargs,message", BAD_ENGINE_ARGS,
                         ids=[str(k) for k, _ in BAD_ENGINE_ARGS])
def test_bad_engine_args_are_refused_before_anything_loads(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"block_size": None}, "block_size must be an integer, got None"),
    ({"tensor_parallel_size": None}, "tensor_parallel_size must be an integer, got None"),
    ({"max_n": 2.0}, "max_n must be an integer, got 2.0"),
    ({"gpu_memory_utilization": None}, "gpu_memory_utilization must be a number, got None"),
    ({"dtype": None}, "dtype must be a string, got None"),
    ({"kv_cache_dtype": None}, "kv_cache_dtype must be a string, got None"),
    ({"tokenizer": 5}, "tokenizer must be a string, got 5"),
])
def test_engine_args_of_the_wrong_type_are_named(llama_dir, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(str(llama_dir), **kwargs)


def test_model_folders_may_be_paths(llama_dir):
    llm = LLM(llama_dir, tokenizer=llama_dir, max_model_len=MAX_LEN)
    assert llm.llm_engine.config.model == str(llama_dir)


def test_a_kv_cache_larger_than_the_ram_is_refused_before_it_is_allocated(llama_dir):
    with pytest.raises(ValueError, match=r"a KV cache of 100000000000 blocks would take .* GiB, "
                                         r"more than the .* GiB of RAM available"):
        LLM(str(llama_dir), num_gpu_blocks_override=10**11)
    with pytest.raises(ValueError, match="of RAM available"):
        LLM(str(llama_dir), kv_cache_memory_bytes=10**15)


def test_a_model_larger_than_the_ram_is_refused_before_its_weights_are_allocated(tmp_path):
    """Its pages were committed as it loaded, until the OOM killer ended the process (exit
    137, no message); here one MLP matrix alone is 275 GB."""
    from fulcrum.default_model import ensure_config_folder

    folder = ensure_config_folder(tmp_path / "huge", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 1 << 24, "num_hidden_layers": 1, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": VOCAB, "max_position_embeddings": 512,
        "bos_token_id": 256, "eos_token_id": 258})
    with pytest.raises(ValueError, match=r"the model's weights take 768\.\d GiB in float32, "
                                         r"more than the .* GiB of RAM available"):
        LLM(folder, load_format="dummy", dtype="float32")


def test_none_switches_take_their_default_as_in_vllm():
    config = EngineConfig(enable_prefix_caching=None, enable_chunked_prefill=None)
    assert config.enable_prefix_caching is True and config.enable_chunked_prefill is True


def test_engine_limits_are_engine_args(llama_dir):
    llm = LLM(str(llama_dir), max_model_len=MAX_LEN, max_n=2, max_logprobs=1)
    with pytest.raises(ValueError, match="n must be at most 2"):
        llm.generate(ids(1), SamplingParams(n=3, max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs must be at most 1"):
        llm.generate(ids(1), SamplingParams(logprobs=2, max_tokens=1), use_tqdm=False)
    (output,) = llm.generate(ids(1), SamplingParams(n=2, logprobs=1, max_tokens=1,
                                                    seed=2 ** 63 - 1), use_tqdm=False)
    assert len(output.outputs) == 2  # the second child's seed wraps around, in range


def test_logprobs_past_the_vocabulary_are_refused_where_max_logprobs_allows_them(llama_dir):
    """A max_logprobs past the vocabulary let a request ask for more top tokens than there
    are, which failed the whole step's logprobs, the other requests in it too."""
    llm = LLM(str(llama_dir), max_model_len=MAX_LEN, max_logprobs=VOCAB + 10)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{name} must be at most the vocabulary size"):
            llm.generate(ids(1, 2), SamplingParams(max_tokens=1, **{name: VOCAB + 1}),
                         use_tqdm=False)
    (output,) = llm.generate(ids(1, 2), SamplingParams(max_tokens=1, logprobs=VOCAB,
                                                       prompt_logprobs=VOCAB), use_tqdm=False)
    assert len(output.outputs[0].logprobs[0]) == VOCAB
    assert len(output.prompt_logprobs[1]) == VOCAB


def test_cache_salt_must_be_a_non_empty_string(llm):
    for salt in ("", 5):
        with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
            llm.generate({"prompt_token_ids": [1, 2], "cache_salt": salt},
                         SamplingParams(max_tokens=1), use_tqdm=False)


def test_sampling_params_of_the_wrong_shape_are_named(llm):
    for given, message in [({"temperature": 0}, "got a dict"),
                           (["x"], "got a list holding str"),
                           ([SamplingParams()] * 2, "got 2 sampling_params for 1 prompts")]:
        with pytest.raises((TypeError, ValueError), match=message):
            llm.generate(["a"], given, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, message", [
    (dict(regex="a\ud800"), "regex is not valid Unicode"),
    (dict(choice=["x", "\udc00"]), "choice.1 is not valid Unicode"),
    (dict(json={"enum": ["\ud800"]}), "json.enum.0 is not valid Unicode"),
    (dict(json_object="no"), "json_object must be true or false, got 'no'"),
    (dict(regex="a", disable_any_whitespace=1), "disable_any_whitespace must be true or false"),
])
def test_bad_structured_outputs_params_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_generate_names_a_bad_priority_and_a_bad_token_id(llm):
    for call, message in [(lambda: llm.generate(["a"], priority=0), "priority must be a list"),
                          (lambda: llm.generate(["a"], 5), "sampling_params must be a "
                                                           "SamplingParams or a list of them, "
                                                           "got int"),
                          (lambda: llm.generate([1, 2.0]), "token ids must be integers, got "
                                                           "float 2.0"),
                          (lambda: llm.generate([True, 1]), "got bool True")]:
        with pytest.raises(TypeError, match=message):
            call()
    for empty in ([[]], [()]):  # an empty list of token ids is a prompt, and empty
        with pytest.raises(ValueError, match="the prompt is empty"):
            llm.generate(empty)
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.llm_engine.add_request("empty", [])
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_failure_while_queueing_a_batch_leaves_none_of_it_queued(llm, monkeypatch):
    """Prompts queued before the one that failed were left in the engine with no caller: the
    next call ran them to the end and threw their outputs away."""
    engine, queued = llm.llm_engine, []
    add_request = engine.add_request

    def fail_second(request_id, *args, **kwargs):
        if queued:
            raise ValueError("refused")
        queued.append(request_id)
        return add_request(request_id, *args, **kwargs)

    monkeypatch.setattr(engine, "add_request", fail_second)
    with pytest.raises(ValueError, match="refused"):
        llm.generate(["hello", "there"], SamplingParams(max_tokens=2), use_tqdm=False)
    monkeypatch.undo()
    engine.step()  # reports the abort
    assert queued and not engine.has_unfinished_requests()
    assert_all_blocks_free(engine)
    (output,) = llm.generate("again", SamplingParams(max_tokens=2, ignore_eos=True),
                             use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 2


def test_a_prompt_given_as_an_iterator_is_read_once(llm):
    params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)
    (listed,) = llm.generate(ids(1, 2, 3), params, use_tqdm=False)
    (iterated,) = llm.generate({"prompt_token_ids": iter([1, 2, 3])}, params, use_tqdm=False)
    assert iterated.prompt_token_ids == [1, 2, 3]
    assert iterated.outputs[0].token_ids == listed.outputs[0].token_ids


def test_generate_called_from_inside_generate_is_refused_not_deadlocked(llm):
    class Reentrant:
        def __iter__(self):
            llm.generate("inner", SamplingParams(max_tokens=1), use_tqdm=False)
            return iter([1, 2])

    with pytest.raises(RuntimeError, match="called from inside another of its calls"):
        llm.generate({"prompt_token_ids": Reentrant()}, use_tqdm=False)
    (output,) = llm.generate("after", SamplingParams(max_tokens=1), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 1


def test_request_ids_must_be_non_empty_strings(llm):
    engine = llm.llm_engine
    for request_id in (7, "", b"id"):
        with pytest.raises(TypeError, match="request id must be a non-empty string"):
            engine.add_request(request_id, [1, 2], SamplingParams(max_tokens=1))
        with pytest.raises(TypeError, match="request id must be a non-empty string"):
            engine.abort_request([request_id])
    with pytest.raises(TypeError, match="got 7"):
        engine.abort_request(7)  # not a list of ids to iterate
    assert not engine.has_unfinished_requests()


def test_an_arrival_time_later_than_now_is_refused(llm):
    """vLLM's arrival times are time.time() readings; read on fulcrum's time.monotonic()
    such a request sorted after every later arrival, and starved while others kept
    coming. A past time.monotonic() reading (a replayed trace) still orders the queue."""
    engine = llm.llm_engine
    for bad in (time.time(), time.monotonic() + 60, math.nan, "0"):
        with pytest.raises(ValueError, match="arrival_time must be a time.monotonic"):
            engine.add_request("late", [1, 2], SamplingParams(max_tokens=1), arrival_time=bad)
    assert not engine.has_unfinished_requests()
    engine.add_request("now", [1, 2], SamplingParams(max_tokens=1))
    engine.add_request("earlier", [3, 4], SamplingParams(max_tokens=1),
                       arrival_time=time.monotonic() - 5)
    assert [r.request_id for r in engine.scheduler.waiting] == ["earlier", "now"]
    run_to_completion(engine)


def test_a_full_length_request_fits_the_smallest_cache_allowed(llama_dir):
    llm = LLM(str(llama_dir), max_model_len=MAX_LEN, block_size=4,
              num_gpu_blocks_override=MAX_LEN // 4 + 1)
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        LLM(str(llama_dir), max_model_len=MAX_LEN, block_size=4,
            num_gpu_blocks_override=MAX_LEN // 4)
    (output,) = llm.generate(ids(*[7] * 40), SamplingParams(max_tokens=MAX_LEN - 40,
                                                            ignore_eos=True), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == MAX_LEN - 40
    assert_all_blocks_free(llm.llm_engine)


# ------------------------------------------------------------- engine API
def test_bad_request_between_good_ones_leaves_them_intact(llm):
    engine = llm.llm_engine
    good = {"a": (ids(*range(1, 20)), 7), "b": (ids(30, 31, 32), 12), "c": ("some text", 4)}
    for request_id, (prompt, n) in list(good.items())[:2]:
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    engine.step()  # the good ones are running when the bad one arrives
    with pytest.raises(ValueError, match="out of vocabulary"):
        engine.add_request("bad", ids(1, VOCAB + 5), SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("bad2", ids(), SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", ids(1, 2), SamplingParams(max_tokens=3))
    assert engine.get_num_unfinished_requests() == 2
    engine.add_request("c", good["c"][0], SamplingParams(max_tokens=4, ignore_eos=True))
    # A refused request id was never registered, so it can be used for a good request.
    engine.add_request("bad", ids(9, 9, 9), SamplingParams(max_tokens=2, ignore_eos=True))
    _, final = run_to_completion(engine)
    assert sorted(final) == ["a", "b", "bad", "c"]
    for request_id, (_, n) in good.items():
        assert len(final[request_id].outputs[0].token_ids) == n
        assert final[request_id].outputs[0].finish_reason == "length"
    assert len(final["bad"].outputs[0].token_ids) == 2
    assert_all_blocks_free(engine)


def test_refused_n_gt_1_request_does_not_disturb_a_clashing_id(llm):
    engine = llm.llm_engine
    engine.add_request("0_x", ids(1, 2, 3), SamplingParams(max_tokens=4, ignore_eos=True))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", ids(4, 5, 6), SamplingParams(n=2, max_tokens=4, ignore_eos=True))
    seen, final = run_to_completion(engine)
    assert {o.request_id for o in seen} == {"0_x"}
    assert len(final["0_x"].outputs[0].token_ids) == 4
    assert not engine.output_processor.has_request("x")
    assert_all_blocks_free(engine)


def test_abort_mid_generation_frees_blocks(llm):
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    engine.add_request("keep", ids(*range(1, 11)), params)
    engine.add_request("drop", ids(*range(40, 58)), params)
    engine.add_request("other", ids(3, 4), params)
    last = {}
    # The default (slo) policy sizes prompt chunks by measured step times, so how many steps
    # the prefills take varies; step until "drop" has 5 tokens, within a bound.
    for _ in range(40):
        for output in engine.step():
            last[output.request_id] = output
        if "drop" in last and len(last["drop"].outputs[0].token_ids) == 5:
            break
    assert len(last["drop"].outputs[0].token_ids) == 5
    manager = engine.block_manager
    held_by_drop = len(manager.block_table("drop"))
    assert held_by_drop >= 6  # 18 prompt + 4 computed output tokens in blocks of 4
    free_before = manager.num_free_blocks
    engine.abort_request(["drop", "other", "no-such-request"])
    assert manager.block_table("drop") == []
    assert manager.num_free_blocks >= free_before + held_by_drop
    assert_all_blocks_free(engine, live=["keep"])
    outputs = engine.step()
    aborted = {o.request_id: o for o in outputs if o.outputs[0].finish_reason == "abort"}
    assert sorted(aborted) == ["drop", "other"]
    for output in aborted.values():
        assert output.finished
    # The abort output carries what was generated before it.
    assert aborted["drop"].outputs[0].token_ids == last["drop"].outputs[0].token_ids
    seen, final = run_to_completion(engine)
    assert all(o.request_id == "keep" for o in seen), "an aborted request produced output"
    assert len(final["keep"].outputs[0].token_ids) == 30
    assert_all_blocks_free(engine)


def test_a_shut_down_engine_refuses_requests_and_steps(llm):
    engine = llm.llm_engine
    engine.add_request("queued", ids(5, 6), SamplingParams(max_tokens=3))
    engine.shutdown()
    engine.shutdown()  # twice is harmless
    with pytest.raises(RuntimeError, match="this engine was shut down"):
        engine.add_request("late", ids(5), SamplingParams(max_tokens=3))
    with pytest.raises(RuntimeError, match="this engine was shut down"):
        engine.step()
    with pytest.raises(RuntimeError, match="this engine was shut down"):
        llm.generate([ids(5)], SamplingParams(max_tokens=3), use_tqdm=False)


def test_abort_of_waiting_and_n_gt_1_request(llama_dir):
    llm = LLM(str(llama_dir), max_model_len=MAX_LEN, block_size=4, max_num_seqs=2)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    engine.add_request("first", ids(1, 2, 3), params)
    engine.add_request("pair", ids(4, 5, 6), SamplingParams(n=2, temperature=1.0, seed=1,
                                                            max_tokens=20, ignore_eos=True))
    engine.add_request("queued", ids(7, 8, 9), params)  # max_num_seqs=2: it waits
    engine.step()
    engine.step()
    assert engine.get_num_unfinished_requests() == 4
    engine.abort_request(["pair", "queued"])
    assert engine.get_num_unfinished_requests() == 1
    aborted = [o for o in engine.step() if o.finished]
    assert sorted(o.request_id for o in aborted) == ["pair", "queued"]
    pair = next(o for o in aborted if o.request_id == "pair")
    assert [c.finish_reason for c in pair.outputs] == ["abort", "abort"]
    assert [c.index for c in pair.outputs] == [0, 1]
    _, final = run_to_completion(engine)
    assert list(final) == ["first"] and len(final["first"].outputs[0].token_ids) == 20
    assert_all_blocks_free(engine)


# ----------------------------------------------------------- model folders
def copy_model(src, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_unknown_architecture_lists_supported(llama_dir, tmp_path):
    folder = copy_model(llama_dir, tmp_path)
    edit_config(folder, architectures=["FooForCausalLM"], model_type="foo")
    with pytest.raises(ValueError, match="FooForCausalLM") as info:
        LLM(str(folder))
    for name in SUPPORTED_ARCHITECTURES:
        assert name in str(info.value)
    assert set(SUPPORTED_ARCHITECTURES) >= {"LlamaForCausalLM", "Qwen2ForCausalLM",
                                            "Qwen3ForCausalLM", "MistralForCausalLM"}


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "no-such-model"))


def test_a_model_path_that_is_a_file(llama_dir):
    with pytest.raises(ValueError, match="is a file: fulcrum loads a model's folder"):
        LLM(str(llama_dir / "config.json"))


def test_missing_config(llama_dir, tmp_path):
    folder = copy_model(llama_dir, tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(folder))


def test_missing_weights(llama_dir, tmp_path):
    folder = copy_model(llama_dir, tmp_path)
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(folder))


def test_weight_shape_mismatch(llama_dir, tmp_path):
    folder = copy_model(llama_dir, tmp_path)
    edit_config(folder, intermediate_size=128)
    with pytest.raises(ValueError, match="shape"):
        LLM(str(folder))


@pytest.mark.parametrize("file, content, message", [
    ("config.json", b"{", r"config\.json is not valid JSON"),
    ("config.json", b"[1, 2]", r"config\.json holds no JSON object"),
    ("config.json", b"\xff\xfe{}", r"config\.json is not text"),
    ("tokenizer.json", b"garbage", r"tokenizer\.json is not a tokenizer"),
    ("tokenizer_config.json", b"{\"bos_token\": ", r"tokenizer_config\.json is not valid JSON"),
    ("tokenizer_config.json", b"{\"chat_template\": [{\"template\": \"x\"}]}",
     r"tokenizer_config\.json: chat_template must be a template or a list"),
    ("tokenizer_config.json", b"{\"chat_template\": 7}",
     r"tokenizer_config\.json: chat_template must be a template or a list"),
    ("generation_config.json", b"nope", r"generation_config\.json is not valid JSON"),
    ("generation_config.json", b"{\"eos_token_id\": \"x\"}",
     r"generation_config\.json: eos_token_id must be a token id"),
    ("chat_template.jinja", b"\xff\xfe{{ x }}", r"chat_template\.jinja is not a readable chat"),
    ("model.safetensors", b"\x10\x00\x00", r"model\.safetensors is not a readable safetensors"),
])
def test_a_broken_file_in_the_model_folder_is_named(llama_dir, tmp_path, file, content, message):
    folder = copy_model(llama_dir, tmp_path)
    (folder / file).write_bytes(content)
    with pytest.raises(ValueError, match=message):
        LLM(str(folder))


def test_the_command_line_reports_a_broken_model_folder_in_one_line(llama_dir, tmp_path, capsys):
    from fulcrum.cli import main

    folder = copy_model(llama_dir, tmp_path)
    (folder / "tokenizer.json").write_text("garbage")
    assert main(["generate", str(folder), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fulcrum generate: error: ") and "tokenizer.json is not a tokenizer" in err
    assert "Traceback" not in err


def test_a_truncated_safetensors_file_is_named(llama_dir, tmp_path):
    folder = copy_model(llama_dir, tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors"):
        LLM(str(folder))


def test_integer_weights_are_refused_not_cast(llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = copy_model(llama_dir, tmp_path)
    weights = load_file(folder / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    weights[name] = weights[name].to(torch.int8)
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ValueError, match=rf"{name}' is torch.int8: fulcrum reads floating"):
        LLM(str(folder))


@pytest.mark.parametrize("name", ["model.layers.1.mlp.up_proj.weight",
                                  "model.layers.0.self_attn.k_proj.weight",
                                  "model.layers.0.mlp.gate_proj.weight"])
def test_a_checkpoint_missing_one_part_of_a_fused_weight_is_refused(llama_dir, tmp_path, name):
    """q/k/v and gate/up are loaded into one parameter each: the parts that never came kept
    their random initial values, and the model generated from them without a word."""
    from safetensors.torch import load_file, save_file

    folder = copy_model(llama_dir, tmp_path)
    weights = load_file(folder / "model.safetensors")
    del weights[name]
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ValueError, match=rf"checkpoint is missing weights: \['{name}'\]"):
        LLM(str(folder))


def test_rope_tables_in_a_checkpoint_are_skipped_and_a_differing_tied_head_is_named(
        llama_dir, tmp_path, caplog):
    """Some trainers save RoPE's cos/sin tables (vLLM skips them); a head stored beside
    tied embeddings is left out, as vLLM does, with a warning where it differs."""
    from safetensors.torch import load_file, save_file

    folder = copy_model(llama_dir, tmp_path)
    edit_config(folder, tie_word_embeddings=True)
    weights = load_file(folder / "model.safetensors")
    expected = LLM(str(folder)).generate([[5, 6, 7]], SamplingParams(max_tokens=6),
                                         use_tqdm=False)[0].outputs[0].token_ids
    weights["model.layers.0.self_attn.rotary_emb.cos_cached"] = torch.ones(4, 4)
    weights["model.layers.0.self_attn.rotary_emb.sin_cached"] = torch.ones(4, 4)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, folder / "model.safetensors")
    caplog.clear()
    with caplog.at_level("WARNING", logger="fulcrum"):
        llm = LLM(str(folder))
    assert "lm_head.weight differs" not in caplog.text
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6),
                        use_tqdm=False)[0].outputs[0].token_ids == expected
    weights["lm_head.weight"] = weights["lm_head.weight"] + 1.0
    save_file(weights, folder / "model.safetensors")
    with caplog.at_level("WARNING", logger="fulcrum"):
        LLM(str(folder))
    assert "the checkpoint's lm_head.weight differs from its embeddings" in caplog.text


@pytest.mark.parametrize("device, message", [
    ("tpu", "fulcrum runs on 'cpu', 'cuda'"), ("meta", "fulcrum runs on 'cpu', 'cuda'"),
    (7, "device must be a string, got 7"),
    ("cuda:99", "no such CUDA device here"),
])
def test_a_device_fulcrum_cannot_run_on_is_refused(llama_dir, device, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(llama_dir), device=device)


def test_max_model_len_beyond_the_model(llama_dir):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(llama_dir), max_model_len=10_000)


def test_the_shortest_context_holds_one_prompt_token_and_one_generated(llama_dir):
    with pytest.raises(ValueError, match="max_model_len must be at least 2"):
        LLM(str(llama_dir), max_model_len=1)
    llm = LLM(str(llama_dir), max_model_len=2)  # its start-up profile fits too
    out = llm.generate([ids(5)], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1
    with pytest.raises(ValueError, match="maximum context length is 2"):
        llm.generate([ids(5, 6)], SamplingParams(max_tokens=1), use_tqdm=False)


def test_kv_cache_too_small_for_one_request(llama_dir):
    with pytest.raises(ValueError, match=r"holds 48 tokens \(3 blocks of 16\), fewer than "
                                         r"max_model_len=64.*\(num_gpu_blocks_override=4, the "
                                         r"null block included\)"):
        LLM(str(llama_dir), max_model_len=64, block_size=16, num_gpu_blocks_override=4)
    with pytest.raises(ValueError, match=r"\(kv_cache_memory_bytes / gpu_memory_utilization\)"):
        LLM(str(llama_dir), max_model_len=64, block_size=16, kv_cache_memory_bytes=1024)


def test_text_too_long_for_any_tokenization_is_refused_before_tokenizing(llm):
    engine = llm.llm_engine
    limit = 2 * MAX_LEN * engine.tokenizer.max_chars_per_token
    with pytest.raises(ValueError, match=f"{limit + 1} characters long: more than {MAX_LEN} "
                                         "tokens"):
        llm.generate("x" * (limit + 1), SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="maximum model length"):  # tokenized, then refused
        llm.generate("x" * limit, SamplingParams(max_tokens=1), use_tqdm=False)


def test_top_k_beyond_the_vocabulary_means_no_cap(llm):
    def sample(top_k):
        params = SamplingParams(temperature=1.0, seed=7, top_k=top_k, max_tokens=6,
                                ignore_eos=True)
        return llm.generate(ids(1, 2, 3), params, use_tqdm=False)[0].outputs[0].token_ids

    assert sample(10 ** 30) == sample(VOCAB) == sample(0)


def test_a_truncation_longer_than_the_model_is_refused(llm):
    """As vLLM refuses it: keeping more tokens than max_model_len keeps nothing out."""
    with pytest.raises(ValueError, match=f"truncate_prompt_tokens value \\(10000\\) is greater "
                                         f"than max_model_len \\({MAX_LEN}\\)"):
        llm.generate("hi", SamplingParams(max_tokens=1, truncate_prompt_tokens=10_000))
    (kept,) = llm.generate("hi", SamplingParams(max_tokens=1, truncate_prompt_tokens=MAX_LEN - 1),
                           use_tqdm=False)
    assert len(kept.outputs[0].token_ids) == 1


def test_numpy_arrays_of_token_ids_are_prompts(llm):
    """A 2-D batch ("got ndarray" before) and a 1-D array given to the engine directly."""
    import numpy as np

    params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)
    batch = llm.generate(np.array([[1, 2, 3], [4, 5, 6]]), params, use_tqdm=False)
    assert [o.prompt_token_ids for o in batch] == [[1, 2, 3], [4, 5, 6]]
    (listed,) = llm.generate(ids(4, 5, 6), params, use_tqdm=False)
    assert batch[1].outputs[0].token_ids == listed.outputs[0].token_ids
    engine = llm.llm_engine
    engine.add_request("array", np.array([1, 2, 3]), params)
    _, final = run_to_completion(engine)
    assert final["array"].prompt_token_ids == [1, 2, 3]


def test_numpy_numbers_are_taken_as_pythons():
    """An evaluation script's seeds and settings often come from numpy: np.int64(3) was
    refused as "not an integer", np.float32(0.5) as "not a finite number"; np.bool_ for a
    switch is a bool (but not a number)."""
    import numpy as np

    params = SamplingParams(n=np.int64(2), temperature=np.float32(0.5), seed=np.int32(3),
                            max_tokens=np.uint16(9), stop_token_ids=[np.int64(5)],
                            logit_bias={np.int64(7): np.float32(1.5)}, top_p=np.float64(0.9))
    assert (params.n, params.temperature, params.seed, params.max_tokens) == (2, 0.5, 3, 9)
    assert params.stop_token_ids == [5] and params.logit_bias == {7: 1.5}
    assert all(type(v) is int for v in (params.n, params.seed, params.max_tokens))
    assert SamplingParams(ignore_eos=np.bool_(True)).ignore_eos is True
    with pytest.raises(ValueError, match="n must be an integer"):
        SamplingParams(n=np.bool_(True))
    with pytest.raises(ValueError, match="top_k must be a non-negative integer"):
        SamplingParams(top_k=np.float32(2.0))

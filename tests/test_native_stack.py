"""The decoder stack in one native call (fulcrum/kernels/decoder_stack.cpp) computes what the
Python layers compute, bit for bit: the same tokens and the same logprobs under chunked
prefill beside decodes (the LM head in the same call, over the rows that sample), in bf16 and
with int8 weights, with and without QKV bias, with Qwen3's per-head q/k norm; models it cannot
run (float32) keep the Python layers."""

import time

import pytest
import torch

from fulcrum import LLM, SamplingParams, kernels
from fulcrum.default_model import write_byte_level_tokenizer

pytestmark = pytest.mark.skipif(
    not kernels.supports_varlen(torch.bfloat16, torch.bfloat16, 3, 64, 16),
    reason="no AVX512-BF16 or AVX2 kernels on this machine")


def build(folder, arch):
    import transformers as tf

    sizes = dict(vocab_size=320, hidden_size=192, intermediate_size=256, num_hidden_layers=3,
                 num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=512,
                 initializer_range=0.1, eos_token_id=258, bos_token_id=256,
                 tie_word_embeddings=False)
    config = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config,
              "qwen3": lambda **kw: tf.Qwen3Config(head_dim=64, **kw)}[arch](**sizes)
    torch.manual_seed(1)
    tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    write_byte_level_tokenizer(folder, 320, 512)
    return folder


def run(llm, native):
    model = llm.llm_engine.runner.model.model
    saved, model.native = model.native, (model.native if native else None)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (70, 9, 41)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        model.native = saved
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in entry.items()}
                                      for entry in o.outputs[0].logprobs]) for o in outputs]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_native_stack_matches_the_python_layers(tmp_path, arch, quantization):
    llm = LLM(str(build(tmp_path / arch, arch)), dtype="bfloat16", quantization=quantization,
              max_num_batched_tokens=32, scheduling_policy="fcfs", enable_prefix_caching=False)
    native = llm.llm_engine.runner.model.model.native
    assert native is not None and native.head is llm.llm_engine.runner.model.lm_head
    assert run(llm, native=True) == run(llm, native=False)


def test_timed_kernels_change_no_result_and_account_for_every_kind_that_ran(tmp_path):
    from fulcrum.models.native_stack import KERNEL_KINDS

    llm = LLM(str(build(tmp_path / "llama", "llama")), dtype="bfloat16",
              max_num_batched_tokens=32, scheduling_policy="fcfs", enable_prefix_caching=False)
    native = llm.llm_engine.runner.model.model.native
    untimed = run(llm, native=True)
    assert native.kernel_seconds is None
    seconds = native.time_kernels()
    start = time.perf_counter()
    assert run(llm, native=True) == untimed
    elapsed = time.perf_counter() - start
    spent = dict(zip(KERNEL_KINDS, seconds.tolist()))
    assert spent.pop("all_reduce") == 0.0  # one rank: no all-reduce ran
    assert all(value > 0.0 for value in spent.values()), spent
    assert sum(spent.values()) < elapsed
    assert native.time_kernels() is native.kernel_seconds and not native.kernel_seconds.any()


def test_models_it_cannot_run_keep_the_python_layers(tmp_path):
    assert LLM(str(build(tmp_path / "f32", "llama")), dtype="float32"
               ).llm_engine.runner.model.model.native is None


def test_greedy_and_random_rows_in_one_native_step_are_sampled_together(tmp_path, caplog):
    """The native call's argmax is the greedy rows' tokens, and the random rows' are drawn
    into the same tensor: it must take that write (an inference-mode tensor refused it, and
    every such step fell back to sampling row by row)."""
    llm = LLM(str(build(tmp_path / "llama", "llama")), dtype="bfloat16",
              scheduling_policy="fcfs", enable_prefix_caching=False)
    prompt = {"prompt_token_ids": list(range(3, 40))}
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    alone = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    random = SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    with caplog.at_level("ERROR"):
        outputs = llm.generate([prompt, prompt], [greedy, random], use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == alone
    assert len(outputs[1].outputs[0].token_ids) == 8
    assert not [r for r in caplog.records if "sampling the batch failed" in r.getMessage()]


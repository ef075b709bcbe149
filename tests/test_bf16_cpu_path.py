"""The bf16 CPU path end to end: packed linear kernels and the varlen paged attention (decodes
and prefill chunks in one call) under chunking, mixed batches and prefix-cache hits, checked
against HF transformers in float32 by the log-probabilities of every generated token."""

import pytest
import torch

from fulcrum import LLM, SamplingParams, kernels
from fulcrum.models.attention import CpuVarlenAttentionBackend, make_backend
from fulcrum.default_model import write_byte_level_tokenizer

pytestmark = pytest.mark.skipif(
    not kernels.supports_varlen(torch.bfloat16, torch.bfloat16, 3, 64, 16),
    reason="no AVX512-BF16 or AVX2 kernels on this machine")


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def head64_dir(request, tmp_path_factory):
    """A model whose heads are the kernels' real size (64), 3 query heads per KV head: Llama,
    Qwen2 (QKV bias) and Qwen3 (q/k RMSNorm)."""
    import transformers as tf

    folder = tmp_path_factory.mktemp(f"{request.param}-head64")
    sizes = dict(vocab_size=320, hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=512,
                 initializer_range=0.1, eos_token_id=258, bos_token_id=256,
                 tie_word_embeddings=False)
    config = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config,
              "qwen3": lambda **kw: tf.Qwen3Config(head_dim=64, **kw)}[request.param](**sizes)
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    write_byte_level_tokenizer(folder, 320, 512)
    return folder


def hf_token_logprobs(model_dir, prompt, generated):
    """float32 HF log-probabilities of each generated token given everything before it."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logprobs = model(ids).logits[0].float().log_softmax(-1)
    rows = torch.arange(len(prompt) - 1, len(prompt) + len(generated) - 1)
    return logprobs[rows, torch.tensor(generated)].tolist()


def test_bf16_kernels_follow_float32_reference(head64_dir):
    shared = [(7 * i) % 250 for i in range(70)]
    prompts = [shared + [1, 2, 3], list(range(5, 45)), [9, 8],
               [(3 * i) % 200 for i in range(150)]]
    # A small budget and chunk: prompts span several steps, chunks attend to their cached
    # context and share steps with decodes; the shared prefix hits the cache.
    llm = LLM(str(head64_dir), dtype="bfloat16", max_num_batched_tokens=48,
              long_prefill_token_threshold=16, max_num_seqs=4)
    runner = llm.llm_engine.runner
    assert isinstance(runner.model.model.layers[0].self_attn.backend, CpuVarlenAttentionBackend)
    assert runner.model.lm_head.packed is not None
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    prompts.append(shared + list(range(90, 130)))
    (again,) = llm.generate({"prompt_token_ids": prompts[-1]}, params, use_tqdm=False)
    assert again.num_cached_tokens == 64  # four full blocks of the shared prefix
    outputs.append(again)
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        ours = [entry[token].logprob for token, entry in zip(completion.token_ids,
                                                              completion.logprobs)]
        reference = hf_token_logprobs(head64_dir, prompt, list(completion.token_ids))
        assert ours == pytest.approx(reference, abs=0.15)


def test_a_block_size_that_keeps_bf16_off_its_kernels_is_named(caplog):
    """bf16 at block_size=128 (vLLM's CPU default with IPEX) runs neither the varlen kernel nor
    the one-call decoder stack, decode steps several times as long: the start says so, and
    names 16; a float32 model, whose path the block size does not change, is not warned."""
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    backend = make_backend(cpu, bf16, bf16, 3, 64, 128)
    assert not isinstance(backend, CpuVarlenAttentionBackend)
    assert "block_size=128" in caplog.text and "block_size=16 runs them" in caplog.text
    caplog.clear()
    assert isinstance(make_backend(cpu, bf16, bf16, 3, 64, 16), CpuVarlenAttentionBackend)
    make_backend(cpu, torch.float32, torch.float32, 3, 64, 128)
    assert not caplog.records

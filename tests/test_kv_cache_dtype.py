"""kv_cache_dtype: a bfloat16 cache under a float32 model, on the native and the torch path."""

import json

import pytest
import torch

from fulcrum import LLM, SamplingParams


def test_bfloat16_cache_reproduces_real_model_greedy_reference(stories_dir, kernel_path):
    """On the CPU, whose backends the two kernel paths choose between."""
    cases = json.loads((stories_dir / "greedy_reference.json").read_text())["cases"]
    llm = LLM(str(stories_dir), kv_cache_dtype="bfloat16", max_num_batched_tokens=16,
              max_num_seqs=4, device="cpu")
    engine = llm.llm_engine
    assert engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    assert engine.dtype == torch.float32
    backend = engine.runner.model.model.layers[0].self_attn.backend
    assert type(backend).__name__ == ("CpuPagedAttentionBackend" if kernel_path == "kernels"
                                      else "TorchAttentionBackend")
    outputs = llm.generate([c["prompt"] for c in cases],
                           SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [c["greedy_token_ids"] for c in cases]


def test_bfloat16_cache_numbers_do_not_depend_on_chunking(llama_dir, kernel_path):
    """A prompt in one chunk attends over its keys and values as the cache holds them
    (rounded to bf16), as a prompt in chunks reading its earlier ones back does: they
    differed by up to 0.03 in prompt logprobs."""
    prompt = [(7 * i) % 250 + 3 for i in range(100)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)

    def prompt_logprobs(**chunking):
        llm = LLM(str(llama_dir), dtype="float32", kv_cache_dtype="bfloat16",
                  scheduling_policy="fcfs", max_model_len=256, **chunking)
        (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return [next(iter(entry.values())).logprob for entry in output.prompt_logprobs[1:]]

    whole, chunked = prompt_logprobs(), prompt_logprobs(max_num_batched_tokens=8)
    assert max(abs(a - b) for a, b in zip(whole, chunked)) < 1e-3


def test_bfloat16_cache_holds_twice_the_blocks(stories_dir):
    budget = 1 << 20
    full = LLM(str(stories_dir), kv_cache_memory_bytes=budget).llm_engine
    half = LLM(str(stories_dir), kv_cache_memory_bytes=budget,
               kv_cache_dtype="bfloat16").llm_engine
    assert half.block_manager.num_blocks == 2 * full.block_manager.num_blocks


def test_unknown_cache_dtype_is_refused(stories_dir):
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(stories_dir), kv_cache_dtype="fp4")


def test_the_cache_memory_is_committed_when_the_engine_starts(stories_dir):
    """The whole cache is resident from the start, so a server's memory does not creep up
    as blocks are first used under load."""
    import subprocess
    import sys

    budget = 256 << 20
    code = (f"import os; from fulcrum import LLM\n"
            f"def rss(): return int(open('/proc/self/statm').read().split()[1]) * "
            f"os.sysconf('SC_PAGE_SIZE')\n"
            f"before = rss(); llm = LLM({str(stories_dir)!r}, kv_cache_memory_bytes={budget})\n"
            f"print(rss() - before)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert int(result.stdout.strip().splitlines()[-1]) > 0.95 * budget, result.stderr

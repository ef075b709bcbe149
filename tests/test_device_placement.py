"""Every tensor a step makes is on the engine's device, checked without a GPU.

A tensor made without a device lands on torch's default one, the CPU: on a GPU that is not
where the model's tensors are, and mixing the two fails (random sampling once failed on every
row on CUDA so), while a native kernel handed memory that is not the CPU's reads garbage or
crashes. With the default device switched to `meta` during a CPU engine's steps, any tensor
made without a device meets the engine's CPU tensors and fails loudly here, or reaches a
native kernel as no memory at all. Built normally first, so only the steps are checked."""

from __future__ import annotations

import pytest
import torch

from fulcrum import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": list(range(1, 40))}, {"prompt_token_ids": [1, 2, 3, 4, 5]},
           {"prompt_token_ids": list(range(1, 30)) + [7, 7]}]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
          SamplingParams(temperature=0.8, top_k=5, seed=1, max_tokens=8, ignore_eos=True,
                         logprobs=2, prompt_logprobs=1),
          SamplingParams(temperature=0.9, top_p=0.9, repetition_penalty=1.2, max_tokens=8,
                         ignore_eos=True, seed=2)]


def _outputs(results):
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason,
             [sorted(entry) for entry in o.outputs[0].logprobs or []]) for o in results]


@pytest.mark.parametrize("arch,dtype", [("llama", "bfloat16"), ("qwen2", "float32")])
def test_steps_make_every_tensor_on_the_engines_device(model_dirs, arch, dtype):
    """bfloat16 runs the native decoder stack, float32 the torch layers; chunked prefill
    (16-token budget), seeds, penalties and logprobs take part, and prefix-cache hits in the
    second run."""
    def engine():  # fcfs: the slo policy sizes chunks from measured step times, and a
        # chunking that differs under load moves bf16 near-ties in the top logprobs
        return LLM(str(model_dirs[arch]), device="cpu", dtype=dtype, max_num_batched_tokens=16,
                   enable_prefix_caching=True, scheduling_policy="fcfs")

    expected = _outputs(engine().generate(PROMPTS, PARAMS, use_tqdm=False))
    llm = engine()
    torch.set_default_device("meta")
    try:
        runs = [_outputs(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) for _ in range(2)]
    finally:
        torch.set_default_device(None)
    assert runs == [expected, expected]
    assert all(reason == "length" for _, reason, _ in expected)

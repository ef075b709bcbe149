"""Model dtypes: auto takes the checkpoint's; bfloat16 and float16 run and stay close to float32."""

import pytest
import torch

from fulcrum import LLM, SamplingParams

PROMPT = "Once upon a time"


def first_step_logprobs(llm: LLM) -> dict:
    (out,) = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1, logprobs=5),
                          use_tqdm=False)
    return {t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}


def test_auto_takes_the_checkpoint_dtype(stories_dir):
    engine = LLM(str(stories_dir)).llm_engine  # config.json says float32
    assert engine.dtype == torch.float32
    assert next(engine.runner.model.parameters()).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_close_to_float32(stories_dir, dtype, kernel_path):
    reference = first_step_logprobs(LLM(str(stories_dir), dtype="float32"))
    llm = LLM(str(stories_dir), dtype=str(dtype).removeprefix("torch."))
    engine = llm.llm_engine
    assert next(engine.runner.model.parameters()).dtype == dtype
    assert engine.runner.kv_caches[0][0].dtype == dtype
    got = first_step_logprobs(llm)
    best = max(reference, key=reference.get)
    assert best in got
    assert got[best] == pytest.approx(reference[best], abs=0.1)
    (out,) = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 16


def test_a_torch_dtype_is_taken_as_vllm_takes_it(stories_dir):
    """vLLM's LLM takes dtype=torch.bfloat16 as it takes "bfloat16" (ModelConfig.dtype:
    ModelDType | torch.dtype); one fulcrum has no kernels for is refused by its name."""
    engine = LLM(str(stories_dir), dtype=torch.bfloat16).llm_engine
    assert engine.config.dtype == "bfloat16" and engine.dtype == torch.bfloat16
    assert next(engine.runner.model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unsupported dtype 'float64'"):
        LLM(str(stories_dir), dtype=torch.float64)

"""Weight-only int8 (`quantization="int8"`): the quantizer's rounding, the int8 kernel and the
portable path against float64 references of the dequantized weights, and whole models whose
greedy tokens match HF's with the same (quantized, then dequantized) weights."""

from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy
from fulcrum import LLM, SamplingParams, kernels
from fulcrum.models.layers import Linear

needs_linear = pytest.mark.skipif(
    not kernels.supports_linear(torch.zeros(2, 2, dtype=torch.bfloat16)),
    reason="no AVX512-BF16 linear kernel on this machine")


def test_quantize_int8_rounds_per_output_channel():
    weight = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [2.0, 1.0, -0.01]])
    q, scale = kernels.quantize_int8(weight)
    assert q.dtype == torch.int8 and scale.tolist() == pytest.approx([1 / 127, 1.0, 2 / 127])
    assert q.tolist() == [[64, -127, 32], [0, 0, 0], [127, 64, -1]]  # 63.5 rounds to even 64
    assert (q.float() * scale[:, None] - weight).abs().max() <= scale.max() / 2


@needs_linear
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
@pytest.mark.parametrize("out_features,in_features", [(100, 64), (48, 576), (200, 34)])
def test_int8_kernel_matches_float64(rows, out_features, in_features):
    torch.manual_seed(rows * out_features)
    weight = torch.randn(out_features, in_features) * 0.1
    bias = torch.randn(out_features)
    q, scale = kernels.quantize_int8(weight)
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    got = kernels.linear_bf16(x, kernels.pack_linear_weight(q), bias, out_features,
                              torch.float32, scale)
    reference = x.double() @ (q.double() * scale.double()[:, None]).T + bias.double()
    assert (got.double() - reference).abs().max() < 1e-4 * reference.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_int8_both_paths_match_the_dequantized_weights(dtype):
    torch.manual_seed(0)
    layer = Linear(64, 40, bias=True).to(dtype)
    q, scale = kernels.quantize_int8(layer.weight.data)
    dequantized = q.double() * scale.double()[:, None]
    bias = layer.bias.data.double()
    layer.pack("int8")
    assert layer.weight is None and layer.scale is not None
    x = torch.randn(5, 64).to(dtype)
    reference = x.double() @ dequantized.T + bias
    got = layer(x, torch.float32).double()
    tolerance = 1e-4 if dtype == torch.float32 else 1e-2
    assert (got - reference).abs().max() < tolerance * reference.abs().max()


def test_int8_model_matches_hf_with_the_same_weights(llama_dir, tmp_path):
    """float32 (the portable path): greedy tokens equal HF's on the dequantized weights."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"):
                q, scale = kernels.quantize_int8(module.weight)
                module.weight.copy_(q.float() * scale[:, None])
    model.save_pretrained(tmp_path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((llama_dir / name).read_bytes())
    prompt = list(range(5, 25))
    expected = hf_greedy(tmp_path, prompt, 12)
    llm = LLM(str(llama_dir), quantization="int8", dtype="float32")
    output = llm.generate([{"prompt_token_ids": prompt}],
                          SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0]
    assert output.outputs[0].token_ids == expected
    plain = LLM(str(llama_dir), dtype="float32").generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=12,
                                                       ignore_eos=True), use_tqdm=False)[0]
    assert plain.outputs[0].token_ids == hf_greedy(llama_dir, prompt, 12)


def test_quantization_values(llama_dir):
    with pytest.raises(ValueError, match="has weight-only 'int8'"):
        LLM(str(llama_dir), quantization="fp8")

"""int8 (`quantization="int8"`: int8 weights with a scale per output channel, each input row
quantized at run time with a scale of its own): both quantizers' rounding, the int8 kernel and
the portable path against float64 references of the quantized products, and whole models
whose greedy tokens match HF's run with the same quantization."""

from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy, hf_greedy_of
from fulcrum import LLM, SamplingParams, kernels
from fulcrum.models.layers import Linear

needs_linear = pytest.mark.skipif(
    not kernels.supports_linear(torch.zeros(2, 2, dtype=torch.bfloat16)),
    reason="no AVX512-BF16 or AVX2 linear kernel on this machine")


def test_quantize_int8_rounds_per_output_channel():
    weight = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [2.0, 1.0, -0.01]])
    q, scale = kernels.quantize_int8(weight)
    assert q.dtype == torch.int8 and scale.tolist() == pytest.approx([1 / 127, 1.0, 2 / 127])
    assert q.tolist() == [[64, -127, 32], [0, 0, 0], [127, 64, -1]]  # 63.5 rounds to even 64
    assert (q.float() * scale[:, None] - weight).abs().max() <= scale.max() / 2


def test_quantize_rows_int8_rounds_per_row_half_to_even():
    x = torch.tensor([[127 / 64, 2.5 / 64, 1.5 / 64, -2.5 / 64],  # x * 64: ties
                      [0.0, 0.0, 0.0, 0.0],
                      [-4.0, 0.5, 1.0, 0.0],
                      [2.0, 1.0, -1.0, 0.0]])  # x * 63.5
    q, scale = kernels.quantize_rows_int8(x)
    assert scale.flatten().tolist() == pytest.approx([1 / 64, 0.0, 4 / 127, 2 / 127])
    assert q.tolist() == [[127, 2, 2, -2], [0, 0, 0, 0], [-127, 16, 32, 0], [127, 64, -64, 0]]


def quantized_reference(x, q, scale, bias=None):
    """float64 of what the int8 path computes: quantized rows times the int8 weights."""
    rows, row_scale = kernels.quantize_rows_int8(x)
    y = (rows.double() @ q.double().T) * row_scale.double() * scale.double()
    return y if bias is None else y + bias.double()


@needs_linear
@pytest.mark.parametrize("rows", [1, 3, 8, 11, 13, 40])
@pytest.mark.parametrize("out_features,in_features", [(100, 64), (48, 576), (200, 34), (64, 1538)])
def test_int8_kernel_matches_float64(rows, out_features, in_features):
    """Any row count (every size of register tile, up to 6 rows on AVX2 and 8 on AVX-512, and
    the parallel quantizer from two tiles' rows) and any input width (34 and 1538 are not
    whole quads); exact up to fp32's rounding."""
    torch.manual_seed(rows * out_features)
    weight = torch.randn(out_features, in_features) * 0.1
    bias = torch.randn(out_features)
    q, scale = kernels.quantize_int8(weight)
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    packed = kernels.pack_linear_weight(q)
    got = kernels.linear_bf16(x, packed, bias, out_features, torch.float32, scale)
    reference = quantized_reference(x, q, scale, bias)
    assert (got.double() - reference).abs().max() < 1e-6 * reference.abs().max()
    as_bf16 = kernels.linear_bf16(x, packed, bias, out_features, torch.bfloat16, scale)
    assert torch.equal(as_bf16, got.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_int8_both_paths_match_the_quantized_products(dtype):
    torch.manual_seed(0)
    layer = Linear(64, 40, bias=True).to(dtype)
    q, scale = kernels.quantize_int8(layer.weight.data)
    bias = layer.bias.data
    layer.pack("int8")
    assert layer.weight is None and layer.scale is not None
    x = torch.randn(5, 64).to(dtype)
    reference = quantized_reference(x, q, scale, bias.float())
    got = layer(x, torch.float32).double()
    assert (got - reference).abs().max() < 1e-5 * reference.abs().max()
    # and not the unquantized rows' product: the activations really are quantized
    plain = x.double() @ (q.double() * scale.double()[:, None]).T + bias.double()
    assert (got - plain).abs().max() > 1e-4 * reference.abs().max()


def quantize_input(module, args):
    """An HF linear's input, quantized per row as fulcrum's int8 path does (then scaled back)."""
    q, scale = kernels.quantize_rows_int8(args[0])
    return (q * scale,)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: a tied LM head
def test_int8_model_matches_hf_with_the_same_quantization(model_dirs, arch):
    """float32 (the portable path): greedy tokens, and every prompt position's full
    next-token distribution, equal HF's with the same quantized weights, the LM head's
    included (a tied head is quantized apart from the embedding table, whose lookups keep
    the model's dtype), and each linear's input quantized per row. (An unquantized head
    moves these log-probabilities by ~0.05.)"""
    import transformers as tf

    model_dir = model_dirs[arch]
    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompt = list(range(5, 25))
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.clone())
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                q, scale = kernels.quantize_int8(module.weight)
                module.weight.copy_(q.float() * scale[:, None])
                module.register_forward_pre_hook(quantize_input)
        expected_logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1], -1)
    expected = hf_greedy_of(model, prompt, 12)
    vocab = expected_logprobs.shape[1]
    llm = LLM(str(model_dir), quantization="int8", dtype="float32", max_logprobs=vocab)
    output = llm.generate([{"prompt_token_ids": prompt}],
                          SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                         prompt_logprobs=vocab), use_tqdm=False)[0]
    assert output.outputs[0].token_ids == expected
    got = torch.tensor([[entry[t].logprob for t in range(vocab)]
                        for entry in output.prompt_logprobs[1:]])
    torch.testing.assert_close(got, expected_logprobs, atol=1e-4, rtol=0)
    plain = LLM(str(model_dir), dtype="float32").generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=12,
                                                       ignore_eos=True), use_tqdm=False)[0]
    assert plain.outputs[0].token_ids == hf_greedy(model_dir, prompt, 12)


def test_quantization_values(llama_dir):
    with pytest.raises(ValueError, match="has 'int8'"):
        LLM(str(llama_dir), quantization="fp8")


@needs_linear
def test_int8_kernel_rounds_rows_as_the_reference_does():
    """Ties (x * 127 / amax exactly k + 0.5) go to even, as `quantize_rows_int8` rounds."""
    x = torch.tensor([[127 / 64, 2.5 / 64, 1.5 / 64, -2.5 / 64], [2.0, 1.0, -1.0, 0.0]])
    identity, scale = kernels.quantize_int8(torch.eye(4))
    got = kernels.linear_bf16(x.to(torch.bfloat16), kernels.pack_linear_weight(identity), None,
                              4, torch.float32, scale)
    _, row_scale = kernels.quantize_rows_int8(x)
    assert torch.round(got / row_scale).tolist() == [[127, 2, 2, -2], [127, 64, -64, 0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_int8_nan_activation_makes_its_row_nan_and_spares_the_others(dtype):
    """A NaN in a row's input makes every output of that row NaN, as a bf16 or float32 linear
    does and on both paths (bfloat16: the kernel, float32: torch), never a number that hides
    it; the NaN in the vectorised part (index 3) and in the scalar tail (41 of 42), while the
    rows beside it in the same register tile stay exact."""
    torch.manual_seed(0)
    layer = Linear(42, 24, bias=True).to(dtype)
    q, scale = kernels.quantize_int8(layer.weight.data)
    bias = layer.bias.data.float()
    layer.pack("int8")
    x = torch.randn(4, 42).to(dtype)
    x[0, 3] = x[2, 41] = float("nan")
    got = layer(x, torch.float32)
    assert got[[0, 2]].isnan().all()
    clean = [1, 3]
    reference = quantized_reference(x[clean], q, scale, bias)
    assert (got[clean].double() - reference).abs().max() < 1e-5 * reference.abs().max()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_int8_off_the_kernel_says_so_at_load(llama_dir, dtype, caplog):
    """int8 on a model the kernel cannot take runs the portable path, which widens every
    int8 weight at every call (a float32 Llama's steps took 2x to 6x as long as without int8):
    the load says so, naming the dtype that sends it there."""
    LLM(str(llama_dir), quantization="int8", dtype=dtype)
    warned = [r.getMessage() for r in caplog.records if "portable path" in r.getMessage()]
    assert len(warned) == 1 and f"runs in {dtype}" in warned[0]
    caplog.clear()
    LLM(str(llama_dir), dtype=dtype)
    assert not any("portable path" in r.getMessage() for r in caplog.records)


@needs_linear
def test_int8_on_the_kernel_loads_without_a_warning(llama_dir, caplog):
    LLM(str(llama_dir), quantization="int8", dtype="bfloat16")
    assert not any("portable path" in r.getMessage() for r in caplog.records)

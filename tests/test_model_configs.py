"""Hugging Face config features beyond the four base test models: fulcrum reads them as
transformers does (the same greedy tokens) and serves as long a context as vLLM
derives from them."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from conftest import _COMMON, hf_greedy, write_byte_level_tokenizer
from fulcrum import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_POS = 64  # the config's max_position_embeddings; the prompts below run past it
PROMPT = [random.Random(7).randrange(256) for _ in range(150)]
NEW = 12


def build(folder: Path, arch: str, **config) -> Path:
    import transformers as tf

    torch.manual_seed(0)
    cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config}[arch]
    model = tf.AutoModelForCausalLM.from_config(
        cls(**{**_COMMON, "max_position_embeddings": MAX_POS, **config}), dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    write_byte_level_tokenizer(folder, _COMMON["vocab_size"], 1024)
    return folder


@pytest.mark.parametrize("arch, scaling, context", [
    ("llama", {"rope_type": "linear", "factor": 4.0}, 256),
    ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, 256),
    ("qwen2", {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 32,
               "beta_fast": 16, "mscale": 2.0, "mscale_all_dim": 1.0}, 96),
])
def test_rope_scaling_matches_hf_past_max_position_embeddings(tmp_path, arch, scaling, context):
    """Linear and YaRN scaling stretch the context by their factor (vLLM's rule; YaRN's from
    its pretrained length): the default max_model_len is the stretched one, and a prompt
    past max_position_embeddings decodes as HF's model does (YaRN's attention factor and
    frequency ramp included)."""
    folder = build(tmp_path / "model", arch, rope_scaling=scaling)
    llm = LLM(str(folder), max_num_batched_tokens=64)
    assert llm.llm_engine.config.max_model_len == context
    prompt = PROMPT[:context - NEW]
    greedy = SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=0.0)
    out = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == hf_greedy(folder, prompt, NEW)


def test_qwen_use_sliding_window_without_a_sliding_layer_is_full_attention(tmp_path):
    """transformers slides layer i only from max_window_layers on: with every layer below it,
    use_sliding_window changes nothing, and the model is served (it was refused); one layer
    that slides is still refused, by name."""
    folder = build(tmp_path / "full", "qwen2", use_sliding_window=True, sliding_window=16,
                   max_window_layers=_COMMON["num_hidden_layers"])
    greedy = SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=0.0)
    out = LLM(str(folder)).generate([PROMPT[:50]], greedy, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == hf_greedy(folder, PROMPT[:50], NEW)
    folder = build(tmp_path / "sliding", "qwen2", use_sliding_window=True, sliding_window=16,
                   max_window_layers=1)
    with pytest.raises(ValueError, match=r"layer 1 of 2 slides"):
        LLM(str(folder))
    config = json.loads((folder / "config.json").read_text())
    del config["sliding_window"], config["layer_types"]  # transformers' default: 4096
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"layer 1 of 2 slides"):
        LLM(str(folder))


@pytest.mark.parametrize("scaling", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 16},
    {"rope_type": "yarn", "factor": 3.0, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    {"rope_type": "yarn", "factor": 8.0, "mscale": 0.7, "mscale_all_dim": 1.0},
    {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3},
])
def test_yarn_frequencies_and_attention_factor_are_transformers(scaling):
    """The table itself against transformers' YaRN (a few greedy tokens of a tiny model
    could pass with a slightly wrong ramp or factor)."""
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from fulcrum.models.layers import RotaryEmbedding
    from fulcrum.models.qwen2 import Qwen2ForCausalLM

    config = {**_COMMON, "max_position_embeddings": MAX_POS, "rope_scaling": dict(scaling)}
    hf = tf.Qwen2Config(**config)
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](hf)
    spec = Qwen2ForCausalLM.spec_from_config(json.loads(hf.to_json_string()))
    table = RotaryEmbedding(spec)
    positions = torch.arange(spec.max_context_len, dtype=torch.float32)
    expected = torch.cat([torch.outer(positions, inv_freq)] * 2, dim=-1)
    assert torch.allclose(table.cos, expected.cos() * attention, atol=2e-5)
    assert torch.allclose(table.sin, expected.sin() * attention, atol=2e-5)


def test_a_linear_scaling_without_a_factor_is_named():
    from fulcrum.models.llama import LlamaForCausalLM

    spec = LlamaForCausalLM.spec_from_config({**_COMMON, "rope_scaling": {"type": "linear"}})
    with pytest.raises(ValueError, match=r"rope_scaling of type 'linear' needs a factor"):
        spec.max_context_len


def test_pytorch_bin_checkpoints_load_as_trainer_saves_them(llama_dir, tmp_path):
    """load_format='pt': the files pytorch_model.bin.index.json names, or every *.bin but
    the Trainer's training_args.bin (a pickle of its arguments, not weights, which
    weights_only loading refused, failing the whole load)."""
    import shutil

    from safetensors.torch import load_file

    weights = load_file(llama_dir / "model.safetensors")
    names = sorted(weights)
    greedy = SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=0.0)
    expected = LLM(str(llama_dir)).generate([PROMPT[:20]], greedy,
                                            use_tqdm=False)[0].outputs[0].token_ids
    for sharded in (False, True):
        folder = tmp_path / f"bin-{sharded}"
        shutil.copytree(llama_dir, folder)
        (folder / "model.safetensors").unlink()
        (folder / "training_args.bin").write_bytes(b"\x80\x04not weights")
        if sharded:
            halves = {"pytorch_model-00001-of-00002.bin": names[::2],
                      "pytorch_model-00002-of-00002.bin": names[1::2]}
            for file, part in halves.items():
                torch.save({n: weights[n] for n in part}, folder / file)
            (folder / "pytorch_model.bin.index.json").write_text(json.dumps(
                {"weight_map": {n: file for file, part in halves.items() for n in part}}))
        else:
            torch.save(weights, folder / "pytorch_model.bin")
        out = LLM(str(folder), load_format="pt").generate([PROMPT[:20]], greedy,
                                                          use_tqdm=False)[0].outputs[0]
        assert out.token_ids == expected


def test_a_pre_quantized_checkpoint_is_refused_by_its_method(llama_dir, tmp_path):
    import shutil

    folder = tmp_path / "fp8"
    shutil.copytree(llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"pre-quantized checkpoints are not supported "
                                         r"\(config.json's quantization_config: quant_method "
                                         r"'fp8'\)"):
        LLM(str(folder))

"""Shared fixtures: tiny random-weight models of each supported architecture, built with HF
transformers (the reference implementation) and saved as local model folders."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Tuple

import pytest
import torch

from fulcrum.default_model import write_byte_level_tokenizer

REPO = Path(__file__).resolve().parents[1]
STORIES_DIR = REPO.parent / "shared" / "models" / "stories260K"
VOCAB = 320
MAX_POS = 512
EOS_ID = 258  # <|im_end|> in the byte-level tokenizer

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POS,
               initializer_range=0.2, eos_token_id=EOS_ID, bos_token_id=256)


def _hf_config(arch: str, max_pos: int = MAX_POS):
    import transformers as tf

    common = {**_COMMON, "max_position_embeddings": max_pos}
    if arch == "llama":
        return tf.LlamaConfig(**common, tie_word_embeddings=False, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if arch == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "qwen3":
        return tf.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True)
    if arch == "mistral":
        return tf.MistralConfig(**common, head_dim=16, sliding_window=48,
                                tie_word_embeddings=False)
    raise ValueError(arch)


ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def build_tiny_model(arch: str, folder: Path, max_pos: int = MAX_POS) -> Path:
    """Save a seeded random HF model of `arch` plus a byte-level tokenizer into `folder`."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(_hf_config(arch, max_pos), dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    write_byte_level_tokenizer(folder, VOCAB, max_pos)
    return folder


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict:
    """{arch: folder} for every supported architecture."""
    root = tmp_path_factory.mktemp("models")
    return {arch: build_tiny_model(arch, root / arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def llama_dir(model_dirs) -> Path:
    return model_dirs["llama"]


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run far faster on one thread than on an oversubscribed pool."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["kernels", "torch"])
def kernel_path(request, monkeypatch):
    """Run a test on fulcrum's native CPU kernels and on the portable torch path."""
    from fulcrum import kernels

    if request.param == "torch":
        monkeypatch.setenv("FULCRUM_DISABLE_KERNELS", "1")
    kernels.clear_cache()
    yield request.param
    monkeypatch.undo()
    kernels.clear_cache()


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    if not STORIES_DIR.is_dir():
        pytest.skip(f"{STORIES_DIR} not present (it ships in ../shared)")
    return STORIES_DIR


def load_benchmark(script: str) -> Any:
    """benchmarks/`script` (a file, not a package) imported as a module, for its tests; with
    its folder on the path, as when it runs, for the scripts it imports."""
    import importlib.util
    import sys

    if str(REPO / "benchmarks") not in sys.path:
        sys.path.append(str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location(Path(script).stem + "_bench",
                                                  REPO / "benchmarks" / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def hf_greedy(model_dir: Path, prompt_ids: list, max_new_tokens: int) -> list:
    """HF transformers' greedy continuation of one prompt (token ids only, EOS ignored)."""
    import transformers as tf

    return hf_greedy_of(tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                        prompt_ids, max_new_tokens)


def hf_greedy_of(model, prompt_ids: list, max_new_tokens: int) -> list:
    """The same for a loaded (possibly altered) HF model."""
    model.generation_config.eos_token_id = None  # like ignore_eos: run to max_new_tokens
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@contextlib.contextmanager
def running_server(model_dir, name: str = "m", app_kwargs: Optional[Dict[str, Any]] = None,
                   **engine_args: Any) -> Iterator[Tuple[Any, Any]]:
    """(server, async_llm): an engine on `model_dir` behind the OpenAI app on a loopback
    port, shut down on leaving."""
    from fulcrum.async_engine import AsyncLLM
    from fulcrum.server import BackgroundServer, build_app

    async_llm = AsyncLLM.from_engine_args(model=str(model_dir), **engine_args)
    try:
        with BackgroundServer(build_app(async_llm, name, **(app_kwargs or {}))) as server:
            yield server, async_llm
    finally:
        async_llm.shutdown()


@pytest.fixture(scope="module")
def server(served):
    """The running server of a module's `served` fixture (a `running_server` pair)."""
    return served[0]


@pytest.fixture(scope="module")
def async_llm(served):
    return served[1]


def free_port() -> int:
    """A loopback port free right now (for servers started in another process)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]

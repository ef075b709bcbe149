"""Build a model from a local Hugging Face folder: config, dtype, weights (or dummy weights)."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterator, Optional, Tuple

import torch

from fulcrum.json_files import read_json_object
from fulcrum.models.attention import AttentionBackend
from fulcrum.models import model_class
from fulcrum.models.layers import STACKED_PARAMS, DecoderForCausalLM, MergedLinear
from fulcrum.worker.memory import available_cpu_memory

if TYPE_CHECKING:
    from fulcrum.distributed.group import ParallelGroup

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


def load_hf_config(model_dir: str) -> Dict[str, Any]:
    folder = Path(model_dir)
    if folder.is_file():
        raise ValueError(f"model {model_dir!r} is a file: fulcrum loads a model's folder (its "
                         "config.json, tokenizer and weights)")
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {model_dir!r} does not exist (fulcrum loads models "
                                "from a local folder; nothing is downloaded)")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{model_dir!r} has no config.json")
    return read_json_object(config_file)


def resolve_dtype(dtype: str, hf_config: Dict[str, Any]) -> torch.dtype:
    """'auto' takes the checkpoint's dtype (float32 if it names none)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dtype = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return _DTYPES[dtype]


# What a Trainer saves beside the weights (vLLM leaves out the same files).
_TRAINING_FILES = ("training_args.bin", "optimizer.bin")


def _weight_files(folder: Path, index_name: str, pattern: str) -> list:
    """The files an index names (a sharded checkpoint), else every file of `pattern` but a
    Trainer's own."""
    index = folder / index_name
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map object")
        return [folder / name for name in sorted(set(weight_map.values()))]
    return sorted(f for f in folder.glob(pattern) if f.name not in _TRAINING_FILES)


def _safetensors_slices(file: Path) -> Iterator[Tuple[str, Any]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_slice(name)
    except (SafetensorError, OSError) as error:  # a truncated or foreign file
        raise ValueError(f"{file} is not a readable safetensors file: {error}") from None


def iter_weights(model_dir: str, load_format: str) -> Iterator[Tuple[str, Any]]:
    """(name, tensor) pairs of a checkpoint; from safetensors, lazy slices that read only
    the part a tensor-parallel rank asks for."""
    folder = Path(model_dir)
    if load_format in ("auto", "safetensors"):
        files = _weight_files(folder, "model.safetensors.index.json", "*.safetensors")
        if files:
            for file in files:
                yield from _safetensors_slices(file)
            return
        if load_format == "safetensors" or not list(folder.glob("*.bin")):
            raise FileNotFoundError(f"no *.safetensors weights in {model_dir!r}")
        raise FileNotFoundError(
            f"{model_dir!r} has only PyTorch *.bin weights; pass load_format='pt' to load them "
            "(read with torch.load(weights_only=True))")
    if load_format == "pt":
        files = _weight_files(folder, "pytorch_model.bin.index.json", "*.bin")
        if not files:
            raise FileNotFoundError(f"no *.bin weights in {model_dir!r}")
        for file in files:
            try:
                weights = torch.load(file, map_location="cpu", weights_only=True)
            except (RuntimeError, EOFError, pickle.UnpicklingError) as error:
                raise ValueError(f"{file} is not a readable PyTorch checkpoint: {error}") from None
            yield from weights.items()
        return
    raise ValueError(f"cannot read weights with load_format={load_format!r}")


_UNFUSED = {}
for _part, (_fused, _index) in STACKED_PARAMS.items():
    _UNFUSED.setdefault(_fused, []).append(_part)


def dummy_weights(model: DecoderForCausalLM, seed: int) -> Iterator[Tuple[str, torch.Tensor]]:
    """A checkpoint of small random weights (norm scales 1, so activations stay finite at
    any depth) in HF naming, for the whole model whatever share of it `model` holds: every
    tensor-parallel size builds the same model from the same seed."""
    generator = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        whole = type(model)(model.shard.full, None)
    for name, param in whole.named_parameters():
        if name.endswith("norm.weight"):
            yield name, torch.ones(param.shape)
            continue
        values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, 0.02,
                                                                       generator=generator)
        module_name, kind = name.rsplit(".", 1)
        module = whole.get_submodule(module_name)
        if not isinstance(module, MergedLinear):
            yield name, values
            continue
        prefix, fused = module_name.rsplit(".", 1)
        for part, piece in zip(_UNFUSED[fused], values.split(module.output_sizes)):
            yield f"{prefix}.{part}.{kind}", piece


def weight_bytes(hf_config: Dict[str, Any], dtype: torch.dtype) -> int:
    """Bytes the whole model's weights take in `dtype` (counted on the meta device: nothing
    is allocated)."""
    cls = model_class(hf_config)
    with torch.device("meta"):
        model = cls(cls.spec_from_config(hf_config), None)
    return sum(p.numel() for p in model.parameters()) * dtype.itemsize


def check_weights_fit_in_ram(hf_config: Dict[str, Any], dtype: torch.dtype,
                             copies: int = 1) -> None:
    """Refuse, before any weight is allocated, a model larger than the RAM available: its
    pages are committed as the weights load, and one that does not fit got the process
    killed by the kernel's OOM killer (exit 137, no message) after minutes of loading.
    `copies`: data-parallel replicas on this machine, which load theirs at the same time."""
    needed, available = copies * weight_bytes(hf_config, dtype), available_cpu_memory()
    if needed > available:
        each = f" ({copies} copies, one per data-parallel replica)" if copies > 1 else ""
        raise ValueError(f"the model's weights take {needed / 2**30:.1f} GiB in "
                         f"{str(dtype).replace('torch.', '')}{each}, more than the "
                         f"{available / 2**30:.1f} GiB of RAM available: load it in a "
                         "smaller dtype (bfloat16's weights take half of float32's), or free "
                         "memory")


def load_model(model_dir: str, hf_config: Dict[str, Any], dtype: torch.dtype,
               device: torch.device, backend: AttentionBackend, load_format: str,
               seed: int, quantization: Optional[str] = None,
               group: Optional["ParallelGroup"] = None) -> DecoderForCausalLM:
    """The model, or with `group` this rank's share of it (reading only its slices)."""
    cls = model_class(hf_config)
    spec = cls.spec_from_config(hf_config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(spec, backend, group)
    finally:
        torch.set_default_dtype(previous)
    weights = (dummy_weights(model, seed) if load_format == "dummy"
               else iter_weights(model_dir, load_format))
    with torch.no_grad():
        model.load_weights(weights)
    model.eval().requires_grad_(False)
    n_params = sum(p.numel() for p in model.parameters())
    model.pack_weights(quantization)
    logger.info("loaded %s (%.1fM parameters, %s) on %s", cls.__name__, n_params / 1e6,
                str(dtype).replace("torch.", ""), device)
    return model

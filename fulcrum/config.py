"""Engine configuration: every knob the user can turn, checked once, in one place.

Names and meanings follow vLLM's engine arguments so that a vLLM user feels at home.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Dict, Literal, Optional

import torch

from fulcrum.sampling_params import is_int

SchedulingPolicy = Literal["slo", "fcfs", "priority"]
BatchingMode = Literal["continuous", "static"]
LoadFormat = Literal["auto", "safetensors", "pt", "dummy"]
# How tensor-parallel ranks start (fulcrum/executor/): one in-process rank, spawned
# processes, Ray actors, torchrun's processes.
EXECUTOR_BACKENDS = ("uni", "mp", "ray", "external_launcher")

# vLLM's defaults for a server; fulcrum uses the same on every entry point.
DEFAULT_MAX_NUM_SEQS = 256
# Smaller than vLLM's 2048: a CPU step over 512 tokens takes ~0.6 s for a 135M model, which
# bounds how long a newly arrived request waits for its first token.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512
# What "auto" long_prefill_token_threshold means in vLLM: 4% of max_model_len.
AUTO_LONG_PREFILL_FRACTION = 0.04
# fulcrum's default prefill chunk: an eighth of the step budget (64 of 512 tokens). A step
# that carries a long prompt's chunk stays short, so a request arriving meanwhile gets its
# first token within about two short steps; the other seven eighths still fill with the
# chunks of up to seven more prompts, so throughput keeps full steps.
DEFAULT_CHUNK_FRACTION = 8
# vLLM's largest block size; a huge one (10**6) was accepted and made start-up crawl for
# minutes over two blocks of a million slots.
MAX_BLOCK_SIZE = 128
# Requests that may wait to run in the server before it answers 503.
DEFAULT_MAX_QUEUED_REQUESTS = 1024


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# What _check_types asks of a field by its declared type (an Optional one may also be None).
# Optional[int] fields are checked with their ranges ("must be a positive integer").
_TYPE_RULES = {
    "bool": (lambda v: isinstance(v, bool), "True or False"),
    "int": (is_int, "an integer"),
    "float": (_is_number, "a number"), "Optional[float]": (_is_number, "a number"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "Optional[str]": (lambda v: isinstance(v, str), "a string"),
}


def _dtype_name(value: object) -> object:
    """A torch.dtype's name ("bfloat16" for torch.bfloat16), the form dtype strings take;
    any other value as it is."""
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value


@dataclass
class EngineConfig:
    """All engine knobs. `resolve()` fills the derived ones once the model is known.

    max_num_seqs defaults to 256 (vLLM's), lowered to the token budget when that is smaller.
    """

    model: Optional[str] = None
    tokenizer: Optional[str] = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    # This engine's index among data-parallel replicas (the router numbers its own): requests
    # without a seed of their own draw from the stream of seed + rank, so that replicas do not
    # repeat one another's samples in lockstep; dummy weights come from the seed alone.
    data_parallel_rank: int = 0
    load_format: LoadFormat = "auto"
    max_model_len: Optional[int] = None
    # Scheduler.
    max_num_seqs: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: Optional[int] = None
    max_num_partial_prefills: Optional[int] = None
    # slo sizes each step's prompt chunks to latency targets; fcfs and priority keep a fixed
    # chunk rule (see docs/performance.md for the two side by side).
    scheduling_policy: SchedulingPolicy = "slo"
    # Latency targets (milliseconds) for requests that set none; None: derived from the
    # measured step time (see LLMEngine.slo_defaults).
    slo_ttft_ms: Optional[float] = None
    slo_tpot_ms: Optional[float] = None
    batching_mode: BatchingMode = "continuous"
    # KV cache.
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: Optional[int] = None
    num_gpu_blocks_override: Optional[int] = None
    # Request limits (see the README's "Security and limits").
    max_logprobs: int = 20
    max_n: int = 128
    # The server's alone (AsyncLLM's admission); None: DEFAULT_MAX_QUEUED_REQUESTS there.
    max_queued_requests: Optional[int] = None
    # A model's own sampling defaults: "auto" (its generation_config.json, if any), "vllm"
    # (none: the library's), or a folder holding a generation_config.json.
    generation_config: str = "auto"
    # Tensor parallelism: the model split across this many ranks (processes), each with its
    # share of the heads and MLP width, combined by all-reduces over torch.distributed.
    tensor_parallel_size: int = 1
    # How the other ranks are started: "mp" (spawned processes, the default with several
    # ranks), "ray" (Ray actors; joins $RAY_ADDRESS's cluster, else starts a local one),
    # "external_launcher" (torchrun's processes), "uni" (one rank, in-process; the default
    # with one). With one rank, the model always runs in the engine's process.
    distributed_executor_backend: Optional[str] = None
    # vLLM's; only 1 (fulcrum has no pipeline parallelism), accepted so commands carry over.
    pipeline_parallel_size: int = 1
    # vLLM: never capture CUDA graphs. fulcrum captures none, so it always runs eagerly.
    enforce_eager: bool = False
    # vLLM's --quantization: None (the model's dtype) or "int8" (int8 weights with a scale per
    # output channel computed at load, inputs quantized per row at run time; the LM head too).
    quantization: Optional[str] = None
    # vLLM: run code shipped in the model folder. fulcrum never does (only False).
    trust_remote_code: bool = False
    # vLLM: which tokenizer implementation; fulcrum has one, tokenizer.json (only "auto").
    tokenizer_mode: str = "auto"
    # vLLM: no periodic stats line and no engine series on /metrics from the server, and no
    # metrics from LLM (whose default is True, as in vLLM).
    disable_log_stats: bool = False

    def __post_init__(self) -> None:
        self._check_types()
        self._check_ranges()

    @property
    def sampling_seed(self) -> int:
        """The seed of the stream that requests without a seed of their own draw from (torch
        takes a seed modulo 2**64, so replica 0's is `seed` itself)."""
        return (self.seed + self.data_parallel_rank) % 2**64

    def _check_types(self) -> None:
        """Switches must be booleans ("no" is truthy); None for the two that vLLM declares
        Optional means their default, as there; a torch.dtype for dtype (vLLM's LLM takes
        one: `LLM(model, dtype=torch.bfloat16)`) is held as its name."""
        self.dtype = _dtype_name(self.dtype)
        for field in dataclasses.fields(self):
            if field.name in ("enable_chunked_prefill", "enable_prefix_caching") and \
                    getattr(self, field.name) is None:
                setattr(self, field.name, field.default)
            value = getattr(self, field.name)
            if isinstance(value, os.PathLike) and field.name in ("model", "tokenizer"):
                value = os.fspath(value)
                setattr(self, field.name, value)
            optional = field.type.startswith("Optional[")
            rule = _TYPE_RULES.get(field.type)
            if rule is not None and not (optional and value is None) and not rule[0](value):
                raise ValueError(f"{field.name} must be {rule[1]}, got {value!r}")

    def _check_ranges(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
                     "max_num_partial_prefills", "kv_cache_memory_bytes", "num_gpu_blocks_override",
                     "max_n", "max_queued_requests"):
            positive(name)
        if self.block_size > MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be at most {MAX_BLOCK_SIZE} (vLLM's largest), "
                             f"got {self.block_size}")
        if not is_int(self.seed) or not -2**63 <= self.seed < 2**64:
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if self.data_parallel_rank < 0:
            raise ValueError(f"data_parallel_rank must be a non-negative integer, got "
                             f"{self.data_parallel_rank!r}")
        if not is_int(self.max_logprobs) or self.max_logprobs < 0:
            raise ValueError(
                f"max_logprobs must be a non-negative integer, got {self.max_logprobs!r}")
        threshold = self.long_prefill_token_threshold
        if threshold is not None and (not is_int(threshold) or threshold < 0):
            raise ValueError(f"long_prefill_token_threshold must be a non-negative integer, "
                             f"got {threshold!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.scheduling_policy not in ("slo", "fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'slo', 'fcfs' or 'priority', got "
                             f"{self.scheduling_policy!r}")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and 0 < value < 1e9):
                raise ValueError(f"{name} must be a positive number of milliseconds, "
                                 f"got {value!r}")
        positive("tensor_parallel_size")
        if self.pipeline_parallel_size != 1:
            raise ValueError(f"pipeline_parallel_size={self.pipeline_parallel_size!r} is not "
                             "supported: fulcrum splits models by tensor parallelism only "
                             "(only 1 is accepted)")
        if self.distributed_executor_backend not in (None, *EXECUTOR_BACKENDS):
            raise ValueError(f"distributed_executor_backend must be one of "
                             f"{', '.join(EXECUTOR_BACKENDS)}, "
                             f"got {self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError("distributed_executor_backend='uni' runs one rank; "
                             f"tensor_parallel_size={self.tensor_parallel_size} needs 'mp', "
                             "'ray' or 'external_launcher'")
        if self.quantization not in (None, "int8"):
            raise ValueError(f"quantization={self.quantization!r} is not supported: fulcrum "
                             "has 'int8' (or None)")
        if self.trust_remote_code:
            raise ValueError("trust_remote_code=True is refused: fulcrum runs no code from "
                             "model folders (its architectures are built in; see the README)")
        if self.tokenizer_mode != "auto":
            raise ValueError(f"tokenizer_mode={self.tokenizer_mode!r} is not supported: fulcrum "
                             "reads the model's tokenizer.json (only 'auto')")
        if self.batching_mode not in ("continuous", "static"):
            raise ValueError(
                f"batching_mode must be 'continuous' or 'static', got {self.batching_mode!r}")
        if self.load_format not in ("auto", "safetensors", "pt", "dummy"):
            raise ValueError(f"load_format must be one of auto, safetensors, pt, dummy, "
                             f"got {self.load_format!r}")
        if not self.chunked_prefill:
            # Both shape prompt chunks: without chunks they would change nothing.
            off = " It is off here (enable_chunked_prefill=False or batching_mode='static')."
            if (self.max_num_partial_prefills or 1) > 1:
                raise ValueError("Chunked prefill must be enabled to set "
                                 "max_num_partial_prefills > 1." + off)  # vLLM's words
            if threshold:
                raise ValueError("Chunked prefill must be enabled to set "
                                 "long_prefill_token_threshold (the most tokens of a prompt "
                                 "in one step)." + off)

    @property
    def chunked_prefill(self) -> bool:
        """Whether prompts may be split into chunks: continuous batching with chunking on."""
        return self.enable_chunked_prefill and self.batching_mode == "continuous"

    def resolve(self, model_max_len: int) -> "EngineConfig":
        """Return a copy with max_model_len, the token budget and the prefill cap filled in."""
        max_model_len = self.max_model_len or model_max_len
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2 (a prompt token and a generated "
                             f"one), got {max_model_len}")
        if max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len={max_model_len} is larger than the model's maximum context "
                f"length ({model_max_len})")
        budget = self.max_num_batched_tokens
        chunked = self.chunked_prefill
        if budget is None:
            budget = DEFAULT_MAX_NUM_BATCHED_TOKENS
            if not chunked:
                budget = max(budget, max_model_len)
        elif not chunked and budget < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) is smaller than max_model_len "
                f"({max_model_len}): without chunked prefill the longest prompt could never be "
                "scheduled. Raise max_num_batched_tokens or enable chunked prefill.")
        max_num_seqs = self.max_num_seqs
        if max_num_seqs is None:
            # Every running request needs one token of budget per decode step.
            max_num_seqs = min(DEFAULT_MAX_NUM_SEQS, budget)
        elif max_num_seqs > budget:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) must be >= max_num_seqs ({max_num_seqs}): "
                "each running request needs one token of the step budget to decode")
        threshold = self.long_prefill_token_threshold
        partial = self.max_num_partial_prefills
        if threshold is None:
            # The slo policy sizes chunks by predicted step time instead of a fixed cap.
            fixed = chunked and self.scheduling_policy != "slo"
            threshold = max(1, budget // DEFAULT_CHUNK_FRACTION) if fixed else 0
        elif threshold == 0 and (partial or 1) > 1:
            threshold = max(1, int(max_model_len * AUTO_LONG_PREFILL_FRACTION))  # vLLM's rule
        if partial is None:
            # As many prompts part-way through prefill as their chunks fill a step; under
            # slo, chunks shrink to fit the step's time, so any prompt may be one.
            if self.scheduling_policy == "slo" and chunked and not threshold:
                partial = max_num_seqs
            else:
                partial = max(1, budget // threshold) if threshold else 1
        backend = self.distributed_executor_backend
        if self.tensor_parallel_size == 1:
            backend = "uni"
        elif backend is None:
            backend = "mp"
        return dataclasses.replace(
            self, distributed_executor_backend=backend,
            max_model_len=max_model_len, max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs, long_prefill_token_threshold=threshold,
            max_num_partial_prefills=partial)


def check_slo_targets_read(scheduling_policy: str, metrics: bool,
                           targets: Dict[str, Optional[float]], where: str) -> None:
    """Latency targets steer only the slo policy; under another, only metrics read them (each
    request's SLO met or missed). Given where neither does, they would change nothing, so
    they are refused. `targets`: name (as the caller spells it) -> value, None if not given;
    `metrics`: whether the caller keeps metrics; `where`: why it keeps none, for the message."""
    given = [name for name, value in targets.items() if value is not None]
    if given and scheduling_policy != "slo" and not metrics:
        raise ValueError(f"{' and '.join(given)}: latency targets steer only the slo "
                         f"scheduling policy, and {where}, so under {scheduling_policy!r} "
                         "they would change nothing (use 'slo', or leave them out)")

"""Command-line flags for every EngineConfig knob, shared by `serve`, `generate` and `bench`.

Flags are derived from the dataclass fields, so a knob added to EngineConfig is a flag at
once, with vLLM's spelling (`--max-num-seqs`, `--enable-prefix-caching/--no-enable-...`).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Dict

from fulcrum.config import EngineConfig

_HELP = {
    "tokenizer": "tokenizer folder (default: the model folder)",
    "dtype": "auto (the checkpoint's: a float32 one stays float32, unlike vLLM's auto, "
             "which runs it in half precision), float32, bfloat16 or float16",
    "device": "auto, cpu or cuda",
    "seed": "seed for dummy weights and for requests without their own seed",
    "data_parallel_rank": "this engine's index among data-parallel replicas (default 0; with "
                          "--data-parallel-size, the first replica's, the others counting up): "
                          "requests without a seed draw from the stream of seed + rank, so "
                          "replicas do not repeat one another's samples",
    "load_format": "auto, safetensors, pt (torch.load with weights_only=True) or dummy "
                   "(random weights from config.json alone)",
    "max_model_len": "longest prompt + output, in tokens (default: the model's)",
    "max_num_seqs": "most requests running at once (default 256, at most the token budget)",
    "max_num_batched_tokens": "token budget of one step (default 512)",
    "enable_chunked_prefill": "split long prompts into chunks that share steps with decodes",
    "long_prefill_token_threshold": "most tokens of one prompt in one step (default: none "
                                    "under slo, which sizes chunks by time; an eighth of the "
                                    "budget under fcfs and priority; 0: vLLM's rule, 4%% of "
                                    "max_model_len when max_num_partial_prefills > 1, else "
                                    "no cap; needs chunked prefill)",
    "max_num_partial_prefills": "most prompts part-way through prefill at once (default: "
                                "max_num_seqs under slo without a threshold; else as many as "
                                "their chunks fill a step, budget / threshold; > 1 needs "
                                "chunked prefill)",
    "scheduling_policy": "slo (default: meet TTFT/TPOT targets step by step), fcfs (first "
                         "come, first served, fixed chunks), or priority (lower value first; "
                         "may preempt; fixed chunks)",
    "slo_ttft_ms": "time-to-first-token target of requests that set none (default: half "
                   "a full-budget step, measured at start-up)",
    "slo_tpot_ms": "time-per-output-token target of requests that set none (default: half "
                   "a full-budget step, measured at start-up)",
    "batching_mode": "continuous, or static (a batch runs to its end before the next joins)",
    "block_size": "tokens per KV-cache block",
    "kv_cache_dtype": "auto (the model's dtype), float32, bfloat16 or float16: bfloat16 halves "
                      "the cache's memory and the decode attention's memory traffic",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "gpu_memory_utilization": "CUDA: fraction of device memory; CPU: fraction of available "
                              "RAM for the KV cache (capped at 4 GiB)",
    "kv_cache_memory_bytes": "exact KV-cache size in bytes (overrides the above)",
    "num_gpu_blocks_override": "exact number of KV blocks",
    "max_logprobs": "most logprobs (or top_logprobs) a request may ask for (default 20, vLLM's)",
    "max_n": "most completions (n) one request may ask for (default 128)",
    "max_queued_requests": "most requests waiting to run; the server answers "
                           "503 with Retry-After beyond it (default 1024)",
    "generation_config": "sampling defaults for unset request fields: auto (the model's "
                         "generation_config.json), vllm (none), or a folder holding one",
    "tensor_parallel_size": "split the model across this many ranks (processes; on CPU each "
                            "gets its share of the cores; see docs/distributed.md)",
    "distributed_executor_backend": "how the other ranks start: mp (spawned processes, the "
                                    "default), ray (Ray actors; $RAY_ADDRESS's cluster or a "
                                    "local one), external_launcher (under torchrun)",
    "pipeline_parallel_size": "vLLM's; only 1 (fulcrum has tensor parallelism only)",
    "enforce_eager": "vLLM's; fulcrum captures no graphs and always runs eagerly",
    "quantization": "int8: int8 weights with a scale per output channel, computed at load, "
                    "and each input row quantized at run time (half the weight bytes a decode "
                    "step reads, int8 dot products; the LM head included)",
    "trust_remote_code": "vLLM's; fulcrum runs no code from model folders (only off)",
    "tokenizer_mode": "vLLM's; only auto (the model's tokenizer.json)",
    "disable_log_stats": "no engine stats (vLLM's): no periodic stats line and no engine "
                         "series on /metrics in the server, no LLM.get_metrics()",
}


_SHORT = {"tensor_parallel_size": ("-tp",), "pipeline_parallel_size": ("-pp",),
          "quantization": ("-q",)}  # vLLM's


def _base_type(annotation: Any) -> type:
    hint = typing.get_type_hints(EngineConfig)[annotation]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Literal:
        return str
    if args:
        inner = args[0]
        return str if typing.get_origin(inner) is typing.Literal else inner
    return hint


# EngineConfig fields only the server reads (AsyncLLM's queue bound).
SERVER_ONLY = ("max_queued_requests",)


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple = ("model",),
                    served: bool = False) -> None:
    """Every EngineConfig field as a flag, but those in `skip`, and the server's own
    (max_queued_requests) where not `served`."""
    group = parser.add_argument_group("engine")
    defaults = EngineConfig()
    for f in dataclasses.fields(EngineConfig):
        if f.name in skip or (f.name in SERVER_ONLY and not served):
            continue
        flags = ["--" + f.name.replace("_", "-"), *_SHORT.get(f.name, ())]
        default = getattr(defaults, f.name)
        kind = _base_type(f.name)
        if kind is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=default,
                               help=_HELP.get(f.name))
        else:
            group.add_argument(*flags, type=kind, default=default, help=_HELP.get(f.name))


def engine_kwargs(args: argparse.Namespace) -> Dict[str, Any]:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return {k: v for k, v in vars(args).items() if k in names}

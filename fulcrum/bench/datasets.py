"""Benchmark prompts: random token ids, a long/short mix, chat-like lengths, or a JSONL file.

Random prompts are token-id lists with ids below 256: every byte-level vocabulary and every
real vocabulary has them, so the same prompt has the same length on any server and the
lengths are exact (no re-tokenisation). Requests carry a group so that the mixed scenario can
report its short and long requests apart.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Union

import numpy as np

from fulcrum.arg_types import non_negative_int, positive_int

RANDOM_ID_LIMIT = 256
CHAT_MAX_LEN = 4096  # --dataset chat's context without --max-model-len (or a server that says)
SHORT, LONG = "short", "long"


@dataclass(frozen=True)
class SampleRequest:
    prompt: Union[str, List[int]]
    prompt_len: int
    output_len: int
    group: str = "all"

    def engine_prompt(self) -> Union[str, dict]:
        """The prompt as `LLM.generate` / `LLMEngine.add_request` take it."""
        if isinstance(self.prompt, str):
            return self.prompt
        return {"prompt_token_ids": list(self.prompt)}


def _lengths(count: int, mean: int, range_ratio: float, rng: np.random.Generator) -> List[int]:
    """Uniform in [mean * (1 - r), mean * (1 + r)], at least 1 (vLLM's random dataset)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    low = max(1, int(mean * (1 - range_ratio)))
    high = max(low, int(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=count).tolist()


def random_requests(count: int, input_len: int, output_len: int, range_ratio: float,
                    rng: np.random.Generator, group: str = "all") -> List[SampleRequest]:
    inputs = _lengths(count, input_len, range_ratio, rng)
    outputs = _lengths(count, output_len, range_ratio, rng)
    return [SampleRequest(rng.integers(0, RANDOM_ID_LIMIT, size=n).tolist(), n, m, group)
            for n, m in zip(inputs, outputs)]


def mixed_requests(num_short: int, short_input_len: int, num_long: int, long_input_len: int,
                   output_len: int, range_ratio: float,
                   rng: np.random.Generator) -> List[SampleRequest]:
    """A few long prompts among many short ones: the head-of-line blocking scenario."""
    return (random_requests(num_long, long_input_len, output_len, range_ratio, rng, LONG)
            + random_requests(num_short, short_input_len, output_len, range_ratio, rng, SHORT))


def _log_normal(count: int, median: int, sigma: float, low: int, high: int,
                rng: np.random.Generator) -> List[int]:
    values = np.exp(np.log(median) + sigma * rng.standard_normal(count))
    return np.clip(np.rint(values), low, high).astype(int).tolist()


def chat_requests(count: int, input_len: int, output_len: int, max_len: int,
                  rng: np.random.Generator) -> List[SampleRequest]:
    """Conversation-like lengths without a download: prompts and answers log-normal around
    the given medians (sigma 1.0 and 0.8), as in ShareGPT-style traces: mostly short, with a
    tail of long prompts (up to max_len / 2) that make the prefill/decode trade-off matter.
    Prompts of `SHORT` and `LONG` groups split at four times the median."""
    inputs = _log_normal(count, input_len, 1.0, 4, max(4, max_len // 2), rng)
    outputs = _log_normal(count, output_len, 0.8, 2, max(2, max_len // 8), rng)
    return [SampleRequest(rng.integers(0, RANDOM_ID_LIMIT, size=n).tolist(), n, m,
                          LONG if n > 4 * input_len else SHORT)
            for n, m in zip(inputs, outputs)]


def jsonl_requests(path: str, default_output_len: int,
                   count_tokens: Optional[Callable[[str], int]] = None) -> List[SampleRequest]:
    """One JSON object per line: `prompt` (text or token ids), optional `output_len`, `group`.

    Text prompts are measured with `count_tokens` when given; otherwise their length is 0
    until a server's `usage` reports it.
    """
    requests = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        item = json.loads(line)
        prompt = item.get("prompt")
        if isinstance(prompt, str):
            length = count_tokens(prompt) if count_tokens else 0
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            length = len(prompt)
        else:
            raise ValueError(f"{path}:{number}: 'prompt' must be text or a list of token ids")
        requests.append(SampleRequest(prompt, length, int(item.get("output_len",
                                                                   default_output_len)),
                                      item.get("group", "all")))
    return requests


# What each dataset reads, and the value of a setting not given. A setting given to a dataset
# that does not read it is refused: it would change nothing while the report claimed it.
DATASET_SETTINGS = {
    "random": ("num_prompts", "input_len", "output_len", "range_ratio"),
    "mixed": ("num_prompts", "input_len", "output_len", "range_ratio", "long_num_prompts",
              "long_input_len"),
    "chat": ("num_prompts", "input_len", "output_len"),
    "jsonl": ("dataset_path", "num_prompts", "output_len"),
}
SETTING_DEFAULTS = {"num_prompts": 64, "input_len": 256, "output_len": 128, "range_ratio": 0.0,
                    "long_num_prompts": 2, "long_input_len": 2048}


def add_dataset_args(parser: argparse.ArgumentParser, **defaults: int) -> None:
    """`defaults` replace SETTING_DEFAULTS for this command (bench sweep's smaller scenario)."""
    group = parser.add_argument_group("dataset")
    group.add_argument("--dataset", choices=list(DATASET_SETTINGS), default="random")
    group.add_argument("--dataset-path", help="the JSONL file of --dataset jsonl")
    group.add_argument("--num-prompts", type=positive_int,
                       help="requests (the short ones for --dataset mixed; the first ones of "
                            "the file for --dataset jsonl, default all)")
    group.add_argument("--input-len", type=positive_int,
                       help="prompt tokens (the short ones for --dataset mixed; the median "
                            "for --dataset chat)")
    group.add_argument("--output-len", type=positive_int,
                       help="tokens generated per request (the median for --dataset chat; for "
                            "--dataset jsonl, of lines without their own)")
    group.add_argument("--range-ratio", type=float,
                       help="random, mixed: lengths drawn uniformly within +-ratio of the given "
                            "ones")
    group.add_argument("--long-num-prompts", type=non_negative_int, help="mixed: long requests")
    group.add_argument("--long-input-len", type=positive_int, help="mixed: long prompt tokens")
    group.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals")
    parser.set_defaults(dataset_defaults={**SETTING_DEFAULTS, **defaults})


def resolve_dataset_args(args: argparse.Namespace) -> None:
    """Fill in the settings the dataset reads that were not given; refuse those it ignores."""
    reads = DATASET_SETTINGS[args.dataset]
    for name in {name for names in DATASET_SETTINGS.values() for name in names} - set(reads):
        if getattr(args, name) is not None:
            raise ValueError(f"--{name.replace('_', '-')} is not read by --dataset "
                             f"{args.dataset}")
    for name in reads:
        if getattr(args, name) is None and not (args.dataset == "jsonl" and name != "output_len"):
            setattr(args, name, args.dataset_defaults[name])


def build_requests(args: argparse.Namespace,
                   count_tokens: Optional[Callable[[str], int]] = None) -> List[SampleRequest]:
    """The dataset's requests; fills in `args`' unset settings first (resolve_dataset_args)."""
    resolve_dataset_args(args)
    rng = np.random.default_rng(args.seed)
    if args.dataset == "random":
        return random_requests(args.num_prompts, args.input_len, args.output_len,
                               args.range_ratio, rng)
    if args.dataset == "mixed":
        return mixed_requests(args.num_prompts, args.input_len, args.long_num_prompts,
                              args.long_input_len, args.output_len, args.range_ratio, rng)
    if args.dataset == "chat":
        return chat_requests(args.num_prompts, args.input_len, args.output_len,
                             getattr(args, "max_model_len", None) or CHAT_MAX_LEN, rng)
    if not args.dataset_path:
        raise ValueError("--dataset jsonl needs --dataset-path")
    return jsonl_requests(args.dataset_path, args.output_len, count_tokens)[:args.num_prompts]

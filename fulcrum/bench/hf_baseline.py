"""The HF transformers baseline: `generate` in static batches over the same prompts.

This is what a user without an inference engine would run, so it anchors fulcrum's offline
throughput. transformers is a bench/test extra, imported only here. With a config-only
folder the HF model gets random weights from the same config, like fulcrum's dummy load.
"""

from __future__ import annotations

import time
from typing import List

import torch

from fulcrum.bench.datasets import SampleRequest
from fulcrum.bench.throughput import ThroughputResult, peak_rss_mib

PAD_ID = 0


def _batch_tensors(batch: List[SampleRequest]) -> tuple:
    """Left-padded input ids and their attention mask (all ones when lengths agree)."""
    width = max(r.prompt_len for r in batch)
    ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, request in enumerate(batch):
        if isinstance(request.prompt, str):
            raise ValueError("the HF baseline takes token-id prompts (random or mixed datasets)")
        ids[row, width - request.prompt_len:] = torch.tensor(request.prompt)
        mask[row, width - request.prompt_len:] = 1
    return ids, mask


def measure_hf(model_dir: str, dtype: torch.dtype, device: str, requests: List[SampleRequest],
               batch_size: int, random_weights: bool) -> ThroughputResult:
    """Greedy, EOS disabled, each batch generating its longest requested output. The output
    tokens counted are the ones asked for (as vLLM's HF baseline counts them): the rows of a
    batch that run past their own length make tokens nobody asked for, which are HF's waste,
    not its throughput."""
    import transformers

    if random_weights:
        config = transformers.AutoConfig.from_pretrained(model_dir)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model = model.to(device).eval()
    model.generation_config.eos_token_id = None
    output_tokens = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(requests), batch_size):
            batch = requests[first:first + batch_size]
            ids, mask = _batch_tensors(batch)
            new = max(r.output_len for r in batch)
            out = model.generate(ids.to(device), attention_mask=mask.to(device),
                                 max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 pad_token_id=PAD_ID)
            made = out.shape[1] - ids.shape[1]
            output_tokens += sum(min(r.output_len, made) for r in batch)
    elapsed = time.perf_counter() - start
    return ThroughputResult(len(requests), sum(r.prompt_len for r in requests), output_tokens,
                            elapsed, peak_rss_mib())

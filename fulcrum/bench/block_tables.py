"""Block tables as a long-running server's BlockManager hands them out: what
benchmarks/attention_layout.py times decode attention over, and what tests/test_block_manager.py
checks stays in runs of adjacent blocks."""

from __future__ import annotations

import random
from typing import Dict, List, Tuple

from fulcrum.core.block_manager import BlockManager
from fulcrum.core.request import Request
from fulcrum.sampling_params import SamplingParams


def long_run_tables(manager: BlockManager, batch: int, per: int, requests: int,
                    rng: random.Random, prompt_lens: Tuple[int, int] = (64, 512),
                    output_lens: Tuple[int, int] = (32, 256)) -> List[List[int]]:
    """`batch` block tables (their first `per` blocks) of requests running once `requests`
    requests have gone through `manager`: `batch` at a time, each a random prompt of
    `prompt_lens` tokens prefilled at once, then one token a step up to its random output
    length of `output_lens`; tables taken at several moments after that."""
    running: List[Tuple[Request, int]] = []
    tables: Dict[str, List[int]] = {}
    admitted = 0
    while len(tables) < batch:
        while len(running) < batch:
            prompt = [rng.randrange(32000) for _ in range(rng.randint(*prompt_lens))]
            request = Request(str(admitted), prompt, SamplingParams())
            if not manager.allocate_slots(request, len(prompt),
                                          manager.get_computed_blocks(request)):
                break
            request.num_computed_tokens = len(prompt)
            running.append((request, rng.randint(*output_lens)))
            admitted += 1
        for request, output_len in list(running):
            if request.num_output_tokens == output_len:
                manager.free(request)
                running.remove((request, output_len))
                continue
            if not manager.append_slot(request) and not manager.allocate_slots(request, 1):
                raise RuntimeError("the simulated server ran out of blocks")
            request.append_token(rng.randrange(32000))
            request.num_computed_tokens += 1
            table = manager.block_table(request.request_id)
            if admitted > requests and len(table) >= per and admitted % 16 == 0:
                tables.setdefault(request.request_id, table[:per])
    return list(tables.values())[:batch]

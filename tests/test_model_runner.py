"""The runner's inputs: a step of single tokens (decodes, mostly) is packed by a fast path
into one persistent buffer; it must give exactly what the general path gives, step after
step, whatever the shape."""

from types import SimpleNamespace

import torch

from fulcrum.core.request import SamplingRow
from fulcrum.core.scheduler import ScheduledChunk
from fulcrum.sampling_params import SamplingParams
from fulcrum.worker.kv_cache import NULL_BLOCK
from fulcrum.worker.model_runner import ModelRunner


def runner(splits: bool) -> ModelRunner:
    model = SimpleNamespace(spec=SimpleNamespace(sliding_window=None))
    backend = SimpleNamespace(reads_padding=False, splits=splits)
    return ModelRunner(model, [], block_size=4, device=torch.device("cpu"), seed=0,
                       backend=backend)


def chunk(request_id: str, token: int, start: int, table, sample: bool = True):
    row = SamplingRow(request_id, SamplingParams(), [], 0) if sample else None
    return ScheduledChunk(request_id, [token], start, list(table), row)


def unpack(prepared):
    ids, positions, meta, rows = prepared
    return {"ids": ids.tolist(), "positions": positions.tolist(),
            "slots": meta.slot_mapping.tolist(), "tables": meta.block_tables.tolist(),
            "query_start": meta.query_start_loc.tolist(), "seq_lens": meta.seq_lens.tolist(),
            "num_decodes": meta.num_decodes, "rows": None if rows is None else rows.tolist()}


def test_single_token_steps_get_what_the_general_path_gives():
    fast, general = runner(splits=False), runner(splits=True)
    steps = [
        [chunk("a", 11, 5, [7, 3]), chunk("b", 12, 0, [9]), chunk("c", 13, 8, [1, 2, 6])],
        # the same shape again: the buffer's views are reused and must show the new values
        [chunk("a", 21, 6, [7, 3]), chunk("b", 22, 1, [9]), chunk("c", 23, 9, [1, 2, 6])],
        # a one-token chunk inside a prompt does not sample: only the others' rows do
        [chunk("a", 31, 7, [7, 3]), chunk("d", 32, 2, [5], sample=False)],
        [chunk("e", 41, 12, [4, 8, 10, 2])],
    ]
    for step in steps:
        got = unpack(fast._prepare(step))
        assert got == unpack(general._prepare(step))
    assert got == {"ids": [41], "positions": [12], "slots": [2 * 4 + 0],
                   "tables": [[4, 8, 10, 2]], "query_start": [0, 1], "seq_lens": [13],
                   "num_decodes": 1, "rows": None}


def test_the_fast_path_pads_block_tables_and_skips_rows_that_do_not_sample():
    ids, positions, meta, rows = runner(splits=False)._prepare(
        [chunk("a", 5, 6, [7, 3]), chunk("b", 6, 2, [9], sample=False)])
    assert ids.tolist() == [5, 6] and positions.tolist() == [6, 2]
    assert meta.slot_mapping.tolist() == [3 * 4 + 2, 9 * 4 + 2]
    assert meta.block_tables.tolist() == [[7, 3], [9, NULL_BLOCK]]
    assert meta.query_start_loc.tolist() == [0, 1, 2] and meta.seq_lens.tolist() == [7, 3]
    assert rows.tolist() == [0]

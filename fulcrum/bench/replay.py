"""Replay a serving scenario against an in-process engine, in real time.

The sweep needs TTFT and TPOT under many engine settings; starting a server per setting would
add HTTP noise and start-up cost. Here each request is added to an `LLMEngine` once its
arrival time has passed, and every step's end time is a token's arrival, which gives the same
`RequestTimeline`s as the HTTP client. A request's send time is its scheduled arrival, so
time spent waiting for a running step to finish counts, as it would on a server.
"""

from __future__ import annotations

import collections
import time
from typing import Dict, List, Tuple

from tqdm.auto import tqdm

from fulcrum.bench.arrivals import Schedule
from fulcrum.bench.metrics import RequestTimeline
from fulcrum.engine import LLMEngine
from fulcrum.sampling_params import RequestOutputKind, SamplingParams


def bench_params(output_len: int) -> SamplingParams:
    """Greedy, EOS ignored, exactly `output_len` tokens, only the new tokens in each output."""
    return SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True,
                          output_kind=RequestOutputKind.DELTA)


def replay(engine: LLMEngine, timed: Schedule,
           show_progress: bool = False) -> Tuple[List[RequestTimeline], float]:
    """Run the schedule; timelines in schedule order, and the duration of the run."""
    pending = collections.deque(enumerate(timed))
    timelines: Dict[str, RequestTimeline] = {}
    bar = tqdm(total=len(timed), desc="Requests", disable=not show_progress, dynamic_ncols=True)
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter()
        while pending and start + pending[0][1][0] <= now:
            index, (offset, request) = pending.popleft()
            request_id = str(index)
            # Its arrival on the engine's clock is its scheduled time, as a server stamps a
            # request on receipt, though the engine only sees it once the running step ends.
            engine.add_request(request_id, request.engine_prompt(),
                               bench_params(request.output_len),
                               arrival_time=time.monotonic() - (now - start - offset))
            timelines[request_id] = RequestTimeline(start + offset, request.prompt_len, 0,
                                                    group=request.group)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + pending[0][1][0] - now))
            continue
        outputs = engine.step()
        stamp = time.perf_counter()
        for output in outputs:
            timeline = timelines[output.request_id]
            new_tokens = len(output.outputs[0].token_ids)
            if new_tokens:
                timeline.chunk_times.append(stamp)
                timeline.output_len += new_tokens
            bar.update(int(output.finished))
    bar.close()
    return [timelines[str(i)] for i in range(len(timed))], time.perf_counter() - start

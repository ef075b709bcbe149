"""When each request is sent: all at once, Poisson at a rate, or gamma with a burstiness.

Gaps are gamma-distributed with shape `burstiness` and mean 1/rate, as in vLLM: burstiness 1
is a Poisson process, below 1 burstier, above 1 more regular. A request group given a rate
of its own (the mixed dataset's long requests) arrives apart at that rate; all the other
requests arrive together, as one process at the "all" rate, whatever their groups (the chat
dataset's short and long requests are reported apart, not sent apart).
"""

from __future__ import annotations

import argparse
import math
from typing import Dict, List, Tuple

import numpy as np

from fulcrum.bench.datasets import LONG, SampleRequest

Schedule = List[Tuple[float, SampleRequest]]  # (seconds after the start, request)


def arrival_offsets(count: int, rate: float, burstiness: float,
                    rng: np.random.Generator) -> List[float]:
    """Send times in seconds from the start; the first request goes at 0."""
    if not rate > 0 or not 0 < burstiness < math.inf:  # NaN fails both
        raise ValueError(f"the request rate must be positive (inf: all at once) and the "
                         f"burstiness positive and finite, got {rate}, {burstiness}")
    if math.isinf(rate):
        return [0.0] * count
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=count)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]).tolist() if count else []


def schedule(requests: List[SampleRequest], rates: Dict[str, float], burstiness: float,
             seed: int) -> Schedule:
    """Offsets for every request, one arrival process per group with a rate of its own in
    `rates` and one for the rest at `rates["all"]`, merged in time order (stable)."""
    rng = np.random.default_rng(seed)
    process = [r.group if r.group in rates else "all" for r in requests]
    timed: Schedule = []
    for key in dict.fromkeys(process):
        members = [r for r, k in zip(requests, process) if k == key]
        offsets = arrival_offsets(len(members), rates[key], burstiness, rng)
        timed.extend(zip(offsets, members))
    return sorted(timed, key=lambda item: item[0])


def add_arrival_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("arrivals")
    group.add_argument("--request-rate", type=float, default=math.inf,
                       help="requests per second (inf: all at once)")
    group.add_argument("--burstiness", type=float, default=1.0,
                       help="gamma shape of the gaps: 1 Poisson, <1 burstier, >1 steadier")
    group.add_argument("--long-request-rate", type=float,
                       help="arrival rate of the long requests, apart from the others "
                            "(default: inf, at the start, for --dataset mixed; with the others "
                            "at --request-rate otherwise)")


def build_schedule(requests: List[SampleRequest], args: argparse.Namespace) -> Schedule:
    long_rate = args.long_request_rate
    if long_rate is not None and not any(r.group == LONG for r in requests):
        raise ValueError("--long-request-rate is given but the dataset has no long requests")
    rates = {"all": args.request_rate}
    if long_rate is not None:
        rates[LONG] = long_rate
    elif args.dataset == "mixed":  # the head-of-line scenario: the long prompts come first
        rates[LONG] = math.inf
    return schedule(requests, rates, args.burstiness, args.seed)

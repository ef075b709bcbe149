"""When each request is sent: all at once, Poisson at a rate, or gamma with a burstiness.

Gaps are gamma-distributed with shape `burstiness` and mean 1/rate, as in vLLM: burstiness 1
is a Poisson process, below 1 burstier, above 1 more regular. Each request group (the mixed
dataset's short and long requests) can arrive at its own rate.
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
    """Offsets for every request, group by group, merged in time order (stable)."""
    rng = np.random.default_rng(seed)
    timed: Schedule = []
    for group in dict.fromkeys(r.group for r in requests):
        members = [r for r in requests if r.group == group]
        offsets = arrival_offsets(len(members), rates.get(group, rates["all"]), burstiness, rng)
        timed.extend(zip(offsets, members))
    return sorted(timed, key=lambda item: item[0])


def add_arrival_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("arrivals")
    group.add_argument("--request-rate", type=float, default=math.inf,
                       help="requests per second (inf: all at once)")
    group.add_argument("--burstiness", type=float, default=1.0,
                       help="gamma shape of the gaps: 1 Poisson, <1 burstier, >1 steadier")
    group.add_argument("--long-request-rate", type=float,
                       help="mixed, chat: arrival rate of the long requests (default inf: at "
                            "the start)")


def build_schedule(requests: List[SampleRequest], args: argparse.Namespace) -> Schedule:
    long_rate = args.long_request_rate
    if long_rate is not None and not any(r.group == LONG for r in requests):
        raise ValueError("--long-request-rate is given but the dataset has no long requests")
    rates = {"all": args.request_rate, LONG: math.inf if long_rate is None else long_rate}
    return schedule(requests, rates, args.burstiness, args.seed)

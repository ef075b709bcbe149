"""Per-step statistics: what each step computed and how the engine's queues and cache stood."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional

if TYPE_CHECKING:
    from fulcrum.outputs import RequestOutput


@dataclass
class StepStats:
    step: int
    start_time: float  # time.monotonic()
    wall_seconds: float  # the whole step: schedule, prepare, forward, sample, detokenise
    predicted_seconds: float  # what the step-time model expected wall_seconds to be
    forward_seconds: float  # the model's forward pass and logits alone
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    num_preempted: int  # preemptions in this step
    num_preemptions_total: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_cache_usage: float
    prefix_cache_queries: int  # cumulative prompt tokens looked up
    prefix_cache_hits: int  # cumulative prompt tokens found cached

    @property
    def overhead_fraction(self) -> float:
        """Share of the step's wall time spent outside the forward pass."""
        if self.wall_seconds <= 0:
            return 0.0
        return 1.0 - self.forward_seconds / self.wall_seconds

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


@dataclass
class StepReport:
    """What one engine step tells its observers (the server's event loop, the metrics)."""

    outputs: List["RequestOutput"]  # DELTA outputs: only what is new since the last report
    stats: Optional[StepStats]
    num_preempted: int  # requests waiting to resume after a preemption
    time: float  # time.monotonic() when the step ended


@dataclass
class FinishedRequest:
    """A request that ran its course (finish reason stop or length), as the dashboard's
    latency window reads it: times in seconds, time.monotonic()."""

    finished_time: float
    ttft_s: Optional[float]
    tpot_s: Optional[float]  # mean time per output token after the first; None for one token
    num_prompt_tokens: int
    num_output_tokens: int
    slo_ttft_s: float
    slo_tpot_s: float
    num_cached_tokens: int  # prompt tokens found in the prefix cache when first scheduled

"""Which request goes first: small policy objects the scheduler consults for order and victims."""

from __future__ import annotations

from typing import Callable, Dict, Tuple

from fulcrum.request import Request

SortKey = Tuple


class SchedulingPolicy:
    """Orders requests; the smallest key is served first and preempted last."""

    name = "base"

    def key(self, request: Request) -> SortKey:
        raise NotImplementedError

    def may_preempt_for(self, candidate: Request, victim: Request) -> bool:
        """Whether admitting `candidate` justifies evicting the running `victim`."""
        return False


class FcfsPolicy(SchedulingPolicy):
    """First come, first served: arrival order (request id breaks ties)."""

    name = "fcfs"

    def key(self, request: Request) -> SortKey:
        return (request.arrival_time, request.request_id)


class PriorityPolicy(SchedulingPolicy):
    """Lower `priority` value first, then arrival. A waiting request may preempt a running one
    of strictly worse priority when the batch or the KV cache is full."""

    name = "priority"

    def key(self, request: Request) -> SortKey:
        return (request.priority, request.arrival_time, request.request_id)

    def may_preempt_for(self, candidate: Request, victim: Request) -> bool:
        return candidate.priority < victim.priority


POLICIES: Dict[str, Callable[[], SchedulingPolicy]] = {
    "fcfs": FcfsPolicy,
    "priority": PriorityPolicy,
}


def make_policy(name: str) -> SchedulingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling_policy {name!r}; choose from {sorted(POLICIES)}") \
            from None

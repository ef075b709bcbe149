"""Where the ranks of a tensor-parallel model run: ports, cores, threads."""

from __future__ import annotations

import os
import socket
import threading
from typing import List, Optional, Sequence, Set, Tuple

import torch


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def split_cores(world_size: int, cores: Optional[Sequence[int]] = None) -> List[List[int]]:
    """This machine's cores cut into `world_size` contiguous shares, one per rank, so the
    ranks' thread pools never compete; with fewer cores than ranks, ranks share them."""
    cores = sorted(cores if cores is not None else DriverPin.process_cores())
    if len(cores) < world_size:
        return [[cores[rank % len(cores)]] for rank in range(world_size)]
    share, extra = divmod(len(cores), world_size)
    shares, start = [], 0
    for rank in range(world_size):
        size = share + (rank < extra)
        shares.append(cores[start:start + size])
        start += size
    return shares


def pin_to_cores(cores: Sequence[int]) -> None:
    """Run this process (and the thread pool of its matrix work) on `cores` only."""
    os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(len(cores))


class DriverPin:
    """A tensor-parallel driver's thread pinned to its share of the cores, in the caller's
    own process: undone by `release` (at shutdown, or when its engine is collected). The
    process's cores and threads are one for all engines in it, so they are kept here: while
    any driver is pinned, the cores to share are the process's own (not a pinned driver's
    one), and the last release gives the process back what it had (a second engine's own
    save would be the first's pin)."""

    _lock = threading.Lock()
    _pinned = 0
    _unpinned: Optional[Tuple[Set[int], int]] = None

    def __init__(self, cores: Sequence[int]) -> None:
        with DriverPin._lock:
            if DriverPin._pinned == 0:
                DriverPin._unpinned = (os.sched_getaffinity(0), torch.get_num_threads())
            DriverPin._pinned += 1
            self._held = True
            pin_to_cores(cores)

    def release(self) -> None:
        with DriverPin._lock:
            if not self._held:
                return
            self._held = False
            DriverPin._pinned -= 1
            if DriverPin._pinned == 0 and DriverPin._unpinned is not None:
                cores, threads = DriverPin._unpinned
                os.sched_setaffinity(0, cores)
                torch.set_num_threads(threads)

    @staticmethod
    def process_cores() -> Set[int]:
        with DriverPin._lock:
            if DriverPin._pinned and DriverPin._unpinned is not None:
                return set(DriverPin._unpinned[0])
        return os.sched_getaffinity(0)

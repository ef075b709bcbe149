"""Where the ranks of a tensor-parallel model run: ports, cores, threads."""

from __future__ import annotations

import os
import socket
from typing import List, Optional, Sequence

import torch


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def split_cores(world_size: int, cores: Optional[Sequence[int]] = None) -> List[List[int]]:
    """This machine's cores cut into `world_size` contiguous shares, one per rank, so the
    ranks' thread pools never compete; with fewer cores than ranks, ranks share them."""
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
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

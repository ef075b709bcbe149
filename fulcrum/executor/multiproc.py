"""Tensor parallelism on one machine: the other ranks in processes spawned by the engine."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import threading
import weakref
from typing import List, Optional, Sequence

import torch

from fulcrum.distributed.group import ParallelGroup, connect
from fulcrum.distributed.launch import free_port, pin_to_cores, split_cores
from fulcrum.executor.parallel import ParallelExecutor, describe_dead
from fulcrum.worker.worker import Worker, WorkerConfig

LOCALHOST = "127.0.0.1"
STOP_TIMEOUT_S = 10.0


def run_rank(wc: WorkerConfig, rank: int, world_size: int, port: int,
             cores: Optional[Sequence[int]]) -> None:
    """A spawned rank's whole life: pin, join the group, build its share, follow."""
    if cores:
        pin_to_cores(cores)
    parent = os.getppid()
    group = connect(rank, world_size, LOCALHOST, port,
                    torch.device("cuda", rank) if wc.device == "cuda" else torch.device("cpu"),
                    host=LOCALHOST, same_host=True,
                    gone=lambda: "the tensor-parallel driver ended" if os.getppid() != parent
                    else "")
    Worker(wc, group).follow_driver()


class MultiprocExecutor(ParallelExecutor):
    def __init__(self, wc: WorkerConfig) -> None:
        world = wc.config.tensor_parallel_size
        cores = split_cores(world) if wc.device == "cpu" else [None] * world
        port = free_port(LOCALHOST)
        context = multiprocessing.get_context("spawn")  # forking a process with threads is unsafe
        self._procs = [context.Process(target=run_rank, args=(wc, rank, world, port, cores[rank]),
                                       name=f"fulcrum-tp-rank{rank}", daemon=True)
                       for rank in range(1, world)]
        super().__init__()
        for process in self._procs:
            process.start()
        self._finalizer = weakref.finalize(self, _stop, self._procs, 0.0)
        try:
            self._pin_driver(cores[0])
            group = connect(0, world, LOCALHOST, port,
                            torch.device("cuda", 0) if wc.device == "cuda" else torch.device("cpu"),
                            host=LOCALHOST, same_host=True, gone=self._dead_ranks)
            threading.Thread(target=_abort_when_one_ends, args=(self._procs, group),
                             name="fulcrum-tp-watch", daemon=True).start()
            self._start_driver(wc, group)
        except BaseException as error:
            self._fail_start(error)

    def _dead_ranks(self) -> str:
        return describe_dead([f"rank {rank} (exit code {p.exitcode})"
                              for rank, p in enumerate(self._procs, 1) if not p.is_alive()])

    def _stop_ranks(self) -> None:
        self._finalizer.detach()
        _stop(self._procs, 0.0 if self._failed else STOP_TIMEOUT_S)


def _abort_when_one_ends(procs: List[multiprocessing.Process], group: ParallelGroup) -> None:
    """Abort the group's collectives as soon as a rank's process ends (at shutdown too,
    when nothing waits on them any more): the driver may be waiting for it inside native
    code, which cannot ask who has ended."""
    multiprocessing.connection.wait([process.sentinel for process in procs])
    group.abort()


def _stop(procs: List[multiprocessing.Process], grace_s: float) -> None:
    for process in procs:
        process.join(grace_s if process.is_alive() else 0)
        if process.is_alive():
            process.terminate()
            process.join(STOP_TIMEOUT_S)

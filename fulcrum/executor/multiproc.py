"""Tensor parallelism on one machine: the other ranks in processes spawned by the engine."""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import weakref
from typing import Dict, List, Optional, Sequence

import torch

from fulcrum.distributed.group import ParallelGroup, connect
from fulcrum.distributed.launch import free_port, pin_to_cores, split_cores
from fulcrum.executor.parallel import ParallelExecutor, describe_dead
from fulcrum.worker.worker import Worker, WorkerConfig

LOCALHOST = "127.0.0.1"
STOP_TIMEOUT_S = 10.0
MAX_LAST_WORDS = 300  # characters of a failed rank's error passed on to the driver


def run_rank(wc: WorkerConfig, rank: int, world_size: int, port: int,
             cores: Optional[Sequence[int]],
             last_words: multiprocessing.connection.Connection) -> None:
    """A spawned rank's whole life: pin, join the group, build its share, follow. If it
    fails, the error goes to the driver through `last_words` (its traceback to stderr).

    A terminal's Ctrl-C goes to its whole foreground process group, the ranks included, and
    systemd's stop sends SIGTERM to every process of the service: a rank either ended
    stopped the engine for good (the server exited 1 mid-drain, LLM failed every later
    call). Ranks ignore both: the driver takes them (a server drains), then stops the ranks
    (`_stop`), or they end once it is gone."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    try:
        if cores:
            pin_to_cores(cores)
        parent = os.getppid()
        group = connect(rank, world_size, LOCALHOST, port,
                        torch.device("cuda", rank) if wc.device == "cuda" else torch.device("cpu"),
                        host=LOCALHOST, same_host=True,
                        gone=lambda: "the tensor-parallel driver ended" if os.getppid() != parent
                        else "")
        Worker(wc, group).follow_driver()
    except BaseException as error:
        with contextlib.suppress(OSError):  # the driver may be gone
            last_words.send(f"{type(error).__name__}: {error}".splitlines()[0][:MAX_LAST_WORDS])
        if isinstance(error, ConnectionError):  # the group broke elsewhere: no traceback
            raise SystemExit(1) from None
        raise


class MultiprocExecutor(ParallelExecutor):
    def __init__(self, wc: WorkerConfig) -> None:
        world = wc.config.tensor_parallel_size
        cores = split_cores(world) if wc.device == "cpu" else [None] * world
        port = free_port(LOCALHOST)
        context = multiprocessing.get_context("spawn")  # forking a process with threads is unsafe
        pipes = [context.Pipe(duplex=False) for _ in range(1, world)]
        self._procs = [context.Process(target=run_rank,
                                       args=(wc, rank, world, port, cores[rank], writer),
                                       name=f"fulcrum-tp-rank{rank}", daemon=True)
                       for rank, (_, writer) in enumerate(pipes, 1)]
        self._ranks = _Ranks(self._procs, [reader for reader, _ in pipes])
        super().__init__()
        for process, (_, writer) in zip(self._procs, pipes):
            process.start()
            writer.close()  # the rank holds its own end; at its exit the pipe reads EOF
        # An engine dropped without shutdown ends its ranks (they held its share of the
        # model and cache for as long as the caller lived).
        self._finalizer = weakref.finalize(self, _stop, self._procs, 0.0)
        _stop_before_multiprocessing_exits(self._finalizer)
        try:
            self._pin_driver(cores[0])
            group = connect(0, world, LOCALHOST, port,
                            torch.device("cuda", 0) if wc.device == "cuda" else torch.device("cpu"),
                            host=LOCALHOST, same_host=True, gone=self._ranks.dead)
            threading.Thread(target=_abort_when_one_ends, args=(self._procs, group),
                             name="fulcrum-tp-watch", daemon=True).start()
            self._start_driver(wc, group)
        except BaseException as error:
            self._fail_start(error)

    def _dead_ranks(self) -> str:
        return self._ranks.dead()

    def _stop_ranks(self) -> None:
        self._finalizer.detach()
        atexit.unregister(self._finalizer)
        _stop(self._procs, 0.0 if self._failed else STOP_TIMEOUT_S)


class _Ranks:
    """The spawned ranks, and what each said before it ended. The group asks `dead` when a
    collective stalls, so this holds no reference to the executor (through the group and
    the watcher thread it would keep the executor, and so the ranks, alive for good)."""

    def __init__(self, procs: List[multiprocessing.Process],
                 last_words: List[multiprocessing.connection.Connection]) -> None:
        self._procs, self._last_words = procs, last_words
        self._why: Dict[int, str] = {}

    def dead(self) -> str:
        return describe_dead([f"rank {rank} (exit code {p.exitcode}{self._error_of(rank)})"
                              for rank, p in enumerate(self._procs, 1) if _ended(p)])

    def _error_of(self, rank: int) -> str:
        """': <the error it failed with>' if the rank sent one before it ended."""
        if rank not in self._why:
            reader = self._last_words[rank - 1]
            try:
                self._why[rank] = f": {reader.recv()}" if reader.poll() else ""
            except EOFError:  # it ended without a word (killed, or it exited cleanly)
                self._why[rank] = ""
        return self._why[rank]


def _ended(process: multiprocessing.Process) -> bool:
    """Ended, or ending: a dying process's sentinel reads ready (the kernel closed its
    descriptors) before it can be reaped, while is_alive() still says True (the group,
    aborted by the sentinel, then failed naming no rank)."""
    if process.is_alive() and not multiprocessing.connection.wait([process.sentinel], 0):
        return False
    process.join(STOP_TIMEOUT_S)  # reaped, with its exit code
    return True


def _abort_when_one_ends(procs: List[multiprocessing.Process], group: ParallelGroup) -> None:
    """Abort the group's collectives as soon as a rank's process ends (at shutdown too,
    when nothing waits on them any more): the driver may be waiting for it inside native
    code, which cannot ask who has ended."""
    multiprocessing.connection.wait([process.sentinel for process in procs])
    group.abort()


def _stop_before_multiprocessing_exits(finalizer: weakref.finalize) -> None:
    """Run `finalizer` (which kills the ranks) at exit before multiprocessing's own exit
    hook, which terminate()s daemon processes with a SIGTERM the ranks ignore and then
    joins them with no timeout: the script never ended. weakref.finalize's one atexit hook
    does not ensure that order: it runs after multiprocessing's wherever a finalize was made
    before multiprocessing was imported (a tempfile.TemporaryDirectory, say). atexit runs
    its hooks last registered first, and this one is registered after multiprocessing's."""
    atexit.register(finalizer)


def _stop(procs: List[multiprocessing.Process], grace_s: float) -> None:
    """Wait up to `grace_s` for each rank to end, then kill it (ranks ignore SIGTERM)."""
    for process in procs:
        process.join(grace_s if process.is_alive() else 0)
        if process.is_alive():
            process.kill()
            process.join(STOP_TIMEOUT_S)

"""The driver's side of tensor parallelism, whatever launched the other ranks.

Each step the driver broadcasts a `StepInput` (a few lists of ints: the chunks' tokens and
the blocks allocated since the last step) and runs its own share of the forward pass; every
rank's collectives pair up because every rank runs the same layers on the same rows. A rank
that fails breaks that pairing for good, so any failure here is an `ExecutorError`: the
engine stops rather than run on with ranks out of step.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import weakref
from abc import abstractmethod
from typing import Any, Iterator, List, Optional, Sequence

from fulcrum.distributed.group import ParallelGroup
from fulcrum.distributed.launch import DriverPin
from fulcrum.executor.base import Executor, ExecutorError
from fulcrum.worker.model_runner import StepResult
from fulcrum.core.scheduler import SchedulerOutput
from fulcrum.worker.worker import StepInputBuilder, Worker, WorkerConfig


class ParallelExecutor(Executor):
    group: ParallelGroup

    def __init__(self) -> None:
        self._failed: Optional[BaseException] = None
        self._closed = False
        self._pin: Optional[DriverPin] = None
        self._steps = StepInputBuilder()

    def _start_driver(self, wc: WorkerConfig, group: ParallelGroup) -> None:
        self.group = group
        self.driver = Worker(wc, group)

    def _pin_driver(self, cores: Optional[Sequence[int]]) -> None:
        """Run the driver's thread (and the threads it starts) on its share of the cores;
        undone at shutdown, or when the executor is dropped without one, since the driver's
        process is the caller's."""
        if cores:
            self._pin = DriverPin(cores)
            weakref.finalize(self, self._pin.release)

    def execute(self, output: SchedulerOutput) -> StepResult:
        if self._failed is not None:
            raise ExecutorError(f"tensor parallelism stopped after a failure: {self._failed!r}")
        dead = self._dead_ranks()
        if dead:
            self._failed = ExecutorError(dead)
            raise self._failed
        with _interrupts_after_the_step():
            try:
                step = self._steps.build(output)
                if step is not None:
                    self.group.broadcast_object(step)
                return self.driver.runner.execute(output)
            except Exception as error:
                raise (self._failure(error, "during a step") or ExecutorError(
                    f"a tensor-parallel step failed: {error!r}")) from error
            except BaseException as error:  # the ranks may be mid-step: none can follow now
                self._failed = error
                raise

    def _failure(self, error: BaseException, during: str) -> Optional[ExecutorError]:
        """Record `error`; and if ranks have ended, the error that names them (the failed
        collective or message was only their consequence)."""
        self._failed = error
        dead = self._dead_ranks()
        return ExecutorError(f"{dead} {during}") if dead else None

    def _fail_start(self, error: BaseException) -> None:
        """Called from the executor's `except` while starting: stop, and raise."""
        failure = self._failure(error, "while the engine started")
        self.shutdown()
        if failure is None or not isinstance(error, Exception):
            raise error
        raise failure from error

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._failed is None and not self._dead_ranks():
            try:
                self.group.broadcast_object(None)
            except Exception:  # noqa: BLE001 - the ranks are stopped below either way
                pass
        self._stop_ranks()
        if self._pin is not None:
            self._pin.release()

    @abstractmethod
    def _dead_ranks(self) -> str:
        """A description of the ranks that are gone ('' when all are alive)."""

    @abstractmethod
    def _stop_ranks(self) -> None:
        """Wait a little for the ranks to finish (none after a failure), then end them."""


@contextlib.contextmanager
def _interrupts_after_the_step() -> Iterator[None]:
    """Ctrl-C in the caller's main thread lands once the step is over, not inside it: an
    interrupt between the driver's collectives left the ranks a step apart, and the next
    call then waited 60 s for a collective no rank would reach (the engine was dead for
    good, where one process recovers). A step is milliseconds to a second; a second Ctrl-C
    (a step stuck on a rank that hangs) goes to the caller's handler at once: Python's
    default interrupts the step, and the engine stops. Where SIGINT is ignored, nothing
    changes."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) in (None, signal.SIG_IGN):  # nothing to hold
        yield
        return
    held: List[int] = []

    def hold(signum: int, frame: Any) -> None:
        if not held:
            held.append(signum)
            return
        signal.signal(signal.SIGINT, previous)
        count, held[:] = len(held) + 1, []  # delivered now, not again after the step
        if not callable(previous):  # SIG_DFL would end the process: stop the step at least
            raise KeyboardInterrupt
        for _ in range(count):  # to the caller's handler, the held one first
            previous(signum, frame)

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:  # to whatever handles it now, as if it came now: after the step
            signal.raise_signal(signal.SIGINT)


def describe_dead(ranks: List[str]) -> str:
    return "" if not ranks else f"tensor-parallel {', '.join(ranks)} stopped"

"""One worker in the engine's own process: the path of a model on one device."""

from __future__ import annotations

from fulcrum.executor.base import Executor
from fulcrum.worker.model_runner import StepResult
from fulcrum.core.scheduler import SchedulerOutput
from fulcrum.worker.worker import Worker, WorkerConfig


class UniprocExecutor(Executor):
    def __init__(self, wc: WorkerConfig) -> None:
        self.driver = Worker(wc)

    def execute(self, output: SchedulerOutput) -> StepResult:
        return self.driver.runner.execute(output)

"""What the engine asks of whatever runs the model: build the workers, run a step."""

from __future__ import annotations

from abc import ABC, abstractmethod

from fulcrum.worker.model_runner import ModelRunner, StepResult
from fulcrum.core.scheduler import SchedulerOutput
from fulcrum.worker.worker import Worker


class ExecutorError(RuntimeError):
    """A rank failed or is gone: the model can no longer run steps (the engine stops)."""


class Executor(ABC):
    driver: Worker  # rank 0, in the engine's process: it samples

    @property
    def num_blocks(self) -> int:
        """KV blocks of the cache (the same on every rank), the null block included."""
        return self.driver.num_blocks

    @property
    def runner(self) -> ModelRunner:
        return self.driver.runner

    @abstractmethod
    def execute(self, output: SchedulerOutput) -> StepResult:
        """Run a scheduled step on every rank; the driver's sampled tokens come back."""

    def shutdown(self) -> None:
        """Stop the other ranks (idempotent)."""

"""Executors: how the engine runs its workers (one in-process, or one per tensor-parallel rank
in spawned processes, Ray actors or torchrun's processes)."""

from __future__ import annotations

from fulcrum.executor.base import Executor, ExecutorError
from fulcrum.worker.worker import WorkerConfig

def make_executor(wc: WorkerConfig) -> Executor:
    """The executor `wc.config` asks for (its distributed_executor_backend, resolved)."""
    backend = wc.config.distributed_executor_backend
    if backend == "uni":
        from fulcrum.executor.uniproc import UniprocExecutor
        return UniprocExecutor(wc)
    if backend == "mp":
        from fulcrum.executor.multiproc import MultiprocExecutor
        return MultiprocExecutor(wc)
    if backend == "ray":
        from fulcrum.executor.ray_executor import RayExecutor
        return RayExecutor(wc)
    from fulcrum.executor.torchrun import TorchrunExecutor
    return TorchrunExecutor(wc)


__all__ = ["Executor", "ExecutorError", "make_executor"]

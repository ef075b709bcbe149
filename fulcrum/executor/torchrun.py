"""Tensor parallelism under torchrun (vLLM's "external_launcher"): torchrun starts one process
per rank and each runs the caller's script. Rank 0's engine drives; on the other ranks,
building the engine serves rank 0 as a worker until rank 0 shuts down, then exits the process
(their script goes no further than the LLM(...) or `fulcrum serve` call). Rank 0 shuts down
when its engine does, when it drops the engine, or when its script ends."""

from __future__ import annotations

import os
import weakref

import torch

from fulcrum.distributed.group import connect
from fulcrum.core.scheduler import SchedulerOutput
from fulcrum.distributed.launch import split_cores
from fulcrum.executor.parallel import ParallelExecutor
from fulcrum.worker.model_runner import StepResult
from fulcrum.worker.worker import Worker, WorkerConfig


def _env(name: str) -> str:
    value = os.environ.get(name)
    if value is None:
        raise RuntimeError(f"distributed_executor_backend='external_launcher' runs under "
                           f"torchrun, which sets ${name}; it is not set")
    return value


class TorchrunExecutor(ParallelExecutor):
    def __init__(self, wc: WorkerConfig) -> None:
        super().__init__()
        rank, world = int(_env("RANK")), int(_env("WORLD_SIZE"))
        if world != wc.config.tensor_parallel_size:
            raise ValueError(f"torchrun started {world} processes but tensor_parallel_size is "
                             f"{wc.config.tensor_parallel_size}")
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        cpu = wc.device == "cpu"
        device = torch.device("cpu") if cpu else torch.device("cuda", local_rank)
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        self._pin_driver(split_cores(local_world)[local_rank] if cpu else None)
        group = connect(rank, world, _env("MASTER_ADDR"), int(_env("MASTER_PORT")), device,
                        host=_env("MASTER_ADDR") if local_world == world else None,
                        is_master=rank == 0 and not agent_store,
                        same_host=local_world == world)
        if rank > 0:
            Worker(wc, group).follow_driver()
            raise SystemExit(0)
        self._start_driver(wc, group)
        # A script that ends, or drops its LLM, without shutting it down must still let the
        # other ranks go: torchrun waits for every process.
        self._farewell = weakref.finalize(self, _tell_ranks_to_exit, group)

    def execute(self, output: SchedulerOutput) -> StepResult:
        try:
            return super().execute(output)
        except BaseException:
            # The ranks may be part-way through the step: a message would meet them out of
            # order (shutdown() sends none after a failure either).
            self._farewell.detach()
            raise

    def _dead_ranks(self) -> str:
        return ""  # torchrun's processes: a dead one shows as a failed collective

    def _stop_ranks(self) -> None:
        # they exit once they receive the shutdown message, which shutdown() has sent
        farewell = getattr(self, "_farewell", None)
        if farewell is not None:
            farewell.detach()


def _tell_ranks_to_exit(group) -> None:
    try:
        group.broadcast_object(None)
    except Exception:  # noqa: BLE001 - a rank that is gone needs no message
        pass

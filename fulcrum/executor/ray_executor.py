"""Tensor parallelism on a Ray cluster: the other ranks are Ray actors, placed together by a
placement group, on this machine or on others (with $RAY_ADDRESS set, fulcrum joins that
cluster; otherwise Ray starts a local one). Ray is an optional extra: pip install fulcrum[ray].
"""

from __future__ import annotations

import functools
import threading
from typing import List, Optional, Sequence

import torch

from fulcrum.distributed.group import ParallelGroup, connect
from fulcrum.distributed.launch import free_port, pin_to_cores, split_cores
from fulcrum.executor.parallel import ParallelExecutor, describe_dead
from fulcrum.worker.worker import Worker, WorkerConfig

PLACEMENT_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0


def _ray():
    try:
        import ray
    except ImportError as error:
        raise ImportError("distributed_executor_backend='ray' needs Ray: "
                          "pip install 'fulcrum[ray]'") from error
    return ray


class RankActor:
    """One rank, in a Ray worker process."""

    def node_ip(self) -> str:
        return _ray().util.get_node_ip_address()

    def run(self, wc: WorkerConfig, rank: int, world_size: int, store_host: str,
            store_port: int, cores: Optional[Sequence[int]], num_cpus: int,
            same_host: bool) -> None:
        if cores:  # on the driver's machine: its share of the cores
            pin_to_cores(cores)
        else:
            torch.set_num_threads(num_cpus)
        device = torch.device("cuda", 0) if wc.device == "cuda" else torch.device("cpu")
        group = connect(rank, world_size, store_host, store_port, device, host=self.node_ip(),
                        same_host=same_host)
        Worker(wc, group).follow_driver()


class RayExecutor(ParallelExecutor):
    def __init__(self, wc: WorkerConfig) -> None:
        super().__init__()
        ray = _ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:  # $RAY_ADDRESS's cluster if set, else a local one, ours to stop
            ray.init(include_dashboard=False, log_to_driver=False)
        world = wc.config.tensor_parallel_size
        cpu = wc.device == "cpu"
        cores = split_cores(world) if cpu else [None] * world
        num_cpus = len(cores[-1]) if cpu else 1
        bundle = {"CPU": num_cpus} if cpu else {"CPU": 1, "GPU": 1}
        self._placement = placement_group([bundle] * (world - 1), strategy="PACK")
        self._actors: List = []
        self._runs: List = []
        try:
            ready, _ = ray.wait([self._placement.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                raise RuntimeError(f"Ray could not place {world - 1} ranks of {bundle} within "
                                   f"{PLACEMENT_TIMEOUT_S:.0f} s: the cluster has "
                                   f"{ray.available_resources()} free")
            actor_class = ray.remote(RankActor)
            self._actors = [actor_class.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._placement, index)
            ).remote() for index in range(world - 1)]
            driver_ip = ray.util.get_node_ip_address()
            ips = ray.get([actor.node_ip.remote() for actor in self._actors])
            port = free_port(driver_ip)
            same_host = all(ip == driver_ip for ip in ips)
            self._runs = [actor.run.remote(wc, rank, world, driver_ip, port,
                                           cores[rank] if ip == driver_ip else None, num_cpus,
                                           same_host)
                          for rank, (actor, ip) in enumerate(zip(self._actors, ips), 1)]
            self._pin_driver(cores[0])
            device = torch.device("cuda", 0) if not cpu else torch.device("cpu")
            group = connect(0, world, driver_ip, port, device, host=driver_ip,
                            same_host=same_host, gone=functools.partial(_dead_runs, self._runs))
            threading.Thread(target=_abort_when_one_ends, args=(self._runs, group),
                             name="fulcrum-tp-watch", daemon=True).start()
            self._start_driver(wc, group)
        except BaseException as error:
            self._fail_start(error)

    def _dead_ranks(self) -> str:
        return _dead_runs(self._runs)

    def _stop_ranks(self) -> None:
        ray = _ray()
        from ray.util.placement_group import remove_placement_group

        if self._runs and self._failed is None:
            ray.wait(self._runs, num_returns=len(self._runs), timeout=STOP_TIMEOUT_S)
        for actor in self._actors:
            ray.kill(actor)
        remove_placement_group(self._placement)
        if self._owns_ray:
            ray.shutdown()


def _dead_runs(runs: List) -> str:
    """The ranks whose run has ended. A function of the runs alone: the group asks it, and
    a method would keep the executor alive through the group for good."""
    ray = _ray()
    ended, _ = ray.wait(runs, num_returns=len(runs), timeout=0)
    dead = []
    for rank, run in enumerate(runs, 1):
        if run in ended:
            try:
                ray.get(run)
                dead.append(f"rank {rank} (returned)")
            except Exception as error:  # noqa: BLE001 - reported as the rank's end
                dead.append(f"rank {rank} ({type(error).__name__})")
    return describe_dead(dead)


def _abort_when_one_ends(runs: List, group: ParallelGroup) -> None:
    """Abort the group's collectives as soon as a rank's actor ends (see multiproc.py)."""
    try:
        _ray().wait(runs, num_returns=1)
    except Exception:  # noqa: BLE001 - Ray was shut down with the engine: nothing to abort
        return
    group.abort()

"""Data-parallel replicas: whole engines, each a `fulcrum serve` of its own on a loopback port
(or on another machine's address, as Ray actors), with its own share of the cores and its
own threads. The router (router.py) is their one front door.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

import httpx

from fulcrum.cli import CommandError
from fulcrum.distributed.launch import free_port, pin_to_cores, split_cores

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 15.0


def replica_args(args: argparse.Namespace, index: int, host: str, port: int,
                 cores: Optional[Sequence[int]]) -> argparse.Namespace:
    """The `fulcrum serve` arguments of replica `index`: the router's, on its own port."""
    mine = copy.copy(args)
    mine.host, mine.port = host, port
    mine.data_parallel_size = 1
    mine.data_parallel_rank = args.data_parallel_rank + index  # a sampling stream of its own
    # Browsers talk to the router: no CORS at the replicas.
    mine.allowed_origins = mine.allowed_methods = mine.allowed_headers = None
    mine.allow_credentials = False
    mine.cores = list(cores) if cores else None
    return mine


def run_replica(args: argparse.Namespace) -> int:
    """A replica's whole life (in its own process): pin, then serve until stopped, or until
    the router's process is gone (a replica never outlives its router). Its exit status is
    `fulcrum serve`'s: a bad setting is one line of error, not a traceback."""
    from fulcrum.cli import configure_logging, run_command

    configure_logging(args)  # a spawned process starts without the router's
    if args.cores:
        pin_to_cores(args.cores)
    parent = os.getppid()
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True,
                     name="fulcrum-replica-watch").start()
    return run_command(args)


def _run_process_replica(args: argparse.Namespace) -> None:
    """A spawned replica, in a session of its own: a terminal's Ctrl-C (sent to its whole
    process group) reaches the router alone, which drains before it stops the replicas.
    It exits with the server's status (a process target's return value is dropped)."""
    os.setsid()
    sys.exit(run_replica(args))


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)  # drain and exit as on any shutdown


@dataclass
class Replica:
    index: int
    url: str
    handle: Any  # a multiprocessing.Process, or a Ray actor's run() reference
    actor: Any = None  # the Ray actor, if one
    in_flight: int = 0
    served: int = 0
    error: Optional[str] = None  # why it is out of service
    # Set when it goes out of service: what the router has open there stops waiting.
    gone: asyncio.Event = field(default_factory=asyncio.Event)

    def process_error(self) -> Optional[str]:
        """Why its process ended, if it has."""
        process = self.handle
        if isinstance(process, multiprocessing.process.BaseProcess):
            return None if process.is_alive() else f"exit code {process.exitcode}"
        import ray

        ended, _ = ray.wait([process], timeout=0)
        if not ended:
            return None
        try:
            ray.get(process)
            return "it stopped"
        except Exception as error:  # noqa: BLE001 - the replica's end, reported
            return f"{type(error).__name__}: {error}"

    @property
    def healthy(self) -> bool:
        return self.error is None

    def kill(self) -> None:
        """End a replica that answers nothing any more, so that its memory and cores come
        back (SIGKILL: a stopped process does not act on SIGTERM until it is continued)."""
        if isinstance(self.handle, multiprocessing.process.BaseProcess):
            self.handle.kill()
        elif self.actor is not None:
            import ray

            ray.kill(self.actor)


@dataclass
class ReplicaSet:
    replicas: List[Replica]
    actors: List[Any] = field(default_factory=list)
    owns_ray: bool = False  # Ray was started for these replicas: stop it with them

    def stop(self) -> None:
        for replica in self.replicas:
            handle = replica.handle
            if isinstance(handle, multiprocessing.process.BaseProcess):
                if handle.is_alive():
                    handle.terminate()  # SIGTERM: the replica drains, then exits
        for replica in self.replicas:
            handle = replica.handle
            if isinstance(handle, multiprocessing.process.BaseProcess):
                handle.join(STOP_TIMEOUT_S)
                if handle.is_alive():
                    handle.kill()
        if self.actors:
            import ray

            for actor in self.actors:
                ray.kill(actor)
            if self.owns_ray:
                ray.shutdown()


def start_replicas(args: argparse.Namespace, count: int, backend: str) -> ReplicaSet:
    """Start `count` replicas and wait until each answers /health."""
    replicas = _start_ray(args, count) if backend == "ray" else _start_processes(args, count)
    try:
        for replica in replicas.replicas:
            _wait_ready(replica)
    except BaseException:
        replicas.stop()
        raise
    return replicas


def sharing_this_machine(args: argparse.Namespace, count: int) -> argparse.Namespace:
    """The arguments of `count` replicas on this machine: they size their KV caches from its
    memory at the same time, so the --gpu-memory-utilization fraction is for all of them
    together (each took it whole: together, `count` times what was asked)."""
    shared = copy.copy(args)
    shared.gpu_memory_utilization = args.gpu_memory_utilization / count
    return shared


def check_copies_fit(args: argparse.Namespace, count: int) -> None:
    """Refuse, before any replica starts, `count` copies of the weights that this machine's
    RAM cannot hold on CPU: the replicas load them at the same time, each checking its own
    copy against RAM the others have not taken yet (then the OOM killer ended some)."""
    from fulcrum.default_model import default_model_dir
    from fulcrum.engine import resolve_device
    from fulcrum.worker.memory import in_this_ram
    from fulcrum.worker.model_loader import check_weights_fit_in_ram, load_hf_config, \
        resolve_dtype

    if not in_this_ram(resolve_device(args.device).type, args.distributed_executor_backend):
        return
    hf_config = load_hf_config(args.model or default_model_dir())
    check_weights_fit_in_ram(hf_config, resolve_dtype(args.dtype, hf_config), count)


def _start_processes(args: argparse.Namespace, count: int) -> ReplicaSet:
    check_copies_fit(args, count)
    context = multiprocessing.get_context("spawn")
    shared = sharing_this_machine(args, count)
    replicas = []
    for index, cores in enumerate(split_cores(count)):
        port = free_port()
        # Not a daemon: a replica may start processes of its own (tensor-parallel ranks).
        process = context.Process(target=_run_process_replica, name=f"fulcrum-dp-replica{index}",
                                  args=(replica_args(shared, index, "127.0.0.1", port, cores),))
        process.start()
        replicas.append(Replica(index, f"http://127.0.0.1:{port}", process))
    return ReplicaSet(replicas)


class ReplicaActor:
    """A replica as a Ray actor: its server runs in the actor's process, on its node."""

    def place(self) -> tuple:
        """(this node's address, a port free on it)."""
        import ray

        return ray.util.get_node_ip_address(), free_port("0.0.0.0")

    def serve(self, args: argparse.Namespace) -> int:
        return run_replica(args)


def _start_ray(args: argparse.Namespace, count: int) -> ReplicaSet:
    try:
        import ray
    except ImportError as error:
        raise ImportError("--data-parallel-backend ray needs Ray: pip install 'fulcrum[ray]'"
                          ) from error
    owns_ray = not ray.is_initialized()
    if owns_ray:  # $RAY_ADDRESS's cluster if set, else a local one
        ray.init(include_dashboard=False, log_to_driver=True)
    here = ray.util.get_node_ip_address()
    shares = split_cores(count)
    actor_class = ray.remote(ReplicaActor)
    actors = [actor_class.options(num_cpus=len(shares[i])).remote() for i in range(count)]
    replicas = []
    places = ray.get([actor.place.remote() for actor in actors])
    for index, (actor, (ip, port)) in enumerate(zip(actors, places)):
        local = ip == here
        host = "127.0.0.1" if local else "0.0.0.0"  # another machine's: the router must reach it
        run = actor.serve.remote(replica_args(args, index, host, port,
                                              shares[index] if local else None))
        replicas.append(Replica(index, f"http://{'127.0.0.1' if local else ip}:{port}", run,
                                actor=actor))
    return ReplicaSet(replicas, actors, owns_ray)


def _wait_ready(replica: Replica) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        ended = replica.process_error()
        if ended is not None:
            raise CommandError(f"data-parallel replica {replica.index} failed to start "
                               f"({ended}); see its log above")
        try:
            if httpx.get(f"{replica.url}/health", timeout=2.0).status_code == 200:
                logger.info("replica %d ready at %s", replica.index, replica.url)
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise CommandError(f"data-parallel replica {replica.index} did not start within "
                       f"{START_TIMEOUT_S:.0f} s")

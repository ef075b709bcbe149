"""Collectives between the ranks of one tensor-parallel model, over torch.distributed.

A `ParallelGroup` is built from a store (a TCPStore the driver hosts, or torchrun's) and owns
its process groups: torch's default group is never touched, so one process may hold several
engines, and nothing about parallelism lives in module globals. On CPU the collectives run on
gloo, or through shared memory when every rank is on this machine (see shm.py); on CUDA on
NCCL, with a gloo group beside it for the per-step messages (Python objects travel on CPU
tensors).
"""

from __future__ import annotations

import datetime
import pickle
import time
from typing import Any, Callable, Optional, cast

import numpy as np
import torch
import torch.distributed as dist

from fulcrum.distributed.shm import SharedMemoryCollectives

# A collective that does not complete within this long means a rank is gone.
DEFAULT_TIMEOUT_S = 600.0
# How often a rank waiting for the others to join asks whether one has ended meanwhile.
JOIN_POLL_S = 0.02


class ParallelGroup:
    def __init__(self, rank: int, world_size: int, store: "dist.Store", device: torch.device,
                 host: Optional[str], timeout_s: float = DEFAULT_TIMEOUT_S,
                 prefix: str = "fulcrum", same_host: bool = False,
                 gone: Callable[[], str] = lambda: "") -> None:
        """`host`: this rank's address as the others reach it (gloo listens there); None:
        gloo's choice (the hostname's address, or $GLOO_SOCKET_IFNAME's). `gone`: which of
        the other ranks are known to have ended ('' while all live), as this rank's launcher
        sees them; waits for the others (joining the group, collectives through shared
        memory, the next step) ask it and stop with it rather than wait out a timeout."""
        self.gone = gone
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a group of {world_size}")
        self.rank, self.world_size, self.device = rank, world_size, device
        self.same_host = same_host  # every rank on this machine, sharing its RAM
        _join(store, f"{prefix}/joined", rank, world_size, gone, timeout_s)
        timeout = datetime.timedelta(seconds=timeout_s)
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host) if host
                            else dist.ProcessGroupGloo.create_default_device()]
        options._timeout = timeout
        self.cpu = dist.ProcessGroupGloo(dist.PrefixStore(f"{prefix}/cpu", store), rank,
                                         world_size, options)
        self.pg = self.cpu
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(dist.PrefixStore(f"{prefix}/nccl", store), rank,
                                            world_size, options)
        self.shm: Optional[SharedMemoryCollectives] = None
        if same_host and device.type == "cpu":
            key = f"{prefix}/shm"

            def publish(path: Optional[str]) -> str:
                if path is not None:
                    store.set(key, path)
                return cast(bytes, store.get(key)).decode()

            self.shm = SharedMemoryCollectives(rank, world_size, publish, self.barrier, gone)

    def abort(self) -> None:
        """Stop every rank's current and later collectives with an error: a rank has ended,
        and those waiting for it must not wait out the timeout. Shared memory: in native
        code, where `gone` is not asked. NCCL: its kernels spin on the GPU for a lost peer
        until the communicator is aborted (what torch's own watchdog does at the timeout).
        Gloo needs nothing: a lost peer's closed sockets fail its waits at once."""
        if self.shm is not None:
            self.shm.abort()
        if self.pg is not self.cpu:
            self.pg.abort()

    def barrier(self) -> None:
        self.cpu.allreduce([torch.zeros(1)]).wait()

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place."""
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_reduce(x)
        self.pg.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` side by side along the last dimension (rank order)."""
        x = x.contiguous()
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_gather(x)
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.pg.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. the KV blocks that fit on each)."""
        t = torch.tensor([value], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.cpu.allreduce([t], options).wait()
        return int(t.item())

    def broadcast_object(self, obj: Any = None) -> Any:
        """The driver's `obj` on every rank (the driver passes it, the others get it);
        through shared memory when it fits, else gloo."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.is_driver else None
        if self.shm is not None:
            received = self.shm.broadcast_bytes(data)
            if received is not None:
                return obj if self.is_driver else pickle.loads(received)
        size = torch.tensor([len(data) if self.is_driver else 0], dtype=torch.int64)
        self.cpu.broadcast(size, 0).wait()
        payload = (torch.from_numpy(np.frombuffer(data, np.uint8).copy()) if self.is_driver
                   else torch.empty(int(size.item()), dtype=torch.uint8))
        self.cpu.broadcast(payload, 0).wait()
        return obj if self.is_driver else pickle.loads(payload.numpy().tobytes())


def connect(rank: int, world_size: int, store_host: str, store_port: int,
            device: torch.device, host: Optional[str], timeout_s: float = DEFAULT_TIMEOUT_S,
            is_master: Optional[bool] = None, same_host: bool = False,
            gone: Callable[[], str] = lambda: "") -> ParallelGroup:
    """Join the group whose store listens at store_host:store_port (rank 0 hosts it unless
    told otherwise, as under torchrun, whose agent hosts it). `same_host`: every rank runs
    on this machine (CPU collectives then go through shared memory)."""
    store = dist.TCPStore(store_host, store_port, world_size,
                          is_master if is_master is not None else rank == 0,
                          timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    return ParallelGroup(rank, world_size, store, device, host, timeout_s,
                         same_host=same_host, gone=gone)


def _join(store: "dist.Store", prefix: str, rank: int, world_size: int,
          gone: Callable[[], str], timeout_s: float) -> None:
    """Wait until every rank has reached the store. Gloo's own rendezvous would wait out its
    whole timeout for a rank that died while starting (importing torch takes seconds, loading
    its weights longer); here each look at the store also asks `gone`."""
    store.set(f"{prefix}/{rank}", b"1")
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        ended = gone()
        if ended:
            raise ConnectionError(f"{ended} before joining the group")
        if time.monotonic() > deadline:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            raise TimeoutError(f"tensor-parallel ranks {missing} did not join within "
                               f"{timeout_s:.0f} s")
        time.sleep(JOIN_POLL_S)

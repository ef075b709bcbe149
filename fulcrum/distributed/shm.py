"""All-reduce and all-gather through shared memory, for CPU ranks on one machine.

Gloo hands every collective to its own threads and wakes the caller when it is done: on a
small VM that costs about 1.5 ms a call, and a decode step makes two all-reduces a layer.
Ranks on one machine can instead meet in a shared buffer (as vLLM's CPU backend does): each
copies its tensor into its slot, raises its flag, waits for everyone's flag, and reads the
others' slots; two slots per rank alternate so that a fast rank never overwrites data a slow
one is still reading. Every rank sums in rank order, so all get bit-identical results.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
import time
from typing import Callable, Dict, Optional, Tuple

import numpy as np
import torch

from fulcrum import kernels

SLOT_BYTES = 8 << 20  # larger tensors (and messages) go through gloo
SPINS_BEFORE_YIELD = 200
FLAGS_BYTES = 4096
# A rank that has not arrived at a collective within this long is taken for gone (ranks run
# in lockstep: the wait is normally the others' lag, microseconds to milliseconds).
COLLECTIVE_TIMEOUT_S = 60.0
# A rank waiting for the driver's next step (idle for as long as the server is) sleeps
# between looks at the flag, up to this long.
IDLE_SLEEP_S = 0.002
# Waits ask `gone()` at most this often (it may cost a system call).
GONE_POLL_S = 0.01
_ABORT_AT = FLAGS_BYTES - 8  # the flags area's last word (the flags take 16 bytes a rank)
_HEADER = 8  # a message's length (int64; -1: it did not fit and follows over gloo)


class _ShmGroup(ctypes.Structure):  # kernels/shm_collectives.cpp's ShmGroup
    _fields_ = [("ready", ctypes.c_void_p), ("done", ctypes.c_void_p),
                ("slots", ctypes.c_void_p), ("slot_bytes", ctypes.c_int64),
                ("seq", ctypes.c_void_p), ("rank", ctypes.c_int32), ("world", ctypes.c_int32),
                ("timeout_s", ctypes.c_double), ("abort", ctypes.c_void_p)]


class SharedMemoryCollectives:
    def __init__(self, rank: int, world_size: int, publish: Callable[[str], str],
                 barrier: Callable[[], None], gone: Callable[[], str] = lambda: "") -> None:
        """`publish(name)` gives every rank rank 0's file name; `barrier()` waits for all;
        `gone()` names the ranks known to have ended (see ParallelGroup)."""
        if 16 * world_size > _ABORT_AT:
            raise ValueError(f"shared-memory collectives hold at most {_ABORT_AT // 16} ranks")
        self.rank, self.world_size, self.gone = rank, world_size, gone
        self._next_look = 0.0
        size = FLAGS_BYTES + world_size * 2 * SLOT_BYTES
        path = None
        if rank == 0:
            fd, path = tempfile.mkstemp(prefix="fulcrum-tp-", dir=_shm_dir())
            os.ftruncate(fd, size)
            os.close(fd)
        try:
            path = publish(path)
            with open(path, "r+b") as f:
                self._map = mmap.mmap(f.fileno(), size)
            barrier()
        finally:  # the mapping outlives the name: nothing is left behind, a crash included
            if rank == 0:
                os.unlink(path)
        # Per rank: the sequence number of its latest data, and of the latest it has read.
        self._ready = np.frombuffer(self._map, np.int64, world_size, 0)
        self._done = np.frombuffer(self._map, np.int64, world_size, 8 * world_size)
        # Raised by any rank that learns that another has ended: every wait then stops.
        self._abort = np.frombuffer(self._map, np.int64, 1, _ABORT_AT)
        self._seq = ctypes.c_int64(0)  # the round counter, shared with the native path
        self._views: Dict[torch.dtype, torch.Tensor] = {}
        # The same protocol in C for bf16 (kernels/shm_collectives.cpp), which the native
        # decoder stack also calls between its layers.
        self._library = kernels.shm_collectives()
        self._group: Optional[_ShmGroup] = None
        if self._library is not None:
            base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
            self._group = _ShmGroup(base, base + 8 * world_size, base + FLAGS_BYTES, SLOT_BYTES,
                                    ctypes.addressof(self._seq), rank, world_size,
                                    COLLECTIVE_TIMEOUT_S, base + _ABORT_AT)

    def abort(self) -> None:
        self._abort[0] = 1

    def native(self) -> Optional[Tuple[int, int]]:
        """(the C all-reduce's address, its group argument), for native callers; or None."""
        if self._group is None:
            return None
        function = ctypes.cast(self._library.fulcrum_shm_all_reduce_bf16, ctypes.c_void_p)
        return function.value, ctypes.addressof(self._group)

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= SLOT_BYTES

    def _slot(self, rank: int, seq: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        view = self._views.get(dtype)
        if view is None:
            view = self._views[dtype] = torch.frombuffer(self._map, dtype=dtype,
                                                         offset=FLAGS_BYTES)
        per_slot = SLOT_BYTES // view.element_size()
        start = (rank * 2 + seq % 2) * per_slot
        return view[start:start + numel]

    def _exchange(self, x: torch.Tensor) -> int:
        """Publish x and wait until every rank has published this round's tensor."""
        self._seq.value += 1
        seq = self._seq.value
        # The slot written now was last read two rounds ago: wait until everyone has.
        self._wait(self._done, seq - 2)
        self._slot(self.rank, seq, x.dtype, x.numel()).copy_(x.reshape(-1))
        self._ready[self.rank] = seq
        self._wait(self._ready, seq)
        return seq

    def _wait(self, flags: np.ndarray, seq: int) -> None:
        spins, deadline = 0, None
        while flags.min() < seq:
            spins += 1
            if spins > SPINS_BEFORE_YIELD:
                time.sleep(0)  # let other threads (the server's) have the interpreter
                now = time.monotonic()
                deadline = deadline or now + COLLECTIVE_TIMEOUT_S
                if now > deadline:
                    raise TimeoutError(f"a tensor-parallel rank did not reach a collective "
                                       f"within {COLLECTIVE_TIMEOUT_S:.0f} s")
                self._check_group(now)

    def _check_group(self, now: float) -> None:
        """Raise if the group was aborted or a rank is known to have ended (asked at most
        every GONE_POLL_S: finding out may cost a system call)."""
        if self._abort[0]:
            raise ConnectionError(self.gone() or "the tensor-parallel group was aborted")
        if now >= self._next_look:
            self._next_look = now + GONE_POLL_S
            ended = self.gone()
            if ended:
                raise ConnectionError(ended)

    def broadcast_bytes(self, data: Optional[bytes]) -> Optional[bytes]:
        """Rank 0's `data` on every rank, through rank 0's slot; None where it did not fit
        (the caller then sends it over gloo). The other ranks may wait here between steps
        for as long as the driver is idle: they sleep between looks, and stop waiting with
        an error once the driver is gone."""
        self._seq.value += 1
        seq = self._seq.value
        flat = self._slot(0, seq, torch.uint8, SLOT_BYTES).numpy()
        if self.rank == 0:
            self._wait(self._done, seq - 2)
            fits = len(data) <= SLOT_BYTES - _HEADER
            flat[:_HEADER] = np.frombuffer(np.int64(len(data) if fits else -1).tobytes(),
                                           np.uint8)
            if fits:
                flat[_HEADER:_HEADER + len(data)] = np.frombuffer(data, np.uint8)
            self._ready[0] = seq
            self._done[0] = seq
            return data if fits else None
        self._wait_for_driver(seq)
        size = int(flat[:_HEADER].view(np.int64)[0])
        received = None if size < 0 else flat[_HEADER:_HEADER + size].tobytes()
        self._done[self.rank] = seq
        return received

    def _wait_for_driver(self, seq: int) -> None:
        spins, sleep = 0, 1e-5
        while self._ready[0] < seq:
            spins += 1
            if spins > SPINS_BEFORE_YIELD:
                self._check_group(time.monotonic())
                time.sleep(sleep)
                sleep = min(2 * sleep, IDLE_SLEEP_S)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and self._group is not None and x.is_contiguous():
            status = self._library.fulcrum_shm_all_reduce_bf16(ctypes.byref(self._group),
                                                               x.data_ptr(), x.numel())
            if status == 1:
                raise ValueError(f"{x.numel()} values do not fit a shared-memory slot")
            if status == 3:
                self._check_group(time.monotonic())
            if status:
                raise TimeoutError(f"a tensor-parallel rank did not reach a collective "
                                   f"within {COLLECTIVE_TIMEOUT_S:.0f} s")
            return x
        seq = self._exchange(x)
        flat = x.view(-1)
        flat.copy_(self._slot(0, seq, x.dtype, x.numel()))
        for rank in range(1, self.world_size):
            flat.add_(self._slot(rank, seq, x.dtype, x.numel()))
        self._done[self.rank] = seq
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x side by side along the last dimension (rank order)."""
        x = x.contiguous()
        seq = self._exchange(x)
        out = torch.cat([self._slot(rank, seq, x.dtype, x.numel()).view(x.shape)
                         for rank in range(self.world_size)], dim=-1)
        self._done[self.rank] = seq
        return out


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()

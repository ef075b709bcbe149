"""AsyncLLM: the engine core steps in a background thread while asyncio serves the clients.

Why a thread and not a separate process. The engine's time goes to torch kernels, which
release the GIL, so a thread that does nothing but step keeps forward passes back to back
while the event loop parses HTTP, tokenises prompts and writes server-sent events in
between. A process would also free the loop of the GIL, but every step's outputs would then
cross a pipe (pickling plus a context switch per step) and the tokenizer, the config and the
KV-cache state behind `/metrics` would live on the other side of it; on a machine with two
cores it would compete for the same cores anyway. Measured with 32 concurrent streaming
clients (in another process) on the built-in 135M model, CPU: the loop spent 1.6% (bfloat16)
and 1.9% (float32) of its busy wall time outside the forward pass, about 8 ms per step of
~400 ms; `LoopStats` keeps the figure, /metrics exports it as fulcrum:engine_loop_*.

Why the engine is built on that thread too. Every thread that runs OpenMP work (model
loading does) gets its own libgomp worker pool, and once the pools hold more threads than
there are cores, libgomp stops spinning between parallel regions and parks its workers
instead, so every one of the ~300 regions of a forward pass pays a futex wake-up. Measured
on 2 cores, 8 decoding requests of the 135M model: 19.5 ms a step with the engine built and
stepped on one thread, 29 ms when it was built on the main thread and stepped on another.

Why the GIL's switch interval is lowered. The engine thread lets go of the GIL in every
native call (the forward pass) and needs it back as soon as the call returns; if the event
loop holds it then, Python's default lets the loop run on for up to 5 ms before it must hand
it over, and that wait lands on every token of every request. AsyncLLM lowers the interval,
for the whole process, to 0.2 ms (it never raises it); a single stream's time per token is
where this shows.

How work flows. The engine object is touched by the engine thread only. Callers put
commands (add, abort) on a thread-safe queue and set an Event; the thread drains the queue
before every step, so an abort frees the request's KV blocks before the next step is
scheduled, and it sleeps on the Event when there is nothing to do. After each step the
thread hands one `StepReport` to the event loop with `call_soon_threadsafe`; on the loop the
outputs go to per-request asyncio queues and to listeners such as the Prometheus metrics.
Prompts are tokenised and validated on the caller's side, so a bad request fails before it
reaches the engine and never disturbs the others.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import sys
import threading
import time
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Set, Tuple

from fulcrum.config import DEFAULT_MAX_QUEUED_REQUESTS, EngineConfig
from fulcrum.engine import LLMEngine, PromptType, check_request_ids
from fulcrum.outputs import RequestFault, RequestOutput
from fulcrum.sampling_params import RequestOutputKind, SamplingParams
from fulcrum.stats import StepReport
from fulcrum.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_SHUTDOWN_TIMEOUT_S = 10.0
_GIL_SWITCH_INTERVAL_S = 0.0002  # see the module's docstring


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an unexpected error; no request can be served."""


class QueueFullError(RuntimeError):
    """max_queued_requests requests already wait: the caller should retry later."""


class RequestFailedError(RuntimeError):
    """Processing this request failed (finish reason "error"); the engine serves on.
    `status` is the HTTP status it means: 400 when the request caused it (a RequestFault),
    else 500."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


@dataclasses.dataclass
class LoopStats:
    """Where the engine thread's busy time went, cumulative since start.

    `busy_seconds` is the wall time of every loop iteration that had work: the step itself
    plus the time between steps (draining commands, handing outputs over). Idle waits for
    work are excluded, so `overhead_fraction` is the share of the loop's working time spent
    outside the model's forward pass.
    """

    busy_seconds: float = 0.0
    forward_seconds: float = 0.0
    steps: int = 0

    @property
    def overhead_fraction(self) -> float:
        if self.busy_seconds <= 0:
            return 0.0
        return 1.0 - self.forward_seconds / self.busy_seconds


Listener = Callable[[StepReport], None]


class AsyncLLM:
    """An `LLMEngine` stepping in its own thread, with an asyncio front end.

    Bound to one event loop at a time: the loop of the first `generate()` call (again after
    that loop closes). The engine thread starts, and builds the engine, in the constructor.
    """

    def __init__(self, config: EngineConfig) -> None:
        sys.setswitchinterval(min(sys.getswitchinterval(), _GIL_SWITCH_INTERVAL_S))
        self.loop_stats = LoopStats()
        self._commands: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopping = False
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._streams: Dict[str, asyncio.Queue] = {}
        self._aborting: Set[str] = set()  # ids aborted here, not yet reported by the engine
        self._listeners: List[Listener] = []
        self._dead_listeners: List[Callable[[BaseException], None]] = []
        self._dead: Optional[BaseException] = None
        # Requests queued for the engine thread but not added yet, and the scheduler's
        # waiting count as the engine thread last saw it: together, what waits to run.
        self._pending_adds = 0
        self._pending_lock = threading.Lock()
        self._engine_waiting = 0
        built: "concurrent.futures.Future[LLMEngine]" = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(config, built),
                                        name="fulcrum-engine", daemon=True)
        self._thread.start()
        self.engine = built.result()  # raises what building the engine raised

    @classmethod
    def from_engine_args(cls, **kwargs: Any) -> "AsyncLLM":
        return cls(EngineConfig(**kwargs))

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def is_healthy(self) -> bool:
        return self._dead is None

    @property
    def is_idle(self) -> bool:
        """No command queued and no request in the engine (a snapshot: the thread runs on)."""
        return self._commands.empty() and not self.engine.has_unfinished_requests()

    @property
    def num_queued(self) -> int:
        """Requests waiting to run (children of n > 1 requests count one each)."""
        return self._engine_waiting + self._pending_adds

    def add_listener(self, listener: Listener) -> None:
        """Call `listener(report)` on the event loop after every engine step."""
        self._listeners.append(listener)

    def add_dead_listener(self, listener: Callable[[BaseException], None]) -> None:
        """Call `listener(error)` on the event loop if the engine loop dies."""
        self._dead_listeners.append(listener)

    # ------------------------------------------------------------ public API
    def process_prompt(self, prompt: PromptType,
                       truncate: Optional[int] = None) -> Tuple[Optional[str], List[int]]:
        """(text, token ids) of a prompt, cut to its last `truncate` tokens if given (vLLM's
        truncate_prompt_tokens); raises ValueError/TypeError if the engine would."""
        text, token_ids = self.engine.truncate_prompt(
            *self.engine.tokenize_prompt(prompt, truncate), truncate)
        self.engine.validate_prompt(token_ids)
        self.engine.cache_salt(prompt)
        return text, token_ids

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise ValueError if the engine would refuse these parameters for such a prompt."""
        if not isinstance(params, SamplingParams):
            raise TypeError("sampling_params must be a SamplingParams")
        self.engine.validate_params(params, num_prompt_tokens)

    def check_capacity(self, num_requests: int) -> None:
        """Raise if the engine is dead, or if `num_requests` more would overfill the queue."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self._dead!r}")
        limit = self.config.max_queued_requests or DEFAULT_MAX_QUEUED_REQUESTS
        if num_requests > limit:
            raise ValueError(f"this request makes {num_requests} engine requests (prompts x n),"
                             f" more than may ever wait at once (max_queued_requests={limit})")
        if self.num_queued + num_requests > limit:
            raise QueueFullError(f"the server is overloaded: {self.num_queued} requests are "
                                 f"waiting (max_queued_requests={limit}); retry later")

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Incremental (DELTA) outputs of one request, the last one with finished=True.

        Leaving the iteration early (break, cancellation, a closed connection) aborts the
        request, which frees its KV blocks before the engine's next step.
        """
        stream = self._open(prompt, sampling_params, request_id, priority)
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if item.error is not None:
                    raise RequestFailedError(f"request {request_id} failed: {item.error}",
                                             400 if isinstance(item.error, RequestFault) else 500)
                yield item
        finally:
            if not finished:
                self._abandon(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed before the next step, and its stream ends with
        finish reason "abort" (as vLLM's). Unknown ids are ignored. The id stays taken until
        the engine reports the abort."""
        check_request_ids([request_id])  # here, not in the engine thread, whose errors are fatal
        self._submit(lambda: self.engine.abort_request(request_id))

    def _abandon(self, request_id: str) -> None:
        """Abort a request whose stream nobody reads any more: its outputs are dropped until
        the engine reports the abort, so that none reaches a new request of the same id."""
        if self._streams.pop(request_id, None) is not None:
            self._aborting.add(request_id)
        self._submit(lambda: self.engine.abort_request(request_id))

    async def drain(self, timeout: float) -> int:
        """Let the requests in flight finish for up to `timeout` seconds, then abort the rest
        (their streams end with finish reason "abort"); return how many were aborted."""
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline and self._dead is None:
            await asyncio.sleep(0.05)
        left = list(self._streams)
        for request_id in left:
            self._submit(lambda rid=request_id: self.engine.abort_request(rid))
        deadline = time.monotonic() + _SHUTDOWN_TIMEOUT_S
        while self._streams and time.monotonic() < deadline and self._dead is None:
            await asyncio.sleep(0.01)
        return len(left)

    def shutdown(self) -> None:
        """Stop the engine thread (requests in flight are dropped)."""
        self._stopping = True
        self._wakeup.set()
        self._thread.join(_SHUTDOWN_TIMEOUT_S)

    # ------------------------------------------------------------ loop side
    def _open(self, prompt: PromptType, params: SamplingParams, request_id: str,
              priority: int) -> asyncio.Queue:
        """Validate the request, register its stream and queue it for the engine thread."""
        check_request_ids([request_id])
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        if request_id in self._aborting:
            raise ValueError(f"request id {request_id!r} is still being aborted; it can be "
                             "used again once the engine has stopped that request")
        if not isinstance(params, SamplingParams):
            raise TypeError("sampling_params must be a SamplingParams")
        text, token_ids = self.process_prompt(prompt, params.truncate_prompt_tokens)
        self.check_request(len(token_ids), params)
        self.check_capacity(params.n)
        self._bind_loop()
        params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        arrival = time.monotonic()
        engine_prompt = {"prompt": text, "prompt_token_ids": token_ids,
                         "cache_salt": self.engine.cache_salt(prompt)}
        with self._pending_lock:
            self._pending_adds += params.n
        self._submit(lambda: self._add(request_id, engine_prompt, params, arrival, priority))
        return stream

    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None or self._loop.is_closed():
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("this AsyncLLM serves another event loop")

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _dispatch(self, report: StepReport) -> None:
        """On the event loop: route outputs to their streams, then tell the listeners."""
        for output in report.outputs:
            if output.request_id in self._aborting:
                if output.finished:
                    self._aborting.discard(output.request_id)
                continue
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put_nowait(output)
                if output.finished:
                    del self._streams[output.request_id]
        for listener in self._listeners:
            listener(report)

    def _fail_streams(self, error: BaseException) -> None:
        self._end_streams(error)
        for listener in self._dead_listeners:
            listener(error)

    def _end_streams(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        self._aborting.clear()
        for stream in streams.values():
            stream.put_nowait(error)

    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        """Run `callback(*args)` on the bound event loop, if it is still open."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop closed between the check and the call
            pass

    # ---------------------------------------------------------- engine thread
    def _add(self, request_id: str, prompt: PromptType, params: SamplingParams,
             arrival: float, priority: int) -> None:
        try:
            self.engine.add_request(request_id, prompt, params, arrival, priority)
        except Exception as error:  # noqa: BLE001 - add_request changes nothing when it raises
            self._post(self._fail_request, request_id, error)
        finally:
            with self._pending_lock:
                self._pending_adds -= params.n
            self._engine_waiting = len(self.engine.scheduler.waiting)

    def _fail_request(self, request_id: str, error: BaseException) -> None:
        self._aborting.discard(request_id)  # never added: the engine will report nothing
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put_nowait(error)

    def _run(self, config: EngineConfig, built: "concurrent.futures.Future[LLMEngine]") -> None:
        try:
            self.engine = LLMEngine(config, served=True)
        except BaseException as error:  # noqa: BLE001 - handed to the constructor's caller
            built.set_exception(error)
            return
        built.set_result(self.engine)
        try:
            while self._wait_for_work():
                start = time.perf_counter()
                forward = self._iterate()
                self.loop_stats.busy_seconds += time.perf_counter() - start
                self.loop_stats.forward_seconds += forward
            # Shut down: streams still open end, and later requests are refused, instead of
            # waiting for a loop that is gone.
            self._dead = RuntimeError("the engine was shut down")
            self._post(self._end_streams, EngineDeadError("the engine was shut down"))
        except BaseException as error:  # noqa: BLE001 - report any engine failure to clients
            logger.exception("the engine loop failed")
            self._dead = error
            self._post(self._fail_streams, EngineDeadError(f"the engine loop failed: {error!r}"))
        finally:
            self.engine.shutdown()  # the other tensor-parallel ranks, if any

    def _wait_for_work(self) -> bool:
        """Sleep until there is a command or an unfinished request; False when stopping."""
        while not self._stopping:
            if not self._commands.empty() or self.engine.has_unfinished_requests():
                return True
            self._wakeup.wait()
            self._wakeup.clear()
        return False

    def _iterate(self) -> float:
        """Apply pending commands, run one step, hand its outputs over; the forward time."""
        while not self._commands.empty():
            self._commands.get_nowait()()
        if not self.engine.has_unfinished_requests():
            return 0.0
        outputs = self.engine.step()
        self._engine_waiting = len(self.engine.scheduler.waiting)
        stats = self.engine.last_step_stats
        self.loop_stats.steps += 1
        report = StepReport(outputs, stats, self.engine.scheduler.stats().num_preempted_waiting,
                            time.monotonic())
        self._post(self._dispatch, report)
        return stats.forward_seconds if stats is not None else 0.0

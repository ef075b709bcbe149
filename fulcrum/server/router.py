"""`fulcrum serve --data-parallel-size N`: one OpenAI endpoint in front of N replicas.

Each completion goes to one replica, chosen by a policy:
- cache_aware (default; SGLang router's rule): while the replicas' loads (requests in
  flight through the router: running + waiting) stay within `balance_abs` of each other,
  a request goes to the replica that served the longest prefix of its text recently, if that
  covers more than `cache_threshold` of it (so repeated prefixes meet their cached blocks),
  else to the least loaded; once loads drift apart, to the least loaded.
- round_robin: in turn (for comparison).
Everything else (/v1/models, /tokenize, ...) goes to any healthy replica; /metrics merges
the replicas' series (each labelled with its `engine` index, as vLLM's are) with the
router's own; /health lists the replicas. A replica that dies, or that answers no /health
for `health_timeout` seconds (alive but stuck), is taken out of service: the requests it had
fail with an error (a 502, or an error event in a stream), the others go on; once none is
left the router stops (`on_all_down`), so that a supervisor can restart the whole. A request
a replica takes no connection for goes to another (a refused connection alone takes no
replica out: it may be the router's own doing). A client that hangs up stops its request at
the replica too, streamed or not. On shutdown the router drains as a single server does
(`drain`, run by api_server.GracefulServer).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import time
from typing import (Any, AsyncIterator, Awaitable, Callable, Dict, List, Optional, Sequence,
                    Tuple, TypeVar)

import httpx
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.exceptions import HTTPException as StarletteHTTPException

from fulcrum.server.middleware import (BodyGuard, DrainGate, RequestIdHeader, api_error,
                                       error_response, http_error)
from fulcrum.server.prefix_tree import PrefixTree
from fulcrum.server.replicas import Replica
from fulcrum.server.serving import CLIENT_CLOSED_REQUEST, APIError, first_of, wait_for_disconnect

logger = logging.getLogger(__name__)

POLICIES = ("cache_aware", "round_robin")
CACHE_THRESHOLD = 0.5  # SGLang's defaults
BALANCE_ABS = 32
MONITOR_INTERVAL_S = 0.5
HEALTH_INTERVAL_S = 2.0  # between a replica's /health probes
HEALTH_TIMEOUT_S = 10.0  # a replica that answers none for this long is stuck
CLOSE_TIMEOUT_S = 5.0  # the most a shutdown waits for the requests it closed to end
_HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "keep-alive"}
T = TypeVar("T")


class RoutingPolicy:
    def __init__(self, name: str, replicas: List[Replica]) -> None:
        if name not in POLICIES:
            raise ValueError(f"router policy must be one of {', '.join(POLICIES)}, got {name!r}")
        self.name, self.replicas = name, replicas
        self.tree = PrefixTree()
        self._turn = itertools.count()
        # Set when a shutdown's wait is over: what is still in flight is closed.
        self.closing = asyncio.Event()

    def in_flight(self) -> int:
        return sum(r.in_flight for r in self.replicas)

    def in_service(self, refused: Sequence[Replica] = ()) -> List[Replica]:
        """The replicas in service that have not `refused` a request's connection; an
        APIError if none is left."""
        healthy = [r for r in self.replicas if r.healthy and r not in refused]
        if not healthy:
            if refused:
                raise APIError(502, "no data-parallel replica took the connection")
            raise APIError(503, "no data-parallel replica is in service")
        return healthy

    def pick(self, text: Optional[str], refused: Sequence[Replica] = ()) -> Replica:
        """The replica for a request of `text` (None: no text)."""
        healthy = self.in_service(refused)
        if self.name == "round_robin" or text is None:
            choice = healthy[next(self._turn) % len(healthy)]
            choice.served += 1
            return choice
        least = min(healthy, key=lambda r: (r.in_flight, r.served, r.index))
        most = max(r.in_flight for r in healthy)
        choice = least
        if most - least.in_flight <= BALANCE_ABS and text:
            matched = self.tree.match(text)
            best = max(healthy, key=lambda r: (matched.get(r.index, 0), -r.in_flight))
            if matched.get(best.index, 0) > CACHE_THRESHOLD * len(text):
                choice = best
        self.tree.insert(text, choice.index)
        choice.served += 1
        return choice

    def take_out(self, replica: Replica, reason: str) -> None:
        if replica.error is None:
            replica.error = reason
            replica.gone.set()
            self.tree.forget(replica.index)
            logger.error("data-parallel replica %d is out of service: %s", replica.index, reason)


async def _metrics_page(client: httpx.AsyncClient,
                        replica: Replica) -> Tuple[int, Optional[str]]:
    """(its index, its /metrics page, None if it gave none within 10 s)."""
    with contextlib.suppress(httpx.HTTPError):
        answer = await client.get(f"{replica.url}/metrics", timeout=10.0)
        if answer.status_code == 200:
            return replica.index, answer.text
    return replica.index, None


def routing_text(path: str, body: bytes) -> Optional[str]:
    """What a request's cacheable prefix is made of: the prompt, or the chat messages in
    order (a conversation's next turn extends the text of its last one)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # the replica answers these with a 400
        return None
    if not isinstance(data, dict):
        return None
    if path.endswith("/chat/completions"):
        messages = data.get("messages")
        return json.dumps(messages, sort_keys=True)[:-1] if isinstance(messages, list) else None
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]  # several prompts: route by the first
    return prompt if isinstance(prompt, str) else json.dumps(prompt)[:-1]


class RouterMetrics:
    def __init__(self, replicas: List[Replica]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("fulcrum:router_requests", "Requests the router sent to each "
                                "replica", ["engine"], registry=self.registry)
        self.up = Gauge("fulcrum:router_replica_up", "1 while a replica is in service",
                        ["engine"], registry=self.registry)
        self.in_flight = Gauge("fulcrum:router_requests_in_flight", "Requests the router has "
                               "open at each replica", ["engine"], registry=self.registry)
        self.replicas = replicas

    def render(self, replica_texts: Dict[int, str]) -> bytes:
        for replica in self.replicas:
            self.up.labels(engine=str(replica.index)).set(float(replica.healthy))
            self.in_flight.labels(engine=str(replica.index)).set(replica.in_flight)
        merged = CollectorRegistry()
        merged.register(_Merged(replica_texts))
        return generate_latest(self.registry) + generate_latest(merged)


class _Merged:
    """The replicas' families, each family once, with every replica's samples."""

    def __init__(self, texts: Dict[int, str]) -> None:
        self.texts = texts

    def collect(self):
        families: Dict[str, Any] = {}
        for index, text in sorted(self.texts.items()):
            try:
                parsed = list(text_string_to_metric_families(text))
            except ValueError as error:  # one replica's page must not cost the others'
                logger.warning("replica %d's /metrics left out: %s", index, error)
                continue
            for family in parsed:
                family.samples = [s._replace(labels={**s.labels, "engine": str(index)})
                                  for s in family.samples]
                kept = families.setdefault(family.name, family)
                if kept is not family:
                    kept.samples.extend(family.samples)
        return iter(families.values())


async def drain(routing: RoutingPolicy, timeout: float) -> int:
    """Let the requests in flight finish for up to `timeout` seconds, then close the rest
    (each replica aborts a request whose connection closes, and its client gets a 503 or,
    mid-stream, an error event); return how many were closed."""
    deadline = time.monotonic() + timeout
    while routing.in_flight() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    left = routing.in_flight()
    routing.closing.set()
    deadline = time.monotonic() + CLOSE_TIMEOUT_S
    while routing.in_flight() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return left


def build_router_app(replicas: List[Replica], policy: str = "cache_aware",
                     max_request_body_bytes: int = 16 << 20,
                     cors: Optional[Dict[str, Any]] = None,
                     request_id_headers: bool = False,
                     health_timeout: float = HEALTH_TIMEOUT_S,
                     on_all_down: Optional[Callable[[], None]] = None) -> FastAPI:
    """The router's app; `cors`: CORSMiddleware's keywords (None: no CORS headers);
    `request_id_headers`: X-Request-Id on the router's own answers too (502s, /health);
    `on_all_down`: called once no replica is left in service. While `app.state.draining`
    (a shutdown: see `drain`, `app.state.drain`), API calls get 503 and so does /health."""
    routing = RoutingPolicy(policy, replicas)
    metrics = RouterMetrics(replicas)
    # No cap on connections: each request in flight holds one (httpx's default of 100 made
    # the rest wait in its pool, /health probes too).
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                               limits=httpx.Limits(max_connections=None))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        watchers = [asyncio.ensure_future(_monitor(routing, on_all_down))]
        watchers += [asyncio.ensure_future(_probe_health(client, routing, r, health_timeout))
                     for r in replicas]
        try:
            yield
        finally:
            for watcher in watchers:
                watcher.cancel()
            await client.aclose()

    app = FastAPI(title="fulcrum router", lifespan=lifespan)
    app.state.routing = routing
    app.state.draining = False
    app.state.drain = functools.partial(drain, routing)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)

    @app.get("/health")
    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's name of it (SageMaker's)
    async def health() -> Response:
        states = [{"engine": r.index, "healthy": r.healthy, "in_flight": r.in_flight,
                   **({"error": r.error} if r.error else {})} for r in replicas]
        ok = any(r.healthy for r in replicas) and not app.state.draining
        return JSONResponse({"replicas": states}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        # All at once: a slow replica costs one timeout, not one each.
        pages = await asyncio.gather(*(_metrics_page(client, r) for r in replicas if r.healthy))
        texts = {index: text for index, text in pages if text is not None}
        return Response(metrics.render(texts), media_type="text/plain; version=0.0.4")

    @app.api_route("/v1/completions", methods=["POST"])
    @app.api_route("/v1/chat/completions", methods=["POST"])
    async def completion(request: Request) -> Response:
        body = await request.body()
        text = routing_text(request.url.path, body)

        answer, replica = await _forward_to_one(
            client, routing, lambda refused: routing.pick(text, refused), request, body)
        metrics.requests.labels(engine=str(replica.index)).inc()
        return answer

    async def first_in_service(request: Request) -> Tuple[Response, Replica]:
        return await _forward_to_one(client, routing,
                                     lambda refused: routing.in_service(refused)[0],
                                     request, await request.body())

    @app.get("/dashboard/state")
    async def dashboard_state(request: Request) -> Response:
        answer, replica = await first_in_service(request)
        return _name_the_replica(answer, replica, len(replicas))

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def anything_else(path: str, request: Request) -> Response:
        answer, _ = await first_in_service(request)
        return answer

    app.add_middleware(DrainGate, is_draining=lambda: app.state.draining)
    app.add_middleware(BodyGuard, max_bytes=max_request_body_bytes)
    if cors is not None:
        app.add_middleware(CORSMiddleware, **cors)
    if request_id_headers:
        app.add_middleware(RequestIdHeader)
    return app


def _name_the_replica(answer: Response, replica: Replica, replicas: int) -> Response:
    """A replica's dashboard state with `data_parallel` added: which replica it shows, of how
    many. The page then says that its numbers are that replica's alone (it showed half of
    the server's load as the whole with -dp 2); /metrics has every replica's."""
    if answer.status_code != 200:
        return answer
    state = json.loads(answer.body)
    state["data_parallel"] = {"engine": replica.index, "size": replicas}
    return JSONResponse(state)


class _ClientLeft(Exception):
    """The client hung up before the answer came."""


class _Closing(Exception):
    """A shutdown closed the request before the answer came."""


class _ReplicaGone(Exception):
    """The replica went out of service before the answer came."""


def _closed() -> APIError:
    return APIError(503, "the server shut down before the answer came (--shutdown-timeout)")


async def _forward_to_one(client: httpx.AsyncClient, routing: RoutingPolicy,
                          pick: Callable[[Sequence[Replica]], Replica], request: Request,
                          body: bytes) -> Tuple[Response, Replica]:
    """The answer of the replica `pick(refused)` gives, and that replica. One that takes no
    connection never saw the request, which goes to the next pick (each replica once). It
    stays in service unless its process ended: a refused connection may be the router's own
    doing (out of file descriptors, say)."""
    refused: List[Replica] = []
    while True:
        replica = pick(refused)
        try:
            return await _forward(client, routing, replica, request, body), replica
        except httpx.ConnectError as error:
            _check(routing, replica)
            refused.append(replica)
            logger.warning("data-parallel replica %d took no connection (%r): trying another",
                           replica.index, error)


async def _forward(client: httpx.AsyncClient, routing: RoutingPolicy, replica: Replica,
                   request: Request, body: bytes) -> Response:
    """The replica's answer: relayed as it comes for a stream, else whole; a 502 if the
    replica fails. httpx.ConnectError (nothing was sent) is the caller's."""
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
    outgoing = client.build_request(request.method, f"{replica.url}{request.url.path}",
                                    params=request.query_params, headers=headers, content=body)
    answer: Optional[httpx.Response] = None
    relayed = False  # the relay then counts the request out and closes the answer
    replica.in_flight += 1
    try:
        answer = await _watched(request, routing, replica, client.send(outgoing, stream=True))
        kept = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP_HEADERS}
        if answer.headers.get("content-type", "").startswith("text/event-stream"):
            relayed = True
            return StreamingResponse(_relay(routing, replica, answer),
                                     status_code=answer.status_code, headers=kept)
        content = await _watched(request, routing, replica, answer.aread())
        return Response(content, status_code=answer.status_code, headers=kept)
    except _ClientLeft:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except _Closing:
        return error_response(_closed())
    except httpx.ConnectError:
        raise
    except (_ReplicaGone, httpx.HTTPError) as error:
        return error_response(_failure(routing, replica, error))
    finally:
        if not relayed:
            replica.in_flight -= 1
            if answer is not None:
                await answer.aclose()


async def _watched(request: Request, routing: RoutingPolicy, replica: Replica,
                   work: Awaitable[T]) -> T:
    """`work`'s result; _ClientLeft if the client hangs up first, _ReplicaGone if the replica
    goes out of service first, _Closing if a shutdown closes it first. `work` is then
    cancelled: the connection it had open is dropped, which the replica takes for its
    client leaving (and aborts the request)."""
    done, result = await first_of(work, wait_for_disconnect(request), replica.gone.wait(),
                                  routing.closing.wait())
    if done:
        return result
    if routing.closing.is_set():
        raise _Closing()
    raise _ReplicaGone() if replica.gone.is_set() else _ClientLeft()


async def _relay(routing: RoutingPolicy, replica: Replica,
                 answer: httpx.Response) -> AsyncIterator[bytes]:
    """A replica's event stream, passed through; if the replica fails or goes out of service
    mid-stream (the answer is then closed under the read), an error event and the end of
    the stream: a client never waits on a dead or stuck replica. A shutdown's close ends it
    the same way."""
    closer = asyncio.ensure_future(_close_when_gone(routing, replica, answer))
    try:
        async for piece in answer.aiter_raw():
            yield piece
    except httpx.HTTPError as error:
        failure = (_closed() if routing.closing.is_set()
                   else _failure(routing, replica, error, " mid-stream"))
        yield f"data: {failure.body().model_dump_json()}\n\ndata: [DONE]\n\n".encode()
    finally:
        closer.cancel()
        replica.in_flight -= 1
        await answer.aclose()


async def _close_when_gone(routing: RoutingPolicy, replica: Replica,
                           answer: httpx.Response) -> None:
    await first_of(replica.gone.wait(), routing.closing.wait())
    await answer.aclose()


def _failure(routing: RoutingPolicy, replica: Replica, error: Exception,
             when: str = "") -> APIError:
    """The 502 of a failed exchange with a replica, which first goes out of service if its
    process ended: why it is out of service, else the kind of error."""
    _check(routing, replica)
    reason = replica.error or type(error).__name__
    return APIError(502, f"data-parallel replica {replica.index} failed{when}: {reason}")


def _check(routing: RoutingPolicy, replica: Replica) -> None:
    ended = replica.process_error()
    if ended is not None:
        routing.take_out(replica, ended)


async def _monitor(routing: RoutingPolicy, on_all_down: Optional[Callable[[], None]]) -> None:
    """Take replicas whose process ended out of service, even while no request is routed;
    once none is left, call `on_all_down`."""
    while True:
        for replica in routing.replicas:
            if replica.healthy:
                _check(routing, replica)
        if on_all_down is not None and not any(r.healthy for r in routing.replicas):
            logger.error("no data-parallel replica is left in service")
            on_all_down()
            return
        await asyncio.sleep(MONITOR_INTERVAL_S)


async def _probe_health(client: httpx.AsyncClient, routing: RoutingPolicy, replica: Replica,
                        timeout: float) -> None:
    """Take a replica that lives but answers no /health within `timeout` out of service
    (stopped, deadlocked, swapped out), and end it: its process looks fine, what the router
    has open there would wait for ever, and it holds its share of memory and cores."""
    while replica.healthy:
        try:
            await client.get(f"{replica.url}/health", timeout=timeout)
        except httpx.TimeoutException:
            routing.take_out(replica, f"it answered no /health for {timeout:g} s")
            replica.kill()
        except httpx.HTTPError:
            _check(routing, replica)
        await asyncio.sleep(HEALTH_INTERVAL_S)

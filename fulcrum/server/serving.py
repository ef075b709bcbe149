"""From OpenAI-style requests to engine requests and back: completions and chat completions.

One API request becomes one engine request per prompt (each with the request's `n`); their
incremental outputs are merged into one stream and grow the request's choices (choices.py),
from which the answer is built: a completion's here, a chat's in chat_answer.py. Everything
here runs on the event loop; the engine thread only ever sees validated requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import (Any, AsyncIterator, Awaitable, Callable, Dict, List, Optional, Sequence,
                    Tuple, TypeVar, Union)

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from fulcrum.async_engine import AsyncLLM, EngineDeadError, QueueFullError, RequestFailedError
from fulcrum.chat_template import (TEMPLATE_ERRORS, check_content_format, check_template_kwargs,
                                   content_format)
from fulcrum.metrics import EngineMetrics
from fulcrum.outputs import RequestOutput
from fulcrum.sampling_params import ParamError, SamplingParams, StructuredOutputsParams
from fulcrum.server import reasoning, tool_calls
from fulcrum.server.chat_answer import ChatAnswer
from fulcrum.server.choices import Choice, Delta, EnginePrompt, Generation
from fulcrum.server.logprob_format import legacy_logprobs, prompt_logprobs
from fulcrum.server.protocol import (ChatCompletionRequest, ChatMessage, CompletionChoice,
                                     CompletionRequest, CompletionResponse, ErrorInfo,
                                     ErrorResponse, SamplingRequest, UsageInfo)

T = TypeVar("T")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that hung up before the answer
RETRY_AFTER_S = 1  # what an overloaded server tells clients to wait before retrying


logger = logging.getLogger(__name__)

class APIError(Exception):
    """An error the client caused or should know about, sent in OpenAI's error format."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
             405: "MethodNotAllowedError", 409: "ConflictError", 413: "RequestTooLargeError",
             500: "InternalServerError", 502: "BadGatewayError", 503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 headers: Optional[Dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(
            message=self.message, type=self.TYPES.get(self.status, "APIError"),
            param=self.param, code=self.status))


def bad_request(error: Union[str, Exception]) -> APIError:
    """A 400 saying why; an error that says nothing (MemoryError()) by its kind."""
    return APIError(400, str(error) or type(error).__name__, param=getattr(error, "param", None))


MAX_REQUEST_ID_CHARS = 256
# The most logprobs (prompt and output entries, each token's alternatives included) one
# request may return: each is a Python object on the engine's side and a JSON value on the
# event loop's (16 prompts x 8,000 tokens x 21 took 2.1 GB and stalled every client 19 s).
MAX_LOGPROB_ENTRIES = 1 << 19


def within_logprob_bound(prompt_lengths: Sequence[int], params: SamplingParams,
                         max_model_len: int) -> SamplingParams:
    """A request that asks for logprobs and gives no max_tokens may run to max_model_len:
    where that could pass MAX_LOGPROB_ENTRIES, its max_tokens is as many as the bound leaves
    (a server's cap, as OpenAI's models have one: finish_reason "length" says it was met).
    One that gives max_tokens is held to it, and refused past the bound."""
    if params.logprobs is None or params.max_tokens is not None or not prompt_lengths:
        return params
    prompt_entries = sum(logprob_entries(length, params) for length in prompt_lengths)
    per_token = len(prompt_lengths) * params.n * (params.logprobs + 1)
    room = max_model_len - min(prompt_lengths)
    if prompt_entries + per_token * room <= MAX_LOGPROB_ENTRIES:
        return params
    cap = max(1, (MAX_LOGPROB_ENTRIES - prompt_entries) // per_token)
    return dataclasses.replace(params, max_tokens=cap)


def logprob_entries(num_prompt_tokens: int, params: SamplingParams) -> int:
    """The logprob entries a prompt's request may return at most, as far as it says: its
    output's only where it gives max_tokens (`within_logprob_bound` gives one that has
    none its max_tokens where the bound needs one)."""
    entries = 0
    if params.prompt_logprobs is not None:
        entries += num_prompt_tokens * (params.prompt_logprobs + 1)
    if params.logprobs is not None and params.max_tokens is not None:
        entries += params.n * params.max_tokens * (params.logprobs + 1)
    return entries


@dataclass(frozen=True)
class RequestIds:
    """A response's id, and the base of the engine ids of its prompts."""

    response: str
    engine: str


def request_ids(prefix: str, raw_request: Request, request: SamplingRequest) -> RequestIds:
    """vLLM's rule: `prefix`-ID, ID being the X-Request-Id header, else the body's request_id,
    else a fresh one (kept in the request's state for --enable-request-id-headers). A
    client's id may repeat (a retry, one id per conversation), so its engine ids get a
    suffix of their own; it reaches logs, the dashboard and a response header, so it must be
    short printable ASCII."""
    given = raw_request.headers.get("x-request-id") or request.request_id
    if not given:
        raw_request.state.request_id = uuid.uuid4().hex
        base = f"{prefix}-{raw_request.state.request_id}"
        return RequestIds(base, base)
    if len(given) > MAX_REQUEST_ID_CHARS or not (given.isascii() and given.isprintable()):
        raise APIError(400, f"request_id (or an X-Request-Id header) must be at most "
                            f"{MAX_REQUEST_ID_CHARS} printable ASCII characters, got "
                            f"{given[:40]!r}{'...' if len(given) > 40 else ''}", "request_id")
    raw_request.state.request_id = given
    base = f"{prefix}-{given}"
    return RequestIds(base, f"{base}-{uuid.uuid4().hex[:8]}")


# ------------------------------------------------------------------ streams
async def merge_streams(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[Tuple[int, T]]:
    """(index of the stream, item) from several async iterators, as items arrive.

    Leaving early cancels every stream still running, which aborts its engine request.
    """
    if len(streams) == 1:  # the common case, without a task and a wait per item
        async with contextlib.aclosing(streams[0]) as stream:
            async for item in stream:
                yield 0, item
        return
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[index]))] = index
                yield index, item
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


# JSON leaves these raw inside strings, but str.splitlines() (which some SSE clients use to
# split events into lines, httpx's and the openai SDK's among them) breaks lines at them.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json().translate(_LINE_BREAKS)}\n\n"


async def wait_for_disconnect(raw_request: Request) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


async def first_of(work: Awaitable[T], *stops: Awaitable[Any]) -> Tuple[bool, Optional[T]]:
    """(True, `work`'s result), or (False, None) if one of `stops` ends first, `work` then
    cancelled; what `work` or a stop raises is raised. Nothing is left running either way."""
    task = asyncio.ensure_future(work)
    watchers = [asyncio.ensure_future(stop) for stop in stops]
    try:
        await asyncio.wait({task, *watchers}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in (task, *watchers):
            waiter.cancel()
        await asyncio.gather(task, *watchers, return_exceptions=True)
    for watcher in watchers:
        if not watcher.cancelled() and watcher.exception() is not None:
            raise watcher.exception()
    if task.cancelled():
        return False, None
    return True, task.result()


async def run_unless_disconnected(raw_request: Request, work: Awaitable[None]) -> bool:
    """Run `work`, cancelling it if the client hangs up first; True if it completed.

    Streaming responses get this from Starlette; a plain response needs it so that a client
    that gives up on a long completion does not keep its requests running.
    """
    completed, _ = await first_of(work, wait_for_disconnect(raw_request))
    return completed


# Prompts longer than this in all (characters or token ids) are tokenized and checked off the
# event loop (a 1.15-million-character prompt held every client up 1.6 s); shorter ones are
# not worth a thread.
HEAVY_PROMPT_ITEMS = 10_000
# Responses holding more logprobs than this are built off the event loop.
HEAVY_RESPONSE_LOGPROBS = 10_000


def _heavy(params: SamplingParams, prompt_items: int) -> bool:
    """A request whose preparation may take long: long prompts, or a constraint to parse (the
    first builds xgrammar's view of the vocabulary: 0.9 s for Qwen's)."""
    return params.structured_outputs is not None or prompt_items > HEAVY_PROMPT_ITEMS


async def in_own_thread(function: Callable[[], T]) -> T:
    """`function()` on a thread of its own while the event loop serves on (other streams,
    /health): a chat template may take long (a trusted request's own template may loop for
    minutes), as may tokenizing a huge conversation. vLLM renders off the loop too. A daemon
    thread: one that never ends must not keep the process from exiting."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, error: Optional[BaseException]) -> None:
        if future.done():  # the caller left
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def run() -> None:
        try:
            outcome = (function(), None)
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            outcome = (None, error)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, daemon=True, name="fulcrum-render").start()
    return await future


# ------------------------------------------------------------------ serving
ChunkMaker = Callable[[Choice, Delta], List[BaseModel]]  # what to send: maybe nothing
# Chat templates rendering at once, each on a thread of its own; and so, apart from them (a
# trusted request's template may run for hours), long prompts tokenizing, constraints and
# tools' schemas being checked, large responses being built. The rest waits.
MAX_RENDERS = 8
MAX_OFF_LOOP = 8


def overloaded(error: QueueFullError) -> APIError:
    return APIError(503, str(error), headers={"Retry-After": str(RETRY_AFTER_S)})


class OpenAIServing:
    """`trust_request_chat_template`: whether a request may bring its own chat template. Off
    by default, as in vLLM: the sandbox keeps a template from reaching the host, but not from
    looping for minutes (on a thread of its own, which the server serves on beside)."""

    def __init__(self, async_llm: AsyncLLM, model_names: Sequence[str],
                 trust_request_chat_template: bool = False, log_requests: bool = False,
                 chat_template: Optional[str] = None,
                 tool_call_parser: Optional[str] = None, max_log_len: Optional[int] = None,
                 metrics: Optional[EngineMetrics] = None,
                 chat_template_content_format: str = "auto",
                 reasoning_parser: Optional[str] = None) -> None:
        self.llm = async_llm
        self.model_names = list(model_names)  # any may be asked for; responses carry the first
        self.model_name = self.model_names[0]
        self.max_log_len = max_log_len  # of a logged prompt: characters and token ids
        self.metrics = metrics
        # --enable-auto-tool-choice with --tool-call-parser: how tool_choice "auto" reads calls.
        self.tool_parser = tool_calls.make_parser(tool_call_parser) if tool_call_parser else None
        self.tool_skip_special = self.tool_parser is None or tool_calls.skips_special_tokens(
            self.tool_parser, async_llm.tokenizer)
        # --reasoning-parser: the model's thinking goes to `reasoning`, the rest to `content`.
        self.reasoning_parser = (reasoning.make_parser(reasoning_parser) if reasoning_parser
                                 else None)
        self.chat_template = chat_template  # the server's, over the model's (--chat-template)
        # How templates read message content (--chat-template-content-format; vLLM's).
        check_content_format(chat_template_content_format)
        self.chat_template_content_format = chat_template_content_format
        self.trust_request_chat_template = trust_request_chat_template
        self.log_requests = log_requests
        self._renders = asyncio.Semaphore(MAX_RENDERS)
        self._off_loop = asyncio.Semaphore(MAX_OFF_LOOP)

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    # -------------------------------------------------------- completions
    async def create_completion(self, request: CompletionRequest,
                                raw_request: Request) -> Union[Response, BaseModel]:
        ids = request_ids("cmpl", raw_request, request)
        # OpenAI's way to score a prompt: echo with max_tokens 0 returns the prompt alone
        # (with its logprobs where asked). The engine runs one token (vLLM's way too), which
        # the choices leave out.
        prompt_only = request.echo and request.max_tokens == 0
        params = self._sampling_params(request, 1 if prompt_only else request.max_tokens,
                                       request.logprobs)
        if request.echo and request.logprobs is not None:  # echoed tokens get theirs too
            params = dataclasses.replace(params, prompt_logprobs=request.logprobs)
        def prepare() -> Tuple[List[EnginePrompt], SamplingParams, Generation]:
            prompts = self._completion_prompts(request, params.truncate_prompt_tokens)
            return prompts, self._check(prompts, params, request), Generation(
                prompts, request.n, request.echo,
                None if request.logprobs is None else self.llm.tokenizer,
                [given != text for given, (text, _) in zip(request.prompts(), prompts)],
                prompt_only)

        given = request.prompt if isinstance(request.prompt, list) else [request.prompt]
        size = sum(len(p) if isinstance(p, (str, list)) else 1 for p in given)
        heavy = _heavy(params, size) or (request.echo and request.logprobs is not None)
        prompts, params, generation = await self.off_loop_if(heavy, prepare)  # (echo: offsets)
        created = int(time.time())

        def response(choices: List[CompletionChoice], usage: Optional[UsageInfo]):
            return CompletionResponse(id=ids.response, created=created, model=self.model_name,
                                      choices=choices, usage=usage)

        decode = lambda token: self.llm.tokenizer.decode([token], False)  # noqa: E731

        ids_sent = set()  # the choices whose prompt token ids went out (return_token_ids)

        def choice(c: Choice, delta: Delta) -> CompletionChoice:
            logprobs = None
            if request.logprobs is not None:
                logprobs = legacy_logprobs(delta, decode, request.return_tokens_as_token_ids)
            asked = request.prompt_logprobs is not None
            with_ids = request.return_token_ids
            prompt_ids = None
            if with_ids and c.index not in ids_sent:
                prompt_ids = generation.prompt_ids[c.index // generation.n]
                ids_sent.add(c.index)
            return CompletionChoice(
                index=c.index, text=delta.text, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs(delta.new_prompt_logprobs) if asked else None,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                token_ids=list(delta.token_ids) if with_ids else None,
                prompt_token_ids=prompt_ids)

        outputs = self._generate(prompts, params, ids.engine, request)
        return await self._respond(
            request, raw_request, generation, outputs,
            chunk=lambda c, d: [response([choice(c, d)],
                                          generation.usage_of(c, request.continuous_usage))],
            usage_chunk=lambda: response([], generation.usage()),
            final=lambda: response([choice(c, c.whole()) for c in generation.choices],
                                   generation.usage()))

    def _completion_prompts(self, request: CompletionRequest,
                            truncate: Optional[int]) -> List[EnginePrompt]:
        try:
            return [self._engine_prompt(p, request.add_special_tokens, truncate)
                    for p in request.prompts()]
        except (ValueError, TypeError) as error:
            raise bad_request(error) from None

    def _engine_prompt(self, prompt: Union[str, List[int]], add_special: bool,
                       truncate: Optional[int]) -> EnginePrompt:
        """(text, token ids) of one prompt, checked against the model's limits; the text of
        token ids keeps their special tokens, as vLLM's (tokenizer.decode(ids))."""
        if isinstance(prompt, str):
            prompt = {"prompt": prompt,
                      "prompt_token_ids": self.llm.engine.encode(prompt, add_special, truncate)}
        text, token_ids = self.llm.process_prompt(prompt, truncate)
        if text is None:
            text = self.llm.tokenizer.decode(token_ids, skip_special_tokens=False)
        return text, token_ids

    # --------------------------------------------------------------- chat
    async def create_chat_completion(self, request: ChatCompletionRequest,
                                     raw_request: Request) -> Union[Response, BaseModel]:
        ids = request_ids("chatcmpl", raw_request, request)
        limit = self.llm.config.max_logprobs
        if request.top_logprobs is not None and request.top_logprobs > limit:
            raise APIError(400, f"top_logprobs must be at most {limit} (max_logprobs), got "
                                f"{request.top_logprobs}", "top_logprobs")
        hides_thinking = not request.include_reasoning and self.reasoning_parser is not None
        num_logprobs = None if hides_thinking else request.num_logprobs
        params = self._sampling_params(request, request.max_output_tokens, num_logprobs)
        params = await self.off_loop_if(request.tool_mode in ("required", "named"),
                                        functools.partial(self._tool_params, request, params))
        self.check_request_template(request.chat_template)
        prompt = await self.render_chat(request.messages, request.add_generation_prompt,
                                        request.chat_template, request.chat_template_kwargs,
                                        request.tool_dicts, params.truncate_prompt_tokens,
                                        request.continue_final_message,
                                        request.add_special_tokens)
        params = await self.off_loop_if(_heavy(params, 0), functools.partial(  # (tokenized)
            self._check, [prompt], params, request))
        generation = Generation([prompt], request.n)
        answer = ChatAnswer(
            request, generation, ids.response, self.model_name,
            thinking={c.index: self._reasoning_stream(params, hides_thinking)
                      for c in generation.choices},
            calls={c.index: self._tool_stream(request) for c in generation.choices},
            num_logprobs=num_logprobs, with_ids=request.return_token_ids and not hides_thinking)
        outputs = self._generate([prompt], params, ids.engine, request)
        return await self._respond(request, raw_request, generation, outputs,
                                   chunk=answer.delta_chunks, usage_chunk=answer.usage_chunk,
                                   final=answer.final, preamble=answer.preamble())

    def _tool_params(self, request: ChatCompletionRequest,
                     params: SamplingParams) -> SamplingParams:
        """The sampling parameters under the request's tool_choice: "required" and named
        calls are enforced by a grammar; "auto" needs the server's tool call parser."""
        mode = request.tool_mode
        if mode == "auto":
            if self.tool_parser is None:
                raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and '
                                    "--tool-call-parser to be set", "tool_choice")
            return dataclasses.replace(params, skip_special_tokens=params.skip_special_tokens
                                       and self.tool_skip_special)
        try:
            constraint = tool_calls.constraint(request.tool_dicts or [],
                                               request.forced_function,
                                               request.parallel_tool_calls is not False,
                                               self._parse_constraint)
        except ValueError as error:  # a tool's schema that xgrammar refuses or cannot hold
            raise APIError(400, f"tools: {error}", "tools") from None
        if constraint is None:
            return params
        if params.structured_outputs is not None:
            raise APIError(400, f"tool_choice {mode!r} is enforced with structured outputs, so "
                                "the request may not bring its own", "tool_choice")
        return dataclasses.replace(params, structured_outputs=constraint)

    def _parse_constraint(self, constraint: StructuredOutputsParams) -> None:
        """Raise ValueError if xgrammar cannot read `constraint` (its compiler is built on
        first use: unconstrained requests never pay for it)."""
        self.llm.engine.grammar_compiler.parse(constraint)

    def _reasoning_stream(self, params: SamplingParams,
                          hidden: bool) -> Optional[reasoning.ReasoningStream]:
        """None without a reasoning parser; `hidden`: the thinking is dropped. A grammar
        (structured outputs, tool_choice required or named) writes the answer from its first
        token: it thinks only where the grammar opens it with <think> (deepseek_r1's rule
        took a JSON answer for thinking)."""
        parser = self.reasoning_parser
        if parser is None:
            return None
        if params.structured_outputs is not None:
            parser = dataclasses.replace(parser, thinks_from_start=False)
        return reasoning.ReasoningStream(parser, hidden)

    def _tool_stream(self, request: ChatCompletionRequest) -> Optional[tool_calls.ToolCallStream]:
        mode = request.tool_mode
        if mode is None:
            return None
        return tool_calls.ToolCallStream(mode, self.tool_parser, request.forced_function,
                                         request.parallel_tool_calls is not False)

    def check_request_template(self, chat_template: Optional[str]) -> None:
        """A request's own chat template is refused unless the server trusts them."""
        if chat_template is not None and not self.trust_request_chat_template:
            raise APIError(400, "chat_template in a request is refused: start the server with "
                                "--trust-request-chat-template to allow it", "chat_template")

    async def off_loop_if(self, heavy: bool, function: Callable[[], T],
                          slots: Optional[asyncio.Semaphore] = None) -> T:
        """`function()`, on a thread of its own where `heavy`, as many at once as `slots`
        (MAX_OFF_LOOP's unless given) allow."""
        if not heavy:
            return function()
        async with slots or self._off_loop:
            return await in_own_thread(function)

    async def render_chat(self, messages: List[ChatMessage], add_generation_prompt: bool = True,
                          chat_template: Optional[str] = None,
                          template_kwargs: Optional[Dict[str, Any]] = None,
                          tools: Optional[List[Dict[str, Any]]] = None,
                          truncate: Optional[int] = None,
                          continue_final_message: bool = False,
                          add_special_tokens: bool = False) -> EnginePrompt:
        """(text, token ids) of a conversation through the model's chat template (its last
        `truncate` tokens, if given; with the tokenizer's special tokens where
        `add_special_tokens`), rendered off the event loop, MAX_RENDERS at once."""
        return await self.off_loop_if(True, functools.partial(
            self._render_chat, messages, add_generation_prompt, chat_template,
            template_kwargs, tools, truncate, continue_final_message, add_special_tokens),
            self._renders)

    def _render_chat(self, messages: List[ChatMessage], add_generation_prompt: bool,
                     chat_template: Optional[str], template_kwargs: Optional[Dict[str, Any]],
                     tools: Optional[List[Dict[str, Any]]], truncate: Optional[int],
                     continue_final_message: bool, add_special_tokens: bool) -> EnginePrompt:
        tokenizer = self.llm.tokenizer
        kwargs = dict(template_kwargs or {})
        if tools:
            kwargs["tools"] = tools
        try:
            check_template_kwargs(template_kwargs)
            template = tokenizer.template_for(chat_template or self.chat_template, tools)
            form = content_format(template, self.chat_template_content_format)
            text = tokenizer.apply_chat_template([m.template_dict(form) for m in messages],
                                                 add_generation_prompt, template,
                                                 continue_final_message, **kwargs)
            token_ids = self.llm.engine.encode(text, add_special_tokens, truncate)
            return self.llm.process_prompt({"prompt": text, "prompt_token_ids": token_ids},
                                           truncate)
        except (ValueError, TypeError, *TEMPLATE_ERRORS) as error:  # a template's own
            raise bad_request(error) from None

    # ------------------------------------------------------------- shared
    def _sampling_params(self, request: SamplingRequest, max_tokens: Optional[int],
                         logprobs: Optional[int]) -> SamplingParams:
        self.check_model(request.model)
        problem = request.unsupported()
        if problem:
            raise APIError(400, problem[1], param=problem[0])
        ignored = request.ignored_fields()
        if ignored:
            logger.warning("ignored unknown request fields: %s", ", ".join(ignored))
        defaults = self.llm.engine.generation_defaults
        if not {"max_tokens", "max_completion_tokens"} & request.model_fields_set:
            max_tokens = defaults.get("max_tokens", max_tokens)
        try:
            self.llm.engine.validate_priority(request.priority)
            return request.to_sampling_params(max_tokens, logprobs, defaults)
        except (ValueError, TypeError) as error:
            raise bad_request(error) from None

    def _check(self, prompts: Sequence[EnginePrompt], params: SamplingParams,
               request: SamplingRequest) -> SamplingParams:
        """Refuse the whole request before any of it streams or reaches the engine; return
        its parameters as it will run (see `within_logprob_bound`)."""
        try:
            self.llm.engine.cache_salt({"cache_salt": request.cache_salt})
            params = within_logprob_bound([len(ids) for _, ids in prompts], params,
                                          self.llm.config.max_model_len)
            entries = 0
            for _, token_ids in prompts:
                self.llm.engine.validate_params(params, len(token_ids))
                entries += logprob_entries(len(token_ids), params)
            if entries > MAX_LOGPROB_ENTRIES:
                raise ParamError("logprobs", f"this request could return {entries:,} logprobs "
                                 f"(prompt tokens x (prompt_logprobs + 1), and n x max_tokens "
                                 f"x (logprobs + 1)), more than the {MAX_LOGPROB_ENTRIES:,} one "
                                 "request may; ask for fewer tokens or alternatives")
            self.llm.check_capacity(len(prompts) * params.n)
        except (ValueError, TypeError) as error:
            raise bad_request(error) from None
        except QueueFullError as error:
            raise overloaded(error) from None
        return params

    def _generate(self, prompts: Sequence[EnginePrompt], params: SamplingParams,
                  request_id: str, request: SamplingRequest,
                  ) -> AsyncIterator[Tuple[int, RequestOutput]]:
        if self.log_requests:
            for i, (text, ids) in enumerate(prompts):
                logger.info("request %s-%d: prompt %r, prompt_token_ids %s (%d tokens), %s",
                            request_id, i, (text or "")[:self.max_log_len],
                            ids[:self.max_log_len], len(ids), params)
        if self.metrics is not None:
            limit = self.llm.config.max_model_len
            for _, ids in prompts:
                self.metrics.record_params(params, params.max_tokens or limit - len(ids))
        streams = [self.llm.generate({"prompt": text, "prompt_token_ids": ids,
                                      "cache_salt": request.cache_salt}, params,
                                     f"{request_id}-{i}", request.priority)
                   for i, (text, ids) in enumerate(prompts)]
        return merge_streams(streams)

    async def _respond(self, request: SamplingRequest, raw_request: Request,
                       generation: Generation,
                       outputs: AsyncIterator[Tuple[int, RequestOutput]], chunk: ChunkMaker,
                       usage_chunk: Callable[[], BaseModel], final: Callable[[], BaseModel],
                       preamble: Sequence[BaseModel] = ()) -> Union[Response, BaseModel]:
        """A server-sent event stream, or the whole response once every choice finished."""
        if request.stream:
            events = _events(generation, outputs, chunk, preamble,
                             usage_chunk if request.include_usage else None)
            return StreamingResponse(events, media_type="text/event-stream")
        if not await run_unless_disconnected(raw_request, generation.consume(outputs)):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        if generation.logprob_entries() <= HEAVY_RESPONSE_LOGPROBS:
            return final()
        # Built and written as JSON on a thread of its own: 64 choices of 1,000 tokens with 20
        # alternatives each held every other client up 1.8 s.
        body = await self.off_loop_if(True, lambda: final().model_dump_json())
        return Response(body, media_type="application/json")


async def _events(generation: Generation, outputs: AsyncIterator[Tuple[int, RequestOutput]],
                  chunk: ChunkMaker, preamble: Sequence[BaseModel],
                  usage_chunk: Optional[Callable[[], BaseModel]]) -> AsyncIterator[str]:
    """OpenAI's stream: one chunk per new output, an optional usage chunk, then [DONE].
    Closed early (the client left, or took nothing for http_protocol.WRITE_TIMEOUT_S), it
    closes `outputs`, which aborts their requests."""
    async with contextlib.aclosing(outputs):
        try:
            for payload in preamble:
                yield _sse(payload)
            async for prompt_index, output in outputs:
                for choice, delta in generation.add(prompt_index, output):
                    for payload in chunk(choice, delta):
                        yield _sse(payload)
            if usage_chunk is not None:
                yield _sse(usage_chunk())
        except EngineDeadError as error:
            yield _sse(APIError(503, str(error)).body())
        except RequestFailedError as error:
            yield _sse(APIError(error.status, str(error)).body())
        except Exception as error:  # noqa: BLE001 - as the 500 a whole response would get
            logger.exception("a stream failed")
            yield _sse(APIError(500, f"internal error: {error!r}").body())
        yield "data: [DONE]\n\n"

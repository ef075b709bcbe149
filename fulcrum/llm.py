"""The offline API: `LLM(...).generate(prompts, sampling_params)`, as in vLLM."""

from __future__ import annotations

import collections.abc
import dataclasses
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Union

from tqdm.auto import tqdm

from fulcrum.chat_messages import template_conversation, template_tools
from fulcrum.chat_template import (TEMPLATE_ERRORS, check_content_format, check_template_kwargs,
                                   content_format)
from fulcrum.config import EngineConfig, check_slo_targets_read
from fulcrum.default_model import DEFAULT_MODEL_NAME
from fulcrum.engine import LLMEngine, PromptType, is_token_id
from fulcrum.metrics import EngineMetrics, Metric, snapshot
from fulcrum.outputs import RequestOutput
from fulcrum.sampling_params import RequestOutputKind, SamplingParams
from fulcrum.stats import StepReport
from fulcrum.tokenizer import Tokenizer

Messages = List[Dict[str, Any]]


class LLM:
    """Generate for many prompts at once with continuous batching.

    `model` is a local Hugging Face folder; None runs the built-in default model (see
    fulcrum.default_model). Every other keyword is an `EngineConfig` field (vLLM's names).
    """

    def __init__(self, model: Optional[str] = None, **kwargs: Any) -> None:
        kwargs.setdefault("disable_log_stats", True)  # vLLM's LLM default
        config = EngineConfig(model=model, **kwargs)
        _check_targets_read(config, config.slo_ttft_ms, config.slo_tpot_ms)
        self.llm_engine = LLMEngine(config)
        self._counter = 0
        self._metrics: Optional[EngineMetrics] = None
        if not self.llm_engine.config.disable_log_stats:
            self._metrics = EngineMetrics(self.llm_engine, model or DEFAULT_MODEL_NAME)
        # generate returns whole outputs whatever kind the params ask for (as vLLM's LLM
        # does): the engine builds them at the end, or every step where the metrics must
        # see each token (their inter-token gaps).
        self._kind = (RequestOutputKind.FINAL_ONLY if self._metrics is None
                      else RequestOutputKind.CUMULATIVE)
        # One call drives the engine at a time: two threads stepping it at once took each
        # other's outputs and neither call returned. A second call waits for the first.
        self._lock = threading.Lock()
        self._driver: Optional[int] = None  # the thread whose call holds the lock

    def get_metrics(self) -> List[Metric]:
        """The engine's metrics now, as the server's /metrics has them (vLLM's
        `LLM.get_metrics()`); needs `disable_log_stats=False`."""
        if self._metrics is None:
            raise ValueError("metrics are off: create the LLM with disable_log_stats=False")
        self._metrics.refresh_state()
        return snapshot(self._metrics.registry)

    def get_tokenizer(self) -> Tokenizer:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when given no SamplingParams: the library's defaults with the
        model's generation_config.json on top (see `generation_config`)."""
        return SamplingParams(**self.llm_engine.generation_defaults)

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 use_tqdm: bool = True, priority: Optional[Sequence[int]] = None,
                 slo_ttft_ms: Optional[float] = None,
                 slo_tpot_ms: Optional[float] = None,
                 lora_request: None = None) -> List[RequestOutput]:
        """Outputs in the order of `prompts`. Every prompt is checked before any is queued.
        `slo_ttft_ms` / `slo_tpot_ms` set the latency targets of every prompt (overriding
        those of its SamplingParams). `lora_request` is vLLM's; fulcrum serves no adapters,
        so only None is accepted."""
        _check_no_lora(lora_request)
        prompt_list = _as_prompt_list(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompt_list))
        targets = {k: v for k, v in (("slo_ttft_ms", slo_ttft_ms), ("slo_tpot_ms", slo_tpot_ms))
                   if v is not None}
        # Once per distinct SamplingParams (one given for all prompts is one object).
        replaced = {id(p): dataclasses.replace(p, output_kind=self._kind, **targets)
                    for p in params_list}
        params_list = [replaced[id(p)] for p in params_list]
        for params in replaced.values():
            _check_targets_read(self.llm_engine.config, params.slo_ttft_ms, params.slo_tpot_ms)
        if priority is not None and (not isinstance(priority, collections.abc.Sequence)
                                     or isinstance(priority, str)):
            raise TypeError("priority must be a list of integers, one per prompt, got "
                            f"{type(priority).__name__}")
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompt_list)} prompts")
        if self._driver == threading.get_ident():
            raise RuntimeError("LLM.generate (or chat) was called from inside another of its "
                               "calls on this LLM (from a prompt's iterator, say): it would wait "
                               "for itself forever")
        with self._lock:
            self._driver = threading.get_ident()
            try:
                return self._generate(prompt_list, params_list, priority, use_tqdm)
            finally:
                self._driver = None

    def _generate(self, prompt_list: List[PromptType], params_list: List[SamplingParams],
                  priority: Optional[Sequence[int]], use_tqdm: bool) -> List[RequestOutput]:
        engine = self.llm_engine
        prepared, max_tokens = [], []
        for i, (prompt, params) in enumerate(zip(prompt_list, params_list)):
            text, token_ids = engine.prepare_prompt(prompt, params)
            max_tokens.append(engine.validate_params(params, len(token_ids)))
            engine.validate_priority(priority[i] if priority is not None else 0)
            # Read once: a prompt given as an iterator would be empty the second time.
            prepared.append({"prompt": text, "prompt_token_ids": token_ids,
                             "cache_salt": engine.cache_salt(prompt)})
        ids: List[str] = []
        try:
            for i, (prompt, params) in enumerate(zip(prepared, params_list)):
                request_id = f"llm-{self._counter}"
                self._counter += 1
                engine.add_request(request_id, prompt, params,
                                   priority=priority[i] if priority is not None else 0)
                ids.append(request_id)
                if self._metrics is not None:
                    self._metrics.record_params(params, max_tokens[i])
        except BaseException:  # none of this call's prompts is left queued without a caller
            engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: Union[Messages, Sequence[Messages]],
             sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
             use_tqdm: bool = True, chat_template: Optional[str] = None,
             add_generation_prompt: bool = True,
             chat_template_kwargs: Optional[Dict[str, Any]] = None,
             tools: Optional[List[Dict[str, Any]]] = None,
             continue_final_message: bool = False,
             chat_template_content_format: str = "auto",
             lora_request: None = None) -> List[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them;
        `chat_template_kwargs` reach the template (e.g. Qwen3's `enable_thinking`), and so do
        `tools` (OpenAI's function definitions, as vLLM's `LLM.chat` takes them).
        `continue_final_message`: the last message stays open and the answer continues it
        (with add_generation_prompt=False, as in vLLM). `chat_template_content_format`
        (vLLM's): how the template reads message content, "string" (text parts joined),
        "openai" (a list of parts) or "auto" (as its loops show). `lora_request`: as in
        `generate`, only None."""
        _check_no_lora(lora_request)
        check_content_format(chat_template_content_format)
        _check_chat_options(chat_template, chat_template_kwargs, add_generation_prompt,
                            continue_final_message)
        conversations = _as_conversations(messages)
        tools = template_tools(tools)
        tokenizer = self.get_tokenizer()
        kwargs = {**(chat_template_kwargs or {}), **({"tools": tools} if tools else {})}
        params_list = self._params_per_prompt(sampling_params, len(conversations))
        prompts = []
        template = tokenizer.template_for(chat_template, tools)
        form = content_format(template, chat_template_content_format)
        for conversation, params in zip(conversations, params_list):
            conversation = template_conversation(conversation, form)
            try:
                text = tokenizer.apply_chat_template(conversation, add_generation_prompt,
                                                     template, continue_final_message, **kwargs)
            except TEMPLATE_ERRORS as error:  # the template's own ({{ 1/0 }}, raise_exception)
                raise ValueError(f"the chat template failed: {error or type(error).__name__}"
                                 ) from None
            # The engine's encode: a text no max_model_len could hold is refused untokenized
            # (unless only its end is kept).
            prompts.append({"prompt": text, "prompt_token_ids": self.llm_engine.encode(
                text, False, params.truncate_prompt_tokens)})
        return self.generate(prompts, params_list, use_tqdm)

    def _params_per_prompt(self, sampling_params, count: int) -> List[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if isinstance(sampling_params, dict):  # list() would take its keys for params
            raise TypeError("sampling_params must be a SamplingParams or a list of them, got "
                            "a dict (SamplingParams(**it) makes one)")
        if not isinstance(sampling_params, collections.abc.Iterable):
            raise TypeError("sampling_params must be a SamplingParams or a list of them, got "
                            f"{type(sampling_params).__name__}")
        params = list(sampling_params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} sampling_params for {count} prompts")
        for param in params:
            if not isinstance(param, SamplingParams):
                raise TypeError("sampling_params must be a SamplingParams or a list of them, "
                                f"got a list holding {type(param).__name__}")
        return params

    def _run(self, request_ids: List[str], use_tqdm: bool) -> List[RequestOutput]:
        engine = self.llm_engine
        finished: Dict[str, RequestOutput] = {}
        # The first step may also report requests an interrupted call left aborted.
        wanted = set(request_ids)
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                outputs = engine.step()
                self._record(outputs)
                for output in outputs:
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        bar.update(1)
        except BaseException:
            engine.abort_request(request_ids)
            raise
        finally:
            bar.close()
        return [finished[i] for i in request_ids]

    def _record(self, outputs: List[RequestOutput]) -> None:
        if self._metrics is None:
            return
        engine, now = self.llm_engine, time.monotonic()
        preempted = engine.scheduler.stats().num_preempted_waiting
        self._metrics.record(StepReport([], engine.last_step_stats, preempted, now))
        self._metrics.record(StepReport(outputs, None, preempted, now), cumulative=True)


def _check_targets_read(config: EngineConfig, slo_ttft_ms: Optional[float],
                        slo_tpot_ms: Optional[float]) -> None:
    """Latency targets, the engine's or a request's, are refused where nothing reads them."""
    check_slo_targets_read(config.scheduling_policy, not config.disable_log_stats,
                           {"slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms},
                           "LLM(disable_log_stats=True) keeps no metrics")


def _check_no_lora(lora_request: Any) -> None:
    if lora_request is not None:
        raise ValueError("lora_request is not supported: fulcrum serves no LoRA adapters")


def _as_conversations(messages: Any) -> List[Sequence[Any]]:
    """One conversation (a list of message dicts) or a list of them, as a list of them."""
    if isinstance(messages, (str, dict)) or not isinstance(messages, collections.abc.Iterable):
        raise TypeError("messages must be a conversation (a list of message dicts) or a list "
                        f"of conversations, got {type(messages).__name__}")
    messages = list(messages)
    # One conversation unless it is a list of lists (of message dicts, or the server's models).
    one = messages and not isinstance(messages[0], (list, tuple))
    conversations = [messages] if one else messages
    if not conversations or not all(isinstance(c, (list, tuple)) and c for c in conversations):
        raise ValueError("LLM.chat needs conversations of at least one message (each a list "
                         "of message dicts)")
    return conversations


def _check_chat_options(chat_template: Any, template_kwargs: Any, add_generation_prompt: Any,
                        continue_final_message: Any) -> None:
    if chat_template is not None and not isinstance(chat_template, str):
        raise TypeError("chat_template must be a template's text or the name of one of the "
                        f"model's, got {type(chat_template).__name__}")
    check_template_kwargs(template_kwargs)
    for name, value in (("add_generation_prompt", add_generation_prompt),
                        ("continue_final_message", continue_final_message)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")


def _as_prompt_list(prompts) -> List[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not hasattr(prompts, "__iter__"):
        # bytes: list() would make them token ids
        raise TypeError("prompts must be a string, a list of token ids, a dict or a list of "
                        f"those, got {type(prompts).__name__}")
    prompts = list(prompts)
    if any(is_token_id(t) for t in prompts):
        return [prompts]  # a single prompt given as token ids (each then checked as one)
    return prompts

"""Request and response bodies of the OpenAI-compatible API, with OpenAI's and vLLM's names.

Unknown request fields are logged and otherwise ignored, as in vLLM, so clients written for
OpenAI or vLLM work unchanged; fields that would change the result but are not supported are
rejected with a 400 naming the field, never dropped silently.
"""

from __future__ import annotations

import time
from typing import Any, Callable, ClassVar, Dict, List, Literal, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from fulcrum.chat_messages import (ChatMessage, ToolCallMessage, ToolDefinition,
                                   check_conversation_size)
from fulcrum.sampling_params import ParamError, SamplingParams, StructuredOutputsParams
from fulcrum.tokenizer import lone_surrogate_at

# Each prompt of a request becomes an engine request; the queue limit bounds them too.
MAX_PROMPTS_PER_REQUEST = 1024


class RequestBody(BaseModel):
    """A request's body: refused whole if any string in it is not valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = lone_surrogate_at(data)
        if where is not None:
            where = where or "body"
            raise ParamError(where.split(".")[0],
                             f"{where} is not valid Unicode: it holds a lone surrogate")
        return data


class StreamOptions(BaseModel):
    """A stream's usage: vLLM's defaults, so stream_options given without include_usage
    (`{"continuous_usage_stats": true}` alone, say) still asks for it, as it does there; a
    null (vLLM's fields are Optional) asks for none."""

    include_usage: Optional[bool] = True
    continuous_usage_stats: Optional[bool] = False


# vLLM's older per-kind fields of structured outputs -> the StructuredOutputsParams field.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
# Sampling fields a model's generation_config.json may default (see generation_config.py).
DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


# vLLM's request fields that fulcrum does not serve and whose values would change the answer:
# (values that change nothing, what the field is for). Other unknown fields are logged only.
UNSERVED_VLLM_FIELDS: Dict[str, Tuple[Tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), "beam search"),
    "logits_processors": (([],), "custom logits processors"),
    "documents": (([],), "documents for a retrieval template"),
    "kv_transfer_params": (({},), "disaggregated prefill's KV transfer"),
    "guided_decoding_backend": (("xgrammar", "auto"), "a structured-output backend other "
                                                      "than the server's, xgrammar"),
}


# OpenAI's fields that take null for their default ("integer or null, defaults to 1"), as
# vLLM's do too: its SDK sends a None given for one as null.
NULL_MEANS_DEFAULT = ("n", "stream", "presence_penalty", "frequency_penalty", "logprobs",
                      "echo")


class SamplingRequest(RequestBody):
    """Fields that completions and chat completions share, vLLM's extras included."""

    model_config = ConfigDict(extra="allow")  # unknown fields: kept aside, logged
    # What `unsupported` refuses (each endpoint adds those of its own).
    UNSERVED: ClassVar[Dict[str, Tuple[Tuple[Any, ...], str]]] = UNSERVED_VLLM_FIELDS

    @model_validator(mode="before")
    @classmethod
    def _nulls_as_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {key: value for key, value in data.items()
                if value is not None or key not in NULL_MEANS_DEFAULT}

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Optional[Union[str, List[str]]] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[Dict[str, float]] = None
    # vLLM's extra sampling parameters.
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: Optional[List[int]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's: logprobs name their tokens "token_id:N", for clients that need the exact ids
    # (several tokens may decode to the same text).
    return_tokens_as_token_ids: bool = False
    # vLLM's: the prompt's and each choice's token ids in the response.
    return_token_ids: bool = False
    priority: int = 0
    # vLLM's: the response's id is "cmpl-"/"chatcmpl-" and this (an X-Request-Id header wins).
    request_id: Optional[str] = None
    cache_salt: Optional[str] = None  # vLLM's: prefix-cache blocks are shared within a salt
    # fulcrum's latency targets for this request (milliseconds); the slo policy meets them.
    slo_ttft_ms: Optional[float] = None
    slo_tpot_ms: Optional[float] = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* fields (at most one of them).
    response_format: Optional[Dict[str, Any]] = None
    structured_outputs: Optional[Dict[str, Any]] = None
    guided_json: Optional[Union[str, Dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[List[str]] = None
    guided_grammar: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None
    # vLLM's token-level controls and prompt handling (see SamplingParams).
    allowed_token_ids: Optional[List[int]] = None
    bad_words: Optional[List[str]] = None
    prompt_logprobs: Optional[int] = None
    truncate_prompt_tokens: Optional[int] = None

    def unsupported(self) -> Optional[Tuple[str, str]]:
        """(field, why) when this request cannot be served as asked."""
        for name, (neutral, what) in self.UNSERVED.items():
            value = (self.model_extra or {}).get(name)
            if value is not None and value not in neutral:
                return name, (f"{name} is not supported ({what}): refused rather than "
                              "answered without it")
        if self.guided_whitespace_pattern is not None:
            return "guided_whitespace_pattern", ("guided_whitespace_pattern is not supported; "
                                                 "structured_outputs.disable_any_whitespace is")
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        return None

    def token_logit_bias(self) -> Optional[Dict[int, float]]:
        """logit_bias with its keys (token ids as JSON strings, in OpenAI's form) as ints."""
        if not self.logit_bias:
            return None
        biases = {}
        for token, value in self.logit_bias.items():
            # ASCII digits only: int() also takes "²", "①" or "1_0", and fails on 4,300 digits.
            digits = token[1:] if token.startswith("-") else token
            if not (digits.isascii() and digits.isdigit()) or len(digits) > 18:
                raise ParamError("logit_bias",
                                 f"logit_bias keys must be token ids, got {token[:40]!r}")
            biases[int(token)] = value
        return biases

    def structured_output_params(self) -> Optional[StructuredOutputsParams]:
        """The output constraint from whichever of response_format, structured_outputs and
        guided_* the request set; ValueError if it set several or one is malformed."""
        given = {}
        # OpenAI's response_format must name its type ({} is a 400 there and in vLLM).
        form = {"type": "text"} if self.response_format is None else self.response_format
        kind = form.get("type")
        if kind == "json_object":
            given["response_format"] = {"json_object": True}
        elif kind == "json_schema":
            spec = form.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise ParamError("response_format", "response_format of type 'json_schema' "
                                 "needs json_schema.schema")
            given["response_format"] = {"json": spec["schema"]}
        elif kind != "text":
            raise ParamError("response_format", "response_format type must be 'text', "
                             f"'json_object' or 'json_schema', got {kind!r}")
        if self.structured_outputs is not None:
            given["structured_outputs"] = self.structured_outputs
        for name, field in GUIDED_FIELDS.items():
            if getattr(self, name) is not None:
                given[name] = {field: getattr(self, name)}
        if len(given) > 1:
            raise ParamError(list(given)[1], "at most one output constraint per request; got "
                             f"{', '.join(given)}")
        if not given:
            return None
        (name, fields), = given.items()
        try:
            return StructuredOutputsParams(**fields)
        except TypeError:
            known = ", ".join(StructuredOutputsParams.__dataclass_fields__)
            raise ParamError(name, f"{name} takes only {known}; got "
                             f"{', '.join(fields)}") from None
        except ValueError as error:
            raise ParamError(name, f"{name}: {error}") from None

    def ignored_fields(self) -> List[str]:
        """Unknown fields the request carried (logged by the server, as vLLM does)."""
        return sorted(self.model_extra or {})

    def to_sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int],
                           defaults: Optional[Dict[str, Any]] = None) -> SamplingParams:
        """SamplingParams for this request; fields it leaves unset take `defaults` (the
        model's generation config). Raises ValueError on out-of-range values."""
        defaults = defaults or {}
        optional = {name: getattr(self, name) if getattr(self, name) is not None
                    else defaults.get(name) for name in DEFAULTABLE}
        optional.update(slo_ttft_ms=self.slo_ttft_ms, slo_tpot_ms=self.slo_tpot_ms)
        return SamplingParams(
            n=self.n, seed=self.seed, stop=self.stop, max_tokens=max_tokens,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            stop_token_ids=self.stop_token_ids, logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.structured_output_params(),
            logit_bias=self.token_logit_bias(), allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words, prompt_logprobs=self.prompt_logprobs,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            **{k: v for k, v in optional.items() if v is not None})

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk: asked with include_usage, as vLLM reads the two."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


PromptInput = Union[str, List[str], List[int], List[List[int]]]


class CompletionRequest(SamplingRequest):
    UNSERVED = {**UNSERVED_VLLM_FIELDS, "prompt_embeds": ((), "prompts given as embeddings")}

    prompt: PromptInput
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    add_special_tokens: bool = True

    def unsupported(self) -> Optional[Tuple[str, str]]:
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of must equal n (fulcrum does not rank candidates)"
        if self.echo and self.logprobs is not None and self.prompt_logprobs is not None \
                and self.prompt_logprobs != self.logprobs:
            return "prompt_logprobs", "with echo and logprobs, prompt_logprobs must equal logprobs"
        return super().unsupported()

    def prompts(self) -> List[Union[str, List[int]]]:
        """The prompt field as a list of prompts, each a string or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(t, int) for t in prompt):
            return [prompt]
        if not prompt:
            raise ValueError("prompt must not be empty")
        if len(prompt) > MAX_PROMPTS_PER_REQUEST:
            raise ValueError(f"prompt holds {len(prompt)} prompts, more than the "
                             f"{MAX_PROMPTS_PER_REQUEST} one request may carry")
        return list(prompt)


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class _Conversation(BaseModel):
    """A body with chat messages: their number is checked before each message is."""

    @model_validator(mode="before")
    @classmethod
    def _bounded(cls, data: Any) -> Any:
        if isinstance(data, dict):
            check_conversation_size(data.get("messages"))
        return data


class ChatCompletionRequest(SamplingRequest, _Conversation):
    UNSERVED = {**UNSERVED_VLLM_FIELDS, "structural_tag": ((), "structural tags")}

    messages: List[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(default=None, ge=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0)
    add_generation_prompt: bool = True
    # vLLM's and HF's: the last message stays open, and the answer continues it.
    continue_final_message: bool = False
    echo: bool = False  # vLLM's: the answer starts with the last message it continues
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    # vLLM's: the tokenizer's special tokens (a BOS) added to the rendered text too; off, as
    # the template writes its own.
    add_special_tokens: bool = False
    tools: Optional[List[ToolDefinition]] = Field(default=None, max_length=1024)
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None  # OpenAI's: False allows one call a turn
    # vLLM's: false drops a reasoning model's thinking (with --reasoning-parser) from the
    # answer, and the logprobs and token ids that would spell it out.
    include_reasoning: bool = True

    @property
    def tool_dicts(self) -> Optional[List[Dict[str, Any]]]:
        """The tools as the chat template (and the tool-call code) see them."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @property
    def tool_mode(self) -> Optional[str]:
        """None (no tool calls to look for), "auto", "required" or "named". With tools and
        no tool_choice, "auto" (as in vLLM and OpenAI)."""
        choice = self.tool_choice if self.tool_choice is not None else (
            "auto" if self.tools else "none")
        if choice == "none":
            return None
        return "named" if isinstance(choice, NamedToolChoice) else choice

    @property
    def forced_function(self) -> Optional[str]:
        """What tool_choice forces: "required", a function's name, or None."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return "required" if self.tool_choice == "required" else None

    @property
    def max_output_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    @property
    def num_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def echo_text(self) -> str:
        """What `echo` puts before the answer: the last message's text where the answer
        continues it (vLLM's rule: its role is the assistant's, or no generation prompt
        starts a new message)."""
        last = self.messages[-1]
        if not self.echo or (self.add_generation_prompt and last.role != "assistant"):
            return ""
        return last.template_dict()["content"]

    def unsupported(self) -> Optional[Tuple[str, str]]:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs set to true"
        if self.stream and self.prompt_logprobs is not None:  # vLLM's refusal too
            return "prompt_logprobs", ("prompt_logprobs are not available when stream is "
                                       "true: a chat stream's chunks have no field for them")
        if self.tool_choice not in (None, "none") and not self.tools:
            return "tool_choice", "tool_choice needs tools"
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name \
                not in {t.function.name for t in self.tools}:
            return "tool_choice", (f"tool_choice names the function "
                                   f"{self.tool_choice.function.name!r}, which is not in tools")
        return super().unsupported()


class TokenizeRequest(RequestBody, _Conversation):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[List[ChatMessage]] = None
    tools: Optional[List[ToolDefinition]] = None
    # None: vLLM's defaults, the tokenizer's special tokens for a prompt and none for
    # messages (as chat completions tokenize them: the template writes its own).
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # With messages, as chat completions take them (a template only where trusted).
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    return_token_strs: bool = False  # vLLM's: each token's string too, in token_strs


class DetokenizeRequest(RequestBody):
    model: Optional[str] = None
    tokens: List[int]
    # vLLM's /detokenize is tokenizer.decode(ids): special tokens kept. True drops them.
    skip_special_tokens: bool = False


# ------------------------------------------------------------------ responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens read from the prefix cache, not computed


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions format."""

    text_offset: List[int] = Field(default_factory=list)
    token_logprobs: List[Optional[float]] = Field(default_factory=list)
    tokens: List[str] = Field(default_factory=list)
    top_logprobs: List[Optional[Dict[str, float]]] = Field(default_factory=list)


def _now() -> int:
    return int(time.time())


class _Choice(BaseModel):
    """What every choice carries: its place and why it ended."""

    index: int
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None  # vLLM's: the stop string or token that ended it
    token_ids: Optional[List[int]] = None  # with return_token_ids (in a stream: the new ones)


class _Response(BaseModel):
    """What every completion response and stream chunk carries besides its choices."""

    id: str
    created: int = Field(default_factory=_now)
    model: str
    usage: Optional[UsageInfo] = None


class PromptLogprob(BaseModel):
    logprob: float
    rank: int
    decoded_token: Optional[str] = None


# vLLM's prompt_logprobs: per prompt token (the first has none), token id -> its logprob.
PromptLogprobs = List[Optional[Dict[int, PromptLogprob]]]


class CompletionChoice(_Choice):
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    prompt_logprobs: Optional[PromptLogprobs] = None
    prompt_token_ids: Optional[List[int]] = None  # with return_token_ids (a stream's first)


class CompletionResponse(_Response):
    """A whole completion, and also each chunk of a streamed one (as in OpenAI's API)."""

    object: Literal["text_completion"] = "text_completion"
    choices: List[CompletionChoice]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[List[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: List[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: List[TokenLogprob] = Field(default_factory=list)


class _WithReasoning(BaseModel):
    """With --reasoning-parser, the model's thinking: `reasoning` (vLLM's field) and
    `reasoning_content` (its older name, which clients still read); left out where none."""

    @model_serializer(mode="wrap")
    def _reasoning_where_given(self, handler: Callable[[Any], Dict[str, Any]]) -> Dict[str, Any]:
        fields = handler(self)
        if self.reasoning is None:
            fields.pop("reasoning", None)
            fields.pop("reasoning_content", None)
        return fields


class ChatResponseMessage(_WithReasoning):
    role: str = "assistant"
    content: Optional[str] = None
    reasoning: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: List[ToolCallMessage] = Field(default_factory=list)


class _WithoutNones(BaseModel):
    """Sent without its unset fields: OpenAI's SDK merges a streamed call's pieces field by
    field, and a later piece's `"type": null` overwrote the first's "function" (its stream
    helper then failed); vLLM leaves them out too."""

    @model_serializer(mode="wrap")
    def _without_nones(self, handler: Callable[[Any], Dict[str, Any]]) -> Dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaFunctionCall(_WithoutNones):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(_WithoutNones):
    """A piece of a streamed call: the first carries its id and name, later ones arguments."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunctionCall] = None


class DeltaMessage(_WithReasoning):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[List[DeltaToolCall]] = None


class _ChatChoice(_Choice):
    logprobs: Optional[ChatLogprobs] = None


class ChatChoice(_ChatChoice):
    message: ChatResponseMessage


class ChatStreamChoice(_ChatChoice):
    delta: DeltaMessage


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: List[ChatChoice]
    prompt_logprobs: Optional[PromptLogprobs] = None
    prompt_token_ids: Optional[List[int]] = None  # with return_token_ids


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: List[ChatStreamChoice]
    prompt_token_ids: Optional[List[int]] = None  # with return_token_ids, on the first chunk


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "fulcrum"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: List[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: List[int]
    token_strs: Optional[List[str]] = None  # with return_token_strs


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo

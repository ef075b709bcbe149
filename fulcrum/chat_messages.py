"""Chat messages and tool definitions in OpenAI's form, checked alike for the server's
requests and `LLM.chat`'s conversations, and turned into what chat templates read."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Literal, Mapping, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fulcrum.chat_template import template_message


# The most messages, and content parts and tool calls in all, one conversation may have:
# each is checked and converted in Python, on the server's event loop (300,000 parts held
# every client up for 2.5 s); no real conversation comes near.
MAX_MESSAGES = 10_000
MAX_CONTENT_PARTS = 10_000


def check_conversation_size(messages: Any) -> None:
    """Refuse a conversation too large to check, before any message of it is checked."""
    if not isinstance(messages, (list, tuple)):
        return
    if len(messages) > MAX_MESSAGES:
        raise ValueError(f"messages holds {len(messages):,} messages, more than the "
                         f"{MAX_MESSAGES:,} allowed")
    parts = sum(len(m[key]) for m in messages if isinstance(m, dict)
                for key in ("content", "tool_calls") if isinstance(m.get(key), (list, tuple)))
    if parts > MAX_CONTENT_PARTS:
        raise ValueError(f"messages hold {parts:,} content parts and tool calls in all, more "
                         f"than the {MAX_CONTENT_PARTS:,} allowed")


class ContentPart(BaseModel):
    """A part of a message's content; fulcrum's models read text parts only. OpenAI's refusal
    part (an assistant's, in the history) is its refusal's text, as vLLM reads it."""

    type: str
    text: Optional[str] = None

    @model_validator(mode="before")
    @classmethod
    def _refusal_as_text(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") == "refusal":
            if not isinstance(data.get("refusal"), str):
                raise ValueError("a refusal content part needs 'refusal', a string")
            return {"type": "text", "text": data["refusal"]}
        return data

    @model_validator(mode="after")
    def _text_only(self) -> "ContentPart":
        if self.type != "text":
            raise ValueError(f"content parts of type {self.type!r} are not supported: this is "
                             "a text-only model")
        if self.text is None:
            raise ValueError("a text content part needs 'text'")
        return self


class FunctionCall(BaseModel):
    name: str
    # A JSON object's text, as OpenAI sends it; or the object (as transformers' and vLLM's
    # LLM.chat take a conversation's calls).
    arguments: Union[str, Dict[str, Any]]


class ToolCallMessage(BaseModel):
    """A call in an assistant message of the history (its id may be left out, as
    transformers' tool-use examples do), or of a response."""

    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    """Keys OpenAI's schema does not name reach the template too (transformers'
    get_json_schema puts a documented return value in "return", which Hermes' template
    prints), as vLLM passes them."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatMessage(BaseModel):
    # OpenAI's roles, or any other a template knows (Llama 3's "ipython", Mistral's
    # "tool_results"): vLLM passes any role through, and a template that has no use for it
    # says so (its raise_exception: a 400).
    role: str = Field(min_length=1, max_length=64)
    content: Union[str, List[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[List[ToolCallMessage]] = None  # assistant: the calls it made
    tool_call_id: Optional[str] = None  # tool: the call this message answers
    # assistant: its reasoning, which templates that keep past reasoning (Qwen3) show
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None

    @model_validator(mode="after")
    def _has_content(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and not (self.tool_call_id or self.name):
            raise ValueError("a tool message needs tool_call_id (or the name of the function "
                             "it answers)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def template_dict(self, content_format: str = "string") -> Dict[str, Any]:
        """The message as the chat template sees it, its content in the template's format
        (`chat_template.message_content`: text parts joined one a line, or a list of parts)."""
        content = self.content
        if isinstance(content, list):
            content = [part.model_dump(exclude_none=True) for part in content]
        message: Dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {**({"id": c.id} if c.id is not None else {}), "type": c.type, "function": {
                    "name": c.function.name, "arguments": c.function.arguments}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        for name in ("reasoning_content", "reasoning"):
            if getattr(self, name) is not None:
                message[name] = getattr(self, name)
        return template_message(message, content_format)


# The names pydantic gives a union's members in an error's location ("content.str"): no
# field of a request is named so, and they say nothing to a client.
_UNION_MEMBERS = ("str", "int", "float", "bool", "dict", "list", "none")


def validation_message(problems: Iterable[Dict[str, Any]]) -> str:
    """pydantic's problems, one a line naming the field, as OpenAI's 400 messages do."""
    parts = []
    for problem in problems:
        location = ".".join(str(p) for p in problem.get("loc", ()) if p != "body" and not (
            isinstance(p, str) and ("[" in p or p in _UNION_MEMBERS)))
        message = str(problem.get("msg"))[:500]  # pydantic may quote the whole bad value
        parts.append(f"{location}: {message}" if location else message)
    return "; ".join(parts[:20]) or "invalid request"


def _checked(model: type, value: Any, where: str) -> BaseModel:
    try:
        return model.model_validate(value)
    except ValidationError as error:
        problems = [{**p, "loc": (where, *p.get("loc", ()))} for p in error.errors()]
        raise ValueError(validation_message(problems)) from None


def template_conversation(messages: Sequence[Any], content_format: str) -> List[Dict[str, Any]]:
    """A conversation of message dicts, checked as the server checks a request's messages,
    as the chat template reads it (content in its `content_format`). Keys OpenAI's messages
    do not have (transformers' `thinking`, a template's own) reach the template as given."""
    check_conversation_size(messages)
    return [_template_message(message, f"messages.{i}", content_format)
            for i, message in enumerate(messages)]


def _template_message(message: Any, where: str, content_format: str) -> Dict[str, Any]:
    checked = _checked(ChatMessage, message, where).template_dict(content_format)
    if not isinstance(message, Mapping):  # a ChatMessage itself
        return checked
    return {**{key: value for key, value in message.items()
               if key not in ChatMessage.model_fields}, **checked}


def template_tools(tools: Optional[Sequence[Any]]) -> Optional[List[Dict[str, Any]]]:
    """Tool definitions checked as the server checks them, as the chat template reads them."""
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise TypeError(f"tools must be a list of tool definitions, got {type(tools).__name__}")
    return [_checked(ToolDefinition, tool, f"tools.{i}").model_dump(exclude_none=True)
            for i, tool in enumerate(tools)] or None

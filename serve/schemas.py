"""OpenAI request bodies (pydantic, strict): the JSON types of the API, never coerced.

A field takes its JSON type only: `"stream": "yes"` or `"max_tokens": "5"` is a 400, not a guess.
Integers follow JSON Schema (as OpenAI's API does): 3 and 3.0 are integers, 3.5 is not. A number
field takes any JSON number. An optional field takes `null` for "not given" (its default), as in
OpenAI's API. Unknown fields are ignored, as OpenAI's API does.

Messages are checked by role as OpenAI checks them: system, developer and user messages need
`content` (a string or a non-empty array of text parts); an assistant message needs `content`
unless it has `tool_calls`; a tool message needs `content` and `tool_call_id`; any other role is a
400 on `messages.N.role`.

Every union here picks its member from the value's JSON type (a callable `Discriminator`), so an
error names the one problem of the member that applies rather than one per member; the members'
tags are written `<name>`, and serve/errors.py leaves them out of the field path it reports.

Only the shape and the API's own bounds are checked here; the sampling values are validated once
more by `SamplingParams`, whose ValueError names the field. Responses are plain dicts built in
`serve/responses.py`. The JSON Schemas of these models are the app's /openapi.json
(serve/openapi.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema

from jaxinfer.sampling_params import DEFAULT_MAX_TOKENS

MAX_TOP_LOGPROBS = 20
MAX_N = 128  # choices per prompt (OpenAI's bound); prompts x n is bounded by max_waiting too
MAX_BEST_OF = 20  # OpenAI's bound; best_of must equal n here (no re-ranking)
MAX_STOP_STRINGS = 16  # OpenAI allows 4; each one is searched in every streamed step
MAX_STOP_TOKEN_IDS = 1024
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
ROLES = ("system", "developer", "user", "assistant", "tool")


def is_union_tag(part: Any) -> bool:
    """Whether a part of a pydantic error's location is one of this module's union tags."""
    return isinstance(part, str) and part.startswith("<") and part.endswith(">")


def _whole_number(value: Any) -> Any:
    """JSON Schema's integer: a float with no fractional part is one (1.0 -> 1)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def integer(**bounds: int) -> Any:
    """A JSON Schema integer within `bounds` (Field's ge, le): 3 and 3.0 are integers, 3.5 or
    "3" is not. The bounds sit on the integer itself, so the JSON Schema says minimum/maximum."""
    return Annotated[int, Field(**bounds), BeforeValidator(_whole_number)]


TokenId = integer(ge=0)
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


def _tagged_union(choose: Callable[[Any], str | None], expected: str, **members: Any) -> Any:
    """A union of `members` (tag -> type) whose member is the one `choose(value)` names (None:
    no member fits, the error says `expected`)."""
    def tag(value: Any) -> str | None:
        name = choose(value)
        return None if name is None else f"<{name}>"

    tagged = tuple(Annotated[t, Tag(f"<{name}>")] for name, t in members.items())
    return Annotated[Union[tagged], Discriminator(  # noqa: UP007 - a tuple of members
        tag, custom_error_type="invalid_type", custom_error_message=f"expected {expected}")]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _prompt_form(value: Any) -> str | None:
    if isinstance(value, str):
        return "text"
    if not isinstance(value, list):
        return None
    first = value[0] if value else ""
    if isinstance(first, str):
        return "texts"
    if _is_number(first):
        return "ids"
    return "id_lists" if isinstance(first, list) else None


def _str_or_list(value: Any) -> str | None:
    if isinstance(value, str):
        return "text"
    return "list" if isinstance(value, list) else None


CompletionPrompt = _tagged_union(
    _prompt_form, "a string, an array of strings, an array of token ids or an array of arrays "
                  "of token ids",
    text=str, texts=Annotated[list[str], Field(min_length=1)], ids=TokenIds,
    id_lists=Annotated[list[TokenIds], Field(min_length=1)])
Stop = _tagged_union(_str_or_list, "a string or an array of strings", text=str,
                     list=Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)])


def _str_or_object(value: Any) -> str | None:
    if isinstance(value, str):
        return "text"
    return "object" if isinstance(value, dict) else None


ToolChoice = _tagged_union(_str_or_object, "a string or an object", text=str,
                           object=dict[str, Any])


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """`null` for an optional field means "not given": the field's default."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if v is not None or k not in fields or fields[k].is_required()}


class ModelRequest(_Body):
    """A request body; `model`, when given, must be the served model's name."""

    model: str | None = None


# -- chat messages --------------------------------------------------------------------------------
class TextPart(_Body):
    type: Literal["text"]
    text: str


Content = _tagged_union(_str_or_list, "a string or an array of content parts", text=str,
                        list=Annotated[list[TextPart], Field(min_length=1)])


class _Message(_Body):
    name: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined); "" when there is none."""
        content = getattr(self, "content", None)
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        return "".join(part.text for part in content)

    def template_message(self) -> dict:
        """The message as the chat template takes it (content as one string)."""
        message = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        return message


class SystemMessage(_Message):
    role: Literal["system"]
    content: Content


class DeveloperMessage(_Message):
    role: Literal["developer"]
    content: Content


class UserMessage(_Message):
    role: Literal["user"]
    content: Content


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(_Message):
    role: Literal["assistant"]
    tool_calls: Annotated[list[ToolCall], Field(min_length=1)] | None = None
    content: Content | None = Field(None, validate_default=True)

    @field_validator("content")
    @classmethod
    def _content_or_tool_calls(cls, v, info: ValidationInfo):
        if v is None and not info.data.get("tool_calls"):
            raise ValueError("an assistant message needs content unless it has tool_calls")
        return v

    def template_message(self) -> dict:
        message = super().template_message()
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return message


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: str

    def template_message(self) -> dict:
        return {**super().template_message(), "tool_call_id": self.tool_call_id}


class _UnknownRole(_Body):
    """What a message whose role is none of ROLES is checked against: the error names `role`."""

    role: Literal[ROLES]  # never matches (the discriminator sends only other roles here)


def _message_kind(value: Any) -> str | None:
    if isinstance(value, _Message):
        return value.role
    if not isinstance(value, dict):
        return None
    role = value.get("role")
    return role if isinstance(role, str) and role in ROLES else "unknown_role"


ChatMessage = _tagged_union(
    _message_kind, "a message object", system=SystemMessage, developer=DeveloperMessage,
    user=UserMessage, assistant=AssistantMessage, tool=ToolMessage,
    unknown_role=SkipJsonSchema[_UnknownRole])
Message = SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage


# -- generation requests --------------------------------------------------------------------------
class StreamOptions(_Body):
    include_usage: bool | None = False


class SamplingFields(ModelRequest):
    """The fields completions and chat share."""

    n: integer(ge=1, le=MAX_N) | None = 1
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: integer(ge=INT64_MIN, le=INT64_MAX) | None = None
    stop: Stop | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # extensions (vLLM's names)
    top_k: integer(ge=-1, le=INT32_MAX) | None = None  # >= vocab size: off
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: integer(ge=0, le=INT32_MAX) | None = None
    ignore_eos: bool | None = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    priority: integer(ge=INT64_MIN, le=INT64_MAX) | None = 0  # lower runs first ("priority")
    # OpenAI's: "flex" runs in the background, yielding to the other requests (batch lines do)
    service_tier: Literal["auto", "default", "flex"] | None = None
    spec_decode: bool | None = None  # speculative decoding for this request (None: engine default)
    # output constraints (serve/structured.py checks them): OpenAI's, and vLLM's extension
    response_format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema"}
    structured_outputs: dict[str, Any] | None = None  # {"json" | "regex" | "choice" | "grammar"}

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v):
        if v == "" or (isinstance(v, list) and any(s == "" for s in v)):
            raise ValueError("stop strings must not be empty")
        return v


class CompletionRequest(SamplingFields):
    prompt: CompletionPrompt
    max_tokens: integer(ge=1) | None = DEFAULT_MAX_TOKENS
    logprobs: integer(ge=0, le=MAX_TOP_LOGPROBS) | None = None
    echo: bool | None = False
    best_of: integer(ge=1, le=MAX_BEST_OF) | None = None
    suffix: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: integer(ge=1) | None = None  # None: up to the context, as OpenAI's chat
    max_completion_tokens: integer(ge=1) | None = None
    logprobs: bool | None = False
    top_logprobs: integer(ge=0, le=MAX_TOP_LOGPROBS) | None = None
    add_generation_prompt: bool | None = True  # extension: False continues the last assistant message
    tools: list[dict[str, Any]] | None = None  # {"type": "function", "function": {...}} (serve/tools.py)
    tool_choice: ToolChoice | None = None  # "none" | "auto" | "required" | a named function


class TokenizeRequest(ModelRequest):
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_generation_prompt: bool | None = True


class DetokenizeRequest(ModelRequest):
    tokens: list[TokenId]

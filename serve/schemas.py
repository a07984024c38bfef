"""OpenAI request bodies (pydantic). Unknown fields are ignored, as the OpenAI API does.

Only the shape and the API's own bounds are checked here; the sampling values are validated once
more by `SamplingParams`, whose ValueError names the field. Responses are plain dicts built in
`serve/responses.py`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

from jaxinfer.sampling_params import DEFAULT_MAX_TOKENS

MAX_TOP_LOGPROBS = 20
MAX_N = 128
MAX_STOP_STRINGS = 16  # OpenAI allows 4; each one is searched in every streamed step

TokenIds = Annotated[list[StrictInt], Field(min_length=1)]
# Order matters: pydantic tries the union members left to right in smart mode on exact type match.
CompletionPrompt = Union[StrictStr, Annotated[list[StrictStr], Field(min_length=1)], TokenIds,
               Annotated[list[TokenIds], Field(min_length=1)]]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ModelRequest(_Body):
    """A request body; `model`, when given, must be the served model's name."""

    model: str | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(ModelRequest):
    """The fields completions and chat share."""

    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # extensions (vLLM's names)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)  # >= vocab size: off
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: int | None = Field(None, ge=0, le=2**31 - 1)
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[int], Field(max_length=1024)] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0  # lower runs first under the engine's "priority" policy
    spec_decode: bool | None = None  # speculative decoding for this request (None: engine default)

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v):
        if isinstance(v, list) and any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        return v


class CompletionRequest(SamplingFields):
    prompt: CompletionPrompt
    max_tokens: int | None = Field(DEFAULT_MAX_TOKENS, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined); other part types are refused."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"content part of type {part.get('type')!r} is not supported; "
                                 "only text parts are")
            texts.append(part["text"])
        return "".join(texts)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1)  # None: up to the context, as OpenAI's chat
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True  # extension: False continues the last assistant message


class TokenizeRequest(ModelRequest):
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(ModelRequest):
    tokens: list[StrictInt]

"""OpenAI wire format: request bodies (validated by pydantic), response bodies, error bodies."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tidal.sampling_params import InvalidParameter, SamplingParams


class _Strict(BaseModel):
    """No coercion: `true` is not 1 and "5" is not 5 (ints still pass where floats are asked)."""

    model_config = ConfigDict(strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    """The knobs both endpoints share. Unknown fields are ignored, as OpenAI's own server does."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, description="tidal/vLLM extension; -1 disables")
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, description="tidal/vLLM extension")
    ignore_eos: bool = Field(default=False, description="tidal/vLLM extension")
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None

    def check_supported(self) -> None:
        """Reject what the engine cannot do rather than silently ignore it."""
        if self.n != 1:
            raise InvalidParameter("n", f"only n=1 is supported, got {self.n}")
        if self.logprobs:
            raise InvalidParameter("logprobs", "logprobs are not supported")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise InvalidParameter(name, "penalties are not supported")
        if self.stream_options is not None and not self.stream:
            raise InvalidParameter("stream_options", "is only allowed when stream is true")

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """SamplingParams validates the values; its InvalidParameter becomes a 400."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            # a top_k past any vocabulary keeps every token; as given it could overflow int64
            top_k=-1 if self.top_k is None or self.top_k >= 2**31 else self.top_k,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions. One prompt: a string or a list of token ids (or a list of one)."""

    prompt: (Annotated[str, Field(min_length=1)] | TokenIds
             | Annotated[list[str], Field(min_length=1, max_length=1)]
             | Annotated[list[TokenIds], Field(min_length=1, max_length=1)])
    max_tokens: int | None = 16
    echo: bool = False

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_message_for_the_union(cls, value, handler):
        try:
            return handler(value)
        except ValidationError:  # pydantic would list one complaint per union member
            raise ValueError("must be a non-empty string, a non-empty list of token ids (integers "
                             ">= 0), or a list holding exactly one of those") from None
    suffix: str | None = None

    def single_prompt(self) -> str | list[int]:
        p = self.prompt  # validated: a list of prompts holds exactly one
        if isinstance(p, list) and isinstance(p[0], (str, list)):
            p = p[0]
        if self.echo:
            raise InvalidParameter("echo", "echo is not supported")
        if self.suffix:
            raise InvalidParameter("suffix", "suffix is not supported")
        return p


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        """The message's text; content parts of type text are joined, others are refused."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidParameter("messages", "only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None

    def conversation(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ------------------------------------------------------------------ responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tidal"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())

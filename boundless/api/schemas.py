"""Request bodies of the OpenAI-compatible routes, with the extensions vLLM accepts and Autellix's program ids."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator


def _require_int(v: Any) -> Any:
    # pydantic would accept 5.0 or "5"; OpenAI does not.
    if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
        raise ValueError("must be an integer")
    return v


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by chat and completions; unknown fields are accepted and ignored, as OpenAI does."""

    model_config = ConfigDict(extra="allow")

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Autellix program identity (also accepted as X-Program-Id / X-Thread-Id headers)
    program_id: str | None = None
    thread_id: str | None = None
    parent_thread_ids: list[str] | None = None

    @field_validator("max_tokens", "n", "seed", "top_k", "min_tokens", mode="before")
    @classmethod
    def _strict_int(cls, v: Any) -> Any:
        return _require_int(v)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    @field_validator("max_completion_tokens", "top_logprobs", mode="before")
    @classmethod
    def _strict_int_chat(cls, v: Any) -> Any:
        return _require_int(v)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    return_token_ids: bool = False  # extension (as vLLM): each choice carries its prompt and output token ids

    @field_validator("logprobs", mode="before")
    @classmethod
    def _strict_int_logprobs(cls, v: Any) -> Any:
        return _require_int(v)


ROLES = ("system", "developer", "user", "assistant", "tool")


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]


def message_text(content: str | list[dict[str, Any]] | None) -> str:
    """The text of a message whose content may be a list of parts (only text parts are supported)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.get("type") != "text":
            raise ValueError(f"content parts of type {part.get('type')!r} are not supported")
        texts.append(part.get("text", ""))
    return "".join(texts)

"""Anthropic's Messages API (``POST /v1/messages``), as vLLM serves it: over the chat route.

Agents written for Anthropic's API (Claude Code and its kin) speak it. A request is read into a chat request
(:func:`chat_fields`): the system prompt, user turns of text blocks, ``tool_result`` blocks as tool messages (a failed
one's, ``is_error``, after ``Error: ``), assistant turns of text and ``tool_use`` blocks as tool calls, ``tools`` with
their ``input_schema``, ``tool_choice`` (``auto``, ``any`` = ``required``, ``tool``, ``none``,
``disable_parallel_tool_use``), ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, ``max_tokens``, and the
chat route's own fields given beside them (vLLM's extensions, such as ``structured_outputs``). A last assistant turn
is a prefill the answer continues (Anthropic's rule: ``continue_final_message``). The chat route then does everything
it does for its own requests (template, program scheduling, tool-call parsing, the reasoning parser, structured calls,
errors), and its answer is written back in Anthropic's shapes: content blocks (``thinking`` with a reasoning parser,
``text``, ``tool_use``), its ``stop_reason`` (``end_turn``, ``max_tokens``, ``stop_sequence``, ``tool_use``), and
usage with the prompt's cached tokens as ``cache_read_input_tokens``; streamed, Anthropic's events
(:class:`EventWriter`). Errors are Anthropic's objects, ``{"type": "error", "error": {"type", "message"}}``, with the
status the chat route gives.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal

import pydantic_core
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from boundless.api.agent_sessions import claude_code_session
from boundless.api.chunk_json import sse_json
from boundless.api.errors import APIError, anthropic_error, part_error
from boundless.api.json_text import UNREADABLE_JSON
from boundless.api.schemas import (
    TEXT_PART_SEPARATOR,
    Bool,
    ChatCompletionRequest,
    Count,
    Float,
    Identifier,
    Int,
    NullIsDefault,
)
from boundless.api.server import ChatStream, guarded_stream, off_loop_if_large
from boundless.api.validation import require_valid_text
from boundless.engine.errors import ContextOverflow, InvalidRequestError

routes = APIRouter()

_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
# What a tool result marked ``is_error`` begins with: chat templates have no field for a failed call (vLLM drops the
# mark), so the model is told in the result's text.
TOOL_ERROR_PREFIX = "Error: "


class AnthropicTool(BaseModel):
    """A custom tool (a function the client runs, with its ``input_schema``). Anthropic's server tools (web search,
    code execution...) and its schema-less client tools (bash, the text editor, computer use) are refused by type:
    nothing here runs them, nor knows their schemas."""

    model_config = ConfigDict(extra="allow")

    type: str | None = None  # (first: its error is the one a server tool's 400 names, not its missing input_schema)
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    strict: Bool | None = None  # Anthropic's strict tool use: calls held to input_schema (api/strict_calls.py)

    @field_validator("type")
    @classmethod
    def _custom(cls, kind: str | None) -> str | None:
        if kind not in (None, "custom"):
            raise ValueError(f"tools of type {kind!r} (Anthropic's server tools) are not supported; only custom tools")
        return kind


class AnthropicToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: Bool = False


class AnthropicMessage(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class TextBlock(BaseModel):
    type: Literal["text"]
    text: str


class MessagesRequest(NullIsDefault):
    """A ``POST /v1/messages`` body: Anthropic's fields, and the program identity of the OpenAI routes."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: Count
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: Float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: Float | None = None
    top_k: Int | None = None
    stream: Bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    program_id: Identifier | None = None
    thread_id: Identifier | None = None


def _text_of(content: Any, where: str) -> str:
    """A block list's (or a string's) text: its text blocks joined as chat's parts are (a tool result's content, as
    vLLM joins it)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: expected a string or a list of text blocks", where)
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise APIError(400, f"{where}.{j}: only text blocks are supported here", f"{where}.{j}")
        texts.append(block["text"])
    return TEXT_PART_SEPARATOR.join(texts)


def chat_messages(body: MessagesRequest) -> list[dict[str, Any]]:
    """The conversation as the chat route's messages (OpenAI's shapes)."""
    out: list[dict[str, Any]] = []
    if body.system:
        # (A system prompt's blocks are joined with nothing between, as vLLM joins them, unlike a turn's parts.)
        system = body.system if isinstance(body.system, str) else "".join(b.text for b in body.system)
        out.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        blocks = [{"type": "text", "text": message.content}] if isinstance(message.content, str) else message.content
        texts: list[dict[str, str]] = []
        calls: list[dict[str, Any]] = []
        thoughts: list[str] = []
        for j, block in enumerate(blocks):
            where = f"messages.{i}.content.{j}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append({"type": "text", "text": block["text"]})
            elif kind == "tool_result" and message.role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise APIError(400, f"{where}: a tool_result block needs its tool_use_id, a string", where)
                text = _text_of(block.get("content", ""), f"{where}.content")
                failed = block.get("is_error")
                if failed not in (None, True, False):
                    raise APIError(400, f"{where}.is_error must be a boolean", f"{where}.is_error")
                if failed:
                    text = TOOL_ERROR_PREFIX + text
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
            elif kind == "tool_use" and message.role == "assistant":
                if not isinstance(block.get("name"), str) or not isinstance(block.get("id"), str):
                    raise APIError(400, f"{where}: a tool_use block needs its id and name", where)
                if not isinstance(block.get("input"), dict):
                    raise APIError(400, f"{where}: a tool_use block needs its input, an object", f"{where}.input")
                arguments = json.dumps(block["input"], ensure_ascii=False)
                function = {"name": block["name"], "arguments": arguments}
                calls.append({"id": block["id"], "type": "function", "function": function})
            elif kind == "thinking" and message.role == "assistant":
                # (An earlier turn's thinking, as the chat route's reasoning_content: the template decides; most drop
                # it from the history, gpt-oss's keeps the thinking before a call.)
                if isinstance(block.get("thinking"), str) and block["thinking"]:
                    thoughts.append(block["thinking"])
            elif kind == "redacted_thinking" and message.role == "assistant":
                continue  # (encrypted by another server: nothing this model reads)
            else:
                raise APIError(400, f"{where}: a {message.role} turn cannot hold a block of type {kind!r}", where)
        if message.role == "user":
            if texts:
                out.append({"role": "user", "content": texts})
        else:
            turn: dict[str, Any] = {"role": "assistant", "content": texts or None}  # (joined as a user's are)
            if calls:
                turn["tool_calls"] = calls
            if thoughts:
                turn["reasoning_content"] = "\n".join(thoughts)
            out.append(turn)
    return out


def chat_fields(body: MessagesRequest, reasons: bool) -> dict[str, Any]:
    """The chat request that does what ``body`` asks (``reasons``: the server has a reasoning parser)."""
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": chat_messages(body),
        "max_tokens": body.max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "stop": body.stop_sequences,
        "stream": body.stream,
        "stream_options": {"include_usage": True} if body.stream else None,
        "program_id": body.program_id,
        "thread_id": body.thread_id,
    }
    if body.metadata and isinstance(body.metadata.get("user_id"), str):
        fields["user"] = body.metadata["user_id"]
        # Claude Code's session, below an explicit program_id or X-Program-Id (api/agent_sessions.py)
        if (session := claude_code_session(body.metadata["user_id"])) is not None:
            fields["prompt_cache_key"] = session
    if body.messages[-1].role == "assistant":  # a prefill: the answer goes on from it
        fields.update(add_generation_prompt=False, continue_final_message=True)
    if body.tools:
        fields["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.input_schema,
                    "strict": t.strict,
                },
            }
            for t in body.tools
        ]
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise APIError(400, "tool_choice: a choice of type tool names the tool", "tool_choice.name")
        named = {"type": "function", "function": {"name": choice.name}}
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type, named)
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    # The chat route's own fields given beside Anthropic's (vLLM's extensions: structured_outputs, seed, min_p,
    # priority, cache_salt, chat_template_kwargs...), where the request has not set them above.
    for key, value in (body.model_extra or {}).items():
        if key in ChatCompletionRequest.model_fields and key not in fields:
            fields[key] = value
    if fields.get("n") not in (None, 1):  # (streamed, several choices' deltas would run into the same blocks)
        raise APIError(400, "n: a message is one answer (Anthropic's API has no n)", "n")
    if body.thinking is not None:
        # Enabled on a model that does not think (no --reasoning-parser): served without thinking blocks, as agents
        # written for Anthropic's models send it whatever model they are pointed at.
        kind = body.thinking.get("type")
        if kind == "disabled" and reasons:
            # (Qwen3's switch, beside the request's own chat_template_kwargs; others' templates ignore it)
            fields["chat_template_kwargs"] = {**(fields.get("chat_template_kwargs") or {}), "enable_thinking": False}
        elif kind not in ("enabled", "disabled", "adaptive"):  # (adaptive: the model decides how long, as enabled)
            raise APIError(400, "thinking.type must be enabled, adaptive or disabled", "thinking.type")
        budget = body.thinking.get("budget_tokens")
        if kind == "enabled" and budget is not None:
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
                raise APIError(400, "thinking.budget_tokens must be a positive integer", "thinking.budget_tokens")
            if budget >= body.max_tokens:  # (Anthropic's rule: the thinking is part of the max_tokens)
                raise APIError(400, "thinking.budget_tokens must be less than max_tokens", "thinking.budget_tokens")
            if reasons:  # the thinking closed after that many tokens (engine/thinking_budget.py)
                fields.setdefault("thinking_token_budget", budget)
    return fields


def _usage(usage: dict[str, Any] | None) -> dict[str, int]:
    """Anthropic's usage from the chat's: input tokens less those read from the prefix cache, which it counts apart."""
    usage = usage or {}
    prompt = usage.get("prompt_tokens", 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": prompt - cached,
        "output_tokens": usage.get("completion_tokens", 0),
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def stop_of(finish: str | None, stop: str | int | None) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` from a chat choice's finish and vLLM's ``stop_reason``."""
    if finish == "stop" and isinstance(stop, str):
        return "stop_sequence", stop
    return _STOP_REASONS.get(finish or "", "end_turn"), None


def _tool_input(arguments: str, cut: bool = False) -> dict[str, Any]:
    """A call's arguments (JSON text) as Anthropic's ``input`` object (text that is no JSON object: under ``{}``'s
    place, kept whole as the model wrote it, so nothing is lost). ``cut``: the output ended at ``max_tokens``, its
    last call's arguments so far: read as partial JSON, as Anthropic's client reads the streamed ``input_json_delta``s
    (jiter's partial mode: an unfinished string, number or literal is left out), so both say the same."""
    try:
        value = json.loads(arguments)
    except UNREADABLE_JSON:
        if cut:
            try:
                partial = pydantic_core.from_json(arguments, allow_partial=True) if arguments.strip() else {}
            except ValueError:
                partial = None
            if isinstance(partial, dict):
                return partial
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def message_of(chat: dict[str, Any], model: str) -> dict[str, Any]:
    """An unstreamed chat completion as Anthropic's message."""
    choice = chat["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("reasoning"):
        content.append({"type": "thinking", "thinking": message["reasoning"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        function = call["function"]
        tool_input = _tool_input(function["arguments"], choice["finish_reason"] == "length")
        content.append({"type": "tool_use", "id": call["id"], "name": function["name"], "input": tool_input})
    stop_reason, stop_sequence = stop_of(choice["finish_reason"], choice.get("stop_reason"))
    return {
        "id": "msg_" + chat["id"].removeprefix("chatcmpl-"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(chat.get("usage")),
    }


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {sse_json({'type': kind, **data})}\n\n".encode()


class EventWriter:
    """A chat completion's stream (its chunks, read back) as Anthropic's events: ``message_start``; for each content
    block ``content_block_start``, its deltas (``thinking_delta``, ``text_delta``, ``input_json_delta``: a call's
    arguments as the chat streams them) and ``content_block_stop``; ``message_delta`` with the stop reason and the
    usage; ``message_stop``. An error the chat stream ends with is Anthropic's ``error`` event."""

    def __init__(self, model: str, input_tokens: int = 0, cached_tokens: int = 0) -> None:
        self.model = model
        self.input_tokens, self.cached_tokens = input_tokens, cached_tokens  # the prompt's, for message_start
        self.block: str | None = None  # the open block's type
        self.index = -1  # its index
        self.calls: dict[int, int] = {}  # a streamed call's index -> its block's
        self.finish: tuple[str, str | None] = ("end_turn", None)
        self.usage: dict[str, Any] | None = None

    def start(self, chat_id: str) -> bytes:
        message: dict[str, Any] = {
            "id": "msg_" + chat_id.removeprefix("chatcmpl-"),
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(
                {"prompt_tokens": self.input_tokens, "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
            ),
        }
        return _event("message_start", {"message": message})

    def _open(self, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.block = block["type"]
        return [*out, _event("content_block_start", {"index": self.index, "content_block": block})]

    def _close(self) -> list[bytes]:
        if self.block is None:
            return []
        self.block = None
        return [_event("content_block_stop", {"index": self.index})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        """The events of one chat chunk."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out: list[bytes] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                if self.block != "thinking":
                    out += self._open({"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning"]}))
            if delta.get("content"):
                if self.block != "text":
                    out += self._open({"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or ():
                function = call.get("function") or {}
                if call.get("id"):  # a call begins: its block
                    out += self._open({"type": "tool_use", "id": call["id"], "name": function["name"], "input": {}})
                    self.calls[call["index"]] = self.index
                if function.get("arguments") and self.calls.get(call["index"]) == self.index:
                    out.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
            if choice.get("finish_reason"):
                self.finish = stop_of(choice["finish_reason"], choice.get("stop_reason"))
        return out

    def end(self) -> list[bytes]:
        reason, sequence = self.finish
        return [
            *self._close(),
            _event(
                "message_delta",
                {"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": _usage(self.usage)},
            ),
            _event("message_stop", {}),
        ]

    async def events(self, chunks: AsyncIterator[bytes | str]) -> AsyncIterator[bytes]:
        """Anthropic's events from the chat stream's server-sent events."""
        started = False
        async for piece in chunks:
            text = piece.decode() if isinstance(piece, bytes) else piece
            for line in text.split("\n"):  # (not splitlines(): it splits too at U+2028 or U+0085 inside JSON text)
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:  # the chat stream's failure: Anthropic's error event, and no more
                    error = chunk["error"]
                    status = {"server_shutting_down": 503, "kv_capacity_unavailable": 503}.get(error.get("code"), 500)
                    yield _event("error", anthropic_error(status, error.get("message", "error")))
                    return
                if not started:
                    started = True
                    yield self.start(chunk["id"])
                for event in self.chunk(chunk):
                    yield event
        for event in self.end():
            yield event


async def _json_object(request: Request) -> dict[str, Any]:
    """The request's body, a JSON object: read here, not by FastAPI, whose refusal of a body that is no JSON is the
    app's own error (OpenAI's shape), raised before the route could answer in Anthropic's. Refused as FastAPI refuses
    it, so the message is the chat route's."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as e:  # (FastAPI's error for it, which the app's handler words)
        raise RequestValidationError(
            [{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error", "ctx": {"error": e.msg}}]
        ) from None
    except UnicodeDecodeError:
        raise APIError(400, "the body is not valid JSON: not UTF-8 text", None, "invalid_value") from None
    except RecursionError:  # (arrays or objects nested thousands deep: past the parser's stack, a 500 it was)
        raise APIError(400, "the body is not valid JSON: it nests too deep", None, "invalid_value") from None
    except ValueError:  # (a number of more digits than int() takes)
        raise APIError(400, "the body is not valid JSON: a number too long", None, "invalid_value") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", None, "invalid_value")
    return body


@routes.post("/v1/messages")
async def create_message(request: Request) -> Response:
    server = request.app.state.server
    body: dict[str, Any] = {}
    try:
        body = await _json_object(request)
        asked = MessagesRequest.model_validate(body)
        chat = ChatCompletionRequest.model_validate(chat_fields(asked, server.reasoning is not None))
        answer = await server.chat(chat, request)
    except Exception as e:
        return await _anthropic_error(request, body, e)
    if isinstance(answer, ChatStream):  # (message_start counts the prompt, as Anthropic's does)
        writer = EventWriter(asked.model, answer.prompt_tokens, answer.cached_tokens)
        events = guarded_stream(
            writer.events(answer.chunks), lambda message: _event("error", anthropic_error(500, message))
        )
        return StreamingResponse(events, media_type="text/event-stream")
    return JSONResponse(message_of(json.loads(answer.body), asked.model))


@routes.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    """Anthropic's token count of a request's prompt (the one ``/v1/messages`` would run), ``{"input_tokens": n}``."""
    server = request.app.state.server
    body: dict[str, Any] = {}
    try:
        body = await _json_object(request)
        asked = MessagesRequest.model_validate({"max_tokens": 1, **body})
        server.check_model(asked.model)
        chat = ChatCompletionRequest.model_validate(chat_fields(asked, server.reasoning is not None))
        require_valid_text(chat.model_dump(by_alias=True))  # (as the Messages route's: a lone surrogate was a 500)
        prompt = await off_loop_if_large(request, server.chat_prompt, chat)
    except Exception as e:
        return await _anthropic_error(request, body, e)
    return JSONResponse({"input_tokens": len(prompt)})


def overflow_message(overflow: ContextOverflow) -> str:
    """Anthropic's words for a request past the context: Claude Code reads "prompt is too long" as the cue to compact
    its conversation."""
    o = overflow
    if o.prompt_tokens > o.max_model_len or o.max_tokens is None:
        return f"prompt is too long: {o.prompt_tokens} tokens > {o.max_model_len} maximum"
    return (
        f"input length and `max_tokens` exceed context limit: {o.prompt_tokens} + {o.max_tokens} > {o.max_model_len}, "
        "decrease input length or `max_tokens` and try again"
    )


async def _anthropic_error(request: Request, body: dict[str, Any], error: Exception) -> JSONResponse:
    """The app's answer to ``error`` (its exception handlers': the status, message and ``Retry-After`` every route
    gives), in Anthropic's shape; a body that does not validate (Anthropic's fields, or the chat request they make) is
    a 400 naming the field. An error the app has no answer for is raised again (its 500)."""
    if isinstance(error, ValidationError):
        error = part_error(error, "body", body)
    if isinstance(error, InvalidRequestError) and error.overflow is not None:
        return JSONResponse(anthropic_error(400, overflow_message(error.overflow)), status_code=400)
    for kind in type(error).__mro__:
        handler = request.app.exception_handlers.get(kind)
        if handler is not None and kind is not Exception:
            response = await handler(request, error)
            message = json.loads(response.body)["error"]["message"].removeprefix("body.").removeprefix("body: ")
            headers = {k: v for k, v in response.headers.items() if k.lower() == "retry-after"}
            status = response.status_code
            return JSONResponse(anthropic_error(status, message), status_code=status, headers=headers)
    raise error

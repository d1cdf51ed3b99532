"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``, ``GET
/v1/responses/{id}/input_items``.

A response runs as a chat completion does (the same chat template, tool-call parser, grammars and sampling): its
``input`` (a string, or items: messages, function calls and their outputs), after ``instructions`` and the
conversation of its ``previous_response_id`` chain, becomes the chat's messages; its output is a message and/or
function calls. Responses are kept (``store``, the default) in a bounded in-memory :class:`ResponseStore` for their
chain's next response and for ``GET``; a server restart forgets them, as it forgets everything else.

A chain of responses is an agent program: each response is one call of the program named by the chain's first
response (unless the client names one, ``program_id`` or ``X-Program-Id``), so the scheduler's program-level
policies (PLAS, ATLAS) and locality routing see an agent that only chains ``previous_response_id``.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from boundless.api.agent_sessions import program_named
from boundless.api.chunk_json import sse_json
from boundless.api.errors import APIError, part_error
from boundless.api.json_text import UNREADABLE_JSON
from boundless.api.reasoning import ReasoningOutput
from boundless.api.schemas import (
    REASONING_EFFORTS,
    TEXT_PART_SEPARATOR,
    Bool,
    ChatCompletionRequest,
    Count,
    Float,
    FunctionName,
    Identifier,
    Int,
    NullIsDefault,
    ParentThreads,
    StructuredOutputsParams,
    check_distinct_names,
    object_schema,
)
from boundless.api.server import (
    Choice,
    DeltaStream,
    OpenAIServer,
    ToolUse,
    check_common,
    check_grammar,
    failure_error,
    guarded_stream,
    off_loop_if_large,
    sampling_params,
    structured_outputs_grammar,
)
from boundless.api.tool_calls import ContentStream, ToolCall, parameter_types
from boundless.api.validation import header_identifier, refuse_removed_fields, require_valid_text
from boundless.engine.errors import InvalidRequestError
from boundless.engine.structured_output import StructuredOutput
from boundless.programs.ref import ProgramRef

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# What ``include`` may name (OpenAI's list). Only the logprobs have anything to add here: the others are data of items
# (hosted tools' results, images, encrypted reasoning) no response of this server holds, so they add nothing.
INCLUDABLE = frozenset(
    {
        LOGPROBS_INCLUDE,
        "web_search_call.action.sources",
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
        "file_search_call.results",
        "message.input_image.image_url",
        "reasoning.encrypted_content",
    }
)


# -- the request -----------------------------------------------------------------------------------


class FunctionTool(BaseModel):
    """A function the model may call (the Responses API's flat shape: no nested ``function``)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, parameters: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
        return object_schema(parameters, info)


class TextFormat(BaseModel):
    """``text.format``: free text, any JSON object, or JSON under ``schema``."""

    model_config = ConfigDict(populate_by_name=True, extra="allow")

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, StringConstraints(min_length=1, max_length=64)] | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # (``schema`` is a BaseModel method)
    description: str | None = None
    strict: Bool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a json_schema format needs its name and schema")
        return self


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    format: TextFormat | None = None


class FunctionChoice(BaseModel):
    type: Literal["function"]
    name: str


class ResponsesRequest(NullIsDefault):
    """``POST /v1/responses``; unknown fields are accepted and ignored, as OpenAI does."""

    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[dict[str, Any]]  # items are read by ``conversation``
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None  # function tools only (``function_tools``)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: Bool = True
    max_output_tokens: Count | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    top_logprobs: Annotated[int, Field(ge=0, strict=True)] | None = None
    include: list[str] | None = None
    stream: Bool = False
    store: Bool = True
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    reasoning: dict[str, Any] | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None  # vLLM's (chat's field)
    priority: Int = 0  # vLLM's (chat's field): a class of service, smaller first
    # vLLM's chat extension, here too: output held to a regex, a choice, a grammar or a schema
    structured_outputs: StructuredOutputsParams | None = None
    # Autellix program identity (also accepted as X-Program-Id / X-Thread-Id headers); by default the chain's.
    program_id: Identifier | None = None
    thread_id: Identifier | None = None
    parent_thread_ids: ParentThreads | None = None
    # OpenAI's cache key (Codex sends its conversation's id): the program, unless program_id or X-Program-Id says
    prompt_cache_key: str | None = None  # (one that cannot be a program id is ignored: api/agent_sessions.py)
    # Typed to be refused by name when set (_prepare): no conversations object, no background mode here.
    conversation: str | dict[str, Any] | None = None
    background: Bool = False


def function_tools(tools: list[dict[str, Any]] | None) -> list[FunctionTool]:
    """The request's tools, each a function (the hosted tools, web search and the like, are not served here)."""
    out = []
    for i, tool in enumerate(tools or ()):
        kind = tool.get("type")
        if kind != "function":
            raise APIError(400, f"tools of type {kind!r} are not supported; only function tools", f"tools.{i}.type")
        try:
            out.append(FunctionTool.model_validate(tool))
        except ValidationError as e:
            raise part_error(e, f"tools.{i}", tool) from e
    try:
        check_distinct_names([t.name for t in out])
    except ValueError as e:
        raise APIError(400, f"tools: {e}", "tools", "invalid_value") from e
    return out


def _item_text(content: Any, where: str) -> str:
    """The text of an input message's content: a string, or parts of type input_text or output_text, joined as chat's
    parts are, as vLLM joins a Responses message's (which keeps an assistant message's first part alone: here none is
    dropped)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, "a message's content must be a string or a list of parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
            raise APIError(400, f"content parts of type {kind!r} are not supported; only text", f"{where}.{j}")
        texts.append(part["text"])
    return TEXT_PART_SEPARATOR.join(texts)


def conversation(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages for a response's input: messages as they are, a run of function calls as the ``tool_calls`` of
    the assistant message just before them (one of their own if there is none), each call's output as a ``tool``
    message. An assistant's text and the calls after it are one turn, as a stored response keeps them and as OpenAI's
    and vLLM's conversions read such items (a stateless client, ``store: false``, sends them back so). A ``reasoning``
    item's text (its ``reasoning_text`` content, as this server writes it, else its summary; several in a row joined)
    is the reasoning of the assistant turn after it, or of the one before it that its calls continue (this server's
    answer-first output: a preamble, then the reasoning, then the calls), as ``reasoning_content``, which a chat
    template that keeps the reasoning before a call renders (gpt-oss's); one with nothing but encrypted content adds
    nothing."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise APIError(400, "input must not be empty", "input", "invalid_value")
    messages: list[dict[str, Any]] = []
    thought: str | None = None  # a reasoning item's text, for the assistant turn after it
    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"unknown role {role!r}", f"{where}.role")
            text = _item_text(item.get("content"), f"{where}.content")
            messages.append({"role": "system" if role == "developer" else role, "content": text})
            if role == "assistant" and thought:
                messages[-1]["reasoning_content"] = thought
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(v, str) for v in (call_id, name, arguments)):
                raise APIError(400, "a function_call needs call_id, name and arguments as strings", where)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                if thought and "reasoning_content" not in last:  # (this server's answer-first turn: message, reasoning)
                    last["reasoning_content"] = thought
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                if thought:
                    messages[-1]["reasoning_content"] = thought
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not isinstance(output, str | list):
                raise APIError(400, "a function_call_output needs a call_id string and an output", where)
            text = _item_text(output, f"{where}.output")  # (a string, or text parts)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            said = _reasoning_text(item)
            if said:  # (several in a row are one turn's, joined; an encrypted one adds nothing)
                thought = said if thought is None else TEXT_PART_SEPARATOR.join((thought, said))
            continue
        else:
            raise APIError(400, f"input items of type {kind!r} are not supported", f"{where}.type")
        thought = None  # (a turn after another item has none of its own)
    return messages


def _reasoning_text(item: dict[str, Any]) -> str | None:
    """A reasoning item's text: its ``reasoning_text`` parts, else its ``summary_text`` ones, joined; None without any
    (an encrypted one's)."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if not isinstance(parts, list):
            continue
        of_kind = [p.get("text") for p in parts if isinstance(p, dict) and p.get("type") == kind]
        texts = [text for text in of_kind if isinstance(text, str)]
        if texts:
            return TEXT_PART_SEPARATOR.join(texts)
    return None


def input_items(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's input as ``GET /v1/responses/{id}/input_items`` lists it: items with ids and statuses, a
    message's text as a part (a string input is one user message)."""
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    out = []
    for item in items:
        item = {"type": "message", **item}
        kind = item["type"]
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}.get(kind, "item")
        item.setdefault("id", f"{prefix}_{uuid.uuid4().hex}")
        item.setdefault("status", "completed")
        out.append(item)
    return out


# -- kept responses --------------------------------------------------------------------------------


@dataclass
class StoredResponse:
    """A finished response: its body, and the conversation a response chained to it continues."""

    body: dict[str, Any]
    messages: list[dict[str, Any]]  # without instructions (a chain does not inherit them, as OpenAI's does not)
    program_id: str
    input_items: list[dict[str, Any]] = field(default_factory=list)  # the request's input, as items with ids


class ResponseStore:
    """The last ``capacity`` stored responses, by id (the oldest forgotten first), and those under way that will be
    (``start``): retrieved as ``in_progress`` meanwhile, and deleted for good (a DELETE while one ran was a 404, and
    the response was kept when it finished)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()
        self._running: dict[str, StoredResponse] = {}  # their in_progress bodies
        self._deleted: set[str] = set()  # deleted while under way: not kept when they finish

    def start(self, response_id: str, running: StoredResponse) -> None:
        self._running[response_id] = running

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._running.pop(response_id, None)
        if response_id in self._deleted:
            self._deleted.discard(response_id)
            return
        self._kept[response_id] = stored
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def end(self, response_id: str) -> None:
        """The response is over (kept by ``put``, or failed or cancelled): no longer under way."""
        self._running.pop(response_id, None)
        self._deleted.discard(response_id)

    def get(self, response_id: str) -> StoredResponse | None:
        """A finished response kept here (what ``previous_response_id`` continues)."""
        return self._kept.get(response_id)

    def running(self, response_id: str) -> StoredResponse | None:
        return self._running.get(response_id)

    def delete(self, response_id: str) -> bool:
        if self._running.pop(response_id, None) is not None:
            self._deleted.add(response_id)
            return True
        return self._kept.pop(response_id, None) is not None


def _not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"no response with id {response_id!r} is stored here", param, "response_not_found")


# -- running a response ----------------------------------------------------------------------------


@dataclass
class _Call:
    """A response's request as the chat path runs it."""

    response_id: str
    created_at: int  # Unix seconds, as OpenAI's
    body: ResponsesRequest
    chat: ChatCompletionRequest
    prompt: list[int]
    messages: list[dict[str, Any]]  # the conversation without instructions: what a chained response continues
    program: ProgramRef
    logprobs: bool
    tools: list[FunctionTool]
    tool_use: ToolUse  # whether and how the output is read for function calls
    lora: str | None  # the LoRA adapter ``model`` names
    reasoning: ReasoningOutput | None = None  # how the output's reasoning is read (with --reasoning-parser)

    @functools.cached_property
    def input_items(self) -> list[dict[str, Any]]:
        """The request's input as ``input_items`` lists it, its ids made once (the same while it runs and after)."""
        return input_items(self.body.input)

    @property
    def tools_used(self) -> bool:
        """Whether the output is read for function calls."""
        return self.tool_use.used

    @property
    def message_id(self) -> str:
        return f"msg_{self.response_id.removeprefix('resp_')}"

    @property
    def reasoning_id(self) -> str:
        return f"rs_{self.response_id.removeprefix('resp_')}"


class ResponsesAPI:
    """The Responses routes over one :class:`~boundless.api.server.OpenAIServer` (its engine, template and
    chat machinery) and a store of finished responses."""

    def __init__(self, server: OpenAIServer, store: ResponseStore) -> None:
        self.server = server
        self.store = store

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        server = self.server
        call = await off_loop_if_large(request, self._prepare, body, request)
        chat = call.chat
        check_common(chat, server.tokenizer.vocab_size, server.client.max_logprobs)
        tools = [t.model_dump(exclude_none=True) for t in chat.tools or ()]
        logprobs = (body.top_logprobs or 0) if call.logprobs else None
        try:
            wanted = _structured(body, tools, server) or server.strict_calls(
                tools, body.tool_choice, body.parallel_tool_calls
            )
            structured = server.after_reasoning(wanted, call.prompt)
            params = sampling_params(
                chat,
                chat.max_completion_tokens,
                logprobs,
                structured,
                lora=call.lora,
                defaults=server.defaults,
                room=server.client.max_model_len - len(call.prompt),
            )
            await check_grammar(params, server.tokenizer.vocab_size)
            streams = await server.submit(call.response_id, [call.prompt], params, call.program)
        except InvalidRequestError as e:  # name the field the client used for the limit
            renamed = {"max_tokens": "max_output_tokens", "prompt": "input"}.get(e.param or "")
            if renamed is not None:
                raise e.renamed(renamed) from e
            raise
        if body.store:
            running = self._envelope(call, "in_progress", [])
            self.store.start(call.response_id, StoredResponse(running, [], call.program.program_id, call.input_items))
        events = None
        try:
            if body.stream:
                replayed = await server.started(streams, request)
                events = self._guarded_events(call, replayed)
                # Ended by its events (their last, or its client gone), or, never read (a client gone before it
                # began), once it is let go.
                weakref.finalize(events, self.store.end, call.response_id)
                return StreamingResponse(events, media_type="text/event-stream")
            (choice,) = await server.collect(streams, request)
            return JSONResponse(self._finished(call, choice))
        finally:
            if events is None:  # (answered, refused or failed before a stream began: no longer under way)
                self.store.end(call.response_id)

    def _prepare(self, body: ResponsesRequest, request: Request) -> _Call:
        server = self.server
        require_valid_text(body.model_dump(by_alias=True))
        refuse_removed_fields(body.model_extra)
        lora = server.check_model(body.model)
        if body.conversation is not None:
            raise APIError(
                400,
                "conversation is not supported: this server keeps no conversations (chain previous_response_id)",
                "conversation",
                "unsupported_parameter",
            )
        if body.background:
            raise APIError(
                400,
                "background is not supported: a response runs while its request waits",
                "background",
                "unsupported_parameter",
            )
        effort = (body.reasoning or {}).get("effort")
        if effort is not None and server.reasoning is None:
            raise APIError(400, f"{server.model_name} does not reason: reasoning.effort is not supported", "reasoning")
        if effort is not None and effort not in REASONING_EFFORTS:
            raise APIError(400, f"reasoning.effort must be one of {', '.join(REASONING_EFFORTS)}", "reasoning.effort")
        unknown = [x for x in body.include or () if x not in INCLUDABLE]
        if unknown:
            raise APIError(400, f"include {unknown[0]!r} is not supported", "include")
        tools = function_tools(body.tools)
        if isinstance(body.tool_choice, FunctionChoice) and body.tool_choice.name not in {t.name for t in tools}:
            raise APIError(400, f"tool_choice names {body.tool_choice.name!r}, not among the tools", "tool_choice")
        if body.tool_choice == "required" and not tools:
            raise APIError(400, "a tool_choice that forces a call needs tools", "tool_choice", "invalid_value")
        previous = None
        if body.previous_response_id is not None:
            previous = self.store.get(body.previous_response_id)
            if previous is None and self.store.running(body.previous_response_id) is not None:
                raise APIError(
                    400,
                    f"the response {body.previous_response_id!r} is still in progress; continue it once it has ended",
                    "previous_response_id",
                    "invalid_value",
                )
            if previous is None:
                raise _not_found(body.previous_response_id, "previous_response_id")
        messages = (previous.messages if previous else []) + conversation(body.input)
        _require_calls_of_outputs(messages)
        if not messages and not body.instructions:  # (the chat route's refusal named messages, no field here)
            raise APIError(400, "input holds no message the model reads (a reasoning item alone is none)", "input")
        instructions = [{"role": "system", "content": body.instructions}] if body.instructions else []
        response_id = f"resp_{uuid.uuid4().hex}"
        program_id = program_named(body.program_id, request.headers, body.prompt_cache_key) or (
            previous.program_id if previous else response_id
        )
        thread_id = body.thread_id or header_identifier(request.headers, "X-Thread-Id")
        logprobs = LOGPROBS_INCLUDE in (body.include or ()) or body.top_logprobs is not None
        chat_tools = [{"type": "function", "function": t.model_dump(include=_CHAT_TOOL_FIELDS)} for t in tools]

        def chat_of(turns: list[dict[str, Any]]) -> ChatCompletionRequest:
            try:
                return ChatCompletionRequest.model_validate(
                    {
                        "model": body.model,
                        "messages": instructions + turns,
                        "max_completion_tokens": body.max_output_tokens,
                        "temperature": body.temperature,
                        "top_p": body.top_p,
                        "tools": chat_tools or None,
                        "tool_choice": _chat_tool_choice(body.tool_choice),
                        "parallel_tool_calls": body.parallel_tool_calls,
                        "logprobs": logprobs,
                        "top_logprobs": body.top_logprobs if logprobs else None,
                        "user": body.user,
                        "cache_salt": body.cache_salt,
                        "priority": body.priority,
                        "reasoning_effort": effort,
                        "structured_outputs": body.structured_outputs,
                        "stream": body.stream,  # (whether its text comes as it is made, or at the end)
                    }
                )
            except ValidationError as e:  # (what was read above has the chat's shapes; a last guard)
                raise APIError(400, f"input: {e.errors()[0]['msg']}", "input") from e

        chat = chat_of(messages)
        prompt = server.chat_prompt(chat)
        if body.truncation == "auto" and not self._fits(prompt, body):
            chat, prompt = self._truncated(messages, chat_of, body)
        tool_use = ToolUse(
            bool(tools) and body.tool_choice != "none",
            body.parallel_tool_calls,
            parameter_types(chat_tools),
            server.call_formats(_forces_call(body)),
            _forces_call(body),  # (as chat's: a forced call cut off by the limit is a call, as far as it got)
        )
        return _Call(
            response_id,
            int(time.time()),
            body,
            chat,
            prompt,
            messages,
            ProgramRef(program_id, thread_id, tuple(body.parent_thread_ids or ())),
            logprobs,
            tools,
            tool_use,
            lora,
            server.reasoning_output(prompt, tool_use),
        )

    def _fits(self, prompt: list[int], body: ResponsesRequest) -> bool:
        return len(prompt) + (body.max_output_tokens or 1) <= self.server.client.max_model_len

    def _truncated(
        self,
        messages: list[dict[str, Any]],
        chat_of: Callable[[list[dict[str, Any]]], ChatCompletionRequest],
        body: ResponsesRequest,
    ) -> tuple[ChatCompletionRequest, list[int]]:
        """``truncation: "auto"``: the conversation without its oldest turns, as few dropped as fit the context
        (it starts at a user message, so no tool output loses its call); the instructions stay. Left as it is
        when even the last turn alone does not fit (the engine's 400 says by how much)."""
        starts = [i for i, m in enumerate(messages) if i > 0 and m["role"] == "user"]
        lo, hi = 0, len(starts)  # the fewest cuts that fit are among starts[lo:hi]; hi: none found yet
        best: tuple[ChatCompletionRequest, list[int]] | None = None
        while lo < hi:
            mid = (lo + hi) // 2
            chat = chat_of(messages[starts[mid] :])
            prompt = self.server.chat_prompt(chat)
            if self._fits(prompt, body):
                best, hi = (chat, prompt), mid
            else:
                lo = mid + 1
        if best is None:
            chat = chat_of(messages)
            return chat, self.server.chat_prompt(chat)
        return best

    # -- what a response says --------------------------------------------------------------------

    def _envelope(self, call: _Call, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        body = call.body
        fmt = body.text.format if body.text is not None else None
        choice = body.tool_choice
        return {
            "id": call.response_id,
            "object": "response",
            "created_at": call.created_at,
            "status": status,
            "model": body.model,
            "output": output,
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "metadata": body.metadata or {},
            "temperature": body.temperature,
            "top_p": body.top_p,
            "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id,
            "parallel_tool_calls": body.parallel_tool_calls,
            "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice) else (choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in call.tools],
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "truncation": body.truncation or "disabled",
            "store": body.store,
            "user": body.user,
            "usage": None,
        }

    def _message_item(self, call: _Call, choice: Choice, text: str, status: str) -> dict[str, Any]:
        """The message item; its logprobs are those of its text's tokens, as chat's message lists them (not the
        reasoning's or the function calls')."""
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        if call.logprobs:
            server = self.server
            skip = call.chat.skip_special_tokens
            tokens = server.message_logprobs(choice, call.prompt, skip, call.tool_use, call.reasoning)
            part["logprobs"] = server.chat_logprobs(tokens)
        return {**_message_without_content(call, status), "content": [part]}

    @staticmethod
    def _reasoning_item(call: _Call, text: str, status: str) -> dict[str, Any]:
        part = {"type": "reasoning_text", "text": text}
        return {"type": "reasoning", "id": call.reasoning_id, "summary": [], "content": [part], "status": status}

    def _finished(
        self,
        call: _Call,
        choice: Choice,
        streamed: tuple[str, list[ToolCall]] | None = None,
        answer_first: bool | None = None,
    ) -> dict[str, Any]:
        """The response's final body: the reasoning (with a reasoning parser, when there is any), a message (unless
        the output is calls alone, or reasoning cut off), then each call; stored unless ``store`` is false.
        ``streamed``: the content and calls as a stream read them (its content keeps blanks that begin text a call
        follows, which the unstreamed one strips: they went out before the call was known). ``answer_first``: the
        message comes before the reasoning, as a stream opened them (harmony's answer may begin before its reasoning:
        a preamble, then analysis); None: as the output wrote them."""
        content: str | None = choice.text
        thought: str | None = None
        thought_tokens = 0
        if call.reasoning is not None:
            split = call.reasoning.split(choice.text)
            thought, content = split.reasoning, split.content or ""
            thought_tokens = self.server.reasoning_tokens(call.reasoning, choice.token_ids)
        calls: list[ToolCall] = []
        if streamed is not None:
            content, calls = streamed
        elif call.tools_used:
            # (Calls cut off by max_output_tokens come as far as they got, as the chat route has them.)
            content, calls, _ = call.tool_use.read(content or "", at_length=choice.finish_reason == "length")
        # OpenAI's rule: a response that reached max_output_tokens is incomplete, whatever it holds.
        incomplete = choice.finish_reason == "length"
        # The reasoning is whole once the answer began (a stream has said so by then); cut off only inside it.
        thought_cut = incomplete and call.reasoning is not None and call.reasoning.ended_in_reasoning(choice.text)
        items = [self._reasoning_item(call, thought, _status(thought_cut))] if thought else []
        if content or not (calls or thought):  # (its text is what was cut off unless calls followed it)
            message = self._message_item(call, choice, content or "", _status(incomplete and not calls))
            if answer_first is None:
                answer_first = call.reasoning is not None and call.reasoning.answers_first(choice.text)
            if answer_first:
                items.insert(0, message)
            else:
                items.append(message)
        items += [_function_call_item(c, incomplete) for c in calls]
        out = self._envelope(call, _status(incomplete), items)
        if incomplete:
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        out["usage"] = {
            "input_tokens": len(call.prompt),
            "input_tokens_details": {"cached_tokens": choice.cached_tokens},
            "output_tokens": len(choice.token_ids),
            "output_tokens_details": {"reasoning_tokens": thought_tokens},
            "total_tokens": len(call.prompt) + len(choice.token_ids),
        }
        if call.body.store:
            said: dict[str, Any] = {"role": "assistant", "content": content or ""}
            if thought:
                said["reasoning_content"] = thought  # (a template that keeps earlier reasoning renders it)
            if calls:
                said["tool_calls"] = [c.to_openai() for c in calls]
            stored = StoredResponse(out, [*call.messages, said], call.program.program_id, call.input_items)
            self.store.put(call.response_id, stored)
        return out

    async def _guarded_events(self, call: _Call, streams: Sequence[DeltaStream]) -> AsyncIterator[bytes]:
        """:meth:`_events`, ended by OpenAI's ``error`` event if making them raised (not a cut connection)."""
        sent = 0  # (events so far: the error's sequence number follows theirs)

        async def counted() -> AsyncIterator[bytes]:
            nonlocal sent
            async for piece in self._events(call, streams):
                sent += piece.count(b"event: ")
                yield piece

        def failure(message: str) -> bytes:
            payload = {"type": "error", "code": "server_error", "message": message, "param": None}
            return f"event: error\ndata: {json.dumps({**payload, 'sequence_number': sent})}\n\n".encode()

        try:
            async for piece in guarded_stream(counted(), failure):
                yield piece
        finally:  # (ended, failed, or its client gone)
            self.store.end(call.response_id)

    async def _events(self, call: _Call, streams: Sequence[DeltaStream]) -> AsyncIterator[bytes]:
        """The response as server-sent events, in OpenAI's order. With a reasoning parser, the reasoning streams first
        as it is written (a ``reasoning`` item at output 0, its ``reasoning_text`` deltas), closed when the answer
        begins. Text streams as it comes, unless the output is read for function calls: then, as chat's does, it
        comes whole when the output ends."""
        server = self.server
        sequence = 0

        def event(kind: str, **fields: Any) -> bytes:
            nonlocal sequence
            payload = {"type": kind, "sequence_number": sequence, **fields}
            sequence += 1
            return f"event: {kind}\ndata: {sse_json(payload)}\n\n".encode()

        yield event("response.created", response=self._envelope(call, "in_progress", []))
        yield event("response.in_progress", response=self._envelope(call, "in_progress", []))
        choice = Choice(0)
        # Read for function calls, the text streams until a call may have begun (ContentStream), as chat's does.
        content = ContentStream(call.tool_use.formats) if call.tools_used else None
        thoughts = call.reasoning.stream() if call.reasoning is not None else None
        thought_at = {"item_id": call.reasoning_id, "output_index": 0, "content_index": 0}  # (1 after the message)
        thought, thought_closed = "", False
        message_index = 0  # 1 once a reasoning item came first
        # The reasoning is whole once the answer begins, but harmony's, whose analysis may follow a preamble: its item
        # closes at the end.
        closes_early = call.reasoning is None or not call.reasoning.parser.interleaves

        def close_thought(item: dict[str, Any]) -> Iterator[bytes]:
            nonlocal thought_closed
            thought_closed = True
            part = item["content"][0]
            yield event("response.reasoning_text.done", **thought_at, text=part["text"])
            yield event("response.content_part.done", **thought_at, part=part)
            yield event("response.output_item.done", output_index=thought_at["output_index"], item=item)

        # The message's logprobs go with its text, as chat's do: those of its content's tokens alone.
        tracked = None
        if call.logprobs:
            tracked = server.streamed_content(call.prompt, call.chat.skip_special_tokens, call.tool_use, call.reasoning)
        sent, sent_logprobs, opened = "", 0, False
        async for _, delta in server.merged(streams):
            server.apply_delta(choice, delta)
            if tracked is not None:
                tracked.add(delta.new_logprobs)
            answer, new_answer = choice.text, delta.new_text
            if thoughts is not None:
                new_thought, new_answer = thoughts.feed(choice.text, final=delta.finished)
                answer = thoughts.content
                if new_thought:
                    if not thought:  # the reasoning item opens with its first text, after the message if that opened
                        thought_at["output_index"], message_index = (1, 0) if opened else (0, 1)
                        item = self._reasoning_item(call, "", "in_progress")
                        added = {**item, "content": []}
                        yield event("response.output_item.added", output_index=thought_at["output_index"], item=added)
                        yield event("response.content_part.added", **thought_at, part=item["content"][0])
                    yield event("response.reasoning_text.delta", **thought_at, delta=new_thought)
                    thought += new_thought
            piece = new_answer if content is None else ("" if delta.finished else content.feed(answer))
            if not piece:
                continue
            if thought and not thought_closed and closes_early:  # the answer begins: the reasoning is whole
                for chunk in close_thought(self._reasoning_item(call, thought, "completed")):
                    yield chunk
            at = {"item_id": call.message_id, "output_index": message_index, "content_index": 0}
            if not opened:  # the message item opens with its first text
                opened = True
                item = _message_without_content(call, "in_progress")
                yield event("response.output_item.added", output_index=message_index, item=item)
                yield event("response.content_part.added", **at, part=_EMPTY_TEXT)
            new_logprobs = []
            if tracked is not None:
                begun = answer if thoughts is None or answer else None
                sent_so_far = None if content is None else content.sent  # (None: the answer all goes out as it comes)
                stretches = thoughts.stretches if thoughts is not None and begun is not None else None
                new_logprobs = server.chat_logprobs(tracked.release(choice.text, begun, sent_so_far, stretches))
            yield event("response.output_text.delta", **at, delta=piece, logprobs=new_logprobs)
            sent, sent_logprobs = sent + piece, sent_logprobs + len(new_logprobs)
        if choice.finish_reason == "error":
            # The items opened are closed as far as they got (incomplete), and the failed response holds them: a
            # client that built its output from the events has what the response says it had.
            output: list[dict[str, Any]] = []
            if thought:
                reasoning = self._reasoning_item(call, thought, "completed" if thought_closed else "incomplete")
                if not thought_closed:
                    for chunk in close_thought(reasoning):
                        yield chunk
                output.append(reasoning)
            if opened:
                at = {"item_id": call.message_id, "output_index": message_index, "content_index": 0}
                part = {**_EMPTY_TEXT, "text": sent}
                message = {**_message_without_content(call, "incomplete"), "content": [part]}
                yield event("response.output_text.done", **at, text=sent, logprobs=[])
                yield event("response.content_part.done", **at, part=part)
                yield event("response.output_item.done", output_index=message_index, item=message)
                output.insert(message_index, message)  # (before the reasoning, where it came first)
            failed = self._envelope(call, "failed", output)
            error = failure_error([(choice.finish_reason, choice.stop_reason)])
            assert error is not None
            failed["error"] = {"code": error.code or "server_error", "message": error.message}
            yield event("response.failed", response=failed)
            return
        answer = thoughts.content if thoughts is not None else choice.text
        at_length = choice.finish_reason == "length"
        rest, calls = call.tool_use.finish(content, answer, at_length) if content is not None else ("", [])
        # (The message first where it opened before any reasoning did, as the stream has numbered them.)
        answer_first = opened and (not thought or thought_at["output_index"] == 1)
        final = self._finished(call, choice, (sent + rest, calls) if content is not None else None, answer_first)
        for index, item in enumerate(final["output"]):
            if item["type"] == "reasoning":
                if not thought_closed:
                    for chunk in close_thought(item):
                        yield chunk
                continue
            if item["type"] == "message":
                part = item["content"][0]
                at = {"item_id": item["id"], "output_index": index, "content_index": 0}
                logprobs = part.get("logprobs", [])
                if not opened:
                    added = {**item, "content": [], "status": "in_progress"}
                    yield event("response.output_item.added", output_index=index, item=added)
                    yield event("response.content_part.added", **at, part=_EMPTY_TEXT)
                # What the deltas have not carried: the text that came whole at the end, and the logprobs of the tokens
                # whose text had not gone out (the end-of-sequence token's, at least).
                unsent, unsent_logprobs = part["text"][len(sent) :], logprobs[sent_logprobs:]
                if unsent or unsent_logprobs:
                    yield event("response.output_text.delta", **at, delta=unsent, logprobs=unsent_logprobs)
                yield event("response.output_text.done", **at, text=part["text"], logprobs=logprobs)
                yield event("response.content_part.done", **at, part=part)
            else:  # a function call, whole: its arguments are known once the output is parsed
                at = {"item_id": item["id"], "output_index": index}
                added = {**item, "arguments": "", "status": "in_progress"}
                yield event("response.output_item.added", output_index=index, item=added)
                yield event("response.function_call_arguments.delta", **at, delta=item["arguments"])
                yield event(
                    "response.function_call_arguments.done", **at, name=item["name"], arguments=item["arguments"]
                )
            yield event("response.output_item.done", output_index=index, item=item)
        yield event(f"response.{final['status']}", response=final)  # completed, or incomplete


_EMPTY_TEXT = {"type": "output_text", "text": "", "annotations": []}
_CHAT_TOOL_FIELDS = {"name", "description", "parameters", "strict"}


def _message_without_content(call: _Call, status: str) -> dict[str, Any]:
    """The message item with no content yet (as ``response.output_item.added`` opens it)."""
    return {"type": "message", "id": call.message_id, "status": status, "role": "assistant", "content": []}


def _require_calls_of_outputs(messages: list[dict[str, Any]]) -> None:
    """Each ``function_call_output`` answers a call made before it (in the input, or in the response it continues):
    OpenAI refuses one that answers none (a client's call id gone wrong would put a result with no call in the
    prompt)."""
    made: set[str] = set()
    for message in messages:
        made.update(c["id"] for c in message.get("tool_calls") or () if isinstance(c, dict) and "id" in c)
        if message.get("role") == "tool" and message.get("tool_call_id") not in made:
            call_id = message.get("tool_call_id")
            raise APIError(400, f"no function call found for the function_call_output's call_id {call_id!r}", "input")


def _forces_call(body: ResponsesRequest) -> bool:
    """Whether the request's ``tool_choice`` forces a call (``required``, or a named function)."""
    return body.tool_choice == "required" or isinstance(body.tool_choice, FunctionChoice)


def _structured(body: ResponsesRequest, tools: list[dict[str, Any]], server: OpenAIServer) -> StructuredOutput | None:
    """The grammar of ``text.format``, of a ``tool_choice`` that forces a call or of ``structured_outputs`` (one of
    them)."""
    fmt = body.text.format if body.text is not None else None
    wants_json = fmt is not None and fmt.type != "text"
    choice = body.tool_choice
    forced = _forces_call(body)
    if body.structured_outputs is not None:
        if wants_json or forced:
            where = "text.format" if wants_json else "tool_choice"
            raise APIError(400, f"{where} cannot go with structured_outputs", "structured_outputs", "invalid_value")
        return structured_outputs_grammar(body.structured_outputs)
    if forced:
        if wants_json:
            raise APIError(400, "text.format cannot go with a tool_choice that forces a call", "text.format")
        name = choice.name if isinstance(choice, FunctionChoice) else None
        return server.forced_calls(tools, name, body.parallel_tool_calls)
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput("json_object", None, "text.format")
    assert fmt.schema_ is not None
    return StructuredOutput.json_schema(fmt.schema_, "text.format")


def _status(cut: bool) -> str:
    """An item's status: ``incomplete`` where max_output_tokens cut it off."""
    return "incomplete" if cut else "completed"


def _function_call_item(call: ToolCall, at_length: bool = False) -> dict[str, Any]:
    """A call's item; ``at_length``: the output reached max_output_tokens, and a call whose arguments are not whole
    JSON is one it cut off, as far as it got."""
    return {
        "type": "function_call",
        "id": f"fc_{call.id.removeprefix('call_')}",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": _status(at_length and not _whole_json(call.arguments)),
    }


def _whole_json(text: str) -> bool:
    try:
        json.loads(text)
    except UNREADABLE_JSON:
        return False
    return True


def _chat_tool_choice(choice: str | FunctionChoice | None) -> Any:
    if isinstance(choice, FunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


# -- routes ----------------------------------------------------------------------------------------

routes = APIRouter()


def _api(request: Request) -> ResponsesAPI:
    return request.app.state.responses


@routes.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    return await _api(request).create(body, request)


@routes.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> Response:
    store = _api(request).store
    stored = store.get(response_id) or store.running(response_id)  # (under way: its in_progress body)
    if stored is None:
        raise _not_found(response_id)
    return JSONResponse(stored.body)


@routes.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    request: Request,
    limit: int = 20,
    order: str = "desc",
    after: str | None = None,
    before: str | None = None,
) -> Response:
    """The response's input items, a page at a time (OpenAI's cursors: the ``limit`` items ``after`` an item id, or
    those just ``before`` one, the previous page; ``limit`` 1 to 100, newest first unless ``order`` is ``asc``)."""
    store = _api(request).store
    stored = store.get(response_id) or store.running(response_id)
    if stored is None:
        raise _not_found(response_id)
    if not 1 <= limit <= 100:
        raise APIError(400, "limit must be between 1 and 100", "limit", "invalid_value")
    if order not in ("asc", "desc"):
        raise APIError(400, "order must be asc or desc", "order", "invalid_value")
    if after is not None and before is not None:
        raise APIError(400, "give after or before, not both", "before", "invalid_value")
    items = stored.input_items if order == "asc" else stored.input_items[::-1]
    ids = [item["id"] for item in items]
    for name, cursor in (("after", after), ("before", before)):
        if cursor is not None and cursor not in ids:
            raise APIError(400, f"no input item {cursor!r} in this response", name, "invalid_value")
    if before is not None:
        items = items[: ids.index(before)]
        page = items[-limit:]
    else:
        if after is not None:
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    )


@routes.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Response:
    if not _api(request).store.delete(response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

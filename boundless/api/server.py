"""The OpenAI-compatible HTTP server.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /health``, ``GET /version`` and ``GET /metrics``; OpenAI's Responses API (``/v1/responses``) is in
:mod:`boundless.api.responses`. The app talks to an :class:`EngineClient`: one in-process
engine (:class:`~boundless.engine.async_engine.AsyncEngine`) or a cluster router.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import jinja2
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp

from boundless import __version__
from boundless.api.agent_sessions import program_named
from boundless.api.chunk_json import ChunkJSON
from boundless.api.conversation import InvalidMessage, template_conversation
from boundless.api.cors import with_cors
from boundless.api.errors import APIError, CancelledRequests, error_bytes, install_error_handlers
from boundless.api.guards import APIKeyAuth, BodyLimit
from boundless.api.harmony import harmony_turns
from boundless.api.harmony import open_call as harmony_open_call
from boundless.api.json_text import UNREADABLE_JSON
from boundless.api.logprobs import (
    Span,
    StreamedContent,
    StreamedOffsets,
    TokenStarts,
    content_tokens,
    stretch_spans,
    text_offsets,
)
from boundless.api.metrics import ServerMetrics
from boundless.api.reasoning import HARMONY_PARSER as HARMONY_REASONING
from boundless.api.reasoning import ReasoningOutput, ReasoningParser, reasoning_parser_name
from boundless.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormat,
    StructuredOutputsParams,
    template_tools,
)
from boundless.api.server_log import request_line
from boundless.api.strict_calls import forced_calls_tag, strict_call_format, strict_calls_tag, structural_tag_text
from boundless.api.tool_calls import (
    ALL_FORMATS,
    BARE_JSON,
    HARMONY,
    TAGGED_JSON,
    TOOL_CALL_PARSERS,
    TOOL_CALL_TAG,
    CallFormats,
    CallStream,
    ContentStream,
    ParameterTypes,
    ToolCall,
    forced_call_schema,
    keeps_special_tokens,
    parameter_types,
    parse_tool_calls,
    spans_around_calls,
    tagged_blocks,
)
from boundless.api.validation import (
    header_identifier,
    refuse_removed_fields,
    require_shallow_json,
    require_token_ids,
    require_valid_text,
)
from boundless.config import ConfigError, ServerConfig
from boundless.engine.async_engine import SHUTTING_DOWN
from boundless.engine.bad_words import bad_words_token_ids
from boundless.engine.core import GRANT_REFUSED, EngineStats, RequestDelta, require_context_room
from boundless.engine.errors import NO_ROOM_AFTER_FAILOVER, InvalidRequestError
from boundless.engine.logprobs import PromptLogprobs, SampledToken, logprobs_limit
from boundless.engine.sampling_params import RequestOutputKind, SamplingParams, truncated_prompt
from boundless.engine.structured_output import MAX_GRAMMAR_TOOLS, StructuredOutput, check_structured_output
from boundless.engine.thinking_budget import ThinkingBudget
from boundless.model.generation_config import NO_DEFAULTS, SamplingDefaults
from boundless.model.lora import LoRAError, LoRARequest
from boundless.model.pooling import EmbeddingPooling
from boundless.model.token_bytes import TokenBytes
from boundless.model.tokenizer import load_chat_template
from boundless.programs.ref import ProgramRef

T = TypeVar("T")
log = logging.getLogger(__name__)

# What chat_template_kwargs may not set: the arguments the route itself passes, the template (vLLM takes a template
# from a request only when its server trusts them), the functions templates call, and ``tokenize`` (the rendering's
# ids, not its text: the route encodes the text itself).
_RESERVED_TEMPLATE_KEYS = frozenset(
    {
        "messages",
        "tokenize",
        "tools",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "raise_exception",
        "strftime_now",
        "namespace",
    }
)


class DeltaStream(Protocol):
    request_id: str

    def __aiter__(self) -> AsyncIterator[RequestDelta]: ...

    def abort(self) -> None: ...


def _delta_batches(stream: DeltaStream | AsyncIterator[RequestDelta]) -> AsyncIterator[list[RequestDelta]]:
    """A stream's deltas in batches: those waiting together where the stream reads so (``RequestStream.batches``),
    else one at a time."""
    batches = getattr(stream, "batches", None)
    return batches() if batches is not None else _one_at_a_time(stream)


async def _one_at_a_time(stream: DeltaStream | AsyncIterator[RequestDelta]) -> AsyncIterator[list[RequestDelta]]:
    async for delta in stream:
        yield [delta]


class _Replayed:
    """A stream whose first delta was taken to look at: it comes again first, then the rest."""

    def __init__(self, stream: DeltaStream, rest: AsyncIterator[RequestDelta], first: RequestDelta | None) -> None:
        self.request_id = stream.request_id
        self._stream, self._rest, self._first = stream, rest, first

    async def __aiter__(self) -> AsyncIterator[RequestDelta]:
        if self._first is None:
            return
        yield self._first
        if not self._first.finished:
            async for delta in self._rest:
                yield delta

    async def batches(self) -> AsyncIterator[list[RequestDelta]]:
        """The first delta, then the rest in batches (:func:`_delta_batches`)."""
        if self._first is None:
            return
        yield [self._first]
        if not self._first.finished:
            async for batch in _delta_batches(self._rest):
                yield batch

    def abort(self) -> None:
        self._stream.abort()

    @property
    def num_cached_tokens(self) -> int:
        """Its prompt's tokens read from the prefix cache (its first delta's)."""
        return self._first.num_cached_tokens if self._first is not None else 0


class ChatStream(StreamingResponse):
    """A streamed chat completion, with what its prompt is known to be as it starts (the Messages route's
    ``message_start`` counts it, as Anthropic's does): its tokens, and those read from the prefix cache."""

    def __init__(self, content: AsyncIterator[bytes], prompt_tokens: int, cached_tokens: int) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.chunks = content  # (its body_iterator, as this class made it: the server-sent events' bytes)
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens


async def _while_connected(work: Coroutine[Any, Any, T], streams: Sequence[DeltaStream], request: Request) -> T:
    """Await ``work``; a client that disconnects meanwhile (checked every 0.5 s) aborts the streams: 499."""
    task = asyncio.create_task(work)
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if not done and await request.is_disconnected():
            task.cancel()
            for s in streams:
                s.abort()
            raise APIError(499, "client disconnected")
    return task.result()


def failure_error(ends: list[tuple[str | None, str | int | None]]) -> APIError | None:
    """The error for requests that ended so (finish and stop reasons), if any did not end well (one mapping for every
    route, streamed or not)."""
    if any(finish == "error" and stop == SHUTTING_DOWN for finish, stop in ends):
        return APIError(503, SHUTTING_DOWN, code="server_shutting_down")
    if any(finish == "error" and stop == NO_ROOM_AFTER_FAILOVER for finish, stop in ends):
        return APIError(503, NO_ROOM_AFTER_FAILOVER, code="instance_lost", headers={"Retry-After": "5"})
    if any(finish == "error" and stop == GRANT_REFUSED for finish, stop in ends):
        # Not the engine's fault: the cluster lost the memory the request needs; it may come back.
        return APIError(503, GRANT_REFUSED, code="kv_capacity_unavailable", headers={"Retry-After": "10"})
    if any(finish == "error" for finish, _ in ends):
        return APIError(500, "the engine failed while generating; the request was dropped", code="engine_error")
    return None


def _stop_reason(finish: str | None, stop: str | int | None) -> str | int | None:
    """vLLM's ``stop_reason`` of a choice: the stop string or stop token id that ended it; None for the model's end of
    sequence or any other end (an error's own reason is not the client's to read)."""
    return stop if finish == "stop" else None


def _raise_for_failure(ends: list[tuple[str | None, str | int | None]]) -> None:
    if (error := failure_error(ends)) is not None:
        raise error


def _usage_so_far(prompt_tokens: int, choice: Choice) -> dict[str, int]:
    """A chunk's usage under vLLM's ``continuous_usage_stats``: its choice's prompt and tokens so far (the stream's
    last chunk, as without it, has the whole request's)."""
    completion = len(choice.token_ids)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def _failure_event(choices: list[Choice]) -> bytes:
    """A stream's error event, before its ``[DONE]``, if a choice ended with an error: the error object an unstreamed
    request gets (its finish chunk says only "error")."""
    error = failure_error([(c.finish_reason, c.stop_reason) for c in choices])
    if error is None:
        return b""
    return b"data: " + error_bytes(error.status, error.message, error.code) + b"\n\n"


class EngineClient(Protocol):
    """What the HTTP layer needs from an engine or a cluster."""

    @property
    def tokenizer(self) -> Any: ...

    @property
    def max_model_len(self) -> int: ...

    # The most requests that may wait at once (``--max-waiting`` of one engine); None: no one such queue. (Read-only
    # here: an engine's plain ``int`` attribute is one.)
    @property
    def max_waiting(self) -> int | None: ...

    # The most alternatives per token a request may ask for (``--max-logprobs``; -1: the whole vocabulary).
    @property
    def max_logprobs(self) -> int: ...

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        program: ProgramRef | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> DeltaStream:
        """Start a request; its stream is read on ``loop`` (by default the running one: a caller off the event loop,
        :meth:`OpenAIServer.submit`, names it)."""

    def stats(self) -> dict[str, EngineStats]: ...

    def is_alive(self) -> bool: ...

    def add_finished_listener(self, fn: Callable[[RequestDelta], None]) -> None: ...

    def cluster_info(self) -> list[dict]: ...

    # How its model's embeddings are made (``/v1/embeddings``); None: it serves none (prefill and decode engines).
    @property
    def pooling(self) -> EmbeddingPooling | None: ...

    def end_requests(self) -> None:
        """End every request in flight with an error (stop reason ``SHUTTING_DOWN``) and refuse new ones."""

    def shutdown(self) -> None:
        """Stop the engine (or the cluster's instances) once the server is done with it; its writes handed over."""


@dataclass
class Choice:
    """One completion being assembled from deltas."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[SampledToken] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # why it finished; for an error, what failed
    cached_tokens: int = 0
    # Predicted Outputs: the prediction's drafts kept and rejected (OpenAI's accepted / rejected_prediction_tokens)
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    instance: str = ""  # the engine instance that produced its latest tokens
    prompt_logprobs: PromptLogprobs | None = None  # with its first token, when asked for
    embedding: list[float] | None = None  # an embedding request's (``/v1/embeddings``)


# -- request -> engine inputs ------------------------------------------------------------------


def sampling_params(
    body: ChatCompletionRequest | CompletionRequest,
    max_tokens: int | None,
    logprobs: int | None,
    structured: StructuredOutput | None,
    prompt_logprobs: int | None = None,
    lora: str | None = None,
    defaults: SamplingDefaults = NO_DEFAULTS,
    room: int | None = None,
) -> SamplingParams:
    """The engine's parameters for a request; what it leaves out is the model's default (``defaults``, from its
    ``generation_config.json``), else the API's. ``room``: the tokens the prompt leaves in the context, to which the
    model's default ``max_tokens`` is capped, as vLLM caps it (a request that sets no limit is not refused for the
    default's: a limit the client sets is still checked whole)."""

    def given(value: Any, default: Any, fallback: Any) -> Any:
        return value if value is not None else (default if default is not None else fallback)

    default_max_tokens = defaults.max_tokens
    if default_max_tokens is not None and room is not None and room >= 1:
        default_max_tokens = min(default_max_tokens, room)

    stop = body.stop if isinstance(body.stop, list) else ([] if body.stop is None else [body.stop])
    return SamplingParams(
        n=body.n,
        temperature=given(body.temperature, defaults.temperature, 1.0),
        top_p=given(body.top_p, defaults.top_p, 1.0),
        top_k=given(body.top_k, defaults.top_k, 0),
        seed=body.seed,
        max_tokens=given(max_tokens, default_max_tokens, None),
        min_tokens=body.min_tokens,
        stop=tuple(stop),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=given(body.repetition_penalty, defaults.repetition_penalty, 1.0),
        min_p=given(body.min_p, defaults.min_p, 0.0),
        logit_bias=tuple((int(t), b) for t, b in (body.logit_bias or {}).items()),
        allowed_token_ids=None if body.allowed_token_ids is None else tuple(body.allowed_token_ids),
        bad_words=tuple(body.bad_words or ()),
        structured=structured,
        lora_name=lora,
        cache_salt=body.cache_salt,
        priority=body.priority,
        # A response that is not streamed is read at the end: its text is decoded once, then (as vLLM's server asks).
        output_kind=RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY,
    )


@dataclass(frozen=True)
class ToolUse:
    """Whether a chat's output is read for tool calls, whether it may make several (``parallel_tool_calls``), the
    tools' parameter schemas by name (``types``: the names a bare JSON call may have, and the types of the values of
    calls whose values are text, Qwen3-Coder's; None: not known, any name), and the shapes of call read (``formats``:
    ``--tool-call-parser``'s, and bare JSON when a forced call's grammar writes it)."""

    used: bool
    parallel: bool = True
    types: ParameterTypes | None = None
    formats: CallFormats = ALL_FORMATS
    forced: bool = False  # tool_choice required or named: the grammar writes calls throughout

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The output's content and calls (the parser a stream's :class:`ContentStream` finishes with)."""
        content, calls, _ = self.read(text)
        return content, calls

    def read(self, text: str, at_length: bool = False) -> tuple[str | None, list[ToolCall], int | None]:
        """The output's content and calls, and where its content ends when it was cut off inside a call (None: it
        was not). ``at_length``: it ended at ``max_tokens``; calls it had begun are then read as far as they were
        written (:meth:`begun_calls`), as OpenAI returns a call cut off, when it was cut inside one."""
        content, calls = parse_tool_calls(text, self.types, self.formats)
        cut_at = None
        if at_length:
            held_at, begun = self.begun_calls(text)
            if self._cut_inside(text, calls, begun, self.formats):
                content, calls, cut_at = (text[:held_at].strip() or None), begun, held_at
        return content, calls if self.parallel else calls[:1], cut_at

    def finish(self, contents: ContentStream, text: str, at_length: bool = False) -> tuple[str, list[ToolCall]]:
        """A stream's end: the whole output ``text`` -> the content its ``contents`` has not sent yet, and the calls,
        as :meth:`read` reads them (``at_length``: calls cut off come as far as they got, and the text held for them
        is no content), so the streamed and the unstreamed response say the same."""
        content, calls, cut_at = self.read(text, at_length)
        if cut_at is None:
            return contents.finish(text, lambda _: (content, calls))  # (read already)
        return (text[contents.sent : cut_at].rstrip() if contents.sent else content or ""), calls

    def cut_off(self, text: str, calls: list[ToolCall]) -> bool:
        """Whether an output that ended at ``max_tokens``, whose parsed calls are ``calls``, was cut off inside a call
        it had begun (:meth:`read` reads it so)."""
        return self._cut_inside(text, calls, self.begun_calls(text)[1], self.formats)

    @staticmethod
    def _cut_inside(text: str, calls: list[ToolCall], begun: list[ToolCall], formats: CallFormats) -> bool:
        """Whether the output was cut off inside a call it had begun (``begun``: as a stream sent them): none of its
        calls parse, or a later one had begun past those that do (its name written), or a harmony call did not end
        (read in ``formats``), or its text after the last closed ``<tool_call>`` block is the start of another
        (``<tool_c``; ``<tool_call>`` with its name not yet whole)."""
        if not begun:
            return False
        if not calls or len(begun) > len(calls):
            return True
        if HARMONY in formats and harmony_open_call(text):
            return True  # (harmony's last call without its end: its arguments as far as they got)
        closed = tagged_blocks(text)
        tail = text[closed[-1][1] :].lstrip() if closed else ""
        return bool(tail) and (tail.startswith(TOOL_CALL_TAG) or TOOL_CALL_TAG.startswith(tail))

    def begun_calls(self, text: str) -> tuple[int, list[ToolCall]]:
        """Where the calls an output had begun start, and those calls, whole or as far as their arguments got: what a
        stream of it sent (:class:`ContentStream`, :class:`CallStream`), so that a cut-off output's streamed and
        unstreamed responses say the same; ``(len(text), [])`` when it began none."""
        contents = ContentStream(self.formats)
        contents.feed(text)
        if not contents.held:
            return len(text), []
        stream = CallStream(self.parallel, self.types, self.forced, self.formats)
        stream.feed(text, contents.sent)
        return contents.sent, stream.begun()

    def content_spans(self, answer: str, at_length: bool = False) -> list[Span]:
        """The parts of an ``answer`` that are its message's content: all of it, unless it holds calls; then the parts
        around them from the first that is not blank to the last, less the blanks that end the last: the content is
        the parts joined, then stripped, so blanks between the parts stay in it. The blanks that begin the first are
        kept: a token that starts in them holds the content's first word as often as not (`` Done`` after a call),
        and a stream sends them with the text they precede. ``at_length``: as :meth:`read` (calls cut off: the
        content is what precedes them)."""
        content, calls, cut_at = self.read(answer, at_length) if self.used else (answer, [], None)
        if not calls:
            return [(0, len(answer))]
        if content is None:
            return []
        spans = [(0, cut_at)] if cut_at is not None else spans_around_calls(answer, self.formats)
        texts = [i for i, (start, end) in enumerate(spans) if answer[start:end].strip()]
        spans = spans[texts[0] : texts[-1] + 1]  # (content: one part at least is not blank)
        start, end = spans[-1]
        return [*spans[:-1], (start, start + len(answer[start:end].rstrip()))]


def _forced_calls(
    body: ChatCompletionRequest, grammar: Callable[[list[dict[str, Any]], str | None, bool], StructuredOutput]
) -> StructuredOutput | None:
    """The grammar of a ``tool_choice`` that forces a call (``required`` or a named function), else None:
    ``grammar(tools, name, parallel)`` (``OpenAIServer.forced_calls``) once the choice is checked."""
    choice = body.tool_choice
    if choice is None or choice in ("none", "auto"):
        return None
    tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
    names = [t["function"]["name"] for t in tools]
    if not tools:
        raise APIError(400, "a tool_choice that forces a call needs tools", "tool_choice", "invalid_value")
    if (body.response_format is not None and body.response_format.type != "text") or body.structured_outputs:
        where = "structured_outputs" if body.structured_outputs else "response_format"
        raise APIError(400, f"{where} cannot go with a tool_choice that forces a call", where, "invalid_value")
    name = None if choice == "required" else choice.function.name  # type: ignore[union-attr]
    if name is not None and name not in names:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", "tool_choice", "invalid_value")
    # (A parameters schema xgrammar cannot use is then the tools' fault: errors name them.)
    return grammar(tools, name, body.parallel_tool_calls)


def _structured(body: ChatCompletionRequest | CompletionRequest) -> StructuredOutput | None:
    """The grammar ``response_format`` or ``structured_outputs`` asks for (not both), else None."""
    response_format, wanted = body.response_format, body.structured_outputs
    if response_format is not None and response_format.type != "text":
        if wanted is not None:
            raise APIError(400, "give response_format or structured_outputs, not both", "structured_outputs")
        if response_format.type == "structural_tag":
            return StructuredOutput("structural_tag", structural_tag_text(response_format.structural_tag()))
        if response_format.json_schema is None or response_format.json_schema.schema_ is None:
            return StructuredOutput("json_object")
        return StructuredOutput.json_schema(response_format.json_schema.schema_)
    return None if wanted is None else structured_outputs_grammar(wanted)


def structured_outputs_grammar(wanted: StructuredOutputsParams) -> StructuredOutput:
    """The grammar of vLLM's ``structured_outputs``."""
    where = "structured_outputs"
    if wanted.json_ is not None:
        return StructuredOutput.json_schema(wanted.json_, where)
    if wanted.regex is not None:
        return StructuredOutput("regex", wanted.regex, where)
    if wanted.choice is not None:
        return StructuredOutput.choice(wanted.choice, where)
    if wanted.grammar is not None:
        return StructuredOutput("grammar", wanted.grammar, where)
    if wanted.structural_tag is not None:
        tag = wanted.structural_tag
        try:
            parsed = json.loads(tag) if isinstance(tag, str) else tag
        except UNREADABLE_JSON:
            parsed = None  # (xgrammar says what is wrong with it)
        if isinstance(parsed, dict) and "structures" in parsed:
            # vLLM's first shape (structures that begin at triggers), which its xgrammar backend still compiles
            try:
                legacy = ResponseFormat.model_validate({**parsed, "type": "structural_tag"})
            except ValidationError as e:
                raise APIError(400, f"the structural_tag is not one: {e.errors()[0]['msg']}", where) from e
            return StructuredOutput("structural_tag", structural_tag_text(legacy.structural_tag()), where)
        return StructuredOutput("structural_tag", tag if isinstance(tag, str) else structural_tag_text(tag), where)
    return StructuredOutput("json_object", None, where)


async def check_grammar(params: SamplingParams, vocab_size: int) -> None:
    """Check a structured request's definition for a vocabulary of ``vocab_size`` ids on a worker thread: the first
    one imports xgrammar (1.5 s), which would stall every stream of the event loop."""
    if params.structured is not None:
        await asyncio.to_thread(_check_structured, params.structured, vocab_size)


def _check_structured(spec: StructuredOutput, vocab_size: int) -> None:
    if spec.kind in ("json_schema", "structural_tag"):  # (JSON: its depth first, which the compilation's time follows)
        require_shallow_json(spec.definition, spec.param, spec.kind)
    check_structured_output(spec, vocab_size)


# A request body past this size has its prompt built (the chat template, the tokenizer) on a worker thread, and a
# text past LONG_TEXT_CHARS is tokenized with the GIL released: a body of megabytes takes seconds to tokenize, which on
# the event loop (or holding the GIL) stalled every other request and stream of the server for as long.
LARGE_BODY_BYTES = 1 << 18
LONG_TEXT_CHARS = 1 << 16


async def off_loop_if_large(request: Request, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, on a worker thread if the request's body is over :data:`LARGE_BODY_BYTES` (else here: a small
    request is not worth a thread, nor a place in the pool's queue)."""
    if len(await request.body()) > LARGE_BODY_BYTES:  # (read already: the route's body)
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """``tokenizer.encode(text)``; a long text through the batch encoder, which releases the GIL (the single one holds
    it throughout: seconds for megabytes, in which no other thread of the server ran)."""
    if len(text) > LONG_TEXT_CHARS and hasattr(tokenizer, "encode_batch"):
        return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


async def guarded_stream(events: AsyncIterator[bytes], failure: Callable[[str], bytes]) -> AsyncIterator[bytes]:
    """``events``, ended by ``failure``'s event (given the error's message) if making them raised: a stream under way
    has its status already, and the app's last resort (errors.UnexpectedErrors) can only cut its connection, which
    tells a client nothing (the openai client reads it as a network error, and retries)."""
    try:
        async for piece in events:
            yield piece
    except Exception as exc:  # (not a cancellation: a client gone has nobody to tell)
        log.error("a stream failed after it began", exc_info=exc)
        yield failure(f"internal error: {type(exc).__name__}")


def data_error(message: str) -> bytes:
    """A chat or completions stream's last events after a failure: the error object, as an engine's failure ends it
    (``_failure_event``), and ``[DONE]``."""
    return b"data: " + error_bytes(500, message, "internal_error") + b"\n\ndata: [DONE]\n\n"


def _program(body: ChatCompletionRequest | CompletionRequest, request: Request) -> ProgramRef | None:
    # An agent written for Boundless names its program; others name their session (api/agent_sessions.py).
    program_id = program_named(body.program_id, request.headers, body.prompt_cache_key)
    thread_id = body.thread_id or header_identifier(request.headers, "X-Thread-Id")
    if not program_id:
        return None
    return ProgramRef(program_id, thread_id, tuple(body.parent_thread_ids or ()))


def require_grammar_tools(count: int, what: str) -> None:
    """A grammar holds calls to ``count`` tools (``what``: why it holds them): at most :data:`MAX_GRAMMAR_TOOLS`."""
    if count > MAX_GRAMMAR_TOOLS:
        raise APIError(
            400,
            f"{what} with {count} tools: their calls' grammar holds at most {MAX_GRAMMAR_TOOLS} (its compilation "
            "grows faster than the tools); send fewer tools",
            "tools",
            "invalid_value",
        )


def _abort_streams(submitted: asyncio.Future[list[DeltaStream]]) -> None:
    """Abort the streams a submission made for a request whose client went meanwhile."""
    if not submitted.cancelled() and submitted.exception() is None:
        for stream in submitted.result():
            stream.abort()


def check_common(body: ChatCompletionRequest | CompletionRequest, vocab_size: int, max_logprobs: int) -> None:
    """What chat and completions check alike before anything is tokenized or submitted; ``max_logprobs``: the engine's
    (``--max-logprobs``; -1: no limit)."""
    require_valid_text(body.model_dump(by_alias=True))
    most = logprobs_limit(max_logprobs, vocab_size)
    for name in ("top_logprobs", "logprobs", "prompt_logprobs"):
        asked = getattr(body, name, None)  # (chat's logprobs is a switch, its count top_logprobs)
        if type(asked) is int and asked > most:
            raise APIError(
                400,
                f"{name}: {asked} alternatives asked for, more than the {most} this server gives (--max-logprobs)",
                name,
                "invalid_value",
            )
    refuse_removed_fields(body.model_extra)
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", "stream_options", "invalid_value")
    if body.stream and body.prompt_logprobs:  # (vLLM's rule: a streamed response has nowhere to put them)
        raise APIError(400, "prompt_logprobs are not available with stream", "prompt_logprobs", "invalid_value")
    require_token_ids(body.stop_token_ids or (), vocab_size, "stop_token_ids")
    bias_ids = []
    for key in body.logit_bias or {}:
        # (Digits past int()'s 4,300 were a 500; past the vocabulary's few they name no token anyway.)
        if not key.isascii() or not key.isdigit() or len(key) > 18:
            raise APIError(400, f"logit_bias: {key[:40]!r} is not a token id", "logit_bias", "invalid_value")
        bias_ids.append(int(key))
    require_token_ids(bias_ids, vocab_size, "logit_bias")
    require_token_ids(body.allowed_token_ids or (), vocab_size, "allowed_token_ids")


def configured_chat_template(config: ServerConfig) -> str | None:
    """The template ``--chat-template`` gives (a file's or the flag's own text), checked; None without the flag."""
    if config.chat_template is None:
        return None
    try:
        return load_chat_template(config.chat_template)
    except ValueError as e:
        raise ConfigError(f"--chat-template: {e}") from e


# -- the app -------------------------------------------------------------------------------------


class OpenAIServer:
    """Routes bound to one engine client and one served model name."""

    def __init__(
        self,
        client: EngineClient,
        model_name: str,
        config: ServerConfig,
        loras: dict[str, str] | None = None,
        defaults: SamplingDefaults = NO_DEFAULTS,
    ) -> None:
        self.client = client
        self.defaults = defaults  # the model's sampling defaults (generation_config.json), for what requests omit
        self.model_name = model_name  # the name answers give
        # Every name a request may call the base model by (--served-model-name's, several as vLLM's).
        self.model_names = tuple(dict.fromkeys((model_name, *config.served_model_name)))
        self.loras = dict(loras or {})  # served LoRA adapters: name -> path (--lora-modules)
        # Ids for adapters loaded at run time, after those EngineCore.from_model gave --lora-modules (1, 2, ...).
        self.next_lora_id = itertools.count(len(self.loras) + 1)
        # Names whose load_lora_adapter is under way: taken, so that a second load of one is refused at once.
        self.loras_loading: set[str] = set()
        for name in self.model_names:
            if name in self.loras:
                raise ConfigError(f"--lora-modules: the adapter name {name!r} is a name of the served model")
        self.config = config
        self.chat_template = configured_chat_template(config)  # None: the model's own
        templates = client.tokenizer.chat_templates
        tools_template = self.chat_template or templates.get("tool_use") or templates.get("default")
        # The model's call format (None: not known): a strict tool's calls under tool_choice auto are held to it, and
        # forced calls are written in it.
        self.strict_format: str | None = None
        self.strict_format = strict_call_format(self.call_formats(forced=False), tools_template)
        # Whether outputs read for calls keep their special tokens (Mistral's [TOOL_CALLS] is one, as vLLM keeps it).
        self.special_calls = keeps_special_tokens(config.tool_call_parser, tools_template)
        # (gpt-oss's messages read with its reasoning parser without --reasoning-parser: reasoning_parser_name)
        reasoning = reasoning_parser_name(config.reasoning_parser, config.tool_call_parser, client.tokenizer)
        self.reasoning = ReasoningParser.named(reasoning) if reasoning else None
        self.metrics = ServerMetrics(client.stats, getattr(client, "cluster_metrics", None))
        client.add_finished_listener(self._observe)
        self.created = int(time.time())
        self.token_bytes = TokenBytes(client.tokenizer)  # (logprobs' bytes)

    def _observe(self, delta: RequestDelta) -> None:
        self.metrics.observe(delta, delta.instance)

    @property
    def tokenizer(self):
        return self.client.tokenizer

    def tokens_as_ids(self, body: ChatCompletionRequest | CompletionRequest) -> bool:
        """Whether a request's logprobs name their tokens ``token_id:<id>``: as it says, else as the server's
        ``--return-tokens-as-token-ids`` (vLLM's)."""
        asked = body.return_tokens_as_token_ids
        return self.config.return_tokens_as_token_ids if asked is None else asked

    def check_model(self, model: str) -> str | None:
        """The LoRA adapter a request's ``model`` names (None: the base model); 404 for a name not served."""
        if model in self.model_names:
            return None
        if model in self.loras:
            return model
        served = ", ".join(repr(name) for name in [*self.model_names, *self.loras])
        raise APIError(
            404, f"the model {model!r} does not exist; this server serves {served}", "model", "model_not_found"
        )

    async def submit(
        self,
        base_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        program: ProgramRef | None,
        prompt_only: bool = False,
    ) -> list[DeltaStream]:
        """:meth:`submit_all` on a worker thread, the streams read on this event loop: a cluster's submission is a
        round trip to an instance for each sample (a request of 128 samples held every other stream of the server,
        and ``/health``, 0.3 s on two instances), and an engine's waits for the engine's lock, which the engine holds
        while it decides a step and takes its results. A request whose client goes while it is submitted has its
        streams aborted once they exist."""
        loop = asyncio.get_running_loop()
        submitted = loop.run_in_executor(
            None, functools.partial(self.submit_all, base_id, prompts, params, program, prompt_only, loop)
        )
        try:
            return await asyncio.shield(submitted)
        except asyncio.CancelledError:
            submitted.add_done_callback(_abort_streams)
            raise

    def submit_all(
        self,
        base_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        program: ProgramRef | None,
        prompt_only: bool = False,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> list[DeltaStream]:
        """Submit every (prompt, sample) pair; on any error, abort those already submitted. A request of more samples
        than ``--max-waiting`` lets wait is refused (400): its samples would be refused as the queue filled (429), again
        at every retry, the server idle or not. A prompt and the tokens asked for past the context are refused here
        (with OpenAI's ``context_length_exceeded``, which an instance's error across Ray would not carry), a prompt
        that fills the context too unless ``prompt_only`` (the completions API's echo with ``max_tokens`` 0, whose one
        token sampled at the prompt's end is left out): the engine takes one token asked for after it, as vLLM's
        engine does."""
        for ids in prompts:
            require_context_room(len(ids), params.max_tokens, self.client.max_model_len, prompt_only)
        limit = self.client.max_waiting
        if limit is not None and (samples := len(prompts) * params.n) > limit:
            raise APIError(
                400,
                f"{samples} samples (n x prompts) exceed the {limit} requests this server lets wait (--max-waiting); "
                "send fewer at a time",
                "n",
                "invalid_value",
            )
        if self.config.enable_log_requests:
            log.info("%s", request_line(base_id, prompts, params, self.tokenizer, self.config.max_log_len))
        streams: list[DeltaStream] = []
        try:
            for p_idx, ids in enumerate(prompts):
                for i in range(params.n):
                    rid = f"{base_id}-{p_idx}-{i}"
                    streams.append(self.client.submit(rid, ids, params.for_sample(i), program, loop))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams

    async def tokenized_bad_words(self, params: SamplingParams, request: Request) -> SamplingParams:
        """``params`` with its ``bad_words`` as their token sequences, tokenized here (on a worker thread for a large
        body, long words with the GIL released) rather than by the engine as it takes the request: one word of 6 MB
        held every other request of the server 12 s there."""
        if not params.bad_words:
            return params

        def encode(text: str) -> list[int]:
            return encode_text(self.tokenizer, text, add_special_tokens=False)

        sequences = await off_loop_if_large(request, bad_words_token_ids, params.bad_words, encode)
        return dataclasses.replace(params, bad_words=(), bad_words_token_ids=sequences)

    # -- chat ------------------------------------------------------------------------------

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        if not body.messages:
            raise APIError(400, "messages must not be empty", "messages", "invalid_value")
        if (body.model_extra or {}).get("chat_template") is not None:  # (vLLM's rule, unless its server trusts them)
            raise APIError(
                400,
                "a request cannot send its own chat template: the server's serves (--chat-template, else the model's)",
                "chat_template",
                "unsupported_parameter",
            )
        turns = [m.model_dump(exclude_none=True) for m in body.messages]
        if self.reasoning is not None and self.reasoning.name == HARMONY_REASONING:
            turns = harmony_turns(turns)
        try:
            messages = template_conversation(turns)
        except InvalidMessage as e:
            raise APIError(400, str(e), e.param, e.code) from e
        excluded = body.tool_choice == "none" and self.config.exclude_tools_when_tool_choice_none
        tools = None if excluded or body.tools is None else template_tools(body.tools)
        if (tools and self.special_calls) or (self.reasoning is not None and self.reasoning.special_tags):
            body.skip_special_tokens = False  # (the parsers' tags are special tokens: the text they read keeps them)
        if body.continue_final_message and body.add_generation_prompt:  # (vLLM's default is True: it must be unset)
            raise APIError(
                400,
                "continue_final_message continues the last message: set add_generation_prompt to false with it",
                "continue_final_message",
                "invalid_value",
            )
        try:
            prompt = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=body.add_generation_prompt,
                chat_template=self.chat_template,
                continue_final_message=body.continue_final_message,
                **self._template_kwargs(body),
            )
        # The template rejected the conversation (raise_exception), or a variable the request gave it does not fit.
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            raise APIError(400, f"the chat template rejected the messages: {e}", "messages") from e
        return encode_text(self.tokenizer, prompt, add_special_tokens=False)

    def _template_kwargs(self, body: ChatCompletionRequest) -> dict[str, Any]:
        """vLLM's ``chat_template_kwargs``, and ``reasoning_effort`` (for a reasoning model only) as the template's
        ``reasoning_effort``."""
        kwargs = dict(body.chat_template_kwargs or {})
        reserved = sorted(_RESERVED_TEMPLATE_KEYS & kwargs.keys())
        if reserved:
            raise APIError(
                400, f"chat_template_kwargs cannot set {reserved[0]!r}", "chat_template_kwargs", "invalid_value"
            )
        if body.reasoning_effort is not None:
            if self.reasoning is None:
                raise APIError(
                    400,
                    f"{self.model_name} does not reason (no --reasoning-parser): reasoning_effort is not supported",
                    "reasoning_effort",
                )
            kwargs.setdefault("reasoning_effort", body.reasoning_effort)
        return kwargs

    def call_formats(self, forced: bool) -> CallFormats:
        """The shapes of call an output is read for: ``--tool-call-parser``'s (all without it), and bare JSON when a
        forced call's grammar writes the output."""
        parser = self.config.tool_call_parser
        formats = ALL_FORMATS if parser is None else TOOL_CALL_PARSERS[parser]
        return formats | {BARE_JSON} if forced and self.strict_format != TAGGED_JSON else formats

    def forced_calls(self, tools: list[dict[str, Any]], name: str | None, parallel: bool) -> StructuredOutput:
        """The grammar of a ``tool_choice`` that forces a call (``name``'s, or with None any tool's): the calls in
        the model's own format where it is Hermes' JSON (``strict_format``: a structural tag, as SGLang holds them, so
        the model writes what it was trained to), else a JSON list of calls (vLLM's; read as bare JSON). Not in
        Qwen3-Coder's XML, nor GLM-4.5's tags: xgrammar's XML values may carry blanks around them, which a string's
        schema then holds only loosely, where the JSON list holds every value exactly."""
        if name is None:  # (one named tool's grammar holds its calls alone)
            require_grammar_tools(len(tools), "a tool_choice that forces a call")
        if self.strict_format != TAGGED_JSON:
            return StructuredOutput.json_schema(forced_call_schema(tools, name, parallel), "tools")
        tag = forced_calls_tag(tools, self.strict_format, parallel, name)
        return StructuredOutput("structural_tag", structural_tag_text(tag), "tools")

    def strict_calls(self, tools: list[dict[str, Any]], choice: object, parallel: bool) -> StructuredOutput | None:
        """The grammar that holds the calls of strict tools (chat-shaped) to their schemas under ``tool_choice`` auto
        (``api/strict_calls.py``), or None: another choice, no strict tool, or a call format not known."""
        if choice not in (None, "auto") or self.strict_format is None:
            return None
        tag = strict_calls_tag(tools, self.strict_format, parallel, self.config.strict_tool_calls)
        if tag is None:
            return None
        require_grammar_tools(len(tools), "strict tools")  # (the tag holds every tool's calls: the others' loosely)
        return StructuredOutput("structural_tag", structural_tag_text(tag), "tools")

    def thinking_budget(self, tokens: int | None, prompt: list[int]) -> ThinkingBudget | None:
        """The budget that closes a reasoning model's thinking after ``tokens`` tokens (``thinking_token_budget``)
        for an output of ``prompt``: its end tag forced then; None without one, or when the prompt turned thinking
        off. A 400 on a model that does not reason: the tags are the reasoning parser's."""
        parser = self.reasoning
        if tokens is None:
            return None
        if parser is None:
            raise APIError(
                400,
                f"{self.model_name} does not reason (no --reasoning-parser): thinking_token_budget is not supported",
                "thinking_token_budget",
            )
        tail = self._prompt_tail(prompt)
        if parser.closed_in(tail):
            return None

        start = () if parser.opens_in_reasoning(tail) else self._tag_ids(parser.start)
        return ThinkingBudget(tokens, self._tag_ids(parser.end), start)

    def _tag_ids(self, tag: str) -> tuple[int, ...]:
        """A reasoning tag's token ids, as the model writes it."""
        return tuple(self.tokenizer.encode(tag, add_special_tokens=False))

    def _prompt_tail(self, prompt: list[int]) -> str:
        # (Enough for a header: harmony's final one with `` <|constrain|>json`` in it, a tag a token or several.)
        return self.tokenizer.decode(prompt[-16:], skip_special_tokens=False)

    def reasoning_opened(self, prompt: list[int]) -> bool:
        """Whether an output of ``prompt`` starts inside its reasoning (the template opened the think block)."""
        assert self.reasoning is not None
        return self.reasoning.opens_in_reasoning(self._prompt_tail(prompt))

    def reasoning_output(self, prompt: list[int], tools: ToolUse, include: bool = True) -> ReasoningOutput | None:
        """How an output of ``prompt`` is read for its reasoning (None: no parser), its answer read for calls as
        ``tools`` says (harmony's answer keeps its calls only when they are read in its format)."""
        if self.reasoning is None:
            return None
        parser = self.reasoning.with_calls(tools.used and HARMONY in tools.formats)
        return ReasoningOutput(parser, self.reasoning_opened(prompt), include)

    def after_reasoning(self, structured: StructuredOutput | None, prompt: list[int]) -> StructuredOutput | None:
        """A reasoning model's grammar begins once it has finished thinking (its end tag), as vLLM's does, unless the
        prompt closed the thinking already or ``--structured-outputs-in-reasoning`` holds the thinking to it too."""
        parser = self.reasoning
        if structured is None or parser is None or self.config.structured_outputs_in_reasoning:
            return structured
        if parser.closed_in(self._prompt_tail(prompt)):
            return structured
        close = self._tag_ids(parser.answer_close) if parser.answer_close else ()
        return dataclasses.replace(structured, after=self._tag_ids(parser.answer_after), after_close=close)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        check_common(body, self.tokenizer.vocab_size, self.client.max_logprobs)
        lora = self.check_model(body.model)
        prompt = await off_loop_if_large(request, self.chat_prompt, body)
        ids = truncated_prompt(prompt, body.truncate_prompt_tokens, self.client.max_model_len)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        forced = _forced_calls(body, self.forced_calls)
        tool_dicts = [t.model_dump(exclude_none=True) for t in body.tools or ()]
        tools = ToolUse(
            bool(body.tools) and body.tool_choice != "none",
            body.parallel_tool_calls,
            parameter_types(tool_dicts),
            self.call_formats(forced=forced is not None),
            forced is not None,
        )
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            wanted = forced or _structured(body)
            if wanted is None:  # (an answer held to a format is the answer: its calls are not read apart from it)
                wanted = self.strict_calls(tool_dicts, body.tool_choice, body.parallel_tool_calls)
            structured = self.after_reasoning(wanted, ids)
            prompt_logprobs = None if body.stream else body.prompt_logprobs  # (a stream has no place for them)
            room = self.client.max_model_len - len(ids)
            params = sampling_params(body, max_tokens, logprobs, structured, prompt_logprobs, lora, self.defaults, room)
            if body.prediction is not None:
                text = body.prediction.text
                prediction = await off_loop_if_large(request, encode_text, self.tokenizer, text, False)
                if len(prediction) > self.client.max_model_len:
                    # (No answer can be longer, and the engine reads every token of it as it drafts: millions of
                    # tokens slowed every step of every request.)
                    raise APIError(
                        400,
                        f"prediction: {len(prediction)} tokens exceed the model's context of "
                        f"{self.client.max_model_len}, which no answer can pass",
                        "prediction",
                        "invalid_value",
                    )
                params = dataclasses.replace(params, prediction=tuple(prediction))
            if body.thinking_token_budget is not None:
                budget = self.thinking_budget(body.thinking_token_budget, ids)
                params = dataclasses.replace(params, thinking_budget=budget)
            params = await self.tokenized_bad_words(params, request)
            await check_grammar(params, self.tokenizer.vocab_size)
            streams = await self.submit(rid, [ids], params, _program(body, request))
        except InvalidRequestError as e:  # name the field the client used: for the limit, and messages for the prompt
            if e.param == "max_tokens" and body.max_completion_tokens is not None:
                raise e.renamed("max_completion_tokens") from e
            if e.param == "prompt":  # (as OpenAI's chat names it)
                raise e.renamed("messages") from e
            raise
        reasoning = self.reasoning_output(ids, tools, body.include_reasoning)
        if body.stream:
            include_usage, running_usage = body.stream_options.usage_wanted() if body.stream_options else (False, False)
            replayed = await self.started(streams, request)
            logprobs_of = None
            if body.logprobs:
                logprobs_of = functools.partial(self.streamed_content, ids, body.skip_special_tokens, tools, reasoning)
            predicted = body.prediction is not None
            as_ids, prompt_ids = self.tokens_as_ids(body), (ids if body.return_token_ids else None)
            gen = self._chat_events(
                rid,
                body.model,
                replayed,
                len(ids),
                logprobs_of,
                tools,
                include_usage,
                reasoning,
                predicted,
                as_ids,
                prompt_ids,
                running_usage,
            )
            # (The prompt's cached tokens as the usage counts them: those every sample found.)
            return ChatStream(guarded_stream(gen, data_error), len(ids), min(s.num_cached_tokens for s in replayed))
        choices = await self.collect(streams, request)

        def message_logprobs(c: Choice) -> list[SampledToken]:
            return self.message_logprobs(c, ids, body.skip_special_tokens, tools, reasoning)

        out_choices = []
        for c in choices:
            text = c.text
            message: dict[str, Any] = {"role": "assistant"}
            if reasoning is not None:
                split = reasoning.split(c.text)
                text = split.content or ""
                if reasoning.include:
                    message.update(reasoning.fields(split.reasoning))
            message["content"] = text if reasoning is None else (text or None)
            finish = c.finish_reason
            if tools.used:
                # (Calls cut off by max_tokens come as far as they got, and the output ended at its length.)
                content, calls, cut_at = tools.read(text, at_length=finish == "length")
                if calls:
                    message.update(content=content, tool_calls=[t.to_openai() for t in calls])
                    finish = finish if cut_at is not None else "tool_calls"
            out_choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": {"content": self.chat_logprobs(message_logprobs(c), self.tokens_as_ids(body))}
                    if body.logprobs
                    else None,
                    "finish_reason": finish,
                    "stop_reason": _stop_reason(c.finish_reason, c.stop_reason),
                }
            )
            if body.return_token_ids:
                out_choices[-1]["token_ids"] = c.token_ids
        response = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.model,
            "system_fingerprint": _fingerprint(choices),
            "choices": out_choices,
            "usage": self._usage(len(ids), choices, reasoning, body.prediction is not None),
        }
        if body.return_token_ids:  # (vLLM's: the prompt's beside the choices, each choice's output's in it)
            response["prompt_token_ids"] = ids
        if body.prompt_logprobs is not None:  # vLLM's place for them in a chat response: beside the choices
            response["prompt_logprobs"] = self._prompt_logprobs(choices[0].prompt_logprobs, body.prompt_logprobs)
        return JSONResponse(response)

    async def _chat_events(
        self,
        rid: str,
        model: str,
        streams: Sequence[DeltaStream],
        prompt_len: int,
        logprobs_of: Callable[[], StreamedContent] | None,
        tools: ToolUse,
        include_usage: bool,
        reasoning: ReasoningOutput | None = None,
        predicted: bool = False,
        as_ids: bool = False,
        prompt_ids: list[int] | None = None,
        running_usage: bool = False,
    ) -> AsyncIterator[bytes]:
        """A chat completion's chunks. ``logprobs_of``: a choice's content logprobs as they are known to be content
        (None: not asked for), their tokens as ids with ``as_ids`` (``return_tokens_as_token_ids``); ``predicted``: the
        request brought a prediction (its usage counts the drafts); ``prompt_ids``: vLLM's ``return_token_ids`` (None:
        not asked for), the prompt's ids in each choice's first chunk, and each chunk's tokens' ids in it (those of a
        delta that made no chunk go with the next); ``running_usage``: vLLM's ``continuous_usage_stats``, each chunk's
        usage so far (:func:`_usage_so_far`)."""
        created = int(time.time())
        choices = [Choice(i) for i in range(len(streams))]
        unsent_ids: list[list[int]] = [[] for _ in choices]  # (each choice's token ids not in a chunk yet)
        plain = prompt_ids is None and not running_usage  # (a chunk holds its choice's fields alone)

        writer = ChunkJSON(
            {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}, include_usage
        )

        def chunk(choice_list: list[dict], usage: dict | None = None, **top: Any) -> bytes:
            return writer.event(_fingerprint(choices), choice_list, usage, **top)

        # Each choice's first chunk (its role), all in one send: a send each, a client gone meanwhile met 128 writes
        # to its closed socket (asyncio logs each) before the server learned it had gone.
        top = {} if prompt_ids is None else {"prompt_token_ids": prompt_ids}  # (vLLM's place)
        roles = []
        for c in choices:
            role = {
                "index": c.index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            roles.append(chunk([role], _usage_so_far(prompt_len, c) if running_usage else None, **top))
        yield b"".join(roles)

        def choice_chunk(index: int, delta: dict, lp: dict | None = None, finish: str | None = None) -> bytes:
            if lp is None and finish is None and plain and len(delta) == 1 and type(delta.get("content")) is str:
                return writer.content_event(_fingerprint(choices), index, delta["content"])  # (the commonest chunk)
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = _stop_reason(choices[index].finish_reason, choices[index].stop_reason)
            if prompt_ids is not None:
                choice["token_ids"], unsent_ids[index] = unsent_ids[index], []
            return chunk([choice], _usage_so_far(prompt_len, choices[index]) if running_usage else None)

        # Read for tool calls: content streams until a call may have begun (ContentStream), its logprobs with it;
        # from there the calls stream as they are written (CallStream: a call's id and name, then its arguments).
        # With a reasoning parser, the reasoning streams first as it is written (ReasoningStream), and only the
        # answer after it is content, read for calls. The logprobs are the content's tokens' alone (StreamedContent):
        # none of the reasoning's or the calls', as the unstreamed message's.
        contents = [ContentStream(tools.formats) for _ in choices] if tools.used else []
        call_streams = (
            [CallStream(tools.parallel, tools.types, tools.forced, tools.formats) for _ in choices]
            if tools.used
            else []
        )
        thoughts = [reasoning.stream() for _ in choices] if reasoning is not None else []
        logprobs = [logprobs_of() for _ in choices] if logprobs_of is not None else []

        def content_logprobs(index: int, answer: str, finished: bool) -> list[SampledToken]:
            """Choice ``index``'s content tokens to send now: those known to be content by what of its ``answer`` went
            out as content; once it finished, the rest of its message's."""
            if not logprobs:
                return []
            c = choices[index]
            if finished:
                spans = self.message_spans(c.text, tools, reasoning, c.finish_reason == "length")
                return logprobs[index].finish(spans, len(c.text))
            begun = answer if reasoning is None or answer else None
            stretches = thoughts[index].stretches if reasoning is not None and begun is not None else None
            return logprobs[index].release(c.text, begun, contents[index].sent if tools.used else None, stretches)

        def lp(tokens: list[SampledToken]) -> dict[str, Any] | None:
            return {"content": self.chat_logprobs(tokens, as_ids)} if logprobs else None

        def delta_chunks(index: int, delta: RequestDelta) -> Iterator[bytes]:
            """The chunks of choice ``index``'s delta."""
            c = choices[index]
            self.apply_delta(c, delta)
            if prompt_ids is not None:  # (kept for return_token_ids alone)
                unsent_ids[index] += delta.new_token_ids
            if logprobs:
                logprobs[index].add(delta.new_logprobs)
            answer, thought, new_answer = c.text, "", delta.new_text
            if reasoning is not None:
                thought, new_answer = thoughts[index].feed(c.text, final=delta.finished)
                answer = thoughts[index].content
                thought = thought if reasoning.include else ""
            fields = ReasoningOutput.fields(thought) if thought else {}
            if tools.used:
                if fields:
                    yield choice_chunk(index, fields)
                    fields = {}
                if not delta.finished:
                    text = contents[index].feed(answer)
                    held, sent = contents[index].held, contents[index].sent
                    if held and (calls_so_far := call_streams[index].feed(answer, sent)):
                        if text:
                            yield choice_chunk(index, {"content": text}, lp(content_logprobs(index, answer, False)))
                            text = ""
                        yield choice_chunk(index, {"tool_calls": calls_so_far})
                else:
                    text, calls = contents[index].finish(answer, tools.calls)
                    held = contents[index].held
                    cut = c.finish_reason == "length" and tools.cut_off(answer, calls)
                    last = call_streams[index].feed(answer, contents[index].sent) if held and (cut or not calls) else []
                    if cut and call_streams[index].begun():
                        # Cut off while writing its calls: they stand as far as they were written (the last delta's
                        # text too), as the unstreamed response has them (ToolUse.calls); the text held for them is
                        # not content.
                        new_logprobs = content_logprobs(index, answer, True)
                        if new_logprobs:
                            yield choice_chunk(index, {"content": ""}, lp(new_logprobs))
                        yield choice_chunk(index, {"tool_calls": last} if last else {}, finish="length")
                        return
                    if calls:
                        new_logprobs = content_logprobs(index, answer, True)
                        if text or new_logprobs:
                            yield choice_chunk(index, {"content": text}, lp(new_logprobs))
                        rest = call_streams[index].finish(calls)
                        yield choice_chunk(index, {"tool_calls": rest} if rest else {}, finish="tool_calls")
                        return
                if not text and not delta.finished:
                    return
            else:
                text = new_answer
            new_logprobs = content_logprobs(index, answer, delta.finished)
            if text or new_logprobs:
                fields["content"] = text
            if fields:
                yield choice_chunk(index, fields, lp(new_logprobs) if "content" in fields else None)
            if delta.finished:
                yield choice_chunk(index, {}, finish=delta.finish_reason)

        async for sent in self.batched_sends(streams, delta_chunks):
            yield sent
        usage = chunk([], self._usage(prompt_len, choices, reasoning, predicted)) if include_usage else b""
        yield usage + _failure_event(choices) + b"data: [DONE]\n\n"

    # -- completions -------------------------------------------------------------------------

    def completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        p = body.prompt
        if isinstance(p, str):
            prompts = [encode_text(self.tokenizer, p)]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]  # type: ignore[arg-type]
        elif p and all(isinstance(x, str) for x in p):
            prompts = [encode_text(self.tokenizer, x) for x in p]  # type: ignore[arg-type]
        elif p and all(isinstance(x, list) for x in p):
            prompts = [list(x) for x in p]  # type: ignore[arg-type]
        else:  # the schema has checked the shape: an empty list is left
            raise APIError(400, "prompt must not be empty", "prompt")
        if any(not ids for ids in prompts):
            raise APIError(400, "prompt must not be empty", "prompt")
        for ids in prompts:  # token ids the client sent must be in the vocabulary (the tokenizer's are)
            require_token_ids(ids, self.tokenizer.vocab_size, "prompt")
        return [truncated_prompt(ids, body.truncate_prompt_tokens, self.client.max_model_len) for ids in prompts]

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        check_common(body, self.tokenizer.vocab_size, self.client.max_logprobs)
        lora = self.check_model(body.model)
        if body.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if body.best_of is not None and body.best_of < body.n:
            raise APIError(400, f"best_of ({body.best_of}) must not be below n ({body.n})", "best_of", "invalid_value")
        if body.best_of is not None and body.best_of > body.n:
            raise APIError(400, "best_of above n is not supported (send n alone)", "best_of", "unsupported_parameter")
        if body.max_tokens == 0 and not body.echo:
            raise APIError(
                400, "max_tokens must be at least 1 (0 only with echo: the prompt alone)", "max_tokens", "invalid_value"
            )
        prompts = await off_loop_if_large(request, self.completion_prompts, body)
        # The prompt alone: the engine still samples a token (a prompt ends in a step that samples), which the response
        # leaves out, as vLLM's does.
        prompt_only = body.echo and body.max_tokens == 0
        max_tokens = 16 if body.max_tokens is None else max(body.max_tokens, 1)
        params = sampling_params(
            body, max_tokens, body.logprobs, _structured(body), _prompt_logprobs_wanted(body), lora, self.defaults
        )
        params = await self.tokenized_bad_words(params, request)
        await check_grammar(params, self.tokenizer.vocab_size)
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = await self.submit(rid, prompts, params, _program(body, request), prompt_only)
        prompt_len = sum(len(p) for p in prompts)
        echoes = [self.tokenizer.decode(p) if body.echo else "" for p in prompts]
        if body.stream:
            include_usage, running_usage = body.stream_options.usage_wanted() if body.stream_options else (False, False)
            replayed = await self.started(streams, request)
            events = self._completion_events(
                rid, body, replayed, prompts, echoes, prompt_len, include_usage, running_usage
            )
            return StreamingResponse(guarded_stream(events, data_error), media_type="text/event-stream")
        choices = await self.collect(streams, request)
        out = []
        for c in choices:
            if prompt_only:
                _drop_output(c)
            prompt, echo = prompts[c.index // body.n], echoes[c.index // body.n]
            logprobs = None
            if body.logprobs is not None:  # (where each token starts: decoded again, so only when asked for)
                starts = TokenStarts(self.tokenizer, prompt, body.skip_special_tokens)
                offsets = text_offsets(starts.add(t.token_id for t in c.logprobs), len(echo), len(c.text))
                logprobs = self._choice_logprobs(body, prompt, echo, c.prompt_logprobs, c.logprobs, offsets)
            choice: dict[str, Any] = {
                "index": c.index,
                "text": echo + c.text,
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
                "stop_reason": _stop_reason(c.finish_reason, c.stop_reason),
            }
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self._prompt_logprobs(c.prompt_logprobs, body.prompt_logprobs)
            if body.return_token_ids:
                choice["prompt_token_ids"] = prompt
                choice["token_ids"] = c.token_ids
            out.append(choice)
        return JSONResponse(
            {
                "id": rid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": body.model,
                "system_fingerprint": _fingerprint(choices),
                "choices": out,
                "usage": self._usage(prompt_len, choices),
            }
        )

    async def _completion_events(
        self,
        rid: str,
        body: CompletionRequest,
        streams: Sequence[DeltaStream],
        prompts: list[list[int]],
        echoes: list[str],
        prompt_len: int,
        include_usage: bool,
        running_usage: bool = False,
    ) -> AsyncIterator[bytes]:
        """A completion's chunks; ``running_usage``: vLLM's ``continuous_usage_stats``, each chunk's usage so far (its
        choice's prompt and tokens: :func:`_usage_so_far`)."""
        created = int(time.time())
        choices = [Choice(i) for i in range(len(streams))]
        echoed = [False] * len(streams)
        shown = [False] * len(streams)  # (whether the choice's first chunk is out: it carries the prompt's ids)
        prompt_only = body.echo and body.max_tokens == 0
        offsets_of: list[StreamedOffsets] = []  # (each choice's tokens, with their text_offset)
        if body.logprobs is not None:
            for i in range(len(streams)):
                starts = TokenStarts(self.tokenizer, prompts[i // body.n], body.skip_special_tokens)
                offsets_of.append(StreamedOffsets(starts, len(echoes[i // body.n])))

        writer = ChunkJSON(
            {"id": rid, "object": "text_completion", "created": created, "model": body.model}, include_usage
        )
        plain = not body.return_token_ids and not running_usage  # (a chunk holds its choice's fields alone)

        def chunk(choice_list: list[dict], usage: dict | None = None) -> bytes:
            return writer.event(_fingerprint(choices), choice_list, usage)

        def delta_chunks(index: int, delta: RequestDelta) -> Iterator[bytes]:
            """The chunk of choice ``index``'s delta, if it makes one."""
            c = choices[index]
            self.apply_delta(c, delta)
            text, generated, token_ids = delta.new_text, delta.new_logprobs, delta.new_token_ids
            if prompt_only:
                text, generated, token_ids = "", [], []
                _drop_output(c)
            prompt, echo = prompts[index // body.n], echoes[index // body.n]
            lp = None
            tokens: list[SampledToken] = []
            offsets: list[int] = []
            if offsets_of:
                tokens, offsets = offsets_of[index].take(generated, len(c.text), delta.finished)
                lp = self._completion_logprobs(tokens, offsets, self.tokens_as_ids(body))
            if body.echo and not echoed[index]:  # the prompt goes first, in the choice's first chunk
                echoed[index] = True
                text = echo + text
                lp = self._choice_logprobs(body, prompt, echo, c.prompt_logprobs, tokens, offsets)
            # (A delta whose tokens are all held back, their text not out yet, makes no chunk; unless the tokens' ids
            # are asked for, which go out as they come, as vLLM's.)
            if text or tokens or delta.finished or (body.return_token_ids and token_ids):
                if lp is None and plain and delta.finish_reason is None and not delta.finished:
                    shown[index] = True
                    yield writer.text_event(_fingerprint(choices), index, text)  # (the commonest chunk)
                    return
                piece = {"index": index, "text": text, "logprobs": lp, "finish_reason": delta.finish_reason}
                if delta.finished:
                    piece["stop_reason"] = _stop_reason(c.finish_reason, c.stop_reason)
                if body.return_token_ids:  # (vLLM's: the prompt's ids in the choice's first chunk, each its new ones)
                    piece["prompt_token_ids"] = None if shown[index] else prompt
                    piece["token_ids"] = list(token_ids)
                shown[index] = True
                yield chunk([piece], _usage_so_far(len(prompt), c) if running_usage else None)

        async for sent in self.batched_sends(streams, delta_chunks):
            yield sent
        usage = chunk([], self._usage(prompt_len, choices)) if include_usage else b""
        yield usage + _failure_event(choices) + b"data: [DONE]\n\n"

    # -- shared --------------------------------------------------------------------------------

    @staticmethod
    def apply_delta(choice: Choice, delta: RequestDelta) -> None:
        choice.text += delta.new_text
        choice.token_ids.extend(delta.new_token_ids)
        choice.logprobs.extend(delta.new_logprobs)
        choice.instance = delta.instance
        if delta.prompt_logprobs is not None:
            choice.prompt_logprobs = delta.prompt_logprobs
        if delta.embedding is not None:
            choice.embedding = delta.embedding
        if delta.finished:
            choice.finish_reason = delta.finish_reason
            choice.stop_reason = delta.stop_reason
            choice.cached_tokens = delta.num_cached_tokens
            choice.accepted_prediction_tokens = delta.num_accepted_prediction_tokens
            choice.rejected_prediction_tokens = delta.num_rejected_prediction_tokens

    async def merged(self, streams: Sequence[DeltaStream]) -> AsyncIterator[tuple[int, RequestDelta]]:
        """Deltas of several streams as they come; if the consumer goes away, every stream is aborted."""
        async with contextlib.aclosing(self.merged_batches(streams)) as batches:
            async for batch in batches:
                for item in batch:
                    yield item

    async def batched_sends(
        self, streams: Sequence[DeltaStream], chunks_of: Callable[[int, RequestDelta], Iterator[bytes]]
    ) -> AsyncIterator[bytes]:
        """A stream response's bytes: the chunks ``chunks_of`` makes of each delta, those of deltas read together
        (the reader was behind the engine) in one send, each delta's chunks as they would be alone."""
        async for batch in self.merged_batches(streams):
            if sent := b"".join([piece for index, delta in batch for piece in chunks_of(index, delta)]):
                yield sent

    async def merged_batches(
        self, streams: Sequence[DeltaStream]
    ) -> AsyncGenerator[list[tuple[int, RequestDelta]], None]:
        """Deltas of several streams as they come, those waiting read together (each stream's in order): a reader
        behind the engine takes several steps' deltas in one wake-up, not one each. If the consumer goes away, every
        stream is aborted."""
        if len(streams) == 1:
            try:
                async for batch in _delta_batches(streams[0]):
                    yield [(0, delta) for delta in batch]
            finally:
                streams[0].abort()
            return
        queue: asyncio.Queue[list[tuple[int, RequestDelta]]] = asyncio.Queue()

        async def pump(i: int, s: DeltaStream) -> None:
            async for batch in _delta_batches(s):
                queue.put_nowait([(i, d) for d in batch])

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                items = await queue.get()
                while not queue.empty():
                    items += queue.get_nowait()
                remaining -= sum(d.finished for _, d in items)
                yield items
        finally:
            for t in tasks:
                t.cancel()
            for s in streams:
                s.abort()

    async def collect(self, streams: Sequence[DeltaStream], request: Request) -> list[Choice]:
        """Run to completion; a client that disconnects meanwhile aborts its requests."""
        choices = [Choice(i) for i in range(len(streams))]

        async def consume() -> None:
            async for batch in self.merged_batches(streams):
                for index, delta in batch:
                    self.apply_delta(choices[index], delta)

        await _while_connected(consume(), streams, request)
        _raise_for_failure([(c.finish_reason, c.stop_reason) for c in choices])
        return choices

    async def started(self, streams: Sequence[DeltaStream], request: Request) -> list[_Replayed]:
        """A streamed response's streams once each has its first delta: a request refused or failed before it
        started gets the status an unstreamed one gets (503, 500) instead of a 200 whose one chunk says "error".
        The 200 then waits for the first token (a lending cluster refuses a request while it awaits its grant)."""
        iterators = [s.__aiter__() for s in streams]

        async def firsts() -> list[RequestDelta | None]:
            return list(await asyncio.gather(*(anext(it, None) for it in iterators)))

        try:
            first = await _while_connected(firsts(), streams, request)
            _raise_for_failure([(d.finish_reason, d.stop_reason) for d in first if d is not None and d.finished])
        except BaseException:  # refused, failed, or an instance's error: none of the others runs on unread
            for s in streams:
                s.abort()
            raise
        return [_Replayed(s, it, d) for s, it, d in zip(streams, iterators, first, strict=True)]

    def _usage(
        self, prompt_len: int, choices: list[Choice], reasoning: ReasoningOutput | None = None, predicted: bool = False
    ) -> dict[str, Any]:
        """OpenAI's usage: tokens in and out, the prompt's cached tokens, and (when there are) the reasoning's tokens
        and a prediction's drafts kept and rejected."""
        completion = sum(len(c.token_ids) for c in choices)
        # The prompt's tokens cached before the request: those every sample found (one sample may find another's).
        cached = min((c.cached_tokens for c in choices), default=0)
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_len,
            "completion_tokens": completion,
            "total_tokens": prompt_len + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if reasoning is not None:
            thought = sum(self.reasoning_tokens(reasoning, c.token_ids) for c in choices)
            usage["completion_tokens_details"] = {"reasoning_tokens": thought}
        if predicted:
            usage.setdefault("completion_tokens_details", {}).update(
                accepted_prediction_tokens=sum(c.accepted_prediction_tokens for c in choices),
                rejected_prediction_tokens=sum(c.rejected_prediction_tokens for c in choices),
            )
        return usage

    def reasoning_tokens(self, reasoning: ReasoningOutput, token_ids: list[int]) -> int:
        return reasoning.tokens(token_ids, lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False))

    def _token_text(self, token_id: int, as_id: bool = False) -> str:
        """A token as logprobs name it: its text, or with ``as_id`` (vLLM's ``return_tokens_as_token_ids``)
        ``token_id:<id>``, for a client that needs the ids (a token's text may be part of a character, or another's)."""
        return f"token_id:{token_id}" if as_id else self.tokenizer.decode([token_id], skip_special_tokens=False)

    def message_spans(
        self, text: str, tools: ToolUse, reasoning: ReasoningOutput | None, at_length: bool = False
    ) -> list[Span]:
        """Where a chat message's content lies in its output's ``text``: in the answer after the reasoning (with a
        reasoning parser), around the tool calls (:meth:`ToolUse.content_spans`; ``at_length``: it ended at
        max_tokens)."""
        answer: str | None = text if reasoning is None else reasoning.split(text).content
        if answer is None:
            return []
        spans = tools.content_spans(answer, at_length)
        stretches = None if reasoning is None else reasoning.stretches(text)
        if stretches is not None:  # (harmony's answer: stretches of the output's messages)
            return stretch_spans(spans, stretches)
        begins = len(text) - len(answer)  # (the answer ends the output)
        return [(begins + start, begins + end) for start, end in spans]

    def message_logprobs(
        self,
        choice: Choice,
        prompt: list[int],
        skip_special_tokens: bool,
        tools: ToolUse,
        reasoning: ReasoningOutput | None,
    ) -> list[SampledToken]:
        """A chat message's logprobs (OpenAI's ``logprobs.content``, "message content tokens"): its content's tokens,
        not its reasoning's or its tool calls' (:func:`~boundless.api.logprobs.content_tokens`)."""
        spans = self.message_spans(choice.text, tools, reasoning, choice.finish_reason == "length")
        if spans == [(0, len(choice.text))]:  # all of it: every token (no need to find where each starts)
            return choice.logprobs
        starts = TokenStarts(self.tokenizer, prompt, skip_special_tokens).add(t.token_id for t in choice.logprobs)
        return content_tokens(choice.logprobs, starts, spans, len(choice.text))

    def streamed_content(
        self, prompt: list[int], skip_special_tokens: bool, tools: ToolUse, reasoning: ReasoningOutput | None
    ) -> StreamedContent:
        """A streamed chat message's logprobs, as :meth:`message_logprobs` lists them; where each token starts is found
        only when there are reasoning or calls to tell apart from the content."""
        if not tools.used and reasoning is None:
            return StreamedContent(None)
        return StreamedContent(TokenStarts(self.tokenizer, prompt, skip_special_tokens))

    def chat_logprobs(self, tokens: list[SampledToken], as_ids: bool = False) -> list[dict[str, Any]]:
        """Tokens' logprobs in the chat API's shape (each with its ``top_logprobs``). ``bytes`` are each token's own
        (:class:`TokenBytes`), as OpenAI's: what a client joins into the text, a character split across tokens too,
        whose pieces' decoded ``token`` is U+FFFD. ``as_ids``: each token named by its id (:meth:`_token_text`), as
        vLLM's: a sampled token's ``bytes`` still its own, an alternative's those of its name."""

        def alternative(token_id: int, logprob: float) -> dict[str, Any]:
            token = self._token_text(token_id, as_ids)
            named = list(token.encode()) if as_ids else list(self.token_bytes(token_id))
            return {"token": token, "logprob": logprob, "bytes": named}

        return [
            {
                "token": self._token_text(t.token_id, as_ids),
                "logprob": t.logprob,
                "bytes": list(self.token_bytes(t.token_id)),
                "top_logprobs": [alternative(tid, lp) for tid, lp in t.top_logprobs],
            }
            for t in tokens
        ]

    def _completion_logprobs(
        self, tokens: list[SampledToken], offsets: list[int], as_ids: bool = False
    ) -> dict[str, Any]:
        """The completions API's logprobs of ``tokens``, at ``offsets`` in the choice's text (:func:`text_offsets`);
        ``as_ids``: tokens named by their ids (:meth:`_token_text`; the offsets are still the text's)."""
        return {
            "tokens": [self._token_text(t.token_id, as_ids) for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [self._top_logprobs(t, as_ids) for t in tokens],
            "text_offset": offsets,
        }

    def _top_logprobs(self, token: SampledToken, as_ids: bool = False) -> dict[str, float] | None:
        """A completion token's ``top_logprobs``: the token itself first, then its most likely alternatives. OpenAI's
        rule: "The API will always return the logprob of the sampled token, so there may be up to logprobs+1 elements
        in the response" (vLLM's too). A token without a logprob (the echoed prompt's first) has None, as vLLM's."""
        if token.logprob is None:
            return None
        top = {self._token_text(token.token_id, as_ids): token.logprob}
        for token_id, logprob in token.top_logprobs:
            top.setdefault(self._token_text(token_id, as_ids), logprob)
        return top

    def _choice_logprobs(
        self,
        body: CompletionRequest,
        prompt: list[int],
        echo: str,
        scored: PromptLogprobs | None,
        generated: list[SampledToken],
        offsets: list[int],
    ) -> dict[str, Any] | None:
        """A completion choice's ``logprobs``: with ``echo``, the prompt's tokens first (at their starts in the echoed
        text, decoded as it was), then the ``generated`` tokens at their ``offsets``."""
        if body.logprobs is None:
            return None
        out = self._completion_logprobs(generated, offsets, self.tokens_as_ids(body))
        if not body.echo:
            return out
        echo_starts = TokenStarts(self.tokenizer, ()).add(prompt)  # (the echo is the prompt decoded alone)
        echoed_tokens = _echoed_tokens(prompt, scored, body.logprobs)
        echo_offsets = text_offsets(echo_starts, 0, len(echo))
        echoed = self._completion_logprobs(echoed_tokens, echo_offsets, self.tokens_as_ids(body))
        return {key: echoed[key] + out[key] for key in out}

    def _prompt_logprobs(self, scored: PromptLogprobs | None, top_k: int) -> list[dict[str, Any] | None] | None:
        """vLLM's ``prompt_logprobs``: per prompt token (None for the first), a map from token id to its logprob, rank
        and text: the prompt's token, then its ``top_k`` most likely alternatives."""
        if scored is None:
            return None
        out: list[dict[str, Any] | None] = []
        for token in scored:
            if token is None:
                out.append(None)
                continue
            entry = {str(token.token_id): self._logprob_entry(token.token_id, token.logprob, token.rank)}
            for rank, (tid, lp) in enumerate(token.top_logprobs[:top_k], 1):
                entry.setdefault(str(tid), self._logprob_entry(tid, lp, rank))
            out.append(entry)
        return out

    def _logprob_entry(self, token_id: int, logprob: float | None, rank: int | None) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": self._token_text(token_id)}


def _prompt_logprobs_wanted(body: CompletionRequest) -> int | None:
    """The alternatives per prompt token the engine is to score: ``prompt_logprobs`` (unstreamed: a stream has no place
    for them), and with ``echo`` the ``logprobs`` (the echoed tokens carry theirs, as vLLM's); None: none."""
    asked = None if body.stream else body.prompt_logprobs
    wanted = [k for k in (asked, body.logprobs if body.echo else None) if k is not None]
    return max(wanted) if wanted else None


def _echoed_tokens(prompt: list[int], scored: PromptLogprobs | None, top_k: int) -> list[SampledToken]:
    """The prompt's tokens as an echo lists them: with their logprobs and ``top_k`` alternatives where scored."""
    if scored is None or len(scored) != len(prompt):  # (none came: a choice that failed before its first token)
        return [SampledToken(t) for t in prompt]
    return [
        SampledToken(t) if e is None else SampledToken(e.token_id, e.logprob, e.rank, e.top_logprobs[:top_k])
        for t, e in zip(prompt, scored, strict=True)
    ]


def _drop_output(choice: Choice) -> None:
    """An echo of the prompt alone (``max_tokens: 0``): the token the engine sampled is not part of the response."""
    choice.text, choice.token_ids, choice.logprobs = "", [], []


def _fingerprint(choices: list[Choice]) -> str:
    """``system_fingerprint``: the engine instances whose tokens ended the response's choices."""
    if len(choices) == 1:  # (asked for each chunk of a stream: one choice's, without a set to sort)
        return "boundless-" + (choices[0].instance or "0")
    return "boundless-" + ",".join(sorted({c.instance for c in choices if c.instance}) or ["0"])


# The routes are defined once, at module level, and find their server in ``request.app.state``: FastAPI
# (0.165) keeps every endpoint function it classifies in process-wide LRU caches, so endpoints made per app
# as closures over the engine client kept each app's engine alive after its server stopped.
routes = APIRouter()


def _server(request: Request) -> OpenAIServer:
    return request.app.state.server


@routes.get("/health")
@routes.get("/ping")  # (SageMaker's, as vLLM serves it)
@routes.post("/ping")
async def health(request: Request) -> Response:
    if not _server(request).client.is_alive():
        return JSONResponse({"status": "unavailable"}, status_code=503)
    return JSONResponse({"status": "ok"})


@routes.get("/version")
async def version() -> Response:
    """vLLM's route: the server's version, which clients written for vLLM read to tell what it takes."""
    return JSONResponse({"version": __version__})


def _model_cards(server: OpenAIServer) -> list[dict[str, Any]]:
    """The models served: the base model under each of its names, then its LoRA adapters as vLLM lists them (the
    adapter's path as its root, the base model's first name as its parent)."""
    base = {
        "id": server.model_name,
        "object": "model",
        "created": server.created,
        "owned_by": "boundless",
        "max_model_len": server.client.max_model_len,
    }
    names = [{**base, "id": name} for name in server.model_names]
    adapters = [{**base, "id": name, "root": path, "parent": server.model_name} for name, path in server.loras.items()]
    return [*names, *adapters]


@routes.get("/v1/models")
@routes.get("/v1/models/")  # (else the retrieve route below takes it for a model named "": it was the listing)
async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": _model_cards(_server(request))})


@routes.get("/v1/models/{model:path}")
async def model(model: str, request: Request) -> Response:
    """OpenAI's retrieve (``client.models.retrieve``): one model's card; 404 ``model_not_found`` for a name not served
    (a model id may hold slashes, as Hugging Face names do)."""
    server = _server(request)
    server.check_model(model)
    return JSONResponse(next(card for card in _model_cards(server) if card["id"] == model))


@routes.get("/cluster")
async def cluster(request: Request) -> Response:
    return JSONResponse({"instances": _server(request).client.cluster_info()})


@routes.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_server(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


class LoadLoRARequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None  # (vLLM's; the name identifies the adapter)


def _runtime_lora_updates(server: OpenAIServer) -> Any:
    """The engine client that loads adapters at run time, or the error that says why there is none."""
    if not server.config.allow_runtime_lora_updating:
        raise APIError(404, "runtime LoRA updating is off: start the server with --allow-runtime-lora-updating")
    if not hasattr(server.client, "add_lora"):
        raise APIError(400, "runtime LoRA updating needs a single engine instance; use --lora-modules with a cluster")
    return server.client


@routes.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRARequest, request: Request) -> Response:
    """vLLM's route: load an adapter, served from now on as a model named ``lora_name``."""
    server = _server(request)
    client = _runtime_lora_updates(server)
    require_valid_text(body.model_dump())
    name = body.lora_name
    if not name.strip():  # (LoRARequest's own refusal named lora_path, the field it blames for a failed load)
        raise APIError(400, "lora_name must not be empty", "lora_name", "invalid_value")
    if name in server.model_names or name in server.loras or name in server.loras_loading:
        raise APIError(400, f"the LoRA adapter {name!r} has already been loaded", "lora_name")
    # The name is taken before the load runs in its thread (no await between the check and this), so a concurrent
    # load of it is refused above rather than loading too and leaving the listing and the engine disagreeing.
    server.loras_loading.add(name)
    try:
        await asyncio.to_thread(client.add_lora, LoRARequest(name, next(server.next_lora_id), body.lora_path))
        server.loras[name] = body.lora_path
    except LoRAError as e:
        raise APIError(400, str(e), "lora_path") from e
    finally:
        server.loras_loading.discard(name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@routes.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRARequest, request: Request) -> Response:
    """vLLM's route: unload an adapter (refused while unfinished requests run with it)."""
    server = _server(request)
    client = _runtime_lora_updates(server)
    require_valid_text(body.model_dump())
    name = body.lora_name
    not_loaded = APIError(404, f"the LoRA adapter {name!r} is not loaded", "lora_name", "model_not_found")
    if name not in server.loras:
        raise not_loaded
    try:
        removed = await asyncio.to_thread(client.remove_lora, name)
    except LoRAError as e:
        raise APIError(400, str(e), "lora_name") from e
    if server.loras.pop(name, None) is None or not removed:  # a concurrent unload of it got there first
        raise not_loaded
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


@routes.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, request: Request) -> Response:
    return await _server(request).chat(body, request)


@routes.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await _server(request).completions(body, request)


@routes.post("/invocations")
async def invocations(request: Request) -> Response:
    """SageMaker's one route, as vLLM serves it: the body's shape says which route answers it (``messages``: chat;
    ``prompt``: completions; ``input``: embeddings, or a classifier's classify; ``query`` and ``documents``: rerank;
    ``text_1`` or ``queries``: score)."""
    from boundless.api import embeddings, scoring
    from boundless.api.validation import validated_body

    try:
        body = await request.json()
    except UNREADABLE_JSON:
        raise APIError(400, "the body is not JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body is not a JSON object")
    server = _server(request)
    if "messages" in body:
        return await server.chat(validated_body(ChatCompletionRequest, body), request)
    if "prompt" in body:
        return await server.completions(validated_body(CompletionRequest, body), request)
    if "query" in body and "documents" in body:
        return await scoring.rerank(validated_body(scoring.RerankRequest, body), request)
    if "text_1" in body or "queries" in body:
        return await scoring.score(validated_body(scoring.ScoreRequest, body), request)
    if "input" in body:
        pooling = server.client.pooling
        if pooling is not None and pooling.classifies:
            return await scoring.classify(validated_body(embeddings.PoolingRequest, body), request)
        return await embeddings.embeddings(validated_body(embeddings.EmbeddingRequest, body), request)
    raise APIError(
        400,
        "the body names no route: messages (chat), prompt (completions), input (embeddings or classify), query and "
        "documents (rerank), text_1 or queries (score)",
    )


def build_app(
    client: EngineClient,
    model_name: str,
    config: ServerConfig | None = None,
    loras: dict[str, str] | None = None,
    defaults: SamplingDefaults = NO_DEFAULTS,
) -> ASGIApp:
    """The ASGI app; guards (body size, API key) wrap the routes, and CORS (the config's) wraps them. ``loras``: the
    LoRA adapters the engine loaded (name -> path), served as models of their own; ``defaults``: the model's sampling
    defaults."""
    config = config or ServerConfig()
    app = FastAPI(title="Boundless", version="0.1.0")
    app.state.server = OpenAIServer(client, model_name, config, loras, defaults)
    # (Imported here: the Responses and Messages routes are built on this module's chat path.)
    from boundless.api.embeddings import routes as embeddings_routes
    from boundless.api.messages import routes as messages_routes
    from boundless.api.responses import ResponsesAPI, ResponseStore
    from boundless.api.responses import routes as responses_routes
    from boundless.api.scoring import routes as scoring_routes
    from boundless.api.tokenize import routes as tokenize_routes

    app.state.responses = ResponsesAPI(app.state.server, ResponseStore(config.max_stored_responses))
    install_error_handlers(app)
    app.include_router(routes)
    app.include_router(responses_routes)
    app.include_router(messages_routes)
    app.include_router(tokenize_routes)
    app.include_router(embeddings_routes)
    app.include_router(scoring_routes)

    outer: ASGIApp = BodyLimit(app, int(config.max_body_mb * (1 << 20)))
    if config.api_key:
        outer = APIKeyAuth(outer, config.api_key)
    # (Outside the key's check: a browser's preflight carries no key, and a 401 needs CORS headers to be read.)
    outer = with_cors(outer, config)
    return CancelledRequests(outer)

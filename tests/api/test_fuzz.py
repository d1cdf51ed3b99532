"""Property-based fuzzing of every route of a live server (a small random model with a chat template that takes
tools, on 127.0.0.1): valid requests of each route, each with a few of its values (at any depth) replaced by edge
values, removed, or joined by unknown ones; raw bodies that are no JSON object; and streams.

Every answer must be a 200 or a 4xx with the route's error object (OpenAI's ``{"error": {"message", "type", "param",
"code"}}``, Anthropic's on ``/v1/messages``), never a 5xx nor a hang; a stream ends with its last event or an error
event, never a cut connection; and after each batch the server still serves a plain request, with no request failed
inside the engine. The fast tests (a few dozen examples) run in the default set; the ``slow`` ones send thousands.
"""

from __future__ import annotations

import gzip
import itertools
import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from served_models import UNITS, WEATHER, Served, serve_hermes

from boundless.api.server import OpenAIServer
from boundless.engine.core import RequestDelta

MODEL = "tiny"
MAX_LEN = 1024  # serve_hermes's
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"
SURROGATE = "\ud800"
TIMEOUT = 60.0  # a request's answer (a stream's every event) within this, else the server hangs

_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0}, "b": {"type": "array", "items": {"type": "string"}}},
    "required": ["a"],
}

# Valid requests of each route that use most of its fields; the fuzzer changes a few of their values.
SEEDS: dict[str, list[dict[str, Any]]] = {
    CHAT: [
        {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3},
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Weather?"}, {"type": "text", "text": "Now"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
                    ],
                },
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
            ],
            "tools": [WEATHER, UNITS],
            "tool_choice": "auto",
            "max_tokens": 4,
            "temperature": 0.7,
            "top_p": 0.9,
            "seed": 1,
            "stop": ["\n\n", "END"],
            "logprobs": True,
            "top_logprobs": 2,
            "logit_bias": {"5": 1.5},
            "presence_penalty": 0.1,
            "n": 2,
        },
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "JSON please"}],
            "max_completion_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _SCHEMA}},
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Pick"}],
            "max_tokens": 3,
            "structured_outputs": {"choice": ["yes", "no"]},
            "top_k": 5,
            "min_p": 0.1,
            "repetition_penalty": 1.1,
            "min_tokens": 1,
            "stop_token_ids": [3],
            "prompt_logprobs": 1,
            "return_token_ids": True,
            "chat_template_kwargs": {"x": 1},
            "priority": 0,
            "program_id": "p",
            "thread_id": "t",
        },
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Call"}],
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "max_tokens": 12,
            "stream": True,
            "parallel_tool_calls": False,
        },
    ],
    COMPLETIONS: [
        {"model": MODEL, "prompt": "Hello", "max_tokens": 3},
        {
            "model": MODEL,
            "prompt": ["Hello", "World"],
            "max_tokens": 3,
            "n": 2,
            "best_of": 2,
            "logprobs": 2,
            "echo": True,
            "stop": "x",
            "seed": 7,
            "temperature": 1.0,
            "frequency_penalty": 0.5,
        },
        {
            "model": MODEL,
            "prompt": [1, 2, 3],
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        {"model": MODEL, "prompt": [[1, 2], [3]], "max_tokens": 0, "echo": True, "logprobs": 1},
        {"model": MODEL, "prompt": "A", "max_tokens": 3, "response_format": {"type": "json_object"}, "suffix": None},
    ],
    RESPONSES: [
        {"model": MODEL, "input": "Hello", "max_output_tokens": 3},
        {
            "model": MODEL,
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            ],
            "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}],
            "max_output_tokens": 4,
            "top_logprobs": 2,
            "include": ["message.output_text.logprobs"],
            "metadata": {"k": "v"},
            "stream": True,
        },
        {
            "model": MODEL,
            "input": "JSON",
            "max_output_tokens": 4,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": _SCHEMA}},
            "truncation": "auto",
            "store": False,
        },
    ],
    MESSAGES: [
        {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "Hello"}]},
        {
            "model": MODEL,
            "max_tokens": 4,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny", "is_error": False}],
                },
            ],
            "tools": [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
            "tool_choice": {"type": "auto"},
            "stop_sequences": ["END"],
            "temperature": 0.5,
            "top_k": 3,
            "stream": True,
        },
        {
            "model": MODEL,
            "max_tokens": 3,
            "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well"}],
            "metadata": {"user_id": "u"},
        },
    ],
    COUNT_TOKENS: [{"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "system": "Be brief."}],
    TOKENIZE: [
        {"model": MODEL, "prompt": "Hello", "return_token_strs": True},
        {"messages": [{"role": "user", "content": "Hello"}], "tools": [WEATHER], "add_generation_prompt": True},
    ],
    DETOKENIZE: [{"model": MODEL, "tokens": [1, 2, 3]}],
}
POST_ROUTES = list(SEEDS)

# Values the fuzzer puts in place of others: every JSON type, the edges of integers and floats, text that is
# empty, long, astral or not Unicode at all (a lone surrogate), strings that name numbers, and nested containers.
EDGE_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    1,
    -1,
    2,
    3,
    100,
    MAX_LEN,
    MAX_LEN + 1,
    2**31,
    2**63 - 1,
    2**63,
    2**64,
    -(2**63) - 1,
    10**30,
    0.0,
    -0.0,
    0.5,
    1.5,
    -2.5,
    1e-320,
    1e308,
    float("nan"),
    float("inf"),
    float("-inf"),
    "",
    " ",
    "0",
    "1",
    "NaN",
    "inf",
    "-Infinity",
    "null",
    "true",
    "auto",
    "none",
    "required",
    "function",
    "text",
    "user",
    "assistant",
    "tool",
    "json_schema",
    SURROGATE,
    "a" + SURROGATE + "b",
    "\x00",
    "\u2028",
    "😀",
    "x" * 10_000,
    [],
    [None],
    [0],
    [""],
    [[]],
    [[[[[]]]]],
    {},
    {"": None},
    {"type": "text", "text": "hi"},
    {"type": "image_url", "image_url": {"url": "data:,"}},
    {"type": "object", "properties": {"a": {"$ref": "#"}}},
    {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
]

_text = st.text(max_size=8) | st.sampled_from(["", SURROGATE, "😀", "x" * 300])
_scalar = st.sampled_from(EDGE_VALUES) | st.integers() | st.floats() | _text | st.booleans() | st.none()
_json = st.recursive(
    _scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3), max_leaves=8
)


def _paths(value: Any, path: tuple = ()) -> Iterator[tuple]:
    """Every path into ``value`` (keys and indices), itself first."""
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*path, i))


def _copy(value: Any) -> Any:
    return json.loads(_encode(value))


def _mutate(body: Any, draw: Any) -> Any:
    """``body`` with one change at a drawn path: a value replaced, a key removed, an unknown key added, a value
    wrapped in a list or nested deep, or a list emptied or repeated."""
    paths = [p for p in _paths(body) if len(p) <= 8]  # (not inside a value nested deep by an earlier change)
    path = draw(st.sampled_from(paths))
    op = draw(st.sampled_from(["replace", "replace", "replace", "delete", "add", "wrap", "deep", "repeat"]))
    if not path:
        if op == "add" and isinstance(body, dict):
            body[draw(_text)] = draw(_json)
            return body
        return draw(_json) if op == "replace" else body
    *parent_path, last = path
    parent = body
    for p in parent_path:
        parent = parent[p]
    old = parent[last]
    if op == "replace":
        parent[last] = draw(_json)
    elif op == "delete":
        del parent[last]
    elif op == "add" and isinstance(old, dict):
        old[draw(_text)] = draw(_json)
    elif op == "wrap":
        parent[last] = [old]
    elif op == "deep":
        deep: Any = old
        for _ in range(draw(st.integers(2, 64))):
            deep = draw(st.sampled_from([[deep], {"a": deep}, {"type": "array", "items": deep}]))
        parent[last] = deep
    elif op == "repeat":
        parent[last] = [old] * draw(st.integers(0, 40)) if not isinstance(old, list) else old * 30
    else:
        parent[last] = draw(_json)
    return body


@st.composite
def requests(draw: Any, routes: tuple[str, ...] = tuple(POST_ROUTES)) -> tuple[str, Any]:
    route = draw(st.sampled_from(routes))
    body = _copy(draw(st.sampled_from(SEEDS[route])))
    for _ in range(draw(st.integers(1, 3))):
        body = _copy(_mutate(body, draw))
    return route, body


# Values for named fields, near their limits: the fuzzer's second way, which sets a few fields of a request that
# otherwise serves (the first changes any value, most often into one the schema refuses).
_ints = st.sampled_from([0, 1, -1, 2, 5, 20, 21, 128, 129, MAX_LEN - 1, MAX_LEN, MAX_LEN + 1, 2**31, 2**63 - 1, 2**63])
_ints = _ints | st.integers(-3, 2000)
_floats = st.sampled_from([0.0, -0.0, 1e-9, 0.5, 1.0, 1.5, 2.0, 2.0001, 100.0, -100.0, 1e30]) | st.floats(-3, 3)
_words = st.sampled_from(["", " ", "\n", "a", "the", "<|im_end|>", "<tool_call>", "😀", SURROGATE, "x" * 3000]) | _text
_ids = st.lists(_ints, max_size=5)
_schemas = (
    st.sampled_from(
        [
            {},
            {"type": "object"},
            {"type": "string", "maxLength": 0},
            {"type": "string", "minLength": 5, "maxLength": 2},
            {"type": "integer", "minimum": 5, "maximum": 1},
            {"enum": []},
            {"enum": ["a", 1, None, {"b": []}]},
            {"const": "x"},
            {"type": "array", "minItems": 10**9},
            {"type": ["string", "null"]},
            {"anyOf": []},
            {"allOf": [{"type": "string"}, {"type": "integer"}]},
            {"not": {}},
            {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
            {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
            {"$ref": "#/nowhere"},
            {"$ref": "http://example.com/schema"},
            {"type": "string", "pattern": "("},
            {"type": "string", "pattern": "[a-z]{3,1}"},
            {"type": "string", "format": "date-time"},
            {"type": "object", "additionalProperties": False, "required": ["x"]},
            {"type": "object", "patternProperties": {"^a": {"type": "integer"}}},
            {"type": "number", "multipleOf": 0},
            _SCHEMA,
        ]
    )
    | _json
)
_tool = st.builds(
    lambda name, params, strict: {
        "type": "function",
        "function": {"name": name, "parameters": params, "strict": strict},
    },
    st.sampled_from(["f", "get_weather", "a.b:c/d-e", "", "x" * 129, "bad name", SURROGATE]),
    _schemas,
    st.none() | st.booleans(),
)
_SAMPLING: dict[str, Any] = {
    "max_tokens": _ints,
    "n": _ints,
    "temperature": _floats,
    "top_p": _floats,
    "top_k": _ints,
    "min_p": _floats,
    "seed": _ints | st.integers(),
    "presence_penalty": _floats,
    "frequency_penalty": _floats,
    "repetition_penalty": _floats,
    "min_tokens": _ints,
    "stop": _words | st.lists(_words, max_size=6),
    "stop_token_ids": _ids,
    "allowed_token_ids": _ids,
    "bad_words": st.lists(_words, max_size=4),
    "logit_bias": st.dictionaries(
        st.sampled_from(["0", "5", "383", "384", "-1", "1e3", " 5", "٥", "5.0", "x"]), _floats
    ),
    "prompt_logprobs": _ints,
    "truncate_prompt_tokens": _ints,
    "priority": _ints,
    "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "return_token_ids": st.booleans(),
    "return_tokens_as_token_ids": st.booleans(),
    "cache_salt": _words,
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
    ),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}])
    | _schemas.map(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}),
    "structured_outputs": st.one_of(
        _schemas.map(lambda s: {"json": s}),
        _words.map(lambda r: {"regex": r}),
        st.lists(_words, max_size=3).map(lambda c: {"choice": c}),
        _words.map(lambda g: {"grammar": g}),
        st.sampled_from(['root ::= "a" root', "root ::= [^\\x00-\\U0010ffff]", 'root ::= "yes" | "no"']).map(
            lambda g: {"grammar": g}
        ),
        st.just({"json_object": True}),
    ),
}
FIELDS: dict[str, dict[str, Any]] = {
    CHAT: {
        **_SAMPLING,
        "max_completion_tokens": _ints,
        "logprobs": st.booleans(),
        "top_logprobs": _ints,
        "tools": st.lists(_tool, max_size=3),
        "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]),
        "parallel_tool_calls": st.booleans(),
        "add_generation_prompt": st.booleans(),
        "continue_final_message": st.booleans(),
        "chat_template_kwargs": st.dictionaries(_text, _json, max_size=2),
        "thinking_token_budget": _ints,
        "reasoning_effort": st.sampled_from(["low", "high", "none", "max"]),
        "prediction": _words.map(lambda t: {"type": "content", "content": t}),
        "messages": st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "x"]),
                    "content": st.none() | _words | st.lists(st.sampled_from(EDGE_VALUES[-4:]) | _json, max_size=3),
                },
                optional={"name": _words, "tool_call_id": _words, "tool_calls": _json, "reasoning_content": _words},
            ),
            max_size=4,
        ),
    },
    COMPLETIONS: {
        **_SAMPLING,
        "logprobs": _ints,
        "echo": st.booleans(),
        "best_of": _ints,
        "suffix": st.none() | _words,
        "prompt": _words | st.lists(_words, max_size=3) | _ids | st.lists(_ids, max_size=3),
    },
    RESPONSES: {
        "max_output_tokens": _ints,
        "temperature": _floats,
        "top_p": _floats,
        "top_logprobs": _ints,
        "stream": st.booleans(),
        "store": st.booleans(),
        "truncation": st.sampled_from(["auto", "disabled"]),
        "instructions": _words,
        "previous_response_id": st.sampled_from(["resp_x", ""]),
        "include": st.lists(st.sampled_from(["message.output_text.logprobs", "reasoning.encrypted_content", "x"])),
        "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "name": "f"}]),
        "tools": st.lists(_tool.map(lambda t: {"type": "function", **t["function"]}), max_size=2),
        "text": _schemas.map(lambda s: {"format": {"type": "json_schema", "name": "x", "schema": s}}),
        "reasoning": st.sampled_from([{}, {"effort": "low"}, {"effort": "x"}]),
        "input": _words
        | st.lists(
            st.sampled_from(
                [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
                    {"role": "developer", "content": [{"type": "input_text", "text": "be brief"}]},
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"},
                    {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": "x"}]},
                    {"type": "reasoning", "summary": []},
                    {"type": "message", "role": "user", "content": [{"type": "input_file", "file_id": "f"}]},
                ]
            )
            | _json,
            max_size=4,
        ),
    },
    MESSAGES: {
        "max_tokens": _ints,
        "temperature": _floats,
        "top_p": _floats,
        "top_k": _ints,
        "stream": st.booleans(),
        "stop_sequences": st.lists(_words, max_size=3),
        "system": _words | st.lists(st.sampled_from([{"type": "text", "text": "x"}, {"type": "image"}]) | _json),
        "thinking": st.sampled_from([{"type": "enabled", "budget_tokens": 10}, {"type": "disabled"}, {}]),
        "tool_choice": st.sampled_from(
            [{"type": "auto"}, {"type": "any"}, {"type": "none"}, {"type": "tool", "name": "f"}, {"type": "tool"}]
        ),
        "tools": st.lists(
            st.builds(lambda n, s: {"name": n, "input_schema": s}, st.sampled_from(["f", "", "a b"]), _schemas),
            max_size=2,
        ),
        "messages": st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["user", "assistant", "system"]),
                    "content": _words
                    | st.lists(
                        st.sampled_from(
                            [
                                {"type": "text", "text": "hi"},
                                {"type": "image", "source": {"type": "base64", "data": ""}},
                                {"type": "tool_use", "id": "t", "name": "f", "input": {}},
                                {"type": "tool_use", "id": "t", "name": "f", "input": "x"},
                                {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "r"}]},
                                {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]},
                                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                                {"type": "redacted_thinking", "data": "x"},
                            ]
                        )
                        | _json,
                        max_size=3,
                    ),
                }
            ),
            max_size=3,
        ),
    },
    TOKENIZE: {
        "prompt": _words,
        "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "x"]), "content": _words})),
        "add_special_tokens": st.booleans(),
        "add_generation_prompt": st.booleans(),
        "continue_final_message": st.booleans(),
        "return_token_strs": st.booleans(),
        "tools": st.lists(_tool, max_size=2),
        "chat_template_kwargs": st.dictionaries(_text, _json, max_size=2),
    },
    DETOKENIZE: {"tokens": _ids | st.lists(_json, max_size=3)},
}
FIELDS[COUNT_TOKENS] = {k: v for k, v in FIELDS[MESSAGES].items() if k not in ("max_tokens", "stream")}


@st.composite
def field_requests(draw: Any, routes: tuple[str, ...] = tuple(POST_ROUTES)) -> tuple[str, Any]:
    """A route's plainest request with one to four of its fields set to values near their limits."""
    route = draw(st.sampled_from(routes))
    body = _copy(SEEDS[route][0])
    fields = FIELDS[route]
    for name in draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=4, unique=True)):
        body[name] = draw(fields[name] | _json) if draw(st.integers(0, 9)) == 0 else draw(fields[name])
    return route, body


def _strict_json(text: str) -> Any:
    """JSON as RFC 8259 has it: no NaN or Infinity (which Python's json writes and reads by default)."""

    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


# The error types by status, OpenAI's and Anthropic's.
OPENAI_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",  # (a stream's error event: a failure after it began)
}
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
}
# What a POST route's request alone can be refused with (as OpenAI and vLLM refuse it): 400 for any invalid body
# (never FastAPI's 422), 404 for what names something not here (a model, a stored response), 413 for a body too
# large. 405 only on paths that are no POST route; 429 and 503 only for a server's load or state.
POST_STATUSES = (200, 400, 404, 413)
NOT_FOUND_PARAMS = ("model", "previous_response_id")


def error_problem(route: str, r: httpx.Response) -> str | None:
    """Why ``r``, a 4xx, is not the route's error object, of the type its status has, or None."""
    try:
        body = _strict_json(r.text)
    except ValueError as e:
        return f"error body is not JSON ({e}): {r.text[:300]!r}"
    status = r.status_code
    if route.startswith(MESSAGES):
        if not (
            isinstance(body, dict)
            and body.get("type") == "error"
            and isinstance(body.get("error"), dict)
            and isinstance(body["error"].get("type"), str)
            and isinstance(body["error"].get("message"), str)
            and body["error"]["message"]
        ):
            return f"not Anthropic's error object: {body}"
        if body["error"]["type"] != ANTHROPIC_TYPES.get(status):
            return f"a {status} of type {body['error']['type']}: {body}"
        return None
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return f"not an OpenAI error object: {body}"
    error = body["error"]
    if set(error) != {"message", "type", "param", "code"}:
        return f"not an OpenAI error object: {body}"
    if not isinstance(error["message"], str) or not error["message"] or not isinstance(error["type"], str):
        return f"bad message or type: {body}"
    if error["param"] is not None and not isinstance(error["param"], str):
        return f"bad param: {body}"
    if error["type"] != OPENAI_TYPES.get(status):
        return f"a {status} of type {error['type']}: {body}"
    if status == 404 and route in SEEDS and error["param"] not in NOT_FOUND_PARAMS:
        return f"a 404 for no model or stored response: {body}"
    return None


def _sse_problem(route: str, events: list[tuple[str | None, str]]) -> str | None:
    """Why a stream's events (event name, data) do not end as the route's streams end, or None."""
    if not events:
        return "an empty stream"
    for _, data in events:
        if data != "[DONE]":
            try:
                _strict_json(data)
            except ValueError as e:
                return f"an event is not JSON ({e}): {data[:300]!r}"
    last = events[-1][1]
    if route in (CHAT, COMPLETIONS):
        if last != "[DONE]":
            return f"the stream ends without [DONE]: {last[:300]!r}"
        errors = [json.loads(d) for _, d in events[:-1] if '"error"' in d and "error" in json.loads(d)]
        for e in errors:
            if error_problem(route, httpx.Response(500, text=json.dumps(e))):
                return f"a bad error event: {e}"
        return None
    if route == RESPONSES:
        kind = json.loads(last).get("type")
        if kind not in ("response.completed", "response.incomplete", "response.failed", "error"):
            return f"the stream ends with {kind}: {last[:300]!r}"
        return None
    if route == MESSAGES:
        kind = json.loads(last).get("type")
        if kind not in ("message_stop", "error"):
            return f"the stream ends with {kind}: {last[:300]!r}"
        return None
    return None


def _read_sse(r: httpx.Response) -> list[tuple[str | None, str]]:
    events: list[tuple[str | None, str]] = []
    name: str | None = None
    data: list[str] = []
    for line in r.iter_lines():
        if line.startswith("event:"):
            name = line.removeprefix("event:").strip()
        elif line.startswith("data:"):
            data.append(line.removeprefix("data:").removeprefix(" "))
        elif not line and data:
            events.append((name, "\n".join(data)))
            name, data = None, []
    if data:
        events.append((name, "\n".join(data)))
    return events


def send(
    client: httpx.Client,
    route: str,
    content: bytes,
    headers: dict[str, str] | None = None,
    method: str = "POST",
) -> str | None:
    """Send a request; why its answer breaks the server's promise, or None."""
    headers = {"content-type": "application/json", **(headers or {})}
    try:
        with client.stream(method, route, content=content, headers=headers) as r:
            if r.status_code >= 500 or not (r.status_code == 200 or 400 <= r.status_code < 500):
                r.read()
                return f"status {r.status_code}: {r.text[:500]}"
            if r.status_code != 200:
                r.read()
                if method == "POST" and route in SEEDS and r.status_code not in POST_STATUSES:
                    return f"status {r.status_code} (not {POST_STATUSES}): {r.text[:300]}"
                return error_problem(route, r)
            if r.headers.get("content-type", "").startswith("text/event-stream"):
                return _sse_problem(route, _read_sse(r))
            r.read()
            try:
                _strict_json(r.text)
            except ValueError as e:
                return f"a 200 whose body is not JSON ({e}): {r.text[:300]!r}"
            return None
    except httpx.TimeoutException:
        return "no answer in time (a hang)"
    except httpx.TransportError as e:
        return f"a broken connection: {type(e).__name__}: {e}"


def _encode(body: Any) -> bytes:
    return json.dumps(body).encode("utf-8", "surrogatepass")


INJECTED_FAILURES = [0]  # requests the tests failed in the engine themselves (FailAfterFirstToken)


def still_serving(client: httpx.Client) -> None:
    r = client.post(CHAT, json=SEEDS[CHAT][0])
    assert r.status_code == 200, r.text
    r = client.post(MESSAGES, json=SEEDS[MESSAGES][0])
    assert r.status_code == 200, r.text
    text = client.get("/metrics").text
    pattern = r'^boundless_requests_finished_total\{[^}]*finish_reason="error"[^}]*\} (\S+)$'
    failed = sum(float(v) for v in re.findall(pattern, text, flags=re.MULTILINE))
    assert failed == INJECTED_FAILURES[0], "a request failed in the engine"  # (only those the test failed)


# -- the server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serve_hermes(tmp_path_factory.mktemp("fuzz")) as s:
        yield s


@pytest.fixture(scope="module")
def client(served: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.url, timeout=TIMEOUT) as c:
        yield c


def _fuzz(client: httpx.Client, route: str, body: Any) -> None:
    why = send(client, route, _encode(body))
    assert why is None, f"{route} {_encode(body)[:2000]!r}: {why}"


_FAST = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
_SLOW = settings(max_examples=10_000, deadline=None, suppress_health_check=list(HealthCheck))


@_FAST
@given(request=requests())
def test_changed_requests_are_served_or_refused(client: httpx.Client, request: tuple[str, Any]) -> None:
    _fuzz(client, *request)


@_FAST
@given(request=field_requests())
def test_requests_with_fields_near_their_limits_are_served_or_refused(
    client: httpx.Client, request: tuple[str, Any]
) -> None:
    _fuzz(client, *request)


@pytest.mark.slow
@_SLOW
@given(request=requests() | field_requests())
def test_many_changed_requests_are_served_or_refused(client: httpx.Client, request: tuple[str, Any]) -> None:
    _fuzz(client, *request)


@pytest.fixture(scope="module")
def stored_responses(client: httpx.Client) -> list[str]:
    """Ids of stored responses to chain from: a plain one, one that called a tool, and one chained from that."""
    ids = []
    for body in (
        SEEDS[RESPONSES][0],
        {**SEEDS[RESPONSES][1], "stream": False, "tool_choice": "required"},
    ):
        r = client.post(RESPONSES, json=body)
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
    r = client.post(RESPONSES, json={**SEEDS[RESPONSES][0], "previous_response_id": ids[-1]})
    assert r.status_code == 200, r.text
    return [*ids, r.json()["id"]]


@_FAST
@given(request=field_requests((RESPONSES,)) | requests((RESPONSES,)), which=st.integers(0, 2))
def test_chained_responses_are_served_or_refused(
    client: httpx.Client, stored_responses: list[str], request: tuple[str, Any], which: int
) -> None:
    route, body = request
    if isinstance(body, dict):
        body["previous_response_id"] = stored_responses[which]
    _fuzz(client, route, body)
    response_id = stored_responses[which]
    for path in (f"{RESPONSES}/{response_id}", f"{RESPONSES}/{response_id}/input_items"):
        assert send(client, path, b"", method="GET") is None


_BATCH = st.lists(requests() | field_requests(), min_size=2, max_size=6)


def _fuzz_beside_a_plain_stream(served: Served, batch: list[tuple[str, Any]]) -> None:
    """Send ``batch`` at once, beside a plain streamed chat: each is served or refused, and the stream (sharing the
    engine's steps with them) ends as it would alone."""
    plain = {**SEEDS[CHAT][0], "max_tokens": 8, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=served.url, timeout=TIMEOUT) as c, ThreadPoolExecutor(len(batch) + 1) as pool:
        stream = pool.submit(lambda: c.post(CHAT, json=plain).text)
        whys = list(pool.map(lambda req: send(c, req[0], _encode(req[1])), batch))
        events = [json.loads(line[6:]) for line in stream.result().splitlines() if line.startswith("data: {")]
    problems = [
        f"{route} {_encode(body)[:500]!r}: {why}" for (route, body), why in zip(batch, whys, strict=True) if why
    ]
    assert not problems, "\n".join(problems)
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length", events[-3:]


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(batch=_BATCH)
def test_concurrent_changed_requests_leave_a_plain_stream_alone(served: Served, batch: list[tuple[str, Any]]) -> None:
    _fuzz_beside_a_plain_stream(served, batch)


@pytest.mark.slow
@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=_BATCH)
def test_many_concurrent_changed_requests_leave_a_plain_stream_alone(
    served: Served, batch: list[tuple[str, Any]]
) -> None:
    _fuzz_beside_a_plain_stream(served, batch)


# Bodies that are no JSON object, each sent to every route with and without the JSON content type.
RAW_BODIES: list[bytes] = [
    b"",
    b"not json",
    b'{"model": ',
    b"[]",
    b"null",
    b"1",
    b'"text"',
    b"[{}]",
    b"\xff\xfe{}",
    b'{"model": "\xed\xa0\x80"}',
    b"\x00" * 100,
    b"{" * 100_000,
    b"[" * 5_000 + b"]" * 5_000,
    b'{"model": "tiny", "model": 1, "messages": [], "messages": [{"role": "user", "content": "hi"}]}',
    b'{"model": "tiny", "prompt": NaN, "messages": Infinity, "max_tokens": -Infinity}',
    gzip.compress(json.dumps(SEEDS[CHAT][0]).encode()),
]
_HEADERS: list[dict[str, str]] = [
    {},
    {"content-type": "text/plain"},
    {"content-type": "application/x-www-form-urlencoded"},
    {"content-type": "application/json; charset=latin-1"},
    {"content-encoding": "gzip"},
]


@pytest.mark.parametrize("route", POST_ROUTES)
def test_raw_bodies_are_refused_with_the_routes_error(client: httpx.Client, route: str) -> None:
    problems = []
    for raw in RAW_BODIES:
        for headers in _HEADERS:
            why = send(client, route, raw, headers)
            if why:
                problems.append(f"{raw[:60]!r} {headers}: {why}")
    assert not problems, "\n".join(problems)
    still_serving(client)


@_FAST
@given(raw=st.binary(max_size=200) | _json.map(_encode), route=st.sampled_from(POST_ROUTES))
def test_any_bytes_are_served_or_refused(client: httpx.Client, raw: bytes, route: str) -> None:
    why = send(client, route, raw)
    assert why is None, f"{route} {raw[:300]!r}: {why}"


_segment = st.text(
    st.characters(codec="utf-8", exclude_characters="/?#", exclude_categories=["Cc"]), min_size=1, max_size=12
)


@_FAST
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
    path=st.sampled_from(
        ["/v1/models/{}", "/v1/responses/{}", "/v1/responses/{}/input_items", "/v1/messages/{}", "/{}", "/v1/{}"]
    ),
    segment=_segment,
    query=st.dictionaries(st.sampled_from(["limit", "order", "after", "include", "x"]), _text.filter(str.isprintable)),
)
def test_any_path_is_served_or_refused(
    client: httpx.Client, method: str, path: str, segment: str, query: dict[str, str]
) -> None:
    route = path.format(segment)
    url = httpx.URL(route, params=query)
    why = send(client, str(url), b"{}", method=method)
    assert why is None, f"{method} {url}: {why}"


def test_still_serving_after_the_fuzzing(client: httpx.Client) -> None:
    # After the hypothesis tests in file order; on its own it checks a fresh server.
    still_serving(client)


# -- what the fuzzing found --------------------------------------------------------------------


def _error(r: httpx.Response) -> dict[str, Any]:
    assert 400 <= r.status_code < 500, r.text
    return r.json()["error"]


def test_a_number_json_cannot_carry_is_a_400_naming_it(client: httpx.Client) -> None:
    """NaN, Infinity and 1e999 (which Python's JSON reads as numbers) anywhere in a body are a 400 naming where. A
    Responses request's tool schema holding one was a 500: the response echoes its tools, and JSON cannot write it."""
    tool = b'{"type": "function", "name": "f", "parameters": {"type": "object", "x": %s}}'
    for number in (b"NaN", b"Infinity", b"-Infinity", b"1e999"):
        body = b'{"model": "tiny", "input": "hi", "max_output_tokens": 2, "tools": [%s]}' % (tool % number)
        r = client.post(RESPONSES, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and _error(r)["param"] == "tools.0.parameters.x", r.text
        body = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "meta": [%s]}'
        r = client.post(CHAT, content=body % number, headers={"content-type": "application/json"})
        assert r.status_code == 400 and _error(r)["param"] == "meta.0", r.text
    still_serving(client)


def test_tool_properties_that_are_no_object_of_schemas_are_a_400(client: httpx.Client) -> None:
    """A function's ``parameters.properties`` that is a list or a string (or holds one where a schema goes) was a
    500 on every route that takes tools: the route read the properties' schemas to type a call's values."""
    for properties in ([{"city": {"type": "string"}}], "city", {"city": "string"}):
        parameters = {"type": "object", "properties": properties}
        chat = {**SEEDS[CHAT][0], "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}]}
        r = client.post(CHAT, json=chat)
        assert r.status_code == 400 and _error(r)["code"] == "invalid_function_parameters", r.text
        assert _error(r)["param"] == "tools.0.function.parameters"
        response = {**SEEDS[RESPONSES][0], "tools": [{"type": "function", "name": "f", "parameters": parameters}]}
        r = client.post(RESPONSES, json=response)
        assert r.status_code == 400 and _error(r)["param"] == "tools.0.parameters", r.text
        message = {**SEEDS[MESSAGES][0], "tools": [{"name": "f", "input_schema": parameters}]}
        r = client.post(MESSAGES, json=message)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    still_serving(client)


def test_no_such_route_or_method_on_anthropics_paths_is_anthropics_error(client: httpx.Client) -> None:
    """``GET /v1/messages`` (405) and ``POST /v1/messages/nothing`` (404) answer with Anthropic's error object, as
    the Messages routes' own errors do; they were OpenAI's."""
    for r, status in ((client.get(MESSAGES), 405), (client.post(MESSAGES + "/nothing", json={}), 404)):
        assert r.status_code == status
        assert r.json()["type"] == "error" and r.json()["error"]["type"] in ("invalid_request_error", "not_found_error")
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"  # (OpenAI's elsewhere)


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def test_a_schema_nested_too_deep_is_refused_at_once(client: httpx.Client) -> None:
    """A schema 900 levels deep took minutes to compile (xgrammar's time grows with about the cube of the depth):
    the request hung, a worker thread busy all the while. Past 64 levels it is a 400 at once, on every route that
    compiles one; a schema of 40 levels is served."""
    deep = _nested(900)
    bodies = [
        (
            CHAT,
            {
                **SEEDS[CHAT][0],
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": deep}},
            },
        ),
        (COMPLETIONS, {**SEEDS[COMPLETIONS][0], "structured_outputs": {"json": json.dumps(deep)}}),
        (RESPONSES, {**SEEDS[RESPONSES][0], "text": {"format": {"type": "json_schema", "name": "x", "schema": deep}}}),
        (
            CHAT,
            {
                **SEEDS[CHAT][0],
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": deep}}},
                    }
                ],
                "tool_choice": "required",
            },
        ),
    ]
    for route, body in bodies:
        r = client.post(route, json=body, timeout=20)
        assert r.status_code == 400 and "levels deep" in _error(r)["message"], r.text
    r = client.post(
        MESSAGES,
        json={
            **SEEDS[MESSAGES][0],
            "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"a": deep}}}],
            "tool_choice": {"type": "any"},
        },
        timeout=20,
    )
    assert r.status_code == 400 and "levels deep" in r.json()["error"]["message"], r.text
    fine = {"type": "json_schema", "json_schema": {"name": "x", "schema": _nested(40)}}
    assert client.post(CHAT, json={**SEEDS[CHAT][0], "response_format": fine}).status_code == 200


_LONG = "hello world " * 150_000  # 1.8 MB, 1.5 million tokens: about a second to tokenize
HUGE = [
    (COMPLETIONS, {"model": MODEL, "prompt": _LONG, "max_tokens": 2}, 400),  # (past the context)
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": _LONG}], "max_tokens": 2}, 400),
    (RESPONSES, {"model": MODEL, "input": _LONG, "max_output_tokens": 2}, 400),
    (TOKENIZE, {"prompt": _LONG}, 200),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": 2, "bad_words": [_LONG]}, 200),
    (CHAT, {**SEEDS[CHAT][0], "prediction": {"type": "content", "content": _LONG}}, 400),  # (past the context)
]


@pytest.mark.parametrize(("route", "body", "status"), HUGE, ids=[f"{r}-{sorted(b)[-1]}" for r, b, _ in HUGE])
def test_a_huge_text_does_not_stall_the_other_requests(
    client: httpx.Client, served: Served, route: str, body: dict[str, Any], status: int
) -> None:
    """Text of megabytes takes a second or more to tokenize; on the event loop holding the GIL (a prompt, a
    prediction), or in the engine as it took the request (a bad word), it stalled every other request of the server
    (and every other thread of the process) for as long: a plain completion waited 4 s behind a 7 MB prompt, 12 s
    behind a 6 MB bad word. Now others are answered meanwhile: no gap between answers is half as long as the huge
    request."""
    content = _encode(body)
    result: dict[str, float] = {}

    def huge() -> None:
        headers = {"content-type": "application/json"}
        r = httpx.post(served.url + route, content=content, headers=headers, timeout=TIMEOUT)
        result["status"] = r.status_code
        result["end"] = time.monotonic()

    start = time.monotonic()
    worker = threading.Thread(target=huge)
    worker.start()
    answered = [start]
    while worker.is_alive() and len(answered) < 200:
        assert client.post(COMPLETIONS, json=SEEDS[COMPLETIONS][0]).status_code == 200
        answered.append(time.monotonic())
        time.sleep(0.02)
    worker.join()
    assert result["status"] == status
    moments = sorted([*answered, result["end"]])
    gap = max(b - a for a, b in itertools.pairwise(moments))
    assert gap < (result["end"] - start) / 2, (gap, result["end"] - start, len(answered))


class FailAfterFirstToken:
    """Step hooks (an engine's ``hooks``) that fail every running request that has sampled a token (``after``
    tokens), as a failed step or a lost instance fails it: its stream has begun."""

    def __init__(self, core: Any, after: int = 1) -> None:
        self.core = core
        self.after = after

    def between_steps(self) -> list[RequestDelta]:
        begun = [r.request_id for r in self.core.scheduler.running if len(r.output_token_ids) >= self.after]
        failed = [rid for rid in begun if self.core.abort(rid)]
        INJECTED_FAILURES[0] += len(failed)
        return [RequestDelta(rid, [], "", [], finished=True, finish_reason="error") for rid in failed]

    def step_failed(self, error: Exception, sched: Any) -> bool:
        return False


STREAMS = [
    (CHAT, {**SEEDS[CHAT][0], "max_tokens": 40, "ignore_eos": True, "stream": True, "n": 2}),
    (COMPLETIONS, {**SEEDS[COMPLETIONS][0], "max_tokens": 40, "ignore_eos": True, "stream": True}),
    # (Greedy: the Responses API has no seed nor ignore_eos, and a sampled answer ended before the failure now and
    # then; this model's greedy answer runs past it.)
    (RESPONSES, {**SEEDS[RESPONSES][0], "max_output_tokens": 40, "stream": True, "temperature": 0}),
    (MESSAGES, {**SEEDS[MESSAGES][0], "max_tokens": 40, "ignore_eos": True, "stream": True}),
]


@pytest.mark.parametrize(("route", "body"), STREAMS, ids=[route for route, _ in STREAMS])
def test_a_stream_that_fails_after_it_began_ends_with_an_error_event(
    client: httpx.Client, served: Served, route: str, body: dict[str, Any]
) -> None:
    engine = served.engine
    with engine.lock:
        engine.hooks = FailAfterFirstToken(engine.core, after=8 if route == RESPONSES else 1)
    try:
        with client.stream("POST", route, json=body) as r:
            assert r.status_code == 200
            events = _read_sse(r)
    finally:
        with engine.lock:
            engine.hooks = None
    assert _sse_problem(route, events) is None, events
    datas = [json.loads(d) for _, d in events if d != "[DONE]"]
    if route == RESPONSES:
        assert datas[-1]["type"] == "response.failed", datas[-1]
        # Every item opened is closed, and the failed response holds them as the events left them.
        added = [d["item"]["id"] for d in datas if d["type"] == "response.output_item.added"]
        done = [d["item"] for d in datas if d["type"] == "response.output_item.done"]
        assert added and [item["id"] for item in done] == added, datas
        assert datas[-1]["response"]["output"] == done and all(item["status"] == "incomplete" for item in done)
        streamed = "".join(d["delta"] for d in datas if d["type"] == "response.output_text.delta")
        assert done[-1]["content"][0]["text"] == streamed
    else:
        assert "error" in datas[-1], datas[-1]  # (Anthropic's error event, or OpenAI's error object)


def test_anthropics_routes_refuse_a_body_nested_past_the_parsers_stack(client: httpx.Client) -> None:
    """The Messages routes read their body themselves: JSON nested thousands deep was a RecursionError, a 500."""
    for route in (MESSAGES, COUNT_TOKENS):
        r = client.post(route, content=b"[" * 5_000 + b"]" * 5_000, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert r.json()["error"]["message"] == "the body is not valid JSON: it nests too deep"


def test_count_tokens_refuses_a_lone_surrogate_as_the_messages_route_does(client: httpx.Client) -> None:
    """``/v1/messages/count_tokens`` handed text that is not Unicode to the tokenizer: a TypeError, a 500."""
    body = _encode({"model": MODEL, "messages": [{"role": "user", "content": SURROGATE}]})
    for route in (MESSAGES, COUNT_TOKENS):
        r = client.post(route, content=body.replace(b"}]", b'}], "max_tokens": 2', 1) if route == MESSAGES else body)
        assert r.status_code == 400 and "not valid Unicode" in r.json()["error"]["message"], (route, r.text)


def test_the_least_double_as_repetition_penalty_is_served(client: httpx.Client) -> None:
    """``repetition_penalty: 5e-324`` (in its range, (0, 100]) made the sampler's row NaN: the engine's step failed,
    a 500 for every request of it."""
    for route in (CHAT, COMPLETIONS):
        r = client.post(route, json={**SEEDS[route][0], "repetition_penalty": 5e-324, "temperature": 1.0})
        assert r.status_code == 200, r.text
    still_serving(client)


def test_a_prediction_longer_than_the_context_is_a_400(client: httpx.Client) -> None:
    """A prediction of 3 million tokens was served, the engine reading it as it drafted: every request's steps were
    slower while it ran (a plain completion waited 1.2 s). None can be answered past the context, so a prediction
    past it is refused; one that fits is served."""
    long = {**SEEDS[CHAT][0], "prediction": {"type": "content", "content": "hello world " * MAX_LEN}}
    r = client.post(CHAT, json=long)
    assert r.status_code == 400 and _error(r)["param"] == "prediction", r.text
    fits = {**SEEDS[CHAT][0], "prediction": {"type": "content", "content": "hello world " * 10}}
    assert client.post(CHAT, json=fits).status_code == 200


@pytest.mark.parametrize(("route", "body"), STREAMS, ids=[route for route, _ in STREAMS])
def test_a_stream_whose_making_fails_after_it_began_ends_with_an_error_event(
    client: httpx.Client, monkeypatch: pytest.MonkeyPatch, route: str, body: dict[str, Any]
) -> None:
    """A failure of the server's own (a bug) while it writes a stream under way: the stream ends with the route's
    error event, where the connection was cut (a broken chunked body, which the openai client reads as a network
    error and retries). Here every delta after a stream's first fails to apply."""
    applied: list[str] = []
    apply = OpenAIServer.apply_delta

    def failing(choice: Any, delta: RequestDelta) -> None:
        applied.append(delta.request_id)
        if applied.count(delta.request_id) > 1:
            raise RuntimeError("a bug")
        apply(choice, delta)

    monkeypatch.setattr(OpenAIServer, "apply_delta", staticmethod(failing))
    with client.stream("POST", route, json=body) as r:
        assert r.status_code == 200
        events = _read_sse(r)
    assert _sse_problem(route, events) is None, events
    last = [json.loads(d) for _, d in events if d != "[DONE]"][-1]
    assert "internal error: RuntimeError" in json.dumps(last), last
    monkeypatch.undo()
    still_serving(client)


def test_a_body_nested_past_the_limit_is_a_400_naming_where(client: httpx.Client) -> None:
    """A tool's schema nested 950 levels (JSON the parser still reads) was a 500: the walk that checks a body's text
    recursed past Python's stack. It walks with a stack of its own now, and refuses a body nested past 128 levels
    (what reads one recursively, a template's tojson, the JSON writer, would fail as it did); 100 are served."""
    deep = '{"a": ' * 950 + '{"type": "string"}' + "}" * 950  # (as text: Python's own JSON writer would recurse)
    tool = '{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": %s}}}'
    body = _encode(SEEDS[CHAT][0])[:-1] + b', "tools": [' + (tool % deep).encode() + b"]}"
    r = client.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "levels deep" in _error(r)["message"], r.text
    assert _error(r)["param"].startswith("tools.0.function.parameters.properties.a.a")
    fine: Any = 1
    for _ in range(100):
        fine = [fine]
    assert client.post(CHAT, json={**SEEDS[CHAT][0], "chat_template_kwargs": {"x": fine}}).status_code == 200


DEEP_JSON = "[" * 50_000 + "]" * 50_000  # past the JSON parser's stack: a RecursionError
HUGE_NUMBER = "1" + "0" * 5_000  # past int()'s 4,300 digits: a ValueError that is no JSONDecodeError


def test_json_text_past_the_parsers_limits_is_refused_or_read_as_no_json_never_a_500(client: httpx.Client) -> None:
    """JSON text of the client's that Python's parser gives up on other than by a JSONDecodeError (a number past
    int()'s digits, nesting past its stack) was a 500 wherever the server read it: a tool call's arguments in the
    history, a logit_bias key, a structural tag, Claude Code's user id, the Messages and SageMaker routes' bodies."""
    for arguments in ('{"a": ' + HUGE_NUMBER + "}", DEEP_JSON):  # (read as no arguments, as text that is no JSON is)
        history = [
            {"role": "user", "content": "x"},
            {
                "role": "assistant",
                "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": arguments}}],
            },
            {"role": "tool", "tool_call_id": "1", "content": "done"},
        ]
        r = client.post(CHAT, json={"model": MODEL, "messages": history, "max_tokens": 2})
        assert r.status_code == 200, r.text[:300]
        r = client.post(TOKENIZE, json={"model": MODEL, "messages": history})
        assert r.status_code == 200, r.text[:300]
    r = client.post(CHAT, json={**SEEDS[CHAT][0], "logit_bias": {"9" * 5_000: 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text[:300]
    r = client.post(CHAT, json={**SEEDS[CHAT][0], "structured_outputs": {"structural_tag": DEEP_JSON}})
    assert r.status_code == 400, r.text[:300]
    for user_id in ('{"x": ' + DEEP_JSON + "}", '{"session_id": ' + HUGE_NUMBER + "}"):  # (no session: ignored)
        r = client.post(MESSAGES, json={**SEEDS[MESSAGES][0], "metadata": {"user_id": user_id}})
        assert r.status_code == 200, r.text[:300]
    for route in (MESSAGES, COUNT_TOKENS):
        body = _encode({**SEEDS[MESSAGES][0], "max_tokens": 0}).replace(
            b'"max_tokens": 0', b'"max_tokens": ' + HUGE_NUMBER.encode()
        )
        r = client.post(route, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["type"] == "error", r.text[:300]
    deep_body = b'{"model": "tiny", "x": ' + DEEP_JSON.encode() + b"}"
    r = client.post("/invocations", content=deep_body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    still_serving(client)

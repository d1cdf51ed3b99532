"""Bad input gets a 400 at the edge, naming the parameter, on one instance and on a 2-instance cluster; afterwards
the server still serves, no request failed inside an engine, and every instance is alive.

``CORPUS`` holds cases tried by hand, each once a 500 or a wrong 200, and boundary values that must be served.
A hypothesis test sends more, drawn from the request schemas' fields with values of any JSON type.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from boundless.api.launch import ServerThread, start_in_thread
from boundless.api.responses import ResponsesRequest
from boundless.api.schemas import ChatCompletionRequest, CompletionRequest
from boundless.engine.async_engine import AsyncEngine
from boundless.engine.core import EngineCore
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel, load_model
from boundless.model.random_model import TinySpec, write_random_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray's, in the cluster test

MODEL = "tiny"
VOCAB = 384  # tiny-llama's; the fixture checks it
MAX_LEN = 512
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
SURROGATE = "\ud800"  # a lone surrogate: JSON can spell it ("\\ud800"), UTF-8 cannot encode it
DROP = object()  # as a value in a change: remove the key from the base body

BASES = {
    CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2},
    COMPLETIONS: {"model": MODEL, "prompt": "Hello", "max_tokens": 2},
    RESPONSES: {"model": MODEL, "input": "Hello", "max_output_tokens": 2},
}


@dataclass(frozen=True)
class Case:
    """A change to a valid body of ``route``, and the status and ``error.param`` it must get."""

    route: str
    change: dict[str, Any]
    status: int
    param: str | None
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        body = {**BASES[self.route], **self.change}
        return {k: v for k, v in body.items() if v is not DROP}


def chat(change: dict[str, Any], param: str | None, status: int = 400, **headers: str) -> Case:
    return Case(CHAT, change, status, param, headers)


def completion(change: dict[str, Any], param: str | None, status: int = 400, **headers: str) -> Case:
    return Case(COMPLETIONS, change, status, param, headers)


def response(change: dict[str, Any], param: str | None, status: int = 400) -> Case:
    return Case(RESPONSES, change, status, param)


def both(change: dict[str, Any], param: str | None, status: int = 400) -> list[Case]:
    return [chat(change, param, status), completion(change, param, status)]


def _msg(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Hello", **fields}]}


_FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def _tool_with(parameters: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def _schema(schema: Any) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def _content(content: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}]}


def _calls(*calls: Any) -> dict[str, Any]:
    """A conversation whose assistant message made ``calls``."""
    return {
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": list(calls)},
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        ]
    }


WEATHER_CALL = {"name": "weather", "arguments": "{}"}


_RESPONSE_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}


_CALL = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}


def _output(output: Any) -> dict[str, Any]:
    """A Responses input item: a function call's output."""
    return {"type": "function_call_output", "call_id": "c", "output": output}


def _tool(function: Any) -> dict[str, Any]:
    return {"tools": [{"type": "function", "function": function}]}


SERVED = 200
CORPUS: list[Case] = [
    # seed: a signed 64-bit integer (outside it, the engine's step failed: a 500 for the whole batch)
    *both({"seed": 2**64}, "seed"),
    *both({"seed": 2**63}, "seed"),
    *both({"seed": -(2**63) - 1}, "seed"),
    *both({"seed": 10**30}, "seed"),
    *both({"seed": 2**64, "stream": True}, "seed"),
    *both({"seed": 1.5}, "seed"),
    *both({"seed": "7"}, "seed"),
    chat({"seed": 2**63 - 1, "n": 3}, None, SERVED),  # the samples' seeds wrap inside the range
    completion({"seed": -(2**63), "n": 2}, None, SERVED),
    completion({"seed": -1}, None, SERVED),
    # temperature, top_p, top_k
    *both({"temperature": -0.5}, "temperature"),
    *both({"temperature": 2.5}, "temperature"),
    *both({"temperature": float("nan")}, "temperature"),
    *both({"temperature": float("inf")}, "temperature"),
    *both({"temperature": "1.0"}, "temperature"),
    *both({"temperature": 5e-324}, None, SERVED),  # greedy: logits / temperature would overflow float32
    completion({"temperature": 1e-30, "seed": 3}, None, SERVED),
    *both({"top_p": 0}, "top_p"),
    *both({"top_p": 1.01}, "top_p"),
    *both({"top_p": float("nan")}, "top_p"),
    *both({"top_k": -2}, "top_k"),
    *both({"top_k": 2.0}, "top_k"),
    completion({"top_k": 10**6}, None, SERVED),  # more than the vocabulary: no filter
    # n
    *both({"n": 0}, "n"),
    *both({"n": 129}, "n"),
    *both({"n": 10**20}, "n"),
    *both({"n": True}, "n"),
    # max_tokens / max_completion_tokens / min_tokens
    *both({"max_tokens": 0}, "max_tokens"),
    chat({"max_tokens": 0, "echo": True}, "max_tokens"),  # (chat has no echo: an unknown field)
    completion({"max_tokens": 0, "echo": True}, None, SERVED),  # the prompt alone, as vLLM's
    completion({"max_tokens": 0, "echo": True, "logprobs": 2, "stream": True}, None, SERVED),
    *both({"max_tokens": -3}, "max_tokens"),
    *both({"max_tokens": 10**20}, "max_tokens"),
    *both({"max_tokens": MAX_LEN}, "max_tokens"),
    *both({"max_tokens": "4"}, "max_tokens"),
    chat({"max_completion_tokens": 0}, "max_completion_tokens"),
    chat({"reasoning_effort": "high"}, "reasoning_effort"),  # this model does not reason (no --reasoning-parser)
    chat({"thinking_token_budget": 100}, "thinking_token_budget"),  # nor has it tags to close its thinking with
    chat({"truncate_prompt_tokens": "5"}, "truncate_prompt_tokens"),
    chat({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    chat({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),  # (ids, where the route wants text)
    chat({"max_completion_tokens": 10**20}, "max_completion_tokens"),
    chat({"max_completion_tokens": 2.0}, "max_completion_tokens"),
    *both({"min_tokens": -1}, "min_tokens"),
    *both({"min_tokens": 3}, "min_tokens"),  # more than max_tokens
    *both({"min_tokens": 10**20}, "min_tokens"),
    # logprobs / top_logprobs
    completion({"logprobs": 21}, "logprobs"),
    completion({"logprobs": -1}, "logprobs"),
    completion({"logprobs": True}, "logprobs"),
    chat({"logprobs": "yes"}, "logprobs"),
    chat({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    chat({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    chat({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    # prompt_logprobs (vLLM's): 0 to the logprobs limit (not -1, the whole vocabulary), and not streamed; echo's own
    *both({"prompt_logprobs": -1}, "prompt_logprobs"),
    *both({"prompt_logprobs": 21}, "prompt_logprobs"),
    *both({"prompt_logprobs": 10**30}, "prompt_logprobs"),
    *both({"prompt_logprobs": 1.0}, "prompt_logprobs"),
    *both({"prompt_logprobs": True}, "prompt_logprobs"),
    *both({"prompt_logprobs": "2"}, "prompt_logprobs"),
    *both({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    *both({"prompt_logprobs": 0, "stream": True}, None, SERVED),  # (nothing to return: vLLM serves it)
    *both({"prompt_logprobs": 20, "n": 2}, None, SERVED),
    completion({"echo": True, "logprobs": 21}, "logprobs"),
    completion({"echo": True, "logprobs": 20, "prompt_logprobs": 0}, None, SERVED),
    completion({"echo": True, "logprobs": 1, "stream": True}, None, SERVED),
    # stop: strings and lists, their encoding
    *both({"stop": ""}, "stop"),
    *both({"stop": [""]}, "stop"),
    *both({"stop": 5}, "stop"),
    *both({"stop": ["ok", 5]}, "stop"),
    *both({"stop": SURROGATE}, "stop"),
    *both({"stop": ["ok", "a" + SURROGATE]}, "stop.1"),
    # stop_token_ids: ids of the vocabulary (out of it, with min_tokens the engine's step failed)
    *both({"stop_token_ids": [-1]}, "stop_token_ids"),
    *both({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    *both({"stop_token_ids": [10**30], "min_tokens": 1}, "stop_token_ids"),
    *both({"stop_token_ids": ["5"]}, "stop_token_ids.0"),
    *both({"stop_token_ids": 5}, "stop_token_ids"),
    completion({"stop_token_ids": [VOCAB - 1], "min_tokens": 1}, None, SERVED),
    # allowed_token_ids and bad_words (vLLM's): ids of the vocabulary, words of some tokens, 128 sequences at most
    *both({"allowed_token_ids": []}, "allowed_token_ids"),
    *both({"allowed_token_ids": [VOCAB]}, "allowed_token_ids"),
    *both({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    *both({"allowed_token_ids": ["5"]}, "allowed_token_ids.0"),
    *both({"allowed_token_ids": 5}, "allowed_token_ids"),
    *both({"bad_words": [""]}, "bad_words"),
    *both({"bad_words": [" "]}, "bad_words"),  # (nothing left to ban once its blanks are dropped, as in vLLM)
    *both({"bad_words": "hello"}, "bad_words"),
    *both({"bad_words": [5]}, "bad_words.0"),
    *both({"bad_words": [f"w{i}" for i in range(129)]}, "bad_words"),
    *both({"return_tokens_as_token_ids": "yes"}, "return_tokens_as_token_ids"),
    # (allowed tokens that min_tokens forbids all: the row had nothing to draw, and the step failed)
    *[
        Case(r, {"allowed_token_ids": [2], "min_tokens": 2, "temperature": 1.0, "bad_words": ["Hello"]}, SERVED, None)
        for r in (CHAT, COMPLETIONS)
    ],
    # penalties and logit_bias: OpenAI's ranges, vLLM's repetition_penalty and min_p, ids of the vocabulary
    *both({"presence_penalty": 2.5}, "presence_penalty"),
    *both({"frequency_penalty": float("-inf")}, "frequency_penalty"),
    *both({"repetition_penalty": 0.0}, "repetition_penalty"),
    *both({"repetition_penalty": -1.0}, "repetition_penalty"),
    *both({"repetition_penalty": "2"}, "repetition_penalty"),
    # (a logit divided past float32's largest made the step's distributions NaN: every request of it failed)
    *[
        Case(r, {"repetition_penalty": p, "temperature": 1.0}, SERVED, None)
        for r in (CHAT, COMPLETIONS)
        for p in (1e-38, 1e-300)
    ],
    *both({"min_p": 1.5}, "min_p"),
    *both({"min_p": -0.1}, "min_p"),
    *both({"logit_bias": {"5": 101}}, "logit_bias.5"),
    *both({"logit_bias": {"5": "1"}}, "logit_bias.5"),
    *both({"logit_bias": {"x": 1}}, "logit_bias"),
    *both({"logit_bias": {"-1": 1}}, "logit_bias"),
    *both({"logit_bias": {"\uff15": 1}}, "logit_bias"),  # a digit, not an ASCII one
    *both({"logit_bias": {str(VOCAB): 1}}, "logit_bias"),
    *both({"logit_bias": {str(10**30): 1}}, "logit_bias"),
    *both({"logit_bias": [5]}, "logit_bias"),
    completion(
        {
            "logit_bias": {str(VOCAB - 1): -100, "0": 100.0},
            "presence_penalty": -2,
            "frequency_penalty": 2,
            "repetition_penalty": 1.5,
            "min_p": 0.5,
            "temperature": 1.0,
        },
        None,
        SERVED,
    ),
    # response_format: OpenAI's three types, a schema xgrammar can use, and not with ignore_eos or min_tokens
    *both({"response_format": "json"}, "response_format"),
    *both({"response_format": {"type": "xml"}}, "response_format.type"),
    *both({"response_format": {"type": "json_schema"}}, "response_format"),
    *both({"response_format": {"type": "json_object", "json_schema": {"name": "x"}}}, "response_format"),
    *both(
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"
    ),
    *both(_schema({"type": 5}), "response_format"),
    # a schema xgrammar builds but cannot compile (the compile failed in the engine's step, every request of it)
    *both(_schema({"type": "string", "minLength": -5}), "response_format"),
    *both(_schema({"enum": ["a" + SURROGATE]}), "response_format.json_schema.schema.enum.0"),
    *both(_schema({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}), "response_format"),
    *both({"response_format": {"type": "json_object"}, "ignore_eos": True}, "response_format"),
    *both({"response_format": {"type": "json_object"}, "min_tokens": 1}, "response_format"),
    completion({"response_format": {"type": "json_object"}}, None, SERVED),
    # structured_outputs (vLLM's): exactly one of json, regex, choice, grammar and json_object, each one usable
    *both({"structured_outputs": {}}, "structured_outputs"),
    *both({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    *both({"structured_outputs": {"json_object": False}}, "structured_outputs"),
    *both({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    *both({"structured_outputs": {"choice": [f"c{i}" for i in range(8193)]}}, "structured_outputs"),  # (compile)
    *both({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs"),
    *both({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    *both({"structured_outputs": {"json": {"type": "string", "minLength": -5}}}, "structured_outputs"),
    *both({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    *both({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice.1"),
    *both({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    *both({"structured_outputs": {"choice": ["a"]}, "ignore_eos": True}, "structured_outputs"),
    completion({"structured_outputs": {"choice": ["yes", "no"]}}, None, SERVED),
    chat({"structured_outputs": {"regex": "[0-9]{2}"}}, None, SERVED),
    chat(_schema({"type": "object", "properties": {"a": {"type": "integer"}}}), None, SERVED),
    chat({"response_format": {"type": "text"}}, None, SERVED),
    # stream, stream_options
    *both({"stream": "false"}, "stream"),
    *both({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    *both({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    *both({"stream": True, "stream_options": 3}, "stream_options"),
    completion({"stream": True, "stream_options": {"include_usage": True}}, None, SERVED),
    # program_id / thread_id / parent_thread_ids: types, lengths, encodings
    *both({"program_id": 5}, "program_id"),
    *both({"program_id": ""}, "program_id"),
    *both({"program_id": "p" * 257}, "program_id"),
    *both({"program_id": "p" + SURROGATE}, "program_id"),
    *both({"program_id": "p", "thread_id": SURROGATE}, "thread_id"),
    *both({"program_id": "p", "thread_id": ["t"]}, "thread_id"),
    *both({"program_id": "p", "parent_thread_ids": "t"}, "parent_thread_ids"),
    *both({"program_id": "p", "parent_thread_ids": [1]}, "parent_thread_ids.0"),
    *both({"program_id": "p", "parent_thread_ids": ["t"] * 65}, "parent_thread_ids"),
    *both({"program_id": "p", "parent_thread_ids": ["t", SURROGATE]}, "parent_thread_ids.1"),
    completion({"program_id": "p" * 256, "thread_id": "t", "parent_thread_ids": ["a", "b"]}, None, SERVED),
    # headers X-Program-Id / X-Thread-Id
    completion({}, "X-Program-Id", **{"X-Program-Id": "p" * 257}),
    completion({}, "X-Program-Id", **{"X-Program-Id": ""}),
    completion({}, "X-Thread-Id", **{"X-Program-Id": "p", "X-Thread-Id": "t" * 257}),
    completion({}, None, SERVED, **{"X-Program-Id": "agent-1", "X-Thread-Id": "t-1"}),
    # other text fields: their encoding
    *both({"user": SURROGATE}, "user"),
    *both({"model": SURROGATE}, "model"),
    *both({"some_extension": {"k": [SURROGATE]}}, "some_extension.k.0"),
    *both({"model": "gpt-9"}, "model", 404),
    # messages: roles, content types, encodings, content as a list of parts
    chat({"messages": []}, "messages"),
    chat({"messages": "Hello"}, "messages"),
    chat({"messages": ["Hello"]}, "messages.0"),
    chat({"messages": [{"content": "Hello"}]}, "messages.0.role"),
    chat({"messages": [{"role": "wizard", "content": "Hello"}]}, "messages.0.role"),
    chat({"messages": [{"role": SURROGATE, "content": "Hello"}]}, "messages.0.role"),
    chat({"messages": [{"role": "user"}]}, "messages.0.content"),
    chat(_content(SURROGATE), "messages.0.content"),
    chat(_content(5), "messages.0.content"),
    chat(_content({"type": "text", "text": "Hello"}), "messages.0.content"),
    chat(_content(["Hello"]), "messages.0.content"),
    chat(_content([{"type": "text"}]), "messages.0.content.0"),
    chat(_content([{"type": "text", "text": 5}]), "messages.0.content.0"),
    chat(_content([{"type": "text", "text": "a"}, {"type": "text", "text": SURROGATE}]), "messages.0.content.1.text"),
    chat(_content([{"type": "image_url", "image_url": {"url": "http://x"}}]), "messages.0.content.0"),
    chat(_content([{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]), None, SERVED),
    chat(_msg(name=SURROGATE), "messages.0.name"),
    chat(_msg(name=5), "messages.0.name"),
    chat({"messages": [{"role": "tool", "content": "42", "tool_call_id": SURROGATE}]}, "messages.0.tool_call_id"),
    chat(_calls({"id": "c1"}), "messages.1.tool_calls.0.function"),
    chat(_calls({"id": "c1", "function": 5}), "messages.1.tool_calls.0.function"),
    chat(_calls({"id": "c1", "function": {"name": "w", "arguments": 5}}), "messages.1.tool_calls.0.function.arguments"),
    chat(_calls({"id": "c1", "type": "other", "function": WEATHER_CALL}), "messages.1.tool_calls.0.type"),
    chat(_calls({"id": "c1", "type": "function", "function": WEATHER_CALL}), None, SERVED),
    # tools and tool_choice
    chat({"tools": "get_weather"}, "tools"),
    chat({"tools": [5]}, "tools.0"),
    chat({"tools": [{"type": "function"}]}, "tools.0.function"),
    chat({"tools": [{"function": {"name": "f"}}]}, "tools.0.type"),
    chat({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
    chat(_tool({"name": ""}), "tools.0.function.name"),
    chat(_tool({"name": SURROGATE}), "tools.0.function.name"),
    chat(_tool({"name": "f", "parameters": "x"}), "tools.0.function.parameters"),
    chat(_tool("f"), "tools.0.function"),
    # OpenAI's rules for tools: a name of ^[a-zA-Z0-9_-]{1,64}$, parameters an object's schema, no name twice
    chat(_tool({"name": "get weather!"}), "tools.0.function.name"),
    chat(_tool({"name": "f" * 129}), "tools.0.function.name"),
    # agents' names (MCP's server.tool, namespaces): served, as vLLM serves them
    chat({"tools": [{"type": "function", "function": {"name": n}} for n in ("fs.read", "srv/x", "m:t")]}, None, SERVED),
    chat(_tool({"name": "get_weather-2"}), None, SERVED),
    chat({"tools": [_tool_with({"type": "string"})], "tool_choice": "required"}, "tools.0.function.parameters"),
    chat({"tools": [_tool_with({"properties": {"a": {"type": "string"}}})]}, "tools.0.function.parameters"),
    chat({"tools": [_tool_with({"type": ["object", "null"]})]}, "tools.0.function.parameters"),
    chat({"tools": [_tool_with({})], "tool_choice": "required"}, None, SERVED),  # (no parameters, as leaving them out)
    chat({"tools": [_FN, _tool_with({"type": "object"})]}, "tools"),
    chat({"tool_choice": "sometimes"}, "tool_choice"),
    chat({"tool_choice": "required"}, "tool_choice"),  # without tools
    chat({"tools": [_FN], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    chat({"tools": [_FN], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    chat({"tools": [_FN], "tool_choice": {"type": "function", "function": {"name": "f"}}}, None, SERVED),
    chat({"tools": [_tool_with({"type": 5})], "tool_choice": "required"}, "tools.0.function.parameters"),
    chat(
        {
            "tools": [_tool_with({"type": "object", "properties": {"a": {"type": "string", "minLength": -5}}})],
            "tool_choice": "required",
        },
        "tools",
    ),
    # nullable fields (OpenAI's n, stream, logprobs, echo, parallel_tool_calls): null is the default
    chat({"n": None, "logprobs": None, "stream": None, "parallel_tool_calls": None, "tools": [_FN]}, None, SERVED),
    completion({"n": None, "echo": None, "stream": None, "min_tokens": None}, None, SERVED),
    chat({"model": None}, "model"),
    chat({"tool_choice": 5}, "tool_choice"),
    chat({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}, None, SERVED),
    # prompt: string, list of strings, token ids out of range, empty
    completion({"prompt": SURROGATE}, "prompt"),
    completion({"prompt": ["ok", "a" + SURROGATE]}, "prompt.1"),
    completion({"prompt": ""}, "prompt"),
    completion({"prompt": []}, "prompt"),
    completion({"prompt": [""]}, "prompt"),
    completion({"prompt": [[]]}, "prompt"),
    completion({"prompt": None}, "prompt"),
    completion({"prompt": 5}, "prompt"),
    completion({"prompt": [1, "a"]}, "prompt"),
    completion({"prompt": [True]}, "prompt"),
    completion({"prompt": [1.0]}, "prompt"),
    completion({"prompt": [-1]}, "prompt"),
    completion({"prompt": [VOCAB]}, "prompt"),
    completion({"prompt": [10**30]}, "prompt"),
    completion({"prompt": [[1, 2], [3, 10**30]]}, "prompt"),
    completion({"prompt": DROP}, "prompt"),
    completion({"prompt": [0, VOCAB - 1]}, None, SERVED),
    completion({"prompt": [[5, 6], [7]]}, None, SERVED),
    completion({"echo": "true"}, "echo"),
    completion({"suffix": SURROGATE}, "suffix"),
    completion({"suffix": "and then"}, "suffix"),
    chat({"chat_template": "{{ 1/0 }}"}, "chat_template"),  # not the request's (vLLM's rule): refused, not dropped
    chat({"chat_template": None}, None, SERVED),
    # best_of: OpenAI's type and its rule (not below n); above n, not served (vLLM V1's neither), not dropped
    completion({"best_of": "x"}, "best_of"),
    completion({"best_of": 1, "n": 2}, "best_of"),
    completion({"best_of": 3, "n": 2}, "best_of"),
    completion({"best_of": 2, "n": 2}, None, SERVED),
    completion({"best_of": None}, None, SERVED),
    # vLLM's removed structured-output fields: refused, not ignored (the output would be unconstrained)
    *both({"guided_json": {"type": "object"}}, "guided_json"),
    chat({"guided_choice": ["a", "b"]}, "guided_choice"),
    completion({"guided_regex": "[a-z]+"}, "guided_regex"),
    response({"guided_grammar": 'root ::= "a"'}, "guided_grammar"),
    chat({"guided_decoding_backend": "xgrammar"}, None, SERVED),  # (no effect to lose: vLLM says drop it)
    # the Responses API: what it does not serve, shapes of input items, tools and formats, limits, unknown ids
    response({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    response({"tools": [{"type": "function"}]}, "tools.0.name"),
    response({"tools": [{"type": "function", "name": "get weather!"}]}, "tools.0.name"),
    response({"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]}, "tools.0.parameters"),
    response({"tools": [_RESPONSE_TOOL, {"type": "function", "name": "f"}]}, "tools"),
    response({"truncation": "middle"}, "truncation"),
    response({"reasoning": {"effort": "high"}}, "reasoning"),
    response({"include": ["everything"]}, "include"),
    # (data of items no response here holds: nothing to add)
    response({"include": ["reasoning.encrypted_content", "file_search_call.results"]}, None, SERVED),
    response(
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"
    ),
    response({"input": [{"role": "user", "content": 5}]}, "input.0.content"),
    response({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input.0.type"),
    response({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input.0"),
    response({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input.0"),
    response({"input": [_output([{"type": "x"}])]}, "input.0.output.0"),
    response({"input": [_CALL, _output([{"type": "input_text", "text": "sunny"}])]}, None, SERVED),
    response({"input": [_output("sunny")]}, "input"),  # (answers no call: OpenAI refuses it)
    response({"input": [{"role": "robot", "content": "Hi"}]}, "input.0.role"),
    response({"input": [{"role": "user", "content": "a" + SURROGATE}]}, "input.0.content"),
    response({"input": []}, "input"),
    response({"input": DROP}, "input"),
    response({"instructions": SURROGATE}, "instructions"),
    response({"tool_choice": "required"}, "tool_choice"),
    response({"tools": [_RESPONSE_TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    response(
        {"tools": [_RESPONSE_TOOL], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
        "text.format",
    ),
    response({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}}, "text.format"),
    response({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    response(
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "string", "minLength": -5}}}},
        "text.format",
    ),
    response({"stream": None, "store": None, "parallel_tool_calls": None}, None, SERVED),
    response({"max_output_tokens": MAX_LEN}, "max_output_tokens"),
    response({"max_output_tokens": 0}, "max_output_tokens"),
    response({"top_logprobs": 21}, "top_logprobs"),
    response({"input": [{"type": "reasoning", "summary": []}]}, "input"),  # (no message: it named chat's messages)
    response({"previous_response_id": "resp_none"}, "previous_response_id", 404),
    response({"model": "other"}, "model", 404),
    response({"stream": "yes"}, "stream"),
    response({"tools": [_RESPONSE_TOOL], "tool_choice": "none"}, None, SERVED),
    response({"input": [{"type": "reasoning", "summary": []}, {"role": "developer", "content": "Hi"}]}, None, SERVED),
]

# Bodies that are not a JSON object of valid text: (raw bytes, status, param).
RAW_CASES: list[tuple[bytes, int, str | None]] = [
    (b'{"model": "tiny", "prompt": "\xff\xfe", "max_tokens": 2}', 400, None),  # not UTF-8
    (b'{"model": "tiny", "prompt": "\xed\xa0\x80", "max_tokens": 2}', 400, "prompt"),  # a surrogate in UTF-8 form
    (b'{"model": "tiny", "prompt": "hi", "temperature": 1e999}', 400, "temperature"),
    (b'{"model": ', 400, None),
    (b"[]", 400, None),
    (b"null", 400, None),
]


# One client for the module: its kept-alive connections spare each of the hundreds of bodies a new one.
_CLIENT = httpx.Client(timeout=60)


def _post(url: str, route: str, body: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    headers = {"content-type": "application/json", **(headers or {})}
    return _CLIENT.post(url + route, content=body, headers=headers)


def _error_mismatch(r: httpx.Response, status: int, param: str | None) -> str | None:
    """Why ``r`` is not the expected answer, or None."""
    if r.status_code != status:
        return f"status {r.status_code}, expected {status}: {r.text[:300]}"
    if status < 400:
        return None
    body = r.json()
    if set(body) != {"error"} or set(body["error"]) != {"message", "type", "param", "code"}:
        return f"not an OpenAI error object: {body}"
    expected_type = "invalid_request_error" if status == 400 else "not_found_error"
    if not body["error"]["message"] or body["error"]["type"] != expected_type:
        return f"bad message or type: {body}"
    if body["error"]["param"] != param:
        return f"param {body['error']['param']!r}, expected {param!r}: {body['error']['message']}"
    return None


def run_corpus(url: str) -> None:
    mismatches = []
    for case in CORPUS:
        r = _post(url, case.route, json.dumps(case.body()).encode(), case.headers)
        why = _error_mismatch(r, case.status, case.param)
        if why:
            mismatches.append(f"{case.route} {case.change} {case.headers or ''}: {why}")
    for raw, status, param in RAW_CASES:
        why = _error_mismatch(_post(url, COMPLETIONS, raw), status, param)
        if why:
            mismatches.append(f"raw {raw[:50]!r}: {why}")
    assert not mismatches, "\n".join(mismatches)


def failed_in_engine(url: str) -> float:
    """Requests that an engine finished with an error (a failed step), from /metrics."""
    text = httpx.get(url + "/metrics").text
    pattern = r'^boundless_requests_finished_total\{[^}]*finish_reason="error"[^}]*\} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, flags=re.MULTILINE))


def assert_still_serving(url: str) -> None:
    for route in (CHAT, COMPLETIONS):
        r = httpx.post(url + route, json=BASES[route], timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
    assert failed_in_engine(url) == 0


# -- one instance ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_llama: LoadedModel) -> Iterator[ServerThread]:
    assert tiny_llama.tokenizer.vocab_size == VOCAB
    config = engine_config(tiny_llama.name, max_model_len=MAX_LEN, kv_cache_gb=0.05)
    engine = AsyncEngine(EngineCore.from_model(tiny_llama, config), max_waiting=1024)
    srv = start_in_thread(engine, MODEL)
    yield srv
    srv.stop()
    engine.shutdown()


def test_corpus_on_one_instance(server: ServerThread) -> None:
    run_corpus(server.url)
    assert_still_serving(server.url)


# Values of every JSON type, with the edges that once got through: 64-bit bounds, non-finite numbers, surrogates.
_EDGE_INTS = [0, 1, -1, VOCAB, MAX_LEN, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30]
_texts = st.text(max_size=6) | st.text(max_size=6).map(lambda s: s + SURROGATE)
_scalars = st.none() | st.booleans() | st.integers() | st.sampled_from(_EDGE_INTS) | st.floats() | _texts
_json = st.recursive(
    _scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_texts, inner, max_size=3), max_leaves=6
)


def _fields(model: type) -> list[str]:
    return sorted(model.model_fields)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    route_field=st.sampled_from(
        [(CHAT, f) for f in _fields(ChatCompletionRequest)]
        + [(COMPLETIONS, f) for f in _fields(CompletionRequest)]
        + [(RESPONSES, f) for f in _fields(ResponsesRequest)]
        + [(CHAT, "an_extension"), (COMPLETIONS, "an_extension"), (RESPONSES, "an_extension")]
    ),
    value=_json,
)
def test_any_value_of_any_field_is_served_or_rejected_by_name(
    server: ServerThread, route_field: tuple[str, str], value: Any
) -> None:
    route, name = route_field
    body = {**BASES[route], name: value}
    r = _post(server.url, route, json.dumps(body).encode())
    assert r.status_code in (200, 400, 404), r.text[:300]
    if r.status_code != 200:
        param = r.json()["error"]["param"]
        assert param == name or param.startswith(name + "."), (param, r.text[:300])
        assert r.status_code == 400 or name in ("model", "previous_response_id")  # (404: none such)


def test_after_generated_input_the_server_still_serves(server: ServerThread) -> None:
    # Runs after the hypothesis test in file order; on its own it checks a fresh server.
    assert_still_serving(server.url)


ALTERNATING_TEMPLATE = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate between user and assistant') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_conversation_the_chat_template_rejects_gets_400(tmp_path: Path) -> None:
    root = write_random_model(tmp_path / "m", TinySpec())
    config = json.loads((root / "tokenizer_config.json").read_text())
    config["chat_template"] = ALTERNATING_TEMPLATE
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = load_model(str(root))
    engine = AsyncEngine(
        EngineCore.from_model(loaded, engine_config(str(root), max_model_len=MAX_LEN, kv_cache_gb=0.05))
    )
    srv = start_in_thread(engine, MODEL)
    try:
        twice = {"messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hi again"}]}
        r = _post(srv.url, CHAT, json.dumps({**BASES[CHAT], **twice}).encode())
        assert _error_mismatch(r, 400, "messages") is None, r.text
        assert "roles must alternate" in r.json()["error"]["message"]
        assert_still_serving(srv.url)
    finally:
        srv.stop()
        engine.shutdown()


# -- a 2-instance cluster --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster_server(model_dirs: dict[str, Path]) -> Iterator[ServerThread]:
    import ray

    from boundless.cluster.client import ClusterClient
    from boundless.config import ClusterConfig

    config = engine_config(str(model_dirs["tiny-llama"]), max_model_len=MAX_LEN, kv_cache_gb=0.05)
    client = ClusterClient(config, ClusterConfig(instances=2, heartbeat_interval_s=0.2, heartbeat_timeout_s=30.0))
    srv = start_in_thread(client, MODEL)
    yield srv
    srv.stop()
    client.shutdown()
    if ray.is_initialized():
        ray.shutdown()


@pytest.mark.slow
def test_corpus_on_a_cluster_keeps_both_instances(cluster_server: ServerThread) -> None:
    url = cluster_server.url
    run_corpus(url)
    assert_still_serving(url)
    instances = httpx.get(url + "/cluster").json()["instances"]
    assert [(i["id"], i["state"]) for i in instances] == [("0", "alive"), ("1", "alive")]
    # Both still serve: spread short calls until each has answered one.
    served = set()
    for i in range(8):
        r = httpx.post(url + COMPLETIONS, json={**BASES[COMPLETIONS], "prompt": [10 + i]}, timeout=60)
        served.add(r.json()["system_fingerprint"])
    assert served == {"boundless-0", "boundless-1"}

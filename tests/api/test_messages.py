"""Anthropic's Messages API (``POST /v1/messages``) through the real ``anthropic`` client: the chat route's answers
in Anthropic's shapes, streamed and not, with tools, prefills, stop sequences, errors and its API-key header."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from served_models import Served, serve_hermes, streamed_chat

from boundless.config import ServerConfig

# (Enums and a boolean: a random model under the call's grammar ends its JSON soon, where a string may run on.)
UNITS_TOOL = {
    "name": "set_units",
    "description": "Set the units of the forecast",
    "input_schema": {
        "type": "object",
        "properties": {"metric": {"type": "boolean"}, "scale": {"enum": ["C", "F", "K"]}},
        "required": ["metric", "scale"],
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# (Sampling parameters are not in the newest client's signature; the API takes them, as older clients send them.)
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serve_hermes(tmp_path_factory.mktemp("messages"), server_config=ServerConfig(api_key="secret")) as s:
        yield s


@pytest.fixture(scope="module")
def client(served: Served) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.url, api_key="secret", max_retries=0)


@pytest.fixture(scope="module")
def chat(served: Served) -> openai.OpenAI:
    """The OpenAI client of the same server, its key given as OpenAI's clients give it."""
    return openai.OpenAI(base_url=served.url + "/v1", api_key="secret", max_retries=0)


def test_a_message_is_the_chat_answer_in_anthropics_shape(chat: openai.OpenAI, client: anthropic.Anthropic) -> None:
    """Text, stop reason and usage are the chat completion's of the same conversation (greedy), the prompt's cached
    tokens counted apart; the streamed events make the same message."""
    system = "Answer briefly."
    message = client.messages.create(model="tiny", max_tokens=12, system=system, messages=ASK, extra_body=GREEDY)
    answer = chat.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": system}, *ASK], max_tokens=12, temperature=0
    )
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == answer.choices[0].message.content
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[answer.choices[0].finish_reason]
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == answer.usage.prompt_tokens
    assert usage.output_tokens == answer.usage.completion_tokens
    with client.messages.stream(model="tiny", max_tokens=12, system=system, messages=ASK, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    assert text == message.content[0].text and [(b.type, b.text) for b in streamed.content] == [("text", text)]
    assert streamed.stop_reason == message.stop_reason and streamed.usage.output_tokens == usage.output_tokens
    count = client.messages.count_tokens(model="tiny", system=system, messages=ASK)
    assert count.input_tokens == answer.usage.prompt_tokens
    # Anthropic's message_start counts the prompt already (its input_tokens were 0 until message_delta's usage).
    events = client.messages.create(
        model="tiny", max_tokens=2, system=system, messages=ASK, extra_body=GREEDY, stream=True
    )
    started = next(iter(events))
    assert started.type == "message_start"
    begun = started.message.usage
    assert begun.input_tokens + begun.cache_read_input_tokens == answer.usage.prompt_tokens and begun.input_tokens > 0
    assert begun.cache_read_input_tokens > 0  # (the conversation's prefix cached by the calls before)
    events.close()


def test_a_stop_sequence_is_named(client: anthropic.Anthropic) -> None:
    free = client.messages.create(model="tiny", max_tokens=12, messages=ASK, extra_body=GREEDY).content[0].text
    stop = free[4:7]  # (not at the start: the answer is then some text)
    message = client.messages.create(
        model="tiny", max_tokens=12, messages=ASK, extra_body=GREEDY, stop_sequences=[stop]
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == free[: free.index(stop)]


def test_a_forced_tool_is_a_tool_use_block_and_its_result_goes_back(client: anthropic.Anthropic) -> None:
    """``tool_choice`` ``tool``: a ``tool_use`` block with its input as an object, ``stop_reason`` ``tool_use``,
    streamed alike (its input as JSON deltas); the next turn takes the ``tool_result`` into the prompt."""
    ask = {"model": "tiny", "max_tokens": 600, "messages": ASK, "extra_body": GREEDY, "tools": [UNITS_TOOL]}
    forced = {"type": "tool", "name": "set_units"}
    message = client.messages.create(**ask, tool_choice=forced)
    (call,) = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" and call.name == "set_units"
    assert isinstance(call.input["metric"], bool) and call.input["scale"] in ("C", "F", "K")
    with client.messages.stream(**ask, tool_choice=forced) as stream:
        partial = [e.partial_json for e in stream if e.type == "input_json"]
        streamed = stream.get_final_message()
    (streamed_call,) = [b for b in streamed.content if b.type == "tool_use"]
    assert streamed_call.input == call.input and json.loads("".join(partial)) == call.input
    assert streamed.stop_reason == "tool_use"
    then = [
        *ASK,
        {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}]},
    ]
    before = client.messages.count_tokens(model="tiny", messages=ASK, tools=[UNITS_TOOL]).input_tokens
    after = client.messages.count_tokens(model="tiny", messages=then, tools=[UNITS_TOOL]).input_tokens
    assert after > before
    assert client.messages.create(**{**ask, "messages": then}).stop_reason in ("end_turn", "max_tokens", "tool_use")


def _text_blocks(*texts: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": t} for t in texts]


def test_text_blocks_reach_the_template_joined_by_newlines(served: Served, client: anthropic.Anthropic) -> None:
    """A turn's text blocks, and a tool result's, are joined by newlines, as the chat route joins a message's parts
    and as vLLM converts them (they were joined with nothing between); the system prompt's blocks are joined with
    nothing between, as vLLM joins them."""
    call = {"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Paris"}}
    messages = [
        {"role": "user", "content": _text_blocks("Hello", "there")},
        {"role": "assistant", "content": [*_text_blocks("Let me look.", "One moment."), call]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "c1", "content": _text_blocks("Sun", "21")}],
        },
    ]
    counted = client.messages.count_tokens(model="tiny", system=_text_blocks("Be ", "brief."), messages=messages)

    def chat_tokens(join: str) -> int:
        arguments = json.dumps(call["input"])
        chat = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": join.join(["Hello", "there"])},
            {
                "role": "assistant",
                "content": join.join(["Let me look.", "One moment."]),
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": join.join(["Sun", "21"])},
        ]
        tokens = httpx.post(served.url + "/tokenize", json={"messages": chat}, headers={"x-api-key": "secret"})
        return tokens.json()["count"]

    assert chat_tokens("") != chat_tokens("\n")  # (the two prompts tell apart)
    assert counted.input_tokens == chat_tokens("\n")


def test_a_last_assistant_turn_is_continued(chat: openai.OpenAI, client: anthropic.Anthropic) -> None:
    """Anthropic's prefill: the answer goes on from a last assistant turn (the chat route's continue_final_message)."""
    prefill = [*ASK, {"role": "assistant", "content": "The weather in Paris is"}]
    message = client.messages.create(model="tiny", max_tokens=8, messages=prefill, extra_body=GREEDY)
    answer = chat.chat.completions.create(
        model="tiny",
        messages=prefill,
        max_tokens=8,
        temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    assert message.content[0].text == answer.choices[0].message.content


def test_errors_are_anthropics(served: Served, client: anthropic.Anthropic) -> None:
    headers = {"x-api-key": "secret"}
    no_limit = httpx.post(served.url + "/v1/messages", json={"model": "tiny", "messages": ASK}, headers=headers)
    assert no_limit.status_code == 400 and no_limit.json()["type"] == "error"
    assert no_limit.json()["error"]["type"] == "invalid_request_error" and "max_tokens" in no_limit.text
    # A chat field given beside Anthropic's (vLLM's extensions) that does not validate: a 400 naming it, on both routes.
    bad = {"model": "tiny", "max_tokens": 2, "messages": ASK, "priority": "high"}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = httpx.post(served.url + path, json=bad, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("priority: "), (path, r.text)
    image = [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(model="tiny", max_tokens=4, messages=image)
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="claude-none", max_tokens=4, messages=ASK)
    assert unknown.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": unknown.value.body["error"]["message"]},
    }
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=served.url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=4, messages=ASK
        )
    # vLLM's n (the chat route's, beside Anthropic's fields): a message is one answer, streamed or not. (Several
    # choices ran into the same content blocks when streamed, and the usage counted them all.)
    for stream in (False, True):
        with pytest.raises(anthropic.BadRequestError, match="n"):
            client.messages.create(model="tiny", max_tokens=4, messages=ASK, stream=stream, extra_body={"n": 2})
    # OpenAI's clients still send the key as a bearer token.
    r = httpx.post(
        served.url + "/v1/messages",
        json={"model": "tiny", "max_tokens": 2, "messages": ASK},
        headers={"Authorization": "Bearer secret"},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["type"] == "message"


@pytest.mark.parametrize(
    ("body", "said"), [(b'{"model": ', "the body is not valid JSON"), (b"[1, 2]", "the body must be a JSON object")]
)
def test_a_body_that_is_no_json_object_gets_anthropics_error(served: Served, body: bytes, said: str) -> None:
    """A body that is not JSON, or not an object, is a 400 in Anthropic's shape on both routes, as their other errors
    are (it was the OpenAI routes' error object, FastAPI's refusal before the route ran)."""
    headers = {"x-api-key": "secret", "content-type": "application/json"}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = httpx.post(served.url + path, content=body, headers=headers)
        assert r.status_code == 400 and r.json()["type"] == "error", (path, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["message"].startswith(said)


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\x85"])
def test_a_streamed_text_may_hold_any_line_separator(client: anthropic.Anthropic, separator: str) -> None:
    """The chat stream's JSON writes U+2028, U+2029 and U+0085 as they are: read back line by line they split the
    chunk's JSON, and the stream broke off (an unterminated string) where the unstreamed message had the text."""
    ask = {"model": "tiny", "max_tokens": 12, "messages": ASK}
    extra = {**GREEDY, "structured_outputs": {"regex": f"ab{separator}cd"}}
    assert client.messages.create(**ask, extra_body=extra).content[0].text == f"ab{separator}cd"
    with client.messages.stream(**ask, extra_body=extra) as stream:
        assert stream.get_final_message().content[0].text == f"ab{separator}cd"


def test_thinking_asked_of_a_model_that_does_not_think_is_served_without_it(client: anthropic.Anthropic) -> None:
    """Agents written for Anthropic's models send ``thinking``; without a reasoning parser the answer is the same as
    without it (no thinking block), not an error."""
    plain = client.messages.create(model="tiny", max_tokens=8, messages=ASK, extra_body=GREEDY)
    thinking = {"type": "enabled", "budget_tokens": 4}
    asked = client.messages.create(model="tiny", max_tokens=8, messages=ASK, extra_body=GREEDY, thinking=thinking)
    assert [(b.type, b.text) for b in asked.content] == [(b.type, b.text) for b in plain.content]
    # A budget of max_tokens or more is refused, as Anthropic refuses it (the thinking is part of max_tokens).
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens must be less than max_tokens"):
        client.messages.create(
            model="tiny", max_tokens=8, messages=ASK, thinking={"type": "enabled", "budget_tokens": 8}
        )


@pytest.mark.parametrize(
    ("block", "said"),
    [
        ({"type": "tool_use", "id": "c1", "name": "get_weather"}, "a tool_use block needs its input, an object"),
        ({"type": "tool_use", "id": "c1", "name": "f", "input": "{}"}, "a tool_use block needs its input, an object"),
        ({"type": "tool_result", "tool_use_id": 5, "content": "x"}, "a tool_result block needs its tool_use_id"),
    ],
)
def test_a_tool_block_missing_a_field_is_refused_by_that_field(
    client: anthropic.Anthropic, block: dict, said: str
) -> None:
    """(It was refused as a block the turn could not hold, which it can.)"""
    turns = [*ASK, {"role": "assistant", "content": [block]}] if block["type"] == "tool_use" else []
    turns = turns or [{"role": "user", "content": [block]}]
    with pytest.raises(anthropic.BadRequestError, match=said):
        client.messages.create(model="tiny", max_tokens=4, messages=turns)


CITY_TOOL = {
    "name": "get_weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.mark.parametrize("max_tokens", [45, 70])
def test_a_tool_use_cut_off_by_max_tokens_has_the_input_the_stream_built(
    client: anthropic.Anthropic, max_tokens: int
) -> None:
    """A forced call cut off by max_tokens inside its arguments: the unstreamed message's ``tool_use`` input is what
    Anthropic's client builds from the stream's ``input_json_delta``s (their partial JSON read as jiter reads it);
    before, it was ``{"arguments": <the JSON text so far>}``, a key the tool does not take, where the stream's was
    the object so far."""
    ask = {"model": "tiny", "max_tokens": max_tokens, "messages": ASK, "extra_body": GREEDY, "tools": [CITY_TOOL]}
    forced = {"type": "tool", "name": "get_weather"}
    message = client.messages.create(**ask, tool_choice=forced)
    with client.messages.stream(**ask, tool_choice=forced) as stream:
        streamed = stream.get_final_message()
    (call,) = [b for b in message.content if b.type == "tool_use"]
    (streamed_call,) = [b for b in streamed.content if b.type == "tool_use"]
    assert message.stop_reason == streamed.stop_reason == "max_tokens"
    assert call.input == streamed_call.input and "arguments" not in call.input


def test_calls_cut_off_after_a_whole_call_come_as_far_as_they_got(served: Served, chat: openai.OpenAI) -> None:
    """Forced calls (Hermes' format) cut off by max_tokens after a whole call, inside the next one's tag or JSON: no
    content, finish_reason length, the calls as far as they got, streamed alike, no logprobs for the calls' tokens;
    before, the next call's text so far was the content (its tokens content logprobs) and the finish tool_calls."""
    eos = {str(e): -100 for e in served.loaded.tokenizer.eos_token_ids}  # (the grammar then goes on to more calls)
    city = {"name": CITY_TOOL["name"], "parameters": CITY_TOOL["input_schema"]}
    noop = {"name": "noop", "parameters": {"type": "object", "properties": {}}}
    tools = [{"type": "function", "function": city}, {"type": "function", "function": noop}]
    for max_tokens in range(66, 110, 7):  # (past the first call: 60 tokens end it, its end tag and all)
        ask = {"model": "tiny", "messages": ASK, "tools": tools, "tool_choice": "required", "logit_bias": eos}
        ask |= {"max_tokens": max_tokens, "temperature": 0, "logprobs": True}
        whole = chat.chat.completions.create(**ask).choices[0]
        content, finish, calls = streamed_chat(chat, ask)
        assert (whole.finish_reason, whole.message.content, content, finish) == ("length", None, "", "length")
        assert whole.message.tool_calls and not (whole.logprobs and whole.logprobs.content)
        assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == calls


@pytest.mark.parametrize("before", ["\n\n", "Let me check.\n\n"])
def test_blanks_before_a_call_are_no_content_streamed_or_not(
    client: anthropic.Anthropic, chat: openai.OpenAI, before: str
) -> None:
    """The blanks between an answer's text and its call (or before a call that opens it) are not content, streamed
    or not: the stream holds them until it knows what follows. Before, it sent them first: a text block of blanks
    alone in Anthropic's stream (which Anthropic's API refuses in a history), ``Let me check.\\n`` on chat where the
    unstreamed message said ``Let me check.``."""
    said = before + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    extra = {**GREEDY, "structured_outputs": {"regex": re.escape(said).replace("\\ ", " ")}}
    ask = {"model": "tiny", "max_tokens": 200, "messages": ASK, "tools": [CITY_TOOL], "extra_body": extra}

    def blocks(message: anthropic.types.Message) -> list[tuple[str, Any]]:
        return [(b.type, b.text if b.type == "text" else (b.name, b.input)) for b in message.content]

    message = client.messages.create(**ask)
    with client.messages.stream(**ask) as stream:
        streamed = stream.get_final_message()
    text = [("text", before.strip())] if before.strip() else []
    assert blocks(message) == blocks(streamed) == [*text, ("tool_use", ("get_weather", {"city": "Paris"}))]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY_TOOL["input_schema"]}}]
    asked = {"model": "tiny", "messages": ASK, "tools": tools, "max_tokens": 200, "extra_body": extra}
    whole = chat.chat.completions.create(**asked).choices[0]
    content, finish, calls = streamed_chat(chat, asked)
    assert (content, finish) == (whole.message.content or "", "tool_calls") and len(calls) == 1


def test_the_guards_errors_are_anthropics_on_its_routes(served: Served, client: anthropic.Anthropic) -> None:
    """A wrong API key (401) and a body over ``--max-body-mb`` (413) are answered by middleware before any route:
    on the Messages routes they are Anthropic's error objects, as the routes' own errors are (they were OpenAI's);
    the OpenAI routes keep OpenAI's."""
    wrong = anthropic.Anthropic(base_url=served.url, api_key="wrong", max_retries=0)
    too_big = "x" * (9 << 20)  # (the default limit: 8 MiB)
    for route, asked in (("create", {"max_tokens": 4}), ("count_tokens", {})):
        with pytest.raises(anthropic.AuthenticationError) as refused:
            getattr(wrong.messages, route)(model="tiny", messages=ASK, **asked)
        assert refused.value.body == {
            "type": "error",
            "error": {"type": "authentication_error", "message": "missing or invalid API key"},
        }
        with pytest.raises(anthropic.ContentTooLargeError) as large:
            getattr(client.messages, route)(model="tiny", messages=ASK, system=too_big, **asked)
        assert large.value.body == {
            "type": "error",
            "error": {"type": "request_too_large", "message": "request body exceeds 8388608 bytes"},
        }
    r = httpx.post(served.url + "/v1/chat/completions", json={}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_a_tool_result_marked_as_an_error_tells_the_model(served: Served, client: anthropic.Anthropic) -> None:
    """``is_error: true`` on a ``tool_result`` (Anthropic's: the tool failed) reaches the model as the result's text
    after ``Error: ``, since chat templates have no field for it; before, it was dropped (the prompt of a success)."""
    call = {"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Atlantis"}}

    def counted(**mark: bool) -> int:
        result = {"type": "tool_result", "tool_use_id": "c1", "content": "no such city", **mark}
        messages = [*ASK, {"role": "assistant", "content": [call]}, {"role": "user", "content": [result]}]
        return client.messages.count_tokens(model="tiny", messages=messages).input_tokens

    function = {"name": "get_weather", "arguments": json.dumps(call["input"])}
    chat = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": function}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Error: no such city"},
    ]
    tokens = httpx.post(served.url + "/tokenize", json={"messages": chat}, headers={"x-api-key": "secret"})
    assert counted(is_error=True) == tokens.json()["count"] != counted(is_error=False) == counted()
    with pytest.raises(anthropic.BadRequestError, match="is_error"):
        client.messages.count_tokens(
            model="tiny",
            messages=[
                *ASK,
                {"role": "assistant", "content": [call]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "is_error": "yes"}]},
            ],
        )


def test_a_server_tool_is_refused_by_its_type(client: anthropic.Anthropic) -> None:
    """Anthropic's server tools (web search and the like) are not served: a 400 naming the tool's type, where it was
    ``tools.0.input_schema: Field required`` (which sent the client looking for a schema it cannot give)."""
    web_search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
    for route, asked in ((client.messages.create, {"max_tokens": 4}), (client.messages.count_tokens, {})):
        with pytest.raises(anthropic.BadRequestError) as refused:
            route(model="tiny", messages=ASK, tools=[UNITS_TOOL, web_search], **asked)
        message = refused.value.body["error"]["message"]  # type: ignore[index]
        assert message.startswith("tools.1.type: ") and "'web_search_20250305'" in message and "server tools" in message
    # A custom tool may say so.
    assert client.messages.count_tokens(model="tiny", messages=ASK, tools=[{**UNITS_TOOL, "type": "custom"}])


def test_a_call_of_a_dag_program_joins_the_threads_it_names(client: anthropic.Anthropic, served: Served) -> None:
    # parent_thread_ids, one of the chat route's fields carried beside Anthropic's: the call starts where the threads
    # it joins ended (ATLAS's critical path), not where its own thread did.
    hi = [{"role": "user", "content": "Hi"}]
    client.messages.create(
        model="tiny", max_tokens=8, messages=hi, extra_body={"program_id": "dag-messages", "thread_id": "a"}
    )
    joined = {"program_id": "dag-messages", "thread_id": "b", "parent_thread_ids": ["a"]}
    client.messages.create(model="tiny", max_tokens=1, messages=hi, extra_body=joined)
    record = served.engine.core.policy.table.get("dag-messages")  # type: ignore[attr-defined]
    assert record is not None and record.threads["b"].service_s > record.threads["a"].service_s


def test_a_request_past_the_context_is_refused_in_anthropics_words(client: anthropic.Anthropic) -> None:
    # Claude Code reads "prompt is too long" (Anthropic's message, its type invalid_request_error) as the cue to
    # compact its conversation; ours said "this model's maximum context length is ...".
    long = [{"role": "user", "content": "word " * 1500}]
    tokens = client.messages.count_tokens(model="tiny", messages=long).input_tokens  # type: ignore[arg-type]
    assert tokens > 1024
    for stream in (False, True):
        with pytest.raises(anthropic.BadRequestError) as refused:
            client.messages.create(model="tiny", max_tokens=4, messages=long, stream=stream)  # type: ignore[arg-type]
        assert refused.value.body["error"] == {  # type: ignore[index]
            "type": "invalid_request_error",
            "message": f"prompt is too long: {tokens} tokens > 1024 maximum",
        }
    fits = [{"role": "user", "content": "Hi"}]
    tokens = client.messages.count_tokens(model="tiny", messages=fits).input_tokens  # type: ignore[arg-type]
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model="tiny", max_tokens=1024, messages=fits)  # type: ignore[arg-type]
    assert refused.value.body["error"]["message"] == (  # type: ignore[index]
        f"input length and `max_tokens` exceed context limit: {tokens} + 1024 > 1024, decrease input length or "
        "`max_tokens` and try again"
    )


def test_an_earlier_turns_thinking_reaches_the_template_as_its_reasoning() -> None:
    """Claude Code sends each earlier turn back whole, its thinking blocks too: their text is the turn's
    ``reasoning_content`` (as the chat route takes it; a template keeping the thinking before a call renders it,
    gpt-oss's), a redacted one adds nothing."""
    from boundless.api.messages import MessagesRequest, chat_messages

    turn = [
        {"type": "thinking", "thinking": "Look it up.", "signature": ""},
        {"type": "redacted_thinking", "data": "gAAAA"},
        {"type": "tool_use", "id": "t1", "name": "f", "input": {}},
    ]
    body = MessagesRequest.model_validate(
        {
            "model": "tiny",
            "max_tokens": 8,
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": turn},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]},
            ],
        }
    )
    messages = chat_messages(body)
    assert messages[1]["reasoning_content"] == "Look it up." and messages[1]["tool_calls"][0]["id"] == "t1"
    assert "reasoning_content" not in chat_messages(body.model_copy(update={"messages": body.messages[:1]}))[0]

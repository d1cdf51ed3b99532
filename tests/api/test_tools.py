"""Tools reach chat templates that take them; tool calls in the output come back as ``tool_calls``."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from served_models import UNITS, WEATHER, Served, serve_hermes, streamed_chat

from boundless.api.call_scanner import CallScanner, scan_calls
from boundless.api.logprobs import StreamedContent, content_tokens
from boundless.api.tool_calls import (
    ALL_FORMATS,
    BARE_JSON,
    PYTHONIC,
    TAGGED,
    TOOL_CALL_PARSERS,
    CallStream,
    ContentStream,
    ParameterTypes,
    ToolCall,
    forced_call_schema,
    parameter_types,
    parse_tool_calls,
    template_messages,
)
from boundless.config import ServerConfig
from boundless.engine.logprobs import SampledToken

WEATHER_CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}  # (a call of WEATHER, as JSON writes it)


@pytest.fixture(scope="module")
def hermes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serve_hermes(tmp_path_factory.mktemp("hermes")) as served:
        yield served


def _streamed(text: str, step: int = 1) -> tuple[list[str], str, list[ToolCall]]:
    """The content a ContentStream sends as ``text`` grows ``step`` characters at a time, and what finish gives."""
    stream = ContentStream()
    sent = [stream.feed(text[:end]) for end in range(step, len(text), step)]
    rest, calls = stream.finish(text, parse_tool_calls)
    return [p for p in sent if p], rest, calls


def _calls_of(deltas: list) -> list[tuple[str, str, str]]:
    """Streamed tool-call deltas put together as a client does: (id, name, arguments) by index."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        call = calls.setdefault(d.index, ["", "", ""])
        call[0] += d.id or ""
        call[1] += (d.function.name or "") if d.function else ""
        call[2] += (d.function.arguments or "") if d.function else ""
    return [tuple(calls[i]) for i in sorted(calls)]  # type: ignore[misc]


def test_content_streams_until_a_call_begins() -> None:
    text = 'Let me check the weather. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    pieces, rest, calls = _streamed(text)
    # As it came, a character at a time, but the blank before the call: no content, as the unstreamed content lacks it.
    assert "".join(pieces) == "Let me check the weather." and len(pieces) > 10
    assert not any("<" in p for p in pieces)  # never a tag's first characters
    assert rest == "" and [c.name for c in calls] == ["get_weather"]
    # Text after the calls comes at the end; sent and rest are the unstreamed content, the blanks between kept.
    text = "Checking. <tool_call>" + '{"name": "f", "arguments": {}}' + "</tool_call> Done."
    pieces, rest, calls = _streamed(text, step=3)
    assert "".join(pieces) + rest == parse_tool_calls(text)[0] == "Checking.  Done."
    assert [c.name for c in calls] == ["f"]


@pytest.mark.parametrize(
    "text",
    [
        "A <toolbox> is not a tag; <tool_use> neither.",  # held while it could be one, then sent
        "  Plain text, blanks first.",
        "[1, 2] is a list, not calls.",
        '{"not": "a call"}',
    ],
)
def test_content_that_holds_no_call_arrives_whole(text: str) -> None:
    pieces, rest, calls = _streamed(text)
    assert "".join(pieces) + rest == text and not calls
    if text[0] in "{[":  # an output that opens with JSON could be a bare call: held to the end
        assert not pieces


def test_a_bare_json_call_is_held_to_the_end() -> None:
    pieces, rest, calls = _streamed('{"name": "get_weather", "arguments": {"city": "Rome"}}')
    assert (
        not pieces
        and rest == ""
        and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Rome"})]
    )


def test_with_tools_an_answer_without_calls_streams_as_it_is_made(hermes: Served) -> None:
    ask: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": [WEATHER],
        "max_tokens": 24,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    whole = hermes.client.chat.completions.create(**ask).choices[0]
    assert not whole.message.tool_calls and whole.message.content  # a random model's text parses as no call
    streamed = [c.choices[0] for c in hermes.client.chat.completions.create(**ask, stream=True, logprobs=True)]
    assert sum(1 for c in streamed if c.delta.content) > 5  # not held to the end
    assert "".join(c.delta.content or "" for c in streamed) == whole.message.content
    assert sum(len(c.logprobs.content or []) for c in streamed if c.logprobs) == 24  # each token's, once


def test_served_json_answer_with_a_name_stays_the_answer(hermes: Served) -> None:
    """A JSON answer that has a "name" (held to it by a regex) is the content, streamed, not streamed and in the
    Responses API; before, it was a call to a function named "Bob", with its answer lost."""
    answer = '{"name": "Bob", "age": 3}'
    extra = {"structured_outputs": {"regex": re.escape(answer)}}
    asked: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [WEATHER],
        "max_tokens": 50,
        "extra_body": extra,
    }
    reply = hermes.client.chat.completions.create(**asked).choices[0]
    assert (reply.message.content, reply.message.tool_calls, reply.finish_reason) == (answer, None, "stop")
    chunks = [c.choices[0] for c in hermes.client.chat.completions.create(**asked, stream=True)]
    assert "".join(c.delta.content or "" for c in chunks) == answer
    assert not any(c.delta.tool_calls for c in chunks) and chunks[-1].finish_reason == "stop"
    response = hermes.client.responses.create(
        model="tiny", input="hi", tools=[{"type": "function", **WEATHER["function"]}], extra_body=extra
    )
    assert [item.type for item in response.output] == ["message"] and response.output_text == answer


@pytest.mark.parametrize("after", [" and more text", "\n\nDone.", '; {"name": "Bob"}'])  # (calls a ";" apart: calls)
def test_served_bare_call_with_text_after_it_is_the_answer_streamed_or_not(hermes: Served, after: str) -> None:
    """Bare JSON shaped like a call, then more text (held to it by a regex): the answer, no call, streamed or not.
    Before, the stream sent the call as soon as its JSON was written, then the whole text as content."""
    answer = json.dumps(WEATHER_CALL) + after
    asked: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "weather in Paris?"}],
        "tools": [WEATHER],
        "max_tokens": 200,
        "temperature": 0,
        "extra_body": {"structured_outputs": {"regex": re.escape(answer)}},
    }
    reply = hermes.client.chat.completions.create(**asked).choices[0]
    assert (reply.message.content, reply.message.tool_calls, reply.finish_reason) == (answer, None, "stop")
    assert streamed_chat(hermes.client, asked) == (answer, "stop", [])
    # Alone, the same JSON is a call, streamed too (whole, at the end).
    asked["extra_body"] = {"structured_outputs": {"regex": re.escape(json.dumps(WEATHER_CALL))}}
    assert streamed_chat(hermes.client, asked) == ("", "tool_calls", [("get_weather", '{"city": "Paris"}')])


def _content_of(text: str, pieces: list[str], tools: Any) -> list[str]:
    """The pieces (an output's tokens' texts, which make up ``text``) that :func:`content_tokens` keeps as content."""
    starts = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
    tokens = [SampledToken(i) for i in range(len(pieces))]
    kept = content_tokens(tokens, starts, tools.content_spans(text), len(text))
    return [pieces[t.token_id] for t in kept]


def test_a_messages_logprobs_are_its_contents_tokens() -> None:
    """OpenAI's ``logprobs.content`` lists "message content tokens": a call's are not among them. A token belongs where
    its text starts: one that holds the blank before a call that ends the content and the call's tag is the call's
    (the content drops the blank), but content where the blank stays in it (text follows the call); the
    end-of-sequence token (no text) goes with the content when content ends the output."""
    from boundless.api.server import ToolUse

    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    pieces = ["Sure", ".", " <tool_call>", call.removeprefix("<tool_call>"), ""]
    assert _content_of("".join(pieces), pieces, ToolUse(True)) == ["Sure", "."]
    pieces = ["Sure", ".", " <tool_call>", call.removeprefix("<tool_call>"), " Done", ".", ""]  # ("Sure.  Done.")
    assert _content_of("".join(pieces), pieces, ToolUse(True)) == ["Sure", ".", " <tool_call>", " Done", ".", ""]
    pieces = ["Sure", ". ", call, ""]  # (". " starts in the content: it is content, blank and all)
    assert _content_of("".join(pieces), pieces, ToolUse(True)) == ["Sure", ". "]
    pieces = ["Sure", ".", " <tool_call>", call.removeprefix("<tool_call>").removesuffix("</tool_call>"), ""]
    assert _content_of("".join(pieces), pieces, ToolUse(True)) == ["Sure", "."]  # (a call in a block left unclosed)
    pieces = ['{"name": "f", ', '"arguments": {}}', ""]  # a bare call: no content at all
    assert _content_of("".join(pieces), pieces, ToolUse(True)) == []
    pieces = ["No", " call", " here.", ""]  # no call, or tools not read: all of it
    assert (
        _content_of("".join(pieces), pieces, ToolUse(True))
        == pieces
        == _content_of("No call here.", pieces, ToolUse(False))
    )


class _Starts:
    """Token starts known in advance (a TokenStarts without a tokenizer)."""

    def __init__(self, starts: list[int]) -> None:
        self._starts = iter(starts)

    def add(self, token_ids: Iterator[int]) -> list[int]:
        return [next(self._starts) for _ in token_ids]


def test_blanks_between_content_and_calls_keep_their_logprobs_streamed_or_not() -> None:
    """The content is the parts around the calls joined, then stripped: blanks between the parts stay in it, and so
    do their tokens, streamed (ContentStream and StreamedContent fed a token at a time) as unstreamed (before, the
    blanks that ended each part were dropped: of ``A\\n\\n\\n\\nB``, two newlines' tokens). A token that starts in the
    blanks that begin the content (`` B`` after a call) is the content's, as the stream sends it."""
    from boundless.api.server import ToolUse

    tools = ToolUse(True, types=parameter_types([WEATHER]))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    for pieces in (
        ["A", "\n", "\n", call, "\n", "\n", "B", ""],
        ["\n", "A", "\n\n", call, "\n\n", call, " ", "\n", "B", ""],
        ["\n", call, "\n\n", "B", "\n", call, "\n", ""],
        ["A", call, "\n\n", call, " B", call, " ", call, "\n", ""],
    ):
        text = "".join(pieces)
        content, calls = tools.calls(text)
        assert calls and content is not None
        unstreamed = _content_of(text, pieces, tools)
        assert "".join(unstreamed).lstrip() == content  # (a token of blanks alone may begin it, as it begins the text)
        starts = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
        stream, logprobs, streamed, sent = ContentStream(), StreamedContent(_Starts(starts)), [], ""
        for i in range(len(pieces)):
            logprobs.add([SampledToken(i)])
            sent += stream.feed(text[: starts[i] + len(pieces[i])])
            streamed += logprobs.release(text, text, stream.sent)
        rest, _ = stream.finish(text, tools.calls)
        streamed += logprobs.finish(tools.content_spans(text), len(text))
        assert (sent + rest).strip() == content
        assert [pieces[t.token_id] for t in streamed] == unstreamed


def test_logprobs_leave_out_the_calls_tokens_streamed_or_not(hermes: Served) -> None:
    """The message's logprobs are its content's tokens', streamed as unstreamed: the text around a Hermes block, the
    blanks between included, as the content keeps them; none for a bare call (the message has no content)."""
    ask: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER],
        "max_tokens": 200,
        "temperature": 0,
        "logprobs": True,
    }
    block = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    for said, content, spelled in [
        (f"Sure. {block} Done.", "Sure.  Done.", "Sure.  Done.<|im_end|>"),
        ('{"name": "get_weather", "arguments": {"city": "Paris"}}', None, ""),
    ]:
        extra = {"structured_outputs": {"regex": re.escape(said).replace("\\ ", " ")}}
        whole = hermes.client.chat.completions.create(**ask, extra_body=extra).choices[0]
        assert whole.finish_reason == "tool_calls" and whole.message.content == content
        tokens = [t.token for t in whole.logprobs.content]
        assert "".join(tokens) == spelled
        chunks = list(hermes.client.chat.completions.create(**ask, extra_body=extra, stream=True))
        streamed = [t.token for c in chunks for t in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])]
        assert streamed == tokens


def test_parse_hermes_blocks() -> None:
    text = 'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0].to_openai()["type"] == "function" and calls[0].id.startswith("call_")


def test_an_end_tag_inside_a_calls_arguments_does_not_cut_its_block() -> None:
    """An agent writing about tool calls: ``</tool_call>`` in a string of the arguments is text, not the block's end
    (a forced call's arguments were lost, returned as content), streamed or not; the content around is kept."""
    call = '<tool_call>\n{"name": "note", "arguments": {"text": "Close with </tool_call>."}}\n</tool_call>'
    content, calls = parse_tool_calls("Noted. " + call + " Done.")
    assert content == "Noted.  Done." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("note", {"text": "Close with </tool_call>."})
    ]
    assert parse_tool_calls(call + call)[1][1].arguments == calls[0].arguments
    _, deltas, rest, streamed, _ = _stream_calls("Noted. " + call)
    assert [(name, json.loads(args)) for _, name, args in _put_together(deltas)] == [
        ("note", {"text": "Close with </tool_call>."})
    ]
    assert [c.arguments for c in streamed] == [calls[0].arguments] and not rest.strip()
    # A block that is not JSON (Qwen3-Coder's XML) still ends at its first end tag.
    xml = "<tool_call>\n<function=note>\n<parameter=text>\nhi\n</parameter>\n</function>\n</tool_call>"
    assert [c.name for c in parse_tool_calls(xml + " after")[1]] == ["note"]


def test_an_end_tag_inside_an_unclosed_calls_arguments_does_not_cut_its_block() -> None:
    """A call the model ended before its end tag (vLLM's Hermes parser reads it), with ``</tool_call>`` in a string of
    its arguments: the tag in the string is not the block's end, so the call is a call, as the stream sent it; before,
    the unstreamed response had the text as content and no call while the stream sent the call and the text."""
    text = 'Noted. <tool_call>\n{"name": "note", "arguments": {"text": "Close with </tool_call>."}}\n'
    content, calls = parse_tool_calls(text)
    assert content == "Noted." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("note", {"text": "Close with </tool_call>."})
    ]
    sent, _, rest, streamed, _ = _stream_calls(text)
    assert [c.arguments for c in streamed] == [calls[0].arguments] and (sent + rest).strip() == "Noted."


def test_parse_bare_json_calls() -> None:
    content, calls = parse_tool_calls('{"name": "f", "parameters": {"x": 1}}')
    assert content is None and calls[0].name == "f" and json.loads(calls[0].arguments) == {"x": 1}
    content, calls = parse_tool_calls('[{"name": "f", "arguments": {}}, {"name": "g", "arguments": "{}"}]')
    assert [c.name for c in calls] == ["f", "g"] and calls[1].arguments == "{}"


@pytest.mark.parametrize(
    "text",
    [
        "plain text",
        '{"not": "a call"}',
        "<tool_call>not json</tool_call>",
        "{broken",
        '{"name": "Bob", "age": 3}',  # a JSON answer with a name: no arguments, so no call
        '[{"name": "Bob"}, {"name": "Ann", "arguments": {}}]',
    ],
)
def test_text_without_calls_is_left_alone(text: str) -> None:
    assert parse_tool_calls(text) == (text, [])


def test_bare_json_is_a_call_only_with_arguments_and_a_tools_name() -> None:
    """Bare JSON (no tags) is read as a call as vLLM's llama3_json parser reads it, with ``arguments`` or
    ``parameters``, and only when it names one of the request's tools: a model answering in JSON is common. Inside
    a ``<tool_call>`` block, which says a call is meant, a name alone is a call with no arguments."""
    types = parameter_types([WEATHER])
    for answer in ('{"name": "Bob", "arguments": {"age": 3}}', '{"name": "get_weather", "city": "Paris"}'):
        assert parse_tool_calls(answer, types) == (answer, [])
    content, calls = parse_tool_calls('{"name": "get_weather", "arguments": {"city": "Paris"}}', types)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]
    content, calls = parse_tool_calls('<tool_call>{"name": "get_weather"}</tool_call>', types)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", "{}")]


def test_assistant_tool_call_arguments_become_objects_for_templates() -> None:
    messages = [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]}
    ]
    assert template_messages(messages)[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # the caller's copy is untouched


def test_tools_and_tool_messages_reach_the_template(hermes: Served) -> None:
    loaded, client = hermes.loaded, hermes.client
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    with_tools = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=2)
    expected = loaded.tokenizer.apply_chat_template(template_messages(messages), tools=[WEATHER])
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in expected
    assert with_tools.usage.prompt_tokens == len(loaded.tokenizer.encode(expected, add_special_tokens=False))
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens
    # tool_choice none keeps the tools in the prompt, as vLLM does (an agent's calls with and without tools share
    # their prefix); vLLM's --exclude-tools-when-tool-choice-none leaves them out (below).
    none = client.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=2
    )
    assert none.usage.prompt_tokens == with_tools.usage.prompt_tokens
    assert not none.choices[0].message.tool_calls


def test_tools_reach_the_template_as_vllm_hands_them_over(hermes: Served) -> None:
    """A tool's omitted description and parameters reach the template as null (vLLM's ``model_dump``: a template
    that writes each tool's JSON writes them), ``strict`` only when sent."""
    bare = {"type": "function", "function": {"name": "ping"}}
    messages = [{"role": "user", "content": "Hi"}]
    r = hermes.client.chat.completions.create(
        model="tiny", messages=messages, tools=[bare, WEATHER], max_tokens=1, extra_body={"return_token_ids": True}
    )  # type: ignore[list-item]
    tok = hermes.loaded.tokenizer
    given = [{"type": "function", "function": {"name": "ping", "description": None, "parameters": None}}, WEATHER]
    text = tok.apply_chat_template(messages, tools=given)
    assert '"description": null' in text and "strict" not in text
    assert r.model_extra["prompt_token_ids"] == tok.encode(text, add_special_tokens=False)


def test_tools_leave_the_prompt_under_tool_choice_none_with_vllms_flag(tmp_path: Path) -> None:
    """``--exclude-tools-when-tool-choice-none``: a call that lets the model use no tool is prompted without them."""
    messages = [{"role": "user", "content": "Weather?"}]
    with serve_hermes(tmp_path, server_config=ServerConfig(exclude_tools_when_tool_choice_none=True)) as served:
        client = served.client
        plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
        none = client.chat.completions.create(
            model="tiny", messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=1
        )
        auto = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=1)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < auto.usage.prompt_tokens


def test_a_named_tool_choice_makes_even_a_random_models_output_that_call(
    hermes: Served,
) -> None:
    """The grammar holds the output to the named function's call: a random model, whose free text parses as no call,
    answers with one, streamed and not; a name that is not among the tools is a 400."""
    client = hermes.client
    ask = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Use Kelvin."}],
        "tools": [WEATHER, UNITS],
        "max_tokens": 200,
        "temperature": 0,
    }
    free = client.chat.completions.create(**ask, tool_choice="auto")
    assert not free.choices[0].message.tool_calls
    forced = client.chat.completions.create(**ask, tool_choice={"type": "function", "function": {"name": "set_units"}})
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0].function
    arguments = json.loads(call.arguments)
    assert call.name == "set_units" and isinstance(arguments["metric"], bool) and arguments["scale"] in "CFK"
    stream = client.chat.completions.create(
        **ask, tool_choice={"type": "function", "function": {"name": "set_units"}}, stream=True
    )
    streamed = [c.choices[0] for c in stream if c.choices]
    deltas = [t for c in streamed if c.delta.tool_calls for t in c.delta.tool_calls]
    assert len(deltas) > 3  # the arguments as they were written
    assert [(name, json.loads(args)) for _, name, args in _calls_of(deltas)] == [("set_units", arguments)]
    assert streamed[-1].finish_reason == "tool_calls"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**ask, tool_choice={"type": "function", "function": {"name": "nothing"}})
    assert err.value.body["param"] == "tool_choice"


def test_parameters_that_are_not_an_objects_schema_get_openais_error(hermes: Served) -> None:
    """A call's arguments are a JSON object, so a tool's parameters must be an object's schema: else a 400 with
    OpenAI's message and code (before, a forced call's "arguments" were then a JSON string, not an object)."""
    expected = (
        "Invalid schema for function 'f': schema must be a JSON Schema of 'type: \"object\"', got 'type: \"string\"'."
    )
    chat_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    with pytest.raises(openai.BadRequestError) as err:
        hermes.client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], tools=[chat_tool], tool_choice="required"
        )
    error = err.value.body
    assert (error["param"], error["code"]) == ("tools.0.function.parameters", "invalid_function_parameters")
    assert error["message"].endswith(expected)
    with pytest.raises(openai.BadRequestError) as err:
        hermes.client.responses.create(
            model="tiny", input="Hi", tools=[{"type": "function", **chat_tool["function"]}], tool_choice="required"
        )
    error = err.value.body
    assert (error["param"], error["code"]) == ("tools.0.parameters", "invalid_function_parameters")
    assert error["message"].endswith(expected)


def test_required_without_parallel_calls_makes_exactly_one(hermes: Served) -> None:
    client = hermes.client
    counts = set()
    for question in ("Units?", "Which scale?", "Metric or not?"):
        r = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": question}],
            tools=[UNITS],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=600,  # (room for the 32 blanks a random model may put between each two JSON tokens)
            temperature=0,
        )
        assert r.choices[0].finish_reason == "tool_calls"
        counts.add(len(r.choices[0].message.tool_calls))
    assert counts == {1}


def test_a_grammar_over_too_many_tools_is_refused_before_it_is_compiled(hermes: Served) -> None:
    """A forced call's (or strict tools') grammar over thousands of tools: its compilation grew faster than the tools
    (20,000 took a server's every byte of memory, and it was killed). Past 512, a 400 naming ``tools``; a named tool
    (one tool's grammar) and tools under ``auto`` (no grammar) are not refused so."""
    many = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}} for i in range(513)]
    ask: dict = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    with pytest.raises(openai.BadRequestError) as forced:
        hermes.client.chat.completions.create(**ask, tools=many, tool_choice="required")
    assert forced.value.body["param"] == "tools" and "at most 512" in forced.value.body["message"]  # type: ignore[index]
    strict = [{**many[0], "function": {**many[0]["function"], "strict": True}}, *many[1:]]
    with pytest.raises(openai.BadRequestError, match="strict tools with 513 tools"):
        hermes.client.chat.completions.create(**ask, tools=strict)
    # A named tool's grammar holds one tool's calls, and auto none: past the tiny model's context, but not refused so.
    for choice in ({"type": "function", "function": {"name": "f7"}}, "auto"):
        with pytest.raises(openai.BadRequestError) as long:
            hermes.client.chat.completions.create(**ask, tools=many, tool_choice=choice)
        assert long.value.body["code"] == "context_length_exceeded"  # type: ignore[index]


def test_the_forced_schema_lists_each_tool_and_caps_the_calls_without_parallel_calls() -> None:
    schema = forced_call_schema([WEATHER, UNITS], None, parallel=False)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert [c["properties"]["name"] for c in schema["items"]["anyOf"]] == [
        {"enum": ["get_weather"]},
        {"enum": ["set_units"]},
    ]
    named = forced_call_schema([WEATHER, UNITS], "set_units")
    assert named["properties"]["parameters"] == UNITS["function"]["parameters"]


def test_without_parallel_calls_only_the_first_parsed_call_is_kept() -> None:
    from boundless.api.server import ToolUse

    text = '[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]'
    assert [c.name for c in ToolUse(True, parallel=False).calls(text)[1]] == ["f"]
    assert [c.name for c in ToolUse(True).calls(text)[1]] == ["f", "g"]


def _stream_calls(
    text: str, parallel: bool = True, types: ParameterTypes | None = None, formats: frozenset[str] = ALL_FORMATS
) -> tuple[str, list[dict], str, list[ToolCall], list[dict]]:
    """``text`` fed a character at a time to a ContentStream and a CallStream, as the server feeds them: (content
    sent, call deltas sent, content at the end, parsed calls, the deltas that complete them). ``types``: the
    request's tools (None: not known); ``formats``: the shapes read."""
    content, calls_stream = ContentStream(formats), CallStream(parallel, types, formats=formats)
    sent, deltas = [], []
    for end in range(1, len(text)):
        sent.append(content.feed(text[:end]))
        if content.held:
            deltas += calls_stream.feed(text[:end], content.sent)
    rest, calls = content.finish(text, lambda t: _parallel(parse_tool_calls(t, types, formats), parallel))
    return "".join(sent), deltas, rest, calls, calls_stream.finish(calls) if calls else []


def _parallel(parsed: tuple[str | None, list[ToolCall]], parallel: bool) -> tuple[str | None, list[ToolCall]]:
    return parsed[0], parsed[1] if parallel else parsed[1][:1]


def _put_together(deltas: list[dict]) -> list[tuple[str, str, str]]:
    calls: dict[int, list[str]] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], ["", "", ""])
        call[0] += d.get("id", "")
        call[1] += d["function"].get("name", "")
        call[2] += d["function"]["arguments"]
    return [tuple(calls[i]) for i in sorted(calls)]  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "content", "rest"),
    [
        (
            'Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "n": 12}}</tool_call>',
            "Checking.",
            "",
        ),
        # Braces and escapes inside strings, a second block, arguments before the name, text after the calls.
        (
            '<tool_call>\n{"name": "f", "arguments": {"a": [1, {"b": "}\\"{"}], "c": null}}\n</tool_call>\n'
            '<tool_call>{"arguments": {"x": -1.5e3}, "name": "g"}</tool_call> Done.',
            "",
            "Done.",
        ),
    ],
)
def test_calls_stream_as_they_are_written(text: str, content: str, rest: str) -> None:
    sent, deltas, rest_got, calls, final = _stream_calls(text)
    assert sent == content and rest_got == rest
    assert len(deltas) > 10  # the arguments a character at a time, not whole at the end
    assert deltas[0]["id"] and deltas[0]["function"]["name"] == calls[0].name  # the name comes first, whole
    together = _put_together(deltas + final)
    assert together == [(c.id, c.name, c.arguments) for c in calls]  # the parsed calls, ids and all
    assert [json.loads(args) for _, _, args in together] == [json.loads(c.arguments) for c in calls]
    # The arguments are the model's own JSON text, streamed or not.
    assert all(c.arguments in text for c in calls) and parse_tool_calls(text)[1][0].arguments == calls[0].arguments


def test_calls_that_cannot_stream_come_whole_at_the_end() -> None:
    # Arguments given as a JSON string: its value is the arguments, known when the string ends.
    _, deltas, _, calls, final = _stream_calls('{"name": "f", "arguments": "{\\"a\\": 1}"}')
    assert deltas == [] and _put_together(final) == [(calls[0].id, "f", '{"a": 1}')]
    # A bare call the model wrote unforced: a call only if nothing follows it, known when the output ends.
    text = '{"name": "f", "arguments": {"path": "a.py", "text": "def f():\\n    return 1\\n"}}'
    _, deltas, rest, calls, final = _stream_calls(text)
    assert deltas == [] and rest == "" and _put_together(final) == [(calls[0].id, "f", calls[0].arguments)]
    assert calls[0].arguments == parse_tool_calls(text)[1][0].arguments and calls[0].arguments in text
    # parallel_tool_calls false: the first call only.
    two = (
        '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
        + '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    )
    _, deltas, _, calls, final = _stream_calls(two, parallel=False)
    assert {d["index"] for d in deltas + final} == {0} and [c.name for c in calls] == ["f"]


@pytest.mark.parametrize(
    "text",
    ['{"name": "Bob", "age": 3}', '{"name": "Bob", "arguments": {"age": 3}}', '[{"name": "Bob", "parameters": {}}]'],
)
def test_bare_json_that_is_no_call_streams_no_call(text: str) -> None:
    """What the parser reads as an answer (no arguments, or a name that is none of the tools) streams no call
    either: it is the content, at the end."""
    sent, deltas, rest, calls, final = _stream_calls(text, types=parameter_types([WEATHER]))
    assert deltas == [] and calls == [] and final == [] and sent + rest == text


@pytest.mark.parametrize(
    "text",
    [
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "nope", "parameters": {}}]',
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time"}]',
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}, 3]',
    ],
)
def test_a_bare_list_with_an_item_that_is_no_call_streams_no_call(text: str) -> None:
    """The parser reads a bare list as calls only when every item is one; else it is an answer, all of it. Streamed
    alike: no call, not even at the list's end (before, the first item's call went out before the second was seen,
    then the list as content)."""
    types = parameter_types([WEATHER, {"type": "function", "function": {"name": "get_time"}}])
    assert parse_tool_calls(text, types) == (text, [])
    sent, deltas, rest, calls, final = _stream_calls(text, types=types)
    assert deltas == [] and calls == [] and final == [] and sent + rest == text
    content, calls_stream = ContentStream(), CallStream(True, types)
    for end in range(1, len(text) + 1):  # (the list closed, too)
        content.feed(text[:end])
        assert calls_stream.feed(text[:end], content.sent) == []


def test_a_bare_lists_calls_go_out_when_the_output_ends() -> None:
    """The forced-call grammar's shape, a bare list with "parameters", written unforced: its calls go out whole at the
    end, with the parsed calls' ids, not when the list closes (text may follow it, and then it is no call)."""
    text = '[{"name": "f", "parameters": {"q": "a b"}}, {"name": "g", "parameters": {}}]'
    content, calls_stream = ContentStream(), CallStream()
    for end in range(1, len(text) + 1):  # (the list closed, too)
        content.feed(text[:end])
        assert calls_stream.feed(text[:end], content.sent) == []
    rest, calls = content.finish(text, parse_tool_calls)
    assert rest == "" and _put_together(calls_stream.finish(calls)) == [(c.id, c.name, c.arguments) for c in calls]
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"q": "a b"}'), ("g", "{}")]


CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.mark.parametrize(
    "text",
    [
        CALL + " and more text",
        CALL + "\n\nDone.",
        CALL + "; and more text",  # (calls a ";" apart are Llama 3.1's: test_llama_calls_a_semicolon_apart)
        "[" + CALL + "]; " + CALL,
        "[" + CALL + "] and more text",
    ],
)
def test_bare_json_with_text_after_it_streams_no_call(text: str) -> None:
    """Bare JSON shaped like a call, then more text: the parser reads it all as the answer, so the stream sends no
    call either. Before, the call went out as soon as its JSON was written, then the same text again as content."""
    types = parameter_types([WEATHER])
    assert parse_tool_calls(text, types) == (text, [])
    sent, deltas, rest, calls, final = _stream_calls(text, types=types)
    assert deltas == [] and calls == [] and final == [] and sent + rest == text


def test_a_forced_calls_list_streams_its_arguments_as_they_are_written() -> None:
    """tool_choice required or named: the grammar writes calls throughout, so the list's calls stream piece by piece
    (as OpenAI's forced calls do), not whole at the close; the pieces put together are the parsed calls."""
    text = '[{"name": "f", "parameters": {"q": "a b"}}, {"name": "g", "parameters": {}}]'
    content, calls_stream = ContentStream(), CallStream(forced=True)
    fed = []
    for end in range(1, len(text) + 1):
        content.feed(text[:end])
        fed.append(calls_stream.feed(text[:end], content.sent))
    assert sum(1 for deltas in fed[:-1] if deltas) > 3  # before the list has closed, in several pieces
    rest, calls = content.finish(text, parse_tool_calls)
    deltas = [d for part in fed for d in part] + calls_stream.finish(calls)
    assert rest == "" and _put_together(deltas) == [(c.id, c.name, c.arguments) for c in calls]


def test_a_call_cut_off_streams_as_far_as_it_got() -> None:
    """Output that ends inside a call (max_tokens): what was streamed stays, nothing parses, the text is content at
    the end (as unstreamed it is all content)."""
    text = '<tool_call>{"name": "f", "arguments": {"a": "long'
    _, deltas, rest, calls, final = _stream_calls(text)
    assert calls == [] and final == [] and rest == text
    assert _put_together(deltas) == [(deltas[0]["id"], "f", '{"a": "lon')]


def test_a_block_cut_off_after_a_whole_one_streams_no_second_copy_of_the_first() -> None:
    """A whole call, then a block cut off inside its JSON (max_tokens): the parser reads the first alone. The stream
    completes the first and leaves the cut one as it went out (it cannot be taken back), where it sent the first again
    whole at a third index."""
    whole = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    text = "A\n" + whole + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    _, deltas, _, calls, final = _stream_calls(text)
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]
    streamed = _put_together(deltas + final)
    assert [(name, args) for _, name, args in streamed] == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_weather", '{"city": "P'),  # (fed up to the output's last character but one)
    ]
    assert streamed[0][0] == calls[0].id


UNCLOSED = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'  # (and then EOS)


@pytest.mark.parametrize(
    ("text", "content"),
    [
        (UNCLOSED, None),
        ("Checking. " + UNCLOSED + "\n", "Checking."),
        ('<tool_call>{"name": "f", "arguments": {}}</tool_call>\n' + UNCLOSED, None),
    ],
)
def test_an_unclosed_last_block_whose_json_is_whole_is_a_call(text: str, content: str | None) -> None:
    """vLLM's Hermes rule: a last ``<tool_call>`` block the model never closed (it stopped before the end tag) is a
    call when its JSON is whole; streamed and not alike (before, the stream sent the call and then its text as
    content too, and the unstreamed response had the text alone)."""
    parsed, calls = parse_tool_calls(text)
    assert parsed == content and calls[-1].name == "get_weather" and calls[-1].arguments == '{"city": "Paris"}'
    sent, deltas, rest, streamed, final = _stream_calls(text)
    assert (sent + rest).strip() == (content or "")
    assert _put_together(deltas + final) == [(c.id, c.name, c.arguments) for c in streamed]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]


def test_an_unclosed_last_block_whose_json_is_not_whole_stays_content() -> None:
    """After a closed call, a last block cut off (max_tokens) stays in the content, as it does alone."""
    cut = '<tool_call>{"name": "g", "arguments": {"a": 1}'
    content, calls = parse_tool_calls(HERMES + cut)
    assert content == cut and [c.name for c in calls] == ["get_weather"]
    sent, _, rest, streamed, _ = _stream_calls(HERMES + cut)
    assert sent + rest == cut and [c.name for c in streamed] == ["get_weather"]


def test_the_scanner_finds_each_calls_arguments_in_any_layout() -> None:
    rng = random.Random(0)

    def value(depth: int) -> object:
        kind = rng.randrange(6 if depth < 3 else 4)
        return [
            lambda: rng.randrange(-999, 999),
            lambda: rng.choice(["", "a b", '}{"]', "é\\n", "\\u00e9"]),
            lambda: rng.choice([True, False, None]),
            lambda: rng.random() * 1e6,
            lambda: {f"k{i}": value(depth + 1) for i in range(rng.randrange(4))},
            lambda: [value(depth + 1) for _ in range(rng.randrange(4))],
        ][kind]()

    for _ in range(200):
        calls = [
            {"name": f"f{i}", ("arguments" if rng.random() < 0.5 else "parameters"): {"x": value(0), "y": value(0)}}
            for i in range(rng.randrange(1, 4))
        ]
        doc = calls if len(calls) > 1 or rng.random() < 0.5 else calls[0]
        text = json.dumps(doc, indent=rng.choice([None, 1, 2]), ensure_ascii=rng.random() < 0.5)
        whole = scan_calls(text)
        scanner = CallScanner(0)
        for end in range(1, len(text) + 1, rng.randrange(1, 9)):
            scanner.feed(text[:end])
        scanner.feed(text)
        assert scanner.calls == whole and scanner.done
        assert [s.name for s in whole] == [c["name"] for c in calls]
        got = [json.loads(text[s.args_start : s.args_end]) for s in whole]  # type: ignore[misc]
        assert got == [c.get("arguments", c.get("parameters")) for c in calls]


# -- Qwen3-Coder's XML calls -------------------------------------------------------------------------------------------

EDIT = {
    "type": "function",
    "function": {
        "name": "edit",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "line": {"type": "integer"},
                "scale": {"type": "number"},
                "dry_run": {"type": "boolean"},
                "tags": {"type": "array"},
                "options": {"type": "object"},
                "note": {"type": ["string", "null"]},
            },
        },
    },
}

XML_CALLS = (
    "I will edit it.\n<tool_call>\n<function=edit>\n<parameter=path>\nsrc/a.py\n</parameter>\n"
    "<parameter=line>\n12\n</parameter>\n<parameter=scale>\n0.5\n</parameter>\n"
    "<parameter=dry_run>\nfalse\n</parameter>\n<parameter=tags>\n['x', \"y\"]\n</parameter>\n"
    '<parameter=options>\n{"indent": 4}\n</parameter>\n<parameter=note>\nline one\n  line two\n</parameter>\n'
    "</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\n007\n</parameter>\n"
    "</function>\n</tool_call>"
)
XML_ARGS = [
    {
        "path": "src/a.py",
        "line": 12,
        "scale": 0.5,
        "dry_run": False,
        "tags": ["x", "y"],
        "options": {"indent": 4},
        "note": "line one\n  line two",
    },
    {"city": "007"},  # a string stays a string, though it reads as a number
]


def test_parse_qwen3_coder_xml_calls() -> None:
    types = parameter_types([EDIT, WEATHER])
    content, calls = parse_tool_calls(XML_CALLS, types)
    assert content == "I will edit it."
    assert [c.name for c in calls] == ["edit", "get_weather"]
    assert [json.loads(c.arguments) for c in calls] == XML_ARGS
    # Without the schemas every value is text; a value that does not read as its type stays text too.
    assert json.loads(parse_tool_calls(XML_CALLS)[1][0].arguments)["line"] == "12"
    odd = "<tool_call><function=edit><parameter=line>twelve</parameter></function></tool_call>"
    assert json.loads(parse_tool_calls(odd, types)[1][0].arguments) == {"line": "twelve"}
    # Values that would not write as JSON (NaN, a Python set, a scalar where an array is wanted) stay text; Python's
    # type names are read as JSON Schema's; two functions in one block are two calls.
    odd_values = (
        "<tool_call><function=edit><parameter=scale>nan</parameter><parameter=tags>{1, 2}</parameter>"
        "<parameter=options>5</parameter></function><function=get_weather><parameter=city>Rome</parameter>"
        "</function></tool_call>"
    )
    content, calls = parse_tool_calls(odd_values, types)
    assert [json.loads(c.arguments) for c in calls] == [
        {"scale": "nan", "tags": "{1, 2}", "options": "5"},
        {"city": "Rome"},
    ]
    python_names = parameter_types([{"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"n": {"type": "int"}, "ok": {"type": "bool"}}}}}])  # fmt: skip
    plain = "<tool_call><function=f><parameter=n>3</parameter><parameter=ok>True</parameter></function></tool_call>"
    assert json.loads(parse_tool_calls(plain, python_names)[1][0].arguments) == {"n": 3, "ok": True}
    # A block that is neither JSON nor XML is no call.
    assert parse_tool_calls("<tool_call>not json</tool_call>", types) == ("<tool_call>not json</tool_call>", [])


def test_xml_values_by_their_listed_values_unions_and_references() -> None:
    """A parameter whose schema lists its values (enum, const) gives the value named, blanks around it aside (xgrammar's
    XML grammar lets a held call write them), as JSON's type where the member is no string; anyOf's members' types
    read the value; a local $ref is the schema it points to."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object",
        "properties": {
            "scale": {"enum": ["C", "F", "K"]},
            "n": {"enum": [1, 2, 3]},
            "flag": {"const": True},
            "x": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]},
            "o": {"$ref": "#/$defs/O"},
            "other": {"enum": ["a"]},
        },
        "$defs": {"O": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    }}}  # fmt: skip
    parameters = {"scale": " \rK\t", "n": "\r2\t ", "flag": " true", "x": "7\n\n", "o": '{"a": 1}', "other": "b"}
    block = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in parameters.items())
    _, calls = parse_tool_calls(f"<tool_call>\n<function=f>\n{block}</function>\n</tool_call>", parameter_types([tool]))
    assert json.loads(calls[0].arguments) == {"scale": "K", "n": 2, "flag": True, "x": 7, "o": {"a": 1}, "other": "b"}
    # A member written exactly wins over one its blanks stripped would name; a string-or-null parameter's null.
    fussy = {"f": {"s": {"enum": ["x", " x"]}, "maybe": {"type": ["string", "null"]}}}
    block = "<parameter=s>\n x\n</parameter>\n<parameter=maybe>\nnull\n</parameter>\n"
    _, calls = parse_tool_calls(f"<tool_call>\n<function=f>\n{block}</function>\n</tool_call>", fussy)
    assert json.loads(calls[0].arguments) == {"s": " x", "maybe": None}


def test_xml_calls_streamed_come_whole_at_the_end() -> None:
    """The content before the first block streams; the calls, whose values are only typed once read whole, come
    with the finish, as the unstreamed response has them."""
    types = parameter_types([EDIT, WEATHER])
    content, calls_stream = ContentStream(), CallStream()
    sent, deltas = "", []
    for end in range(1, len(XML_CALLS)):
        sent += content.feed(XML_CALLS[:end])
        if content.held:
            deltas += calls_stream.feed(XML_CALLS[:end], content.sent)
    from boundless.api.server import ToolUse

    rest, calls = content.finish(XML_CALLS, ToolUse(True, types=types).calls)
    assert sent + rest == "I will edit it." and deltas == []
    together = _put_together(calls_stream.finish(calls))
    assert [json.loads(args) for _, _, args in together] == XML_ARGS


def test_served_call_without_its_end_tag(hermes: Served) -> None:
    """A model that writes a whole call and stops before ``</tool_call>`` (held to it by a regex here) made the
    call, streamed and not."""
    extra = {"structured_outputs": {"regex": re.escape(UNCLOSED)}}
    asked: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [WEATHER],
        "max_tokens": 200,  # (the tiny vocabulary's tokens are short)
        "extra_body": extra,
    }
    choice = hermes.client.chat.completions.create(**asked).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    chunks = [c.choices[0] for c in hermes.client.chat.completions.create(**asked, stream=True)]
    deltas = [d for c in chunks for d in c.delta.tool_calls or ()]
    assert [(name, args) for _, name, args in _calls_of(deltas)] == [("get_weather", '{"city": "Paris"}')]
    assert not "".join(c.delta.content or "" for c in chunks) and chunks[-1].finish_reason == "tool_calls"


def test_served_xml_calls_with_their_types(hermes: Served) -> None:
    """A model writing Qwen3-Coder's calls (held to them by a regex here), through the real client, streamed and
    not: the calls' arguments are typed by the request's tools."""
    regex = r"<tool_call>\n<function=edit>\n<parameter=line>\n[1-9]\n</parameter>\n</function>\n</tool_call>"
    asked = {"model": "tiny", "messages": [{"role": "user", "content": "Edit it."}], "tools": [EDIT, WEATHER]}
    extra = {"structured_outputs": {"regex": regex}}
    reply = hermes.client.chat.completions.create(**asked, max_tokens=200, temperature=0, extra_body=extra)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    line = json.loads(call.function.arguments)["line"]
    assert call.function.name == "edit" and isinstance(line, int) and 1 <= line <= 9
    chunks = list(
        hermes.client.chat.completions.create(**asked, max_tokens=200, temperature=0, extra_body=extra, stream=True)
    )
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    assert [(name, args) for _, name, args in _calls_of(deltas)] == [("edit", call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


# -- --tool-call-parser -----------------------------------------------------------------------------------------------

HERMES = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
XML = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
BARE = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
PYTHON = '[get_weather(city="Paris")]'
GLM = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"


@pytest.mark.parametrize(
    ("parser", "read"),
    [
        (None, {HERMES, XML, BARE, PYTHON, GLM}),
        ("hermes", {HERMES}),
        ("qwen3_coder", {XML}),
        ("llama3_json", {BARE}),
        ("pythonic", {PYTHON}),
        ("llama4_pythonic", {PYTHON}),  # (vLLM's name for Llama 4's, whose command lines name it)
        ("glm45", {GLM}),
    ],
)
def test_a_tool_call_parser_reads_its_shape_only(parser: str | None, read: set[str]) -> None:
    ServerConfig(tool_call_parser=parser)  # (the flag takes the name)
    formats = ALL_FORMATS if parser is None else TOOL_CALL_PARSERS[parser]
    types = parameter_types([WEATHER])  # (the request's tools: a bare call names one)
    for text in (HERMES, XML, BARE, PYTHON, GLM):
        content, calls = parse_tool_calls(text, types, formats)
        assert (text in read) == bool(calls) and (content is None if calls else content == text), (parser, text)
        if calls:
            assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
        # Streamed, an output is held from where a call of a shape read could begin (a tag, when a tagged shape is
        # read, whatever the block holds; JSON or a list opening it), and what is not a call comes as content in the
        # end.
        stream = ContentStream(formats)
        sent = "".join(stream.feed(text[:end]) for end in range(1, len(text) + 1))
        could_begin = {
            BARE: BARE_JSON in formats,
            PYTHON: bool(formats & {BARE_JSON, PYTHONIC}),
        }.get(text, bool(formats & TAGGED))
        assert stream.held == could_begin and (sent == "" if could_begin else sent == text)
        rest, calls = stream.finish(text, lambda t: parse_tool_calls(t, types, formats))
        assert (sent + rest == text) == (not calls)


def _served_with_parser(tmp_path_factory: pytest.TempPathFactory, parser: str) -> Iterator[Served]:
    """The tiny model served with ``--tool-call-parser parser``."""
    with serve_hermes(tmp_path_factory.mktemp(parser), server_config=ServerConfig(tool_call_parser=parser)) as s:
        yield s


@pytest.fixture(scope="module")
def hermes_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from _served_with_parser(tmp_path_factory, "hermes")


def test_served_with_a_tool_call_parser(hermes_only: Served) -> None:
    """``--tool-call-parser hermes``: an XML call is the answer's text, not a call; a forced call (its grammar writes
    Hermes' own blocks) is read."""
    asked = {"model": "tiny", "messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER]}
    xml = XML.replace("\n", "\\n")
    reply = hermes_only.client.chat.completions.create(
        **asked, max_tokens=200, temperature=0, extra_body={"structured_outputs": {"regex": xml}}
    )
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content == XML
    forced = hermes_only.client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Units?"}],
        tools=[UNITS],
        max_tokens=600,  # (a schema of enums and booleans, and room for the blanks a random model writes)
        temperature=0,
        tool_choice="required",
    )
    assert forced.choices[0].finish_reason == "tool_calls"
    assert forced.choices[0].message.tool_calls[0].function.name == "set_units"


@pytest.mark.parametrize(
    "text",
    [
        "Checking.\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>",  # no block tags
        "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>",  # no end
    ],
)
def test_xml_calls_without_their_block_tags(text: str) -> None:
    """Qwen3-Coder sometimes drops the ``<tool_call>`` tags around its call: the call is still read, streamed and
    not, and the text before it is the content; a parser of JSON shapes only leaves it as text."""
    content, calls = parse_tool_calls(text, parameter_types([WEATHER]))
    assert content == "Checking." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    stream = ContentStream()
    sent = "".join(stream.feed(text[:end]) for end in range(1, len(text) + 1))
    rest, streamed = stream.finish(text, lambda t: parse_tool_calls(t, parameter_types([WEATHER])))
    assert (sent + rest).strip() == "Checking." and [c.arguments for c in streamed] == [c.arguments for c in calls]
    assert parse_tool_calls(text, {}, TOOL_CALL_PARSERS["hermes"]) == (text, [])


# -- Python calls (Llama 3.2, Llama 4: vLLM's pythonic parser) ---------------------------------------------------------

EDIT_FILE = {"type": "function", "function": {"name": "edit_file", "parameters": {"type": "object"}}}


def test_parse_python_calls() -> None:
    """A list of calls with keyword arguments of literal values: each a call, the values as JSON (Python's ``True``
    and ``None`` as ``true`` and ``null``), in order."""
    types = parameter_types([WEATHER, EDIT_FILE])
    text = (
        ' [get_weather(city="Paris"), edit_file(path=\'a.py\', lines=[1, 2], opts={"dry": True, "n": None}),'
        " get_weather()]\n"
    )
    content, calls = parse_tool_calls(text, types)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("edit_file", {"path": "a.py", "lines": [1, 2], "opts": {"dry": True, "n": None}}),
        ("get_weather", {}),
    ]
    assert calls[1].arguments == '{"path": "a.py", "lines": [1, 2], "opts": {"dry": true, "n": null}}'
    assert len({c.id for c in calls}) == 3


@pytest.mark.parametrize(
    "text",
    [
        "[1, 2, 3]",  # a list that is data
        "[]",
        '[get_weather("Paris")]',  # a positional argument
        "[get_weather(city=paris)]",  # a value that is no literal
        '[get_weather(city="Paris"), send_mail(to="x")]',  # a name of no tool
        '[os.system(cmd="ls")]',  # a dotted name
        '[get_weather(**{"city": "Paris"})]',
        "[get_weather(city={1, 2})]",  # a set: no JSON
        'Sure: [get_weather(city="Paris")]',  # not the whole output
        '[get_weather(city="Paris")',  # cut off
    ],
)
def test_python_that_is_no_call_list_is_the_answer(text: str) -> None:
    """vLLM's pythonic rule: the whole output a list of calls of the tools by name, keyword arguments of literals;
    anything else is the answer, all of it, streamed or not."""
    types = parameter_types([WEATHER])
    assert parse_tool_calls(text, types) == (text, [])
    sent, deltas, rest, calls, final = _stream_calls(text, types=types)
    assert deltas == [] and calls == [] and final == [] and sent + rest == text


@pytest.mark.parametrize("formats", [ALL_FORMATS, TOOL_CALL_PARSERS["pythonic"]])
def test_python_calls_come_whole_at_the_end_of_a_stream(formats: frozenset[str]) -> None:
    """Streamed, the list is held from its opening bracket and its calls come whole once it has closed and parsed
    (braces and brackets inside its strings and values do not end it early)."""
    text = '[edit_file(path="a]b}.py", text="{[", n=[{"k": 1}]), get_weather(city="Paris")]'
    types = parameter_types([WEATHER, EDIT_FILE])
    sent, deltas, rest, calls, final = _stream_calls(text, types=types, formats=formats)
    assert sent == "" and deltas == [] and rest == "" and [c.name for c in calls] == ["edit_file", "get_weather"]
    assert [(name, json.loads(args)) for _, name, args in _put_together(final)] == [
        ("edit_file", {"path": "a]b}.py", "text": "{[", "n": [{"k": 1}]}),
        ("get_weather", {"city": "Paris"}),
    ]


def test_with_python_calls_alone_a_json_list_streams_no_call() -> None:
    """``--tool-call-parser pythonic``: a JSON list of calls is the answer, so the stream sends no call of it, even
    at the end (where a reader of bare JSON sends its calls)."""
    text = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    types = parameter_types([WEATHER])
    for formats, streamed in ((TOOL_CALL_PARSERS["pythonic"], []), (ALL_FORMATS, ["get_weather"])):
        content, calls = ContentStream(formats), CallStream(True, types, formats=formats)
        deltas = []
        for end in range(1, len(text) + 1):
            content.feed(text[:end])
            deltas += calls.feed(text[:end], content.sent)
        parsed = content.finish(text, lambda t, formats=formats: parse_tool_calls(t, types, formats))[1]
        deltas += calls.finish(parsed) if parsed else []
        assert [d["function"]["name"] for d in deltas if "id" in d] == streamed


@pytest.fixture(scope="module")
def pythonic_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from _served_with_parser(tmp_path_factory, "pythonic")


def test_served_python_calls(pythonic_only: Served) -> None:
    """A model writing Llama 3.2's calls (held to them by a regex here) under ``--tool-call-parser pythonic``, through
    the real client, streamed and not: the calls, their arguments as JSON, ``finish_reason`` ``tool_calls``; a
    Hermes block is then the answer's text."""
    asked = {"model": "tiny", "messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER, EDIT_FILE]}
    regex = r'\[get_weather\(city="Paris"\), edit_file\(path="a\.py", dry=True\)\]'
    extra = {"structured_outputs": {"regex": regex}}
    reply = pythonic_only.client.chat.completions.create(**asked, max_tokens=200, temperature=0, extra_body=extra)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris"}), ("edit_file", {"path": "a.py", "dry": True})]
    chunks = list(
        pythonic_only.client.chat.completions.create(
            **asked, max_tokens=200, temperature=0, extra_body=extra, stream=True
        )
    )
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    assert [(name, json.loads(args)) for _, name, args in _calls_of(deltas)] == calls
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    hermes_text = HERMES.replace("{", "\\{").replace("}", "\\}")
    tagged = pythonic_only.client.chat.completions.create(
        **asked, max_tokens=200, temperature=0, extra_body={"structured_outputs": {"regex": hermes_text}}
    )
    assert tagged.choices[0].message.tool_calls is None and tagged.choices[0].message.content == HERMES

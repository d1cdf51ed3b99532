"""Tools reach chat templates that take them; tool calls in the output come back as ``tool_calls``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from served_models import Served, serve_hermes

from boundless.api.tool_calls import ContentStream, ToolCall, forced_call_schema, parse_tool_calls, template_messages

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


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


def test_content_streams_until_a_call_begins() -> None:
    text = 'Let me check the weather. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    pieces, rest, calls = _streamed(text)
    assert "".join(pieces) == "Let me check the weather. " and len(pieces) > 10  # as it came, a character at a time
    assert not any("<" in p for p in pieces)  # never a tag's first characters
    assert rest == "" and [c.name for c in calls] == ["get_weather"]
    # Text after the calls comes at the end; sent and rest are the unstreamed content but for the blanks around it.
    text = "Checking. <tool_call>" + '{"name": "f", "arguments": {}}' + "</tool_call> Done."
    pieces, rest, calls = _streamed(text, step=3)
    assert ("".join(pieces) + rest).strip() == parse_tool_calls(text)[0] == "Checking.  Done."
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


def test_parse_hermes_blocks() -> None:
    text = 'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0].to_openai()["type"] == "function" and calls[0].id.startswith("call_")


def test_parse_bare_json_calls() -> None:
    content, calls = parse_tool_calls('{"name": "f", "parameters": {"x": 1}}')
    assert content is None and calls[0].name == "f" and json.loads(calls[0].arguments) == {"x": 1}
    content, calls = parse_tool_calls('[{"name": "f", "arguments": {}}, {"name": "g", "arguments": "{}"}]')
    assert [c.name for c in calls] == ["f", "g"] and calls[1].arguments == "{}"


@pytest.mark.parametrize("text", ["plain text", '{"not": "a call"}', "<tool_call>not json</tool_call>", "{broken"])
def test_text_without_calls_is_left_alone(text: str) -> None:
    assert parse_tool_calls(text) == (text, [])


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
    none = client.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=2
    )
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens


UNITS = {
    "type": "function",
    "function": {
        "name": "set_units",
        "parameters": {
            "type": "object",
            "properties": {"metric": {"type": "boolean"}, "scale": {"enum": ["C", "F", "K"]}},
            "required": ["metric", "scale"],
        },
    },
}


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
    calls = [t for c in streamed if c.delta.tool_calls for t in c.delta.tool_calls]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [("set_units", arguments)]
    assert streamed[-1].finish_reason == "tool_calls"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**ask, tool_choice={"type": "function", "function": {"name": "nothing"}})
    assert err.value.body["param"] == "tool_choice"


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

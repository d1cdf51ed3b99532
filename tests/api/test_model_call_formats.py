"""Tool calls and reasoning in the formats of the model families served beside Hermes' and Qwen's, as vLLM's parsers
of the same names read them: Mistral's ``[TOOL_CALLS]`` (a JSON list before tokenizer v11, ``name[ARGS]{...}`` from
v11 on, ``[CALL_ID]`` in Mistral Small 3.2) with its 9-character ids, Llama 3.1's ``<|python_tag|>`` and calls a
``;`` apart, Phi-4-mini's ``functools[...]``, GLM-4.5's ``<tool_call>NAME`` blocks of ``<arg_key>`` and
``<arg_value>`` pairs with its ``<think>``, and Magistral's ``[THINK]...[/THINK]``. Each is read whole and
streamed a character at a time (the streamed pieces put together are the calls read whole), then served: a random
model whose tokenizer has Mistral's tags as special tokens, held by a grammar to write each shape, through the real
`openai` client."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from served_models import UNITS, WEATHER, Served, serve_hermes, streamed_chat, streamed_parts

from boundless.api.reasoning import REASONING_PARSERS, ReasoningParser, Split
from boundless.api.tool_calls import (
    ALL_FORMATS,
    BARE_JSON,
    DEEPSEEK,
    FUNCTOOLS,
    MISTRAL,
    TAGGED_GLM,
    TAGGED_JSON,
    TOOL_CALL_PARSERS,
    CallStream,
    ContentStream,
    ToolCall,
    parameter_types,
    parse_tool_calls,
    spans_around_calls,
)
from boundless.config import ConfigError, ServerConfig

TYPES = parameter_types([WEATHER, UNITS])
MISTRAL_ONLY = TOOL_CALL_PARSERS["mistral"]
_ID = re.compile(r"[A-Za-z0-9]{9}")

# Mistral 7B v0.3's and Mixtral's calls: one tag, a JSON list.
MISTRAL_LIST = (
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "set_units", "arguments": {"metric": true, "scale": "C"}}]'
)
# Tokenizer v11 on (Mistral Small 3.x, Magistral, Devstral): a tag a call, its name, [ARGS], its arguments; Mistral
# Small 3.2's template writes a [CALL_ID] between.
MISTRAL_V11 = (
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]set_units[CALL_ID]a1B2c3D4e[ARGS]{"metric": true, '
    '"scale": "C"}'
)
TWO_CALLS = [("get_weather", {"city": "Paris"}), ("set_units", {"metric": True, "scale": "C"})]


def _named(calls: list[ToolCall]) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _stream(
    text: str, formats: frozenset[str] = ALL_FORMATS, parallel: bool = True, forced: bool = False
) -> tuple[str, list[dict], list[ToolCall]]:
    """``text`` fed a character at a time to a ContentStream and a CallStream, as the server feeds them: the content
    sent in all, every call delta sent (the ones the end adds too), and the calls read whole."""
    contents, stream = ContentStream(formats), CallStream(parallel, TYPES, forced, formats)
    sent, deltas = "", []
    for end in range(1, len(text) + 1):
        sent += contents.feed(text[:end])
        if contents.held:
            deltas += stream.feed(text[:end], contents.sent)

    def read(t: str) -> tuple[str | None, list[ToolCall]]:
        content, calls = parse_tool_calls(t, TYPES, formats)
        return content, calls if parallel else calls[:1]

    rest, calls = contents.finish(text, read)
    return sent + rest, deltas + (stream.finish(calls) if calls else []), calls


def _together(deltas: list[dict]) -> list[tuple[str, str, str]]:
    """Call deltas put together as a client does: (id, name, arguments) by index."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], ["", "", ""])
        call[0] += d.get("id", "")
        call[1] += d["function"].get("name", "")
        call[2] += d["function"].get("arguments", "")
    return [(i, n, a) for i, n, a in (calls[k] for k in sorted(calls))]


# -- Mistral's [TOOL_CALLS] --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("formats", [MISTRAL_ONLY, ALL_FORMATS], ids=["mistral", "no parser"])
@pytest.mark.parametrize("text", [MISTRAL_LIST, MISTRAL_V11], ids=["list", "v11"])
def test_mistral_calls_are_read_with_mistral_ids(text: str, formats: frozenset[str]) -> None:
    """Both of Mistral's forms are calls (vLLM's ``mistral`` parser reads them), each with an id of 9 letters and
    digits (Mistral's templates refuse any other: a client sending the call back would get a 400), the arguments the
    model's own JSON text."""
    content, calls = parse_tool_calls(text, TYPES, formats)
    assert content is None and _named(calls) == TWO_CALLS
    assert all(_ID.fullmatch(c.id) for c in calls) and len({c.id for c in calls}) == 2
    assert all(c.arguments in text for c in calls)


@pytest.mark.parametrize(
    ("text", "content"),
    [
        ("Let me look.[TOOL_CALLS]get_weather[ARGS]" + '{"city": "Paris"}', "Let me look."),
        ("Let me look. [TOOL_CALLS] " + '[{"name": "get_weather", "arguments": {"city": "Paris"}}]', "Let me look."),
        ('[TOOL_CALLS]get_weather{"city": "Paris"}', None),  # ([ARGS] a special token left out of the text)
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"} Done.', "Done."),
    ],
)
def test_mistral_calls_with_text_around_them(text: str, content: str | None) -> None:
    """The text before the tag (and after the calls) is the content, streamed as it is written up to the tag."""
    parsed, calls = parse_tool_calls(text, TYPES, MISTRAL_ONLY)
    assert parsed == content and _named(calls) == [("get_weather", {"city": "Paris"})]
    streamed, deltas, streamed_calls = _stream(text, MISTRAL_ONLY)
    assert streamed.strip() == (content or "")
    assert _together(deltas) == [(c.id, c.name, c.arguments) for c in streamed_calls]
    assert _named(streamed_calls) == _named(calls)


@pytest.mark.parametrize("formats", [MISTRAL_ONLY, ALL_FORMATS], ids=["mistral", "no parser"])
@pytest.mark.parametrize("text", [MISTRAL_LIST, MISTRAL_V11], ids=["list", "v11"])
def test_mistral_calls_stream_as_they_are_written(text: str, formats: frozenset[str]) -> None:
    """Each call's id and name first, then its arguments a piece at a time; put together, the calls read whole,
    ids and all."""
    content, deltas, calls = _stream(text, formats)
    assert content == "" and _named(calls) == TWO_CALLS
    assert len(deltas) > 20  # (a character at a time, not whole at the end)
    begun = [d for d in deltas if "id" in d]
    assert [d["function"]["name"] for d in begun] == ["get_weather", "set_units"]
    assert all(_ID.fullmatch(d["id"]) for d in begun)
    assert _together(deltas) == [(c.id, c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("text", [MISTRAL_LIST, MISTRAL_V11], ids=["list", "v11"])
def test_mistral_without_parallel_calls_streams_the_first_alone(text: str) -> None:
    _, deltas, calls = _stream(text, MISTRAL_ONLY, parallel=False)
    assert {d["index"] for d in deltas} == {0} and _named(calls) == TWO_CALLS[:1]
    assert _together(deltas) == [(calls[0].id, calls[0].name, calls[0].arguments)]


@pytest.mark.parametrize(
    "text",
    [
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Par',  # cut off
        "[TOOL_CALLS] [{",
        "[TOOL_CALLS]not a name[ARGS]{}",
        "I would use [TOOL_CALLS] here.",
    ],
)
def test_mistral_tags_without_whole_calls_stay_text(text: str) -> None:
    assert parse_tool_calls(text, TYPES, MISTRAL_ONLY) == (text, [])


def test_under_the_mistral_parser_every_call_gets_a_mistral_id() -> None:
    """A forced call's grammar writes a bare JSON list (read beside Mistral's calls): its calls get Mistral's ids too,
    streamed or not, so that the next turn's template takes them; other parsers keep OpenAI's ``call_`` ids."""
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    forced = MISTRAL_ONLY | {BARE_JSON}
    _, calls = parse_tool_calls(text, TYPES, forced)
    assert _ID.fullmatch(calls[0].id)
    _, deltas, streamed = _stream(text, forced, forced=True)
    assert _ID.fullmatch(deltas[0]["id"]) and _together(deltas) == [(c.id, c.name, c.arguments) for c in streamed]
    assert parse_tool_calls(text, TYPES, TOOL_CALL_PARSERS["llama3_json"])[1][0].id.startswith("call_")


def test_the_content_around_mistral_calls() -> None:
    """Where a message's content lies in its output (its logprobs are those tokens'): around the tags and calls."""
    text = 'A [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"} B'
    assert [text[s:e] for s, e in spans_around_calls(text, MISTRAL_ONLY)] == ["A ", " B"]


# -- Llama 3.1's <|python_tag|> and calls a ";" apart ------------------------------------------------------------------

CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


@pytest.mark.parametrize("parser", ["llama3_json", "llama4_json", None])
@pytest.mark.parametrize(
    ("text", "count"),
    [
        ("<|python_tag|>" + CALL, 1),
        (" <|python_tag|> " + CALL + "\n", 1),
        (CALL + "; " + CALL, 2),
        ("<|python_tag|>" + CALL + ";" + CALL + ";", 2),
    ],
)
def test_llama_calls_a_semicolon_apart(text: str, count: int, parser: str | None) -> None:
    """vLLM's ``llama3_json``: the JSON after ``<|python_tag|>`` (Llama 3.1 writes it; it is in the text when the
    request keeps special tokens), and several calls a ``;`` apart. Streamed, the output is held from its start and
    the calls come at the end (text after them would make them an answer)."""
    formats = ALL_FORMATS if parser is None else TOOL_CALL_PARSERS[parser]
    content, calls = parse_tool_calls(text, TYPES, formats)
    assert content is None and _named(calls) == [("get_weather", {"city": "Paris"})] * count
    streamed, deltas, streamed_calls = _stream(text, formats)
    assert streamed == "" and _together(deltas) == [(c.id, c.name, c.arguments) for c in streamed_calls]
    assert len(streamed_calls) == count


@pytest.mark.parametrize("text", ["<|python_tag|>" + CALL + " and more", "<|python_tag|>not json", "<|eot_id|>hi"])
def test_llama_text_that_is_no_call_is_the_answer(text: str) -> None:
    assert parse_tool_calls(text, TYPES, TOOL_CALL_PARSERS["llama3_json"]) == (text, [])
    streamed, deltas, calls = _stream(text, TOOL_CALL_PARSERS["llama3_json"])
    assert streamed == text and deltas == [] and calls == []


# -- Phi-4-mini's functools[...] ---------------------------------------------------------------------------------------

FUNCTOOLS_TEXT = (
    'functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "set_units", "arguments": {"metric": true, "scale": "C"}}]'
)


@pytest.mark.parametrize("formats", [TOOL_CALL_PARSERS["phi4_mini_json"], ALL_FORMATS], ids=["phi4", "no parser"])
def test_phi4_mini_calls(formats: frozenset[str]) -> None:
    """vLLM's ``phi4_mini_json`` reads the list after ``functools``; here streamed as written too (vLLM's streams
    nothing), text before it the content; a list that does not read whole is text."""
    content, calls = parse_tool_calls(FUNCTOOLS_TEXT, TYPES, formats)
    assert content is None and _named(calls) == TWO_CALLS
    streamed, deltas, streamed_calls = _stream("Sure. " + FUNCTOOLS_TEXT, formats)
    assert streamed == "Sure." and len(deltas) > 20
    assert _together(deltas) == [(c.id, c.name, c.arguments) for c in streamed_calls]
    assert all(c.id.startswith("call_") for c in streamed_calls)
    assert parse_tool_calls("Use functools.partial.", TYPES, formats) == ("Use functools.partial.", [])
    cut = FUNCTOOLS_TEXT[:30]
    assert parse_tool_calls(cut, TYPES, formats) == (cut, [])
    # Arrays inside the arguments (vLLM's regex cut the list at their first "]") and the list Phi-4-mini writes
    # between its <|tool_call|> tokens, which decoded text leaves out.
    nested = 'functools[{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, [2]]}}]'
    assert _named(parse_tool_calls(nested, TYPES, formats)[1]) == [("get_weather", {"city": "Paris", "days": [1, [2]]})]
    bare = nested.removeprefix("functools")
    assert _named(parse_tool_calls(bare, TYPES, formats)[1]) == [("get_weather", {"city": "Paris", "days": [1, [2]]})]
    kept = f"<|tool_call|>{bare}<|/tool_call|>"  # (a request that keeps special tokens)
    assert _named(parse_tool_calls(kept, TYPES, formats)[1]) == [("get_weather", {"city": "Paris", "days": [1, [2]]})]
    assert _named(_stream(kept, formats)[2]) == [("get_weather", {"city": "Paris", "days": [1, [2]]})]


# -- Granite 3's list after <|tool_call|> ------------------------------------------------------------------------------

GRANITE_LIST = (
    '[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "set_units", "arguments": {"metric": true, "scale": "C"}}]'
)


@pytest.mark.parametrize("formats", [TOOL_CALL_PARSERS["granite"], ALL_FORMATS], ids=["granite", "no parser"])
@pytest.mark.parametrize(
    "tag", ["", "<|tool_call|>", "<tool_call>"], ids=["special-token", "special-token-kept", "text-tag"]
)
def test_granite_calls(formats: frozenset[str], tag: str) -> None:
    """vLLM's ``granite`` reads Granite 3's JSON list after ``<|tool_call|>`` (a special token: decoded text has only
    the list, unless the request keeps special tokens) or after ``<tool_call>`` written as text, with no end tag.
    Streamed, the tagged list's calls as they are written, the bare list's at the end (as Llama's bare JSON: text
    after it would make it an answer); a list that does not read whole is text."""
    text = tag + GRANITE_LIST
    content, calls = parse_tool_calls(text, TYPES, formats)
    assert content is None and _named(calls) == TWO_CALLS
    streamed, deltas, streamed_calls = _stream(text, formats)
    assert streamed == "" and (len(deltas) > 20 if tag == "<tool_call>" else len(deltas) == 2)
    assert _together(deltas) == [(c.id, c.name, c.arguments) for c in streamed_calls]
    assert _named(streamed_calls) == TWO_CALLS
    cut = text[:30]
    assert parse_tool_calls(cut, TYPES, formats) == (cut, [])


# -- SmolLM2's list in a <tool_call> block ----------------------------------------------------------------------------

SMOL = (
    '<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Paris"}},\n'
    '{"name": "set_units", "arguments": {"metric": true, "scale": "C"}}\n]</tool_call>'
)


@pytest.mark.parametrize("formats", [TOOL_CALL_PARSERS["hermes"], ALL_FORMATS], ids=["hermes", "no parser"])
def test_smollm2_calls_a_list_in_one_block(formats: frozenset[str]) -> None:
    """SmolLM2's template asks for every call in one block, as a JSON list: each is a call, streamed as written
    (before, the block was no call, its text the answer; vLLM's hermes parser reads it as none either). A list with
    an item that is no call, or an empty one (SmolLM2's "no call"), stays text."""
    content, calls = parse_tool_calls("Checking. " + SMOL, TYPES, formats)
    assert content == "Checking." and _named(calls) == TWO_CALLS
    streamed, deltas, streamed_calls = _stream("Checking. " + SMOL, formats)
    assert streamed == "Checking." and len(deltas) > 20
    assert _together(deltas) == [(c.id, c.name, c.arguments) for c in streamed_calls]
    for text in ("<tool_call>[]</tool_call>", '<tool_call>[{"name": "get_weather"}, 3]</tool_call>'):
        assert parse_tool_calls(text, TYPES, formats) == (text, [])


# -- DeepSeek's <｜tool▁call▁begin｜> ---------------------------------------------------------------------------------

DEEPSEEK_V3 = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>set_units\n```json\n'
    '{"metric": true, "scale": "C"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
DEEPSEEK_V31 = (
    '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
    '<｜tool▁call▁begin｜>set_units<｜tool▁sep｜>{"metric": true, "scale": "C"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)


@pytest.mark.parametrize("parser", ["deepseek_v3", "deepseek_v31", None])
@pytest.mark.parametrize("text", [DEEPSEEK_V3, DEEPSEEK_V31], ids=["v3", "v3.1"])
def test_deepseek_calls(text: str, parser: str | None) -> None:
    """DeepSeek's calls (V3's and R1's, whose distills' templates write them, and V3.1's), as vLLM's ``deepseek_v3``
    and ``deepseek_v31`` read them: the text before the calls' tag is the content, streamed up to it; each call
    streams as it is written; the tags are no content."""
    formats = ALL_FORMATS if parser is None else TOOL_CALL_PARSERS[parser]
    content, calls = parse_tool_calls("Let me check.\n\n" + text, TYPES, formats)
    assert content == "Let me check." and _named(calls) == TWO_CALLS
    assert [c.arguments for c in calls] == ['{"city": "Paris"}', '{"metric": true, "scale": "C"}']
    streamed, deltas, streamed_calls = _stream("Let me check.\n\n" + text + "\nDone.", formats)
    assert streamed == "Let me check.\n\n\nDone." and len(deltas) > 20  # (the blanks around the calls kept)
    assert _together(deltas) == [(c.id, c.name, c.arguments) for c in streamed_calls]
    assert _named(streamed_calls) == TWO_CALLS
    cut = text[: text.index("Paris")]
    assert parse_tool_calls(cut, TYPES, formats) == (cut, [])


# -- GLM-4.5's <arg_key> calls ----------------------------------------------------------------------------------------

GLM45 = TOOL_CALL_PARSERS["glm45"]
# As GLM-4.5's and GLM-4.6's template writes calls: each block on a line of its own after the text, the function's
# name on its first line, then each argument's key and value a line apart.
GLM_CALLS = (
    "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"
    "\n<tool_call>set_units\n<arg_key>metric</arg_key>\n<arg_value>true</arg_value>\n<arg_key>scale</arg_key>\n"
    "<arg_value>C</arg_value>\n</tool_call>"
)


@pytest.mark.parametrize("formats", [GLM45, ALL_FORMATS], ids=["glm45", "no parser"])
def test_glm_calls(formats: frozenset[str]) -> None:
    """GLM-4.5's calls, as vLLM's ``glm45`` reads them: the text before the first block is the content, streamed up
    to it; each block is a call, its values typed by the tool's schema (``true`` a boolean, ``C`` the enum's string);
    streamed, the calls come whole with the finish, and put together they are the calls read whole, ids and all, the
    text between and after the blocks the content both ways."""
    content, calls = parse_tool_calls(GLM_CALLS, TYPES, formats)
    assert content == "Let me check." and _named(calls) == TWO_CALLS
    assert [c.arguments for c in calls] == ['{"city": "Paris"}', '{"metric": true, "scale": "C"}']
    text = GLM_CALLS + "\nDone."
    streamed, deltas, streamed_calls = _stream(text, formats)
    assert streamed == parse_tool_calls(text, TYPES, formats)[0] == "Let me check.\n\n\nDone."
    assert _together(deltas) == [(c.id, c.name, c.arguments) for c in streamed_calls]
    assert _named(streamed_calls) == TWO_CALLS
    # (where the content lies, for its logprobs: around the blocks)
    assert [text[a:b] for a, b in spans_around_calls(text, formats)] == ["Let me check.\n", "\n", "\nDone."]
    # Without parallel calls the first alone.
    streamed, deltas, _ = _stream(GLM_CALLS, formats, parallel=False)
    assert [(n, json.loads(a)) for _, n, a in _together(deltas)] == TWO_CALLS[:1]


PLAN = {
    "type": "function",
    "function": {
        "name": "plan",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "code": {"type": "string"},
                "line": {"type": "integer"},
                "n": {"type": "integer"},
                "scale": {"type": "number"},
                "dry_run": {"type": "boolean"},
                "tags": {"type": "array"},
                "options": {"type": "object"},
                "note": {"type": ["string", "null"]},
                "unit": {"enum": ["C", "F"]},
                "free": {"description": "a parameter of no type"},
            },
        },
    },
}


def test_glm_values_are_read_by_the_tools_schema() -> None:
    """A value is text in GLM-4.5's calls: read by its parameter's schema as Qwen3-Coder's are (a string stays text,
    blanks and all, though it reads as a number; a value that does not read as its type stays text); a parameter of no
    type, or not in the schema, is the JSON its value holds (the template writes every value that is no string as
    JSON), else its text."""
    values = {
        "path": " src/a b.py ",
        "code": "007",
        "line": "12",
        "n": "twelve",
        "scale": "0.5",
        "dry_run": "false",
        "tags": '["x", "y"]',
        "options": "{'indent': 4}",  # (a Python literal, as models write them)
        "note": "null",
        "unit": " F",
        "free": '{"k": [1, 2]}',
        "unlisted": "3",
        "word": "007",
        "nan": "NaN",
    }
    pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in values.items())
    _, calls = parse_tool_calls(f"<tool_call>plan\n{pairs}</tool_call>", parameter_types([PLAN]), GLM45)
    assert json.loads(calls[0].arguments) == {
        "path": " src/a b.py ",
        "code": "007",
        "line": 12,
        "n": "twelve",
        "scale": 0.5,
        "dry_run": False,
        "tags": ["x", "y"],
        "options": {"indent": 4},
        "note": None,
        "unit": "F",
        "free": {"k": [1, 2]},
        "unlisted": 3,
        "word": "007",
        "nan": "NaN",  # (JSON has no NaN)
    }
    # A tool the request does not have: its values read as JSON where they are JSON.
    _, calls = parse_tool_calls(f"<tool_call>plan\n{pairs}</tool_call>", TYPES, GLM45)
    assert json.loads(calls[0].arguments)["line"] == 12 and json.loads(calls[0].arguments)["path"] == " src/a b.py "


@pytest.mark.parametrize(
    ("text", "read"),
    [
        # GLM-4.7 writes no line after the name, nor between the tags.
        ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>", {"city": "Paris"}),
        ("<tool_call>now\n</tool_call>", {}),  # (a tool without parameters: the template's two lines)
        # A key without its value, and text between the pairs, are passed over, as vLLM's parser reads them.
        ("<tool_call>get_weather\n<arg_key>day</arg_key>\nsoon\n<arg_key>city</arg_key> <arg_value>Rome</arg_value>\n"
         "</tool_call>", {"city": "Rome"}),
        # A value that holds tags of its own, but for its end tag, and lines.
        ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>a <b>\nc</arg_value>\n</tool_call>",
         {"city": "a <b>\nc"}),
    ],
)  # fmt: skip
def test_glm_calls_in_other_layouts(text: str, read: dict[str, Any]) -> None:
    content, calls = parse_tool_calls(text, TYPES, GLM45)
    assert content is None and [json.loads(c.arguments) for c in calls] == [read]
    _, deltas, _ = _stream(text, GLM45)
    assert [json.loads(a) for _, _, a in _together(deltas)] == [read]


@pytest.mark.parametrize(
    "text",
    [
        # Cut off inside a value, and stopped before the end tag: only </tool_call> says the call is whole.
        "Sure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n",
        "<tool_call>get_weather",
        # A first line that is no function's name; an empty block.
        "<tool_call>not a name\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
        "<tool_call>\n</tool_call>",
        # Hermes' JSON and Qwen3-Coder's XML are not GLM's.
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
    ],
)
def test_glm_blocks_that_hold_no_call_stay_text(text: str) -> None:
    """Streamed and not, and cut off at ``max_tokens`` (``ToolUse.read``): the text is the answer's, as vLLM's
    ``glm45`` leaves it."""
    from boundless.api.server import ToolUse

    assert parse_tool_calls(text, TYPES, GLM45) == (text, [])
    assert ToolUse(True, types=TYPES, formats=GLM45).read(text, at_length=True) == (text, [], None)
    streamed, deltas, calls = _stream(text, GLM45)
    assert (streamed, deltas, calls) == (text, [], [])


def test_glm_calls_under_other_parsers_and_a_call_cut_off_after_one() -> None:
    """``hermes`` (and ``qwen3_coder``) read no GLM call; a closed call before one cut off is a call, the one cut off
    the text after it."""
    for parser in ("hermes", "qwen3_coder"):
        assert parse_tool_calls(GLM_CALLS, TYPES, TOOL_CALL_PARSERS[parser]) == (GLM_CALLS, [])
    cut = GLM_CALLS[: GLM_CALLS.index("true")]
    content, calls = parse_tool_calls(cut, TYPES, GLM45)
    assert _named(calls) == TWO_CALLS[:1] and content == "Let me check.\n\n" + cut[cut.rindex("<tool_call>") :]
    streamed, _, streamed_calls = _stream(cut, GLM45)
    assert streamed == content and _named(streamed_calls) == TWO_CALLS[:1]


# GLM-4.5's tags: tokens of its vocabulary that are not special (they stay in decoded text, as vLLM reads them).
GLM_TAGS = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
)
# A template of GLM-4.5's shape (its tags, its generation prompt, thinking turned off as it turns it off).
GLM_TEMPLATE = (
    "[gMASK]<sop>{% if tools %}<|system|>\\n# Tools\\n{% for t in tools %}{{ t | tojson }}\\n{% endfor %}"
    "<tool_call>{function-name}\\n<arg_key>{arg-key-1}</arg_key>\\n<arg_value>{arg-value-1}</arg_value>\\n...</tool_call>"
    "{% endif %}{% for m in messages %}<|{{ m.role }}|>\\n{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}\\n<think></think>{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    config = ServerConfig(tool_call_parser="glm45", reasoning_parser="glm45", structured_outputs_in_reasoning=True)
    with serve_hermes(tmp_path_factory.mktemp("glm"), GLM_TEMPLATE, config, added_tokens=GLM_TAGS) as served:
        yield served


def _glm_ask(regex: str | None, **kwargs: Any) -> dict[str, Any]:
    extra = {"structured_outputs": {"regex": regex}} if regex else {}
    return {"model": "tiny", "messages": ASK, "tools": [WEATHER, UNITS], "max_tokens": 200, "temperature": 0,
            "extra_body": {**extra, **kwargs.pop("extra_body", {})}, **kwargs}  # fmt: skip


GLM_CALLS_REGEX = (
    r"Let me check\.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>[A-Z][a-z]{2,6}</arg_value>\n"
    r"</tool_call>\n<tool_call>set_units\n<arg_key>metric</arg_key>\n<arg_value>(true|false)</arg_value>\n"
    r"<arg_key>scale</arg_key>\n<arg_value>[CFK]</arg_value>\n</tool_call>"
)


def test_served_glm_thinking_then_calls(glm: Served) -> None:
    """``--tool-call-parser glm45 --reasoning-parser glm45``: a model that thinks, then writes GLM-4.5's calls (held
    to them by a regex here), through the real client, streamed and not: the thinking is the reasoning, the answer's
    text before the calls the content, the calls' values typed by the request's tools."""
    ask = _glm_ask(r"\n<think>[a-z ]{4,12}</think>\n" + GLM_CALLS_REGEX)
    message = glm.client.chat.completions.create(**ask).choices[0]
    assert message.finish_reason == "tool_calls" and message.message.content == "Let me check."
    reasoning = message.message.model_dump()["reasoning"]
    assert re.fullmatch("[a-z ]{4,12}", reasoning)
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.message.tool_calls]
    assert [name for name, _ in calls] == ["get_weather", "set_units"]
    assert isinstance(calls[1][1]["metric"], bool) and calls[1][1]["scale"] in "CFK"
    streamed = _streamed(glm, ask)
    assert streamed["reasoning"] == reasoning and streamed["content"].strip() == "Let me check."
    assert [(n, json.loads(a)) for _, n, a in streamed["calls"]] == calls and streamed["finish"] == "tool_calls"


def test_served_glm_with_thinking_turned_off(glm: Served) -> None:
    """``enable_thinking: false``: the template closes an empty think block in the prompt; the output is the answer."""
    ask = _glm_ask(r"It is sunny\.", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = glm.client.chat.completions.create(**ask).choices[0].message
    assert message.content == "It is sunny." and message.model_dump().get("reasoning") is None


def test_served_glm_strict_call_is_held_to_its_schema(glm: Served) -> None:
    """A strict tool under ``tool_choice: auto``: a call the model opens (``<tool_call>``, favoured here) is held to
    GLM-4.5's format and the tool's schema, and reads back as a call."""
    (tag,) = glm.loaded.tokenizer.encode("<tool_call>", add_special_tokens=False)
    strict_units = {"type": "function", "function": {**UNITS["function"], "strict": True}}
    ask = _glm_ask(None, tools=[strict_units], logit_bias={str(tag): 100}, parallel_tool_calls=False)
    choice = glm.client.chat.completions.create(**ask).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "set_units" and isinstance(arguments["metric"], bool) and arguments["scale"] in "CFK"
    compiled = glm.engine.core.grammars._compiled
    tags = [json.loads(spec.definition) for spec in compiled if spec.kind == "structural_tag" and spec.definition]
    held = [t for tag in tags for t in tag["format"]["tags"] if t["begin"] == "<tool_call>set_units"]
    assert held and held[0]["content"]["style"] == "glm_xml"


# -- the parsers' names ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("parser", "formats"),
    [
        ("mistral", {MISTRAL}),
        ("phi4_mini_json", {FUNCTOOLS, BARE_JSON}),
        ("granite", {TAGGED_JSON, BARE_JSON}),
        ("llama4_json", {BARE_JSON}),
        ("deepseek_v3", {DEEPSEEK}),
        ("deepseek_v31", {DEEPSEEK}),
        ("glm45", {TAGGED_GLM}),
    ],
)
def test_the_new_tool_call_parsers_are_vllms_names(parser: str, formats: set[str]) -> None:
    ServerConfig(tool_call_parser=parser)
    assert TOOL_CALL_PARSERS[parser] == formats


def test_an_unknown_parser_name_is_a_one_line_error() -> None:
    for field in ("tool_call_parser", "reasoning_parser"):
        with pytest.raises(ConfigError) as raised:
            ServerConfig(**{field: "mistrall"})
        message = str(raised.value)
        assert "\n" not in message and "mistral" in message and "glm45" in message


def test_glm45_names_both_parsers_as_vllm_does() -> None:
    """``--tool-call-parser glm45`` and ``--reasoning-parser glm45`` (vLLM's names for GLM-4.5's and GLM-4.6's), and
    ``glm47`` for GLM-4.7's calls (the same reading); ``glm4_moe``, the model's type, names no parser in vLLM, nor
    here."""
    ServerConfig(tool_call_parser="glm45", reasoning_parser="glm45")
    ServerConfig(tool_call_parser="glm47", reasoning_parser="glm45")
    assert "glm45" in REASONING_PARSERS
    assert TOOL_CALL_PARSERS["glm47"] == TOOL_CALL_PARSERS["glm45"]
    with pytest.raises(ConfigError, match=r"--tool-call-parser: must be one of .*glm45"):
        ServerConfig(tool_call_parser="glm4_moe")


# -- Magistral's [THINK] -----------------------------------------------------------------------------------------------

MAGISTRAL = ReasoningParser.named("mistral")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[THINK]a, then b[/THINK]Answer.", Split("a, then b", "Answer.")),
        ("Answer without thinking.", Split(None, "Answer without thinking.")),
        ("[THINK]cut off", Split("cut off", None)),
        ("<think>not Mistral's</think>x", Split(None, "<think>not Mistral's</think>x")),
    ],
)
def test_mistral_reasoning(text: str, expected: Split) -> None:
    """vLLM's ``mistral`` reasoning parser: ``[THINK]...[/THINK]`` when the output opens with it, else all answer."""
    assert "mistral" in REASONING_PARSERS and MAGISTRAL.special_tags
    assert not MAGISTRAL.opens_in_reasoning("[INST]Why?[/INST]")
    assert MAGISTRAL.split(text, opened=False) == expected


# -- served ------------------------------------------------------------------------------------------------------------

SPECIAL = (
    "[TOOL_CALLS]",
    "[ARGS]",
    "[CALL_ID]",
    "[THINK]",
    "[/THINK]",
    "<|python_tag|>",
    "<tool_call>",
    "</tool_call>",
)
# Mistral Small 3.2's template as far as the API needs it: its tools, and each call sent back written as the model
# writes it, refused unless its id (and the tool message's) is 9 characters, as Mistral's templates refuse it.
MISTRAL_TEMPLATE = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}{% for c in m.tool_calls %}"
    "{% if c.id is not string or c.id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "[TOOL_CALLS]{{ c.function.name }}[CALL_ID]{{ c.id }}[ARGS]{{ c.function.arguments | tojson }}{% endfor %}</s>"
    "{% elif m.role == 'tool' %}"
    "{% if m.tool_call_id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "[TOOL_RESULTS]{{ m.tool_call_id }}[TOOL_CONTENT]{{ m.content }}[/TOOL_RESULTS]"
    "{% elif m.role == 'assistant' %}{{ m.content }}</s>"
    "{% else %}[INST]{{ m.content }}[/INST]{% endif %}{% endfor %}"
)


def _serve(directory: Path, config: ServerConfig) -> Iterator[Served]:
    """The tiny random model, Mistral's tags (and Llama's ``<|python_tag|>``) special tokens of its vocabulary, as in
    theirs (decoded text leaves them out unless the request keeps special tokens), with :data:`MISTRAL_TEMPLATE`."""
    from tokenizers import AddedToken, Tokenizer

    from boundless.api.launch import start_in_thread
    from boundless.engine.async_engine import AsyncEngine
    from boundless.engine.core import EngineCore
    from boundless.llm import engine_config
    from boundless.model.loader import load_model
    from boundless.model.random_model import TinySpec, write_random_model

    root = write_random_model(directory / "m", TinySpec(vocab_size=384 + len(SPECIAL)))
    tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tokenizer.save(str(root / "tokenizer.json"))
    tokenizer_config = json.loads((root / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = MISTRAL_TEMPLATE
    (root / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    loaded = load_model(str(root))
    engine = AsyncEngine(EngineCore.from_model(loaded, engine_config(str(root), max_model_len=1024, kv_cache_gb=0.05)))
    server = start_in_thread(engine, "tiny", config)
    try:
        yield Served(loaded, engine, server.url, openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0))
    finally:
        server.stop()
        engine.shutdown()


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    config = ServerConfig(tool_call_parser="mistral", reasoning_parser="mistral", structured_outputs_in_reasoning=True)
    yield from _serve(tmp_path_factory.mktemp("mistral"), config)


@pytest.fixture(scope="module")
def unflagged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from _serve(tmp_path_factory.mktemp("unflagged"), ServerConfig())


ASK = [{"role": "user", "content": "Weather in Paris, in Celsius?"}]


def _ask(served: Served, regex: str | None, **kwargs: Any) -> dict[str, Any]:
    """A chat request's arguments: held to ``regex`` (None: free), the special tokens favoured wherever the grammar
    allows them, so that the model writes Mistral's tags as the tokens they are, not letter by letter."""
    tokenizer = served.loaded.tokenizer
    bias = {str(tokenizer.encode(t, add_special_tokens=False)[0]): 100 for t in SPECIAL}
    extra = {"structured_outputs": {"regex": regex}} if regex else {}
    return {
        "model": "tiny",
        "messages": kwargs.pop("messages", ASK),
        "tools": kwargs.pop("tools", [WEATHER, UNITS]),
        "max_tokens": kwargs.pop("max_tokens", 300),
        "temperature": 0,
        "logit_bias": bias,
        "extra_body": {**extra, **kwargs.pop("extra_body", {})},
        **kwargs,
    }


def _streamed(served: Served, ask: dict[str, Any]) -> dict[str, Any]:
    return streamed_parts(served.client, ask)


V11_REGEX = (
    r'Sure\.\[TOOL_CALLS\]get_weather\[ARGS\]\{"city": "Paris"\}'
    r'\[TOOL_CALLS\]set_units\[CALL_ID\][a-z]{9}\[ARGS\]\{"metric": true, "scale": "C"\}'
)
LIST_REGEX = (
    r'\[TOOL_CALLS\] \[\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}, '
    r'\{"name": "set_units", "arguments": \{"metric": true, "scale": "C"\}\}\]'
)


def _calls_sent_back(served: Served, calls: list[Any]) -> None:
    """The calls sent back with their results, as a client continues the conversation: the template takes their ids
    (it refuses any but Mistral's)."""
    messages = [
        *ASK,
        {"role": "assistant", "tool_calls": [c.model_dump() for c in calls]},
        *({"role": "tool", "tool_call_id": c.id, "content": "ok"} for c in calls),
    ]
    reply = served.client.chat.completions.create(**_ask(served, None, messages=messages, max_tokens=2))
    assert reply.choices[0].finish_reason == "length"


@pytest.mark.parametrize(("regex", "content"), [(V11_REGEX, "Sure."), (LIST_REGEX, None)], ids=["v11", "list"])
def test_served_mistral_calls(mistral: Served, regex: str, content: str | None) -> None:
    """``--tool-call-parser mistral``: the model writes ``[TOOL_CALLS]`` as the special token it is, which decoded
    text leaves out by default; the server keeps it (vLLM's parser asks for special tokens so), so the calls are read,
    streamed and not, with ids the template takes when the client sends them back."""
    reply = mistral.client.chat.completions.create(**_ask(mistral, regex))
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == content
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == TWO_CALLS
    assert all(_ID.fullmatch(c.id) for c in calls)
    streamed = _streamed(mistral, _ask(mistral, regex))
    assert streamed["content"] == (content or "") and streamed["finish"] == "tool_calls"
    assert [(n, json.loads(a)) for _, n, a in streamed["calls"]] == TWO_CALLS
    assert all(_ID.fullmatch(i) for i, _, _ in streamed["calls"])
    _calls_sent_back(mistral, calls)


def test_served_mistral_without_parallel_calls(mistral: Served) -> None:
    ask = _ask(mistral, V11_REGEX, parallel_tool_calls=False)
    calls = mistral.client.chat.completions.create(**ask).choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == TWO_CALLS[:1]
    assert [(n, json.loads(a)) for _, n, a in _streamed(mistral, ask)["calls"]] == TWO_CALLS[:1]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "set_units"}}])
def test_served_mistral_forced_calls_get_mistral_ids(mistral: Served, choice: Any) -> None:
    """A forced call (its grammar writes a JSON list) under the mistral parser: its id is Mistral's, streamed or not,
    and the template takes it back."""
    ask = _ask(mistral, None, tools=[UNITS], tool_choice=choice, parallel_tool_calls=False, max_tokens=600)
    reply = mistral.client.chat.completions.create(**ask)
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["set_units"]
    assert _ID.fullmatch(calls[0].id)
    streamed = _streamed(mistral, ask)
    assert [n for _, n, _ in streamed["calls"]] == ["set_units"] and _ID.fullmatch(streamed["calls"][0][0])
    _calls_sent_back(mistral, calls)


def test_served_mistral_reasoning_then_a_call(mistral: Served) -> None:
    """``--reasoning-parser mistral``: ``[THINK]...[/THINK]``, special tokens too, is the reasoning; the call after
    it is read from the answer, streamed and not."""
    regex = r'\[THINK\][a-z ]{4,12}\[/THINK\]\[TOOL_CALLS\]get_weather\[ARGS\]\{"city": "Paris"\}'
    reply = mistral.client.chat.completions.create(**_ask(mistral, regex))
    message = reply.choices[0].message
    assert message.reasoning and re.fullmatch("[a-z ]{4,12}", message.reasoning) and message.content is None
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    streamed = _streamed(mistral, _ask(mistral, regex))
    assert streamed["reasoning"] == message.reasoning and streamed["content"] == ""
    assert [(n, a) for _, n, a in streamed["calls"]] == [("get_weather", '{"city": "Paris"}')]
    answer = mistral.client.chat.completions.create(**_ask(mistral, r"\[THINK\]hm\[/THINK\]Sunny\.", tools=None))
    assert (answer.choices[0].message.reasoning, answer.choices[0].message.content) == ("hm", "Sunny.")
    assert reply.usage.completion_tokens_details.reasoning_tokens > 0


def test_served_mistral_template_without_a_parser(unflagged: Served) -> None:
    """No ``--tool-call-parser``, but a chat template that writes ``[TOOL_CALLS]``: the special tokens are kept for
    a request with tools, so Mistral's v11 calls are read (before, the text was ``get_weather{...}``, no call), with
    Mistral's ids; without tools the text is as it was, special tokens left out."""
    reply = unflagged.client.chat.completions.create(**_ask(unflagged, V11_REGEX))
    choice = reply.choices[0]
    assert choice.message.content == "Sure." and all(_ID.fullmatch(c.id) for c in choice.message.tool_calls)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == TWO_CALLS
    _calls_sent_back(unflagged, choice.message.tool_calls)
    plain = unflagged.client.chat.completions.create(**_ask(unflagged, r"\[TOOL_CALLS\]hi", tools=None))
    assert plain.choices[0].message.content == "hi"


def test_served_llama_python_tag_and_phi4_calls(unflagged: Served) -> None:
    """Llama 3.1's ``<|python_tag|>`` before its JSON, kept in the text by a request's ``skip_special_tokens:
    false``, and Phi-4-mini's ``functools[...]``: calls, streamed and not."""
    python_tag = r'<\|python_tag\|>\{"name": "get_weather", "parameters": \{"city": "Paris"\}\}'
    functools = re.escape(FUNCTOOLS_TEXT).replace("\\ ", " ")
    for regex, expected in ((python_tag, TWO_CALLS[:1]), (functools, TWO_CALLS)):
        ask = _ask(unflagged, regex, extra_body={"skip_special_tokens": False})
        choice = unflagged.client.chat.completions.create(**ask).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == expected
        streamed = _streamed(unflagged, ask)
        assert streamed["content"] == "" and [(n, json.loads(a)) for _, n, a in streamed["calls"]] == expected


@pytest.fixture(scope="module")
def hermes_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serve_hermes(tmp_path_factory.mktemp("smol"), server_config=ServerConfig(tool_call_parser="hermes")) as s:
        yield s


def test_served_smollm2_calls(hermes_only: Served) -> None:
    """A model writing SmolLM2's list of calls in one ``<tool_call>`` block (held to it by a regex here), under
    ``--tool-call-parser hermes``: the calls, streamed and not."""
    asked = {
        "model": "tiny",
        "messages": ASK,
        "tools": [WEATHER, UNITS],
        "max_tokens": 300,
        "temperature": 0,
        "extra_body": {"structured_outputs": {"regex": re.escape(SMOL).replace("\\ ", " ")}},
    }
    choice = hermes_only.client.chat.completions.create(**asked).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == TWO_CALLS
    content, finish, calls = streamed_chat(hermes_only.client, asked)
    assert (content, finish) == ("", "tool_calls") and [(n, json.loads(a)) for n, a in calls] == TWO_CALLS


def test_served_deepseek_calls(unflagged: Served) -> None:
    """DeepSeek V3's calls (held to them by a regex here), read with no parser, streamed and not."""
    ask = _ask(unflagged, re.escape("Sure." + DEEPSEEK_V3).replace("\\ ", " "))
    choice = unflagged.client.chat.completions.create(**ask).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == TWO_CALLS
    streamed = _streamed(unflagged, ask)
    assert streamed["content"] == "Sure." and [(n, json.loads(a)) for _, n, a in streamed["calls"]] == TWO_CALLS


@pytest.mark.parametrize(
    "text",
    [
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]set_units[ARGS]{"metric": tr',
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "set_units", "arguments": {"m',
    ],
)
def test_mistral_calls_cut_off_at_max_tokens_come_as_far_as_they_got(text: str) -> None:
    """An output that ends at ``max_tokens`` inside a call: the calls it had begun come as far as they were written,
    as a stream of it sent them (OpenAI returns a call cut off so), not the first alone with the rest as content."""
    from boundless.api.server import ToolUse

    content, calls, cut_at = ToolUse(True, types=TYPES, formats=MISTRAL_ONLY).read(text, at_length=True)
    assert content is None and cut_at == 0
    assert (calls[0].name, calls[0].arguments) == ("get_weather", '{"city": "Paris"}')
    assert [c.name for c in calls] == ["get_weather", "set_units"] and calls[1].arguments.startswith('{"m')
    assert all(_ID.fullmatch(c.id) for c in calls)


@pytest.fixture(scope="module")
def hermes_special(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from _serve(tmp_path_factory.mktemp("hermes_special"), ServerConfig(tool_call_parser="hermes"))


def test_served_hermes_tags_that_are_special_tokens(hermes_special: Served) -> None:
    """``--tool-call-parser hermes`` on a model whose ``<tool_call>`` tags are special tokens (Hermes 2 Pro's): the
    server keeps them in the text, as vLLM's hermes parser asks, so the calls are read, streamed and not (before, the
    tags were left out and the JSON between them was the answer)."""
    regex = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}</tool_call>'
    ask = _ask(hermes_special, regex)
    choice = hermes_special.client.chat.completions.create(**ask).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    streamed = _streamed(hermes_special, ask)
    assert streamed["content"] == "" and [(n, a) for _, n, a in streamed["calls"]] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    plain = hermes_special.client.chat.completions.create(**_ask(hermes_special, regex, tools=None))
    assert plain.choices[0].message.content == '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def test_served_mistral_strict_call_is_held_to_its_schema(mistral: Served) -> None:
    """A ``strict`` tool under ``tool_choice: auto`` on the mistral parser (the template writes v11 calls): the call
    the model opens with ``[TOOL_CALLS]`` (favoured here) is held to the tool's schema, where a random model would
    write any arguments; without parallel calls the output ends after it."""
    tokens = mistral.loaded.tokenizer
    bias = {str(tokens.encode("[TOOL_CALLS]", add_special_tokens=False)[0]): 100}
    units = {"type": "function", "function": {**UNITS["function"], "strict": True}}
    ask = _ask(mistral, None, tools=[units], logit_bias=bias, parallel_tool_calls=False, max_tokens=600)
    choice = mistral.client.chat.completions.create(**ask).choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "set_units" and _ID.fullmatch(call.id)
    assert isinstance(arguments["metric"], bool) and arguments["scale"] in ("C", "F", "K")
    streamed = _streamed(mistral, ask)
    assert [n for _, n, _ in streamed["calls"]] == ["set_units"] and streamed["finish"] == "tool_calls"


def test_served_mistral_calls_through_the_responses_api(mistral: Served) -> None:
    """The Responses API reads Mistral's calls the same way, and its ``call_id`` (Mistral's 9 characters) takes the
    call's output back through the template, chained by ``previous_response_id``."""
    tokens = mistral.loaded.tokenizer
    bias = {str(tokens.encode(t, add_special_tokens=False)[0]): 100 for t in SPECIAL}
    regex = r'\[TOOL_CALLS\]get_weather\[ARGS\]\{"city": "Paris"\}'
    response = mistral.client.responses.create(
        model="tiny",
        input="Weather in Paris?",
        tools=[{"type": "function", **WEATHER["function"]}],
        max_output_tokens=300,
        extra_body={"structured_outputs": {"regex": regex}, "logit_bias": bias, "temperature": 0},
    )
    (call,) = response.output
    assert call.type == "function_call" and (call.name, call.arguments) == ("get_weather", '{"city": "Paris"}')
    assert _ID.fullmatch(call.call_id)
    answer = mistral.client.responses.create(
        model="tiny",
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}],
        max_output_tokens=16,  # (the minimum the API takes)
        extra_body={"temperature": 0},
    )
    assert answer.status in ("completed", "incomplete")

"""boundless/api/tool_calls.py: reading Qwen3-Coder's XML calls by their tools' parameter schemas, whatever those
schemas hold (the request's tools are the client's: a malformed one must not fail the response)."""

from __future__ import annotations

import json

import pytest

from boundless.api.tool_calls import parameter_types, parse_tool_calls


def _tool(schema: object) -> dict[str, object]:
    return {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"n": schema}}},
    }


@pytest.mark.parametrize(
    ("schema", "read"),
    [
        ({"type": {"not": "a type"}}, "3"),  # a type that is no name: the schema does not say, the text stays text
        ({"type": 5}, "3"),
        ({"type": ["integer", ["nested"]]}, 3),  # a list's malformed member says nothing; the others still read it
        ({"anyOf": [{"type": {"x": 1}}, {"type": "integer"}]}, "3"),  # (a member that does not say: as before)
    ],
)
def test_an_xml_calls_parameter_whose_schema_type_is_no_name_reads_as_text(schema: object, read: object) -> None:
    """A parameter schema whose ``type`` is not a name (nor a list of names) is read as one that does not say:
    the call comes back, rather than the parser failing on the schema (it raised TypeError, unhashable type)."""
    text = "<tool_call>\n<function=f>\n<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>"
    _, calls = parse_tool_calls(text, parameter_types([_tool(schema)]))
    assert [c.name for c in calls] == ["f"]
    assert json.loads(calls[0].arguments) == {"n": read}


DEEP = "[" * 5_000 + "]" * 5_000  # past the JSON parser's stack: a RecursionError
HUGE = "1" + "0" * 5_000  # past int()'s 4,300 digits: a ValueError of its own


@pytest.mark.parametrize(
    "output",
    [
        f"<tool_call>{DEEP}</tool_call>",
        f'<tool_call>{{"name": "f", "arguments": {{"n": {HUGE}}}}}</tool_call>',
        DEEP,  # (a bare JSON answer)
        f'[TOOL_CALLS]f{{"n": {DEEP}}}',
        f"<tool_call>\n<function=f>\n<parameter=n>\n{HUGE}\n</parameter>\n</function>\n</tool_call>",
        f"<tool_call>\n<function=f>\n<parameter=n>\n{DEEP}\n</parameter>\n</function>\n</tool_call>",
        # GLM-4.5's, a typed parameter's value and one of no type (read as JSON where it reads whole)
        f"<tool_call>f\n<arg_key>n</arg_key>\n<arg_value>{HUGE}</arg_value>\n</tool_call>",
        f"<tool_call>f\n<arg_key>n</arg_key>\n<arg_value>{DEEP}</arg_value>\n</tool_call>",
        f"<tool_call>f\n<arg_key>x</arg_key>\n<arg_value>{DEEP}</arg_value>\n<arg_key>y</arg_key>\n"
        f"<arg_value>{HUGE}</arg_value>\n</tool_call>",
    ],
)
def test_output_past_the_json_parsers_limits_is_read_without_raising(output: str) -> None:
    """A model's output (which a client can force, with a choice of texts) holding JSON nested past the parser's stack
    or a number past int()'s digits raised out of the parser: a 500, or a stream cut short with an error."""
    schemas = {"n": {"type": "integer"}, "m": {"type": "array"}}
    for schema in schemas.values():
        tools = [
            {
                "type": "function",
                "function": {"name": "f", "parameters": {"type": "object", "properties": {"n": schema}}},
            }
        ]
        content, calls = parse_tool_calls(output, parameter_types(tools))
        assert content is not None or calls  # (read one way or the other)
        for call in calls:
            assert isinstance(json.loads(call.arguments), dict)

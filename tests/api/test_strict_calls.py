"""Strict function calling under ``tool_choice: auto`` (``strict: true``, ``--strict-tool-calls``), and vLLM's
``structural_tag`` response format, which it is built on."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest
from served_models import HERMES_TEMPLATE, UNITS, WEATHER, Served, serve_hermes

from boundless.api.strict_calls import forced_calls_tag, strict_call_format, strict_calls_tag, structural_tag_text
from boundless.api.tool_calls import (
    ALL_FORMATS,
    MISTRAL,
    TAGGED_GLM,
    TAGGED_JSON,
    TAGGED_XML,
    TOOL_CALL_PARSERS,
    parameter_types,
    parse_tool_calls,
)
from boundless.config import ServerConfig
from boundless.engine.structured_output import Grammars, StructuredOutput
from boundless.model.loader import load_model
from boundless.model.random_model import TinySpec, write_random_model


def strict(tool: dict) -> dict:
    return {"type": "function", "function": {**tool["function"], "strict": True}}


# -- which format, which tag ------------------------------------------------------------------------------------------


def test_the_call_format_is_the_parsers_or_else_the_templates() -> None:
    assert strict_call_format(TOOL_CALL_PARSERS["hermes"], None) == TAGGED_JSON
    assert strict_call_format(TOOL_CALL_PARSERS["qwen3_coder"], None) == TAGGED_XML
    assert strict_call_format(TOOL_CALL_PARSERS["glm45"], None) == TAGGED_GLM
    # Formats with no trigger that tells a call from an answer are not held.
    assert strict_call_format(TOOL_CALL_PARSERS["llama3_json"], "<tool_call>") is None
    assert strict_call_format(TOOL_CALL_PARSERS["pythonic"], "<tool_call>") is None
    # (nor those of a parser that reads two: the template decides only without a parser)
    for parser in ("mistral", "phi4_mini_json", "deepseek_v3"):
        assert strict_call_format(TOOL_CALL_PARSERS[parser], "<tool_call>\n<function={{ name }}>") is None
    # Without a parser the template says: Qwen3-Coder's writes both tags, Hermes' only the first.
    assert strict_call_format(ALL_FORMATS, HERMES_TEMPLATE) == TAGGED_JSON
    assert strict_call_format(ALL_FORMATS, "<tool_call>\n<function={{ name }}>") == TAGGED_XML
    assert strict_call_format(ALL_FORMATS, "{{ messages }}") is None
    assert strict_call_format(ALL_FORMATS, "<tool_call>{{ name }}\n<arg_key>") == TAGGED_GLM  # GLM-4.5's own format
    assert strict_call_format(ALL_FORMATS, None) is None


def test_no_tag_unless_a_tool_is_strict() -> None:
    assert strict_calls_tag([UNITS, WEATHER], TAGGED_JSON, parallel=True) is None
    assert strict_calls_tag([], TAGGED_JSON, parallel=True, every_tool=True) is None
    assert strict_calls_tag([UNITS], TAGGED_JSON, parallel=True, every_tool=True) is not None
    tag = strict_calls_tag([strict(UNITS), WEATHER], TAGGED_JSON, parallel=False)
    assert tag is not None and tag["format"]["stop_after_first"] is True


@pytest.fixture(scope="module")
def tiny_grammars(tmp_path_factory: pytest.TempPathFactory) -> Grammars:
    root = write_random_model(tmp_path_factory.mktemp("strict") / "m", TinySpec(vocab_size=384))
    loaded = load_model(str(root))
    return Grammars(loaded.tokenizer, loaded.arch.vocab_size)


def accepts(grammars: Grammars, tag: dict, text: str) -> bool:
    """Whether the tag's grammar takes ``text`` whole and may end there."""
    matcher = grammars.matcher(StructuredOutput("structural_tag", structural_tag_text(tag)))
    try:
        matcher.replay(grammars.tokenizer.encode(text, add_special_tokens=False))
    except RuntimeError:
        return False
    return bool(matcher._matcher.is_completed())


def json_call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def test_a_strict_tools_calls_are_held_to_its_schema_and_text_stays_free(tiny_grammars: Grammars) -> None:
    tag = strict_calls_tag([strict(UNITS), WEATHER], TAGGED_JSON, parallel=True)
    assert tag is not None
    ok = json_call("set_units", '{"metric": true, "scale": "K"}')
    assert accepts(tiny_grammars, tag, "No call needed, just text.")
    assert accepts(tiny_grammars, tag, "Setting it. " + ok + " Done.")
    assert not accepts(tiny_grammars, tag, json_call("set_units", '{"metric": "yes", "scale": "K"}'))
    assert not accepts(tiny_grammars, tag, json_call("set_units", '{"metric": true, "scale": "X"}'))
    assert not accepts(tiny_grammars, tag, json_call("set_units", '{"metric": true}'))  # a required one left out
    assert not accepts(tiny_grammars, tag, json_call("launch", "{}"))  # no such tool
    # A tool that is not strict: its name, and any object.
    assert accepts(tiny_grammars, tag, json_call("get_weather", '{"town": 3}'))
    assert not accepts(tiny_grammars, tag, json_call("get_weather", '"Paris"'))
    # Calls one after another, unless parallel calls are off: then the first ends the output.
    assert accepts(tiny_grammars, tag, ok + ok)
    single = strict_calls_tag([strict(UNITS)], TAGGED_JSON, parallel=False)
    assert single is not None
    assert accepts(tiny_grammars, single, "Text. " + ok) and not accepts(tiny_grammars, single, ok + " More.")


def test_xml_calls_are_held_to_the_schema_as_qwen3_coder_writes_them(tiny_grammars: Grammars) -> None:
    tag = strict_calls_tag([strict(UNITS), WEATHER], TAGGED_XML, parallel=True)
    assert tag is not None

    def xml(name: str, **values: str) -> str:
        parameters = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
        return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"

    assert accepts(tiny_grammars, tag, "Sure. " + xml("set_units", metric="true", scale="F"))
    assert not accepts(tiny_grammars, tag, xml("set_units", metric="maybe", scale="F"))
    assert not accepts(tiny_grammars, tag, xml("set_units", metric="true", scale="F", extra="1"))
    assert accepts(tiny_grammars, tag, xml("get_weather", anything="goes"))
    # A tool without parameters: the two lines Qwen3-Coder's template writes.
    bare = strict_calls_tag([strict({"type": "function", "function": {"name": "now"}})], TAGGED_XML, parallel=True)
    assert bare is not None and accepts(tiny_grammars, bare, "<tool_call>\n<function=now>\n</function>\n</tool_call>")


def test_glm_calls_are_held_to_the_schema_as_glm_45_writes_them(tiny_grammars: Grammars) -> None:
    """GLM-4.5's calls (``--tool-call-parser glm45``, or a template that writes ``<arg_key>``): the trigger
    ``<tool_call>``, then the name and a line (GLM-4.7's: none), each argument's key and value (xgrammar's ``glm_xml``:
    a string as text, the others as JSON), ``</tool_call>``; what the grammar lets through reads back as the schema's
    values."""
    tag = strict_calls_tag([strict(UNITS), WEATHER], TAGGED_GLM, parallel=True)
    assert tag is not None

    def glm(name: str, **values: str) -> str:
        pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in values.items())
        return f"<tool_call>{name}\n{pairs}</tool_call>"

    ok = glm("set_units", metric="true", scale="F")
    assert accepts(tiny_grammars, tag, "Sure.\n" + ok) and accepts(tiny_grammars, tag, "No call.")
    assert accepts(tiny_grammars, tag, ok + "\n" + ok)
    assert not accepts(tiny_grammars, tag, glm("set_units", metric="maybe", scale="F"))
    assert not accepts(tiny_grammars, tag, glm("set_units", metric="true", scale="X"))
    assert not accepts(tiny_grammars, tag, glm("set_units", metric="true"))  # a required one left out
    assert not accepts(tiny_grammars, tag, glm("launch"))  # no such tool
    assert accepts(tiny_grammars, tag, glm("get_weather", anything="goes"))  # (not strict: any text)
    _, calls = parse_tool_calls(ok, parameter_types([UNITS]), TOOL_CALL_PARSERS["glm45"])
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("set_units", {"metric": True, "scale": "F"})]
    # A tool without parameters: the template's two lines; without parallel calls the first call ends the output.
    bare = strict_calls_tag([strict({"type": "function", "function": {"name": "now"}})], TAGGED_GLM, parallel=False)
    assert bare is not None and accepts(tiny_grammars, bare, "<tool_call>now\n</tool_call>")
    assert not accepts(tiny_grammars, bare, "<tool_call>now\n</tool_call>\n<tool_call>now\n</tool_call>")
    # GLM-4.7's layout (--tool-call-parser glm47): no line after the name, nor between the tags; held as well.
    tight = "<tool_call>set_units<arg_key>metric</arg_key><arg_value>true</arg_value>"
    tight += "<arg_key>scale</arg_key><arg_value>F</arg_value></tool_call>"
    assert accepts(tiny_grammars, tag, tight) and accepts(tiny_grammars, bare, "<tool_call>now</tool_call>")
    assert not accepts(tiny_grammars, tag, tight.replace("<arg_value>F<", "<arg_value>X<"))


MISTRAL_V11_TEMPLATE = "{{ '[TOOL_CALLS]' + call.function.name + '[ARGS]' + call.function.arguments | tojson }}"


def test_mistral_calls_by_name_are_held_where_the_template_writes_them(tiny_grammars: Grammars) -> None:
    """Mistral's v11 calls, ``[TOOL_CALLS]NAME[ARGS]{...}``: the ``mistral`` parser's format, or without a parser a
    template's that writes them; held as Hermes' are (the trigger its tag, the arguments to the schema, nothing
    after them). Mistral's older list (its template writes no ``[ARGS]``) is read, not held."""
    assert strict_call_format(TOOL_CALL_PARSERS["mistral"], MISTRAL_V11_TEMPLATE) == MISTRAL
    assert strict_call_format(ALL_FORMATS, MISTRAL_V11_TEMPLATE) == MISTRAL
    assert strict_call_format(TOOL_CALL_PARSERS["mistral"], "{{ '[TOOL_CALLS] [' + calls | tojson }}") is None
    assert strict_call_format(TOOL_CALL_PARSERS["mistral"], None) is None
    tag = strict_calls_tag([strict(UNITS), WEATHER], MISTRAL, parallel=True)
    assert tag is not None

    def call(name: str, arguments: str) -> str:
        return f"[TOOL_CALLS]{name}[ARGS]{arguments}"

    ok = call("set_units", '{"metric": true, "scale": "K"}')
    assert accepts(tiny_grammars, tag, "Plain text.") and accepts(tiny_grammars, tag, "Sure. " + ok + ok)
    assert not accepts(tiny_grammars, tag, call("set_units", '{"metric": true, "scale": "X"}'))
    assert not accepts(tiny_grammars, tag, call("launch", "{}"))
    assert accepts(tiny_grammars, tag, call("get_weather", '{"town": 3}'))  # (not strict: any object)
    single = strict_calls_tag([strict(UNITS)], MISTRAL, parallel=False)
    assert single is not None and accepts(tiny_grammars, single, ok) and not accepts(tiny_grammars, single, ok + ok)


def test_forced_calls_are_written_in_the_models_own_format(tiny_grammars: Grammars) -> None:
    """tool_choice required or named, where the call format is known: the output is the calls, in that format, each
    held to its schema, a line apart; nothing else."""
    ok = json_call("set_units", '{"metric": false, "scale": "C"}')
    city = json_call("get_weather", '{"city": "Rome"}')
    required = forced_calls_tag([UNITS, WEATHER], TAGGED_JSON, parallel=True, name=None)
    assert accepts(tiny_grammars, required, ok) and accepts(tiny_grammars, required, ok + "\n" + city)
    assert not accepts(tiny_grammars, required, "")  # a call is required
    assert not accepts(tiny_grammars, required, "Sure. " + ok) and not accepts(tiny_grammars, required, ok + " Done.")
    assert not accepts(tiny_grammars, required, json_call("get_weather", "{}"))  # its schema's required city
    single = forced_calls_tag([UNITS, WEATHER], TAGGED_JSON, parallel=False, name=None)
    assert accepts(tiny_grammars, single, city) and not accepts(tiny_grammars, single, ok + "\n" + city)
    named = forced_calls_tag([UNITS, WEATHER], TAGGED_JSON, parallel=True, name="get_weather")
    assert accepts(tiny_grammars, named, city) and not accepts(tiny_grammars, named, ok)
    assert not accepts(tiny_grammars, named, city + "\n" + city)  # a named choice is one call


def test_arguments_come_in_the_order_the_schema_declares(tiny_grammars: Grammars) -> None:
    """xgrammar holds an object's properties to the schema's order: the tag must keep it (not sort it), for strict
    calls, forced calls and a structural_tag response format alike."""
    schema = {
        "type": "object",
        "properties": {"query": {"type": "integer"}, "limit": {"type": "integer"}},
        "required": ["query", "limit"],
    }
    search = {"type": "function", "function": {"name": "search", "parameters": schema, "strict": True}}
    declared = json_call("search", '{"query": 1, "limit": 2}')
    for tag in (
        strict_calls_tag([search], TAGGED_JSON, parallel=True),
        forced_calls_tag([search], TAGGED_JSON, parallel=True, name="search"),
    ):
        assert tag is not None and accepts(tiny_grammars, tag, declared)


# -- served ----------------------------------------------------------------------------------------------------------


def _serve(directory: Path, strict_tool_calls: bool = False) -> Iterator[Served]:
    # <tool_call> is one token of the vocabulary, as in Qwen's, so that a logit bias can make the random model open a
    # call; what it writes in the call is then the grammar's doing.
    config = ServerConfig(strict_tool_calls=strict_tool_calls)
    with serve_hermes(directory, server_config=config, added_tokens=("<tool_call>", "</tool_call>")) as served:
        yield served


@pytest.fixture(scope="module")
def hermes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from _serve(tmp_path_factory.mktemp("strict-served"))


def _opens_calls(served: Served) -> dict[str, int]:
    """A logit bias that makes the model open a call wherever the grammar lets it."""
    (tag,) = served.loaded.tokenizer.encode("<tool_call>", add_special_tokens=False)
    return {str(tag): 100}


def _compiled_tags(served: Served) -> list[str]:
    """The structural tags the engine compiled grammars for (what its requests were held to)."""
    compiled = served.engine.core.grammars._compiled
    return [spec.definition for spec in compiled if spec.kind == "structural_tag" and spec.definition]


def _ask(served: Served, tools: list[dict], **extra: object) -> dict:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Use Kelvin."}],
        "tools": tools,
        "max_tokens": 600,  # (room for the 32 blanks a random model may put between each two JSON tokens)
        "temperature": 0,
        "logit_bias": _opens_calls(served),
        **extra,
    }


def _units_call(arguments: str) -> None:
    values = json.loads(arguments)
    assert set(values) == {"metric", "scale"} and isinstance(values["metric"], bool) and values["scale"] in "CFK"


def test_a_call_the_model_opens_is_held_to_a_strict_tools_schema(hermes: Served) -> None:
    """The random model, made to open a call, writes garbage without strict (no call parses) and a call that follows
    the schema with it, streamed and not; without parallel calls it stops after the first."""
    client = hermes.client
    loose = client.chat.completions.create(**_ask(hermes, [UNITS]), tool_choice="auto")
    assert not loose.choices[0].message.tool_calls
    held = client.chat.completions.create(**_ask(hermes, [strict(UNITS)], parallel_tool_calls=False))
    choice = held.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    assert choice.message.tool_calls[0].function.name == "set_units"
    _units_call(choice.message.tool_calls[0].function.arguments)
    stream = client.chat.completions.create(**_ask(hermes, [strict(UNITS)], parallel_tool_calls=False), stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    arguments = "".join(t.function.arguments or "" for c in chunks for t in c.delta.tool_calls or ())
    assert arguments == choice.message.tool_calls[0].function.arguments
    assert chunks[-1].finish_reason == "tool_calls"


def test_parallel_calls_each_follow_their_schema(hermes: Served) -> None:
    reply = hermes.client.chat.completions.create(**_ask(hermes, [strict(UNITS)], max_tokens=700))
    calls = reply.choices[0].message.tool_calls or []
    whole = calls if reply.choices[0].finish_reason != "length" else calls[:-1]  # (the last may be cut off)
    assert len(whole) >= 2
    for call in whole:
        assert call.function.name == "set_units"
        _units_call(call.function.arguments)


def test_a_format_or_a_forced_choice_takes_the_place_of_strict_calls(hermes: Served) -> None:
    """tool_choice none reads no calls; an answer held to JSON is the answer; a forced call keeps its own grammar,
    which writes the calls in the template's format."""
    client = hermes.client
    none = client.chat.completions.create(**_ask(hermes, [strict(UNITS)]), tool_choice="none")
    assert not none.choices[0].message.tool_calls
    as_json = client.chat.completions.create(**_ask(hermes, [strict(UNITS)]), response_format={"type": "json_object"})
    assert not as_json.choices[0].message.tool_calls
    forced = client.chat.completions.create(**_ask(hermes, [strict(UNITS)]), tool_choice="required")
    _units_call(forced.choices[0].message.tool_calls[0].function.arguments)
    assert any('"tags_with_separator"' in tag for tag in _compiled_tags(hermes))


def test_strict_tools_through_the_responses_and_messages_apis(hermes: Served) -> None:
    """Anthropic's API is the chat route's, logit bias included: the call is held. The Responses API has no logit bias
    to make the random model open a call, so what shows its tools are held is the grammar its request compiled."""
    claude_like = anthropic.Anthropic(base_url=hermes.url, api_key="x", max_retries=0)
    message = claude_like.messages.create(
        model="tiny",
        max_tokens=600,
        messages=[{"role": "user", "content": "Use Kelvin."}],
        tools=[{"name": "set_units", "input_schema": UNITS["function"]["parameters"], "strict": True}],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        extra_body={"temperature": 0, "logit_bias": _opens_calls(hermes)},
    )
    uses = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and len(uses) == 1
    _units_call(json.dumps(uses[0].input))
    schema = {**UNITS["function"]["parameters"], "properties": {"level": {"type": "integer"}}, "required": ["level"]}
    function = {"type": "function", "name": "set_level", "parameters": schema}
    for strict_field in (False, True):
        hermes.client.responses.create(
            model="tiny", input="Level?", tools=[{**function, "strict": strict_field}], max_output_tokens=4
        )
        assert any("set_level" in tag for tag in _compiled_tags(hermes)) == strict_field


def test_on_qwen3_coders_format_forced_calls_stay_a_json_list(tmp_path: Path) -> None:
    """A template that writes Qwen3-Coder's XML calls: a strict call under auto is held in that format (the grammar its
    request compiled), but a forced call keeps vLLM's JSON list, whose values its schema holds exactly (xgrammar's
    XML lets blanks surround a value)."""
    template = HERMES_TEMPLATE.replace("Tools:", "Call a tool as <tool_call>\\n<function=NAME>. Tools:")
    with serve_hermes(tmp_path, template) as served:
        ask = {"model": "tiny", "messages": [{"role": "user", "content": "Units?"}], "max_tokens": 2}
        served.client.chat.completions.create(**ask, tools=[UNITS], tool_choice="required")
        assert [spec.kind for spec in served.engine.core.grammars._compiled] == ["json_schema"]
        served.client.chat.completions.create(**ask, tools=[strict(UNITS)])
        tags = _compiled_tags(served)
        assert len(tags) == 1 and '"qwen_xml"' in tags[0] and "triggered_tags" in tags[0]


def test_strict_tool_calls_hold_every_tool(tmp_path: Path) -> None:
    """--strict-tool-calls: a tool that does not say strict is held all the same."""
    for served in _serve(tmp_path, strict_tool_calls=True):
        reply = served.client.chat.completions.create(**_ask(served, [UNITS], parallel_tool_calls=False))
        (call,) = reply.choices[0].message.tool_calls
        _units_call(call.function.arguments)


# -- structural_tag response format (vLLM's, SGLang's) ----------------------------------------------------------------

TAGGED_NUMBER = {
    "type": "tag",
    "begin": "<n>",
    "content": {
        "type": "json_schema",
        "json_schema": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
        "max_whitespace_cnt": 2,
    },
    "end": "</n>",
}


def test_a_structural_tag_response_format_holds_the_output(hermes: Served) -> None:
    client = hermes.client
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "A number."}], "max_tokens": 100, "temperature": 0}
    reply = client.chat.completions.create(
        **ask,
        response_format={"type": "structural_tag", "format": TAGGED_NUMBER},  # type: ignore[typeddict-item]
    )
    found = re.fullmatch(r"<n>(.*)</n>", reply.choices[0].message.content or "", re.DOTALL)
    assert found and isinstance(json.loads(found.group(1))["x"], int)
    # vLLM's structured_outputs takes the tag as its JSON text; here an object too.
    wrapped = {"type": "structural_tag", "format": TAGGED_NUMBER}
    for tag in (json.dumps(wrapped), wrapped):
        same = client.chat.completions.create(**ask, extra_body={"structured_outputs": {"structural_tag": tag}})
        assert same.choices[0].message.content == reply.choices[0].message.content


def test_vllms_first_structural_tag_shape(tiny_grammars: Grammars) -> None:
    """``structures`` that begin at one of the ``triggers``: free text, each structure held to its schema."""
    from boundless.api.schemas import ResponseFormat

    legacy = ResponseFormat.model_validate(
        {
            "type": "structural_tag",
            "structures": [{"begin": "<n>", "schema": TAGGED_NUMBER["content"]["json_schema"], "end": "</n>"}],
            "triggers": ["<n>"],
        }
    )
    tag = legacy.structural_tag()
    assert accepts(tiny_grammars, tag, 'Here: <n>{"x": 3}</n> and text.')
    assert not accepts(tiny_grammars, tag, 'Here: <n>{"x": "3"}</n>')


def test_vllms_first_structural_tag_shape_in_structured_outputs(tiny_grammars: Grammars) -> None:
    """vLLM's structured_outputs.structural_tag takes its first shape too (its xgrammar backend compiles a tag with
    ``structures`` and ``triggers`` the old way), as JSON text or an object."""
    from boundless.api.schemas import StructuredOutputsParams
    from boundless.api.server import structured_outputs_grammar

    legacy = {
        "type": "structural_tag",
        "structures": [{"begin": "<n>", "schema": TAGGED_NUMBER["content"]["json_schema"], "end": "</n>"}],
        "triggers": ["<n>"],
    }
    for tag in (json.dumps(legacy), legacy):
        spec = structured_outputs_grammar(StructuredOutputsParams.model_validate({"structural_tag": tag}))
        matcher = tiny_grammars.matcher(spec)
        matcher.replay(tiny_grammars.tokenizer.encode('Here: <n>{"x": 3}</n>.', add_special_tokens=False))
        assert matcher._matcher.is_completed()


@pytest.mark.parametrize(
    ("fmt", "param"),
    [
        ({"type": "structural_tag"}, "response_format"),
        ({"type": "structural_tag", "format": {"type": "no_such_format"}}, "response_format"),
        ({"type": "structural_tag", "format": TAGGED_NUMBER, "triggers": ["<n>"]}, "response_format"),
    ],
)
def test_a_bad_structural_tag_is_a_400(hermes: Served, fmt: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        hermes.client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hi"}],
            response_format=fmt,  # type: ignore[arg-type]
        )
    assert err.value.body["param"].startswith(param)

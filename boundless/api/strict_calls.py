"""Strict function calling under ``tool_choice: auto``: a call the model begins is held to its tool's schema.

OpenAI's ``strict: true`` on a function tool promises that a call's arguments follow the tool's parameters schema,
whether the model chose to call (``auto``) or was made to. A forced call (``required``, a named function) is held to
a JSON schema of the calls from its first token (``tool_calls.forced_call_schema``). Under ``auto`` the model may
answer in text, so the output cannot be held to calls from the start; it is held to a *structural tag* instead
(xgrammar's, as vLLM and SGLang use it): text is free until the model writes the opening of a call in the model's own
call format (the trigger, ``<tool_call>``), and from there the call must name one of the tools and give it arguments
its schema allows, then close; then text is free again (or, without ``parallel_tool_calls``, the output ends).

The call format is the one the server reads (``--tool-call-parser``), or, without the flag, the one the chat template
teaches: Qwen3-Coder's XML calls where the template writes ``<function=``, GLM-4.5's where it writes ``<tool_call>`` and
``<arg_key>`` (the name, a line, then each argument's ``<arg_key>`` and ``<arg_value>``: xgrammar's ``glm_xml``),
Hermes' JSON where it writes ``<tool_call>`` alone, Mistral's calls by name (``[TOOL_CALLS]NAME[ARGS]{...}``, tokenizer
v11 on) where it writes ``[TOOL_CALLS]`` and ``[ARGS]``. Other formats (bare JSON, Python lists, Mistral's older list)
have no trigger that tells a call from an answer or none this holds, so there a ``strict`` tool is served as vLLM serves
it without a structural tag: its calls are read, not held.

A tool is held to its schema when it says ``strict: true`` (or every tool, with ``--strict-tool-calls``, as vLLM's
``VLLM_ENFORCE_STRICT_TOOL_CALLING`` and SGLang's ``SGLANG_TOOL_STRICT_LEVEL`` do); once any tool of a request is,
the others' calls are held to their names and to a JSON object (an XML or GLM call's to its tags), so that every call
the model begins parses.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from boundless.api.tool_calls import (
    ALL_FORMATS,
    GLM_KEY,
    MISTRAL,
    MISTRAL_TAG,
    TAGGED,
    TAGGED_GLM,
    TAGGED_JSON,
    TAGGED_XML,
    TOOL_CALL_TAG,
    XML_FUNCTION_TAG,
    CallFormats,
)
from boundless.engine.structured_output import MAX_WHITESPACE

# The call formats that a structural tag can hold: each one's trigger, a call's opening (before and after its name),
# and its end. Hermes' JSON call as Qwen's templates write it; Qwen3-Coder's XML call as its template does (the line
# before </function> is the parameters' last blank, so that a call without parameters is the template's two lines).
_JSON_OPEN, _JSON_ARGUMENTS, _JSON_END = '<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>"
_XML_OPEN, _XML_AFTER_NAME, _XML_END = "<tool_call>\n<function=", ">\n", "</function>\n</tool_call>"
# GLM's call: the name, then each argument's two tags, then the end tag. Nothing is held after the name: GLM-4.5's
# template writes a line there and GLM-4.7's none, and glm_xml's content takes either (as xgrammar's own GLM tag).
_GLM_END = "</tool_call>"
# Mistral's v11 call: its tag and name, [ARGS], the arguments' object, and nothing after it.
_MISTRAL_ARGS = "[ARGS]"
# No parameters: a call's arguments are the empty object.
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def strict_call_format(formats: CallFormats, template: str | None) -> str | None:
    """The call format a strict call is held to: the server's ``--tool-call-parser``'s when it reads one tagged format
    (``formats``), else the one the chat template writes (``template``: its source); None when neither says.
    Mistral's calls (its parser's, or a template's that writes them) only in the by-name form, which its template
    says it writes with ``[ARGS]``."""
    tagged = formats & TAGGED
    if len(tagged) == 1 and len(formats) == 1:
        return next(iter(tagged))
    mistral_v11 = template is not None and MISTRAL_TAG in template and _MISTRAL_ARGS in template
    if formats == frozenset({MISTRAL}) or (formats == ALL_FORMATS and mistral_v11):
        return MISTRAL if mistral_v11 else None
    if formats == ALL_FORMATS and template is not None:  # (no parser: every format is read, so the template decides)
        if XML_FUNCTION_TAG in template:
            return TAGGED_XML
        if TOOL_CALL_TAG in template:  # (GLM-4.5's tags hold a format of its own)
            return TAGGED_GLM if GLM_KEY in template else TAGGED_JSON
    return None


def is_strict(tool: dict[str, Any]) -> bool:
    """Whether a chat-shaped tool (``{"type": "function", "function": {...}}``) asks for strict calls."""
    return bool((tool.get("function") or {}).get("strict"))


def strict_calls_tag(
    tools: Sequence[dict[str, Any]], call_format: str, parallel: bool, every_tool: bool = False
) -> dict[str, Any] | None:
    """The structural tag (xgrammar's JSON) that holds an ``auto`` output's calls in ``call_format`` to ``tools``
    (chat-shaped), or None when no tool is strict (``every_tool``: all are). ``parallel``: False ends the output with
    its first call (OpenAI's ``parallel_tool_calls: false``)."""
    if not tools or not (every_tool or any(is_strict(t) for t in tools)):
        return None
    triggered = {"type": "triggered_tags", "triggers": [_trigger(call_format)], "stop_after_first": not parallel}
    return {"type": "structural_tag", "format": triggered | {"tags": _call_tags(tools, call_format, every_tool)}}


def forced_calls_tag(
    tools: Sequence[dict[str, Any]], call_format: str, parallel: bool, name: str | None
) -> dict[str, Any]:
    """The structural tag of a ``tool_choice`` that forces a call, in the model's own call format (as SGLang holds
    forced calls): the output is one call of ``name``'s tool, or with ``name=None`` (``required``) one or more calls
    of any of the tools (one, unless ``parallel``), a line apart, each held to its tool's schema, and nothing else."""
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    calls = {
        "type": "tags_with_separator",
        "tags": _call_tags(chosen, call_format, every_tool=True),
        "separator": "\n",
        "at_least_one": True,
        "stop_after_first": name is not None or not parallel,
    }
    return {"type": "structural_tag", "format": calls}


def _trigger(call_format: str) -> str:
    return {TAGGED_JSON: TOOL_CALL_TAG, TAGGED_GLM: TOOL_CALL_TAG, MISTRAL: MISTRAL_TAG}.get(call_format, _XML_OPEN)


def _call_tags(tools: Sequence[dict[str, Any]], call_format: str, every_tool: bool) -> list[dict[str, Any]]:
    """A tag per tool: its call's opening in ``call_format`` with its name, then its arguments, held to its schema
    where the tool is strict (``every_tool``: all are), else to any object (an XML or GLM call's to any text), then
    the call's end."""
    tags = []
    for tool in tools:
        function = tool["function"]
        name, schema = function["name"], function.get("parameters") or _NO_PARAMETERS
        strict = every_tool or bool(function.get("strict"))
        # (Blanks capped as in every JSON grammar here, structured_output.MAX_WHITESPACE.)
        content: dict[str, Any] = {"type": "json_schema", "max_whitespace_cnt": MAX_WHITESPACE}
        if call_format == TAGGED_JSON:
            content["json_schema"] = schema if strict else {"type": "object"}
            begin, end = _JSON_OPEN + name + _JSON_ARGUMENTS, _JSON_END
        elif call_format == MISTRAL:
            content["json_schema"] = schema if strict else {"type": "object"}
            begin, end = MISTRAL_TAG + name + _MISTRAL_ARGS, ""
        elif call_format == TAGGED_GLM:
            content = content | {"json_schema": schema, "style": "glm_xml"} if strict else {"type": "any_text"}
            begin, end = TOOL_CALL_TAG + name, _GLM_END
        else:
            content = content | {"json_schema": schema, "style": "qwen_xml"} if strict else {"type": "any_text"}
            begin, end = _XML_OPEN + name + _XML_AFTER_NAME, _XML_END
        tags.append({"type": "tag", "begin": begin, "content": content, "end": end})
    return tags


def structural_tag_text(tag: dict[str, Any]) -> str:
    """A structural tag as the grammar's definition (its JSON). Keys keep their order: a schema's ``properties`` are
    written in the order it declares them (xgrammar holds an object to that order), so sorting them would make a
    call's arguments come in alphabetical order, not the schema's (what the model was taught, and OpenAI writes)."""
    return json.dumps(tag, ensure_ascii=False)

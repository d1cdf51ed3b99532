"""Tool calls in model output, parsed back into OpenAI ``tool_calls``.

Templates that take ``tools`` teach the model one of three shapes, and all are recognised:
Hermes/Qwen-style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (SmolLM2's hold a JSON list of
such calls); the same blocks holding
Qwen3-Coder's XML, ``<function=NAME><parameter=KEY>VALUE</parameter>...</function>``, whose values are text read
by the tool's parameter schema (:func:`parameter_types`); the same blocks holding GLM-4.5's and GLM-4.6's calls
(vLLM's ``glm45``), the function's name on the block's first line, then each argument as ``<arg_key>KEY</arg_key>``
and ``<arg_value>VALUE</arg_value>``, whose values are text read by the schema too (a value whose type the schema does
not name is the JSON it holds, if any: the template writes each value that is no string as JSON); and a bare JSON
object (or list of objects) with ``name`` and ``arguments`` or ``parameters`` (Llama 3.1), naming one of the
request's tools: without tags, JSON is as likely
an answer (``{"name": "Bob", "age": 3}``), so it is a call only in that shape, as vLLM's ``llama3_json`` reads it.
Llama 3.1 may open its JSON with ``<|python_tag|>`` (a special token, in the text when the request keeps those) and
writes several calls a ``;`` apart, ``{...}; {...}``, as vLLM's ``llama3_json`` reads them.
Llama 3.2 and Llama 4 write a fourth: a Python list of calls with keyword arguments, ``[get_weather(city="Paris")]``
(vLLM's ``pythonic``), likewise a call only when the whole output is that list and every name is one of the tools.
Mistral's models write ``[TOOL_CALLS]`` (a special token) then their calls: a JSON list of call objects (Mistral 7B
v0.3, Mixtral), or, from tokenizer v11 on (Mistral Small 3.x, Magistral, Devstral), each call as its name, then
``[ARGS]`` and its arguments' object, ``[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}`` (vLLM's ``mistral``); their
chat templates refuse a call id that is not 9 letters and digits, so calls read in that format get such ids, as vLLM
gives them. Phi-4-mini writes ``functools[...]``, a JSON list of call objects (vLLM's ``phi4_mini_json``).
DeepSeek's templates (V3, R1 and its Qwen and Llama distills) write calls between ``<｜tool▁calls▁begin｜>`` and
``<｜tool▁calls▁end｜>``, each ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` then its arguments in a JSON fence
(V3.1: ``NAME<｜tool▁sep｜>`` and the bare object) and ``<｜tool▁call▁end｜>`` (vLLM's ``deepseek_v3``,
``deepseek_v31``). gpt-oss writes OpenAI's harmony messages, a call being a message to ``functions.NAME`` whose body is
its arguments (vLLM's ``openai``); its reasoning parser (``api/harmony.py``) leaves them in the answer in one form,
``<|start|>assistant to=functions.NAME<|message|>{...}<|call|>``, which is read here as a call whatever its body holds
or however far it got (the recipient made it one).

A ``tool_choice`` that forces a call (``required``, or a named function) holds the output to the model's own tagged
calls where the server knows its format (``api/strict_calls.py``), else to the bare JSON shape with a JSON schema
(:func:`forced_call_schema`, as vLLM does), so the calls parse whatever the model would say.
"""

from __future__ import annotations

import ast
import contextlib
import json
import math
import random
import re
import string
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from boundless.api import harmony
from boundless.api.call_scanner import (
    ARGUMENT_KEYS,
    CALL_NAME,
    CallScanner,
    CallSpan,
    NamedCallScanner,
    deepseek_call_name,
    named_call_name,
    scan_calls,
)
from boundless.api.json_text import UNREADABLE_JSON

_XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|(?=<function=)|\Z)", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)
# GLM-4.5's tags around an argument's key and its value (its template writes a line between them). A key holds no
# <arg_key> of its own: a key left without its value is passed over, not run into the next one.
GLM_KEY = "<arg_key>"
# (Neither a key nor a value runs past the next <arg_key>: a value left open is passed over, and each failed match scans
# to the next key, not to the block's end, which made a long block of open values quadratic.)
_GLM_ARGUMENT = re.compile(
    r"<arg_key>((?:(?!<arg_key>).)*?)</arg_key>\s*<arg_value>((?:(?!<arg_key>).)*?)</arg_value>", re.DOTALL
)
_INTEGER = re.compile(r"-?\d+")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")  # JSON's: no NaN, no Infinity
# Schema types as models and tools sometimes spell them (Python's names), as vLLM's parser reads them.
_TYPE_ALIASES = {"int": "integer", "float": "number", "double": "number", "bool": "boolean", "dict": "object",
                 "list": "array", "str": "string"}  # fmt: skip

# Each tool's parameters' schemas (function name -> parameter name -> schema): how XML and GLM calls' values are read.
ParameterTypes = dict[str, dict[str, Any]]

# The shapes of calls in an output: JSON in <tool_call> blocks, Qwen3-Coder's XML in them, GLM-4.5's <arg_key> calls
# in them, bare JSON, a Python list of calls, Mistral's calls after [TOOL_CALLS], Phi-4-mini's functools[...] list,
# DeepSeek's <｜tool▁call▁begin｜> calls, and harmony's calls as its reasoning parser leaves them in the answer.
TAGGED_JSON, TAGGED_XML, TAGGED_GLM = "tagged-json", "tagged-xml", "tagged-glm"
BARE_JSON, PYTHONIC = "bare-json", "pythonic"
MISTRAL, FUNCTOOLS, DEEPSEEK, HARMONY = "mistral", "functools", "deepseek", "harmony"
CallFormats = frozenset[str]
TAGGED: CallFormats = frozenset({TAGGED_JSON, TAGGED_XML, TAGGED_GLM})  # (the shapes in <tool_call> blocks)
ALL_FORMATS: CallFormats = TAGGED | {BARE_JSON, PYTHONIC, MISTRAL, FUNCTOOLS, DEEPSEEK, HARMONY}
# vLLM's --tool-call-parser names -> the shapes each reads (without the flag, all of them).
TOOL_CALL_PARSERS: dict[str, CallFormats] = {
    "hermes": frozenset({TAGGED_JSON}),
    "qwen3_coder": frozenset({TAGGED_XML}),
    "qwen3_xml": frozenset({TAGGED_XML}),
    "llama3_json": frozenset({BARE_JSON}),
    "llama4_json": frozenset({BARE_JSON}),  # (vLLM's other name for the same parser)
    "pythonic": frozenset({PYTHONIC}),
    "llama4_pythonic": frozenset({PYTHONIC}),  # (vLLM's name for Llama 4's: the same list, its tags special tokens)
    "mistral": frozenset({MISTRAL}),
    # (and the bare list Phi-4-mini writes between its <|tool_call|> tokens, special ones that decoded text leaves out)
    "phi4_mini_json": frozenset({FUNCTOOLS, BARE_JSON}),
    # (Granite 3's list after <|tool_call|>, a special token decoded text leaves out, or after <tool_call> as text)
    "granite": frozenset({TAGGED_JSON, BARE_JSON}),
    "deepseek_v3": frozenset({DEEPSEEK}),  # (V3's and R1's calls, and V3.1's: either reads both)
    "deepseek_v31": frozenset({DEEPSEEK}),
    "openai": frozenset({HARMONY}),  # (gpt-oss's harmony calls: its reasoning parser reads them out of its messages)
    "glm45": frozenset({TAGGED_GLM}),  # (GLM-4.5's and GLM-4.6's)
    "glm47": frozenset({TAGGED_GLM}),  # (GLM-4.7's: the same calls, no line between the name and its first key)
}
MISTRAL_TAG = "[TOOL_CALLS]"  # (Mistral's special token before its calls)
FUNCTOOLS_TAG = "functools["  # (Phi-4-mini's, its list's bracket with it)
PYTHON_TAG = "<|python_tag|>"  # (Llama 3.1's special token before a call's JSON)
# The special tokens bare JSON calls may follow, in the text when a request keeps special tokens: Llama 3.1's, and
# Granite 3's before its list.
BARE_TAGS = (PYTHON_TAG, "<|tool_call|>")
PHI4_CALL_END = "<|/tool_call|>"  # (Phi-4-mini's special token after its list)


def _after_bare_tag(text: str) -> str | None:
    """``text`` (stripped at its start) past a leading :data:`BARE_TAGS` tag and the blanks after it; None when it
    opens with none."""
    tag = next((t for t in BARE_TAGS if text.startswith(t)), None)
    return None if tag is None else text[len(tag) :].lstrip()


# DeepSeek's tags around its calls, and around each.
DEEPSEEK_CALLS, DEEPSEEK_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DEEPSEEK_CALL, DEEPSEEK_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
_ALPHANUMERIC = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """A call id Mistral's chat templates (and mistral-common) take: 9 letters and digits."""
    return "".join(random.choices(_ALPHANUMERIC, k=9))


def mistral_ids(formats: CallFormats) -> bool:
    """Whether every call of an output read for ``formats`` gets a Mistral id: when the server reads Mistral's calls
    alone (``--tool-call-parser mistral``; a forced call's bare JSON beside them), as vLLM's mistral parser makes
    them, so that the next turn's template takes them. (Without the flag, calls read in Mistral's format get one.)"""
    return formats - {BARE_JSON} == {MISTRAL}


def keeps_special_tokens(parser: str | None, template: str | None) -> bool:
    """Whether outputs read for tool calls are decoded with their special tokens (vLLM's mistral and hermes parsers
    set ``skip_special_tokens`` false so): Mistral's ``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens, and without
    them a v11 call is its name run into its arguments; some Hermes models' ``<tool_call>`` tags are too (Hermes 2
    Pro's); harmony's tags all are (``openai``, whose reasoning parser keeps them for every output). Under
    ``--tool-call-parser mistral``, ``hermes`` or ``openai``, or without a parser, when the chat template
    (``template``, its source) writes ``[TOOL_CALLS]``."""
    return parser in ("mistral", "hermes", "openai") or (
        parser is None and template is not None and MISTRAL_TAG in template
    )


def parameter_types(tools: list[dict[str, Any]] | None) -> ParameterTypes:
    """The parameter schemas of ``tools`` as a chat request sends them (``{"type": "function", "function": {...}}``),
    a parameter's local ``$ref`` (``#/$defs/...``) resolved against its tool's parameters."""
    out: ParameterTypes = {}
    for tool in tools or ():
        function = tool.get("function") or {}
        if isinstance(function.get("name"), str):
            root = function.get("parameters") or {}
            properties = root.get("properties") or {}
            out[function["name"]] = {key: _resolved(schema, root) for key, schema in properties.items()}
    return out


def _resolved(schema: Any, root: dict[str, Any]) -> Any:
    """``schema``, or the schema its local ``$ref`` points to in ``root`` (one level: what a parameter's type needs)."""
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return schema
    found: Any = root
    for part in ref[2:].split("/"):
        found = found.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(found, dict) else None
    return found if isinstance(found, dict) else schema


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"call_{uuid.uuid4().hex[:24]}"

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out["index"] = index
        return out


def _as_call(obj: Any, text: str, span: CallSpan | None) -> ToolCall | None:
    """A parsed call object -> the call; its arguments the model's own JSON text (``text``'s span), a string's
    value, or ``{}`` when it gave none."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return ToolCall(obj["name"], args)
    if span is not None and span.args_start is not None and span.args_end is not None:
        return ToolCall(obj["name"], text[span.args_start : span.args_end])
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _bare_call(obj: Any, tools: Collection[str] | None) -> bool:
    """Whether a JSON object written without tags is a call: a ``name`` with ``arguments`` or ``parameters`` (vLLM's
    ``llama3_json`` rule), the name one of ``tools`` (the request's tool names; None: not known, any name)."""
    return (
        isinstance(obj, dict)
        and isinstance(obj.get("name"), str)
        and any(key in obj for key in ARGUMENT_KEYS)
        and (tools is None or obj["name"] in tools)
    )


def _kinds(schema: Any) -> set[str | None]:
    """The JSON types a schema allows: its ``type`` (one or a list, Python's names too), else its ``anyOf`` or
    ``oneOf`` members' together; ``{None}`` when it does not say."""
    if not isinstance(schema, dict):
        return {None}
    kinds = schema.get("type")
    if kinds is None:
        members = schema.get("anyOf") or schema.get("oneOf")
        if isinstance(members, list) and members:
            found = set().union(*(_kinds(m) for m in members))
            return {None} if None in found else found
    # (A type that is no name, a client's malformed schema, says nothing: it is no key to look up.)
    return {
        _TYPE_ALIASES.get(k, k) if isinstance(k, str) else None for k in (kinds if isinstance(kinds, list) else [kinds])
    }


def _listed(text: str, schema: Any) -> tuple[bool, Any]:
    """``(True, value)`` when the schema lists its values (``enum``, ``const``) and ``text`` is one of them, written
    as text or as JSON, blanks around it aside; else ``(False, None)``."""
    options = schema.get("enum") if isinstance(schema, dict) else None
    if isinstance(schema, dict) and "const" in schema:
        options = [schema["const"]]
    if not isinstance(options, list):
        return False, None
    stripped = text.strip()
    for written in (text, stripped):  # (as written first: a member may hold blanks of its own)
        if written in options and isinstance(written, str):
            return True, written
    try:
        parsed = json.loads(stripped)
    except UNREADABLE_JSON:
        return False, None
    # (1 == True in Python: a member matches only a value of its own type)
    return next(((True, o) for o in options if type(o) is type(parsed) and o == parsed), (False, None))


def _typed(value: str, schema: Any) -> Any:
    """An XML call's parameter text as its schema's type says (vLLM's qwen3_coder parser reads them so): a string
    stays text, as does a value of no known type or one that does not read as its type. A schema that lists its values
    (``enum``, ``const``) gives the one the text names, whatever blanks surround it."""
    listed, option = _listed(value, schema)
    if listed:
        return option
    kinds = _kinds(schema)
    if "null" in kinds and value.strip().lower() in ("null", "none"):
        return None  # (a string-or-null parameter's null, as vLLM's parser reads it)
    if kinds == {None} or "string" in kinds:
        return value
    text = value.strip()
    if text.lower() in ("null", "none"):
        return None
    with contextlib.suppress(ValueError):  # (an integer past int()'s 4,300 digits stays text)
        if "integer" in kinds and _INTEGER.fullmatch(text):
            return int(text)
        if "number" in kinds and _NUMBER.fullmatch(text):
            number = int(text) if _INTEGER.fullmatch(text) else float(text)
            if math.isfinite(number):  # (1e400 overflows to infinity, which JSON has not: it stays text)
                return number
    if "boolean" in kinds and text.lower() in ("true", "false"):
        return text.lower() == "true"
    wanted = tuple(t for k, t in (("object", dict), ("array", list)) if k in kinds)
    if wanted:
        parsed: Any = None
        with contextlib.suppress(*UNREADABLE_JSON):  # (NaN and Infinity, which JSON lacks, refused too)
            parsed = json.loads(text, parse_constant=_refuse)
        if parsed is None:
            with contextlib.suppress(ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                parsed = ast.literal_eval(text)  # (Python's dict and list literals, which models write too)
        if isinstance(parsed, wanted) and _is_json(parsed):
            return parsed
    return value


def _refuse(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _is_json(value: Any) -> bool:
    """Whether ``value`` writes as JSON (a Python literal may hold sets, bytes, tuples as keys, NaN)."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def _xml_calls(block: str, types: ParameterTypes) -> list[ToolCall]:
    """Qwen3-Coder's calls in a ``<tool_call>`` block (a ``<function=...>`` each). A value loses one newline at each
    end (the template writes each on lines of its own); the arguments are then JSON text, as OpenAI returns them."""
    calls = []
    for found in _XML_FUNCTION.finditer(block):
        name = found.group(1).strip()
        schemas = types.get(name, {})
        args = {}
        for key, raw in _XML_PARAMETER.findall(found.group(2)):
            value = raw.removeprefix("\n")
            value = value[:-1] if value.endswith("\n") else value
            args[key.strip()] = _typed(value, schemas.get(key.strip()))
        calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
    return calls


def _glm_call(
    block: str, types: ParameterTypes | None, closed: bool = True, tools_only: bool = False
) -> list[ToolCall]:
    """GLM-4.5's call in a ``<tool_call>`` block's text (stripped), as vLLM's ``glm45`` parser reads it: the
    function's name up to the first line's end (or to the first ``<arg_key>``: GLM-4.7 writes no line between), then
    each ``<arg_key>KEY</arg_key>`` and the ``<arg_value>VALUE</arg_value>`` after it, blanks between, a value read by
    its parameter's schema (:func:`_glm_value`); what else the block holds is passed over. ``[]`` when the name is
    none (JSON, or text, in the block), or when the block was never closed (``closed``: the model stopped, or was cut
    off, before ``</tool_call>``, which alone says the call is whole): that stays the answer's text. ``tools_only``
    (GLM's calls read beside other formats, without the flag that names them): a name that is not one of the request's
    tools is text too (``<tool_call>example</tool_call>`` in prose), as a bare JSON call's is."""
    cut = min((at for at in (block.find("\n"), block.find(GLM_KEY)) if at >= 0), default=len(block))
    name = block[:cut].strip()
    if not closed or not CALL_NAME.fullmatch(name) or (tools_only and types is not None and name not in types):
        return []
    schemas = (types or {}).get(name, {})
    args = {key.strip(): _glm_value(value, schemas.get(key.strip())) for key, value in _GLM_ARGUMENT.findall(block)}
    return [ToolCall(name, json.dumps(args, ensure_ascii=False))]


def _glm_value(value: str, schema: Any) -> Any:
    """A GLM-4.5 argument's value: as its schema's type says (:func:`_typed`, as Qwen3-Coder's values are read); where
    the schema names no type (or the tool or the parameter is not one of the request's), the JSON the value holds
    when it reads whole as JSON (its template writes each value that is no string as JSON, vLLM's parser reads it
    back so), else its text."""
    if _kinds(schema) != {None} or _listed(value, schema)[0]:
        return _typed(value, schema)
    with contextlib.suppress(*UNREADABLE_JSON):  # (NaN and Infinity, which JSON lacks, refused too)
        parsed = json.loads(value.strip(), parse_constant=_refuse)
        if _is_json(parsed):  # (1e400 reads as infinity, past parse_constant)
            return parsed
    return value


def _pythonic_calls(text: str, tools: Collection[str] | None) -> list[ToolCall]:
    """Llama 3.2's and Llama 4's calls: ``text`` is a Python list of calls by name with keyword arguments of literal
    values (``[get_weather(city="Paris"), get_time()]``), as vLLM's ``pythonic`` parser reads it; the names among
    ``tools`` (None: any). The arguments become JSON text. Anything else (a value that is not a literal, a positional
    argument, a list that is data) is no call: ``[]``."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return []
    if not isinstance(tree, ast.List) or not tree.elts:
        return []
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args):
            return []
        if (tools is not None and node.func.id not in tools) or any(k.arg is None for k in node.keywords):
            return []  # (a name of no tool, or **kwargs)
        try:
            args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return []
        if not _is_json(args):
            return []
        calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False)))
    return calls


def _block_calls(block: str, types: ParameterTypes | None, formats: CallFormats, closed: bool = True) -> list[ToolCall]:
    """The calls in a ``<tool_call>`` block's text: its JSON call, or a JSON list of calls (SmolLM2 writes its calls
    so, all in one block; every item a call, or none is), or else Qwen3-Coder's XML ones, or else GLM-4.5's call (of
    ``formats``; ``closed``: the block has its end tag, without which GLM's is no call)."""
    try:
        obj = json.loads(block) if TAGGED_JSON in formats else None
    except UNREADABLE_JSON:
        obj = None
    if obj is None:
        xml = _xml_calls(block, types or {}) if TAGGED_XML in formats else []
        glm_only = formats == TOOL_CALL_PARSERS["glm45"]  # (under --tool-call-parser glm45 or glm47, any name)
        return xml or (_glm_call(block, types, closed, not glm_only) if TAGGED_GLM in formats else [])
    spans = scan_calls(block)
    items = obj if isinstance(obj, list) else [obj]
    calls = [_as_call(item, block, spans[n] if n < len(spans) else None) for n, item in enumerate(items)]
    return [call for call in calls if call is not None] if all(calls) else []


_JSON = json.JSONDecoder()
_END_TAG = "</tool_call>"


def tagged_blocks(text: str) -> list[tuple[int, int, str]]:
    """The closed ``<tool_call>`` blocks of ``text``: each one's span, tags included, and its text between the tags,
    stripped. A block whose text opens with JSON ends at the end tag after that JSON, so a ``</tool_call>`` inside a
    string of its arguments (an agent writing about tool calls) does not cut it; any other block (Qwen3-Coder's XML)
    ends at the first end tag."""
    blocks, pos = [], 0
    while (at := text.find(TOOL_CALL_TAG, pos)) >= 0:
        inner = at + len(TOOL_CALL_TAG)
        first = len(text) - len(text[inner:].lstrip())
        close, json_end = -1, -1
        if text.startswith(("{", "["), first):
            try:
                json_end = _JSON.raw_decode(text, first)[1]
            except UNREADABLE_JSON:
                json_end = -1
            after = len(text) - len(text[json_end:].lstrip()) if json_end >= 0 else -1
            if after >= 0 and text.startswith(_END_TAG, after):
                close = after
        if close < 0:
            # (Past a JSON that reads whole: an end tag inside its strings is no end, even with none right after it.)
            close = text.find(_END_TAG, json_end if json_end >= 0 else inner)
        if close < 0:
            break
        blocks.append((at, close + len(_END_TAG), text[inner:close].strip()))
        pos = close + len(_END_TAG)
    return blocks


def _unclosed_block(text: str, closed: list[tuple[int, int, str]]) -> tuple[int, str]:
    """Where a last ``<tool_call>`` block that the output never closed begins (its tag, after every closed block:
    ``closed``, its :func:`tagged_blocks`), and its text; ``(-1, "")`` when there is none. Its calls are calls when
    they parse, as vLLM's Hermes parser reads such a block: the model stopped before the end tag. A block cut off
    inside its JSON does not parse, and stays content."""
    at = text.find(TOOL_CALL_TAG, closed[-1][1] if closed else 0)
    return (at, text[at + len(TOOL_CALL_TAG) :].strip()) if at >= 0 else (-1, "")


def _skip_blanks(text: str, at: int) -> int:
    return len(text) - len(text[at:].lstrip())


def _json_calls(text: str, at: int) -> tuple[int, list[ToolCall]]:
    """The calls of the JSON value at ``at`` (a call object, or a list of them: Mistral's after ``[TOOL_CALLS]``,
    Phi-4-mini's after ``functools``), each one's arguments the model's own text; and where the value ends. ``(at,
    [])`` when it does not read whole or an item is no call."""
    try:
        obj, end = _JSON.raw_decode(text, at)
    except UNREADABLE_JSON:
        return at, []
    items = obj if isinstance(obj, list) else [obj]
    spans = scan_calls(text[at:end])
    calls = [_as_call(item, text[at:end], spans[n] if n < len(spans) else None) for n, item in enumerate(items)]
    if not items or any(call is None for call in calls):
        return at, []
    return end, [call for call in calls if call is not None]


def _named_call(
    text: str, at: int, name_of: Callable[[str], str | None] = named_call_name
) -> tuple[int, list[ToolCall]]:
    """Mistral's v11 call at ``at`` (after its ``[TOOL_CALLS]``; DeepSeek's with ``name_of``
    :func:`deepseek_call_name`): its name, then its arguments' object, which are the call's arguments as written;
    and where they end. ``(at, [])`` when the name is none or the object does not read whole."""
    brace = text.find("{", at)
    name = name_of(text[at:brace]) if brace >= 0 else None
    if name is None:
        return at, []
    try:
        args, end = _JSON.raw_decode(text, brace)
    except UNREADABLE_JSON:
        return at, []
    return (end, [ToolCall(name, text[brace:end])]) if isinstance(args, dict) else (at, [])


def marked_calls(text: str, formats: CallFormats) -> list[tuple[int, int, list[ToolCall]]]:
    """The calls after the tags of Mistral (``[TOOL_CALLS]``), Phi-4-mini (``functools[``), DeepSeek
    (``<｜tool▁call▁begin｜>``) and harmony (``harmony.CALL_TAG``), those of ``formats``, in ``text``: each tag's span
    with its calls (a DeepSeek call's with the tags and fence around it), and those calls, in order. Mistral's tag is
    followed by a JSON list of calls (before v11) or one call by name (v11 on, a tag each); calls read there get
    Mistral's ids. A tag whose calls do not read whole (cut off) is no call: it stays in the text; but a harmony call is
    one however far it got (its message's header, whole, made it one)."""
    marks = ((MISTRAL, MISTRAL_TAG), (FUNCTOOLS, FUNCTOOLS_TAG), (DEEPSEEK, DEEPSEEK_CALL), (HARMONY, harmony.CALL_TAG))
    tags = [t for f, t in marks if f in formats]
    found, pos = [], 0
    while tags and (hits := [(at, t) for t in tags if (at := text.find(t, pos)) >= 0]):
        at, tag = min(hits)
        after = at + len(tag)
        if tag == FUNCTOOLS_TAG:
            end, calls = _json_calls(text, after - 1)  # (the list's bracket is the tag's last character)
        elif tag == harmony.CALL_TAG:
            end, calls = _harmony_call(text, at)
        elif tag == DEEPSEEK_CALL:
            end, calls = _named_call(text, after, deepseek_call_name)
            if calls:
                at, end = _deepseek_span(text, at, end)
        elif text.startswith(("[", "{"), first := _skip_blanks(text, after)):
            end, calls = _json_calls(text, first)
        else:
            end, calls = _named_call(text, after)
        if calls:
            if tag == MISTRAL_TAG:
                for call in calls:
                    call.id = mistral_call_id()
            found.append((at, end, calls))
        pos = end if calls else after
    return found


def _harmony_call(text: str, at: int) -> tuple[int, list[ToolCall]]:
    """The harmony call whose tag is at ``at`` (``harmony.marked_call``): where it ends, and the call; ``(at, [])``
    when its name is not whole."""
    found = harmony.marked_call(text, at)
    if found is None:
        return at, []
    end, name, arguments, _ = found
    return end, [ToolCall(name, arguments)]


def _deepseek_span(text: str, at: int, end: int) -> tuple[int, int]:
    """One of DeepSeek's calls, ``[at, end)`` from its begin tag to its arguments' end, with what surrounds it: the
    fence that closes V3's arguments and the call's end tag, the calls' begin tag before it (blanks between) and
    their end tag after it, and the blanks before a next call: no content."""
    for closing in ("```", DEEPSEEK_CALL_END, DEEPSEEK_CALLS_END):
        if text.startswith(closing, after := _skip_blanks(text, end)):
            end = after + len(closing)
    if text.startswith(DEEPSEEK_CALL, after := _skip_blanks(text, end)):
        end = after  # (the line between two calls is theirs)
    head = text[:at].rstrip()
    return (len(head) - len(DEEPSEEK_CALLS) if head.endswith(DEEPSEEK_CALLS) else at), end


def bare_json_calls(text: str, tools: Collection[str] | None) -> list[ToolCall]:
    """The calls of an output that is bare JSON, all of it (blanks around it aside): a call object, a list of them,
    or, as Llama 3.1 writes several, call objects a ``;`` apart, after a ``<|python_tag|>`` or not (vLLM's
    ``llama3_json``), or Granite's list after its ``<|tool_call|>`` (Phi-4-mini's between it and
    ``<|/tool_call|>``); each a call by :func:`_bare_call`. ``[]`` when it is anything else (an answer)."""
    body = text.strip()
    body = _after_bare_tag(body) or body
    body = body.removesuffix(PHI4_CALL_END).rstrip() if body.startswith("[") else body
    docs, at = [], 0
    while at < len(body):
        try:
            obj, end = _JSON.raw_decode(body, at)
        except UNREADABLE_JSON:
            return []
        docs.append((at, end, obj))
        at = _skip_blanks(body, end)
        if at < len(body):
            if body[at] != ";":
                return []
            at = _skip_blanks(body, at + 1)
    if len(docs) > 1 and not all(isinstance(obj, dict) for _, _, obj in docs):
        return []  # (a list, then more: not Llama's calls)
    items = [(start, end, item) for start, end, obj in docs for item in (obj if isinstance(obj, list) else [obj])]
    if not items or not all(_bare_call(item, tools) for _, _, item in items):
        return []
    spans = {start: scan_calls(body[start:end]) for start, end, _ in docs}
    calls, seen = [], dict.fromkeys(spans, 0)
    for start, end, item in items:
        n, seen[start] = seen[start], seen[start] + 1
        doc_spans = spans[start]
        call = _as_call(item, body[start:end], doc_spans[n] if n < len(doc_spans) else None)
        if call is not None:
            calls.append(call)
    return calls


def parse_tool_calls(
    text: str, types: ParameterTypes | None = None, formats: CallFormats = ALL_FORMATS
) -> tuple[str | None, list[ToolCall]]:
    """Split model output into (remaining content or None, tool calls). ``types``: the request's tools' parameter
    schemas by name, for Qwen3-Coder's XML calls, and the names a bare JSON call may have (None: not known, any);
    ``formats``: the shapes of call read (``--tool-call-parser``). Under Mistral's parser every call gets Mistral's
    id (:func:`mistral_ids`)."""
    content, calls = _parsed(text, types, formats)
    if mistral_ids(formats):
        for call in calls:
            call.id = call.id if _is_mistral_id(call.id) else mistral_call_id()
    return content, calls


def _is_mistral_id(id_: str) -> bool:
    return len(id_) == 9 and id_.isascii() and id_.isalnum()


def _parsed(text: str, types: ParameterTypes | None, formats: CallFormats) -> tuple[str | None, list[ToolCall]]:
    if formats & TAGGED:
        closed = tagged_blocks(text)
        at, tail = _unclosed_block(text, closed)
        blocks = [(inner, True) for _, _, inner in closed] + ([(tail, False)] if at >= 0 else [])
        calls = [call for block, whole in blocks for call in _block_calls(block, types, formats, whole)]
        if calls:
            return (_content_before_calls(text, formats).strip() or None), calls
        if closed:
            return text, []
    if marked := marked_calls(text, formats):
        return (_content_before_calls(text, formats).strip() or None), [c for _, _, calls in marked for c in calls]
    if TAGGED_XML in formats and (at := text.find(XML_FUNCTION_TAG)) >= 0:
        # Qwen3-Coder's calls without their block's tags
        calls = _xml_calls(text[at:], types or {})
        if calls:
            return (_content_before_calls(text, formats).strip() or None), calls
    stripped = text.strip()
    if BARE_JSON in formats and (calls := bare_json_calls(stripped, types)):
        return None, calls
    if PYTHONIC in formats and stripped.startswith("[") and (calls := _pythonic_calls(stripped, types)):
        return None, calls
    return text, []


TOOL_CALL_TAG = "<tool_call>"
XML_FUNCTION_TAG = "<function="


def call_tags(formats: CallFormats) -> list[str]:
    """The tags that begin calls of ``formats``: Hermes' ``<tool_call>`` (JSON, XML or GLM-4.5's call in it), Mistral's
    ``[TOOL_CALLS]``, Phi-4-mini's ``functools[``, DeepSeek's ``<｜tool▁call▁begin｜>`` (each call's), harmony's
    ``harmony.CALL_TAG``."""
    tagged = [(TOOL_CALL_TAG, formats & TAGGED), (MISTRAL_TAG, MISTRAL in formats)]
    others = [(FUNCTOOLS_TAG, FUNCTOOLS in formats), (DEEPSEEK_CALL, DEEPSEEK in formats)]
    others.append((harmony.CALL_TAG, HARMONY in formats))
    return [tag for tag, read in [*tagged, *others] if read]


# Output text -> (its content, or None when it is calls alone; the calls in it).
CallParser = Callable[[str], tuple[str | None, list[ToolCall]]]


class ContentStream:
    """The content of an output read for tool calls, streamed as it is made: text that cannot be part of a call goes
    out at once; from a tag that begins calls on (Hermes' ``<tool_call>``, Mistral's ``[TOOL_CALLS]``, Phi-4-mini's
    ``functools[``; held back while the text ends in part of one), or an output that opens with JSON (a bare call,
    Llama 3.1's, with its ``<|python_tag|>`` or not) or a list (Llama 3.2's Python calls), the rest waits for the
    parser at the end (:meth:`finish`). Blanks that end the text so far wait for what follows them: before a call
    they are no content (the unstreamed content is stripped), so they go out only with the text after them, or at
    the end."""

    def __init__(self, formats: CallFormats = ALL_FORMATS) -> None:
        self.sent = 0  # characters of the output sent as content
        self.held = False  # a call has begun, or may have: nothing more is sent before the end
        self.formats = formats
        # An output that opens with one of these may be calls: JSON (bare calls), a list (Python calls too).
        self.openers = "{[" if BARE_JSON in formats else "[" if PYTHONIC in formats else ""
        # The tags that begin one: <tool_call>, <function= (Qwen3-Coder's call without its block's tag), Mistral's,
        # Phi-4-mini's, DeepSeek's and harmony's.
        self.tags = call_tags(formats) + ([XML_FUNCTION_TAG] if TAGGED_XML in formats else [])
        self.tags += [DEEPSEEK_CALLS] if DEEPSEEK in formats else []  # (the calls' tag, before the first call's)

    def feed(self, text: str) -> str:
        """The output so far (``text``) -> the content to send now."""
        if self.held:
            return ""
        if self.sent == 0:
            head = text.lstrip()
            if not head:
                return ""
            if head[0] in self.openers or (BARE_JSON in self.formats and head.startswith(BARE_TAGS)):
                self.held = True
                return ""
            if BARE_JSON in self.formats and any(t.startswith(head) for t in BARE_TAGS):
                return ""  # (Llama 3.1's or Granite's tag being written, or text that begins like it)
        found = [at for t in self.tags if (at := text.find(t, max(self.sent - len(t) + 1, 0))) >= 0]
        if found:
            self.held, end = True, min(found)
        else:
            end = len(text) - max((partial_tag(text, t) for t in self.tags), default=0)
        piece = text[self.sent : end].rstrip() if end > self.sent else ""
        self.sent += len(piece)
        return piece

    def finish(self, text: str, calls_of: CallParser) -> tuple[str, list[ToolCall]]:
        """The whole output -> the content not sent yet, and the calls (``calls_of``: the parser). Sent and rest
        together are the unstreamed response's content, but for blanks that begin it (stripped there, where calls
        follow: they went out with the text after them, before the calls were known)."""
        content, calls = calls_of(text)
        if not calls:
            return text[self.sent :], []
        if not self.sent:
            return content or "", calls
        return _content_before_calls(text, self.formats)[self.sent :].rstrip(), calls


class CallStream:
    """Tool calls streamed as they are written, as OpenAI's and vLLM's chunks carry them: a call's first delta has
    its index, id and name, once the name is complete and its arguments' object has begun, and the arguments' text
    so far; the next ones the text added since. The calls are read from where :class:`ContentStream` held the
    output: a Hermes ``<tool_call>`` block each, Mistral's calls after each ``[TOOL_CALLS]`` (a JSON list, or a call
    by name, its arguments streamed as they are written, with Mistral's ids), Phi-4-mini's ``functools[`` list, a
    harmony call (its message's body as it is written), or, when a forced call's grammar writes it, the bare JSON the
    output opens with. Bare JSON the model wrote unforced streams no call: the parser reads it as calls only when
    nothing but blanks follows it (``{...} and more text`` is an answer, all of it), which is known only when the
    output ends, so its calls come whole from :meth:`finish`.
    ``parallel=False`` streams the first call only; ``tools``: the request's tool names, the only names a bare call
    may have, as the parser reads it (None: not known, any); ``forced``: a forced call's (its grammar writes calls
    throughout, so bare ones stream as they are written); ``formats``: the shapes the parser reads (Python calls come
    whole from :meth:`finish` always). :meth:`finish` sends what the parsed calls have beyond what was streamed."""

    def __init__(
        self,
        parallel: bool = True,
        tools: Collection[str] | None = None,
        forced: bool = False,
        formats: CallFormats = ALL_FORMATS,
    ) -> None:
        self.parallel = parallel
        self.tools = tools
        self.forced = forced
        self.bare_json = BARE_JSON in formats
        self.mistral_ids = mistral_ids(formats)  # every call's id is Mistral's (else those after its tag)
        # The tags calls follow: Hermes' where its JSON is read (a forced call's grammar writes its blocks only then;
        # a block of Qwen3-Coder's XML or GLM-4.5's call streams nothing, its calls come whole from finish), the others
        # as read.
        self.tags = [TOOL_CALL_TAG] if TAGGED_JSON in formats else []
        self.tags += [t for t in call_tags(formats) if t != TOOL_CALL_TAG]
        self._bare: bool | None = None  # the calls are the JSON the output opens with (else after tags)
        # One a document: the bare JSON, or each block's, each Mistral call's or list, each functools list; and
        # whether its calls are Mistral's.
        self._scanners: list[CallScanner | NamedCallScanner | harmony.HarmonyCallScanner] = []
        self._mistral: list[bool] = []
        self._searched = 0  # (no tag begins before here that has not been read)
        self._ids: list[str] = []  # each begun call's id
        self._names: list[str] = []  # and name
        self._sent: list[str] = []  # and arguments sent

    def feed(self, text: str, start: int) -> list[dict[str, Any]]:
        """``text``: the output so far; ``start``: where the content stream held it. -> tool-call deltas to send."""
        if self._bare is None:
            head = text[start:].lstrip()
            if self.bare_json and (after := _after_bare_tag(head)) is not None:
                head = after  # (Llama 3.1's or Granite's tag before its JSON)
                if not head:
                    return []
            elif not head or any(len(head) < len(t) and t.startswith(head) for t in self.tags + list(BARE_TAGS)):
                return []  # (a tag being written, "[" of "[TOOL_CALLS]" say: not yet known which)
            self._bare = head[0] in "{[" and not any(head.startswith(t) for t in self.tags)
            if self._bare:
                self._add(CallScanner(len(text) - len(head)), mistral=False)
        if self._scanners:
            self._scanners[-1].feed(text)
        if self._bare and not (self.bare_json and self.forced):
            return []  # (unforced, its calls wait for the end: see the class's docstring)
        while not self._bare and (not self._scanners or self._scanners[-1].done):
            if not self._next_document(text, self._scanners[-1].pos if self._scanners else start):
                break
            self._scanners[-1].feed(text)
        deltas: list[dict[str, Any]] = []
        calls = [(n, scanner, call) for n, scanner in enumerate(self._scanners) for call in scanner.calls]
        for index, (n, scanner, call) in enumerate(calls[: None if self.parallel else 1]):
            if index == len(self._ids):
                if call.name is None or call.args_start is None or call.args_opener not in "{[":
                    break  # calls begin in order
                if self._bare and self.tools is not None and call.name not in self.tools:
                    break  # JSON naming none of the tools is an answer, not a call (the parser reads it so)
                mistral = self.mistral_ids or self._mistral[n]
                self._ids.append(mistral_call_id() if mistral else f"call_{uuid.uuid4().hex[:24]}")
                self._names.append(call.name)
                self._sent.append("")
                begun = {"index": index, "id": self._ids[index], "type": "function"}
                deltas.append({**begun, "function": {"name": call.name, "arguments": ""}})
            assert call.args_start is not None
            end = call.args_end if call.args_end is not None else scanner.pos
            piece = text[call.args_start + len(self._sent[index]) : end]
            if piece:
                self._sent[index] += piece
                if deltas and deltas[-1]["index"] == index:
                    deltas[-1]["function"]["arguments"] += piece
                else:
                    deltas.append({"index": index, "function": {"arguments": piece}})
        return deltas

    def _add(self, scanner: CallScanner | NamedCallScanner | harmony.HarmonyCallScanner, mistral: bool) -> None:
        self._scanners.append(scanner)
        self._mistral.append(mistral)

    def _next_document(self, text: str, pos: int) -> bool:
        """Begin reading the calls after the next tag from ``pos`` on; False when there is none yet (none written, or
        Mistral's tag with nothing but blanks after it so far: which of its forms follows is not yet known). Text
        searched before is not searched again, but for a tag's length at its end (a tag it may have begun)."""
        pos = max(pos, self._searched)
        hits = [(at, tag) for tag in self.tags if (at := text.find(tag, pos)) >= 0]
        if not hits:
            self._searched = max(pos, len(text) - max((len(t) for t in self.tags), default=1) + 1)
            return False
        at, tag = min(hits)
        self._searched = at
        after = at + len(tag)
        if tag == TOOL_CALL_TAG:
            self._add(CallScanner(after), mistral=False)
        elif tag == FUNCTOOLS_TAG:
            self._add(CallScanner(after - 1), mistral=False)  # (the list's bracket is the tag's last character)
        elif tag == DEEPSEEK_CALL:
            self._add(NamedCallScanner(after, deepseek_call_name), mistral=False)
        elif tag == harmony.CALL_TAG:
            self._add(harmony.HarmonyCallScanner(after), mistral=False)
        elif (first := _skip_blanks(text, after)) == len(text):
            return False
        else:  # Mistral's: a JSON list of calls (before v11), else a call by name
            json_calls = text[first] in "[{"
            self._add(CallScanner(first) if json_calls else NamedCallScanner(after), mistral=True)
        return True

    def begun(self) -> list[ToolCall]:
        """The calls streamed so far, with their ids, each's arguments as far as they went out."""
        return [ToolCall(name, sent, id_) for id_, name, sent in zip(self._ids, self._names, self._sent, strict=True)]

    def finish(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        """The parsed calls -> the deltas that complete them, the streamed ones keeping their ids. A streamed call past
        the parsed ones (a last block cut off inside its JSON) is left as it went out: what was sent cannot be taken
        back. Should the calls not be what was streamed (a block before them that did not parse, say), they come whole
        after the streamed indices, which are left as they went out."""
        if any(
            calls[index].name != self._names[index] or not calls[index].arguments.startswith(sent)
            for index, sent in enumerate(self._sent[: len(calls)])
        ):
            return [call.to_openai(len(self._ids) + index) for index, call in enumerate(calls)]
        deltas = []
        for index, call in enumerate(calls):
            if index < len(self._ids):
                call.id = self._ids[index]
                if rest := call.arguments[len(self._sent[index]) :]:
                    deltas.append({"index": index, "function": {"arguments": rest}})
            else:
                deltas.append(call.to_openai(index))
        return deltas


def _content_before_calls(text: str, formats: CallFormats) -> str:
    """An output that holds calls, less the calls (:func:`spans_around_calls`)."""
    return "".join(text[start:end] for start, end in spans_around_calls(text, formats))


def spans_around_calls(text: str, formats: CallFormats) -> list[tuple[int, int]]:
    """The parts ``[start, end)`` of an output that holds calls that are not the calls: around its closed blocks, and
    before its unclosed last block when that holds calls (of ``formats``), or, when it has no block, around Mistral's
    and Phi-4-mini's tags with their calls (:func:`marked_calls`), or else (Qwen3-Coder's calls without their tags)
    before the first ``<function=`` (and before a ``<tool_call>`` just before it, blanks between); none empty. (Where
    a message's content lies in its output: its logprobs are those of its content's tokens.)"""
    closed = tagged_blocks(text) if formats & TAGGED else []
    at, tail = _unclosed_block(text, closed)
    unclosed = at >= 0 and bool(formats & TAGGED) and bool(_block_calls(tail, None, formats, closed=False))
    if unclosed or closed:
        end = at if unclosed else len(text)  # (every closed block ends before an unclosed one)
        bounds = [0, *(i for start, stop, _ in closed for i in (start, stop)), end]
        spans = list(zip(bounds[::2], bounds[1::2], strict=True))
    elif marked := marked_calls(text, formats):
        bounds = [0, *(i for start, stop, _ in marked for i in (start, stop)), len(text)]
        spans = list(zip(bounds[::2], bounds[1::2], strict=True))
    elif (at := text.find(XML_FUNCTION_TAG)) >= 0:
        head = text[:at].rstrip()
        spans = [(0, len(head) - len(TOOL_CALL_TAG) if head.endswith(TOOL_CALL_TAG) else at)]
    else:
        spans = [(0, len(text))]
    return [(start, end) for start, end in spans if start < end]


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (shorter than ``tag``; 0: none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def forced_call_schema(tools: list[dict[str, Any]], name: str | None, parallel: bool = True) -> dict[str, Any]:
    """The JSON schema of the output when a call is forced: ``name``'s call (``{"name": ..., "parameters": ...}``
    with its parameters' schema), or with ``name=None`` (``required``) a list of one or more calls of any of the
    tools (one, unless ``parallel``). ``tools`` as the request sends them
    (``{"type": "function", "function": {...}}``)."""

    def call(function: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {
                "name": {"enum": [function["name"]]},
                "parameters": function.get("parameters") or {"type": "object"},
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }

    functions = [t["function"] for t in tools]
    if name is not None:
        return call(next(f for f in functions if f["name"] == name))
    calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": [call(f) for f in functions]}}
    if not parallel:
        calls["maxItems"] = 1
    return calls


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them, as vLLM hands them over: an assistant's tool-call arguments as the
    objects their JSON text holds (arguments that are no JSON, empty ones or none at all as ``{}``), and an
    assistant's empty list of calls dropped, so that templates take the turn as text. The messages given are not
    changed."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and isinstance(calls, list):
            if not calls:
                del m["tool_calls"]
            converted = []
            for call in calls:
                call = dict(call)
                fn = dict(call.get("function", {}))
                arguments = fn.get("arguments")
                if isinstance(arguments, str):
                    try:
                        fn["arguments"] = json.loads(arguments)
                    except UNREADABLE_JSON:
                        fn["arguments"] = {}
                elif not isinstance(arguments, dict | list):
                    fn["arguments"] = {}
                call["function"] = fn
                converted.append(call)
            if converted:
                m["tool_calls"] = converted
        out.append(m)
    return out

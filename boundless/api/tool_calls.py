"""Tool calls in model output, parsed back into OpenAI ``tool_calls``.

Templates that take ``tools`` teach the model one of two shapes, and both are recognised:
Hermes/Qwen-style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, and a bare
JSON object (or list of objects) with ``name`` and ``arguments`` or ``parameters`` (Llama 3.1).

A ``tool_choice`` that forces a call (``required``, or a named function) holds the output to the second shape
with a JSON schema (:func:`forced_call_schema`, as vLLM does), so the calls parse whatever the model would say.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


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


def _as_call(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """Split model output into (remaining content or None, tool calls)."""
    tagged = _TAGGED.findall(text)
    if tagged:
        calls = []
        for block in tagged:
            try:
                call = _as_call(json.loads(block))
            except json.JSONDecodeError:
                call = None
            if call is not None:
                calls.append(call)
        if calls:
            rest = _TAGGED.sub("", text).strip()
            return (rest or None), calls
        return text, []
    stripped = text.strip()
    if stripped.startswith(("{", "[")):
        try:
            obj = json.loads(stripped)
        except json.JSONDecodeError:
            return text, []
        items = obj if isinstance(obj, list) else [obj]
        calls = [c for c in (_as_call(i) for i in items) if c is not None]
        if calls and len(calls) == len(items):
            return None, calls
    return text, []


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
    """Messages as chat templates expect them: assistant tool-call arguments as objects, not JSON text."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls:
            converted = []
            for call in calls:
                call = dict(call)
                fn = dict(call.get("function", {}))
                if isinstance(fn.get("arguments"), str):
                    with contextlib.suppress(json.JSONDecodeError):
                        fn["arguments"] = json.loads(fn["arguments"])
                call["function"] = fn
                converted.append(call)
            m["tool_calls"] = converted
        out.append(m)
    return out

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
from collections.abc import Callable
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


TOOL_CALL_TAG = "<tool_call>"
# Output text -> (its content, or None when it is calls alone; the calls in it).
CallParser = Callable[[str], tuple[str | None, list[ToolCall]]]


class ContentStream:
    """The content of an output read for tool calls, streamed as it is made: text that cannot be part of a call goes
    out at once; from a Hermes ``<tool_call>`` tag on (held back while the text ends in part of one), or an output that
    opens with JSON (a bare call, Llama 3.1's), the rest waits for the parser at the end (:meth:`finish`)."""

    def __init__(self) -> None:
        self.sent = 0  # characters of the output sent as content
        self.held = False  # a call has begun, or may have: nothing more is sent before the end

    def feed(self, text: str) -> str:
        """The output so far (``text``) -> the content to send now."""
        if self.held:
            return ""
        if self.sent == 0:
            head = text.lstrip()
            if not head:
                return ""
            if head[0] in "{[":
                self.held = True
                return ""
        tag = text.find(TOOL_CALL_TAG, max(self.sent - len(TOOL_CALL_TAG) + 1, 0))
        if tag >= 0:
            self.held, end = True, tag
        else:
            end = len(text) - _partial_tag(text)
        piece = text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece

    def finish(self, text: str, calls_of: CallParser) -> tuple[str, list[ToolCall]]:
        """The whole output -> the content not sent yet, and the calls (``calls_of``: the parser). Sent and rest
        together are the unstreamed response's content, but for the blanks around it (stripped there)."""
        content, calls = calls_of(text)
        if not calls:
            return text[self.sent :], []
        if not self.sent:
            return content or "", calls
        return _TAGGED.sub("", text)[self.sent :].rstrip(), calls


def _partial_tag(text: str) -> int:
    """Characters at the end of ``text`` that begin a tool-call tag (0: none)."""
    for k in range(min(len(TOOL_CALL_TAG) - 1, len(text)), 0, -1):
        if text.endswith(TOOL_CALL_TAG[:k]):
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

"""The JSON of tool calls read as it is written: each call's name and where its arguments are in the text.

A call is an object with a ``name`` and its ``arguments`` (or ``parameters``, Llama 3.1's and the forced-call
grammar's key); a document is one call (a Hermes ``<tool_call>`` block, a bare object) or a list of them. The
scanner reads characters as they come, once each (a call's arguments may be a whole file being written), and
keeps for each call its name once the string is complete and the span of its arguments' value in the text, the
end once the value is complete. Streamed tool calls send the arguments' text as it grows, and a parsed call's
``arguments`` is that same text (the model's JSON, as OpenAI returns it).

Mistral's newer models (tokenizer v11 and on) write a call as its name, then its arguments' object, without a call
object around them: ``[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}`` (``[ARGS]`` a special token, and in some a
``[CALL_ID]`` and an id before it); :class:`NamedCallScanner` reads those.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

ARGUMENT_KEYS = ("arguments", "parameters")
_BLANK = " \t\n\r"
_DELIMITERS = ",}]:" + _BLANK
# Mistral's tokens between a call's name and its arguments (v11's [ARGS]; an id after [CALL_ID] in later ones).
MISTRAL_ARGS, MISTRAL_CALL_ID = "[ARGS]", "[CALL_ID]"
# A function's name as the tools' check allows it: OpenAI's, and MCP's separators.
CALL_NAME = re.compile(r"[\w.\-:/]+")
# DeepSeek's tokens around a call (V3 and R1: ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```
# <｜tool▁call▁end｜>``; V3.1: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``).
DEEPSEEK_SEP = "<｜tool▁sep｜>"
_FENCE = re.compile(r"```(?:json)?\s*$")  # (the fence V3 opens its arguments with)
# The most text a call by name puts before its arguments: a name (128 characters at most), tags, an id, a fence.
_MAX_HEAD = 512


@dataclass
class CallSpan:
    """One call object as far as it was read: its name (None until the string is complete), where its arguments'
    value begins and ends in the text (None until then), and that value's first character."""

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    args_opener: str = ""


@dataclass
class _Frame:
    opener: str  # "{" or "["
    key: str | None = None  # an object's current key, once read
    expects_key: bool = True  # an object's next string is a key (at its start and after a comma)


@dataclass
class CallScanner:
    """Reads one JSON document of calls from ``start`` (a call object, or a list of them) as the text grows
    (:meth:`feed`); ``calls`` holds what it found, ``done`` says the document ended."""

    start: int
    calls: list[CallSpan] = field(default_factory=list)
    done: bool = False
    pos: int = -1  # the next character to read (set from start on the first feed)
    _stack: list[_Frame] = field(default_factory=list)
    _call_depth: int = 0  # frames above a call's values: 1 for a lone call, 2 in a list
    _string_at: int = -1  # where the string being read began (-1: not in one)
    _escaped: bool = False
    _key_string: bool = False
    _primitive_at: int = -1  # where the number or literal being read began (-1: not in one)

    def feed(self, text: str) -> None:
        """Read ``text`` (the whole output so far: it only grows) up to its end or the document's."""
        if self.pos < 0:
            self.pos = self.start
        i = self.pos
        while i < len(text) and not self.done:
            c = text[i]
            if self._string_at >= 0:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    at, self._string_at = self._string_at, -1
                    if self._key_string:
                        self._stack[-1].key = json.loads(text[at : i + 1])
                        self._stack[-1].expects_key = False
                    else:
                        self._value_done(text, at, i + 1)
                i += 1
                continue
            if self._primitive_at >= 0:
                if c not in _DELIMITERS:
                    i += 1
                    continue
                at, self._primitive_at = self._primitive_at, -1
                self._value_done(text, at, i)
            if c in _BLANK:
                pass
            elif c == '"':
                top = self._stack[-1] if self._stack else None
                self._key_string = top is not None and top.opener == "{" and top.expects_key
                if not self._key_string:
                    self._value_begins(i, c)
                self._string_at = i
            elif c in "{[":
                if not self._stack:
                    self._call_depth = 1 if c == "{" else 2
                self._value_begins(i, c)
                self._stack.append(_Frame(c))
            elif c in "}]":
                if not self._stack:
                    self.done = True
                    break
                self._stack.pop()
                self._value_done(text, -1, i + 1)
            elif c == ",":
                if self._stack:
                    self._stack[-1].expects_key = self._stack[-1].opener == "{"
            elif c == ":":
                pass
            else:
                self._value_begins(i, c)
                self._primitive_at = i
            i += 1
        self.pos = i

    def _value_begins(self, at: int, opener: str) -> None:
        depth = len(self._stack)
        if depth == self._call_depth - 1 and opener == "{":
            self.calls.append(CallSpan())  # a call object opens
        elif depth == self._call_depth and self.calls:
            call = self.calls[-1]
            if self._stack[-1].key in ARGUMENT_KEYS and call.args_start is None:
                call.args_start, call.args_opener = at, opener

    def _value_done(self, text: str, string_at: int, end: int) -> None:
        depth = len(self._stack)
        if not self._stack:
            self.done = True  # the document's one value ended
            return
        if depth == self._call_depth and self.calls:
            call = self.calls[-1]
            key = self._stack[-1].key
            if key in ARGUMENT_KEYS and call.args_start is not None and call.args_end is None:
                call.args_end = end
            elif key == "name" and string_at >= 0 and call.name is None:
                call.name = json.loads(text[string_at:end])


def scan_calls(text: str) -> list[CallSpan]:
    """The calls of a whole JSON document (valid JSON: the parser checked it)."""
    start = len(text) - len(text.lstrip())
    scanner = CallScanner(start)
    scanner.feed(text)
    return scanner.calls


def named_call_name(head: str) -> str | None:
    """The name of a call written as its name then its arguments (Mistral's v11 calls), from ``head``: the text between
    ``[TOOL_CALLS]`` and the arguments' ``{``, which may hold ``[ARGS]`` and ``[CALL_ID]`` with an id; None when it
    is no name (blanks inside it, another tag)."""
    name = head.split(MISTRAL_CALL_ID)[0].split(MISTRAL_ARGS)[0].strip()
    return name if CALL_NAME.fullmatch(name) else None


def deepseek_call_name(head: str) -> str | None:
    """The name of one of DeepSeek's calls from ``head``, the text between ``<｜tool▁call▁begin｜>`` and the arguments'
    ``{``: V3's (and R1's) ``function<｜tool▁sep｜>NAME`` and a JSON fence, or V3.1's ``NAME<｜tool▁sep｜>``; None when
    it is neither."""
    parts = head.split(DEEPSEEK_SEP)
    if len(parts) != 2:
        return None
    before, after = parts[0].strip(), parts[1].strip()
    after = _FENCE.sub("", after).strip()
    name = after or before  # (V3 names the call after the separator, V3.1 before it)
    return name if CALL_NAME.fullmatch(name) and not (after and before != "function") else None


@dataclass
class NamedCallScanner:
    """One call written as its name, then its arguments' JSON object (Mistral's ``name[ARGS]{...}``), from ``start``
    (after its ``[TOOL_CALLS]``), read as the text grows; the same face as :class:`CallScanner`: ``calls`` (the one
    call, once its name is whole: once its arguments' ``{`` is written), ``done``, ``pos``. A name that is none
    (``name_of``: :func:`named_call_name`, or :func:`deepseek_call_name` for DeepSeek's), or more text than a name and
    its tags before any ``{``, ends it without a call."""

    start: int
    name_of: Callable[[str], str | None] = named_call_name
    calls: list[CallSpan] = field(default_factory=list)
    done: bool = False
    pos: int = -1
    _args: CallScanner | None = None
    _searched: int = -1  # (text before here holds no "{": each character looked at once)

    def feed(self, text: str) -> None:
        if self.pos < 0:
            self.pos = self._searched = self.start
        if self._args is None:
            brace = text.find("{", self._searched)
            if brace < 0:
                self._searched = len(text)
                if len(text) - self.start > _MAX_HEAD:  # (no call: text that goes on without arguments)
                    self.done, self.pos = True, len(text)
                return
            name = self.name_of(text[self.start : brace])
            if name is None:
                self.done, self.pos = True, brace
                return
            self.calls.append(CallSpan(name, brace, None, "{"))
            self._args = CallScanner(brace)  # (its one document: the arguments' object, whose end it finds)
        self._args.feed(text)
        self.pos = self._args.pos
        if self._args.done:
            self.calls[0].args_end, self.done = self._args.pos, True

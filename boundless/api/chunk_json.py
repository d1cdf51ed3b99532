"""The server-sent events of a streamed chat or text completion, written a chunk at a time without a ``json.dumps`` of
the whole chunk.

A stream of N tokens sends N chunks that differ only in their choice: ``json.dumps`` made an encoder and wrote the same
id, object, created and model for every one. :class:`ChunkJSON` writes those fields once, and a chunk that carries
only text (the commonest by far) from a template around the text's JSON string: 0.3 us a chunk where ``json.dumps``
took 4 us (timeit, a completions chunk of one token). Every event is the text ``json.dumps(chunk, ensure_ascii=False)``
gave, byte for byte (``tests/api/test_chunk_json.py``), but for the three characters outside ASCII that Python's
``str.splitlines`` ends a line at (U+0085, U+2028, U+2029): those are written escaped (:func:`sse_json`), the same JSON
value. An event is one line of text to a client that splits the decoded stream so (``httpx``'s ``iter_lines``): a
model's text or a request's tool schema holding one of them broke the event in two there.
"""

from __future__ import annotations

import json
from typing import Any

# ``json.dumps(value, ensure_ascii=False)``'s text, from one encoder (``json.dumps`` makes one per call with options).
_encode = json.JSONEncoder(ensure_ascii=False).encode
# The characters past ASCII that end a line for str.splitlines, which JSON text may hold only inside strings.
_LINE_BREAKS = ("\x85", "\u2028", "\u2029")


def escape_line_breaks(text: str) -> str:
    """JSON ``text`` with U+0085, U+2028 and U+2029 as ``\\u`` escapes: the same value, one line to any reader."""
    for char in _LINE_BREAKS:
        if char in text:
            text = text.replace(char, f"\\u{ord(char):04x}")
    return text


def sse_json(value: Any) -> str:
    """``value``'s JSON for a server-sent event's data: ``json.dumps(value, ensure_ascii=False)``, its line breaks
    escaped (:func:`escape_line_breaks`)."""
    return escape_line_breaks(_encode(value))


def _string(text: str) -> str:
    """A string's JSON as :func:`sse_json` writes it (the C function ``json.dumps`` calls for a ``str``, escaped)."""
    return escape_line_breaks(json.encoder.encode_basestring(text))


class ChunkJSON:
    """The ``data: {...}`` events of one streamed response: ``fields`` (id, object, created, model, in that order)
    first, then ``system_fingerprint``, ``choices``, any other fields, and ``usage`` when ``include_usage`` (null but in
    the last chunk), as the routes have always written them."""

    def __init__(self, fields: dict[str, Any], include_usage: bool) -> None:
        self._head = "data: " + sse_json(fields)[:-1] + ', "system_fingerprint": '
        self._include_usage = include_usage
        self._end = ', "usage": null}\n\n' if include_usage else "}\n\n"
        # The last fingerprint and its JSON (it changes only when another instance takes the request over).
        self._fingerprint: tuple[str | None, str] = (None, "")

    def _fingerprint_json(self, fingerprint: str) -> str:
        if fingerprint != self._fingerprint[0]:
            self._fingerprint = (fingerprint, _string(fingerprint))
        return self._fingerprint[1]

    def event(
        self, fingerprint: str, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None, **more: Any
    ) -> bytes:
        """A chunk's event: its choices, ``more`` fields after them (the chat route's ``prompt_token_ids``) and its
        usage (written only with ``include_usage``)."""
        parts = [self._head, self._fingerprint_json(fingerprint), ', "choices": ', sse_json(choices)]
        for name, value in more.items():
            parts += [", ", _string(name), ": ", sse_json(value)]
        if self._include_usage and usage is not None:
            parts += [', "usage": ', sse_json(usage), "}\n\n"]
        else:
            parts.append(self._end)
        return "".join(parts).encode()

    def text_event(self, fingerprint: str, index: int, text: str) -> bytes:
        """The event of a completions chunk with text alone: ``event(fingerprint, [{"index": index, "text": text,
        "logprobs": None, "finish_reason": None}])``."""
        return (
            f'{self._head}{self._fingerprint_json(fingerprint)}, "choices": [{{"index": {index:d}, "text": '
            f'{_string(text)}, "logprobs": null, "finish_reason": null}}]{self._end}'
        ).encode()

    def content_event(self, fingerprint: str, index: int, content: str) -> bytes:
        """The event of a chat chunk with content alone: ``event(fingerprint, [{"index": index, "delta": {"content":
        content}, "logprobs": None, "finish_reason": None}])``."""
        return (
            f'{self._head}{self._fingerprint_json(fingerprint)}, "choices": [{{"index": {index:d}, "delta": '
            f'{{"content": {_string(content)}}}, "logprobs": null, "finish_reason": null}}]{self._end}'
        ).encode()

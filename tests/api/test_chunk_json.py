"""A stream's chunks written by ChunkJSON are the text json.dumps gave, byte for byte, but for the line breaks past
ASCII that str.splitlines ends a line at, written escaped: each event one line to any reader."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from boundless.api.chunk_json import ChunkJSON, escape_line_breaks

# Text as a detokenizer hands it out: any characters, quotes, backslashes, controls, line separators, emoji.
TEXTS = st.text(alphabet=st.characters(codec="utf-8"), max_size=40) | st.sampled_from(
    ['"', "\\", "\n\t\r", "\x00\x1f\x7f", "\u2028\u2029\u0085", "é東京🎉", "\ud7ff\ue000", ""]
)
FIELDS = st.fixed_dictionaries(
    {
        "id": st.text(max_size=12),
        "object": st.sampled_from(["text_completion", "chat.completion.chunk"]),
        "created": st.integers(0, 2**40),
        "model": TEXTS,
    }
)


def _dumped(fields: dict[str, Any], fingerprint: str, choices: list, include_usage: bool, usage: Any = None, **more):
    body = {**fields, "system_fingerprint": fingerprint, "choices": choices, **more}
    if include_usage:
        body["usage"] = usage
    event = f"data: {escape_line_breaks(json.dumps(body, ensure_ascii=False))}\n\n"
    assert json.loads(event.splitlines()[0].removeprefix("data: ")) == body  # (one line, the same value)
    return event.encode()


@given(FIELDS, TEXTS, st.integers(0, 300), TEXTS, st.booleans())
def test_a_text_chunk_is_json_dumps_of_it(
    fields: dict[str, Any], fingerprint: str, index: int, text: str, include_usage: bool
) -> None:
    writer = ChunkJSON(fields, include_usage)
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": None}
    assert writer.text_event(fingerprint, index, text) == _dumped(fields, fingerprint, [choice], include_usage)
    assert writer.event(fingerprint, [choice]) == _dumped(fields, fingerprint, [choice], include_usage)


@given(FIELDS, TEXTS, st.integers(0, 300), TEXTS, st.booleans())
def test_a_content_chunk_is_json_dumps_of_it(
    fields: dict[str, Any], fingerprint: str, index: int, content: str, include_usage: bool
) -> None:
    writer = ChunkJSON(fields, include_usage)
    choice = {"index": index, "delta": {"content": content}, "logprobs": None, "finish_reason": None}
    assert writer.content_event(fingerprint, index, content) == _dumped(fields, fingerprint, [choice], include_usage)


def test_any_chunk_is_json_dumps_of_it_its_usage_and_fields_after_the_choices() -> None:
    fields = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 17, "model": "m"}
    choice = {"index": 1, "delta": {}, "logprobs": {"content": [{"logprob": -0.25}]}, "finish_reason": "stop"}
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    with_usage, without = ChunkJSON(fields, include_usage=True), ChunkJSON(fields, include_usage=False)
    assert with_usage.event("boundless-0", [choice], usage) == _dumped(fields, "boundless-0", [choice], True, usage)
    assert with_usage.event("boundless-0", []) == _dumped(fields, "boundless-0", [], True)  # (usage: null)
    assert without.event("boundless-0", [choice], usage) == _dumped(fields, "boundless-0", [choice], False)
    more = {"prompt_token_ids": [1, 2, 3]}
    assert with_usage.event("boundless-1,2", [choice], None, **more) == _dumped(
        fields, "boundless-1,2", [choice], True, None, **more
    )
    # The fingerprint changes (another instance took the request over): the chunks after it say so.
    assert b'"system_fingerprint": "boundless-1"' in without.text_event("boundless-1", 0, "x")

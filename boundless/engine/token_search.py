"""Token sequences searched at C speed: packed as 32-bit words, searched as bytes (the proposers of speculative
decoding look up a sequence's end among its earlier tokens every step)."""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence


def packed_tokens(store: dict[str, bytearray], request_id: str, token_ids: Sequence[int]) -> bytearray:
    """The request's tokens as 32-bit words, kept in ``store`` and extended by the tokens added since (a request's
    tokens only grow; a shorter sequence under the same id is a new request, packed afresh)."""
    words = store.get(request_id)
    if words is None or len(words) > 4 * len(token_ids):
        words = store[request_id] = bytearray()
    words += array("I", token_ids[len(words) // 4 :]).tobytes()
    return words


def occurrences(words: bytearray, pattern: bytes | bytearray, end: int) -> Iterator[int]:
    """The byte offsets of the word-aligned occurrences of ``pattern`` ending at or before byte ``end``, latest
    first."""
    while True:
        at = words.rfind(pattern, 0, end)
        if at < 0:
            return
        if at % 4 == 0:
            yield at
        end = at + len(pattern) - 1  # before this one (a match across word boundaries included)


def first_occurrence(words: bytes | bytearray, pattern: bytes | bytearray, start: int = 0) -> int:
    """The byte offset of the first word-aligned occurrence of ``pattern`` at or after byte ``start``; -1 if none."""
    at = words.find(pattern, start)
    while at >= 0 and at % 4:
        at = words.find(pattern, at + 1)
    return at

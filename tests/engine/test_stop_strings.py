"""Stop strings found in new text (``engine/stop_strings.py``): a few by ``find``, many by their lengths, the same
first match either way."""

from __future__ import annotations

import random

import pytest

from boundless.engine.stop_strings import FEW_STOPS, StopStrings, stop_strings


def _reference(stops: list[str], text: str, before: int) -> tuple[int, str] | None:
    """The stop string ending past ``text[:before]`` that starts first (the first listed of those starting there)."""
    found = []
    for listed, s in enumerate(stops):
        for start in range(len(text) - len(s) + 1):
            if text.startswith(s, start) and start + len(s) > before:
                found.append((start, listed, s))
                break
    if not found:
        return None
    start, _, s = min(found)
    return start, s


@pytest.mark.parametrize("count", [1, FEW_STOPS, FEW_STOPS + 1, 200])
def test_the_first_stop_string_in_new_text_is_the_one_a_search_of_every_string_finds(count: int) -> None:
    rng = random.Random(count)
    for _ in range(300):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 5))) for _ in range(count)]
        text = "".join(rng.choice("abcd") for _ in range(rng.randint(0, 30)))
        before = rng.randint(0, len(text))
        assert StopStrings(tuple(stops)).first(text, before) == _reference(stops, text, before), (stops, text, before)


def test_a_string_that_ended_before_the_new_text_is_not_found_again() -> None:
    index = StopStrings(tuple(f"x{i}" for i in range(50)) + ("ab",))
    assert index.first("ab--", 3) is None  # ("ab" ended at 2: found then, or before min_tokens)
    assert index.first("ab--ab", 4) == (4, "ab")
    assert index.first("--abc", 3) == (2, "ab")  # (begun in the old text, ended in the new)


def test_a_requests_samples_share_one_index_of_many_strings() -> None:
    many = tuple(f"stop{i}" for i in range(1000))
    assert stop_strings(many) is stop_strings(many)
    assert stop_strings(many).longest == len("stop999")
    few = ("a", "bb")
    assert stop_strings(few).first("xxbb", 2) == (2, "bb")

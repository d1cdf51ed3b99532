"""A request's stop strings, found where they end in an output's new text.

A few are looked for with one ``str.find`` each from where they could begin. Many (a request may send hundreds of
thousands: no API caps them) are looked up by length instead: at each place the new text could end one, the text of
each length the strings have is looked up in a set of the strings of that length, so a token costs the lengths
there are, not the strings. A find per string per token was most of a step: 400,000 strings on 100 samples held
the engine 2.7 s a step, every other request of the step with it.

One index serves every sample of a request (they share their params' tuple of strings): :func:`stop_strings`.
"""

from __future__ import annotations

from boundless.engine.identity_cache import IdentityCache

# Up to this many, one find each; past it, by length.
FEW_STOPS = 8
_KEPT = 64  # indexes kept for the requests of late (by their tuple of strings)


class StopStrings:
    """``stops`` (in the order given: of two that start at the same place, the first listed is the one found)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.longest = max(map(len, stops), default=0)
        self._by_length: list[tuple[int, dict[str, int]]] | None = None
        if len(stops) > FEW_STOPS:
            by_length: dict[int, dict[str, int]] = {}
            for listed, s in enumerate(stops):
                by_length.setdefault(len(s), {}).setdefault(s, listed)
            self._by_length = sorted(by_length.items())

    def first(self, text: str, before: int) -> tuple[int, str] | None:
        """The stop string that ends past ``text[:before]`` (in the new text) and starts first, and where it starts;
        None if none does. One that ends before it does not count: its text was there already (or came before the
        request's ``min_tokens``, where stop strings count from the token after)."""
        best: tuple[int, int, str] | None = None  # (start, listed, string)
        if self._by_length is None:
            for listed, s in enumerate(self.stops):
                start = text.find(s, max(0, before - len(s) + 1))
                if start != -1 and (best is None or start < best[0]):
                    best = (start, listed, s)
        else:
            for end in range(before + 1, len(text) + 1):
                for length, strings in self._by_length:
                    start = end - length
                    if start < 0:
                        break
                    if best is not None and start > best[0]:
                        continue  # (a longer one may still start sooner)
                    piece = text[start:end]
                    listed = strings.get(piece, -1)
                    if listed != -1 and (best is None or (start, listed) < best[:2]):
                        best = (start, listed, piece)
        return None if best is None else (best[0], best[2])


_index: IdentityCache[tuple[str, ...], StopStrings] = IdentityCache(_KEPT)


def stop_strings(stops: tuple[str, ...]) -> StopStrings:
    """The index of ``stops``, made once for the params that share the tuple (a request's samples)."""
    if len(stops) <= FEW_STOPS:
        return StopStrings(stops)
    return _index.get(stops, StopStrings)

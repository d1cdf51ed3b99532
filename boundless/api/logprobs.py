"""Where an output's tokens fall in its text, for the logprobs the APIs return with it.

A token's place is where its text starts: the length of the text the tokens before it decode to, as the engine's
detokenizer makes that text (whole characters only: a token that ends inside a character adds nothing until the one
that completes it). The completions API gives it as ``text_offset``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from boundless.engine.detokenizer import Decoder, IncrementalDetokenizer
from boundless.engine.logprobs import SampledToken
from boundless.engine.sampling_params import SamplingParams


class TokenStarts:
    """Where each token of an output starts in its text, found as the engine's detokenizer finds the text: after the
    prompt's last tokens (a token may decode differently after others), with the request's ``skip_special_tokens``.
    Fed the output's tokens as they come (:meth:`add`), so a stream and a whole response get the same starts."""

    def __init__(self, tokenizer: Decoder, prompt: Sequence[int], skip_special_tokens: bool = True) -> None:
        # (No stop strings: a text cut at one is the caller's to clamp to, as it alone knows where it ended.)
        self._text = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(skip_special_tokens=skip_special_tokens))

    def add(self, token_ids: Iterable[int]) -> list[int]:
        """The starts of ``token_ids``, the output's next tokens."""
        starts = []
        for token_id in token_ids:
            starts.append(len(self._text.text))
            self._text.add(token_id)
        return starts


def text_offsets(starts: Iterable[int], base: int, length: int) -> list[int]:
    """The completions API's ``text_offset`` of tokens starting at ``starts`` in a text of ``length`` characters that
    the choice's text holds from ``base`` on (after the echoed prompt). A start past the text's end (tokens of a stop
    string the text was cut at) is its end: an offset never passes the text it points into."""
    return [base + min(start, length) for start in starts]


class StreamedOffsets:
    """A streamed completion's tokens with their ``text_offset`` (:func:`text_offsets`), each once the text before it
    has gone out: the engine holds back a tail that may begin a stop string, and its tokens wait with it (a stop
    string the text is then cut at puts them at its end), so that the chunks' offsets are the whole response's."""

    def __init__(self, starts: TokenStarts, base: int) -> None:
        self._starts = starts
        self._base = base  # where the generated text begins in the choice's (after the echoed prompt)
        self._waiting: list[tuple[SampledToken, int]] = []

    def take(self, tokens: Sequence[SampledToken], length: int, finished: bool) -> tuple[list[SampledToken], list[int]]:
        """The tokens to send now, and their offsets: the output's next ``tokens`` added, its text so far ``length``
        characters (the whole text once ``finished``)."""
        self._waiting += zip(tokens, self._starts.add(t.token_id for t in tokens), strict=True)
        ready = len(self._waiting)
        if not finished:  # (starts never decrease: those ready come first)
            ready = sum(1 for _, start in self._waiting if start <= length)
        taken, self._waiting = self._waiting[:ready], self._waiting[ready:]
        return [t for t, _ in taken], text_offsets((start for _, start in taken), self._base, length)

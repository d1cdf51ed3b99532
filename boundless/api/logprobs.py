"""Where an output's tokens fall in its text, for the logprobs the APIs return with it.

A token's place is where its text starts: the length of the text the tokens before it decode to, as the engine's
detokenizer makes that text (whole characters only: a token that ends inside a character adds nothing until the one
that completes it). The completions API gives it as ``text_offset``; the chat and Responses APIs list the tokens of
the message's content alone (OpenAI's ``logprobs.content``: "message content tokens"), those whose text starts in the
content's part of the output (:func:`content_tokens`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from boundless.engine.detokenizer import Decoder, IncrementalDetokenizer
from boundless.engine.logprobs import SampledToken
from boundless.engine.sampling_params import SamplingParams

# A part of a text: its characters [start, end).
Span = tuple[int, int]
# A stretch of an answer copied from its output's text: where it begins in the answer, where in the text, its length
# (a harmony answer gathers its messages' bodies from all over the output: ``api/harmony.py``).
Stretch = tuple[int, int, int]


def stretch_spans(spans: Sequence[Span], stretches: Sequence[Stretch]) -> list[Span]:
    """Spans of an answer made of ``stretches`` of a text -> where they lie in the text: each span's part in each
    stretch (what the answer holds between them, a separator, lies nowhere)."""
    out = []
    for a, b in spans:
        for at, text_at, length in stretches:
            lo, hi = max(a, at), min(b, at + length)
            if lo < hi:
                out.append((text_at + lo - at, text_at + hi - at))
    return out


def stretch_position(k: int, stretches: Sequence[Stretch]) -> int:
    """Where the first ``k`` characters of an answer made of ``stretches`` end in the text: in the last stretch that
    begins at or before them (past what lies between two stretches, which is not the answer's), 0 before any."""
    at_text = 0
    for at, text_at, length in stretches:
        if at <= k:
            at_text = text_at + min(k - at, length)
    return at_text


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


def content_tokens(
    tokens: Sequence[SampledToken], starts: Sequence[int], spans: Sequence[Span], length: int
) -> list[SampledToken]:
    """The ``tokens`` of an output (``length`` characters) that belong to its content, whose parts are ``spans``: those
    whose text starts in a part. A token that straddles a part's end (one holding both the blank before a tool call
    and the call's tag) belongs where it starts; one with no text of its own at the output's end (the end-of-sequence
    token) belongs with the text it follows, when a part ends the output."""
    return [t for t, start in zip(tokens, starts, strict=True) if _starts_in(min(start, length), spans, length)]


def _starts_in(start: int, spans: Sequence[Span], length: int) -> bool:
    return any(a <= start < b or start == b == length for a, b in spans)


class StreamedContent:
    """A streamed message's content logprobs: a token's go out once its text is known to be content, those of the
    reasoning before it and of tool calls never, so that the chunks together list what the unstreamed message does
    (:meth:`finish`). ``starts`` None: every token is content (no reasoning or calls to tell apart), and goes out at
    once."""

    def __init__(self, starts: TokenStarts | None) -> None:
        self._starts = starts
        self._tokens: list[SampledToken] = []
        self._at: list[int] = []  # each token's start
        self._decided = 0  # tokens known to be content or not
        self._sent = 0  # content tokens sent

    def add(self, tokens: Sequence[SampledToken]) -> None:
        """The output's next tokens."""
        self._tokens += tokens
        if self._starts is not None:
            self._at += self._starts.add(t.token_id for t in tokens)

    def release(
        self, text: str, answer: str | None, sent: int | None, stretches: Sequence[Stretch] | None = None
    ) -> list[SampledToken]:
        """The tokens now known to be content, the output so far being ``text``, whose end after any reasoning is
        ``answer`` (None: the answer has not begun), of which ``sent`` characters went out as content (None: all of it
        goes out as it comes, the output being read for no calls). A token that starts before the answer is not
        content (the reasoning's); one that starts before the last sent character that is not blank is (blanks that
        end what was sent are dropped should a call follow them). ``stretches``: the answer is not the text's end but
        these stretches of it (harmony's); a token is then content when it starts in one, and known to be or not once
        it starts before where the answer's text (its part sent, read for calls) ends in the text."""
        if self._starts is None:
            out = self._tokens[self._decided :]
            self._decided = len(self._tokens)
        elif answer is None:
            return []
        elif stretches is not None:
            known = stretch_position(len(answer) if sent is None else len(answer[:sent].rstrip()), stretches)
            out = []
            while self._decided < len(self._tokens) and self._at[self._decided] < known:
                start = self._at[self._decided]
                if any(at <= start < at + length for _, at, length in stretches):
                    out.append(self._tokens[self._decided])
                self._decided += 1
        else:
            start = len(text) - len(answer)
            until = None if sent is None else start + len(answer[:sent].rstrip())
            out = []
            while self._decided < len(self._tokens) and (until is None or self._at[self._decided] < until):
                if self._at[self._decided] >= start:
                    out.append(self._tokens[self._decided])
                self._decided += 1
        self._sent += len(out)
        return out

    def finish(self, spans: Sequence[Span], length: int) -> list[SampledToken]:
        """The content tokens not sent yet, the output (``length`` characters) being whole and its content ``spans``
        known. (Those sent were content whatever came after them: the first of the whole message's.)"""
        if self._starts is None:
            out = self._tokens[self._sent :]
        else:
            out = content_tokens(self._tokens, self._at, spans, length)[self._sent :]
        self._sent += len(out)
        return out


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

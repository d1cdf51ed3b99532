"""vLLM's ``bad_words``: words a request's output may not hold.

A word is banned as token sequences (:func:`bad_words_token_ids`, vLLM's ``SamplingParams.update_from_tokenizer``):
the word as written (blanks before it dropped) and, where the tokenizer writes a word after a space with other tokens
(byte-level BPE's ``Ġword``), the word after a space, so that it is banned at the text's start and in its middle alike.
The sampler then bans each sequence's last token wherever the tokens before it end the output so far
(:func:`banned_tokens`, vLLM's ``apply_bad_words``): a one-token word never appears, a longer one is never completed.
Only the output counts, as in vLLM: a sequence whose first tokens end the prompt does not ban its last.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from boundless.engine.errors import InvalidRequestError

# Token sequences a request may ban at most (vLLM's VLLM_MAX_NUM_BAD_WORDS): each is matched at every step.
MAX_BAD_WORDS = 128


def bad_words_token_ids(words: Sequence[str], encode: Callable[[str], list[int]]) -> tuple[tuple[int, ...], ...]:
    """The token sequences that ban ``words``, ``encode`` being the tokenizer's (no special tokens): each word's, and
    its form after a space where that has as many tokens and another first one (vLLM's rule: where the space makes a
    longer sequence, the word's own tokens already ban it mid-text). An :class:`InvalidRequestError` for a word with
    no tokens."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(encode(word.lstrip()))
        if not bare:
            raise InvalidRequestError(f"bad_words: {word!r} has no tokens", "bad_words")
        spaced = tuple(encode(" " + word.lstrip()))
        sequences += [bare, spaced] if len(spaced) == len(bare) and spaced[0] != bare[0] else [bare]
    return tuple(sequences)


def longest_prefix(sequences: Sequence[tuple[int, ...]]) -> int:
    """How many of the output's last tokens :func:`banned_tokens` reads for these sequences."""
    return max((len(word) for word in sequences), default=1) - 1


def banned_tokens(sequences: Sequence[tuple[int, ...]], recent: Sequence[int]) -> list[int]:
    """The tokens ``sequences`` ban next, the output so far ending with ``recent`` (its last :func:`longest_prefix`
    tokens at least, or all of it): each sequence's last token where the tokens before it end the output."""
    banned = []
    for word in sequences:
        before = len(word) - 1
        if before == 0 or (before <= len(recent) and word[:-1] == tuple(recent[-before:])):
            banned.append(word[-1])
    return banned

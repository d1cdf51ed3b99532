"""Incremental detokenization and stop strings.

Byte-level BPE tokens need not end on a character boundary, and some tokenizers change how a
token decodes depending on what precedes it. So text is produced by decoding a short window of
recent tokens and taking what the newest token added, and only once it forms whole characters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from boundless.engine.sampling_params import RequestOutputKind, SamplingParams
from boundless.engine.stop_strings import stop_strings

# Prompt tokens kept as left context for the first output tokens.
_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    @property
    def byte_fallback(self) -> bool: ...  # (``Tokenizer.byte_fallback``)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def decode_batch(self, seqs: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]: ...


class IncrementalDetokenizer:
    """The output text of one request, grown token by token, cut at the first stop string (no text at all, and
    no decoding, for a request that asked for none: ``SamplingParams.detokenize``).

    A request that takes its text at the end (``RequestOutputKind.FINAL_ONLY``) hands out none before it, and
    without stop strings its tokens wait in ``pending`` and are decoded once, at the end (:func:`flush`), as one
    run: the text a token at a time gives (:func:`add_runs`), without a step's two decodes for each token (but for a
    tokenizer that falls back to bytes, whose runs go a token at a time)."""

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop
        self._stops = stop_strings(params.stop)
        self.include_stop = params.include_stop_str_in_output
        self.enabled = params.detokenize
        self.final_only = params.output_kind is RequestOutputKind.FINAL_ONLY
        # (None: each token is decoded as it comes.)
        self.pending: list[int] | None = [] if self.final_only and self.enabled and not self.stop else None
        # Stop strings count from the token after the first ``min_tokens`` (vLLM's rule): text that ends before it
        # stops nothing.
        self.min_tokens = params.min_tokens
        # The tokens that end the request where they are sampled (from min_tokens on): EOS, unless ignore_eos, and
        # stop_token_ids. Their text is left out of the output unless include_stop_str_in_output, as vLLM leaves it.
        ending = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self._stop_ids_left_out = frozenset(() if self.include_stop else ending)
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._num_context = len(self._ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        self.stopped_by: str | None = None
        self._emitted = 0
        self.text_pending = False

    def add(self, token_id: int) -> bool:
        """Add a token; True when its text completed a stop string (the text is then cut there)."""
        if self.pending is not None:
            self.pending.append(token_id)  # (counted when it is decoded)
            return False
        return add_tokens([self], [token_id])[0]

    def _left_out(self, token_id: int, num_tokens: int) -> bool:
        """Whether ``token_id``, the output's ``num_tokens``-th token, is a stop token whose text is left out."""
        return token_id in self._stop_ids_left_out and num_tokens >= self.min_tokens

    @property
    def num_tokens(self) -> int:
        """Tokens taken (decoded, or decoded a window at a time): those after the prompt's context."""
        return len(self._ids) - self._num_context

    def _windows(self, token_id: int) -> tuple[list[int], list[int]]:
        """Take the token; the two windows to decode: the text before it and the text with it."""
        self._ids.append(token_id)
        return self._ids[self._prefix_offset : self._read_offset], self._ids[self._prefix_offset :]

    def _resolve(self, prefix: str, full: str, left_off: int = 0) -> bool:
        """Take the decoded windows' new text, if it forms whole characters (``full``: the window up to its last
        ``left_off`` tokens); True when it completed a stop string. ``text_pending`` says whether it took none
        because the text ends inside a character."""
        self.text_pending = full.endswith("\ufffd")
        if len(full) <= len(prefix) or self.text_pending:
            return False  # no whole new character yet
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids) - left_off
        before = len(self.text)
        self.text += delta
        return self._check_stop(before)

    def _check_stop(self, before: int) -> bool:
        if not self.stop or self.num_tokens <= self.min_tokens:
            return False
        best = self._stops.first(self.text, before)  # (only one that ends inside the new text can be new)
        if best is None:
            return False
        idx, s = best
        self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
        self.stopped_by = s
        return True

    def skip_emitted(self, num_chars: int) -> None:
        """Mark the first ``num_chars`` of the text as already handed out (a resumed request)."""
        self._emitted = min(num_chars, len(self.text))

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out. Until the end, holds back a tail that could start a stop string (and all of it,
        for a request that takes its text at the end)."""
        if self.final_only and not finished:
            return ""
        if self.pending:
            flush([self])
        end = len(self.text)
        if not finished and self._stops.longest > 1:
            end = max(self._emitted, end - (self._stops.longest - 1))
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta


def add_tokens(detokenizers: Sequence[IncrementalDetokenizer], token_ids: Sequence[int]) -> list[bool]:
    """Add a token to each detokenizer (one token each, different requests); whether each completed a stop string.
    The windows of all of them are decoded in one call of each tokenizer and flag (a step's requests share one): two
    decodes per token from Python were a tenth of a 256-request decode step's Python."""
    stops = [False] * len(detokenizers)
    taking = [
        detok.enabled and not detok._left_out(token_id, detok.num_tokens + 1)
        for detok, token_id in zip(detokenizers, token_ids, strict=True)
    ]
    for tokenizer, skip, members in _by_tokenizer(detokenizers, taking):
        seqs: list[list[int]] = []
        for i in members:
            seqs += detokenizers[i]._windows(token_ids[i])
        texts = tokenizer.decode_batch(seqs, skip)
        for k, i in enumerate(members):
            stops[i] = detokenizers[i]._resolve(texts[2 * k], texts[2 * k + 1])
    return stops


def add_runs(detokenizers: Sequence[IncrementalDetokenizer], runs: Sequence[Sequence[int]]) -> None:
    """Add a run of tokens to each detokenizer (a multi-step window's kept tokens, a final-only request's whole output;
    requests without stop strings, whose text cannot cut their tokens short), each run's text from one decode of its
    window, all of them in one call, where a token at a time decoded two windows per token. What a token at a time
    gives: byte-level pieces join across a run as across steps, and a run whose text ends inside a character takes
    its longest head that does not (decoded again a token shorter at a time), leaving the rest for later tokens, as
    a token at a time leaves it.

    A tokenizer that falls back to bytes (``Decoder.byte_fallback``: SentencePiece's, Llama-2's, Mistral's, Gemma's)
    takes its runs a token at a time: its decoder turns a group of byte tokens with a bad byte into a replacement
    character a byte, the valid characters before it included, so its text depends on where each decoded window
    begins, which a token at a time moves token by token (byte-level BPE's replaces the bad bytes alone)."""
    if any(detok.stop for detok in detokenizers):
        raise ValueError("a run of tokens goes to a detokenizer without stop strings")
    # (A run's stop token can only be its last: the request ends there.)
    runs = [
        run[:-1] if run and detok._left_out(run[-1], detok.num_tokens + len(run)) else run
        for detok, run in zip(detokenizers, runs, strict=True)
    ]
    taking = [detok.enabled and bool(run) for detok, run in zip(detokenizers, runs, strict=True)]
    for tokenizer, skip, members in _by_tokenizer(detokenizers, taking):
        if tokenizer.byte_fallback:
            for j in range(max(len(runs[i]) for i in members)):
                live = [i for i in members if len(runs[i]) > j]
                add_tokens([detokenizers[i] for i in live], [runs[i][j] for i in live])
            continue
        seqs: list[list[int]] = []
        for i in members:
            detok = detokenizers[i]
            detok._ids += runs[i]
            seqs += [detok._ids[detok._prefix_offset : detok._read_offset], detok._ids[detok._prefix_offset :]]
        texts = tokenizer.decode_batch(seqs, skip)
        prefixes = {i: texts[2 * k] for k, i in enumerate(members)}
        cut = 0  # tokens left off the end of each run still to resolve
        unresolved = [i for k, i in enumerate(members) if not detokenizers[i]._resolve(prefixes[i], texts[2 * k + 1])]
        while True:
            unresolved = [i for i in unresolved if detokenizers[i].text_pending and len(runs[i]) > cut + 1]
            if not unresolved:
                break
            cut += 1
            heads = []
            for i in unresolved:
                detok = detokenizers[i]
                heads.append(detok._ids[detok._prefix_offset : len(detok._ids) - cut])
            texts = tokenizer.decode_batch(heads, skip)
            unresolved = [
                i
                for i, text in zip(unresolved, texts, strict=True)
                if not detokenizers[i]._resolve(prefixes[i], text, cut)
            ]


def flush(detokenizers: Sequence[IncrementalDetokenizer]) -> None:
    """Decode the tokens waiting in each detokenizer's ``pending`` (requests that take their text at the end), all
    in one call (:func:`add_runs`)."""
    runs = []
    for detok in detokenizers:
        assert detok.pending is not None, "only a final-only request's tokens wait"
        runs.append(detok.pending)
        detok.pending = []
    add_runs(detokenizers, runs)


def _by_tokenizer(
    detokenizers: Sequence[IncrementalDetokenizer], taking: Sequence[bool]
) -> list[tuple[Decoder, bool, list[int]]]:
    """The detokenizers ``taking`` a token, by the tokenizer and flag their windows decode with (one batched call
    each; a step's requests share one): the tokenizer, ``skip_special_tokens`` and their indices."""
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, detok in enumerate(detokenizers):
        if taking[i]:
            groups.setdefault((id(detok.tokenizer), detok.skip_special_tokens), []).append(i)
    return [(detokenizers[members[0]].tokenizer, skip, members) for (_, skip), members in groups.items()]

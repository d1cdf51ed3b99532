"""Suffix decoding (Arctic Inference's, vLLM's ``method: suffix``): drafts from the request's own tokens and from
other requests' outputs.

An agent's calls repeat each other: the same tool-call formats, the same files and records quoted again, the same
plan re-stated call after call. Prompt lookup (``NgramProposer``) sees only the request's own tokens; suffix decoding
also looks through the outputs of the last ``suffix_decoding_max_cached_requests`` requests, the running ones
included, so the second call of a kind is drafted from the first one's answer.

The proposal is Arctic's, computed over occurrences instead of a suffix tree. For each length ``m`` of the
sequence's end that occurred before (``MIN_MATCH`` to ``max_tree_depth - 1``), the occurrences of those ``m``
tokens are followed forward together: at each step the token that follows most of them is proposed, with
probability (the product so far) times its share of them, and the walk goes on over the occurrences it followed,
while that probability is at least ``min_token_prob``, for at most ``m * max_spec_factor`` tokens and to the tree's
depth (``m`` plus the draft at most ``max_tree_depth``). A draft's score is the sum of its tokens' probabilities;
the best of every ``m`` in the request's own tokens and of every ``m`` in the cached outputs is proposed (a longer
match wins a tie, the request's own tokens win a tie with the outputs). An occurrence with nothing after it (the
sequence's own end, an output still being written) counts among the occurrences but proposes nothing, as a suffix
tree's end points do. Where Arctic keeps a tree of every suffix, this keeps the token lists and an index of each
output's 3-token windows, and looks at the latest ``MAX_OCCURRENCES`` occurrences of the sequence's last 3 tokens.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import islice

from boundless.config import SpeculativeConfig
from boundless.engine.token_search import occurrences, packed_tokens

MIN_MATCH = 3  # the shortest end of a sequence looked up (and the index's window)
MAX_OCCURRENCES = 128  # the latest occurrences of its last MIN_MATCH tokens a proposal looks at, in each source


class SuffixProposer:
    """Suffix decoding's proposer (module docstring): the request's own tokens and a FIFO cache of the outputs of
    the last ``suffix_decoding_max_cached_requests`` requests, each recorded as it is written."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.max_drafts = config.max_drafts  # by a step's number of requests
        self.depth = config.suffix_decoding_max_tree_depth
        self.max_cached = config.suffix_decoding_max_cached_requests
        self.factor = config.suffix_decoding_max_spec_factor
        self.min_prob = config.suffix_decoding_min_token_prob
        self._packed: dict[str, bytearray] = {}  # each running request's own tokens, packed for the byte search
        self._outputs: dict[int, array[int]] = {}  # cached outputs by sequence number, oldest first (4 bytes a token)
        self._writing: dict[str, int] = {}  # a running request's sequence number (while its output is cached)
        # Each MIN_MATCH-token window of the cached outputs (packed: _window) -> where it ends (number << 32 |
        # position), oldest first. Packed ints and arrays: at the default 10,000 outputs the cache is ~3 M tokens.
        self._index: dict[int, array[int]] = {}
        self._indexed = 0  # positions in the index, evicted outputs' included
        self._live = 0  # tokens of the cached outputs
        self._next = 0

    @property
    def cached_outputs(self) -> int:
        return len(self._outputs)

    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int, limit: int) -> list[int]:
        """At most ``min(limit, num_speculative_tokens)`` tokens to follow ``token_ids`` (the request's tokens so far:
        they only grow; its output, from ``num_prompt_tokens`` on, is cached as it grows)."""
        if self.max_cached:
            self._record(request_id, token_ids, num_prompt_tokens)
        k = min(limit, self.num_speculative_tokens)
        pattern = list(token_ids[-self.depth :])
        if k <= 0 or len(pattern) <= MIN_MATCH:
            return []
        words = packed_tokens(self._packed, request_id, token_ids)
        latest = islice(occurrences(words, words[-4 * MIN_MATCH :], len(words)), MAX_OCCURRENCES)
        own = [(token_ids, at // 4 + MIN_MATCH - 1) for at in latest]
        score, draft = self._best(own, pattern, k)
        ends = self._index.get(_window(pattern, len(pattern) - 1), ())
        cached = []
        for packed in reversed(ends):
            output = self._outputs.get(packed >> 32)
            if output is not None:
                cached.append((output, packed & 0xFFFFFFFF))
                if len(cached) == MAX_OCCURRENCES:
                    break
        other_score, other = self._best(cached, pattern, k)
        return other if other_score > score else draft

    def finish(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """The request finished: its output stays cached (with the tokens of its last step, or all of them if it
        never speculated), its own packing goes."""
        if self.max_cached:
            self._record(request_id, token_ids, num_prompt_tokens)
            del self._writing[request_id]
        self._packed.pop(request_id, None)

    def _record(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """Cache the request's output tokens not cached yet (a new request takes a sequence number, evicting the
        oldest output past the cache's size)."""
        number = self._writing.get(request_id)
        if number is None:
            number = self._writing[request_id] = self._next
            self._next += 1
            self._outputs[number] = array("I")
            while len(self._outputs) > self.max_cached:
                self._evict(next(iter(self._outputs)))
        output = self._outputs.get(number)
        if output is None:  # evicted while running: the rest of it is not cached
            return
        start = len(output)
        output.extend(token_ids[num_prompt_tokens + start :])
        self._index_windows(number, output, start)
        self._live += len(output) - start

    def _index_windows(self, number: int, output: array[int], start: int) -> None:
        """Index the windows of ``output`` (cached output ``number``) that end at ``start`` or later."""
        index = self._index
        for end in range(max(start, MIN_MATCH - 1), len(output)):
            key = _window(output, end)
            ends = index.get(key)
            if ends is None:
                ends = index[key] = array("q")
            ends.append(number << 32 | end)
        self._indexed += len(output) - start

    def _evict(self, number: int) -> None:
        self._live -= len(self._outputs.pop(number))
        if self._indexed > 2 * self._live + 1024:
            # Mostly evicted outputs' positions: index the live ones afresh (in the order of the outputs, where it
            # was the order they were written in: ties between running outputs may go the other way after this).
            self._index.clear()
            self._indexed = 0
            for n, output in self._outputs.items():
                self._index_windows(n, output, 0)

    def _best(self, found: Sequence[tuple[Sequence[int], int]], pattern: list[int], k: int) -> tuple[float, list[int]]:
        """The best-scoring draft over the occurrences ``found`` (a token list and where in it the pattern's last
        ``MIN_MATCH`` tokens end, latest first), for every length of match they give (up to the pattern's length
        less one: the pattern is the sequence's last ``depth`` tokens at most, and longer than ``MIN_MATCH``)."""
        longest = len(pattern) - 1
        if not found:
            return 0.0, []
        matched = []  # each occurrence's match: how many of the pattern's last tokens it ends with
        for seq, end in found:
            m = MIN_MATCH
            while m < longest and end - m >= 0 and seq[end - m] == pattern[-1 - m]:
                m += 1
            matched.append(m)
        # The occurrences of a match of m tokens are those matching m or more: one group for each m up to the next
        # length some occurrence matches. A walk allowed more tokens extends one allowed fewer (its score is no
        # lower), so each group's best is its walk with the most tokens any of its m allow; a later group wins ties.
        best: tuple[float, list[int]] = (0.0, [])
        lengths = sorted(set(matched))
        low = MIN_MATCH
        for high in lengths:
            group = [at for at, n in zip(found, matched, strict=True) if n >= high]
            most = max(min(k, int(m * self.factor + 1e-6), self.depth - m) for m in range(low, high + 1))
            score, draft = follow(group, most, self.min_prob)
            if score >= best[0]:
                best = (score, draft)
            low = high + 1
        return best


def _window(tokens: Sequence[int], end: int) -> int:
    """The ``MIN_MATCH`` tokens ending at ``end`` packed into one int (token ids fit 32 bits: ``token_search``)."""
    return tokens[end - 2] | tokens[end - 1] << 32 | tokens[end] << 64


def follow(group: list[tuple[Sequence[int], int]], most: int, min_prob: float) -> tuple[float, list[int]]:
    """Arctic's path walk over a match's occurrences (``group``: a token list and the match's last position, latest
    first): the token that follows most of them (the latest one's on a tie) while the running probability, the
    product of each step's share, stays at least ``min_prob``; at most ``most`` tokens. -> (the sum of the tokens'
    probabilities, the tokens)."""
    draft: list[int] = []
    prob, score = 1.0, 0.0
    while len(draft) < most:
        if len(group) == 1:  # one occurrence left: the rest of it, at the same probability
            seq, end = group[0]
            for token in seq[end + 1 : end + 1 + most - len(draft)]:
                score += prob
                draft.append(token)
            break
        after: dict[int, list[tuple[Sequence[int], int]]] = {}  # each next token -> the occurrences it follows
        for seq, end in group:
            end += 1
            if end < len(seq):
                followed = after.get(seq[end])
                if followed is None:
                    after[seq[end]] = [(seq, end)]
                else:
                    followed.append((seq, end))
        if not after:
            break
        token, followed = max(after.items(), key=lambda item: len(item[1]))
        p = prob * len(followed) / len(group)
        if p < min_prob:
            break
        prob = p
        score += p
        draft.append(token)
        group = followed
    return score, draft

"""Speculative decoding with n-gram proposals (prompt lookup, vLLM's ``method: ngram``), and the verification every
proposer's drafts go through (suffix decoding's proposer: ``engine/suffix_decoding.py``; :func:`draft_proposer`
picks the configured one).

A decoding request whose recent tokens occurred earlier in its prompt or output is likely to go on as it went on
then: agents quote files, tool results and their own earlier turns. The scheduler asks :class:`NgramProposer` for
the tokens that followed the latest earlier occurrence of the request's last ``n`` tokens, and schedules them after
its last token as one chunk (``ScheduledChunk.draft_token_ids``); the forward pass computes logits at every
position of it at once. :func:`accepted_tokens` then keeps, of the tokens sampled at those positions, those up to
and including the first that differs from its draft.

Why this is exact: the sample at position ``j`` is drawn from the model's distribution given the drafts before it.
Draft ``j + 1`` is kept when that sample equals it (with probability ``p_j(draft)``, the rule of speculative
sampling for a proposer that puts all its mass on one token), and when it differs, the sample, drawn from ``p_j``
given that it is not the draft, is the correction (the residual distribution ``p_j`` without the draft,
renormalized). So greedy output is the same as without speculation, token for token, and sampled output has the
same distribution. The drafts' KV past the kept tokens is left in slots the next steps overwrite.
"""

from __future__ import annotations

from collections.abc import Sequence

from boundless.config import SpeculativeConfig
from boundless.engine.suffix_decoding import SuffixProposer
from boundless.engine.token_search import occurrences, packed_tokens


class NgramProposer:
    """Proposes up to ``num_speculative_tokens`` tokens: those that followed the latest earlier occurrence of the
    sequence's last ``n`` tokens, for the longest ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``
    that occurs. The search is a byte search over the tokens packed as 32-bit words (C speed, no Python loop per
    position); each request's packing is kept and extended by its new tokens (packing 8 K tokens afresh took 3/4
    of a proposal's time), until :meth:`finish`."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.max_drafts = config.max_drafts  # by a step's number of requests
        self._packed: dict[str, bytearray] = {}

    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int, limit: int) -> list[int]:
        """At most ``min(limit, num_speculative_tokens)`` tokens to follow ``token_ids`` (the request's tokens so far:
        they only grow); empty when no n-gram of the sequence's end occurred before."""
        k = min(limit, self.num_speculative_tokens)
        length = len(token_ids)
        if k <= 0 or length <= self.min_n:
            return []
        words = packed_tokens(self._packed, request_id, token_ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            at = next(occurrences(words, words[-4 * n :], 4 * (length - 1)), None)
            if at is not None:
                follow = at // 4 + n
                return list(token_ids[follow : follow + k])
        return []

    def finish(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """Drop a finished request's packing."""
        self._packed.pop(request_id, None)


def draft_proposer(config: SpeculativeConfig | None) -> NgramProposer | SuffixProposer | None:
    """The proposer of the configured method (None: no speculative decoding)."""
    if config is None:
        return None
    return SuffixProposer(config) if config.method == "suffix" else NgramProposer(config)


def accepted_tokens(samples: Sequence[int], drafts: Sequence[int]) -> int:
    """How many of ``samples`` (one per position of a speculating chunk: after its last known token, then after
    each draft) the request keeps: every sample up to and including the first that differs from the draft it
    follows (all of them, the last a bonus token, when every draft matched)."""
    for j, draft in enumerate(drafts):
        if samples[j] != draft:
            return j + 1
    return len(drafts) + 1

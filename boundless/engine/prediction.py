"""OpenAI's Predicted Outputs (``prediction``): drafts for speculative decoding read from a request's own prediction.

An agent that rewrites a file, or answers with most of a document it was given, knows most of the answer before it is
written. The request carries that text as ``SamplingParams.prediction`` (its tokens), and :class:`PredictionProposer`
drafts from it: the prediction's next tokens while the output is the prediction's beginning, then the tokens that
follow, in the prediction, the latest ``n`` tokens of the output (the longest ``n`` from :data:`MAX_MATCH` down to
:data:`MIN_MATCH` that occurs, at the place the last match left off or later when it occurs there, else its first
place), so that the drafts find their way back after an edit. The drafts are verified as every proposer's are
(``engine/speculative.py``): the output is the one the request would have had without a prediction, token for token
when greedy; a prediction only makes it come in fewer steps. The kept and rejected drafts are counted per request,
OpenAI's ``accepted_prediction_tokens`` and ``rejected_prediction_tokens``.

A step where the output's end is nowhere in the prediction (the model wrote what the prediction lacks: a preamble, a
line of its own, a passage of the prompt) gets its drafts by prompt lookup over the request's own prompt and output
instead: :class:`~boundless.engine.speculative.NgramProposer`'s matching (the same code, the latest earlier
occurrence of the sequence's last :data:`MAX_MATCH` down to :data:`MIN_MATCH` tokens), as many as the request's
length allows (below); so a wrong prediction still drafts where the answer repeats its context, as the server's n-gram
proposer would. Those drafts are verified as the prediction's, and how they fare sets the next length as theirs
does, but they are not prediction tokens: OpenAI's counts are of the prediction's tokens the completion holds or
lacks, and a lookup draft is a token of the request's own text, so neither ``accepted_prediction_tokens`` nor
``rejected_prediction_tokens`` counts it. (:attr:`PredictionProposer.from_prediction` says which the drafts just
proposed were; the scheduler names the step's requests whose drafts are their prediction's in
``SchedulerOutput.predicted``, and the engine counts only those.)
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from boundless.config import SpeculativeConfig
from boundless.engine.speculative import NgramProposer
from boundless.engine.token_search import first_occurrence

# Drafts a step from a prediction, at most and at first. A request's number follows how its last drafts fared: all
# kept, twice as many next time (a copied stretch: each pass keeps more); one rejected, one more than were kept (an
# edited stretch: a verified position costs about a prefill token, wasted when it is rejected).
MAX_DRAFTS, FIRST_DRAFTS = 16, 4
# The lengths of the output's end looked up in the prediction (a single token matches too often to realign on).
MAX_MATCH, MIN_MATCH = 8, 2


class PredictionProposer:
    """Drafts from the predictions of the requests that have one (:meth:`add` when they arrive, :meth:`finish` when
    they leave); the scheduler's ``DraftProposer`` for those requests."""

    def __init__(self, num_drafts: int = MAX_DRAFTS, first_drafts: int = FIRST_DRAFTS) -> None:
        self.num_drafts = num_drafts
        self.first_drafts = min(first_drafts, num_drafts)
        self._predictions: dict[str, tuple[Sequence[int], bytes]] = {}  # request -> (tokens, packed)
        self._resume: dict[str, int] = {}  # request -> where in its prediction the last drafts ended
        self._length: dict[str, int] = {}  # request -> how many drafts it gets next
        self._last: dict[str, tuple[int, list[int]]] = {}  # request -> (its length then, its last drafts)
        # Where the prediction has no drafts: prompt lookup over the request's own tokens (its matching, its packing).
        self._lookup = NgramProposer(SpeculativeConfig("ngram", num_drafts, MIN_MATCH, MAX_MATCH))
        # Whether the drafts :meth:`propose` returned last are the prediction's (False: prompt lookup's, or none).
        self.from_prediction = False

    @property
    def active(self) -> bool:
        """Whether any request here has a prediction."""
        return bool(self._predictions)

    def add(self, request_id: str, prediction: Sequence[int]) -> None:
        if prediction:
            self._predictions[request_id] = (prediction, array("I", prediction).tobytes())
            self._resume[request_id] = 0
            self._length[request_id] = self.first_drafts

    def has(self, request_id: str) -> bool:
        return request_id in self._predictions

    def max_drafts(self, batch_size: int) -> int:
        return self.num_drafts

    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int, limit: int) -> list[int]:
        """Up to ``limit`` tokens likely to follow ``token_ids`` (the request's prompt, then its output), as many as
        its last drafts earned (:data:`MAX_DRAFTS`): its prediction's, else, when the output's end is nowhere in the
        prediction, prompt lookup's over ``token_ids`` (:attr:`from_prediction` says which); empty when neither has
        any, or the request brought no prediction."""
        self.from_prediction = False
        found = self._predictions.get(request_id)
        if found is None:
            return []
        k = min(limit, self._next_length(request_id, token_ids))
        if k <= 0:
            return []
        drafts = self._predicted(request_id, found, token_ids, num_prompt_tokens, k)
        self.from_prediction = bool(drafts)
        if not drafts:
            drafts = self._lookup.propose(request_id, token_ids, num_prompt_tokens, k)
        if drafts:
            self._last[request_id] = (len(token_ids), drafts)
        return drafts

    def _predicted(
        self,
        request_id: str,
        found: tuple[Sequence[int], bytes],
        token_ids: Sequence[int],
        num_prompt_tokens: int,
        k: int,
    ) -> list[int]:
        """Up to ``k`` tokens of the prediction likely to follow ``token_ids``; empty when the output's end is nowhere
        in it."""
        prediction, words = found
        output = len(token_ids) - num_prompt_tokens
        if output <= MAX_MATCH and list(token_ids[num_prompt_tokens:]) == list(prediction[:output]):
            follow = output  # the answer so far is the prediction's beginning
        else:
            follow = -1
            resume = self._resume[request_id]
            for n in range(min(MAX_MATCH, output), MIN_MATCH - 1, -1):
                pattern = array("I", token_ids[len(token_ids) - n :]).tobytes()
                # Where the last drafts left off, less the n tokens that lead up to it, or later; else anywhere.
                at = first_occurrence(words, pattern, 4 * max(resume - n, 0))
                if at < 0:
                    at = first_occurrence(words, pattern)
                if at >= 0:
                    follow = at // 4 + n
                    break
            if follow < 0:
                return []
        drafts = list(prediction[follow : follow + k])
        self._resume[request_id] = follow + len(drafts)
        return drafts

    def _next_length(self, request_id: str, token_ids: Sequence[int]) -> int:
        """How many drafts the request gets now, from how many of its last ones its output kept."""
        last = self._last.pop(request_id, None)
        length = self._length[request_id]
        if last is not None:
            at, drafts = last
            written = token_ids[at : at + len(drafts)]
            kept = next((j for j, (w, d) in enumerate(zip(written, drafts, strict=False)) if w != d), len(written))
            length = min(2 * length, self.num_drafts) if kept == len(drafts) else kept + 1
            self._length[request_id] = length
        return length

    def finish(self, request_id: str, token_ids: Sequence[int] = (), num_prompt_tokens: int = 0) -> None:
        for kept in (self._predictions, self._resume, self._length, self._last):
            kept.pop(request_id, None)
        self._lookup.finish(request_id, token_ids, num_prompt_tokens)

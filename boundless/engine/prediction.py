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
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from boundless.engine.token_search import first_occurrence

# Drafts a step from a prediction: a verified position costs about a prefill token, and a copied answer keeps most.
PREDICTION_DRAFTS = 8
# The lengths of the output's end looked up in the prediction (a single token matches too often to realign on).
MAX_MATCH, MIN_MATCH = 8, 2


class PredictionProposer:
    """Drafts from the predictions of the requests that have one (:meth:`add` when they arrive, :meth:`finish` when
    they leave); the scheduler's ``DraftProposer`` for those requests."""

    def __init__(self, num_drafts: int = PREDICTION_DRAFTS) -> None:
        self.num_drafts = num_drafts
        self._predictions: dict[str, tuple[Sequence[int], bytes]] = {}  # request -> (tokens, packed)
        self._resume: dict[str, int] = {}  # request -> where in its prediction the last drafts ended

    @property
    def active(self) -> bool:
        """Whether any request here has a prediction."""
        return bool(self._predictions)

    def add(self, request_id: str, prediction: Sequence[int]) -> None:
        if prediction:
            self._predictions[request_id] = (prediction, array("I", prediction).tobytes())
            self._resume[request_id] = 0

    def has(self, request_id: str) -> bool:
        return request_id in self._predictions

    def max_drafts(self, batch_size: int) -> int:
        return self.num_drafts

    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int, limit: int) -> list[int]:
        """Up to ``min(limit, num_drafts)`` tokens of the request's prediction likely to follow ``token_ids`` (its
        prompt, then its output); empty when the output's end is nowhere in the prediction."""
        found = self._predictions.get(request_id)
        k = min(limit, self.num_drafts)
        if found is None or k <= 0:
            return []
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

    def finish(self, request_id: str, token_ids: Sequence[int] = (), num_prompt_tokens: int = 0) -> None:
        self._predictions.pop(request_id, None)
        self._resume.pop(request_id, None)

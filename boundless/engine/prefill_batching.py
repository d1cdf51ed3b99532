"""Prefill batches filled by predicted attention time (DualPath section 4.3.2).

With attention data-parallel (each GPU serves its own requests, then all meet for the FFN), a GPU
whose batch attends over more context makes the others wait. So a prefill engine fills its batch in
FIFO order while the batch's *predicted attention time* stays under a compute quota, rather than
while its *token count* stays under a budget: a request with a long cached context costs far more
attention per new token than a fresh one. The first request that would pass the quota is cut: a
binary search finds the longest chunk of it that fits (prediction grows with the chunk), it is
prefilled in part (chunked prefill), and the requests behind it wait for the next step, as FIFO
requires.

Pure: a function of the waiting requests, a predictor (:class:`~boundless.engine.attention_time.
AttentionTimeModel` fitted from the engine's steps, or any function of the shapes) and the limits.

Plugged in with ``--prefill-batching attention``: ``EngineCore`` records every step's ``shapes_of(sched)``
and measured seconds in an ``AttentionTimeRecorder`` and refits every so many steps, handing the scheduler
the predictor and :func:`step_quota` (``Scheduler.prefill_time``); ``Scheduler.schedule`` then builds a
:class:`PrefillCandidate` per request in its order that still has prompt to compute, calls
:func:`fill_prefill_batch` with the engine's step budget before its admission loop, and takes each chunk's
``num_tokens`` as the most that request may be given (prefilling requests left out get nothing this step;
decodes run as before). Until the first fit, the token budget alone decides. Decode engines need none of
this: they put every request in one batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from boundless.engine.attention_time import AttentionTimeModel, ChunkShape

Predictor = Callable[[Sequence[ChunkShape]], float]


@dataclass(frozen=True)
class PrefillCandidate:
    """A request waiting for prefill: ``cached`` tokens already have KV, ``new`` tokens are to compute."""

    request_id: str
    cached: int
    new: int


@dataclass(frozen=True)
class PrefillChunk:
    """Tokens of one request in the batch: ``num_tokens`` of its ``new`` (all of them unless cut)."""

    request_id: str
    cached: int
    num_tokens: int

    @property
    def shape(self) -> ChunkShape:
        return ChunkShape(self.cached, self.num_tokens)


@dataclass(frozen=True)
class PrefillBatch:
    chunks: tuple[PrefillChunk, ...]
    predicted_s: float

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


def fill_prefill_batch(
    waiting: Sequence[PrefillCandidate],
    predict: Predictor,
    quota_s: float,
    token_budget: int,
    max_seqs: int | None = None,
    align: int = 1,
) -> PrefillBatch:
    """Fill a batch in FIFO order while the predicted time stays within ``quota_s`` and the tokens within
    ``token_budget``; the first request that does not fit whole is cut to the longest chunk that does
    (ending on a multiple of ``align``, the block size, where that leaves any tokens: the next chunk then
    starts on a block boundary and the cut's full blocks can be named and shared), and ends the batch.

    The head request always gets at least one chunk, even over the quota, so a request too long for
    any quota still progresses (a token, or ``align`` tokens, per step).
    """
    chunks: list[PrefillChunk] = []
    tokens = 0
    for cand in waiting:
        if tokens >= token_budget or (max_seqs is not None and len(chunks) >= max_seqs):
            break
        if cand.new <= 0:
            continue
        room = min(cand.new, token_budget - tokens)
        shapes = [c.shape for c in chunks]
        n = _longest_chunk(shapes, cand.cached, room, predict, quota_s)
        if n < cand.new and n - (cand.cached + n) % align > 0:
            n -= (cand.cached + n) % align  # a cut ends on a block boundary
        if n == 0 and not chunks:
            n = min(room, align)  # progress for the head, whatever the quota
        if n > 0:
            chunks.append(PrefillChunk(cand.request_id, cand.cached, n))
            tokens += n
        if n < cand.new:
            break  # cut (by quota or budget): FIFO, nothing behind it this step
    return PrefillBatch(tuple(chunks), predict([c.shape for c in chunks]))


def _longest_chunk(shapes: list[ChunkShape], cached: int, room: int, predict: Predictor, quota_s: float) -> int:
    """The largest n in 0..room with predict(shapes + [(cached, n)]) <= quota_s (predictions grow with n)."""
    if predict([*shapes, ChunkShape(cached, room)]) <= quota_s:
        return room
    lo, hi = 0, room  # predict fits at lo (or lo == 0), not at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if predict([*shapes, ChunkShape(cached, mid)]) <= quota_s:
            lo = mid
        else:
            hi = mid
    return lo


def step_quota(model: AttentionTimeModel, max_num_batched_tokens: int) -> float:
    """A quota from the fitted model: the predicted time of a full step of fresh tokens (no cached context).
    A batch predicted to take longer attends over so much context that it would hold its peers up."""
    return model.predict([ChunkShape(0, max_num_batched_tokens)])

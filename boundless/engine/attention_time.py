"""A step's attention time, predicted from its shape and fitted from the engine's own measurements
(DualPath section 4.3.2: "the relation between the theoretical work and the measured time depends on
the hardware and the parallel setup, and is fitted by profiling").

A step's shape is, per request, the tokens that already have KV (``cached``) and the tokens computed
now (``new``). Causal attention over a chunk costs one query-key pair per new token per earlier
token: ``new * cached + new * (new + 1) / 2`` pairs. The model is linear in what a step does::

    seconds = base_s + per_seq_s * requests + per_token_s * sum(new) + per_pair_s * sum(pairs)

fitted by least squares with non-negative coefficients (so a longer chunk never predicts less time,
which the prefill batcher's binary search relies on). Samples are what the engine can record after
every step: the step's shapes (:func:`shapes_of` its ``SchedulerOutput``) and its measured seconds.
Fitted on whole-step times, the token term takes the rest of the network (MLPs, projections) and the
prediction is the step's time; fitted on an attention-only timer, it is the paper's attention time.
Either way the batcher compares like with like: predictions against a quota in the same seconds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from boundless.engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class ChunkShape:
    """One request's part of a step: ``new`` tokens computed over ``cached`` tokens that already have KV."""

    cached: int
    new: int

    @property
    def pairs(self) -> int:
        """Query-key pairs causal attention computes for the chunk."""
        return self.new * self.cached + self.new * (self.new + 1) // 2


@dataclass(frozen=True)
class AttentionSample:
    """A measured step: its shapes and its seconds."""

    shapes: tuple[ChunkShape, ...]
    seconds: float


def shapes_of(sched: SchedulerOutput) -> tuple[ChunkShape, ...]:
    """The shapes of a scheduled step: each chunk's start position is the tokens it attends to before it."""
    return tuple(ChunkShape(c.start_pos, len(c.token_ids)) for c in sched.chunks)


@dataclass(frozen=True)
class AttentionTimeModel:
    """``base_s + per_seq_s * requests + per_token_s * new tokens + per_pair_s * query-key pairs``, all
    coefficients >= 0 (the per-request term: a kernel launch or loop per sequence, its sampling)."""

    base_s: float = 0.0
    per_seq_s: float = 0.0
    per_token_s: float = 0.0
    per_pair_s: float = 0.0

    def predict(self, shapes: Sequence[ChunkShape]) -> float:
        if not shapes:
            return 0.0
        tokens = sum(s.new for s in shapes)
        pairs = sum(s.pairs for s in shapes)
        return self.base_s + self.per_seq_s * len(shapes) + self.per_token_s * tokens + self.per_pair_s * pairs


def _features(shapes: Sequence[ChunkShape]) -> list[float]:
    return [1.0, float(len(shapes)), float(sum(s.new for s in shapes)), float(sum(s.pairs for s in shapes))]


def fit_attention_time(samples: Iterable[AttentionSample]) -> AttentionTimeModel:
    """Least squares over the samples, coefficients held non-negative (a term fitted negative is
    dropped and the rest refitted: noise must not make a bigger step predict less time)."""
    rows = [(_features(s.shapes), s.seconds) for s in samples if s.shapes]
    if not rows:
        raise ValueError("no samples to fit")
    x = np.array([r[0] for r in rows], dtype=np.float64)
    y = np.array([r[1] for r in rows], dtype=np.float64)
    # Columns span ~1 to ~1e9 (pairs): scale them to 1 so the solver's cut-off treats them alike.
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    x = x / scale
    active = [i for i in range(x.shape[1]) if np.any(x[:, i])]
    coef = np.zeros(x.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (solution >= 0).all():
            coef[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    coef = coef / scale
    base, per_seq, per_token, per_pair = (float(c) for c in coef)
    return AttentionTimeModel(base_s=base, per_seq_s=per_seq, per_token_s=per_token, per_pair_s=per_pair)


class AttentionTimeRecorder:
    """The engine's latest ``capacity`` step measurements, and the model fitted from them.

    The engine records each prefill step (``record(shapes_of(sched), result.elapsed_s)``) and refits
    when it likes (every so many steps); old samples age out, so the fit follows the machine's state.
    """

    def __init__(self, capacity: int = 512) -> None:
        self.samples: deque[AttentionSample] = deque(maxlen=capacity)

    def record(self, shapes: Sequence[ChunkShape], seconds: float) -> None:
        if shapes:
            self.samples.append(AttentionSample(tuple(shapes), seconds))

    def fit(self) -> AttentionTimeModel | None:
        """The fitted model; None until samples of four different sizes can pin down its four terms."""
        if len({_totals(s.shapes) for s in self.samples}) < 4:
            return None
        return fit_attention_time(self.samples)


def _totals(shapes: Sequence[ChunkShape]) -> tuple[int, int, int]:
    return len(shapes), sum(s.new for s in shapes), sum(s.pairs for s in shapes)

"""A step's attention time, predicted from its shape and fitted from the engine's own measurements
(DualPath section 4.3.2: "the relation between the theoretical work and the measured time depends on
the hardware and the parallel setup, and is fitted by profiling").

A step's shape is, per request, the tokens that already have KV (``cached``) and the tokens computed
now (``new``). Causal attention over a chunk costs one query-key pair per new token per earlier
token: ``new * cached + new * (new + 1) / 2`` pairs (compute), and reads each request's cached KV
once per layer (memory traffic, which dominates when a short append attends to a long context: the
agentic case). The model is linear in what a step does::

    seconds = base_s + per_seq_s * requests + per_token_s * sum(new)
              + per_cached_s * sum(cached) + per_pair_s * sum(pairs)

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
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:  # the scheduler imports the prefill batcher, which imports this module
    from boundless.engine.scheduler import SchedulerOutput

# Rounds of dropping steps far slower than the fit (see fit_attention_time's outlier_factor).
MAX_TRIM_ROUNDS = 5


class ChunkShape(NamedTuple):
    """One request's part of a step: ``new`` tokens computed over ``cached`` tokens that already have KV.

    A named tuple rather than a dataclass: the engine makes one per chunk per forward pass (a multi-step window's
    too), and the simulator's speed is bounded by that per-pass Python (docs/simulation.md, Speed)."""

    cached: int
    new: int

    @property
    def pairs(self) -> int:
        """Query-key pairs causal attention computes for the chunk."""
        return self.new * self.cached + self.new * (self.new + 1) // 2


@dataclass(frozen=True)
class AttentionSample:
    """A measured step: its shapes, its seconds, and when it ended on the recording engine's clock (0: not known;
    the simulator's contention fit tells steps of several engines that overlapped by it); and the requests that
    entered the engine since the step before it and those that left (``SchedulerOutput.arrivals``,
    ``finished_ids``): a served engine's server parses the ones and answers the others beside this step, on the
    same cores. ``remote``: of the tokens the step attended to (its shapes' ``cached``), how many lay on other
    instances (KV lending's lent blocks, attended over by round trips to their creditors): such a step's seconds
    include the round trips' waits, which no model of its shapes alone describes."""

    shapes: tuple[ChunkShape, ...]
    seconds: float
    ended_at: float = 0.0
    arrivals: int = 0
    departures: int = 0
    remote: int = 0


def shapes_of(sched: SchedulerOutput) -> tuple[ChunkShape, ...]:
    """The shapes of a scheduled step: each chunk's start position is the tokens it attends to before it."""
    return tuple(ChunkShape(c.start_pos, len(c.token_ids)) for c in sched.chunks)


@dataclass(frozen=True)
class AttentionTimeModel:
    """``base_s + per_seq_s * requests + per_token_s * new tokens + per_cached_s * cached tokens read +
    per_pair_s * query-key pairs``, all coefficients >= 0 (the per-request term: a kernel launch or loop
    per sequence, its sampling)."""

    base_s: float = 0.0
    per_seq_s: float = 0.0
    per_token_s: float = 0.0
    per_cached_s: float = 0.0
    per_pair_s: float = 0.0

    def predict(self, shapes: Sequence[ChunkShape]) -> float:
        if not shapes:
            return 0.0
        _, seqs, tokens, cached, pairs = _features(shapes)
        return (
            self.base_s
            + self.per_seq_s * seqs
            + self.per_token_s * tokens
            + self.per_cached_s * cached
            + self.per_pair_s * pairs
        )


CACHED_COLUMN = 3  # the cached tokens' column of _features


def _features(shapes: Sequence[ChunkShape]) -> list[float]:
    return [
        1.0,
        float(len(shapes)),
        float(sum(s.new for s in shapes)),
        float(sum(s.cached for s in shapes)),
        float(sum(s.pairs for s in shapes)),
    ]


def fit_attention_time(
    samples: Iterable[AttentionSample],
    relative: bool = False,
    outlier_factor: float | None = None,
    cached_term: bool = True,
) -> AttentionTimeModel:
    """Least squares over the samples, coefficients held non-negative (a term fitted negative is
    dropped and the rest refitted: noise must not make a bigger step predict less time).

    ``relative`` minimizes relative errors instead of absolute ones, so the many short steps (decodes)
    weigh as much as the few long ones (big prefills). With ``outlier_factor``, the steps that took more
    than that many times the fitted time are dropped and the fit redone, until none is left (at most
    :data:`MAX_TRIM_ROUNDS` times): a step slowed by something else than its shape (another process on
    the cores, a collector pause) says nothing about its shape's cost, and such slowdowns only add time.

    ``cached_term=False`` holds ``per_cached_s`` at 0: in decode-only samples the cached tokens are the
    query-key pairs less one per request, so that term cannot be told apart from the other two.
    """
    kept = [s for s in samples if s.shapes and (s.seconds > 0 or not relative)]
    if not kept:
        raise ValueError("no samples to fit")
    model = _nnls(kept, relative, cached_term)
    for _ in range(MAX_TRIM_ROUNDS if outlier_factor is not None else 0):
        inliers = [s for s in kept if s.seconds <= outlier_factor * model.predict(s.shapes)]  # type: ignore[operator]
        if len(inliers) == len(kept) or len({tuple(_features(s.shapes)) for s in inliers}) < 4:
            break
        kept = inliers
        model = _nnls(kept, relative, cached_term)
    return model


def _nnls(samples: Sequence[AttentionSample], relative: bool, cached_term: bool = True) -> AttentionTimeModel:
    x = np.array([_features(s.shapes) for s in samples], dtype=np.float64)
    y = np.array([s.seconds for s in samples], dtype=np.float64)
    if relative:  # each row divided by its step's seconds: the residuals are relative errors
        x, y = x / y[:, None], np.ones_like(y)
    use = [cached_term or i != CACHED_COLUMN for i in range(x.shape[1])]
    base, per_seq, per_token, per_cached, per_pair = (float(c) for c in nonnegative_lstsq(x, y, use))
    return AttentionTimeModel(base, per_seq, per_token, per_cached, per_pair)


def nonnegative_lstsq(a: np.ndarray, b: np.ndarray, use: Sequence[bool]) -> np.ndarray:
    """Least squares of ``a @ coef = b`` with every coefficient >= 0, over the columns ``use`` allows (the others
    0): a term fitted negative is dropped and the rest refitted, so noise never makes a bigger step predict less
    time. Columns with nothing in them stay 0."""
    # Columns span ~1 to ~1e9 (pairs): scale them to 1 so the solver's cut-off treats them alike.
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    active = [i for i in range(a.shape[1]) if use[i] and np.any(a[:, i])]
    coef = np.zeros(a.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (solution >= 0).all():
            coef[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    return coef / scale


# A recorded step or multi-step window: each pass's shapes, each pass's seconds, when the last pass ended, arrivals,
# departures, how many of its passes have shapes (the samples it makes), and the remote tokens of its first pass.
_Pending = tuple[Sequence[Sequence[ChunkShape]], Sequence[float], float, int, int, int, int]

# The reader of the KV-lending heartbeats (the gManager's performance model), beside the default one (calibrate
# --served, bench programs): each drains what it has not seen yet, so neither takes the other's steps.
HEARTBEAT_READER = "heartbeat"


class AttentionTimeRecorder:
    """The engine's latest ``capacity`` step measurements, and the model fitted from them.

    The engine records each step (``record(shapes_of(sched), result.elapsed_s)``, or a multi-step window's passes
    with :meth:`record_window`) and refits when it likes (every so many steps); old samples age out, so the fit
    follows the machine's state. :meth:`drain` hands the samples recorded since the last drain to whoever collects
    them from several engines (the KV-lending gManager, through heartbeats).

    Samples are made when :attr:`samples` is read, not when a step is recorded: most engines never read them (only
    lending, attention-time prefill batching and calibration do), and only the latest ``capacity`` are kept, so a
    step that ages out before a read is never made (making a sample for every pass of every window was a large part
    of the simulator's per-pass cost, and of its garbage collector's). A read returns what making each sample at
    once would have kept.
    """

    def __init__(self, capacity: int = 512) -> None:
        self.capacity = capacity
        self._samples: deque[AttentionSample] = deque(maxlen=capacity)
        self._recorded = 0  # samples recorded since the start, made or not (those aged out too)
        self._read: dict[str, int] = {}  # each reader's ``_recorded`` at its last drain
        # Recorded, not yet made samples, oldest first (a step is a window of one pass), and their count.
        self._pending: deque[_Pending] = deque()
        self._pending_samples = 0

    def record(
        self,
        shapes: Sequence[ChunkShape],
        seconds: float,
        ended_at: float = 0.0,
        arrivals: int = 0,
        departures: int = 0,
        remote: int = 0,
    ) -> None:
        if shapes:
            self._add_pending(((tuple(shapes),), (seconds,), ended_at, arrivals, departures, 1, remote))

    def record_window(
        self,
        pass_shapes: Sequence[Sequence[ChunkShape]],
        pass_seconds: Sequence[float],
        ended_at: float,
        arrivals: int = 0,
        departures: int = 0,
        made: int | None = None,
        remote: int = 0,
    ) -> None:
        """A multi-step window's passes, each a step of its own shape to the step-time models, ended in turn (pass
        ``j`` at ``ended_at`` less the later passes' seconds); the window's arrivals and departures go with its first
        pass. Made into samples when read. ``made``: how many passes have shapes, when the caller knows (counting
        them would make a lazy window's shapes: ``multi_step.WindowPasses``, whose every pass has some). ``remote``:
        the first pass's tokens on other instances (``AttentionSample.remote``; KV lending runs windows of one)."""
        if made is None:
            made = sum(1 for shapes in pass_shapes if shapes)
        if made:
            self._add_pending((pass_shapes, pass_seconds, ended_at, arrivals, departures, made, remote))

    def _add_pending(self, entry: _Pending) -> None:
        self._pending.append(entry)
        self._pending_samples += entry[5]
        self._recorded += entry[5]
        # Steps whose samples the later ones would push out of the deque are never made.
        while self._pending_samples - self._pending[0][5] >= self.capacity:
            self._pending_samples -= self._pending.popleft()[5]

    @property
    def samples(self) -> deque[AttentionSample]:
        """The latest ``capacity`` samples, oldest first."""
        if self._pending:
            self._make_pending()
        return self._samples

    def _make_pending(self) -> None:
        for pass_shapes, passes, ended_at, arrivals, departures, _, remote in self._pending:
            for j, seconds in enumerate(passes):
                shapes = pass_shapes[j]
                if shapes:
                    events = (arrivals, departures, remote) if j == 0 else (0, 0, 0)
                    self._samples.append(
                        AttentionSample(tuple(shapes), seconds, ended_at - sum(passes[j + 1 :]), *events)
                    )
        self._pending.clear()
        self._pending_samples = 0

    def drain(self, reader: str = "") -> list[AttentionSample]:
        """The samples recorded since ``reader``'s last drain, oldest first (those that aged out meanwhile are
        lost); a reader's first drain takes every sample held."""
        samples = self.samples
        new = min(self._recorded - self._read.get(reader, 0), len(samples))
        self._read[reader] = self._recorded
        return list(samples)[len(samples) - new :] if new else []

    def fit(self) -> AttentionTimeModel | None:
        """The fitted model; None until samples of five different sizes can pin down its five terms."""
        if len({tuple(_features(s.shapes)) for s in self.samples}) < 5:
            return None
        return fit_attention_time(self.samples)

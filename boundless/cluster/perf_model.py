"""The performance model the KV-lending planner maximizes, fitted from the engine's own step times.

Infinite-LLM (§5.2) models a layer's time as the non-attention part, a function of the batch size, plus the
attention part, proportional to the context the batch attends over; an instance's throughput is its batch over
its step time, and the cluster's is the sum over instances. Here the step time is linear in its features::

    step_s = base_s + per_seq_s * batch + per_prefill_token_s * (tokens - batch) + per_attended_s * attended

with ``attended`` the key positions the step's tokens attend over (a decode step's total context; see
``engine/step_times.py``). A decode step of ``batch`` requests over ``context`` tokens then takes
``base_s + per_seq_s * batch + per_attended_s * context``.

The coefficients are fitted by least squares over an instance's recorded steps, relative to each step's time
(so the many short decode steps weigh as much as the few long prefills), and kept non-negative (a negative
cost would have the planner chase a batch or a context that costs nothing): with four coefficients the
non-negative least-squares solution is found exactly by trying each subset of them. Steps far slower than the
fit (slowed by something else) are dropped and the fit redone.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from boundless.engine.scheduler import SchedulerOutput
from boundless.engine.step_times import StepSample, step_sample

# Fewer samples than this fit nothing: the planner waits for the engines to have run.
MIN_SAMPLES = 8
# A step this many times slower than the fit predicts was slowed by something else; the fit is redone without it.
OUTLIER_FACTOR = 1.5
MAX_TRIM_ROUNDS = 5


class NotEnoughSamplesError(ValueError):
    """The samples cannot determine the model (too few, or without two batch sizes and two contexts)."""


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds per engine step as a linear function of its batch, prefill tokens and attention (see the module)."""

    base_s: float
    per_seq_s: float
    per_prefill_token_s: float
    per_attended_s: float

    def decode_step_s(self, batch_size: int, context_tokens: int) -> float:
        """Seconds of one decode step of ``batch_size`` requests attending over ``context_tokens`` in all."""
        return self.base_s + self.per_seq_s * batch_size + self.per_attended_s * context_tokens

    def throughput(self, batch_size: int, context_tokens: int) -> float:
        """Tokens per second of an instance decoding ``batch_size`` requests over ``context_tokens``."""
        if batch_size <= 0:
            return 0.0
        return batch_size / max(self.decode_step_s(batch_size, context_tokens), 1e-12)

    def sample_s(self, sample: StepSample) -> float:
        """The modelled seconds of a recorded step."""
        return float(np.dot(_features(sample), self.coefficients))

    def step_time(self, sched: SchedulerOutput) -> float:
        """The modelled seconds of a scheduled step (the simulator's ``StepCost`` interface)."""
        return self.sample_s(step_sample(sched, 0.0))

    @property
    def coefficients(self) -> tuple[float, float, float, float]:
        return (self.base_s, self.per_seq_s, self.per_prefill_token_s, self.per_attended_s)


def _features(sample: StepSample) -> tuple[float, float, float, float]:
    return (1.0, float(sample.batch_size), float(sample.prefill_tokens), float(sample.attended_tokens))


def fit_step_time_model(samples: Sequence[StepSample]) -> StepTimeModel:
    """The non-negative least-squares fit of :class:`StepTimeModel` to ``samples``, in relative error, without
    the steps that ran more than :data:`OUTLIER_FACTOR` times slower than the fit predicts.

    A step slowed by something else than its batch and context (another process on the cores, a collector
    pause) says nothing about their cost, and such slowdowns only ever add time: so the fit is repeated without
    the steps far above it until none is left (at most :data:`MAX_TRIM_ROUNDS` times). A slowdown shared by
    all steps stays in the fit.

    Raises :class:`NotEnoughSamplesError` when the samples cannot separate the per-request cost from the
    per-context cost: fewer than :data:`MIN_SAMPLES`, or a single batch size or a single context among them.
    """
    usable = [s for s in samples if s.seconds > 0 and s.batch_size > 0]
    _check_determined(usable)
    model = _nnls_relative(usable)
    for _ in range(MAX_TRIM_ROUNDS):
        kept = [s for s in usable if s.seconds <= OUTLIER_FACTOR * model.sample_s(s)]
        if len(kept) == len(usable):
            break
        try:
            _check_determined(kept)
        except NotEnoughSamplesError:
            break
        usable = kept
        model = _nnls_relative(usable)
    return model


def _check_determined(samples: Sequence[StepSample]) -> None:
    if len(samples) < MIN_SAMPLES:
        raise NotEnoughSamplesError(f"{len(samples)} usable step samples; the fit needs {MIN_SAMPLES}")
    if len({s.batch_size for s in samples}) < 2 or len({s.attended_tokens for s in samples}) < 2:
        raise NotEnoughSamplesError("the step samples need two batch sizes and two contexts at least")


def _nnls_relative(samples: Sequence[StepSample]) -> StepTimeModel:
    """Non-negative least squares in relative error, by trying every subset of the coefficients."""
    x = np.array([_features(s) for s in samples], dtype=np.float64)
    y = np.array([s.seconds for s in samples], dtype=np.float64)
    # Relative error: each row divided by its step's seconds.
    x, y = x / y[:, None], np.ones_like(y)
    # Columns scaled to unit norm, so the rank test below does not mistake a column of large counts for the rest.
    norms = np.linalg.norm(x, axis=0)
    present = [j for j in range(x.shape[1]) if norms[j] > 0]
    xs = x[:, present] / norms[present]
    best: tuple[float, dict[int, float]] | None = None
    for size in range(len(present), 0, -1):
        for subset in itertools.combinations(range(len(present)), size):
            cols = xs[:, subset]
            coef, _, rank, _ = np.linalg.lstsq(cols, y, rcond=None)
            if rank < size or (coef < 0).any():
                continue
            residual = float(np.sum((cols @ coef - y) ** 2))
            if best is None or residual < best[0] - 1e-12:
                best = (residual, {present[j]: float(c / norms[present[j]]) for j, c in zip(subset, coef, strict=True)})
    if best is None:  # no subset fits with non-negative costs: only possible for degenerate samples
        raise NotEnoughSamplesError("no non-negative fit to the step samples")
    c = [best[1].get(j, 0.0) for j in range(4)]
    return StepTimeModel(base_s=c[0], per_seq_s=c[1], per_prefill_token_s=c[2], per_attended_s=c[3])

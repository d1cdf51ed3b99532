"""A fitted profile's step model: a CPU engine step's seconds from its chunk shapes, and its fit.

The terms follow what this engine's CPU kernels do with a step (``model/cpu_kernels.cpp``,
``attention/cpu_attention.cpp``)::

    seconds = base_s                                  per step: the layer loop, sampling's fixed part
            + per_seq_s       * requests              per request in the step (its sampling, its metadata)
            + per_prefill_s   * prefill chunks        per request prefilling (its first step, when served:
                                                      the server admitting it on the same cores)
            + per_row_s       * matmul rows           the packed matmuls' rows on the slowest thread
            + per_row_group_s * matmul row groups     the matmul micro-kernel's passes: 4 rows at a time
            + per_cached_s    * cached tokens read    attention reading each request's KV
            + per_pair_s      * query-key pairs       attention's compute
            + per_contention_s * contention           the other engines of a cluster stepping beside it
            + per_departure_s * requests departed     served: the server answering them beside the step

*Matmul rows* (:func:`matmul_rows`) are the step's new tokens on one thread. On more, the packed
matmuls split their work, (block of 192 rows, panel of weights) pairs with the block outermost, between
the threads in equal contiguous shares (OpenMP's static schedule): a step of 256 tokens is a block of 192
and one of 64, one thread takes the first and the other the second, and the step lasts as long as
192 x 2 = 384 balanced rows (measured on the served 2-thread engine: two 128-token prompts in one
step took 2.7x one of them, where one thread takes 2.0x). *Row groups* are those rows in the
micro-kernel's groups of four (``ceil(rows / 4)``): a decode of 5 or 6 requests passes over the
weights as often as one of 8 (measured: 6 decodes cost as much as 8 or more on every CPU profile).
With ``threads = 1`` and only the base, per-request, per-row, per-cached and per-pair terms this is the
engine's own ``AttentionTimeModel``, the form the profiles before it were fitted in (they load as such).

*Contention* (:func:`contention`, 0-1) is the share of a step the other engines of a cluster on this
machine stepped beside it: they share its memory bandwidth (a decode streams all the weights) and its cores.
The steps keep their end times, so a served cluster's calibration knows it for every step; the simulator
gives a step starting now the share of the other instances mid-step.

*Departures* are the requests that left the engine at the step before while others stayed
(``SchedulerOutput.departures``, recorded with every step: ``AttentionSample``; the step records its arrivals too).
A served engine shares its cores (and the GIL) with the HTTP server and the client, which parse a request while
the engine steps and answer it after it leaves: on the quiet machine (``docs/simulation.md``, Validation) a decode
step during which a call arrived took 1.3-1.5x its shape's time, the step after a call left 1.15-1.2x, where the
steps beside neither took 1.05-1.1x. An arrival is counted at the step that admits it, which is its prefill's:
``per_prefill_s`` is its term (a separate one would be the same column). The simulator's engine runs the same
scheduler, so it charges them from the same fields (:meth:`StepTimeModel.predict_sample`,
``FittedStepCost.step_time``); ``calibrate --served --workloads`` adds served programs' own steps, where calls
arrive and leave beside running ones, to the fit.

The fit (:func:`fit_step_model`) is non-negative least squares in relative error (the short decodes
weigh as much as the long prefills), on every measured step or on one time per shape (the fastest, for
the bare engine), and ``robust`` makes it least *absolute* relative error (iteratively reweighted): the
median's counterpart for a served engine, whose steps vary with the server's work beside them and whose
shapes often come once, so a per-shape median is a single sample.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

import numpy as np

from boundless.engine.attention_time import AttentionSample, ChunkShape, nonnegative_lstsq

# The packed matmuls' rows per block (M_BLOCK in model/cpu_kernels.cpp) and rows per micro-kernel call.
MATMUL_BLOCK_ROWS = 192
MICRO_KERNEL_ROWS = 4
# Rounds of reweighting for the least-absolute fit (each a weighted least squares; 20 settle to 0.1%).
ROBUST_ROUNDS = 20
# Rounds of dropping steps far slower than the fit.
MAX_TRIM_ROUNDS = 5


def matmul_rows(tokens: int, threads: int) -> float:
    """The rows of a step's packed matmuls on its slowest thread, times the threads: the step's tokens
    when the static schedule shares them out evenly, more when it does not (see the module docstring)."""
    if threads <= 1 or tokens <= MATMUL_BLOCK_ROWS:
        return float(tokens)  # one block: every thread takes its share of the panels, all rows each
    blocks = math.ceil(tokens / MATMUL_BLOCK_ROWS)
    rows = [min(MATMUL_BLOCK_ROWS, tokens - b * MATMUL_BLOCK_ROWS) for b in range(blocks)]
    slowest = 0.0
    for t in range(threads):  # thread t's contiguous share of the blocks (panels divide evenly: even counts)
        lo, hi = t * blocks / threads, (t + 1) * blocks / threads
        slowest = max(slowest, sum(r * max(0.0, min(hi, b + 1) - max(lo, b)) for b, r in enumerate(rows)))
    return threads * slowest


@dataclass(frozen=True)
class StepTimeModel:
    """A step's seconds on one engine (see the module docstring for each term); every coefficient >= 0, so
    a bigger step never predicts less time. ``threads`` is the engine's torch threads (a property of the
    profile, not fitted)."""

    base_s: float = 0.0
    per_seq_s: float = 0.0
    per_prefill_s: float = 0.0
    per_row_s: float = 0.0
    per_row_group_s: float = 0.0
    per_cached_s: float = 0.0
    per_pair_s: float = 0.0
    per_contention_s: float = 0.0
    per_departure_s: float = 0.0
    threads: int = 1

    def predict(self, shapes: Sequence[ChunkShape], contention: float = 0.0, departures: int = 0) -> float:
        """The step's seconds; ``contention`` (0-1: :func:`contention`) is how much the other engines step beside
        it, ``departures`` the requests that left the engine at the step before while others stayed."""
        if not shapes:
            return 0.0
        return float(np.dot(self.coefficients, features(shapes, self.threads, contention, departures)))

    def predict_sample(self, sample: AttentionSample, contention: float = 0.0) -> float:
        """A recorded step's seconds: its shapes and departures."""
        return self.predict(sample.shapes, contention, sample.departures)

    @property
    def coefficients(self) -> list[float]:
        """The per-term coefficients, in :data:`TERMS`' order."""
        return [getattr(self, t) for t in TERMS]

    def scaled(self, factor: float) -> StepTimeModel:
        """Every step ``factor`` times as long: the same machine running faster or slower as a whole."""
        return StepTimeModel.from_coefficients([c * factor for c in self.coefficients], self.threads)

    @classmethod
    def from_coefficients(cls, coefficients: Iterable[float], threads: int) -> StepTimeModel:
        return cls(**dict(zip(TERMS, (float(c) for c in coefficients), strict=True)), threads=threads)

    @classmethod
    def from_json(cls, coefficients: dict[str, float], threads: int = 1) -> StepTimeModel:
        """From a profile's ``coefficients``; those of the engine's linear model (``per_token_s``, fitted before
        the matmul terms) are its rows on one thread."""
        c = dict(coefficients)
        if "per_token_s" in c:
            linear = (c["base_s"], c["per_seq_s"], 0.0, c["per_token_s"], 0.0, c["per_cached_s"], c["per_pair_s"])
            return cls(*linear, threads=1)
        return cls(**c, threads=threads)


TERMS = tuple(f.name for f in fields(StepTimeModel) if f.name != "threads")


def features(shapes: Sequence[ChunkShape], threads: int, contention: float = 0.0, departures: int = 0) -> list[float]:
    """What each coefficient multiplies, in :data:`TERMS`' order."""
    rows = matmul_rows(sum(c.new for c in shapes), threads)
    return [
        1.0,
        float(len(shapes)),
        float(sum(1 for c in shapes if c.new > 1)),
        rows,
        float(math.ceil(rows / MICRO_KERNEL_ROWS)),
        float(sum(c.cached for c in shapes)),
        float(sum(c.pairs for c in shapes)),
        contention,
        float(departures),
    ]


def fit_step_model(
    samples: Sequence[AttentionSample],
    threads: int = 1,
    robust: bool = False,
    outlier_factor: float | None = None,
    terms: Sequence[str] = TERMS,
    others: int = 0,
) -> StepTimeModel:
    """The model over ``samples`` (only ``terms`` fitted, the rest held at 0), in relative error; ``robust``:
    least absolute relative error. With ``outlier_factor``, steps slower than that many times the fit are
    dropped and the fit redone (a step slowed by another process says nothing about its shape).

    With ``others`` (the engines beside the one measured, whose steps are among ``samples`` with their end
    times), each step's :func:`contention` is known and ``per_contention_s`` is fitted with the rest; without,
    it stays 0. Steps over lent blocks are left out (:func:`local_steps`)."""
    kept = local_steps([s for s in samples if s.shapes and s.seconds > 0], others)
    if not kept:
        raise ValueError("no samples to fit")
    x = np.array([features(s.shapes, threads, c, s.departures) for s, c in kept])
    y = np.array([s.seconds for s, _ in kept])
    use = [t in terms and (t != "per_contention_s" or any(c for _, c in kept)) for t in TERMS]
    return StepTimeModel.from_coefficients(_fit_trimmed(x, y, use, robust, outlier_factor), threads)


def _fit_trimmed(
    x: np.ndarray, y: np.ndarray, use: list[bool], robust: bool, outlier_factor: float | None
) -> np.ndarray:
    inliers = np.ones(len(y), dtype=bool)
    coef = _fit(x[inliers], y[inliers], use, robust)
    for _ in range(MAX_TRIM_ROUNDS if outlier_factor is not None else 0):
        now = y <= outlier_factor * (x @ coef)
        if (now == inliers).all() or len({tuple(r) for r in x[now]}) < len(TERMS):
            break
        inliers = now
        coef = _fit(x[inliers], y[inliers], use, robust)
    return coef


def _fit(x: np.ndarray, y: np.ndarray, use: list[bool], robust: bool) -> np.ndarray:
    weights = np.ones(len(y))
    coef = _nnls(x, y, use, weights)
    for _ in range(ROBUST_ROUNDS if robust else 0):
        # Least absolute error as weighted least squares: each step weighs 1 / sqrt(its relative error).
        errors = np.abs(x @ coef - y) / y
        weights = 1.0 / np.sqrt(np.maximum(errors, 1e-4))
        coef = _nnls(x, y, use, weights)
    return coef


def _nnls(x: np.ndarray, y: np.ndarray, use: list[bool], weights: np.ndarray) -> np.ndarray:
    """Least squares of the relative errors, weighted, coefficients >= 0: a term fitted negative is dropped and
    the rest refitted (noise must not make a bigger step predict less time)."""
    return nonnegative_lstsq(x / y[:, None] * weights[:, None], weights.copy(), use)


def samples_json(samples: Sequence[AttentionSample]) -> list:
    """The measured steps, to refit or inspect: [[cached, new] per request], seconds, when the step ended (seconds on
    the engines' shared monotonic clock) where known, then arrivals and departures where any, then the tokens it
    attended on other instances where any (KV lending)."""
    return [[[[c.cached, c.new] for c in s.shapes], s.seconds, *_step_tail(s)] for s in samples]


def _step_tail(s: AttentionSample) -> list[float]:
    if s.remote:
        return [s.ended_at, s.arrivals, s.departures, s.remote]
    if s.arrivals or s.departures:
        return [s.ended_at, s.arrivals, s.departures]
    return [s.ended_at] if s.ended_at else []


def samples_from_json(rows: Sequence) -> list[AttentionSample]:
    """The steps a profile's ``calibration`` (or a validate JSON's ``real_steps``) keeps, back as samples."""
    return [AttentionSample(tuple(ChunkShape(c, n) for c, n in row[0]), *row[1:]) for row in rows]


def local_steps(samples: Sequence[AttentionSample], others: int = 0) -> list[tuple[AttentionSample, float]]:
    """The steps that attended to local KV only, each with its :func:`contention` (taken over every step: one over
    lent blocks ran beside the others all the same). A step over lent blocks (``AttentionSample.remote``, KV
    lending) also waits for its creditors' partials, which its shapes do not describe; the simulator prices that
    apart (``sim/lending.py``), so a step model is fitted and checked on the local steps."""
    beside = contention(samples, others) if others else [0.0] * len(samples)
    return [(s, c) for s, c in zip(samples, beside, strict=True) if not s.remote]


def contention(samples: Sequence[AttentionSample], others: int) -> list[float]:
    """Each step's contention: the seconds other engines' steps ran beside it, over its own seconds times
    ``others`` (the other engines): 0 when it ran alone, 1 when every other engine stepped all through it.

    One engine's steps never overlap each other, so every step that overlaps another in time (by ``ended_at``,
    the engines' shared monotonic clock) is another engine's: the steps need not say which engine ran them."""
    if others <= 0 or not all(s.ended_at for s in samples):
        return [0.0] * len(samples)
    spans = sorted((s.ended_at - s.seconds, s.ended_at, i) for i, s in enumerate(samples))
    starts = [a for a, _, _ in spans]
    result = [0.0] * len(samples)
    longest = max((b - a for a, b, _ in spans), default=0.0)
    for a, b, i in spans:
        lo = bisect.bisect_left(starts, a - longest)  # no step starting earlier can reach this one
        hi = bisect.bisect_right(starts, b)
        beside = sum(max(0.0, min(b, b2) - max(a, a2)) for a2, b2, j in spans[lo:hi] if j != i)
        result[i] = min(1.0, beside / (max(b - a, 1e-12) * others))
    return result

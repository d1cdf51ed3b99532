"""The planner's step-time model is fitted from step samples: it recovers known coefficients, ignores steps
slowed by something else, refuses samples that cannot separate the per-context cost from the rest, and charges
a step's fixed cost per request when the samples show one batch size."""

from __future__ import annotations

import random

import pytest
from lending_cases import ATTENTION_BOUND, GPU_LIKE, samples_of

from boundless.cluster.perf_model import (
    NotEnoughSamplesError,
    decode_step_s,
    decode_throughput,
    fit_step_time_model,
)
from boundless.engine.attention_time import AttentionSample, AttentionTimeModel, ChunkShape

COEFFICIENTS = ("base_s", "per_seq_s", "per_token_s", "per_pair_s")


def coefficients(model: AttentionTimeModel) -> tuple[float, ...]:
    return tuple(getattr(model, name) for name in COEFFICIENTS)


@pytest.mark.parametrize("true", [GPU_LIKE, ATTENTION_BOUND])
def test_the_fit_recovers_known_coefficients(true: AttentionTimeModel) -> None:
    assert coefficients(fit_step_time_model(samples_of(true))) == pytest.approx(coefficients(true), rel=1e-6)


def test_the_fit_is_close_under_noise_and_predicts_decode_throughput() -> None:
    fitted = fit_step_time_model(samples_of(GPU_LIKE, noise=0.05, seed=3))
    assert fitted.base_s == pytest.approx(GPU_LIKE.base_s, rel=0.05)
    for batch, context in ((1, 4096), (8, 8 * 300), (32, 32 * 1000)):
        assert decode_throughput(fitted, batch, context) == pytest.approx(
            decode_throughput(GPU_LIKE, batch, context), rel=0.05
        )


def test_decode_steps_alone_determine_decode_times() -> None:
    # Without prefill chunks a step's tokens equal its requests: the two costs cannot be told apart, and
    # need not be: their sum is what a decode costs.
    decodes = [s for s in samples_of(GPU_LIKE) if all(c.new == 1 for c in s.shapes)]
    fitted = fit_step_time_model(decodes)
    assert min(coefficients(fitted)) >= 0
    for batch, context in ((1, 100), (16, 16 * 3000)):
        assert decode_step_s(fitted, batch, context) == pytest.approx(decode_step_s(GPU_LIKE, batch, context))


def test_steps_slowed_by_something_else_do_not_skew_the_fit() -> None:
    # A fifth of the steps ran 2-10 times slower (another process on the cores, a collector pause).
    rng = random.Random(7)
    samples = [
        AttentionSample(s.shapes, s.seconds * (rng.uniform(2, 10) if i % 5 == 0 else 1))
        for i, s in enumerate(samples_of(GPU_LIKE, noise=0.02, seed=5))
    ]
    fitted = fit_step_time_model(samples)
    for batch, context in ((1, 4096), (8, 8 * 300), (16, 16 * 2000)):
        assert decode_throughput(fitted, batch, context) == pytest.approx(
            decode_throughput(GPU_LIKE, batch, context), rel=0.03
        )


def decode_step(batch: int, context_each: int, seconds: float) -> AttentionSample:
    return AttentionSample((ChunkShape(context_each - 1, 1),) * batch, seconds)


@pytest.mark.parametrize(
    "samples",
    [
        [decode_step(2, 50, 0.01)] * 3,  # too few
        [decode_step(i, 1000 // i, 0.01 + 1e-3 * i) for i in (1, 2, 4, 5, 8, 10) * 3],  # one context in all
    ],
)
def test_samples_that_cannot_determine_the_model_fit_nothing(samples: list[AttentionSample]) -> None:
    with pytest.raises(NotEnoughSamplesError):
        fit_step_time_model(samples)


@pytest.mark.parametrize("batch", [1, 4])
def test_steps_of_one_batch_size_charge_the_fixed_cost_per_request(batch: int) -> None:
    """At light load every step is a batch of one: a step's fixed cost cannot be told from a request's. The fit
    charges it per request (batching gains nothing), predicts the steps it saw, and still plans: before, it refused
    them, and a request longer than its pool waited for a move no plan ordered (docs/lending.md)."""
    samples = []
    for context in (64, 256, 512, 1024, 2048, 4096):
        for new in (1, 1, 64):
            shapes = (ChunkShape(context - new, new),) * batch
            samples.append(AttentionSample(shapes, GPU_LIKE.predict(shapes)))
    fitted = fit_step_time_model(samples)
    assert fitted.base_s == 0.0
    for sample in samples:
        assert fitted.predict(sample.shapes) == pytest.approx(sample.seconds, rel=1e-6)
    # Twice the batch over twice the context: twice the time, no gain in throughput.
    assert decode_throughput(fitted, 2 * batch, 2 * batch * 1000) == pytest.approx(
        decode_throughput(fitted, batch, batch * 1000)
    )
    assert decode_throughput(fitted, batch, batch * 1000) == pytest.approx(
        decode_throughput(GPU_LIKE, batch, batch * 1000)
    )


def test_throughput_is_batch_over_decode_step_time() -> None:
    assert decode_step_s(GPU_LIKE, 4, 1000) == pytest.approx(0.03 + 4 * 0.0005 + 1000 * 1e-6)
    assert decode_step_s(GPU_LIKE, 4, 1000) == pytest.approx(GPU_LIKE.predict([ChunkShape(249, 1)] * 4))
    assert decode_throughput(GPU_LIKE, 4, 1000) == pytest.approx(4 / decode_step_s(GPU_LIKE, 4, 1000))
    assert decode_throughput(GPU_LIKE, 0, 0) == 0.0


def test_long_noisy_prefills_do_not_swamp_the_short_decodes() -> None:
    # Many decode steps (tens of ms) and a few long prefill steps (seconds) whose times vary by ±10%: in
    # absolute error the prefills' noise alone outweighs every decode; in relative error it does not.
    rng = random.Random(11)
    decodes = [s for s in samples_of(GPU_LIKE) if all(c.new == 1 for c in s.shapes)]
    prefills = []
    for _ in range(12):
        shapes = (ChunkShape(rng.randrange(0, 4000), rng.randrange(2000, 8000)),)
        prefills.append(AttentionSample(shapes, GPU_LIKE.predict(shapes) * rng.uniform(0.9, 1.1)))
    fitted = fit_step_time_model(decodes + prefills)
    for batch, context in ((1, 200), (4, 4 * 500), (16, 16 * 2000)):
        assert decode_step_s(fitted, batch, context) == pytest.approx(decode_step_s(GPU_LIKE, batch, context), rel=0.02)

"""The step-time model is fitted from step samples: it recovers known coefficients, keeps them non-negative, and
refuses samples that cannot separate the per-request cost from the per-context cost."""

from __future__ import annotations

import random

import pytest
from lending_cases import ATTENTION_BOUND, GPU_LIKE, samples_of

from boundless.cluster.perf_model import NotEnoughSamplesError, StepTimeModel, fit_step_time_model
from boundless.engine.step_times import StepSample


@pytest.mark.parametrize("true", [GPU_LIKE, ATTENTION_BOUND])
def test_the_fit_recovers_known_coefficients(true: StepTimeModel) -> None:
    fitted = fit_step_time_model(samples_of(true))
    assert fitted.coefficients == pytest.approx(true.coefficients, rel=1e-6)
    assert all(isinstance(c, float) for c in fitted.coefficients)


def test_the_fit_is_close_under_noise_and_predicts_decode_throughput() -> None:
    fitted = fit_step_time_model(samples_of(GPU_LIKE, noise=0.05, seed=3))
    assert fitted.base_s == pytest.approx(GPU_LIKE.base_s, rel=0.05)
    for batch, context in ((1, 4096), (8, 8 * 300), (32, 32 * 1000)):
        assert fitted.throughput(batch, context) == pytest.approx(GPU_LIKE.throughput(batch, context), rel=0.05)


def test_a_cost_the_samples_do_not_show_is_zero_not_negative() -> None:
    # Only decode steps: no prefill tokens, so nothing says what one costs.
    decodes = [s for s in samples_of(GPU_LIKE) if s.prefill_tokens == 0]
    fitted = fit_step_time_model(decodes)
    assert fitted.per_prefill_token_s == 0.0
    assert (fitted.base_s, fitted.per_seq_s, fitted.per_attended_s) == pytest.approx(
        (GPU_LIKE.base_s, GPU_LIKE.per_seq_s, GPU_LIKE.per_attended_s), rel=1e-6
    )
    # Steps that got cheaper with context (measurement noise, say) fit no negative cost per token.
    falling = [StepSample(b, b, c, 0.05 + 0.001 * b - 1e-6 * c) for b in (1, 2, 4, 8) for c in (100, 1000, 5000)]
    assert min(fit_step_time_model(falling).coefficients) >= 0.0


@pytest.mark.parametrize(
    "samples",
    [
        [StepSample(2, 2, 100, 0.01)] * 3,  # too few
        [StepSample(4, 4, 100 * i, 0.01 + 1e-5 * i) for i in range(1, 20)],  # one batch size
        [StepSample(i, i, 500, 0.01 + 1e-3 * i) for i in range(1, 20)],  # one context
    ],
)
def test_samples_that_cannot_determine_the_model_fit_nothing(samples: list[StepSample]) -> None:
    with pytest.raises(NotEnoughSamplesError):
        fit_step_time_model(samples)


def test_throughput_is_batch_over_decode_step_time() -> None:
    assert GPU_LIKE.decode_step_s(4, 1000) == pytest.approx(0.03 + 4 * 0.0005 + 1000 * 1e-6)
    assert GPU_LIKE.throughput(4, 1000) == pytest.approx(4 / GPU_LIKE.decode_step_s(4, 1000))
    assert GPU_LIKE.throughput(0, 0) == 0.0


def test_steps_slowed_by_something_else_do_not_skew_the_fit() -> None:
    # A fifth of the steps ran 2-10 times slower (another process on the cores, a collector pause).
    rng = random.Random(7)
    samples = [
        StepSample(s.batch_size, s.num_tokens, s.attended_tokens, s.seconds * (rng.uniform(2, 10) if i % 5 == 0 else 1))
        for i, s in enumerate(samples_of(GPU_LIKE, noise=0.02, seed=5))
    ]
    fitted = fit_step_time_model(samples)
    for batch, context in ((1, 4096), (8, 8 * 300), (16, 16 * 2000)):
        assert fitted.throughput(batch, context) == pytest.approx(GPU_LIKE.throughput(batch, context), rel=0.03)

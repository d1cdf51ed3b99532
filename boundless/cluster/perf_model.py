"""The performance model the KV-lending planner maximizes, fitted from the engine's own step times.

Infinite-LLM (§5.2) models a layer's time as the non-attention part, a function of the batch size, plus the
attention part, proportional to the context the batch attends over; an instance's throughput is its batch over
its step time, and the cluster's is the sum over instances. The step-time model is the engine's
(``engine/attention_time.py``), linear in what a step does::

    step_s = base_s + per_seq_s * requests + per_token_s * tokens + per_pair_s * query-key pairs

so a decode step of ``batch`` requests attending over ``context`` tokens in all (one query-key pair per token
of context) takes ``base_s + (per_seq_s + per_token_s) * batch + per_pair_s * context``.

The gManager fits it to the steps of all instances (their heartbeats carry each engine's samples; those over lent
blocks too, whose waits for the creditors price lending: fitted without them, the planner lent more than paid,
``docs/lending.md``) in
relative error, so the many short decode steps weigh as much as the few long prefills, and without the steps
far slower than the fit (slowed by something else than their batch and context). It refuses samples that
cannot tell the cost of a request from the cost of its context.

Steps of a single batch size (at light load every step is a batch of one) cannot tell a step's fixed cost from
a request's: the fit then charges it all per request, the cautious reading, in which batching more requests
gains nothing and only a move that lets a request run that could not (one stalled for want of blocks) gains.
Refusing them left the planner without a model, and a request longer than its instance's pool waited for a
move that was never planned. Once steps of two batch sizes have run, the full fit replaces it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from boundless.engine.attention_time import AttentionSample, AttentionTimeModel, fit_attention_time

# Fewer samples than this fit nothing: the planner waits for the engines to have run.
MIN_SAMPLES = 8
# A step this many times slower than the fit predicts was slowed by something else; the fit is redone without it.
OUTLIER_FACTOR = 1.5


class NotEnoughSamplesError(ValueError):
    """The samples cannot determine the model (too few, or without two batch sizes and two contexts)."""


def fit_step_time_model(samples: Sequence[AttentionSample]) -> AttentionTimeModel:
    """The step-time model of ``samples`` for planning (see the module); :class:`NotEnoughSamplesError` when
    they are fewer than :data:`MIN_SAMPLES` or show a single context. Of a single batch size, the step's fixed cost
    is charged per request (see the module)."""
    usable = [s for s in samples if s.shapes and s.seconds > 0]
    if len(usable) < MIN_SAMPLES:
        raise NotEnoughSamplesError(f"{len(usable)} usable step samples; the fit needs {MIN_SAMPLES}")
    if len({_pairs(s) for s in usable}) < 2:
        raise NotEnoughSamplesError("the step samples need two contexts at least")
    model = fit_attention_time(usable, relative=True, outlier_factor=OUTLIER_FACTOR, cached_term=False)
    batch_sizes = {len(s.shapes) for s in usable}
    if len(batch_sizes) > 1:
        return model
    # One batch size: base and per-request columns are proportional, and only their sum at that size is known.
    (batch,) = batch_sizes
    return dataclasses.replace(model, base_s=0.0, per_seq_s=model.per_seq_s + model.base_s / batch)


def _pairs(sample: AttentionSample) -> int:
    return sum(s.pairs for s in sample.shapes)


def decode_step_s(model: AttentionTimeModel, batch_size: int, context_tokens: int) -> float:
    """Seconds of one decode step of ``batch_size`` requests attending over ``context_tokens`` in all."""
    return model.base_s + (model.per_seq_s + model.per_token_s) * batch_size + model.per_pair_s * context_tokens


def decode_throughput(model: AttentionTimeModel, batch_size: int, context_tokens: int) -> float:
    """Tokens per second of an instance decoding ``batch_size`` requests over ``context_tokens``."""
    if batch_size <= 0:
        return 0.0
    return batch_size / max(decode_step_s(model, batch_size, context_tokens), 1e-12)

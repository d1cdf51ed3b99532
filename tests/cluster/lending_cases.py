"""Shared by the lending tests: two hardware profiles, step samples drawn from them, and hand-built reports."""

from __future__ import annotations

import random
from collections.abc import Sequence

from boundless.cluster.perf_model import StepTimeModel
from boundless.cluster.placement import InstanceReport, RequestReport
from boundless.engine.step_times import StepSample

BLOCK = 16
# A GPU-like instance (a fixed step cost dominates) and an attention-bound one.
GPU_LIKE = StepTimeModel(base_s=0.03, per_seq_s=0.0005, per_prefill_token_s=0.0002, per_attended_s=1e-6)
ATTENTION_BOUND = StepTimeModel(base_s=0.001, per_seq_s=0.0001, per_prefill_token_s=0.0003, per_attended_s=1e-4)


def samples_of(model: StepTimeModel, noise: float = 0.0, seed: int = 0) -> list[StepSample]:
    """Decode steps over a grid of batches and contexts, and a few mixed steps with a prefill chunk."""
    rng = random.Random(seed)
    out = []
    for batch in (1, 2, 4, 8, 16):
        for context in (64, 512, 2048):
            for prefill in (0, 0, 128):
                shape = StepSample(batch, batch + prefill, batch * context + prefill * (prefill + 1) // 2, 0.0)
                seconds = model.sample_s(shape) * (1 + rng.uniform(-noise, noise))
                out.append(StepSample(shape.batch_size, shape.num_tokens, shape.attended_tokens, seconds))
    return out


def instance(
    iid: str,
    total: int,
    used: int,
    batch: int,
    context: int,
    waiting: Sequence[int] = (),
    max_batch: int = 16,
) -> InstanceReport:
    return InstanceReport(iid, BLOCK, total, total - used, batch, max_batch, context, tuple(waiting))


def request(rid: str, iid: str, blocks: int, tokens: int | None = None) -> RequestReport:
    """A request with all its blocks local; all but the last may move."""
    return RequestReport(rid, iid, tokens if tokens is not None else blocks * BLOCK, blocks, blocks - 1)

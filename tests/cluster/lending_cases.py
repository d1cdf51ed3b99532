"""Shared by the lending tests: two hardware profiles, step samples drawn from them, and hand-built reports."""

from __future__ import annotations

import random
from collections.abc import Sequence

from boundless.cluster.placement import Heartbeat, InstanceReport, RequestReport
from boundless.engine.attention_time import AttentionSample, AttentionTimeModel, ChunkShape

BLOCK = 16
# A GPU-like instance (a fixed step cost dominates) and an attention-bound one. A decode costs a request
# per_seq_s + per_token_s: 0.5 ms on the first, 0.1 ms on the second.
GPU_LIKE = AttentionTimeModel(base_s=0.03, per_seq_s=0.0003, per_token_s=0.0002, per_pair_s=1e-6)
ATTENTION_BOUND = AttentionTimeModel(base_s=0.001, per_seq_s=0.00005, per_token_s=0.00005, per_pair_s=1e-4)


def samples_of(model: AttentionTimeModel, noise: float = 0.0, seed: int = 0) -> list[AttentionSample]:
    """Decode steps over a grid of batches and contexts, some with a prefill chunk beside them."""
    rng = random.Random(seed)
    out = []
    for batch in (1, 2, 4, 8, 16):
        for context in (64, 512, 2048):
            for prefill in (0, 0, 128):
                shapes = (ChunkShape(context - 1, 1),) * batch + ((ChunkShape(0, prefill),) if prefill else ())
                out.append(AttentionSample(shapes, model.predict(shapes) * (1 + rng.uniform(-noise, noise))))
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


def heartbeat(report: InstanceReport, *requests: RequestReport, samples: Sequence[AttentionSample] = ()) -> Heartbeat:
    return Heartbeat(report, requests, tuple(samples))


class ManualClock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

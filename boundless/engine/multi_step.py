"""Multi-step decoding (``--num-scheduler-steps k``, as vLLM's multi-step scheduling): a step whose batch is all
one-token decodes is scheduled once and runs up to k forward passes, each decoding the token the last one sampled.

The scheduler decides the window (``Scheduler._plan_window``): every request's slots for its passes are allocated
before the first, and a request runs no more passes than the output tokens it may still produce. The executor runs
the passes back to back (:func:`window_iteration` is pass ``j``'s batch) and returns each pass's tokens; the engine
applies them in order when the window ends (``EngineCore.finish_step``), stopping a request at its first stop token,
stop string or length, and discarding the tokens it sampled past it. So each request's tokens are those k single
steps would have given it (greedy, or seeded sampling); what changes is time: requests that arrive or finish during
a window are admitted or reported at its end, and the scheduler, the policy and the deltas run once per window
instead of once per pass (the point of it: a GPU engine's Python per step, and the simulator's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from boundless.engine.attention_time import ChunkShape
from boundless.engine.scheduler import SchedulerOutput


def window_iteration(sched: SchedulerOutput, j: int, last_tokens: Mapping[str, int]) -> SchedulerOutput:
    """Pass ``j`` (from 1) of a multi-step window: each chunk with more than ``j`` passes decodes the token pass
    ``j - 1`` sampled for it (``last_tokens``), one position on."""
    chunks = [
        dataclasses.replace(
            c,
            token_ids=[last_tokens[c.request_id]],
            start_pos=c.start_pos + j,
            num_output_tokens=c.num_output_tokens + j,
        )
        for c in sched.chunks
        if c.num_steps > j
    ]
    return SchedulerOutput(chunks=chunks)


def window_shapes(sched: SchedulerOutput) -> list[tuple[ChunkShape, ...]]:
    """Every pass's chunk shapes (pass ``j`` from 0: each chunk with more than ``j`` passes, ``j`` positions on), made
    once per step: the simulator's executor prices them and the engine records them for its step-time models."""
    if sched.pass_shapes is None:
        rows = [(c.start_pos, len(c.token_ids), c.num_steps) for c in sched.chunks]
        sched.pass_shapes = [
            tuple([ChunkShape(start + j, new) for start, new, steps in rows if steps > j]) for j in range(sched.window)
        ]
    return sched.pass_shapes

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

from collections.abc import Mapping, Sequence
from typing import overload

from boundless.engine.attention_time import ChunkShape
from boundless.engine.scheduler import SchedulerOutput


def window_iteration(sched: SchedulerOutput, j: int, last_tokens: Mapping[str, int]) -> SchedulerOutput:
    """Pass ``j`` (from 1) of a multi-step window: each chunk with more than ``j`` passes decodes the token pass
    ``j - 1`` sampled for it (``last_tokens``), one position on."""
    chunks = [c.next_pass(last_tokens[c.request_id], j) for c in sched.chunks if c.num_steps > j]
    return SchedulerOutput(chunks=chunks)


# A window's chunk as its passes see it: (start position, new tokens, passes).
PassRow = tuple[int, int, int]


class WindowPasses(Sequence[tuple[ChunkShape, ...]]):
    """Each pass's chunk shapes of a multi-step window (pass ``j`` from 0: each chunk with more than ``j`` passes,
    ``j`` positions on), each made when first indexed. Every pass has a chunk (the window is its longest chunk's
    passes). Most are never made: a cost that prices ``rows`` directly and a step-time recorder that makes samples
    only when they are read leave them alone (the simulator's per-pass cost)."""

    __slots__ = ("_made", "rows")

    def __init__(self, rows: list[PassRow], window: int) -> None:
        self.rows = rows
        self._made: list[tuple[ChunkShape, ...] | None] = [None] * window

    def __len__(self) -> int:
        return len(self._made)

    @overload
    def __getitem__(self, j: int) -> tuple[ChunkShape, ...]: ...

    @overload
    def __getitem__(self, j: slice) -> list[tuple[ChunkShape, ...]]: ...

    def __getitem__(self, j: int | slice) -> tuple[ChunkShape, ...] | list[tuple[ChunkShape, ...]]:
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self)))]
        shapes = self._made[j]
        if shapes is None:
            j = j % len(self._made)
            shapes = self._made[j] = tuple([ChunkShape(start + j, new) for start, new, steps in self.rows if steps > j])
        return shapes


def window_shapes(sched: SchedulerOutput) -> WindowPasses:
    """Every pass's chunk shapes (:class:`WindowPasses`), once per step: the simulator's executor prices them and
    the engine records them for its step-time models."""
    passes = sched.pass_shapes
    if passes is None:
        rows = [(c.start_pos, len(c.token_ids), c.num_steps) for c in sched.chunks]
        passes = sched.pass_shapes = WindowPasses(rows, sched.window)
    # (Set here only: the scheduler's module, compiled and imported by this one, types it as the Sequence it is.)
    assert isinstance(passes, WindowPasses)
    return passes

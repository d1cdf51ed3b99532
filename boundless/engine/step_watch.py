"""The step an engine loop is running, for a watchdog in another thread or process.

The engine loop runs its forward pass outside its lock (``engine/async_engine.py``), so a pass that never returns
(a hung kernel, a deadlocked collective, a KV read that never lands) leaves the loop's other calls answering: a
cluster instance's ``drain`` and ``heartbeat`` still reply, and only the age of the step in flight tells that the
engine is stuck. :class:`StepWatch` records when the current step began and its size; its :class:`StepReport`
travels in the instance's heartbeat, and the cluster's front end decides from it (``cluster/stuck_step.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from boundless.engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class StepReport:
    """The step in flight when the engine was asked: seconds it has run, by the engine's clock, and its size."""

    running_s: float
    num_requests: int
    num_tokens: int
    passes: int = 1  # forward passes of a multi-step decoding window

    def describe(self) -> str:
        passes = f", {self.passes} passes" if self.passes > 1 else ""
        return f"{self.num_requests} requests, {self.num_tokens} tokens{passes}"


@dataclass(frozen=True)
class _Step:
    started: float
    num_requests: int
    num_tokens: int
    passes: int


class StepWatch:
    """When the engine loop's current step began, on ``clock``. The loop calls :meth:`begin` and :meth:`end` around
    each step's execution; any thread may call :meth:`report` (the record is one reference, swapped whole, so a
    reader never sees a half-written one and no lock is needed: the loop's own lock is not held while it runs)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._step: _Step | None = None

    def begin(self, sched: SchedulerOutput) -> None:
        self._step = _Step(self.clock(), len(sched.chunks), sched.num_tokens, sched.window)

    def end(self) -> None:
        self._step = None

    def report(self) -> StepReport | None:
        """The step in flight now, or None when the loop is between steps or idle."""
        step = self._step
        if step is None:
            return None
        return StepReport(self.clock() - step.started, step.num_requests, step.num_tokens, step.passes)

"""The executor seam: what runs a scheduled step.

``EngineCore`` hands every step's plain :class:`~boundless.engine.scheduler.SchedulerOutput` to an
executor and gets a :class:`StepResult` back. The model executor runs the network and samples; the
simulator's executor returns placeholder tokens and a step time from a cost model. Nothing else in
the engine differs between the two.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from boundless.engine.runner import ModelRunner
from boundless.engine.sampler import SampledToken
from boundless.engine.scheduler import SchedulerOutput
from boundless.kv.swap import HostSwapSpace


@dataclass(frozen=True)
class StepResult:
    """One executed step: a token per sampling chunk (by request id) and the step's seconds."""

    sampled: dict[str, SampledToken]
    elapsed_s: float


class Executor(Protocol):
    def execute(self, sched: SchedulerOutput) -> StepResult:
        """Apply the step's block transfers, run it, and sample a token for every chunk that samples."""
        ...


class ModelExecutor:
    """Runs steps on the real network: KV copies between tiers, the forward pass, sampling.

    ``timer`` measures the step (wall time by default); it is injected so that the step time a
    scheduler sees comes from one place.
    """

    def __init__(
        self,
        runner: ModelRunner,
        swap_space: HostSwapSpace | None,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.runner = runner
        self.swap_space = swap_space
        self.timer = timer

    def execute(self, sched: SchedulerOutput) -> StepResult:
        start = self.timer()
        self.runner.sampler.forget(sched.finished_ids)
        if sched.swap_out or sched.swap_in:
            assert self.swap_space is not None, "the scheduler swapped with no host memory"
            self.swap_space.apply(sched.swap_out, sched.swap_in)
        sampled = self.runner.sample(self.runner.forward(sched)) if sched.chunks else {}
        return StepResult(sampled, self.timer() - start)

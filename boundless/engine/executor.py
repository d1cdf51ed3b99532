"""The executor seam: what runs a scheduled step.

``EngineCore`` hands every step's plain :class:`~boundless.engine.scheduler.SchedulerOutput` to an
executor and gets a :class:`StepResult` back. The model executor runs the network and samples; the
simulator's executor returns placeholder tokens and a step time from a cost model. Nothing else in
the engine differs between the two.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from boundless.engine.runner import ModelRunner
from boundless.engine.sampler import SampledToken
from boundless.engine.scheduler import SchedulerOutput
from boundless.kv.tiers import KVTier
from boundless.kv.transfer import DEVICE, TierId, apply_transfers


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

    The device tier is the runner's KV cache; ``lower_tiers`` are the tiers below it (host memory), by
    id. ``timer`` measures the step (wall time by default); it is injected so that the step time a
    scheduler sees comes from one place.
    """

    def __init__(
        self,
        runner: ModelRunner,
        lower_tiers: Mapping[TierId, KVTier],
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.runner = runner
        self.tiers: dict[TierId, KVTier] = {DEVICE: runner.kv_cache, **lower_tiers}
        self.timer = timer

    def execute(self, sched: SchedulerOutput) -> StepResult:
        start = self.timer()
        self.runner.sampler.forget(sched.finished_ids)
        apply_transfers(sched.transfers, self.tiers)
        sampled = self.runner.sample(self.runner.forward(sched)) if sched.chunks else {}
        return StepResult(sampled, self.timer() - start)

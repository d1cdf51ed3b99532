"""The executor seam: what runs a scheduled step.

``EngineCore`` hands every step's plain :class:`~boundless.engine.scheduler.SchedulerOutput` to an
executor and gets a :class:`StepResult` back. The model executor runs the network and samples; the
simulator's executor returns placeholder tokens and a step time from a cost model. Nothing else in
the engine differs between the two.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from boundless.engine.runner import ModelRunner
from boundless.engine.sampler import SampledToken
from boundless.engine.scheduler import SchedulerOutput
from boundless.kv.disk_moves import TierReport
from boundless.kv.tier_io import DEFAULT_WRITE_QUEUE_BLOCKS, TierIO
from boundless.kv.tiers import BlockStore, KVTier
from boundless.kv.transfer import DEVICE, TierId

# A step with nothing to run but disk reads in flight waits this long at most for one to finish, so that an
# engine waiting only for the disk does not spin.
READ_WAIT_S = 0.02


@dataclass(frozen=True)
class StepResult:
    """One executed step: a token per sampling chunk (by request id), the step's seconds, and the disk reads
    and writes that finished meanwhile (for the scheduler)."""

    sampled: dict[str, SampledToken]
    elapsed_s: float
    tier_report: TierReport = field(default_factory=TierReport)


class Executor(Protocol):
    def execute(self, sched: SchedulerOutput) -> StepResult:
        """Apply the step's block transfers, run it, and sample a token for every chunk that samples."""
        ...

    def close(self) -> None:
        """Finish what was handed over for the background (writes to the disk store) and stop."""
        ...


class ModelExecutor:
    """Runs steps on the real network: KV moves between tiers, the forward pass, sampling.

    The device tier is the runner's KV cache; ``lower_tiers`` are the memory tiers below it (host memory),
    by id; ``store`` is the disk store, if any, read and written in the background (``kv/tier_io.py``).
    ``timer`` measures the step (wall time by default); it is injected so that the step time a scheduler
    sees comes from one place.
    """

    def __init__(
        self,
        runner: ModelRunner,
        lower_tiers: Mapping[TierId, KVTier],
        timer: Callable[[], float] = time.perf_counter,
        store: BlockStore | None = None,
        write_queue_blocks: int = DEFAULT_WRITE_QUEUE_BLOCKS,
    ) -> None:
        self.runner = runner
        self.tiers: dict[TierId, KVTier] = {DEVICE: runner.kv_cache, **lower_tiers}
        self.timer = timer
        self.kv_io = TierIO(self.tiers, store, write_queue_blocks)

    def execute(self, sched: SchedulerOutput) -> StepResult:
        start = self.timer()
        self.runner.sampler.forget(sched.finished_ids)
        self.kv_io.apply(sched.disk_reads, sched.disk_writes, sched.transfers, sched.disk_ages)
        sampled = self.runner.sample(self.runner.forward(sched)) if sched.chunks else {}
        elapsed = self.timer() - start
        idle = not sched.chunks and sched.num_reads_in_flight > 0
        return StepResult(sampled, elapsed, self.kv_io.report(wait_s=READ_WAIT_S if idle else 0.0))

    def close(self) -> None:
        self.kv_io.close()

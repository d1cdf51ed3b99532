"""What each engine step cost, as samples a performance model is fitted from.

The KV-lending planner (``cluster/gmanager.py``) needs the step time of an instance as a function of its batch
size and the context its batch attends over. It fits that from the engine's own steps
(``cluster/perf_model.py``), not from constants: every step that ran chunks leaves a :class:`StepSample`, and
a bounded :class:`StepTimeRecorder` keeps the latest ones for the heartbeat to carry.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from boundless.engine.scheduler import SchedulerOutput

# Samples kept per instance: enough to cover the batch sizes and contexts of a few minutes of steps.
DEFAULT_CAPACITY = 4096


@dataclass(frozen=True)
class StepSample:
    """One step: how many requests it ran, how many tokens it computed, how much attention it did, and its seconds.

    ``attended_tokens`` counts the key positions each computed token attends over, summed over the step: a
    decode's context length, and ``L·p + L(L+1)/2`` for a prefill chunk of ``L`` tokens after ``p`` computed
    ones. For a step of decodes it is the batch's total context.
    """

    batch_size: int
    num_tokens: int
    attended_tokens: int
    seconds: float

    @property
    def prefill_tokens(self) -> int:
        """Tokens computed beyond one per request (what a prefill chunk adds to a decode)."""
        return self.num_tokens - self.batch_size


def step_sample(sched: SchedulerOutput, seconds: float) -> StepSample:
    """The sample of a step that ran ``sched`` in ``seconds``."""
    attended = 0
    for chunk in sched.chunks:
        n = len(chunk.token_ids)
        attended += n * chunk.start_pos + n * (n + 1) // 2
    return StepSample(len(sched.chunks), sched.num_tokens, attended, seconds)


class StepTimeRecorder:
    """The latest ``capacity`` step samples of one instance; :meth:`drain` hands over those not yet taken."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._samples: deque[StepSample] = deque(maxlen=capacity)
        self._taken = 0  # of the samples now held, how many a drain already handed over
        self.num_recorded = 0

    def record(self, sample: StepSample) -> None:
        if len(self._samples) == self._samples.maxlen:
            self._taken = max(0, self._taken - 1)  # the oldest falls out
        self._samples.append(sample)
        self.num_recorded += 1

    def samples(self) -> list[StepSample]:
        """Every sample held, oldest first."""
        return list(self._samples)

    def drain(self) -> list[StepSample]:
        """The samples recorded since the last drain (those that fell out meanwhile are lost), oldest first."""
        new = list(self._samples)[self._taken :]
        self._taken = len(self._samples)
        return new

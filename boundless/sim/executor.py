"""The simulator's executor: no network, placeholder tokens, and a step time from a cost model."""

from __future__ import annotations

from boundless.engine.executor import StepResult
from boundless.engine.sampler import SampledToken
from boundless.engine.scheduler import ScheduledChunk, SchedulerOutput
from boundless.sim.cost import HOST_COPY_BYTES_PER_S, StepCost

# Where placeholder tokens start: above the low ids where tokenizers keep their special tokens.
PLACEHOLDER_TOKEN = 100


class CostModelExecutor:
    """Runs steps in virtual time: every sampling chunk gets a placeholder token, and a step takes the
    seconds ``cost`` gives it plus its swap copies at ``host_copy_bytes_per_s``.

    The placeholder is deterministic: ``token_id`` when one is asked for (an EOS, say, to end calls
    early), else the first id from :data:`PLACEHOLDER_TOKEN` up that is neither an EOS nor one of the
    request's stop tokens, so every call runs to the length its caller set, as the workload fixes it.
    """

    def __init__(
        self,
        cost: StepCost,
        bytes_per_block: int,
        host_copy_bytes_per_s: float = HOST_COPY_BYTES_PER_S,
        token_id: int | None = None,
    ) -> None:
        self.cost = cost
        self.bytes_per_block = bytes_per_block
        self.host_copy_bytes_per_s = host_copy_bytes_per_s
        self.token_id = token_id

    def execute(self, sched: SchedulerOutput) -> StepResult:
        sampled = {c.request_id: SampledToken(self._placeholder(c)) for c in sched.chunks if c.sample}
        copied = len(sched.transfers) * self.bytes_per_block  # device <-> host copies, a block each
        return StepResult(sampled, self.cost.step_time(sched) + copied / self.host_copy_bytes_per_s)

    def _placeholder(self, chunk: ScheduledChunk) -> int:
        if self.token_id is not None:
            return self.token_id
        ending = set(chunk.eos_token_ids) | set(chunk.sampling_params.stop_token_ids)
        token = PLACEHOLDER_TOKEN
        while token in ending:
            token += 1
        return token

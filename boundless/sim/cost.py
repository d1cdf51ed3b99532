"""What a simulated step costs, in seconds, from the step's plain :class:`SchedulerOutput`.

:class:`StepCost` is the interface the cost-model executor uses; :class:`CostModel` is today's
linear model of one CPU. Fitted models per hardware can replace it behind the same interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from boundless.engine.scheduler import SchedulerOutput

# Host-copy bandwidth for swapped KV blocks, bytes per second. Measured on the 2-core machine the
# CostModel defaults describe: HostSwapSpace.apply moved SmolLM2-135M fp32 blocks (720 KiB each)
# out and back in at 10-14 GB/s (1-16 blocks per copy, median of 20); rounded down.
HOST_COPY_BYTES_PER_S = 10e9

# The disk store, until measured on the machine the CostModel describes: a latency per read or write (opening
# files, checking headers) and sequential bandwidths of a local NVMe drive, rounded down.
DISK_READ_BYTES_PER_S = 1.5e9
DISK_WRITE_BYTES_PER_S = 1.0e9
DISK_LATENCY_S = 2e-4


class StepCost(Protocol):
    def step_time(self, sched: SchedulerOutput) -> float:
        """Seconds the step's forward pass and sampling take (its KV copies are charged apart)."""
        ...


@dataclass(frozen=True)
class CostModel:
    """Seconds per engine step: ``base + per_token * tokens + per_seq * sequences``, where a
    sequence's first token costs ``per_seq`` and the rest of its chunk (prefill) ``per_token``. The defaults
    approximate SmolLM2-135M in fp32 on 2 CPU cores (measured: ~40 ms for one decode, ~190 ms for
    32 decodes, ~2.3 ms per prefill token).
    """

    base_s: float = 0.035
    per_token_s: float = 0.0022
    per_seq_s: float = 0.0035

    def step_time(self, sched: SchedulerOutput) -> float:
        num_tokens = sched.num_tokens
        decode_like = min(num_tokens, len(sched.chunks))
        return self.base_s + self.per_seq_s * decode_like + self.per_token_s * (num_tokens - decode_like)

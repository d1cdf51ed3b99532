"""One generation as the engine tracks it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from boundless.engine.handoff import HandoffPlan, PrefixPush
from boundless.engine.sampling_params import SamplingParams
from boundless.programs.ref import ProgramRef


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # lost its KV; will be recomputed
    SWAPPED = "swapped"  # its KV waits in host memory
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_HANDED_OFF = "handoff"  # prefilled here; decodes on another instance (engine/handoff.py)


@dataclass
class Request:
    """A sequence being generated.

    Progress is one counter: ``num_computed_tokens`` of ``num_tokens`` have KV in the cache.
    Prefill, chunked prefill, prefix-cache hits, recompute after preemption and decode all follow
    from it: each step computes some of the tokens not yet computed.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 1 << 30
    program: ProgramRef | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_preemptions: int = 0
    service_s: float = 0.0  # model execution time spent on this request (attained service)
    first_token_time: float | None = None
    finish_time: float | None = None
    stop_reason: str | int | None = None
    # Prefill/decode disaggregation (engine/handoff.py). A PE's request: where its KV goes after its prefill.
    handoff: HandoffPlan | None = None
    handoff_sent: bool = False
    # A DE's request: held back until its first token comes from the PE; under DE-read, its prefix to push.
    awaiting_resume: bool = False
    push: PrefixPush | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must not be empty")
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.all_token_ids.extend(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        """Output tokens allowed: the caller's cap, and never past the context length."""
        room = self.max_model_len - self.num_prompt_tokens
        cap = self.sampling_params.max_tokens
        return room if cap is None else min(cap, room)

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self) -> RequestStatus | None:
        """The finished status the last sampled token implies, if any (stop strings are checked elsewhere)."""
        output = self.output_token_ids
        if not output:
            return None
        last, num_output = output[-1], len(output)  # (once: every sampled token comes here)
        params = self.sampling_params
        if num_output >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if num_output >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

"""Iteration-level scheduling: which tokens of which requests to compute in the next step.

The scheduler is pure bookkeeping. It is given a clock, a KV cache manager and a policy; it never
runs the model. Each step it fills a token budget with work from running requests first, then
admits waiting ones, and hands the runner a plain :class:`SchedulerOutput`. Prefill chunks and
decodes share one batch, because both are "compute the next tokens not yet computed".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from boundless.engine.request import Request, RequestStatus
from boundless.engine.sampling_params import SamplingParams
from boundless.kv.manager import KVCacheManager
from boundless.programs.policy import SchedulingPolicy

Clock = Callable[[], float]


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens of one request to compute in a step."""

    request_id: str
    token_ids: list[int]
    start_pos: int  # position of token_ids[0]; tokens before it already have KV
    block_ids: list[int]
    sample: bool  # the chunk ends at the last known token, so the step samples the next one
    sampling_params: SamplingParams
    num_output_tokens: int
    eos_token_ids: tuple[int, ...]


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # left since the last step

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_prompt_tokens_cached: int = 0


class Scheduler:
    """Continuous batching under a token budget, with preemption by recompute."""

    def __init__(
        self,
        kv: KVCacheManager,
        policy: SchedulingPolicy,
        clock: Clock,
        max_num_batched_tokens: int,
        max_num_seqs: int,
    ) -> None:
        self.kv = kv
        self.policy = policy
        self.clock = clock
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self._finished_since_step: list[str] = []

    # -- queue changes ---------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.policy.on_arrival(request, self.clock())

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Remove a request (finished or aborted) and free its blocks."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        request.finish_time = self.clock()
        self.kv.free(request_id)
        self.policy.on_finish(request, request.finish_time)
        self._finished_since_step.append(request_id)
        return request

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # -- the decision ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        out = SchedulerOutput(finished_ids=self._finished_since_step)
        self._finished_since_step = []
        budget = self.max_num_batched_tokens
        key = lambda r: self.policy.priority(r, now)
        self.running.sort(key=key)
        scheduled: list[tuple[Request, int]] = []

        # Running requests first, in priority order; the lowest-priority ones give way when memory is short.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            after = request.num_computed_tokens + num_new
            while not self.kv.allocate(request.request_id, request.all_token_ids, after):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new))
                budget -= num_new
                i += 1

        # Then admit waiting requests while budget, sequence slots and memory allow.
        if not out.preempted_ids:
            self.waiting.sort(key=key)
            admitted = []
            for request in self.waiting:
                if budget <= 0 or len(self.running) >= self.max_num_seqs:
                    break
                prefix = self.kv.find_cached_prefix(request.request_id, request.all_token_ids)
                computed = prefix.num_tokens
                num_new = min(request.num_tokens - computed, budget)
                if not self.kv.allocate(request.request_id, request.all_token_ids, computed + num_new, prefix):
                    break
                if request.first_scheduled_time is None:
                    request.first_scheduled_time = now
                    request.num_cached_tokens = computed
                    self.stats.num_prompt_tokens_cached += computed
                request.num_computed_tokens = computed
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                admitted.append(request)
                scheduled.append((request, num_new))
                budget -= num_new
            for request in admitted:
                self.waiting.remove(request)

        for request, num_new in scheduled:
            start = request.num_computed_tokens
            end = start + num_new
            out.chunks.append(
                ScheduledChunk(
                    request_id=request.request_id,
                    token_ids=request.all_token_ids[start:end],
                    start_pos=start,
                    block_ids=self.kv.block_ids(request.request_id),
                    sample=end == request.num_tokens,
                    sampling_params=request.sampling_params,
                    num_output_tokens=request.num_output_tokens,
                    eos_token_ids=request.eos_token_ids,
                )
            )
        return out

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Drop a running request's KV; it will be recomputed (prefix-cache hits make that cheaper)."""
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.append(request)
        out.preempted_ids.append(request.request_id)

    # -- after the step ----------------------------------------------------------------------

    def advance(self, output: SchedulerOutput, service_s: float) -> None:
        """Record that the step ran: each scheduled request computed its chunk.

        ``service_s`` is the step's model execution time; each request in the batch is charged
        its share by tokens (what program-aware policies count as attained service).
        """
        now = self.clock()
        total = max(output.num_tokens, 1)
        for chunk in output.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None:
                continue
            request.num_computed_tokens += len(chunk.token_ids)
            self.policy.on_service(request, service_s * len(chunk.token_ids) / total, now)

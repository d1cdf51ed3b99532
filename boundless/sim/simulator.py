"""A discrete-event simulator that drives the real scheduler and policies on a virtual clock.

The scheduler, KV cache manager and policy objects are the engine's own; only the model is
replaced by a cost model (step time from the step's token and sequence counts) and tokens by
placeholders. Agent programs from :mod:`boundless.bench.workloads` issue their calls as the real
benchmark does. Runs are deterministic and take seconds, so policy parameters can be explored
before they are measured on the real engine.
"""

from __future__ import annotations

import heapq
import itertools
import zlib
from dataclasses import dataclass, field

from boundless.bench.workloads import SHARED_SYSTEM_PROMPT, CallSpec, ProgramSpec, compaction
from boundless.config import SchedulerConfig
from boundless.engine.request import Request, RequestStatus
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.scheduler import Scheduler
from boundless.kv.manager import KVCacheManager
from boundless.programs.ref import ProgramRef


@dataclass(frozen=True)
class CostModel:
    """Seconds per engine step: ``base + per_token * tokens + per_seq * sequences``.

    The defaults approximate SmolLM2-135M in fp32 on 2 CPU cores (measured: ~40 ms for one decode,
    ~190 ms for 32 decodes, ~2.3 ms per prefill token).
    """

    base_s: float = 0.035
    per_token_s: float = 0.0022
    per_seq_s: float = 0.0035

    def step_time(self, num_tokens: int, num_seqs: int) -> float:
        decode_like = min(num_tokens, num_seqs)
        prefill = num_tokens - decode_like
        return self.base_s + self.per_seq_s * decode_like + self.per_token_s * prefill


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class SimProgram:
    spec: ProgramSpec
    stage: int = 0
    pending: int = 0
    contexts: dict[str, int] = field(default_factory=dict)  # thread -> context length in tokens
    # thread -> (salt of the tokens after the head, head) since its last compaction; (0, 0) before any
    compacted: dict[str, tuple[int, int]] = field(default_factory=dict)
    output_tokens: int = 0
    finish_s: float | None = None


@dataclass
class SimResult:
    program_id: str
    arrival_s: float
    finish_s: float
    output_tokens: int

    @property
    def latency_s(self) -> float:
        return self.finish_s - self.arrival_s


class Simulator:
    """One engine instance under a stream of agent programs, in virtual time."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        num_blocks: int = 4096,
        block_size: int = 16,
        num_host_blocks: int = 4096,
        cost: CostModel | None = None,
        max_model_len: int | None = None,
    ) -> None:
        from boundless.programs.registry import make_policy

        self.clock = VirtualClock()
        # As the engine: the asked context length, capped by the KV pool.
        self.max_context = min(max_model_len or num_blocks * block_size, num_blocks * block_size)
        self.cost = cost or CostModel()
        kv = KVCacheManager(num_blocks, block_size, True, "sim", num_host_blocks=num_host_blocks)
        self.scheduler = Scheduler(
            kv,
            make_policy(scheduler_config),
            self.clock,
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
            max_num_seqs=scheduler_config.max_num_seqs,
        )
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self._calls: dict[str, tuple[SimProgram, CallSpec]] = {}
        self._ids = itertools.count()

    def _at(self, t: float, kind: str, payload: object) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def run(self, programs: list[ProgramSpec]) -> list[SimResult]:
        sims = [SimProgram(p) for p in programs]
        for sp in sims:
            self._at(sp.spec.arrival_s, "stage", sp)
        while self._events or self.scheduler.num_unfinished:
            # Deliver every event due by now (arrivals, tool waits ending).
            while self._events and self._events[0][0] <= self.clock.now:
                _, _, kind, payload = heapq.heappop(self._events)
                if kind == "stage":
                    self._start_stage(payload)  # type: ignore[arg-type]
                else:
                    self._submit(*payload)  # type: ignore[misc]
            out = self.scheduler.schedule() if self.scheduler.num_unfinished else None
            if out is None or out.is_empty:
                if not self._events:
                    break
                self.clock.now = max(self.clock.now, self._events[0][0])
                continue
            duration = self.cost.step_time(out.num_tokens, len(out.chunks))
            self.clock.now += duration
            self.scheduler.advance(out, duration)
            for chunk in out.chunks:
                if chunk.sample:
                    self._sampled(chunk.request_id)
        return [
            SimResult(sp.spec.program_id, sp.spec.arrival_s, sp.finish_s or self.clock.now, sp.output_tokens)
            for sp in sims
        ]

    def _start_stage(self, sp: SimProgram) -> None:
        if sp.stage >= len(sp.spec.stages):
            sp.finish_s = self.clock.now
            return
        stage = sp.spec.stages[sp.stage]
        sp.pending = len(stage)
        for call in stage:
            self._at(self.clock.now + call.tool_wait_s, "call", (sp, call))

    def _submit(self, sp: SimProgram, call: CallSpec) -> None:
        system_len = SHARED_SYSTEM_PROMPT + sp.spec.system_prompt
        base = sp.contexts.get(call.parents[0], system_len) if call.parents else system_len
        prompt_len = base + sum(sp.contexts.get(p, 0) for p in call.parents[1:]) // 4 + call.new_input
        after, head = sp.compacted.get(call.parents[0], (0, 0)) if call.parents else (0, 0)
        # As the benchmark does: compact the conversation when it outgrows the context the pool holds.
        cut = compaction(prompt_len, system_len if after == 0 or head else 0, self.max_context - call.output - 1)
        if cut is not None:
            head, prompt_len = cut
            after = zlib.crc32(f"{sp.spec.program_id}/{call.thread_id}/{next(self._ids)}".encode()) or 1
        sp.compacted[call.thread_id] = (after, head)
        rid = f"c{next(self._ids)}"
        # Placeholder tokens: a program's threads share its prefix; a compaction keeps only its head
        # and starts tokens of its own.
        salt = zlib.crc32(sp.spec.program_id.encode())
        prompt = [(salt + 7919 * i + (after if i >= head else 0)) % 30000 + 1000 for i in range(prompt_len)]
        req = Request(
            rid,
            prompt,
            SamplingParams(max_tokens=call.output, ignore_eos=True),
            arrival_time=self.clock.now,
            program=ProgramRef(sp.spec.program_id, call.thread_id, call.parents),
        )
        self._calls[rid] = (sp, call)
        sp.contexts[call.thread_id] = prompt_len + call.output
        self.scheduler.add(req)

    def _sampled(self, rid: str) -> None:
        req = self.scheduler.requests[rid]
        req.append_output(0)
        if req.num_output_tokens >= req.sampling_params.max_tokens:
            self.scheduler.finish(rid, RequestStatus.FINISHED_LENGTH)
            sp, _ = self._calls.pop(rid)
            sp.output_tokens += req.num_output_tokens
            sp.pending -= 1
            if sp.pending == 0:
                sp.stage += 1
                self._start_stage(sp)

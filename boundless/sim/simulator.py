"""A discrete-event simulator: agent programs against the real engine, in virtual time.

The engine is the real :class:`~boundless.engine.core.EngineCore` (scheduler, KV cache manager,
policy, finish and stop rules, context length), sized from an ``EngineConfig`` as the real one is;
only its executor differs: placeholder tokens and a step time from a cost model. Programs from
:mod:`boundless.bench.workloads` send the prompts the real benchmark sends (same tokens, same
compaction). Runs are deterministic and take seconds, so policy parameters can be explored before
they are measured on the real engine.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field

from boundless.bench.workloads import CallSpec, ProgramSpec, PromptTokens, call_prompt
from boundless.config import EngineConfig
from boundless.engine.errors import InvalidRequestError
from boundless.engine.request import Request
from boundless.engine.sampling_params import SamplingParams
from boundless.programs.ref import ProgramRef
from boundless.sim.cost import CostModel, StepCost
from boundless.sim.engine import SimulatedModel, simulated_engine


class VirtualClock:
    """The engine's clock in a simulation: it moves only when the event loop moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class SimProgram:
    """A program in flight: its prompt tokens, its threads' conversations, the stage it is at."""

    spec: ProgramSpec
    rng: random.Random
    system: list[int]
    stage: int = 0
    pending: int = 0
    contexts: dict[str, list[int]] = field(default_factory=dict)  # thread -> its conversation so far
    outputs: dict[str, list[int]] = field(default_factory=dict)  # thread -> its last output
    output_tokens: int = 0
    failed_calls: int = 0
    finish_s: float | None = None


@dataclass(frozen=True)
class SimResult:
    program_id: str
    arrival_s: float
    finish_s: float
    output_tokens: int
    failed_calls: int = 0  # calls the engine refused (as the benchmark counts them)

    @property
    def latency_s(self) -> float:
        return self.finish_s - self.arrival_s


@dataclass(frozen=True)
class _Call:
    program: SimProgram
    spec: CallSpec
    prompt: list[int]
    request: Request


class Simulator:
    """One engine instance under a stream of agent programs, in virtual time.

    The event loop delivers arrivals and the ends of tool waits, then runs one engine step:
    schedule, execute on the cost-model executor, move the clock on by the step's seconds, and
    let the engine apply the step (``finish_step``), which ends calls by its own rules.
    """

    def __init__(
        self, config: EngineConfig, model: SimulatedModel, cost: StepCost | None = None, seed: int = 0
    ) -> None:
        self.clock = VirtualClock()
        self.core = simulated_engine(config, model, cost or CostModel(), self.clock)
        self.tokens = PromptTokens(model.identity.vocab_size, seed)
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self._calls: dict[str, _Call] = {}
        self._ids = itertools.count()

    def _at(self, t: float, kind: str, payload: object) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def run(self, programs: list[ProgramSpec]) -> list[SimResult]:
        sims = []
        for spec in programs:
            rng, system = self.tokens.start(spec)
            sims.append(SimProgram(spec, rng, system))
            self._at(spec.arrival_s, "stage", sims[-1])
        core = self.core
        while self._events or core.has_unfinished():
            # Deliver every event due by now (arrivals, tool waits ending).
            while self._events and self._events[0][0] <= self.clock.now:
                _, _, kind, payload = heapq.heappop(self._events)
                if kind == "stage":
                    self._start_stage(payload)  # type: ignore[arg-type]
                else:
                    self._submit(*payload)  # type: ignore[misc]
            sched = core.schedule() if core.has_unfinished() else None
            if sched is None or sched.is_empty:
                if not self._events:
                    break
                self.clock.now = max(self.clock.now, self._events[0][0])
                continue
            result = core.execute(sched)
            self.clock.now += result.elapsed_s
            for delta in core.finish_step(sched, result):
                if delta.finished:
                    self._call_done(self._calls.pop(delta.request_id))
        return [
            SimResult(
                sp.spec.program_id,
                sp.spec.arrival_s,
                sp.finish_s if sp.finish_s is not None else self.clock.now,
                sp.output_tokens,
                sp.failed_calls,
            )
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
        new_input = self.tokens.draw(sp.rng, call.new_input)
        prompt = call_prompt(call, sp.system, sp.contexts, sp.outputs, new_input, self.core.max_model_len)
        rid = f"c{next(self._ids)}"
        try:
            request = self.core.add_request(
                rid,
                prompt,
                SamplingParams(max_tokens=call.output, ignore_eos=True),
                program=ProgramRef(sp.spec.program_id, call.thread_id, call.parents),
            )
        except InvalidRequestError:  # as the benchmark: counted, and the program goes on with what it has
            sp.failed_calls += 1
            sp.contexts[call.thread_id] = prompt
            sp.outputs[call.thread_id] = []
            self._end_call(sp)
            return
        self._calls[rid] = _Call(sp, call, prompt, request)

    def _call_done(self, call: _Call) -> None:
        sp, out = call.program, list(call.request.output_token_ids)
        sp.contexts[call.spec.thread_id] = call.prompt + out
        sp.outputs[call.spec.thread_id] = out
        sp.output_tokens += len(out)
        self._end_call(sp)

    def _end_call(self, sp: SimProgram) -> None:
        sp.pending -= 1
        if sp.pending == 0:
            sp.stage += 1
            self._start_stage(sp)

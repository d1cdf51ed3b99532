"""A discrete-event simulator: agent programs against the real engines, in virtual time.

Each instance is the real :class:`~boundless.engine.core.EngineCore` (scheduler, KV cache manager,
policy, finish and stop rules, context length), sized from an ``EngineConfig`` as the real one is;
only its executor differs: placeholder tokens and a step time from a cost model. With more than one
instance the calls go through the real cluster :class:`~boundless.cluster.dispatcher.Dispatcher` and
:class:`~boundless.cluster.routing.Router` (program locality, the router's process table, global
program service), exactly as ``boundless serve --instances N`` sends them; with one, straight to the
engine, as the single-process server does. Programs from :mod:`boundless.bench.workloads` send the
prompts the real benchmark sends (same tokens, same compaction).

Events, not threads: a heap of (time, sequence number) orders arrivals, tool waits and the ends of
instances' steps, and ties are broken by the order the events were made, so a run is a function of
its inputs and seed alone.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from boundless.bench.workloads import CallSpec, ProgramSpec, PromptTokens, call_prompt
from boundless.cluster.dispatcher import AddResult, Decision, Dispatcher, Fail, Send
from boundless.cluster.links import Link
from boundless.cluster.routing import Router
from boundless.config import ClusterConfig, EngineConfig
from boundless.engine.core import EngineCore, RequestDelta
from boundless.engine.errors import InvalidRequestError
from boundless.engine.executor import StepResult
from boundless.engine.request import Request
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.scheduler import SchedulerOutput
from boundless.programs.process_table import ProcessTable
from boundless.programs.ref import ProgramRef
from boundless.sim.cost import CostModel, StepCost
from boundless.sim.engine import DEFAULT_DISK_COST, HOST_COPY, SimulatedModel, simulated_engine
from boundless.sim.profiles import HardwareProfile


class VirtualClock:
    """The engines' clock in a simulation: it moves only when the event loop moves it."""

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
class Placement:
    """Where a call ran: its program and the instance the router chose."""

    request_id: str
    program_id: str
    instance_id: str
    num_prompt_tokens: int


@dataclass
class _Call:
    program: SimProgram
    spec: CallSpec
    prompt: list[int]
    request: Request | None = None  # the engine's request, once an instance took it
    output_token_ids: list[int] = field(default_factory=list)


@dataclass
class SimInstance:
    """An engine instance and the step it is running: ``step`` is set from the step's start to its end."""

    instance_id: str
    core: EngineCore
    step: tuple[SchedulerOutput, StepResult] | None = None


# Event kinds, in the heap as (time, sequence, kind, payload).
_STAGE, _CALL, _STEP_END = 0, 1, 2

Progress = Callable[[float], None]  # told the virtual time as the run goes


class Simulator:
    """``instances`` engine instances under a stream of agent programs, in virtual time.

    An instance with work starts a step (``schedule``, ``execute`` on the cost-model executor) and
    the step ends ``elapsed_s`` later, when the engine applies it (``finish_step``); its deltas go to
    the dispatcher and finished calls move their programs on. Instances step independently, each at
    its own pace, on one shared clock.
    """

    def __init__(
        self,
        config: EngineConfig,
        model: SimulatedModel,
        cost: StepCost | None = None,
        seed: int = 0,
        instances: int = 1,
        cluster: ClusterConfig | None = None,
        profile: HardwareProfile | None = None,
        instances_per_node: int = 0,
    ) -> None:
        self.clock = VirtualClock()
        host_copy, disk_cost = HOST_COPY, DEFAULT_DISK_COST
        if profile is not None:  # its step model unless ``cost`` is given, and its links
            cost = cost or profile.step
            host_copy, disk_cost = profile.host_copy, profile.disk_cost
        cost = cost or CostModel()
        # Instances of a node read the disk store over one storage link, the sum of their shares (DGX: 2 NICs for 8).
        self.storage_links: list[Link] = []
        if instances_per_node > 0:
            rate = disk_cost.read_bytes_per_s * instances_per_node
            nodes = -(-instances // instances_per_node)
            self.storage_links = [Link(f"storage-node{k}", rate) for k in range(nodes)]
        self.instances = {}
        for i in range(instances):
            link = self.storage_links[i // instances_per_node] if self.storage_links else None
            core = simulated_engine(config, model, cost, self.clock, None, host_copy, disk_cost, link)
            self.instances[str(i)] = SimInstance(str(i), core)
        self.core = self.instances["0"].core  # the engine, for one instance
        self.max_model_len = min(i.core.max_model_len for i in self.instances.values())
        self.dispatcher: Dispatcher | None = None
        self.cluster = cluster or ClusterConfig(instances=instances)
        if instances > 1:  # as ClusterClient builds it
            table = ProcessTable(ttl_s=config.scheduler.program_ttl_s, critical_path=config.scheduler.policy == "atlas")
            router = Router(self.cluster.routing, self.cluster.locality_threshold, self.cluster.locality_max_imbalance)
            self.dispatcher = Dispatcher(self.instances, router, table, self.clock)
        self.tokens = PromptTokens(model.identity.vocab_size, seed)
        self.placements: list[Placement] = []
        self.num_steps = 0
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        self._calls: dict[str, _Call] = {}
        self._ids = itertools.count()
        self._ready: set[str] = set()  # idle instances that may have work to start
        self._next_expiry = 0.0

    def _at(self, t: float, kind: int, payload: object) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def run(self, programs: list[ProgramSpec], progress: Progress | None = None) -> list[SimResult]:
        sims = []
        for spec in programs:
            rng, system = self.tokens.start(spec)
            sims.append(SimProgram(spec, rng, system))
            self._at(spec.arrival_s, _STAGE, sims[-1])
        events, clock = self._events, self.clock
        while events:
            # Deliver every event due now (those it makes for now too), then start the idle instances' steps.
            clock.now = now = events[0][0]
            while events and events[0][0] <= now:
                _, _, kind, payload = heapq.heappop(events)
                if kind == _STEP_END:
                    self._step_end(payload)  # type: ignore[arg-type]
                elif kind == _STAGE:
                    self._start_stage(payload)  # type: ignore[arg-type]
                else:
                    self._submit(*payload)  # type: ignore[misc]
            if self.dispatcher is not None and now >= self._next_expiry:
                self.dispatcher.expire()  # as the transport's heartbeat loop does
                self._next_expiry = now + self.cluster.heartbeat_interval_s
            for iid in sorted(self._ready):
                self._start_step(self.instances[iid])
            self._ready.clear()
            if progress is not None:
                progress(now)
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

    # -- instances ---------------------------------------------------------------------------

    def _start_step(self, inst: SimInstance) -> None:
        if inst.step is not None or not inst.core.has_unfinished():
            return
        sched = inst.core.schedule()
        if sched.is_empty:  # nothing it can run until a call arrives or ends
            return
        result = inst.core.execute(sched)
        inst.step = (sched, result)
        self.num_steps += 1
        self._at(self.clock.now + result.elapsed_s, _STEP_END, inst)

    def _step_end(self, inst: SimInstance) -> None:
        sched, result = inst.step  # type: ignore[misc]
        inst.step = None
        self._ready.add(inst.instance_id)
        for delta in inst.core.finish_step(sched, result):
            self._on_delta(inst.instance_id, delta)

    def _on_delta(self, instance_id: str, delta: RequestDelta) -> None:
        if self.dispatcher is not None and not self.dispatcher.on_delta(instance_id, delta):
            return  # a call nobody waits for
        call = self._calls.get(delta.request_id)
        if call is None:
            return
        call.output_token_ids.extend(delta.new_token_ids)
        if delta.finished:
            del self._calls[delta.request_id]
            self._call_done(call)

    # -- programs ----------------------------------------------------------------------------

    def _start_stage(self, sp: SimProgram) -> None:
        if sp.stage >= len(sp.spec.stages):
            sp.finish_s = self.clock.now
            return
        stage = sp.spec.stages[sp.stage]
        sp.pending = len(stage)
        for call in stage:
            self._at(self.clock.now + call.tool_wait_s, _CALL, (sp, call))

    def _submit(self, sp: SimProgram, spec: CallSpec) -> None:
        new_input = self.tokens.draw(sp.rng, spec.new_input)
        prompt = call_prompt(spec, sp.system, sp.contexts, sp.outputs, new_input, self.max_model_len)
        rid = f"c{next(self._ids)}"
        params = SamplingParams(max_tokens=spec.output, ignore_eos=True)
        program = ProgramRef(sp.spec.program_id, spec.thread_id, spec.parents)
        call = _Call(sp, spec, prompt)
        if self.dispatcher is None:
            self._add(call, Send("0", rid, prompt, params, program, None))
            return
        self._carry_out(call, self.dispatcher.submit(rid, prompt, params, program))

    def _carry_out(self, call: _Call, decisions: list[Decision]) -> None:
        """Carry out the dispatcher's decisions as ``ClusterClient`` does, with the instances at hand."""
        queue = list(decisions)
        while queue:
            decision = queue.pop(0)
            if isinstance(decision, Send):
                result = self._add(call, decision)
                queue.extend(self.dispatcher.add_done(decision, result))  # type: ignore[union-attr]
            elif isinstance(decision, Fail):  # refused (the calls of one submit are this call alone)
                self._refused(call)
            # MarkDead and AbortOn need failures and aborts, which simulated instances do not have yet.

    def _add(self, call: _Call, send: Send) -> AddResult:
        core = self.instances[send.instance_id].core
        try:
            call.request = core.add_request(
                send.request_id, send.prompt, send.params, program=send.program, resume=send.resume
            )
        except InvalidRequestError as e:  # as the benchmark: counted, and the program goes on with what it has
            if self.dispatcher is None:
                self._refused(call)
            return AddResult("invalid", str(e), e.param)
        self._calls[send.request_id] = call
        self.placements.append(
            Placement(send.request_id, call.program.spec.program_id, send.instance_id, len(send.prompt))
        )
        self._ready.add(send.instance_id)
        return AddResult("ok")

    def _refused(self, call: _Call) -> None:
        sp = call.program
        sp.failed_calls += 1
        sp.contexts[call.spec.thread_id] = call.prompt
        sp.outputs[call.spec.thread_id] = []
        self._end_call(sp)

    def _call_done(self, call: _Call) -> None:
        sp, out = call.program, call.output_token_ids
        sp.contexts[call.spec.thread_id] = call.prompt + out
        sp.outputs[call.spec.thread_id] = out
        sp.output_tokens += len(out)
        self._end_call(sp)

    def _end_call(self, sp: SimProgram) -> None:
        sp.pending -= 1
        if sp.pending == 0:
            sp.stage += 1
            self._start_stage(sp)

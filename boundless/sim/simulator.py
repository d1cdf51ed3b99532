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
its inputs and seed alone. A plain cluster can also run in windows of virtual time, its engines in several processes
(``sim/parallel.py``), each shard on this loop run to a horizon (``_advance``).

Instances may fail (``sim/failures.py``): a failed one stops mid-step, the dispatcher is told as the
transport would tell it, and its decisions (``MarkDead``, sends resumed elsewhere, requeues, and the lost
instance's ``Restart`` when it is due) are carried out here as ``DispatcherFrontEnd`` carries them out: a
restarted instance is a fresh engine, empty, back ``instance_startup_s`` after its restart. With KV lending the
dispatcher holds the cluster's lending, as the Ray client's does, and its ``PeerLost`` and ``PeerBack`` go to the
other instances' agents (``sim/lending.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
import random
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

from boundless.bench.workloads import CallSpec, ProgramSpec, PromptTokens, call_kind, call_prompt
from boundless.cluster.dispatcher import AbortOn, AddResult, Dispatcher, Fail, MarkDead, Send
from boundless.cluster.lending_cluster import PeerBack, PeerLost
from boundless.cluster.links import Link, gbps_to_bytes_per_s
from boundless.cluster.pd_dispatcher import Continue, PDDecision, PDDispatcher, PDInstance, Prepare, PrepareResult
from boundless.cluster.pd_scheduler import PDSchedulerConfig, read_queue_tokens
from boundless.cluster.restarts import Restart, RestartPolicy
from boundless.cluster.routing import Router
from boundless.cluster.stuck_step import stuck_step
from boundless.config import ClusterConfig, ConfigError, EngineConfig, ServerConfig, check_serve_configs
from boundless.engine.builder import size_engine
from boundless.engine.core import EngineCore, RequestDelta
from boundless.engine.errors import InvalidRequestError
from boundless.engine.executor import StepResult
from boundless.engine.request import Request
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.scheduler import SchedulerOutput
from boundless.engine.step_watch import StepReport
from boundless.gc_quiet import quiet_collector
from boundless.kv.block_hash import BlockHash
from boundless.programs.process_table import ProcessTable
from boundless.programs.ref import ProgramRef
from boundless.sim.cost import CostModel, StepCost
from boundless.sim.engine import DEFAULT_DISK_COST, HOST_COPY, SimulatedModel, ranks_memory, simulated_engine
from boundless.sim.executor import DiskCost
from boundless.sim.failures import InstanceFailure, check_failures
from boundless.sim.lending import SimulatedLending, lending_max_model_len, simulated_lending
from boundless.sim.links import LinkSpec
from boundless.sim.profiles import HardwareProfile, kv_links, with_kv_cache_dtype, with_tensor_parallel
from boundless.sim.remote import KVFabric


def check_split_simulation(
    config: EngineConfig, cluster: ClusterConfig, profile: HardwareProfile | None, cost: StepCost | None
) -> None:
    """What the simulator needs to run a model split over GPUs (``--tensor-parallel-size``): a roofline profile that
    prices it (``with_tensor_parallel``), and what ``serve`` runs with one."""
    size = config.model.tensor_parallel_size
    if profile is None or cost is not None:
        raise ConfigError(
            f"--tensor-parallel-size {size}: the simulator prices a model split over GPUs on a roofline --profile "
            "(a100-80gb, h100, h200), not a step model of its own"
        )
    try:
        with_tensor_parallel(profile, size)
    except ValueError as e:
        raise ConfigError(f"--tensor-parallel-size {size}: {e}") from None
    check_serve_configs(config, ServerConfig(), cluster)


class VirtualClock:
    """The engines' clock in a simulation: it moves only when the event loop moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class SimProgram:
    """A program: the stage it is at, and while in flight its prompt tokens and its threads' conversations (made when it
    arrives and dropped when it finishes: a long run's programs would otherwise hold them all, a generator each)."""

    spec: ProgramSpec
    rng: random.Random | None = None
    system: list[int] = field(default_factory=list)
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
    finished: bool = True  # False: the run ended with the program's calls unserved (finish_s is the run's end)

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
    at_s: float = 0.0  # when it was placed


@dataclass(frozen=True)
class CallOutcome:
    """A completed call: the output tokens its program got, of the ``max_tokens`` it asked for."""

    output_tokens: int
    max_tokens: int


@dataclass
class _Call:
    program: SimProgram
    spec: CallSpec
    prompt: list[int]
    request: Request | None = None  # the engine's request, once an instance took it
    output_token_ids: list[int] = field(default_factory=list)
    submit_s: float = 0.0  # when the program sent it (after its tool wait)


@dataclass
class SimInstance:
    """An engine instance and the step it is running: ``step`` is set from the step's start (``step_started``) to
    its end. A ``dead`` one (``sim/failures.py``) runs nothing more: its step in flight never ends. A ``stuck`` one
    is alive, but its step in flight (or the next it starts) never ends, until the step watchdog finds it."""

    instance_id: str
    core: EngineCore
    step: tuple[SchedulerOutput, StepResult] | None = None
    step_started: float = 0.0
    step_ends: float = 0.0  # when the step in flight ends (its event; an earlier one for it is stale)
    dead: bool = False
    stuck: bool = False


# Event kinds, in the heap as (time, sequence, kind, payload); only a run with failures has the last five.
_STAGE, _CALL, _STEP_END, _WAKE, _FAIL, _DETECT, _STUCK, _RESTART, _BACK = 0, 1, 2, 3, 4, 5, 6, 7, 8

# How long a restarted instance takes from its start to its first heartbeat, by default: a model's load (an 8B model's
# 16 GB of weights from local NVMe at a few GB/s, CUDA graphs and warm-up) and the process's start; vLLM's and
# SGLang's servers take 20-60 s to be ready for such a model.
DEFAULT_INSTANCE_STARTUP_S = 30.0

# Without a profile, the compute network prefill/decode handoffs cross: 400 Gbit/s per GPU (a DGX H100's CNIC).
DEFAULT_NETWORK = LinkSpec(50e9, 5e-6)

Progress = Callable[[float], None]  # told the virtual time as the run goes

# With KV lending, heartbeats keep coming while work remains, until this many in a row saw no step start.
LENDING_STALL_BEATS = 120


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
        compact_prompts: bool = True,
        fast_forward: bool = True,
        failures: Sequence[InstanceFailure] = (),
        instance_startup_s: float = DEFAULT_INSTANCE_STARTUP_S,
        lending_pools: float | None = None,
        owned: Collection[int] | None = None,
    ) -> None:
        """``owned``: the instances (by index) this object builds engines for, when not all of them: a windowed run's
        shards (``sim/parallel.py``) each hold some, and its main process none (the dispatcher still knows them all)."""
        if not instance_startup_s >= 0:
            raise ValueError(f"instance_startup_s must not be negative (got {instance_startup_s})")
        self.clock = VirtualClock()
        # Run an instance's steps back to back, off the event heap, while nothing else is due before its next step
        # ends (``_step_alone``); the results are the same either way (tests/sim compares them).
        self.fast_forward = fast_forward
        host_copy, disk_cost, network = HOST_COPY, DEFAULT_DISK_COST, DEFAULT_NETWORK
        self.gpus_per_instance = config.model.tensor_parallel_size
        if config.model.tensor_parallel_size > 1:
            check_split_simulation(config, cluster or ClusterConfig(instances=instances), profile, cost)
            config = ranks_memory(config, model.arch.num_kv_heads)
        if profile is not None:  # its step model unless ``cost`` is given, and its links
            # A roofline model's KV bytes in the KV cache's type (--kv-cache-dtype), as the engines' pools hold them.
            profile = with_kv_cache_dtype(profile, config.cache.kv_cache_dtype)
            # A model split over GPUs: each GPU's share of a step, their all-reduces, and links of every GPU.
            profile = with_tensor_parallel(profile, config.model.tensor_parallel_size)
            cost = cost or profile.step
            host_copy, disk_cost, network = profile.host_copy, profile.disk_cost, profile.network
        cost = cost or CostModel()
        self.cluster = cluster or ClusterConfig(instances=instances)
        check_failures(failures, self.cluster)
        self.failures = list(failures)
        self.lost: dict[str, float] = {}  # instance -> when the dispatcher was told it is lost
        self.instance_startup_s = instance_startup_s
        self.restarted: dict[str, float] = {}  # instance -> when its restart took calls again
        self._restart_checks: set[float] = set()  # when restarts are due (an event each, not yet delivered)
        self.dispatcher: Dispatcher | None = None
        self.instances = {}
        self._new_engine: dict[str, Callable[[], EngineCore]] = {}  # a fresh engine of each instance (a restart)
        self.storage_links: list[Link] = []
        self.fabric: KVFabric | None = None
        self.lending: SimulatedLending | None = None
        if self.cluster.disaggregated:
            # The cluster's emulated NICs, when given, in place of the profile's figures (as the real links: one a GPU).
            links = kv_links(profile)
            if self.cluster.storage_gbps is not None:
                disk_cost = dataclasses.replace(
                    disk_cost, read_bytes_per_s=gbps_to_bytes_per_s(self.cluster.storage_gbps) * links
                )
            if self.cluster.net_gbps is not None:
                network = dataclasses.replace(network, bytes_per_s=gbps_to_bytes_per_s(self.cluster.net_gbps) * links)
            shape = getattr(profile.step, "shape", None) if profile is not None else None
            kv_bytes = shape.kv_bytes_per_token if shape is not None else None
            self._build_roles(config, model, cost, host_copy, disk_cost, network, instances_per_node, kv_bytes)
        else:
            # Instances of a node read the disk store over one storage link, the sum of their shares (DGX: 2 NICs
            # for 8).
            if instances_per_node > 0:
                rate = disk_cost.read_bytes_per_s * instances_per_node
                nodes = -(-instances // instances_per_node)
                self.storage_links = [Link(f"storage-node{k}", rate) for k in range(nodes)]
            lending = self.cluster.kv_lending == "on"
            # With lending a request may hold ``lending_pools`` instances' pools' worth: all of them by default, as
            # `bench longctx` and the paper size it; what `serve --kv-lending on` admits (validate passes
            # ``lending_plan.served_request_pools``); 1 sizes the engines as without lending.
            pools = instances if lending_pools is None else lending_pools
            max_len = lending_max_model_len(config, model, pools) if lending and pools > 1 else None
            for i in range(instances) if owned is None else sorted(owned):
                link = self.storage_links[i // instances_per_node] if self.storage_links else None
                make = self._new_engine[str(i)] = functools.partial(
                    simulated_engine,
                    config, model, cost, self.clock, None, host_copy, disk_cost, link, max_model_len=max_len,
                )  # fmt: skip
                self.instances[str(i)] = SimInstance(str(i), make())
            if lending:
                cores = {iid: inst.core for iid, inst in self.instances.items()}
                idle = lambda iid: self.instances[iid].step is None
                self.lending = simulated_lending(cores, self.cluster, self.clock, network, model, profile, idle)
            if instances > 1:  # as ClusterClient builds it
                table = ProcessTable(
                    ttl_s=config.scheduler.program_ttl_s, critical_path=config.scheduler.policy == "atlas"
                )
                router = Router(
                    self.cluster.routing, self.cluster.locality_threshold, self.cluster.locality_max_imbalance
                )
                restarts = RestartPolicy.from_config(self.cluster)
                # With lending, the gManager beside the router: the dispatcher tells it of lost and restarted ones.
                cluster_lending = self.lending.lending if self.lending is not None else None
                self.dispatcher = Dispatcher(
                    [str(i) for i in range(instances)], router, table, self._dispatcher_now, cluster_lending, restarts
                )
        if len(self.instances) > 1 and getattr(cost, "contended", False):
            for iid, inst in self.instances.items():  # each step slows with the others stepping beside it
                inst.core.executor.contention = self._contention_beside(iid)  # type: ignore[attr-defined]
        # Every instance of the cluster, built here or not (``owned``).
        self.instance_ids = list(self.instances) if owned is None else [str(i) for i in range(instances)]
        if self.instances:
            self.core = next(iter(self.instances.values())).core  # the engine, for one instance
            self.max_model_len = min(i.core.max_model_len for i in self.instances.values())
        else:  # no engine here: the context they admit, as they are sized (no lending in a windowed run)
            plain = not self.cluster.disaggregated and self.cluster.kv_lending != "on"  # (see simulated_engine)
            self.max_model_len = size_engine(config, model.arch, model.dtype, release_windows=plain).max_model_len
        # Without compaction a prompt goes as it is, and one longer than an instance admits is refused.
        self.compact_prompts = compact_prompts
        self._lending_idle_beats = 0  # lending heartbeats in a row with no step started (a stall)
        # When lending gave up on a stall with work left: requests over one pool waiting for room no instance could
        # lend (docs/lending.md, "Two requests over one pool").
        self.lending_stalled_at: float | None = None
        self._lending_steps_seen = 0
        self._lending_wake_at: float | None = None  # the heartbeat the lending chain of wakes waits for, if any
        self.tokens = PromptTokens(model.identity.vocab_size, seed)
        self.placements: list[Placement] = []
        self.num_steps = 0  # engine steps (forward passes)
        self.num_scheduled = 0  # of which scheduled (one per multi-step window: --num-scheduler-steps)
        self.num_steps_alone = 0  # of which fast-forwarded (run back to back, off the heap)
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        self._calls: dict[str, _Call] = {}
        self.call_latencies: dict[str, list[float]] = {}  # call_kind -> each completed call's submit-to-finish
        self.call_outcomes: dict[str, CallOutcome] = {}  # request id -> what it produced, for each completed call
        self._ids = itertools.count()
        self._params: dict[int | None, SamplingParams] = {}  # the calls' sampling parameters, by output length
        self._ready: set[str] = set()  # idle instances that may have work to start
        self._open_programs = 0  # programs of the run not finished yet
        self._next_expiry = 0.0
        self._horizon = math.inf  # events from this time on wait (a windowed run's shard runs a window at a time)

    def _build_roles(
        self,
        config: EngineConfig,
        model: SimulatedModel,
        cost: StepCost,
        host_copy: LinkSpec,
        disk_cost: DiskCost,
        network: LinkSpec,
        instances_per_node: int,
        kv_bytes_per_token: int | None,
    ) -> None:
        """Prefill and decode engines behind the real :class:`PDDispatcher`, as ``make_pd_dispatcher`` builds it
        for a Ray or local cluster: ``p0``.. and ``d0``.. (in that order), one disk store shared by name, a
        storage link per node (``instances_per_node`` engines, or each its own) and a network link per engine,
        over which the KV handoffs and DE-read pushes cross (``sim/remote.py``). Under ``oracle`` reads cost
        nothing and cross no link, as the real cluster gives its engines no storage link then. Bytes moved are
        the profile's model's (``kv_bytes_per_token``) when it has one."""
        prefill, decode = self.cluster.roles
        roles = {f"p{i}": "prefill" for i in range(prefill)} | {f"d{i}": "decode" for i in range(decode)}
        per_node = instances_per_node if instances_per_node > 0 else 1
        oracle = self.cluster.kv_path == "oracle"
        if oracle:
            disk_cost = DiskCost(float("inf"), disk_cost.write_bytes_per_s, 0.0)
        fabric = self.fabric = KVFabric(lambda iid, t: self._at(t, _WAKE, iid), self.cluster.kv_handoff_timeout_s)
        store: OrderedDict[BlockHash, None] = OrderedDict()
        nodes: dict[str, str] = {}
        self._storage_of: dict[str, Link | None] = {}  # each engine's node storage link (None under oracle)

        def engine(iid: str, link: Link | None) -> EngineCore:
            net = Link(f"net-{iid}", network.bytes_per_s)
            remote = functools.partial(fabric.attach, iid, iid, net, network.latency_s)
            core = simulated_engine(
                config, model, cost, self.clock, None, host_copy, disk_cost, link, store, remote, kv_bytes_per_token
            )
            core.handoff_timeout_s = self.cluster.kv_handoff_timeout_s
            return core

        for rank, iid in enumerate(roles):
            nodes[iid] = f"node{rank // per_node}"
            if not oracle and rank % per_node == 0:
                self.storage_links.append(Link(f"storage-{nodes[iid]}", disk_cost.read_bytes_per_s * per_node))
            link = self._storage_of[iid] = self.storage_links[-1] if not oracle else None
            make = self._new_engine[iid] = functools.partial(engine, iid, link)
            self.instances[iid] = SimInstance(iid, make())
        members = {
            iid: PDInstance(
                role,  # type: ignore[arg-type]
                nodes[iid],
                iid,  # its fabric address
                self.instances[iid].core.layout.num_blocks * config.cache.block_size if role == "decode" else None,
            )
            for iid, role in roles.items()
        }
        table = ProcessTable(ttl_s=config.scheduler.program_ttl_s, critical_path=config.scheduler.policy == "atlas")
        pd_config = PDSchedulerConfig.from_configs(self.cluster, config.scheduler)
        restarts = RestartPolicy.from_config(self.cluster)
        self.dispatcher = PDDispatcher(
            members, table, self.clock, pd_config, config.cache.block_size, restarts=restarts
        )
        layout = next(iter(self.instances.values())).core.layout
        self._kv_bytes_per_token = kv_bytes_per_token or max(1, layout.bytes_per_block // layout.block_size)

    def _at(self, t: float, kind: int, payload: object) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def run(self, programs: list[ProgramSpec], progress: Progress | None = None) -> list[SimResult]:
        with quiet_collector():
            return self._run(programs, progress)

    def _run(self, programs: list[ProgramSpec], progress: Progress | None) -> list[SimResult]:
        sims = self._arrivals(programs)
        for failure in self.failures:
            self._at(failure.at_s, _FAIL, failure)
            if failure.hang:
                self._at(failure.detected_at(self.cluster.heartbeat_timeout_s), _DETECT, failure)
        self._advance(math.inf, progress)
        return self._results(sims)

    def _arrivals(self, programs: list[ProgramSpec]) -> list[SimProgram]:
        """The run's programs, each arriving (its first stage) at its arrival time."""
        sims = []
        for spec in programs:
            sims.append(SimProgram(spec))
            self._at(spec.arrival_s, _STAGE, sims[-1])
        self._open_programs = len(sims)
        return sims

    def _advance(self, horizon: float, progress: Progress | None = None) -> None:
        """Run the events before ``horizon`` (all of them: ``math.inf``) and the steps they start; those at or after
        it stay on the heap."""
        events, clock = self._events, self.clock
        self._horizon = horizon
        while self._ready or (events and events[0][0] < horizon):
            # Deliver every event due now (those it makes for now too), then start the idle instances' steps;
            # instances made ready while steps start (an idle step that applied ended streams) go round again.
            if not self._ready:
                if events[0][2] >= _FAIL and not self._open_programs:
                    heapq.heappop(events)  # a failure after every program finished: the run is over
                    continue
                clock.now = events[0][0]
            while events and events[0][0] <= clock.now:  # (fast-forwarded steps move the clock on)
                at, _, kind, payload = heapq.heappop(events)
                if kind == _STEP_END:
                    if payload.dead or payload.stuck or payload.step is None or at != payload.step_ends:  # type: ignore[attr-defined]
                        continue  # its instance stopped or is stuck mid-step (the step never ends), or it ends later
                    self._step_end(payload)  # type: ignore[arg-type]
                    if self.fast_forward:
                        self._step_alone(payload)  # type: ignore[arg-type]
                elif kind == _STAGE:
                    self._start_stage(payload)  # type: ignore[arg-type]
                elif kind == _CALL:
                    self._submit(*payload)  # type: ignore[misc]
                elif kind == _WAKE:
                    if self.instances[payload].step is None:  # type: ignore[index]
                        self._ready.add(payload)  # type: ignore[arg-type]  # a stream of this idle instance ended
                elif kind == _FAIL:
                    self._fail(payload)  # type: ignore[arg-type]
                elif kind == _STUCK:
                    self._watch_step(payload)  # type: ignore[arg-type]
                elif kind == _RESTART:
                    self._start_due_restarts()
                elif kind == _BACK:
                    self._rejoin(payload)  # type: ignore[arg-type]
                else:
                    self._lose(payload.instance_id, "heartbeat failed: GetTimeoutError")  # type: ignore[attr-defined]
            now = clock.now
            if self._beat_due(now):
                self._heartbeat(now)
                self._next_expiry = now + self.cluster.heartbeat_interval_s
            ready, self._ready = self._ready, set()
            for iid in sorted(ready):
                self._start_step(self.instances[iid])
            if progress is not None:
                progress(now)

    def _results(self, sims: list[SimProgram]) -> list[SimResult]:
        return [
            SimResult(
                sp.spec.program_id,
                sp.spec.arrival_s,
                sp.finish_s if sp.finish_s is not None else self.clock.now,
                sp.output_tokens,
                sp.failed_calls,
                sp.finish_s is not None,
            )
            for sp in sims
        ]

    def num_preemptions(self) -> int:
        """The engines' preemptions over the run."""
        return sum(i.core.stats().num_preemptions for i in self.instances.values())

    def helper_cpu_s(self) -> list[float]:
        """The CPU seconds each other process spent on the run (a windowed run's workers); none here."""
        return []

    def _dispatcher_now(self) -> float:
        """The dispatcher's clock: the virtual time (a windowed run's is when its router hears of a finish)."""
        return self.clock.now

    def _beat_due(self, now: float) -> bool:
        return self.dispatcher is not None and now >= self._next_expiry

    def _heartbeat(self, now: float) -> None:
        """As the transport's heartbeat loop: with roles, each engine's node storage read queue to the
        dispatcher; then programs idle past their TTL expire."""
        assert self.dispatcher is not None
        if isinstance(self.dispatcher, PDDispatcher):
            for iid, link in self._storage_of.items():
                if not self.dispatcher.views[iid].alive:
                    continue  # lost: the transport asks it nothing more
                queued = 0
                if link is not None:
                    link.advance(now)
                    queued = link.stats().queued_bytes
                self.dispatcher.report(iid, read_queue_tokens(queued, self._kv_bytes_per_token))
        self.dispatcher.expire()
        if self.lending is not None:
            self._lending_heartbeat(now)

    def _lending_heartbeat(self, now: float) -> None:
        """KV lending's part of the heartbeat (``sim/lending.py``): reports to the gManager (an instance mid-step
        reports at its step's end), a due plan's orders carried out by idle debtors at once (busy ones at their
        step's end); every instance looks again for work (blocks moved or freed). While work remains, the next
        heartbeat is an event, as the real loop's timer fires whether or not anything else happens, until nothing
        has stepped for ``LENDING_STALL_BEATS`` heartbeats."""
        assert self.lending is not None
        self.lending.heartbeat()
        self._lending_refused()
        self._ready.update(self.instances)
        self._lending_idle_beats = self._lending_idle_beats + 1 if self.num_steps == self._lending_steps_seen else 0
        self._lending_steps_seen = self.num_steps
        busy = [iid for iid, inst in self.instances.items() if not inst.dead and inst.core.has_unfinished()]
        self._lending_wake_at = None
        if busy and self._lending_idle_beats < LENDING_STALL_BEATS:
            self._lending_wake_at = now + self.cluster.heartbeat_interval_s
            self._at(self._lending_wake_at, _WAKE, busy[0])
        elif busy and self.lending_stalled_at is None:
            self.lending_stalled_at = now - LENDING_STALL_BEATS * self.cluster.heartbeat_interval_s

    # -- instances ---------------------------------------------------------------------------

    # -- failures (sim/failures.py) ------------------------------------------------------------

    def _fail(self, failure: InstanceFailure) -> None:
        """The instance stops; a crash is seen at once (Ray fails the calls to a dead actor as they are made), a hang
        at its detection event, ``heartbeat_timeout_s`` later. A stuck one does not stop: its step in flight (or its
        next) never ends, and the step watchdog finds it (``_watch_step``)."""
        if failure.stuck:
            inst = self.instances[failure.instance_id]
            inst.stuck = True
            if inst.step is not None:
                self._at(self._stuck_found_at(inst), _STUCK, inst)
            return
        self._stop(failure.instance_id)
        if not failure.hang:
            self._lose(failure.instance_id, "drain failed: RayActorError")

    def _stuck_found_at(self, inst: SimInstance) -> float:
        """When the front end's step watchdog finds ``inst`` stuck in its step in flight: at a heartbeat past
        ``step_timeout_s`` of the step, a heartbeat interval after that at the latest (the real loop's phase is
        not modelled: the latest is taken)."""
        found = inst.step_started + self.cluster.step_timeout_s + self.cluster.heartbeat_interval_s
        return max(self.clock.now, found)

    def _watch_step(self, inst: SimInstance) -> None:
        """The heartbeat's watchdog (``cluster/stuck_step.py``), on the report a stuck instance's heartbeat carries:
        its step in flight, how long it has run and its size."""
        if inst.dead or inst.step is None:
            return
        sched = inst.step[0]
        report = StepReport(self.clock.now - inst.step_started, len(sched.chunks), sched.num_tokens, sched.window)
        reason = stuck_step(report, self.cluster.step_timeout_s)
        if reason is not None:
            self._lose(inst.instance_id, reason)

    def _stop(self, instance_id: str) -> None:
        """The instance runs nothing more: its step in flight never ends (nor delivers its tokens), and its KV
        streams not ended by now never complete (their live ends time out: ``sim/remote.py``)."""
        inst = self.instances[instance_id]
        if inst.dead:
            return
        inst.dead, inst.step = True, None
        self._ready.discard(instance_id)
        if self.fabric is not None:
            self.fabric.lose(instance_id, self.clock.now)
        if self.lending is not None:
            self.lending.stop(instance_id)
            self._round_trips_lost(instance_id)

    def _round_trips_lost(self, instance_id: str) -> None:
        """The steps in flight over blocks on a stopped creditor: their next round trip to it gets no answer, and
        fails when its receive times out (``PartialClient.collect``: a peer that sends nothing is seen only then),
        ``kv_handoff_timeout_s`` from now; the step ends then, failed (``SimulatedLending.step_failed``), unless a
        round trip to another creditor that stopped before fails it sooner."""
        assert self.lending is not None
        for inst in self.instances.values():
            if inst.step is not None and self.lending.fails_over(inst.instance_id, inst.step[0], (instance_id,)):
                inst.step_ends = self.clock.now + self.cluster.kv_handoff_timeout_s
                self._at(inst.step_ends, _STEP_END, inst)

    def _lose(self, instance_id: str, reason: str) -> None:
        """Tell the dispatcher the instance is lost, as the transport's poller or heartbeat does, and carry out what
        it decides (its calls resent elsewhere, with the tokens they produced)."""
        assert self.dispatcher is not None
        self.lost.setdefault(instance_id, self.clock.now)
        self._carry_out(self.dispatcher.instance_lost(instance_id, reason))
        due = self.dispatcher.next_restart_at()
        if due is not None and due not in self._restart_checks:  # the front end's heartbeat finds it due then
            self._restart_checks.add(due)
            self._at(due, _RESTART, None)

    def _start_due_restarts(self) -> None:
        """The restarts due now, as the front end's heartbeat asks for them."""
        assert self.dispatcher is not None
        self._restart_checks.discard(self.clock.now)
        self._carry_out(self.dispatcher.restarts_due())

    def _rejoin(self, instance_id: str) -> None:
        """A restarted instance answers its first heartbeat: a fresh engine (an empty cache, the same sizes, links
        and store) in place of the lost one, whose steps and streams stay dead; the dispatcher takes it back."""
        assert self.dispatcher is not None
        old = self.instances[instance_id]
        inst = self.instances[instance_id] = SimInstance(instance_id, self._new_engine[instance_id]())
        if old.core.executor.contention is not None:  # type: ignore[attr-defined]
            inst.core.executor.contention = self._contention_beside(instance_id)  # type: ignore[attr-defined]
        if self.fabric is not None:
            self.fabric.rejoin(instance_id)
        if self.lending is not None:  # a fresh agent, as the restarted actor's (the others hear PeerBack)
            self.lending.rejoin(instance_id, inst.core)
        self.restarted[instance_id] = self.clock.now
        self._carry_out(self.dispatcher.instance_ready(instance_id))

    def _contention_beside(self, instance_id: str) -> Callable[[], float]:
        """The share of the other instances mid-step now: a step starting now runs beside them (a fitted
        profile's contention, as ``sim/step_model.py`` measures it from the steps' overlaps)."""
        others, instances = [iid for iid in self.instances if iid != instance_id], self.instances
        return lambda: sum(1 for iid in others if instances[iid].step is not None) / len(others)  # (restarts too)

    def _lending_wait(self, instance_id: str) -> None:
        """An instance with work it cannot start (a request awaiting the gManager's grant, or held back) waits for
        the next heartbeat: wake then, as the real loop's timer would, if no wake is already due and lending has not
        given up on a stall."""
        if self._lending_wake_at is None and self._lending_idle_beats < LENDING_STALL_BEATS:
            self._lending_wake_at = max(self.clock.now, self._next_expiry)
            self._at(self._lending_wake_at, _WAKE, instance_id)

    def _start_step(self, inst: SimInstance) -> None:
        end = self._begin_step(inst)
        if end is not None:
            self._at(end, _STEP_END, inst)

    def _step_alone(self, inst: SimInstance) -> None:
        """Fast-forward, just after ``inst``'s step ended: while it is the only instance to start a step now,
        nothing else is due now (no event, no heartbeat), and nothing is due before its next step ends either,
        run that step here and end it at once, as the event loop would have, without the heap. Nothing else
        happens meanwhile, so every engine call and every event is as without it (the step's event would have
        been the next one out of the heap)."""
        events, clock, iid = self._events, self.clock, inst.instance_id
        while self._ready == {iid} and not (events and events[0][0] <= clock.now) and not self._beat_due(clock.now):
            self._ready.clear()
            end = self._begin_step(inst)
            if end is None:
                return
            if (events and events[0][0] <= end) or self._beat_due(end) or end >= self._horizon:
                # Something else comes first (or at the same time, queued before), or the step ends in a later window.
                self._at(end, _STEP_END, inst)
                return
            clock.now = end
            self.num_steps_alone += 1
            self._step_end(inst)

    def _begin_step(self, inst: SimInstance) -> float | None:
        """Start the instance's next step: the time it ends, or None when it has none to run now."""
        if inst.step is not None or inst.dead or not inst.core.has_unfinished():
            return None
        sched = inst.core.schedule()
        if sched.is_empty:  # nothing it can run until a call arrives or ends
            if self.lending is not None:
                self._lending_wait(inst.instance_id)
            return None
        result = inst.core.execute(sched)
        elapsed = result.elapsed_s
        if self.lending is not None and self.lending.fails_over(inst.instance_id, sched, self.lending.control.down):
            elapsed = self.cluster.kv_handoff_timeout_s  # its round trip waits for a stopped creditor, in vain
        if not sched.chunks and result.elapsed_s == 0 and sched.num_remote_in_flight:
            # Nothing to compute, and its streams end at a time not known yet (a peer has not sent): the step
            # is applied now and the instance sleeps until the fabric wakes it (or a call comes).
            reported = result.remote_report.recvs or result.remote_report.sends or result.tier_report.reads
            for delta in inst.core.finish_step(sched, result):
                self._on_delta(inst.instance_id, delta)
            if reported:
                self._ready.add(inst.instance_id)
            return None
        inst.step, inst.step_started = (sched, result), self.clock.now
        if inst.stuck:  # the step it was stuck in: it never ends
            self._at(self._stuck_found_at(inst), _STUCK, inst)
        self.num_steps += sched.window  # forward passes (a multi-step window runs several)
        self.num_scheduled += 1
        inst.step_ends = self.clock.now + elapsed
        return inst.step_ends

    def _step_end(self, inst: SimInstance) -> None:
        sched, result = inst.step  # type: ignore[misc]
        inst.step = None
        self._ready.add(inst.instance_id)
        # A step over blocks on a creditor lost meanwhile fails (its round trip does): dropped, and run again.
        failed = self.lending is not None and self.lending.step_failed(inst.instance_id, sched)
        for delta in [] if failed else inst.core.finish_step(sched, result):
            self._on_delta(inst.instance_id, delta)
        if self.lending is not None:
            if self.lending.between_steps(inst.instance_id) or failed:
                self._ready.update(self.instances)  # blocks moved or freed: the creditors' room changed too
            self._lending_refused()

    def _lending_refused(self) -> None:
        """The calls the gManager's refusals failed (the live instances could not hold them): their final deltas
        go to the dispatcher and the programs, as the real loop sends them."""
        assert self.lending is not None
        for instance_id, delta in self.lending.take_refused():
            self._on_delta(instance_id, delta)

    def _on_delta(self, instance_id: str, delta: RequestDelta) -> None:
        # With roles, the prefill engine's handoff shows as an unfinished delta, and a delta nobody waits for shows
        # as None; what follows from a delta is carried out either way (a call placed again after its push failed
        # shows nothing).
        shown: RequestDelta | None = delta
        decisions: Sequence[PDDecision] = ()
        if self.dispatcher is not None:
            shown, decisions = self.dispatcher.receive(instance_id, delta)
        if shown is not None and (call := self._calls.get(shown.request_id)) is not None:
            call.output_token_ids.extend(shown.new_token_ids)
            if shown.finished:
                del self._calls[shown.request_id]
                self.call_outcomes[shown.request_id] = CallOutcome(len(call.output_token_ids), call.spec.output)
                if shown.finish_reason == "error":  # the server answers it with an error: a failed call
                    self._refused(call)
                else:
                    self._call_done(call)
        self._carry_out(decisions)

    # -- programs ----------------------------------------------------------------------------

    def _start_stage(self, sp: SimProgram) -> None:
        if sp.stage == 0 and sp.rng is None:  # it arrives (its tokens are its own generator's: drawn now or before)
            sp.rng, sp.system = self.tokens.start(sp.spec)
        if sp.stage >= len(sp.spec.stages):
            sp.finish_s = self.clock.now
            self._open_programs -= 1
            sp.rng, sp.system, sp.contexts, sp.outputs = None, [], {}, {}
            return
        stage = sp.spec.stages[sp.stage]
        sp.pending = len(stage)
        for call in stage:
            self._at(self.clock.now + call.tool_wait_s, _CALL, (sp, call))

    def _submit(self, sp: SimProgram, spec: CallSpec) -> None:
        assert sp.rng is not None, "a call of a program that has not arrived"
        new_input = self.tokens.draw(sp.rng, spec.new_input)
        limit = self.max_model_len if self.compact_prompts else 1 << 62
        prompt = call_prompt(spec, sp.system, sp.contexts, sp.outputs, new_input, limit)
        rid = f"c{next(self._ids)}"
        params = self._params.get(spec.output)  # (immutable: one per output length, checked once)
        if params is None:
            # Nothing reads a simulated call's text: its tokens are decoded by no one (the engine skips that work).
            params = SamplingParams(max_tokens=spec.output, ignore_eos=True, detokenize=False)
            self._params[spec.output] = params
        program = ProgramRef(sp.spec.program_id, spec.thread_id, spec.parents)
        call = _Call(sp, spec, prompt, submit_s=self.clock.now)
        if self.dispatcher is None:
            self._add(call, Send("0", rid, prompt, params, program, None))
            return
        self._calls[rid] = call  # the dispatcher's decisions name it by its id
        self._carry_out(self.dispatcher.submit(rid, prompt, params, program))

    def _carry_out(self, decisions: Iterable[PDDecision]) -> None:
        """Carry out the dispatcher's decisions and those that follow, as ``DispatcherFrontEnd`` does, with the
        instances at hand (``MarkDead``: the transport kills the instance, so a hung one stays stopped)."""
        queue = deque(decisions)
        while queue:
            decision = queue.popleft()
            if isinstance(decision, Send):
                queue.extend(self.dispatcher.add_done(decision, self._add(self._calls[decision.request_id], decision)))  # type: ignore[union-attr]
            elif isinstance(decision, Prepare):
                queue.extend(self.dispatcher.prepare_done(decision, self._prepare(decision)))  # type: ignore[union-attr]
            elif isinstance(decision, Continue):
                queue.extend(self.dispatcher.continue_done(decision, self._continue(decision)))  # type: ignore[union-attr]
            elif isinstance(decision, AbortOn):
                self.instances[decision.instance_id].core.abort(decision.request_id)
                self._ready.add(decision.instance_id)
            elif isinstance(decision, MarkDead):
                self._stop(decision.instance_id)
            elif isinstance(decision, PeerLost):  # it frees what it lent the lost one, recomputes what it held
                self.lending.peer_lost(decision.instance_id, decision.lost)  # type: ignore[union-attr]
                self._ready.update(self.instances)
            elif isinstance(decision, PeerBack):
                self.lending.peer_back(decision.instance_id, decision.address)  # type: ignore[union-attr]
            elif isinstance(decision, Restart):  # its first heartbeat once started (a model's load)
                self._at(self.clock.now + self.instance_startup_s, _BACK, decision.instance_id)
            elif isinstance(decision, Fail):  # refused, or no live instance left to take it
                call = self._calls.pop(decision.request_id, None)
                if call is not None:
                    self._refused(call)

    def _add(self, call: _Call, send: Send) -> AddResult:
        core = self.instances[send.instance_id].core
        try:
            call.request = core.add_request(
                send.request_id,
                send.prompt,
                send.params,
                program=send.program,
                resume=send.resume,
                handoff=send.handoff,
            )
        except InvalidRequestError as e:  # as the benchmark: counted, and the program goes on with what it has
            if self.dispatcher is None:
                self._refused(call)
            return AddResult("invalid", str(e), e)
        self._calls[send.request_id] = call
        self.placements.append(
            Placement(send.request_id, call.program.spec.program_id, send.instance_id, len(send.prompt), self.clock.now)
        )
        self._ready.add(send.instance_id)
        return AddResult("ok")

    def _prepare(self, prepare: Prepare) -> PrepareResult:
        """Make a decode engine ready for a call its prefill engine will hand over."""
        core = self.instances[prepare.instance_id].core
        try:
            answer = core.prepare_intake(
                prepare.request_id, prepare.prompt, prepare.params, prepare.plan, program=prepare.program
            )
        except InvalidRequestError as e:
            return PrepareResult("invalid", message=str(e), refusal=e)
        self._ready.add(prepare.instance_id)  # under DE-read it loads and pushes the stored prefix
        return PrepareResult("ok", answer)

    def _continue(self, cont: Continue) -> AddResult:
        if not self.instances[cont.instance_id].core.continue_request(cont.request_id, cont.resume):
            return AddResult("failed", "the decode engine no longer holds the call")
        self._ready.add(cont.instance_id)
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
        kind = call_kind(call.spec, len(sp.spec.stages[sp.stage]))
        self.call_latencies.setdefault(kind, []).append(self.clock.now - call.submit_s)
        self._end_call(sp)

    def _end_call(self, sp: SimProgram) -> None:
        sp.pending -= 1
        if sp.pending == 0:
            sp.stage += 1
            self._start_stage(sp)

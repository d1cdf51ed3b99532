"""KV lending (Infinite-LLM) in the simulator: the real agents, rManagers and gManager, on the virtual clock.

Every decision is the real system's: each simulated engine gets an
:class:`~boundless.engine.lending.LendingAgent` with its :class:`~boundless.cluster.rmanager.RManager` (the ledger
and the try/send/confirm protocol, the engine's ``lend_leading_blocks`` / ``allocate_unowned`` bookkeeping, the
``stalled_growth`` view), between agents over a :class:`~boundless.engine.lending.LocalControlPlane`; the
heartbeats carry the rManagers' reports and the engines' recorded step times to the real
:class:`~boundless.cluster.lending_cluster.ClusterLending` and its :class:`~boundless.cluster.gmanager.GManager`,
which fits its performance model and plans (Algorithm 1) when due, and each debtor carries out its orders between
its steps, as ``cluster/lending_instance.py`` does in a Ray cluster.

Only the tensors' side (:class:`~boundless.engine.lending.LendingData`) is replaced, as ``sim/remote.py`` replaces
the KV streams' executor side:

- **a move's blocks** cross the debtor's ``network`` link (a :class:`~boundless.cluster.links.Link` in virtual
  time, queued behind its other sends); the debtor runs the protocol synchronously between its steps, as the real
  agent does, so its next step starts once the last byte has arrived (the wait is added to that step);
- **a step over lent blocks** (:class:`LendingStepCost`) costs the step model over the debtor's *local* context,
  plus per layer what the round trip to its creditors exposes: the query rows out to every creditor and their
  partials (m, e, o) back over the debtor's link (full duplex: latency each way plus the larger direction's
  bytes over the bandwidth) and the slowest creditor's partial attention, which is the
  step model's marginal cost of attending over that creditor's tokens, less the debtor's own local attention,
  which overlaps it (the queries go out first). The creditor's GPU does that work too: when it is running a step
  of its own meanwhile, the seconds are added to its next step (an idle creditor computes them in its idle time).
  The marginal cost under the roofline model is at most what the partials would cost as a kernel of their own.

Bytes are the profile model's (fp32 queries and partials, as on the wire; the blocks at the profile model's KV
bytes per token).

Instances may fail (``sim/failures.py``). A stopped one answers no control message (a move to or from it fails at
once: the wait of a call to a hung actor is not modelled), sends no report and carries out no order. A step in
flight over its blocks, or one started over them, gets no partials: it ends ``kv_handoff_timeout_s`` after the
stop (or its start), failed, as the real round trip's receive times out, and the debtor takes the creditor as lost
(``InstanceLending.step_failed``, ``LendingAgent.round_trip_failed``). When the dispatcher is told an instance is
lost, the real :class:`ClusterLending` (passed to it, as the Ray client passes its own) drops it from the gManager
and makes a ``PeerLost`` for every other instance, whose agent's ``peer_lost`` frees what it lent the lost one and
recomputes the requests that had blocks there (``preempt_to_recompute``), at once, mid-step too, as a Ray instance's
handler runs while its loop steps. A restarted instance is a fresh engine with a fresh agent and rManager, and the
others hear ``PeerBack`` (``Dispatcher.instance_ready``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from boundless.cluster.gmanager import GManager
from boundless.cluster.lending_cluster import ClusterLending, LendingOrder
from boundless.cluster.links import Link, Traffic, gbps_to_bytes_per_s
from boundless.cluster.rmanager import RManager
from boundless.config import ClusterConfig, ConfigError, EngineConfig
from boundless.engine.attention_time import ChunkShape, shapes_of
from boundless.engine.builder import size_engine
from boundless.engine.core import EngineCore, RequestDelta
from boundless.engine.lending import LendingAgent, LocalControlPlane, PartialCounters
from boundless.engine.lending_stats import LendingStats
from boundless.engine.scheduler import SchedulerOutput
from boundless.sim.cost import StepCost
from boundless.sim.engine import SimulatedModel
from boundless.sim.links import LinkSpec
from boundless.sim.profiles import HardwareProfile, kv_links

Clock = Callable[[], float]

# A partial request's header and a reply's status, bytes (docs/distributed-attention.md, "The protocol").
HEADER_BYTES = 8 * 8
STATUS_BYTES = 2 * 8
FLOAT_BYTES = 4  # queries and partials travel as fp32


@dataclass(frozen=True)
class AttentionShape:
    """What sizes a round trip: the layers that each make one, and a query row's heads and head size."""

    layers: int
    q_heads: int
    head_dim: int

    def query_bytes(self, rows: int) -> int:
        return HEADER_BYTES + rows * self.q_heads * self.head_dim * FLOAT_BYTES

    def partial_bytes(self, rows: int) -> int:
        return STATUS_BYTES + rows * self.q_heads * (self.head_dim + 2) * FLOAT_BYTES  # m, e and o


@dataclass
class _Done:
    """A send or receive that has already happened in virtual time (its cost is charged elsewhere)."""

    block_ids: list[int] = field(default_factory=list)

    def wait(self, timeout_s: float | None = None) -> None:
        """Nothing left to wait for."""

    def cancel(self) -> None:
        """Nothing left to give up."""


@dataclass
class SimulatedLendingData:
    """One instance's tensor side of lending in virtual time (see the module): its network link, the seconds
    owed to its next step (moves it sent, partials it computed for debtors) and DistAttention's counters."""

    instance_id: str
    link: Link
    latency_s: float
    bytes_per_block: int
    clock: Clock
    owed_s: float = 0.0
    round_trips: int = 0
    round_trip_bytes: int = 0
    partials_served: int = 0
    remote_layers: int = 0
    exposed_wait_s: float = 0.0
    move_bytes: int = 0
    debtors: set[str] = field(default_factory=set)

    def send_blocks(self, creditor: str, tag: int, block_ids: Sequence[int]) -> _Done:
        now = self.clock()
        nbytes = len(block_ids) * self.bytes_per_block
        transfer = self.link.submit(nbytes, now, Traffic.KV)
        arrives = self.link.estimated_finish(transfer) + self.latency_s
        self.owed_s += max(0.0, arrives - now)  # the debtor waits for its confirmation before stepping on
        self.move_bytes += nbytes
        return _Done()

    def receive_blocks(self, debtor: str, tag: int, block_ids: Sequence[int], move_id: str) -> _Done:
        return _Done(list(block_ids))

    def serve(self, debtor: str) -> None:
        self.debtors.add(debtor)

    def counters(self) -> PartialCounters:
        return PartialCounters(
            self.round_trips, self.round_trip_bytes, self.partials_served, self.remote_layers, self.exposed_wait_s
        )

    def close(self) -> None:
        """Nothing runs in the background in virtual time."""

    def take_owed(self) -> float:
        owed, self.owed_s = self.owed_s, 0.0
        return owed


def _predict(cost: StepCost, shapes: Sequence[ChunkShape], contention: float = 0.0) -> float:
    # A contended profile (a fitted one's per_contention_s) takes the contention; a roofline one does not.
    if contention:
        return cost.predict(shapes, contention)  # type: ignore[attr-defined]
    return cost.predict(shapes)  # type: ignore[attr-defined]


class LendingStepCost:
    """A step's seconds on an instance that may attend over lent blocks (see the module); ``base`` is the
    profile's step model, which must predict from chunk shapes (``predict``)."""

    def __init__(
        self,
        base: StepCost,
        data: SimulatedLendingData,
        peers: dict[str, SimulatedLendingData],
        shape: AttentionShape,
        network: LinkSpec,
        idle: Callable[[str], bool],
    ) -> None:
        if not hasattr(base, "predict"):
            raise ConfigError("--kv-lending: the simulator needs a --profile (a step model over chunk shapes)")
        self.base = base
        self.data = data
        self.peers = peers
        self.shape = shape
        self.network = network
        self.idle = idle

    def step_time(self, sched: SchedulerOutput, contention: float = 0.0) -> float:
        """``contention``: how much the other instances step beside this one, for a contended profile (the
        simulator passes it when the profile's steps slow with it, as on ``cpu-served-2inst``)."""
        owed = self.data.take_owed()
        if not any(c.remote for c in sched.chunks):
            base = self.base.step_time(sched, contention) if contention else self.base.step_time(sched)  # type: ignore[call-arg]
            return base + owed
        shapes = shapes_of(sched)
        local_shapes = [
            ChunkShape(s.cached - sum(r.num_tokens for r in c.remote), s.new)
            for s, c in zip(shapes, sched.chunks, strict=True)
        ]
        local = _predict(self.base, local_shapes, contention)
        local_attention = local - _predict(self.base, [ChunkShape(0, s.new) for s in local_shapes], contention)
        layers = self.shape.layers
        computes, sent, received = [], 0, 0
        for creditor, rows, tokens in _by_creditor(sched):
            # The creditor's partials: the step model's marginal cost of attending over its tokens as well.
            with_remote = [
                ChunkShape(s.cached + tokens.get(c.request_id, 0), s.new)
                for s, c in zip(local_shapes, sched.chunks, strict=True)
            ]
            compute = max(0.0, _predict(self.base, with_remote, contention) - local)
            computes.append(compute)
            sent += self.shape.query_bytes(rows)
            received += self.shape.partial_bytes(rows)
            self.data.round_trips += layers
            self.data.round_trip_bytes += layers * (self.shape.query_bytes(rows) + self.shape.partial_bytes(rows))
            peer = self.peers.get(creditor)
            if peer is not None:
                peer.partials_served += layers
                if not self.idle(creditor):  # its GPU computes them beside its own step: the next one takes longer
                    peer.owed_s += compute
        # Per layer: every creditor's queries leave on the debtor's NIC and their partials come back on it (full
        # duplex), one latency each way; the slowest creditor's compute sets the rest.
        wire = 2 * self.network.latency_s + max(sent, received) / self.network.bytes_per_s
        exposed = max(0.0, wire + max(computes) / layers - local_attention / layers)
        self.data.remote_layers += layers
        self.data.exposed_wait_s += layers * exposed
        return local + layers * exposed + owed


def _by_creditor(sched: SchedulerOutput) -> list[tuple[str, int, dict[str, int]]]:
    """Each creditor of the step: the query rows sent to it and, per request, the tokens it holds."""
    out: dict[str, tuple[int, dict[str, int]]] = {}
    for chunk in sched.chunks:
        for remote in chunk.remote:
            rows, tokens = out.get(remote.creditor, (0, {}))
            tokens[chunk.request_id] = tokens.get(chunk.request_id, 0) + remote.num_tokens
            out[remote.creditor] = (rows + len(chunk.token_ids), tokens)
    return [(creditor, rows, tokens) for creditor, (rows, tokens) in sorted(out.items())]


class SimulatedLending:
    """The cluster's lending in a simulation: an agent per engine, the gManager beside the router, and the orders
    each debtor carries out between its steps (see the module). Instance ids are the agents' addresses."""

    def __init__(
        self,
        cores: dict[str, EngineCore],
        cluster: ClusterConfig,
        clock: Clock,
        network: LinkSpec,
        shape: AttentionShape,
        bytes_per_block: int,
        idle: Callable[[str], bool],
    ) -> None:
        self.cluster = cluster
        self.clock = clock
        self.network = network
        self.shape = shape
        self.bytes_per_block = bytes_per_block
        self.idle = idle  # whether an instance is between steps (where its loop carries out move orders)
        self.control = LocalControlPlane()  # its ``down``: the instances stopped (dead or hung), which answer nothing
        self.data: dict[str, SimulatedLendingData] = {}
        self.agents: dict[str, LendingAgent] = {}
        self.retired: list[LendingAgent] = []  # the agents of lost instances, whose counts the totals keep
        for iid, core in cores.items():
            self._attach(iid, core)
        self.lending = ClusterLending(GManager.from_config(cluster, clock), {iid: iid for iid in cores})
        self._orders: dict[str, deque[LendingOrder]] = {iid: deque() for iid in cores}
        self._failing: dict[str, set[str]] = {}  # instance -> the stopped creditors its step in flight attends over
        self._refused: list[tuple[str, RequestDelta]] = []  # (instance, final delta) of refused requests

    def _attach(self, instance_id: str, core: EngineCore) -> None:
        """An agent with its rManager for the engine, and its steps priced with what lending adds."""
        cluster, network = self.cluster, self.network
        num_blocks = core.layout.num_blocks
        rm = RManager(
            instance_id,
            num_blocks,
            core.layout.block_size,
            core.clock,
            cluster.lending_reservation_timeout_s,
            headroom_blocks=int(cluster.lending_creditor_headroom * num_blocks),
        )
        link = Link(f"net-{instance_id}", network.bytes_per_s)
        data = SimulatedLendingData(instance_id, link, network.latency_s, self.bytes_per_block, self.clock)
        self.data[instance_id] = data
        self.agents[instance_id] = self.control.add(
            LendingAgent(
                core,
                rm,
                None,
                self.control,
                cluster.kv_handoff_timeout_s,
                data=data,
                lookahead_chunks=cluster.lending_lookahead_chunks,
            )
        )
        executor = core.executor  # the cost-model executor: its steps now cost what lending adds
        executor.cost = LendingStepCost(executor.cost, data, self.data, self.shape, network, self.idle)  # type: ignore[attr-defined]

    def heartbeat(self) -> bool:
        """The router's heartbeat round: each instance's rManager reports (with the step times its engine
        recorded), one mid-step too, as the real one does (the engine loop holds its lock only between steps, and
        the report counts the step in flight as done: ``Scheduler.tokens_after_step``), so a step longer than the
        heartbeat timeout does not leave its instance out of the plans; then a due plan's orders go to their
        debtors. A stopped instance reports nothing. Whether blocks moved."""
        for iid in self.agents:
            if iid not in self.control.down:
                self._report(iid)
        return self._plan()

    def between_steps(self, instance_id: str) -> bool:
        """What the instance's loop does between steps: tell its rManager the engine's state (releasing the remote
        blocks of requests it dropped) and carry out its orders. Whether any blocks moved."""
        self.agents[instance_id].observe()
        return self._carry_out(instance_id)

    # -- failures (sim/failures.py) ---------------------------------------------------------------------------

    def stop(self, instance_id: str) -> None:
        """The instance stopped (died or hung): it answers no control message and carries out no order."""
        self.control.down.add(instance_id)
        self._orders[instance_id].clear()
        self._failing.pop(instance_id, None)

    def peer_lost(self, instance_id: str, lost: str) -> None:
        """The cluster's ``PeerLost``: the instance's agent frees what it lent ``lost`` and recomputes the requests
        whose blocks were there; at once, mid-step too (the real actor's handler takes the engine loop's lock, which
        the loop does not hold while a step runs). A stopped instance hears nothing."""
        if instance_id not in self.control.down:
            self.agents[instance_id].peer_lost(lost)

    def peer_back(self, instance_id: str, address: str) -> None:
        """The cluster's ``PeerBack``: the instance at ``address``, lost before, may lend and borrow again."""
        if instance_id not in self.control.down:
            self.agents[instance_id].peer_back(address)

    def fails_over(self, instance_id: str, sched: SchedulerOutput, stopped: Collection[str]) -> bool:
        """Record which of the ``stopped`` creditors the instance's step (starting, or in flight) attends over: its
        round trip to them gets no answer, and the step fails (``step_failed``). Whether it was not failing
        already (the first round trip to time out ends it)."""
        lost = {r.creditor for c in sched.chunks for r in c.remote} & set(stopped)
        if not lost:
            return False
        failing = instance_id in self._failing
        self._failing.setdefault(instance_id, set()).update(lost)
        return not failing

    def step_failed(self, instance_id: str, sched: SchedulerOutput) -> bool:
        """Whether the step ended in a failed round trip (``fails_over``); if so it is dropped (its chunks run
        again) and the agent takes those creditors as lost, as ``InstanceLending.step_failed`` does."""
        lost = self._failing.pop(instance_id, None)
        if not lost:
            return False
        agent = self.agents[instance_id]
        agent.core.scheduler.step_failed(sched)
        for creditor in sorted(lost):
            agent.round_trip_failed(creditor)
        return True

    def rejoin(self, instance_id: str, core: EngineCore) -> None:
        """A restarted instance: a fresh agent and rManager over its fresh engine (the lost one's counts stay in
        the totals); it reports from the next heartbeat."""
        self.retired.append(self.agents[instance_id])
        self._attach(instance_id, core)
        self.control.down.discard(instance_id)

    # -- plans ------------------------------------------------------------------------------------------------

    def _report(self, instance_id: str) -> None:
        agent = self.agents[instance_id]
        agent.observe()
        agent.apply(agent.rm.expire())
        self.lending.on_heartbeat(agent.heartbeat())

    def _plan(self) -> bool:
        """A plan, if one is due (every live instance reported since the last); idle debtors carry out their
        orders at once, busy ones between their steps. An order to a stopped instance is never carried out."""
        for order in self.lending.orders():
            if order.instance_id not in self.control.down:
                self._orders[order.instance_id].append(order)
        moved = False
        for iid in sorted(self._orders):
            if self._orders[iid] and self.idle(iid):
                moved |= self._carry_out(iid)
        return moved

    def _carry_out(self, instance_id: str) -> bool:
        agent, orders, moved = self.agents[instance_id], self._orders[instance_id], False
        while orders:
            moved |= agent.carry_out(orders.popleft())
        self._refused += [(instance_id, d) for d in agent.take_refused()]
        return moved

    def take_refused(self) -> list[tuple[str, RequestDelta]]:
        """The final deltas of the requests the gManager's refusals failed since the last call, with their
        instances, for the simulator to deliver as the real loop sends them."""
        out, self._refused = self._refused, []
        return out

    def totals(self) -> dict[str, float]:
        """What lending did over the run, summed over the instances (lost ones included)."""
        agents = [*self.retired, *self.agents.values()]
        total = LendingStats.total(a.snapshot() for a in agents)
        gm = self.lending.gm.counters
        return {
            "plans": gm.plans,
            "moves_ordered": gm.moves_ordered,
            "moves": total.moves_out,
            "blocks_moved": total.blocks_out,
            # The bytes the simulated data side moved: the profile's model's when it states one, not --model's.
            "bytes_moved": sum(a.data.move_bytes for a in agents),  # type: ignore[attr-defined]
            "round_trips": total.round_trips,
            "round_trip_bytes": total.round_trip_bytes,
            "exposed_wait_s": total.exposed_wait_s,
            "requests_recomputed": total.requests_recomputed,
            "requests_held": total.requests_held,
            "requests_granted": total.requests_granted,
            "requests_refused": total.requests_refused,
        }


def lending_max_model_len(config: EngineConfig, model: SimulatedModel, pools: float) -> int:
    """With lending a request may hold ``pools`` pools' worth of KV, not one (as ``size_engine``'s ``pools``); the
    simulated model's position limit does not apply (nothing runs it)."""
    layout = size_engine(config, model.arch, model.dtype)
    return int(layout.num_blocks * pools) * layout.block_size


def simulated_lending(
    cores: dict[str, EngineCore],
    cluster: ClusterConfig,
    clock: Clock,
    network: LinkSpec,
    model: SimulatedModel,
    profile: HardwareProfile | None,
    idle: Callable[[str], bool],
) -> SimulatedLending:
    """Lending over these engines, its bytes and round trips sized by the profile's model when it states one (a
    roofline GPU profile), else by ``model``'s; ``--net-gbps``, when given, sets each instance's network link."""
    if cluster.net_gbps is not None:  # (a split instance's GPUs each lend and borrow their share over a NIC of its own)
        network = LinkSpec(gbps_to_bytes_per_s(cluster.net_gbps) * kv_links(profile), network.latency_s)
    shape = getattr(profile.step, "shape", None) if profile is not None else None
    layout = next(iter(cores.values())).layout
    if shape is not None:
        attention = AttentionShape(shape.layers, shape.q_heads, shape.head_dim)
        block_bytes = shape.kv_bytes_per_token * layout.block_size
    else:
        arch = model.arch
        attention = AttentionShape(arch.num_layers, arch.num_heads, arch.head_dim)
        block_bytes = layout.bytes_per_block
    return SimulatedLending(cores, cluster, clock, network, attention, block_bytes, idle)

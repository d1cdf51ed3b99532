"""The cluster's decisions, as plain code over plain data: which instance takes a call, what the
router knows of programs, which calls are in flight where, and what happens when an instance fails.

A :class:`Dispatcher` is told what happened (a call arrived, an instance answered an ``add``, an
instance was lost, a delta came, a call was aborted) and answers with decisions: :class:`Send` a
call to an instance (with its program's global service and, after a failover, where it left off),
:class:`Fail` a call, :class:`MarkDead` an instance, :class:`AbortOn` an instance. It never does
I/O, sleeps or starts threads, and reads time only from the clock it is given; the Ray transport
(:mod:`boundless.cluster.client`) carries its decisions out, and a simulator can do the same with
simulated instances. A lost instance is started again after a delay (:class:`~boundless.cluster.restarts.Restart`,
``cluster/restarts.py``), and takes calls again from the first heartbeat of its new self
(:meth:`Dispatcher.instance_ready`).

An instance that does not answer (dead or hung) is marked dead and its calls go elsewhere; an
instance that answers with an error fails that one call and keeps serving, so a request that trips
a bug cannot take the cluster down instance by instance.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from boundless.cluster.lending_cluster import ClusterLending, PeerBack, PeerLost
from boundless.cluster.restarts import Restart, RestartPolicy, Restarts
from boundless.cluster.routing import InstanceView, LoadIndex, NoLiveInstanceError, Router
from boundless.engine.core import RequestDelta, Resume
from boundless.engine.errors import InvalidRequestError
from boundless.engine.handoff import HandoffPlan
from boundless.engine.sampling_params import SamplingParams
from boundless.programs.process_table import ProcessTable
from boundless.programs.ref import ProgramRef


@dataclass
class InflightCall:
    """A call as the router tracks it, enough to resend it elsewhere."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    program: ProgramRef | None
    instance: str = ""  # where it runs, once an instance took it
    output_token_ids: list[int] = field(default_factory=list)
    text_chars_sent: int = 0
    failovers: int = 0
    # The prompt's tokens a cache served it where it first ran, what every delta reports (None: nothing heard yet). A
    # call resumed on another instance after a failover is its prompt and its output so far there, which that
    # instance's count measures; one engine keeps its first admission's count through preemptions alike.
    prompt_cached_tokens: int | None = None


AddStatus = Literal["ok", "invalid", "busy", "failed", "unreachable"]


@dataclass(frozen=True)
class AddResult:
    """An instance's answer to an ``add``.

    The instance itself answers ``ok``, ``invalid`` (the request cannot be served as asked) or
    ``busy`` (its queue is full). The transport answers for it ``failed`` when ``add`` raised there
    (the instance lives; this call fails) and ``unreachable`` when the instance did not answer
    (it died or hung; the call goes elsewhere). An ``invalid`` answer carries the instance's error whole
    (``refusal``): its field, OpenAI code and what did not fit reach the client as the instance said them.
    """

    status: AddStatus
    message: str = ""
    refusal: InvalidRequestError | None = None


@dataclass(frozen=True)
class Send:
    """Add a call on ``instance_id``; ``program`` carries the program's global service and waiting,
    ``resume`` the tokens a failed-over call already produced (None for a fresh call), ``handoff`` makes the
    instance the call's prefill engine (``cluster/pd_dispatcher.py``)."""

    instance_id: str
    request_id: str
    prompt: list[int]
    params: SamplingParams
    program: ProgramRef | None
    resume: Resume | None
    handoff: HandoffPlan | None = None


FailReason = Literal["invalid", "busy", "failed", "unavailable"]


@dataclass(frozen=True)
class Fail:
    """The call ends with an error: ``invalid`` or ``busy`` as its instance answered, ``failed`` when
    ``add`` raised on its instance, ``unavailable`` when no live instance is left."""

    request_id: str
    reason: FailReason
    message: str
    refusal: InvalidRequestError | None = None


@dataclass(frozen=True)
class MarkDead:
    """The instance gets no more calls; the transport stops it (a hung one must not come back)."""

    instance_id: str
    reason: str


@dataclass(frozen=True)
class AbortOn:
    """Tell the instance to drop a call nobody waits for any more."""

    instance_id: str
    request_id: str


Decision = Send | Fail | MarkDead | AbortOn | PeerLost | PeerBack | Restart


class Dispatcher:
    """Routing, the router's process table, in-flight calls and failover for a set of instances.

    Every call reaches an instance through here, so each instance's load (calls in flight) is exact.
    A call is *pending* between its :class:`Send` and the instance's answer (:meth:`add_done`), then
    *in flight* until its final delta, an abort, or its instance's loss (which resends it). Whatever changes a
    view's load or liveness refiles it in ``load_index``, which the router reads in place of a pass over the views.
    A lost instance is started again as ``restarts`` says (none without a policy); it is not alive, and gets no call,
    until it is ready.
    """

    def __init__(
        self,
        instance_ids: Iterable[str],
        router: Router,
        table: ProcessTable,
        clock: Callable[[], float],
        lending: ClusterLending | None = None,
        restarts: RestartPolicy | None = None,
    ) -> None:
        self.views: dict[str, InstanceView] = {iid: InstanceView(iid) for iid in instance_ids}
        self.restarts = Restarts(restarts or RestartPolicy(max_restarts=0), self.views)
        self.load_index = LoadIndex(self.views.values())  # the views by load, refiled on every change below
        self.router = router
        self.table = table
        table.track_removed = True  # the router forgets the homes of the programs it drops
        self.clock = clock
        self.inflight: dict[str, InflightCall] = {}
        self.pending: dict[str, InflightCall] = {}  # sent, the instance's answer not in yet
        # Calls with no live instance to go to while one is being restarted: routed when one is back
        # (``instance_ready``), or failed when no restart is left (``_route_awaiting``). The PD dispatcher keeps here
        # the calls that wait for a decode engine.
        self.awaiting: dict[str, InflightCall] = {}
        self.num_failovers = 0  # calls resent after their instance was lost
        self.lending = lending  # KV lending's gManager, told of lost instances

    def is_alive(self) -> bool:
        return any(v.alive for v in self.views.values())

    def submit(
        self, request_id: str, prompt: list[int], params: SamplingParams, program: ProgramRef | None = None
    ) -> list[Decision]:
        """A new call: where to send it (or why it fails at once)."""
        if program is not None:
            self.table.call_arrived(program, self.clock())
        return self._route(InflightCall(request_id, list(prompt), params, program))

    def add_done(self, send: Send, result: AddResult) -> list[Decision]:
        """The instance's answer to ``send``."""
        call = self.pending.pop(send.request_id, None)
        if call is None:  # aborted while the add was under way
            return [AbortOn(send.instance_id, send.request_id)] if result.status == "ok" else []
        if result.status == "ok" and not self.views[send.instance_id].alive:
            # The instance was lost while it took the call: the call goes elsewhere like its others.
            call.failovers += 1
            self.num_failovers += 1
            return self._route(call)
        if result.status == "ok":
            call.instance = send.instance_id
            self.views[send.instance_id].inflight += 1
            self.load_index.update(send.instance_id)
            self.inflight[call.request_id] = call
            return []
        if result.status == "unreachable":
            # Marking the instance dead first keeps the router off it when this call is routed again.
            lost = self.instance_lost(send.instance_id, f"add failed: {result.message}")
            return lost + self._route(call)
        if result.status == "busy" and call.failovers and self._restart_coming():
            # Moved off a lost instance onto one whose queue is full: it waits for the lost one's restart (the room
            # that went with it), as calls wait when no instance is live.
            self.awaiting[call.request_id] = call
            return []
        self._release(call.program)
        return [Fail(call.request_id, result.status, result.message, result.refusal)]

    def instance_lost(self, instance_id: str, reason: str) -> list[Decision]:
        """The instance died or stopped answering: mark it dead and resend its calls elsewhere. (A restarted one
        lost before it was ready held no call: its restart failed, and is tried again as the policy allows.)"""
        if self._lost_while_starting(instance_id):  # its restart failed: calls waiting may wait no longer
            return [MarkDead(instance_id, reason), *self._route_awaiting()]
        view = self.views[instance_id]
        if not view.alive:
            return []
        self._set_alive(instance_id, False)
        self.router.drop_instance(instance_id)
        decisions: list[Decision] = [MarkDead(instance_id, reason)]
        if self.lending is not None:  # the others free what they lent it and recompute what it held
            decisions += self.lending.instance_lost(instance_id)
        for call in [c for c in self.inflight.values() if c.instance == instance_id]:
            del self.inflight[call.request_id]
            call.failovers += 1
            self.num_failovers += 1
            decisions += self._route(call)
        return decisions

    def restarts_due(self) -> list[Decision]:
        """The restarts of lost instances due by now (the front end asks on its heartbeats)."""
        return list(self.restarts.due(self.clock()))

    def next_restart_at(self) -> float | None:
        """When the next restart is due, on the dispatcher's clock (None: none is)."""
        return self.restarts.next_due()

    def instance_ready(self, instance_id: str, kv_address: str | None = None) -> list[Decision]:
        """A restarted instance answered its first heartbeat: it takes calls from now, with no load (and an empty
        cache: the router's homes on it went with its loss). Nothing for an instance not being restarted. With KV
        lending, the other instances are told it is back (at ``kv_address``, its transport's address now)."""
        if not self.restarts.ready(instance_id, self.clock()):
            return []
        self._set_alive(instance_id, True)
        back = list(self.lending.instance_back(instance_id, kv_address)) if self.lending is not None else []
        return back + self._route_awaiting()

    def _route_awaiting(self) -> list[Decision]:
        """Route the calls that wait for an instance: to one back, or failed if none is live or coming (each again
        as :meth:`_route_waiting` routes it, which may make it wait again)."""
        waiting, self.awaiting = self.awaiting, {}
        decisions: list[Decision] = []
        for call in waiting.values():
            decisions += self._route_waiting(call)
        return decisions

    def _route_waiting(self, call: InflightCall) -> list[Decision]:
        """Route a call that waited for a restarted instance (the PD dispatcher's go to a decode engine)."""
        return self._route(call)

    def _lost_while_starting(self, instance_id: str) -> bool:
        """A restarted instance lost before it was ready: its restart failed (counted; the next is scheduled)."""
        if self.restarts.state(instance_id) != "starting":
            return False
        self.restarts.lost(instance_id, self.clock())
        return True

    def _set_alive(self, instance_id: str, alive: bool) -> None:
        """A view's liveness changes (lost, or restarted and ready): it has no call either way, and is refiled."""
        view = self.views[instance_id]
        view.alive, view.inflight = alive, 0
        self.load_index.update(instance_id)
        if not alive:
            self.restarts.lost(instance_id, self.clock())

    def on_delta(self, instance_id: str, delta: RequestDelta) -> bool:
        """Account for a delta from ``instance_id``; False for one nobody waits for (aborted, or a
        stale delta from an instance the call has failed over from)."""
        call = self.inflight.get(delta.request_id)
        if call is None or call.instance != instance_id:
            return False
        call.output_token_ids.extend(delta.new_token_ids)
        call.text_chars_sent += len(delta.new_text)
        if delta.finished:
            del self.inflight[delta.request_id]
            self.views[instance_id].inflight -= 1
            self.load_index.update(instance_id)
            if call.program is not None and delta.finish_time is not None:
                wait = max(0.0, (delta.finish_time - delta.arrival_time) - delta.service_s)
                self.table.call_finished(call.program, delta.service_s, wait, self.clock(), instance_id)
            else:
                self._release(call.program)
        return True

    def receive(self, instance_id: str, delta: RequestDelta) -> tuple[RequestDelta | None, list[Decision]]:
        """A delta from ``instance_id``: the delta to hand its client (None: nobody waits for it), and what
        follows from it (nothing, without prefill and decode roles), to carry out whether or not anything is shown
        (a prefill that failed with its push shows nothing, and places its call again)."""
        call = self.inflight.get(delta.request_id)
        if call is None or not self.on_delta(instance_id, delta):
            return None, []
        if call.prompt_cached_tokens is None:
            call.prompt_cached_tokens = delta.num_cached_tokens
        if delta.num_cached_tokens == call.prompt_cached_tokens:
            return delta, []  # (most deltas: a copy only where the count differs)
        return dataclasses.replace(delta, num_cached_tokens=call.prompt_cached_tokens), []

    def abort(self, request_id: str) -> list[Decision]:
        """Nobody waits for the call any more."""
        waiting = self.awaiting.pop(request_id, None)
        if waiting is not None:
            self._release(waiting.program)
            return []
        call = self.pending.pop(request_id, None)
        if call is not None:  # its add is under way: add_done tells the instance to drop it
            self._release(call.program)
            return []
        call = self.inflight.pop(request_id, None)
        if call is None:
            return []
        view = self.views[call.instance]
        self._release(call.program)
        if not view.alive:
            return []
        view.inflight -= 1
        self.load_index.update(call.instance)
        return [AbortOn(call.instance, request_id)]

    def expire(self) -> list[str]:
        """Drop programs idle past the table's TTL, and their homes; returns their ids."""
        dropped = self.table.expire(self.clock())
        self._forget(self.table.take_removed())  # (those the size cap dropped too)
        return dropped

    def _forget(self, removed: list[str]) -> None:
        """Forget what is kept per program for the programs the table dropped (``removed``) and does not hold again."""
        self.router.forget(removed, self.table)

    def _route(self, call: InflightCall) -> list[Decision]:
        pid = call.program.program_id if call.program else None
        try:
            num_tokens = len(call.prompt) + len(call.output_token_ids)
            iid = self.router.choose(self.views.values(), pid, num_tokens, self.load_index)
        except NoLiveInstanceError as e:
            if self._restart_coming():
                self.awaiting[call.request_id] = call  # an instance is being restarted: the call waits for it
                return []
            self._release(call.program)
            return [Fail(call.request_id, "unavailable", str(e))]
        self.pending[call.request_id] = call
        resume = Resume(tuple(call.output_token_ids), call.text_chars_sent) if call.output_token_ids else None
        return [Send(iid, call.request_id, call.prompt, call.params, self._global_view(call.program), resume)]

    def _restart_coming(self) -> bool:
        """Whether a lost instance is being restarted (or will be): calls may wait for it."""
        return any(self.restarts.state(iid) in ("down", "starting") for iid in self.views)

    def _global_view(self, program: ProgramRef | None) -> ProgramRef | None:
        """The program with its service and waiting as the router knows them across instances."""
        rec = self.table.get(program.program_id) if program is not None else None
        if program is None or rec is None:
            return program
        return dataclasses.replace(
            program, service_s=rec.service_s, total_service_s=rec.total_service_s, waiting_s=rec.waiting_s
        )

    def _release(self, program: ProgramRef | None) -> None:
        """A call of ``program`` will not complete: it stops keeping the program active."""
        if program is not None:
            self.table.call_abandoned(program.program_id)

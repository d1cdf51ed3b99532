"""The cluster's decisions with prefill and decode roles (DualPath, issue 13), as plain code over plain data.

A call goes through four phases, each a decision the transport carries out and answers:

1. **queued**: it waits in a FIFO within its ``priority`` class, a smaller class first, as the engines rank calls
   (by arrival by default; or by its program's first arrival, as the engines order their own queues with
   ``--queue-order program``: see :class:`PDDispatcher`) until the inter-engine scheduler
   (``cluster/pd_scheduler.py``) places it on a prefill engine (PE) and a decode engine (DE) and picks its read
   path, from the load the dispatcher counts itself (each engine's calls and their tokens, exact as every call
   passes here) and the storage read queues the engines report;
2. **preparing**: :class:`Prepare` makes the DE ready (``EngineCore.prepare_intake``): the DE holds what it
   has of the prompt, reserves host memory for the rest, and under DE-read loads the stored blocks the PE
   lacks (the PE is asked first how many leading blocks it holds: ``Prepare.prefill_engine``) to push to the
   PE; it answers from which block the PE should send;
3. **prefilling**: a :class:`~boundless.cluster.dispatcher.Send` with a handoff plan makes the PE prefill,
   stream the KV to the DE and end with the first token (finish reason ``handoff``). That delta goes to the
   client as an ordinary one (not finished);
4. **decoding**: :class:`Continue` gives the DE the first token; its deltas go to the client to the end.

Failures: a PE lost before its handoff puts the call back at the head of the queue, of its priority class (nothing
reached the client; the DE's half is aborted), and so does a PE whose prefill failed because the DE-read push it was
reading as it landed failed (its DE gone mid-push, a timeout: finish reason ``error``, stop reason
``KV_STREAM_LOST``), up to ``MAX_STREAM_LOSSES`` times a call. A DE lost before the handoff leaves the
PE's stream to fail on its own; at the handoff the call goes to another DE as a resumed request (prompt
plus the first token, which recomputes or reads the store: the engines' ordinary failover). A DE lost
while decoding is the same failover. So no token is lost or repeated, and greedy outputs equal one
engine's. Every stream has a timeout on both sides, and a DE drops a prepared call whose first token never
comes, so no failure leaves blocks held. A lost engine is started again as ``cluster/restarts.py`` decides: it takes
calls from its first heartbeat (:meth:`PDDispatcher.instance_ready`), holding nothing (the memory the read paths
counted on it is forgotten at its loss); while a role has no live engine but one being restarted, calls wait in the
queue for it instead of failing.

The read path needs each call's stored tokens. The dispatcher does not see the store; it estimates them
from what it served: a program's next call usually extends its last one (prompt and output), whose full
blocks were written through to the shared store. A program's first call here counts its prompt's full blocks
as stored: an agent resumed with its context in the store (after a restart, or served by another router) would
otherwise always read on the PE, and a wrong guess costs little, since each engine counts what the store really
holds before it reads (a ``stat`` a block, stopping at the first missing one) and computes the rest. A call
without a program counts as nothing stored.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, overload

from boundless.cluster.dispatcher import (
    AbortOn,
    AddResult,
    AddStatus,
    Decision,
    Dispatcher,
    Fail,
    InflightCall,
    MarkDead,
    Send,
)
from boundless.cluster.pd_scheduler import (
    EngineLoad,
    PDSchedulerConfig,
    PendingRequest,
    ReadPath,
    Role,
    plan_prefetches,
    schedule,
)
from boundless.cluster.restarts import RestartPolicy
from boundless.cluster.routing import Router
from boundless.engine.core import KV_STREAM_LOST, RequestDelta, Resume
from boundless.engine.errors import InvalidRequestError
from boundless.engine.handoff import HandoffPlan, IntakeAnswer, IntakePlan
from boundless.engine.sampling_params import SamplingParams
from boundless.programs.process_table import ProcessTable
from boundless.programs.ref import ProgramRef

# Under program order, how far (seconds of arrivals) a call may go ahead of calls that came before it: it bounds
# the wait of a later program's call behind an earlier program's stream of calls (the engines' policies bound it
# by promoting starved calls), and is far above an agent's turn here (a few seconds), so sessions keep their turns
# back to back.
PROGRAM_ORDER_LEAD_S = 60.0
# Of an engine's host memory, the share that reads ahead for calls not yet placed (:class:`Prefetch`) may take, in
# the dispatcher's count. Half of what the engine's own loads for its waiting requests may hold (``kv/manager.py``,
# ``PREFETCH_SHARE``), so that the calls placed meanwhile still find room to load, and receives from peers room to
# land; at 0.25 of the benchmark's host memory (room for 4 of the longest contexts) that is ~2 first contexts ahead
# per engine, ~2 s of reading on two 25 MB/s links: enough to keep a link busy between placements.
PREFETCH_HOST_SHARE = 0.25
# How many times a call is placed again after its prefill failed with the push it was reading (KV_STREAM_LOST); past
# that the error goes to the client (a stream that fails every time is not a lost engine).
MAX_STREAM_LOSSES = 3

Phase = Literal["queued", "preparing", "prefilling", "continuing", "decoding"]


@dataclass(frozen=True)
class PDInstance:
    """An engine as the dispatcher places work on it: its role, the node whose storage link it reads through
    (with emulated links every instance is a node of its own), its KV transport's address, and the tokens of KV
    its device memory holds (the scheduler's KV-room rule, for a DE's calls and for a PE's)."""

    role: Role
    node: str
    address: str
    kv_capacity_tokens: int | None = None  # its KV memory (device blocks x block size); None: not limited
    host_capacity_tokens: int | None = None  # its host KV memory, in tokens; None: it reads nothing ahead


@dataclass(frozen=True)
class ServedBy:
    """The engines that served a program's last call, and its prompt's length: what their memories likely hold of
    the program's next call (:meth:`PDDispatcher._in_memory`)."""

    prefill_engine: str
    decode_engine: str
    prompt_tokens: int


@dataclass(frozen=True)
class Prepare:
    """Make ``instance_id`` the decode engine of a call, its KV coming as ``plan`` says."""

    instance_id: str
    request_id: str
    prompt: list[int]
    params: SamplingParams
    program: ProgramRef | None
    plan: IntakePlan
    prefill_engine: str = ""  # under DE-read, asked first how much of the prompt it holds (``plan.pe_holds``)


@dataclass(frozen=True)
class PrepareResult:
    """The DE's answer to a :class:`Prepare` (statuses as :class:`~boundless.cluster.dispatcher.AddResult`)."""

    status: AddStatus
    answer: IntakeAnswer | None = None
    message: str = ""
    refusal: InvalidRequestError | None = None


@dataclass(frozen=True)
class Continue:
    """Give the DE the tokens the PE produced: it decodes from there."""

    instance_id: str
    request_id: str
    resume: Resume


@dataclass(frozen=True)
class Prefetch:
    """Read the stored KV of a call still waiting for its placement into ``instance_id``'s host memory, where the
    call will read it (``EngineCore.prefetch``): the engine holds the blocks for the call until it arrives, is
    dropped, or the hold expires, so a storage link works while its call waits (DualPath's engines read ahead for
    the requests queued on them). Answered by nothing: a prefetch only saves a read later."""

    instance_id: str
    request_id: str
    prompt: list[int]


@dataclass(frozen=True)
class DropPrefetch:
    """The call prefetched on ``instance_id`` will not come there (aborted, failed, or placed elsewhere): the
    engine lets its blocks go, to stay as ordinary cache."""

    instance_id: str
    request_id: str


PDDecision = Decision | Prepare | Continue | Prefetch | DropPrefetch


@dataclass
class PDCall(InflightCall):
    """A call and where it stands (``instance`` is whichever engine's deltas it takes now)."""

    phase: Phase = "queued"
    prefill_engine: str = ""
    decode_engine: str = ""
    read_path: ReadPath = "none"
    stored_tokens: int = 0
    tag: int = 0  # of this placement's streams (a placement's answers are told from an earlier one's by it)
    prepared: bool = False  # the DE answered its Prepare (it holds the call's half)
    prefill_service_s: float = 0.0
    order: tuple[int, float, int] = (0, 0.0, 0)  # its place in the queue: smaller goes first
    prefetch_engine: str = ""  # where its stored KV is read ahead while it waits (see Prefetch)
    prefetch_tokens: int = 0  # what that read counts against the engine's prefetch room
    stream_losses: int = 0  # prefills failed with the push they were reading (placed again each time)
    # Its DE was lost while its PE prefilled: a failover, counted once the call leaves for another DE (at its handoff,
    # or when a DE restarted meanwhile turns down its Continue), or once it is placed again.
    lost_decode_engine: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output_token_ids)


class QueueView(Sequence[PendingRequest]):
    """The queued calls as the scheduler reads them, each :class:`PendingRequest` made when first read: a round reads
    the queue only as far as it places or reads ahead, while the queue may hold a call of every waiting agent (making
    them all, on every call's arrival and end, was most of a large cluster's dispatcher time)."""

    def __init__(self, calls: list[PDCall], pending: Callable[[PDCall], PendingRequest]) -> None:
        self._calls = list(calls)  # as the round starts: placing takes calls off the queue
        self._pending = pending
        self._made: dict[int, PendingRequest] = {}

    def __len__(self) -> int:
        return len(self._calls)

    @overload
    def __getitem__(self, i: int) -> PendingRequest: ...

    @overload
    def __getitem__(self, i: slice) -> list[PendingRequest]: ...

    def __getitem__(self, i: int | slice) -> PendingRequest | list[PendingRequest]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self._calls))[i]  # a negative index counts from the end; out of range raises
        made = self._made.get(i)
        if made is None:
            made = self._made[i] = self._pending(self._calls[i])
        return made


class PDDispatcher(Dispatcher):
    """Prefill/decode placement, handoff and failover for engines with roles (see the module docstring).

    ``order_by_program``: the queue is ordered by each call's program's first arrival, then by the call's own
    (``--queue-order program``, the engines' default), instead of by call arrival alone. An agent's next call
    then goes before the calls of programs that came after it, so a few sessions at a time run their turns
    back to back while their KV is still in the engines' memory; in plain call order every session's turn
    waits behind one of every other session's, and with more sessions than memory holds, each turn finds its
    context evicted (least recently used first) and reads it from the store again. A colocated engine orders
    its own queue the same way. A call goes at most ``PROGRAM_ORDER_LEAD_S`` ahead of its own arrival, so an
    early program's stream of calls cannot keep a later program's call waiting for ever."""

    def __init__(
        self,
        instances: Mapping[str, PDInstance],
        table: ProcessTable,
        clock: Callable[[], float],
        config: PDSchedulerConfig,
        block_size: int,
        order_by_program: bool = False,
        restarts: RestartPolicy | None = None,
        max_queued: int | None = None,
    ) -> None:
        """``max_queued``: the calls its queue holds at most (None: no bound); one more is refused as busy (a 429), as
        an engine refuses a request past ``--max-waiting``."""
        super().__init__(instances, Router("least-loaded"), table, clock, restarts=restarts)
        self.max_queued = max_queued
        self.instances = dict(instances)
        self.config = config
        self.block_size = block_size
        self.calls: dict[str, PDCall] = {}
        self.queue: list[PDCall] = []
        # Calls with their first token whose decode engines are all lost, one being restarted: sent on when it is back.
        self.read_queues: dict[str, int] = {}  # tokens, per instance, as last reported
        self.placements: Counter[str] = Counter()  # calls placed, by read path
        self.placed_stored_tokens: Counter[str] = Counter()  # their estimated stored tokens, by read path
        self.prefetches: Counter[str] = Counter()  # reads ahead decided for waiting calls, by the path they serve
        self.num_stream_losses = 0  # prefills failed with the DE-read push they were reading, each placed again
        self._history: dict[str, list[int]] = {}  # program id -> its last call's tokens
        self._served: dict[str, ServedBy] = {}  # program id -> the engines of its last call
        self._next_tag = 1
        self.order_by_program = order_by_program
        self._next_seq = 0

    def is_alive(self) -> bool:
        return all(self._live(role) for role in ("prefill", "decode"))

    def role(self, instance_id: str) -> Role:
        return self.instances[instance_id].role

    # -- events ------------------------------------------------------------------------------------

    # (A dispatcher with roles decides more kinds than the plain one: its callers take either. At run time both are
    # lists.)
    def submit(  # type: ignore[override]
        self, request_id: str, prompt: list[int], params: SamplingParams, program: ProgramRef | None = None
    ) -> list[PDDecision]:
        if self.max_queued is not None and len(self.queue) >= self.max_queued:
            # (Else each call placed walked the queue, so a request of thousands of samples held the server minutes.)
            return [Fail(request_id, "busy", f"{len(self.queue)} calls wait for a prefill engine already")]
        now = self.clock()
        first_arrival = now
        if program is not None:
            record = self.table.call_arrived(program, now)
            if self.order_by_program and record.first_arrival is not None:
                first_arrival = max(record.first_arrival, now - PROGRAM_ORDER_LEAD_S)
        call = PDCall(request_id, list(prompt), params, program)
        call.stored_tokens = self._stored_estimate(call)
        # Its priority class first, as the engines rank it (Scheduler._ranking): a call of a smaller one waits behind
        # none of a larger one's for a DE's room.
        call.order = (params.priority, first_arrival, self._next_seq)
        self._next_seq += 1
        self.calls[request_id] = call
        # Before the first call that goes after it (at the tail in call order); a call put back at the head after
        # a lost PE stays there unless this one's program came first.
        at = next((i for i, other in enumerate(self.queue) if other.order > call.order), len(self.queue))
        self.queue.insert(at, call)
        return self._place()

    def report(self, instance_id: str, read_queue_tokens: int) -> None:
        """An engine's heartbeat: its node's storage read queue, in tokens."""
        self.read_queues[instance_id] = read_queue_tokens

    def prepare_done(self, prepare: Prepare, result: PrepareResult) -> list[PDDecision]:
        """The DE's answer: on success the PE gets the call, with where to send the KV."""
        call = self.calls.get(prepare.request_id)
        if call is None or call.phase != "preparing" or call.tag != prepare.plan.recv_tag:
            return [AbortOn(prepare.instance_id, prepare.request_id)] if result.status == "ok" else []
        if result.status == "ok" and result.answer is not None:
            call.prepared = True
            plan = HandoffPlan(
                self.instances[call.decode_engine].address,
                prepare.plan.recv_tag,
                result.answer.send_from_block,
                recv_tag=prepare.plan.push_tag or 0,
                recv_blocks=result.answer.push_blocks,
                recv_from=result.answer.push_from,
            )
            program = self._global_view(call.program)
            return [Send(call.prefill_engine, call.request_id, call.prompt, call.params, program, None, plan)]
        if result.status == "unreachable":
            return self.instance_lost(prepare.instance_id, f"prepare failed: {result.message}")
        return self._fail(call, result.status, result.message, result.refusal)

    def add_done(self, send: Send, result: AddResult) -> list[PDDecision]:  # type: ignore[override]
        call = self.calls.get(send.request_id)
        if call is None or not _answers_current(call, send):
            return [AbortOn(send.instance_id, send.request_id)] if result.status == "ok" else []
        if result.status == "ok":
            call.phase = "prefilling" if send.handoff is not None else "decoding"
            call.instance = send.instance_id
            return []
        if result.status == "unreachable":
            return self.instance_lost(send.instance_id, f"add failed: {result.message}")
        return self._fail(call, result.status, result.message, result.refusal)

    def continue_done(self, cont: Continue, result: AddResult) -> list[PDDecision]:
        """The DE's answer to a :class:`Continue`; a DE that no longer holds the call gets it afresh."""
        call = self.calls.get(cont.request_id)
        if call is None or call.phase != "continuing" or call.decode_engine != cont.instance_id:
            return [AbortOn(cont.instance_id, cont.request_id)] if result.status == "ok" else []
        if result.status == "ok":
            call.phase = "decoding"
            return []
        if result.status == "unreachable":
            return self.instance_lost(cont.instance_id, f"continue failed: {result.message}")
        self._count_failover(call)  # (a DE restarted since the call's was lost holds none of it)
        return self._route_decode(call)  # it dropped the call (its first token came too late): resend it

    def receive(  # type: ignore[override]
        self, instance_id: str, delta: RequestDelta
    ) -> tuple[RequestDelta | None, list[PDDecision]]:
        call = self.calls.get(delta.request_id)
        if call is None or call.instance != instance_id:
            return None, []  # aborted, or stale (from an engine the call has left)
        call.output_token_ids.extend(delta.new_token_ids)
        call.text_chars_sent += len(delta.new_text)
        if delta.finish_reason == "handoff":
            call.prefill_service_s = delta.service_s
            # What the PE found cached, reported for the DE's deltas too (``prompt_cached_tokens``): the DE finds every
            # block the PE handed it, which no cache served the client's prompt (every call counted nearly all cached).
            call.prompt_cached_tokens = delta.num_cached_tokens
            shown = dataclasses.replace(delta, finished=False, finish_reason=None, stop_reason=None)
            call.phase = "continuing"  # the PE is done with it: its room there (and its tokens) free for the queue
            if not self.views[call.decode_engine].alive:  # lost while the PE prefilled: the call fails over now
                self._count_failover(call)
                call.prepared = False
                return shown, self._route_decode(call) + self._place()
            call.instance = call.decode_engine
            resume = Resume(tuple(call.output_token_ids), call.text_chars_sent)
            return shown, [Continue(call.decode_engine, call.request_id, resume), *self._place()]
        if call.prompt_cached_tokens is not None:
            delta = dataclasses.replace(delta, num_cached_tokens=call.prompt_cached_tokens)
        if not delta.finished:
            return delta, []
        if _lost_its_push(call, delta) and call.stream_losses < MAX_STREAM_LOSSES:
            return None, self._place_again(call)
        del self.calls[delta.request_id]
        decisions: list[PDDecision] = []
        if call.phase == "prefilling" and self.views[call.decode_engine].alive:
            decisions.append(AbortOn(call.decode_engine, call.request_id))  # its first token ended it
        if call.program is not None:
            self._history[call.program.program_id] = call.prompt + call.output_token_ids
            self._served[call.program.program_id] = ServedBy(call.prefill_engine, call.decode_engine, len(call.prompt))
            if delta.finish_time is not None:
                service = call.prefill_service_s + delta.service_s
                wait = max(0.0, (delta.finish_time - delta.arrival_time) - delta.service_s)
                self.table.call_finished(call.program, service, wait, self.clock(), instance_id)
            else:
                self._release(call.program)
        return delta, decisions + self._place()

    def instance_lost(self, instance_id: str, reason: str) -> list[PDDecision]:  # type: ignore[override]
        if self._lost_while_starting(instance_id):  # its restart failed: calls waiting for it may wait no longer
            return [MarkDead(instance_id, reason), *self._route_awaiting(), *self._place()]
        view = self.views[instance_id]
        if not view.alive:
            return []
        self._set_alive(instance_id, False)
        self.read_queues.pop(instance_id, None)
        for pid, served in self._served.items():  # its memory is gone: a restarted engine starts empty
            if instance_id in (served.prefill_engine, served.decode_engine):
                pe, de = (("" if e == instance_id else e) for e in (served.prefill_engine, served.decode_engine))
                self._served[pid] = ServedBy(pe, de, served.prompt_tokens)
        decisions: list[PDDecision] = [MarkDead(instance_id, reason)]
        requeue = []
        for call in self.queue:
            if call.prefetch_engine == instance_id:  # its read ahead is gone with the engine: read again elsewhere
                call.prefetch_engine, call.prefetch_tokens = "", 0
        for call in list(self.calls.values()):
            pe_lost = call.prefill_engine == instance_id and call.phase in ("preparing", "prefilling")
            de_lost = call.decode_engine == instance_id
            if pe_lost or (de_lost and call.phase == "preparing"):
                # Nothing reached the client yet: the call starts over, ahead of later calls.
                other = call.decode_engine if pe_lost else call.prefill_engine
                if self.views[other].alive and (call.prepared or call.phase == "prefilling"):
                    decisions.append(AbortOn(other, call.request_id))
                requeue.append(call)
            elif de_lost and call.phase in ("continuing", "decoding"):
                self.num_failovers += 1
                decisions += self._route_decode(call)
            elif de_lost and call.phase == "prefilling":
                call.lost_decode_engine = True  # (the PE's stream fails, and the handoff goes elsewhere: counted then)
        for call in reversed(requeue):
            self.num_failovers += 1
            self._reset(call)
            self._put_back(call)
        return decisions + self._place()

    def instance_ready(self, instance_id: str, kv_address: str | None = None) -> list[PDDecision]:  # type: ignore[override]
        """A restarted engine takes calls again: the queue is placed, with it among the engines. Its KV is sent to
        and read from ``kv_address`` from now: a transport that binds a fresh port (NIXL, Mooncake) gives the new
        process another address than its predecessor's."""
        was_alive = self.views[instance_id].alive
        decisions = super().instance_ready(instance_id, kv_address)
        if kv_address and not was_alive and self.views[instance_id].alive:  # it is back (not a stray answer)
            self.instances[instance_id] = dataclasses.replace(self.instances[instance_id], address=kv_address)
        return [*decisions, *self._place()]  # (the base routed the calls that waited for a decode engine)

    def _route_waiting(self, call: InflightCall) -> list[PDDecision]:  # type: ignore[override]
        """A call that waited for a decode engine goes on at one back, or fails if none is live or coming."""
        assert isinstance(call, PDCall)
        return self._route_decode(call) if self.calls.get(call.request_id) is call else []

    def _place_again(self, call: PDCall) -> list[PDDecision]:
        """A call whose prefill failed with its DE-read push (nothing reached the client) goes back to the head of
        the queue (:meth:`_put_back`), its DE's half dropped; placed afresh, it reads or computes its KV again."""
        call.stream_losses += 1
        self.num_stream_losses += 1
        self.num_failovers += 1
        decisions: list[PDDecision] = []
        if call.prepared and self.views[call.decode_engine].alive:
            decisions.append(AbortOn(call.decode_engine, call.request_id))
        self._reset(call)
        self._put_back(call)
        return decisions + self._place()

    def _put_back(self, call: PDCall) -> None:
        """A call placed before, started over: at the head of its priority class in the queue (ahead of the calls of
        its class, which came after it; behind those of a smaller class, which outrank it)."""
        at = next((i for i, other in enumerate(self.queue) if other.order[0] >= call.order[0]), len(self.queue))
        self.queue.insert(at, call)

    def abort(self, request_id: str) -> list[PDDecision]:  # type: ignore[override]
        call = self.calls.pop(request_id, None)
        if call is None:
            return []
        self._release(call.program)
        self.awaiting.pop(request_id, None)
        if call.phase == "queued":
            self.queue.remove(call)
            return self._drop_prefetch(call) + self._place()
        # A Prepare or Send still under way is answered later: its answer sees the call gone and aborts it there.
        return self._abort_halves(call) + self._place()

    def _forget(self, removed: list[str]) -> None:
        # (Every program the table dropped, by the TTL or its size cap: one dropped at the cap never expires.)
        super()._forget(removed)
        for pid in removed:
            if pid not in self.table:
                self._history.pop(pid, None)
                self._served.pop(pid, None)

    # -- decisions ---------------------------------------------------------------------------------

    def loads(self) -> list[EngineLoad]:
        """Every live engine's load as the scheduler sees it: its calls and their tokens (counted here), its
        node's storage read queue (reported, plus the reads placed since), and its free KV: its capacity less what
        its calls will take, in whole blocks (a DE's with room for their outputs; a PE's their prompts, until their
        handoffs) (exact and current, as every call passes here; a report of free blocks would lag the placements of
        a burst, and counts blocks a prepared call is about to take as free). An engine with no call counts as
        having room for anything, so a call longer than its memory still goes somewhere (the engine then serves or
        rejects it as it would alone)."""
        seq: Counter[str] = Counter()
        tok: Counter[str] = Counter()
        kv: Counter[str] = Counter()  # KV an engine's calls will take: whole blocks (on a DE with their outputs' room)
        for call in self.calls.values():  # (every call in the cluster, on every placement round: kept lean)
            phase = call.phase
            if phase == "queued":
                continue
            num_tokens = len(call.prompt) + len(call.output_token_ids)  # call.num_tokens
            if phase == "preparing" or phase == "prefilling":
                pe = call.prefill_engine
                seq[pe] += 1
                tok[pe] += num_tokens
                kv[pe] += self._prompt_footprint(call)
            de = call.decode_engine
            if de:
                seq[de] += 1
                tok[de] += num_tokens
                kv[de] += self._kv_footprint(call)
        longest_queued = max((c.num_tokens for c in self.queue), default=0)
        queues: dict[str, int] = {}
        for iid, q in self.read_queues.items():
            node = self.instances[iid].node
            queues[node] = max(queues.get(node, 0), q)
        return [
            EngineLoad(
                iid,
                inst.role,
                inst.node,
                f"{inst.role}@{inst.node}",
                seq[iid],
                tok[iid],
                queues.get(inst.node, 0),
                _free_kv(inst, seq[iid], kv[iid], longest_queued),
            )
            for iid, inst in self.instances.items()
            if self.views[iid].alive
        ]

    def _prompt_footprint(self, call: PDCall) -> int:
        """Tokens of a PE's memory a call placed there takes until its handoff: its prompt, in whole blocks. Bounding
        them by the PE's memory is what keeps the prefixes its waiting calls found in memory at their arrival there
        until their admission (with two DEs the DEs' room alone lets twice the calls in flight, more than the PE
        holds, and a prefix evicted before its call's admission is computed again: ``evicted_before_admission``)."""
        return -(-len(call.prompt) // self.block_size) * self.block_size

    def _kv_footprint(self, call: PDCall) -> int:
        """Tokens of a DE's memory a call takes at most: its prompt and every output token, in whole blocks (a
        count of bare tokens would let the rounding of a few calls overfill the DE, whose admissions then wait
        on each other's held prefixes)."""
        most = len(call.prompt) + max(len(call.output_token_ids), call.params.max_tokens or 0)
        return -(-most // self.block_size) * self.block_size

    def _place(self) -> list[PDDecision]:
        """Place queued calls in FIFO order while engines take them; then read ahead for those still waiting."""
        if not self.queue:
            return []
        if not self.is_alive():
            if all(self._live(role) or self._restarting(role) for role in ("prefill", "decode")):
                return []  # the calls wait for an engine of the missing role being restarted
            failed: list[PDDecision] = []
            for call in list(self.queue):
                failed += self._fail(call, "unavailable", "no live prefill or decode engine")
            return failed
        result = schedule(QueueView(self.queue, self._pending), self.loads(), self.config)
        decisions: list[PDDecision] = []
        # The placed reads join their nodes' queues until the engines report again: calls placed meanwhile (one
        # at a time, as calls end) see them, instead of all taking the path the last report made shorter.
        for iid, inst in self.instances.items():
            if iid in self.read_queues or result.read_queues.get(inst.node):
                self.read_queues[iid] = result.read_queues.get(inst.node, 0)
        for placement in result.placements:
            call = self.calls[placement.request_id]
            self.queue.remove(call)
            call.phase = "preparing"
            call.prefill_engine, call.decode_engine = placement.prefill_engine, placement.decode_engine
            call.read_path = placement.read_path
            self.placements[placement.read_path] += 1
            self.placed_stored_tokens[placement.read_path] += call.stored_tokens
            call.tag = self._next_tag
            self._next_tag += 2
            reads_at = {"pe": call.prefill_engine, "de": call.decode_engine}.get(placement.read_path)
            if call.prefetch_engine and call.prefetch_engine != reads_at:
                decisions += self._drop_prefetch(call)  # placed where its read ahead is not: that read is cache now
            call.prefetch_engine, call.prefetch_tokens = "", 0
            push = call.tag + 1 if placement.read_path == "de" else None
            plan = IntakePlan(self.instances[call.prefill_engine].address, recv_tag=call.tag, push_tag=push)
            program = self._global_view(call.program)
            pe = call.prefill_engine
            decisions.append(Prepare(call.decode_engine, call.request_id, call.prompt, call.params, program, plan, pe))
        return decisions + self._read_ahead()

    def _pending(self, call: PDCall) -> PendingRequest:
        alive = call.prefetch_engine and self.views[call.prefetch_engine].alive
        stored = min(call.stored_tokens, call.num_tokens)
        prefetched = call.prefetch_engine if alive else None
        return PendingRequest(call.request_id, call.num_tokens, stored, prefetched, self._in_memory(call, stored))

    def _in_memory(self, call: PDCall, stored: int) -> dict[str, int]:
        """Of the call's stored tokens, the leading ones each engine likely still holds in memory: those of its
        program's last call, on the engines that served it (the PE its prompt's full blocks, computed, read or
        pushed there; the DE the prompt and output it decoded). The scheduler weighs each read path by what it would
        really read (``read_tokens``): a next turn's context is mostly in memory, and counting it whole on the link
        it is placed on would steer the next whole-context read to the other link. An estimate: memory may have let
        the blocks go since (the engine then reads them, and its node's reported queue shows it)."""
        served = self._served.get(call.program.program_id) if call.program is not None else None
        if served is None:
            return {}
        held: dict[str, int] = {}
        if served.prefill_engine and self.views[served.prefill_engine].alive:
            held[served.prefill_engine] = min(stored, served.prompt_tokens // self.block_size * self.block_size)
        if served.decode_engine and self.views[served.decode_engine].alive:
            held[served.decode_engine] = stored
        return held

    def prefetch_room(self) -> dict[str, int]:
        """Tokens each live engine may still read ahead for calls not placed yet: ``PREFETCH_HOST_SHARE`` of its host
        memory less the prefetches of the calls waiting here (a placed call's prefetched blocks are its own load
        from then on, held by the engine until its admission; an engine of unknown host memory reads nothing
        ahead)."""
        taken: Counter[str] = Counter()
        for call in self.queue:
            if call.prefetch_engine:
                taken[call.prefetch_engine] += call.prefetch_tokens
        return {
            iid: int(inst.host_capacity_tokens * PREFETCH_HOST_SHARE) - taken[iid]
            for iid, inst in self.instances.items()
            if inst.host_capacity_tokens and self.views[iid].alive
        }

    def _read_ahead(self) -> list[PDDecision]:
        """Prefetches for the calls still queued (``plan_prefetches``), their reads joining their nodes' queues."""
        if not self.queue or self.config.kv_path == "oracle":
            return []
        room = self.prefetch_room()
        if not room:
            return []
        planned, queues = plan_prefetches(QueueView(self.queue, self._pending), self.loads(), room, self.config)
        if not planned:
            return []
        for iid, inst in self.instances.items():
            if iid in self.read_queues or queues.get(inst.node):
                self.read_queues[iid] = queues.get(inst.node, 0)
        decisions: list[PDDecision] = []
        for ahead in planned:
            call = self.calls[ahead.request_id]
            call.prefetch_engine, call.prefetch_tokens = ahead.engine_id, ahead.read_tokens
            self.prefetches[ahead.read_path] += 1
            decisions.append(Prefetch(ahead.engine_id, call.request_id, call.prompt))
        return decisions

    def _drop_prefetch(self, call: PDCall) -> list[PDDecision]:
        """Tell the engine a call's prefetch is for that the call will not come (it lets the blocks go)."""
        engine = call.prefetch_engine
        call.prefetch_engine, call.prefetch_tokens = "", 0
        return [DropPrefetch(engine, call.request_id)] if engine and self.views[engine].alive else []

    def _route_decode(self, call: PDCall) -> list[PDDecision]:
        """Send a call that has its first token to the live DE with the fewest tokens, as a resumed request."""
        tokens = {load.engine_id: load.tok for load in self.loads() if load.role == "decode"}
        if not tokens:
            if self._restarting("decode"):  # it waits for the restarted DE (instance_ready), its tokens kept
                call.phase, call.decode_engine, call.instance, call.prepared = "continuing", "", "", False
                self.awaiting[call.request_id] = call
                return []
            return self._fail(call, "unavailable", "no live decode engine")
        de = min(tokens, key=lambda iid: tokens[iid])
        call.phase, call.decode_engine, call.instance, call.prepared = "continuing", de, "", False
        resume = Resume(tuple(call.output_token_ids), call.text_chars_sent)
        return [Send(de, call.request_id, call.prompt, call.params, self._global_view(call.program), resume)]

    def _fail(
        self, call: PDCall, status: str, message: str, refusal: InvalidRequestError | None = None
    ) -> list[PDDecision]:
        self.calls.pop(call.request_id, None)
        if call in self.queue:
            self.queue.remove(call)
        self.awaiting.pop(call.request_id, None)
        self._release(call.program)
        decisions = self._abort_halves(call) + self._drop_prefetch(call)
        reason = status if status in ("invalid", "busy", "failed") else "unavailable"
        return [*decisions, Fail(call.request_id, reason, message, refusal)]  # type: ignore[arg-type]

    def _abort_halves(self, call: PDCall) -> list[PDDecision]:
        """Tell the live engines that hold a part of the call to drop it."""
        holders = []
        if call.phase == "prefilling" or (call.phase == "preparing" and call.prepared):
            holders.append(call.prefill_engine)
        if call.decode_engine and (call.prepared or call.phase in ("continuing", "decoding")):
            holders.append(call.decode_engine)
        return [AbortOn(e, call.request_id) for e in holders if self.views[e].alive]

    @staticmethod
    def _reset(call: PDCall) -> None:
        call.phase, call.prefill_engine, call.decode_engine, call.instance = "queued", "", "", ""
        call.prepared, call.lost_decode_engine = False, False  # (placed again: counted as a failover there)

    def _count_failover(self, call: PDCall) -> None:
        """A call whose DE was lost while its PE prefilled leaves for another DE: one failover."""
        if call.lost_decode_engine:
            self.num_failovers += 1
            call.lost_decode_engine = False

    def _stored_estimate(self, call: PDCall) -> int:
        """Tokens of the call's prompt likely in the store: the full blocks it shares with its program's last call,
        or, for a program's first call here, every full block of its prompt (see the module docstring). None for a
        call that scores its prompt (``prompt_logprobs``): its prefill engine computes every block, reading none."""
        if call.program is None or call.params.prompt_logprobs is not None:
            return 0
        last = self._history.get(call.program.program_id)
        if last is None:
            return len(call.prompt) // self.block_size * self.block_size
        common = 0
        for a, b in zip(last, call.prompt, strict=False):
            if a != b:
                break
            common += 1
        return common // self.block_size * self.block_size

    def _live(self, role: Role) -> bool:
        return any(self.views[iid].alive for iid, inst in self.instances.items() if inst.role == role)

    def _restarting(self, role: Role) -> bool:
        """Whether an engine of ``role`` is lost and will be started again."""
        coming = ("down", "starting")
        return any(self.restarts.state(iid) in coming for iid, inst in self.instances.items() if inst.role == role)


def _free_kv(instance: PDInstance, calls: int, taken: int, longest_queued: int) -> int | None:
    """An engine's free KV in tokens as the scheduler's KV-room rule reads it (None: no limit; see ``loads``). An
    empty engine has room for the longest waiting call even beyond its capacity (the engine serves or rejects such
    a call as it would alone), and for that call only: the round accounts it before the next."""
    if instance.kv_capacity_tokens is None:
        return None
    if calls == 0:
        return max(instance.kv_capacity_tokens, longest_queued)
    return max(0, instance.kv_capacity_tokens - taken)


def _lost_its_push(call: PDCall, delta: RequestDelta) -> bool:
    """Whether the PE failed the call's prefill because the push it was reading failed, before any token."""
    return (
        call.phase == "prefilling"
        and delta.finish_reason == "error"
        and delta.stop_reason == KV_STREAM_LOST
        and not call.output_token_ids
    )


def _answers_current(call: PDCall, send: Send) -> bool:
    """Whether an engine's answer to ``send`` is for the call as it stands (not an earlier placement's)."""
    if send.handoff is not None:
        return (
            call.phase == "preparing" and send.handoff.send_tag == call.tag and send.instance_id == call.prefill_engine
        )
    return call.phase == "continuing" and send.instance_id == call.decode_engine


def placement_counts(dispatcher: PDDispatcher) -> Sequence[tuple[str, int, int]]:
    """(read path, calls placed, their estimated stored tokens), for ``/metrics``."""
    return [(path, n, dispatcher.placed_stored_tokens[path]) for path, n in sorted(dispatcher.placements.items())]
